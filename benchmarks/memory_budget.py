"""Workspace and step time of the 3-layer GPT with and without `--memory-budget`.

    python benchmarks/memory_budget.py [--batch 64] [--fraction 0.5] [--calls 30]

Compiles `workloads/gpt.tg` (f32, one thread, the batch symbolic as the file has it, sized
`--batch` for the planner) without a budget, then with a budget of
`--fraction` of that workspace (tgc/budget.py), and prints for each the planned
workspace and the peak of live temporaries (`tgc explain`), the kernels, what the
planner chose, and the minimum and median time per training step over `--calls` calls
(lr = 0, so every call does the same work). The machine may be shared: repeat, and
read minima.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

import tgc
from tgc.explain import explain

GPT = Path(__file__).with_name("workloads") / "gpt.tg"


def step_times(program, batch: int, calls: int) -> list[float]:
    rng = np.random.default_rng(0)
    arrays = {}
    for s in program.inputs:
        shape = tuple(batch if isinstance(n, str) else n for n in s.shape)   # the symbolic batch
        if str(s.dtype) in ("i32", "int32"):
            arrays[s.name] = rng.integers(0, 64, shape).astype(np.int32)
        else:
            arrays[s.name] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    arrays["lr"] = np.float32(0.0)
    program(**arrays)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        program(**arrays)
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--calls", type=int, default=30)
    a = ap.parse_args()
    base = None
    for label in ("no budget", "budget"):
        options = tgc.Options(cpu=tgc.CpuOptions(threads=1), rep_size=a.batch)   # the batch stays symbolic; the planner sizes it so
        if label == "budget":
            options = options.with_(memory_budget=int(base * a.fraction))
        t = time.perf_counter()
        program = tgc.compile(str(GPT), options=options)
        built = time.perf_counter() - t
        report = explain(program.lowered, {"batch": a.batch})
        base = base or report["workspace"]["bytes"]
        times = step_times(program, a.batch, a.calls)
        print(f"{label:9s} workspace={report['workspace']['bytes'] / 1e6:.2f} MB "
              f"peak={report['peak']['bytes'] / 1e6:.2f} MB kernels={len(report['kernels'])} "
              f"recompute={len(report['recompute'])} compile={built:.1f} s "
              f"min={min(times) * 1e3:.3f} ms median={np.median(times) * 1e3:.3f} ms")
        if program.memory_plan is not None:
            print("  " + program.memory_plan.summary())
            print("\n".join(program.memory_plan.lines()))


if __name__ == "__main__":
    main()
