"""`Program.check`: everything a call checks, without running it.

A data-parallel step checks each rank's call with it before any communication
(tgc.distributed), so it must refuse what a call refuses, with the same message, also
when its signature-only checks are skipped for a signature seen before.
"""
from __future__ import annotations

import numpy as np
import pytest

import tgc

SRC = """
dim batch
dim v = 5
input ids: i32[batch]
input x[batch]
param E[v]
param s
input lr
loss = mean[batch](E[v = ids] * x) + s * s
out loss
update E = E - lr * grad(loss, E)
update s = s - lr * grad(loss, s)
"""


@pytest.fixture(scope="module")
def prog():
    return tgc.compile(SRC)


def _good() -> dict:
    return {"ids": np.array([0, 4, 2], np.int32), "x": np.ones(3, np.float32),
            "E": np.arange(5, dtype=np.float32), "s": np.array(1.0, np.float32), "lr": 0.1}


def test_check_runs_nothing_and_gives_the_dims(prog):
    arrays = _good()
    assert prog.check(arrays) == {"batch": 3, "v": 5}
    assert prog.check(arrays) == {"batch": 3, "v": 5}      # a signature seen before
    assert np.array_equal(arrays["E"], np.arange(5)) and arrays["s"] == 1.0


def _shared(a: dict) -> dict:
    E = np.zeros(6, np.float32)
    return {**a, "E": E[:5], "s": E[4:5].reshape(())}     # s is E[4]


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "x": np.ones(4, np.float32)}, "batch"),
    (lambda a: {k: v for k, v in a.items() if k != "lr"}, "missing input 'lr'"),
    (lambda a: {**a, "z": 1.0}, "unexpected input 'z'"),
    (lambda a: {**a, "x": np.ones(3, np.int64)}, "input 'x' must be a float array"),
    (lambda a: {**a, "ids": np.array([0, 5, 2], np.int32)}, "gather index out of range: 'ids'\\[batch=1\\] = 5"),
    (lambda a: {**a, "ids": np.array([0, -1, 2], np.int32)}, "gather index out of range"),
    (_shared, "update targets 'E' and 's' share memory"),
])
def test_check_refuses_what_a_call_refuses(prog, change, message):
    prog.check(_good())                   # the good signature is known: the bad one must still be caught
    bad = change(_good())
    with pytest.raises(tgc.EvalError, match=message) as checked:
        prog.check(bad)
    with pytest.raises(tgc.EvalError) as called:
        prog.run(change(_good()))
    assert str(checked.value) == str(called.value)


def test_a_dim_no_argument_carries_says_how_to_give_it():
    # c = head * hd: no shape gives head or hd alone. A keyword call takes no dims=, so the
    # message says where dims= goes; run(dims=) then binds it
    prog = tgc.compile("dim head, hd\ndim c = head * hd\ninput x[c]\nout y[head, hd] = x[c = hd*head + hd]\n")
    x = np.arange(6, dtype=np.float32)
    with pytest.raises(tgc.EvalError, match=r"dim '(head|hd)' is not bound.*program\.run\(arrays, dims=\{\.\.\.\}\)"):
        prog(x=x)
    np.testing.assert_array_equal(prog.run({"x": x}, dims={"head": 2, "hd": 3})["y"], x.reshape(2, 3))
