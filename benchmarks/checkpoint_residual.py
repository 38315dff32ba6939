"""Workspace and step time of a residual MLP with and without `checkpoint`.

    python benchmarks/checkpoint_residual.py [--batch 2048] [--d 64] [--h 512] [--calls 10]

Three residual blocks `r + checkpoint(relu(r @ A)) @ B` and a softmax cross-entropy
head, one SGD step (f32, one thread). For each variant (the hidden activations kept,
or recomputed by the backward pass) it prints the planned workspace and the peak of
live temporaries (`tgc explain`), the kernels, and the minimum and median time per
step over `--calls` calls. The machine is shared: repeat, and read minima.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import tgc
from tgc.explain import explain

SRC = """dim batch = {batch}, d = {d}, h = {h}, classes = 10
input x[batch, d]
input y[batch, classes]
param A1[d, h], B1[h, d], A2[d, h], B2[h, d], A3[d, h], B3[h, d], C[d, classes]
input lr
r1 = x + {c}(relu(x @ A1)) @ B1
r2 = r1 + {c}(relu(r1 @ A2)) @ B2
r3 = r2 + {c}(relu(r2 @ A3)) @ B3
loss = mean[batch](cross_entropy[classes](r3 @ C, y))
out loss
update C = C - lr * grad(loss, C)
update B3 = B3 - lr * grad(loss, B3)
update A3 = A3 - lr * grad(loss, A3)
update B2 = B2 - lr * grad(loss, B2)
update A2 = A2 - lr * grad(loss, A2)
update B1 = B1 - lr * grad(loss, B1)
update A1 = A1 - lr * grad(loss, A1)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--h", type=int, default=512)
    ap.add_argument("--calls", type=int, default=10)
    a = ap.parse_args()
    for c in ("", "checkpoint"):
        program = tgc.compile(SRC.format(batch=a.batch, d=a.d, h=a.h, c=c), options=tgc.Options(cpu=tgc.CpuOptions(threads=1)))
        report = explain(program.lowered, {})
        rng = np.random.default_rng(0)
        arrays = {s.name: (rng.standard_normal(s.shape) * 0.1).astype(np.float32) for s in program.inputs}
        arrays["lr"] = np.float32(0.0)   # the parameters stay as they are from call to call
        program(**arrays)
        times = []
        for _ in range(a.calls):
            t = time.perf_counter()
            program(**arrays)
            times.append(time.perf_counter() - t)
        print(f"{c or 'kept':10s} workspace={report['workspace']['bytes'] / 2**20:.2f} MiB "
              f"peak={report['peak']['bytes'] / 2**20:.2f} MiB kernels={len(report['kernels'])} "
              f"recompute={len(report['recompute'])} min={min(times) * 1e3:.2f} ms "
              f"median={np.median(times) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
