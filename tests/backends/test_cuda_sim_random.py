"""Random draws (`rand`, `randn`, `dropout`: Philox 4x32-10, tgc/ir/philox.py) on the
CUDA backend, run by cuda-sim: the same bits as the IR interpreter and the CPU backend
(f32, f64, --fp-strict, negative keys, folds, renamed draws, a dropout training step),
and the module's draw functions compile with nvcc for sm_90 without warnings.
cuda-sim needs g++ (skipped without it); the nvcc check is skipped without nvcc."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.frontend import compile_source
from tgc.ir.interp import evaluate
from tgc.options import Options

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from test_random import DRAWS, FOLD_BY_INPUT, TRAIN, _optimized  # noqa: E402  (the CPU tests' programs)

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="cuda-sim needs g++ with OpenMP")


def _inputs(key: int, dtype: str) -> dict:
    rng = np.random.default_rng(key & 0xFF)
    fp = dtype.replace("f", "float")
    return {"key": np.int32(key), "x": rng.standard_normal((37, 29)).astype(fp), "x2": np.zeros(37, fp)}


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("key", [0, 12345, -7])
def test_cuda_sim_draws_are_the_interpreters_and_cpus_bit_for_bit(dtype, key):
    opts = Options(dtype=dtype)
    m = pipeline.lower(compile_source(DRAWS, "<draws>", opts), opts).module
    want = evaluate(m, _inputs(key, dtype), dtype=dtype)
    cpu = tgc.compile(DRAWS, dtype=dtype)(**_inputs(key, dtype))
    got = tgc.compile(DRAWS, dtype=dtype, backend="cuda-sim")(**_inputs(key, dtype))
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        np.testing.assert_array_equal(got[k], cpu[k], err_msg=k)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_cuda_sim_fold_by_an_i32_input(dtype):
    """fold(key, n) with n an i32 input: a parameter of the draw's device function."""
    opts = Options(dtype=dtype)
    m = pipeline.lower(compile_source(FOLD_BY_INPUT, "<folds>", opts), opts).module
    x = np.random.default_rng(1).standard_normal((37, 5)).astype(dtype.replace("f", "float"))
    program = tgc.compile(FOLD_BY_INPUT, dtype=dtype, backend="cuda-sim")
    for step in (4, 0, -5, 2 ** 31 - 1):
        inputs = {"key": np.int32(3), "step": np.int32(step), "x": x}
        want = evaluate(m, dict(inputs), dtype=dtype)
        got = program(**inputs)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{k}, step {step}")


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_cuda_sim_fp_strict_draws(dtype):
    src = "dim i = 300, j = 7\ninput key: i32\nout u = rand[i, j](key)\nout z = randn[j, i](fold(key, 9))\n"
    want = evaluate(compile_source(src, "t.tg", Options(dtype=dtype)), {"key": 99})
    got = tgc.compile(src, dtype=dtype, backend="cuda-sim",
                      options=Options(dtype=dtype, fp_strict=True))(key=np.int32(99))
    for k in want:
        assert got[k].dtype == want[k].dtype
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_cuda_sim_dropout_training_step():
    """The dropout MLP's training step: each step's key draws new masks; loss and
    updated params follow the interpreter's (sums in another order: to rounding)."""
    rng = np.random.default_rng(2)
    arrays = dict(x=rng.standard_normal((32, 5)), y=np.eye(3)[rng.integers(0, 3, 32)],
                  W1=0.3 * rng.standard_normal((5, 16)), b1=np.zeros(16), W2=0.3 * rng.standard_normal((16, 3)),
                  b2=np.zeros(3), lr=0.1)
    step = tgc.compile(TRAIN, dtype="f64", backend="cuda-sim")
    m = _optimized(TRAIN)
    losses = []
    for it in range(6):
        want = evaluate(m, {**arrays, "key": it}, dtype="f64")
        got = step(**arrays, key=np.int32(it))
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-10)
        np.testing.assert_allclose(arrays["W1"], want["W1"], rtol=1e-9, atol=1e-12)
        losses.append(float(got["loss"]))
    assert len(set(losses)) == len(losses)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (the CUDA toolkit) is not installed")
@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("src", [DRAWS, FOLD_BY_INPUT], ids=["draws", "fold_by_input"])
def test_draw_functions_compile_for_sm90_without_warnings(dtype, src, tmp_path):
    from tgc.backends.cuda import codegen
    from tgc.backends.cuda.runtime import lower

    opts = Options(dtype=dtype)
    m = pipeline.lower(compile_source(src, "<draws>", opts), opts).module
    source = codegen.generate(lower(m, opts)).source
    assert source.count("__dmul_rn(") > 20   # float products spelled so that nvcc cannot fuse them
    cu = tmp_path / "draws.cu"
    cu.write_text(source)
    done = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "--Werror", "all-warnings", "-o",
                           str(tmp_path / "draws.cubin"), str(cu)], capture_output=True, text=True)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr[-3000:]
