"""GEMM cells as LLVM functions calling cblas ?gemm through the function table.

    void tgc.kN(const i64* dims, T* a, T* b, T* c)

For every index of the batch edges (a loop nest, offsets by each buffer's batch
strides; an operand without a batch edge is reused along it) one row-major
`cblas_?gemm` call. `layout` guarantees each buffer holds its
matrix with both edge groups merged and one group contiguous: a transpose flag
absorbs an operand stored the other way round, and a result stored with M
innermost is computed as C^T = B^T A^T.

With taps or shifts (GEMMs on shifted views) the nest also runs over the taps; each
call offsets the shifted operand, clips the shifted edge's range to where every
index is in bounds, and adds into `out` (zeroed first, beta = 1).
"""
from __future__ import annotations

import llvmlite.ir as ir

from tgc.backends.cpu import blas, fntable
from tgc.backends.cpu.irutil import I32, I64, PTR, Frame, define, for_range, offset
from tgc.ir.lowered import GemmKernel, Lowered, matrix_form


class GemmGen:
    def __init__(self, mod: ir.Module, low: Lowered, k: GemmKernel, name: str, fp):
        self.low, self.k, self.fp = low, k, fp
        self.fn = define(mod, name, ir.VoidType(), [PTR] * 4)
        self.fn.attributes.add("noinline")
        self.f = Frame(self.fn, low.module, self.fn.args[0])
        self.b = self.f.b

    def group(self, order, edges):
        """(merged size, stride of the group's innermost edge) in a buffer."""
        strides = self.f.strides(order)
        return self.f.count(edges), strides[edges[-1]]

    def operand(self, view_order, buf_order, rows, cols, to_buf):
        """(trans flag, ld) for a matrix [rows, cols] held in a buffer."""
        form = matrix_form(view_order, rows, cols)
        if form is None:
            raise ValueError(f"internal: GEMM operand in order {view_order} is not a matrix")
        r, c, cols_inner = form
        outer = r if cols_inner else c
        strides = self.f.strides(buf_order)
        ld = strides[to_buf(outer[-1])]
        return (blas.NO_TRANS if cols_inner else blas.TRANS), ld

    def emit(self) -> ir.Function:
        k, low, b = self.k, self.low, self.b
        ab, bb, cb = (low.buffers[n] for n in (k.a.buf, k.b.buf, k.out))
        va, vb = k.a.view_order(ab.order), k.b.view_order(bb.order)
        c_form = matrix_form(cb.order, k.m, k.n)
        if c_form is None:
            raise ValueError("internal: GEMM result is not a matrix")
        M, N, K = self.f.count(k.m), self.f.count(k.n), self.f.count(k.k)
        ta, lda = self.operand(va, ab.order, k.m, k.k, k.a.buf_edge)
        tb, ldb = self.operand(vb, bb.order, k.k, k.n, k.b.buf_edge)
        cs = self.f.strides(cb.order)
        ldc = cs[k.m[-1]] if c_form[2] else cs[k.n[-1]]
        views = [(self.fn.args[1], self.f.strides(ab.order), dict(k.a.edges), "a"),
                 (self.fn.args[2], self.f.strides(bb.order), dict(k.b.edges), "b"),
                 (self.fn.args[3], cs, {e: e for e in cb.edges}, "c")]
        clipped = {e for _, e, _ in k.shifts}

        def leaf(vars):  # a batch edge that an operand lacks repeats it (stride 0)
            lo, ok = self.clip(vars, views)
            ptrs = []
            for arg, st, to_buf, role in views:
                parts = [(vars[e], st[to_buf[e]]) for e in k.batch + k.taps if e in to_buf]
                parts += [(lo[e], st[to_buf[e]]) for e in clipped if e in to_buf]
                parts += [(self.ix(ix, vars), st[to_buf[e]]) for r, e, ix in k.shifts if r == role]
                ptrs.append(b.gep(arg, [offset(b, parts)], inbounds=True, source_etype=self.fp))
            m, n, kk = (self.extent(g, lo, full) for g, full in ((k.m, M), (k.n, N), (k.k, K)))
            if c_form[2]:  # C[M, N], N contiguous
                call = (ta, tb, m, n, kk, lda, ldb, ldc, False)
            else:          # C^T[N, M] = B^T A^T
                flip = {blas.NO_TRANS: blas.TRANS, blas.TRANS: blas.NO_TRANS}
                call = (flip[tb], flip[ta], n, m, kk, ldb, lda, ldc, True)
            if ok is None:
                self.call_blas(call, *ptrs)
            else:
                with b.if_then(ok):
                    self.call_blas(call, *ptrs)

        if k.accumulates():
            self.fill_zero(self.fn.args[3], self.f.count(cb.edges))
        nonempty = b.icmp_signed(">", b.mul(M, N), I64(0))
        with b.if_then(nonempty):
            self.nest(list(k.batch + k.taps), {}, leaf)
        b.ret_void()
        self.f.finish()
        return self.fn

    def clip(self, vars, views):
        """Per clipped edge, the start of its range where every shifted index is in
        bounds (`self.hi` gets the end); `ok`: all ranges nonempty (None: no clips)."""
        b, k = self.b, self.k
        lo, self.hi, ok = {}, {}, None
        for role, e, ix in k.shifts:
            view = dict(k.a.edges if role == "a" else k.b.edges)
            sh = self.ix(ix, vars)
            l0 = b.sub(I64(0), sh)
            h0 = b.sub(self.f.edge_size(view[e]), sh)
            l1, h1 = lo.get(e, I64(0)), self.hi.get(e, self.f.edge_size(e))
            lo[e] = b.select(b.icmp_signed(">", l0, l1), l0, l1)
            self.hi[e] = b.select(b.icmp_signed("<", h0, h1), h0, h1)
        for e in lo:
            bit = b.icmp_signed("<", lo[e], self.hi[e])
            ok = bit if ok is None else b.and_(ok, bit)
        return lo, ok

    def extent(self, group, lo, full):
        if len(group) == 1 and group[0] in lo:
            return self.b.sub(self.hi[group[0]], lo[group[0]])
        return full

    def ix(self, ix, vars):
        b = self.b
        total = self.f.size(ix.const)
        for atom, coef in ix.terms:
            term = vars[atom] if coef == 1 else b.mul(vars[atom], self.f.size(coef))
            total = b.add(total, term)
        return total

    def fill_zero(self, ptr, n):
        with for_range(self.b, I64(0), n, "z") as i:
            self.b.store(ir.Constant(self.fp, 0.0), self.b.gep(ptr, [i], source_etype=self.fp))

    def nest(self, edges, vars, leaf):
        if not edges:
            leaf(vars)
            return
        with for_range(self.b, I64(0), self.f.edge_size(edges[0]), edges[0]) as i:
            self.nest(edges[1:], {**vars, edges[0]: i}, leaf)

    def call_blas(self, call, pa, pb, pc):
        ta, tb, M, N, K, lda, ldb, ldc, swapped = call
        b = self.b
        x, y = (pb, pa) if swapped else (pa, pb)
        one = ir.Constant(self.fp, 1.0)
        zero = one if self.k.accumulates() else ir.Constant(self.fp, 0.0)  # beta
        name = "sgemm" if isinstance(self.fp, ir.FloatType) else "dgemm"
        ld = [self.at_least_one(v) for v in (lda, ldb, ldc)]
        fntable.call(b, name, [I32(blas.ORDER_ROW_MAJOR), I32(ta), I32(tb), M, N, K, one,
                               x, ld[0], y, ld[1], zero, pc, ld[2]])

    def at_least_one(self, v):
        return self.b.select(self.b.icmp_signed("<", v, I64(1)), I64(1), v)
