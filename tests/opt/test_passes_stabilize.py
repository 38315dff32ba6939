"""stabilize: exp-ratio and log patterns become fused stable ops (golden IR + --verify-each),
in forward and in derived backward graphs; the new ops in the interpreter and autodiff."""
import numpy as np
import pytest

from passes_util import body, ops, optimize, same_values, tg, tgir
from tgc.ir.interp import evaluate
from tgc.registry import DEFAULT_PIPELINE

STABILIZE = ("normalize", "stabilize")

PATTERNS = """
dim b = 2, n = 5
input x[b, n]
out p[b, n] = softmax[n](x)
out l[b, n] = log_softmax[n](x)
out s[b, n] = sigmoid(x)
out sp[b, n] = softplus(x)
out th[b, n] = (exp(x) - exp(-x)) / (exp(x) + exp(-x))
out sg[b, n] = 1 / (1 + exp(-x))
out lse[b] = log(sum[n](exp(x)))
"""

# softmax = exp(d - logsumexp(d)), log_softmax = d - logsumexp(d) on the shifted logits
# d = x - max(x) (the shift stays: x - logsumexp(x) would cancel in floating point); the
# prelude's logsumexp, sigmoid/softplus and sigmoid/tanh written through exp: their fused ops.
PATTERNS_AFTER = """\
%0 = reduce[max: n] %x : f64[b]
%1 = add[1.0, -1.0] %x, %0 : f64[b, n]
%2 = reduce[logsumexp: n] %1 : f64[b]
%3 = add[-1.0, 1.0] %2, %1 : f64[b, n]
%4 = map[exp] %3 : f64[b, n]
%5 = map[sigmoid] %x : f64[b, n]
%6 = map[softplus] %x : f64[b, n]
%7 = map[tanh] %x : f64[b, n]
%8 = reduce[logsumexp: n] %x : f64[b]
out p = %4 : [b, n]
out l = %3 : [b, n]
out s = %5 : [b, n]
out sp = %6 : [b, n]
out th = %7 : [b, n]
out sg = %5 : [b, n]
out lse = %8 : [b]"""


def test_forward_patterns():
    assert body(optimize(tg(PATTERNS), STABILIZE)) == PATTERNS_AFTER


def test_stable_at_large_magnitudes():
    m = optimize(tg(PATTERNS), DEFAULT_PIPELINE)
    x = np.array([[1000.0, -1000.0, 0.0, 3.0, 2000.0], [-800.0, -900.0, -1000.0, -700.0, -750.0]])
    with np.errstate(all="raise"):
        out = evaluate(m, {"x": x}, dtype="f64")
    for name, value in out.items():
        assert np.all(np.isfinite(value)), name
    np.testing.assert_allclose(out["lse"], [2000.0, -700.0 + np.log(1 + np.exp(-50) + np.exp(-100) + np.exp(-200) + np.exp(-300))])
    np.testing.assert_allclose(out["sp"][0, :2], [1000.0, 0.0], atol=1e-300)


CE_GRAD = """
dim b = 2, n = 5
input x[b, n], y[b, n]
out g = grad(sum(cross_entropy[n](x, y)), x)
"""

# With stabilize only after differentiation, the derived gradient's 1 / sum exp and
# exp ratios still become the same stable form: sum(y) softmax(x) - y, the softmax on
# the shifted logits.
CE_GRAD_AFTER = """\
%0 = reduce[max: n] %x : f64[b]
%1 = add[1.0, -1.0] %x, %0 : f64[b, n]
%2 = reduce[logsumexp: n] %1 : f64[b]
%3 = add[-1.0, 1.0] %2, %1 : f64[b, n]
%4 = map[exp] %3 : f64[b, n]
%5 = rename[n -> n.1] %y : f64[b, n.1]
%6 = contract %4, %5 : f64[b, n]
%7 = add[-1.0, 1.0] %y, %6 : f64[b, n]
out g = %7 : [b, n]"""


def test_backward_patterns():
    m = optimize(tg(CE_GRAD), ("normalize", "adjoint", "tangent", "simplify", "stabilize"))
    assert body(m) == CE_GRAD_AFTER


def test_both_orders_agree():
    a = optimize(tg(CE_GRAD), ("normalize", "adjoint", "tangent", "simplify", "stabilize"))
    b = optimize(tg(CE_GRAD), ("normalize", "stabilize", "adjoint", "tangent", "simplify"))
    assert body(a) == body(b)


def test_stabilize_keeps_stop_semantics_before_differentiation():
    """Fusing before `adjoint` must keep every derivative (checked by --verify-each on grads)."""
    m = optimize(tg("""
dim b = 3, n = 4
input x[b, n], y[b, n]
loss = sum(cross_entropy[n](x, y)) + sum(softplus(x) * y) + sum(sigmoid(x) * y)
out g = grad(loss, x)
out h = grad(grad(loss, x) @ y, x)
"""), DEFAULT_PIPELINE)
    assert ops(m, "reduce", "logsumexp")


LSE_IR = """
dim b = 2
dim n = 4
input x : f64[b, n]
input d : f64[b, n]
input w : f64[b]
%l = reduce[logsumexp: n] %x : f64[b]
%f = contract %l, %w : f64[]
%g = grad %f, %x : f64[b, n]
%j = jvp %f, %x, %d : f64[]
%gd = contract %g, %d : f64[]
%h = grad %gd, %x : f64[b, n]
out f = %f : []
out g = %g : [b, n]
out j = %j : []
out h = %h : [b, n]
"""


def test_logsumexp_derivatives_match_finite_differences():
    m = optimize(tgir(LSE_IR), ("normalize", "adjoint", "tangent", "simplify"))
    rng = np.random.default_rng(0)
    x, d, w = rng.standard_normal((2, 4)), rng.standard_normal((2, 4)), rng.standard_normal(2)
    out = evaluate(m, {"x": x, "d": d, "w": w}, dtype="f64")
    f = lambda x: float(np.sum(w * np.log(np.sum(np.exp(x), axis=1))))  # noqa: E731
    eps = 1e-6
    fd = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[idx] = eps
        fd[idx] = (f(x + e) - f(x - e)) / (2 * eps)
    np.testing.assert_allclose(out["g"], fd, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(out["j"], np.sum(fd * d), rtol=1e-6)
    s = np.exp(x) / np.exp(x).sum(1, keepdims=True)
    hv = w[:, None] * (s * d - s * (s * d).sum(1, keepdims=True))
    np.testing.assert_allclose(out["h"], hv, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("x, want", [(np.array([-np.inf, -np.inf]), -np.inf), (np.array([np.inf, 0.0]), np.inf),
                                     (np.array([1e308, 1e308]), 1e308 + np.log(2))])
def test_interpreter_logsumexp_edges(x, want):
    m = tgir("dim n = 2\ninput x : f64[n]\n%l = reduce[logsumexp: n] %x : f64[]\nout l = %l : []\n")
    assert evaluate(m, {"x": x}, dtype="f64")["l"] == want


def test_interpreter_sigmoid_softplus_tails():
    m = tgir("dim n = 3\ninput x : f64[n]\n%s = map[sigmoid] %x : f64[n]\n%p = map[softplus] %x : f64[n]\n"
             "out s = %s : [n]\nout p = %p : [n]\n")
    with np.errstate(all="raise"):
        out = evaluate(m, {"x": np.array([-1000.0, 0.0, 1000.0])}, dtype="f64")
    np.testing.assert_allclose(out["s"], [0.0, 0.5, 1.0])
    np.testing.assert_allclose(out["p"], [0.0, np.log(2), 1000.0])


def test_fusing_before_differentiation_keeps_every_derivative():
    """--verify-each starts checking after `tangent`; compare with no pre-adjoint pass at all."""
    src = tg("""
dim b = 3, n = 4
input x[b, n], y[b, n]
loss = sum(cross_entropy[n](x, y)) + sum(softplus(x) * y) + sum(sigmoid(x) * y) + sum(silu(x))
out g = grad(loss, x)
out h = grad(grad(loss, x) @ y, x)
out j = jvp(grad(loss, x), x, y)
""")
    same_values(optimize(src, ("adjoint", "tangent")), optimize(src, DEFAULT_PIPELINE))
