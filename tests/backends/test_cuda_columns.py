"""Column sums in the CUDA backends (codegen's `col_loop`): a bias or weight gradient
`out[c] = sum[rows] ...` runs as a block per tile of neighbouring columns and chunk of
rows, warps over rows and lanes over columns (float4 loads where the sizes and
addresses allow), the chunks' partials added in chunk order by a second kernel.

Run on cuda-sim against the interpreter at sizes that are and are not multiples of
the tile (128 columns), of 4 and of a chunk (64 rows), and of size 1; the emulator's
counters say which path ran. The result is the same bits on every run, and the same
bits through the float4 path and the per-element one (an operand that is a view 4
bytes into its memory takes the latter). The kernels compile for sm_90 without
spilling (`ptxas -v`), as do the row groups' (layernorm, softmax, forward and
backward), whose registers do not depend on the row length."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest

import tgc
from tgc.backends.cuda import codegen
from tgc.backends.cuda.options import CudaOptions
from tgc.ir.inputs import random_inputs
from tgc.ir.interp import evaluate
from tgc.options import Options

from layer_programs import LAYERNORM

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="cuda-sim needs g++ with OpenMP")
NVCC = shutil.which("nvcc")

# a bias gradient, a weight gradient (a broadcast factor per row), two reduced loops,
# two kept loops, and a mean (an epilogue after the sum)
BIAS = "dim rows, d\ninput dy[rows, d]\nout db[d] = sum[rows](dy)\n"
WEIGHT = "dim rows, d\ninput dy[rows, d]\ninput x[rows, d]\ninput s[rows]\nout dw[d] = sum[rows](dy * x * s)\n"
TWO_REDUCED = "dim b, t, d\ninput x[b, t, d]\nout y[d] = sum[b, t](x)\n"
TWO_KEPT = "dim rows, h, d\ninput x[rows, h, d]\nout y[h, d] = sum[rows](x)\n"
MEAN = "dim rows, d\ninput x[rows, d]\nout m[d] = mean[rows](x)\n"
TOL = {"f64": (1e-12, 1e-13), "f32": (2e-6, 1e-6)}


def build(source: str, dtype: str, row_min: int = 1, **cuda):
    """The program on cuda-sim; `row_min` 1: every reduction takes its block form (so
    the column tiles) at any size."""
    return tgc.compile(source, backend="cuda-sim", dtype=dtype,
                       options=Options().with_(cuda=CudaOptions(row_min=row_min, **cuda)))


def counters(prog):
    fn = prog._kernels._device.lib.tgc_sim_counters
    fn.restype = ctypes.POINTER(ctypes.c_longlong)
    return fn()


def run(prog, dims: dict, dtype: str, seed: int = 0, inputs=None) -> tuple[dict, int, int]:
    """(outputs, float4 tiles, per-element tiles): checked against the interpreter."""
    m = prog.module
    x = inputs if inputs is not None else random_inputs(m, m.bind_dims(dims), seed, dtype)
    want = evaluate(m, {k: np.array(v) for k, v in x.items()}, dtype=dtype)
    c = counters(prog)
    c[3] = c[4] = 0
    got = prog(**x)
    rtol, atol = TOL[dtype]
    for name, w in want.items():
        scale = max(1.0, float(np.max(np.abs(w)))) if w.size else 1.0
        np.testing.assert_allclose(got[name], w, rtol=rtol, atol=atol * scale, err_msg=f"{name} at {dims}")
    return got, c[3], c[4]


@needs_gxx
def test_column_sums_are_tiled_kernels():
    prog = build(WEIGHT, "f32")
    (x,) = [x for x in prog.cuda_module.launches if x.kind == "loop"]
    assert x.col and x.col_sum and x.row
    src = prog.cuda_source
    assert f"void __launch_bounds__(256) {x.col}(" in src and "tgc_col_chunks(" in src
    assert "reinterpret_cast<const float4*>" in src.split(x.col + "(")[1]
    # a row sum (the reduced loop is the contiguous one) keeps its one block per output
    rows = build("dim rows, d\ninput x[rows, d]\nout y[rows] = sum[d](x)\n", "f32")
    assert [(x.row != "", x.col) for x in rows.cuda_module.launches] == [(True, "")]


@needs_gxx
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_column_sums_match_the_interpreter(dtype):
    """Columns 1, 3, 4, 127, 128, 129, 260 (one tile, a tile and a bit, three tiles)
    and rows 1, 2, 63, 64, 65, 130, 1000 (one chunk, or several: 1000 rows of 4
    columns are 16 chunks)."""
    prog = build(WEIGHT, dtype)
    for d in (1, 3, 4, 127, 128, 129, 260):
        for rows in (1, 2, 65, 130):
            _, vec, scalar = run(prog, {"rows": rows, "d": d}, dtype, seed=d + rows)
            assert scalar > 0 if d % 4 or dtype == "f64" else vec > 0, (rows, d, vec, scalar)
    for rows in (63, 64, 1000):
        run(prog, {"rows": rows, "d": 4}, dtype, seed=rows)
    assert codegen.col_chunks(1000, 4) == 16 and codegen.col_chunks(65, 4) == 2 and codegen.col_chunks(64, 1) == 1


@needs_gxx
@pytest.mark.parametrize("source", [BIAS, TWO_REDUCED, TWO_KEPT, MEAN], ids=["bias", "two_reduced", "two_kept", "mean"])
def test_column_sum_forms_match_the_interpreter(source):
    prog = build(source, "f32")
    assert any(x.col for x in prog.cuda_module.launches)
    names = prog.module.symbolic_dims()
    for sizes in ((1, 1, 1), (3, 5, 7), (70, 2, 129), (2, 40, 12)):
        dims = dict(zip(names, sizes))
        _, vec, scalar = run(prog, dims, "f32", seed=sum(sizes))
        assert vec + scalar > 0, dims


@needs_gxx
def test_the_default_threshold_picks_the_tiles_for_long_columns_only():
    prog = build(BIAS, "f32", row_min=128)
    _, vec, scalar = run(prog, {"rows": 100, "d": 8}, "f32")
    assert vec + scalar == 0                     # 100 rows: one thread per column
    _, vec, scalar = run(prog, {"rows": 300, "d": 8}, "f32")
    assert vec > 0 and scalar == 0
    prog = build(BIAS, "f32", row_min=128, column_tiles=False)   # one block per output
    _, vec, scalar = run(prog, {"rows": 300, "d": 8}, "f32")
    assert vec + scalar == 0


@needs_gxx
def test_column_sums_are_the_same_bits_on_every_run_and_on_both_paths():
    """Two runs give the same bits; so do the float4 path and the per-element one (an
    operand 4 bytes into its memory is not 16-byte aligned), and a result with many
    chunks."""
    prog = build(WEIGHT, "f32")
    rng = np.random.default_rng(7)
    rows, d = 1000, 132
    big = rng.standard_normal(rows * d + 1).astype(np.float32)
    ins = dict(dy=big[:-1].copy().reshape(rows, d), x=rng.standard_normal((rows, d)).astype(np.float32),
               s=rng.standard_normal(rows).astype(np.float32))
    first, vec, scalar = run(prog, {}, "f32", inputs=ins)
    assert vec > 0 and scalar == 0 and codegen.col_chunks(rows, d) > 1
    again, _, _ = run(prog, {}, "f32", inputs={k: v.copy() for k, v in ins.items()})
    assert first["dw"].tobytes() == again["dw"].tobytes()
    shifted = dict(ins, dy=big[1:].reshape(rows, d))
    shifted["dy"][...] = ins["dy"]
    other, vec, scalar = run(prog, {}, "f32", inputs=shifted)
    assert vec == 0 and scalar > 0
    assert first["dw"].tobytes() == other["dw"].tobytes()


SOFTMAX = "dim rows, d\ninput x[rows, d]\ninput dy[rows, d]\ny = softmax[d](x)\nout y\nout dx = grad(sum(y * dy), x)\n"


@pytest.mark.skipif(NVCC is None, reason="nvcc (the CUDA toolkit) is not installed")
def test_column_and_row_kernels_compile_without_spills(tmp_path):
    """`ptxas -v` for sm_90: no kernel of the layernorm (its row group, both variants,
    with the dw, db column sums in it or as column tiles) or the softmax, forward and backward, in f32 and f64,
    spills or keeps a stack frame. A row group's registers are fixed at compile time
    (`CudaOptions.row_regs` per thread), so this holds for every row length, 4096
    included."""
    parts = []
    fused, apart = CudaOptions(row_columns=True), CudaOptions()   # dw, db in the row group, or column tiles
    for j, (source, dtype, cuda) in enumerate([(LAYERNORM, "f32", fused), (SOFTMAX, "f32", fused),
                                               (WEIGHT, "f32", fused), (LAYERNORM, "f64", fused),
                                               (LAYERNORM, "f32", apart)]):
        low = tgc.compile(source, backend="cuda-sim", dtype=dtype, options=Options().with_(cuda=cuda)).lowered
        parts.append((dtype, codegen.generate(low, prefix=f"m{j}_").source))
    report = []
    for dtype in ("f32", "f64"):
        cu = tmp_path / f"{dtype}.cu"
        cu.write_text("\n".join(s for t, s in parts if t == dtype))
        r = subprocess.run([NVCC, "-cubin", "-arch=sm_90", "--Werror", "all-warnings", "-Xptxas", "-v", str(cu),
                            "-o", str(tmp_path / "k.cubin")], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        report.append(r.stderr)
    text = "\n".join(report)
    kernels = re.findall(r"Function properties for (\w+)\n\s+(\d+) bytes stack frame, (\d+) bytes spill stores, "
                         r"(\d+) bytes spill loads", text)
    names = {k for k, *_ in kernels}
    assert {"m0_k0", "m0_k0_warp", "m0_k0_cols", "m4_k1_col", "m4_k1_col_sum", "m2_k0_col", "m3_k0",
            "m3_k0_warp"} <= names, sorted(names)
    bad = [(k, frame, st, ld) for k, frame, st, ld in kernels if (frame, st, ld) != ("0", "0", "0")]
    assert not bad, bad

