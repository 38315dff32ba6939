"""Defects found by an outsider's probe of the language (probe11): each test is the
minimal program that gave a wrong result, a crash or a hang, checked on every backend
that runs it against an independent computation."""
import numpy as np
import pytest

import tgc


def _tanh_chain(n: int) -> str:
    return ("dim n = 3\ninput x[n]\nh0 = x\n" + "".join(f"h{i + 1} = tanh(h{i})\n" for i in range(n))
            + f"out y = grad(sum(h{n}), x)\n")


@pytest.mark.parametrize("backend", ["interp", "lowered", "cpu"])
def test_a_product_of_more_factors_than_einsum_takes(backend):
    """The gradient of 40 chained tanh is one product of 80 factors (tanh' = (1 - t)(1 + t)):
    numpy's einsum takes at most 63 operands, so the reference interpreter (`tgc run`'s
    default backend) failed with an internal error `too many operands`."""
    n = 40
    x = np.array([0.5, -1.0, 2.0])
    got = tgc.compile(_tanh_chain(n), backend=backend, dtype="f64")(x=x)["y"]
    h, want = x.copy(), np.ones(3)
    for _ in range(n):
        h = np.tanh(h)
        want = want * (1 - h * h)
    np.testing.assert_allclose(got, want, rtol=1e-13)
