"""Defects found by differential fuzzing of random programs against a numpy evaluator
(probe17): each test is the minimal program that gave a wrong result, a crash or a
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
