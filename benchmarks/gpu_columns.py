"""Column sums and layernorm rows on a CUDA device: the kernels docs/cuda.md's "Column
sums" and "Row groups" describe, timed one table row at a time.

    python benchmarks/gpu_columns.py                      # on an NVIDIA GPU (CuPy)
    python benchmarks/gpu_columns.py --backend cuda-sim   # small sizes, emulated: tests this script

Rows: a bias gradient `db[d] = sum[rows](dy)`, a weight gradient
`dw[d] = sum[rows](dy * x)`, and a layernorm forward and backward (its row group and
its dw, db column sums), at rows x d sizes with rows of 64 to 4096 elements. For each:
tgc with column tiles (`CudaOptions.column_tiles`, the default), tgc with one block per
output instead (`column_tiles=False`) (for the layernorm: dw, db as column tiles, the
default, then summed inside its row group instead, `CudaOptions.row_columns`), torch's (`dy.sum(0)`, ...; on a GPU, when torch
has CUDA), the rate in GB/s of the bytes the sums must read (against the copy
bandwidth), the largest error against numpy in float64 (relative to the largest
value), and whether three calls gave the same bits (`same bits`; `DIFFERENT` else).
Each time is the median of `--repeat` samples of calls replayed as CUDA graphs
(gpu_bench.py's `timed`). Under cuda-sim (one small size, the column sums only) the
times say nothing about a GPU.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from gpu_bench import _device, copy_bandwidth, fmt, timed  # noqa: E402

PROGRAMS = {
    "bias": ("dim rows, d\ninput dy[rows, d]\nout db[d] = sum[rows](dy)\n", ("dy",)),
    "weight": ("dim rows, d\ninput dy[rows, d]\ninput x[rows, d]\nout dw[d] = sum[rows](dy * x)\n", ("dy", "x")),
    "layernorm": ("dim rows, d\ninput x[rows, d]\ninput dy[rows, d]\nparam w[d], b[d]\n"
                  "y = layernorm[d](x, w, b)\nloss = sum(y * dy)\nout y\nout dx = grad(loss, x)\n"
                  "out dw = grad(loss, w)\nout db = grad(loss, b)\n", ("x", "dy", "w", "b")),
}
GPU_SIZES = [(4096, 1024), (16384, 768), (65536, 64), (1024, 4096), (8192, 4096)]
SIM_SIZES = [(130, 36)]


def reference(name: str, a: dict) -> dict:
    """The results in float64 with numpy."""
    f = {k: v.astype(np.float64) for k, v in a.items()}
    if name == "bias":
        return {"db": f["dy"].sum(0)}
    if name == "weight":
        return {"dw": (f["dy"] * f["x"]).sum(0)}
    x, dy, w = f["x"], f["dy"], f["w"]
    mu = x.mean(1, keepdims=True)
    xc = x - mu
    rs = 1.0 / np.sqrt((xc * xc).mean(1, keepdims=True) + 1e-5)
    xh = xc * rs
    g = dy * w
    dx = rs * (g - g.mean(1, keepdims=True) - xh * (g * xh).mean(1, keepdims=True))
    return {"y": xh * w + f["b"], "dx": dx, "dw": (dy * xh).sum(0), "db": dy.sum(0)}


def torch_step(name: str, arrays: dict, backend: str):
    """The same sums in torch (eager) on the device, or None without torch with CUDA (and
    under cuda-sim: torch on the CPU is not what this script measures)."""
    if backend != "cuda":
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    t = {k: torch.from_numpy(v).to("cuda") for k, v in arrays.items()}
    if name == "bias":
        return lambda: t["dy"].sum(0)
    if name == "weight":
        return lambda: (t["dy"] * t["x"]).sum(0)
    ln = torch.nn.functional.layer_norm
    x = t["x"].clone().requires_grad_(True)
    w, b = t["w"].clone().requires_grad_(True), t["b"].clone().requires_grad_(True)

    def step():
        y = ln(x, (x.shape[1],), w, b, 1e-5)
        return torch.autograd.grad((y * t["dy"]).sum(), (x, w, b))
    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["cuda", "cuda-sim"], default="cuda")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    import tgc
    from tgc.backends.cuda.options import CudaOptions
    from tgc.options import Options

    xp, sync, device = _device(args.backend)
    bw = copy_bandwidth(xp, sync, args.repeat) if args.backend == "cuda" else None
    print(f"device: {device}" + (f"; copy bandwidth {bw / 1e9:.0f} GB/s" if bw else ""))
    head = (f"{'program':<10} {'rows x d':<13} {'tiles ms':>9} {'per-out ms':>10} {'torch ms':>9}  "
            f"{'tiles rate':>18}  {'max rel err':>11}  runs")
    print(head)
    print("-" * len(head))
    torch_sync = (lambda: None)
    if args.backend == "cuda":
        try:
            import torch
            torch_sync = torch.cuda.synchronize
        except ImportError:
            pass
    rng = np.random.default_rng(0)
    for name, (source, ins) in PROGRAMS.items():
        if args.backend == "cuda-sim" and name == "layernorm":
            continue   # the emulator's layernorm calls take seconds: the column sums alone test the script
        # the default, then the variant it replaced: tiles / one block per output, or, for
        # the layernorm, dw and db as column tiles / inside the row group
        other = CudaOptions(row_columns=True) if name == "layernorm" else CudaOptions(column_tiles=False)
        progs = {first: tgc.compile(source, backend=args.backend, dtype="f32", options=Options().with_(cuda=cuda))
                 for first, cuda in ((True, CudaOptions()), (False, other))}
        for rows, d in (GPU_SIZES if args.backend == "cuda" else SIM_SIZES):
            arrays = {k: rng.standard_normal((rows, d) if k in ("x", "dy") else (d,)).astype(np.float32)
                      for k in ins}
            dev = {k: xp.asarray(v) for k, v in arrays.items()}
            try:
                outs = [progs[True](**dev) for _ in range(3)]
                host = [{k: np.asarray(v.get() if hasattr(v, "get") else v) for k, v in o.items()} for o in outs]
            except Exception as e:  # noqa: BLE001 -- a row that fails says why and the table goes on
                print(f"{name:<10} {f'{rows}x{d}':<13} n/a ({type(e).__name__}: {str(e)[:80]})", flush=True)
                continue
            same = all(h[k].tobytes() == host[0][k].tobytes() for h in host[1:] for k in h)
            want = reference(name, arrays)
            err = max(float(np.max(np.abs(host[0][k] - w))) / max(float(np.max(np.abs(w))), 1e-30)
                      for k, w in want.items())
            t_tiles = timed(lambda: progs[True](**dev), sync, args.repeat)
            t_plain = timed(lambda: progs[False](**dev), sync, args.repeat)
            step = torch_step(name, arrays, args.backend)
            t_torch = timed(step, torch_sync, args.repeat) if step is not None else None
            nbytes = 4 * rows * d * len([k for k in ins if k in ("x", "dy")])
            rate = f"{nbytes / t_tiles / 1e9:7.1f} GB/s" + (f" ({nbytes / t_tiles / bw:4.0%})" if bw else "")
            print(f"{name:<10} {f'{rows}x{d}':<13} {fmt(t_tiles)} {fmt(t_plain):>10} {fmt(t_torch)}  {rate:>18}  "
                  f"{err:11.2e}  {'same bits' if same else 'DIFFERENT'}", flush=True)


if __name__ == "__main__":
    main()
