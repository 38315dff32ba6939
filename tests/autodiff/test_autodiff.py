"""Symbolic differentiation (the adjoint and tangent passes) against finite differences.

Programs are IR text; `check` adds, for each input differentiated, its gradient, a
jvp along a random direction and (when asked) a Hessian-vector product both ways,
runs the passes, and compares all with central differences in float64.
"""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tgc.ir import values as V
from tgc.ir.dtypes import CONVERSIONS, ROUNDINGS
from tgc.ir.interp import EvalError, evaluate
from tgc.ir.parser import parse_module
from tgc.ir.printer import print_module
from tgc.ir.verify import verify
from tgc.options import Options
from tgc.autodiff.rules import RULES
from tgc.manager import run_pipeline
from passes_util import central_difference, run_f64 as run

PIPELINE = Options(passes=("normalize", "adjoint", "tangent"))
H = 1e-6


def compile_ir(text):
    m = run_pipeline(parse_module(text), PIPELINE).module
    verify(m, derivatives=False)
    return m


def fd(m, inputs, out, x, d):
    """Central difference of output `out` when input `x` moves along `d`."""
    return central_difference(m, inputs, out, x, d, H)


def fd_grad(m, inputs, out, x):
    """d out / d x by central differences: shape x.shape + out.shape."""
    base = np.asarray(inputs[x], dtype=float)
    rows = []
    for idx in np.ndindex(base.shape):
        e = np.zeros_like(base)
        e[idx] = 1.0
        rows.append(fd(m, inputs, out, x, e))
    return np.array(rows).reshape(base.shape + np.shape(rows[0]))


def _decl(text, name):
    for line in text.splitlines():
        words = line.split()
        if len(words) > 1 and words[0] in ("input", "param", "state") and words[1] == name:
            dtype_edges = line.split(":", 1)[1].strip()
            return dtype_edges, dtype_edges[dtype_edges.index("[") + 1:-1]
    raise KeyError(name)


def derive(text, wrt, second=False):
    """`text` (defining scalar `%f`) plus grad/jvp (and Hessian-vector) values per input."""
    lines = text.strip().splitlines()
    head = [line for line in lines if line.split()[:1] in (["dim"], ["edge"], ["input"], ["param"], ["state"])]
    body = [line for line in lines if line not in head]
    decls, values, outs = [], [], ["out f = %f : []"]
    for x in wrt:
        typ, order = _decl(text, x)
        decls += [f"input d_{x} : {typ}", f"input u_{x} : {typ}"]
        values += [f"%g_{x} = grad %f, %{x} : {typ}", f"%t_{x} = jvp %f, %{x}, %d_{x} : f64[]"]
        outs += [f"out g_{x} = %g_{x} : [{order}]", f"out t_{x} = %t_{x} : []"]
        if second:
            values += [f"%gu_{x} = contract %g_{x}, %u_{x} : f64[]", f"%h_{x} = grad %gu_{x}, %{x} : {typ}",
                       f"%jh_{x} = jvp %g_{x}, %{x}, %u_{x} : {typ}"]
            outs += [f"out h_{x} = %h_{x} : [{order}]", f"out jh_{x} = %jh_{x} : [{order}]"]
    return "\n".join(head + decls + body + values + outs) + "\n"


def random_inputs(m, rng, overrides=None):
    """Standard normal floats of every input's shape, `overrides[name](shape)` where given."""
    sizes = {e: int(m.dims[d]) for e, d in m.edges.items()}
    out = {}
    for a in m.args.values():
        shape = tuple(sizes[e] for e in a.order)
        make = (overrides or {}).get(a.name)
        out[a.name] = make(shape, rng) if make else rng.standard_normal(shape)
    return out


def check(text, wrt, overrides=None, second=False, seed=0, rtol=1e-5, atol=1e-6):
    """Compile `derive(text)` and compare every derivative with finite differences."""
    m = compile_ir(derive(text, wrt, second))
    inputs = random_inputs(m, np.random.default_rng(seed), overrides)
    got = run(m, inputs)
    for x in wrt:
        np.testing.assert_allclose(got[f"g_{x}"], fd_grad(m, inputs, "f", x), rtol=rtol, atol=atol, err_msg=f"grad {x}")
        np.testing.assert_allclose(got[f"t_{x}"], fd(m, inputs, "f", x, inputs[f"d_{x}"]), rtol=rtol, atol=atol,
                                   err_msg=f"jvp {x}")
        if second:
            hv = fd(m, inputs, f"g_{x}", x, inputs[f"u_{x}"])
            np.testing.assert_allclose(got[f"h_{x}"], hv, rtol=1e-4, atol=1e-5, err_msg=f"grad of grad {x}")
            np.testing.assert_allclose(got[f"jh_{x}"], hv, rtol=1e-4, atol=1e-5, err_msg=f"jvp of grad {x}")
    return m, inputs, got


def positive(shape, rng):
    return rng.uniform(0.5, 2.0, shape)


def above_minus_one(shape, rng):
    return rng.uniform(-0.9, 2.0, shape)


def away_from_zero(shape, rng):
    return rng.choice([-1.0, 1.0], shape) * rng.uniform(0.3, 2.0, shape)


# ---- every map fn --------------------------------------------------------------------

UNARY = {  # fn: (domain of x, smooth enough for second order)
    "exp": (None, True), "log": (positive, True), "sqrt": (positive, True), "tanh": (None, True),
    "erf": (None, True), "sin": (None, True), "cos": (None, True), "abs": (away_from_zero, True),
    "sign": (away_from_zero, True), "sigmoid": (None, True), "softplus": (None, True),
    "checkpoint": (None, True), "recompute": (None, True),  # identities (autodiff/remat.py)
    "log1p": (above_minus_one, True), "expm1": (None, True), "atan": (None, True), "asinh": (None, True),
}
BINARY = {  # fn: (domain of x, domain of y)
    "div": (None, away_from_zero), "pow": (positive, None), "max": (None, None), "min": (None, None),
    "mul0": (away_from_zero, None), "mul00": (away_from_zero, away_from_zero), "lt": (None, None), "le": (None, None), "gt": (None, None),
    "ge": (None, None), "eq": (None, None), "ne": (None, None),
}


def test_every_map_fn_and_op_has_a_rule_and_a_test():
    # round32 is --fp-strict's f32 emulation, made after differentiation: no derivative;
    # the conversions (to_bf16 ..) and bf16/f16 roundings are tested in test_dtypes.py
    assert set(V.MAP_ARITY) == set(UNARY) | set(BINARY) | {"where", "round32"} | set(CONVERSIONS) | set(ROUNDINGS)
    ops = set(V.BUILDERS) | {"arg", "const", "size", "indicator"}
    assert ops - set(V.DERIVATIVE_OPS) - {"map"} <= set(RULES)
    assert set(V.MAP_ARITY) - {"round32"} <= set(RULES)


@pytest.mark.parametrize("fn", sorted(UNARY))
def test_unary(fn):
    domain, smooth = UNARY[fn]
    text = f"""
dim n = 5
input x : f64[n]
input w : f64[n]
%v = map[{fn}] %x : f64[n]
%f = contract %v, %w : f64[]
"""
    check(text, ["x"], {"x": domain}, second=smooth)


@pytest.mark.parametrize("fn", sorted(BINARY))
@pytest.mark.parametrize("y_edges", ["n, k", "k"], ids=["same", "broadcast"])
def test_binary(fn, y_edges):
    dx, dy = BINARY[fn]
    text = f"""
dim n = 3
dim k = 2
input x : f64[n, k]
input y : f64[{y_edges}]
input w : f64[n, k]
%v = map[{fn}] %x, %y : f64[k, n]
%f = contract %v, %w : f64[]
"""
    check(text, ["x", "y"], {"x": dx, "y": dy}, second=True)


def test_comparisons_and_sign_have_exactly_zero_derivative():
    text = """
dim n = 4
input x : f64[n]
input y : f64[n]
%a = map[lt] %x, %y : f64[n]
%b = map[sign] %x : f64[n]
%c = add[1.0, 1.0] %a, %b : f64[n]
%f = contract %c : f64[]
"""
    m, inputs, got = check(text, ["x", "y"])
    assert not got["g_x"].any() and not got["g_y"].any() and got["t_x"] == 0


def test_where():
    text = """
dim n = 6
input c : f64[n]
input x : f64[n]
input y : f64[]
input w : f64[n]
%s = map[sin] %x : f64[n]
%v = map[where] %c, %s, %y : f64[n]
%f = contract %v, %w : f64[]
"""
    check(text, ["x", "y"], {"c": lambda s, r: r.choice([0.0, 1.0, -2.0], s)}, second=True)
    m, inputs, got = check(text, ["c"], {"c": lambda s, r: r.choice([0.5, 1.0, -2.0], s)})
    assert not got["g_c"].any() and got["t_c"] == 0


@settings(max_examples=30, deadline=None)
@given(x=st.floats(-3, 3), fn=st.sampled_from(["exp", "tanh", "erf", "sin", "cos"]))
def test_unary_analytic(x, fn):
    """Hypothesis: the gradient equals the textbook derivative at any point."""
    text = f"""
input x : f64[]
%f = map[{fn}] %x : f64[]
%g = grad %f, %x : f64[]
out g = %g : []
"""
    want = {"exp": math.exp(x), "tanh": 1 - math.tanh(x) ** 2, "erf": 2 / math.sqrt(math.pi) * math.exp(-x * x),
            "sin": math.cos(x), "cos": -math.sin(x)}[fn]
    assert run(compile_ir(text), {"x": np.float64(x)})["g"] == pytest.approx(want, rel=1e-12, abs=1e-15)


# ---- the other primitives ----------------------------------------------------------------

def test_add_with_coefficients_and_broadcast():
    text = """
dim n = 3
dim k = 4
input x : f64[n, k]
input b : f64[k]
input s : f64[]
input w : f64[n, k]
%v = add[2.0, -0.5, 3.0] %x, %b, %s : f64[k, n]
%t = map[tanh] %v : f64[k, n]
%f = contract %t, %w : f64[]
"""
    check(text, ["x", "b", "s"], second=True)


def test_contract_matmul_outer_sum_and_broadcast():
    text = """
dim i = 3
dim j = 4
dim k = 2
input A : f64[i, j]
input B : f64[j, k]
input v : f64[k]
%ab = contract %A, %B : f64[i, k]
%o = contract %ab, %v : f64[i, j, k]
%t = map[sin] %o : f64[i, j, k]
%s = contract %t, %A : f64[k]
%f = contract %s, %s, %v : f64[]
"""
    check(text, ["A", "B", "v"], second=True)


def test_contract_of_repeated_operand():
    text = """
dim n = 4
input x : f64[n]
%c = contract %x, %x, %x : f64[n]
%f = contract %c, %x : f64[]
"""
    check(text, ["x"], second=True)


@pytest.mark.parametrize("kind", ["max", "min"])
def test_reduce(kind):
    text = f"""
dim n = 3
dim k = 5
input x : f64[n, k]
input w : f64[n]
%r = reduce[{kind}: k] %x : f64[n]
%e = map[exp] %r : f64[n]
%f = contract %e, %w : f64[]
"""
    check(text, ["x"], second=True)


def test_rename_and_transpose_product():
    text = """
dim n = 3
edge m : n
input A : f64[n, m]
%t = rename[m -> k, n -> m] %A : f64[k, m]
%k = rename[k -> n] %t : f64[m, n]
%p = contract %k, %A : f64[n, m]
%q = map[tanh] %p : f64[m, n]
%f = contract %q : f64[]
"""
    check(text.replace("edge m : n", "edge m : n\nedge k : n"), ["A"], second=True)


def test_const_and_size_have_no_cotangent():
    text = """
dim n = 4
input x : f64[n]
%c = const[2.5] : f64[n]
%s = size[n] : f64[]
%v = contract %x, %c, %s : f64[n]
%f = contract %v, %v : f64[]
"""
    m, inputs, got = check(text, ["x"])
    np.testing.assert_allclose(got["g_x"], 2 * 100 * inputs["x"])


def test_stop():
    text = """
dim n = 4
input x : f64[n]
%s = stop %x : f64[n]
%p = contract %s, %x : f64[]
%q = contract %s, %s : f64[]
%f = add[1.0, 1.0] %p, %q : f64[]
"""
    m = compile_ir(derive(text, ["x"]))
    x = np.arange(4.0)
    got = run(m, {"x": x, "d_x": np.ones(4), "u_x": np.ones(4)})
    np.testing.assert_array_equal(got["g_x"], x)  # d/dx sum(stop(x) x) = stop(x)
    assert got["t_x"] == x.sum()


def test_inactive_wrt_is_exactly_zero():
    text = """
dim n = 3
input x : f64[n]
input y : f64[n]
%f = contract %y, %y : f64[]
%g = grad %f, %x : f64[n]
%t = jvp %f, %x, %y : f64[]
out g = %g : [n]
out t = %t : []
"""
    got = run(compile_ir(text), {"x": np.ones(3), "y": np.ones(3)})
    assert not got["g"].any() and got["t"] == 0


def test_exactly_zero_tangent_flows_through_every_op():
    """0 * x has no tangent at all; the ops above it must cope (rename, gather, reduce)."""
    text = """
dim n = 3
edge m : n
input x : f64[n]
input ids : i32[n]
%zero = const[0.0] : f64[]
%z = contract %zero, %x : f64[n]
%r = rename[n -> m] %z : f64[m]
%g = gather[m] %r, %ids : f64[n]
%mx = reduce[max: n] %g : f64[]
%f = map[exp] %mx : f64[]
"""
    m = compile_ir(derive(text, ["x"]))
    got = run(m, {"x": np.ones(3), "ids": np.array([0, 2, 2], np.int32), "d_x": np.ones(3), "u_x": np.ones(3)})
    assert not got["g_x"].any() and got["t_x"] == 0


# ---- conventions: ties and NaN safety ------------------------------------------------------

def _grads(text, inputs):
    return run(compile_ir(derive(text, [k for k in inputs if k != "w"])),
               {**inputs, **{f"{p}_{k}": np.ones_like(v) for k, v in inputs.items() if k != "w" for p in "du"}})


@pytest.mark.parametrize("fn,first,second", [("max", 1.0, 0.0), ("min", 1.0, 0.0)])
def test_two_argument_ties_go_to_the_first(fn, first, second):
    text = f"""
dim n = 3
input x : f64[n]
input y : f64[n]
%v = map[{fn}] %x, %y : f64[n]
%f = contract %v : f64[]
"""
    x = np.array([1.0, -2.0, 0.0])
    got = _grads(text, {"x": x, "y": x.copy()})
    np.testing.assert_array_equal(got["g_x"], first)
    np.testing.assert_array_equal(got["g_y"], second)
    assert got["t_x"] == 3.0 and got["t_y"] == 0.0


def test_relu_at_zero_and_abs_at_zero():
    text = """
dim n = 3
input x : f64[n]
%z = const[0.0] : f64[]
%r = map[max] %z, %x : f64[n]
%a = map[abs] %x : f64[n]
%v = add[1.0, 1.0] %r, %a : f64[n]
%f = contract %v : f64[]
"""
    got = _grads(text, {"x": np.array([0.0, 2.0, -2.0])})
    np.testing.assert_array_equal(got["g_x"], [0.0, 2.0, -1.0])


@pytest.mark.parametrize("kind", ["max", "min"])
def test_reduce_ties_share_evenly(kind):
    text = f"""
dim n = 5
input x : f64[n]
input w : f64[]
%r = reduce[{kind}: n] %x : f64[]
%f = contract %r, %w : f64[]
"""
    x = np.array([1.0, 3.0, 3.0, 2.0, 3.0]) * (1 if kind == "max" else -1)
    got = _grads(text, {"x": x, "w": np.array(6.0)})
    np.testing.assert_array_equal(got["g_x"], [0.0, 2.0, 2.0, 0.0, 2.0])
    assert got["t_x"] == 6.0


@pytest.mark.parametrize("branch", ["sqrt", "log", "inv", "rsqrt"])
def test_untaken_where_branch_adds_exactly_zero(branch):
    make = {
        "sqrt": "%b = map[sqrt] %x : f64[n]",
        "log": "%b = map[log] %x : f64[n]",
        "inv": "%one = const[1.0] : f64[]\n%b = map[div] %one, %x : f64[n]",
        "rsqrt": "%e = const[-0.5] : f64[]\n%b = map[pow] %x, %e : f64[n]",
    }[branch]
    text = f"""
dim n = 3
input x : f64[n]
%zero = const[0.0] : f64[]
%c = map[gt] %x, %zero : f64[n]
{make}
%v = map[where] %c, %b, %zero : f64[n]
%f = contract %v : f64[]
"""
    got = _grads(text, {"x": np.array([0.0, -1.0, 0.0])})
    assert np.array_equal(got["g_x"], np.zeros(3)) and got["t_x"] == 0.0


def test_term_times_exact_zero_adds_nothing():
    """0 * sqrt(x), mask * log(x) with mask 0, and where-masked products: exact 0."""
    text = """
dim n = 3
input x : f64[n]
input y : f64[n]
input mask : f64[n]
%zero = const[0.0] : f64[]
%s = map[sqrt] %x : f64[n]
%a = contract %zero, %s : f64[n]
%l = map[log] %x : f64[n]
%b = contract %mask, %l : f64[n]
%c = map[gt] %x, %zero : f64[n]
%yl = contract %y, %l : f64[n]
%d = map[where] %c, %yl, %zero : f64[n]
%v = add[1.0, 1.0, 1.0] %a, %b, %d : f64[n]
%f = contract %v : f64[]
"""
    m = compile_ir(derive(text, ["x", "y"]))
    ins = {"x": np.zeros(3), "y": np.ones(3), "mask": np.zeros(3)}
    got = run(m, {**ins, "d_x": np.ones(3), "u_x": np.ones(3), "d_y": np.ones(3), "u_y": np.ones(3)})
    for k in ("g_x", "t_x", "g_y", "t_y"):
        assert np.array_equal(got[k], np.zeros_like(got[k])), k


def test_masked_reduction_adds_exactly_zero():
    """where(c, sum[e](w * log x), 0): the summed product's cotangents are guarded too."""
    text = """
dim r = 2
dim e = 3
input x : f64[r, e]
input w : f64[r, e]
input c : f64[r]
%l = map[log] %x : f64[r, e]
%s = contract %w, %l : f64[r]
%zero = const[0.0] : f64[]
%v = map[where] %c, %s, %zero : f64[r]
%f = contract %v : f64[]
"""
    ins = {"x": np.array([[0.0, 1.0, 2.0], [3.0, 0.0, 1.0]]), "w": np.ones((2, 3)), "c": np.zeros(2)}
    m = compile_ir(derive(text, list(ins)))
    got = run(m, {**ins, **{f"{p}_{k}": np.ones_like(v) for k, v in ins.items() for p in "du"}})
    for k in ("g_x", "g_w", "g_c", "t_x", "t_w"):
        assert np.array_equal(got[k], np.zeros_like(got[k])), k


def test_pow_at_zero():
    text = """
dim n = 2
input x : f64[n]
input y : f64[n]
%two = const[2.0] : f64[]
%sq = map[pow] %x, %two : f64[n]
%p = map[pow] %x, %y : f64[n]
%v = add[1.0, 1.0] %sq, %p : f64[n]
%f = contract %v : f64[]
"""
    got = _grads(text, {"x": np.zeros(2), "y": np.array([2.0, 3.0])})
    assert np.array_equal(got["g_x"], [0.0, 0.0]) and np.array_equal(got["g_y"], [0.0, 0.0])
    assert got["t_x"] == 0.0 and got["t_y"] == 0.0
    m = compile_ir(derive(text, ["x"]))  # the exponent is inactive: no log(x) in the program
    assert not any(v.op == "map" and v.attrs[0] == "log" for v in m.values())


# ---- index operations ----------------------------------------------------------------------

def test_conv_stride_padding_reindex():
    text = """
dim t = 9
dim s = 4
dim k = 3
dim c = 2
input x : f64[c, t]
input w : f64[c, k]
input v : f64[s]
%ind = indicator[t = 2*s + k - 1] : f64[k, s, t]
%y = contract %x, %ind, %w : f64[s]
%a = map[tanh] %y : f64[s]
%f = contract %a, %v : f64[]
"""
    m, _, _ = check(text, ["x", "w"], second=True)
    indicators = {v for v in m.values() if v.op == "indicator"}
    assert [str(v.attrs[0]) for v in indicators] == ["t = k + 2*s - 1"]  # the same relation, no dense copy
    assert not any(v.op == "const" and v.edges for v in m.values())


def test_slice_and_concat_reindex():
    text = """
dim t1 = 3
dim t2 = 2
dim t = 5
input a : f64[t1]
input b : f64[t2]
input w : f64[t]
%ia = indicator[t1 = t] : f64[t, t1]
%ib = indicator[t2 = t - 3] : f64[t, t2]
%ca = contract %a, %ia : f64[t]
%cb = contract %b, %ib : f64[t]
%j = add[1.0, 1.0] %ca, %cb : f64[t]
%e = map[exp] %j : f64[t]
%f = contract %e, %w : f64[]
"""
    check(text, ["a", "b"], second=True)


GATHER = """
dim v = 4
dim n = 6
dim d = 3
input E : f64[v, d]
input ids : i32[n]
input w : f64[n, d]
%g = gather[v] %E, %ids : f64[d, n]
%t = map[tanh] %g : f64[d, n]
%f = contract %t, %w : f64[]
"""


def test_gather_repeated_ids_scatter_accumulates():
    ids = lambda s, r: np.array([1, 3, 1, 1, 0, 3], dtype=np.int32)
    m, inputs, got = check(GATHER, ["E"], {"ids": ids}, second=True)
    assert any(v.op == "scatter" for v in m.values())
    E, w = inputs["E"], inputs["w"]
    want = np.zeros_like(E)
    np.add.at(want, inputs["ids"], (1 - np.tanh(E[inputs["ids"]]) ** 2) * w)
    np.testing.assert_allclose(got["g_E"], want, rtol=1e-12)
    assert not got["g_E"][2].any()  # an id no one gathered gets exactly zero


def test_batched_gather_matches_the_shared_edge():
    text = """
dim b = 2
dim v = 3
dim n = 4
input E : f64[b, v]
input ids : i32[b, n]
input w : f64[b, n]
%g = gather[v] %E, %ids : f64[b, n]
%s = map[sin] %g : f64[b, n]
%f = contract %s, %w : f64[]
"""
    ids = lambda s, r: np.array([[0, 2, 2, 1], [1, 1, 1, 0]], dtype=np.int32)
    check(text, ["E"], {"ids": ids}, second=True)


def test_scatter_text_form_derivative_and_bounds():
    text = """
dim v = 4
dim n = 5
dim d = 2
input c : f64[n, d]
input ids : i32[n]
input w : f64[v, d]
%s = scatter[v] %c, %ids : f64[d, v]
%e = map[exp] %s : f64[d, v]
%f = contract %e, %w : f64[]
"""
    printed = print_module(parse_module(text + "out f = %f : []\n"))
    assert "%0 = scatter[v] %c, %ids : f64[d, v]" in printed
    assert print_module(parse_module(printed)) == printed
    ids = lambda s, r: np.array([3, 0, 3, 3, 1], dtype=np.int32)
    check(text, ["c"], {"ids": ids}, second=True)
    m = compile_ir(derive(text, ["c"]))
    inputs = random_inputs(m, np.random.default_rng(0), {"ids": lambda s, r: np.full(s, 4, np.int32)})
    with pytest.raises(EvalError, match="scatter index out of range"):
        run(m, inputs)


def test_scatter_keeps_matched_edges():
    text = """
dim b = 2
dim v = 3
dim n = 4
input c : f64[b, n]
input ids : i32[b, n]
%s = scatter[v] %c, %ids : f64[b, v]
out s = %s : [b, v]
"""
    c = np.arange(8.0).reshape(2, 4)
    ids = np.array([[0, 2, 2, 1], [1, 1, 1, 0]], dtype=np.int32)
    got = run(parse_module(text), {"c": c, "ids": ids})["s"]
    np.testing.assert_array_equal(got, [[0, 3, 3], [7, 15, 0]])


# ---- Jacobians, vjp, jvp, training steps -----------------------------------------------------

JAC = """
dim m = 3
dim a = 2
dim r = 2
input x : f64[m]
input W : f64[m, a, r]
%h = contract %x, %W : f64[a, r]
%f = map[tanh] %h : f64[a, r]
"""


def test_jacobian_of_non_scalar():
    text = JAC + "%J = grad %f, %x : f64[a, m, r]\nout y = %f : [a, r]\nout J = %J : [m, a, r]\n"
    m = compile_ir(text)
    inputs = random_inputs(m, np.random.default_rng(1))
    np.testing.assert_allclose(run(m, inputs)["J"], fd_grad(m, inputs, "y", "x"), rtol=1e-6, atol=1e-8)


def test_vjp_and_jvp_with_batch_edges():
    """The batch edge `k` of v / dx is also an edge of an intermediate value (%p)."""
    text = """
dim m = 3
dim n = 2
dim k = 4
input x : f64[m]
input P : f64[m, k]
input U : f64[k, n]
input v : f64[n, k]
input dx : f64[m, k]
%p = contract %x, %P : f64[k]
%s = map[sin] %p : f64[k]
%f = contract %s, %U : f64[n]
%vj = vjp %f, %x, %v : f64[k, m]
%jv = jvp %f, %x, %dx : f64[k, n]
%J = grad %f, %x : f64[m, n]
out y = %f : [n]
out vj = %vj : [m, k]
out jv = %jv : [n, k]
out J = %J : [m, n]
"""
    m = compile_ir(text)
    inputs = random_inputs(m, np.random.default_rng(2))
    got = run(m, inputs)
    J = fd_grad(m, inputs, "y", "x")  # [m, n]
    np.testing.assert_allclose(got["J"], J, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(got["vj"], np.einsum("mn,nk->mk", J, inputs["v"]), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(got["jv"], np.einsum("mn,mk->nk", J, inputs["dx"]), rtol=1e-6, atol=1e-8)


def test_training_step_updates_use_gradients_of_the_same_step():
    text = """
dim batch = 4
dim i = 3
dim o = 2
input x : f64[batch, i]
input y : f64[batch, o]
param W : f64[i, o]
state mW : f64[i, o]
input lr : f64[]
%z = contract %x, %W : f64[batch, o]
%d = add[1.0, -1.0] %z, %y : f64[batch, o]
%l = contract %d, %d : f64[]
%g = grad %l, %W : f64[i, o]
%m2 = add[0.9, 0.1] %mW, %g : f64[i, o]
%step = contract %lr, %m2 : f64[i, o]
%W2 = add[1.0, -1.0] %W, %step : f64[i, o]
out loss = %l : []
update W = %W2
update mW = %m2
"""
    m = compile_ir(text)
    assert [u.target for u in m.updates] == ["W", "mW"]
    inputs = random_inputs(m, np.random.default_rng(3), {"lr": lambda s, r: np.array(0.1)})
    got = run(m, inputs)
    g = fd_grad(m, inputs, "loss", "W")
    m2 = 0.9 * inputs["mW"] + 0.1 * g
    np.testing.assert_allclose(got["mW"], m2, rtol=1e-6)
    np.testing.assert_allclose(got["W"], inputs["W"] - 0.1 * m2, rtol=1e-6)


def test_default_pipeline_leaves_no_derivative_node():
    text = JAC + """
%s = contract %f, %f : f64[]
%g = grad %s, %x : f64[m]
%gg = contract %g, %g : f64[]
%hw = grad %gg, %W : f64[a, m, r]
out h = %hw : [m, a, r]
"""
    m = run_pipeline(parse_module(text), Options()).module
    verify(m, derivatives=False)
    assert print_module(parse_module(print_module(m))) == print_module(m)


# ---- PyTorch as a second oracle ------------------------------------------------------------

def test_against_torch_autograd():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch oracle is skipped")
    text = """
dim b = 3
dim c = 4
dim t = 7
dim s = 4
dim k = 3
input x : f64[b, c]
input y : f64[b, c]
input z : f64[t]
input w : f64[k]
%m = reduce[max: c] %x : f64[b]
%ms = stop %m : f64[b]
%d = add[1.0, -1.0] %x, %ms : f64[b, c]
%e = map[exp] %d : f64[b, c]
%se = contract %e : f64[b]
%lse = map[log] %se : f64[b]
%ls = add[1.0, -1.0] %d, %lse : f64[b, c]
%ce = contract %y, %ls : f64[]
%ind = indicator[t = 2*s + k - 1] : f64[k, s, t]
%cv = contract %z, %ind, %w : f64[s]
%r = map[tanh] %cv : f64[s]
%q = contract %r, %r : f64[]
%f = add[-1.0, 1.0] %ce, %q : f64[]
%gx = grad %f, %x : f64[b, c]
%gz = grad %f, %z : f64[t]
%gw = grad %f, %w : f64[k]
out gx = %gx : [b, c]
out gz = %gz : [t]
out gw = %gw : [k]
"""
    m = compile_ir(text)
    inputs = random_inputs(m, np.random.default_rng(4))
    got = run(m, inputs)
    tx, ty, tz, tw = (torch.tensor(inputs[n], requires_grad=n in "xzw") for n in "xyzw")
    ce = -(ty * torch.log_softmax(tx, dim=1)).sum()
    cv = torch.nn.functional.conv1d(tz.view(1, 1, -1), tw.view(1, 1, -1), stride=2, padding=1).view(-1)
    (ce + (torch.tanh(cv) ** 2).sum()).backward()
    for name, t in (("gx", tx), ("gz", tz), ("gw", tw)):
        np.testing.assert_allclose(got[name], t.grad.numpy(), rtol=1e-10, atol=1e-12)
