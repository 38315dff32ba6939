"""GEMMs without BLAS (`CpuOptions(blas="none")`, what `tgc build`'s default libraries
run when their caller passes no BLAS): every tile too large for the small-tile
loops runs the blocked loops (`gemm_small.loops_kernel`) instead of cblas.

The JIT passes no BLAS in its function table with "none", so a product that still
called cblas would jump to a null pointer: these runs show the loops cover every
layout (each operand and the result in either order, B' packed or not), several
column blocks and K chunks with remainders, R chunks accumulated in place (many
tiles), batches, symbolic sizes and shifted operands (a convolution), each against
numpy in float64. "numpy" (the default) generates the code it always did.
"""
from __future__ import annotations

import numpy as np
import pytest

import tgc
from tgc.backends.cpu import codegen
from tgc.ir.parser import parse_module
from tgc.options import Options
from tgc.pipeline import lower_module
from tgc.pipeline import compile_module as build

TOL = {"f64": (1e-10, 1e-12), "f32": (2e-4, 2e-5)}
NP = {"f64": np.float64, "f32": np.float32}


def close(got, want, dtype):
    rtol, atol = TOL[dtype]
    scale = max(1.0, float(np.max(np.abs(want))))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * scale)


def matmul_text(a_order, b_order, c_order, sizes, dtype, fixed):
    dims = "\n".join(f"dim {d}" + (f" = {sizes[d]}" if d in fixed else "") for d in "bijk")
    return f"""
{dims}
input A : {dtype}[{a_order}]
input B : {dtype}[{b_order}]
%0 = contract %A, %B : {dtype}[b, i, j]
out C = %0 : [{c_order}]
"""


def run_matmul(a_order, b_order, c_order, sizes, dtype, fixed=("b", "i", "j", "k"), **opts):
    text = matmul_text(a_order, b_order, c_order, sizes, dtype, fixed)
    prog = build(parse_module(text), Options(dtype=dtype).with_(blas="none", **opts))
    rng = np.random.default_rng(0)
    shape = lambda order: tuple(sizes[e.strip()] for e in order.split(","))  # noqa: E731
    A = rng.standard_normal(shape(a_order)).astype(NP[dtype])
    B = rng.standard_normal(shape(b_order)).astype(NP[dtype])
    got = prog.run({"A": A, "B": B})["C"]
    spec = ",".join("".join(e.strip() for e in o.split(",")) for o in (a_order, b_order)) + "->" + \
        "".join(e.strip() for e in c_order.split(","))
    close(got, np.einsum(spec, A.astype(np.float64), B.astype(np.float64)).astype(NP[dtype]), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("a_order", ["b, i, k", "b, k, i"])
@pytest.mark.parametrize("b_order", ["b, k, j", "b, j, k"])
@pytest.mark.parametrize("c_order", ["b, i, j", "b, j, i"])
def test_large_products_without_blas_every_layout(dtype, a_order, b_order, c_order):
    """150 x 261 x 300 per batch index: tiles far over `gemm_loop_max_flops`, so
    every one runs the blocked loops; 261 columns are 8 blocks and a partial one,
    300 rows of K two chunks and a partial one (f32: 128 per chunk, f64: 256)."""
    run_matmul(a_order, b_order, c_order, {"b": 2, "i": 150, "j": 261, "k": 300}, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_symbolic_sizes_and_many_tiles_without_blas(dtype):
    """Sizes known only at the call; 64 tiles on 3 threads cut R too (chunks that
    accumulate into C), and a product of one row."""
    sizes = {"b": 1, "i": 3, "j": 700, "k": 1100}
    run_matmul("b, i, k", "b, k, j", "b, i, j", sizes, dtype, fixed=(), threads=3, gemm_tiles=64)
    run_matmul("b, k, i", "b, j, k", "b, j, i", sizes, dtype, fixed=(), threads=3, gemm_tiles=64)
    run_matmul("b, i, k", "b, j, k", "b, i, j", {"b": 3, "i": 1, "j": 515, "k": 2049}, dtype, fixed=())


CONV = """
dim batch, len
dim cin = 32, cout = 24, klen = 5
input  x[batch, cin, t: len]
input  dy[batch, cout, s: len]
param  K[cout, cin, k: klen]
y    = x[t = s + k - 2] @ K
loss = sum(y * dy)
out y[batch, cout, s]
out dx = grad(loss, x)
out dK = grad(loss, K)
"""


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_convolution_without_blas(dtype):
    """Shifted operands (taps, clipped ranges, every task accumulating) through the
    blocked loops: a 1-D convolution and both its gradients."""
    prog = tgc.compile(CONV, dtype=dtype, options=Options().with_(blas="none"))
    rng = np.random.default_rng(1)
    x, dy = (rng.standard_normal(s).astype(NP[dtype]) for s in ((2, 32, 600), (2, 24, 600)))
    K = rng.standard_normal((24, 32, 5)).astype(NP[dtype])
    got = prog(x=x, dy=dy, K=K.copy())
    x64, dy64, K64 = (a.astype(np.float64) for a in (x, dy, K))
    xp = np.pad(x64, ((0, 0), (0, 0), (2, 2)))
    win = np.stack([xp[:, :, k:k + 600] for k in range(5)], axis=-1)          # b, ci, s, k
    dyp = np.pad(dy64, ((0, 0), (0, 0), (2, 2)))
    dx = sum(np.einsum("oc,bot->bct", K64[:, :, k], dyp[:, :, 4 - k:4 - k + 600]) for k in range(5))
    want = {"y": np.einsum("bcsk,ock->bos", win, K64), "dK": np.einsum("bcsk,bos->ock", win, dy64), "dx": dx}
    for name, w in want.items():
        close(got[name], w.astype(NP[dtype]), dtype)


def test_only_the_builds_without_a_required_blas_have_the_loops():
    """`blas="numpy"` (the JIT's default) generates what it always did: no blocked
    loops, and a cblas call not guarded by a test of the table; "system" and "none"
    have both, chosen at run time."""
    text = matmul_text("b, i, k", "b, j, k", "b, i, j", {}, "f32", fixed=())
    texts = {}
    for blas in ("numpy", "system", "none"):
        opts = Options().with_(blas=blas)
        texts[blas] = codegen.generate(lower_module(parse_module(text), opts), opts)
    assert "tgc.gemm.loops" not in texts["numpy"]
    for blas in ("system", "none"):
        assert "tgc.gemm.loops.f32.packed" in texts[blas]
