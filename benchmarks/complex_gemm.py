"""A complex GEMM and its gradient: tgc (one cgemm/zgemm per product, docs/complex.md) against
numpy's complex matmul (BLAS cgemm/zgemm) and, when present, eager PyTorch.

    python benchmarks/complex_gemm.py [--n 256] [--repeat 15] [--dtype f32]

Prints the minimum over `--repeat` samples of the time per call (each sample is the mean
of enough calls to last about 50 ms) and the largest difference from numpy's product,
relative to its largest element. The machine is shared: take minima, and repeat.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import tgc

SRC = """dim i, j, k
input a: c64[i, j]
input b: c64[j, k]
out c = a @ b
"""
GRAD = """dim i, j, k
input a: c64[i, j]
input b: c64[j, k]
c = a @ b
out g = grad(sum(abs(c) ^ 2), a)
"""


def best(fn, repeat: int) -> float:
    fn()
    calls = 1
    t = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t, 1e-6)
    calls = max(1, int(0.05 / one))
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--dtype", choices=["f32", "f64"], default="f32")
    args = p.parse_args()
    n, cdt = args.n, {"f32": np.complex64, "f64": np.complex128}[args.dtype]
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((n, n)) + 1j * rng.standard_normal((n, n))).astype(cdt)
    b = (rng.standard_normal((n, n)) + 1j * rng.standard_normal((n, n))).astype(cdt)
    ref = a.astype(np.complex128) @ b.astype(np.complex128)
    fwd, grad = tgc.compile(SRC, dtype=args.dtype), tgc.compile(GRAD, dtype=args.dtype)
    err = np.abs(fwd(a=a, b=b)["c"] - ref).max() / np.abs(ref).max()
    err_np = np.abs(a @ b - ref).max() / np.abs(ref).max()
    gref = 2 * ref @ b.astype(np.complex128).conj().T
    gerr = np.abs(grad(a=a, b=b)["g"] - gref).max() / np.abs(gref).max()
    print(f"complex GEMM {n}x{n}x{n}, {args.dtype} parts; min of {args.repeat} samples")
    print(f"  tgc   a @ b          {best(lambda: fwd(a=a, b=b), args.repeat) * 1e3:8.3f} ms   rel. error {err:.2e}")
    print(f"  numpy a @ b          {best(lambda: a @ b, args.repeat) * 1e3:8.3f} ms   rel. error {err_np:.2e}")
    print(f"  tgc   grad |a b|^2   {best(lambda: grad(a=a, b=b), args.repeat) * 1e3:8.3f} ms   rel. error {gerr:.2e}")
    print(f"  numpy grad |a b|^2   {best(lambda: 2 * (a @ b) @ b.conj().T, args.repeat) * 1e3:8.3f} ms")
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(2)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    print(f"  torch a @ b          {best(lambda: ta @ tb, args.repeat) * 1e3:8.3f} ms")

    def tgrad():
        x = ta.clone().requires_grad_()
        ((x @ tb).abs() ** 2).sum().backward()
        return x.grad

    print(f"  torch grad |a b|^2   {best(tgrad, args.repeat) * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
