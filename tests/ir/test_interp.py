"""The reference interpreter against numpy, op by op (programs written as IR text)."""
import numpy as np
import pytest

from tgc.ir.interp import EvalError, evaluate
from tgc.ir.parser import parse_module

rng = np.random.default_rng(0)


def run(text, **inputs):
    return evaluate(parse_module(text), inputs, dtype="f64")


def test_matmul_broadcast_and_abi_order():
    x, w, b = rng.random((5, 3)), rng.random((4, 3)), rng.random(4)
    out = run("""dim n
dim f = 3
dim h = 4
input x : f32[n, f]
input w : f32[h, f]
input b : f32[h]
%0 = contract %x, %w : f32[h, n]
%1 = add[1.0, 2.0] %0, %b : f32[h, n]
out y = %1 : [n, h]
out yt = %1 : [h, n]
""", x=x, w=w, b=b)
    np.testing.assert_allclose(out["y"], x @ w.T + 2 * b)
    np.testing.assert_allclose(out["yt"], (x @ w.T + 2 * b).T)


def test_three_operand_contraction_and_broadcast_result_edges():
    a, b, c = rng.random((2, 3)), rng.random((3, 4)), rng.random((4, 2))
    out = run("""dim i = 2
dim j = 3
dim k = 4
dim z = 5
input a : f32[i, j]
input b : f32[j, k]
input c : f32[k, i]
%0 = contract %a, %b, %c : f32[]
%1 = contract %a : f32[i, z]
out tr = %0 : []
out bc = %1 : [z, i]
""", a=a, b=b, c=c)
    np.testing.assert_allclose(out["tr"], np.trace(a @ b @ c))
    np.testing.assert_allclose(out["bc"], np.broadcast_to(a.sum(1), (5, 2)))


def test_reductions_and_maps():
    x = rng.standard_normal((3, 4))
    out = run("""dim i = 3
dim j = 4
input x : f32[i, j]
%0 = reduce[max: j] %x : f32[i]
%1 = reduce[min: i, j] %x : f32[]
%2 = map[exp] %x : f32[i, j]
%3 = const[0.0] : f32[]
%4 = map[gt] %x, %3 : f32[i, j]
%5 = map[sqrt] %x : f32[i, j]
%6 = map[where] %4, %5, %3 : f32[i, j]
%7 = map[mul0] %3, %5 : f32[i, j]
out mx = %0 : [i]
out mn = %1 : []
out e = %2 : [i, j]
out w = %6 : [i, j]
out z = %7 : [i, j]
""", x=x)
    np.testing.assert_allclose(out["mx"], x.max(1))
    np.testing.assert_allclose(out["mn"], x.min())
    np.testing.assert_allclose(out["e"], np.exp(x))
    np.testing.assert_allclose(out["w"], np.where(x > 0, np.sqrt(np.abs(x)), 0))
    assert np.all(out["z"] == 0)  # 0 * NaN is exactly 0 under mul0


CONV = """dim b = 2
dim t = 9
dim s = 5
dim k = 3
input x : f32[b, t]
%0 = indicator[t = k + 2*s - 1] : f32[k, s, t]
%1 = contract %x, %0 : f32[b, s, k]
out win = %1 : [b, s, k]
"""


def test_conv_window_with_stride_and_padding():
    x = rng.random((2, 9))
    out = run(CONV, x=x)["win"]
    padded = np.pad(x, ((0, 0), (1, 1)))
    ref = np.stack([padded[:, 2 * s:2 * s + 3] for s in range(5)], 1)
    np.testing.assert_allclose(out, ref)


def test_flip_split_merge_and_mask():
    x = rng.random(6)
    out = run("""dim t = 6
dim a = 2
dim c = 3
edge s : t
input x : f32[t]
%0 = indicator[t = -s + 5] : f32[s, t]
%1 = contract %x, %0 : f32[s]
%2 = indicator[t = c*a + c] : f32[a, c, t]
%3 = contract %x, %2 : f32[a, c]
%4 = contract %3, %2 : f32[t]
%5 = indicator[s <= t] : f32[s, t]
out flip = %1 : [s]
out split = %3 : [a, c]
out merged = %4 : [t]
out mask = %5 : [s, t]
""", x=x)
    np.testing.assert_allclose(out["flip"], x[::-1])
    np.testing.assert_allclose(out["split"], x.reshape(2, 3))
    np.testing.assert_allclose(out["merged"], x)
    np.testing.assert_allclose(out["mask"], np.triu(np.ones((6, 6))))


def test_gather_and_bounds_error():
    E = rng.random((5, 3))
    prog = """dim v = 5
dim d = 3
dim n
input E : f32[v, d]
input ids : i32[n]
%0 = gather[v] %E, %ids : f32[d, n]
out y = %0 : [n, d]
"""
    ids = np.array([4, 0, 4], dtype=np.int32)
    np.testing.assert_allclose(run(prog, E=E, ids=ids)["y"], E[ids])
    with pytest.raises(EvalError, match=r"'ids'\[n=1\] = 7.*size 5"):
        run(prog, E=E, ids=np.array([1, 7], dtype=np.int32))


def test_symbolic_dim_mismatch_names_edge_and_sizes():
    prog = """dim n
input a : f32[n]
input b : f32[n]
%0 = add[1.0, 1.0] %a, %b : f32[n]
out y = %0 : [n]
"""
    np.testing.assert_allclose(run(prog, a=np.ones(3), b=np.ones(3))["y"], 2 * np.ones(3))
    with pytest.raises(EvalError, match="edge 'n' has size 4, but dim 'n' is 3"):
        run(prog, a=np.ones(3), b=np.ones(4))
    with pytest.raises(EvalError, match="missing input 'b'"):
        run(prog, a=np.ones(3))
    with pytest.raises(EvalError, match="unexpected input 'c'"):
        run(prog, a=np.ones(3), b=np.ones(3), c=np.ones(3))


def test_a_value_too_big_for_memory_is_an_error_not_numpys():
    """A value of more than 2^62 bytes (each dim fits, their product does not) is an
    EvalError naming its edges, before numpy's 'array is too big'; so is one that
    does not fit in memory (here the first product, 4.9e9 elements)."""
    import pytest as _pytest

    from tgc.frontend import compile_source
    from tgc.ir.interp import EvalError, evaluate
    from tgc.options import Options

    m = compile_source("dim a\ndim c = a, e = a, f = a\ninput x[a]\nz = x * x[a -> c]\n"
                       "out s = sum(exp(z * z[a -> e, c -> f]))\n", "<t>", Options())
    with _pytest.raises(EvalError, match=r"value over \[a, c.*elements"):
        evaluate(m, {"x": np.zeros(70000, np.float32)})
    from tgc import pipeline

    lowered = pipeline.lower(m, Options()).module   # computes the 4-edge value first
    with _pytest.raises(EvalError, match=r"\[a, c, e, f\] has 24010000000000000000 elements: more than 2\^62"):
        evaluate(lowered, {"x": np.zeros(70000, np.float32)})
