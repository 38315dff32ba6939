"""The one definition of every op and elementwise function (`tgc.ir.ops`) and what
reads it: every function has a template in every backend (or is removed before
backends, or is listed as not built there yet), the views other modules keep are
derived from it, and `log1p`/`expm1` — added as one entry, a derivative rule and a
template per backend — compute numpy's values at tiny and large arguments in f32 and
f64 on the IR interpreter, the lowered program's interpreter, the CPU backend and
cuda-sim, with derivatives that match finite differences."""
from __future__ import annotations

import re
import shutil

import numpy as np
import pytest

import tgc
from tgc.backends.cpu import elementwise, vecmath
from tgc.backends.cuda import codegen as cuda_codegen
from tgc.frontend import compile_source
from tgc.ir import interp, ops
from tgc.ir import values as V
from tgc.ir.diag import CompileError
from tgc.ir.interp import evaluate
from tgc.ir.parser import parse_module
from tgc.ir.printer import print_module
from tgc.lower import interp as lowered_interp
from tgc.options import Options
from tgc.opt.facts import NONNEG, POS, Facts

CUH = cuda_codegen.header()


# ---------------------------------------------------------------- the tables


def test_every_function_has_a_template_in_every_backend():
    need = set(ops.backend_fns())
    assert need and not {f.name for f in ops.FNS.values() if f.lowered_by} & need
    cpu = set(ops.VECMATH) | set(elementwise.EMITTERS)
    assert need <= cpu, f"no CPU template: {sorted(need - cpu)}"
    cuda = set(cuda_codegen.TEMPLATES) | set(cuda_codegen.NOT_YET)
    assert need <= cuda, f"no CUDA template: {sorted(need - cuda)}"
    # no template for a function the IR does not have, none twice
    for table in (elementwise.EMITTERS, cuda_codegen.TEMPLATES, cuda_codegen.NOT_YET):
        assert set(table) <= set(ops.FNS)
    assert not set(ops.VECMATH) & set(elementwise.EMITTERS)
    assert not set(cuda_codegen.TEMPLATES) & set(cuda_codegen.NOT_YET)


def test_cpu_vector_math_hint_is_what_vecmath_implements():
    assert set(ops.VECMATH) == set(vecmath.NAMES)


def test_math_library_functions_are_written_into_the_header_from_the_table():
    raw = cuda_codegen.HEADER.read_text()
    for f in ops.FNS.values():
        if f.libm:
            params = ", ".join(f"double {p}" for p in "xyz"[:f.arity])
            assert f"TGC_DEV double tgc_{f.name}({params}) {{ return {f.libm}(" in CUH, f.name
            assert f"TGC_DEV float tgc_{f.name}(" in CUH and f"{f.libm}f(" in CUH, f.name
            assert not re.search(rf"tgc_{f.name}\((float|double|T) ", raw), f"{f.name}: defined in tgc_ops.cuh too"
    assert cuda_codegen.LIBM_MARK not in CUH


def test_cuda_templates_call_functions_the_header_defines_with_the_right_arity():
    for fn, template in cuda_codegen.TEMPLATES.items():
        called = re.match(r"(\w+)\(", template).group(1)
        assert re.search(rf"\b{called}\(", CUH), f"{fn}: {called} is not in tgc_ops.cuh"
        assert set(re.findall(r"\{(\d)\}", template)) == {str(i) for i in range(ops.FNS[fn].arity)}, fn


def test_derived_views_agree_with_the_table():
    assert V.MAP_ARITY == {n: f.arity for n, f in ops.FNS.items()}
    assert interp.MAP_FNS is ops.NUMPY and lowered_interp.MAP_FNS is ops.NUMPY
    assert ops.EXPENSIVE >= {"exp", "log", "tanh", "erf", "sin", "cos", "pow", "log1p", "expm1"}
    assert ops.LIGHT == {"sqrt", "div"}
    assert ops.IDENTITY_FNS == {"checkpoint", "recompute"}
    for f in ops.FNS.values():
        assert f.cost in ops.COSTS and f.finite in ops.FINITE and f.sign in ops.SIGN
        assert callable(f.numpy)


def test_the_language_calls_the_surface_functions_by_name():
    from tgc.frontend.builtins import ARITY
    from tgc.frontend.scope import PRIMITIVES

    for fn in ops.SURFACE_UNARY:
        assert fn in PRIMITIVES and ARITY[fn] == (1,)
    with pytest.raises(CompileError, match="'log1p' is a built-in function"):
        compile_source("fn log1p(x) = x\ninput x\nout y = log1p(x)\n")
    with pytest.raises(CompileError, match="'expm1' takes 1 argument"):
        compile_source("input x\nout y = expm1(x, x)\n")


def test_every_op_round_trips_through_the_text_form():
    text = """\
dim n = 3
input x : f64[n]

%0 = map[log1p] %x : f64[n]
%1 = map[expm1] %0 : f64[n]
%2 = reduce[max: n] %1 : f64[]
%3 = add[1.0, -2.0] %1, %2 : f64[n]

out y = %3 : [n]
"""
    m = parse_module(text)
    assert print_module(m) == text
    assert set(ops.OPS) >= set(V.BUILDERS) | {"arg", "const", "size", "indicator", "slot", "fold"}


def test_facts_of_log1p_and_expm1():
    pos = V.arg("p", "f64", ())
    facts = Facts({"p": (POS, 3.0)})
    unknown = V.arg("u", "f64", ())
    l1p, em1 = V.map_("log1p", pos), V.map_("expm1", pos)
    assert facts.finite(l1p) and facts.sign(l1p) == POS and facts.upper(l1p) == pytest.approx(np.log1p(3.0))
    assert facts.finite(em1) and facts.sign(em1) == POS and facts.upper(em1) == pytest.approx(np.expm1(3.0))
    # log1p of a value of unknown sign may be NaN (x < -1) or -inf (x = -1)
    assert not facts.finite(V.map_("log1p", unknown)) and facts.sign(V.map_("log1p", unknown)) is None
    # expm1 overflows like exp: finite only below the overflow
    assert not facts.finite(V.map_("expm1", unknown))
    big = V.mul([V.const(1000.0, "f64"), pos])
    assert not facts.finite(V.map_("expm1", big))
    assert facts.sign(V.map_("expm1", V.map_("abs", unknown))) == NONNEG


# ---------------------------------------------------------------- log1p and expm1, end to end

SOURCE = """\
dim n
input x[n]
input y[n]
a = log1p(x)
b = expm1(y)
out a
out b
out ga = grad(sum(a), x)
out gb = grad(sum(b), y)
"""
TINY = [1e-30, -1e-30, 1e-20, 1e-10, -1e-10, 3e-8, -3e-8, 1e-6, -1e-5, 0.0, -0.0]
X = np.array(TINY + [1e-3, -0.5, -0.999, 0.5, 2.0, 1e3, 1e6, 1e30, -1.0, -2.0, np.inf])
Y = {"f64": np.array(TINY + [1e-3, -0.5, 0.5, 2.0, -30.0, -50.0, -800.0, 30.0, 700.0, 710.0, -np.inf]),
     "f32": np.array(TINY + [1e-3, -0.5, 0.5, 2.0, -30.0, -50.0, -110.0, 30.0, 88.0, 89.0, -np.inf])}


def _want(dtype):
    t = np.float32 if dtype == "f32" else np.float64
    x, y = X.astype(t), Y[dtype].astype(t)
    with np.errstate(all="ignore"):
        return {"a": np.log1p(x.astype(np.float64)), "b": np.expm1(y.astype(np.float64)),
                "ga": 1 / (1 + x.astype(np.float64)), "gb": np.exp(y.astype(np.float64))}, {"x": x, "y": y}


def _check(got, dtype, tol_ulps):
    want, _ = _want(dtype)
    t = np.float32 if dtype == "f32" else np.float64
    for k, w in want.items():
        g = np.asarray(got[k], dtype=np.float64)
        with np.errstate(over="ignore"):
            wr = w.astype(t).astype(np.float64)
        special = ~np.isfinite(wr)
        np.testing.assert_array_equal(g[special], wr[special], err_msg=k)
        ok = ~special
        ulp = np.spacing(np.abs(wr[ok]).astype(t)).astype(np.float64)
        err = np.abs(g[ok] - w[ok]) / ulp
        assert err.max() <= tol_ulps, (k, dtype, err.max(), int(np.argmax(err)))
        zero = ok & (w == 0)
        np.testing.assert_array_equal(np.signbit(g[zero]), np.signbit(wr[zero]), err_msg=f"{k}: sign of 0")


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_values_and_gradients_on_the_interpreters(dtype):
    from tgc import pipeline
    from tgc.pipeline import lower_module

    opts = Options(dtype=dtype)
    m = pipeline.lower(compile_source(SOURCE, "<log1p>", opts), opts).module   # differentiated
    _, inputs = _want(dtype)
    # numpy's own, each op rounded once (the gradient 1 / (1 + x) is two ops)
    _check(evaluate(m, dict(inputs), dtype=dtype), dtype, 1.0)
    _check(lowered_interp.run_lowered(lower_module(m, opts), dict(inputs)), dtype, 1.0)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_values_and_gradients_on_the_cpu(dtype):
    prog = tgc.compile(SOURCE, dtype=dtype)
    _, inputs = _want(dtype)
    _check(prog(**inputs), dtype, 3.0)   # vecmath: <= 2.5 ulp (tests/backends/test_cpu_vecmath.py)


@pytest.mark.skipif(shutil.which("g++") is None, reason="cuda-sim needs g++ with OpenMP")
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_values_and_gradients_on_cuda_sim(dtype):
    prog = tgc.compile(SOURCE, dtype=dtype, backend="cuda-sim")
    _, inputs = _want(dtype)
    _check(prog(**inputs), dtype, 3.0)   # libm's log1p/expm1 (CUDA's log1pf/expm1f on a GPU)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_gradients_match_finite_differences(dtype):
    """d/dx of sum(log1p(x) * expm1(x)) at ordinary points, against central differences
    of the compiled program's own forward value (in f64, where differences are exact
    enough; f32 compares with f64's)."""
    src = "dim n\ninput x[n]\nf = sum(log1p(x) * expm1(x))\nout f\nout g = grad(f, x)\n"
    x = np.array([-0.7, -0.1, 1e-4, 0.3, 1.5, 4.0])
    f64 = tgc.compile(src, dtype="f64")
    h = 1e-6
    fd = np.array([(f64(x=x + h * e)["f"] - f64(x=x - h * e)["f"]) / (2 * h) for e in np.eye(len(x))])
    got = tgc.compile(src, dtype=dtype)(x=x.astype(np.float32 if dtype == "f32" else np.float64))["g"]
    np.testing.assert_allclose(got, fd, rtol=1e-5 if dtype == "f32" else 1e-7, atol=1e-6)


def test_written_forms_lose_what_the_functions_keep():
    """The point of the two functions, in f32: log(1 + x) and exp(x) - 1 are 0 at x =
    1e-10; log1p and expm1 are x."""
    src = "dim n\ninput x[n]\nout a = log(1 + x)\nout b = exp(x) - 1\nout c = log1p(x)\nout d = expm1(x)\n"
    x = np.array([1e-10, -1e-9], np.float32)
    got = tgc.compile(src, dtype="f32")(x=x)
    assert np.all(got["a"] == 0) and np.all(got["b"] == 0)
    np.testing.assert_allclose(got["c"], x, rtol=1e-6)
    np.testing.assert_allclose(got["d"], x, rtol=1e-6)
