"""What each thread does of each kernel: a step on one thread against the same step on N.

For a workload of `benchmarks/breakdown.py` (the nanoGPT-char AdamW step by default),
the program a timed call runs is built twice with `CpuOptions(profile=True)` and the
contention rule off (`contention_memory_cycles=0`: every kernel over its threshold runs
in a region, as on a quiet machine): on one thread and on `--threads` (2). Calls of the
two alternate; after each, `Program.thread_profile()` gives per kernel the CPU time
(each thread's `clock_gettime(CLOCK_THREAD_CPUTIME_ID)`) of thread 0 over the kernel,
thread 0's busy time, and the other threads' busy time in its regions' bodies. CPU time,
not wall time: on a shared machine the time slices other processes take are not
counted, so the table holds under load (cache sharing with them still slows a kernel,
so each figure is its least over the calls).

Per kernel (a loop's step kernels summed over its steps): `1t` its CPU time on one
thread; on N threads `t0 all` thread 0's CPU time over it (its busy time, plus starting
and ending its regions and spinning while it waits for the others), `t0 busy` and `t1
busy` (the other threads' busy time; on 2 threads, the worker's); `loss` the busier
thread's time less an even share of the one-thread time (what an uneven split, a serial
kernel or extra work costs the step), `infl` the busy times' sum less the one-thread time
(work the split adds: a repacked operand; negative where the shares fit the caches
better), `spd` the one-thread time over the busier thread's. The kernels with the
largest loss come first; the totals estimate the step on N quiet cores (the sum of the
busier threads' times) against an even split. The profiled program runs no merged
regions and shares no loop's steps among the threads (its counters are per kernel;
`codegen.parallel_step_loops`): a timed call shares regions between kernels, so it
starts fewer, and runs the independent steps of a loop (a streamed attention's key
blocks) each on one thread, where the profiled one splits each step's kernels; the
kernels' work is the same. (nanoGPT-char's loops carry their layers: none of its steps
are shared.)

    python benchmarks/thread_split.py                      # nanoGPT-char, 1 vs 2 threads, 8 calls each
    python benchmarks/thread_split.py --workload conv2d_sym --calls 15 --top 20
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def build(w, threads: int):
    """`w`'s step program (breakdown's workload) with the counters, on `threads`, the
    contention rule off."""
    from tgc import pipeline

    opts = w.options.with_(cpu=w.options.cpu.with_(profile=True, threads=threads, contention_memory_cycles=0))
    fixed = pipeline.specialized_module(w.module, w.dims, opts) if w.dims else w.module
    return pipeline.compile_module(fixed, opts)


def measure(w, threads: int, calls: int) -> tuple[list, dict]:
    """(breakdown's kernel rows, {1: [...], threads: [...]}: per call, each counter's
    `thread_profile` row), calls of the two programs alternated."""
    import breakdown
    from tgc.explain import _fixed_dims

    progs = {t: build(w, t) for t in (1, threads)}
    arrays = {t: w.arrays(progs[t]) for t in progs}
    low = progs[1].lowered
    rows, _ = breakdown.kernel_rows(low, _fixed_dims(low))
    for t, p in progs.items():
        p(**arrays[t])
    seen: dict[int, list] = {t: [] for t in progs}
    order = list(progs)
    for c in range(calls):
        for t in order if c % 2 == 0 else order[::-1]:
            progs[t].profile(reset=True)
            progs[t](**arrays[t])
            seen[t].append(progs[t].thread_profile())
    return rows, seen


def report(rows, seen: dict, threads: int, top: int) -> dict:
    """Print the per-kernel table (module docstring); returns the totals (ms)."""
    def least(t, j):
        return [min(call[i][j] for call in seen[t]) for i in range(len(rows))]

    one, all0, own, rest = least(1, 0), least(threads, 0), least(threads, 1), least(threads, 2)
    ms = lambda ns: ns / 1e6   # noqa: E731
    out, tot = [], dict(one=0.0, all0=0.0, own=0.0, rest=0.0, busiest=0.0)
    for i, r in enumerate(rows):
        if r.loop:   # its step kernels have their rows
            continue
        busiest = max(own[i], rest[i])
        out.append((busiest - one[i] / threads, r, one[i], all0[i], own[i], rest[i], busiest))
        for k, v in zip(("one", "all0", "own", "rest", "busiest"), (one[i], all0[i], own[i], rest[i], busiest)):
            tot[k] += v
    out.sort(key=lambda x: -x[0])
    print(f"CPU ms per call, each the least of {len(seen[1])} calls; threads 1 and {threads}")
    print(f"  {'kernel (first line)':<66} {'x':>3} {'1t':>7} {'t0 all':>7} {'t0 busy':>7} {'t1 busy':>7} "
          f"{'loss':>6} {'infl':>6} {'spd':>5}")
    for loss, r, o, a, b0, b1, busiest in out[:top]:
        text = r.text if len(r.text) <= 66 else r.text[:63] + "..."
        print(f"  {text:<66} {r.times:>3} {ms(o):7.2f} {ms(a):7.2f} {ms(b0):7.2f} {ms(b1):7.2f} {ms(loss):6.2f} "
              f"{ms(b0 + b1 - o):6.2f} {o / max(busiest, 1):5.2f}")
    rest_n = len(out) - top
    if rest_n > 0:
        print(f"  ... {rest_n} more kernels, {ms(sum(x[0] for x in out[top:])):.2f} ms of loss together")
    t = {k: ms(v) for k, v in tot.items()}
    print(f"  all kernels: 1t {t['one']:.1f}; {threads} threads: t0 all {t['all0']:.1f}, t0 busy {t['own']:.1f}, "
          f"others busy {t['rest']:.1f}, the busier thread's summed {t['busiest']:.1f} (an even split: "
          f"{t['one'] / threads:.1f}; loss {t['busiest'] - t['one'] / threads:.1f}, work added "
          f"{t['own'] + t['rest'] - t['one']:.1f})")
    return t


def main(argv=None) -> int:
    import breakdown

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=sorted(breakdown.WORKLOADS), default="nanogpt")
    ap.add_argument("--threads", type=int, default=2, help="the thread count set against one (default 2)")
    ap.add_argument("--calls", type=int, default=8, help="calls of each program, alternated (default 8)")
    ap.add_argument("--top", type=int, default=25, help="kernels listed, largest loss first (default 25)")
    args = ap.parse_args(argv)
    if args.threads < 2:
        ap.error("--threads: at least 2")
    w = breakdown.WORKLOADS[args.workload]()
    print(f"== {w.title}; load average {os.getloadavg()[0]:.2f}")
    t0 = time.perf_counter()
    rows, seen = measure(w, args.threads, args.calls)
    report(rows, seen, args.threads, args.top)
    print(f"  ({time.perf_counter() - t0:.0f} s; load average {os.getloadavg()[0]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
