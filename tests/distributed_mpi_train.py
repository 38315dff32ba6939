"""Run under mpirun by tests/test_distributed.py: k data-parallel steps of a program.

    mpirun -n N python tests/distributed_mpi_train.py OUT_DIR SPEC... [--steps K]

A SPEC is a case's name (`distributed_cases.CASES`), then any of `:det` for `deterministic=True`
(the sum in rank order), `:small` for buckets of at most 1 KiB (several per step, so that
the reduction overlaps phase 1), `:serial` for `overlap=False`. Every rank builds the same global batches and initial params from `distributed_cases.py` (rank 1+
start from different params on purpose: the first call must broadcast rank 0's), trains
on its shard, and writes OUT_DIR/SPEC.rank{R}.npz: the params and states after the steps
the loss each step returned, whether the last step overlapped and how many buckets it had.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import distributed_cases as cases  # noqa: E402

import tgc  # noqa: E402
from tgc.distributed import BUCKET_BYTES, DataParallel  # noqa: E402


def main() -> int:
    from mpi4py import MPI

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    for spec in args.specs:
        run(MPI.COMM_WORLD, spec, Path(args.out), args.steps)
    return 0


def run(comm, spec: str, out: Path, steps: int, lock=contextlib.nullcontext(), backend: str = "cpu") -> None:
    """The SPEC's steps on `comm` (mpi4py's, or one of `tgc.distributed.local_group`'s
    with a `lock` that serializes the compiles of the threads)."""
    name, *modes = spec.split(":")
    case = cases.CASES[name]
    with lock:
        step: DataParallel = tgc.compile(case.path, data_parallel=comm, deterministic="det" in modes,
                                         bucket_bytes=1024 if "small" in modes else BUCKET_BYTES,
                                         overlap="serial" not in modes,
                                         options=tgc.Options(cpu=tgc.CpuOptions(threads=1)), backend=backend)
    state = case.init()
    if step.rank:
        for v in state.values():
            v += 1.0          # wrong on purpose: the first call broadcasts rank 0's values
    losses = []
    for k in range(steps):
        mine = step.shard_inputs(case.batch(k))
        result = step(**mine, **case.scalars(k), **state)
        losses.append(float(result[case.loss]))
    np.savez(out / f"{spec}.rank{step.rank}.npz", losses=np.array(losses), overlapped=step.last_overlapped,
             buckets=len(step.buckets), **state)


if __name__ == "__main__":
    sys.exit(main())
