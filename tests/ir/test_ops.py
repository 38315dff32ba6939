"""The one definition of every op and elementwise function (`tgc.ir.ops`) and what
reads it: every function has a template in every backend (or is removed before
backends, or is listed as not built there yet), the views other modules keep are
derived from it, and the added functions — `log1p`/`expm1` (an entry, a derivative
rule and vector math) and `atan`/`asinh` (an entry with its math library spelling and a
derivative rule, nothing else) — compute numpy's values at tiny, large and negative
arguments in f32 and f64 on the IR interpreter, the lowered program's interpreter, the
CPU backend and cuda-sim, with derivatives that match finite differences."""
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
    assert ops.EXPENSIVE >= {"exp", "log", "tanh", "erf", "sin", "cos", "pow", "log1p", "expm1", "atan", "asinh"}
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
    # atan and asinh: odd, increasing, finite where their operand is
    for fn, f in (("atan", np.arctan), ("asinh", np.arcsinh)):
        assert facts.finite(V.map_(fn, pos)) and facts.sign(V.map_(fn, pos)) == POS
        assert facts.upper(V.map_(fn, pos)) == pytest.approx(f(3.0))
        assert facts.sign(V.map_(fn, V.map_("abs", unknown))) == NONNEG


# ---------------------------------------------------------------- added functions, end to end
# log1p and expm1 (vector math on the CPU); atan and asinh (the math library's on every
# backend: `Fn.libm`, one entry in tgc.ir.ops and a derivative rule each)

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
SOURCE_ATAN = """\
dim n
input x[n]
a = atan(x)
b = asinh(x)
out a
out b
out ga = grad(sum(a), x)
out gb = grad(sum(b), x)
"""
TINY = [1e-30, -1e-30, 1e-20, 1e-10, -1e-10, 3e-8, -3e-8, 1e-6, -1e-5, 0.0, -0.0]
X = np.array(TINY + [1e-3, -0.5, -0.999, 0.5, 2.0, 1e3, 1e6, 1e30, -1.0, -2.0, np.inf])
Y = {"f64": np.array(TINY + [1e-3, -0.5, 0.5, 2.0, -30.0, -50.0, -800.0, 30.0, 700.0, 710.0, -np.inf]),
     "f32": np.array(TINY + [1e-3, -0.5, 0.5, 2.0, -30.0, -50.0, -110.0, 30.0, 88.0, 89.0, -np.inf])}
# up to where x^2 (the derivatives' 1 + x^2) stays finite: 1e18 in f32, 1e150 in f64
Z = {"f64": np.array(TINY + [0.5, -0.5, 1.0, -1.0, 2.0, -3.0, 10.0, 1e3, -1e6, 1e18, -1e18, 1e30, -1e150,
                             np.inf, -np.inf]),
     "f32": np.array(TINY + [0.5, -0.5, 1.0, -1.0, 2.0, -3.0, 10.0, 1e3, -1e6, 1e12, -1e15, 1e18, -1e18,
                             np.inf, -np.inf])}
# case: (source, its inputs in a dtype, the outputs' exact values (f64) from those inputs,
# the tolerance in ulps on the interpreters (numpy's own, each op rounded once: a
# gradient of two to four ops) and on the backends (vecmath: <= 2.5 ulp,
# tests/backends/test_cpu_vecmath.py; libm and CUDA's math library: a few))
CASES = {
    "log1p_expm1": (SOURCE, lambda d: {"x": X, "y": Y[d]},
                    lambda x, y: {"a": np.log1p(x), "b": np.expm1(y), "ga": 1 / (1 + x), "gb": np.exp(y)}, 1.0, 3.0),
    "atan_asinh": (SOURCE_ATAN, lambda d: {"x": Z[d]},
                   lambda x: {"a": np.arctan(x), "b": np.arcsinh(x), "ga": 1 / (1 + x * x),
                              "gb": 1 / np.sqrt(1 + x * x)}, 2.0, 3.0),
}


def _want(case, dtype):
    source, args, exact, *_ = CASES[case]
    t = np.float32 if dtype == "f32" else np.float64
    inputs = {k: v.astype(t) for k, v in args(dtype).items()}
    with np.errstate(all="ignore"):
        return exact(**{k: v.astype(np.float64) for k, v in inputs.items()}), inputs


def _check(got, case, dtype, tol_ulps):
    want, _ = _want(case, dtype)
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


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_values_and_gradients_on_the_interpreters(case, dtype):
    from tgc import pipeline
    from tgc.pipeline import lower_module

    opts = Options(dtype=dtype)
    source, _, _, tol, _ = CASES[case]
    m = pipeline.lower(compile_source(source, f"<{case}>", opts), opts).module   # differentiated
    _, inputs = _want(case, dtype)
    _check(evaluate(m, dict(inputs), dtype=dtype), case, dtype, tol)
    _check(lowered_interp.run_lowered(lower_module(m, opts), dict(inputs)), case, dtype, tol)


def _check_compiled(case, dtype, backend):
    """`case` compiled for `backend` gives the exact values within the backends' tolerance."""
    source, _, _, _, tol = CASES[case]
    prog = tgc.compile(source, dtype=dtype, backend=backend)
    _, inputs = _want(case, dtype)
    _check(prog(**inputs), case, dtype, tol)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_values_and_gradients_on_the_cpu(case, dtype):
    _check_compiled(case, dtype, "cpu")


@pytest.mark.skipif(shutil.which("g++") is None, reason="cuda-sim needs g++ with OpenMP")
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_values_and_gradients_on_cuda_sim(case, dtype):
    _check_compiled(case, dtype, "cuda-sim")   # libm's (CUDA's log1pf, atanf, ... on a GPU)


@pytest.mark.skipif(shutil.which("cc") is None, reason="linking a shared library needs a C compiler (cc)")
def test_a_built_library_links_the_math_library(tmp_path):
    """`tgc build`'s .so calls libm's atanf/asinhf (the CPU's code for `Fn.libm`
    functions), links with -z defs, loads and computes them."""
    import ctypes

    from click.testing import CliRunner

    from tgc.cli.app import main

    src = tmp_path / "arc.tg"
    src.write_text("dim n\ninput x[n]\nout y = atan(x) + asinh(x)\n")
    r = CliRunner().invoke(main, ["build", str(src), "-o", str(tmp_path / "libarc.so"), "--blas=none"])
    assert r.exit_code == 0, r.output
    lib = ctypes.CDLL(str(tmp_path / "libarc.so"))
    assert lib.arc_init_default() == 0
    x = np.array([-1e6, -2.0, -1e-20, 0.0, 0.5, 3.0, 1e18], np.float32)
    y = np.zeros_like(x)
    dims = (ctypes.c_int64 * 1)(len(x))
    args, outs = (ctypes.c_void_p * 1)(x.ctypes.data), (ctypes.c_void_p * 1)(y.ctypes.data)
    lib.arc_workspace_bytes.restype = ctypes.c_int64
    ws = np.zeros(lib.arc_workspace_bytes(dims) + 64, np.uint8)
    assert lib.arc_run(dims, args, outs, ctypes.c_void_p(ws.ctypes.data + (-ws.ctypes.data) % 64)) == 0
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(y, np.arctan(x64) + np.arcsinh(x64), rtol=1e-6)


@pytest.mark.parametrize("f", ["log1p(x) * expm1(x)", "atan(x) * asinh(x)"])
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_gradients_match_finite_differences(f, dtype):
    """d/dx of sum(f(x)) at ordinary points, against central differences of the
    compiled program's own forward value (in f64, where differences are exact enough;
    f32 compares with f64's)."""
    src = f"dim n\ninput x[n]\nf = sum({f})\nout f\nout g = grad(f, x)\n"
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
