"""Custom derivatives: `fn f(x) = body with vjp(g) = ...` and `with jvp(dx, ...) = ...`.

A call's value is its body's; reverse mode uses the vjp clause and forward mode the jvp
clause, at every order (a second derivative differentiates the clause). Values and
derivatives are checked against numpy formulas and finite differences, on the IR
interpreter, the lowered-program interpreter and the CPU backend; the IR prints and reads
back; every mistake is a located error.
"""
from __future__ import annotations

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.frontend import compile_source
from tgc.ir.diag import CompileError
from tgc.ir.interp import evaluate
from tgc.lower.interp import run_lowered
from tgc.ir.parser import parse_module
from tgc.ir.printer import print_module
from tgc.options import Options
from tgc.manager import run_pipeline
from tgc.pipeline import lower_module
from passes_util import optimize

H = 1e-6


def module(src: str, dtype: str = "f64"):
    return compile_source(src, "<test>", Options(dtype=dtype))


def optimized(src: str, dtype: str = "f64"):
    opts = Options(dtype=dtype)
    return pipeline.lower(module(src, dtype), opts).module, opts


def interp(src: str, inputs: dict, dtype: str = "f64") -> dict:
    m, _ = optimized(src, dtype)
    return evaluate(m, inputs, dtype=dtype)


def every_way(src: str, inputs: dict, dtype: str = "f64") -> dict:
    """The IR interpreter's values, checked against the lowered-program interpreter and
    the CPU backend (tgc.compile) on the same inputs."""
    m, opts = optimized(src, dtype)
    want = evaluate(m, {k: np.copy(v) for k, v in inputs.items()}, dtype=dtype)
    low = run_lowered(lower_module(m, opts), {k: np.copy(v) for k, v in inputs.items()})
    cpu = tgc.compile(src, dtype=dtype)(**{k: np.copy(v) for k, v in inputs.items()})
    tol = 1e-10 if dtype == "f64" else 2e-5
    for k, w in want.items():
        scale = max(1.0, float(np.max(np.abs(w)))) if w.size else 1.0
        np.testing.assert_allclose(low[k], w, rtol=tol, atol=tol * scale, err_msg=f"lowered {k}")
        np.testing.assert_allclose(np.asarray(cpu[k]), w, rtol=tol, atol=tol * scale, err_msg=f"cpu {k}")
    return want


def fd(src: str, inputs: dict, out: str, x: str, d: np.ndarray, h: float = H) -> np.ndarray:
    """d out / d x along d, by a central difference of the program's own values."""
    m, _ = optimized(src)
    plus, minus = dict(inputs), dict(inputs)
    plus[x], minus[x] = inputs[x] + h * d, inputs[x] - h * d
    return (evaluate(m, plus, dtype="f64")[out] - evaluate(m, minus, dtype="f64")[out]) / (2 * h)


def sigmoid(x):
    return np.where(x >= 0, 1 / (1 + np.exp(-np.abs(x))), np.exp(-np.abs(x)) / (1 + np.exp(-np.abs(x))))


rng = np.random.default_rng(7)


# ---- reverse mode: the vjp clause replaces the body's derivative ------------------------

STE = """
dim n = 6
param x[n]
input t[n]
fn ste(x) = sign(x) with vjp(g) = g       # straight-through: forward sign, backward identity
loss = sum((ste(x) - t) ^ 2)
out loss
out gx = grad(loss, x)
"""


def test_straight_through_estimator():
    x, t = rng.standard_normal(6), rng.standard_normal(6)
    got = every_way(STE, {"x": x, "t": t})
    np.testing.assert_allclose(got["loss"], np.sum((np.sign(x) - t) ** 2))
    np.testing.assert_allclose(got["gx"], 2 * (np.sign(x) - t))  # sign's own derivative would give 0


CLIP_MODEL = """
dim batch = 8, features = 4, hidden = 5
input x[batch, features]
input y[batch]
param W1[features, hidden], W2[hidden]
input lr
fn clip_grad(x) = x with vjp(g) = max(-0.01, min(0.01, g))
h    = clip_grad(tanh(x @ W1))
loss = mean[batch]((h @ W2 - y) ^ 2)
out loss
out g1 = grad(loss, W1)
out g2 = grad(loss, W2)
update W1 = W1 - lr * grad(loss, W1)
"""


def test_gradient_clipping_inside_a_model():
    x, y = rng.standard_normal((8, 4)), rng.standard_normal(8)
    W1, W2 = rng.standard_normal((4, 5)), rng.standard_normal(5)
    got = every_way(CLIP_MODEL, {"x": x, "y": y, "W1": W1, "W2": W2, "lr": np.float64(0.5)})
    h = np.tanh(x @ W1)
    r = h @ W2 - y
    dpred = 2 * r / 8
    dh = np.clip(np.outer(dpred, W2), -0.01, 0.01)   # the clause clips the cotangent of h
    np.testing.assert_allclose(got["loss"], np.mean(r ** 2))
    np.testing.assert_allclose(got["g2"], h.T @ dpred)  # W2 is outside the clipped call
    np.testing.assert_allclose(got["g1"], x.T @ (dh * (1 - h ** 2)))
    np.testing.assert_allclose(got["W1"], W1 - 0.5 * x.T @ (dh * (1 - h ** 2)))
    assert np.abs(np.outer(dpred, W2)).max() > 0.01  # the clipping did bite


SOFTPLUS = """
dim n = 8
input x[n]
fn softplus_hand(x) = max(x, 0) + log(1 + exp(-abs(x))) with vjp(g) = g * sigmoid(x)
y = softplus_hand(x)
out y
out gx = grad(sum(y), x)
"""


@pytest.mark.parametrize("dtype,big", [("f64", 800.0), ("f32", 100.0)])
def test_numerically_special_function(dtype, big):
    x = np.array([-big, -30, -1, -1e-3, 0, 2, 30, big])
    got = every_way(SOFTPLUS, {"x": x.astype({"f64": np.float64, "f32": np.float32}[dtype])}, dtype)
    np.testing.assert_allclose(got["y"], np.logaddexp(0, x), rtol=1e-6, atol=1e-30)  # f32: 4e-44 is subnormal
    np.testing.assert_allclose(got["gx"], sigmoid(x), rtol=1e-6, atol=1e-30)
    assert np.isfinite(got["gx"]).all()


SCALE = """
dim n = 5, m = 3
param x[n, m]
param s
input w[n, m]
fn scale(x, s) = x * s with vjp(g) = (g * s, sum(g * x))      # ds has s's (no) edges
fn halved(a, b) = a * b with vjp(g) = (g * b, 0.5 * sum(g * a))  # a rule that is not the body's
out f = sum(scale(x, s) * w)
out gx = grad(sum(scale(x, s) * w), x)
out gs = grad(sum(scale(x, s) * w), s)
out hb = grad(sum(halved(x, s) * w), s)
"""


def test_two_parameters_with_a_tuple_clause():
    x, w, s = rng.standard_normal((5, 3)), rng.standard_normal((5, 3)), np.float64(1.7)
    got = every_way(SCALE, {"x": x, "s": s, "w": w})
    np.testing.assert_allclose(got["gx"], s * w)
    np.testing.assert_allclose(got["gs"], np.sum(x * w))
    np.testing.assert_allclose(got["gs"], fd(SCALE, {"x": x, "s": s, "w": w}, "f", "s", np.float64(1.0)), rtol=1e-6)
    np.testing.assert_allclose(got["hb"], 0.5 * np.sum(x * w))  # the clause, not the body's derivative


ROWCLIP = """
dim rows = 4, d = 3
param x[rows, d]
input w[rows, d]
# block form and an edge parameter: the clause clips the norm of each row's gradient to 1
fn clip_norm[e](x) {
  y = x
  return y
} with vjp(g) = g / max(1, sqrt(sum[e](g * g)))
out gx = grad(sum(clip_norm[d](x) * w), x)
"""


def test_block_function_with_an_edge_parameter():
    x, w = rng.standard_normal((4, 3)), 2 * rng.standard_normal((4, 3))
    w[0] *= 0.01  # one row under the bound
    got = every_way(ROWCLIP, {"x": x, "w": w})
    norms = np.sqrt(np.sum(w * w, axis=1, keepdims=True))
    np.testing.assert_allclose(got["gx"], w / np.maximum(1, norms))


# ---- forward mode: the jvp clause ---------------------------------------------------------

HYPOT = """
dim n = 4
param a[n], b[n]
input u[n], v[n]
fn hyp(a, b) {
  r = sqrt(a * a + b * b)
  return r
} with vjp(g) = (g * a / r, g * b / r) with jvp(da, db) = (a * da + b * db) / r
f = sum(hyp(a, b) * u)
out f
out ja = jvp(f, a, v)
out jb = jvp(f, b, v)
out ga = grad(f, a)
"""


def test_jvp_clause_against_finite_differences():
    a, b = rng.standard_normal(4), rng.standard_normal(4)
    u, v = rng.standard_normal(4), rng.standard_normal(4)
    ins = {"a": a, "b": b, "u": u, "v": v}
    got = every_way(HYPOT, ins)
    np.testing.assert_allclose(got["ja"], fd(HYPOT, ins, "f", "a", v), rtol=1e-6)
    np.testing.assert_allclose(got["jb"], fd(HYPOT, ins, "f", "b", v), rtol=1e-6)
    np.testing.assert_allclose(got["ga"], u * a / np.hypot(a, b))


CUBE = """
dim n = 5
input x[n], dx[n]
fn cube(x) = x * x * x with jvp(t) = 2 * x * x * t      # deliberately not 3 x^2: the clause is used
out j = jvp(sum(cube(x)), x, dx)
"""


def test_forward_mode_uses_the_clause_not_the_body():
    x, dx = rng.standard_normal(5), rng.standard_normal(5)
    got = every_way(CUBE, {"x": x, "dx": dx})
    np.testing.assert_allclose(got["j"], np.sum(2 * x * x * dx))


# ---- higher order: the clause is differentiated ------------------------------------------

HVP = """
dim n = 3, m = 4
param W[n, m]
input x[n], c[m], V[n, m]
fn sp(x) = max(x, 0) + log(1 + exp(-abs(x))) with vjp(g) = g * sigmoid(x)
loss = sum(sp(x @ W) * c)
gW = grad(loss, W)
out gW
out hv = grad(sum(gW * V), W)        # reverse over reverse: differentiates the clause
out hj = jvp(gW, W, V)               # forward over reverse
"""


def test_hessian_vector_product_through_a_vjp_clause():
    W, x, c, V = rng.standard_normal((3, 4)), rng.standard_normal(3), rng.standard_normal(4), rng.standard_normal((3, 4))
    ins = {"W": W, "x": x, "c": c, "V": V}
    got = every_way(HVP, ins)
    z = x @ W
    np.testing.assert_allclose(got["gW"], np.outer(x, c * sigmoid(z)))
    want = fd(HVP, ins, "gW", "W", V)
    np.testing.assert_allclose(got["hv"], want, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(got["hj"], want, rtol=1e-6, atol=1e-9)
    s = sigmoid(z)
    np.testing.assert_allclose(got["hv"], np.outer(x, c * s * (1 - s) * (x @ V)), rtol=1e-9)


NESTED = """
dim n = 5
param x[n]
input w[n], V[n]
fn clip(x) = x with vjp(g) = max(-1, min(1, g))
fn double(x) = 2 * x with vjp(g) = clip(2 * g)   # a clause that calls a function with its own rule
loss = sum(double(x) * w)
out gx = grad(loss, x)                            # clip's value is 2 w
out m = grad(sum(grad(loss, x) * V), w)           # the second derivative meets clip's own rule
"""


def test_a_clause_calling_a_function_with_its_own_rule():
    x, w, V = rng.standard_normal(5), rng.standard_normal(5), 3 * rng.standard_normal(5)
    got = every_way(NESTED, {"x": x, "w": w, "V": V})
    np.testing.assert_allclose(got["gx"], 2 * w)
    np.testing.assert_allclose(got["m"], 2 * np.clip(V, -1, 1))   # not 2 V: clip's rule
    assert np.abs(V).max() > 1


JACOBIAN = """
dim n = 3, k = n
param x[n]
fn clip_grad(x) = x with vjp(g) = max(-1, min(1, g))
y = clip_grad(5 * x)
out J = grad(y[n -> k], x)                # a batch of cotangents: the seed's extra edge k
"""


def test_jacobian_through_a_clause_batches_the_cotangent():
    x = rng.standard_normal(3)
    got = interp(JACOBIAN, {"x": x})
    np.testing.assert_allclose(got["J"], 5 * np.eye(3))  # each cotangent is a unit vector: clipped to itself


# ---- inside a loop: the clause sees the cotangent (tangent) summed over all its uses -------

def _loop_and_unrolled(step: str, decls: str, rolled: str, unrolled: str, outs: str) -> tuple[str, str]:
    head = f"dim l = 2, n = 3\nparam W[l, n]\nparam x[n]\ninput dx[n]\n{decls}\nfn step(h, w) = {step}\n"
    return (head + f"y = {rolled}\n" + outs, head + f"y = {unrolled}\n" + outs)


def test_a_scan_step_clips_its_summed_cotangent():
    """A step's value feeds both the next step and the stacked result: the clause
    (nonlinear: a clip) sees the sum of both cotangents, as the unrolled program's does,
    not each cotangent clipped and then added."""
    decls = "fn clip_grad(a) = a with vjp(g) = max(-1, min(1, g))"
    outs = "out gx = grad(L, x)\nout gW = grad(L, W)\n"
    loop, flat = _loop_and_unrolled(
        "clip_grad(h * w)", decls, "0", "0", outs)
    loop = loop.replace("y = 0\n", "L = sum(scan[l](step, x, W) * ([l = 0] * 3 + 1))\n")
    flat = flat.replace("y = 0\n", "h1 = step(x, W[l = 0])\nL = 4 * sum(h1) + sum(step(h1, W[l = 1]))\n")
    r = np.random.default_rng(31)
    W, x = r.standard_normal((2, 3)), r.standard_normal(3)
    ins = {"W": W, "x": x, "dx": np.zeros(3)}
    got, want = every_way(loop, ins), every_way(flat, ins)
    for k in ("gx", "gW"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, err_msg=k)
    ct1 = np.clip(4 + np.clip(1, -1, 1) * W[1], -1, 1)        # h1's cotangent, summed, then clipped
    np.testing.assert_allclose(got["gx"], ct1 * W[0], rtol=1e-12)
    assert not np.allclose(ct1, 1 + np.clip(W[1], -1, 1))  # clipping each cotangent apart differs


def test_a_repeat_hvp_through_a_nonlinear_clause_is_the_unrolled_one():
    """Reverse over reverse through `repeat`: the cotangents that reach a step's clause
    from the loss and from the backward loop's reads of the step are summed first."""
    decls = "fn clip_grad(a) = a with vjp(g) = max(-0.1, min(0.1, g))"
    outs = "L = sum(y * y)\nout gx = grad(L, x)\nout hx = grad(grad(L, x) @ dx, x)\nout hw = grad(grad(L, x) @ dx, W)\n"
    loop, flat = _loop_and_unrolled("h * h * w + clip_grad(h)", decls, "repeat[l](step, x, W)",
                                    "step(step(x, W[l = 0]), W[l = 1])", outs)
    r = np.random.default_rng(32)
    ins = {"W": r.standard_normal((2, 3)), "x": r.standard_normal(3), "dx": r.standard_normal(3)}
    got, want = every_way(loop, ins), every_way(flat, ins)
    for k in ("gx", "hx", "hw"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-10, atol=1e-12, err_msg=k)


def test_a_scan_hvp_through_a_nonlinear_clause_is_the_unrolled_one():
    """Reverse over reverse through `scan`: the loss reads the stacked steps and the
    first grad's backward loop reads the kept ones; the second backward sees their
    cotangents summed before the clause clips them (one backward loop for both)."""
    decls = "fn clip_grad(a) = a with vjp(g) = max(-0.1, min(0.1, g))"
    outs = "out gx = grad(L, x)\nout hx = grad(grad(L, x) @ dx, x)\nout hw = grad(grad(L, x) @ dx, W)\n"
    loop, flat = _loop_and_unrolled("h * h * w + clip_grad(h)", decls, "0", "0", outs)
    loop = loop.replace("y = 0\n", "s = scan[l](step, x, W)\nL = sum(s * s * ([l = 0] * 2 + 1))\n")
    flat = flat.replace("y = 0\n", "h1 = step(x, W[l = 0])\nh2 = step(h1, W[l = 1])\n"
                        "L = 3 * sum(h1 * h1) + sum(h2 * h2)\n")
    r = np.random.default_rng(34)
    ins = {"W": r.standard_normal((2, 3)), "x": r.standard_normal(3), "dx": r.standard_normal(3)}
    got, want = every_way(loop, ins), every_way(flat, ins)
    for k in ("gx", "hx", "hw"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-10, atol=1e-12, err_msg=k)


def test_a_loop_jvp_through_a_nonlinear_clause_is_the_unrolled_one():
    """Forward mode through `repeat` where the carry and the stacked argument both move:
    the jvp clause sees their summed tangent, as the unrolled program's does."""
    decls = "fn sq_tangent(a) = a with jvp(d) = d * d"
    outs = "out jx = jvp(y, x, dx)\n"
    loop, flat = _loop_and_unrolled("sq_tangent(h + w) * 0.5", decls, "repeat[l](step, x, x * W)",
                                    "step(step(x, x * W[l = 0]), x * W[l = 1])", outs)
    r = np.random.default_rng(33)
    ins = {"W": r.standard_normal((2, 3)), "x": r.standard_normal(3), "dx": r.standard_normal(3)}
    got, want = every_way(loop, ins), every_way(flat, ins)
    np.testing.assert_allclose(got["jx"], want["jx"], rtol=1e-12)


# ---- IR: prints and reads back, --verify-each, the rules leave before lowering ----------

def test_ir_round_trip_and_verify_each():
    for src in (STE, CLIP_MODEL, SCALE, ROWCLIP, HYPOT, HVP, NESTED):
        m = module(src)
        text = print_module(m)
        assert "custom[" in text and "slot[" in text
        assert print_module(parse_module(text)) == text
        mid = run_pipeline(m, Options(passes=("normalize", "adjoint"))).module
        assert print_module(parse_module(print_module(mid))) == print_module(mid)
        out = optimize(m)  # the default pipeline with --verify-each on two seeds
        assert not any(v.op in ("custom", "slot") for v in out.values())


def test_a_pass_list_without_simplify_still_lowers():
    m = module(STE)
    opts = Options(dtype="f64", passes=("adjoint",))
    mod = pipeline.lower(m, opts).module
    assert any(v.op == "custom" for v in mod.values())
    x, t = rng.standard_normal(6), rng.standard_normal(6)
    got = run_lowered(lower_module(mod, opts), {"x": x, "t": t})
    np.testing.assert_allclose(got["gx"], 2 * (np.sign(x) - t))


def test_a_call_without_derivatives_is_its_body():
    src = "dim n = 3\ninput x[n]\nfn ste(x) = sign(x) with vjp(g) = g\nout y = ste(x)\n"
    m, _ = optimized(src)
    assert [v.op for v in m.values() if v.op != "arg"] == ["map"]


# ---- errors ----------------------------------------------------------------------------

HEAD = "dim n = 3, k = 2\nparam x[n]\nparam s\n"


def error_of(src: str, passes: bool = False) -> str:
    with pytest.raises(CompileError) as e:
        m = module(src)
        if passes:
            pipeline.lower(m, Options(dtype="f64"))
    return str(e.value)


@pytest.mark.parametrize("body,where,message", [
    ("fn f(a, b) = a * b with vjp(g) = g * b\nout y = f(x, s)\n", "4:34",
     "the vjp of 'f' gives 1 derivative, it needs a tuple of 2 (one per parameter: a, b)"),
    ("fn f(a) = a with vjp(g) = (g, g)\nout y = f(x)\n", "4:28",
     "the vjp of 'f' gives 2 derivatives, it needs one (for 'a')"),
    ("fn f(a, b) = a * b with vjp(g) = (g * b, g * a)\nout y = f(x, s)\n", "4:42",
     "the derivative for 'b' in the vjp of 'f' has edge 'n', which 'b' lacks (its edges: [])"),
    ("fn f(a) = a with vjp(g) = g * x[n -> k]\nout y = f(x)\n", "4:31",
     "'x' is not visible inside function 'f': pass it as a parameter"),
    ("fn f(a) = a with vjp(g) = g * h\nout y = f(x)\n", "4:31", "unknown name 'h'"),
    ("fn f(a) = sum(a) with jvp(da) = da\nout y = f(x)\n", "4:33",
     "the jvp of 'f' has edge 'n', which its result lacks (the result's edges: [])"),
    ("fn f(a, b) = a * b with jvp(da) = da\nout y = f(x, s)\n", "4:20",
     "the jvp of 'f' takes 2 tangents, one per parameter (a, b), not 1"),
    ("fn f(a) = a with jvp(da) = (da, da)\nout y = f(x)\n", "4:29", "a jvp clause gives one expression"),
    ("fn f(a) = a with vjp(g, h) = g\nout y = f(x)\n", "4:25", "a vjp clause takes one variable"),
    ("fn f(a) = a with vjp(a) = a\nout y = f(x)\n", "4:22", "'a' is already defined in function 'f'"),
    ("fn f(a) = a with hvp(g) = g\nout y = f(x)\n", "4:18", "unknown derivative rule 'hvp'"),
    ("fn f(a) = a with vjp(g) = g with vjp(h) = h\nout y = f(x)\n", "4:29", "duplicate derivative rule 'vjp'"),
    ("fn f() = 1 with vjp(g) = g\nout y = f()\n", "4:12", "'f' has no parameters"),
    ("fn f(a) = a with vjp(g) = f(g)\nout y = f(x)\n", "4:27", "function 'f' calls itself"),
])
def test_clause_errors_are_located(body, where, message):
    text = error_of(HEAD + body)
    assert text.startswith(f"<test>:{where}: error: "), text
    assert message in text


def test_a_missing_rule_is_named_at_the_call():
    src = HEAD + "input v[n]\nfn clip(a) = a with vjp(g) = max(-1, min(1, g))\n" \
                 "fn cube(a) = a * a * a with jvp(t) = 3 * a * a * t\n" \
                 "y = clip(x)\nz = cube(x)\nout j = jvp(sum(y), x, v)\n"
    text = error_of(src, passes=True)
    assert text.startswith("<test>:7:5: error: forward mode needs the jvp of 'clip', which gives only its own vjp"), text
    text = error_of(src.replace("out j = jvp(sum(y), x, v)", "out g = grad(sum(z), x)"), passes=True)
    assert text.startswith("<test>:8:5: error: reverse mode needs the vjp of 'cube', which gives only its own jvp"), text


def test_a_rule_not_needed_is_not_asked_for():
    # forward mode through a vjp-only function's *argument* only: never reaches the call
    src = HEAD + "input v[n]\nfn clip(a) = a with vjp(g) = max(-1, min(1, g))\n" \
                 "y = clip(x)\nout y\nout j = jvp(sum(x * x), x, v)\n"
    m, _ = optimized(src)
    x, v = rng.standard_normal(3), rng.standard_normal(3)
    got = evaluate(m, {"x": x, "s": np.float64(0), "v": v}, dtype="f64")
    np.testing.assert_allclose(got["j"], 2 * np.sum(x * v))


def test_cli_renders_the_error_with_a_caret(tmp_path):
    from click.testing import CliRunner

    from tgc.cli import main

    bad = tmp_path / "bad.tg"
    bad.write_text(HEAD + "fn f(a, b) = a * b with vjp(g) = (g * b, g * a)\nout y = f(x, s)\n")
    r = CliRunner().invoke(main, ["check", str(bad)], catch_exceptions=False)
    assert r.exit_code == 1
    assert f"{bad}:4:42: error: the derivative for 'b' in the vjp of 'f' has edge 'n'" in r.output
    assert "^" in r.output
    ok = tmp_path / "ok.tg"
    ok.write_text(STE)
    r = CliRunner().invoke(main, ["dump-ir", str(ok), "--after", "elaborate"], catch_exceptions=False)
    assert r.exit_code == 0 and "custom[ste; 1; ste.g.1; ]" in r.output


def test_the_example_trains_one_step_as_numpy_says():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "custom_grad.tg"
    x, y = rng.standard_normal((6, 8)), rng.standard_normal(6)
    W1, W2 = 0.8 * rng.standard_normal((8, 16)), rng.standard_normal(16)
    step = tgc.compile(str(path), dtype="f64")
    got = step(x=x, y=y, W1=np.copy(W1), W2=np.copy(W2), lr=0.1)
    z = x @ np.sign(W1)                                   # ste_sign's value: sign
    h = np.logaddexp(0, z)                                # softplus_hand, clip_grad: values unchanged
    r = h @ W2 - y
    dh = np.clip(np.outer(2 * r / 6, W2), -0.1, 0.1)      # clip_grad's rule
    dW1 = x.T @ (dh * sigmoid(z))                         # softplus_hand's rule, then ...
    dW1 = np.where(np.abs(W1) <= 1, dW1, 0)               # ... straight through inside [-1, 1]
    np.testing.assert_allclose(got["loss"], np.mean(r ** 2))
    np.testing.assert_allclose(got["W1"], W1 - 0.1 * dW1)
    np.testing.assert_allclose(got["W2"], W2 - 0.1 * h.T @ (2 * r / 6))
