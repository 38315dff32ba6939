"""The generated f32 GEMM (AVX-512): tgc's own register-blocked kernel for the tiles
that OpenBLAS runs slower (`GemmGen.call_large` chooses; see `gemm.uses_own_gemm`).

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
past M read row M - 1 and store nothing (as `bf16_kernel` does). R x V = 4 x 4 by
default (16 accumulators; 8 x 2 measured the same or slower on the 2-core Zen 5).

An implicit GEMM (implicit.py) gets its own copy, which packs its window operand
(`Window`) from the window's source instead of reading a stored buffer: B' block by
block as above, or A''s rows for each block of R rows, each row segment by segment
(`_Segments`); it takes `i64* dims, i64 row0, i64 col0` more (the dims for sizes,
where in the window matrix the tile starts).

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


class Window:
    """The window operand of an implicit GEMM (implicit.py) as the own kernel packs it:
    the normalized product's `role` operand ('a': A'[rows, K], 'b': B'[K, cols]) is the
    matrix [row group, column group] (edges in the window's order; the column group
    is contiguous, its last edge `run`) of `source[index]` masked by `conds`. The
    kernel gets the source pointer already moved to the batch and tap indices; the
    rest of the index (`coefs`: elements per unit of each row and column edge, `const`)
    and the conditions (which use no batch or tap edge) are evaluated here."""

    def __init__(self, role: str, rows: tuple, cols: tuple, source_order: tuple, index: dict, conds: tuple):
        self.role, self.rows, self.cols = role, tuple(rows), tuple(cols)
        self.source_order, self.index, self.conds = tuple(source_order), dict(index), tuple(conds)
        self.run = self.cols[-1]

    def setup(self, f):
        """Entry-block values: each row/column edge's size and source stride, the constant offset."""
        st = f.strides(self.source_order)
        e = f.entry
        self.size = {v: f.edge_size(v) for v in self.rows + self.cols}
        self.coef = {}
        for v in self.rows + self.cols:
            total = I64(0)
            for edge, ix in self.index.items():
                c = ix.coef(v)
                if c != 0:
                    total = e.add(total, e.mul(st[edge], f.size(c)))
            self.coef[v] = total
        const = I64(0)
        for edge, ix in self.index.items():
            const = e.add(const, e.mul(st[edge], f.size(ix.const)))
        self.const = const
        self.cond_const = [f.size(c.ix.const) for c in self.conds]

    def split(self, b, index, edges):
        """The values of `edges` (outermost first) at flat index `index`."""
        out = {}
        for v in reversed(edges):
            n = self.size[v]
            out[v] = b.srem(index, n)
            index = b.sdiv(index, n)
        return out

    def part(self, b, vals):
        """(source offset, each condition's value) of the edges in `vals`."""
        off = I64(0)
        for v, x in vals.items():
            off = b.add(off, b.mul(x, self.coef[v]))
        cs = []
        for c in self.conds:
            t = I64(0)
            for v, x in vals.items():
                k = c.ix.coef(v)
                if k != 0:
                    t = b.add(t, b.mul(x, I64(k)))
            cs.append(t)
        return off, cs


class _Segments:
    """A table of the segments of a column range of the window (built once per block,
    read for every row): each segment is a run along `run`, with its offset in the
    packed row, its length, its part of the source offset and of each condition
    (constants included). `cap` entries at most: a range of `cap` columns has at most
    that many segments."""

    def __init__(self, entry, win, cap: int):
        self.win, self.cap = win, cap
        n = 3 + len(win.conds)
        self.table = entry.alloca(I64, size=I64(n * (cap + 1)), name="segs")
        self.count = entry.alloca(I64, name="nseg")
        self.o_ptr = entry.alloca(I64, name="seg.o")

    def at(self, b, field: int, s):
        return b.gep(self.table, [b.add(b.mul(s, I64(3 + len(self.win.conds))), I64(field))], source_etype=I64)

    def build(self, b, col0, length):
        """The segments of columns col0 .. col0 + length."""
        win = self.win
        b.store(I64(0), self.o_ptr)
        b.store(I64(0), self.count)
        fn = b.function
        head, body, done = (fn.append_basic_block(n) for n in ("segs.head", "segs.body", "segs.done"))
        b.branch(head)
        b.position_at_end(head)
        o = b.load(self.o_ptr, typ=I64)
        b.cbranch(b.icmp_signed("<", o, length), body, done)
        b.position_at_end(body)
        cvals = win.split(b, b.add(col0, o), win.cols)
        left = b.sub(length, o)
        room = b.sub(win.size[win.run], cvals[win.run])
        seg = b.select(b.icmp_signed("<", room, left), room, left)
        coff, ccs = win.part(b, cvals)
        s = b.load(self.count, typ=I64)
        b.store(o, self.at(b, 0, s))
        b.store(seg, self.at(b, 1, s))
        b.store(b.add(coff, win.const), self.at(b, 2, s))
        for i, (cc, k0) in enumerate(zip(ccs, win.cond_const)):
            b.store(b.add(cc, k0), self.at(b, 3 + i, s))
        b.store(b.add(s, I64(1)), self.count)
        b.store(b.add(o, seg), self.o_ptr)
        b.branch(head)
        b.position_at_end(done)

    def fill(self, b, src, row, dst):
        """dst[o .. o + len) of every segment = the window's row `row` there (zeros where
        a condition fails): masked 16-lane loads from the source and stores."""
        from tgc.backends.cpu.gemm import _masked_intrinsics

        win = self.win
        f32 = ir.FloatType()
        vt = ir.VectorType(f32, VL)
        load_fn, store_fn, _ = _masked_intrinsics(b.module, f32, VL)
        zero_v = ir.Constant(vt, [0.0] * VL)
        roff, rcs = win.part(b, win.split(b, row, win.rows))
        i16, mt = ir.IntType(16), ir.VectorType(I1, VL)

        def clamp(x, lo, hi):
            x = b.select(b.icmp_signed("<", x, I64(lo)), I64(lo), x)
            return b.select(b.icmp_signed(">", x, I64(hi)), I64(hi), x)

        def bits(n):   # the first n of 16 lanes (0 <= n <= 16)
            return b.sub(b.shl(I32(1), b.trunc(n, I32)), I32(1))

        with for_range(b, I64(0), b.load(self.count, typ=I64), "seg") as s:
            o = b.load(self.at(b, 0, s), typ=I64)
            seg = b.load(self.at(b, 1, s), typ=I64)
            base = b.add(roff, b.load(self.at(b, 2, s), typ=I64))
            # a condition without `run` holds for the whole segment or not at all; one
            # with `run` (coefficient +-1) bounds the lanes where it holds: [lo, hi)
            scalar, lo, hi = ir.Constant(I1, 1), I64(0), seg
            for i, (c, rc) in enumerate(zip(win.conds, rcs)):
                v = b.add(rc, b.load(self.at(b, 3 + i, s), typ=I64))
                k = c.ix.coef(win.run)
                if k == 0:
                    scalar = b.and_(scalar, b.icmp_signed(c.op, v, I64(0)))
                elif (k, c.op) == (1, ">="):
                    lo = b.select(b.icmp_signed(">", b.neg(v), lo), b.neg(v), lo)
                elif (k, c.op) == (1, "<"):
                    hi = b.select(b.icmp_signed("<", b.neg(v), hi), b.neg(v), hi)
                elif (k, c.op) == (-1, ">="):
                    hi = b.select(b.icmp_signed("<", b.add(v, I64(1)), hi), b.add(v, I64(1)), hi)
                else:   # (-1, "<")
                    lo = b.select(b.icmp_signed(">", b.add(v, I64(1)), lo), b.add(v, I64(1)), lo)
            hi = b.select(scalar, hi, I64(0))
            with for_range(b, I64(0), b.sdiv(b.add(seg, I64(VL - 1)), I64(VL)), "sv") as t:
                lane0 = b.mul(t, I64(VL))
                ok = b.and_(bits(clamp(b.sub(hi, lane0), 0, VL)), b.not_(bits(clamp(b.sub(lo, lane0), 0, VL))))
                ok_m = b.bitcast(b.trunc(ok, i16), mt)
                x = b.call(load_fn, [b.gep(src, [b.add(base, lane0)], source_etype=f32), I32(4), ok_m, zero_v])
                # a whole-vector store: lanes past the segment (zeros) land where a later
                # segment or row is written, or in the buffer's slack. A masked store
                # here made every later load wait for it (the packing took 3x longer)
                b.store(x, b.bitcast(b.gep(dst, [b.add(o, lane0)], source_etype=f32), vt.as_pointer()), align=4)


def own_kernel(mod: ir.Module, rows: int = 4, vecs: int = 4, home: ir.Module | None = None,
               depth: int = OWN_DEPTH, window: Window | None = None, name: str | None = None,
               frame=None) -> ir.Function:
    """The kernel (see the module's docstring) with `rows` x `vecs` register blocks;
    one function per program and shape, defined in `home` (default `mod`) and declared
    in `mod` when that is another unit of the program. With `window` (an implicit
    GEMM's own copy, named `name`; `frame(fn, dims)` makes its `Frame`) it takes
    three more arguments, `i64* dims, i64 row0, i64 col0`, and packs the window
    operand, whose pointer is its source's, at rows row0.. and columns col0.. of the
    window matrix."""
    from tgc.backends.cpu.gemm import _gather_intrinsic, _masked_intrinsics, _splat

    if window is None:
        name = kernel_name(rows, vecs) + ("" if depth == OWN_DEPTH else f".d{depth}")
        if name in mod.globals:
            return mod.globals[name]
        if home is not None and home is not mod:
            return export(own_kernel(home, rows, vecs, depth=depth), mod)
    f32 = ir.FloatType()
    cols = vecs * VL
    extra = [PTR, I64, I64] if window is not None else []
    fn = define(mod, name, ir.VoidType(), [I64, I64, I64, PTR, I64, I64, PTR, I64, I64, PTR, I64, I32] + extra)
    fn.attributes.add("noinline")
    M, N, K, pa, sam, _sak, pb, sbk, sbn, pc, ldc, acc = fn.args[:12]
    for a in (pa, pb, pc):
        a.add_attribute("noalias")
    if window is not None:
        fr = frame(fn, fn.args[12])
        entry, b = fr.entry, fr.b
        row0, col0 = fn.args[13], fn.args[14]
        window.setup(fr)
    else:
        entry = ir.IRBuilder(fn.append_basic_block("entry"))
        body = fn.append_basic_block("body")
        b = ir.IRBuilder(body)
    bpack = entry.alloca(f32, size=I64(depth * cols + VL), name="bpack")   # slack: see _Segments.fill
    bpack.align = 64
    apack = None
    if window is not None and window.role == "a":
        apack = entry.alloca(f32, size=I64(depth * rows + VL), name="apack")
        apack.align = 64
    segs = _Segments(entry, window, cols if window.role == "b" else depth) if window is not None else None
    vt, mt = ir.VectorType(f32, VL), ir.VectorType(I1, VL)
    it = ir.VectorType(I64, VL)
    accs = [[entry.alloca(vt, name=f"acc{r}.{c}") for c in range(vecs)] for r in range(rows)]
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
            if apack is not None:
                segs.build(b, b.add(col0, k0), kd)   # this K block's columns of the window
            if window is not None and window.role == "b":
                # the window's block: each packed row zeroed, then filled from the source
                with b.if_then(b.icmp_signed("==", kb, I64(0))):
                    segs.build(b, b.add(col0, j0), width)   # the same columns for every K block
                with for_range(b, I64(0), kd, "pw") as p:
                    dst = b.gep(bpack, [b.mul(p, I64(cols))], source_etype=f32)
                    with b.if_then(b.icmp_signed("<", width, I64(cols))):
                        for c in range(vecs):
                            b.store(zero_v, b.bitcast(b.gep(dst, [I64(c * VL)], source_etype=f32),
                                                      vt.as_pointer()), align=64)
                    segs.fill(b, pb, b.add(row0, b.add(k0, p)), dst)
            else:
                _pack_b(b, pb, sbk, sbn, k0, kd, j0, width, cols, vecs, masks, bpack, lane_bytes, load_fn, gather,
                        zero_v, it, vt)
            init_mask = _splat(b, add_c, mt)
            with for_range(b, I64(0), b.sdiv(b.add(M, I64(rows - 1)), I64(rows)), "oi") as ib:
                i0 = b.mul(ib, I64(rows))
                last = b.sub(M, I64(1))
                rix = [b.add(i0, I64(r)) for r in range(rows)]
                inside = [b.icmp_signed("<", i, M) for i in rix]
                rix = [b.select(x, i, last) for x, i in zip(inside, rix)]
                crow = [b.gep(pc, [b.add(b.mul(i, ldc), j0)], source_etype=f32) for i in rix]
                if apack is not None:   # the window's rows of this block, packed from the source
                    arow = []
                    for r in range(rows):
                        dst = b.gep(apack, [I64(r * depth)], source_etype=f32)
                        segs.fill(b, pa, b.add(row0, rix[r]), dst)
                        arow.append(dst)
                else:
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
    if window is not None:
        fr.finish()
    else:
        entry.branch(body)
    return fn


def _pack_b(b, pb, sbk, sbn, k0, kd, j0, width, cols, vecs, masks, bpack, lane_bytes, load_fn, gather, zero_v,
            it, vt):
    """B's block: one packed row of `cols` floats per K (zeros past N): masked vector
    loads when B's columns are contiguous, transposed 16 x 16 squares when its K is,
    gathers otherwise."""
    from tgc.backends.cpu.gemm import _splat

    f32 = ir.FloatType()
    align = I32(4)
    prefetch = b.module.globals.get("llvm.prefetch.p0") or ir.Function(
        b.module, ir.FunctionType(ir.VoidType(), [PTR, I32, I32, I32]), "llvm.prefetch.p0")
    with b.if_else(b.icmp_signed("==", sbn, I64(1))) as (contiguous, strided):
        with contiguous:
            with for_range(b, I64(0), kd, "pv") as p:
                src = b.gep(pb, [b.add(b.mul(b.add(k0, p), sbk), j0)], source_etype=f32)
                dst = b.gep(bpack, [b.mul(p, I64(cols))], source_etype=f32)
                # the same row's next block of columns, read when the next block is packed:
                # asked for now (rows a page or more apart defeat the hardware's prefetchers)
                for c in range(vecs):
                    b.call(prefetch, [b.gep(src, [I64(cols + c * VL)], source_etype=f32), I32(0), I32(2), I32(1)])
                for c in range(vecs):
                    v = b.call(load_fn, [b.gep(src, [I64(c * VL)], source_etype=f32), align, masks[c], zero_v])
                    b.store(v, b.bitcast(b.gep(dst, [I64(c * VL)], source_etype=f32), vt.as_pointer()), align=64)
        with strided:
            with b.if_else(b.icmp_signed("==", sbk, I64(1))) as (transposed, scattered):
                with transposed:
                    _pack_transposed(b, pb, sbn, k0, kd, j0, width, cols, vecs, bpack, load_fn, zero_v, vt)
                with scattered:
                    base = b.ptrtoint(pb, I64)
                    with for_range(b, I64(0), kd, "pg") as p:
                        row = b.add(base, b.mul(b.add(b.mul(b.add(k0, p), sbk), b.mul(j0, sbn)), I64(4)))
                        dst = b.gep(bpack, [b.mul(p, I64(cols))], source_etype=f32)
                        for c in range(vecs):
                            at = b.add(row, b.mul(sbn, I64(4 * c * VL)))
                            ptrs = b.inttoptr(b.add(_splat(b, at, it), lane_bytes), ir.VectorType(PTR, VL))
                            v = b.call(gather, [ptrs, align, masks[c], zero_v])
                            b.store(v, b.bitcast(b.gep(dst, [I64(c * VL)], source_etype=f32), vt.as_pointer()),
                                    align=64)


def _transpose16(b, rows):
    """The 16 x 16 transpose of 16 vectors of 16 lanes: four rounds of interleaving
    row m with row m + 8 (lanes 0-7 of each, then 8-15) transpose a 2^4 square."""
    lo = ir.Constant(ir.VectorType(I32, VL), [x for i in range(8) for x in (i, i + VL)])
    hi = ir.Constant(ir.VectorType(I32, VL), [x for i in range(8, 16) for x in (i, i + VL)])
    for _ in range(4):
        out = []
        for m in range(8):
            out += [b.shuffle_vector(rows[m], rows[m + 8], lo), b.shuffle_vector(rows[m], rows[m + 8], hi)]
        rows = out
    return rows


def _pack_transposed(b, pb, sbn, k0, kd, j0, width, cols, vecs, bpack, load_fn, zero_v, vt):
    """B's block when its K is contiguous (B' = a row-major matrix transposed): for
    each 16 columns and 16 K, 16 masked vector loads along K, a transpose in
    registers, 16 whole-vector stores of packed rows (gathers, 16 lines each, were
    slower than OpenBLAS's packing)."""
    from tgc.backends.cpu.gemm import _splat

    f32 = ir.FloatType()
    it = ir.VectorType(I64, VL)
    iota = ir.Constant(it, list(range(VL)))
    with for_range(b, I64(0), b.sdiv(b.add(kd, I64(VL - 1)), I64(VL)), "pt") as t:
        kk0 = b.mul(t, I64(VL))
        kmask = b.icmp_signed("<", iota, _splat(b, b.sub(kd, kk0), it))
        for c in range(vecs):
            rows = []
            for i in range(VL):
                col = c * VL + i
                inside = _splat(b, b.icmp_signed("<", I64(col), width), ir.VectorType(I1, VL))
                at = b.gep(pb, [b.add(b.add(k0, kk0), b.mul(b.add(j0, I64(col)), sbn))], source_etype=f32)
                rows.append(b.call(load_fn, [at, I32(4), b.and_(kmask, inside), zero_v]))
            for kk, v in enumerate(_transpose16(b, rows)):
                dst = b.gep(bpack, [b.add(b.mul(b.add(kk0, I64(kk)), I64(cols)), I64(c * VL))], source_etype=f32)
                b.store(v, b.bitcast(dst, vt.as_pointer()), align=64)
