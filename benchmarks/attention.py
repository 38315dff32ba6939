"""Causal attention, forward and backward, at long lengths: tgc against torch SDPA.

Each row is one causal self-attention over `t` positions (`heads` heads of 64, `batch`
sequences), written in .tg as a new user would (`softmax[s]` of the masked, scaled
scores, contracted with `v` over `s`), with the gradients of `sum(y * dy)` with
respect to q, k and v. torch runs `F.scaled_dot_product_attention(is_causal=True)`
and `torch.autograd.grad` on the same arrays.

Columns: the median time of a call (forward and backward), and the peak memory of
temporaries: for tgc, `tgc explain`'s peak (the live temporaries at its fullest
kernel, a loop's step once per thread that runs its steps; the workspace it allocates
is at least that); for torch, the growth of the
process's peak resident set over one call, in a fresh process (inputs allocated
before). `layer peak`: tgc's peak for the same attention inside a layer as
examples/attention.tg writes it (projections in and out, heads split by a reindex, a
symbolic batch bound to the row's), explain only. Both outputs are checked against each other before timing (2e-3 of the
largest value).

    python benchmarks/attention.py                  # every row
    python benchmarks/attention.py --rows 1024 --repeat 3
    python benchmarks/attention.py --rows --wide-rows 8192   # t = 8192 at 4 heads x batch 2 only
    python benchmarks/attention.py --explain-only   # tgc's peak, no timing

Rows (ROWS): t = 1024 and 2048 at 4 heads x batch 2, 4096 at 2 x 1, 8192 at 1 x 1; and
(WIDE) t = 8192 again at 4 heads x batch 2, issue 32's largest row.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROWS = {1024: (4, 2), 2048: (4, 2), 4096: (2, 1), 8192: (1, 1)}   # t -> (heads, batch)
WIDE = {8192: (4, 2)}   # t -> (heads, batch): the long row again at the largest heads x batch
HD = 64

SOURCE = """
dim batch = {batch}, head = {heads}, t = {t}, hd = {hd}
dim s = t
input q[batch, head, t, hd]
input k[batch, head, s, hd]
input v[batch, head, s, hd]
input dy[batch, head, t, hd]
scores = sum[hd](q * k) / sqrt(size(hd))
p = softmax[s](where([s <= t], scores, -1e9))
y = sum[s](p * v)
out y[batch, head, t, hd]
loss = sum(y * dy)
out dq[batch, head, t, hd] = grad(loss, q)
out dk[batch, head, s, hd] = grad(loss, k)
out dv[batch, head, s, hd] = grad(loss, v)
"""


def row_shape(t: int, wide: bool = False) -> tuple[int, int]:
    """(heads, batch) of the row at `t`: ROWS's, or WIDE's (`wide`)."""
    return (WIDE if wide else ROWS)[t]


def source(t: int, wide: bool = False) -> str:
    heads, batch = row_shape(t, wide)
    return SOURCE.format(batch=batch, heads=heads, t=t, hd=HD)


def layer_source(t: int, wide: bool = False) -> str:
    """examples/attention.tg (projections in and out, heads split by a reindex, the
    batch symbolic) with the row's heads of 64 over `t` positions, masked by -1e9."""
    import tgc

    heads, _ = row_shape(t, wide)
    src = (Path(tgc.__file__).resolve().parents[1] / "examples" / "attention.tg").read_text()
    return (src.replace("dim t = 11", f"dim t = {t}")
            .replace("dim c = 48, head = 3", f"dim c = {HD * heads}, head = {heads}")
            .replace("scores, -inf)", "scores, -1e9)").replace("\nout probs", "\n# out probs"))


def arrays(t: int, seed: int = 0, wide: bool = False) -> dict:
    heads, batch = row_shape(t, wide)
    rng = np.random.default_rng(seed)
    shape = (batch, heads, t, HD)
    return {n: rng.standard_normal(shape, dtype=np.float32) for n in ("q", "k", "v", "dy")}


def tgc_peak(text: str, dims: dict, opts=None) -> tuple[int, int]:
    """(peak bytes of live temporaries, workspace bytes the CPU code allocates) from
    `tgc explain` at `dims` (under `opts`, default Options()), each thread's copy of a
    loop's step on the threads included."""
    from tgc import pipeline
    from tgc.explain import explain
    from tgc.frontend import compile_source
    from tgc.options import Options
    from tgc.pipeline import lower_module

    opts = opts or Options()
    module = compile_source(text, "<attention>", opts)
    env = module.bind_dims(dims)
    lowered = pipeline.lower(module, opts.with_(dims=tuple(sorted(dims.items()))))   # as `tgc explain`
    report = explain(lower_module(lowered.module, opts), env, opts)   # with the threads' lanes, as `tgc explain`
    ws = report["workspace"]
    return report["peak"]["bytes"], ws.get("allocated_bytes", ws["bytes"] + ws.get("lanes_bytes", 0))


def median_time(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def torch_step(a: dict):
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.from_numpy(a[n]).requires_grad_(True) for n in "qkv")
    dy = torch.from_numpy(a["dy"])

    def step():
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        dq, dk, dv = torch.autograd.grad(y, (q, k, v), dy)
        return {"y": y.detach().numpy(), "dq": dq.numpy(), "dk": dk.numpy(), "dv": dv.numpy()}
    return step


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: resident now, VmHWM: its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def torch_peak_child(t: int, wide: bool = False) -> None:
    """In a fresh process: the peak resident set during one torch step (the step run
    once before, untimed), less the resident set before it; Linux resets the peak
    when 5 is written to /proc/self/clear_refs."""
    import torch
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    step = torch_step(arrays(t, wide=wide))
    step()
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    step()
    print(json.dumps({"peak": _status("VmHWM") - before}))


def torch_peak(t: int, threads: int, wide: bool = False) -> int:
    r = subprocess.run([sys.executable, __file__, "--torch-peak-child", str(t)] + ["--wide"] * wide,
                       capture_output=True, text=True,
                       env={**os.environ, "THREADS": str(threads)}, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])["peak"]


def row(t: int, repeat: int, threads: int, explain_only: bool, wide: bool = False) -> dict:
    heads, batch = row_shape(t, wide)
    peak, workspace = tgc_peak(source(t, wide), {})
    layer, _ = tgc_peak(layer_source(t, wide), {"batch": batch})
    out = {"t": t, "heads": heads, "batch": batch, "tgc_peak": peak, "tgc_workspace": workspace,
           "layer_peak": layer}
    if explain_only:
        return out
    import tgc
    import torch
    torch.set_num_threads(threads)
    a = arrays(t, wide=wide)
    prog = tgc.compile(source(t, wide), backend="cpu", dtype="f32")
    got, want = prog(**a), torch_step(a)()
    for name, w in want.items():
        err = float(np.max(np.abs(got[name] - w)))
        if err > 2e-3 * float(np.max(np.abs(w))):
            raise SystemExit(f"t={t}: tgc's {name} differs from torch's by {err}")
    out["tgc_s"] = median_time(lambda: prog(**a), repeat)
    out["torch_s"] = median_time(torch_step(a), repeat)
    out["torch_peak"] = torch_peak(t, threads, wide)
    return out


def mb(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", default=None, choices=sorted(ROWS),
                    help=f"lengths of ROWS's rows (default: all, and WIDE's {sorted(WIDE)})")
    ap.add_argument("--wide-rows", type=int, nargs="*", default=None, choices=sorted(WIDE),
                    help="lengths of WIDE's rows, at their larger heads x batch (default: all when --rows is not given)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--explain-only", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--torch-peak-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--wide", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_peak_child:
        torch_peak_child(args.torch_peak_child, args.wide)
        return
    wide_rows = args.wide_rows if args.wide_rows is not None else ([] if args.rows is not None else sorted(WIDE))
    todo = [(t, False) for t in (sorted(ROWS) if args.rows is None else args.rows)] + [(t, True) for t in wide_rows]
    rows = []
    print("| t | heads x batch | tgc time | torch SDPA time | tgc/torch | tgc peak (explain) | torch peak (RSS) "
          "| layer peak (explain) |")
    print("|---|---|---|---|---|---|---|---|")
    for t, wide in todo:
        r = row(t, args.repeat, args.threads, args.explain_only, wide)
        rows.append(r)
        timing = ("-", "-", "-", "-") if args.explain_only else \
            (f"{r['tgc_s'] * 1e3:.0f} ms", f"{r['torch_s'] * 1e3:.0f} ms", f"{r['tgc_s'] / r['torch_s']:.2f}",
             mb(r["torch_peak"]))
        print(f"| {t} | {r['heads']} x {r['batch']} | {timing[0]} | {timing[1]} | {timing[2]} | "
              f"{mb(r['tgc_peak'])} | {timing[3]} | {mb(r['layer_peak'])} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
