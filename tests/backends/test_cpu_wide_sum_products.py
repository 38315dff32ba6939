"""A wide f32 sum's product terms (`lowered.wide_term_factors`): a two-factor product is
multiplied in f32 and the rounded product widened, unless `Options.sum_exact_products`
(the old rule: every factor widened, multiplied in f64); a product of three or more
factors stays widened. Golden counts of f64 conversions and multiplications in the
CPU's LLVM IR, and the CPU's bits against the lowered interpreter's."""
from __future__ import annotations

import re

import numpy as np

import tgc
from tgc.options import CpuOptions, Options

SUM = """
dim n = 64
input a[n], b[n], c[n], d[n], e[n]
out y[n] = a * b - c * d + e
out z[n] = a * b * c - d + e
"""


def _fp64_ops(text: str) -> tuple[int, int]:
    """(f32 -> f64 conversions, f64 multiplications) in LLVM IR `text`."""
    ext = len(re.findall(r"fpext (?:<\d+ x )?float", text))
    mul = len(re.findall(r"fmul (?:\w+ )*(?:<\d+ x )?double", text))
    return ext, mul


def _prog(src: str, exact: bool):
    return tgc.compile(src, dtype="f32", options=Options(sum_exact_products=exact, cpu=CpuOptions(threads=1)))


def test_two_factor_products_multiply_in_f32():
    src = "dim n = 64\ninput a[n], b[n], c[n], d[n], e[n]\nout y[n] = a * b - c * d + e\n"
    narrow, exact = (_fp64_ops(_prog(src, e).llvm_ir) for e in (False, True))
    assert narrow == (3, 0), narrow   # the two f32 products and e widened, added in f64
    assert exact == (5, 2), exact     # the old rule: every factor widened, multiplied in f64


def test_three_factor_product_stays_widened():
    ext, mul = _fp64_ops(_prog("dim n = 64\ninput a[n], b[n], c[n], d[n], e[n]\nout z[n] = a * b * c - d + e\n",
                               False).llvm_ir)
    assert mul >= 2 and ext >= 5, (ext, mul)


def test_cpu_bits_match_lowered_interpreter():
    from tgc import pipeline
    from tgc.lower.interp import run_lowered

    r = np.random.default_rng(5)
    args = {k: (r.standard_normal(64) * 10 ** r.uniform(-3, 3, 64)).astype(np.float32) for k in "abcde"}
    args["d"] = args["a"] * args["b"] / np.where(args["c"] == 0, 1, args["c"])   # a b - c d near 0
    for exact in (False, True):
        prog = _prog(SUM, exact)
        got = prog(**args)
        want = run_lowered(prog.lowered, args)
        for name in ("y", "z"):
            np.testing.assert_array_equal(got[name], want[name])
    a, b, c, d, e = (args[k] for k in "abcde")
    y = _prog(SUM, False)(**args)["y"]
    rounded = (a * b).astype(np.float64) - (c * d).astype(np.float64) + e.astype(np.float64)
    np.testing.assert_array_equal(y, rounded.astype(np.float32))   # f32 products, the sum in f64 rounded once
