"""The CE∘softmax Hessian-vector product with and without `assume sum[v](y) = 1`.

    python benchmarks/assume_hvp.py [--batch 512] [--vocab 8192] [--calls 15]

Compiles the same program twice (f32, one thread), the second time with the fact, and
prints for each the ops left after the IR pipeline, the kernels and the minimum and
median time per call on inputs whose rows sum to 1 (both give the same values).
The machine is shared: repeat, and read minima.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import tgc

SRC = """dim b = {b}, v = {v}
input y[b, v]
input z[b, v]
input dz[b, v]
{fact}
loss = sum[b](cross_entropy[v](z, y))
out hv = jvp(grad(loss, z), z, dz)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=15)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    shape = (a.batch, a.vocab)
    y = rng.random(shape).astype(np.float32)
    y /= y.sum(axis=1, keepdims=True)
    inputs = {"y": y, "z": rng.standard_normal(shape).astype(np.float32),
              "dz": rng.standard_normal(shape).astype(np.float32)}
    results = []
    for fact in ("", "assume sum[v](y) = 1"):
        program = tgc.compile(SRC.format(b=a.batch, v=a.vocab, fact=fact), options=tgc.Options(cpu=tgc.CpuOptions(threads=1)))
        ops = sum(1 for v in program.module.values() if v.op != "arg")
        results.append(program(**inputs)["hv"])
        times = []
        for _ in range(a.calls):
            t = time.perf_counter()
            program(**inputs)
            times.append(time.perf_counter() - t)
        print(f"{fact or 'no fact':22s} ops={ops} kernels={len(program.lowered.kernels)} "
              f"min={min(times) * 1e3:.2f} ms median={np.median(times) * 1e3:.2f} ms")
    print(f"max |difference| of hv: {float(np.max(np.abs(results[0] - results[1]))):.3g}")


if __name__ == "__main__":
    main()
