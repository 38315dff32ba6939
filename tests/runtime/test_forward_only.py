"""The forward-only call: `program.run(..., updates=False)`, `program(..., updates=False)`
and `tgc run --no-update` apply no update and compute nothing only the updates need."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import tgc
from tgc import pipeline
from tgc.cli import main
from tgc.ir.interp import EvalError
from tgc.ir.values import DERIVATIVE_OPS

ROOT = Path(__file__).parents[2]
MLP = ROOT / "examples/mlp.tg"


def mlp_arrays(batch: int = 6, dtype=np.float32) -> dict:
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((batch, 13)).astype(dtype),
            "y": np.eye(3, dtype=dtype)[rng.integers(0, 3, batch)],
            "W1": (0.3 * rng.standard_normal((13, 64))).astype(dtype), "b1": np.zeros(64, dtype),
            "W2": (0.3 * rng.standard_normal((64, 3))).astype(dtype), "b2": np.zeros(3, dtype),
            "lr": dtype(0.1)}


@pytest.fixture(scope="module")
def mlp():
    return tgc.compile(MLP)


def test_outputs_equal_the_full_call_and_nothing_is_written(mlp):
    arrays = mlp_arrays()
    given = {k: np.copy(v) for k, v in arrays.items()}
    forward = mlp.run(given, updates=False)
    assert sorted(forward) == ["correct", "loss", "probs"]          # no update results
    for k, v in arrays.items():                                      # params untouched
        np.testing.assert_array_equal(given[k], v, err_msg=k)
    full = mlp.run({k: np.copy(v) for k, v in arrays.items()})
    for name in forward:
        np.testing.assert_allclose(forward[name], full[name], rtol=1e-6, atol=1e-7, err_msg=name)
    # the keyword call, and again (the pruned program is compiled once and kept)
    again = mlp(**given, updates=False)
    np.testing.assert_array_equal(again["loss"], forward["loss"])
    assert mlp.without_updates() is mlp.without_updates()


def test_the_pruned_program_computes_less(mlp):
    forward = mlp.without_updates()
    assert forward.updates == [] and [s.name for s in forward.outputs] == [s.name for s in mlp.outputs]
    assert len(forward.lowered.kernels) < len(mlp.lowered.kernels)
    # lr is read by the updates only: the pruned program does not take it
    assert "lr" in [s.name for s in mlp.inputs] and "lr" not in [s.name for s in forward.inputs]
    assert not any(s.updated for s in forward.inputs)
    assert "update" not in forward.ir()


def test_arguments_only_the_updates_read_may_be_left_out(mlp):
    arrays = mlp_arrays()
    del arrays["lr"]
    for a in arrays.values():   # read-only arrays are fine: nothing is written
        a.flags.writeable = False
    result = mlp.run(arrays, updates=False)
    assert np.isfinite(result["loss"])
    with pytest.raises(EvalError, match="unexpected input 'nope'"):
        mlp.run({**arrays, "nope": np.zeros(1)}, updates=False)
    with pytest.raises(EvalError, match="missing input 'W1'"):
        mlp.run({k: v for k, v in arrays.items() if k != "W1"}, updates=False)
    with pytest.raises(TypeError, match="updates="):
        mlp.run(arrays, updates="no")


def test_a_program_without_updates_is_its_own_forward_program():
    prog = tgc.compile("dim n = 3\ninput x[n]\nout y = 2 * x\n")
    assert prog.without_updates() is prog
    x = np.arange(3, dtype=np.float32)
    np.testing.assert_array_equal(prog(x=x, updates=False)["y"], 2 * x)


def test_an_argument_named_updates_is_an_argument():
    prog = tgc.compile("dim n = 2\ninput updates[n]\nparam w[n]\nout s = sum(w * updates)\n"
                       "update w = w - updates\n")
    w = np.ones(2, np.float32)
    result = prog(updates=np.ones(2, np.float32), w=w)
    assert result["s"] == 2 and np.array_equal(w, [0, 0])


def test_states_and_f64_and_fp_strict():
    src = ("dim n = 4\ninput x[n]\nparam w[n]\nstate m[n]\ninput lr\n"
           "loss = sum((w * x - 1) ^ 2)\nout loss\n"
           "update m = 0.9 * m + grad(loss, w)\nupdate w = w - lr * m\n")
    for dtype, strict in (("f64", False), ("f32", True)):
        prog = tgc.compile(src, dtype=dtype, options=tgc.Options(fp_strict=strict))
        np_t = np.float64 if dtype == "f64" else np.float32
        args = {"x": np.arange(4, dtype=np_t), "w": np.ones(4, np_t), "m": np.ones(4, np_t), "lr": np_t(0.1)}
        before = {k: np.copy(v) for k, v in args.items()}
        forward = prog.run(args, updates=False)
        assert forward["loss"].dtype == np_t
        for k in args:
            np.testing.assert_array_equal(args[k], before[k])
        full = prog.run(args)
        assert full["loss"] == forward["loss"]
        assert not np.array_equal(args["w"], before["w"])     # the full call did update
        assert not any(v.op in DERIVATIVE_OPS for v in prog.without_updates().module.values())


def test_forward_only_drops_only_what_the_updates_read():
    module = pipeline.load(str(MLP), tgc.Options())
    pruned = pipeline.forward_only(module)
    assert pruned.updates == [] and list(pruned.args) == ["x", "y", "W1", "b1", "W2", "b2"]
    # an argument nothing reads but which alone gives a used symbolic dim its size stays
    src = "dim n\ninput a[n]\ninput lr\nparam w[n]\nout z = 0 * a\nupdate w = w - lr\n"
    from tgc.frontend.elaborate import elaborate_source

    m = elaborate_source(src, "<t>", tgc.Options()).module
    m = pipeline.lower(m, tgc.Options()).module
    assert list(pipeline.forward_only(m).args) in (["a"], ["a", "w"])


def test_cli_no_update(tmp_path):
    runner = CliRunner()
    full = tmp_path / "full.npz"
    fwd = tmp_path / "fwd.npz"
    for backend in ("interp", "cpu"):
        r = runner.invoke(main, ["run", str(MLP), "--random-inputs", "--backend", backend, "-o", str(full)])
        assert r.exit_code == 0, r.output
        r = runner.invoke(main, ["run", str(MLP), "--random-inputs", "--backend", backend, "--no-update",
                                 "-o", str(fwd)])
        assert r.exit_code == 0, r.output
        with np.load(full) as a, np.load(fwd) as b:
            assert sorted(b.files) == ["correct", "loss", "probs"]
            assert set(a.files) > set(b.files)
            for k in b.files:
                np.testing.assert_allclose(b[k], a[k], rtol=1e-6, atol=1e-7, err_msg=k)
