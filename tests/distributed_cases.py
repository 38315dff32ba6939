"""Training steps the data-parallel tests (test_distributed.py, distributed_mpi_train.py) run: the program, its initial params and
states, and the global batch of step k (the same on every rank and in the test)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@dataclass
class Case:
    path: str
    init: Callable[[], dict]
    batch: Callable[[int], dict]
    scalars: Callable[[int], dict]
    loss: str = "loss"


def _mlp_init() -> dict:
    rng = np.random.default_rng(1)
    return {"W1": 0.3 * rng.standard_normal((13, 64), dtype=np.float32), "b1": np.zeros(64, np.float32),
            "W2": 0.3 * rng.standard_normal((64, 3), dtype=np.float32), "b2": np.zeros(3, np.float32)}


def _mlp_batch(k: int, rows: int = 12) -> dict:
    rng = np.random.default_rng([2, k])
    return {"x": rng.standard_normal((rows, 13), dtype=np.float32),
            "y": np.eye(3, dtype=np.float32)[rng.integers(0, 3, rows)]}


def _digits_init() -> dict:
    """The digits conv net's params and Adam state (examples/train_digits.tg)."""
    import tgc

    prog = tgc.compile(str(EXAMPLES / "train_digits.tg"))
    rng = np.random.default_rng(3)
    out = {}
    for s in prog.inputs:
        if s.kind == "param":
            out[s.name] = (0.2 * rng.standard_normal(s.shape)).astype(np.float32)
        elif s.kind == "state":
            out[s.name] = np.zeros(s.shape, np.float32)
    return out


def _digits_batch(k: int, rows: int = 12) -> dict:
    rng = np.random.default_rng([4, k])
    return {"x": rng.random((rows, 8, 8), dtype=np.float32),
            "y": np.eye(10, dtype=np.float32)[rng.integers(0, 10, rows)]}


CASES = {
    # SGD on the README's MLP; 12 rows split 6+6 or 4+4+4
    "mlp": Case(str(EXAMPLES / "mlp.tg"), _mlp_init, _mlp_batch, lambda k: {"lr": 0.1}),
    # 13 rows: unequal shards (7+6, 5+4+4), averaged by rows
    "mlp13": Case(str(EXAMPLES / "mlp.tg"), _mlp_init, lambda k: _mlp_batch(k, 13), lambda k: {"lr": 0.1}),
    # a conv net with Adam written as state and updates (examples/train_digits.tg)
    "digits": Case(str(EXAMPLES / "train_digits.tg"), _digits_init, _digits_batch, lambda k: {"lr": 0.01}),
}
