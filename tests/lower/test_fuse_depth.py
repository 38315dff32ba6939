"""fuse cuts a long chain of single-use elementwise values into kernels that meet at a
buffer (`MAX_INLINE_DEPTH`): a program of hundreds of chained bindings compiles (it
used to overflow Python's recursion limit while building one kernel's expression) and
computes what numpy computes step by step."""
from __future__ import annotations

import numpy as np

import tgc
from tgc.frontend.elaborate import elaborate_source
from tgc.lower.fuse import MAX_INLINE_DEPTH
from tgc.lower.lowered import LoopKernel
from tgc.options import Options
from tgc.pipeline import lower_module

N = 1500


def chain(n: int, step: str, edges: str = "") -> str:
    """`y0 = step(x)`, `y1 = step(y0)`, ...: every value read once, by the next."""
    head = "dim n = 5\ninput x[n]\n" if edges else "input x\n"
    body = "\n".join(f"y{i} = {step.format('x' if i == 0 else f'y{i - 1}')}" for i in range(n))
    return f"{head}{body}\nout y{n - 1}{edges}\n"


def test_a_long_chain_is_cut_into_kernels_of_bounded_depth():
    m = elaborate_source(chain(N, "{} * 1.0001 + 0.5"), "<chain>", Options()).module
    low = lower_module(m, Options(), stop_after="fuse")
    loops = [k for k in low.kernels if isinstance(k, LoopKernel)]
    assert len(loops) >= N // MAX_INLINE_DEPTH


def test_a_long_scalar_chain_and_its_derivative_match_numpy():
    src = chain(N, "{} * 1.0001 + 0.5").replace(f"out y{N - 1}\n", f"out y{N - 1}\nout g = grad(y{N - 1}, x)\n")
    r = tgc.compile(src, dtype="f64")(x=1.0)
    want = 1.0
    for _ in range(N):
        want = want * 1.0001 + 0.5
    np.testing.assert_allclose(r[f"y{N - 1}"], want, rtol=1e-12)
    np.testing.assert_allclose(r["g"], 1.0001 ** N, rtol=1e-12)


def test_a_long_tensor_chain_with_kinks_matches_numpy():
    x = np.linspace(-1, 1, 5)
    for dtype, tol in (("f64", 1e-12), ("f32", 1e-5)):
        r = tgc.compile(chain(N, "abs({} * 0.999 - 0.01)", "[n]"), dtype=dtype)(x=x)[f"y{N - 1}"]
        want = x.copy()
        for _ in range(N):
            want = np.abs(want * 0.999 - 0.01)
        np.testing.assert_allclose(r, want, rtol=tol, atol=tol)
