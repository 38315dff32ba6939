"""A square product whose readers sum its rows over its first group (lit test
lower_layout_rows_square.tg: stored with that group innermost) computes what the
interpreter computes, on the CPU in f32 and f64."""
import numpy as np
import pytest

import tgc
from tgc.ir.interp import evaluate
from tgc.frontend.elaborate import elaborate_source
from tgc.lower.lowered import GemmKernel
from tgc.options import Options
from tgc.pipeline import lower, lower_module

SRC = """\
dim q = 64, s = 64, d = 32
input a[q, d]
input b[s, d]
out y[s, d] = sum[q](softmax[q](sum[d](a * b)) * a)
"""


def scores_order(**opts) -> tuple[str, ...]:
    options = Options(dtype="f32").with_(**opts)
    module = lower(elaborate_source(SRC, "<test>", options).module, options).module
    low = lower_module(module, options, stop_after="layout")
    gemm = next(k for k in low.kernels if isinstance(k, GemmKernel))
    return low.buffers[gemm.out].order


def test_the_scores_are_stored_with_the_summed_group_innermost():
    assert scores_order() == ("s", "q")   # rows of 64 (Options.layout_tie_rows)


def test_shorter_rows_keep_the_size_rule_order():
    # rows under layout_tie_rows are summed down the columns of a block of rows
    assert scores_order(layout_tie_rows=65) == ("q", "s")


@pytest.mark.parametrize("dtype,rtol", [("f64", 1e-12), ("f32", 1e-5)])
def test_cpu_matches_the_interpreter(dtype, rtol):
    rng = np.random.default_rng(0)
    ins = {"a": rng.standard_normal((64, 32)), "b": rng.standard_normal((64, 32)) * 0.3}
    options = Options(dtype="f64")
    want = evaluate(lower(elaborate_source(SRC, "<test>", options).module, options).module, ins, dtype="f64")["y"]
    got = tgc.compile(SRC, dtype=dtype)(**{k: v.astype(dtype.replace("f", "float")) for k, v in ins.items()})["y"]
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=rtol * np.abs(want).max())
