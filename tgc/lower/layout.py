"""layout: one physical axis order per buffer, loop orders, GEMM matrix forms.

`Lowered` -> `Lowered`. Arguments and outputs keep their ABI orders. Each
temporary gets, in kernel order, the order that suits it best:

- an update value: its target's ABI order (the final copy, or an in-place write, is
  then a straight pass);
- a GEMM operand: batch edges, then the rows group, then the columns group (the
  contraction group innermost), each group in the order the other buffer sharing
  it already has, so that BLAS reads it with no transposing copy;
- a GEMM result: batch, M, N in the operands' orders; or, when another GEMM reads
  it, the operand order that GEMM wants, if this one can write its matrices that
  way (batch edges may sit between the groups: rows then have a longer stride).
  GPT's attention products feed its weight gradients with no copy in between;
  when only loop kernels read it, elementwise or summing a few taps, the order whose
  innermost edge moves with theirs (`_suit_readers`: a 2-D convolution's `dx` sums
  its partial along contiguous rows); when they sum its rows over the whole of one
  group (a softmax over the key edge) and that group is at least as large, it goes
  innermost all the same (`_summed_group`: a streamed attention step's `[64, s]`
  scores, as the unstreamed `[t, s]` ones, and a layer loop's square `[t, s]` `dP`);
- anything else: the order of the loaded buffer it shares most edges with (edges
  it lacks go outermost), so the innermost loop is contiguous for both.

Then every GEMM is checked (`matrix_form`): a transpose flag absorbs an operand
whose groups are swapped; a group the result's order splits becomes batch edges
(`_demote`); a group holding a shifted (clipped) edge keeps the edges that follow
it in every buffer holding the group, the rest become loops of calls (`_fit_clips`:
the clipped range is then one run of the merged group); a K group an operand's
order splits gives its outer edges to taps, loops of calls that add into the
result, when at least `Options.layout_tap_min_k` of K is left to each call (`_taps_for_split_k`: a
2-D convolution's kernel gradient sums 16 images by 16 accumulating calls instead
of copying its two operands, 4 MB and 19 MB, into transposed temporaries); a result
whose fixed order (an argument's, an output's) makes BLAS write a matrix at least
`Options.layout_tall` times wider than tall, over a long sum, is computed the other way round into a
temporary and copied (`_tall_result`: OpenBLAS runs tall matrices faster); an
operand that still splits a group, or whose group order disagrees with the other
buffer, gets a copy kernel into a temporary in the canonical form, or its transpose
when the result is column-major (then the product is computed as C^T = B^T A^T, and
B^T's K or A^T's M is contiguous: what tgc's own CPU kernel needs of its left
operand; conv1d's input gradient: 11.2 Mcycles on 2 threads, 13.6 with a copy in the
canonical form). These are the
only copies this pass inserts. Each of these only moves edges between the groups and the
loops around the calls, so every term of the product is still added exactly once.
Finally each loop kernel's loops are ordered: the innermost is the variable with
the cheapest strides over all accesses (stores weigh double, reductions win ties,
so they accumulate in registers), the others outward by decreasing stride (a
floor-divided index `floor((c v + ...) / d)` by its mean stride, c / d of its axis's:
a streamed loop's stacked blocks read back along the whole edge keep the edge inside
the batch and head edges; a gather's index counts as a far stride). Last, a summed loop whose
mask says `lo(outer vars) <= v < hi(outer vars)` gets those bounds instead of the
mask (a causal mask halves the work, padding needs no masked loads); a condition
on a multiple of v (`2 v + k - 1 >= 0`, a stride) gives a bound by floor division.

Terminates: one visit per kernel and buffer (`_demote` and `_fit_clips` move each
edge at most once; `_taps_for_split_k` tries each subset of a K group once).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Sequence

from tgc.ir.complex_io import RI
from tgc.lower.lowered import (Buffer, FloorDiv, GemmKernel, IdLoad, Ix, Load, LoopKernel, Lowered,
                            Mask, StepLoop, View, matrix_form, walk)
from tgc.ir.sizes import size_dims, size_estimate
from tgc.options import Options
from tgc.ir.passes import Pass
from tgc.lower.indexing import edge_size
from tgc.lower.alias import plain_copy, split_order


@dataclass(frozen=True)
class Layout(Pass[Lowered, Lowered]):
    """Choose buffer axis orders and loop orders; make GEMM operands BLAS-ready."""

    name = "layout"
    takes = gives = "lowered"
    rep_size: int | None = None   # a symbolic dim's size when ranking strides and groups (None: options.rep_size)

    def options_error(self, ir) -> str | None:
        """A `rep_size` below 1: it stands for a dim's size."""
        if self.rep_size is not None and self.rep_size < 1:
            return f"rep_size={self.rep_size}: a dim's size, 1 or more"
        return None

    def run(self, low: Lowered, options: Options) -> Lowered:
        out = low.staged("layout")
        guess = options.rep_size if self.rep_size is None else self.rep_size
        _order_buffers(out, guess, options)
        _fix_gemms(out, guess, options)
        out.kernels = [_tighten(_order_loops(out, k, guess)) if isinstance(k, LoopKernel) else k
                       for k in out.kernels]
        return out


# ------------------------------------------------------------------ buffer orders


def _order_buffers(low: Lowered, guess: int, options: Options) -> None:
    gemm_uses: dict[str, tuple[GemmKernel, str]] = {}
    for k in low.kernels:
        if isinstance(k, GemmKernel):
            gemm_uses.setdefault(k.a.buf, (k, "a"))
            gemm_uses.setdefault(k.b.buf, (k, "b"))
    complex_bufs = {b for k in low.kernels if isinstance(k, GemmKernel) and k.cplx is not None
                    for b in (k.out, k.a.buf, k.b.buf)}
    readers = _loop_readers(low)
    copies = _split_copies(low)
    for k in low.kernels:
        if isinstance(k, StepLoop):   # a loop's buffers have the orders its step was built for
            continue
        buf = low.buffers[k.out]
        if buf.order is not None:
            continue
        if buf.prefer is not None:
            buf.order = buf.prefer
        elif isinstance(k, GemmKernel) and k.cplx is not None:
            buf.order = _gemm_result_order(low, k, guess) + (RI,)
            if buf.name in gemm_uses:
                want = _gemm_operand_order(low, *gemm_uses[buf.name], buf.order)
                other = gemm_uses[buf.name][0]
                mine = _demote(k, k.matrix_order(want))
                if other.matrix_order(want) is not None and k.matrix_order(want) is not None \
                        and matrix_form(k.matrix_order(want), mine.m, mine.n) is not None:
                    buf.order = want
        elif isinstance(k, GemmKernel):
            buf.order = _gemm_result_order(low, k, guess)
            if buf.name in gemm_uses:   # written as the GEMM that reads it wants, where it can be
                want = _gemm_operand_order(low, *gemm_uses[buf.name], buf.order)
                mine = _demote(k, want)
                if matrix_form(want, mine.m, mine.n) is not None:
                    buf.order = want
            else:
                buf.order = _suit_readers(low, k, buf.order, guess, options.layout_short_sum,
                                           options.layout_tie_rows, readers.get(k.out, ()))
            if buf.name in copies:
                _split_of_copy(low, k, buf, copies[buf.name], gemm_uses)
        elif buf.name in gemm_uses:
            buf.order = _gemm_operand_order(low, *gemm_uses[buf.name], _follow_loads(low, k, buf))
        else:
            buf.order = _follow_loads(low, k, buf)
        if buf.name in complex_bufs and RI in buf.order and buf.order[-1] != RI:
            buf.order = tuple(e for e in buf.order if e != RI) + (RI,)   # a complex matrix's pairs


def _split_copies(low: Lowered) -> dict[str, LoopKernel]:
    """buffer -> the plain copy (`tgc.lower.alias.plain_copy`) that is the only kernel
    reading it."""
    readers: dict[str, list] = {}
    for k in low.kernels:
        for b in k.buffers_read():
            readers.setdefault(b, []).append(k)
    return {b: ks[0] for b, ks in readers.items() if len(ks) == 1 and plain_copy(low, ks[0]) == b}


def _split_of_copy(low: Lowered, k: GemmKernel, buf: Buffer, c: LoopKernel, gemm_uses) -> None:
    """A GEMM result that only a copy splitting or merging edges reads (attention's heads
    merged into the width): the order whose element offsets are the copy's output's
    (`tgc.lower.alias.split_order`: `[batch, t, head, hd]` for `[batch, t, c2]`), where
    the GEMM can write it, so that the `alias` stage drops the copy. The output's order is
    chosen first, as it would be when its turn came (`buf`'s order so far is what its
    loads follow)."""
    out = low.buffers[c.out]
    order = out.order
    if order is None:
        order = _follow_loads(low, c, out)
        if out.name in gemm_uses:
            order = _gemm_operand_order(low, *gemm_uses[out.name], order)
    want = split_order(low, c, order)
    if want is None or sorted(want) != sorted(buf.edges):
        return
    mine = _demote(k, want)
    if matrix_form(want, mine.m, mine.n) is None:
        return
    buf.order, out.order = want, order


def _loop_readers(low: Lowered) -> dict[str, list[LoopKernel]]:
    """buffer -> the loop kernels that read it, in kernel order: asked once per GEMM
    result, a scan of every kernel each time made the pass quadratic in the program's
    length (48 unrolled GPT blocks: 500 GEMMs x 7,000 kernels)."""
    readers: dict[str, list[LoopKernel]] = {}
    for r in low.kernels:
        if isinstance(r, LoopKernel):
            for b in r.buffers_read():
                readers.setdefault(b, []).append(r)
    return readers


def _view_order(low: Lowered, view: View, k: GemmKernel | None = None) -> tuple[str, ...] | None:
    """The view's order (as complex product `k`'s matrix sees it, when given)."""
    order = low.buffers[view.buf].order
    order = None if order is None else view.view_order(order)
    return order if k is None else k.matrix_order(order)


def _pick(order: Sequence[str] | None, group: Sequence[str]) -> tuple[str, ...]:
    """`group` in the order it has in `order` (or as given when unknown)."""
    if order is None:
        return tuple(group)
    rank = {e: i for i, e in enumerate(order)}
    return tuple(sorted(group, key=lambda e: rank.get(e, len(rank))))


def _gemm_result_order(low: Lowered, k: GemmKernel, guess: int) -> tuple[str, ...]:
    """Batch edges, then the larger of the M and N groups, the smaller innermost (a
    [tokens, features] activation keeps its features contiguous whichever operand
    BLAS sees first; an M innermost is computed as C^T = B^T A^T)."""
    va, vb = _view_order(low, k.a, k), _view_order(low, k.b, k)
    m, n = _pick(va, k.m), _pick(vb, k.n)
    env = {d: guess for d in low.module.symbolic_dims()}
    sym = set(low.module.symbolic_dims())

    def size(g):  # a group with a symbolic dim (a batch) counts as the larger on a tie
        return (math.prod(size_estimate(low.size(e), env) for e in g),
                any(d in sym for e in g for d in size_dims(low.size(e))))
    return _pick(va, k.batch) + (n + m if size(m) < size(n) else m + n)


def _suit_readers(low: Lowered, k: GemmKernel, order: tuple[str, ...], guess: int, short: int,
                  tie_rows: int, readers: Sequence[LoopKernel]) -> tuple[str, ...]:
    """A GEMM result that only loop kernels read: of its two matrix orders (batch, then
    M and N either way round), the one whose innermost edge moves with the innermost
    edge of what those readers write, where that is known (an output, an argument),
    else of the buffers they load whose order is known (`_reader_inner_vars`), so
    that their innermost loop is contiguous in both. Only when every reader is
    elementwise or sums a few terms (at most `short`: kernel taps); a longer
    sum (a softmax's) keeps the default order. A 2-D convolution's input
    gradient `dx[b, c, h, w] = sum[kw] t[b, c, h, kw, w - kw + 1]` then reads the
    GEMM's rows along `w` instead of with a stride of c x kw. BLAS computes either
    order (a transpose flag), so this changes no sum. `readers`: the loop kernels
    that read the result, in kernel order (`_loop_readers`)."""
    nb = len(k.batch)
    head, rest = order[:nb], order[nb:]
    m = tuple(e for e in rest if e in k.m)
    n = tuple(e for e in rest if e in k.n)
    if rest != m + n and rest != n + m:
        return order
    votes = {"m": 0, "n": 0}
    rows = _summed_group(low, k, m, n, guess, short, tie_rows, readers)
    if rows is not None:
        inner, other = (m, n) if rows == "m" else (n, m)
        clipped = {e for _, e, _ in k.shifts}
        if rest[-len(inner):] == inner or clipped & set(m + n):
            return order
        return head + other + inner
    for r in readers:
        if any(not isinstance(r.sizes[v], int) or r.sizes[v] > short for v in r.red):
            return order   # a longer sum (a softmax's) has its say in the default order
        for var in _reader_inner_vars(low, r, k.out):
            for load in _loads(r):
                if load.buf != k.out:
                    continue
                for e, ix in load.index:
                    if ix.coef(var) in (1, -1):
                        for g, edges in (("m", m), ("n", n)):
                            if edges and edges[-1] == e:
                                votes[g] += 1
    if votes["m"] == votes["n"]:
        return order
    inner, other = (m, n) if votes["m"] > votes["n"] else (n, m)
    if rest[-len(inner):] == inner:
        return order
    clipped = {e for _, e, _ in k.shifts}
    if any(e in clipped for e in other[1:]):
        return order
    # a clipped edge leads what stays of its group; the edges before it become batch
    # edges (`_demote`), outside the other group
    cut = next((i for i, e in enumerate(inner) if e in clipped), 0)
    return head + inner[:cut] + other + inner[cut:]


def _reader_inner_vars(low: Lowered, r: LoopKernel, result: str) -> list[str]:
    """The loop variables that move along the innermost axis of what reader `r` of
    GEMM result `result` writes, when its order is known; else of each other buffer
    it loads whose order is known (a backward GELU's temporary `dh`, ordered after the
    GEMM, follows the saved activations it reads, whose order the forward pass fixed)."""
    out_order = low.buffers[r.out].order
    refs = [(out_order, r.index)] if out_order else [
        (low.buffers[load.buf].order, load.index) for load in _loads(r)
        if load.buf != result and low.buffers[load.buf].order]
    inner = [dict(index).get(order[-1]) for order, index in refs]   # (none: a complex pair's axis)
    return [v for ix in inner if ix is not None and (v := ix.as_var()) is not None]


def _summed_group(low: Lowered, k: GemmKernel, m: tuple[str, ...], n: tuple[str, ...], guess: int,
                  short: int, tie_rows: int, readers: Sequence[LoopKernel]) -> str | None:
    """The group ("m" or "n") that the loop kernels reading GEMM `k`'s result sum
    over, each along its rows (a softmax's max, log-sum-exp and sums over the key
    edge `s` of the `[t, s]` scores), when they agree on one and it is at least as
    large as the other (on a tie, when it has at least `tie_rows` elements), which the
    size rule (`_gemm_result_order`) would put outside (on a tie, the first group):
    that group innermost makes every such row contiguous, so the reductions run along memory, and the CPU group stage keeps one
    row, not a block of columns, in its scratch (a `[64, s]` block of scores in a
    streamed loop step is otherwise stored with its short edge innermost; attention's
    square `dP[s, t]`, M = s, in a layer loop's backward step was read at a stride of
    t: 58-62 Mcycles a step for its softmax backward at nanoGPT-char's size, one
    thread, against 25 along rows; rows of 11 keys, the benchmark GPT's, are summed
    faster down the columns of a block of rows: 118-128 against 135-160 kcycles for
    its forward softmax). A reader votes when it sums a whole group (of
    more than `short` elements) and keeps the other: a full sum (a loss) has no rows.
    None when none votes, they disagree, or the summed group is the smaller."""
    env = {d: guess for d in low.module.symbolic_dims()}
    size = {g: math.prod(size_estimate(low.size(e), env) for e in edges) for g, edges in (("m", m), ("n", n))}
    found = set()
    for r in readers:
        if not r.red:
            continue
        long = {v for v in r.red if not isinstance(r.sizes[v], int) or r.sizes[v] > short}
        if not long:
            continue
        for load in _loads(r):
            if load.buf != k.out:
                continue
            summed = {e for e, ix in load.index if ix.as_var() in long}
            kept = {e for e, ix in load.index if ix.vars() and not set(ix.vars()) & set(r.red)}
            for g, edges, other in (("m", m, n), ("n", n, m)):
                if edges and set(edges) <= summed and set(other) <= kept:
                    found.add(g)
    if len(found) != 1:
        return None
    g = found.pop()
    other = size["n" if g == "m" else "m"]
    return g if size[g] > other or (size[g] == other and size[g] >= tie_rows) else None


def _demote(k: GemmKernel, vc: Sequence[str] | None) -> GemmKernel:
    """Move M/N edges that split the result's groups to the batch (a loop of calls):
    C[b, o, s] = W[o, ck] @ A[b, ck, s] is one GEMM per b."""
    if vc is None:
        return k
    clipped = {e for _, e, _ in k.shifts}
    while matrix_form(vc, k.m, k.n) is None:
        movable = [e for e in vc if e not in clipped and
                   ((e in k.m and len(k.m) > 1) or (e in k.n and len(k.n) > 1))]
        if not movable:
            break
        e = movable[0]
        k = replace(k, batch=k.batch + (e,), m=tuple(x for x in k.m if x != e),
                    n=tuple(x for x in k.n if x != e))
    return k


def _gemm_operand_order(low: Lowered, k: GemmKernel, role: str, load_order) -> tuple[str, ...]:
    view, other = (k.a, k.b) if role == "a" else (k.b, k.a)
    vo = _view_order(low, other, k)
    vc = k.matrix_order(low.buffers[k.out].order)
    k = _demote(k, vc)
    if k.cplx is not None:   # the pairs stay innermost
        load_order = tuple(e for e in load_order if e != RI)
    rows, cols = (k.m, k.k) if role == "a" else (k.k, k.n)
    by_c = (lambda g: _pick(vc, g)) if vc is not None else (lambda g: _pick(vo, g))
    want_rows = by_c(rows) if role == "a" else _pick(vo, rows)
    want_cols = _pick(vo, cols) if role == "a" else by_c(cols)
    tail = (RI,) if k.cplx is not None else ()
    form = matrix_form(tuple(e for e in view.view_order(load_order + tail) if e not in tail), rows, cols)
    if form and form[0] == want_rows and form[1] == want_cols:
        return load_order + tail
    seq = _pick(vo, k.batch + k.taps) + want_rows + want_cols
    return tuple(view.buf_edge(e) for e in seq if e in dict(view.edges)) + tail


def _loads(k: LoopKernel) -> list[Load]:
    roots = [k.body] + ([k.epilogue] if k.epilogue is not None else [])
    return [n for r in roots for n in walk(r) if isinstance(n, Load)]


def _follow_loads(low: Lowered, k: LoopKernel, buf: Buffer) -> tuple[str, ...]:
    """Order `buf`'s edges so that the kernel computing it walks its loads along their
    layouts: every loaded buffer gives each edge it indexes its depth there (0 for
    the innermost axis; an axis indexed by `s + k` gives both), and the edges go
    outermost first by decreasing mean depth. A row statistic [batch, t] read next to
    a [t, c] table thus leaves c innermost (where its reduction ran) rather than
    outermost. Edges no load indexes go outermost; ties keep the declaration order."""
    var_of = {ix.as_var(): e for e, ix in k.index if ix.as_var() is not None}
    depths: dict[str, list[int]] = {}
    for load in _loads(k):
        order = low.buffers[load.buf].order or ()
        index = dict(load.index)
        seen: dict[str, int] = {}
        for pos, e in enumerate(order):
            for atom, _ in index[e].terms:
                if isinstance(atom, str) and atom in var_of:
                    seen.setdefault(var_of[atom], len(order) - 1 - pos)
        for e, d in seen.items():
            depths.setdefault(e, []).append(d)
    canon = list(low.module.order_edges(buf.edges))

    def key(e):
        d = depths.get(e)
        return (0, 0.0, canon.index(e)) if d is None else (1, -sum(d) / len(d), canon.index(e))

    return tuple(sorted(buf.edges, key=key))


# ------------------------------------------------------------------ GEMMs


def _fix_gemms(low: Lowered, guess: int, options: Options) -> None:
    kernels = []
    for k in low.kernels:
        if isinstance(k, GemmKernel):
            kernels += _fix_gemm(low, k, guess, options)
        else:
            kernels.append(k)
    low.kernels = kernels


def _fix_gemm(low: Lowered, k: GemmKernel, guess: int, options: Options) -> list:
    if k.cplx is not None:
        return _fix_complex_gemm(low, k)
    va, vb = _view_order(low, k.a), _view_order(low, k.b)
    vc = low.buffers[k.out].order
    k = _demote(k, vc)
    k = _fit_clips(k, va, vb, vc)
    k = _taps_for_split_k(low, k, va, vb, guess, options.layout_tap_min_k)
    fa, fb, fc = matrix_form(va, k.m, k.k), matrix_form(vb, k.k, k.n), matrix_form(vc, k.m, k.n)
    m = fc[0] if fc else fa[0] if fa else k.m
    n = fc[1] if fc else fb[1] if fb else k.n
    kk = fa[1] if fa else fb[0] if fb else k.k
    clipped = {e for _, e, _ in k.shifts}   # a clipped edge leads its group, copies included
    m, n, kk = (tuple(sorted(g, key=lambda e: e not in clipped)) for g in (m, n, kk))
    before, after = [], []
    a, b, out = k.a, k.b, k.out
    # a copy holds its matrix the way the product reads it: when C is column-major
    # (computed as C^T = B^T A^T), B^T's rows with K contiguous and A^T's with M
    # (every GEMM reads either way; tgc's own CPU kernel needs its left operand's K
    # contiguous: conv1d's input gradient)
    flipped = fc is not None and not fc[2]
    if not fa or fa[:2] != (m, kk):
        a = _copy_view(low, k.a, _pick(va, _present(k.a, k.batch + k.taps)) + (kk + m if flipped else m + kk), before)
    if not fb or fb[:2] != (kk, n):
        b = _copy_view(low, k.b, _pick(vb, _present(k.b, k.batch + k.taps)) + (n + kk if flipped else kk + n), before)
    tall = fc is not None and _tall_result(low, k, fc, guess, options)
    if not fc or fc[:2] != (m, n) or tall:
        out = low.fresh("t")
        inner = (n + m if fc[2] else m + n) if tall else m + n
        low.buffers[out] = Buffer(out, low.dtype, low.buffers[k.out].edges, "temp",
                                  order=_pick(vc, k.batch) + inner)
        after.append(_copy(low, k.out, View(out, tuple((e, e) for e in low.buffers[out].edges))))
    return before + [replace(k, a=a, b=b, out=out, m=m, n=n, k=kk)] + after


def _tall_result(low: Lowered, k: GemmKernel, fc, guess: int, options: Options) -> bool:
    """Whether to compute the product into a temporary that holds its matrix the
    other way round, then copy it into the result: when the result's order (an
    argument's or output's, fixed) makes the matrix BLAS writes (C': rows by its
    contiguous columns) at least `options.layout_tall` times wider than tall, and each
    element sums `options.layout_tall_min_k` terms or more (over K and the taps), so the copy costs nothing next to
    the product. numpy's OpenBLAS runs tall C' faster on the reference machine (one
    thread, minimum of 300 calls): 64 x 288 x 1024 with B transposed at 130 GFLOP/s,
    the same product as 288 x 64 at 177. A 2-D convolution's kernel gradient
    `dK[cout, (cin, kh, kw)]` is such a product. Only the layout of the product
    changes, not its sum."""
    if low.buffers[k.out].kind == "temp" or k.shifts or k.cplx is not None:
        return False
    env = {d: guess for d in low.module.symbolic_dims()}

    def size(g):
        return math.prod(size_estimate(low.size(e), env) for e in g)
    rows, cols = (fc[0], fc[1]) if fc[2] else (fc[1], fc[0])
    return (size(cols) >= options.layout_tall * size(rows)
            and size(k.k) * size(k.taps) >= options.layout_tall_min_k)


def _fix_complex_gemm(low: Lowered, k: GemmKernel) -> list:
    """`_fix_gemm` for a complex product (no taps or shifts): each buffer must hold its
    matrix of pairs with `re.im` innermost; one that does not is copied into one that
    does (the pairs stay together, so the copy moves whole complex numbers)."""
    va, vb, vc = _view_order(low, k.a, k), _view_order(low, k.b, k), k.matrix_order(low.buffers[k.out].order)
    k = _demote(k, vc)
    fa = matrix_form(va, k.m, k.k) if va is not None else None
    fb = matrix_form(vb, k.k, k.n) if vb is not None else None
    fc = matrix_form(vc, k.m, k.n) if vc is not None else None
    m = fc[0] if fc else fa[0] if fa else k.m
    n = fc[1] if fc else fb[1] if fb else k.n
    kk = fa[1] if fa else fb[0] if fb else k.k
    before, after = [], []
    a, b, out = k.a, k.b, k.out
    if not fa or fa[:2] != (m, kk):
        a = _copy_view(low, k.a, _pick(va, _present(k.a, k.batch)) + m + kk + (RI,), before)
    if not fb or fb[:2] != (kk, n):
        b = _copy_view(low, k.b, _pick(vb, _present(k.b, k.batch)) + kk + n + (RI,), before)
    if not fc or fc[:2] != (m, n):
        out = low.fresh("t")
        low.buffers[out] = Buffer(out, low.dtype, low.buffers[k.out].edges, "temp",
                                  order=_pick(vc, k.batch) + m + n + (RI,))
        after.append(_copy(low, k.out, View(out, tuple((e, e) for e in low.buffers[out].edges))))
    return before + [replace(k, a=a, b=b, out=out, m=m, n=n, k=kk)] + after


def _fit_clips(k: GemmKernel, va, vb, vc) -> GemmKernel:
    """A shifted edge clips its group's range: with other edges in the group
    (`y[b, o, (ho, wo)] += W[o, (c, kw)] @ x[b, (c, kw), (ho + kh - 1, wo)]`) it must
    be the group's outermost edge in each buffer holding the group, so that its
    clipped range is one run of the merged group. Where it is not, the group's other
    edges become loops of calls (M and N edges batch edges, K edges taps), as in a
    one-edge group."""
    clipped = {e for _, e, _ in k.shifts}
    holders = {"m": (va, vc), "n": (vb, vc), "k": (va, vb)}
    for name, orders in holders.items():
        g = getattr(k, name)
        cut = clipped & set(g)
        if not cut or len(g) == 1:
            continue
        e = cut.pop()
        keep = None
        for o in orders:   # the run of the group's edges from e inward, common to every holder
            run = _run_from(o, g, e) if o is not None else (e,)
            keep = run if keep is None else tuple(a for a, b in zip(keep, run) if a == b)
            keep = keep[:next((i for i, (a, b) in enumerate(zip(keep, run)) if a != b), len(keep))]
        rest = tuple(x for x in g if x not in keep)
        if not rest:
            continue
        more = {"batch": k.batch + rest} if name in "mn" else {"taps": k.taps + rest}
        k = replace(k, **{name: tuple(x for x in g if x in keep)}, **more)
    return k


def _run_from(order, group, e) -> tuple[str, ...]:
    """`e` and the edges of `group` that follow it in `order` without a gap."""
    run = [e]
    for x in order[order.index(e) + 1:]:
        if x not in group:
            break
        run.append(x)
    return tuple(run)


def _taps_for_split_k(low: Lowered, k: GemmKernel, va, vb, guess: int, min_k: int) -> GemmKernel:
    """Where an operand's order splits the K group (`dK[o, c] = sum_{b, s} dy[b, o, s]
    col[b, c, s]`: `b` is outside `o` and `c`), the outermost K edges become taps,
    loops of calls that add into the result, when what is left of K is at least
    `min_k` long: one accumulating call per batch index instead of a transposing
    copy of both operands (a 2-D convolution's kernel gradient)."""
    if va is None or vb is None or (matrix_form(va, k.m, k.k) and matrix_form(vb, k.k, k.n)):
        return k
    clipped = {e for _, e, _ in k.shifts}
    free = [e for e in k.k if e not in clipped]
    env = {d: guess for d in low.module.symbolic_dims()}
    best = None
    for n in range(1, len(free) + 1):
        for out in itertools.combinations(free, n):
            rest = tuple(e for e in k.k if e not in out)
            if not rest or not (matrix_form(va, k.m, rest) and matrix_form(vb, rest, k.n)):
                continue
            length = math.prod(size_estimate(low.size(e), env) for e in rest)
            if length >= min_k and (best is None or length > best[0]):
                best = (length, out, rest)
    if best is None:
        return k
    _, out, rest = best
    return replace(k, k=rest, taps=k.taps + tuple(e for e in va if e in out))


def _present(view: View, edges) -> tuple[str, ...]:
    return tuple(e for e in edges if e in dict(view.edges))


def _copy_view(low: Lowered, view: View, order: tuple[str, ...], kernels: list) -> View:
    src = low.buffers[view.buf]
    name = low.fresh("t")
    low.buffers[name] = Buffer(name, src.dtype, src.edges, "temp",
                               order=tuple(view.buf_edge(e) for e in order))
    kernels.append(_copy(low, name, View(view.buf, tuple((e, e) for e in src.edges))))
    return View(name, view.edges)


def _copy(low: Lowered, dst: str, src: View) -> LoopKernel:
    edges = low.buffers[dst].edges
    index = tuple((e, Ix.var(e)) for e in edges)
    body = Load(src.buf, tuple((src.buf_edge(e), Ix.var(e)) for e in edges))
    sizes = {e: edge_size(low.module, e) for e in edges}
    return LoopKernel(dst, index, edges, sizes, body, note="transposing copy for BLAS")


# ------------------------------------------------------------------ loop orders


def _accesses(low: Lowered, k: LoopKernel, guess: int) -> list[tuple[float, list[tuple[Ix, int]]]]:
    """(weight, [(index, axis stride)]) for the store and every load of the kernel."""
    def axes(buf: str, index) -> list[tuple[Ix, int]]:
        b = low.buffers[buf]
        order = b.order or b.edges
        idx = dict(index)
        strides, s = [], 1
        for e in reversed(order):
            strides.append((idx[e], s))
            n = edge_size(low.module, e) if e in low.module.edges else guess
            s *= n if isinstance(n, int) else guess
        return strides

    out = [(2.0, axes(k.out, k.index))]
    roots = [k.body] + ([k.epilogue] if k.epilogue is not None else [])
    for r in roots:
        for node in walk(r):
            if isinstance(node, Load):
                out.append((1.0, axes(node.buf, node.index)))
                out += [(1.0, axes(a.buf, a.index)) for _, ix in node.index for a in _idloads(ix)]
            elif isinstance(node, Mask):
                out += [(1.0, axes(a.buf, a.index)) for c in node.conds for a in _idloads(c.ix)]
    return out


def _idloads(ix: Ix) -> list[IdLoad]:
    return [a for a, _ in ix.terms if isinstance(a, IdLoad)]


def _stride(var: str, axes: list[tuple[Ix, int]], guess: int) -> int:
    """How far one step of `var` moves the accesses `axes`, summed (elements). A
    gather (an IdLoad) moves unpredictably: 1 << 20. A floor division
    `floor((c var + ...) / d)` moves by c / d per step on average (`_floor_stride`):
    a block index `t - 256 floor(t / 256)`, `floor(t / 256)` of a buffer in blocks of
    256 rows moves a row per step of `t` and a block per 256 steps, so `t` sits
    inside the block's batch and head edges as in the unblocked buffer."""
    total = 0
    for ix, stride in axes:
        for atom, coef in ix.terms:
            k = abs(coef if isinstance(coef, int) else guess)
            if atom == var:
                total += k * stride
            elif isinstance(atom, FloorDiv) and var in Ix.of(atom).vars():
                total += _floor_stride(var, atom, k * stride)
            elif isinstance(atom, IdLoad) and var in Ix.of(atom).vars():
                total += 1 << 20
    return total


def _floor_stride(var: str, atom: FloorDiv, scale: int) -> int:
    """The mean stride of `scale * floor(num / den)` per step of `var`: scale x
    |coef of var in num| / den, at least 1 (exact: floor moves by c / d per step on
    average), when `num` is linear in `var` with a constant integer coefficient and
    `den` a positive integer; else 1 << 20 (unknown, as a gather)."""
    c = atom.num.coef(var)
    nested = any(not isinstance(a, str) and var in Ix.of(a).vars() for a, _ in atom.num.terms)
    if nested or not isinstance(c, int) or not isinstance(atom.den, int) or atom.den <= 0:
        return 1 << 20
    return max(1, abs(c) * scale // atom.den)


def _contiguity_cost(s: int) -> int:
    return 0 if s == 0 else 1 if s == 1 else 4 if s <= 8 else 16


def _order_loops(low: Lowered, k: LoopKernel, guess: int) -> LoopKernel:
    if not k.loops:
        return k
    acc = _accesses(low, k, guess)
    strides = {v: [(w, _stride(v, axes, guess)) for w, axes in acc] for v in k.loops}
    canon = {v: i for i, v in enumerate(k.loops)}

    def inner_key(v):  # cheap strides; a loop of a few iterations vectorizes poorly
        cost = sum(w * _contiguity_cost(s) for w, s in strides[v])
        short = isinstance(k.sizes[v], int) and k.sizes[v] < 8
        return (cost + (3 if short else 0), v not in k.red, -canon[v])

    def outer_key(v):  # larger total stride -> further out
        return (-sum(w * s for w, s in strides[v]), canon[v])

    # logsumexp keeps its reduction in registers: its reduced loops go innermost
    inner = min(k.red if k.reduce == "logsumexp" and k.red else k.loops, key=inner_key)
    rest = [v for v in k.loops if v != inner]
    if inner in k.red and not k.scatter:
        kept = sorted((v for v in rest if v not in k.red), key=outer_key)
        red = sorted((v for v in rest if v in k.red), key=outer_key)
        loops = kept + red + [inner]
    else:
        loops = sorted(rest, key=outer_key) + [inner]
    return replace(k, loops=tuple(loops))


# ------------------------------------------------------------------ loop bounds


def _tighten(k: LoopKernel) -> LoopKernel:
    """Move mask conditions on summed loops into those loops' bounds."""
    if k.reduce != "sum" or k.scatter or not isinstance(k.body, Mask):
        return k
    pos = {v: i for i, v in enumerate(k.loops)}
    keep, bounds = [], {}
    for c in k.body.conds:
        found = _as_bound(c, pos, k.red)
        if found is None:
            keep.append(c)
            continue
        v, lo, hi = found
        old_lo, old_hi = bounds.get(v, ((), ()))
        bounds[v] = (old_lo + lo, old_hi + hi)
    if not bounds:
        return k
    body = Mask(tuple(keep), k.body.arg) if keep else k.body.arg
    return replace(k, body=body, bounds=bounds)


def _as_bound(c, pos: dict, red) -> tuple[str, tuple, tuple] | None:
    """`a*v + R op 0` (a an integer, R of loops outside v) as bounds on the summed
    loop v. With a = +-1, v op' -a R; with |a| > 1 (a stride), floor divisions:
    `a v + R >= 0` is `v >= -floor(R / a)`, `a v + R < 0` is `v < floor((-R - 1) / a) + 1`
    (a > 0; a < 0 mirrors the relation). An equality with |a| > 1 stays a mask."""
    if c.op == "!=":
        return None
    mirror = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "=": "="}
    for v in sorted(red, key=lambda x: -pos[x]):
        a = c.ix.coef(v)
        if not isinstance(a, int) or a == 0 or (abs(a) > 1 and c.op == "="):
            continue
        rest = Ix(tuple(t for t in c.ix.terms if t[0] != v), c.ix.const)
        if v in rest.vars() or any(pos[x] >= pos[v] for x in rest.vars()):
            continue
        if a in (1, -1):
            r = rest.scaled(-a)  # v op' r, with op' = op (a = 1) or mirrored (a = -1)
            op = c.op if a == 1 else mirror[c.op]
            one = r.plus_const(1)
            lo, hi = {"<": ((), (r,)), "<=": ((), (one,)), ">": ((one,), ()), ">=": ((r,), ()),
                      "=": ((r,), (one,))}[op]
            return v, lo, hi
        op, k, r = (c.op, a, rest) if a > 0 else (mirror[c.op], -a, rest.scaled(-1))   # k v + r op 0, k > 1

        def fl(x: Ix) -> Ix:
            return Ix.of(FloorDiv(x, k))
        if op in (">=", ">"):
            return v, (fl(r if op == ">=" else r.plus_const(-1)).scaled(-1),), ()
        return v, (), (fl(r.scaled(-1) if op == "<=" else r.scaled(-1).plus_const(-1)).plus_const(1),)
    return None
