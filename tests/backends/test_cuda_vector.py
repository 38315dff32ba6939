"""float4 loads and stores in the CUDA backends' elementwise loops (codegen's
`vector_loop`): taken when the innermost size is a multiple of 4 and every buffer
read or written four at a time is 16-byte aligned, the scalar loop otherwise. Run on
cuda-sim against the interpreter, at sizes that are and are not multiples of 4 and
with arrays that are views at an offset (misaligned); the emulator's counters say
which loop ran."""
from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest

import tgc
from tgc.ir.interp import evaluate

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="cuda-sim needs g++ with OpenMP")

# contiguous operands, a broadcast one (b along d, c along rows) and a transposed one
# (read per element: its innermost edge is not d)
SOURCE = """
dim rows, d
input x[rows, d]
input z[rows, d]
input u[d, rows]
param b[d]
input c[rows]
out y[rows, d] = tanh(x * z + b) * c + u
"""


def counters(prog):
    fn = prog._kernels._device.lib.tgc_sim_counters
    fn.restype = ctypes.POINTER(ctypes.c_longlong)
    return fn()


def run(prog, dtype, rows, d, offset: bool):
    rng = np.random.default_rng(rows * 100 + d)
    t = np.dtype(dtype)
    big = rng.standard_normal(rows * d + 1).astype(t)
    z = (big[1:] if offset else big[:-1].copy()).reshape(rows, d)
    ins = dict(x=rng.standard_normal((rows, d)).astype(t), z=z, u=rng.standard_normal((d, rows)).astype(t),
               b=rng.standard_normal(d).astype(t), c=rng.standard_normal(rows).astype(t))
    want = evaluate(prog.module, {k: np.copy(v) for k, v in ins.items()}, dtype="f32" if t == np.float32 else "f64")
    c = counters(prog)
    c[0] = 0
    got = prog(**ins)
    np.testing.assert_allclose(got["y"], want["y"], rtol=2e-6 if t == np.float32 else 1e-14, atol=1e-6)
    return c[0]


def test_float4_loop_runs_where_sizes_and_addresses_allow():
    prog = tgc.compile(SOURCE, backend="cuda-sim", dtype="f32")
    src = prog.cuda_source
    assert "reinterpret_cast<const float4*>" in src and "tgc_aligned16(" in src and "d1 % 4 == 0" in src
    # x, z, b: float4 loads; c (one value per row) and u (transposed): per element
    assert src.count("const float4 l") == 3
    for rows, d in ((3, 8), (5, 4), (2, 12), (1, 64)):
        assert run(prog, np.float32, rows, d, offset=False) > 0, (rows, d)
        assert run(prog, np.float32, rows, d, offset=True) == 0, (rows, d)     # z is 4 bytes past 16
    for rows, d in ((3, 7), (2, 1), (4, 5), (3, 30)):
        assert run(prog, np.float32, rows, d, offset=False) == 0, (rows, d)


def test_f64_and_reductions_stay_scalar():
    prog = tgc.compile(SOURCE, backend="cuda-sim", dtype="f64")
    assert "reinterpret_cast<const float4*>" not in prog.cuda_source
    assert run(prog, np.float64, 3, 8, offset=False) == 0
    red = tgc.compile("dim r, d\ninput x[r, d]\nout s[r] = sum[d](x)\n", backend="cuda-sim", dtype="f32")
    assert "const float4" not in red.cuda_source
