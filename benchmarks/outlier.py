"""One outlying parallel region: does it make later calls run on one thread?

tgc times each parallel region; what a region takes beyond its expected cost is its
excess, and the lag (the least excess of the last `CpuOptions.contention_confirm_regions`
regions) keeps kernels under twice it serial for 50 times itself
(docs/optimization.md, "Shared cores"). This script calls attention.py's causal
attention (forward and backward) `--calls` times per program and prints each call's
wall time and the process's CPU time over it (2.0: both cores used, 1.0: serial).
Programs, called in turn in one process, `--rounds` times: `1` (the lag follows every
region's excess) and `2` (the default).

`--inject MS`: during call `--inject-at` of each block, a process at real-time priority
(SCHED_FIFO 10, `chrt`) pinned to CPU 1 spins MS ms, so that one region's worker
starts that much late (run with `OMP_PROC_BIND=true OMP_PLACES=cores`, which bind
thread 1 to CPU 1). `--realtime`: the calls themselves run at SCHED_FIFO 1 (their
threads inherit it), so that other processes on a shared machine do not make lags of
their own. Both need the right to set real-time priorities (root here).
`--load N`: N processes spin meanwhile (as `run.py --load`); `--one-thread` adds a program
on one thread to compare with.

    OMP_PROC_BIND=true OMP_PLACES=cores python benchmarks/outlier.py --realtime --inject 15
    python benchmarks/outlier.py --load 3 --calls 10
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention  # noqa: E402

SPIN = """import sys, time
while sys.stdin.read(1):
    time.sleep(0.005)
    t = time.perf_counter()
    while time.perf_counter() - t < {s}:
        pass
"""


def set_realtime(on: bool) -> None:
    """SCHED_FIFO 1 (or back to SCHED_OTHER) for every thread of this process."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setscheduler(int(tid), os.SCHED_FIFO if on else os.SCHED_OTHER, os.sched_param(1 if on else 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t", type=int, default=1024, choices=sorted(attention.ROWS))
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--inject", type=float, default=0.0, metavar="MS")
    ap.add_argument("--inject-at", type=int, default=2)
    ap.add_argument("--realtime", action="store_true")
    ap.add_argument("--load", type=int, default=0, metavar="N")
    ap.add_argument("--confirm", default="1,2", help="contention_confirm_regions of each program")
    ap.add_argument("--one-thread", action="store_true", help="also a program on one thread (CpuOptions(threads=1))")
    args = ap.parse_args()

    import torch   # as attention.py: torch's libgomp is the one loaded
    import tgc
    from tgc.backends.cpu.options import CpuOptions
    from tgc.options import Options

    torch.set_num_threads(2)
    a = attention.arrays(args.t)
    progs = {}
    for n in args.confirm.split(","):
        progs[f"confirm {n}"] = tgc.compile(attention.source(args.t), backend="cpu", dtype="f32",
                               options=Options(cpu=CpuOptions(contention_confirm_regions=int(n))))
    if args.one_thread:
        progs["1 thread"] = tgc.compile(attention.source(args.t), backend="cpu", dtype="f32",
                                        options=Options(cpu=CpuOptions(threads=1)))
    spinner, realtime = None, False
    if args.inject:
        spinner = subprocess.Popen(["chrt", "-f", "10", "taskset", "-c", "1", sys.executable, "-c",
                                    SPIN.format(s=args.inject / 1e3)], stdin=subprocess.PIPE, text=True)
    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.load)]
    try:
        for prog in progs.values():
            prog(**a)
        if args.realtime:
            try:
                set_realtime(True)
            except PermissionError:
                raise SystemExit("--realtime: this user may not set real-time priorities") from None
            realtime = True
        res = {n: [] for n in progs}
        for r in range(args.rounds):
            for n, prog in progs.items():
                time.sleep(0.3)   # each program keeps its own lag; the last block's workers go to sleep
                for i in range(args.calls):
                    if spinner and i == args.inject_at:
                        spinner.stdin.write("x")
                        spinner.stdin.flush()
                    w0, c0 = time.perf_counter(), time.process_time()
                    prog(**a)
                    w = time.perf_counter() - w0
                    res[n].append((i, w * 1e3, (time.process_time() - c0) / w))
                print(f"round {r}, {n}: " + " ".join(f"{x[1]:.0f}/{x[2]:.2f}" for x in res[n][-args.calls:]),
                      flush=True)
    finally:
        if realtime:
            set_realtime(False)
        if spinner:
            spinner.stdin.close()
            spinner.wait()
        for p in busy:
            p.kill()
            p.wait()
    print("(each call: wall ms / process CPU time over wall time)")
    for n, rows in res.items():
        after = [x for x in rows if x[0] > args.inject_at]
        ms, ratio = np.array([x[1] for x in after]), np.array([x[2] for x in after])
        print(f"{n}: calls after call {args.inject_at}: median {np.median(ms):.1f} ms "
              f"(min {ms.min():.1f}), CPU/wall median {np.median(ratio):.2f}, "
              f"{int((ratio < 1.3).sum())} of {len(after)} serial (CPU/wall < 1.3)")


if __name__ == "__main__":
    main()
