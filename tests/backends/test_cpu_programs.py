"""The CPU backend against the reference interpreter on whole programs: every
example, every corpus program, and every prelude function with its derivatives."""
from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.ir.interp import evaluate
from tgc.ir.inputs import random_inputs
from tgc.options import Options

from marks import heavy, sized_by_themselves

ROOT = Path(__file__).parent.parent.parent
PROGRAMS = sized_by_themselves(sorted((ROOT / "examples").glob("*.tg"))) + sorted((ROOT / "tests/programs/good").glob("*.tg"))
F32_RTOL, F32_ATOL = 2e-4, 2e-5  # relative to each output's scale; f32 sums accumulate in f32


def compare(module, dtype, seed=0, dims=None):
    dims = {d: 5 for d in module.symbolic_dims()} if dims is None else dims
    inputs = random_inputs(module, module.bind_dims(dims), seed, dtype)
    want = evaluate(module, {k: v.copy() for k, v in inputs.items()}, dtype="f64", dims=dims)
    prog = tgc.compile(module, dtype=dtype)
    got = prog.run({k: v.copy() for k, v in inputs.items()}, dims)
    assert set(got) == set(want)
    for name, ref in want.items():
        scale = max(1.0, float(np.nanmax(np.abs(ref)))) if ref.size else 1.0
        if dtype == "f64":
            np.testing.assert_allclose(got[name], ref, rtol=1e-9, atol=1e-9 * scale, err_msg=name)
        else:
            np.testing.assert_allclose(got[name], ref, rtol=F32_RTOL, atol=F32_ATOL * scale, err_msg=name)


@pytest.mark.parametrize("dtype", ["f64", "f32"])
@pytest.mark.parametrize("path", heavy(PROGRAMS), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_program_matches_interpreter(path, dtype):
    options = Options(dtype=dtype)
    module = pipeline.lower(pipeline.load(str(path), options), options).module
    compare(module, dtype)


PRELUDE_CALLS = {
    "relu": "relu(x)", "sigmoid": "sigmoid(x)", "softplus": "softplus(x)", "gelu": "gelu(x)",
    "gelu_erf": "gelu_erf(x)", "silu": "silu(x)", "dot": "dot[c](x, w)", "logsumexp": "logsumexp[c](x)",
    "softmax": "softmax[c](x)", "log_softmax": "log_softmax[c](x)", "layernorm": "layernorm[c](x, w, b)",
    "rmsnorm": "rmsnorm[c](x, w)", "cross_entropy": "cross_entropy[c](x, softmax[c](y))",
    "mse": "mse(x, y)", "attention": "attention[s, c](x, k, v)",
}


@pytest.mark.parametrize("fn", sorted(PRELUDE_CALLS))
def test_prelude_function_and_its_derivatives(fn):
    src = f"""dim r, c = 6, s = 4
input x[r, c], y[r, c], w[c], b[c], k[s, c], v[s, c], u[r, c]
f = {PRELUDE_CALLS[fn]}
out f
out g = grad(sum(f * f), x)
out t = jvp(f, x, u)
"""
    options = Options(dtype="f64")
    from tgc.frontend import compile_source

    module = pipeline.lower(compile_source(src, f"{fn}.tg", options), options).module
    compare(module, "f64", seed=3)


@pytest.mark.parametrize("r", [0, 1, 3])
def test_an_update_copying_a_scalar_param(r):
    # `update m = W` with a scalar W, and m a scalar or a vector: a copy of a scalar,
    # which the implicit-GEMM stage took for a window of its source's last axis
    # (IndexError; found by scripts/fuzz, seeds 777025 and 777126)
    src = f"dim r = {r}\nstate m[r]\n" if r else "param m\n"
    prog = tgc.compile(src + "param W\nupdate m = W\n")
    m = np.zeros(r or (), np.float32)
    prog(m=m, W=np.float32(0.25))
    np.testing.assert_array_equal(m, np.full(r or (), 0.25, np.float32))
