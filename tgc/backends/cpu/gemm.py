"""GEMM cells as LLVM functions calling cblas ?gemm through the function table.

    void tgc.kN(const i64* dims, T* a, T* b, T* c)

For every index of the batch edges (a loop nest, offsets by each buffer's batch
strides; an operand without a batch edge is reused along it) one row-major
`cblas_?gemm` call. `layout` guarantees each buffer holds its
matrix with both edge groups merged and one group contiguous: a transpose flag
absorbs an operand stored the other way round, and a result stored with M
innermost is computed as C^T = B^T A^T.
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
        if c_form[2]:  # C[M, N], N contiguous
            ldc = cs[k.m[-1]]
            call = (ta, tb, M, N, K, lda, ldb, ldc, False)
        else:          # C^T[N, M] = B^T A^T
            ldc = cs[k.n[-1]]
            flip = {blas.NO_TRANS: blas.TRANS, blas.TRANS: blas.NO_TRANS}
            call = (flip[tb], flip[ta], N, M, K, ldb, lda, ldc, True)
        strides = [(self.f.strides(ab.order), dict(k.a.edges)), (self.f.strides(bb.order), dict(k.b.edges)),
                   (cs, {e: e for e in cb.edges})]

        def leaf(vars):  # a batch edge that an operand lacks repeats it (stride 0)
            ptrs = []
            for arg, (st, to_buf) in zip(self.fn.args[1:], strides):
                off = offset(b, [(vars[e], st[to_buf[e]]) for e in k.batch if e in to_buf])
                ptrs.append(b.gep(arg, [off], inbounds=True, source_etype=self.fp))
            self.call_blas(call, *ptrs)

        nonempty = b.icmp_signed(">", b.mul(M, N), I64(0))
        with b.if_then(nonempty):
            self.nest(list(k.batch), {}, leaf)
        b.ret_void()
        self.f.finish()
        return self.fn

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
        one, zero = ir.Constant(self.fp, 1.0), ir.Constant(self.fp, 0.0)
        name = "sgemm" if isinstance(self.fp, ir.FloatType) else "dgemm"
        ld = [self.at_least_one(v) for v in (lda, ldb, ldc)]
        fntable.call(b, name, [I32(blas.ORDER_ROW_MAJOR), I32(ta), I32(tb), M, N, K, one,
                               x, ld[0], y, ld[1], zero, pc, ld[2]])

    def at_least_one(self, v):
        return self.b.select(self.b.icmp_signed("<", v, I64(1)), I64(1), v)
