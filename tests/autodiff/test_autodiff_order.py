"""Derivatives of any order, the passes' nesting contract, and reverse-mode cost.

Higher-order results are checked by finite differences of the next-lower order,
which the same compiled module computes.
"""
import numpy as np
import pytest

from tgc.ir.interp import evaluate
from tgc.ir.parser import parse_module
from tgc.ir.values import DERIVATIVE_OPS
from tgc.ir.verify import verify
from tgc.options import Options
from tgc.manager import run_pipeline
from passes_util import central_difference, run_f64 as run

H = 1e-5


def compile_ir(text, passes=("normalize", "adjoint", "tangent")):
    return run_pipeline(parse_module(text), Options(passes=passes)).module


def fd(m, inputs, out, x, d):
    """Central difference of output `out` when input `x` moves along `d`."""
    return central_difference(m, inputs, out, x, d, H)


def derivative_ops(m):
    return [v.op for v in m.values() if v.op in DERIVATIVE_OPS]


# f(x, W) = sum(w * tanh(W @ x) * exp(-x . x / 4)) + sum(log(1 + (W @ x)^2))
SMOOTH = """
dim n = 3
dim m = 4
input x : f64[n]
input W : f64[n, m]
input w : f64[m]
input u : f64[n]
input p : f64[n]
input U : f64[n, m]
%z = contract %x, %W : f64[m]
%t = map[tanh] %z : f64[m]
%q = contract %x, %x : f64[]
%e0 = add[-0.25] %q : f64[]
%e = map[exp] %e0 : f64[]
%a = contract %t, %w, %e : f64[]
%one = const[1.0] : f64[]
%two = const[2.0] : f64[]
%z2 = map[pow] %z, %two : f64[m]
%l0 = add[1.0, 1.0] %one, %z2 : f64[m]
%l = map[log] %l0 : f64[m]
%b = contract %l : f64[]
%f = add[1.0, 1.0] %a, %b : f64[]
%g = grad %f, %x : f64[n]
"""
ORDER_OUTS = "out f = %f : []\nout g = %g : [n]\n"


def _inputs(seed=0):
    r = np.random.default_rng(seed)
    return {"x": r.standard_normal(3) * 0.7, "W": r.standard_normal((3, 4)) * 0.7, "w": r.standard_normal(4),
            "u": r.standard_normal(3), "p": r.standard_normal(3), "U": r.standard_normal((3, 4))}


@pytest.mark.parametrize("name,body", [
    ("grad of grad", "%gu = contract %g, %u : f64[]\n%hv = grad %gu, %x : f64[n]"),
    ("jvp of grad", "%hv = jvp %g, %x, %u : f64[n]"),
    ("grad of jvp", "%j = jvp %f, %x, %u : f64[]\n%hv = grad %j, %x : f64[n]"),
    ("vjp of grad", "%r = rename[n -> n.2] %g : f64[n.2]\n%u2 = rename[n -> n.2] %u : f64[n.2]\n"
                    "%hv = vjp %r, %x, %u2 : f64[n]"),
])
def test_hessian_vector_products(name, body):
    text = SMOOTH.replace("dim m = 4", "dim m = 4\nedge n.2 : n") + body + "\n" + ORDER_OUTS + "out hv = %hv : [n]\n"
    m = compile_ir(text)
    assert not derivative_ops(m)
    ins = _inputs()
    got = run(m, ins)
    np.testing.assert_allclose(got["hv"], fd(m, ins, "g", "x", ins["u"]), rtol=1e-6, atol=1e-8)


def test_jvp_of_jvp_and_mixed_partials():
    text = SMOOTH + """
%j1 = jvp %f, %x, %u : f64[]
%jj = jvp %j1, %x, %p : f64[]
%gW = grad %f, %W : f64[n, m]
%gWu = contract %gW, %U : f64[]
%mixed = grad %gWu, %x : f64[n]
""" + ORDER_OUTS + "out j1 = %j1 : []\nout jj = %jj : []\nout gW = %gW : [n, m]\nout mixed = %mixed : [n]\n"
    m = compile_ir(text)
    ins = _inputs(1)
    got = run(m, ins)
    np.testing.assert_allclose(got["j1"], got["g"] @ ins["u"], rtol=1e-12)
    np.testing.assert_allclose(got["jj"], fd(m, ins, "g", "x", ins["p"]) @ ins["u"], rtol=1e-6, atol=1e-8)
    mixed = [np.sum(fd(m, ins, "gW", "x", e) * ins["U"]) for e in np.eye(3)]
    np.testing.assert_allclose(got["mixed"], mixed, rtol=1e-6, atol=1e-8)


def test_third_order():
    text = SMOOTH + """
%gu = contract %g, %u : f64[]
%hu = grad %gu, %x : f64[n]
%hup = contract %hu, %p : f64[]
%t3 = grad %hup, %x : f64[n]
""" + ORDER_OUTS + "out hu = %hu : [n]\nout t3 = %t3 : [n]\n"
    m = compile_ir(text)
    ins = _inputs(2)
    got = run(m, ins)
    want = [fd(m, ins, "hu", "x", e) @ ins["p"] for e in np.eye(3)]
    np.testing.assert_allclose(got["t3"], want, rtol=1e-5, atol=1e-7)


def test_nested_vjp_jvp_projection():
    """p . (H u) through a vjp of a jvp of a vjp equals the finite-difference value."""
    text = SMOOTH.replace("dim m = 4", "dim m = 4\nedge n.2 : n") + """
%one1 = const[1.0] : f64[]
%v1 = vjp %f, %x, %one1 : f64[n]
%r = rename[n -> n.2] %v1 : f64[n.2]
%j = jvp %r, %x, %u : f64[n.2]
%p2 = rename[n -> n.2] %p : f64[n.2]
%pj = contract %j, %p2 : f64[]
%t3 = vjp %pj, %x, %one1 : f64[n]
""" + ORDER_OUTS + "out pj = %pj : []\nout t3 = %t3 : [n]\n"
    m = compile_ir(text)
    ins = _inputs(3)
    got = run(m, ins)
    np.testing.assert_allclose(got["pj"], fd(m, ins, "g", "x", ins["u"]) @ ins["p"], rtol=1e-6, atol=1e-8)
    want = [fd(m, ins, "pj", "x", e) for e in np.eye(3)]
    np.testing.assert_allclose(got["t3"], want, rtol=1e-5, atol=1e-7)


# ---- the passes' nesting contract -------------------------------------------------------------

NESTED = """
dim n = 3
input x : f64[n]
input u : f64[n]
%s = map[sin] %x : f64[n]
%f = contract %s, %s : f64[]
"""


@pytest.mark.parametrize("body,passes,left", [
    ("%j = jvp %f, %x, %u : f64[]\n%r = grad %j, %x : f64[n]", ("adjoint",), []),
    ("%g = grad %f, %x : f64[n]\n%r = jvp %g, %x, %u : f64[n]", ("tangent",), []),
    ("%g = grad %f, %x : f64[n]\n%r = jvp %g, %x, %u : f64[n]", ("adjoint",), ["jvp"]),
    ("%g = grad %f, %x : f64[n]\n%r = jvp %g, %x, %u : f64[n]", ("adjoint", "tangent"), []),
    ("%j = jvp %f, %x, %u : f64[]\n%r0 = grad %j, %x : f64[n]\n%r = jvp %r0, %x, %u : f64[n]",
     ("adjoint", "tangent"), []),
    ("%j = jvp %f, %x, %u : f64[]\n%r0 = grad %j, %x : f64[n]\n%r = jvp %r0, %x, %u : f64[n]",
     ("tangent", "adjoint"), []),
])
def test_each_pass_resolves_everything_beneath_its_nodes(body, passes, left):
    m = compile_ir(NESTED + body + "\nout r = %r : [n]\n", passes)
    assert derivative_ops(m) == left
    if not left:
        verify(m, derivatives=False)
        x = np.array([0.3, -1.2, 2.0])
        u = np.array([1.0, 0.5, -2.0])
        got = run(m, {"x": x, "u": u})["r"]
        want = 2 * np.cos(2 * x) * u if body.count("jvp") + body.count("grad") == 2 else -4 * np.sin(2 * x) * u * u
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_cross_entropy_softmax_hessian_vector_product():
    text = """
dim b = 3
dim c = 5
input x : f64[b, c]
input y : f64[b, c]
input v : f64[b, c]
%m = reduce[max: c] %x : f64[b]
%ms = stop %m : f64[b]
%d = add[1.0, -1.0] %x, %ms : f64[b, c]
%e = map[exp] %d : f64[b, c]
%se = contract %e : f64[b]
%lse = map[log] %se : f64[b]
%ls = add[1.0, -1.0] %d, %lse : f64[b, c]
%yl = contract %y, %ls : f64[]
%loss = add[-1.0] %yl : f64[]
%g = grad %loss, %x : f64[b, c]
%gv = contract %g, %v : f64[]
%hv = grad %gv, %x : f64[b, c]
out g = %g : [b, c]
out hv = %hv : [b, c]
"""
    m = compile_ir(text)
    assert not any(v.op == "map" and v.attrs[0] == "eq" for v in m.values())  # stop(max) gets no cotangent
    r = np.random.default_rng(5)
    x, y, v = r.standard_normal((3, 5)) * 3, r.uniform(0, 1, (3, 5)), r.standard_normal((3, 5))
    got = run(m, {"x": x, "y": y, "v": v})
    s = np.exp(x - x.max(1, keepdims=True))
    s /= s.sum(1, keepdims=True)
    np.testing.assert_allclose(got["g"], s * y.sum(1, keepdims=True) - y, rtol=1e-12, atol=1e-14)
    want = np.stack([(np.diag(s[i]) - np.outer(s[i], s[i])) @ v[i] * y[i].sum() for i in range(3)])
    np.testing.assert_allclose(got["hv"], want, rtol=1e-10, atol=1e-13)


# ---- reverse mode cost is linear in depth --------------------------------------------------------

def mlp(n_layers):
    """An n-layer ReLU MLP with a squared-error loss and an SGD update of every parameter."""
    lines = ["dim batch = 4", "dim h = 8"] + [f"edge h{i} : h" for i in range(n_layers + 1)]
    lines += ["input x : f64[batch, h0]", f"input y : f64[batch, h{n_layers}]", "input lr : f64[]"]
    for i in range(1, n_layers + 1):
        lines += [f"param W{i} : f64[h{i - 1}, h{i}]", f"param b{i} : f64[h{i}]"]
    lines += ["%zero = const[0.0] : f64[]"]
    prev = "%x"
    for i in range(1, n_layers + 1):
        lines += [f"%z{i} = contract {prev}, %W{i} : f64[batch, h{i}]",
                  f"%a{i} = add[1.0, 1.0] %z{i}, %b{i} : f64[batch, h{i}]",
                  f"%r{i} = map[max] %zero, %a{i} : f64[batch, h{i}]"]
        prev = f"%r{i}"
    lines += [f"%d = add[1.0, -1.0] {prev}, %y : f64[batch, h{n_layers}]", "%loss = contract %d, %d : f64[]"]
    outs = ["out loss = %loss : []"]
    for i in range(1, n_layers + 1):
        for p, e in ((f"W{i}", f"h{i - 1}, h{i}"), (f"b{i}", f"h{i}")):
            lines += [f"%g{p} = grad %loss, %{p} : f64[{e}]", f"%s{p} = contract %lr, %g{p} : f64[{e}]",
                      f"%n{p} = add[1.0, -1.0] %{p}, %s{p} : f64[{e}]"]
            outs.append(f"update {p} = %n{p}")
    return "\n".join(lines + outs) + "\n"


def cost(m):
    sizes = {e: int(m.dims[d]) for e, d in m.edges.items()}
    values = [v for v in m.values() if v.op != "arg"]
    return len(values), sum(int(np.prod([sizes[e] for e in v.edges])) for v in values)


MEASURED: dict[int, tuple[int, int]] = {}


def test_reverse_mode_cost_is_linear_in_depth():
    for n in (2, 4, 8, 16):
        MEASURED[n] = cost(compile_ir(mlp(n)))
    ops = {n: c[0] for n, c in MEASURED.items()}
    elems = {n: c[1] for n, c in MEASURED.items()}
    for measure in (ops, elems):
        assert measure[16] / measure[8] < 2.3 and measure[8] / measure[4] < 2.3
        per_layer = [(measure[2 * n] - measure[n]) / n for n in (2, 4, 8)]
        assert max(per_layer) <= 1.1 * min(per_layer), per_layer
    print("ops, elements by depth:", MEASURED)


def test_mlp_training_step_is_correct():
    m = compile_ir(mlp(2))
    r = np.random.default_rng(6)
    ins = {a.name: r.standard_normal(tuple({"batch": 4}.get(e, 8) for e in a.order)) for a in m.args.values()}
    ins["lr"] = np.array(0.5)
    got = run(m, ins)
    for p in ("W1", "b2"):
        grad = np.zeros_like(ins[p])
        for idx in np.ndindex(grad.shape):
            e = np.zeros_like(grad)
            e[idx] = 1
            grad[idx] = fd(m, ins, "loss", p, e)
        np.testing.assert_allclose(got[p], ins[p] - 0.5 * grad, rtol=1e-6, atol=1e-8)
