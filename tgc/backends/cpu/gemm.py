"""GEMM cells as LLVM functions: tiles of cblas ?gemm calls or generated loops,
spread over the cores through libgomp.

    i32 tgc.kN(const i64* dims, T* a, T* b, T* c, i64 min_flops)

The matrix product; returns 1 when it ran on several threads (a libgomp region).
`layout` guarantees each buffer holds its matrix with both edge groups merged and
one group contiguous. The code works on the normalized
product C'[P, Q] = A'[P, R] B'[R, Q] whose Q is C's contiguous group: (P, Q, R) =
(M, N, K) when C holds N innermost, else (N, M, K) with A' = B^T, B' = A^T (C^T =
B^T A^T). A' and B' may be stored either way round (a transpose flag, or strides).

The tiles' kernels: cblas, tgc's own f32 kernel (fgemm.py), the generated small-tile
and blocked loops (gemm_small.py) and the bf16 kernel (gemm_bf16.py). Which of them
a product may run is decided in gemm_dispatch.py; its taps and shifts are gemm_taps.py's.

Tasks. The work is cut into tasks: every index of the batch edges (an operand
without a batch edge is reused along it, stride 0) times a grid of tiles of C'.
The tiles depend on the product's sizes and the options only (`tile_limit`), never
on the thread count or on whether this call runs in a region: every run makes the
same cblas calls, so the result has the same bits on 1 or N threads and from run to
run (OpenBLAS's value for an element depends on where a call's edges cut its
kernels: 2 and 3 tiles of one product differed in the last bits). A product batched
`options.cpu.gemm_batch_tasks` times or more (a convolution over 32 signals) is
one tile per batch index: tasks enough, each one cblas call at the packed kernels' speed. Another is
cut into `options.cpu.gemm_tiles` tiles (`options.cpu.gemm_tap_tiles` times as many with shifts),
each of at least `options.cpu.blas_tile_mnk` multiply-adds (P x Q x R; R cut into
chunks accumulated in place only when P and Q cannot be cut), so a small product
stays one call, as does one of fewer than `options.cpu.gemm_parallel_min_flops` flops
(it shares a region only while the workers still spin, and two calls on one thread
pack their common operand twice). When the whole product has at least `min_flops` flops (the caller
passes `options.cpu.gemm_parallel_min_flops`, or the `_warm` one; see codegen), and
`options.cpu.threads != 1`, and the runtime gave GOMP_parallel, the tasks are shared
among tgc's threads (libgomp) in contiguous runs (`tgc.kN.par`, `parallel.py`);
otherwise one thread runs them all (`tgc.kN.work(dims, a, b, c, lo, hi, tp, tq, tr)`).
One big cblas call per thread runs OpenBLAS's packed kernels at their best (tgc_run
keeps OpenBLAS on one thread, so its own pool never competes for the cores): GPT's
48 x 192 x 704 products took 86 us in 8 tiles and 66 us in 2 on 2 cores; OpenBLAS
alone on one core runs an 88-row tile with B transposed at 80 GFLOP/s, a 352-row one
at 112. The default of 2 tiles fits the 2-core reference machine; more cores need
more tiles (`gemm_tiles`), which changes the bits, as any option may.
"""
from __future__ import annotations

from collections import ChainMap
from dataclasses import replace

import llvmlite.ir as ir

from tgc.backends.cpu import blas, fntable, parallel
from tgc.backends.cpu.fgemm import Window, own_kernel
from tgc.backends.cpu.gemm_bf16 import bf16_kernel
from tgc.backends.cpu.gemm_epilogue import emit_epilogue, epilogue_buffers, load_pointers
from tgc.backends.cpu.gemm_dispatch import (EDGE_ROWS, OWN_COLS, a_k_contiguous, bf16_product, edge_vecs,
                                            operand_forms, shared_b_batch, taps_in_one_call, uses_own_gemm)
from tgc.backends.cpu.gemm_small import loops_kernel, small_kernel, vector_lanes
from tgc.backends.cpu.gemm_taps import TapCalls
from tgc.backends.cpu.irutil import I1, I32, I64, PTR, Frame, define, for_range, offset, optimize_not
from tgc.lower.lowered import GemmKernel, Lowered
from tgc.options import Options

UNTILED = 1 << 62  # the tile limit of a product batched `gemm_batch_tasks` times or more: one tile per batch index


def _control(fn: ir.Function) -> None:
    """A batched GEMM's work function only decodes tasks and calls: optimized for size
    (less for LLVM to do), and never inlined. The entry, and the work function of a
    product without batch edges (a few tasks), are not optimized at all: the MLP's
    units took 0.205 + 0.236 s to compile with all of them optimized for size, 0.132 +
    0.16 s with none, and its step measured the same."""
    for attr in ("noinline", "minsize", "optsize"):
        fn.attributes.add(attr)


class _Operand:
    """A' or B' of the normalized product: pointer role ('a' | 'b'), strides of its
    two groups (row, col) as IR values, and which is the unit-stride one."""

    def __init__(self, role, row_stride, col_stride, col_unit):
        self.role, self.row, self.col, self.col_unit = role, row_stride, col_stride, col_unit


class GemmGen(TapCalls):
    """One GEMM cell's entry, parallel region and work functions (see the module
    docstring)."""

    def __init__(self, mod: ir.Module, low: Lowered, k: GemmKernel, name: str, fp,
                 options: Options, home: ir.Module | None = None, implicit=None, tri=None):
        if implicit is not None:   # an implicit GEMM (implicit.py): its window buffer, never allocated
            # (over the program's buffers, not a copy of them: one per implicit GEMM made
            # generating 48 unrolled GPT blocks quadratic in their length)
            low = replace(low, buffers=ChainMap(implicit.private(low), low.buffers))
        self.implicit = implicit
        # a split tap sum (implicit.py): one task per part, each into its row of the partial buffer
        self.parts = implicit.parts if implicit is not None and implicit.partial else 0
        self.mod, self.low, self.k, self.fp, self.name = mod, low, k, fp, name
        self.home = home or mod   # where the small-tile helpers are defined
        self.opt = options
        # a complex product (cgemm/zgemm) addresses, and strides over, whole pairs
        self.elem = fp if k.cplx is None else ir.ArrayType(fp, 2)
        # a bf16 product (`gemm_operands` chose it): bf16 operands (their 16 bits) or f32
        # ones rounded as they are packed, f32 C
        self.bf16 = bf16_product(low, k)
        self.elems = {r: (ir.IntType(16) if low.buffers[v.buf].dtype == "bf16" else self.elem)
                      for r, v in (("a", k.a), ("b", k.b))}
        self.rounds = dict(zip("ab", k.rounded))
        kinds = {low.buffers[n].dtype for n in (k.a.buf, k.b.buf)}
        if kinds - {low.dtype} and not (self.bf16 and low.dtype == "f32" and k.cplx is None
                                        and not k.taps and not k.shifts):
            raise ValueError(f"internal: a GEMM on {'/'.join(sorted(kinds))} operands in an {low.dtype} program "
                             "(the gemm_operands stage widens them)")
        # an epilogue (gemm_epilogue.py): run on each tile, its buffers' pointers in an array (one more argument)
        self.epi = bool(k.epilogue)
        self.fn = define(mod, name, I32, [PTR] * 4 + [I64] + ([PTR] if self.epi else []))
        optimize_not(self.fn)   # plans the tiles once per call: not worth LLVM's time
        self.bufs = {r: low.buffers[n] for r, n in (("a", k.a.buf), ("b", k.b.buf), ("c", k.out))}
        self.forms = operand_forms(low, k)
        fa, fc = self.forms["a"], self.forms["c"]
        self.flip = not fc[2]                 # C holds M innermost: compute C^T = B^T A^T
        # the normalized groups (edges in memory order)
        if not self.flip:
            self.P, self.Q = fc[0], fc[1]
        else:
            self.P, self.Q = fc[1], fc[0]
        self.R = fa[1]
        # tgc's own f32 kernel (fgemm.py) for large tiles, where `options.cpu.own_gemm` allows it
        self.own = uses_own_gemm(low, k, options, window=implicit is not None)
        self.a_rows = implicit is None and not a_k_contiguous(low, k)   # A' has its rows contiguous
        # the edge block's vectors (gemm_dispatch.edge_vecs; 0: none) for a tile a little wider than one block
        self.edge = edge_vecs(low, k, options) if self.own and implicit is None else 0
        self.window = None
        if implicit is not None:
            self.window = self.window_of(implicit)
        # batch edges each task takes whole, for one call of the own kernel per tap
        self.shared = shared_b_batch(low, k, options) if implicit is None and self.own else ()
        self.task_batch = tuple(e for e in k.batch if e not in self.shared)
        # all taps in one call of the own kernel's taps form
        self.tapped = implicit is None and self.own and taps_in_one_call(low, k, options)
        self.tri = self.tri_coefs(tri)
        self.clipped = {e for _, e, _ in k.shifts}
        for e in self.clipped:
            if not any(g[:1] == (e,) for g in (self.P, self.Q, self.R)):
                raise ValueError(f"internal: shifted GEMM edge '{e}' is not the outermost of its group")

    def tri_coefs(self, tri) -> tuple[int, int, int, int] | None:
        """The causal plan (`tgc.backends.cpu.causal.Tri`) as the own kernel's `tri`
        coefficients (cp, cq, cr, c) over the normalized product's P, Q, R, where each of
        its edges is the only edge of its group and the tiles run the plain own kernel
        (not shared B, taps, an implicit window or bf16); else None (every element is
        computed: the plan only allows skipping)."""
        if tri is None or not self.own or self.shared or self.tapped or self.window is not None or self.bf16:
            return None
        coefs = [0, 0, 0]
        for e, c in tri.rel.coefs:
            for i, g in enumerate((self.P, self.Q, self.R)):
                if e in g:
                    if len(g) != 1:
                        return None
                    coefs[i] = c
        if sum(1 for c in coefs if c) != 2 or (tri.kind == "out") != (coefs[2] == 0):
            return None
        return coefs[0], coefs[1], coefs[2], tri.rel.const

    def window_of(self, implicit):
        """The implicit GEMM's window as the normalized product's operand (fgemm.Window)."""
        role = implicit.role()
        norm = ("a" if role == "a" else "b") if not self.flip else ("b" if role == "a" else "a")
        rows, cols = (self.P, self.R) if norm == "a" else (self.R, self.Q)
        order = implicit.order
        for group in (rows, cols):
            if tuple(e for e in order if e in group) != tuple(group):
                raise ValueError(f"internal: implicit window order {order} does not hold group {group} as is")
        if not self.own or cols[-1] != order[-1]:
            raise ValueError("internal: an implicit GEMM's window must be the own kernel's contiguous operand")
        load = implicit.load()
        conds = implicit.gather.body.conds if load is not implicit.gather.body else ()
        src = self.low.buffers[load.buf]
        return Window(norm, rows, cols, tuple(src.order), dict(load.index), conds)

    # ------------------------------------------------------------ shapes

    def views(self, f: Frame):
        """Per role: (strides by view edge of the buffer, view edge -> buffer edge)."""
        k = self.k
        out = {}

        def strides(order):   # a complex buffer's pairs axis is innermost: strides in pairs
            return f.strides(order if k.cplx is None else order[:-1])
        for role, view in (("a", k.a), ("b", k.b)):
            st = strides(self.bufs[role].order)
            to_buf = {e: b for e, b in view.edges if b in st}
            out[role] = ({e: st[b] for e, b in to_buf.items()}, to_buf)
        cst = strides(self.bufs["c"].order)   # by product edge (a `prefix` edge: its buffer edge's stride)
        out["c"] = ({e: cst[k.out_edge(e)] for e in k.out_edges()}, {e: k.out_edge(e) for e in k.out_edges()})
        return out

    def operands(self, f: Frame, st):
        """(A', B', C' row stride) of the normalized product."""
        (ar, ac, a_inner), (br, bc, b_inner) = self.forms["a"], self.forms["b"]
        sa, sb = st["a"][0], st["b"][0]
        one = I64(1)
        # A[m, k], B[k, n]: strides of each group = stride of its innermost edge
        a_m, a_k = (sa[ar[-1]], one) if a_inner else (one, sa[ac[-1]])
        b_k, b_n = (sb[br[-1]], one) if b_inner else (one, sb[bc[-1]])
        if not self.flip:
            A = _Operand("a", a_m, a_k, a_inner)              # A'[P=m, R=k]
            B = _Operand("b", b_k, b_n, b_inner)              # B'[R=k, Q=n]
            c_p = st["c"][0][self.P[-1]]
        else:
            A = _Operand("b", b_n, b_k, not b_inner)          # A'[P=n, R=k] = B^T
            B = _Operand("a", a_k, a_m, not a_inner)          # B'[R=k, Q=m] = A^T
            c_p = st["c"][0][self.P[-1]]
        return A, B, c_p

    def tiles(self, f: Frame, b: ir.IRBuilder, P, Q, R, limit):
        """Tile sizes (tp, tq, tr): halve the larger of tp and tq (not below
        `cpu.gemm_min_tile`), or when neither can be halved tr (not below
        `cpu.gemm_min_chunk`), until
        tp * tq * tr <= limit. Rows and columns first, since only they make tasks
        (R chunks add up inside one task): a 48 x 48 weight gradient summed over 704
        rows, cut along R alone, would be one task, leaving its region's second thread
        idle."""
        pre = b.block
        head = f.fn.append_basic_block("tile.head")
        step = f.fn.append_basic_block("tile.step")
        done = f.fn.append_basic_block("tile.done")
        b.branch(head)
        b.position_at_end(head)
        tp, tq, tr = (b.phi(I64, name=n) for n in ("tp", "tq", "tr"))
        for phi, init in ((tp, P), (tq, Q), (tr, R)):
            phi.add_incoming(init, pre)
        over = b.icmp_signed(">", b.mul(b.mul(tp, tq), tr), limit)
        zero, cpu = I64(0), self.opt.cpu
        hp = b.select(b.icmp_signed(">=", tp, I64(2 * cpu.gemm_min_tile)), tp, zero)
        hq = b.select(b.icmp_signed(">=", tq, I64(2 * cpu.gemm_min_tile)), tq, zero)
        if self.epi:   # each tile's epilogue covers its rows, all of Q
            hq = zero
        hr = b.select(b.icmp_signed(">=", tr, I64(2 * cpu.gemm_min_chunk)), tr, zero)
        pick_p = b.and_(b.icmp_signed(">=", hp, hq), b.icmp_signed(">", hp, zero))
        pick_q = b.and_(b.not_(pick_p), b.icmp_signed(">", hq, zero))
        best = b.select(pick_p, hp, b.select(pick_q, hq, hr))
        b.cbranch(b.and_(over, b.icmp_signed(">", best, zero)), step, done)
        b.position_at_end(step)

        def half(x):
            return b.ashr(b.add(x, I64(1)), I64(1))
        pick_r = b.not_(b.or_(pick_p, pick_q))
        for phi, pick in ((tp, pick_p), (tq, pick_q), (tr, pick_r)):
            phi.add_incoming(b.select(pick, half(phi), phi), step)
        b.branch(head)
        b.position_at_end(done)
        return tp, tq, tr

    @staticmethod
    def ceil_div(b, x, y):
        return b.sdiv(b.add(x, b.sub(y, I64(1))), y)

    def plan(self, f: Frame, b: ir.IRBuilder, limit):
        """Sizes, tiles (at most `limit` m*n*k) and the task count, emitted at `b`."""
        P, Q, R = (f.count(g) for g in (self.P, self.Q, self.R))
        one = I64(1)
        tp, tq, tr = self.tiles(f, b, P, Q, R, limit)
        tp, tq, tr = (b.select(b.icmp_signed("<", t, one), one, t) for t in (tp, tq, tr))
        return self.tasks(f, b, tp, tq, tr)

    def tasks(self, f: Frame, b: ir.IRBuilder, tp, tq, tr):
        """The plan for tiles of tp x tq x tr: sizes, tiles per row and column, tasks."""
        P, Q, R = (f.count(g) for g in (self.P, self.Q, self.R))
        n_p, n_q = self.ceil_div(b, P, tp), self.ceil_div(b, Q, tq)
        tasks = b.mul(b.mul(f.count(self.task_batch), n_p), n_q)
        if self.parts:
            tasks = b.mul(tasks, I64(self.parts))
        return dict(P=P, Q=Q, R=R, tp=tp, tq=tq, tr=tr, n_p=n_p, n_q=n_q, tasks=tasks)

    # ------------------------------------------------------------ entry

    def emit(self) -> ir.Function:
        """The entry: plans the tiles once (one tile per batch index when it runs on
        one thread), then runs every task here or shares them out in a region. A
        negative `min_flops` says the caller is every thread of a region already
        (`regions.py`: kernels merged into one region): then each runs its share of
        the tasks (`parallel.thread_range`; a product of one task runs on thread 0);
        -2 - i, that the caller runs the product paired with a loop (`regions.pairs`):
        only the tasks of batch index i, here (a product batched over one edge)."""
        work = self.emit_work()
        par = self.emit_par(work) if self.opt.cpu.threads != 1 else None
        f = Frame(self.fn, self.low.module, self.fn.args[0])
        b = f.b
        args, min_flops = list(self.fn.args[:4]), self.fn.args[4]
        extra = [self.fn.args[5]] if self.epi else []   # the epilogue's pointers
        limit = self.tile_limit(f, b)
        pl = self.plan(f, b, limit)
        big = None
        if self.k.batch and self.task_batch == self.k.batch:
            # pair mode (`regions.pairs`): -2 - i runs the tasks of batch index i only
            with b.if_then(b.icmp_signed("<=", min_flops, I64(-2))):
                per = b.sdiv(pl["tasks"], f.count(self.task_batch))
                lo = b.mul(b.sub(I64(-2), min_flops), per)
                b.call(work, args + [lo, b.add(lo, per), pl["tp"], pl["tq"], pl["tr"]] + extra)
                b.ret(I32(0))
        if par is not None:
            with b.if_then(b.icmp_signed("<", min_flops, I64(0))):
                lo, hi = parallel.thread_range(b, pl["tasks"])
                with b.if_then(b.icmp_signed("<", lo, hi)):
                    b.call(work, args + [lo, hi, pl["tp"], pl["tq"], pl["tr"]] + extra)
                b.ret(I32(1))
            P, Q, R = (f.count(g) for g in (self.P, self.Q, self.R))
            flops = b.mul(b.mul(b.mul(P, Q), R), I64(2))
            flops = b.mul(b.mul(flops, f.count(self.k.batch)), f.count(self.k.taps))
            big = b.icmp_signed(">=", flops, min_flops)
            big = b.and_(big, fntable.is_set(b, "gomp_parallel"))
        tiles = [pl["tp"], pl["tq"], pl["tr"]]
        if big is not None:
            with b.if_then(b.and_(big, b.icmp_signed(">=", pl["tasks"], I64(2)))):
                data = f.alloca(ir.ArrayType(I64, 8 + len(extra)), "data")
                for i, v in enumerate(args + [pl["tasks"]] + tiles + extra):
                    v = b.ptrtoint(v, I64) if isinstance(v.type, ir.PointerType) else v
                    b.store(v, b.gep(data, [I32(0), I32(i)]))
                b.call(parallel.region_fn(self.mod, self.home, self.opt.cpu), [par, data])
                b.ret(I32(1))
        if self.merges_rows():   # on this thread alone: tiles cut along P only are one call
            with b.if_else(self.rows_merge(f, b, pl)) as (whole, cut):
                with whole:
                    mp = self.tasks(f, b, pl["P"], pl["tq"], pl["tr"])
                    b.call(work, args + [I64(0), mp["tasks"], pl["P"], pl["tq"], pl["tr"]] + extra)
                with cut:
                    b.call(work, args + [I64(0), pl["tasks"]] + tiles + extra)
        else:
            b.call(work, args + [I64(0), pl["tasks"]] + tiles + extra)
        b.ret(I32(0))
        f.finish()
        return self.fn

    def merges_rows(self) -> bool:
        """Whether a product run whole on one thread may take its tiles' rows (P) in one
        call of the own kernel (`CpuOptions.gemm_merge_rows`): a plain product of the own
        kernel (no taps, shifts, shared B', window, split parts, epilogue; f32), whose
        tiles cut along P change no bits there (`rows_merge` checks the rest at run
        time)."""
        k = self.k
        return (self.opt.cpu.gemm_merge_rows and self.own and not self.bf16 and k.cplx is None and not k.taps
                and not k.shifts and not self.shared and not self.tapped and self.window is None and not self.parts
                and not self.epi)

    def rows_merge(self, f: Frame, b: ir.IRBuilder, pl: dict):
        """i1: the plan cuts P (more than one row tile) but not R, its tiles are not the
        small-tile loops', and every tile, cut or merged, runs the own kernel (`own_tile`
        at the cut tiles' rows and at P, for the first and last column tiles). Then one
        call per column tile over all of P gives every element of C the same FMAs in the
        same order as the cut tiles (the kernel's K blocks depend on K alone, its row
        blocks and row panels on nothing an element's sum sees), with B' packed once
        rather than once per row tile (attention's P v and dS k in a stream step: 2 x 64
        rows each packing the keys' v or k)."""
        A, B, _ = self.operands(f, self.views(f))
        keep, self.b = getattr(self, "b", None), b
        try:
            ok = b.and_(b.icmp_signed(">", pl["n_p"], I64(1)), b.icmp_signed(">=", pl["tr"], pl["R"]))
            ok = b.and_(ok, b.not_(self.small_ok(b, pl, B)))
            last_p = b.sub(pl["P"], b.mul(b.sub(pl["n_p"], I64(1)), pl["tp"]))
            last_q = b.sub(pl["Q"], b.mul(b.sub(pl["n_q"], I64(1)), pl["tq"]))
            for m in (pl["tp"], last_p, pl["P"]):
                for n in (pl["tq"], last_q):
                    ok = b.and_(ok, self.own_tile(m, pl["R"], n))
        finally:
            self.b = keep
        return ok

    def tile_limit(self, f: Frame, b: ir.IRBuilder):
        """i64: the most multiply-adds of one tile. A function of the product's sizes
        and the options only, never of the thread count or of whether this call runs
        in a region: every run makes the same cblas calls (and small-tile loops), so
        the result has the same bits on any number of threads (OpenBLAS's result for
        an element depends on where the call's edges cut its kernels). A product
        batched `gemm_batch_tasks` times or more is one tile per batch index (tasks enough);
        another is cut into `options.cpu.gemm_tiles` tiles (`gemm_tap_tiles` times
        that with shifts, unless the own kernel runs it), each of at least `blas_tile_mnk`, so a small one stays whole.
        A product of fewer than `gemm_parallel_min_flops` flops (the threshold of a cold
        region) stays whole too: it runs in a region only while the workers still spin
        from another, and cut into tiles on one thread it repacks its uncut operand once
        per cblas call (the wine MLP's 178 x 64 x 64 products with B transposed: 9.9 us
        whole, 12.7 us in two calls; the whole step 5% slower). A split tap sum
        (implicit.py, "Split sums") is one tile per part: its parts are its tasks."""
        if self.parts:
            return I64(UNTILED)
        many = b.icmp_signed(">=", f.count(self.k.batch), I64(self.opt.cpu.gemm_batch_tasks))
        P, Q, R = (f.count(g) for g in (self.P, self.Q, self.R))
        mnk = b.mul(b.mul(P, Q), R)
        parts = max(1, self.opt.cpu.gemm_tiles) * (self.opt.cpu.gemm_tap_tiles if self.k.shifts and not self.own else 1)
        share = b.sdiv(mnk, I64(parts))
        small = I64(max(1, self.opt.cpu.blas_tile_mnk))
        tile = b.select(b.icmp_signed(">", share, small), share, small)
        flops = b.mul(b.mul(b.mul(mnk, I64(2)), f.count(self.k.batch)), f.count(self.k.taps))
        cold = b.icmp_signed("<", flops, I64(max(1, self.opt.cpu.gemm_parallel_min_flops)))
        return b.select(b.or_(many, cold), I64(UNTILED), tile)

    def emit_par(self, work: ir.Function) -> ir.Function:
        fn = define(self.mod, self.name + ".par", ir.VoidType(), [PTR])
        optimize_not(fn)   # a few loads and one call per thread
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        n = 9 if self.epi else 8
        vals = [b.load(b.gep(fn.args[0], [I64(i)], source_etype=I64), typ=I64) for i in range(n)]
        ptrs = [b.inttoptr(v, PTR) for v in vals[:4]]
        extra = [b.inttoptr(vals[8], PTR)] if self.epi else []
        lo, hi = parallel.thread_range(b, vals[4])
        with b.if_then(b.icmp_signed("<", lo, hi)):
            b.call(work, ptrs + [lo, hi] + vals[5:8] + extra)
        b.ret_void()
        return fn

    def emit_work(self) -> ir.Function:
        """`tgc.kN.work(dims, a, b, c, lo, hi, tp, tq, tr)`: tasks [lo, hi) of the
        plan with tiles of tp x tq x tr."""
        k = self.k
        fn = define(self.mod, self.name + ".work", ir.VoidType(), [PTR] * 4 + [I64] * 5 + ([PTR] if self.epi else []))
        if k.batch:   # maybe a task per batch index: GPT's 192 tiles of 11 x 16 x 11
            _control(fn)   # took 13-15 us optimized, 19-20 not
        else:         # a few tiles, so a few tasks: not worth LLVM's time
            optimize_not(fn)
        f = Frame(fn, self.low.module, fn.args[0])
        b = f.b
        self.f, self.b = f, b
        ptrs = {"a": fn.args[1], "b": fn.args[2], "c": fn.args[3]}
        lo, hi = fn.args[4], fn.args[5]
        st = self.views(f)
        A, B, c_p = self.operands(f, st)
        pl = self.tasks(f, b, *fn.args[6:9])
        small = self.small_ok(b, pl, B) if k.cplx is None and not self.bf16 and self.window is None else None
        with for_range(b, lo, hi, "task") as t:
            # decode: t = ((batch...) * n_p + ip) * n_q + iq
            iq = b.srem(t, pl["n_q"])
            rest = b.sdiv(t, pl["n_q"])
            ip = b.srem(rest, pl["n_p"])
            rest = b.sdiv(rest, pl["n_p"])
            vars = {}
            for e in reversed(self.task_batch):
                n = f.edge_size(e)
                vars[e] = b.srem(rest, n)
                rest = b.sdiv(rest, n)
            ptrs["c"] = fn.args[3]
            self.tap_range = {}
            if self.parts:   # a split tap sum: the rest is the part, its row of the partial buffer and its taps
                tap = k.taps[0]
                rows = f.count(self.P + self.Q)
                ptrs["c"] = self.ptr(fn.args[3], [(rest, rows)])
                n = f.edge_size(tap)
                chunk = self.ceil_div(b, n, I64(self.parts))
                t0 = self.smin(b.mul(rest, chunk), n)
                self.tap_range = {tap: (t0, self.smin(b.add(t0, chunk), n))}
            p0 = b.mul(ip, pl["tp"])
            q0 = b.mul(iq, pl["tq"])
            p1 = self.smin(b.add(p0, pl["tp"]), pl["P"])
            q1 = self.smin(b.add(q0, pl["tq"]), pl["Q"])
            tile = (p0, p1, q0, q1)

            def each_tap():
                if k.zeroes():
                    def zero(v):
                        cbase = self.ptr(ptrs["c"], [(v[e], st["c"][0][e]) for e in k.batch])
                        self.zero_tile(b, cbase, c_p, p0, p1, q0, q1)
                    self.nest(list(self.shared), vars, zero)
                leaf = self.leaf_shared if self.shared else self.leaf
                self.nest(list(k.taps), vars, lambda v: leaf(v, tile, pl, st, ptrs, A, B, c_p, small))
            if self.tapped:   # the tile runs the own kernel: all taps in one call
                own = self.own_tile(b.sub(p1, p0), pl["R"], b.sub(q1, q0))
                with b.if_else(b.and_(b.not_(small), own)) as (one, many):
                    with one:
                        self.call_taps(vars, tile, pl, st, ptrs, A, B, c_p)
                    with many:
                        each_tap()
            else:
                each_tap()
            if self.epi:   # the tile's rows, all of Q (its tiles never cut Q), while they are in cache
                self.tile_epilogue(fn, p0, p1)
        b.ret_void()
        f.finish()
        return fn

    def tile_epilogue(self, fn: ir.Function, p0, p1) -> None:
        """Call the epilogue (gemm_epilogue.py) on rows [p0, p1) of C'."""
        b = self.b
        names = epilogue_buffers(self.low, self.k)
        epi = emit_epilogue(self.mod, self.low, self.k, self.name + ".epi", self.fp, self.opt)
        with b.if_then(b.icmp_signed("<", p0, p1)):
            b.call(epi, [fn.args[0]] + load_pointers(b, fn.args[-1], len(names)) + [p0, p1])

    def small_ok(self, b, pl, B):
        """i1: the tiles go to the generated loops (not BLAS)."""
        mnk = b.mul(b.mul(pl["tp"], pl["tq"]), pl["tr"])
        ok = b.icmp_signed("<=", b.mul(mnk, I64(2)), I64(self.opt.cpu.gemm_loop_max_flops))
        if not B.col_unit:
            vl = I64(vector_lanes(self.fp))   # the packed rows are padded to whole vectors
            padded = b.mul(self.ceil_div(b, pl["tq"], vl), vl)
            ok = b.and_(ok, b.icmp_signed("<=", b.mul(padded, pl["tr"]), I64(self.opt.cpu.gemm_pack_elems)))
        return ok

    # ------------------------------------------------------------ one task, one tap

    def leaf(self, vars, tile, pl, st, ptrs, A, B, c_p, small):
        b, k = self.b, self.k
        lo, hi, ok = self.clip(vars)
        (ps, pe), (qs, qe), (rs, re) = self.ranges(tile, pl, lo, hi)
        nonempty = b.and_(b.icmp_signed("<", ps, pe), b.icmp_signed("<", qs, qe))
        if ok is not None:
            nonempty = b.and_(nonempty, ok)
        shift_off = self.shift_offsets(vars, st)
        win = self.window
        if win is not None:   # the window's pointer is its source's, moved to the batch and tap indices
            role = self.implicit.role()
            src = self.f.strides(win.source_order)
            parts = []
            for e in k.batch + k.taps:
                if e in st[role][0]:
                    for edge, ix in win.index.items():
                        c = ix.coef(e)
                        if c != 0:
                            parts.append((b.mul(vars[e], self.f.size(c)), src[edge]))
            shift_off[role] = parts
        c_parts = [(vars[e], st["c"][0][e]) for e in k.batch]
        with b.if_then(nonempty):
            wa, wb = (win is not None and win.role == "a"), (win is not None and win.role == "b")
            pa = self.ptr(ptrs[A.role], shift_off[A.role] + ([] if wa else [(ps, A.row)]), self.elems[A.role])
            pb = self.ptr(ptrs[B.role], shift_off[B.role] + ([] if wb else [(qs, B.col)]), self.elems[B.role])
            pc = self.ptr(ptrs["c"], c_parts + [(ps, c_p), (qs, I64(1))])
            m, n = b.sub(pe, ps), b.sub(qe, qs)
            kk = self.smax(b, b.sub(re, rs), I64(0))
            chunks = self.ceil_div(b, kk, pl["tr"])
            chunks = b.select(b.icmp_signed("<", chunks, I64(1)), I64(1), chunks)
            with for_range(b, I64(0), chunks, "chunk") as j:
                r = b.add(rs, b.mul(j, pl["tr"]))
                kc = self.smin(pl["tr"], b.sub(re, r))
                kc = self.smax(b, kc, I64(0))
                beta1 = b.icmp_signed(">", j, I64(0))
                if k.accumulates():
                    beta1 = ir.Constant(I1, 1)
                xa = pa if wa else self.ptr(pa, [(r, A.col)], self.elems[A.role])
                xb = pb if wb else self.ptr(pb, [(r, B.row)], self.elems[B.role])
                if win is not None:   # the window packed from its source: row0, col0 of its matrix
                    row0, col0 = (ps, r) if wa else (r, qs)
                    self.b.call(self.window_kernel(),
                                [m, n, kc, xa, A.row, A.col, xb, B.row, B.col, pc, c_p, b.zext(beta1, I32),
                                 self.f.fn.args[0], row0, col0])
                elif self.bf16:   # vdpbf16ps (no BLAS has a bf16 GEMM here)
                    rounds = (self.rounds[A.role], self.rounds[B.role])
                    self.b.call(bf16_kernel(self.mod, self.opt.cpu, home=self.home, rounds=rounds),
                                [m, n, kc, xa, A.row, A.col, xb, B.row, B.col, pc, c_p, b.zext(beta1, I32)])
                elif small is None:   # a complex product: always cgemm/zgemm (blas "numpy" or "system")
                    self.call_blas(m, n, kc, xa, A, xb, B, pc, c_p, beta1)
                else:
                    with b.if_else(small) as (then, otherwise):
                        with then:
                            self.call_small(m, n, kc, xa, A, xb, B, pc, c_p, beta1)
                        with otherwise:
                            self.tri_at = (ps, qs, r)   # the tile's first row, column and term
                            self.call_large(m, n, kc, xa, A, xb, B, pc, c_p, beta1)

    def ptr(self, base, parts, etype=None):
        return self.b.gep(base, [offset(self.b, parts)], inbounds=True, source_etype=etype or self.elem)

    def smin(self, x, y):
        return self.b.select(self.b.icmp_signed("<", x, y), x, y)

    @staticmethod
    def smax(b, x, y):
        return b.select(b.icmp_signed(">", x, y), x, y)

    def zero_tile(self, b, base, ld, p0, p1, q0, q1):
        """Zero rows p0..p1, columns q0..q1: a memset per row (LLVM vectorizes and
        unrolls a loop of stores: ~10 ms more to compile per GEMM)."""
        memset = self.mod.globals.get("llvm.memset.p0.i64") or ir.Function(
            self.mod, ir.FunctionType(ir.VoidType(), [PTR, ir.IntType(8), I64, I1]), "llvm.memset.p0.i64")
        width = I64(4 if isinstance(self.fp, ir.FloatType) else 8)
        with for_range(b, p0, p1, "zp") as p:
            row = b.gep(base, [b.add(b.mul(p, ld), q0)], source_etype=self.fp)
            b.call(memset, [row, ir.IntType(8)(0), b.mul(b.sub(q1, q0), width), ir.Constant(I1, 0)])

    # ------------------------------------------------------------ the two paths

    def call_blas(self, m, n, kk, pa, A, pb, B, pc, ldc, beta1):
        """C'[m, n] (+)= A'[m, kk] B'[kk, n], row-major cblas."""
        b = self.b
        ta = blas.NO_TRANS if A.col_unit else blas.TRANS
        lda = A.row if A.col_unit else A.col
        tb = blas.NO_TRANS if B.col_unit else blas.TRANS
        ldb = B.row if B.col_unit else B.col
        if self.k.cplx is not None:
            self.call_complex(m, n, kk, pa, A, ta, lda, pb, B, tb, ldb, pc, ldc, beta1)
            return
        one = ir.Constant(self.fp, 1.0)
        name = "sgemm" if isinstance(self.fp, ir.FloatType) else "dgemm"
        ld = [self.at_least_one(v) for v in (lda, ldb, ldc)]
        cpu = self.opt.cpu
        if cpu.blas_chain_mnk <= 0:
            beta = b.select(beta1, one, ir.Constant(self.fp, 0.0))
            fntable.call(b, name, [I32(blas.ORDER_ROW_MAJOR), I32(ta), I32(tb), m, n, kk, one,
                                   pa, ld[0], pb, ld[1], beta, pc, ld[2]])
            return
        # a call of at most `blas_chain_mnk` multiply-adds goes in K chunks of `sum_chunk`,
        # each summed from zero by its own call (see the option)
        depth = I64(max(1, cpu.sum_chunk))
        chained = b.and_(b.icmp_signed("<=", b.mul(b.mul(m, n), kk), I64(cpu.blas_chain_mnk)),
                         b.icmp_signed(">", kk, depth))
        chunk = self.at_least_one(b.select(chained, depth, kk))
        chunks = self.at_least_one(self.ceil_div(b, kk, chunk))   # K = 0 still writes C (zeros)
        with for_range(b, I64(0), chunks, "kchunk") as j:
            r = b.mul(j, chunk)
            kc = self.smax(b, self.smin(chunk, b.sub(kk, r)), I64(0))
            beta = b.select(b.or_(beta1, b.icmp_signed(">", j, I64(0))), one, ir.Constant(self.fp, 0.0))
            xa = self.ptr(pa, [(r, A.col)], self.elems[A.role])
            xb = self.ptr(pb, [(r, B.row)], self.elems[B.role])
            fntable.call(b, name, [I32(blas.ORDER_ROW_MAJOR), I32(ta), I32(tb), m, n, kc, one,
                                   xa, ld[0], xb, ld[1], beta, pc, ld[2]])

    def call_complex(self, m, n, kk, pa, A, ta, lda, pb, B, tb, ldb, pc, ldc, beta1):
        """C'[m, n] (+)= alpha op(A')[m, kk] op(B')[kk, n] in pairs, row-major cblas
        cgemm/zgemm; a conjugated operand is read with OpenBLAS's CblasConjNoTrans or
        CblasConjTrans (the conjugation costs nothing). alpha and beta are passed by
        address: constants of the module."""
        b = self.b
        conj = {"a": self.k.cplx[0], "b": self.k.cplx[1]}
        ta = (blas.CONJ_NO_TRANS if ta == blas.NO_TRANS else blas.CONJ_TRANS) if conj[A.role] else ta
        tb = (blas.CONJ_NO_TRANS if tb == blas.NO_TRANS else blas.CONJ_TRANS) if conj[B.role] else tb
        alpha = self.pair_constant(self.k.alpha)
        beta = b.select(beta1, self.pair_constant(1.0), self.pair_constant(0.0))
        name = "cgemm" if isinstance(self.fp, ir.FloatType) else "zgemm"
        ld = [self.at_least_one(v) for v in (lda, ldb, ldc)]
        fntable.call(b, name, [I32(blas.ORDER_ROW_MAJOR), I32(ta), I32(tb), m, n, kk, alpha,
                               pa, ld[0], pb, ld[1], beta, pc, ld[2]])

    def pair_constant(self, value: float):
        """The address of a module constant holding the complex number `value` + 0i."""
        name = f"tgc.complex.{'f32' if isinstance(self.fp, ir.FloatType) else 'f64'}.{value!r}"
        g = self.mod.globals.get(name)
        if g is None:
            g = ir.GlobalVariable(self.mod, self.elem, name)
            g.linkage, g.global_constant = "internal", True
            g.initializer = ir.Constant(self.elem, [value, 0.0])
        return g

    def call_large(self, m, n, kk, pa, A, pb, B, pc, ldc, beta1):
        """A tile too large for the small-tile loops: cblas, or with `options.cpu.blas`
        "system" or "none" (a built library, whose caller may give no BLAS), cblas
        when the function table has it and the blocked loops (`loops_kernel`) when not."""
        if self.own:   # deep or wide tiles whose B' fits in L2 run the own kernel (see `uses_own_gemm`)
            b = self.b
            with b.if_else(self.own_tile(m, kk, n)) as (then, otherwise):
                with then:
                    self.call_own(m, n, kk, pa, A, pb, B, pc, ldc, beta1)
                with otherwise:
                    self.call_library(m, n, kk, pa, A, pb, B, pc, ldc, beta1)
            return
        self.call_library(m, n, kk, pa, A, pb, B, pc, ldc, beta1)

    def own_tile(self, m, kk, n):
        """i1: a tile of m rows and n columns summing kk terms runs the own kernel: deep
        or wide with a B' that fits in L2, or tall, or (A''s K contiguous) deep with one
        block of columns, whatever its B', or (A' transposed, `own_gemm_tall_transposed`)
        tall with exactly one block of columns, whatever its depth (see `uses_own_gemm`)."""
        b, o = self.b, self.opt.cpu
        deep = b.and_(b.icmp_signed(">=", kk, I64(o.own_gemm_min_depth)), b.icmp_signed(">=", n, I64(OWN_COLS)))
        wide = b.or_(b.icmp_signed(">=", n, I64(o.own_gemm_min_cols)), deep)
        fits = b.and_(wide, b.icmp_signed("<=", b.mul(b.mul(kk, n), I64(4)), I64(o.own_gemm_max_b_bytes)))
        tall = b.and_(b.icmp_signed(">=", m, I64(o.own_gemm_min_rows)), b.icmp_signed(">=", n, I64(2 * OWN_COLS)))
        tall = b.and_(tall, b.icmp_signed("<=", b.mul(b.mul(kk, n), I64(4)), I64(o.own_gemm_tall_max_b_bytes)))
        own = b.or_(fits, tall)
        if not self.a_rows:   # one block of columns, deep: B' is packed once per row panel, whatever its size
            own = b.or_(own, b.and_(deep, b.icmp_signed("<=", n, I64(OWN_COLS))))
        elif o.own_gemm_tall_transposed:   # A' transposed, tall, one block of columns: whatever its depth
            own = b.or_(own, b.and_(b.icmp_signed(">=", m, I64(o.own_gemm_min_rows)),
                                    b.icmp_signed("==", n, I64(OWN_COLS))))
        if self.a_rows:   # a transposed A' (packed where the columns fill more than one block): whole blocks
            # or at least two (a last block of one column would pack A' for it: 384 x 65 x 1024
            # 90 GFLOP/s, OpenBLAS 127), or the edge block's columns (one block, A' read in place)
            whole = b.icmp_signed("==", b.srem(n, I64(OWN_COLS)), I64(0))
            whole = b.or_(whole, b.icmp_signed(">=", n, I64(2 * OWN_COLS)))
            if self.edge:
                whole = b.or_(whole, self.edge_tile(n))
            own = b.and_(own, whole)
        return own

    def edge_tile(self, n):
        """i1: a tile of n columns runs the edge block (`gemm_dispatch.edge_vecs`)."""
        b, vl = self.b, 16
        return b.and_(b.icmp_signed(">", n, I64(vl * self.opt.cpu.own_gemm_vecs)),
                      b.icmp_signed("<=", n, I64(vl * self.edge)))

    def call_library(self, m, n, kk, pa, A, pb, B, pc, ldc, beta1):
        """cblas, or the blocked loops where a built library's caller gave no BLAS."""
        if self.opt.cpu.blas == "numpy":
            self.call_blas(m, n, kk, pa, A, pb, B, pc, ldc, beta1)
            return
        b = self.b
        name = "sgemm" if isinstance(self.fp, ir.FloatType) else "dgemm"
        with b.if_else(fntable.is_set(b, name)) as (have, missing):
            with have:
                self.call_blas(m, n, kk, pa, A, pb, B, pc, ldc, beta1)
            with missing:
                self.call_small(m, n, kk, pa, A, pb, B, pc, ldc, beta1, blocked=True)

    def call_own(self, m, n, kk, pa, A, pb, B, pc, ldc, beta1):
        """C'[m, n] (+)= A'[m, kk] B'[kk, n] by tgc's own f32 kernel (A''s K contiguous):
        the one product (0, 0, 0, kk) of its products sharing B."""
        b = self.b
        one = [self.f.alloca(ir.ArrayType(I64, 1), name) for name in ("a_off", "c_off", "k_lo", "k_hi")]
        for arr, v in zip(one, (I64(0), I64(0), I64(0), kk)):
            b.store(v, b.gep(arr, [I32(0), I32(0)]))
        tri = self.tri if getattr(self, "tri_at", None) is not None else None
        fn = own_kernel(self.mod, self.opt.cpu, home=self.home, tri=tri is not None)
        edge = None
        if self.edge and tri is None:   # a tile a little wider than one block: the edge block, one pass
            edge = own_kernel(self.mod, self.opt.cpu, EDGE_ROWS, self.edge, home=self.home)
        extra = []
        if tri is not None:   # the mask's constant at the tile's first row, column and term
            cp, cq, cr, c = tri
            ps, qs, r = self.tri_at
            const = b.add(b.add(b.add(I64(c), b.mul(I64(cp), ps)), b.mul(I64(cq), qs)), b.mul(I64(cr), r))
            extra = [I64(cp), I64(cq), I64(cr), const]
        args = ([m, n, kk, pa, A.row, A.col, pb, B.row, B.col, pc, ldc, b.zext(beta1, I32), I64(1)]
                + [b.gep(arr, [I32(0), I32(0)]) for arr in one])
        if edge is None:
            b.call(fn, args + extra)
            return
        with b.if_else(self.edge_tile(n)) as (wide, plain):
            with wide:
                b.call(edge, args)
            with plain:
                b.call(fn, args)

    def window_kernel(self) -> ir.Function:
        """This implicit GEMM's own copy of the own kernel, packing its window."""
        name = self.name + ".own"
        if name not in self.mod.globals:
            module, edges = self.low.module, self.low.edges
            own_kernel(self.mod, self.opt.cpu, window=self.window, name=name,
                       frame=lambda fn, dims: Frame(fn, module, dims, edges))
        return self.mod.globals[name]

    def call_small(self, m, n, kk, pa, A, pb, B, pc, ldc, beta1, blocked=False):
        kernel = loops_kernel if blocked else small_kernel
        fn = kernel(self.mod, self.fp, not B.col_unit, self.opt.cpu, home=self.home)
        self.b.call(fn, [m, n, kk, pa, A.row, A.col, pb, B.row, B.col, pc, ldc,
                         self.b.zext(beta1, I32)])

    def at_least_one(self, v):
        return self.b.select(self.b.icmp_signed("<", v, I64(1)), I64(1), v)
