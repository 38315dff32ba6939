"""The bf16 GEMM kernel: tiles of bf16 products summed in f32 by `vdpbf16ps`
(AVX-512 BF16), called by `GemmGen` (gemm.py).

bf16 products. A product of two bf16 buffers (the `gemm_operands` stage keeps them
bf16 only where the CPU has AVX-512 BF16, or `options.cpu.bf16_gemm` is "on") makes
the same tasks and tiles, each tile one call of `bf16_kernel` (`vdpbf16ps`, f32
sums) instead of cblas: numpy's OpenBLAS exports no bf16 GEMM (`sbgemm`).
"""
from __future__ import annotations

import llvmlite.ir as ir

from tgc.backends.cpu.irutil import I1, I32, I64, PTR, define, export, for_range, masked_intrinsics, splat
from tgc.backends.cpu.options import CpuOptions

BF16_ROWS = 4      # rows of C' per register block of the bf16 kernel ...
BF16_VECS = 4      # ... by this many vectors of 16 f32 columns (16 accumulators)


class _BFloat(ir.types.Type):
    """LLVM's `bfloat` (llvmlite has no such type): only the vectors the dot-product
    intrinsic takes are ever made of it, by bitcasts from i32 pairs."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


def _dpbf16ps(mod: ir.Module) -> ir.Function:
    """`<16 x float> llvm.x86.avx512bf16.dpbf16ps.512(acc, <32 x bfloat> a, <32 x bfloat> b)`:
    per f32 lane j, acc + a[2j] * b[2j] + a[2j+1] * b[2j+1] (`vdpbf16ps`; the products
    are exact in f32, the sums rounded to nearest even; inputs and result below f32's
    normal range are taken as zero, as the instruction does)."""
    name = "llvm.x86.avx512bf16.dpbf16ps.512"
    if name in mod.globals:
        return mod.globals[name]
    pairs = ir.VectorType(_BFloat(), 32)
    fv = ir.VectorType(ir.FloatType(), 16)
    return ir.Function(mod, ir.FunctionType(fv, [fv, pairs, pairs]), name)


def bf16_kernel(mod: ir.Module, cpu: CpuOptions, home: ir.Module | None = None,
                rounds: tuple[bool, bool] = (False, False)) -> ir.Function:
    """void tgc.gemm.bf16[.ra][.rb](i64 M, i64 N, i64 K, T* A, i64 sAm, i64 sAk, T* B, i64 sBk,
    i64 sBn, float* C, i64 ldc, i32 accumulate): C[M, N] (+)= A[M, K] B[K, N] for bf16 A
    and B and f32 C with N contiguous (any strides, in elements), summed in f32 by
    `vdpbf16ps` (AVX-512 BF16). An operand is bf16 (its 16 bits), or, where `rounds`
    says so (`.ra`, `.rb`), f32 rounded to bf16 as it is packed (to nearest even, NaN
    kept quiet: `elementwise.emit_round_bf16`'s bits), so no rounded copy is stored.

    Rows in panels of `cpu.bf16_gemm_panel` and K in blocks of `cpu.bf16_gemm_depth`
    (even); per panel and K block,
    A's pairs (A[i, k], A[i, k+1]) are packed once for all the panel's rows (one 32-bit
    lane per row and pair: vector loads of 4 rows when A's M is contiguous), then for
    every block of BF16_VECS x 16 columns B's block is packed as pairs (B[k, j], B[k+1, j])
    (vector loads when B's N is contiguous, i32 gathers of whole pairs when its K is,
    else element by element; zeros past K and N) and every block of BF16_ROWS rows of
    the panel runs the K pairs with 16 vector accumulators: each step broadcasts a
    row's pair and takes one `vdpbf16ps` per vector, i.e. two K steps of 16
    multiply-adds. A bf16 A whose K is contiguous is not packed (its pairs are 32-bit
    loads; the panel is then all of M). Each K block's part of an element of C is
    summed from zero, in pairs, in K's order, then added to C (or stored, for the
    first block of a call that does not accumulate), whatever the strides: one chain
    over all of K (the block's accumulators started from C) lost f32 accuracy on long
    sums, 5.6e-6 norm-wise on an 8 x 65536 x 16 product of bf16 operands against
    PyTorch f32's 2.8e-7, as `fgemm.own_kernel`'s docstring describes. Rows past M
    read row M - 1 (or zeros) and store nothing. One function per program and kind
    (like `small_kernel`)."""
    name = "tgc.gemm.bf16" + (".ra" if rounds[0] else "") + (".rb" if rounds[1] else "")
    if name in mod.globals:
        return mod.globals[name]
    if home is not None and home is not mod:
        return export(bf16_kernel(home, cpu, rounds=rounds), mod)
    i16, f32 = ir.IntType(16), ir.FloatType()
    depth, panel_rows = cpu.bf16_gemm_depth, cpu.bf16_gemm_panel
    vl, cols, half, rows_n = 16, BF16_VECS * 16, depth // 2, BF16_ROWS
    fn = define(mod, name, ir.VoidType(), [I64, I64, I64, PTR, I64, I64, PTR, I64, I64, PTR, I64, I32])
    fn.attributes.add("noinline")
    M, N, K, pa, sam, sak, pb, sbk, sbn, pc, ldc, acc = fn.args
    for a in (pa, pb, pc):
        a.add_attribute("noalias")
    entry = ir.IRBuilder(fn.append_basic_block("entry"))
    bpack = entry.alloca(I32, size=I64(half * cols), name="bpack")
    apanel = entry.alloca(I32, size=I64(half * panel_rows), name="apanel")
    bpack.align = apanel.align = 64
    vt, it, mt = ir.VectorType(f32, vl), ir.VectorType(I32, vl), ir.VectorType(I1, vl)
    pairs = ir.VectorType(_BFloat(), 32)
    accs = [[entry.alloca(vt, name=f"acc{r}.{c}") for c in range(BF16_VECS)] for r in range(rows_n)]
    body = fn.append_basic_block("body")
    b = ir.IRBuilder(body)
    dot = _dpbf16ps(mod)
    load_fn, store_fn, _ = masked_intrinsics(mod, f32, vl)
    zero_v = ir.Constant(vt, [0.0] * vl)
    iota = ir.Constant(ir.VectorType(I64, vl), list(range(vl)))
    align = I32(4)
    ops_a = _Bf16Operand(b, mod, rounds[0])
    ops_b = _Bf16Operand(b, mod, rounds[1])

    def smin(x, y):
        return b.select(b.icmp_signed("<", x, y), x, y)

    accumulate = b.icmp_signed("!=", acc, I32(0))
    chunks = b.sdiv(b.add(K, I64(depth - 1)), I64(depth))
    chunks = b.select(b.icmp_signed("<", chunks, I64(1)), I64(1), chunks)   # K = 0 still writes C (zeros)
    a_direct = ir.Constant(I1, 0) if rounds[0] else b.icmp_signed("==", sak, I64(1))
    panel = b.select(a_direct, b.select(b.icmp_signed("<", M, I64(1)), I64(1), M), I64(panel_rows))
    last = b.sub(M, I64(1))
    with for_range(b, I64(0), b.sdiv(b.add(M, b.sub(panel, I64(1))), panel), "bm") as mb:
        r0 = b.mul(mb, panel)
        blocks = b.sdiv(b.add(smin(panel, b.sub(M, r0)), I64(rows_n - 1)), I64(rows_n))

        def block_rows(ib):
            i0 = b.add(r0, b.mul(ib, I64(rows_n)))
            rows = [b.add(i0, I64(r)) for r in range(rows_n)]
            inside = [b.icmp_signed("<", i, M) for i in rows]
            return i0, [b.select(x, i, last) for x, i in zip(inside, rows)], inside

        with for_range(b, I64(0), chunks, "bk") as kb:
            k0 = b.mul(kb, I64(depth))
            kd = smin(I64(depth), b.sub(K, k0))
            kd = b.select(b.icmp_signed("<", kd, I64(0)), I64(0), kd)
            kp = b.sdiv(b.add(kd, I64(1)), I64(2))
            full = b.sdiv(kd, I64(2))
            odd = b.icmp_signed("!=", b.srem(kd, I64(2)), I64(0))
            add_c = b.or_(accumulate, b.icmp_signed(">", kb, I64(0)))
            with b.if_then(b.not_(a_direct)):   # the panel's pairs of A, once per K block
                with for_range(b, I64(0), blocks, "pa") as ib:
                    i0, rows, _ = block_rows(ib)
                    dst = b.gep(apanel, [b.mul(ib, I64(half * rows_n))], source_etype=I32)
                    _pack_a(b, ops_a, pa, sam, sak, dst, k0, kd, kp, i0, M, rows)
            with for_range(b, I64(0), b.sdiv(b.add(N, I64(cols - 1)), I64(cols)), "bj") as jb:
                j0 = b.mul(jb, I64(cols))
                width = smin(I64(cols), b.sub(N, j0))
                masks = []
                for c in range(BF16_VECS):
                    left = b.sub(width, I64(c * vl))
                    masks.append(b.icmp_signed("<", iota, splat(b, left, ir.VectorType(I64, vl))))
                _pack_b(b, ops_b, pb, sbk, sbn, bpack, k0, kd, kp, full, odd, j0, width, masks, cols)
                with for_range(b, I64(0), blocks, "bi") as ib:
                    i0, rows, inside = block_rows(ib)
                    crow = [b.gep(pc, [b.add(b.mul(i, ldc), j0)], source_etype=f32) for i in rows]
                    for regs in accs:   # each K block's sum starts from zero (see the docstring)
                        for acc_r in regs:
                            b.store(ir.Constant(vt, [0.0] * vl), acc_r)

                    def steps(count, a_of, name):
                        """`count` pair steps from pair 0: a_of(r, p) is row r's pair p (i32)."""
                        with for_range(b, I64(0), count, name, unroll=False) as p:
                            step(p, a_of)

                    def step(p, a_of):
                        bv = []
                        for c in range(BF16_VECS):
                            at = b.gep(bpack, [b.add(b.mul(p, I64(cols)), I64(c * vl))], source_etype=I32)
                            bv.append(b.bitcast(b.load(b.bitcast(at, it.as_pointer()), typ=it, align=64), pairs))
                        for r in range(rows_n):
                            av = b.bitcast(splat(b, a_of(r, p), it), pairs)
                            for c in range(BF16_VECS):
                                b.store(b.call(dot, [b.load(accs[r][c], typ=vt), av, bv[c]]), accs[r][c])

                    arow = [b.mul(i, sam) for i in rows]
                    with b.if_else(a_direct) as (direct, packed):
                        with direct:   # a bf16 A with K contiguous: each pair is one 32-bit load
                            def a_pair(r, p):
                                at = b.gep(pa, [b.add(arow[r], b.add(k0, b.mul(p, I64(2))))], source_etype=i16)
                                return b.load(b.bitcast(at, I32.as_pointer()), typ=I32, align=2)
                            steps(full, a_pair, "kd")
                            with b.if_then(odd):   # the last K of an odd block, alone (B's pair ends in 0)
                                step(full, lambda r, p: ops_a.element(
                                    pa, b.add(arow[r], b.add(k0, b.sub(kd, I64(1)))), ir.Constant(I1, 1)))
                        with packed:   # from the panel
                            src = b.gep(apanel, [b.mul(ib, I64(half * rows_n))], source_etype=I32)
                            steps(kp, lambda r, p: b.load(b.gep(src, [b.add(b.mul(p, I64(rows_n)), I64(r))],
                                                                source_etype=I32), typ=I32), "kp")
                    with b.if_else(add_c) as (onto_c, into_c):   # C + the block's sum, or the sum
                        for adds in (True, False):
                            with (onto_c if adds else into_c):
                                for r in range(rows_n):
                                    real = splat(b, inside[r], mt)
                                    for c in range(BF16_VECS):
                                        at = b.gep(crow[r], [I64(c * vl)], source_etype=f32)
                                        keep = b.and_(masks[c], real)
                                        v = b.load(accs[r][c], typ=vt)
                                        if adds:
                                            v = b.fadd(b.call(load_fn, [at, align, keep, zero_v]), v)
                                        b.call(store_fn, [v, at, align, keep])
    b.ret_void()
    entry.branch(body)
    return fn


class _Bf16Operand:
    """Reads of one operand of the bf16 kernel as bf16 bits in i32 lanes (zero
    extended): a bf16 operand's 16 bits, or an f32 operand's value rounded to bf16
    (`rounds`), with the rounding of `elementwise.emit_round_bf16` (the f32 bits plus
    0x7fff plus the lowest kept bit; NaN made quiet), on scalars or vectors."""

    def __init__(self, b, mod, rounds: bool):
        self.b, self.mod, self.rounds = b, mod, rounds
        self.etype = ir.FloatType() if rounds else ir.IntType(16)
        self.size = 4 if rounds else 2

    def bits(self, x):
        """bf16 bits (i32 lanes) of the f32 value(s) x, rounded to nearest even."""
        b = self.b
        n = x.type.count if isinstance(x.type, ir.VectorType) else None
        i32 = I32 if n is None else ir.VectorType(I32, n)

        def k(v):
            return ir.Constant(I32, v) if n is None else ir.Constant(i32, [v] * n)
        bits = b.bitcast(x, i32)
        lsb = b.and_(b.lshr(bits, k(16)), k(1))
        up = b.add(b.add(bits, k(0x7FFF)), lsb)
        kept = b.select(b.fcmp_unordered("uno", x, x), b.or_(bits, k(0x00400000)), up)
        return b.lshr(kept, k(16))

    def element(self, ptr, index, ok):
        """Element `index` as bf16 bits in an i32 where `ok`, else 0 (read only where ok)."""
        b = self.b
        safe = b.select(ok, index, I64(0))
        v = b.load(b.gep(ptr, [safe], source_etype=self.etype), typ=self.etype)
        v = self.bits(v) if self.rounds else b.zext(v, I32)
        return b.select(ok, v, I32(0))

    def vector(self, ptr, n, mask=None):
        """<n x i32>: n consecutive elements' bf16 bits (zeros where `mask` is off;
        a plain load without one)."""
        b = self.b
        vt = ir.VectorType(self.etype, n)
        zero = ir.Constant(vt, [0.0] * n if self.rounds else [0] * n)
        if mask is None:
            v = b.load(b.bitcast(ptr, vt.as_pointer()), typ=vt, align=self.size)
        else:
            tag = f"v{n}f32" if self.rounds else f"v{n}i16"
            fname = f"llvm.masked.load.{tag}.p0"
            f = self.mod.globals.get(fname) or ir.Function(
                self.mod, ir.FunctionType(vt, [PTR, I32, ir.VectorType(I1, n), vt]), fname)
            v = b.call(f, [ptr, I32(self.size), mask, zero])
        return self.bits(v) if self.rounds else b.zext(v, ir.VectorType(I32, n))

    def gather(self, ptrs, mask, wide=False):
        """<16 x i32> gathered at `ptrs`: with `wide`, a bf16 operand's whole pairs
        (32 bits: the element and the next); else one element's bf16 bits."""
        b = self.b
        n = 16
        et = I32 if wide else self.etype
        vt = ir.VectorType(et, n)
        tag = "i32" if et == I32 else ("f32" if self.rounds else "i16")
        name = f"llvm.masked.gather.v{n}{tag}.v{n}p0"
        ty = ir.FunctionType(vt, [ir.VectorType(PTR, n), I32, ir.VectorType(I1, n), vt])
        f = self.mod.globals.get(name) or ir.Function(self.mod, ty, name)
        zero = ir.Constant(vt, [0.0] * n if et == ir.FloatType() else [0] * n)
        v = b.call(f, [ptrs, I32(2 if wide else self.size), mask, zero])
        if wide:
            return v
        return self.bits(v) if self.rounds else b.zext(v, ir.VectorType(I32, n))


def _pair(b, lo, hi):
    """lo | hi << 16 (i32 or vectors of i32)."""
    n = lo.type.count if isinstance(lo.type, ir.VectorType) else None
    sixteen = I32(16) if n is None else ir.Constant(ir.VectorType(I32, n), [16] * n)
    return b.or_(lo, b.shl(hi, sixteen))


def _pack_b(b, op, pb, sbk, sbn, bpack, k0, kd, kp, full, odd, j0, width, masks, cols):
    """B's block of pairs (B[k0 + 2p, j], B[k0 + 2p + 1, j]) into `bpack` (pair p of
    column j at p * cols + j; zeros past N and K): vector loads when B's N is
    contiguous; when its K is, a bf16 B's pairs are 32-bit words (one i32 gather per
    16 columns) and an f32 B's two elements two gathers; else element by element."""
    vl = 16
    it, i64v = ir.VectorType(I32, vl), ir.VectorType(I64, vl)
    mt = ir.VectorType(I1, vl)

    def dst(p, c):
        at = b.gep(bpack, [b.add(b.mul(p, I64(cols)), I64(c * vl))], source_etype=I32)
        return b.bitcast(at, it.as_pointer())

    with b.if_else(b.icmp_signed("==", sbn, I64(1))) as (contiguous, other):
        with contiguous:
            with for_range(b, I64(0), kp, "pv") as p:
                k = b.add(k0, b.mul(p, I64(2)))
                ok0 = splat(b, b.icmp_signed("<", b.mul(p, I64(2)), kd), mt)
                in1 = b.icmp_signed("<", b.add(b.mul(p, I64(2)), I64(1)), kd)
                ok1 = splat(b, in1, mt)
                hi_k = b.select(in1, b.add(k, I64(1)), k)
                for c in range(len(masks)):
                    at = b.add(j0, I64(c * vl))
                    lo = op.vector(b.gep(pb, [b.add(b.mul(k, sbk), at)], source_etype=op.etype), vl,
                                   b.and_(masks[c], ok0))
                    hi = op.vector(b.gep(pb, [b.add(b.mul(hi_k, sbk), at)], source_etype=op.etype), vl,
                                   b.and_(masks[c], ok1))
                    b.store(_pair(b, lo, hi), dst(p, c), align=64)
        with other:
            with b.if_else(b.icmp_signed("==", sbk, I64(1))) as (kcontig, scattered):
                with kcontig:   # a transposed B (a weight gradient's x^T dy): gathers along N
                    iota = ir.Constant(i64v, list(range(vl)))
                    base = b.ptrtoint(pb, I64)
                    lanes = []
                    for c in range(len(masks)):
                        colv = b.add(splat(b, b.add(j0, I64(c * vl)), i64v), iota)
                        lanes.append(b.mul(colv, splat(b, b.mul(sbn, I64(op.size)), i64v)))

                    def ptrs(k, c):
                        row = b.add(base, b.mul(k, I64(op.size)))
                        return b.inttoptr(b.add(splat(b, row, i64v), lanes[c]), ir.VectorType(PTR, vl))
                    with for_range(b, I64(0), full, "pg") as p:
                        k = b.add(k0, b.mul(p, I64(2)))
                        for c, m in enumerate(masks):
                            if op.rounds:
                                v = _pair(b, op.gather(ptrs(k, c), m), op.gather(ptrs(b.add(k, I64(1)), c), m))
                            else:
                                v = op.gather(ptrs(k, c), m, wide=True)
                            b.store(v, dst(p, c), align=64)
                    with b.if_then(odd):   # the last K alone: nothing read past it
                        k = b.add(k0, b.mul(full, I64(2)))
                        for c, m in enumerate(masks):
                            b.store(op.gather(ptrs(k, c), m), dst(full, c), align=64)
                with scattered:
                    with for_range(b, I64(0), kp, "pp") as p:
                        k = b.add(k0, b.mul(p, I64(2)))
                        ok0 = b.icmp_signed("<", b.mul(p, I64(2)), kd)
                        ok1 = b.icmp_signed("<", b.add(b.mul(p, I64(2)), I64(1)), kd)
                        with for_range(b, I64(0), I64(cols), "pj") as j:
                            inside = b.icmp_signed("<", j, width)
                            col = b.mul(b.add(j0, j), sbn)
                            lo = op.element(pb, b.add(b.mul(k, sbk), col), b.and_(ok0, inside))
                            hi = op.element(pb, b.add(b.mul(b.add(k, I64(1)), sbk), col), b.and_(ok1, inside))
                            b.store(_pair(b, lo, hi), b.gep(bpack, [b.add(b.mul(p, I64(cols)), j)],
                                                            source_etype=I32))


def _pack_a(b, op, pa, sam, sak, apack, k0, kd, kp, i0, M, rows):
    """Rows i0.. i0+3's pairs of A's K block into `apack` (row r's pair p at p * 4 + r):
    when A's M is contiguous, the 4 rows of each K are one vector load (masked, rows
    past M reading as zeros, only for a last partial block of rows or the last odd K:
    LLVM makes scattered scalar loads of a masked <4 x i16>) and each pair of K one
    vector store; when its K is, a row's pairs are read along K; else element by element."""
    rows_n = BF16_ROWS
    with b.if_else(b.icmp_signed("==", sam, I64(1))) as (columns, scattered):
        with columns:
            it4 = ir.VectorType(I32, rows_n)
            iota4 = ir.Constant(ir.VectorType(I64, rows_n), list(range(rows_n)))
            real = b.icmp_signed("<", iota4, splat(b, b.sub(M, i0), ir.VectorType(I64, rows_n)))
            whole = b.icmp_signed(">=", b.sub(M, i0), I64(rows_n))
            plain = b.select(whole, b.sdiv(kd, I64(2)), I64(0))   # pairs read with plain loads

            def store(p, v):
                dst = b.gep(apack, [b.mul(p, I64(rows_n))], source_etype=I32)
                b.store(v, b.bitcast(dst, it4.as_pointer()), align=16)

            def at(k):
                return b.gep(pa, [b.add(i0, b.mul(k, sak))], source_etype=op.etype)
            with for_range(b, I64(0), plain, "aw") as p:
                k = b.add(k0, b.mul(p, I64(2)))
                store(p, _pair(b, op.vector(at(k), rows_n), op.vector(at(b.add(k, I64(1))), rows_n)))
            with for_range(b, plain, kp, "av") as p:
                k = b.add(k0, b.mul(p, I64(2)))
                ok0 = splat(b, b.icmp_signed("<", b.mul(p, I64(2)), kd), ir.VectorType(I1, rows_n))
                ok1 = b.icmp_signed("<", b.add(b.mul(p, I64(2)), I64(1)), kd)
                hi_k = b.select(ok1, b.add(k, I64(1)), k)
                lo = op.vector(at(k), rows_n, b.and_(real, ok0))
                hi = op.vector(at(hi_k), rows_n, b.and_(real, splat(b, ok1, ir.VectorType(I1, rows_n))))
                store(p, _pair(b, lo, hi))
        with scattered:
            for r in range(rows_n):
                arow = b.mul(rows[r], sam)
                with for_range(b, I64(0), kp, "ap") as p:
                    k = b.add(k0, b.mul(p, I64(2)))
                    ok0 = b.icmp_signed("<", b.mul(p, I64(2)), kd)
                    ok1 = b.icmp_signed("<", b.add(b.mul(p, I64(2)), I64(1)), kd)
                    lo = op.element(pa, b.add(arow, b.mul(k, sak)), ok0)
                    hi = op.element(pa, b.add(arow, b.mul(b.add(k, I64(1)), sak)), ok1)
                    b.store(_pair(b, lo, hi), b.gep(apack, [b.add(b.mul(p, I64(rows_n)), I64(r))],
                                                    source_etype=I32))
