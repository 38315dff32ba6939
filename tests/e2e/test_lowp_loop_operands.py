"""bf16/f16 operands of loops and conversions, found by differential fuzzing of random
programs against a numpy evaluator: each test is the minimal program that gave a wrong result, a crash or a
refused valid program, checked on the backends that run it."""
import numpy as np
import pytest

import tgc

_LOW_STACKED = """
dim d = 3, l = 3
input x: bf16[d]
param V: bf16[l, d]
param U: bf16[l]
fn step(h, a) = h * a + 0.5
"""


@pytest.mark.parametrize("init", ["x * 2", "x - logsumexp[d](x)"])
@pytest.mark.parametrize("backend", ["interp", "lowered", "cpu"])
def test_a_loop_over_computed_bf16_operands(backend, init):
    """`repeat[l](step, x * 2, V + U)` with bf16 `x`, `V`, `U`: the initial value and the
    stacked argument are bf16 expressions (computed in f32, rounded to bf16). The loop's
    parameters took the unrounded f32 type, and the rounding pass then failed with an
    internal error ('the loop's operand 1 (slice) has type bf16[l, d], its body parameter
    f32[d]'); a prelude call's roundings inside (`logsumexp` of bf16) are made explicit as
    well, else the carry was f32 at the call and bf16 after the rounding pass (the same
    internal error). The loop equals its steps written out."""
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    tail = "out y\nout g = grad(sum(f32(y) * f32(y)), V)\n"
    loop = _LOW_STACKED + f"y = repeat[l](step, {init}, V + U)\n" + tail
    written = (_LOW_STACKED + f"a = V + U\nh0 = {init}\n"
               + "".join(f"h{i + 1} = step(h{i}, a[l = {i}])\n" for i in range(3)) + "y = h3\n" + tail)
    rng = np.random.default_rng(0)
    args = {"x": rng.standard_normal(3).astype(bf16), "V": rng.standard_normal((3, 3)).astype(bf16),
            "U": rng.standard_normal(3).astype(bf16)}
    got = tgc.compile(loop, backend=backend)(**args)
    want = tgc.compile(written, backend=backend)(**args)
    assert got["y"].dtype == bf16
    np.testing.assert_array_equal(got["y"].astype(np.float32), want["y"].astype(np.float32))
    np.testing.assert_allclose(got["g"].astype(np.float32), want["g"].astype(np.float32), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("backend", ["interp", "cpu"])
@pytest.mark.parametrize("loop", [False, True])
def test_a_conversion_of_a_call_on_a_low_expression(backend, loop):
    """`f32(tanh(x * 0.5))` with f16 `x`: the product is f16, tanh of it f16 (rounded once),
    and the conversion makes it f32. The conversion looked at its operand before the
    product's rounding was explicit, saw an f32 tanh and dropped itself; the rounding pass
    then rounded tanh to f16, so the program returned f16 (and a loop step so written
    was refused: 'the step returns f16[d], but the carry is f32[d]')."""
    x = np.array([[0.3, 1.7], [-0.9, 0.05]], np.float16)
    if loop:
        src = ("dim d = 2, L = 2\ninput x: f16[L, d]\ninput h0[d]\n"
               "fn step(h, a) = f32(tanh(a * 0.5))\nout y = repeat[L](step, h0, x)\n")
        got = tgc.compile(src, backend=backend)(x=x, h0=np.zeros(2, np.float32))["y"]
        row = x[1]
    else:
        src = "dim d = 2, L = 2\ninput x: f16[L, d]\nout y[L, d] = f32(tanh(x * 0.5))\n"
        got = tgc.compile(src, backend=backend)(x=x)["y"]
        row = x
    prod = (row.astype(np.float32) * np.float32(0.5)).astype(np.float16)
    want = np.tanh(prod.astype(np.float32)).astype(np.float16).astype(np.float32)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


_NESTED_BF16 = """
dim d = 2, L = 2, M = 2
input h0[d]
param W: bf16[M, L]
fn inner(h, b) = 0.5 * h + 0.5 * tanh(h * b)
fn outer(h, a) = tanh(repeat[M](inner, h, a) + 0.5 * h)
"""


@pytest.mark.parametrize("backend", ["interp", "cpu"])
def test_a_nested_loop_over_a_bf16_argument(backend):
    """The outer loop reads slices W[L = i] of a bf16 `W` and passes them to an inner loop.
    Unrolling the outer loop built each slice as a product with an indicator, which has
    the f32 compute type, so the inner loop no longer fit its bf16 parameter (internal
    error 'the loop's operand 1 (slice) has type f32[M], its body parameter bf16[]').
    Unrolled, kept as a loop, and written out, the program gives one answer."""
    import ml_dtypes

    loop = _NESTED_BF16 + "y = repeat[L](outer, h0, W)\nout y\nout g = grad(sum(y * y), W)\n"
    written = _NESTED_BF16 + ("y = outer(outer(h0, W[L = 0]), W[L = 1])\nout y\n"
                              "out g = grad(sum(y * y), W)\n")
    rng = np.random.default_rng(0)
    args = {"h0": rng.standard_normal(2).astype(np.float32),
            "W": rng.standard_normal((2, 2)).astype(ml_dtypes.bfloat16)}
    want = tgc.compile(written, backend=backend)(**args)
    for options in (None, tgc.Options(unroll_max_ops=0)):
        got = tgc.compile(loop, backend=backend, options=options)(**args)
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-6)
        np.testing.assert_allclose(got["g"].astype(np.float32), want["g"].astype(np.float32), rtol=0.02, atol=0.02)
