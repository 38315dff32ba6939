"""The generated f32 GEMM (AVX-512): tgc's own register-blocked kernel for the tiles
that OpenBLAS runs slower (`GemmGen.call_large` chooses; see `gemm_dispatch.uses_own_gemm`).

    void tgc.gemm.own.f32.bR.vV(i64 M, i64 N, i64 K, float* A, i64 sAm, i64 sAk,
                                float* B, i64 sBk, i64 sBn, float* C, i64 ldc, i32 accumulate,
                                i64 nv, i64* a_off, i64* c_off, i64* k_lo, i64* k_hi)

C[M, N] (+)= A[M, K] B[K, N] with C's N contiguous and A and B of any strides. An A
with its K contiguous is read in place; one with its rows contiguous (sAm = 1: a
weight gradient's or attention's transposed A') is packed, where B has more than
one block of columns, or one and A's K block spans more than `CpuOptions.own_gemm_pack_a_span`
bytes (attention's dk and dv at long keys: in place, each line of A is fetched once
per block of rows it holds, from L3 past an L2), K block by K block for each row panel (`_pack_a_transposed`:
16 x 16 transposes into a stack buffer, K contiguous, read by every column block),
and read in place (one cache line per K for a block of rows) otherwise; by one block of
columns, where it spans more than that, such an A' is copied as it is instead, sub-panel by sub-panel
of `CpuOptions.own_gemm_copy_a_rows` rows (`_copy_a_rows`: no transposes; its K's lines no longer
4 KiB apart), where that option is on.
Columns in blocks of V vectors
of 16, K in even blocks of at most 5/4 `CpuOptions.own_gemm_depth` (400 terms: a 288-deep convolution
product and a width-384 transformer's 384-deep ones are one block, no second pass over C). Each block of B is packed into a stack buffer, one
row of V x 16 floats per K (zeros past N and K; masked vector loads when B's N is
contiguous, gathers when not), so the inner loop reads it with aligned whole-vector
loads. Then for every block of R rows the K loop keeps R x V vector accumulators in
registers: each step loads the V vectors of the packed row and, per row, broadcasts
A[i, k] and takes V fused multiply-adds; `CpuOptions.own_gemm_unroll` steps per
iteration of the loop (the same steps in the same order, fewer loop instructions
beside them; the packed row's pointer and A's index step by the unroll, and a
compiler fence between steps keeps LLVM from hoisting loads above the FMAs, which
at -O2 spilled accumulators), the last few one by one. A K block after the first adds into C; rows
past M read row M - 1 and store nothing (as `bf16_kernel` does). R x V is
`CpuOptions.own_gemm_rows` x `own_gemm_vecs` (6 x 4: 24 accumulators), and
`own_gemm_window_rows` x 4 (6 x 4) in an implicit GEMM's copy; a last block of
columns at most half full runs the 8 x 2 kernel (a 64 x 288 x 1024 product with B
transposed ran at 173 GFLOP/s with 8 x 2, 149 with 4 x 4, whose last block is half
empty, on the 2-core Zen 5).

The kernel takes `i64 nv, i64* a_off, i64* c_off, i64* k_lo, i64* k_hi` more: nv
products sharing B (offsets into A and C, a range of K each; a plain product is one
of them), every block of B packed once for all of them (`gemm_dispatch.shared_b_batch` says
which products share one). The
`.taps` form takes `i64 nt, i64* a_off, i64* b_off, i64* q_lo, i64* q_hi, i64* k_lo,
i64* k_hi` more: C = the sum over nt taps, each with its own A and B, columns and K
(`gemm_dispatch.taps_in_one_call`); the accumulators stay in registers across the taps.

An implicit GEMM (implicit.py) gets its own copy, which packs its window operand
(`Window`) from the window's source instead of reading a stored buffer: B' block by
block as above, or A''s rows for each block of R rows, each row vector by vector
from a table of the block's columns (`_Lanes`); it takes `i64* dims, i64 row0, i64 col0` more (the dims for sizes,
where in the window matrix the tile starts).

Exact as a GEMM may be (a contraction's sum may be reassociated and contracted): each
element of C is summed block by block, each K block's part a chain of fused
multiply-adds in K's order from zero, then added to C (or stored, for the first
block of a call that does not accumulate). One chain over all of K, as before,
lost f32 accuracy on long sums: a 2-D convolution's kernel gradient summing 3 x
416 terms was off by 1.6e-4 (4.4e-5 with OpenBLAS) where its largest value was
141. The blocking depends only on the tile's sizes, so the bits never depend on
the thread count. Terminates: counted loops over sizes.
"""
from __future__ import annotations

import llvmlite.ir as ir
import numpy as np

from tgc.backends.cpu.irutil import (I1, I32, I64, PTR, define, export, for_range, gather_intrinsic, masked_intrinsics,
                                     splat)
from tgc.backends.cpu.options import CpuOptions

VL = 16            # f32 lanes of a 512-bit vector
MAX_TAPS = 16      # the most taps the `.taps` form takes in one call (its buffer holds 16 K of each)


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


class _Lines:
    """Floats from byte address `addr` on, read from the aligned 64-byte lines that
    hold them: a vector of 16 that starts `shift` floats into line j is lanes shift..
    of line j and 0..shift - 1 of line j + 1, one two-table permute (vpermi2ps). A
    convolution window's runs start one float off the lines (kw - 1), and a load
    across two lines cost about twice as much (conv2d's output product: 12.6 against
    10.4 Mcycles with the loads forced onto lines)."""

    def __init__(self, b, addr):
        self.b = b
        self.vt, self.mt = ir.VectorType(ir.FloatType(), VL), ir.VectorType(I1, VL)
        i32v = ir.VectorType(I32, VL)
        self.load_fn = masked_intrinsics(b.module, ir.FloatType(), VL)[0]
        name = "llvm.x86.avx512.vpermi2var.ps.512"
        self.perm = b.module.globals.get(name) or ir.Function(
            b.module, ir.FunctionType(self.vt, [self.vt, i32v, self.vt]), name)
        self.line0 = b.and_(addr, I64(-64))
        self.shift = b.trunc(b.lshr(b.sub(addr, self.line0), I64(2)), I32)   # 0 .. 15 floats into the line
        self.idx = b.add(splat(b, self.shift, i32v), ir.Constant(i32v, list(range(VL))))

    def split(self, ok):
        """(i32 lanes of the first line, of the second) that a vector's lanes `ok` need."""
        b = self.b
        bits = b.zext(b.bitcast(ok, ir.IntType(16)), I32)
        return b.shl(bits, self.shift), b.lshr(bits, b.sub(I32(VL), self.shift))

    def load(self, j, bits):
        """Line j (i64) from the first, its lanes in `bits` (i32; zeros elsewhere)."""
        b = self.b
        ptr = b.inttoptr(b.add(self.line0, b.mul(j, I64(64))), PTR)
        mask = b.bitcast(b.trunc(bits, ir.IntType(16)), self.mt)
        return b.call(self.load_fn, [ptr, I32(64), mask, ir.Constant(self.vt, [0.0] * VL)])

    def join(self, first, second):
        """The vector that starts `shift` floats into line `first`."""
        return self.b.call(self.perm, [first, self.idx, second])


def _step(b, digits, sizes):
    """The next index of a split (allocas `digits`, outermost first, of edges of
    `sizes`): the innermost digit steps; one that reaches its size wraps to 0 and
    carries into the one outside it."""
    carry = ir.Constant(I1, 1)
    for d, n in reversed(list(zip(digits, sizes))):
        x1 = b.add(b.load(d, typ=I64), b.zext(carry, I64))
        wrap = b.icmp_signed("==", x1, n)
        b.store(b.select(wrap, I64(0), x1), d)
        carry = b.and_(carry, wrap)


class _Lanes:
    """A table of a column range of the window (built once per range, read for every
    row it packs): for each vector of 16 columns, each lane's part of the source
    offset and of each condition (constants included), whether the lane is inside
    the range, and whether the vector's lanes are consecutive in the source (then its
    two aligned lines are read and joined, `_Lines`; otherwise a masked gather reads
    it), and whether all the vectors are one run (`chain`: each line is then read
    once, `fill_run`). A row then costs its own part of the offset and conditions
    (its edges stepped like an odometer), and per vector a compare per condition,
    the loads and a store: no division and no data-dependent branch per element.
    Condition values are i32 lanes (`implicit._window_ok` bounds them). `cap` columns
    at most.

    When the row edges that enter the conditions (a convolution's kh and kw) have
    fixed sizes whose product (the row classes) is at most `mask_classes`, the table
    also holds each vector's mask for every row class: a row then loads its masks
    instead of comparing (rows of one class have the same conditions' row part).
    When the innermost row edge is the last of those, with 2 to 16 rows
    (`CpuOptions.own_gemm_window_groups`: a convolution's kernel columns), the rows
    of one step of the edges outside it are packed as a group (`fill_group`): each
    row's source is the first's moved by one element per step of the edge, so their
    lines are read and joined once."""

    def __init__(self, entry, win, cap: int, mask_classes: int, groups: bool = False):
        self.win, self.nv = win, -(-cap // VL)
        nc = len(win.conds)
        self.class_edges = [v for v in win.rows if any(c.ix.coef(v) != 0 for c in win.conds)]
        sizes = [win.size[v] for v in self.class_edges]
        self.class_sizes = [x.constant for x in sizes] if all(isinstance(x, ir.Constant) for x in sizes) else None
        self.classes = int(np.prod(self.class_sizes)) if self.class_sizes is not None and win.conds else 0
        if not 0 < self.classes <= mask_classes:
            self.classes = 0
        if self.classes:
            self.masks = entry.alloca(ir.IntType(16), size=I64(self.classes * self.nv), name="lane.masks")
        self.off = entry.alloca(I64, size=I64(self.nv * VL), name="lane.off")
        self.conds = entry.alloca(I32, size=I64(max(1, nc) * self.nv * VL), name="lane.cond")
        self.valid = entry.alloca(ir.IntType(16), size=I64(self.nv), name="lane.valid")
        self.contig = entry.alloca(I1, size=I64(self.nv), name="lane.contig")
        self.chain = entry.alloca(I1, name="lane.chain")
        self.prev = (entry.alloca(ir.VectorType(ir.FloatType(), VL), name="run.line"),
                     entry.alloca(I32, name="run.hi"))
        self.digits = [entry.alloca(I64, name=f"lane.{v}") for v in win.cols]
        for a in (self.off, self.conds):
            a.align = 64
        # row groups (`fill_group`): the innermost row edge, when it is the last class edge
        # with a fixed size of 2 .. 16 (a convolution's kernel columns kw)
        self.group = 0
        if groups and self.classes and self.class_edges and self.class_edges[-1] == win.rows[-1]:
            n = self.class_sizes[-1]
            if 2 <= n <= VL:
                self.group = n
        if self.group:
            self.umasks = entry.alloca(ir.IntType(16), size=I64(self.classes // self.group * (self.nv + 2)),
                                       name="lane.union")
            self.group_ok = entry.alloca(I1, name="lane.grouped")
            self.rowvar = entry.alloca(I64, name="group.row")

    def build(self, b, col0, length, vectors):
        """The table of columns col0 .. col0 + length, `vectors` (an i64, at least
        length / 16 rounded up) vectors of it; lanes past `length` are masked. Per
        vector, the first lane's column is split once (divisions), the others step
        like an odometer."""
        win = self.win
        with for_range(b, I64(0), vectors, "lv") as v:
            first = b.mul(v, I64(VL))
            split = win.split(b, b.add(col0, first), win.cols)
            for c, d in zip(win.cols, self.digits):
                b.store(split[c], d)
            off0 = None
            contig, valid = ir.Constant(I1, 1), ir.Constant(ir.IntType(16), 0)
            for lane in range(VL):
                vals = {c: b.load(d, typ=I64) for c, d in zip(win.cols, self.digits)}
                off, cs = win.part(b, vals)
                off = b.add(off, win.const)
                inside = b.icmp_signed("<", b.add(first, I64(lane)), length)
                at = b.add(first, I64(lane))
                b.store(off, b.gep(self.off, [at], source_etype=I64))
                for i, (cc, k0) in enumerate(zip(cs, win.cond_const)):
                    slot = b.add(b.mul(b.add(b.mul(v, I64(len(win.conds))), I64(i)), I64(VL)), I64(lane))
                    b.store(b.trunc(b.add(cc, k0), I32), b.gep(self.conds, [slot], source_etype=I32))
                if lane == 0:
                    off0 = off
                else:   # a lane outside the range is masked: it does not break the run
                    step = b.icmp_signed("==", off, b.add(off0, I64(lane)))
                    contig = b.and_(contig, b.or_(step, b.not_(inside)))
                valid = b.or_(valid, b.select(inside, ir.Constant(ir.IntType(16), 1 << lane),
                                              ir.Constant(ir.IntType(16), 0)))
                _step(b, self.digits, [win.size[c] for c in win.cols])   # the next column
            b.store(valid, b.gep(self.valid, [v], source_etype=ir.IntType(16)))
            b.store(contig, b.gep(self.contig, [v], source_etype=I1))
            # one run so far: this vector continues the last one's run (or has no lane)
            before = b.select(b.icmp_signed(">", v, I64(0)), b.sub(first, I64(VL)), I64(0))
            prev = b.load(b.gep(self.off, [before], source_etype=I64), typ=I64)
            follows = b.or_(b.icmp_signed("==", v, I64(0)), b.icmp_signed("==", off0, b.add(prev, I64(VL))))
            empty = b.icmp_signed("==", valid, ir.Constant(ir.IntType(16), 0))
            ok = b.or_(empty, b.and_(contig, follows))
            was = b.select(b.icmp_signed("==", v, I64(0)), ir.Constant(I1, 1), b.load(self.chain, typ=I1))
            b.store(b.and_(was, ok), self.chain)
        b.store(b.and_(b.load(self.chain, typ=I1), b.icmp_signed(">", vectors, I64(0))), self.chain)
        if self.classes:
            with for_range(b, I64(0), I64(self.classes), "lc") as c:
                rcs = self.class_parts(b, c)
                with for_range(b, I64(0), vectors, "lm") as v:
                    ok = self.compare(b, rcs, v)
                    b.store(b.bitcast(ok, ir.IntType(16)), self.mask_at(b, c, v))
        if self.group:
            self.build_unions(b, vectors)

    def class_parts(self, b, c):
        """Each condition's row part for row class `c` (a mixed-radix index of the
        class edges)."""
        vals = {}
        for v, n in reversed(list(zip(self.class_edges, self.class_sizes))):
            vals[v] = b.srem(c, I64(n))
            c = b.sdiv(c, I64(n))
        return self.win.part(b, vals)[1]

    def row_class(self, b, split):
        """The row class of a row (its digits `split`)."""
        c = I64(0)
        for v, n in zip(self.class_edges, self.class_sizes):
            c = b.add(b.mul(c, I64(n)), split[v])
        return c

    def mask_at(self, b, c, v):
        return b.gep(self.masks, [b.add(b.mul(c, I64(self.nv)), v)], source_etype=ir.IntType(16))

    def mask(self, b, rcs, v, cls):
        """<16 x i1>: vector `v`'s lanes where the row's conditions hold (its class's
        mask from the table, or compared)."""
        if cls is not None:
            return b.bitcast(b.load(self.mask_at(b, cls, v), typ=ir.IntType(16)), ir.VectorType(I1, VL))
        return self.compare(b, rcs, v)

    def compare(self, b, rcs, v):
        """<16 x i1>: the lanes of vector `v` inside the range where every condition
        holds, for a row whose conditions' row parts are `rcs`."""
        win = self.win
        i32v = ir.VectorType(I32, VL)
        ok = b.bitcast(b.load(b.gep(self.valid, [v], source_etype=ir.IntType(16)), typ=ir.IntType(16)),
                       ir.VectorType(I1, VL))
        zero_i = ir.Constant(i32v, [0] * VL)
        for i, (c, rc) in enumerate(zip(win.conds, rcs)):
            slot = b.mul(b.add(b.mul(v, I64(len(win.conds))), I64(i)), I64(VL))
            cv = b.load(b.bitcast(b.gep(self.conds, [slot], source_etype=I32), i32v.as_pointer()), typ=i32v, align=64)
            t = b.add(cv, splat(b, b.trunc(rc, I32), i32v))
            ok = b.and_(ok, b.icmp_signed(c.op, t, zero_i))
        return ok

    def row_digits(self, entry, b, row):
        """Allocas holding row `row`'s split into the window's row edges (for `fill`)."""
        digits = [entry.alloca(I64, name=f"row.{v}") for v in self.win.rows]
        split = self.win.split(b, row, self.win.rows)
        for v, d in zip(self.win.rows, digits):
            b.store(split[v], d)
        return digits

    def step_row(self, b, digits):
        """The digits of the next row: the innermost row edge steps, carrying outward."""
        _step(b, digits, [self.win.size[v] for v in self.win.rows])

    @staticmethod
    def load_run(b, at, ok):
        """16 consecutive floats at `at` where `ok` (zeros elsewhere), read as two
        masked loads of the aligned 64-byte lines that hold them and one two-table
        permute (`_Lines`)."""
        lines = _Lines(b, b.ptrtoint(at, I64))
        lo, hi = lines.split(ok)
        return lines.join(lines.load(I64(0), lo), lines.load(I64(1), hi))

    def load_vector(self, b, src, roff, rcs, v, cls=None):
        """The window's row (offset `roff`, condition parts `rcs`, row class `cls`
        when the table has masks per class) at the table's vector `v`: 16 floats,
        zeros where a condition fails."""
        f32 = ir.FloatType()
        vt, i64v = ir.VectorType(f32, VL), ir.VectorType(I64, VL)
        gather = gather_intrinsic(b.module, f32, VL)
        zero_v = ir.Constant(vt, [0.0] * VL)
        ok = self.mask(b, rcs, v, cls)
        first = b.mul(v, I64(VL))
        with b.if_else(b.load(b.gep(self.contig, [v], source_etype=I1), typ=I1)) as (run, scattered):
            with run:
                at = b.gep(src, [b.add(roff, b.load(b.gep(self.off, [first], source_etype=I64), typ=I64))],
                           source_etype=f32)
                x_run = self.load_run(b, at, ok)
                from_run = b.block
            with scattered:
                offs = b.load(b.bitcast(b.gep(self.off, [first], source_etype=I64), i64v.as_pointer()),
                              typ=i64v, align=64)
                base = splat(b, b.ptrtoint(b.gep(src, [roff], source_etype=f32), I64), i64v)
                ptrs = b.inttoptr(b.add(base, b.shl(offs, ir.Constant(i64v, [2] * VL))), ir.VectorType(PTR, VL))
                x_gather = b.call(gather, [ptrs, I32(4), ok, zero_v])
                from_gather = b.block
        x = b.phi(vt)
        x.add_incoming(x_run, from_run)
        x.add_incoming(x_gather, from_gather)
        return x

    def fill(self, b, src, row, dst, vectors, digits=None):
        """dst[0 .. 16 vectors) = the window's row `row` over the table's columns
        (`vectors`: a Python int, unrolled, or an i64 count). With `digits` (allocas
        holding the row's split, see `step_row`), no division."""
        win = self.win
        split = win.split(b, row, win.rows) if digits is None else {
            v: b.load(d, typ=I64) for v, d in zip(win.rows, digits)}
        roff, rcs = win.part(b, split)
        cls = self.row_class(b, split) if self.classes else None
        vt = ir.VectorType(ir.FloatType(), VL)

        def at(v):
            return b.bitcast(b.gep(dst, [b.mul(v, I64(VL))], source_etype=ir.FloatType()), vt.as_pointer())
        with b.if_else(b.load(self.chain, typ=I1)) as (one_run, vectorwise):
            with one_run:
                self.fill_run(b, src, roff, rcs, cls, at, vectors)
            with vectorwise:
                if isinstance(vectors, int):   # every load, then every store
                    xs = [self.load_vector(b, src, roff, rcs, I64(v), cls) for v in range(vectors)]
                    for v, x in enumerate(xs):
                        b.store(x, at(I64(v)), align=64)
                else:
                    with for_range(b, I64(0), vectors, "fv") as v:
                        b.store(self.load_vector(b, src, roff, rcs, v, cls), at(v), align=4)

    def fill_run(self, b, src, roff, rcs, cls, at, vectors):
        """`fill` when the table's vectors are one run in the source (`chain`: a
        convolution's 64 columns are two adjacent image rows, its 256 K columns eight):
        the run's aligned lines are each loaded once, with the lanes either of the
        two vectors that share it needs (vector v takes a line's lanes from `shift`
        on, vector v - 1 those below it), and each vector is one two-table permute of
        its two lines. 5 line loads for 4 vectors, not 8."""
        vt = ir.VectorType(ir.FloatType(), VL)
        lines = _Lines(b, b.ptrtoint(b.gep(src, [b.add(roff, b.load(self.off, typ=I64))],
                                           source_etype=ir.FloatType()), I64))
        lo, hi = lines.split(self.mask(b, rcs, I64(0), cls))
        b.store(lines.load(I64(0), lo), self.prev[0])
        b.store(hi, self.prev[1])
        n = I64(vectors) if isinstance(vectors, int) else vectors
        with for_range(b, I64(1), n, "rv") as v:
            lo, hi = lines.split(self.mask(b, rcs, v, cls))
            cur = lines.load(v, b.or_(lo, b.load(self.prev[1], typ=I32)))
            b.store(lines.join(b.load(self.prev[0], typ=vt), cur), at(b.sub(v, I64(1))), align=4)
            b.store(cur, self.prev[0])
            b.store(hi, self.prev[1])
        last = lines.load(n, b.load(self.prev[1], typ=I32))
        b.store(lines.join(b.load(self.prev[0], typ=vt), last), at(b.sub(n, I64(1))), align=4)

    def union_at(self, b, g, u):
        return b.gep(self.umasks, [b.add(b.mul(g, I64(self.nv + 2)), u)], source_etype=ir.IntType(16))

    def build_unions(self, b, vectors):
        """For `fill_group`: each group class's union of its rows' lanes, as words of 16
        (0 .. `vectors` + 1) over the run counted from the group's first row's first
        column (row kw's vector v reads the run's lanes 16 v + kw .. 16 v + kw + 15: its
        class's mask v shifted kw further), so that the lines read once for the group read
        no element the rows' own loads would not. Also whether this build's rows group
        (`group_ok`): the table is one run (`chain`) and the innermost row edge moves the
        source by one element."""
        S = self.group
        i16 = ir.IntType(16)
        with for_range(b, I64(0), I64(self.classes // S), "lg") as g:
            with for_range(b, I64(0), b.add(vectors, I64(2)), "lu") as u:
                w = I32(0)
                for kw in range(S):
                    c = b.add(b.mul(g, I64(S)), I64(kw))

                    def word(v):   # class c's mask of vector v (i32; 0 outside the table's vectors)
                        inside = b.and_(b.icmp_signed(">=", v, I64(0)), b.icmp_signed("<", v, vectors))
                        m = b.zext(b.load(self.mask_at(b, c, b.select(inside, v, I64(0))), typ=i16), I32)
                        return b.select(inside, m, I32(0))
                    part = b.shl(word(u), I32(kw))
                    if kw:
                        part = b.or_(part, b.lshr(word(b.sub(u, I64(1))), I32(VL - kw)))
                    w = b.or_(w, part)
                b.store(b.trunc(w, i16), self.union_at(b, g, u))
        unit = b.icmp_signed("==", self.win.coef[self.win.rows[-1]], I64(1))
        b.store(b.and_(b.load(self.chain, typ=I1), unit), self.group_ok)

    def fill_group(self, b, src, split, dsts, vectors):
        """The `group` rows from the row whose digits are `split` (its innermost row edge
        0) on, row kw into `dsts[kw]` (`vectors`: a Python int, unrolled),
        where `group_ok`: the rows are one run each, row kw's the first's moved by kw
        elements (a convolution's kernel columns read one image row at kw - 1, kw, kw + 1).
        Their aligned lines are read once for all of them (with the union of their lanes,
        `build_unions`), joined once at the first row's shift (one two-table permute a
        vector, as `fill_run`'s), and row kw's vector v is the joined vectors v and v + 1
        moved by kw lanes (`valignd`) where its class's mask holds, +0.0 elsewhere: the
        same values `fill` stores row by row, with 6 line loads and their lane masks
        for a convolution's 3 rows of 4 vectors instead of 15, and the scalar work
        (offset, row class, row steps) once a group (13 permutes instead of 12; the
        generated loop: about 115 instructions a group against 70 a row)."""
        S, win = self.group, self.win
        f32, i16 = ir.FloatType(), ir.IntType(16)
        vt = ir.VectorType(f32, VL)
        zero = ir.Constant(vt, [0.0] * VL)
        roff, _ = win.part(b, split)
        g = I64(0)   # the group's class: the row class of its first row over the edges outside
        for v, n in zip(self.class_edges[:-1], self.class_sizes[:-1]):
            g = b.add(b.mul(g, I64(n)), split[v])
        cls = b.mul(g, I64(S))
        lines = _Lines(b, b.ptrtoint(b.gep(src, [b.add(roff, b.load(self.off, typ=I64))], source_etype=f32), I64))
        back = b.sub(I32(VL), lines.shift)

        def bits(j):   # line j's lanes: union word j's from the shift on, word j - 1's below it
            w = b.shl(b.zext(b.load(self.union_at(b, g, j), typ=i16), I32), lines.shift)
            if isinstance(j, ir.Constant) and j.constant == 0:
                return w
            return b.or_(w, b.lshr(b.zext(b.load(self.union_at(b, g, b.sub(j, I64(1))), typ=i16), I32), back))

        def put(v, here, after):   # every row's vector v from the joined vectors v and v + 1
            for kw in range(S):
                x = here if kw == 0 else b.shuffle_vector(here, after, ir.Constant(
                    ir.VectorType(I32, VL), list(range(kw, kw + VL))))
                ok = self.mask(b, None, v, b.add(cls, I64(kw)))
                at = b.bitcast(b.gep(dsts[kw], [b.mul(v, I64(VL))], source_etype=f32), vt.as_pointer())
                b.store(b.select(ok, x, zero), at, align=4)

        ls = [lines.load(I64(j), bits(I64(j))) for j in range(vectors + 2)]
        ps = [lines.join(ls[j], ls[j + 1]) for j in range(vectors + 1)]
        for v in range(vectors):
            put(I64(v), ps[v], ps[v + 1])

    def fill_rows(self, b, src, digits, count, dst, vectors):
        """`count` rows of the window from the row whose digits (allocas, see `row_digits`)
        are `digits` on, row p into `dst(p)`, the digits stepped past them: a whole group
        (`fill_group`) where a row starts one (its innermost digit 0, `group_ok`, the
        group's rows in the range), else one row (`fill`)."""
        S = self.group
        fn = b.block.function
        head, body, done = (fn.append_basic_block(f"gr.{n}") for n in ("head", "body", "done"))
        b.store(I64(0), self.rowvar)
        b.branch(head)
        b.position_at_end(head)
        p = b.load(self.rowvar, typ=I64)
        b.cbranch(b.icmp_signed("<", p, count), body, done)
        b.position_at_end(body)
        vals = {v: b.load(d, typ=I64) for v, d in zip(self.win.rows, digits)}
        grouped = b.and_(b.load(self.group_ok, typ=I1),
                         b.and_(b.icmp_signed("==", vals[self.win.rows[-1]], I64(0)),
                                b.icmp_signed("<=", b.add(p, I64(S)), count)))
        with b.if_else(grouped) as (whole, single):
            with whole:
                self.fill_group(b, src, vals, [dst(b.add(p, I64(kw))) for kw in range(S)], vectors)
                b.store(I64(S - 1), digits[-1])   # the innermost digit wraps: the next group's first row
                self.step_row(b, digits)
                b.store(b.add(p, I64(S)), self.rowvar)
            with single:
                self.fill(b, src, None, dst(p), vectors, digits)
                self.step_row(b, digits)
                b.store(b.add(p, I64(1)), self.rowvar)
        b.branch(head)
        b.position_at_end(done)


def own_kernel(mod: ir.Module, cpu: CpuOptions, rows: int | None = None, vecs: int | None = None,
               home: ir.Module | None = None,
               depth: int | None = None, window: Window | None = None, name: str | None = None,
               frame=None, taps: bool = False, tri: bool = False) -> ir.Function:
    """The kernel (see the module's docstring) with `rows` x `vecs` register blocks
    and K blocks of about `depth` (default `cpu.own_gemm_depth`; another depth's kernel
    is named with `.dDEPTH`); a window's mask table holds at most
    `cpu.own_gemm_mask_classes` row classes (`_Lanes`);
    one function per program and shape, defined in `home` (default `mod`) and declared
    in `mod` when that is another unit of the program. With `window` (an implicit
    GEMM's own copy, named `name`; `frame(fn, dims)` makes its `Frame`) it takes
    three more arguments, `i64* dims, i64 row0, i64 col0`, and packs the window
    operand, whose pointer is its source's, at rows row0.. and columns col0.. of the
    window matrix. Without either it takes `i64 nv, i64* a_off, i64* c_off,
    i64* k_lo, i64* k_hi` more: nv products that share B, product v being
    C + c_off[v] (+)= (A + a_off[v]) B over K in [k_lo[v], k_hi[v]) (offsets in
    elements; one product (0, 0, 0, K) is the plain C (+)= A B); each block of B is
    packed once for all of them. A product adds into C from its first K block
    unless `accumulate` is 0; one with an empty range writes nothing when it
    accumulates, zeros when not. With `taps`
    (`tgc.gemm.own.f32.bR.vV.taps`) it takes `i64 nt, i64* a_off, i64* b_off,
    i64* q_lo, i64* q_hi, i64* k_lo, i64* k_hi` more: C (+)= the sum over t < nt of
    (A + a_off[t]) (B + b_off[t]), tap t over its columns [q_lo[t], q_hi[t]) and
    its K [k_lo[t], k_hi[t]) (zeros elsewhere), B's columns contiguous (sBn = 1):
    the taps' blocks of B are packed side by side and each block of rows keeps its
    accumulators in registers across all of them (C is read and written once per K
    block, not once per tap). With `tri` (`tgc.gemm.own.f32.bR.vV.tri`, a plain product's
    form) it takes `i64 cp, i64 cq, i64 cr, i64 c` more: a causal mask over C's row p, its
    column q and the summed index r (each coefficient -1, 0 or 1, `c` with the call's
    offsets folded in; `Tri` below): with cr = 0, C = (A B) * [cp p + cq q + c >= 0]
    (a block of rows that the mask rejects for all of a column block's columns is not
    computed: zeros are stored, or nothing when adding; the rest is stored through the
    mask); with cr != 0, the caller states that A and B are 0 wherever
    cp p + cq q + cr r + c < 0, and each block of rows by a column block sums only the
    K range where some element of the block is admitted (the terms skipped are products
    with an exact zero: an FMA chain from +0 gives the same bits without them)."""
    depth = cpu.own_gemm_depth if depth is None else depth
    if rows is None:   # an implicit GEMM's copy: `own_gemm_window_rows` x 4 blocks
        rows = cpu.own_gemm_rows if window is None else cpu.own_gemm_window_rows
    if vecs is None:
        vecs = cpu.own_gemm_vecs if window is None else 4
    if window is None:
        name = (kernel_name(rows, vecs) + ("" if depth == cpu.own_gemm_depth else f".d{depth}") + (".taps" if taps else "")
                + (".tri" if tri else ""))
        if name in mod.globals:
            return mod.globals[name]
        if home is not None and home is not mod:
            return export(own_kernel(home, cpu, rows, vecs, depth=depth, taps=taps, tri=tri), mod)
    f32 = ir.FloatType()
    cols = vecs * VL
    extra = [PTR, I64, I64] if window is not None else []
    variants = window is None and not taps   # the products sharing B (one, for a plain product)
    if variants:
        extra = [I64, PTR, PTR, PTR, PTR] + ([I64] * 4 if tri else [])
    if taps:
        extra = [I64] + [PTR] * 6
    fn = define(mod, name, ir.VoidType(), [I64, I64, I64, PTR, I64, I64, PTR, I64, I64, PTR, I64, I32] + extra)
    fn.attributes.add("noinline")
    M, N, K, pa, sam, sak, pb, sbk, sbn, pc, ldc, acc = fn.args[:12]
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
    # K blocks: up to a quarter deeper than `depth` (whole vectors: the packs write
    # K in steps of 16), as even as can be
    span = depth + depth // 4 // VL * VL
    rows_held = max(span, VL * MAX_TAPS) if taps else span
    bpack = entry.alloca(f32, size=I64(rows_held * cols + VL), name="bpack")   # slack: see own_kernel's packing
    bpack.align = 64
    apack = None
    if window is not None and window.role == "a":
        apack = entry.alloca(f32, size=I64(span * rows + VL), name="apack")
        apack.align = 64
    # A with its rows contiguous (sam = 1, sak != 1: a weight gradient's or attention's
    # transposed A'): the row panel's K block packed once, K contiguous, for every
    # column block (`_pack_a_transposed`); the plain form with one product only
    panel = -(-max(1, cpu.own_gemm_panel_rows) // rows) * rows if window is None else 0
    # (a larger panel reads A' in place); `own_gemm_pack_a_rows` bounds the option's panel,
    # not its rounding up to whole row blocks (512 rows in blocks of 6: 516, packed; not
    # packed, attention's dk and dv at 8192 keys ran at 32 GFLOP/s, packed 102)
    tpack_rows = -(-panel // VL) * VL
    if cpu.own_gemm_panel_rows > cpu.own_gemm_pack_a_rows:
        tpack_rows = min(tpack_rows, cpu.own_gemm_pack_a_rows)
    tpack = None
    if variants and tpack_rows > 0:
        tpack = entry.alloca(f32, size=I64(tpack_rows * span), name="apack.t")
        tpack.align = 64
    # such an A' by one block of B''s columns: sub-panels of `copy_rows` rows copied as
    # they are, K by K, `copy_stride` floats a K (`_copy_a_rows`; `own_gemm_copy_a_rows`)
    copy_rows = -(-cpu.own_gemm_copy_a_rows // rows) * rows if variants and cpu.own_gemm_copy_a_rows > 0 else 0
    copy_stride = -(-copy_rows // VL) * VL
    cbuf = None
    if copy_rows:
        cbuf = entry.alloca(f32, size=I64(copy_stride * span), name="apack.c")
        cbuf.align = 64
    # row groups where the window is B' (its packed block of 64 columns, 4 vectors a row, is
    # filled row by row); A''s rows of a K block (22 vectors a row at 1024 columns) cost as
    # much either way (one thread, dK's product, least thread time: 3.93, 4.07 against
    # 3.84, 4.12 ms row by row, load 15-20)
    segs = _Lanes(entry, window, cols if window.role == "b" else span, cpu.own_gemm_mask_classes,
                  cpu.own_gemm_window_groups and window.role == "b") if window is not None else None
    vt, mt = ir.VectorType(f32, VL), ir.VectorType(I1, VL)
    it = ir.VectorType(I64, VL)
    accs = [[entry.alloca(vt, name=f"acc{r}.{c}") for c in range(vecs)] for r in range(rows)]
    bvar, pvar = entry.alloca(PTR, name="brow"), entry.alloca(I64, name="krow")   # the unrolled FMA loop's
    load_fn, store_fn, fma_fn = masked_intrinsics(mod, f32, VL)
    gather = gather_intrinsic(mod, f32, VL)
    zero_v = ir.Constant(vt, [0.0] * VL)
    iota = ir.Constant(it, list(range(VL)))
    align = I32(4)

    prefetch = mod.globals.get("llvm.prefetch.p0") or ir.Function(
        mod, ir.FunctionType(ir.VoidType(), [PTR, I32, I32, I32]), "llvm.prefetch.p0")
    fence = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "", "~{memory}", side_effect=True)

    def smin(x, y):
        return _min(b, x, y)

    def smax(x, y):
        return _max(b, x, y)

    # A's K stride in the FMA loop: 1 for an implicit GEMM's copy (its packed rows, or an
    # A with its K contiguous, which implicit.py requires)
    astep = I64(1) if window is not None else sak
    cur = {"M": M}   # the rows of the row panel being computed (see the panel loop below)
    packs_a = ir.Constant(I1, 0)
    if tpack is not None:
        packs_a = b.and_(b.and_(b.icmp_signed("==", sam, I64(1)), b.icmp_signed("!=", sak, I64(1))),
                         b.icmp_signed("==", fn.args[12], I64(1)))
        # several column blocks read the packed panel; one reads it once, packed only where
        # A''s K block spans more than `own_gemm_pack_a_span` bytes (see its docs row)
        spans = b.icmp_signed(">", b.mul(b.mul(_min(b, K, I64(span)), sak), I64(4)), I64(cpu.own_gemm_pack_a_span))
        packs_a = b.and_(packs_a, b.or_(b.icmp_signed(">", N, I64(cols)), spans))
        packs_a = b.and_(packs_a, b.icmp_signed("<=", b.mul(b.sdiv(b.add(_min(b, M, I64(panel)), I64(VL - 1)),
                                                                   I64(VL)), I64(VL)), I64(tpack_rows)))
        astep = b.select(packs_a, I64(1), sak)
    copies = ir.Constant(I1, 0)
    if cbuf is not None:   # where the transposed packing would pack for one column block
        copies = b.and_(b.and_(b.icmp_signed("==", sam, I64(1)), b.icmp_signed("!=", sak, I64(1))),
                        b.and_(b.icmp_signed("==", fn.args[12], I64(1)), b.icmp_signed("<=", N, I64(cols))))
        copies = b.and_(copies, b.icmp_signed(">", b.mul(b.mul(_min(b, K, I64(span)), sak), I64(4)),
                                              I64(cpu.own_gemm_pack_a_span)))
        packs_a = b.and_(packs_a, b.not_(copies))
        astep = b.select(copies, I64(copy_stride), b.select(packs_a, I64(1), sak))

    # B with its columns contiguous, its rows exactly one block of columns apart (sbn = 1,
    # sbk = cols: attention's v and k in P v and dS k) and 64-byte aligned is its own
    # packed block wherever the block is full width: read in place, not copied
    # (`CpuOptions.own_gemm_b_in_place`; a B off the lines would split every load)
    in_place = None
    if variants and cpu.own_gemm_b_in_place:
        in_place = b.and_(b.icmp_signed("==", sbn, I64(1)), b.icmp_signed("==", sbk, I64(cols)))
        in_place = b.and_(in_place, b.icmp_signed("==", b.and_(b.ptrtoint(pb, I64), I64(63)), I64(0)))

    def row_blocks(pa, pc, p0, p1, add_c, j0, k0, masks, tap_parts=None, rows=rows, blocks=None):
        """Every block of `rows` rows: C's block (+)= A's rows times the packed
        rows p0..p1 of B's block (K k0 + p0 .. k0 + p1); with `tap_parts`, a
        function of the builder that yields each tap's (A, packed block, p0, p1),
        the sum over the taps. `blocks` (first row, count): those blocks of `rows`
        rows only (default: all of M's, the last one's rows past M clamped to M's
        last)."""
        M = cur["M"]
        first, count = blocks or (I64(0), b.sdiv(b.add(M, I64(rows - 1)), I64(rows)))
        with for_range(b, I64(0), count, "oi") as ib:
            i0 = b.add(first, b.mul(ib, I64(rows)))
            last = b.sub(M, I64(1))
            rix = [b.add(i0, I64(r)) for r in range(rows)]
            inside = [b.icmp_signed("<", i, M) for i in rix]
            rix = [b.select(x, i, last) for x, i in zip(inside, rix)]
            crow = [b.gep(pc, [b.add(b.mul(i, ldc), j0)], source_etype=f32) for i in rix]
            if apack is not None:   # the window's rows of this block, packed from the source
                arow = []
                for r in range(rows):
                    dst = b.gep(apack, [I64(r * span)], source_etype=f32)
                    segs.fill(b, pa, b.add(row0, rix[r]), dst, cur["kvecs"])
                    arow.append(dst)
            else:
                arow = [b.gep(pa, [b.add(b.mul(i, sam), b.mul(k0, astep))], source_etype=f32) for i in rix]
                if tpack is not None:   # the packed panel's rows (see `_pack_a_transposed`)
                    arow = [b.select(packs_a, b.gep(tpack, [b.mul(i, I64(span))], source_etype=f32), a)
                            for i, a in zip(rix, arow)]
                if cbuf is not None:   # the copied sub-panel's rows (see `_copy_a_rows`)
                    arow = [b.select(copies, b.gep(cbuf, [b.sub(i, cur["sub0"])], source_etype=f32), a)
                            for i, a in zip(rix, arow)]
            if window is None:
                # C's block into L2 while the FMAs run: read (or written) after them, from
                # L3 when C is too wide to stay (1024 x 1536 x 384: 188 -> 2xx GFLOP/s)
                for row in crow:
                    for c in range(vecs):
                        b.call(prefetch, [b.gep(row, [I64(c * VL)], source_etype=f32), I32(1), I32(2), I32(1)])
            for regs in accs:   # each K block's sum starts from zero (see the module's docstring)
                for acc in regs:
                    b.store(zero_v, acc)

            def k_step(arow, packed, p, kstep, src=None):
                if src is None:
                    src = b.gep(packed, [b.mul(p, I64(cols))], source_etype=f32)
                bv = [b.load(b.bitcast(b.gep(src, [I64(c * VL)], source_etype=f32), vt.as_pointer()),
                             typ=vt, align=64) for c in range(vecs)]
                for r in range(rows):
                    av = splat(b, b.load(b.gep(arow[r], [b.mul(p, kstep)], source_etype=f32), typ=f32), vt)
                    for c in range(vecs):
                        b.store(b.call(fma_fn, [av, bv[c], b.load(accs[r][c], typ=vt)]), accs[r][c])

            def fmas_loop(arow, packed, p0, p1, kstep):
                """Packed rows p0..p1 in K's order: `own_gemm_unroll` rows per iteration of
                the main loop, then the rest one by one."""
                u = max(1, cpu.own_gemm_unroll)
                rest = p0
                if u > 1:
                    # the packed row's pointer and A's index step by u per iteration (at -O2,
                    # without loop strength reduction, LLVM would multiply them out per step)
                    whole = b.sdiv(b.sub(p1, p0), I64(u))
                    b.store(b.gep(packed, [b.mul(p0, I64(cols))], source_etype=f32), bvar)
                    b.store(p0, pvar)
                    with for_range(b, I64(0), whole, "ku", unroll=False):
                        p, src = b.load(pvar, typ=I64), b.load(bvar, typ=PTR)
                        for j in range(u):
                            if j:   # no load of this step above the last one's FMAs (at -O2 LLVM
                                # hoists them, and the broadcasts held early spill accumulators)
                                b.call(fence, [])
                            k_step(arow, packed, b.add(p, I64(j)), kstep,
                                   b.gep(src, [I64(j * cols)], source_etype=f32))
                        b.store(b.add(p, I64(u)), pvar)
                        b.store(b.gep(src, [I64(u * cols)], source_etype=f32), bvar)
                    rest = b.add(p0, b.mul(whole, I64(u)))
                with for_range(b, rest, p1, "kk", unroll=False) as p:
                    k_step(arow, packed, p, kstep)

            def fmas(arow, packed, p0, p1, late=False):
                """The FMA loop over packed rows p0..p1; a copy for A's K contiguous (one
                index for every row's broadcast, not a pointer per row to step: those
                adds compete with the FMAs for ports). With `late`, that copy prefetches
                C's block into L1 `own_gemm_c_prefetch` K steps before its end: the
                prefetch at the block's start leaves it in L2 (the packed B' streaming
                through L1 evicts it from there) and the store would wait for it
                (1024 x 1536 x 384: 149 -> 155 GFLOP/s, one thread). Two loops there, the
                same steps in the same order (a test in one loop kept a row's pointer on
                the stack; the second loop one step an iteration gained nothing)."""
                if window is not None:
                    fmas_loop(arow, packed, p0, p1, I64(1))
                    return
                with b.if_else(b.icmp_signed("==", astep, I64(1))) as (unit, strided):
                    with unit:
                        if late:
                            mid = smax(p0, b.sub(p1, I64(cpu.own_gemm_c_prefetch)))
                            fmas_loop(arow, packed, p0, mid, I64(1))
                            for row in crow:
                                for c in range(vecs):
                                    b.call(prefetch, [b.gep(row, [I64(c * VL)], source_etype=f32),
                                                      I32(1), I32(3), I32(1)])
                            fmas_loop(arow, packed, mid, p1, I64(1))
                        else:
                            fmas_loop(arow, packed, p0, p1, I64(1))
                    with strided:
                        fmas_loop(arow, packed, p0, p1, astep)
            lanes, whole = None, None
            if tri:   # this block's K range (the mask's), and its store's admitted lanes
                p0, p1, lanes, whole = tri_block(i0, rix[-1], j0, k0, p0, p1, rix)
            if tap_parts is None:
                fmas(arow, cur.get("bsrc", bpack), p0, p1, late=window is None and cpu.own_gemm_c_prefetch > 0)
            else:
                for a_t, packed, t0, t1 in tap_parts():
                    fmas([b.gep(a_t, [b.add(b.mul(i, sam), b.mul(k0, sak))], source_etype=f32) for i in rix],
                         packed, t0, t1)
            def store(adds, lanes):
                for r in range(rows):
                    for c in range(vecs):
                        at = b.gep(crow[r], [I64(c * VL)], source_etype=f32)
                        keep = b.and_(masks[c], splat(b, inside[r], mt))
                        v = b.load(accs[r][c], typ=vt)
                        if lanes is not None:
                            v = b.select(lanes(r, c), v, zero_v)
                        if adds:
                            v = b.fadd(b.call(load_fn, [at, align, keep, zero_v]), v)
                        b.call(store_fn, [v, at, align, keep])

            with b.if_else(add_c) as (onto_c, into_c):   # C + the block's sum, or the sum
                for adds in (True, False):
                    with (onto_c if adds else into_c):
                        if lanes is None:
                            store(adds, None)
                            continue
                        # a block the mask admits whole (every block of a mask with r) is
                        # stored as is; only one it cuts selects its admitted lanes
                        with b.if_else(whole) as (as_is, cut):
                            with as_is:
                                store(adds, None)
                            with cut:
                                store(adds, lanes)

    def tri_block(i0, ilast, j0, k0, p0, p1, rix):
        """(p0, p1, lanes, whole) of the block of rows i0..ilast by the column block at
        j0 under the `tri` mask: the packed rows whose K some element of the block admits
        (all or none for a mask without r), for a mask without r `lanes(r, c)`: the
        admitted lanes of row r's vector c (`Tri`), and `whole` (i1): the mask admits
        every element of the block (always, for a mask with r), whose store then
        computes no lanes (their 64-bit compares and multiplies, per stored vector, on
        the FMAs' ports)."""
        cp, cq, cr = fn.args[17:20]
        c0 = cur["c"]
        width = cur["width"]
        zero = I64(0)

        def top(coef, first, last):   # max of coef * x over x in [first, last], coef in {-1, 0, 1}
            return b.select(b.icmp_signed(">", coef, zero), last,
                            b.select(b.icmp_signed("<", coef, zero), b.neg(first), zero))
        m = b.add(b.add(top(cp, i0, ilast), top(cq, j0, b.sub(b.add(j0, width), I64(1)))), c0)
        # cr = 1: r >= -m; cr = -1: r <= m; cr = 0: the whole range when m >= 0, else none
        lo = b.select(b.icmp_signed(">", cr, zero), b.sub(b.neg(m), k0), p0)
        hi = b.select(b.icmp_signed("<", cr, zero), b.add(b.sub(m, k0), I64(1)), p1)
        none = b.and_(b.icmp_signed("==", cr, zero), b.icmp_signed("<", m, zero))
        lo = smax(lo, p0)
        hi = b.select(none, lo, smax(lo, smin(hi, p1)))
        with_r = b.icmp_signed("!=", cr, zero)

        def bottom(coef, first, last):   # min of coef * x over x in [first, last]
            return b.select(b.icmp_signed(">", coef, zero), first,
                            b.select(b.icmp_signed("<", coef, zero), b.neg(last), zero))
        least = b.add(b.add(bottom(cp, i0, ilast), bottom(cq, j0, b.sub(b.add(j0, width), I64(1)))), c0)
        whole = b.or_(with_r, b.icmp_signed(">=", least, zero))
        cols_v = splat(b, cq, it)

        def lanes(r, c):   # lane l (column q = j0 + 16 c + l) is admitted where cq q + row >= 0
            row = b.add(b.mul(cp, rix[r]), c0)
            q = b.add(splat(b, b.add(j0, I64(c * VL)), it), iota)
            return b.icmp_signed(">=", b.add(b.mul(cols_v, q), splat(b, row, it)), splat(b, zero, it))
        return lo, hi, lanes, whole

    accumulate = b.icmp_signed("!=", acc, I32(0))
    block = I64(span)
    if taps:   # the taps' blocks side by side in the buffer: K blocks of rows_held / nt (whole vectors)
        nt, tap_args = fn.args[12], fn.args[13:19]
        block = b.mul(b.sdiv(b.sdiv(I64(rows_held), nt), I64(VL)), I64(VL))
        block = b.select(b.icmp_signed("<", block, I64(VL)), I64(VL), block)
    chunks = b.sdiv(b.add(K, b.sub(block, I64(1))), block)
    chunks = b.select(b.icmp_signed("<", chunks, I64(1)), I64(1), chunks)   # K = 0 still writes C (zeros)
    step = b.sdiv(b.add(K, b.sub(chunks, I64(1))), chunks)     # K's blocks as even as can be
    lane_bytes = b.mul(splat(b, b.mul(sbn, I64(4)), it), iota)
    panels = b.sdiv(b.add(N, I64(cols - 1)), I64(cols))
    narrow = None
    if window is None and vecs == 4 and not taps:
        # a last block of columns at most half full runs the 8 x 2 kernel (32 columns)
        # rather than this one's 64, half of whose lanes would be masked off (a
        # 64 x 32 x 1024 product with B transposed: 87 GFLOP/s, 159 with 8 x 2)
        fn_narrow = own_kernel(mod, cpu, 8, 2, depth=depth, tri=tri)
        tail = b.sub(N, b.mul(b.sub(panels, I64(1)), I64(cols)))
        narrow = b.and_(b.icmp_signed(">", N, I64(0)), b.icmp_signed("<=", tail, I64(cols // 2)))
        panels = b.select(narrow, b.sub(panels, I64(1)), panels)
    # Row panels: all of B's column blocks for `panel` rows of A at a time, so that the
    # panel's A (panel x K block) stays in L2 while B's blocks are packed and read; a
    # 1024 x 1536 x 384 product ran at 171 GFLOP/s whole, 188 in panels of 256 rows
    # (its 1.5 MB A and 2.4 MB B exceed the 2 MB L2). Every element of C is summed as
    # without panels (the K blocks depend on K only).
    pa_all, pc_all = pa, pc
    if panel:
        npanels = b.sdiv(b.add(M, I64(panel - 1)), I64(panel))
        npanels = b.select(b.icmp_signed("<", npanels, I64(1)), I64(1), npanels)   # M = 0: one empty panel
        row_panel = for_range(b, I64(0), npanels, "om")
        m0 = b.mul(row_panel.__enter__(), I64(panel))
        cur["M"] = smin(I64(panel), b.sub(M, m0))
        pa = b.gep(pa_all, [b.mul(m0, sam)], source_etype=f32)
        pc = b.gep(pc_all, [b.mul(m0, ldc)], source_etype=f32)
        if tri:   # the mask's constant at the panel's first row
            cur["c"] = b.add(fn.args[20], b.mul(fn.args[17], m0))

    def block_step(jb, kb):
        """Column block jb times K block kb: pack B's block, then every row block."""
        j0 = b.mul(jb, I64(cols))
        width = smin(I64(cols), b.sub(N, j0))
        cur["width"] = width
        masks = [b.icmp_signed("<", iota, splat(b, b.sub(width, I64(c * VL)), it)) for c in range(vecs)]
        k0 = b.mul(kb, step)
        kd = smin(step, b.sub(K, k0))
        kd = b.select(b.icmp_signed("<", kd, I64(0)), I64(0), kd)
        add_c = b.or_(accumulate, b.icmp_signed(">", kb, I64(0)))
        if apack is not None:
            cur["kvecs"] = kvecs = b.sdiv(b.add(kd, I64(VL - 1)), I64(VL))
            segs.build(b, b.add(col0, k0), kd, kvecs)   # this K block's columns of the window
        if window is not None and window.role == "b":
            # the window's block, row by row from the source (zeros past the block's width)
            with b.if_then(b.icmp_signed("==", kb, I64(0))):
                segs.build(b, b.add(col0, j0), width, I64(vecs))   # the same columns for every K block
            digits = segs.row_digits(entry, b, b.add(row0, k0))
            if segs.group:
                segs.fill_rows(b, pb, digits, kd, lambda p: b.gep(bpack, [b.mul(p, I64(cols))], source_etype=f32),
                               vecs)
            else:
                with for_range(b, I64(0), kd, "pw") as p:
                    dst = b.gep(bpack, [b.mul(p, I64(cols))], source_etype=f32)
                    segs.fill(b, pb, None, dst, vecs, digits)
                    segs.step_row(b, digits)
        elif taps:
            parts = _pack_taps(b, pa, pb, sbk, N, k0, kd, j0, cols, vecs, bpack, block, nt, tap_args, load_fn,
                               zero_v, it, vt)
        elif in_place is not None:   # B's block already in the packed layout: read where it is
            here = b.and_(in_place, b.icmp_signed("==", width, I64(cols)))
            cur["bsrc"] = b.select(here, b.gep(pb, [b.add(b.mul(k0, sbk), j0)], source_etype=f32), bpack)
            with b.if_then(b.not_(here)):
                _pack_b(b, pb, sbk, sbn, k0, kd, j0, width, cols, vecs, masks, bpack, lane_bytes, load_fn, gather,
                        zero_v, it, vt)
        else:
            _pack_b(b, pb, sbk, sbn, k0, kd, j0, width, cols, vecs, masks, bpack, lane_bytes, load_fn, gather,
                    zero_v, it, vt)
        if taps:
            row_blocks(pa, pc, None, None, add_c, j0, k0, masks, tap_parts=parts)
        elif variants:   # each product's part of this K block, from the one packed block
            nv, offs = fn.args[12], fn.args[13:17]
            with for_range(b, I64(0), nv, "ov") as v:
                a_off, c_off, lo, hi = (b.load(b.gep(x, [v], source_etype=I64), typ=I64) for x in offs)
                p0 = b.sub(smax(k0, lo), k0)
                p1 = b.sub(smin(b.add(k0, kd), hi), k0)
                adds = b.or_(accumulate, b.icmp_signed(">", k0, lo))
                with b.if_then(b.or_(b.icmp_signed("<", p0, p1), b.not_(adds))):   # (K = 0 writes zeros)
                    pa_v, pc_v = b.gep(pa, [a_off], source_etype=f32), b.gep(pc, [c_off], source_etype=f32)
                    if cbuf is None:
                        row_blocks(pa_v, pc_v, p0, _max(b, p0, p1), adds, j0, k0, masks)
                    else:
                        copied_row_blocks(pa_v, pc_v, p0, _max(b, p0, p1), adds, j0, k0, kd, masks)
        else:   # an implicit GEMM's copy
            window_row_blocks(pa, pc, kd, add_c, j0, k0, masks)

    def copied_row_blocks(pa, pc, p0, p1, add_c, j0, k0, kd, masks):
        """`row_blocks` in sub-panels of `copy_rows` rows where `copies` (one sub-panel of
        all rows otherwise), each sub-panel's A' rows of this K block copied first (with
        the next sub-panel's lines prefetched). Each element of C takes the same FMAs in
        the same order as in one pass over the rows (the copy moves values, and the
        row blocks start at the same rows: `copy_rows` is whole blocks): the same bits."""
        M = cur["M"]
        per = b.select(copies, I64(copy_rows), smax(M, I64(1)))
        nsub = smax(b.sdiv(b.add(M, b.sub(per, I64(1))), per), I64(1))
        with for_range(b, I64(0), nsub, "oc") as sp:
            sub0 = b.mul(sp, per)
            n = smax(smin(per, b.sub(M, sub0)), I64(0))
            cur["sub0"] = sub0
            with b.if_then(copies):
                nxt = smax(smin(per, b.sub(M, b.add(sub0, per))), I64(0))
                b.call(_copy_a_rows(mod, copy_stride // VL), [b.gep(pa, [sub0], source_etype=f32), sak, k0, kd, n,
                                                              nxt, I64(copy_rows), cbuf])
            row_blocks(pa, pc, p0, p1, add_c, j0, k0, masks,
                       blocks=(sub0, b.sdiv(b.add(n, I64(rows - 1)), I64(rows))))

    def window_row_blocks(pa, pc, kd, add_c, j0, k0, masks):
        """An implicit GEMM's copy's row blocks: the whole blocks of `rows` rows, then
        a last block of fewer rows than M has left (`rows` - 2, when they fit) in a
        block of that many rows, not a whole one (its rows past M computed again:
        conv2d's output product has 64 rows, 10 blocks of 6 and one of 4, whose FMAs
        were a third wasted at 6). Each element of C takes the same FMAs in the same
        order in a block of any height: the same bits."""
        M = cur["M"]
        small = rows - 2
        if small < 1:
            row_blocks(pa, pc, I64(0), kd, add_c, j0, k0, masks)
            return
        whole = b.sdiv(M, I64(rows))
        rest = b.sub(M, b.mul(whole, I64(rows)))
        short = b.and_(b.icmp_signed(">", rest, I64(0)), b.icmp_signed("<=", rest, I64(small)))
        # the rows left over in a whole (clamped) block where they do not fit the short one
        big = b.select(b.or_(short, b.icmp_signed("==", rest, I64(0))), whole, b.add(whole, I64(1)))
        row_blocks(pa, pc, I64(0), kd, add_c, j0, k0, masks, blocks=(I64(0), big))
        with b.if_then(short):
            row_blocks(pa, pc, I64(0), kd, add_c, j0, k0, masks, rows=small,
                       blocks=(b.mul(whole, I64(rows)), I64(1)))

    # the K blocks outside the column blocks: a row panel's A (panel x K block) stays in
    # L2 across all of B's column blocks (512 x 384 x 1536: 156 -> 1xx GFLOP/s); an
    # implicit GEMM's copy keeps the column blocks outside (a window B's table of
    # columns is built once per column block)
    if window is None:
        with for_range(b, I64(0), chunks, "ok") as kb:
            if tpack is not None:
                with b.if_then(packs_a):
                    k0 = b.mul(kb, step)
                    kd = smax(smin(step, b.sub(K, k0)), I64(0))
                    a0 = b.load(fn.args[13], typ=I64)   # the one product's offset into A
                    b.call(_pack_a_transposed(mod), [b.gep(pa, [a0], source_etype=f32), sak, k0, kd, cur["M"],
                                                     tpack, I64(span)])
            with for_range(b, I64(0), panels, "oj") as jb:
                block_step(jb, kb)
    else:
        with for_range(b, I64(0), panels, "oj") as jb:
            with for_range(b, I64(0), chunks, "ok") as kb:
                block_step(jb, kb)
    if narrow is not None:
        with b.if_then(narrow):
            j0 = b.mul(panels, I64(cols))
            rest = list(fn.args[12:17])
            if tri:   # the narrow block's columns from 0: the constant moved by cq j0 (and the panel's rows)
                rest += list(fn.args[17:20]) + [b.add(cur["c"], b.mul(fn.args[18], j0))]
            b.call(fn_narrow, [cur["M"], b.sub(N, j0), K, pa, sam, sak, b.gep(pb, [b.mul(j0, sbn)], source_etype=f32),
                               sbk, sbn, b.gep(pc, [j0], source_etype=f32), ldc, acc] + rest)
    if panel:
        row_panel.__exit__(None, None, None)
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
                            ptrs = b.inttoptr(b.add(splat(b, at, it), lane_bytes), ir.VectorType(PTR, VL))
                            v = b.call(gather, [ptrs, align, masks[c], zero_v])
                            b.store(v, b.bitcast(b.gep(dst, [I64(c * VL)], source_etype=f32), vt.as_pointer()),
                                    align=64)


def _pack_a_transposed(mod: ir.Module) -> ir.Function:
    """`void tgc.gemm.own.f32.pack_a(float* A, i64 sak, i64 k0, i64 kd, i64 rows,
    float* apack, i64 span)`, one per module (the kernels of every block shape call
    it): A's rows 0..rows - 1 (at most a row panel), K k0 .. k0 + kd, when its rows
    are contiguous (A[i, k] at A + i + k * sak): for each 16 rows and 16 K, 16 masked
    vector loads along the rows, a transpose in registers, 16 whole-vector stores,
    row i's K at apack + i * span (the FMA loop's broadcasts then read one line per
    16 K, not one per K, and the row panel's A' is read from memory once for every
    column block). Lanes past `rows` or `kd` are not read; their packed values (zeros)
    are never used."""
    name = "tgc.gemm.own.f32.pack_a"
    if name in mod.globals:
        return mod.globals[name]
    fn = define(mod, name, ir.VoidType(), [PTR, I64, I64, I64, I64, PTR, I64])
    fn.attributes.add("noinline")
    pa, sak, k0, kd, rows, apack, span = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    f32 = ir.FloatType()
    vt = ir.VectorType(f32, VL)
    load_fn = masked_intrinsics(mod, f32, VL)[0]
    zero_v = ir.Constant(vt, [0.0] * VL)
    it = ir.VectorType(I64, VL)
    iota = ir.Constant(it, list(range(VL)))
    # K outside the rows: 16 rows of A at a time (16 K) walked along the panel's rows, 16
    # streams the hardware prefetcher follows; rows outside, each strip touched every one
    # of the K block's rows of A, one line apiece (attention's dk and dv at 8192 keys, A'
    # of 4096 x 256 with a K stride of 8192: 96 -> 115 GFLOP/s on one thread)
    with for_range(b, I64(0), b.sdiv(b.add(kd, I64(VL - 1)), I64(VL)), "ak") as tk:
        kk0 = b.mul(tk, I64(VL))
        with for_range(b, I64(0), b.sdiv(b.add(rows, I64(VL - 1)), I64(VL)), "ai") as ti:
            i0 = b.mul(ti, I64(VL))
            imask = b.icmp_signed("<", iota, splat(b, b.sub(rows, i0), it))
            vecs = []
            for j in range(VL):
                kj = b.add(kk0, I64(j))
                inside = splat(b, b.icmp_signed("<", kj, kd), ir.VectorType(I1, VL))
                at = b.gep(pa, [b.add(i0, b.mul(b.add(k0, kj), sak))], source_etype=f32)
                vecs.append(b.call(load_fn, [at, I32(4), b.and_(imask, inside), zero_v]))
            for r, v in enumerate(_transpose16(b, vecs)):
                dst = b.gep(apack, [b.add(b.mul(b.add(i0, I64(r)), span), kk0)], source_etype=f32)
                b.store(v, b.bitcast(dst, vt.as_pointer()), align=64)
    b.ret_void()
    return fn


def _copy_a_rows(mod: ir.Module, nvec: int) -> ir.Function:
    """`void tgc.gemm.own.f32.copy_a.N(float* A, i64 sak, i64 k0, i64 kd, i64 rows,
    i64 next, i64 ahead, float* cbuf)`, one per module and N (vectors a K): A's rows
    0..rows - 1 (rows at most 16 N, contiguous: A[i, k] at A + i + k * sak), K k0 ..
    k0 + kd, copied as they are to cbuf + (k - k0) * 16 N + i: per K, N masked vector
    loads and N aligned stores; and the lines of the next `next` rows at A + ahead
    prefetched into L2. The own kernel then broadcasts A'[i, k] from the copy: its K
    stride is 16 N floats, where A's own (attention's dS and P, [128 x s] f32: 32 KiB
    at s = 8192) puts every K's line of one row in the same L1 set (the 128 lines of a
    block of rows thrash its 12 ways) and a block's rows in one L2 line group.
    Lanes past `rows` are zeros, never read. No transpose: no shuffles, which cost the
    transposed packing (`_pack_a_transposed`) a port the FMAs' broadcasts share."""
    name = f"tgc.gemm.own.f32.copy_a.{nvec}"
    if name in mod.globals:
        return mod.globals[name]
    fn = define(mod, name, ir.VoidType(), [PTR, I64, I64, I64, I64, I64, I64, PTR])
    fn.attributes.add("noinline")
    pa, sak, k0, kd, rows, nxt, ahead, cbuf = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    f32 = ir.FloatType()
    vt = ir.VectorType(f32, VL)
    load_fn = masked_intrinsics(mod, f32, VL)[0]
    prefetch = mod.globals.get("llvm.prefetch.p0") or ir.Function(
        mod, ir.FunctionType(ir.VoidType(), [PTR, I32, I32, I32]), "llvm.prefetch.p0")
    zero_v = ir.Constant(vt, [0.0] * VL)
    it = ir.VectorType(I64, VL)
    iota = ir.Constant(it, list(range(VL)))
    masks = [b.icmp_signed("<", iota, splat(b, b.sub(rows, I64(j * VL)), it)) for j in range(nvec)]
    fetch = [b.icmp_signed(">", nxt, I64(j * VL)) for j in range(nvec)]
    with for_range(b, I64(0), kd, "ck") as k:
        src = b.gep(pa, [b.mul(b.add(k0, k), sak)], source_etype=f32)
        dst = b.gep(cbuf, [b.mul(k, I64(nvec * VL))], source_etype=f32)
        for j in range(nvec):
            v = b.call(load_fn, [b.gep(src, [I64(j * VL)], source_etype=f32), I32(4), masks[j], zero_v])
            b.store(v, b.bitcast(b.gep(dst, [I64(j * VL)], source_etype=f32), vt.as_pointer()), align=64)
        ahead_at = b.gep(src, [ahead], source_etype=f32)
        for j in range(nvec):
            with b.if_then(fetch[j]):
                b.call(prefetch, [b.gep(ahead_at, [I64(j * VL)], source_etype=f32), I32(0), I32(2), I32(1)])
    b.ret_void()
    return fn


def _pack_taps(b, pa, pb, sbk, N, k0, kd, j0, cols, vecs, bpack, block, nt, tap_args, load_fn, zero_v, it, vt):
    """The taps form's packing: each tap's rows of this K block that its K range
    holds, at bpack + t * block * cols, lanes outside its columns zero (masked
    loads, B's columns contiguous). Returns `tap_parts` for `row_blocks`: a
    function yielding, per tap (a loop over nt), (A + a_off[t], its packed
    block, its first and last packed row)."""
    f32 = ir.FloatType()
    iota = ir.Constant(it, list(range(VL)))
    a_off, b_off, q_lo, q_hi, k_lo, k_hi = tap_args

    def at(arr, t):
        return b.load(b.gep(arr, [t], source_etype=I64), typ=I64)

    def rows_of(t):
        p0 = b.sub(_max(b, k0, at(k_lo, t)), k0)
        p1 = b.sub(_min(b, b.add(k0, kd), at(k_hi, t)), k0)
        return p0, _max(b, p0, p1)

    with for_range(b, I64(0), nt, "tp") as t:
        p0, p1 = rows_of(t)
        lo = _max(b, at(q_lo, t), I64(0))
        hi = _min(b, at(q_hi, t), N)
        masks = []
        for c in range(vecs):
            col = b.add(splat(b, b.add(j0, I64(c * VL)), it), iota)
            masks.append(b.and_(b.icmp_signed(">=", col, splat(b, lo, it)), b.icmp_signed("<", col, splat(b, hi, it))))
        src0 = b.gep(pb, [b.add(at(b_off, t), j0)], source_etype=f32)
        dst0 = b.gep(bpack, [b.mul(b.mul(t, block), I64(cols))], source_etype=f32)
        with for_range(b, p0, p1, "tq") as p:
            src = b.gep(src0, [b.mul(b.add(k0, p), sbk)], source_etype=f32)
            dst = b.gep(dst0, [b.mul(p, I64(cols))], source_etype=f32)
            for c in range(vecs):
                v = b.call(load_fn, [b.gep(src, [I64(c * VL)], source_etype=f32), I32(4), masks[c], zero_v])
                b.store(v, b.bitcast(b.gep(dst, [I64(c * VL)], source_etype=f32), vt.as_pointer()), align=64)

    def parts():
        with for_range(b, I64(0), nt, "tf") as t:
            p0, p1 = rows_of(t)
            yield (b.gep(pa, [at(a_off, t)], source_etype=f32),
                   b.gep(bpack, [b.mul(b.mul(t, block), I64(cols))], source_etype=f32), p0, p1)
    return parts


def _min(b, x, y):
    return b.select(b.icmp_signed("<", x, y), x, y)


def _max(b, x, y):
    return b.select(b.icmp_signed(">", x, y), x, y)


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
    f32 = ir.FloatType()
    it = ir.VectorType(I64, VL)
    iota = ir.Constant(it, list(range(VL)))
    with for_range(b, I64(0), b.sdiv(b.add(kd, I64(VL - 1)), I64(VL)), "pt") as t:
        kk0 = b.mul(t, I64(VL))
        kmask = b.icmp_signed("<", iota, splat(b, b.sub(kd, kk0), it))
        for c in range(vecs):
            rows = []
            for i in range(VL):
                col = c * VL + i
                inside = splat(b, b.icmp_signed("<", I64(col), width), ir.VectorType(I1, VL))
                at = b.gep(pb, [b.add(b.add(k0, kk0), b.mul(b.add(j0, I64(col)), sbn))], source_etype=f32)
                rows.append(b.call(load_fn, [at, I32(4), b.and_(kmask, inside), zero_v]))
            for kk, v in enumerate(_transpose16(b, rows)):
                dst = b.gep(bpack, [b.add(b.mul(b.add(kk0, I64(kk)), I64(cols)), I64(c * VL))], source_etype=f32)
                b.store(v, b.bitcast(dst, vt.as_pointer()), align=64)
