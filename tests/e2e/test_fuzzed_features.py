"""Programs that the featured fuzzer (`tests/fuzz/features.py`) found wrong, minimized
(each test says which seed and feature)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import tgc

# dtypes seed 301: an output of type f64 (`f64 + bf16` promotes to f64) whose f64 operand the
# optimizer folds to 0 (`f64(W8 - stop(W8))`) came back as bfloat16 from every backend, and
# `tgc build`'s header declared it `uint16_t` (bfloat16 bits): the optimizer's `0 + x -> x`
# gave the output its bf16 operand's type. docs/dtypes.md: an output has its expression's type.
OUT_TYPE = """dim p = 4
dim q = 1
dim w = p + q
param W8: f32[p]
param W9: bf16[q]
out hf = f64((W8 - stop(W8))[p = w]) + cos(W9)[q = w - size(p)]
out hg = W8 - W8 + cos(W9)[q = 0 * p]
"""


@pytest.mark.parametrize("backend", ["interp", "lowered", "cpu"])
@pytest.mark.parametrize("dtype", ["f64", "f32"])
def test_an_output_keeps_its_type_when_the_optimizer_drops_the_operand_that_set_it(backend, dtype):
    prog = tgc.compile(OUT_TYPE, backend=backend, dtype=dtype)
    w9 = np.array([0.5], ml_dtypes.bfloat16)
    res = prog(W8=np.ones(4), W9=w9, updates=False)
    # hf: f64 + bf16 is f64 (f32 in an f32 program); hg: f32 + bf16 is f32
    want = {"hf": np.float64 if dtype == "f64" else np.float32, "hg": np.float32}
    for k in ("hf", "hg"):
        assert res[k].dtype == want[k], (k, res[k].dtype)
    np.testing.assert_array_equal(res["hf"], [0, 0, 0, 0, np.cos(np.float32(0.5)).astype(ml_dtypes.bfloat16)])


def test_the_built_header_declares_the_output_type(tmp_path):
    from click.testing import CliRunner

    from tgc.cli import main

    src = tmp_path / "p.tg"
    src.write_text(OUT_TYPE)
    res = CliRunner().invoke(main, ["build", str(src), "-o", str(tmp_path / "libp.so"), "--dtype", "f64"])
    assert res.exit_code == 0, res.output
    header = (tmp_path / "p.h").read_text()
    line = next(x for x in header.splitlines() if "_OUT_HF " in x)
    assert "double" in line and "uint16_t" not in line, line
