"""Causal attention on the GPU, forward and backward: tgc's cuda backend against torch SDPA.

The program is benchmarks/attention.py's (the masked, scaled `softmax[s]` contracted with
`v`, and the gradients of `sum(y * dy)` for q, k and v), compiled for f32 with the default
options, as a user compiles it: the CUDA backends' options keep the chain whole for their
`flash` stage (`Backend.pipeline_options`), so the forward is one fused kernel and the
backward two at every length (docs/cuda.md, "Attention"). torch runs
`F.scaled_dot_product_attention(is_causal=True)` and `torch.autograd.grad` on the same
device arrays. Both results are checked against each other (2e-3 of the largest value)
before timing. `--streamed` adds the program with the flash stage off
(`CudaOptions(flash=False)`: the stream pass runs it in blocks of the query edge where its
thresholds say so, as cuBLAS GEMMs and kernels per block).

Columns: the median time of a call; launches per call of the fused program (kernels; no
cuBLAS call); the peak device memory of the call beyond its inputs (tgc: CuPy's pool after
the call; torch: `max_memory_allocated` over the call).

    python benchmarks/gpu_attention.py                      # t = 1024 .. 8192 on the GPU
    benchmarks/gpu_check.sh --attention                     # the same on a lent device, one command (carry build/gpu-wheels)
    python benchmarks/gpu_attention.py --backend cuda-sim --rows 64   # the script, here
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from attention import HD, ROWS, SOURCE  # noqa: E402
from gpu_bench import _device, fmt, timed  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["cuda", "cuda-sim"], default="cuda")
    ap.add_argument("--rows", type=int, nargs="*", default=sorted(ROWS), help="lengths t")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--streamed", action="store_true", help="also time the streamed program (flash stage off)")
    args = ap.parse_args(argv)
    import tgc

    xp, sync, name = _device(args.backend)
    try:
        import torch
        tdev = "cuda" if args.backend == "cuda" else "cpu"
        if tdev == "cuda" and not torch.cuda.is_available():
            torch = None
    except ImportError:
        torch = None
    print(f"# causal attention, f32, forward and backward, on {name}")
    print(f"{'t':>6} {'heads':>5} {'batch':>5} {'kern':>4} {'fused ms':>9} {'stream ms':>9} {'torch ms':>9} {'ratio':>6} "
          f"{'tgc MiB':>8} {'torch MiB':>9}")
    failed = 0
    for t in args.rows:
        heads, batch = ROWS.get(t, (1, 1))
        src = SOURCE.format(batch=batch, heads=heads, t=t, hd=HD)
        prog = tgc.compile(src, backend=args.backend, dtype="f32")   # the default options
        kinds = [getattr(k, "kind", "") for k in prog.lowered.kernels]
        launches = len(prog._kernels._cm.launches)
        if "flash" not in kinds or "flashback" not in kinds:
            print(f"# t={t}: the flash stage did not fuse the chain ({kinds})")
            failed += 1
        streamed = tgc.compile(src, backend=args.backend, dtype="f32",
                               options=tgc.Options().with_(flash=False)) if args.streamed else None
        rng = np.random.default_rng(t)
        host = {k: rng.standard_normal((batch, heads, t, HD)).astype(np.float32) for k in ("q", "k", "v", "dy")}
        dev = {k: xp.asarray(v) for k, v in host.items()}
        pool = xp.get_default_memory_pool() if args.backend == "cuda" else None
        before = pool.total_bytes() if pool else 0
        got = prog(**dev)
        sync()
        tgc_mib = ((pool.total_bytes() - before) / 2 ** 20) if pool else float("nan")
        t_tgc = timed(lambda d=dev: prog(**d), sync, args.repeat)
        t_stream = timed(lambda d=dev: streamed(**d), sync, args.repeat) if streamed is not None else None
        t_torch, torch_mib = None, float("nan")
        if torch is not None:
            import torch.nn.functional as F
            tq, tk, tv, tdy = (torch.as_tensor(host[k], device=tdev) for k in ("q", "k", "v", "dy"))
            for x in (tq, tk, tv):
                x.requires_grad_(True)

            def torch_step():
                y = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
                return (y, *torch.autograd.grad(y, (tq, tk, tv), tdy))
            tsync = torch.cuda.synchronize if tdev == "cuda" else (lambda: None)
            if tdev == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            want = [x.detach().cpu().numpy() for x in torch_step()]
            if tdev == "cuda":
                torch_mib = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
            for key, w in zip(("y", "dq", "dk", "dv"), want):
                g = got[key].get() if hasattr(got[key], "get") else np.asarray(got[key])
                err = float(np.max(np.abs(g - w)))
                if err > 2e-3 * float(np.max(np.abs(w))):
                    print(f"# t={t}: {key} differs from torch by {err:.3g}")
                    failed += 1
            t_torch = timed(torch_step, tsync, args.repeat)
        ratio = f"{t_tgc / t_torch:6.2f}" if t_torch else "   n/a"
        print(f"{t:6d} {heads:5d} {batch:5d} {launches:4d} {fmt(t_tgc)} {fmt(t_stream)} {fmt(t_torch)} {ratio} "
              f"{tgc_mib:8.1f} {torch_mib:9.1f}", flush=True)
        del got, dev
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
