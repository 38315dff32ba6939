"""tgc's own f32 GEMM kernel (tgc/backends/cpu/fgemm.py) and the products that run it.

The kernel alone, JIT-compiled, against numpy in float64 on sizes around its blocks
(rows of the register block, vectors of 16 columns, the packed K depth), with B's
columns contiguous and strided, and accumulating into C. Then whole programs with
`options.cpu.own_gemm` "on": products in every operand order, convolutions (1-D and
2-D, values and gradients) against the interpreter and the cblas path, the same bits
on 1 and 2 threads, and which path the generated code calls.
"""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.frontend import compile_source
from tgc.backends.cpu.fgemm import kernel_name
from tgc.backends.cpu.llvm_env import has_feature
from tgc.backends.cpu.options import CpuOptions
from tgc.ir.interp import evaluate
from tgc.lower.lowered import LoopKernel
from tgc.options import Options

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not has_feature("avx512f"), reason="the own GEMM kernel needs AVX-512 (avx512f)")


def _jitted_kernels(tri: bool):
    """(rows, vecs, depth[, panel rows]) -> a ctypes function of the own kernel with those
    blocks (its `tri` form, which takes the mask's four coefficients more, where `tri`);
    the JIT modules are closed when the generator ends."""
    import llvmlite.ir as ir

    from tgc.backends.cpu import llvm_env
    from tgc.backends.cpu.fgemm import own_kernel

    made, keep = {}, []
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    proto = ctypes.CFUNCTYPE(None, i64, i64, i64, vp, i64, i64, vp, i64, i64, vp, i64, ctypes.c_int32,
                             i64, vp, vp, vp, vp, *(i64,) * (4 if tri else 0))

    def get(rows, vecs, depth, panel=CpuOptions().own_gemm_panel_rows):
        if (rows, vecs, depth, panel) not in made:
            mod = ir.Module("own")
            fn = own_kernel(mod, CpuOptions(own_gemm_panel_rows=panel), rows, vecs, depth=depth, tri=tri)
            fn.linkage = "external"
            jit = llvm_env.jit(str(mod))
            keep.append(jit)
            made[rows, vecs, depth, panel] = proto(jit.address(fn.name))
        return made[rows, vecs, depth, panel]
    yield get
    for jit in keep:
        jit.close()


@pytest.fixture(scope="module")
def kernels():
    """(rows, vecs, depth[, panel rows]) -> a ctypes function of the kernel with those blocks."""
    yield from _jitted_kernels(tri=False)


def call(fn, A, B, C, accumulate):
    """C (+)= A B: the kernel's one product (0, 0, 0, K), A and B of any strides."""
    (M, K), N = A.shape, B.shape[1]
    s = 4
    one = [np.zeros(1, np.int64) for _ in range(3)] + [np.full(1, K, np.int64)]
    fn(M, N, K, A.ctypes.data, A.strides[0] // s, A.strides[1] // s, B.ctypes.data, B.strides[0] // s, B.strides[1] // s,
       C.ctypes.data, C.strides[0] // s, accumulate, 1, *(x.ctypes.data for x in one))


@pytest.mark.parametrize("blocks", [(8, 2, 256), (4, 4, 64), (6, 1, 16)])
@pytest.mark.parametrize("transposed", [False, True])
def test_kernel_against_numpy_around_its_blocks(kernels, blocks, transposed):
    """Sizes at, below and above every block edge (rows past M read row M - 1 and
    store nothing; columns past N and K past the depth are masked / zero-padded), a
    C with a row stride wider than N, and C += A B."""
    rows, vecs, depth = blocks
    fn = kernels(rows, vecs, depth)
    cols = 16 * vecs
    rng = np.random.default_rng(rows * 100 + vecs)
    for M in (1, rows - 1, rows, rows + 1, 3 * rows + 2):
        for N in (1, 15, cols, cols + 1, 2 * cols + 17):
            for K in (0, 1, depth - 1, depth, depth + 3):
                if M < 1:
                    continue
                A = rng.standard_normal((M, K + 3), dtype=np.float32)[:, 1:K + 1]   # row stride K + 3
                B = (rng.standard_normal((N, K), dtype=np.float32).T if transposed
                     else rng.standard_normal((K, N), dtype=np.float32))
                big = np.full((M, N + 5), 7.0, np.float32)
                C = big[:, :N]
                want = A.astype(np.float64) @ B.astype(np.float64)
                call(fn, A, B, C, 0)
                np.testing.assert_allclose(C, want, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(want).max()))
                assert (big[:, N:] == 7.0).all()   # nothing past N
                call(fn, A, B, C, 1)
                np.testing.assert_allclose(C, 2 * want, rtol=1e-5, atol=2e-5 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("blocks", [(6, 4, 64), (4, 4, 32), (8, 2, 16)])
def test_kernel_a_of_any_strides_and_row_panels(kernels, blocks):
    """A with its K contiguous or its rows contiguous (A^T of a row-major matrix), B
    either way, M across several row panels (`own_gemm_panel_rows`, rounded up to
    whole register blocks) with partial ones, against numpy in float64, and C += A B.
    Row panels only change which elements are computed together: the values are
    the same bits as without them (one panel of all rows). An A with its rows
    contiguous is packed panel by panel where B has more than one block of columns
    (`fgemm._pack_a_transposed`), read in place otherwise: the same bits as the same
    A stored with its K contiguous."""
    rows, vecs, depth = blocks
    panel = 2 * rows - 1   # rounded up to 2 x rows
    fn, whole = kernels(rows, vecs, depth, panel), kernels(rows, vecs, depth, 1 << 20)
    rng = np.random.default_rng(rows * 7 + vecs)
    for M in (1, rows + 1, 2 * rows, 2 * rows + 1, 7 * rows + 3):
        for N in (1, 16 * vecs + 1, 3 * 16 * vecs - 5):
            for K in (0, 1, depth + 3, 2 * depth + 5):
                for a_rows in (False, True):
                    for b_t in (False, True):
                        A = (rng.standard_normal((K, M + 2), dtype=np.float32)[:, :M].T if a_rows
                             else rng.standard_normal((M, K + 1), dtype=np.float32)[:, :K])
                        B = (rng.standard_normal((N, K), dtype=np.float32).T if b_t
                             else rng.standard_normal((K, N), dtype=np.float32))
                        want = A.astype(np.float64) @ B.astype(np.float64)
                        tol = 1e-5 * max(1.0, np.abs(want).max())
                        big = np.full((M, N + 3), 7.0, np.float32)
                        C = big[:, :N]
                        call(fn, A, B, C, 0)
                        np.testing.assert_allclose(C, want, rtol=1e-5, atol=tol)
                        assert (big[:, N:] == 7.0).all()
                        ref = np.zeros((M, N), np.float32)
                        call(whole, A, B, ref, 0)
                        assert np.array_equal(C, ref)
                        if a_rows:
                            call(fn, np.ascontiguousarray(A), B, ref, 0)
                            assert np.array_equal(C, ref)
                        call(fn, A, B, C, 1)
                        np.testing.assert_allclose(C, 2 * want, rtol=1e-5, atol=2 * tol)


def test_one_column_block_packs_a_spanning_more_than_pack_a_span(kernels):
    """An A with its rows contiguous and one block of B's columns (attention's dk and
    dv: A' = P^T, 64 columns) is packed only where its K block spans more than
    `own_gemm_pack_a_span` bytes (K x K stride x 4), read in place otherwise: both the
    same bits (each element's chain of K terms is the same), against numpy in float64,
    also accumulating, with partial row panels and K past one block."""
    import llvmlite.ir as ir

    from tgc.backends.cpu import llvm_env
    from tgc.backends.cpu.fgemm import own_kernel

    i64, vp = ctypes.c_int64, ctypes.c_void_p
    proto = ctypes.CFUNCTYPE(None, i64, i64, i64, vp, i64, i64, vp, i64, i64, vp, i64, ctypes.c_int32,
                             i64, vp, vp, vp, vp)
    fns, jits = {}, []
    for name, span in (("packed", 0), ("in place", 1 << 62)):
        mod = ir.Module("own")
        fn = own_kernel(mod, CpuOptions(own_gemm_pack_a_span=span, own_gemm_panel_rows=48, own_gemm_copy_a_rows=0),
                        6, 4, depth=64)
        fn.linkage = "external"
        jits.append(llvm_env.jit(str(mod)))
        fns[name] = proto(jits[-1].address(fn.name))
    rng = np.random.default_rng(11)
    try:
        for M, N, K, ld in ((200, 64, 80, 1024), (97, 64, 256, 4096), (50, 40, 33, 64), (7, 16, 1, 32)):
            A = rng.standard_normal((K, ld), dtype=np.float32)[:, :M].T   # rows contiguous, K stride ld
            B = rng.standard_normal((K, N), dtype=np.float32)
            want = A.astype(np.float64) @ B.astype(np.float64)
            tol = 1e-5 * max(1.0, np.abs(want).max())
            out = {}
            for name, fn in fns.items():
                C = np.full((M, N), 3.0, np.float32)
                call(fn, A, B, C, 1)
                np.testing.assert_allclose(C, want + 3.0, rtol=1e-5, atol=tol)
                call(fn, A, B, C, 0)
                np.testing.assert_allclose(C, want, rtol=1e-5, atol=tol)
                out[name] = C
            assert np.array_equal(out["packed"], out["in place"])
    finally:
        for jit in jits:
            jit.close()


@pytest.mark.parametrize("blocks", [(6, 4), (8, 2), (4, 5)])
def test_copied_a_rows_same_bits_as_packed_and_in_place(blocks):
    """`own_gemm_copy_a_rows`: an A with its rows contiguous by one block of B's columns
    (attention's dk and dv), spanning more than `own_gemm_pack_a_span` (0 here; read in
    place at the default span), is copied sub-panel by sub-panel, rows still contiguous,
    and broadcast from the copy: the same bits as the transposed packing and as
    reading it in place (the option off), against numpy in float64, accumulating or
    not; sub-panels of 48, 96 and 20 rows (rounded up to whole row blocks), several
    row panels and sub-panels with a partial last one, K past one block (64 deep),
    B transposed, several column blocks (not copied), a narrow last block (8 x 2),
    K = 0 (zeros stored, or C kept)."""
    import llvmlite.ir as ir

    from tgc.backends.cpu import llvm_env
    from tgc.backends.cpu.fgemm import own_kernel

    rows, vecs = blocks
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    proto = ctypes.CFUNCTYPE(None, i64, i64, i64, vp, i64, i64, vp, i64, i64, vp, i64, ctypes.c_int32,
                             i64, vp, vp, vp, vp)
    variants = {"packed": dict(own_gemm_pack_a_span=0, own_gemm_copy_a_rows=0),
                "in place": dict(own_gemm_pack_a_span=1 << 62, own_gemm_copy_a_rows=0),
                "copy 48": dict(own_gemm_pack_a_span=0, own_gemm_copy_a_rows=48),
                "copy 96": dict(own_gemm_pack_a_span=0, own_gemm_copy_a_rows=96),
                "copy 20": dict(own_gemm_pack_a_span=0, own_gemm_copy_a_rows=20),
                "copy in place": dict(own_gemm_pack_a_span=1 << 62)}
    fns, jits, texts = {}, [], {}
    for name, kw in variants.items():
        mod = ir.Module("own")
        fn = own_kernel(mod, CpuOptions(own_gemm_panel_rows=240, **kw), rows, vecs, depth=64)
        fn.linkage = "external"
        texts[name] = str(mod)
        jits.append(llvm_env.jit(texts[name]))
        fns[name] = proto(jits[-1].address(fn.name))
    assert "copy_a" not in texts["packed"] and "copy_a" in texts["copy 48"]
    # the copy's buffer: the sub-panel's rows rounded up to whole row blocks, then to 16, x 80 K
    stride = -(-(-(-20 // rows) * rows) // 16) * 16
    assert re.search(rf'%"apack\.c" = alloca float, i64 {stride * 80}\b', texts["copy 20"])
    rng = np.random.default_rng(12)
    try:
        for M, N, K, ld, bt in ((500, 64, 128, 4096, False), (257, 64, 80, 1024, True), (97, 40, 256, 2048, False),
                                (50, 130, 33, 64, False), (61, 16, 70, 512, False), (7, 64, 1, 32, False),
                                (30, 64, 0, 32, False)):
            A = rng.standard_normal((max(K, 1), ld), dtype=np.float32)[:K, :M].T   # rows contiguous, K stride ld
            B = rng.standard_normal((N, K), dtype=np.float32).T if bt else rng.standard_normal((K, N), dtype=np.float32)
            want = A.astype(np.float64) @ B.astype(np.float64)
            tol = 1e-5 * max(1.0, np.abs(want).max())
            out = {}
            for name, fn in fns.items():
                C = np.full((M, N), 3.0, np.float32)
                call(fn, A, B, C, 1)
                np.testing.assert_allclose(C, want + 3.0, rtol=1e-5, atol=tol)
                C2 = np.full((M, N), 3.0, np.float32)
                call(fn, A, B, C2, 0)
                np.testing.assert_allclose(C2, want, rtol=1e-5, atol=tol)
                out[name] = (C, C2)
            for name in variants:
                assert np.array_equal(out[name][0], out["packed"][0]), (name, M, N, K)
                assert np.array_equal(out[name][1], out["packed"][1]), (name, M, N, K)
    finally:
        for jit in jits:
            jit.close()


@pytest.mark.parametrize("panel", [None, 384, 516, 600])
def test_transposed_a_buffer_holds_a_whole_row_panel(panel):
    """The stack buffer of a transposed A' holds a whole row panel (the option's rows
    rounded up to whole blocks of 6 rows, then to 16: 512 -> 516 -> 528) wherever the
    option is at most `own_gemm_pack_a_rows`, so that a tall tile's panels are packed
    (read in place, attention's dk and dv at 8192 keys ran at a third of the speed);
    a larger panel (600) keeps the buffer at `own_gemm_pack_a_rows`."""
    import llvmlite.ir as ir

    from tgc.backends.cpu.fgemm import own_kernel

    cpu = CpuOptions() if panel is None else CpuOptions(own_gemm_panel_rows=panel)
    mod = ir.Module("own")
    own_kernel(mod, cpu, 6, 4)
    size = int(re.search(r'%"apack\.t" = alloca float, i64 (\d+)', str(mod)).group(1))
    depth = cpu.own_gemm_depth
    span = depth + depth // 4 // 16 * 16
    rows = -(-cpu.own_gemm_panel_rows // 6) * 6
    want = -(-rows // 16) * 16
    if cpu.own_gemm_panel_rows > cpu.own_gemm_pack_a_rows:
        want = min(want, cpu.own_gemm_pack_a_rows)
    assert size == want * span
    assert panel is not None or size >= rows * span


def k_blocks(K, depth, taps=0):
    """The own kernel's K blocks for K terms (fgemm.own_kernel: even blocks of at most
    5/4 `depth` in whole vectors; the taps form shares its buffer among `taps`)."""
    span = depth + depth // 4 // 16 * 16
    if taps:
        span = max(16, max(span, 16 * 16) // taps // 16 * 16)
    chunks = max(1, -(-K // span))
    step = -(-K // chunks)
    return [(j * step, min(K, (j + 1) * step)) for j in range(chunks)]


def fma_chain(acc, A, B):
    """acc after fma(A[:, k], B[k], acc) for k in order, element by element (float32
    rounding of each step done in float64: exact for one product plus one addend)."""
    for k in range(A.shape[1]):
        acc = (acc.astype(np.float64) + np.outer(A[:, k].astype(np.float64), B[k].astype(np.float64))).astype(np.float32)
    return acc


def test_kernel_sums_each_k_block_in_order_with_fused_multiply_adds(kernels):
    """The kernel's value for an element: per K block, fma(a_k, b_k, s) over the
    block's k in order from s = 0, then C + s (the first block of a call that does
    not accumulate stores s): compared bit for bit with those sums done in numpy."""
    fn = kernels(4, 2, 16)
    rng = np.random.default_rng(3)
    M, N, K = 5, 40, 37
    A = rng.standard_normal((M, K), dtype=np.float32)
    B = rng.standard_normal((K, N), dtype=np.float32)
    C = np.zeros((M, N), np.float32)
    call(fn, A, B, C, 0)
    blocks = k_blocks(K, 16)
    assert len(blocks) == 3
    want = None
    for k0, k1 in blocks:
        part = fma_chain(np.zeros((M, N), np.float32), A[:, k0:k1], B[k0:k1])
        want = part if want is None else want + part
    assert np.array_equal(C, want)
    C2 = C.copy()
    call(fn, A, B, C2, 1)   # accumulating: every block adds into C
    again = C.copy()
    for k0, k1 in blocks:
        again = again + fma_chain(np.zeros((M, N), np.float32), A[:, k0:k1], B[k0:k1])
    assert np.array_equal(C2, again)


@pytest.mark.parametrize("blocks", [(6, 4, 64), (8, 2, 32)])
def test_unrolled_fma_loop_gives_the_same_bits(blocks):
    """`own_gemm_unroll` K steps per iteration of the FMA loop, then the rest one by
    one: the same fused multiply-adds in the same order, so every unroll gives the
    bits of the loop of one step, for K blocks of odd lengths (a remainder of 1 to
    u - 1 steps), A with its K or its rows contiguous, B either way, and the
    variants form's K ranges that start and end inside a block; and matches numpy
    in float64."""
    import llvmlite.ir as ir

    from tgc.backends.cpu import llvm_env
    from tgc.backends.cpu.fgemm import own_kernel

    rows, vecs, depth = blocks
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    proto = ctypes.CFUNCTYPE(None, i64, i64, i64, vp, i64, i64, vp, i64, i64, vp, i64, ctypes.c_int32,
                             i64, vp, vp, vp, vp)
    fns, jits = {}, []
    for u in (1, 2, 3, 4):
        mod = ir.Module("own")
        fn = own_kernel(mod, CpuOptions(own_gemm_unroll=u, own_gemm_panel_rows=2 * rows), rows, vecs, depth=depth)
        fn.linkage = "external"
        jits.append(llvm_env.jit(str(mod)))
        fns[u] = proto(jits[-1].address(fn.name))
    rng = np.random.default_rng(11)
    M, N = 3 * rows + 1, 16 * vecs * 2 + 5
    for K in (1, 3, depth - 1, depth + 7, 2 * depth + 5):
        for a_rows in (False, True):
            for b_t in (False, True):
                A = (rng.standard_normal((K, M), dtype=np.float32).T if a_rows
                     else rng.standard_normal((M, K), dtype=np.float32))
                B = (rng.standard_normal((N, K), dtype=np.float32).T if b_t
                     else rng.standard_normal((K, N), dtype=np.float32))
                for lo, hi in ((0, K), (K // 3, K - K // 5)):
                    want = A[:, lo:hi].astype(np.float64) @ B[lo:hi].astype(np.float64)
                    got = {}
                    for u, fn in fns.items():
                        C = np.full((M, N), np.nan, np.float32)
                        ks = [np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, lo, np.int64),
                              np.full(1, hi, np.int64)]
                        fn(M, N, K, A.ctypes.data, A.strides[0] // 4, A.strides[1] // 4, B.ctypes.data,
                           B.strides[0] // 4, B.strides[1] // 4, C.ctypes.data, N, 0, 1, *(x.ctypes.data for x in ks))
                        got[u] = C
                    np.testing.assert_allclose(got[1], want, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(want).max()))
                    for u in (2, 3, 4):
                        assert np.array_equal(got[u], got[1]), (K, a_rows, b_t, lo, hi, u)
    for jit in jits:
        jit.close()


@pytest.mark.parametrize("blocks", [(6, 4, 64), (8, 2, 32)])
def test_late_c_prefetch_gives_the_same_bits(blocks):
    """`own_gemm_c_prefetch`: C's lines prefetched into L1 that many K steps before
    the end of a block's FMA loop (the loop cut in two there) adds no arithmetic:
    every distance (none, one inside the loop, one past its start), unrolled by 1 or
    4 (the first loop's last steps one by one), gives the bits of the kernel without
    it, for K blocks of odd lengths, A with its K or its rows contiguous, storing into
    C or adding to it."""
    import llvmlite.ir as ir

    from tgc.backends.cpu import llvm_env
    from tgc.backends.cpu.fgemm import own_kernel

    rows, vecs, depth = blocks
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    proto = ctypes.CFUNCTYPE(None, i64, i64, i64, vp, i64, i64, vp, i64, i64, vp, i64, ctypes.c_int32,
                             i64, vp, vp, vp, vp)
    fns, jits = {}, []
    for u, pf in ((1, 0), (1, 5), (4, 0), (4, 5), (4, 16), (4, 1 << 20)):
        mod = ir.Module("own")
        fn = own_kernel(mod, CpuOptions(own_gemm_unroll=u, own_gemm_c_prefetch=pf, own_gemm_panel_rows=2 * rows),
                        rows, vecs, depth=depth)
        fn.linkage = "external"
        jits.append(llvm_env.jit(str(mod)))
        fns[u, pf] = proto(jits[-1].address(fn.name))
    rng = np.random.default_rng(12)
    M, N = 3 * rows + 1, 16 * vecs * 2 + 5
    for K in (1, 3, depth - 1, depth + 7, 2 * depth + 5):
        for a_rows in (False, True):
            A = (rng.standard_normal((K, M), dtype=np.float32).T if a_rows
                 else rng.standard_normal((M, K), dtype=np.float32))
            B = rng.standard_normal((K, N), dtype=np.float32)
            C0 = rng.standard_normal((M, N), dtype=np.float32)
            ks = [np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, K, np.int64)]
            for acc in (0, 1):
                got = {}
                for key, fn in fns.items():
                    C = C0.copy()
                    fn(M, N, K, A.ctypes.data, A.strides[0] // 4, A.strides[1] // 4, B.ctypes.data,
                       B.strides[0] // 4, B.strides[1] // 4, C.ctypes.data, N, acc, 1, *(x.ctypes.data for x in ks))
                    got[key] = C
                want = A.astype(np.float64) @ B.astype(np.float64) + (C0 if acc else 0)
                np.testing.assert_allclose(got[1, 0], want, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(want).max()))
                for key in fns:
                    assert np.array_equal(got[key], got[1, 0]), (K, a_rows, acc, key)
    for jit in jits:
        jit.close()


@pytest.mark.parametrize("blocks", [(4, 4, 64), (8, 2, 256)])
def test_variants_form_runs_each_product_over_its_own_k(blocks):
    """The own kernel runs several products on one packed B (a 1-D
    convolution's kernel gradient, one per tap: gemm_dispatch.shared_b_batch): product v is
    C + c_off[v] += (A + a_off[v]) B over K in [k_lo[v], k_hi[v]), each of the
    call's K blocks cut to that range. Bit for bit against those sums done in
    numpy, including a last block of columns the 4 x 4 kernel hands to the 8 x 2
    one and ranges cutting the blocks; an empty range writes nothing."""
    import llvmlite.ir as ir

    from tgc.backends.cpu import llvm_env
    from tgc.backends.cpu.fgemm import own_kernel

    rows, vecs, depth = blocks
    mod = ir.Module("own")
    multi = own_kernel(mod, CpuOptions(), rows, vecs, depth=depth)
    multi.linkage = "external"
    jit = llvm_env.jit(str(mod))
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    base = [i64, i64, i64, vp, i64, i64, vp, i64, i64, vp, i64, ctypes.c_int32]
    run_multi = ctypes.CFUNCTYPE(None, *base, i64, vp, vp, vp, vp)(jit.address(multi.name))
    rng = np.random.default_rng(7)
    M, N, K = 9, 64 + 17, 300
    A = rng.standard_normal((4 * M, K + 2), dtype=np.float32)     # product v: rows v*M.., row stride K + 2
    B = rng.standard_normal((N, K), dtype=np.float32).T            # K contiguous: packed transposed
    C0 = rng.standard_normal((4, M, N + 3), dtype=np.float32)      # product v: block v, row stride N + 3
    ranges = [(0, K), (5, 133), (200, 200), (37, K - 1)]            # the third is empty
    a_off = np.array([v * M * (K + 2) + v for v in range(4)], np.int64)
    c_off = np.array([v * M * (N + 3) for v in range(4)], np.int64)
    lo, hi = (np.array(x, np.int64) for x in zip(*ranges))
    C = C0.copy()
    run_multi(M, N, K, A.ctypes.data, K + 2, 1, B.ctypes.data, 1, K, C.ctypes.data, N + 3, 1,
              4, a_off.ctypes.data, c_off.ctypes.data, lo.ctypes.data, hi.ctypes.data)
    jit.close()
    assert depth == 256 or len(k_blocks(K, depth)) > 1   # depth 64: ranges cut the blocks
    for v, (r0, r1) in enumerate(ranges):
        flat = A.reshape(-1)   # product v's rows (the last one's last element is past A: never read)
        a = np.stack([np.pad(flat[s:s + K], (0, K - len(flat[s:s + K]))) for s in a_off[v] + (K + 2) * np.arange(M)])
        want = C0[v][:, :N].copy()
        for k0, k1 in k_blocks(K, depth):
            k0, k1 = max(k0, r0), min(k1, r1)
            if k0 < k1:
                want = want + fma_chain(np.zeros((M, N), np.float32), a[:, k0:k1], B[k0:k1])
        assert np.array_equal(C[v][:, :N], want), v
        assert np.array_equal(C[v][:, N:], C0[v][:, N:])
    assert np.array_equal(C[2], C0[2])


@pytest.mark.parametrize("depth", [256, 64])
def test_taps_form_sums_every_tap_in_one_call(depth):
    """`own_kernel(taps=True)` (gemm_dispatch.taps_in_one_call): C = the sum over taps t of
    (A + a_off[t]) (B + b_off[t]) over t's columns [q_lo, q_hi) and K [k_lo, k_hi),
    every element written (zeros where no tap reaches). Per K block (the taps share
    the block's buffer) the element is one chain of fused multiply-adds, tap by tap,
    from zero, then added to C: bit for bit against that in numpy, with one block
    (depth 256) and three (depth 64)."""
    import llvmlite.ir as ir

    from tgc.backends.cpu import llvm_env
    from tgc.backends.cpu.fgemm import own_kernel

    mod = ir.Module("own")
    taps = own_kernel(mod, CpuOptions(), depth=depth, taps=True)
    taps.linkage = "external"
    jit = llvm_env.jit(str(mod))
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    base = [i64, i64, i64, vp, i64, i64, vp, i64, i64, vp, i64, ctypes.c_int32]
    run_taps = ctypes.CFUNCTYPE(None, *base, i64, *[vp] * 6)(jit.address(taps.name))
    rng = np.random.default_rng(11)
    M, N, K, ld = 9, 64 + 40, 40 if depth == 256 else 200, 120
    A = rng.standard_normal((3, M, K), dtype=np.float32)           # tap t: A[t]
    B = rng.standard_normal((K, ld + 4), dtype=np.float32)          # tap t: B's columns from 2 t
    spans = [(3, N), (0, N - 7), (20, 30)]                           # columns per tap
    ks = [(0, K), (5, 33), (0, 0)]                                   # K per tap; the last adds nothing
    a_off = np.array([t * M * K for t in range(3)], np.int64)
    b_off = np.array([2 * t for t in range(3)], np.int64)
    q_lo, q_hi = (np.array(x, np.int64) for x in zip(*spans))
    k_lo, k_hi = (np.array(x, np.int64) for x in zip(*ks))
    C = np.full((M, N + 5), 7.0, np.float32)
    run_taps(M, N, K, A.ctypes.data, K, 1, B.ctypes.data, ld + 4, 1, C.ctypes.data, N + 5, 0, 3,
             *(x.ctypes.data for x in (a_off, b_off, q_lo, q_hi, k_lo, k_hi)))
    jit.close()
    assert (C[:, N:] == 7.0).all()
    blocks = k_blocks(K, depth, taps=3)
    assert len(blocks) == (1 if depth == 256 else 3)
    want = None
    for k0, k1 in blocks:
        part = np.zeros((M, N), np.float32)
        for t in range(3):
            (c0, c1), (r0, r1) = spans[t], ks[t]
            b_t = np.zeros((K, N), np.float32)
            b_t[:, c0:c1] = B[:, 2 * t + c0:2 * t + c1]
            lo, hi = max(k0, r0), min(k1, r1)
            if lo < hi:
                part = fma_chain(part, A[t][:, lo:hi], b_t[lo:hi])
        want = part if want is None else want + part
    assert np.array_equal(C[:, :N], want)


# the own kernel for every large tile, whatever its shape (the defaults keep it to wide, short ones)
EVERY_TILE = dict(own_gemm_min_cols=1, own_gemm_max_b_bytes=1 << 60)

MATMUL = """
dim b = 2
dim i = {i}
dim j = {j}
dim k = {k}
input A : f32[{a}]
input B : f32[{b_}]
%0 = contract %A, %B : f32[b, i, j]
out C = %0 : [{c}]
"""


@pytest.mark.parametrize("orders", [("b, i, k", "b, k, j", "b, i, j"), ("b, i, k", "b, j, k", "b, i, j"),
                                    ("b, k, i", "b, k, j", "b, j, i"), ("b, k, i", "b, j, k", "b, i, j")])
@pytest.mark.parametrize("sizes", [(150, 260, 300), (67, 33, 1000), (300, 17, 70)])
def test_products_with_own_gemm_match_numpy(orders, sizes):
    """Every operand order (A' with K contiguous read in place, with its rows
    contiguous packed by 16 x 16 transposes; B' packed with vector loads or, its K
    contiguous, by transposes), tiles cut on two threads, against numpy in float64;
    the own kernel is in the code of every order."""
    options = Options(dtype="f32").with_(own_gemm="on", threads=2, **EVERY_TILE)
    prog, *_ = _ordered_matmul(orders, sizes, options, 0)
    assert re.search(r'call void @"?tgc\.gemm\.own\.f32', prog.llvm_ir) is not None


@pytest.mark.parametrize("orders", [("b, i, k", "b, k, j", "b, i, j"), ("b, i, k", "b, j, k", "b, i, j"),
                                    ("b, k, i", "b, k, j", "b, j, i"), ("b, k, i", "b, j, k", "b, i, j")])
@pytest.mark.parametrize("sizes", [(600, 130, 48), (560, 300, 390), (178, 64, 64)])
def test_default_plan_sends_tall_tiles_to_the_own_kernel(orders, sizes):
    """With the default options, tiles of at least `own_gemm_min_rows` rows and two
    blocks of columns run the own kernel whatever their depth and B' (a transformer's
    products: 1024 tokens by 384 or 1536 features, attention's 256 x 256 x 64), on two
    threads (the plan's tiles of 300 and 280 rows), every operand order against numpy
    (an A' with its rows contiguous too: the kernel packs it); a product of few rows
    (an MLP's 178 x 64 x 64) does not even compile it, nor does an order whose A' has
    its rows contiguous with `own_gemm_transposed_a` off."""
    from tgc.ir.parser import parse_module
    from tgc.pipeline import compile_module

    a, b_, c = orders
    i, j, k = sizes
    prog, A, B, want = _ordered_matmul(orders, sizes, Options(dtype="f32").with_(threads=2), 1)
    own = re.search(r'call void @"?tgc\.gemm\.own\.f32', prog.llvm_ir) is not None
    assert own == (i >= CpuOptions().own_gemm_min_rows * 2)
    a_k = orders[0] == "b, i, k" if orders[2] == "b, i, j" else orders[1] == "b, j, k"   # A' has K contiguous
    if not a_k:
        off = compile_module(parse_module(MATMUL.format(i=i, j=j, k=k, a=a, b_=b_, c=c)),
                             Options(dtype="f32").with_(threads=2, own_gemm_transposed_a=False))
        assert re.search(r'call void @"?tgc\.gemm\.own\.f32', off.llvm_ir) is None
        np.testing.assert_allclose(off.run({"A": A, "B": B})["C"], want, rtol=2e-4, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("k", [2600, 4100])
def test_deep_one_column_block_runs_the_own_kernel_whatever_b(kernels, k):
    """A deep product of one block of columns whose A' has K contiguous (attention's
    P v and dS k over s keys: 128 x 64 x s tiles) runs the own kernel even where B'
    (k x 64 floats) is over `own_gemm_max_b_bytes`: the program's result has the
    kernel's bits (its sums depend on K's blocks only, not on the plan's tiles of
    rows), on 1 and 2 threads, and matches numpy in float64. With A' transposed
    (its rows contiguous) the rule does not apply: still correct."""
    assert k * 64 * 4 > CpuOptions().own_gemm_max_b_bytes
    sizes = (128, 64, k)
    for threads in (1, 2):
        prog, A, B, want = _ordered_matmul(("b, i, k", "b, k, j", "b, i, j"), sizes,
                                           Options(dtype="f32").with_(threads=threads), 5)
        got = prog.run({"A": A, "B": B})["C"]
        for bi in range(A.shape[0]):
            C = np.empty((128, 64), np.float32)
            call(kernels(6, 4, CpuOptions().own_gemm_depth), A[bi], B[bi], C, 0)
            assert np.array_equal(got[bi], C), (threads, bi)
    _ordered_matmul(("b, k, i", "b, k, j", "b, i, j"), sizes, Options(dtype="f32").with_(threads=1), 6)


def _ordered_matmul(orders, sizes, options, seed):
    """MATMUL with operand orders (A', B', C) and sizes (i, j, k), batch 2, compiled with
    `options` and run on random f32 operands; checked against numpy's float64 product.
    Returns the program, A, B and that product."""
    from tgc.ir.parser import parse_module
    from tgc.pipeline import compile_module

    a, b_, c = orders
    i, j, k = sizes
    prog = compile_module(parse_module(MATMUL.format(i=i, j=j, k=k, a=a, b_=b_, c=c)), options)
    rng = np.random.default_rng(seed)
    n = {"b": 2, "i": i, "j": j, "k": k}
    shape = lambda order: tuple(n[e.strip()] for e in order.split(","))  # noqa: E731
    A = rng.standard_normal(shape(a), dtype=np.float32)
    B = rng.standard_normal(shape(b_), dtype=np.float32)
    got = prog.run({"A": A, "B": B})["C"]
    sub = lambda o: "".join(e.strip() for e in o.split(","))  # noqa: E731
    want = np.einsum(f"{sub(a)},{sub(b_)}->{sub(c)}", A.astype(np.float64), B.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5 * np.abs(want).max())
    return prog, A, B, want


def conv_arrays(path, sizes, seed=1):
    rng = np.random.default_rng(seed)
    prog = tgc.compile(str(path), options=Options(dtype="f32").with_(own_gemm="off"))
    return {t.name: rng.standard_normal(tuple(sizes[t.name]), dtype=np.float32) for t in prog.inputs}, prog


def conv2d_source(cin, cout, h, w, k, pad, stride=1, out=None):
    """A padded 2-D convolution (y, dx, dK) of a k x k kernel; `out`: the output's
    (ho, wo) when strided."""
    ho, wo = out or ("h", "w")
    s = f"{stride}*" if stride != 1 else ""
    return f"""
dim batch
dim cin = {cin}, cout = {cout}, h = {h}, w = {w}, kh = {k}, kw = {k}
dim ho = {ho}, wo = {wo}
input  x[batch, cin, h, w]
input  dy[batch, cout, ho, wo]
param  K[cout, cin, kh, kw]
y    = x[h = {s}ho + kh - {pad}, w = {s}wo + kw - {pad}] @ K
loss = sum(y * dy)
out y[batch, cout, ho, wo]
out dx = grad(loss, x)
out dK = grad(loss, K)
"""


CONV2D_ODD = conv2d_source(32, 64, 23, 29, 3, 1)


@pytest.mark.parametrize("implicit", [False, True])
@pytest.mark.parametrize("case", ["conv2d", "conv1d", "conv2d_odd"])
def test_convolutions_with_own_gemm_match_the_interpreter_and_cblas(case, implicit, tmp_path):
    """Values and both gradients of the benchmark convolutions (at batch 18: one tile
    per signal or image) and of an odd-sized padded 2-D one, own kernel (and implicit
    GEMMs) against the f64 interpreter and against the cblas path; on 1 and 2 threads
    the same bits."""
    if case == "conv2d":
        path, sizes = ROOT / "benchmarks/workloads/conv2d.tg", {"x": (18, 32, 32, 32), "dy": (18, 64, 32, 32),
                                                                 "K": (64, 32, 3, 3)}
    elif case == "conv1d":
        path, sizes = ROOT / "benchmarks/workloads/conv1d.tg", {"x": (18, 64, 600), "dy": (18, 64, 600),
                                                                 "K": (64, 64, 5)}
    else:
        path = tmp_path / "odd.tg"
        path.write_text(CONV2D_ODD)
        sizes = {"x": (18, 32, 23, 29), "dy": (18, 64, 23, 29), "K": (64, 32, 3, 3)}
    arrays, off = conv_arrays(path, sizes)
    results = {}
    for threads in (1, 2):
        prog = tgc.compile(str(path), options=Options(dtype="f32").with_(own_gemm="on", implicit_gemm=implicit,
                                                                         threads=threads))
        assert "tgc.gemm.own" in prog.llvm_ir
        # conv1d's output and input gradient and conv2d's input gradient: all taps in one call
        assert kernel_name(CpuOptions().own_gemm_rows, CpuOptions().own_gemm_vecs) + ".taps" in prog.llvm_ir
        results[threads] = prog(**{k: v.copy() for k, v in arrays.items()})
    base = off(**{k: v.copy() for k, v in arrays.items()})
    opts = Options(dtype="f64")
    module = pipeline.lower(compile_source(path.read_text(), str(path), opts), opts).module
    want = evaluate(module, {k: v.astype(np.float64) for k, v in arrays.items()}, dtype="f64")
    for name in ("y", "dx", "dK"):
        w = np.asarray(want[name])
        scale = np.abs(w).max()
        for got in (results[1][name], base[name]):
            np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-5 * scale)
        assert np.array_equal(results[1][name], results[2][name]), name


def test_shared_b_batch_takes_the_taps_the_packed_operand_does_not_read():
    """conv1d's kernel gradient (batch k, the tap: dy shifted by k, x read whole as
    B') shares B' along k; its output product (B' = x shifted by the tap) and its
    input gradient (batched 32 times: one task per signal) share nothing; nor does
    a product whose batch size is symbolic."""
    from tgc.backends.cpu.gemm_dispatch import shared_b_batch
    from tgc.lower.lowered import GemmKernel

    src = (ROOT / "benchmarks/workloads/conv1d.tg").read_text()
    opts = Options(dtype="f32").with_(own_gemm="on")
    low = lowered(src, own_gemm="on")
    gemms = {k.out: k for k in low.kernels if isinstance(k, GemmKernel)}
    shared = {out: shared_b_batch(low, k, opts) for out, k in gemms.items()}
    assert shared == {"y": (), "dx": (), next(o for o in gemms if o not in ("y", "dx")): ("k",)}
    symbolic = lowered(src.replace("klen = 5", "klen"), own_gemm="on")
    assert not any(shared_b_batch(symbolic, k, opts) for k in symbolic.kernels if isinstance(k, GemmKernel))


CONV1D = """
dim batch
dim len{len}
dim cin = {cin}, cout = {cout}, klen = {k}
input  x[batch, cin, t: len]
input  dy[batch, cout, s: len]
param  K[cout, cin, k: klen]
y    = x[t = s + {dil}*k - {pad}] @ K
loss = sum(y * dy)
out y[batch, cout, s]
out dx = grad(loss, x)
out dK = grad(loss, K)
"""


@pytest.mark.parametrize("shape", [
    dict(batch=3, cin=8, cout=12, n=300, k=3, pad=1, dil=1),     # padded both sides
    dict(batch=2, cin=5, cout=7, n=83, k=4, pad=0, dil=1),       # zeros past the end only
    dict(batch=3, cin=6, cout=9, n=70, k=3, pad=3, dil=2),       # dilated
    dict(batch=2, cin=4, cout=30, n=6, k=3, pad=9, dil=1, len=""),   # symbolic len, every tap out of bounds
    dict(batch=17, cin=3, cout=20, n=40, k=5, pad=2, dil=1),     # batched 17 times: a task per signal
])
def test_shifted_products_in_every_form_match_the_interpreter(shape):
    """1-D convolutions whose products run the own kernel for every tile (no small
    tiles, no size bounds): the taps form (output, input gradient), the shared-B'
    form (kernel gradient) and the plain calls, at odd sizes, with taps partly or
    wholly out of bounds, against the f64 interpreter; 1 and 2 threads the same bits."""
    batch = shape.pop("batch")
    src = CONV1D.format(**{"len": f" = {shape['n']}", **shape})
    rng = np.random.default_rng(5)
    arrays = {"x": rng.standard_normal((batch, shape["cin"], shape["n"]), dtype=np.float32),
              "dy": rng.standard_normal((batch, shape["cout"], shape["n"]), dtype=np.float32),
              "K": rng.standard_normal((shape["cout"], shape["cin"], shape["k"]), dtype=np.float32)}
    every = dict(own_gemm="on", gemm_loop_max_flops=0, **EVERY_TILE)
    got = {}
    for threads in (1, 2):
        prog = tgc.compile(src, options=Options(dtype="f32").with_(threads=threads, **every))
        got[threads] = prog(**arrays)
    assert ".taps" in prog.llvm_ir
    f64 = Options(dtype="f64")
    module = pipeline.lower(compile_source(src, "<test>", f64), f64).module
    want = evaluate(module, {k: v.astype(np.float64) for k, v in arrays.items()}, dtype="f64")
    for name in ("y", "dx", "dK"):
        w = np.asarray(want[name])
        np.testing.assert_allclose(got[1][name], w, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(w).max()), err_msg=name)
        assert np.array_equal(got[1][name], got[2][name]), name


def test_taps_in_one_call_where_shifts_move_b_columns_or_k():
    """conv1d's output (x shifted along its columns) and input gradient (dy shifted,
    B' after the flip) run all 5 taps in one call; its kernel gradient shares B'
    instead; with the taps' count symbolic, none does. conv2d's input gradient (3
    taps) does too."""
    from tgc.backends.cpu.gemm_dispatch import taps_in_one_call
    from tgc.lower.lowered import GemmKernel

    opts = Options(dtype="f32").with_(own_gemm="on")
    src = (ROOT / "benchmarks/workloads/conv1d.tg").read_text()
    low = lowered(src, own_gemm="on")
    got = {k.out: taps_in_one_call(low, k, opts) for k in low.kernels if isinstance(k, GemmKernel)}
    assert got.pop("y") and got.pop("dx") and not any(got.values())
    low = lowered(src.replace("klen = 5", "klen"), own_gemm="on")
    assert not any(taps_in_one_call(low, k, opts) for k in low.kernels if isinstance(k, GemmKernel))
    low = lowered((ROOT / "benchmarks/workloads/conv2d.tg").read_text(), own_gemm="on", implicit_gemm=True)
    assert [taps_in_one_call(low, k, opts) for k in low.kernels if isinstance(k, GemmKernel)] == [True]


def test_own_gemm_off_calls_cblas_only():
    """`own_gemm="off"` generates no own kernel (and no implicit GEMM); "on" with
    `implicit_gemm` sends the benchmark conv2d's three products to it: the input gradient's (the shared kernel) and the two that
    read the window (each its own copy, packing the window: implicit.py)."""
    import re

    path = str(ROOT / "benchmarks/workloads/conv2d.tg")
    off = tgc.compile(path, options=Options(dtype="f32").with_(own_gemm="off", implicit_gemm=True))
    on = tgc.compile(path, options=Options(dtype="f32").with_(own_gemm="on", implicit_gemm=True))
    assert "tgc.gemm.own" not in off.llvm_ir and ".own" not in off.llvm_ir
    assert re.search(r"call void @\"?tgc\.gemm\.own\.f32", on.llvm_ir)
    assert len(re.findall(r'define [^\n]*@"tgc\.k\d+\.own"', on.llvm_ir)) == 2


# ---------------------------------------------------------------- implicit GEMMs (implicit.py)


def lowered(source: str, dtype: str = "f32", **opts):
    from tgc.pipeline import lower_module

    options = Options(dtype=dtype).with_(**opts)
    module = pipeline.lower(compile_source(source, "<test>", options), options).module
    return lower_module(module, options)


PADDED_5X5 = conv2d_source(24, 40, 15, 21, 5, 2)


def test_conv2d_windows_are_packed_not_stored():
    """With implicit GEMMs, the benchmark conv2d's window (9x the image) is no buffer:
    two implicit GEMMs (y and dK) pack it from x, and the im2col loop is gone; the
    workspace drops from 25.2 MB to the input gradient's partial. Implicit GEMMs are
    the default; with `implicit_gemm=False` the plan keeps the copy."""
    from tgc.backends.cpu.implicit import ImplicitGemm

    text = (ROOT / "benchmarks/workloads/conv2d.tg").read_text()
    on, off = lowered(text, own_gemm="on"), lowered(text, own_gemm="on", implicit_gemm=False)
    imp = [k for k in on.kernels if isinstance(k, ImplicitGemm)]
    assert len(imp) == 2 and {k.source for k in imp} == {"x"}
    outs = {k.gemm.out for k in imp}
    assert "y" in outs and len(outs) == 2   # y, and dK's product (summed over the batch: taps)
    assert any(k.gemm.taps == ("batch",) for k in imp)
    assert not any(isinstance(k, LoopKernel) and k.out == imp[0].window for k in on.kernels)
    assert imp[0].window not in on.buffers
    assert not any(isinstance(k, ImplicitGemm) for k in off.kernels)
    assert any(isinstance(k, LoopKernel) and len(off.buffers[k.out].edges) == 6 for k in off.kernels)
    env = {"batch": 16}
    bytes_on, bytes_off = (sum(explain_slot(low, env)) for low in (on, off))
    assert bytes_on < bytes_off / 3


def explain_slot(low, env):
    from tgc.ir.sizes import size_eval

    return [max(size_eval(s, env) for s in sizes) for sizes in low.slots]


def test_implicit_plan_reads_back_verifies_and_interprets():
    """The lowered text of an implicit GEMM reads back to the same program; the
    verifier accepts it and refuses a window that is also a buffer; the lowered
    interpreter (gather, then the product) gives the f64 values."""
    from tgc.lower.interp import run_lowered
    from tgc.lower.lowered import print_lowered
    from tgc.lower.text import parse_lowered
    from tgc.lower.verify import VerifyError, verify_lowered

    low = lowered(PADDED_5X5, "f32", own_gemm="on", implicit_gemm=True)   # the own kernel is f32's
    text = print_lowered(low)
    assert "implicit %" in text
    back = parse_lowered(text)
    assert print_lowered(back) == text
    verify_lowered(back)
    rng = np.random.default_rng(5)
    arrays = {"x": rng.standard_normal((2, 24, 15, 21)), "dy": rng.standard_normal((2, 40, 15, 21)),
              "K": rng.standard_normal((40, 24, 5, 5))}
    opts = Options(dtype="f64")
    module = pipeline.lower(compile_source(PADDED_5X5, "<test>", opts), opts).module
    want = evaluate(module, dict(arrays), dtype="f64")
    got = run_lowered(back, {k: v.astype(np.float32) for k, v in arrays.items()})
    for name in ("y", "dx", "dK"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5 * np.abs(want[name]).max())
    window = next(k for k in back.kernels if hasattr(k, "window")).window
    bad = back.staged(back.stage)
    bad.buffers[window] = next(k for k in back.kernels if hasattr(k, "window")).buffer("f32")
    bad.buffers[window].slot = 0
    with pytest.raises(VerifyError, match="also a buffer"):
        verify_lowered(bad)


@pytest.mark.parametrize("threads, rows", [(1, 6), (2, 6), (1, 4), (1, 5)])
def test_implicit_gemm_values_padding_two_and_odd_sizes(threads, rows):
    """A 5 x 5 kernel with padding 2 on a 15 x 21 image, 24 -> 40 channels (windows cut
    at both ends of rows and columns; 21-wide rows, so the segments of a packed block
    start anywhere in an image row and cross rows; blocks of rows and columns with
    partial edges: 40 rows of y in blocks of 6 or 5 or 4, `own_gemm_window_rows`):
    values and gradients against the f64 interpreter, with the window packed by both
    implicit products (y: B', dK: A')."""
    from tgc.backends.cpu.implicit import ImplicitGemm

    assert sum(isinstance(k, ImplicitGemm) for k in lowered(PADDED_5X5, own_gemm="on", implicit_gemm=True).kernels) == 2
    rng = np.random.default_rng(6)
    arrays = {"x": rng.standard_normal((17, 24, 15, 21), dtype=np.float32),
              "dy": rng.standard_normal((17, 40, 15, 21), dtype=np.float32),
              "K": rng.standard_normal((40, 24, 5, 5), dtype=np.float32)}
    _against_f64(PADDED_5X5, arrays, implicit_gemm=True, threads=threads, own_gemm_window_rows=rows)


def _against_f64(src, arrays, **opts):
    """y, dx and dK of `src` with the own kernel (and `opts`) against the f64 interpreter.
    The arrays go in as they are (a copy would move a misaligned x onto a line)."""
    got = tgc.compile(src, options=Options(dtype="f32").with_(own_gemm="on", **opts))(**arrays)
    f64 = Options(dtype="f64")
    module = pipeline.lower(compile_source(src, "<test>", f64), f64).module
    want = evaluate(module, {k: np.asarray(v, np.float64) for k, v in arrays.items()}, dtype="f64")
    for name in ("y", "dx", "dK"):
        w = np.asarray(want[name])
        np.testing.assert_allclose(got[name], w, rtol=1e-4, atol=1e-5 * np.abs(w).max(), err_msg=name)


@pytest.mark.parametrize("case", ["9x9 kernel", "misaligned x", "aligned x"])
def test_implicit_packer_masks_and_line_offsets(case):
    """The packer's paths (fgemm._Lanes): a 9 x 9 kernel has 81 row classes, more
    than the table holds masks for, so each row compares its conditions; the 5 x 5
    kernel's 25 classes load their masks. Each run of 16 floats is read from the two
    aligned lines that hold it: an x that starts 4 bytes past a 64-byte line moves
    every run's offset into its lines (and a run that starts on a line has none)."""
    from tgc.backends.cpu.implicit import ImplicitGemm

    src = conv2d_source(24, 40, 15, 21, 9, 4) if case == "9x9 kernel" else PADDED_5X5
    assert sum(isinstance(k, ImplicitGemm) for k in lowered(src, own_gemm="on").kernels) == 2
    rng = np.random.default_rng(8)
    k = 9 if case == "9x9 kernel" else 5
    n = 3 * 24 * 15 * 21
    buf = np.empty(n + 32, np.float32)
    at = (-buf.ctypes.data // 4) % 16 + (1 if case == "misaligned x" else 0)
    x = buf[at:at + n].reshape(3, 24, 15, 21)
    x[...] = rng.standard_normal(x.shape)
    assert (x.ctypes.data % 64 == 4) == (case == "misaligned x")
    arrays = {"x": x, "dy": rng.standard_normal((3, 40, 15, 21), dtype=np.float32),
              "K": rng.standard_normal((40, 24, k, k), dtype=np.float32)}
    _against_f64(src, arrays)


def test_strided_window_stays_a_copy():
    """A stride-2 window reads x's columns two apart: the packer's runs need one
    element per step, so the copy stays (and the values are right)."""
    from tgc.backends.cpu.implicit import ImplicitGemm

    src = conv2d_source(24, 40, 15, 21, 5, 2, stride=2, out=(8, 11))
    low = lowered(src, own_gemm="on", implicit_gemm=True)
    assert not any(isinstance(k, ImplicitGemm) for k in low.kernels)
    rng = np.random.default_rng(7)
    arrays = {"x": rng.standard_normal((3, 24, 15, 21), dtype=np.float32),
              "dy": rng.standard_normal((3, 40, 8, 11), dtype=np.float32),
              "K": rng.standard_normal((40, 24, 5, 5), dtype=np.float32)}
    _against_f64(src, arrays, implicit_gemm=True)


def test_implicit_candidate_whose_other_operand_is_renamed():
    """The implicit stage reads the other operand's matrix form through its view: here
    the product reads W6's edge n as u (`W6[u = u - 1]`), which its buffer's own order
    does not name (looked up there, an internal error). Values against the f64
    interpreter (tests/fuzz/regressions/implicit_gemm_renamed_operand.tg)."""
    src = (ROOT / "tests/fuzz/regressions/implicit_gemm_renamed_operand.tg").read_text()
    rng = np.random.default_rng(3)
    arrays = {"W6": rng.standard_normal((1, 3), dtype=np.float32), "W8": rng.standard_normal((2, 3), dtype=np.float32),
              "edge_v2": rng.standard_normal(3, dtype=np.float32)}
    got = tgc.compile(src, options=Options(dtype="f32").with_(own_gemm="on", implicit_gemm=True))(**arrays)
    f64 = Options(dtype="f64")
    module = pipeline.lower(compile_source(src, "<test>", f64), f64).module
    want = evaluate(module, {k: np.asarray(v, np.float64) for k, v in arrays.items()}, dtype="f64")
    np.testing.assert_allclose(got["h2"], want["h2"], rtol=1e-5, atol=1e-6)


ATTENTION = """
dim batch = 2, head = 2, hd = 64, t = 256, s = 256
input q[batch, head, t, hd], k[batch, head, s, hd], v[batch, head, s, hd], dy[batch, head, t, hd]
p = softmax[s](dot[hd](q, k) / 8 - 1e9 * [s > t])
y = sum[s](p * v)
loss = sum(y * dy)
out y
out dq = grad(loss, q)
out dk = grad(loss, k)
out dv = grad(loss, v)
"""


@pytest.mark.slow
def test_attention_backward_products_with_transposed_a_match_the_interpreter(tmp_path):
    """Causal attention's value and gradients at t = 256 (its backward products have
    A' with its rows contiguous: the own kernel takes them, packing A' where B' has
    more than one block of columns), f32 on 1 and 2 threads (the same bits) and with
    `own_gemm_transposed_a` off (cblas), and f64, against the f64 interpreter."""
    from tgc.backends.cpu.codegen import leaf_kernels
    from tgc.backends.cpu.gemm_dispatch import a_k_contiguous, uses_own_gemm
    from tgc.lower.lowered import GemmKernel

    path = tmp_path / "attention.tg"
    path.write_text(ATTENTION)
    rng = np.random.default_rng(3)
    shapes = {"q": (2, 2, 256, 64), "k": (2, 2, 256, 64), "v": (2, 2, 256, 64), "dy": (2, 2, 256, 64)}
    arrays = {n: rng.standard_normal(s, dtype=np.float32) for n, s in shapes.items()}
    opts = Options(dtype="f64")
    module = pipeline.lower(compile_source(ATTENTION, str(path), opts), opts).module
    want = evaluate(module, {n: a.astype(np.float64) for n, a in arrays.items()}, dtype="f64")
    got = {}
    for key, options in {"1": Options(dtype="f32").with_(threads=1), "2": Options(dtype="f32").with_(threads=2),
                         "off": Options(dtype="f32").with_(own_gemm_transposed_a=False),
                         "f64": Options(dtype="f64")}.items():
        prog = tgc.compile(str(path), options=options)
        if key != "f64":   # products whose A' has its rows contiguous that the own kernel may take
            transposed = [k for lw, k in leaf_kernels(prog.lowered) if isinstance(k, GemmKernel)
                          and not a_k_contiguous(lw, k) and uses_own_gemm(lw, k, prog.options)]
            assert len(transposed) >= (2 if key in "12" else 0) and (key != "off" or not transposed)
        dtype = np.float64 if key == "f64" else np.float32
        got[key] = prog(**{n: a.astype(dtype) for n, a in arrays.items()})
    for name in ("y", "dq", "dk", "dv"):
        w = np.asarray(want[name])
        scale = np.abs(w).max()
        for key in ("1", "off"):
            np.testing.assert_allclose(got[key][name], w, rtol=1e-4, atol=1e-5 * scale)
        np.testing.assert_allclose(got["f64"][name], w, rtol=1e-10, atol=1e-12 * scale)
        assert np.array_equal(got["1"][name], got["2"][name]), name


@pytest.fixture(scope="module")
def tri_kernels():
    """(rows, vecs, depth, panel rows) -> the ctypes function of the kernel's `tri` form."""
    yield from _jitted_kernels(tri=True)


def call_tri(fn, A, B, C, accumulate, mask):
    (M, K), N = A.shape, B.shape[1]
    s = 4
    one = [np.zeros(1, np.int64) for _ in range(3)] + [np.full(1, K, np.int64)]
    fn(M, N, K, A.ctypes.data, A.strides[0] // s, A.strides[1] // s, B.ctypes.data, B.strides[0] // s, B.strides[1] // s,
       C.ctypes.data, C.strides[0] // s, accumulate, 1, *(x.ctypes.data for x in one), *mask)


MASKS = [(-1, 1, 0, 0), (1, -1, 0, 0), (-1, 1, 0, -5), (1, -1, 0, 3),          # on C: q >= p, p >= q, ...
         (1, 0, 0, -7), (0, -1, 0, 21), (0, 1, 0, -20),                         # ... p >= 7, q <= 21, q >= 20
         (1, 0, -1, 0), (-1, 0, 1, 0), (1, 0, -1, 7), (0, 1, -1, 0), (0, -1, 1, -2)]   # zeros of A or B over r


@pytest.mark.parametrize("blocks", [(6, 4, 64, 12), (8, 2, 32, 384), (6, 4, 320, 384)])
@pytest.mark.parametrize("mask", MASKS)
def test_tri_kernel_masks_c_or_skips_zero_terms(kernels, tri_kernels, blocks, mask):
    """The `tri` form (fgemm.own_kernel): with a mask over C's rows p and columns q
    (cr = 0), C = (A B) * [cp p + cq q + c >= 0], exactly 0 at every rejected element
    (whole blocks of rows skipped, the diagonal blocks stored through the mask), and
    C + that when adding; with a mask over r, A (cp) or B (cq) zero where it rejects,
    the same bits as the plain kernel, which sums every term. Sizes across the
    register blocks, the narrow last column block, several row panels and K blocks;
    A with its K or its rows contiguous."""
    rows, vecs, depth, panel = blocks
    cp, cq, cr, c = mask
    fn, plain = tri_kernels(rows, vecs, depth, panel), kernels(rows, vecs, depth, panel)
    rng = np.random.default_rng(abs(hash(mask)) % 1000)
    for M, N, K in ((1, 1, 1), (rows + 1, 17, 5), (3 * rows + 2, 16 * vecs + 9, depth + 3),
                    (40, 40, 40), (100, 3 * 16 * vecs - 5, 2 * depth + 5), (64, 24, 70)):
        for a_rows in (False, True):
            A = (rng.standard_normal((K, M + 2), dtype=np.float32)[:, :M].T if a_rows
                 else rng.standard_normal((M, K + 1), dtype=np.float32)[:, :K])
            B = rng.standard_normal((K, N), dtype=np.float32)
            p, q, r = np.arange(M)[:, None], np.arange(N)[None, :], np.arange(K)
            if cr == 0:
                keep = cp * p + cq * q + c >= 0
                want = np.where(keep, A.astype(np.float64) @ B.astype(np.float64), 0.0)
                C = np.full((M, N), np.nan, np.float32)
                call_tri(fn, A, B, C, 0, mask)
                assert (C[~keep] == 0).all()
                np.testing.assert_allclose(C, want, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(want).max()))
                call_tri(fn, A, B, C, 1, mask)
                np.testing.assert_allclose(C, 2 * want, rtol=1e-5, atol=2e-5 * max(1.0, np.abs(want).max()))
                continue
            A = A.copy() if not a_rows else np.asfortranarray(A)
            if cp:
                A[cp * p + cr * r[None, :] + c < 0] = 0.0
            else:
                B[cr * r[:, None] + cq * q + c < 0] = 0.0
            got, ref = np.zeros((M, N), np.float32), np.zeros((M, N), np.float32)
            call_tri(fn, A, B, got, 0, mask)
            call(plain, A, B, ref, 0)
            assert got.tobytes() == ref.tobytes()
            call_tri(fn, A, B, got, 1, mask)
            call(plain, A, B, ref, 1)
            assert got.tobytes() == ref.tobytes()


@pytest.mark.parametrize("orders", [("b, i, k", "b, k, j", "b, i, j"), ("b, i, k", "b, j, k", "b, i, j"),
                                    ("b, k, i", "b, k, j", "b, j, i"), ("b, k, i", "b, j, k", "b, i, j")])
@pytest.mark.parametrize("sizes", [(70, 65, 300), (80, 72, 260)])
def test_tiles_a_little_wider_than_a_block_run_the_edge_block(orders, sizes):
    """A tile of C' with 65 to 80 columns (nanoGPT's vocabulary of 65) runs the own
    kernel's 4 x 5 edge block over all of its columns (`gemm_dispatch.edge_vecs`), in
    every operand order (A' with its rows contiguous read in place), on two threads,
    against numpy in float64; the block is in the code, and not with
    `own_gemm_edge_vecs` at most `own_gemm_vecs`, nor for a product whose columns are
    a whole block (64) or whose tiles never have 65 to 80 columns (81: 64 and 17)."""
    from tgc.ir.parser import parse_module
    from tgc.pipeline import compile_module

    options = Options(dtype="f32").with_(threads=2)
    edge = kernel_name(4, CpuOptions().own_gemm_edge_vecs)
    prog, A, B, want = _ordered_matmul(orders, sizes, options, 2)
    assert re.search(rf'call void @"?{re.escape(edge)}"?\(', prog.llvm_ir) is not None
    i, j, k = sizes
    if sizes != (70, 65, 300):
        return
    off = compile_module(parse_module(MATMUL.format(i=i, j=j, k=k, a=orders[0], b_=orders[1], c=orders[2])),
                         options.with_(own_gemm_edge_vecs=4))
    assert edge not in off.llvm_ir
    np.testing.assert_allclose(off.run({"A": A, "B": B})["C"], want, rtol=2e-4, atol=2e-5 * np.abs(want).max())
    for cols in (64, 81):
        wider = (i, cols, k) if orders[2] == "b, i, j" else (cols, j, k)
        plain, *_ = _ordered_matmul(orders, wider, options, 3)
        assert edge not in plain.llvm_ir


def _aligned(shape, off_bytes: int, rng) -> np.ndarray:
    """A float32 array of `shape` (random normal) starting `off_bytes` past a 64-byte line."""
    n = int(np.prod(shape))
    buf = np.empty(n + 32, np.float32)
    start = (-buf.ctypes.data % 64 + off_bytes) // 4
    out = buf[start:start + n].reshape(shape)
    out[...] = rng.standard_normal(shape, dtype=np.float32)
    return out


def test_b_one_block_wide_on_the_lines_is_read_in_place_with_the_same_bits():
    """`own_gemm_b_in_place`: a B' with its columns contiguous, its rows exactly one block
    of columns apart (64 floats: attention's v in P v, k in dS k) and on a 64-byte line is
    the kernel's packed block already: read where it is (the kernel tests B's address;
    "off" compiles no such test), with the bits of the packed path, storing into C and
    adding to it, over several K blocks; a B off the lines by 16 bytes, or with a wider
    row stride, is packed as before."""
    import llvmlite.ir as ir

    from tgc.backends.cpu import llvm_env
    from tgc.backends.cpu.fgemm import own_kernel

    rows, vecs, depth = 6, 4, 64
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    proto = ctypes.CFUNCTYPE(None, i64, i64, i64, vp, i64, i64, vp, i64, i64, vp, i64, ctypes.c_int32,
                             i64, vp, vp, vp, vp)
    fns, jits, text = {}, [], {}
    for on in (False, True):
        mod = ir.Module("own")
        fn = own_kernel(mod, CpuOptions(own_gemm_b_in_place=on), rows, vecs, depth=depth)
        fn.linkage = "external"
        text[on] = str(fn)
        jits.append(llvm_env.jit(str(mod)))
        fns[on] = proto(jits[-1].address(fn.name))
    assert re.search(r"and i64 %\S+, 63", text[True]) and not re.search(r"and i64 %\S+, 63", text[False])
    rng = np.random.default_rng(31)
    for K in (1, depth - 1, depth + 7, 3 * depth + 5):
        for M in (1, rows + 1, 4 * rows + 3):
            A = rng.standard_normal((M, K), dtype=np.float32)
            for off, stride in ((0, 64), (16, 64), (0, 80)):
                B = _aligned((K, stride), off, rng)[:, :64]
                C0 = rng.standard_normal((M, 64), dtype=np.float32)
                for acc in (0, 1):
                    got = {}
                    for on, fn in fns.items():
                        C = C0.copy()
                        call(fn, A, B, C, acc)
                        got[on] = C
                    want = A.astype(np.float64) @ B.astype(np.float64) + (C0 if acc else 0)
                    np.testing.assert_allclose(got[True], want, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(want).max()))
                    assert np.array_equal(got[True], got[False]), (K, M, off, stride, acc)
    for jit in jits:
        jit.close()


ROW_TILES = """
dim p = 128, r = 1024, q = 64
input a[p, r]
input b[r, q]
out c[p, q] = sum[r](a * b)
"""


def test_row_tiles_on_one_thread_run_as_one_call_with_the_same_bits():
    """`gemm_merge_rows`: a product whose plan cuts only its rows (P v of a stream step:
    128 rows in two tiles of 64, each packing all of B') run whole on one thread takes
    both tiles in one call of the own kernel (the entry's second serial call of the
    work function, with tiles of all of P; "off" has none), with the bits of the cut
    tiles on one thread and on two (the kernel's K blocks depend on K alone), whether B'
    is on the lines (read in place) or not (packed)."""
    prog = {}
    for name, opts in (("off", dict(threads=1, gemm_merge_rows=False)), ("on", dict(threads=1)),
                       ("2", dict(threads=2))):
        prog[name] = tgc.compile(ROW_TILES, backend="cpu", options=Options(dtype="f32").with_(**opts))
    work_calls = {n: len(re.findall(r'call void @"?tgc\.k\d+\.work"?\(', p.llvm_ir)) for n, p in prog.items()}
    assert work_calls["on"] == work_calls["off"] + 1
    rng = np.random.default_rng(5)
    a = rng.standard_normal((128, 1024), dtype=np.float32)
    for off in (0, 16):
        b = _aligned((1024, 64), off, rng)
        got = {n: p(a=a, b=b)["c"] for n, p in prog.items()}
        want = a.astype(np.float64) @ b.astype(np.float64)
        np.testing.assert_allclose(got["on"], want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
        assert np.array_equal(got["on"], got["off"]) and np.array_equal(got["on"], got["2"])
