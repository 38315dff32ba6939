"""GEMMs on shifted views (a convolution's taps) in `GemmGen` (gemm.py): where each
tap's shifted edges are in bounds, and the own kernel's forms that run several
products in one call.

Taps and shifts (GEMMs on shifted views). The task also loops over the taps; each
tap offsets the shifted operand and clips the shifted edge's range to where every
index is in bounds (the rest of the sum is zeros); the tile's range is cut to that.
A clipped edge is the outermost edge of its group (`layout` sees to it), so its
range [lo, hi) is the run [lo * inner, hi * inner) of the merged group, `inner`
being the other edges' extent: a 2-D image shifted along its rows is one call per
tap over whole rows. Such a product accumulates: every task first zeroes its tile
of `out`, then every call adds into it (beta = 1). Taps without shifts (a K edge
that an operand's order splits, looped outside the calls) accumulate the same way.

Shared B'. An accumulating product that the own kernel runs, batched fewer than
`options.cpu.gemm_batch_tasks` times along edges its B' does not read (`shared_b_batch`: a 1-D
convolution's kernel gradient, batched by the tap, which shifts only A' along K),
makes tasks of the other batch edges and tiles only; each of its calls runs the
products of every index of those edges on one packed B'.

All taps in one call. A product whose taps have fixed sizes and whose shifts move
only B''s columns or K (`taps_in_one_call`: a convolution's output, or its input
gradient after the flip) makes, for a tile the own kernel runs, one call of its
`.taps` form for all taps: C is written once, never zeroed first.
"""
from __future__ import annotations

import itertools

import llvmlite.ir as ir

from tgc.backends.cpu.fgemm import own_kernel
from tgc.backends.cpu.irutil import I32, I64, for_range, offset


class TapCalls:
    """`GemmGen`'s methods for taps and shifts, a base class of it: they read the
    generator's state (`b`, `f`, `k`, `low`, `mod`, `home`, `elems`, the groups `P`,
    `Q`, `R` and the `shared` batch edges) and call its `ptr`, `smin`, `smax`,
    `ceil_div`, `own_tile` and `leaf`."""

    def ranges(self, tile, pl, lo, hi):
        """The tile's (P, Q, R) ranges cut to the clipped edges' ranges `lo`..`hi`."""
        b = self.b
        p0, p1, q0, q1 = tile
        # the clipped edge's range cuts its group's range; it is the group's outermost
        # edge, so its range times the other edges' extent is one run of the group
        ranges = {"P": [p0, p1], "Q": [q0, q1], "R": [I64(0), pl["R"]]}
        for e in lo:
            g = next(g for g in ("P", "Q", "R") if getattr(self, g)[:1] == (e,))
            inner = self.f.count(getattr(self, g)[1:])
            start, end = b.mul(lo[e], inner), b.mul(hi[e], inner)
            ranges[g] = [self.smax(b, ranges[g][0], start), self.smin(ranges[g][1], end)]
        return ranges["P"], ranges["Q"], ranges["R"]

    def shift_offsets(self, vars, st, roles=("a", "b")):
        """Per role, the (index, stride) parts of its pointer at the batch and tap
        indices `vars` (shifts included)."""
        k = self.k
        out = {}
        for role in roles:
            strides = st[role][0]
            parts = [(vars[e], strides[e]) for e in k.batch + k.taps if e in strides]
            parts += [(self.ix(ix, vars), strides[e]) for r, e, ix in k.shifts if r == role]
            out[role] = parts
        return out

    def leaf_shared(self, vars, tile, pl, st, ptrs, A, B, c_p, small):
        """One task's tap with the `shared` batch edges taken whole: where the tile runs
        the own kernel, one call for every index of them, on one packed B' (each
        index's K range cut to where the shifts it moves are in bounds); elsewhere
        `leaf` per index."""
        b, k = self.b, self.k
        p0, p1, q0, q1 = tile
        multi = b.and_(b.not_(small), self.own_tile(b.sub(p1, p0), self.smin(pl["tr"], pl["R"]),
                                                          b.sub(q1, q0)))
        moved = [s for s in k.shifts if any(atom in self.shared for atom, _ in s[2].terms)]
        fixed = [s for s in k.shifts if s not in moved]
        sizes = [self.low.size(e) for e in self.shared]
        indices = list(itertools.product(*(range(n) for n in sizes)))
        with b.if_else(multi) as (then, otherwise):
            with otherwise:
                self.nest(list(self.shared), vars, lambda v: self.leaf(v, tile, pl, st, ptrs, A, B, c_p, small))
            with then:
                lo, hi, ok = self.clip(vars, fixed)
                (ps, pe), (qs, qe), (rs, re) = self.ranges(tile, pl, lo, hi)
                nonempty = b.and_(b.icmp_signed("<", ps, pe), b.icmp_signed("<", qs, qe))
                if ok is not None:
                    nonempty = b.and_(nonempty, ok)
                with b.if_then(nonempty):
                    self.call_shared(vars, tile, pl, st, ptrs, A, B, c_p, (ps, pe, qs, qe, rs, re), moved, indices)

    def call_shared(self, vars, tile, pl, st, ptrs, A, B, c_p, box, moved, indices):
        """`leaf_shared`'s calls of the own kernel, one per R chunk, each for every
        product of the shared edges."""
        b, k = self.b, self.k
        ps, pe, qs, qe, rs, re = box
        offs = [self.f.alloca(ir.ArrayType(I64, len(indices)), name) for name in ("a_off", "c_off", "k_lo", "k_hi")]
        pb = self.ptr(ptrs[B.role], self.shift_offsets(vars, st, (B.role,))[B.role] + [(qs, B.col)],
                      self.elems[B.role])
        kk = self.smax(b, b.sub(re, rs), I64(0))
        chunks = self.ceil_div(b, kk, pl["tr"])
        chunks = b.select(b.icmp_signed("<", chunks, I64(1)), I64(1), chunks)
        with for_range(b, I64(0), chunks, "chunk") as j:
            r = b.add(rs, b.mul(j, pl["tr"]))
            kc = self.smax(b, self.smin(pl["tr"], b.sub(re, r)), I64(0))
            for i, index in enumerate(indices):
                at = {**vars, **{e: I64(x) for e, x in zip(self.shared, index)}}
                lo, hi, _ = self.clip(at, moved)
                _, _, (hs, he) = self.ranges(tile, pl, lo, hi)
                k_lo = self.smin(self.smax(b, b.sub(self.smax(b, hs, rs), r), I64(0)), kc)
                k_hi = self.smin(self.smax(b, b.sub(self.smin(he, re), r), I64(0)), kc)
                a_off = offset(b, self.shift_offsets(at, st, (A.role,))[A.role] + [(ps, A.row), (r, A.col)])
                c_off = offset(b, [(at[e], st["c"][0][e]) for e in k.batch] + [(ps, c_p), (qs, I64(1))])
                for arr, v in zip(offs, (a_off, c_off, k_lo, k_hi)):
                    b.store(v, b.gep(arr, [I32(0), I32(i)]))
            fn = own_kernel(self.mod, self.opt.cpu, home=self.home)
            ptrs_v = [b.gep(arr, [I32(0), I32(0)]) for arr in offs]
            b.call(fn, [b.sub(pe, ps), b.sub(qe, qs), kc, ptrs[A.role], A.row, A.col,
                        self.ptr(pb, [(r, B.row)], self.elems[B.role]), B.row, B.col, ptrs["c"], c_p, I32(1),
                        I64(len(indices))] + ptrs_v)

    def call_taps(self, vars, tile, pl, st, ptrs, A, B, c_p):
        """The tile's sum over every tap in one call of the own kernel's taps form
        (`taps_in_one_call`): per tap, its A' and B' offsets and the columns and K
        where its shifts are in bounds."""
        b, k = self.b, self.k
        p0, p1, q0, q1 = tile
        indices = list(itertools.product(*(range(self.low.size(e)) for e in k.taps)))
        offs = [self.f.alloca(ir.ArrayType(I64, len(indices)), name)
                for name in ("a_off", "b_off", "q_lo", "q_hi", "k_lo", "k_hi")]
        for i, index in enumerate(indices):
            at = {**vars, **{e: I64(x) for e, x in zip(k.taps, index)}}
            lo, hi, ok = self.clip(at)
            _, (qs, qe), (rs, re) = self.ranges(tile, pl, lo, hi)
            if ok is not None:   # a tap whose shifts leave nothing in bounds adds nothing
                rs, re = b.select(ok, rs, I64(0)), b.select(ok, re, I64(0))
            sh = self.shift_offsets(at, st)
            values = (offset(b, sh[A.role] + [(p0, A.row)]), offset(b, sh[B.role] + [(q0, B.col)]),
                      b.sub(qs, q0), b.sub(qe, q0), rs, re)
            for arr, v in zip(offs, values):
                b.store(v, b.gep(arr, [I32(0), I32(i)]))
        pc = self.ptr(ptrs["c"], [(vars[e], st["c"][0][e]) for e in k.batch] + [(p0, c_p), (q0, I64(1))])
        fn = own_kernel(self.mod, self.opt.cpu, home=self.home, taps=True)
        b.call(fn, [b.sub(p1, p0), b.sub(q1, q0), pl["R"], ptrs[A.role], A.row, A.col, ptrs[B.role], B.row, B.col,
                    pc, c_p, I32(0), I64(len(indices))] + [b.gep(arr, [I32(0), I32(0)]) for arr in offs])

    def clip(self, vars, shifts=None):
        """Per clipped edge, the range [lo, hi) where every shifted index (of `shifts`,
        default all) is in bounds; `ok`: all ranges nonempty (None: no clips)."""
        b, k = self.b, self.k
        lo, hi, ok = {}, {}, None
        for role, e, ix in (k.shifts if shifts is None else shifts):
            view = dict(k.a.edges if role == "a" else k.b.edges)
            sh = self.ix(ix, vars)
            l0 = b.sub(I64(0), sh)
            h0 = b.sub(self.f.edge_size(view[e]), sh)
            l1, h1 = lo.get(e, I64(0)), hi.get(e, self.f.edge_size(e))
            lo[e] = b.select(b.icmp_signed(">", l0, l1), l0, l1)
            hi[e] = b.select(b.icmp_signed("<", h0, h1), h0, h1)
        for e in lo:
            bit = b.icmp_signed("<", lo[e], hi[e])
            ok = bit if ok is None else b.and_(ok, bit)
        return lo, hi, ok

    def ix(self, ix, vars):
        b = self.b
        total = self.f.size(ix.const)
        for atom, coef in ix.terms:
            term = vars[atom] if coef == 1 else b.mul(vars[atom], self.f.size(coef))
            total = b.add(total, term)
        return total

    def nest(self, edges, vars, leaf):
        if not edges:
            leaf(vars)
            return
        lo, hi = getattr(self, "tap_range", {}).get(edges[0], (I64(0), self.f.edge_size(edges[0])))
        with for_range(self.b, lo, hi, edges[0]) as i:
            self.nest(edges[1:], {**vars, edges[0]: i}, leaf)
