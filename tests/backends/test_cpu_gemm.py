"""GEMM cells on the CPU (tgc/backends/cpu/gemm.py): the generated small-tile loops,
serial cblas calls, and the parallel tiled path (tiles and R chunks spread over
libgomp threads), each against numpy in float64 or the reference interpreter.

Which path a product takes follows from its size (Options defaults): a tile of at
most `gemm_loop_max_flops` flops runs the generated loops; a product of at least
`gemm_parallel_min_flops` flops is cut into tiles of at most `blas_tile_mnk`
multiply-adds run on every thread. The sizes below are chosen to reach each one,
with transposed operands (every axis order of A, B and C), batch edges, an operand
without the batch edge, symbolic sizes (decided at run time), empty sums, and
shifted operands (a convolution: taps, clipped ranges, accumulation).
"""
from __future__ import annotations

import numpy as np
import pytest

import tgc
from tgc.ir.interp import evaluate
from tgc.ir.inputs import random_inputs
from tgc.ir.parser import parse_module
from tgc.options import Options
from tgc.pipeline import compile_module as build

TOL = {"f64": (1e-10, 1e-12), "f32": (2e-4, 2e-5)}
NP = {"f64": np.float64, "f32": np.float32}


def compile_ir(text: str, dtype: str, **opts):
    return build(parse_module(text), Options(dtype=dtype).with_(**opts))


def close(got, want, dtype):
    rtol, atol = TOL[dtype]
    scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * scale)


def run_matmul(a_order, b_order, c_order, sizes, dtype, fixed=("i", "j", "k"), seed=0, **opts):
    """C[b, i, j] = sum_k A[b, i, k] B[b, k, j] (B without b when 'b' is not in
    b_order), each operand and the result in the given axis order."""
    dims = "\n".join(f"dim {d}" + (f" = {sizes[d]}" if d in fixed else "") for d in "bijk")
    c_edges = "b, i, j"
    text = f"""
{dims}
input A : {dtype}[{a_order}]
input B : {dtype}[{b_order}]
%0 = contract %A, %B : {dtype}[{c_edges}]
out C = %0 : [{c_order}]
"""
    prog = compile_ir(text, dtype, **opts)
    rng = np.random.default_rng(seed)
    shape = lambda order: tuple(sizes[e.strip()] for e in order.split(","))  # noqa: E731
    A = rng.standard_normal(shape(a_order)).astype(NP[dtype])
    B = rng.standard_normal(shape(b_order)).astype(NP[dtype])
    got = prog.run({"A": A, "B": B})["C"]
    a = "".join(e.strip() for e in a_order.split(","))
    b = "".join(e.strip() for e in b_order.split(","))
    c = "".join(e.strip() for e in c_order.split(","))
    want = np.einsum(f"{a},{b}->{c}", A.astype(np.float64), B.astype(np.float64))
    close(got, want.astype(NP[dtype]), dtype)
    return prog


A_ORDERS = ["b, i, k", "b, k, i", "k, b, i"]
B_ORDERS = ["b, k, j", "b, j, k", "j, k, b"]
C_ORDERS = ["b, i, j", "b, j, i", "j, b, i"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("a_order", A_ORDERS)
@pytest.mark.parametrize("b_order", B_ORDERS)
@pytest.mark.parametrize("c_order", C_ORDERS)
def test_small_batched_gemm_every_layout(dtype, a_order, b_order, c_order):
    """11 x 13 x 16 per batch index: the generated loops (remainder rows, one masked
    vector of columns; a packed B' when its columns are not contiguous)."""
    run_matmul(a_order, b_order, c_order, {"b": 5, "i": 11, "j": 13, "k": 16}, dtype)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("sizes", [
    {"b": 3, "i": 1, "j": 1, "k": 1},
    {"b": 2, "i": 9, "j": 40, "k": 7},       # two vectors of columns (f32: 16 + 24 masked)
    {"b": 1, "i": 37, "j": 33, "k": 5},      # blocks of 4 rows plus a remainder of 1
    {"b": 4, "i": 6, "j": 17, "k": 30},      # (sizes are positive: a 0 is refused at the call)
])
def test_gemm_symbolic_sizes(dtype, sizes):
    """Every size symbolic: the path and the tiles are chosen at run time."""
    for c_order in ("b, i, j", "b, j, i"):
        run_matmul("b, i, k", "b, j, k", c_order, sizes, dtype, fixed=())
        run_matmul("b, k, i", "b, k, j", c_order, sizes, dtype, fixed=())


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("b_order", ["k, j", "j, k"])
def test_operand_without_the_batch_edge(dtype, b_order):
    for sizes in ({"b": 7, "i": 11, "j": 16, "k": 9}, {"b": 3, "i": 100, "j": 120, "k": 90}):
        run_matmul("b, i, k", b_order, "b, i, j", sizes, dtype)
        run_matmul("i, b, k", b_order, "b, j, i", sizes, dtype)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("orders", [("b, i, k", "b, k, j", "b, i, j"),
                                    ("b, k, i", "b, j, k", "b, j, i"),
                                    ("i, b, k", "k, b, j", "b, i, j")])
@pytest.mark.slow
@pytest.mark.parametrize("threads, tiles", [(0, 2), (3, 64)])
def test_large_gemm_parallel_tiles(dtype, orders, threads, tiles):
    """150 x 260 x 300 per batch index in `gemm_tiles` tiles, shared among the threads
    (threads=0: libgomp's team). With 64 tiles they are cut in all three groups (R in
    chunks accumulated in place)."""
    run_matmul(*orders, {"b": 2, "i": 150, "j": 260, "k": 300}, dtype, threads=threads, gemm_tiles=tiles)
    run_matmul(*orders, {"b": 1, "i": 3, "j": 700, "k": 1100}, dtype, fixed=(), threads=threads, gemm_tiles=tiles)


def test_multi_edge_groups():
    """M and K of two edges each (merged groups), through tiles and loops."""
    for dtype in ("f32", "f64"):
        for n in (3, 40):
            text = f"""
dim b
dim h = 3
dim d = 16
dim e = 24
dim t = {n}
input Q : {dtype}[b, h, t, d]
input W : {dtype}[h, d, e]
%0 = contract %Q, %W : {dtype}[b, t, e]
out Y = %0 : [b, t, e]
"""
            prog = compile_ir(text, dtype)
            x = random_inputs(prog.module, prog.module.bind_dims({"b": 5}), 0, dtype)
            ref = evaluate(prog.module, {k: np.copy(v) for k, v in x.items()}, dtype=dtype)
            got = prog.run({k: np.copy(v) for k, v in x.items()})
            close(got["Y"], ref["Y"], dtype)


CONV = """
dim batch, len
dim cin = {cin}, cout = {cout}, klen = 5
input  x[batch, cin, t: len]
input  dy[batch, cout, s: len]
param  K[cout, cin, k: klen]
y    = x[t = s + k - 2] @ K
loss = sum(y * dy)
out y[batch, cout, s]
out dx = grad(loss, x)
out dK = grad(loss, K)
"""


def conv_reference(x, dy, K):
    x, dy, K = (a.astype(np.float64) for a in (x, dy, K))
    B, ci, L = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (2, 2)))
    win = np.stack([xp[:, :, k:k + L] for k in range(K.shape[2])], axis=-1)    # b, ci, s, k
    y = np.einsum("bcsk,ock->bos", win, K)
    dK = np.einsum("bcsk,bos->ock", win, dy)
    dyp = np.pad(dy, ((0, 0), (0, 0), (2, 2)))
    dx = np.zeros_like(x)
    for k in range(K.shape[2]):     # y[s] uses x[s + k - 2]: dx[t] += K_k^T dy[t - k + 2]
        dx += np.einsum("oc,bot->bct", K[:, :, k], dyp[:, :, 4 - k:4 - k + L])
    return y, dx, dK


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("sizes", [(3, 4, 5, 9), (2, 32, 24, 600), (1, 8, 8, 3)])
def test_convolution_shifted_gemms(dtype, sizes):
    """Taps, shifted views with clipped ranges, accumulation: small (loops), large
    (parallel tiles cut across the clipped edge), and a signal shorter than the kernel."""
    batch, cin, cout, length = sizes
    prog = tgc.compile(CONV.format(cin=cin, cout=cout), dtype=dtype)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, cin, length)).astype(NP[dtype])
    dy = rng.standard_normal((batch, cout, length)).astype(NP[dtype])
    K = rng.standard_normal((cout, cin, 5)).astype(NP[dtype])
    got = prog(x=x, dy=dy, K=K.copy())
    for name, want in zip(("y", "dx", "dK"), conv_reference(x, dy, K)):
        close(got[name], want.astype(NP[dtype]), dtype)


def test_packs_b_names_the_helper_every_gemm_calls():
    """The first unit makes the small-tile helpers before any GEMM is generated
    (`gemm_dispatch.packs_b`); it must name the one `GemmGen` calls, for every layout."""
    import glob
    from pathlib import Path

    import llvmlite.ir as ir

    from tgc import pipeline
    from tgc.backends.cpu import gemm, gemm_dispatch
    from tgc.backends.cpu.irutil import Frame
    from tgc.lower.lowered import GemmKernel
    from tgc.pipeline import lower_module

    root = Path(__file__).resolve().parents[2]
    seen = set()
    for path in sorted(glob.glob(str(root / "benchmarks" / "workloads" / "*.tg"))):
        opts = Options(dtype="f32")
        low = lower_module(pipeline.lower(pipeline.load(path, opts), opts).module, opts)
        for i, k in enumerate(low.kernels):
            if isinstance(k, GemmKernel):
                g = gemm.GemmGen(ir.Module(), low, k, f"k{i}", ir.FloatType(), opts)
                f = Frame(g.fn, low.module, g.fn.args[0], low.edges)
                _, b, _ = g.operands(f, g.views(f))
                assert gemm_dispatch.packs_b(low, k) == (not b.col_unit), (path, i)
                seen.add(gemm_dispatch.packs_b(low, k))
    assert seen == {True, False}


@pytest.mark.parametrize("fixed", [("i", "j", "k"), ()])
def test_a_product_below_the_parallel_threshold_is_one_cblas_call(monkeypatch, fixed):
    """178 x 64 x 64 with B transposed (the wine MLP's backward product): 1.46 Mflop,
    below `gemm_parallel_min_flops` (2^21), so one cblas call over every row, however
    many threads (two calls would pack B twice); with the threshold below its flops it is
    cut into `gemm_tiles` calls. Counted through a BLAS table whose sgemm logs each
    call's m, n, k and passes it on; the values agree with numpy either way."""
    calls = _log_sgemm_calls(monkeypatch)
    sizes = {"b": 1, "i": 178, "j": 64, "k": 64}
    for threads in (1, 2):
        calls.clear()
        run_matmul("b, i, k", "j, k", "b, i, j", sizes, "f32", fixed=fixed, threads=threads)
        assert calls == [(178, 64, 64)]
    calls.clear()
    run_matmul("b, i, k", "j, k", "b, i, j", sizes, "f32", fixed=fixed, gemm_parallel_min_flops=1 << 20, threads=1)
    assert sorted(calls) == [(89, 64, 64), (89, 64, 64)]


def _log_sgemm_calls(monkeypatch) -> list:
    """A BLAS table whose sgemm appends each call's (m, n, k) to the list returned, then
    runs the real one: programs compiled after this count their cblas calls."""
    import ctypes

    from tgc.backends.cpu import blas

    real = blas.gemm_addresses()
    proto = blas.gemm_ctypes(ctypes.c_float)
    forward = proto(real["sgemm"])
    calls = []

    def logged(*args):
        calls.append(args[3:6])
        forward(*args)

    hook = proto(logged)
    monkeypatch.setattr(blas, "gemm_addresses", lambda: {**real, "sgemm": ctypes.cast(hook, ctypes.c_void_p).value})
    return calls


def long_sum_error(prog, sizes, seed=1):
    """Norm-wise error of C = A B (positive operands, the worst case of a chain of
    f32 sums) against numpy in float64."""
    m, k, n = sizes
    rng = np.random.default_rng(seed)
    a = (np.abs(rng.standard_normal((m, k))) + 1).astype(np.float32)
    b = (np.abs(rng.standard_normal((k, n))) + 1).astype(np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)
    got = prog.run({"A": a, "B": b})["C"]
    return float(np.abs(got - want).max() / np.abs(want).max())


LONG_SUM = """
dim i{m}
dim k{k}
dim j{n}
input A : f32[i, k]
input B : f32[k, j]
%0 = contract %A, %B : f32[i, j]
out C = %0 : [i, j]
"""


def test_small_cblas_calls_are_cut_into_k_chunks(monkeypatch):
    """A cblas call of at most `blas_chain_mnk` multiply-adds goes in K chunks of
    `sum_chunk` (numpy's OpenBLAS sums such calls on AVX-512 in one f32 chain over
    all of K: 2.8e-6 off on 4 x 4096 x 16 positive operands, PyTorch f32 2.2e-7);
    with the option 0, one call. Counted through a logging BLAS table, as above."""
    calls = _log_sgemm_calls(monkeypatch)
    text = LONG_SUM.format(m=" = 4", k=" = 4096", n=" = 16")
    err = long_sum_error(compile_ir(text, "f32"), (4, 4096, 16))
    assert sorted({c[2] for c in calls}) == [256] and len(calls) == 16, calls
    assert err < 5e-7, err
    calls.clear()
    long_sum_error(compile_ir(text, "f32", blas_chain_mnk=0), (4, 4096, 16))
    assert [c[2] for c in calls] == [4096], calls


def test_small_tile_loops_sum_k_in_blocks():
    """The generated small-tile loops (symbolic sizes: a 2 x 4000 x 2 tile is under
    `gemm_loop_max_flops`) sum each block of `sum_chunk` terms from zero: one chain of
    4000 fused multiply-adds of positive terms was 1.2e-6 off (PyTorch f32 1.7e-7)."""
    prog = compile_ir(LONG_SUM.format(m="", k="", n=""), "f32")
    assert "tgc.gemm.small.f32" in prog.llvm_ir
    assert long_sum_error(prog, (2, 4000, 2)) < 3e-7
    assert long_sum_error(prog, (1, 16000, 1)) < 3e-7
