"""unsplit: an elementwise kernel that reads a GEMM's product through a split of one of
its edges is computed over the product's own edges, then copied into the split.

`Lowered` (after `layout`) -> `Lowered`, before `epilogue` and `alias`. nanoGPT's
layer step projects the queries, keys and values with one GEMM each,
`t[batch, c2, t] = h @ w`, and adds the bias as it splits the width into heads:

    loop %r5[batch, hd, head, s] = add(%p11[hd + 64*head], %t35[batch, hd + 64*head, s])

a kernel over the split edges, which `epilogue` does not take (its loads are not at
the product's own index) and `alias` does not remove (it is no plain copy): each of
the three reads the product back (1.6 MB at batch 4) and writes the heads (1.6 MB),
18 times a step. This stage rewrites such a kernel `y = f(t[split], x[split], ...)` as

    loop %u[batch, c2, t] = f(t[batch, c2, t], x[c2], ...)      # the product's edges
    loop %y[batch, hd, head, s] = %u[batch, hd + 64*head, s]    # a plain copy

when every edge of the product is indexed by one loop variable or by a mixed radix of
several (`hd + 64 head`: coefficients 1, |hd|, |hd||head|, ... covering the edge
exactly), each variable in one of them, and every other load indexes with those same
expressions (a bias `x[hd + 64 head]` becomes `x[c2]`); `u` is laid out as the
product, and the copy has the same bytes on both sides (`tgc.lower.alias.same_bytes`,
checked here: otherwise nothing changes). Then `epilogue` folds the first kernel into
the GEMM's store (the bias added as the tile is written, the product no longer
stored on its own), and `alias` makes the copy a view: the pass over the product is
gone. Only a kernel that is the product's sole reader is rewritten (a second reader
keeps the product stored, and the copy would stay).

Exact: the first kernel computes, at each element of the product, the expression the
original kernel computed at the one element of `y` that reads it (the index map is a
bijection: a mixed radix), from the same loaded values; the copy moves the bits.
Terminates: one pass over each program's kernels (and each loop's step), each kernel
rewritten at most once, into kernels this pass does not visit again.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tgc.ir.passes import Pass
from tgc.lower.alias import same_bytes
from tgc.lower.lowered import (Acc, Buffer, ExprVisitor, GemmKernel, Ix, Load, LoopKernel, Lowered, Mask, Rand,
                               StepLoop, walk)
from tgc.options import Options


@dataclass(frozen=True)
class Unsplit(Pass[Lowered, Lowered]):
    """Compute an elementwise reader of a split GEMM product over the product's edges."""

    name = "unsplit"
    takes = gives = "lowered"

    def run(self, low: Lowered, options: Options) -> Lowered:
        out = low.staged("unsplit")
        _unsplit(out)
        return out


def _unsplit(low: Lowered) -> None:
    kernels = []
    for k in low.kernels:
        if isinstance(k, StepLoop):
            step = k.step.staged("unsplit")
            _unsplit(step)
            k = replace(k, step=step)
        kernels.append(k)
    products = {k.out for k in kernels if isinstance(k, GemmKernel) and not k.epilogue
                and low.buffers[k.out].kind == "temp" and low.buffers[k.out].order is not None}
    readers: dict[str, int] = {}
    for k in kernels:
        for b in k.buffers_read():
            readers[b] = readers.get(b, 0) + 1
    out = []
    for k in kernels:
        new = _rewrite(low, k, products, readers) if isinstance(k, LoopKernel) else None
        out.extend(new or [k])
    low.kernels = out


def _rewrite(low: Lowered, k: LoopKernel, products: set[str], readers: dict[str, int]) -> list | None:
    """[u = f(over the product's edges), y = u[split]] for kernel `k`, or None."""
    if k.reduce or k.red or k.scatter or k.epilogue is not None or k.bounds:
        return None
    if any(isinstance(n, (Mask, Rand, Acc)) for n in walk(k.body)):
        return None
    if [ix.as_var() for _, ix in k.index] != [e for e, _ in k.index] or sorted(k.loops) != sorted(e for e, _ in k.index):
        return None   # not stored at the identity index over its own edges
    loads = [n for n in walk(k.body) if isinstance(n, Load)]
    ts = {ld.buf for ld in loads if ld.buf in products}
    if len(ts) != 1:
        return None
    t = ts.pop()
    if readers.get(t) != 1 or t == k.out:
        return None
    tindex = {ld.index for ld in loads if ld.buf == t}
    if len(tindex) != 1:
        return None
    tix = next(iter(tindex))
    by_ix = _bijection(low, k, tix)
    if by_ix is None or all(ix.as_var() is not None for _, ix in tix):
        return None   # no split: nothing to gain
    body = _Reindex(t, by_ix).expr(k.body)
    if body is None:
        return None
    tb, yb = low.buffers[t], low.buffers[k.out]
    u = low.fresh("u")
    low.buffers[u] = Buffer(u, yb.dtype, tb.edges, "temp", order=tb.order)
    loops = tuple(tb.order)
    first = LoopKernel(u, tuple((e, Ix.var(e)) for e in sorted(tb.edges)), loops,
                       {e: low.size(e) for e in loops}, body, note=k.note)
    copy = LoopKernel(k.out, k.index, k.loops, dict(k.sizes), Load(u, tix), note="split")
    if not same_bytes(low, copy):
        del low.buffers[u]
        return None
    return [first, copy]


def _bijection(low: Lowered, k: LoopKernel, tix) -> dict[Ix, str] | None:
    """{index expression: the product's edge it indexes} when each of the product's
    edges is indexed by one loop variable of `k` of its size, or by a mixed radix of
    several that covers it exactly, every loop variable in exactly one; else None."""
    seen: set[str] = set()
    out: dict[Ix, str] = {}
    for e, ix in tix:
        if ix.const != 0 or not ix.terms or any(not isinstance(a, str) for a, _ in ix.terms):
            return None
        terms = sorted(ix.terms, key=lambda t: t[1] if isinstance(t[1], int) else -1)
        place = 1
        for v, coef in terms:
            n = k.sizes.get(v)
            if v in seen or coef != place or not isinstance(n, int):
                return None
            seen.add(v)
            place *= n
        if place != low.size(e) or ix in out:
            return None
        out[ix] = e
    return out if seen == set(k.loops) else None


class _Reindex(ExprVisitor):
    """The expression over the product's edges: each load's index expressions replaced
    by the edge they index (None where a load has another index expression)."""

    def __init__(self, product: str, by_ix: dict[Ix, str]) -> None:
        self.product, self.by_ix = product, by_ix

    def expr_load(self, e: Load):
        index = []
        for edge, ix in e.index:
            if ix.terms == () and ix.const is not None and not ix.vars():
                index.append((edge, ix))   # a constant index
                continue
            if ix not in self.by_ix:
                return None
            index.append((edge, Ix.var(self.by_ix[ix])))
        return Load(e.buf, tuple(index))

    def _args(self, e):
        args = tuple(self.expr(a) for a in e.args)
        return None if any(a is None for a in args) else replace(e, args=args)

    expr_add = expr_mul = expr_map = _args

    def expr_const(self, e):
        return e

    expr_size_of = expr_const

    def expr_mask(self, e):   # excluded before the rewrite
        return None

    expr_acc = expr_rand = expr_mask

    def atom_var(self, a):
        return a

    atom_id_load = atom_floor_div = atom_var


assert not _Reindex.missing(), _Reindex.missing()
