"""Micro-benchmarks of two runtime costs, printed (never asserted: timings are not tests).

    python benchmarks/micro.py [--repeat N]

- parallel region overhead: one call of a tiny elementwise program (64 elements) with
  its loop forced onto the worker threads (`parallel_min_work=0`) against the same
  program on one thread (`threads=1`): the cost of a libgomp region on this machine;
- exp over 10^7 float32 values: tgc's vectorized `exp` (one elementwise kernel)
  against `np.exp`, each writing into a preallocated array.

Each figure is the median of N samples (default 7). The environment's GOMP_SPINCOUNT
and OMP_WAIT_POLICY are printed with the region figures: they change them.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tgc  # noqa: E402
from tgc.options import CpuOptions, Options  # noqa: E402


def median_us(fn, calls: int, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t) / calls * 1e6)
    return float(np.median(samples))


def region_overhead(repeat: int) -> str:
    src = "dim n\ninput x[n]\nout y = tanh(x) * 2\n"
    x = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    serial = tgc.compile(src, dtype="f32", options=Options(cpu=CpuOptions(threads=1)))
    parallel = tgc.compile(src, dtype="f32", options=Options(cpu=CpuOptions(parallel_min_work=0, parallel_min_work_warm=0)))
    res = {}
    for label, prog in (("serial call", serial), ("parallel region", parallel)):
        for _ in range(200):
            prog(x=x)
        res[label] = median_us(lambda: prog(x=x), 2000, repeat)
    env = f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}"
    return f"call of a 64-element program ({env}): " + ", ".join(f"{k} {v:.1f} us" for k, v in res.items())


def exp_f32(repeat: int) -> str:
    x = np.random.default_rng(2).uniform(-80, 80, 10_000_000).astype(np.float32)
    out = np.empty_like(x)
    prog = tgc.compile("dim n\ninput x[n]\nout y = exp(x)\n", dtype="f32")
    prog(x=x)
    tgc_ms = median_us(lambda: prog(x=x), 1, repeat) / 1e3
    np_ms = median_us(lambda: np.exp(x, out=out), 1, repeat) / 1e3
    return f"exp over 1e7 f32, median: tgc {tgc_ms:.2f} ms (output allocated per call), np.exp {np_ms:.2f} ms (into `out`)"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=7, help="samples per figure (median)")
    args = ap.parse_args(argv)
    print(region_overhead(args.repeat))
    print(exp_f32(args.repeat))


if __name__ == "__main__":
    main()
