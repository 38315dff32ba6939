"""Derived gradients of every prelude function, through `.tg` source, in float64.

Each program is `f = sum(sin(F(...)))` for one prelude function F (the outer sin
makes the cotangent non-uniform); for every float input x it outputs grad(f, x),
jvp(f, x, d_x) and the Hessian-vector product grad(grad(f, x) @ u_x, x), all
checked against central finite differences of `f` and of the gradient.
"""
import numpy as np
import pytest

import tgc.frontend
from tgc.ir.interp import evaluate
from tgc.ir.verify import verify
from tgc.options import Options
from tgc.manager import run_pipeline
from passes_util import central_difference, run_f64 as run

if not hasattr(tgc.frontend, "compile_source"):
    pytest.skip("tgc.frontend has no compile_source yet: prelude gradients cannot be compiled",
                allow_module_level=True)

H = 1e-6
X = [("x", "rows, cls")]
XT = [("x", "rows, cls"), ("t", "rows, cls")]

CASES = {  # name: (differentiated inputs with their edges, the expression)
    "relu": (X, "relu(x)"),
    "sigmoid": (X, "sigmoid(x)"),
    "softplus": (X, "softplus(x)"),
    "gelu": (X, "gelu(x)"),
    "gelu_erf": (X, "gelu_erf(x)"),
    "silu": (X, "silu(x)"),
    "dot": (XT, "dot[cls](x, t)"),
    "logsumexp": (X, "logsumexp[cls](x)"),
    "softmax": (X, "softmax[cls](x)"),
    "log_softmax": (X, "log_softmax[cls](x)"),
    "layernorm": ([("x", "rows, cls"), ("w", "cls"), ("b", "cls")], "layernorm[cls](x, w, b)"),
    "rmsnorm": ([("x", "rows, cls"), ("w", "cls")], "rmsnorm[cls](x, w)"),
    "cross_entropy": (XT, "cross_entropy[cls](x, t)"),
    "mse": (XT, "mse(x, t)"),
    "attention": ([("q", "rows, feat"), ("k", "keys, feat"), ("v", "keys, cls")], "attention[keys, feat](q, k, v)"),
    "dropout": (X, "dropout[rows, cls](x, key, 0.3)"),   # the key (an i32 input) is held fixed
}


def source(wrt, expr):
    lines = ["dim rows = 3, cls = 4, keys = 5, feat = 2"] + (["input key: i32"] if "key" in expr else [])
    for x, edges in wrt:
        lines += [f"input {x}[{edges}]", f"input d_{x}[{edges}]", f"input u_{x}[{edges}]"]
    lines += [f"f = sum(sin({expr}))", "out f"]
    for x, edges in wrt:
        lines += [f"g_{x} = grad(f, {x})", f"out g_{x}[{edges}]", f"out t_{x} = jvp(f, {x}, d_{x})",
                  f"out h_{x}[{edges}] = grad(g_{x} @ u_{x}, {x})"]
    return "\n".join(lines) + "\n"


def compile_program(text, name):
    options = Options(dtype="f64")
    m = tgc.frontend.compile_source(text, f"{name}.tg", options)
    m = run_pipeline(m, options.with_(passes=("normalize", "adjoint", "tangent"))).module
    verify(m, derivatives=False)
    return m


def inputs_for(m, seed):
    rng = np.random.default_rng(seed)
    sizes = {e: int(m.dims[d]) for e, d in m.edges.items()}
    return {a.name: rng.standard_normal(tuple(sizes[e] for e in a.order)) if a.dtype != "i32"
            else np.int32(rng.integers(-2 ** 31, 2 ** 31)) for a in m.args.values()}


def fd(m, inputs, out, x, d):
    """Central difference of output `out` when input `x` moves along `d`."""
    return central_difference(m, inputs, out, x, d, H)


def test_every_prelude_function_is_covered():
    import pathlib
    import re

    prelude = pathlib.Path(tgc.frontend.__file__).with_name("prelude.tg").read_text()
    assert set(re.findall(r"^fn (\w+)", prelude, re.M)) == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_prelude_function_derivatives(name):
    wrt, expr = CASES[name]
    m = compile_program(source(wrt, expr), name)
    ins = inputs_for(m, seed=sorted(CASES).index(name))
    got = run(m, ins)
    for x, _ in wrt:
        grad = np.zeros_like(ins[x])
        for idx in np.ndindex(grad.shape):
            e = np.zeros_like(grad)
            e[idx] = 1.0
            grad[idx] = fd(m, ins, "f", x, e)
        np.testing.assert_allclose(got[f"g_{x}"], grad, rtol=1e-5, atol=1e-7, err_msg=f"{name}: grad {x}")
        np.testing.assert_allclose(got[f"t_{x}"], fd(m, ins, "f", x, ins[f"d_{x}"]), rtol=1e-5, atol=1e-7,
                                   err_msg=f"{name}: jvp {x}")
        np.testing.assert_allclose(got[f"h_{x}"], fd(m, ins, f"g_{x}", x, ins[f"u_{x}"]), rtol=1e-4, atol=1e-6,
                                   err_msg=f"{name}: Hessian-vector product {x}")
