"""Run under mpirun -n 2 by tests/test_distributed.py: data-parallel steps with one rank at fault.

    mpirun -n 2 --enable-recovery python tests/distributed_mpi_faults.py OUT_DIR CASE...

The CASEs run in the order given (`killed` last: it ends rank 1); each is one of:

- `bad-batch`: the MLP case for STEPS steps; at step BAD rank 1 passes a batch of the
  wrong shape and catches the EvalError, as a loop that skips a bad batch would, and
  so does rank 0.
- `mismatch`: rank 1 compiles another program (a param of another size) than rank 0,
  and both call the step once.
- `killed`: rank 1 kills itself (SIGKILL) before step KILLED; rank 0 makes the call with
  `Options(collective_timeout=TIMEOUT)` (`mpirun --enable-recovery` lets rank 0 live on,
  as when a node is lost).

Each surviving rank writes OUT_DIR/CASE.rank{R}.json: the errors its calls raised
(type and message), how long the failed call took, and its params after the steps.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import distributed_cases as cases  # noqa: E402

import tgc  # noqa: E402
from tgc.distributed import DataParallelError  # noqa: E402

STEPS, BAD, KILLED, TIMEOUT = 4, 1, 2, 3.0
OPTIONS = tgc.Options(cpu=tgc.CpuOptions(threads=1))
SOURCE = """
dim batch
dim f = {f}
input x[batch, f]
param W[f]
input lr
loss = mean[batch](sum[f](x * W) ^ 2)
out loss
update W = W - lr * grad(loss, W)
"""


def main() -> int:
    from mpi4py import MPI

    out = Path(sys.argv[1])
    for case in sys.argv[2:]:
        run(MPI.COMM_WORLD, case, out)
    if "killed" in sys.argv[2:]:
        # a peer is dead: MPI_Finalize at exit may wait for it forever; the reports are written
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def run(comm, case: str, out: Path) -> None:
    rank = comm.Get_rank()
    report = {"errors": [], "seconds": None}
    if case == "bad-batch":
        state = _train(comm, report, bad_at=BAD if rank == 1 else None)
    elif case == "mismatch":
        f = 3 + rank
        step = tgc.compile(SOURCE.format(f=f), data_parallel=comm, options=OPTIONS)
        state = {"W": 0.5 * (1 + rank) * np.ones(f, np.float32)}
        x = np.ones((4, f), np.float32)
        _call(step, report, {**step.shard_inputs({"x": x}), **state, "lr": 0.1})
    elif case == "killed":
        state = _train(comm, report, kill_at=KILLED if rank == 1 else None, stop_on_error=True,
                       options=OPTIONS.with_(collective_timeout=TIMEOUT))
    else:
        raise SystemExit(f"unknown case {case}")
    report["params"] = {k: v.tolist() for k, v in state.items()}
    (out / f"{case}.rank{rank}.json").write_text(json.dumps(report))


def _train(comm, report: dict, bad_at=None, kill_at=None, stop_on_error=False, options=OPTIONS) -> dict:
    case = cases.CASES["mlp"]
    step = tgc.compile(case.path, data_parallel=comm, options=options)
    state = case.init()
    for k in range(STEPS):
        if k == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        mine = step.shard_inputs(case.batch(k))
        if k == bad_at:
            mine["x"] = mine["x"][:, :-1]      # one feature short
        if not _call(step, report, {**mine, **case.scalars(k), **state}) and stop_on_error:
            break
    return state


def _call(step, report: dict, arrays: dict) -> bool:
    """One step; an EvalError or DataParallelError is noted (and the loop goes on)."""
    start = time.monotonic()
    try:
        step(**arrays)
        return True
    except (tgc.EvalError, DataParallelError) as e:
        report["errors"].append([type(e).__name__, str(e)])
        report["seconds"] = time.monotonic() - start
        return False


if __name__ == "__main__":
    sys.exit(main())
