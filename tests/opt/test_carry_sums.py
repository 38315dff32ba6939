"""carry_sums: a loop's f32 running sum is carried compensated (tgc/opt/carry_sums.py).
The golden IR is tests/opt/carry_sums.tgir. Here: which carries the rule takes (a
cumulative sum and its gradient) and which it leaves (a residual stream over layers
and its gradient, the depth benchmark's model, an RNN's state and its shared weights'
gradients, f64 and --fp-strict programs); every backend gives the same bits, each within
an f32 rounding of the exact running sum where the plain f32 loop is hundreds of
roundings off. The errors against PyTorch are tests/e2e/test_numerics_f32_probe.py's
(`cumsum_scan_*`, `rnn_tanh_1000_steps`)."""
import sys

import numpy as np
import pytest

import tgc
from backends_util import backends
from numerics_util import Case, tgc_outputs
from passes_util import ROOT, optimize, tg
from tgc.ir.values import topo_order
from tgc.options import Options
from tgc.registry import DEFAULT_PIPELINE, STRICT_PIPELINE

WITHOUT = tuple(p for p in DEFAULT_PIPELINE if p != "carry_sums")

CUMSUM = """
dim t = 1000, n = 4
input xs[t, n], h0[n], ct[t, n]
fn add(h, x) = h + x
cs = scan[t](add, h0, xs)
out cs[t, n]
out gx[t, n] = grad(sum(cs * ct), xs)
out gh[n] = grad(sum(cs * ct), h0)
"""

RESIDUAL = """
dim layer = 20, b = 4, d = 16
input x0[b, d], ct[b, d]
param Ws[layer, d: d, e: d], g[layer, d]
fn block(x, W, g) = x + 0.1 * tanh(rmsnorm[d](x, g) @ W)[e -> d]
y = repeat[layer](block, x0, Ws, g)
out y[b, d]
out dWs[layer, d, e] = grad(sum(y * ct), Ws)
out dx0[b, d] = grad(sum(y * ct), x0)
"""

RNN = """
dim t = 100, b = 4, h = 8, i = 3
input xs[t, b, i], h0[b, h], ct[b, h]
param U[i, h], W[h, g: h]
fn cell(hh, x, U, W) = tanh(x @ U + (hh @ W)[g -> h])
hT = repeat[t](cell, h0, xs, U * [t = t], W * [t = t])
out hT[b, h]
out dU[i, h] = grad(sum(hT * ct), U)
out dW[h, g] = grad(sum(hT * ct), W)
"""


def _carries(m) -> list[tuple[int, int]]:
    """(carries, slices) of each loop body, in the order the module reaches them."""
    bodies = []
    for v in topo_order(m.roots()):
        if v.op == "loop" and v.attrs[0] not in bodies:
            bodies.append(v.attrs[0])
    return [(b.carries, b.slices) for b in bodies]


def _both(src: str, dtype: str = "f32"):
    m = tg(src, dtype)
    return _carries(optimize(m, WITHOUT, seeds=(0,))), _carries(optimize(m, DEFAULT_PIPELINE, seeds=(0,)))


def test_a_cumulative_sum_and_its_gradient_are_compensated():
    """The forward scan adds x[t] to its carry, the reverse loop adds ct[t] into the
    carry's cotangent: each gains one compensation carry."""
    off, on = _both(CUMSUM)
    assert off == [(1, 1), (1, 2)]
    assert on == [(2, 1), (2, 2)]


def test_a_residual_stream_and_its_gradient_keep_one_carry():
    """x + f(x) and its gradient ct + J^T ct read their carry in the increment."""
    off, on = _both(RESIDUAL)
    assert off and on == off


def test_the_depth_benchmark_model_keeps_its_carries():
    """benchmarks/loops.py's model (a transformer's blocks over `layer`): no carry of its
    forward or backward loop is compensated, so its activations keep one buffer."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import loops

    off, on = _both(loops.source(2, 32, loop=True))
    assert off and on == off


def test_an_rnn_keeps_its_carries():
    """The state tanh(x U + h W) is no sum; reverse mode accumulates dU and dW (the
    weights every step shares) by x^T g and h^T g, whose g comes from the state's
    cotangent carry: a recurrence's sums, as PyTorch's autograd makes them (one f32
    rounding a step), so no carry is compensated."""
    off, on = _both(RNN)
    assert len(off) == 2 and on == off


def test_f64_and_fp_strict_programs_are_unchanged():
    off, on = _both(CUMSUM, "f64")
    assert on == off
    assert "carry_sums" not in STRICT_PIPELINE


def test_a_second_run_changes_nothing():
    from tgc.ir.printer import print_module

    once = optimize(tg(CUMSUM, "f32"), DEFAULT_PIPELINE, seeds=(0,))
    assert print_module(optimize(once, ("carry_sums",), seeds=(0,))) == print_module(once)


# A running sum of mixed signs and magnitudes (10^-3 .. 10^3): the plain f32 loop loses
# about log2(n) bits; the compensated one is the exact prefix sum rounded once.
N = 10_000
LONG = f"""
dim t = {N}, n = 3
input xs[t, n], h0[n]
fn add(h, x) = h + x
out cs[t, n] = scan[t](add, h0, xs)
"""


def _inputs():
    rng = np.random.default_rng(7)
    xs = (rng.standard_normal((N, 3)) * 10.0 ** rng.uniform(-3, 3, (N, 3))).astype(np.float32)
    return {"xs": xs, "h0": np.float32([0.5, -1e3, 1e-3])}


def _ulps(got, inputs) -> float:
    exact = inputs["h0"].astype(np.float64) + np.cumsum(inputs["xs"].astype(np.float64), 0)
    return float(np.max(np.abs(got.astype(np.float64) - exact) / np.spacing(np.abs(exact).astype(np.float32))))


@pytest.fixture(scope="module")
def interp_bits():
    return tgc_outputs(Case("long", LONG, _inputs(), lambda T: {}), "interp")["cs"]


def test_the_compensated_sum_is_the_exact_one_rounded_once(interp_bits):
    """Within an f32 rounding (half an ulp, and what the compensation still misses) of
    the exact running sum; without the pass, hundreds of ulps."""
    inputs = _inputs()
    assert _ulps(interp_bits, inputs) <= 1.0
    plain = tgc_outputs(Case("plain", LONG, inputs, lambda T: {}, options={"passes": WITHOUT}), "interp")["cs"]
    assert _ulps(plain, inputs) > 50
    # --fp-strict keeps the program's own roundings: numpy's f32 running sum, bit for bit
    strict = tgc.compile(LONG, dtype="f32", options=Options(fp_strict=True))(**_inputs())["cs"]
    want = np.cumsum(np.concatenate([inputs["h0"][None], inputs["xs"]]), 0, dtype=np.float32)[1:]
    np.testing.assert_array_equal(strict, want)


@pytest.mark.parametrize("backend", [pytest.param(b, marks=[pytest.mark.slow] if b == "cuda-sim" else [])
                                     for b in backends()])
def test_every_backend_gives_the_interpreters_bits(backend, interp_bits):
    """No backend reassociates the two-sum's additions, contracts them or keeps one
    wider than f32: the same bits as the reference interpreter's."""
    got = tgc_outputs(Case("long", LONG, _inputs(), lambda T: {}), backend)["cs"]
    np.testing.assert_array_equal(got, interp_bits)
