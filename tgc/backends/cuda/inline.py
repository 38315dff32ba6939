"""inline_elementwise: the CUDA backends' lowering stage that computes an elementwise temporary
again in each kernel that reads it, instead of storing it and reading it back.

`Lowered` (after `cublas_operands`, before `rowgroup`) -> `Lowered`. `fuse` gives
one loop nest per materialized value, and a value two kernels read is materialized:
gelu's forward and backward store `t = tanh(...)` and read it back in the kernel
that writes `y` and in the one that writes `dx` (three kernels, nine array passes).
On a GPU an elementwise kernel is bound by memory, so computing `t` again where it is
read costs less than its store and loads: two kernels, five passes.

A temporary is computed again in its readers when:
- its writer is an elementwise loop kernel (no reduction, scatter or bounds, no
  random draw) over exactly its edges, at the identity index, of the program's float
  type (a 2-byte buffer rounds: `narrow`);
- every reader is a later loop kernel, reading it with `Load`s only (not as ids) and
  already reading every buffer the writer reads: no new array is read, one fewer is;
- no kernel between the writer and a reader writes a buffer the writer reads.
Each load of the temporary becomes the writer's body with its loop variables
substituted by the load's index; the writer and the buffer go.

Exact: the reader computes the value the writer computed, from the same inputs
(unchanged in between) in the same float type: the operations are the same, so are
the values, bar a GPU's contraction into FMAs across what was the store (none under
`--fp-strict`). Terminates: each step removes a kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tgc.ir.passes import Pass
from tgc.lower.lowered import Add, Cond, IdLoad, Ix, Load, LoopKernel, Lowered, Map, Mask, Mul, Rand, walk
from tgc.options import Options


@dataclass(frozen=True)
class InlineElementwise(Pass[Lowered, Lowered]):
    """Compute an elementwise temporary again in the kernels that read it."""

    name = "inline_elementwise"
    takes = gives = "lowered"

    def run(self, low: Lowered, options: Options) -> Lowered:
        out = low.staged("inline_elementwise")
        if not options.cuda.inline_elementwise:
            return out
        changed = True
        while changed:
            changed = False
            for i, k in enumerate(out.kernels):
                readers = _inlinable(out, i)
                if readers is None:
                    continue
                for j in readers:
                    out.kernels[j] = _inline(out.kernels[j], k)
                del out.kernels[i]
                del out.buffers[k.out]
                changed = True
                break
        return out


def _elementwise(low: Lowered, k) -> bool:
    if not (isinstance(k, LoopKernel) and not k.reduce and not k.scatter and not k.bounds and k.epilogue is None):
        return False
    b = low.buffers.get(k.out)
    if b is None or b.kind != "temp" or b.dtype != low.dtype:
        return False
    if set(k.loops) != set(b.edges) or any(ix != Ix.var(e) for e, ix in k.index):
        return False
    return not any(isinstance(n, Rand) for n in walk(k.body))


def _inlinable(low: Lowered, i: int) -> list[int] | None:
    """The readers of kernel `i`'s output, when it is computed again in each; else None."""
    k = low.kernels[i]
    if not _elementwise(low, k) or any(c.buf == k.out for c in low.checks):
        return None
    inputs = k.buffers_read()
    readers = [j for j, r in enumerate(low.kernels) if j != i and k.out in r.buffers_read()]
    if not readers or min(readers) < i:
        return None
    for j in readers:
        r = low.kernels[j]
        if not isinstance(r, LoopKernel) or not inputs <= r.buffers_read() or k.out in _id_reads(r):
            return None
        if any(w.writes() & inputs for w in low.kernels[i + 1:j]):
            return None
    return readers


def _id_reads(k: LoopKernel) -> set[str]:
    """Buffers `k` reads inside indices (ids, masks, bounds, draws) or as its output."""
    out: set[str] = {k.out}
    ixs = [ix for _, ix in k.index] + [ix for lo, hi in k.bounds.values() for ix in lo + hi]
    for root in [k.body] + ([k.epilogue] if k.epilogue is not None else []):
        for n in walk(root):
            if isinstance(n, Load):
                ixs += [ix for _, ix in n.index]
            elif isinstance(n, Mask):
                ixs += [c.ix for c in n.conds]
            elif isinstance(n, Rand):
                ixs += [n.key, n.counter] + [f for f in n.folds if isinstance(f, Ix)]
    while ixs:
        ix = ixs.pop()
        for atom, _ in ix.terms:
            if isinstance(atom, IdLoad):
                out.add(atom.buf)
                ixs += [x for _, x in atom.index]
            elif hasattr(atom, "num"):
                ixs.append(atom.num)
    return out


def _inline(reader: LoopKernel, writer: LoopKernel) -> LoopKernel:
    """`reader` with every load of the writer's output replaced by the writer's body at
    that load's index."""

    def at(load: Load):
        mapping = dict(load.index)
        return _subst(writer.body, {v: mapping[v] for v in writer.loops})

    def expr(e):
        if isinstance(e, Load):
            return at(e) if e.buf == writer.out else e
        if isinstance(e, Mask):
            return Mask(e.conds, expr(e.arg))
        if isinstance(e, (Add, Mul, Map)):
            return replace(e, args=tuple(expr(a) for a in e.args))
        return e

    return replace(reader, body=expr(reader.body),
                   epilogue=None if reader.epilogue is None else expr(reader.epilogue))


def _subst(e, mapping: dict[str, Ix]):
    """`e` with its loop variables replaced by the index expressions `mapping` gives."""
    if isinstance(e, Load):
        return Load(e.buf, tuple((b, ix.subst(mapping)) for b, ix in e.index))
    if isinstance(e, Mask):
        return Mask(tuple(Cond(c.ix.subst(mapping), c.op) for c in e.conds), _subst(e.arg, mapping))
    if isinstance(e, (Add, Mul, Map)):
        return replace(e, args=tuple(_subst(a, mapping) for a in e.args))
    return e
