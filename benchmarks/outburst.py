"""A short outburst of load: how long does tgc run serially after it ends?

tgc keeps kernels serial while it holds a lag (a worker waited for its core: another
process held it; docs/optimization.md, "Shared cores"), and measures the lag again
when the hold runs out. This script calls one of `run.py`'s rows (default: the GPT
step) back to back for `--total-s` seconds, with each call's wall time and parallel
regions counted (run.py's `RegionCounter`). After 0.3 s an outburst starts: a process at
real-time priority (SCHED_FIFO 10, `chrt`) pinned to CPU 1 spins `--on-ms`, sleeps
`--off-ms`, for `--burst-ms` (a worker that needs CPU 1 waits up to `--on-ms` for it).
The calls themselves run at SCHED_FIFO 1, so that a shared machine's other processes
make no lags of their own, with `OMP_PROC_BIND=true OMP_PLACES=cores` (thread 1 on
CPU 1). It prints, per round, the calls before, during and after the outburst, and the
serial tail: from the outburst's end to the first call that runs its regions again.
Needs the right to set real-time priorities (root here).

    OMP_PROC_BIND=true OMP_PLACES=cores python benchmarks/outburst.py --on-ms 20 --off-ms 0.05
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "10000")   # as run.py
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import run  # noqa: E402

SPIN = """import sys, time
on, off, dur = {on}, {off}, {dur}
while sys.stdin.read(1):
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < dur:
        t = time.perf_counter()
        while time.perf_counter() - t < on:
            pass
        time.sleep(off)
    sys.stdout.write("d")
    sys.stdout.flush()
"""


def set_realtime(on: bool) -> None:
    """SCHED_FIFO 1 (or back to SCHED_OTHER) for every thread of this process."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setscheduler(int(tid), os.SCHED_FIFO if on else os.SCHED_OTHER, os.sched_param(1 if on else 0))


def report(log, start, end):
    """One round's line: `log` holds (seconds since the round began, ms, regions) per call."""
    full = max(r for _, _, r in log)
    parallel = [r >= full / 2 for _, _, r in log]
    before = [i for i, x in enumerate(log) if x[0] < start]
    during = [i for i, x in enumerate(log) if start <= x[0] < end]
    after = [i for i, x in enumerate(log) if x[0] >= end]
    back = next((i for i in after if parallel[i]), None)
    tail = f"{(log[back][0] - end) * 1e3:.0f} ms ({back - after[0]} calls)" if back is not None else \
        f"more than {(log[-1][0] - end) * 1e3:.0f} ms (every call after it, {len(after)})"
    return (f"before: {len(before)} calls, median {np.median([log[i][1] for i in before]):.2f} ms, "
            f"{sum(parallel[i] for i in before)} parallel; during: {len(during)} calls, "
            f"{sum(parallel[i] for i in during)} parallel; serial tail {tail}"
            + ("" if back is None else f", then {sum(parallel[i] for i in after if i >= back)} of "
               f"{sum(1 for i in after if i >= back)} parallel (median "
               f"{np.median([log[i][1] for i in after if i >= back]):.2f} ms)"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", default="gpt", help="a workload of run.py (its first size)")
    ap.add_argument("--burst-ms", type=float, default=300.0)
    ap.add_argument("--on-ms", type=float, default=20.0)
    ap.add_argument("--off-ms", type=float, default=0.05)
    ap.add_argument("--total-s", type=float, default=3.5)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    import tgc
    counter = run.RegionCounter()
    case = next(c for c in run.cases() if c.workload == args.row)
    arrays = case.inputs(np.random.default_rng(0))
    prog = tgc.compile(str(run.WORK / f"{case.workload}.tg"), backend="cpu", dtype="f32", dims=case.dims)
    for _ in range(5):
        prog(**arrays)
    spinner = subprocess.Popen(["chrt", "-f", "10", "taskset", "-c", "1", sys.executable, "-c",
                                SPIN.format(on=args.on_ms / 1e3, off=args.off_ms / 1e3, dur=args.burst_ms / 1e3)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    realtime = False
    print(f"# {case.workload} {case.size}: outburst of {args.burst_ms:.0f} ms ({args.on_ms} ms on, "
          f"{args.off_ms} ms off on CPU 1) after 0.3 s of {args.total_s} s; tgc {Path(tgc.__file__).parent}")
    try:
        try:
            set_realtime(True)
        except PermissionError:
            raise SystemExit("this user may not set real-time priorities") from None
        realtime = True
        for r in range(args.rounds):
            time.sleep(0.3)
            log, t_start, sent = [], time.perf_counter(), None
            while time.perf_counter() - t_start < args.total_s:
                if sent is None and time.perf_counter() - t_start > 0.3:
                    spinner.stdin.write("x")
                    spinner.stdin.flush()
                    sent = time.perf_counter() - t_start
                c0, t0 = counter.count, time.perf_counter()
                prog(**arrays)
                log.append((t0 - t_start, (time.perf_counter() - t0) * 1e3, counter.count - c0))
            spinner.stdout.read(1)
            print(f"round {r}: " + report(log, sent, sent + args.burst_ms / 1e3), flush=True)
    finally:
        if realtime:
            set_realtime(False)
        spinner.stdin.close()
        spinner.wait()
        counter.close()


if __name__ == "__main__":
    main()
