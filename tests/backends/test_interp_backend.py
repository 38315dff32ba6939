"""`tgc.compile(..., backend="interp")`: the reference IR interpreter behind the neutral
runtime, under the name `tgc run --backend interp` takes (tgc/backends/interp.py), and
the error for a backend name that does not exist."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc.backends.base import backend_names, get_backend
from tgc.ir.input_checks import EvalError
from tgc.ir.interp import evaluate

ROOT = Path(__file__).resolve().parents[2]
MLP = str(ROOT / "examples/mlp.tg")


def _mlp_arrays(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return dict(x=rng.standard_normal((8, 13), dtype=np.float32),
                y=np.eye(3, dtype=np.float32)[rng.integers(0, 3, 8)],
                W1=rng.standard_normal((13, 64), dtype=np.float32), b1=np.zeros(64, np.float32),
                W2=rng.standard_normal((64, 3), dtype=np.float32), b2=np.zeros(3, np.float32),
                lr=np.float32(0.1))


def test_compile_with_interp_runs_the_interpreter_and_updates_in_place():
    program = tgc.compile(MLP, backend="interp")
    given = _mlp_arrays(0)
    want = evaluate(program.module, {k: v.copy() for k, v in given.items()}, dtype="f32")
    W2 = given["W2"]
    got = program(**given)
    assert set(got) == set(want)
    for k, v in want.items():
        np.testing.assert_array_equal(np.asarray(got[k]), v, err_msg=k)
    assert got["W2"] is W2 and np.array_equal(W2, want["W2"])   # written into the caller's array
    cpu = tgc.compile(MLP, backend="cpu")(**_mlp_arrays(0))
    for k, v in want.items():
        np.testing.assert_allclose(np.asarray(cpu[k]), v, rtol=1e-5, atol=1e-6, err_msg=k)


def test_interp_takes_i32_ids_and_checks_them():
    src = """
dim n = 4, v = 5
input E[v, n]
input ids: i32[n]
out y[n] = E[v = ids]
"""
    program = tgc.compile(src, backend="interp")
    E = np.arange(20, dtype=np.float32).reshape(5, 4)
    ids = np.array([4, 0, 2, 1], np.int32)
    np.testing.assert_array_equal(program(E=E, ids=ids)["y"], E[ids, np.arange(4)])
    with pytest.raises(EvalError, match="ids"):
        program(E=E, ids=np.array([5, 0, 0, 0], np.int32))


def test_interp_gives_complex_outputs():
    src = """
dim n = 3
input z: c64[n]
out w[n] = z * z
"""
    z = np.array([1 + 2j, -0.5j, 3], np.complex64)
    np.testing.assert_allclose(tgc.compile(src, backend="interp")(z=z)["w"], z * z, rtol=1e-6)


def test_an_unknown_backend_lists_every_name():
    with pytest.raises(ValueError) as info:
        tgc.compile(MLP, backend="nope")
    message = str(info.value)
    assert "'nope'" in message
    for name in (*backend_names(), "interp"):
        assert name in message
    assert "interp" not in backend_names()   # the backend tests run the interpreter themselves
    assert get_backend("interp").name == "interp"
