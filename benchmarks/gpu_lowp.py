"""Mixed precision on a CUDA device: tgc's bf16 GEMM (`cublasGemmStridedBatchedEx`,
bf16 inputs, f32 output and compute) and `--autocast bf16` GPT step against f32, and
against torch on the same GPU.

    python benchmarks/gpu_lowp.py                      # on an NVIDIA GPU (CuPy; torch if installed)
    python benchmarks/gpu_lowp.py --backend cuda-sim   # small sizes, emulated: tests this script

Rows:
- `matmul N`: one product C = A @ B of N x N matrices, f32 result: tgc with bf16
  inputs (`out c = f32(a) @ f32(b)`: one GemmEx call) and with f32 inputs (sgemm),
  torch's f32 and bf16 products. tgc's bf16 result is first checked against float64
  products of the same bf16 values (within N * 2^-22 of the sum of magnitudes) and its
  call counted (`gemm ex` column: GemmEx calls per tgc call).
- `gpt`: the benchmark GPT's training step (benchmarks/workloads/gpt.tg, batch 64), f32
  and `--autocast bf16` (every product's operands rounded to bf16 and stored in 2 bytes,
  the products GemmEx calls); the autocast loss is checked against the f32 one.

A sample is the mean of enough calls to last 20 ms between device synchronizations;
the median of `--repeat` samples is printed (gpu_bench.py's `timed`). On a GPU, tgc's
calls replay a CUDA graph.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import gpu_bench  # noqa: E402  (device, timing)
import run  # noqa: E402  (the GPT row's inputs)

MATMUL_TG = """
dim m = {n}, k = {n}, n = {n}
input a: {t}[i: m, kk: k]
input b: {t}[kk, j: n]
out c = {cast}
"""


def _matmul_src(n: int, t: str) -> str:
    return MATMUL_TG.format(n=n, t=t, cast="f32(a) @ f32(b)" if t == "bf16" else "a @ b")


def _ex_counter():
    """(counts, restore): the GEMM cells of the next first call, and how many are
    GemmEx calls (bf16/f16 operands): planned through `blas` on a GPU, run by
    `gemm.run_numpy` under cuda-sim."""
    from tgc.backends.cuda import blas, gemm

    counts = {"ex": 0, "calls": 0}
    owners = ((blas.DirectCublas, "caller"), (blas.CupyCublas, "caller"), (gemm, "run_numpy"))
    originals = [getattr(o, n) for o, n in owners]

    def wrap(fn, method: bool):
        def counted(*a, **kw):
            call = a[1] if method else a[0]
            counts["calls"] += 1
            counts["ex"] += bool(call.atype)
            return fn(*a, **kw)
        return counted
    for (o, n), fn in zip(owners, originals):
        setattr(o, n, wrap(fn, o is not gemm))

    def restore():
        for (o, n), fn in zip(owners, originals):
            setattr(o, n, fn)
    return counts, restore


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["cuda", "cuda-sim"], default="cuda")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--sizes", default=None, help="matmul sizes, comma-separated (default 4096,8192; sim: 128)")
    args = ap.parse_args(argv)
    import ml_dtypes

    import tgc

    sim = args.backend == "cuda-sim"
    xp, sync, name = gpu_bench._device(args.backend)
    try:
        import torch
        tdev = "cpu" if sim else "cuda"
        if tdev == "cuda" and not torch.cuda.is_available():
            torch = None
    except ImportError:
        torch = None
    sizes = [int(s) for s in (args.sizes or ("128" if sim else "4096,8192")).split(",")]
    rng = np.random.default_rng(0)
    print(f"device: {name}; backend {args.backend}")
    head = f"{'row':<14} {'contender':<26} {'ms':>9} {'rate':>14}  {'gemm ex':>7}  check"
    print(head)
    print("-" * len(head))
    bad = 0
    for n in sizes:
        a = rng.standard_normal((n, n)).astype(ml_dtypes.bfloat16)
        b = rng.standard_normal((n, n)).astype(ml_dtypes.bfloat16)
        flops = 2.0 * n ** 3
        for t in ("bf16", "f32"):
            prog = tgc.compile(_matmul_src(n, t), backend=args.backend)
            if t == "bf16":   # bf16 bits (uint16) on a GPU, ml_dtypes under cuda-sim
                da, db = (xp.asarray(x.view(np.uint16)) if not sim else x for x in (a, b))
            else:
                da, db = xp.asarray(a.astype(np.float32)), xp.asarray(b.astype(np.float32))
            counts, restore = _ex_counter()
            try:
                out = prog(a=da, b=db)["c"]
            finally:
                restore()
            got = np.asarray(out.get() if hasattr(out, "get") else out, np.float64)
            a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
            if n <= 4096:
                err = np.abs(got - a64 @ b64).max() / (np.abs(a64) @ np.abs(b64)).max()
                ok = err <= n * 2.0 ** -22
                check = f"{'ok' if ok else 'WRONG'} (rel {err:.1e})"
                bad += not ok
            else:
                check = "-"
            ms = gpu_bench.timed(lambda: prog(a=da, b=db), sync, args.repeat)
            print(f"{'matmul ' + str(n):<14} {'tgc ' + t:<26} {ms * 1e3:9.3f} {flops / ms / 1e12:10.1f} TF/s"
                  f"  {counts['ex']:>7}  {check}")
        if torch is not None:
            for tt in ("float32", "bfloat16"):
                ta = torch.tensor(np.asarray(a, np.float32), device=tdev).to(getattr(torch, tt))
                tb = torch.tensor(np.asarray(b, np.float32), device=tdev).to(getattr(torch, tt))
                tsync = torch.cuda.synchronize if tdev == "cuda" else (lambda: None)
                ms = gpu_bench.timed(lambda: ta @ tb, tsync, args.repeat)
                print(f"{'matmul ' + str(n):<14} {'torch ' + tt:<26} {ms * 1e3:9.3f} {flops / ms / 1e12:10.1f} TF/s")
    # the GPT step, f32 and --autocast bf16
    src = str(HERE / "workloads" / "gpt.tg")
    inputs = run._gpt_inputs(np.random.default_rng(1))
    losses = {}
    for cast in (None, "bf16"):
        prog = tgc.compile(src, backend=args.backend, options=tgc.Options(autocast=cast))
        arrays = {k: xp.asarray(v.copy()) for k, v in inputs.items()}
        counts, restore = _ex_counter()
        try:
            out = prog(**arrays)
        finally:
            restore()
        losses[cast] = float(out["loss"].get() if hasattr(out["loss"], "get") else out["loss"])
        check = f"loss {losses[cast]:.4f}"
        if cast:
            ok = abs(losses[cast] - losses[None]) <= 2e-2 * max(1.0, abs(losses[None]))
            check += " ok" if ok else " WRONG (f32: %.4f)" % losses[None]
            bad += not ok
        ms = None if sim else gpu_bench.timed(lambda: prog(**arrays), sync, args.repeat)   # the emulator: untimed
        print(f"{'gpt step':<14} {'tgc ' + ('autocast bf16' if cast else 'f32'):<26} {gpu_bench.fmt(ms)} {'':>14}"
              f"  {counts['ex']:>7}  {check}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
