"""The elaborator, section by section of LANGUAGE.md: values against numpy."""
import numpy as np
import pytest

from tgc.frontend import compile_source
from tgc.ir.diag import CompileError
from tgc.ir.interp import evaluate
from tgc.options import Options

rng = np.random.default_rng(7)


def run(src, **inputs):
    m = compile_source(src, "t.tg", Options(dtype="f64"))
    return evaluate(m, inputs, dtype="f64")


def error(src):
    with pytest.raises(CompileError) as e:
        compile_source(src, "t.tg")
    return e.value


def test_dims_and_dim_expressions():
    out = run("""dim d = 64, heads = 4
dim hd = d / heads
dim n
dim m = n - 2 + 1
input x[n]
out y = sum(x[n = m + k]) + size(hd) + size(m)
dim k = 2
""".replace("out y = sum(x[n = m + k]) + size(hd) + size(m)\ndim k = 2\n",
            "dim k = 2\nout y = sum(x[n = m + k]) + size(hd) + size(m)\n"), x=np.arange(5.0))
    # m = 4 windows of length 2: sum of x[m+k] for m<4, k<2
    assert out["y"] == pytest.approx(sum(i + j for i in range(4) for j in range(2)) + 16 + 4)


def test_abi_orders_broadcast_and_contraction():
    x, W, b = rng.random((5, 3)), rng.random((3, 4)), rng.random(4)
    out = run("""dim batch
dim f = 3, h = 4
input x[batch, f]
param W[f, h], b[h]
y = x @ W + b
out y
out yt[h, batch] = y
out v = b @ b
""", x=x, W=W, b=b)
    np.testing.assert_allclose(out["y"], x @ W + b)
    np.testing.assert_allclose(out["yt"], (x @ W + b).T)
    np.testing.assert_allclose(out["v"], b @ b)


def test_declaration_order_is_abi_order():
    A = rng.random((3, 4))
    out = run("""dim n = 4, m = 3
input A[m, n]
out B = A * 2
""", A=A)
    # the output order follows first declaration of the edge names: n then m
    np.testing.assert_allclose(out["B"], 2 * A.T)


def test_precedence_and_operators():
    a, b = rng.random(3) + 0.5, rng.random(3) + 0.5
    out = run("""dim i = 3
input a[i], b[i]
out p = -a ^ 2 + a * b / b - a
out c = a < b
out e = a == a
out q = 2 ^ 3 ^ 2
""", a=a, b=b)
    np.testing.assert_allclose(out["p"], -(a ** 2) + a * b / b - a)
    np.testing.assert_allclose(out["c"], (a < b).astype(float))
    np.testing.assert_allclose(out["e"], np.ones(3))
    assert out["q"] == 2 ** 9


def test_reductions():
    x = rng.standard_normal((3, 4))
    out = run("""dim i = 3, j = 4
input x[i, j]
out s = sum[j](x)
out mu = mean[i](x)
out mx = max[j](x)
out mn = min(x)
out all = mean(x)
out r = max(0, x)
""", x=x)
    np.testing.assert_allclose(out["s"], x.sum(1))
    np.testing.assert_allclose(out["mu"], x.mean(0))
    np.testing.assert_allclose(out["mx"], x.max(1))
    np.testing.assert_allclose(out["mn"], x.min())
    np.testing.assert_allclose(out["all"], x.mean())
    np.testing.assert_allclose(out["r"], np.maximum(0, x))


def test_rename_swap_and_transpose_product():
    A = rng.random((3, 3))
    out = run("""dim n = 3
input A[i: n, j: n]
dim kk = 3
out At[i, j] = A[i -> j, j -> i]
out AtA = A[j -> k] @ A
input dummy[k: n]
""".replace("out AtA = A[j -> k] @ A\ninput dummy[k: n]\n", "input dummy[k: n]\nout AtA[k, j] = A[j -> k] @ A\n"),
        A=A, dummy=np.zeros(3))
    np.testing.assert_allclose(out["At"], A.T)
    np.testing.assert_allclose(out["AtA"], A.T @ A)


def test_conv_stride_padding_flip_and_concat():
    x = rng.random(9)
    a, b = rng.random(2), rng.random(3)
    out = run("""dim t = 9, s = 5, k = 3, t1 = 2, t2 = 3, tt = 5
input x[t]
input a[t1], b[t2]
out win[s, k] = x[t = 2*s + k - 1]
input r[u: t]
out flip[u] = x[t = 8 - u]
out cat[tt] = a[t1 = tt] + b[t2 = tt - size(t1)]
""", x=x, a=a, b=b, r=np.zeros(9))
    padded = np.pad(x, 1)
    np.testing.assert_allclose(out["win"], np.stack([padded[2 * s:2 * s + 3] for s in range(5)]))
    np.testing.assert_allclose(out["flip"], x[::-1])
    np.testing.assert_allclose(out["cat"], np.concatenate([a, b]))


def test_multi_head_split_and_merge():
    x = rng.random((2, 4, 48))
    out = run("""dim batch, t
dim c = 48, head = 3, hd = 16
input x[batch, t, c]
xh = x[c = hd*head + hd]
out xh[batch, t, head, hd]
out back[batch, t, c] = xh @ [c = hd*head + hd]
""", x=x)
    np.testing.assert_allclose(out["xh"], x.reshape(2, 4, 3, 16))
    np.testing.assert_allclose(out["back"], x)


def test_indicators_and_causal_mask():
    out = run("""dim s = 4
input z[t: s]
out mask[s, t] = [s <= t]
out eye[s, t] = [s = t]
""", z=np.zeros(4))
    np.testing.assert_allclose(out["mask"], np.triu(np.ones((4, 4))))
    np.testing.assert_allclose(out["eye"], np.eye(4))


def test_gather():
    E, ids = rng.random((10, 3)), np.array([[1, 9], [0, 1]], dtype=np.int32)
    out = run("""dim vocab = 10, d = 3, batch, seq
input E[vocab, d]
input ids: i32[batch, seq]
out e[batch, seq, d] = E[vocab = ids]
""", E=E, ids=ids)
    np.testing.assert_allclose(out["e"], E[ids])


def test_functions_edge_params_defaults_and_prelude():
    x = rng.standard_normal((2, 5))
    out = run("""dim b = 2, c = 5
input x[b, c]
fn scale(x, k = 2) = x * k
fn norm1[e](v) {
  s = sum[e](abs(v))
  return v / s
}
out a[b, c] = scale(x)
out k[b, c] = scale(x, k = 3)
out n[b, c] = norm1[c](x)
out sm[b, c] = softmax[c](x)
out lse = logsumexp[c](x)
""", x=x)
    np.testing.assert_allclose(out["a"], 2 * x)
    np.testing.assert_allclose(out["k"], 3 * x)
    np.testing.assert_allclose(out["n"], x / np.abs(x).sum(1, keepdims=True))
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(out["sm"], e / e.sum(1, keepdims=True))
    np.testing.assert_allclose(out["lse"], np.log(np.exp(x).sum(1)))


def test_update_targets_and_broadcast():
    W = rng.random((2, 3))
    out = run("""dim i = 2, j = 3
param W[i, j]
state m[i, j]
input lr
update W = W - lr * W
update m = 0
""", W=W, m=np.ones((2, 3)), lr=np.array(0.5))
    np.testing.assert_allclose(out["W"], 0.5 * W)
    np.testing.assert_allclose(out["m"], np.zeros((2, 3)))


@pytest.mark.parametrize("src,line,col,words", [
    ("dim n = 3\ninput x[n]\nout y = q + x\n", 3, 9, "unknown name"),
    ("dim n = 3, m = 4\ninput A[i: n]\ninput B[i: m]\n", 3, 9, "two sizes"),
    ("dim n = 3, m = 3\ninput A[n, m]\nout y = A[n -> m]\n", 3, 16, "already has"),
    ("dim n = 3\ninput x[n]\ny = x * 2\nout g = grad(sum(y), y)\n", 4, 22, "not an input"),
    ("dim n = 3, k = 2\ninput x[n]\nout y = x[n = k / 2]\n", 3, 15, "not an affine"),
    ("fn f(x) = g(x)\nfn g(x) = f(x)\ndim n = 2\ninput x[n]\nout y = f(x)\n", 2, 11, "recursive"),
    ("dim n = 3\ninput x[n]\nupdate x = x * 2\n", 3, 8, "cannot update input"),
    ("dim n = 7, m = n / 2\n", 1, 16, "divide"),
    ("dim n = 3\ninput n[n]\n", 2, 7, "already declared"),
    ("dim n = 3, m = 4\ninput A[n]\nout y = A[n -> m]\n", 3, 11, "sizes differ"),
    # an index whose value could leave int64: the native code's index arithmetic would wrap
    ("dim n = 3\ninput x[t: n]\ninput z[s: n]\nout y = x[t = 99999999999999999999*s] + z\n", 4, 15, "out of range"),
    ("dim n = 3\ninput x[t: n]\ninput z[s: n]\nout y = x[t = 4611686018427387904*s] + z\n", 4, 15, "out of range"),
    ("dim n = 3\ninput x[t: n]\ninput z[s: n]\nout y = x * [t = s - 9999999999999999999]\n", 4, 18, "out of range"),
    ("dim n\ninput x[t: n]\ninput z[s: n]\nout y = x[t = 99999999999999999999*s] + z\n", 4, 15, "out of range"),
])
def test_errors(src, line, col, words):
    e = error(src)
    assert (e.loc.line, e.loc.col) == (line, col), e.format({"t.tg": src})
    assert words in e.message


def _call_chain(n: int, wrap: int = 0) -> str:
    """f{n-1} calls f{n-2} ... calls f0: `n` calls open at once, each inside `wrap` exps."""
    fns = "".join(f"fn f{i}(a) = {'exp(' * wrap}f{i - 1}(a){')' * wrap} + 1\n" for i in range(1, n))
    return f"dim n = 3\ninput x[n]\n{fns}fn f0(a) = a\nout y = f{n - 1}(x)\n"


def test_function_calls_nested_past_the_limit_are_a_located_error():
    """Thousands of functions each calling the next overflowed Python's stack (a
    RecursionError out of `tgc.compile`); past MAX_CALL_DEPTH calls open at once the
    innermost call is a located error. Up to it, the chain compiles and runs."""
    from tgc.frontend.functions import MAX_CALL_DEPTH

    x = np.arange(3.0)
    got = evaluate(compile_source(_call_chain(MAX_CALL_DEPTH), "t.tg", Options(dtype="f64")),
                   {"x": x}, dtype="f64")
    np.testing.assert_array_equal(got["y"], x + MAX_CALL_DEPTH - 1)
    e = error(_call_chain(3000))
    assert "nested too deeply" in e.message and e.loc.line > 2 and e.loc.col > 1, e.message


def test_a_call_tree_that_doubles_is_a_located_error_not_a_hang():
    """Calls are inlined, so `fn f{i}(a) = f{i-1}(f{i-1}(a))` 30 deep asks for 2^29
    inlined calls: it ran for minutes and took gigabytes before. Past MAX_INLINED_CALLS
    inlined calls in one program the call that passes it is a located error, quickly;
    a tree under the limit compiles and runs."""
    import time

    from tgc.frontend.functions import MAX_INLINED_CALLS

    def tree(k):
        fns = "".join(f"fn f{i}(a) = f{i - 1}(f{i - 1}(a))\n" for i in range(1, k))
        return f"fn f0(a) = a + 1\n{fns}dim n = 3\ninput x[n]\nout y = f{k - 1}(x)\n"

    got = evaluate(compile_source(tree(8), "t.tg", Options(dtype="f64")), {"x": np.zeros(3)}, dtype="f64")
    np.testing.assert_array_equal(got["y"], np.full(3, 2.0 ** 7))
    t0 = time.perf_counter()
    e = error(tree(30))
    assert time.perf_counter() - t0 < 60
    assert f"over {MAX_INLINED_CALLS} function calls" in e.message and e.loc.line > 1, e.message


def test_deep_expressions_in_deep_calls_are_a_compile_error_not_a_recursion_error():
    """Each function's body within the expression limit, the calls within the call
    limit, yet together past Python's stack: a CompileError (the backstop)."""
    src = _call_chain(250, wrap=200)
    e = error(src)
    assert "nested too deeply" in e.message
