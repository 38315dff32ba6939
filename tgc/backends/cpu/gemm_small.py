"""GEMM tiles without BLAS: loop nests generated once per program and shared by its
GEMM kernels (`GemmGen`, gemm.py, calls them).

Small tiles. A tile of at most `options.cpu.gemm_loop_max_flops` flops is computed by a
generated loop nest instead of a cblas call (`tgc.gemm.small.*`, shared by every
kernel of the module): rows of C' in blocks of 4 (a last partial block reads its
last row again and stores only its rows), columns in vectors of the host's widest
SIMD (masked at the edge), the K loop accumulating 4 x 2 vectors in
registers with fused multiply-adds. K goes in blocks of `options.cpu.sum_chunk`:
each block's part of an element of C' is a chain of fused multiply-adds from zero
in K's order, added to the element's total (C' when the call accumulates, else
zero) at the block's end, so no chain is longer than a block (exact as a GEMM may
be: a contraction's sum may be reassociated). One chain over all of K lost f32
accuracy on long sums: a 4 x 4096 x 16 product of positive operands was 2.5e-6
off norm-wise, 11x PyTorch f32's 2.2e-7. Q must be contiguous in B' too; when it is not,
B' is first gathered (packed) into a stack buffer of `options.cpu.gemm_pack_elems` elements, its rows
padded to whole vectors (larger tiles go to BLAS). Which path a tile takes is decided
at run time from the tile sizes (constants when the dims are fixed at build time, then
LLVM drops the other).

Without BLAS. With `options.cpu.blas` "system" or "none" (`tgc build`'s libraries, whose
caller may put no BLAS in the function table; the JIT's table has none with "none"),
a larger tile calls cblas only when the table has it, and otherwise the blocked loops
(`tgc.gemm.loops.*`): the small-tile kernel over blocks of columns and chunks of K
that fit its pack buffer. With "numpy" (the JIT's default) the code is as above.
"""
from __future__ import annotations

import llvmlite.ir as ir

from tgc.backends.cpu.irutil import (I1, I32, I64, PTR, define, export, for_range, gather_intrinsic, masked_intrinsics,
                                     optimize_not, splat)

from tgc.backends.cpu.options import CpuOptions

ROWS = 4          # rows of C' per register block of the small-tile kernel


def vector_lanes(fp) -> int:
    """The lanes of the widest vector of `fp` the kernels use (512 bits)."""
    return 16 if isinstance(fp, ir.FloatType) else 8


def small_kernel(mod: ir.Module, fp, packed: bool, cpu: CpuOptions, home: ir.Module | None = None) -> ir.Function:
    """void tgc.gemm.small.<T>[.packed](i64 M, i64 N, i64 K, T* A, i64 sAm, i64 sAk,
    T* B, i64 sBk, i64 sBn, T* C, i64 ldc, i32 accumulate):
    C[M, N] (+)= A[M, K] B[K, N] with C's N contiguous; B's N contiguous (sBn is
    ignored) unless `packed` (then B is first copied into a stack buffer; K*N must
    not exceed `cpu.gemm_pack_elems`, the buffer's capacity: a larger tile goes to BLAS). One function per program and kind: defined in `home`
    (default `mod`) and, when that is another unit of the program, declared in
    `mod`."""
    tag = "f32" if isinstance(fp, ir.FloatType) else "f64"
    name = f"tgc.gemm.small.{tag}" + (".packed" if packed else "")
    if name in mod.globals:
        return mod.globals[name]
    if home is not None and home is not mod:
        return export(small_kernel(home, fp, packed, cpu), mod)
    if packed:
        return _packed_kernel(mod, fp, name, small_kernel(mod, fp, False, cpu), cpu.gemm_pack_elems)
    fn = define(mod, name, ir.VoidType(), [I64, I64, I64, PTR, I64, I64, PTR, I64, I64, PTR, I64, I32])
    fn.attributes.add("noinline")
    M, N, K, pa, sam, sak, pb, sbk, _sbn, pc, ldc, acc = fn.args
    for a in (pa, pb, pc):
        a.add_attribute("noalias")
    entry = ir.IRBuilder(fn.append_basic_block("entry"))
    body = fn.append_basic_block("body")
    b = ir.IRBuilder(body)
    vl = vector_lanes(fp)
    vt = ir.VectorType(fp, vl)
    mt = ir.VectorType(I1, vl)
    accs = [[entry.alloca(vt, name=f"acc{r}.{c}") for c in range(2)] for r in range(ROWS)]
    parts = [[entry.alloca(vt, name=f"part{r}.{c}") for c in range(2)] for r in range(ROWS)]
    depth = max(1, cpu.sum_chunk)
    iota = ir.Constant(ir.VectorType(I64, vl), [i for i in range(vl)])
    accumulate = b.icmp_signed("!=", acc, I32(0))
    acc_mask = splat(b, accumulate, mt)
    zero_v = ir.Constant(vt, [0.0] * vl)
    load_fn, store_fn, fma_fn = masked_intrinsics(mod, fp, vl)
    align = I32(4 if isinstance(fp, ir.FloatType) else 8)

    def block(i0, j0, nc):
        """ROWS rows from i0 by nc vectors of columns from j0. Rows past M read row
        M - 1 and store nothing: every block is a whole one, so the kernel has two
        kinds of block (one or two vectors), not six (blocks of 4, 2 and 1 rows take
        LLVM ~3x as long to compile, in every program with a GEMM)."""
        masks = []
        for c in range(nc):
            left = b.sub(N, b.add(j0, I64(c * vl)))
            masks.append(b.icmp_signed("<", iota, splat(b, left, ir.VectorType(I64, vl))))
        last = b.sub(M, I64(1))
        rows = [b.add(i0, I64(r)) for r in range(ROWS)]
        inside = [b.icmp_signed("<", i, M) for i in rows]
        real = [splat(b, x, mt) for x in inside]
        rows = [b.select(x, i, last) for x, i in zip(inside, rows)]
        crow = [b.gep(pc, [b.add(b.mul(i, ldc), j0)], source_etype=fp) for i in rows]
        for r in range(ROWS):
            for c in range(nc):
                p = b.gep(crow[r], [I64(c * vl)], source_etype=fp)
                init = b.call(load_fn, [p, align, b.and_(masks[c], acc_mask), zero_v])
                b.store(init, accs[r][c])
        arow = [b.gep(pa, [b.mul(i, sam)], source_etype=fp) for i in rows]
        # K in blocks of `depth`, each block's sum from zero, then added to the total
        # (see the module's docstring); not unrolled: LLVM's runtime unrolling of the k
        # loops cost ~18 ms of compile time in every program with a GEMM, for ~3% on an
        # 11 x 11 x 16 tile
        with for_range(b, I64(0), b.sdiv(b.add(K, I64(depth - 1)), I64(depth)), "kb", unroll=False) as kb:
            k0 = b.mul(kb, I64(depth))
            k1 = b.add(k0, I64(depth))
            k1 = b.select(b.icmp_signed("<", K, k1), K, k1)
            for r in range(ROWS):
                for c in range(nc):
                    b.store(zero_v, parts[r][c])
            with for_range(b, k0, k1, "k", unroll=False) as kk:
                brow = b.gep(pb, [b.add(b.mul(kk, sbk), j0)], source_etype=fp)
                bv = [b.call(load_fn, [b.gep(brow, [I64(c * vl)], source_etype=fp), align, masks[c], zero_v])
                      for c in range(nc)]
                for r in range(ROWS):
                    a = b.load(b.gep(arow[r], [b.mul(kk, sak)], source_etype=fp), typ=fp)
                    av = splat(b, a, vt)
                    for c in range(nc):
                        b.store(b.call(fma_fn, [av, bv[c], b.load(parts[r][c], typ=vt)]), parts[r][c])
            for r in range(ROWS):
                for c in range(nc):
                    total = b.fadd(b.load(accs[r][c], typ=vt), b.load(parts[r][c], typ=vt))
                    b.store(total, accs[r][c])
        for r in range(ROWS):
            for c in range(nc):
                p = b.gep(crow[r], [I64(c * vl)], source_etype=fp)
                b.call(store_fn, [b.load(accs[r][c], typ=vt), p, align, b.and_(masks[c], real[r])])

    # columns: two vectors at a time while more than one vector is left
    pairs = b.sdiv(b.add(N, I64(2 * vl - 1)), I64(2 * vl))  # ceil(N / 2vl) blocks
    with for_range(b, I64(0), b.sdiv(b.add(M, I64(ROWS - 1)), I64(ROWS)), "ib") as ib:
        i0 = b.mul(ib, I64(ROWS))
        with for_range(b, I64(0), pairs, "jb") as jb:
            j0 = b.mul(jb, I64(2 * vl))
            two = b.icmp_signed(">", b.sub(N, j0), I64(vl))
            with b.if_else(two) as (then, otherwise):
                with then:
                    block(i0, j0, 2)
                with otherwise:
                    block(i0, j0, 1)
    b.ret_void()
    entry.branch(body)
    return fn


def loops_kernel(mod: ir.Module, fp, packed: bool, cpu: CpuOptions, home: ir.Module | None = None) -> ir.Function:
    """void tgc.gemm.loops.<T>[.packed](the arguments of `small_kernel`): the same
    product of any size, without BLAS (`options.cpu.blas` "none", or a library whose
    caller gave none). Columns in blocks of `cpu.gemm_loop_cols` vectors and K in chunks
    that make one block of B' `cpu.gemm_pack_elems` elements (16 KiB of f32: it stays in L1 while
    every row of A' passes over it), each block one call of the small-tile kernel
    on all the rows (the packed one gathers the block first); a chunk after the
    first accumulates. Each element of C' is summed in K's order, block by block
    (the small-tile kernel's blocks within each chunk). One function per program and kind, like `small_kernel`."""
    tag = "f32" if isinstance(fp, ir.FloatType) else "f64"
    name = f"tgc.gemm.loops.{tag}" + (".packed" if packed else "")
    if name in mod.globals:
        return mod.globals[name]
    if home is not None and home is not mod:
        return export(loops_kernel(home, fp, packed, cpu), mod)
    inner = small_kernel(mod, fp, packed, cpu)
    fn = define(mod, name, ir.VoidType(), [I64, I64, I64, PTR, I64, I64, PTR, I64, I64, PTR, I64, I32])
    fn.attributes.add("noinline")
    optimize_not(fn)   # loops around calls: not worth LLVM's time
    M, N, K, pa, sam, sak, pb, sbk, sbn, pc, ldc, acc = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    cols = cpu.gemm_loop_cols * vector_lanes(fp)
    depth = cpu.gemm_pack_elems // cols

    def smin(x, y):
        return b.select(b.icmp_signed("<", x, y), x, y)

    chunks = b.sdiv(b.add(K, I64(depth - 1)), I64(depth))
    chunks = b.select(b.icmp_signed("<", chunks, I64(1)), I64(1), chunks)   # K = 0 still writes C' (zeros)
    with for_range(b, I64(0), b.sdiv(b.add(N, I64(cols - 1)), I64(cols)), "lj") as jb:
        j0 = b.mul(jb, I64(cols))
        width = smin(I64(cols), b.sub(N, j0))
        with for_range(b, I64(0), chunks, "lk") as kc:
            k0 = b.mul(kc, I64(depth))
            kb = smin(I64(depth), b.sub(K, k0))
            kb = b.select(b.icmp_signed("<", kb, I64(0)), I64(0), kb)
            accumulate = b.or_(b.icmp_signed("!=", acc, I32(0)), b.icmp_signed(">", kc, I64(0)))
            a = b.gep(pa, [b.mul(k0, sak)], source_etype=fp)
            bb = b.gep(pb, [b.add(b.mul(k0, sbk), b.mul(j0, sbn))], source_etype=fp)
            c = b.gep(pc, [j0], source_etype=fp)
            b.call(inner, [M, width, kb, a, sam, sak, bb, sbk, sbn, c, ldc, b.zext(accumulate, I32)])
    b.ret_void()
    return fn


def _packed_kernel(mod, fp, name, direct, pack_elems: int):
    """B' (N strided) gathered a vector of columns at a time into a stack buffer whose
    rows are padded to whole vectors, then the direct kernel on it. Whole-vector
    stores matter: the kernel's vector loads follow at once, and after scalar stores
    they could not be forwarded and waited for the stores to retire (GPT's 11 x 11 x
    16 attention-score tiles: 42.8 us per 192 in the program after a scalar copy,
    35.5 after gathers; 16 x 16 blocks transposed in registers gave 32-34 us, but
    their 64 shuffles took LLVM ~40 ms more to compile, in every program with a GEMM)."""
    fn = define(mod, name, ir.VoidType(), [I64, I64, I64, PTR, I64, I64, PTR, I64, I64, PTR, I64, I32])
    fn.attributes.add("noinline")
    M, N, K, pa, sam, sak, pb, sbk, sbn, pc, ldc, acc = fn.args
    entry = ir.IRBuilder(fn.append_basic_block("entry"))
    buf = entry.alloca(fp, size=I64(pack_elems), name="pack")
    buf.align = 64
    body = fn.append_basic_block("body")
    b = ir.IRBuilder(body)
    vl = vector_lanes(fp)
    vt, it = ir.VectorType(fp, vl), ir.VectorType(I64, vl)
    elem = 4 if isinstance(fp, ir.FloatType) else 8
    size = I64(elem)
    chunks = b.sdiv(b.add(N, I64(vl - 1)), I64(vl))
    ldp = b.mul(chunks, I64(vl))
    iota = ir.Constant(it, list(range(vl)))
    base = b.ptrtoint(pb, I64)
    zero = ir.Constant(vt, [0.0] * vl)
    gather = gather_intrinsic(mod, fp, vl)
    with for_range(b, I64(0), chunks, "pc") as jc:
        cols = b.add(splat(b, b.mul(jc, I64(vl)), it), iota)
        mask = b.icmp_signed("<", cols, splat(b, N, it))
        lanes = b.mul(cols, splat(b, b.mul(sbn, size), it))
        with for_range(b, I64(0), K, "pk") as kk:
            row = b.add(base, b.mul(b.mul(kk, sbk), size))
            ptrs = b.inttoptr(b.add(splat(b, row, it), lanes), ir.VectorType(PTR, vl))
            v = b.call(gather, [ptrs, I32(elem), mask, zero])
            dst = b.gep(buf, [b.add(b.mul(kk, ldp), b.mul(jc, I64(vl)))], source_etype=fp)
            b.store(v, b.bitcast(dst, vt.as_pointer()), align=64)
    b.call(direct, [M, N, K, pa, sam, sak, buf, ldp, I64(1), pc, ldc, acc])
    b.ret_void()
    entry.branch(body)
    return fn
