"""Programs that mutation fuzzing of the examples found wrong (each test says which).

LANGUAGE.md section 8: "any term multiplied by an exact 0 adds nothing to a
derivative even where its own derivative is infinite or undefined". A convolution's
padding taps read exact zeros, so a NaN cotangent there (here from `sqrt` of a negative
pre-activation) adds nothing to the kernel's gradient at those taps. Found by mutation
fuzzing of examples/conv1d.tg (`dim len = 2`, `relu` replaced by `sqrt`): the CPU
backend gives 0 at the padding taps; the reference interpreters (interp, lowered) give
NaN, a dense product with the zero-filled window (0 * NaN)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tgc

ROOT = Path(__file__).resolve().parents[2]


def source() -> str:
    src = (ROOT / "examples" / "conv1d.tg").read_text()
    src = src.replace("dim len  = 64", "dim len  = 2").replace("relu(windows @ K + bias)", "sqrt(windows @ K + bias)")
    assert "dim len  = 2" in src and "sqrt(windows" in src
    return src


def inputs():
    rng = np.random.default_rng(3)
    return dict(x=rng.standard_normal((3, 4, 2)), target=rng.standard_normal((3, 8, 1)),
                K=rng.standard_normal((8, 4, 4)), bias=rng.standard_normal(8), lr=0.1)


@pytest.mark.parametrize("backend", [
    "cpu",
    pytest.param("interp", marks=pytest.mark.xfail(strict=True, reason="the interpreter multiplies the zero padding by the NaN cotangent")),
    pytest.param("lowered", marks=pytest.mark.xfail(strict=True, reason="the lowered interpreter multiplies the zero padding by the NaN cotangent")),
])
def test_padding_taps_take_no_nan_from_the_cotangent(backend):
    prog = tgc.compile(source(), backend=backend, dtype="f64", options=tgc.Options())
    args = inputs()
    names = {s.name for s in prog.inputs}
    dK = prog(**{k: v for k, v in args.items() if k in names}, updates=False)["dK"]
    assert np.isnan(dK).any()                      # the cotangent is NaN where the window is real
    assert (dK[:, :, 0] == 0).all() and (dK[:, :, 3] == 0).all(), dK[0]   # taps 0 and 3 read only padding


def test_a_power_of_inf_compiles_and_matches_the_interpreter():
    """`x ^ inf` (a fuzzed custom_grad.tg: `(pred - y) ^ inf`) was an internal error in
    the CPU code generator (`int(inf)` testing for an integer exponent)."""
    src = "dim n = 5\ninput x[n]\nout y = x ^ inf\nout z = x ^ -inf\n"
    x = np.array([-2.0, -0.5, 0.0, 0.5, 2.0])
    want = tgc.compile(src, backend="interp", dtype="f64")(x=x)
    got = tgc.compile(src, dtype="f64")(x=x)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
