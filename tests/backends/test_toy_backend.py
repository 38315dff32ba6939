"""A backend is its folder: the toy backend (tests/backends/plugins/toy, outside tgc/)
becomes visible by adding its parent folder to `tgc.backends.__path__` and calling
`tgc.backends.base.refresh()`, and nothing else changes: `tgc.compile(...,
backend="toy")` and `tgc run --backend toy` run its code, `backend_names()` lists it,
and the tests parametrized over the registered backends (`backends_util`) run it when
pytest is given `--backends-from tests/backends/plugins`."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import tgc
import tgc.backends
from tgc.backends.base import backend_names, get_backend, refresh
from tgc.cli import main

import backends_util

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = str(Path(__file__).resolve().parent / "plugins")
MLP = str(ROOT / "examples" / "mlp.tg")


@pytest.fixture
def toy():
    """The toy backend registered for one test, and forgotten after it."""
    tgc.backends.__path__.append(PLUGINS)
    refresh()
    try:
        yield get_backend("toy")
    finally:
        tgc.backends.__path__.remove(PLUGINS)
        refresh()


def _mlp_arrays(batch: int = 5) -> dict:
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((batch, 13), dtype=np.float32),
            "y": np.eye(3, dtype=np.float32)[rng.integers(0, 3, batch)],
            "W1": 0.3 * rng.standard_normal((13, 64), dtype=np.float32), "b1": np.zeros(64, np.float32),
            "W2": 0.3 * rng.standard_normal((64, 3), dtype=np.float32), "b2": np.zeros(3, np.float32), "lr": 0.1}


def test_the_toy_folder_registers_a_backend_and_compile_runs_its_code(toy):
    assert "toy" in backend_names() and "toy" in backends_util.backends()
    assert toy.name == "toy" and toy.lowering() == ("fuse", "layout", "narrow", "plan")
    program = tgc.compile(MLP, backend="toy")
    assert program.backend == "toy" and program.toy_calls == 0
    given, ref = _mlp_arrays(), _mlp_arrays()
    got = program(**given)
    assert program.toy_calls == 1
    want = tgc.compile(MLP, backend="lowered")(**ref)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    np.testing.assert_array_equal(given["W1"], ref["W1"])   # updated in place, as on every backend


def test_the_toy_backends_own_stage_stores_bf16_in_two_bytes(toy):
    """Its stage (`narrow`) puts the bf16 param and output in 2-byte buffers: the
    runtime passes them as bfloat16 arrays, and the values are the `lowered`
    backend's (which holds them in floats), bit for bit."""
    import ml_dtypes

    src = "dim n = 4, m = 3\nparam h: bf16[n, m]\ninput x[n]\nout q[m] = sum[n](h * x)\nout r = h * h\n" \
          "update h = h * 3\n"
    program, plain = tgc.compile(src, backend="toy"), tgc.compile(src, backend="lowered")
    assert program.lowered.buffers["h"].dtype == "bf16" and plain.lowered.buffers["h"].dtype == "f32"
    assert program.element_dtype(program.inputs[0]) == np.dtype(ml_dtypes.bfloat16)
    h = (np.arange(12, dtype=np.float32).reshape(4, 3) - 5.5).astype(ml_dtypes.bfloat16)
    x = np.linspace(-1, 1, 4, dtype=np.float32)
    mine, theirs = np.copy(h), np.copy(h)
    got, want = program(h=mine, x=x), plain(h=theirs, x=x)
    assert program.toy_calls == 1 and got["r"].dtype == np.dtype(ml_dtypes.bfloat16)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k], np.float32), np.asarray(want[k], np.float32), err_msg=k)
    np.testing.assert_array_equal(mine.astype(np.float32), 3 * h.astype(np.float32))


def test_tgc_run_takes_the_toy_backend(toy, tmp_path):
    outs = {}
    for backend in ("toy", "lowered"):
        out = tmp_path / f"{backend}.npz"
        r = CliRunner().invoke(main, ["run", MLP, "--random-inputs", "--backend", backend, "-o", str(out)])
        assert r.exit_code == 0, r.output
        outs[backend] = dict(np.load(out))
    assert set(outs["toy"]) == set(outs["lowered"]) >= {"loss", "W1"}
    for k, v in outs["lowered"].items():
        np.testing.assert_array_equal(outs["toy"][k], v, err_msg=k)


def test_the_toy_backend_is_gone_with_its_folder():
    assert "toy" not in backend_names()
    with pytest.raises(ValueError, match="backend 'toy' is not available"):
        get_backend("toy")


def test_the_tests_parametrized_over_the_backends_run_it():
    """`pytest --backends-from tests/backends/plugins`: the notification tests,
    parametrized over the registered backends, run on the toy too, and pass."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--backends-from", PLUGINS,
                        str(ROOT / "tests" / "runtime" / "test_notify.py"), "-k", "toy", "-rA"],
                       capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    passed = [line for line in r.stdout.splitlines() if line.startswith("PASSED") and "[toy]" in line]
    assert len(passed) >= 4, r.stdout
