"""quotients: a product's reciprocal factors become divisions at the end of the pipeline
(tgc/opt/quotients.py): golden forms with --verify-each, the values unchanged, and the
f32 values that the reciprocal form got wrong."""
import numpy as np

import tgc
from passes_util import body, ops, optimize, same_values, tg
from tgc.registry import DEFAULT_PIPELINE


def _recip_factors(m) -> list:
    """Contractions with a factor 1/b."""
    return [v for v in ops(m, "contract")
            if any(o.op == "map" and o.attrs[0] == "div" and o.operands[0].op == "const"
                   and o.operands[0].attrs[0] == 1.0 for o in v.operands)]


def test_quotients_and_their_derivatives_are_divisions():
    m = optimize(tg("""
dim n = 4
input x[n], y[n]
out z = x / y
out dy = grad(sum(x / y), y)
"""))
    assert DEFAULT_PIPELINE.index("quotients") > DEFAULT_PIPELINE.index("factor")
    assert body(m).splitlines() == [
        "%0 = map[div] %x, %y : f64[n]",
        "%1 = const[1.0] : f64[]",
        "%2 = map[div] %1, %y : f64[n]",
        "%3 = map[mul0] %0, %2 : f64[n]",      # -(x/y) (1/y): the cotangent first, never (1/y)(1/y)
        "%4 = add[-1.0] %3 : f64[n]",
        "out z = %0 : [n]",
        "out dy = %4 : [n]"]


def test_a_reciprocal_inside_a_sum_divides_the_factor_with_its_edges():
    src = """
dim n = 4, m = 3
input x[n, m], y[m], w[n]
out s[n] = sum[m](x / y)
out t = sum(w * sum[m](x / y))
"""
    before = tg(src)
    m = optimize(before)
    assert not _recip_factors(m)
    assert all(v.operands[0].edges == ("m", "n") for v in ops(m, "map", "div"))   # x / y, elementwise
    same_values(before, m)


def test_a_safe_hoisted_reciprocal_stays_a_factor():
    """layernorm's 1/sqrt(var + eps) is per row, normal and at most 2^40: one division per row,
    a multiplication per element (a division per element was 1.5x slower at 64 x 256)."""
    m = optimize(tg("""
dim rows = 4, d = 8
input x[rows, d], w[d], b[d]
out y[rows, d] = layernorm[d](x, w, b)
"""))
    kept = _recip_factors(m)
    assert kept and all(o.edges == ("rows",) for v in kept for o in v.operands if o.op == "map")


def test_f32_quotients_at_the_extremes():
    p = tgc.compile("""
dim n = 4
input x[n], y[n]
out z = x / y
out dy = grad(sum(x / y), y)
""", backend="cpu")
    x = np.array([1e-20, 1e-39, 3e38, 6.0], np.float32)
    y = np.array([1e-20, 1e-39, 3e38, 3.0], np.float32)
    r = p(x=x, y=y)
    np.testing.assert_array_equal(r["z"], np.float32([1, 1, 1, 2]))
    assert np.isfinite(r["dy"][[0, 2, 3]]).all()
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    np.testing.assert_allclose(r["dy"][[0, 2, 3]], -(x64 / y64 / y64)[[0, 2, 3]], rtol=1e-6)
