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



# ------------------------------------------------------------ counts: 1/max(deg, 1) per node
def test_a_count_is_bounded_by_its_edge_sizes():
    """A sum of terms in [0, 1] (a scatter of ones, a sum of indicators) is at most the
    size of the summed edge: its fixed size, or 2^62 (the limit every call checks); a sum
    of terms of at most 2 twice that; unbounded without sizes or for terms with no bound."""
    from tgc.ir import values as V
    from tgc.opt.facts import Facts, edge_bounds

    m = tg("dim n, e, g = 5\ninput x[n], ids: i32[e], gids: i32[g]\nout y[n] = x")
    facts = Facts({}, edge_bounds(m))
    ids, gids = V.arg("ids", "i32", ("e",)), V.arg("gids", "i32", ("g",))
    assert facts.upper(V.scatter(V.const(1.0, "f64", ("e",)), ids, "n")) == 2.0 ** 62
    assert facts.upper(V.scatter(V.const(1.0, "f64", ("g",)), gids, "n")) == 5.0
    assert facts.upper(V.contract([V.const(2.0, "f64", ("g",))], ())) == 10.0
    assert facts.upper(V.contract([V.const(-2.0, "f64", ("e",))], ())) == 0.0   # terms <= 0
    x = V.arg("x", "f64", ("n",))
    assert facts.upper(V.scatter(V.gather(x, ids, "n"), ids, "n")) == float("inf")   # x has no bound
    assert facts.upper(V.size("e", "f64")) == 2.0 ** 62 and facts.upper(V.size("g", "f64")) == 5.0
    assert Facts().upper(V.scatter(V.const(1.0, "f64", ("g",)), gids, "n")) == float("inf")   # no sizes


MEAN = """
dim n{n}, e{e}, f = 3
input x[n, f], src: i32[e], dst: i32[e]
deg = sum[e]({count})
inv = 1 / max(deg, {floor})
out y[n, f] = (x[n = src] @ [n = dst]) * inv
"""


def _mean(n="", e="", count="[n = dst]", floor="1", dtype="f64"):
    return tg(MEAN.format(n=n, e=e, count=count, floor=floor), dtype)


def _per_node(m) -> bool:
    """1/max(deg, ...) is a reciprocal over n alone, and nothing divides per element."""
    divs = ops(m, "map", "div")
    return bool(divs) and all(v.operands[0].op == "const" and v.edges == ("n",) for v in divs)


def test_a_mean_over_a_count_multiplies_by_one_reciprocal_per_node():
    """A graph convolution's mean: deg counts a node's in-edges (at most 2^62, and at
    least 1 under the max), so 1/max(deg, 1) is normal and at most 1: one division per
    node, a multiplication per feature (a division per element was 560-725 -> 773-836 us
    on benchmarks/workloads/gcn.tg)."""
    before = _mean()
    m = optimize(before)
    assert _per_node(m)
    assert body(m).splitlines() == [
        "%0 = const[1.0] : f64[]",
        "%1 = const[1.0] : f64[e]",
        "%2 = scatter[n] %1, %dst : f64[n]",
        "%3 = map[max] %2, %0 : f64[n]",
        "%4 = map[div] %0, %3 : f64[n]",        # one reciprocal per node
        "%5 = gather[n] %4, %dst : f64[e]",
        "%6 = gather[n] %x, %src : f64[e, f]",
        "%7 = contract %5, %6 : f64[e, f]",     # a product per element
        "%8 = scatter[n] %7, %dst : f64[f, n]",
        "out y = %8 : [n, f]"]
    same_values(before, m)
    fixed = optimize(_mean(n=" = 6", e=" = 20"))                    # fixed sizes: bound 20
    assert _per_node(fixed)


def test_counts_without_a_safe_bound_divide_per_element():
    """Where 1/b is not provably normal and at most 2^40 the quotient stays a division:
    a sum of unbounded values, terms of at most 2 over a symbolic edge (2^63), a count
    over two symbolic edges (2^124), a floor below 2^-40, a divisor without a floor."""
    cases = {
        "unbounded terms": _mean(count="[n = dst] * x[n = src, f = 0]"),
        "terms up to 2 over a symbolic edge": _mean(count="2 * [n = dst]"),
        "a floor below 2^-40": _mean(floor="1e-13"),
        "no floor": tg(MEAN.replace("max(deg, {floor})", "deg").format(n="", e="", count="[n = dst]")),
    }
    for why, before in cases.items():
        m = optimize(before)
        assert not _per_node(m), why
        assert any(v.operands[0].op != "const" for v in ops(m, "map", "div")), why
    two = tg("""
dim n, e, k, f = 3
input x[n, f], dst: i32[e, k]
inv = 1 / max(sum[e, k]([n = dst]), 1)
out y[n, f] = x * inv
""")
    m = optimize(two)
    assert not _recip_factors(m) and [v.operands[0].op for v in ops(m, "map", "div")] == ["arg"]   # x / max(...)
    # with fixed sizes the same count is bounded and terms of at most 2 are too
    assert _per_node(optimize(_mean(e=" = 20", count="2 * [n = dst]")))


def test_mean_aggregation_f32_against_numpy():
    """The compiled mean (one reciprocal per node, f32) against numpy's quotient in f64:
    isolated nodes (deg 0 -> max 1), a hub of 5000 in-edges."""
    p = tgc.compile(MEAN.format(n="", e="", count="[n = dst]", floor="1"), backend="cpu")
    rng = np.random.default_rng(0)
    n, e = 50, 6000
    dst = np.concatenate([np.zeros(5000, np.int32), rng.integers(1, 40, e - 5000).astype(np.int32)])
    src = rng.integers(0, n, e).astype(np.int32)
    x = rng.standard_normal((n, 3)).astype(np.float32)
    y = p(x=x, src=src, dst=dst)["y"]
    agg = np.zeros((n, 3))
    np.add.at(agg, dst, x.astype(np.float64)[src])
    ref = agg / np.maximum(np.bincount(dst, minlength=n), 1)[:, None]
    np.testing.assert_allclose(y, ref, rtol=2e-5, atol=1e-6)
    assert (y[40:] == 0).all()

