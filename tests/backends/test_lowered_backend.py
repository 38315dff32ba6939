"""The `lowered` backend (tgc/backends/lowered): the lowered-program interpreter behind
the `Backend` interface. A program compiled for it gives the bits of
`tgc.lower.interp.run_lowered` on the same lowered program, with its buffers bound by
the neutral runtime: updates written in place, symbolic dims bound per call, complex
and bf16 arguments, gather ids out of range refused before anything is written, and
another backend's lowered program (`Options.stages`: the CPU's loop groups) run
through its kernels' own `interpret` hooks."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import tgc
from tgc import pipeline
from tgc.cli import main
from tgc.ir.interp import EvalError
from tgc.lower.interp import run_lowered

ROOT = Path(__file__).resolve().parents[2]
MLP = str(ROOT / "examples" / "mlp.tg")


def _mlp_arrays(batch: int, dtype=np.float32) -> dict:
    rng = np.random.default_rng(batch)
    return {"x": rng.standard_normal((batch, 13)).astype(dtype),
            "y": np.eye(3, dtype=dtype)[rng.integers(0, 3, batch)],
            "W1": (0.3 * rng.standard_normal((13, 64))).astype(dtype), "b1": np.zeros(64, dtype),
            "W2": (0.3 * rng.standard_normal((64, 3))).astype(dtype), "b2": np.zeros(3, dtype), "lr": 0.1}


def _copy(arrays: dict) -> dict:
    return {k: np.copy(v) for k, v in arrays.items()}


def _same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, w in want.items():
        np.testing.assert_array_equal(np.asarray(got[k]), w, err_msg=k)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_a_call_gives_the_interpreters_bits_and_updates_in_place(dtype):
    program = tgc.compile(MLP, backend="lowered", dtype=dtype)
    assert program.backend == "lowered"
    assert pipeline.lowering("lowered") == ("fuse", "layout", "plan")
    np_t = np.float32 if dtype == "f32" else np.float64
    for batch in (4, 7):   # the symbolic batch, bound at each call
        given = _mlp_arrays(batch, np_t)
        want = run_lowered(program.lowered, _copy(given))
        before = np.copy(given["W1"])
        got = program(**given)
        _same(got, want)
        assert got["W1"] is given["W1"] and not np.array_equal(given["W1"], before)


def test_gather_ids_out_of_range_are_refused_and_nothing_is_written():
    program = tgc.compile("dim n = 3, v = 5\ninput k: i32[n]\nparam E[v]\nout y[n] = E[v = k]\n"
                          "update E = E * 2\n", backend="lowered")
    E = np.arange(5, dtype=np.float32)
    with pytest.raises(EvalError, match=r"gather index out of range: 'k'\[n=1\] = 5.*nothing was written"):
        program(k=np.array([0, 5, 1], np.int32), E=E)
    np.testing.assert_array_equal(E, np.arange(5))
    got = program(k=np.array([4, 0, 2], np.int32), E=E)
    np.testing.assert_array_equal(got["y"], [4, 0, 2])
    np.testing.assert_array_equal(E, 2 * np.arange(5))


def test_complex_and_bf16_arguments():
    program = tgc.compile("dim n = 4\nparam z: c64[n]\ninput w: c64[n]\nparam h: bf16[n]\n"
                          "out p = z * w\nout q = sum[n](h * h)\nupdate z = z * 1j\nupdate h = h * 3\n",
                          backend="lowered")
    z = np.array([1 + 2j, -1j, 3, 0.5 + 0.5j], np.complex64)
    w = np.array([2, 1j, -1 + 1j, 4], np.complex64)
    h = np.array([1.0, 2.0, -1.5, 0.25], np.float32)
    import ml_dtypes

    hb = h.astype(ml_dtypes.bfloat16)
    z0 = np.copy(z)
    got = program(z=z, w=w, h=hb)
    np.testing.assert_allclose(got["p"], z0 * w, rtol=1e-6)
    np.testing.assert_allclose(z, z0 * 1j, rtol=1e-6)
    assert float(got["q"]) == float(np.sum(h * h))
    np.testing.assert_array_equal(hb.astype(np.float32), 3 * h)


def test_another_backends_stages_run_through_options_stages():
    """`Options(stages=lowering("cpu"))`: the CPU's lowered program (loop groups,
    which the interpreter runs through their own `interpret` hook), as the fuzz
    harness's `lowered-f64` runs it."""
    options = tgc.Options(stages=pipeline.lowering("cpu"))
    program = tgc.compile(MLP, backend="lowered", options=options)
    assert any(type(k).__name__ == "LoopGroup" for k in program.lowered.kernels)
    given = _mlp_arrays(6)
    want = run_lowered(program.lowered, _copy(given))
    _same(program(**given), want)


def test_tgc_run_with_the_lowered_backend_gives_the_interpreters_values(tmp_path):
    np.savez(tmp_path / "in.npz", **_mlp_arrays(4))
    outs = {}
    for backend in ("lowered", "interp"):
        out = tmp_path / f"{backend}.npz"
        r = CliRunner().invoke(main, ["run", MLP, "--inputs", str(tmp_path / "in.npz"), "--backend", backend,
                                      "-o", str(out)])
        assert r.exit_code == 0, r.output
        outs[backend] = dict(np.load(out))
    assert set(outs["lowered"]) == set(outs["interp"]) >= {"loss", "probs", "W1", "b2"}
    for k, v in outs["interp"].items():
        np.testing.assert_allclose(outs["lowered"][k], v, rtol=2e-5, atol=1e-6, err_msg=k)
    program = tgc.compile(MLP, backend="lowered")
    _same({k: outs["lowered"][k] for k in ("loss", "probs", "W1", "b2")},
          {k: v for k, v in program(**_copy(dict(np.load(tmp_path / "in.npz")))).items()
           if k in ("loss", "probs", "W1", "b2")})
