"""GPT-2 small's AdamW step on one thread: tgc per kernel, and the step against PyTorch eager.

examples/gpt2.tg bound to GPT-2 small (12 layers, 12 heads of 64 = width 768, t 1024,
vocabulary 50257, batch 1; 124.4 M params), as benchmarks/nanogpt.py builds and checks
nanoGPT-char's. The program is the one a timed call runs (every size fixed, as
benchmarks/breakdown.py builds it) with `CpuOptions(threads=1)`; with `--profile` it is
compiled again with the per-kernel counters and each kernel's time of the fastest call
is printed (a loop's step kernels summed over its steps, so the layer loop's kernels are
12 layers' time), largest first. The step is timed in per-thread CPU time
(`time.thread_time`, robust to other processes' load), the minimum of `--repeat` calls,
tgc and torch (one thread) alternated. It peaks at about 5 GB of memory: run one at a time.

    python benchmarks/gpt2_small.py --repeat 3
    python benchmarks/gpt2_small.py --profile --stream-block 0 --layers 2
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
SIZES = {"layer": 12, "head": 12, "hd": 64, "t": 1024, "vocab": 50257}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--t", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--stream-block", type=int, default=None, help="Options.stream_block (default: the default)")
    ap.add_argument("--profile", action="store_true", help="per-kernel times (a second build with counters)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args(argv)

    import breakdown
    import nanogpt
    from tgc import explain

    sizes = dict(SIZES, layer=args.layers, t=args.t, vocab=args.vocab)
    from tgc import pipeline

    src = pipeline.load_source(str(nanogpt.GPT2), dims=sizes, lookup=False)
    options = src.options
    if args.stream_block is not None:
        options = options.with_(stream_block=args.stream_block)
    c0 = time.process_time()
    module = pipeline.lower(src.module, options).module
    program = breakdown.build(module, {"batch": 1}, options, False, 1)
    print(f"sizes {sizes} batch 1, stream_block {options.stream_block}: built in {time.process_time() - c0:.1f} s CPU")
    rep = explain.explain(program.lowered, {}, options)
    peak = (f"tgc explain: peak {rep['peak']['bytes'] / 2**20:.0f} MiB of temporaries (workspace "
            f"{rep['workspace']['bytes'] / 2**20:.0f} MiB), {rep['bytes'] / 1e9:.2f} GB moved, {rep['flops'] / 1e9:.0f} GFLOP")
    arrays = nanogpt.initial(program, 1, sizes=sizes)
    mine = {k: v.copy() for k, v in arrays.items()}
    got = float(program(**mine)["loss"])
    print(f"first-step loss {got:.5f}")
    step = None
    if not args.no_torch:
        import torch

        torch.set_num_threads(1)
        names = [s.name for s in program.inputs if s.kind == "param"]
        step, P = nanogpt.torch_step(arrays, names, False, sizes=sizes)
        want = step()
        ref = P["wte"].detach().numpy()
        err = np.abs(mine["wte"] - ref).max() / np.abs(ref).max()
        print(f"torch loss {want:.5f} (rel diff {abs(got - want) / abs(want):.1e}); wte updated, max diff {err:.1e} of its largest")
    ts, tt, ps = [], [], []
    for _ in range(args.repeat):
        t0, p0 = time.thread_time(), time.process_time()
        program(**mine)
        ts.append(time.thread_time() - t0)
        ps.append(time.process_time() - p0)
        if step is not None:
            t0 = time.thread_time()
            step()
            tt.append(time.thread_time() - t0)
    line = f"tgc step (one thread, thread_time, min of {args.repeat}): {min(ts) * 1e3:.0f} ms (process {min(ps) * 1e3:.0f})"
    if tt:
        line += f"; torch eager {min(tt) * 1e3:.0f} ms; ratio {min(ts) / min(tt):.3f}"
    print(line)
    if peak is not None:
        print(peak)
    if args.profile:
        from tgc.explain import _fixed_dims

        prof = breakdown.build(module, {"batch": 1}, options, True, 1)
        low = prof.lowered
        rows, _ = breakdown.kernel_rows(low, _fixed_dims(low))
        mine = {k: v.copy() for k, v in arrays.items()}
        prof(**mine)
        least = None
        for _ in range(args.repeat):
            prof.profile(reset=True)
            prof(**mine)
            got = [c[0] for c in prof.thread_profile()]
            least = got if least is None else [min(a, b) for a, b in zip(least, got)]
        n = len(low.kernels)
        for r, c in zip(rows, least):
            r.ticks = c / 1e6   # ms of thread CPU time, the least over the calls
        top = sum(r.ticks for r in rows[:n])
        steps = [r for r in rows[n:]]
        print(f"profiled (thread CPU, per kernel least of {args.repeat}): top-level kernels {top:.0f} ms, "
              f"of which loops {sum(r.ticks for r in rows[:n] if r.loop):.0f} ms = step kernels {sum(r.ticks for r in steps):.0f} ms + own")
        shown = sorted((r for r in rows if not r.loop), key=lambda r: -r.ticks)[:args.top]
        for r in shown:
            print(f"{r.ticks:9.2f} ms x{r.times:<4} {'GEMM ' + r.shape + ' ' if r.product else ''}{r.text[:160]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
