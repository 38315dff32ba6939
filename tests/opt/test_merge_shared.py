"""Merging nested products into their user never duplicates a shared value, through
renames too (`tgc.opt.rewrite`: uses are counted on the value under its renames).

An unrolled recurrence's backward pass shares each step's cotangent between the
weight gradient and the step before; merging it through a renaming once copied the
whole chain into every weight-gradient term: quadratic FLOPs, and a compile time that
grew faster than N^2 (20 steps: minutes)."""
from __future__ import annotations

import numpy as np
import pytest

from tgc import pipeline
from tgc.frontend import compile_source
from tgc.ir.interp import evaluate
from tgc.opt.stats import module_stats
from tgc.options import Options


def recurrence(n: int) -> str:
    lines = ["dim g = 4, h = 4", "input x[h]", "param W[g, h]", "y0 = x"]
    lines += [f"y{i} = tanh(y{i - 1}[h -> g] @ W) + x" for i in range(1, n + 1)]
    return "\n".join(lines + [f"out dW = grad(sum(y{n}), W)"]) + "\n"


def optimized(n: int):
    opts = Options(dtype="f64")
    return pipeline.lower(compile_source(recurrence(n), "rnn.tg", opts), opts).module


def test_an_unrolled_recurrence_stays_linear():
    small, large = (module_stats(optimized(n), 64) for n in (8, 16))
    assert large.flops < 2.3 * small.flops and large.ops < 2.3 * small.ops
    widest = max((len(v.operands) for v in optimized(16).values() if v.op == "contract"), default=0)
    assert widest <= 4


@pytest.mark.parametrize("n", [3, 9])
def test_its_gradient_is_the_interpreters(n):
    opts = Options(dtype="f64")
    source = compile_source(recurrence(n), "rnn.tg", opts)
    rng = np.random.default_rng(n)
    inputs = {"x": rng.standard_normal(4), "W": rng.standard_normal((4, 4)) * 0.5}
    derived = pipeline.lower(source, opts.with_(passes=("adjoint", "tangent"))).module   # not simplified
    want = evaluate(derived, inputs)["dW"]
    got = pipeline.compile_module(optimized(n), opts)(**inputs)["dW"]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
