"""GEMM cells as LLVM functions: tiles of cblas ?gemm calls or generated loops,
spread over the cores through libgomp.

    i32 tgc.kN(const i64* dims, T* a, T* b, T* c, i64 min_flops)

The matrix product; returns 1 when it ran on several threads (a libgomp region).
`layout` guarantees each buffer holds its matrix with both edge groups merged and
one group contiguous. The code works on the normalized
product C'[P, Q] = A'[P, R] B'[R, Q] whose Q is C's contiguous group: (P, Q, R) =
(M, N, K) when C holds N innermost, else (N, M, K) with A' = B^T, B' = A^T (C^T =
B^T A^T). A' and B' may be stored either way round (a transpose flag, or strides).

Tasks. The work is cut into tasks: every index of the batch edges (an operand
without a batch edge is reused along it, stride 0) times a grid of tiles of C'.
The tiles depend on the product's sizes and the options only (`tile_limit`), never
on the thread count or on whether this call runs in a region: every run makes the
same cblas calls, so the result has the same bits on 1 or N threads and from run to
run (OpenBLAS's value for an element depends on where a call's edges cut its
kernels: 2 and 3 tiles of one product differed in the last bits). A product batched
BATCH_TASKS times or more (a convolution over 32 signals) is one tile per batch
index: tasks enough, each one cblas call at the packed kernels' speed. Another is
cut into `options.cpu.gemm_tiles` tiles (TAP_TILES_PER_THREAD times as many with shifts),
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

Small tiles. A tile of at most `options.cpu.gemm_loop_max_flops` flops is computed by a
generated loop nest instead of a cblas call (`tgc.gemm.small.*`, shared by every
kernel of the module): rows of C' in blocks of 4 (a last partial block reads its
last row again and stores only its rows), columns in vectors of the host's widest
SIMD (masked at the edge), the K loop accumulating 4 x 2 vectors in
registers with fused multiply-adds. Q must be contiguous in B' too; when it is not,
B' is first gathered (packed) into a stack buffer of `PACK_ELEMS` elements, its rows
padded to whole vectors (larger tiles go to BLAS). Which path a tile takes is decided
at run time from the tile sizes (constants when the dims are fixed at build time, then
LLVM drops the other).

Without BLAS. With `options.cpu.blas` "system" or "none" (`tgc build`'s libraries, whose
caller may put no BLAS in the function table; the JIT's table has none with "none"),
a larger tile calls cblas only when the table has it, and otherwise the blocked loops
(`tgc.gemm.loops.*`): the small-tile kernel over blocks of columns and chunks of K
that fit its pack buffer. With "numpy" (the JIT's default) the code is as above.

bf16 products. A product of two bf16 buffers (the `gemm_operands` stage keeps them
bf16 only where the CPU has AVX-512 BF16, or `options.cpu.bf16_gemm` is "on") makes
the same tasks and tiles, each tile one call of `bf16_kernel` (`vdpbf16ps`, f32
sums) instead of cblas: numpy's OpenBLAS exports no bf16 GEMM (`sbgemm`).

Shared B'. An accumulating product that the own kernel runs, batched fewer than
BATCH_TASKS times along edges its B' does not read (`shared_b_batch`: a 1-D
convolution's kernel gradient, batched by the tap, which shifts only A' along K),
makes tasks of the other batch edges and tiles only; each of its calls runs the
products of every index of those edges on one packed B'.

All taps in one call. A product whose taps have fixed sizes and whose shifts move
only B''s columns or K (`taps_in_one_call`: a convolution's output, or its input
gradient after the flip) makes, for a tile the own kernel runs, one call of its
`.taps` form for all taps: C is written once, never zeroed first.

Taps and shifts (GEMMs on shifted views). The task also loops over the taps; each
tap offsets the shifted operand and clips the shifted edge's range to where every
index is in bounds (the rest of the sum is zeros); the tile's range is cut to that.
A clipped edge is the outermost edge of its group (`layout` sees to it), so its
range [lo, hi) is the run [lo * inner, hi * inner) of the merged group, `inner`
being the other edges' extent: a 2-D image shifted along its rows is one call per
tap over whole rows. Such a product accumulates: every task first zeroes its tile
of `out`, then every call adds into it (beta = 1). Taps without shifts (a K edge
that an operand's order splits, looped outside the calls) accumulate the same way.
"""
from __future__ import annotations

import itertools

import llvmlite.ir as ir

from tgc.backends.cpu import blas, fntable, parallel
from tgc.backends.cpu.fgemm import MAX_TAPS, Window, own_kernel, start_accumulators

OWN_COLS = 64     # the own kernel's block of columns (4 vectors of 16)
from tgc.backends.cpu.irutil import (I1, I32, I64, PTR, Frame, define, export, for_range, gather_intrinsic,
                                     masked_intrinsics, offset, optimize_not, splat)
from tgc.lower.lowered import GemmKernel, Lowered, matrix_form
from tgc.options import Options

# Capacity (elements) of the stack buffer a small tile's B' is packed into when its
# Q is not contiguous; a tile with more R x Q elements than this goes to BLAS.
PACK_ELEMS = 4096
ROWS = 4          # rows of C' per register block of the small-tile kernel
LOOP_COLS = 2     # vectors of columns per block of the blocked loops (`loops_kernel`)
MIN_TILE = 16     # tiles are not cut below this many rows or columns ...
MIN_CHUNK = 64    # ... nor R chunks below this
UNTILED = 1 << 62  # the tile limit of a product batched BATCH_TASKS times or more: one tile per batch index
# A task of a product with shifts makes one accumulating cblas call per tap; there,
# tiles 4x smaller than one per thread measured faster: conv1d's kernel gradient
# (5 x 32 taps of 64 x 64 x 1024) took 11.9 ms in 2 tiles per batch index and 9.3 ms
# in 8, whose 16 x 32 x 1024 calls (2^19 multiply-adds) OpenBLAS runs with its
# unpacked small-matrix kernel (68 GFLOP/s alone, against 54-61 for 32 x 32 or 32 x 64).
# Taps without shifts keep one tile per thread: a 2-D convolution's kernel gradient
# (16 taps of 64 x 288 x 1024) took 39 Mcycles in 2 tiles, 60 in 8 (32 x 72 calls).
# Products the own kernel runs (fgemm.py) keep one tile per thread too: it packs B'
# once per call, and 16 x 32 tiles left it 4 row blocks to share that with (conv1d's
# kernel gradient on 2 threads: 16.3 -> 14.4 Mcycles; 14.7 -> 9.3 with its 5 taps'
# products sharing each packed B', `shared_b_batch`).
TAP_TILES_PER_THREAD = 4
BATCH_TASKS = 16  # a product batched at least this many times is shared untiled (conv1d: 25.5 -> 21.3 ms)


def uses_own_gemm(low: Lowered, k: GemmKernel, options: Options, window: bool = False) -> bool:
    """Whether GEMM `k`'s large tiles may run tgc's own f32 kernel (fgemm.py) rather
    than cblas: a real f32 product of f32 operands whose A' (the normalized product's
    left operand) has its K contiguous, `options.cpu.own_gemm` "on", or "auto" where
    the host has AVX-512 (the kernel's 16-lane vectors). A tile then goes to it when
    it has at least `own_gemm_min_cols` columns of C', or sums at least
    `own_gemm_min_depth` terms over at least one block of columns (OWN_COLS; a
    narrower tile wastes lanes: 64 x 48 x 704 134 / 167), and its B' has at most `own_gemm_max_b_bytes` (it stays in L2
    while its blocks are packed; OpenBLAS streams a larger one from memory better).
    Measured on the 2-core Zen 5 (one thread, min of 200 calls of one product, its
    operands in cache; GFLOP/s own / OpenBLAS): 64 x 1024 x 288 (conv2d's output per
    image) 183 / 166, 96 x 1024 x 64 182 / 144, 288 x 64 x 1024 with B' transposed
    (conv2d's kernel gradient) 207-220 / 179-193, 178 x 64 x 1024 199 / 160, 178 x
    192 x 256 202 / 172; but with 64 terms 178 x 64 x 64 133 / 202, 64 x 192 x 64
    130 / 205, and 1024^3 179 / 181. Inside conv2d, whose output product reads a
    1.2 MB window per image from memory, OpenBLAS was faster (11.1 against 12.9
    Mcycles), hence the bound on B'. What the layout fixes (contiguity; C' columns
    and K of fixed size) is checked here, so a program whose products can never run
    the kernel does not compile it; the tile sizes at run time."""
    mode = options.cpu.own_gemm
    if mode == "off" or k.cplx is not None or low.dtype != "f32":
        return False
    if any(low.buffers.get(n) is None or low.buffers[n].dtype != "f32" for n in (k.a.buf, k.b.buf)):
        return False
    if any(k.rounded):   # a bf16 GEMM rounding f32 operands as it packs (gemm_operands)
        return False
    if window:   # an implicit GEMM (implicit.py checks its operands): any shape
        return mode == "on" or _has_avx512()
    f = _forms(low, k)
    flip = not f["c"][2]
    if not (f["a"][2] if not flip else not f["b"][2]):   # A' has its K contiguous
        return False
    cols, depth = _fixed_count(low, f["c"][1] if not flip else f["c"][0]), _fixed_count(low, f["a"][1])
    if cols is not None and cols < options.cpu.own_gemm_min_cols and (
            cols < OWN_COLS or depth is not None and depth < options.cpu.own_gemm_min_depth):
        return False
    return mode == "on" or _has_avx512()


def _has_avx512() -> bool:
    from tgc.backends.cpu.llvm_env import has_feature

    return has_feature("avx512f")


def _control(fn: ir.Function) -> None:
    """A batched GEMM's work function only decodes tasks and calls: optimized for size
    (less for LLVM to do), and never inlined. The entry, and the work function of a
    product without batch edges (a few tasks), are not optimized at all: the MLP's
    units took 0.205 + 0.236 s to compile with all of them optimized for size, 0.132 +
    0.16 s with none, and its step measured the same."""
    for attr in ("noinline", "minsize", "optsize"):
        fn.attributes.add(attr)


def _vector_lanes(fp) -> int:
    return 16 if isinstance(fp, ir.FloatType) else 8


class _Operand:
    """A' or B' of the normalized product: pointer role ('a' | 'b'), strides of its
    two groups (row, col) as IR values, and which is the unit-stride one."""

    def __init__(self, role, row_stride, col_stride, col_unit):
        self.role, self.row, self.col, self.col_unit = role, row_stride, col_stride, col_unit


def _forms(low: Lowered, k: GemmKernel) -> dict:
    """Each operand's and the result's `matrix_form` (in its buffer's order)."""
    ab, bb, cb = (low.buffers[n] for n in (k.a.buf, k.b.buf, k.out))
    va, vb, vc = (k.matrix_order(o) for o in (k.a.view_order(ab.order), k.b.view_order(bb.order), cb.order))
    fa, fb, fc = (matrix_form(o, r, c) if o is not None else None
                  for o, r, c in ((va, k.m, k.k), (vb, k.k, k.n), (vc, k.m, k.n)))
    for form, what in ((fa, f"operand {va}"), (fb, f"operand {vb}"), (fc, "result")):
        if form is None:
            raise ValueError(f"internal: GEMM {what} is not a matrix")
    return {"a": fa, "b": fb, "c": fc}


def bf16_product(low: Lowered, k: GemmKernel) -> bool:
    """Whether `k` is a bf16 product (the `gemm_operands` stage chose it): each operand
    a bf16 buffer, or an f32 one rounded to bf16 as it is read (`k.rounded`)."""
    return k.cplx is None and all(low.buffers[v.buf].dtype == "bf16" or r for v, r in zip((k.a, k.b), k.rounded))


def bf16_kinds(low: Lowered, k: GemmKernel) -> set[tuple[bool, bool]]:
    """The bf16 kernels (`rounds` per operand of the normalized product) `k` calls."""
    if not bf16_product(low, k):
        return set()
    flip = not _forms(low, k)["c"][2]
    return {tuple(reversed(k.rounded)) if flip else tuple(k.rounded)}


def packs_b(low: Lowered, k: GemmKernel) -> bool:
    """Whether the product's small tiles pack B' (its columns are not contiguous):
    which small-tile helper it calls (see `GemmGen.operands`)."""
    f = _forms(low, k)
    return f["a"][2] if not f["c"][2] else not f["b"][2]


def shared_b_batch(low: Lowered, k: GemmKernel, options: Options) -> tuple[str, ...]:
    """The batch edges of an accumulating product whose tasks each take the whole of,
    so that one call of the own kernel (fgemm: products sharing B) runs the
    products along them on one packed B': the edges B' does not depend on (not in
    its buffer, not in its shifts), where every shift they move clips K (never a
    tile's rows or columns), the batch has fixed sizes and fewer than BATCH_TASKS
    indices (a product tiled by rows and columns), and the own kernel may run it.
    A 1-D convolution's kernel gradient (5 taps of 64 x 64 x 1024 per signal,
    the input transposed as B') packed each signal 5 times, 40% of its time on one
    thread. Each call's K blocks are cut to each product's range, so where they
    fall depends on the sizes only, never on the thread count."""
    if not k.accumulates() or not uses_own_gemm(low, k, options):
        return ()
    f = _forms(low, k)
    packed = _packed_role(f)
    view = k.b if packed == "b" else k.a
    order = low.buffers[view.buf].order
    reads = {ve for ve, be in view.edges if be in order}
    reads |= {atom for role, _, ix in k.shifts if role == packed for atom, _ in ix.terms}
    edges = tuple(e for e in k.batch if e not in reads)
    if not edges:
        return ()
    if any(e != f["a"][1][0] and any(atom in edges for atom, _ in ix.terms) for _, e, ix in k.shifts):
        return ()
    count = _fixed_count(low, k.batch)
    return edges if count is not None and count < BATCH_TASKS else ()


def _packed_role(forms: dict) -> str:
    """The operand ('a' | 'b') that is B' of the normalized product (A^T when C
    holds M innermost)."""
    return "b" if forms["c"][2] else "a"




def taps_in_one_call(low: Lowered, k: GemmKernel, options: Options) -> bool:
    """Whether the own kernel may run all taps of product `k` in one call (its
    `taps` form: each block of rows keeps its accumulators across the taps, so C is
    read and written once, not once per tap, and never zeroed first): a product
    the own kernel may run, with at most MAX_TAPS taps of fixed sizes, B''s
    columns contiguous, every shift moving B''s columns or K (never A''s rows, which
    the kernel reads in place), and not one `shared_b_batch` takes. A 1-D
    convolution's output (5 taps of 64 terms) and a 2-D one's input gradient (3)."""
    if not k.taps or not uses_own_gemm(low, k, options) or shared_b_batch(low, k, options):
        return False
    f = _forms(low, k)
    flip = not f["c"][2]
    if not (f["b"][2] if not flip else not f["a"][2]):   # B' has its columns contiguous
        return False
    packed = _packed_role(f)
    cols = f["c"][1] if not flip else f["c"][0]
    if any(not (role == packed and e == cols[0] or e == f["a"][1][0]) for role, e, _ in k.shifts):
        return False
    count = _fixed_count(low, k.taps)
    return count is not None and count <= MAX_TAPS


def _fixed_count(low: Lowered, edges) -> int | None:
    """The number of indices of `edges`, or None when a size is symbolic."""
    count = 1
    for e in edges:
        size = low.size(e)
        if not isinstance(size, int):
            return None
        count *= size
    return count


class GemmGen:
    def __init__(self, mod: ir.Module, low: Lowered, k: GemmKernel, name: str, fp,
                 options: Options, home: ir.Module | None = None, implicit=None):
        if implicit is not None:   # an implicit GEMM (implicit.py): its window buffer, never allocated
            low = low.staged(low.stage)
            low.buffers[implicit.window] = implicit.buffer(low.dtype)
        self.implicit = implicit
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
        self.fn = define(mod, name, I32, [PTR] * 4 + [I64])
        optimize_not(self.fn)   # plans the tiles once per call: not worth LLVM's time
        self.bufs = {r: low.buffers[n] for r, n in (("a", k.a.buf), ("b", k.b.buf), ("c", k.out))}
        self.forms = _forms(low, k)
        fa, fc = self.forms["a"], self.forms["c"]
        self.flip = not fc[2]                 # C holds M innermost: compute C^T = B^T A^T
        # the normalized groups (edges in memory order)
        if not self.flip:
            self.P, self.Q = fc[0], fc[1]
        else:
            self.P, self.Q = fc[1], fc[0]
        self.R = fa[1]
        # tgc's own f32 kernel (fgemm.py) for large tiles, where `options.cpu.own_gemm` allows it
        a_k_unit = fa[2] if not self.flip else not self.forms["b"][2]   # A' has its K contiguous
        self.own = uses_own_gemm(low, k, options, window=implicit is not None) and a_k_unit
        self.window = None
        if implicit is not None:
            self.window = self.window_of(implicit)
        # batch edges each task takes whole, for one call of the own kernel per tap
        self.shared = shared_b_batch(low, k, options) if implicit is None and self.own else ()
        self.task_batch = tuple(e for e in k.batch if e not in self.shared)
        # all taps in one call of the own kernel's taps form
        self.tapped = implicit is None and self.own and taps_in_one_call(low, k, options)
        self.clipped = {e for _, e, _ in k.shifts}
        for e in self.clipped:
            if not any(g[:1] == (e,) for g in (self.P, self.Q, self.R)):
                raise ValueError(f"internal: shifted GEMM edge '{e}' is not the outermost of its group")

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
        cst = strides(self.bufs["c"].order)
        out["c"] = (dict(cst), {e: e for e in self.bufs["c"].edges})
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
        MIN_TILE), or when neither can be halved tr (not below MIN_CHUNK), until
        tp * tq * tr <= limit. Rows and columns first, since only they make tasks
        (R chunks add up inside one task): a 48 x 48 weight gradient summed over 704
        rows was one task, and its region left the second thread idle."""
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
        zero = I64(0)
        hp = b.select(b.icmp_signed(">=", tp, I64(2 * MIN_TILE)), tp, zero)
        hq = b.select(b.icmp_signed(">=", tq, I64(2 * MIN_TILE)), tq, zero)
        hr = b.select(b.icmp_signed(">=", tr, I64(2 * MIN_CHUNK)), tr, zero)
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
        return dict(P=P, Q=Q, R=R, tp=tp, tq=tq, tr=tr, n_p=n_p, n_q=n_q, tasks=tasks)

    # ------------------------------------------------------------ entry

    def emit(self) -> ir.Function:
        """The entry: plans the tiles once (one tile per batch index when it runs on
        one thread), then runs every task here or shares them out in a region."""
        work = self.emit_work()
        par = self.emit_par(work) if self.opt.cpu.threads != 1 else None
        f = Frame(self.fn, self.low.module, self.fn.args[0])
        b = f.b
        args, min_flops = list(self.fn.args[:4]), self.fn.args[4]
        limit = self.tile_limit(f, b)
        big = None
        if par is not None:
            P, Q, R = (f.count(g) for g in (self.P, self.Q, self.R))
            flops = b.mul(b.mul(b.mul(P, Q), R), I64(2))
            flops = b.mul(b.mul(flops, f.count(self.k.batch)), f.count(self.k.taps))
            big = b.icmp_signed(">=", flops, min_flops)
            big = b.and_(big, fntable.is_set(b, "gomp_parallel"))
        pl = self.plan(f, b, limit)
        tiles = [pl["tp"], pl["tq"], pl["tr"]]
        if big is not None:
            with b.if_then(b.and_(big, b.icmp_signed(">=", pl["tasks"], I64(2)))):
                data = f.alloca(ir.ArrayType(I64, 8), "data")
                for i, v in enumerate(args + [pl["tasks"]] + tiles):
                    v = b.ptrtoint(v, I64) if isinstance(v.type, ir.PointerType) else v
                    b.store(v, b.gep(data, [I32(0), I32(i)]))
                b.call(parallel.region_fn(self.mod, self.home, self.opt.cpu), [par, data])
                b.ret(I32(1))
        b.call(work, args + [I64(0), pl["tasks"]] + tiles)
        b.ret(I32(0))
        f.finish()
        return self.fn

    def tile_limit(self, f: Frame, b: ir.IRBuilder):
        """i64: the most multiply-adds of one tile. A function of the product's sizes
        and the options only, never of the thread count or of whether this call runs
        in a region: every run makes the same cblas calls (and small-tile loops), so
        the result has the same bits on any number of threads (OpenBLAS's result for
        an element depends on where the call's edges cut its kernels). A product
        batched BATCH_TASKS times or more is one tile per batch index (tasks enough);
        another is cut into `options.cpu.gemm_tiles` tiles (TAP_TILES_PER_THREAD times
        that with shifts, unless the own kernel runs it), each of at least `blas_tile_mnk`, so a small one stays whole.
        A product of fewer than `gemm_parallel_min_flops` flops (the threshold of a cold
        region) stays whole too: it runs in a region only while the workers still spin
        from another, and cut into tiles on one thread it repacks its uncut operand once
        per cblas call (the wine MLP's 178 x 64 x 64 products with B transposed: 9.9 us
        whole, 12.7 us in two calls; the whole step 5% slower)."""
        many = b.icmp_signed(">=", f.count(self.k.batch), I64(BATCH_TASKS))
        P, Q, R = (f.count(g) for g in (self.P, self.Q, self.R))
        mnk = b.mul(b.mul(P, Q), R)
        parts = max(1, self.opt.cpu.gemm_tiles) * (TAP_TILES_PER_THREAD if self.k.shifts and not self.own else 1)
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
        vals = [b.load(b.gep(fn.args[0], [I64(i)], source_etype=I64), typ=I64) for i in range(8)]
        ptrs = [b.inttoptr(v, PTR) for v in vals[:4]]
        lo, hi = parallel.thread_range(b, vals[4])
        with b.if_then(b.icmp_signed("<", lo, hi)):
            b.call(work, ptrs + [lo, hi] + vals[5:8])
        b.ret_void()
        return fn

    def emit_work(self) -> ir.Function:
        """`tgc.kN.work(dims, a, b, c, lo, hi, tp, tq, tr)`: tasks [lo, hi) of the
        plan with tiles of tp x tq x tr."""
        k = self.k
        fn = define(self.mod, self.name + ".work", ir.VoidType(), [PTR] * 4 + [I64] * 5)
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
            p0 = b.mul(ip, pl["tp"])
            q0 = b.mul(iq, pl["tq"])
            p1 = self.smin(b.add(p0, pl["tp"]), pl["P"])
            q1 = self.smin(b.add(q0, pl["tq"]), pl["Q"])
            tile = (p0, p1, q0, q1)

            def each_tap():
                if k.accumulates():
                    def zero(v):
                        cbase = self.ptr(ptrs["c"], [(v[e], st["c"][0][e]) for e in k.batch])
                        self.zero_tile(b, cbase, c_p, p0, p1, q0, q1)
                    self.nest(list(self.shared), vars, zero)
                leaf = self.leaf_shared if self.shared else self.leaf
                self.nest(list(k.taps), vars, lambda v: leaf(v, tile, pl, st, ptrs, A, B, c_p, small))
            if self.tapped:   # the tile runs the own kernel: all taps in one call
                with b.if_else(b.and_(b.not_(small), self.own_tile(pl["R"], b.sub(q1, q0)))) as (one, many):
                    with one:
                        self.call_taps(vars, tile, pl, st, ptrs, A, B, c_p)
                    with many:
                        each_tap()
            else:
                each_tap()
        b.ret_void()
        f.finish()
        return fn

    def small_ok(self, b, pl, B):
        """i1: the tiles go to the generated loops (not BLAS)."""
        mnk = b.mul(b.mul(pl["tp"], pl["tq"]), pl["tr"])
        ok = b.icmp_signed("<=", b.mul(mnk, I64(2)), I64(self.opt.cpu.gemm_loop_max_flops))
        if not B.col_unit:
            vl = I64(_vector_lanes(self.fp))   # the packed rows are padded to whole vectors
            padded = b.mul(self.ceil_div(b, pl["tq"], vl), vl)
            ok = b.and_(ok, b.icmp_signed("<=", b.mul(padded, pl["tr"]), I64(PACK_ELEMS)))
        return ok

    # ------------------------------------------------------------ one task, one tap

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
                    self.b.call(bf16_kernel(self.mod, home=self.home, rounds=rounds),
                                [m, n, kc, xa, A.row, A.col, xb, B.row, B.col, pc, c_p, b.zext(beta1, I32)])
                elif small is None:   # a complex product: always cgemm/zgemm (blas "numpy" or "system")
                    self.call_blas(m, n, kc, xa, A, xb, B, pc, c_p, beta1)
                else:
                    with b.if_else(small) as (then, otherwise):
                        with then:
                            self.call_small(m, n, kc, xa, A, xb, B, pc, c_p, beta1)
                        with otherwise:
                            self.call_large(m, n, kc, xa, A, xb, B, pc, c_p, beta1)

    def leaf_shared(self, vars, tile, pl, st, ptrs, A, B, c_p, small):
        """One task's tap with the `shared` batch edges taken whole: where the tile runs
        the own kernel, one call for every index of them, on one packed B' (each
        index's K range cut to where the shifts it moves are in bounds); elsewhere
        `leaf` per index."""
        b, k = self.b, self.k
        p0, p1, q0, q1 = tile
        multi = b.and_(b.not_(small), self.own_tile(self.smin(pl["tr"], pl["R"]), b.sub(q1, q0)))
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
            fn = own_kernel(self.mod, home=self.home)
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
        fn = own_kernel(self.mod, home=self.home, taps=True)
        b.call(fn, [b.sub(p1, p0), b.sub(q1, q0), pl["R"], ptrs[A.role], A.row, A.col, ptrs[B.role], B.row, B.col,
                    pc, c_p, I32(0), I64(len(indices))] + [b.gep(arr, [I32(0), I32(0)]) for arr in offs])

    def ptr(self, base, parts, etype=None):
        return self.b.gep(base, [offset(self.b, parts)], inbounds=True, source_etype=etype or self.elem)

    def smin(self, x, y):
        return self.b.select(self.b.icmp_signed("<", x, y), x, y)

    @staticmethod
    def smax(b, x, y):
        return b.select(b.icmp_signed(">", x, y), x, y)

    def zero_tile(self, b, base, ld, p0, p1, q0, q1):
        """Zero rows p0..p1, columns q0..q1: a memset per row (a loop of stores here
        was vectorized and unrolled by LLVM, ~10 ms more to compile per GEMM)."""
        memset = self.mod.globals.get("llvm.memset.p0.i64") or ir.Function(
            self.mod, ir.FunctionType(ir.VoidType(), [PTR, ir.IntType(8), I64, I1]), "llvm.memset.p0.i64")
        width = I64(4 if isinstance(self.fp, ir.FloatType) else 8)
        with for_range(b, p0, p1, "zp") as p:
            row = b.gep(base, [b.add(b.mul(p, ld), q0)], source_etype=self.fp)
            b.call(memset, [row, ir.IntType(8)(0), b.mul(b.sub(q1, q0), width), ir.Constant(I1, 0)])

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
        with for_range(self.b, I64(0), self.f.edge_size(edges[0]), edges[0]) as i:
            self.nest(edges[1:], {**vars, edges[0]: i}, leaf)

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
        beta = b.select(beta1, one, ir.Constant(self.fp, 0.0))
        name = "sgemm" if isinstance(self.fp, ir.FloatType) else "dgemm"
        ld = [self.at_least_one(v) for v in (lda, ldb, ldc)]
        fntable.call(b, name, [I32(blas.ORDER_ROW_MAJOR), I32(ta), I32(tb), m, n, kk, one,
                               pa, ld[0], pb, ld[1], beta, pc, ld[2]])

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
            with b.if_else(self.own_tile(kk, n)) as (then, otherwise):
                with then:
                    self.call_own(m, n, kk, pa, A, pb, B, pc, ldc, beta1)
                with otherwise:
                    self.call_library(m, n, kk, pa, A, pb, B, pc, ldc, beta1)
            return
        self.call_library(m, n, kk, pa, A, pb, B, pc, ldc, beta1)

    def own_tile(self, kk, n):
        """i1: a tile of n columns summing kk terms runs the own kernel: deep or wide,
        and its B' fits in L2 (see `uses_own_gemm`)."""
        b, o = self.b, self.opt.cpu
        deep = b.and_(b.icmp_signed(">=", kk, I64(o.own_gemm_min_depth)), b.icmp_signed(">=", n, I64(OWN_COLS)))
        wide = b.or_(b.icmp_signed(">=", n, I64(o.own_gemm_min_cols)), deep)
        return b.and_(wide, b.icmp_signed("<=", b.mul(b.mul(kk, n), I64(4)), I64(o.own_gemm_max_b_bytes)))

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
        fn = own_kernel(self.mod, home=self.home)
        b.call(fn, [m, n, kk, pa, A.row, A.col, pb, B.row, B.col, pc, ldc, b.zext(beta1, I32), I64(1)]
               + [b.gep(arr, [I32(0), I32(0)]) for arr in one])

    def window_kernel(self) -> ir.Function:
        """This implicit GEMM's own copy of the own kernel, packing its window."""
        name = self.name + ".own"
        if name not in self.mod.globals:
            module, edges = self.low.module, self.low.edges
            own_kernel(self.mod, window=self.window, name=name,
                       frame=lambda fn, dims: Frame(fn, module, dims, edges))
        return self.mod.globals[name]

    def call_small(self, m, n, kk, pa, A, pb, B, pc, ldc, beta1, blocked=False):
        kernel = loops_kernel if blocked else small_kernel
        fn = kernel(self.mod, self.fp, packed=not B.col_unit, home=self.home)
        self.b.call(fn, [m, n, kk, pa, A.row, A.col, pb, B.row, B.col, pc, ldc,
                         self.b.zext(beta1, I32)])

    def at_least_one(self, v):
        return self.b.select(self.b.icmp_signed("<", v, I64(1)), I64(1), v)


# ---------------------------------------------------------------- small tiles


def small_kernel(mod: ir.Module, fp, packed: bool, home: ir.Module | None = None) -> ir.Function:
    """void tgc.gemm.small.<T>[.packed](i64 M, i64 N, i64 K, T* A, i64 sAm, i64 sAk,
    T* B, i64 sBk, i64 sBn, T* C, i64 ldc, i32 accumulate):
    C[M, N] (+)= A[M, K] B[K, N] with C's N contiguous; B's N contiguous (sBn is
    ignored) unless `packed` (then B is first copied into a stack buffer; K*N must
    not exceed PACK_ELEMS). One function per program and kind: defined in `home`
    (default `mod`) and, when that is another unit of the program, declared in
    `mod`."""
    tag = "f32" if isinstance(fp, ir.FloatType) else "f64"
    name = f"tgc.gemm.small.{tag}" + (".packed" if packed else "")
    if name in mod.globals:
        return mod.globals[name]
    if home is not None and home is not mod:
        return export(small_kernel(home, fp, packed), mod)
    if packed:
        return _packed_kernel(mod, fp, name, small_kernel(mod, fp, packed=False))
    fn = define(mod, name, ir.VoidType(), [I64, I64, I64, PTR, I64, I64, PTR, I64, I64, PTR, I64, I32])
    fn.attributes.add("noinline")
    M, N, K, pa, sam, sak, pb, sbk, _sbn, pc, ldc, acc = fn.args
    for a in (pa, pb, pc):
        a.add_attribute("noalias")
    entry = ir.IRBuilder(fn.append_basic_block("entry"))
    body = fn.append_basic_block("body")
    b = ir.IRBuilder(body)
    vl = _vector_lanes(fp)
    vt = ir.VectorType(fp, vl)
    mt = ir.VectorType(I1, vl)
    accs = [[entry.alloca(vt, name=f"acc{r}.{c}") for c in range(2)] for r in range(ROWS)]
    iota = ir.Constant(ir.VectorType(I64, vl), [i for i in range(vl)])
    accumulate = b.icmp_signed("!=", acc, I32(0))
    acc_mask = splat(b, accumulate, mt)
    zero_v = ir.Constant(vt, [0.0] * vl)
    load_fn, store_fn, fma_fn = masked_intrinsics(mod, fp, vl)
    align = I32(4 if isinstance(fp, ir.FloatType) else 8)

    def block(i0, j0, nc):
        """ROWS rows from i0 by nc vectors of columns from j0. Rows past M read row
        M - 1 and store nothing: every block is a whole one, so the kernel has two
        kinds of block (one or two vectors), not six (rows of 4, 2 and 1 had taken
        LLVM ~3x as long, in every program with a GEMM)."""
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
        # not unrolled: LLVM's runtime unrolling of the k loops cost ~18 ms of compile
        # time in every program with a GEMM, for ~3% on an 11 x 11 x 16 tile
        with for_range(b, I64(0), K, "k", unroll=False) as kk:
            brow = b.gep(pb, [b.add(b.mul(kk, sbk), j0)], source_etype=fp)
            bv = [b.call(load_fn, [b.gep(brow, [I64(c * vl)], source_etype=fp), align, masks[c], zero_v])
                  for c in range(nc)]
            for r in range(ROWS):
                a = b.load(b.gep(arow[r], [b.mul(kk, sak)], source_etype=fp), typ=fp)
                av = splat(b, a, vt)
                for c in range(nc):
                    b.store(b.call(fma_fn, [av, bv[c], b.load(accs[r][c], typ=vt)]), accs[r][c])
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


def loops_kernel(mod: ir.Module, fp, packed: bool, home: ir.Module | None = None) -> ir.Function:
    """void tgc.gemm.loops.<T>[.packed](the arguments of `small_kernel`): the same
    product of any size, without BLAS (`options.cpu.blas` "none", or a library whose
    caller gave none). Columns in blocks of LOOP_COLS vectors and K in chunks that
    make one block of B' PACK_ELEMS elements (16 KiB of f32: it stays in L1 while
    every row of A' passes over it), each block one call of the small-tile kernel
    on all the rows (the packed one gathers the block first); a chunk after the
    first accumulates. Each element of C' is still one sum over K in K's order, cut
    where the chunks end. One function per program and kind, like `small_kernel`."""
    tag = "f32" if isinstance(fp, ir.FloatType) else "f64"
    name = f"tgc.gemm.loops.{tag}" + (".packed" if packed else "")
    if name in mod.globals:
        return mod.globals[name]
    if home is not None and home is not mod:
        return export(loops_kernel(home, fp, packed), mod)
    inner = small_kernel(mod, fp, packed)
    fn = define(mod, name, ir.VoidType(), [I64, I64, I64, PTR, I64, I64, PTR, I64, I64, PTR, I64, I32])
    fn.attributes.add("noinline")
    optimize_not(fn)   # loops around calls: not worth LLVM's time
    M, N, K, pa, sam, sak, pb, sbk, sbn, pc, ldc, acc = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    cols = LOOP_COLS * _vector_lanes(fp)
    depth = PACK_ELEMS // cols

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


def _packed_kernel(mod, fp, name, direct):
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
    buf = entry.alloca(fp, size=I64(PACK_ELEMS), name="pack")
    buf.align = 64
    body = fn.append_basic_block("body")
    b = ir.IRBuilder(body)
    vl = _vector_lanes(fp)
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


# ---------------------------------------------------------------- bf16 products (AVX-512 BF16)

BF16_ROWS = 4      # rows of C' per register block of the bf16 kernel ...
BF16_VECS = 4      # ... by this many vectors of 16 f32 columns (16 accumulators)
BF16_DEPTH = 256   # K per packed block (even): B' block of 128 pairs x 64 columns, 32 KiB
BF16_PANEL = 256   # rows of A' packed at a time (per K block): 256 x 128 pairs, 128 KiB


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


def bf16_kernel(mod: ir.Module, home: ir.Module | None = None, rounds: tuple[bool, bool] = (False, False)
                ) -> ir.Function:
    """void tgc.gemm.bf16[.ra][.rb](i64 M, i64 N, i64 K, T* A, i64 sAm, i64 sAk, T* B, i64 sBk,
    i64 sBn, float* C, i64 ldc, i32 accumulate): C[M, N] (+)= A[M, K] B[K, N] for bf16 A
    and B and f32 C with N contiguous (any strides, in elements), summed in f32 by
    `vdpbf16ps` (AVX-512 BF16). An operand is bf16 (its 16 bits), or, where `rounds`
    says so (`.ra`, `.rb`), f32 rounded to bf16 as it is packed (to nearest even, NaN
    kept quiet: `elementwise.emit_round_bf16`'s bits), so no rounded copy is stored.

    Rows in panels of BF16_PANEL and K in blocks of BF16_DEPTH; per panel and K block,
    A's pairs (A[i, k], A[i, k+1]) are packed once for all the panel's rows (one 32-bit
    lane per row and pair: vector loads of 4 rows when A's M is contiguous), then for
    every block of BF16_VECS x 16 columns B's block is packed as pairs (B[k, j], B[k+1, j])
    (vector loads when B's N is contiguous, i32 gathers of whole pairs when its K is,
    else element by element; zeros past K and N) and every block of BF16_ROWS rows of
    the panel runs the K pairs with 16 vector accumulators: each step broadcasts a
    row's pair and takes one `vdpbf16ps` per vector, i.e. two K steps of 16
    multiply-adds. A bf16 A whose K is contiguous is not packed (its pairs are 32-bit
    loads; the panel is then all of M). A K block after the first adds into C; rows
    past M read row M - 1 (or zeros) and store nothing. Each element of C is one sum
    over K, in pairs, in K's order, whatever the strides. One function per program
    and kind (like `small_kernel`)."""
    name = "tgc.gemm.bf16" + (".ra" if rounds[0] else "") + (".rb" if rounds[1] else "")
    if name in mod.globals:
        return mod.globals[name]
    if home is not None and home is not mod:
        return export(bf16_kernel(home, rounds=rounds), mod)
    i16, f32 = ir.IntType(16), ir.FloatType()
    vl, cols, half, rows_n = 16, BF16_VECS * 16, BF16_DEPTH // 2, BF16_ROWS
    fn = define(mod, name, ir.VoidType(), [I64, I64, I64, PTR, I64, I64, PTR, I64, I64, PTR, I64, I32])
    fn.attributes.add("noinline")
    M, N, K, pa, sam, sak, pb, sbk, sbn, pc, ldc, acc = fn.args
    for a in (pa, pb, pc):
        a.add_attribute("noalias")
    entry = ir.IRBuilder(fn.append_basic_block("entry"))
    bpack = entry.alloca(I32, size=I64(half * cols), name="bpack")
    apanel = entry.alloca(I32, size=I64(half * BF16_PANEL), name="apanel")
    bpack.align = apanel.align = 64
    vt, it, mt = ir.VectorType(f32, vl), ir.VectorType(I32, vl), ir.VectorType(I1, vl)
    pairs = ir.VectorType(_BFloat(), 32)
    accs = [[entry.alloca(vt, name=f"acc{r}.{c}") for c in range(BF16_VECS)] for r in range(rows_n)]
    body = fn.append_basic_block("body")
    b = ir.IRBuilder(body)
    dot = _dpbf16ps(mod)
    _, store_fn, _ = masked_intrinsics(mod, f32, vl)
    iota = ir.Constant(ir.VectorType(I64, vl), list(range(vl)))
    align = I32(4)
    ops_a = _Bf16Operand(b, mod, rounds[0])
    ops_b = _Bf16Operand(b, mod, rounds[1])

    def smin(x, y):
        return b.select(b.icmp_signed("<", x, y), x, y)

    accumulate = b.icmp_signed("!=", acc, I32(0))
    chunks = b.sdiv(b.add(K, I64(BF16_DEPTH - 1)), I64(BF16_DEPTH))
    chunks = b.select(b.icmp_signed("<", chunks, I64(1)), I64(1), chunks)   # K = 0 still writes C (zeros)
    a_direct = ir.Constant(I1, 0) if rounds[0] else b.icmp_signed("==", sak, I64(1))
    panel = b.select(a_direct, b.select(b.icmp_signed("<", M, I64(1)), I64(1), M), I64(BF16_PANEL))
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
            k0 = b.mul(kb, I64(BF16_DEPTH))
            kd = smin(I64(BF16_DEPTH), b.sub(K, k0))
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
                    start_accumulators(b, add_c, crow, accs, masks)

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
                    for r in range(rows_n):
                        real = splat(b, inside[r], mt)
                        for c in range(BF16_VECS):
                            at = b.gep(crow[r], [I64(c * vl)], source_etype=f32)
                            b.call(store_fn, [b.load(accs[r][c], typ=vt), at, align, b.and_(masks[c], real)])
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
