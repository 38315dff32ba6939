"""The generated f32 GEMM (AVX-512): tgc's own register-blocked kernel for the tiles
that OpenBLAS runs slower (`GemmGen.call_large` chooses; see `use_own`).

    void tgc.gemm.own.f32.bR.vV(i64 M, i64 N, i64 K, float* A, i64 sAm, i64 sAk,
                                float* B, i64 sBk, i64 sBn, float* C, i64 ldc, i32 accumulate)

C[M, N] (+)= A[M, K] B[K, N] with A's K and C's N contiguous (sAk is ignored: the
caller only sends such tiles) and B of any strides. Columns in blocks of V vectors
of 16, K in blocks of OWN_DEPTH. Each block of B is packed into a stack buffer, one
row of V x 16 floats per K (zeros past N and K; masked vector loads when B's N is
contiguous, gathers when not), so the inner loop reads it with aligned whole-vector
loads. Then for every block of R rows the K loop keeps R x V vector accumulators in
registers: each step loads the V vectors of the packed row and, per row, broadcasts
A[i, k] and takes V fused multiply-adds. A K block after the first adds into C; rows
past M read row M - 1 and store nothing (as `bf16_kernel` does).

Exact as a GEMM may be: each element of C is one f32 sum over K in K's order, fused
multiply-adds (a contraction's sum may be reassociated and contracted, and this one
is not even reordered); the blocking depends only on the tile's sizes, so the bits
never depend on the thread count. Terminates: counted loops over sizes.
"""
from __future__ import annotations

import llvmlite.ir as ir

from tgc.backends.cpu.irutil import I1, I32, I64, PTR, define, export, for_range

VL = 16            # f32 lanes of a 512-bit vector
OWN_DEPTH = 256    # K per packed block of B


def kernel_name(rows: int, vecs: int) -> str:
    return f"tgc.gemm.own.f32.b{rows}.v{vecs}"


def own_kernel(mod: ir.Module, rows: int = 8, vecs: int = 2, home: ir.Module | None = None,
               depth: int = OWN_DEPTH) -> ir.Function:
    """The kernel (see the module's docstring) with `rows` x `vecs` register blocks;
    one function per program and shape, defined in `home` (default `mod`) and declared
    in `mod` when that is another unit of the program."""
    from tgc.backends.cpu.gemm import _gather_intrinsic, _masked_intrinsics, _splat

    name = kernel_name(rows, vecs) + ("" if depth == OWN_DEPTH else f".d{depth}")
    if name in mod.globals:
        return mod.globals[name]
    if home is not None and home is not mod:
        return export(own_kernel(home, rows, vecs, depth=depth), mod)
    f32 = ir.FloatType()
    cols = vecs * VL
    fn = define(mod, name, ir.VoidType(), [I64, I64, I64, PTR, I64, I64, PTR, I64, I64, PTR, I64, I32])
    fn.attributes.add("noinline")
    M, N, K, pa, sam, _sak, pb, sbk, sbn, pc, ldc, acc = fn.args
    for a in (pa, pb, pc):
        a.add_attribute("noalias")
    entry = ir.IRBuilder(fn.append_basic_block("entry"))
    bpack = entry.alloca(f32, size=I64(depth * cols), name="bpack")
    bpack.align = 64
    vt, mt = ir.VectorType(f32, VL), ir.VectorType(I1, VL)
    it = ir.VectorType(I64, VL)
    accs = [[entry.alloca(vt, name=f"acc{r}.{c}") for c in range(vecs)] for r in range(rows)]
    body = fn.append_basic_block("body")
    b = ir.IRBuilder(body)
    load_fn, store_fn, fma_fn = _masked_intrinsics(mod, f32, VL)
    gather = _gather_intrinsic(mod, f32, VL)
    zero_v = ir.Constant(vt, [0.0] * VL)
    iota = ir.Constant(it, list(range(VL)))
    align = I32(4)

    def smin(x, y):
        return b.select(b.icmp_signed("<", x, y), x, y)

    accumulate = b.icmp_signed("!=", acc, I32(0))
    chunks = b.sdiv(b.add(K, I64(depth - 1)), I64(depth))
    chunks = b.select(b.icmp_signed("<", chunks, I64(1)), I64(1), chunks)   # K = 0 still writes C (zeros)
    lane_bytes = b.mul(_splat(b, b.mul(sbn, I64(4)), it), iota)
    with for_range(b, I64(0), b.sdiv(b.add(N, I64(cols - 1)), I64(cols)), "oj") as jb:
        j0 = b.mul(jb, I64(cols))
        width = smin(I64(cols), b.sub(N, j0))
        masks = [b.icmp_signed("<", iota, _splat(b, b.sub(width, I64(c * VL)), it)) for c in range(vecs)]
        with for_range(b, I64(0), chunks, "ok") as kb:
            k0 = b.mul(kb, I64(depth))
            kd = smin(I64(depth), b.sub(K, k0))
            kd = b.select(b.icmp_signed("<", kd, I64(0)), I64(0), kd)
            add_c = b.or_(accumulate, b.icmp_signed(">", kb, I64(0)))
            # B's block: one packed row of `cols` floats per K (zeros past N)
            with b.if_else(b.icmp_signed("==", sbn, I64(1))) as (contiguous, strided):
                with contiguous:
                    with for_range(b, I64(0), kd, "pv") as p:
                        src = b.gep(pb, [b.add(b.mul(b.add(k0, p), sbk), j0)], source_etype=f32)
                        dst = b.gep(bpack, [b.mul(p, I64(cols))], source_etype=f32)
                        for c in range(vecs):
                            v = b.call(load_fn, [b.gep(src, [I64(c * VL)], source_etype=f32), align,
                                                 masks[c], zero_v])
                            b.store(v, b.bitcast(b.gep(dst, [I64(c * VL)], source_etype=f32), vt.as_pointer()),
                                    align=64)
                with strided:
                    base = b.ptrtoint(pb, I64)
                    with for_range(b, I64(0), kd, "pg") as p:
                        row = b.add(base, b.mul(b.add(b.mul(b.add(k0, p), sbk), b.mul(j0, sbn)), I64(4)))
                        dst = b.gep(bpack, [b.mul(p, I64(cols))], source_etype=f32)
                        for c in range(vecs):
                            at = b.add(row, b.mul(b.mul(sbn, I64(4 * c * VL)), I64(1)))
                            ptrs = b.inttoptr(b.add(_splat(b, at, it), lane_bytes), ir.VectorType(PTR, VL))
                            v = b.call(gather, [ptrs, align, masks[c], zero_v])
                            b.store(v, b.bitcast(b.gep(dst, [I64(c * VL)], source_etype=f32), vt.as_pointer()),
                                    align=64)
            init_mask = _splat(b, add_c, mt)
            with for_range(b, I64(0), b.sdiv(b.add(M, I64(rows - 1)), I64(rows)), "oi") as ib:
                i0 = b.mul(ib, I64(rows))
                last = b.sub(M, I64(1))
                rix = [b.add(i0, I64(r)) for r in range(rows)]
                inside = [b.icmp_signed("<", i, M) for i in rix]
                rix = [b.select(x, i, last) for x, i in zip(inside, rix)]
                crow = [b.gep(pc, [b.add(b.mul(i, ldc), j0)], source_etype=f32) for i in rix]
                arow = [b.gep(pa, [b.add(b.mul(i, sam), k0)], source_etype=f32) for i in rix]
                for r in range(rows):
                    for c in range(vecs):
                        at = b.gep(crow[r], [I64(c * VL)], source_etype=f32)
                        b.store(b.call(load_fn, [at, align, b.and_(masks[c], init_mask), zero_v]), accs[r][c])
                with for_range(b, I64(0), kd, "kk", unroll=False) as p:
                    src = b.gep(bpack, [b.mul(p, I64(cols))], source_etype=f32)
                    bv = [b.load(b.bitcast(b.gep(src, [I64(c * VL)], source_etype=f32), vt.as_pointer()),
                                 typ=vt, align=64) for c in range(vecs)]
                    for r in range(rows):
                        av = _splat(b, b.load(b.gep(arow[r], [p], source_etype=f32), typ=f32), vt)
                        for c in range(vecs):
                            b.store(b.call(fma_fn, [av, bv[c], b.load(accs[r][c], typ=vt)]), accs[r][c])
                for r in range(rows):
                    real = _splat(b, inside[r], mt)
                    for c in range(vecs):
                        at = b.gep(crow[r], [I64(c * VL)], source_etype=f32)
                        b.call(store_fn, [b.load(accs[r][c], typ=vt), at, align, b.and_(masks[c], real)])
    b.ret_void()
    entry.branch(body)
    return fn
