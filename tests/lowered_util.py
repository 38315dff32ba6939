"""A lowered program checked against the IR interpreter (tests of the lowering stages)."""
from __future__ import annotations

import numpy as np

from tgc.ir.inputs import random_inputs
from tgc.ir.interp import evaluate
from tgc.lower.epilogue import expand
from tgc.lower.interp import run_lowered


def assert_lowered_gives_the_ir_interpreters_values(m, low, dtype: str) -> None:
    """`low` (lowered from module `m`) run by the lowered interpreter gives the IR
    interpreter's values on random inputs (f64 to 1e-10, f32 to 3e-5 of each output's
    scale), and its epilogues expanded into loops give the same bits."""
    x = random_inputs(m, m.bind_dims({}), 0, dtype)
    want = evaluate(m, {k: np.copy(v) for k, v in x.items()}, dtype=dtype)
    got = run_lowered(low, {k: np.copy(v) for k, v in x.items()})
    expanded = run_lowered(expand(low), {k: np.copy(v) for k, v in x.items()})
    tol = 1e-10 if dtype == "f64" else 3e-5
    for k, w in want.items():
        scale = max(1.0, float(np.max(np.abs(w))))
        np.testing.assert_allclose(got[k], w, rtol=tol, atol=tol * scale, err_msg=k)
        np.testing.assert_array_equal(expanded[k], got[k], err_msg=k)


def gpt2_start(program, state_dims: dict, batch: int, seed: int = 3) -> dict[str, np.ndarray]:
    """A first AdamW step's arguments for examples/gpt2.tg: random weights (N(0, 0.3):
    attention far from uniform), LayerNorm scales 1, zero moments (`init_state` of
    `state_dims`), random tokens of `batch` sequences."""
    rng = np.random.default_rng(seed)
    arrays = program.init_state(state_dims)
    for spec in program.inputs:
        if spec.kind == "param":
            arrays[spec.name] = (np.ones(spec.shape) if spec.name.startswith("ln") and spec.name.endswith("_w")
                                 else 0.3 * rng.standard_normal(spec.shape))
    ftype = arrays["step"].dtype
    arrays = {k: v.astype(ftype) for k, v in arrays.items()}
    tokens = rng.integers(0, state_dims["vocab"], (batch, state_dims["t"] + 1)).astype(np.int32)
    return {**arrays, "ids": tokens[:, :-1].copy(), "targets": tokens[:, 1:].copy(),
            "lr": np.asarray(3e-3, ftype), "wd": np.asarray(0.1, ftype)}
