"""centered: a variance's sum of squares in the corrected two-pass form (tgc/opt/centered.py),
with --verify-each (the values unchanged in float64); where it applies and where not; the
f32 values it fixes; and softmax_projection (tgc/opt/stabilize.py), the exact sum_E p = 1
of a softmax in a log_softmax's backward."""
import numpy as np

import tgc
from passes_util import ops, optimize, same_values, tg
from tgc.options import Options
from tgc.registry import DEFAULT_PIPELINE

DERIVED = ("normalize", "adjoint", "tangent")   # the derivatives taken, nothing else: the reference

VARIANCE = """
dim b = 3, n = 8
input x[b, n], w[b]
mu = mean[n](x)
v = mean[n]((x - mu) ^ 2)
out v[b]
out gx[b, n] = grad(sum(v * w), x)
"""


def _corrected(m) -> list:
    """The max(., 0) the pass puts around each corrected sum of squares."""
    return ops(m, "map", "max")


def test_a_variance_is_corrected_and_keeps_its_values():
    before = tg(VARIANCE)
    m = optimize(before)
    assert DEFAULT_PIPELINE.index("factor") < DEFAULT_PIPELINE.index("centered") < DEFAULT_PIPELINE.index("quotients")
    (clip,) = _corrected(m)
    new = clip.operands[0]                       # sum c^2 - (sum c) (mean c)
    assert new.op == "add" and new.attrs[0] == (1.0, -1.0)
    square, correction = new.operands
    (c,) = set(square.operands)
    t, mean = sorted(correction.operands, key=lambda o: o.op != "contract")
    assert t.op == "contract" and t.operands == (c,) and t.edges == ("b",)
    assert mean.op == "add" and mean.operands == (t,) and mean.attrs[0] == (1.0 / 8,)
    same_values(optimize(before, DERIVED), m)


def test_twice_is_once():
    m = optimize(tg(VARIANCE))
    again = optimize(m, ("centered",))
    assert len(_corrected(again)) == 1 and len(ops(again)) == len(ops(m))


def test_symbolic_edge_and_a_sum_over_more_edges():
    """A mean over a symbolic edge divides by its size; a sum over (b, n) of squares
    centered along n subtracts the per-row corrections summed over b."""
    src = """
dim b = 3
dim n
input x[b, n]
mu = mean[n](x)
out v[b] = mean[n]((x - mu) * (x - mu))
out total = sum((x - mu) * (x - mu))
"""
    before = tg(src)
    m = optimize(before)
    assert len(_corrected(m)) == 2
    same_values(before, m, dims={"n": 5})


def test_layernorm_is_left_as_it_is():
    """Its output reads c itself (the error of the rounded mean, which the correction
    cannot remove): no pass over the rows is added."""
    m = optimize(tg("""
dim rows = 4, d = 8
input x[rows, d], w[d], b[d], ct[rows, d]
y = layernorm[d](x, w, b)
out y[rows, d]
out gx[rows, d] = grad(sum(y * ct), x)
"""))
    assert not _corrected(m)


def test_not_centered_no_correction():
    """x - mean over another edge, or a mean of a different value, is not centered along n."""
    m = optimize(tg("""
dim b = 3, n = 8
input x[b, n], y[b, n]
out v1[b] = sum[n]((x - mean[n](y)) ^ 2)
out v2[n] = sum[b]((x - mean[n](x)) ^ 2)
"""))
    assert not _corrected(m)


def test_f32_variance_at_an_offset():
    """Rows 1e5 away from 0 with unit spread: var + d^2 (d the mean's rounding) before,
    the variance to f32 accuracy after."""
    rng = np.random.default_rng(5)
    x = (1e5 + rng.standard_normal((4, 4096))).astype(np.float32)
    want = x.astype(np.float64).var(-1)
    src = "dim b = 4, n = 4096\ninput x[b, n]\nmu = mean[n](x)\nout v[b] = mean[n]((x - mu) * (x - mu))"
    got = tgc.compile(src, backend="cpu")(x=x)["v"]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    plain = tgc.compile(src, backend="cpu", options=Options(passes=tuple(p for p in DEFAULT_PIPELINE
                                                                           if p != "centered")))(x=x)["v"]
    assert np.max(np.abs(plain - want) / want) > 1e-6   # what the pass fixes


def test_deviations_of_an_ulp_at_3e23():
    """Rows of 3e23 and its next float, alternately: the mean rounds half an ulp (9e15)
    from the true one, sum c = 3.7e19 over 4096 terms, whose square is past f32's range;
    the correction (sum c)(mean c) = 3.3e35 is not, nor is the variance, 8.1e31."""
    base = np.float32(3e23)
    row = np.where(np.arange(4096) % 2 == 0, base, np.nextafter(base, np.float32(np.inf)))
    x = np.stack([row, row[::-1]]).astype(np.float32)
    want = x.astype(np.float64).var(-1)
    src = "dim b = 2, n = 4096\ninput x[b, n]\nmu = mean[n](x)\nout v[b] = mean[n]((x - mu) * (x - mu))"
    got = tgc.compile(src, backend="cpu")(x=x)["v"]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_a_row_of_equal_values_has_variance_zero():
    x = np.full((2, 48), 1234.567, np.float32)
    got = tgc.compile("dim b = 2, n = 48\ninput x[b, n]\nmu = mean[n](x)\nout v[b] = mean[n]((x - mu) * (x - mu))",
                      backend="cpu")(x=x)["v"]
    assert np.all(got >= 0) and np.all(got < 1e-9)


# ------------------------------------------------------------ softmax_projection (stabilize)

ENTROPY = """
dim b = 2, c = 6
input x[b, c]
h = -sum[c](softmax[c](x) * log_softmax[c](x))
out h[b]
out gx[b, c] = grad(sum(h), x)
"""


def test_entropy_gradient_drops_the_softmax_term():
    """g - p sum(g) with g = -p log p - p: the -p term gives -p + p sum(p) = 0 exactly, and
    goes; what is left is -p log p - p sum(-p log p)."""
    before = tg(ENTROPY)
    m = optimize(before)
    gx = next(o.value for o in m.outputs if o.name == "gx")
    p = next(v for v in ops(m, "map", "exp"))
    from tgc.ir.values import topo_order

    assert not [v for v in topo_order([gx]) if v.op == "add" and p in v.operands]   # no term p in its sums
    same_values(optimize(before, DERIVED), m)


def test_entropy_gradient_where_a_probability_rounds_to_one():
    import torch

    x = (1e4 + 30 * np.random.default_rng(28).standard_normal((4, 16))).astype(np.float32)
    got = tgc.compile(ENTROPY.replace("b = 2, c = 6", "b = 4, c = 16"), backend="cpu")(x=x)["gx"]
    t = torch.from_numpy(x.astype(np.float64)).requires_grad_(True)
    h = -(torch.softmax(t, -1) * torch.log_softmax(t, -1)).sum()
    (want,) = torch.autograd.grad(h, t)
    want = want.numpy()
    assert np.max(np.abs(got - want)) <= 1e-6 * np.max(np.abs(want))


LOOP = """
dim layer, b = 2, n = 8
input x0[b, n], s[layer, n]
fn step(h, s) {{
  c = h - mean[n](h)
  return {ret}
}}
out y[b, n] = repeat[layer](step, x0, s)
"""


def _in_bodies(m) -> list:
    from tgc.ir.values import topo_order

    return [v for L in ops(m, "loop") for v in topo_order(L.attrs[0].results) if v.op == "map" and v.attrs[0] == "max"]


def test_in_a_loop_body_only_where_nothing_else_reads_c():
    """A body's results are read after the loop, where c may be read too: there the sum
    is corrected only when c is read by nothing but sums of its squares."""
    m = optimize(tg(LOOP.format(ret="h + mean[n](c * c) * s")))
    assert len(_in_bodies(m)) == 1
    m = optimize(tg(LOOP.format(ret="c / sqrt(mean[n](c * c) + 1e-5) + s")))
    assert not _in_bodies(m)
