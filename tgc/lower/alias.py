"""alias: a copy that only splits or merges edges, whose two buffers have the same
bytes in their orders, is no copy: its destination becomes a view of its source.

`Lowered` (after `layout`) -> `Lowered`. Attention's heads are merged back into the
width by a copy, `%m[batch, t, c2] = %o[batch, head, t, hd]` at `c2 = hd + 64 head`
(`[c2 = hd*head + hd]` in the source); `layout` gives a GEMM result that only such a
copy reads the split of the copy's destination order (`split_order`: `[batch, t, head,
hd]` for `[batch, t, c2]`), so the product is stored straight into the width's layout.
This pass then removes every copy kernel whose destination's element offsets equal its
source's (`same_bytes`, a proof below) and marks one of the two buffers an `alias` of
the other (`Buffer.alias`: a temporary whose bytes are another buffer's): the copy's
readers read the source's bytes in place (nanoGPT-char's layer step: 4 merge copies of
[batch, t, 384], and the split of `wo` into heads for the backward's `dO`).

A copy is rewritten when:
- it is a plain loop kernel over its output's edges (no reduction, scatter, epilogue or
  bounds; a mask only where it holds over the whole loop range, `_holds`) storing at
  the identity index one load of another buffer of the same type and byte size, or
  of more bytes, both sizes known (a prefix of it: a causal run's keys `s.1 < 1024`
  of `k[s, hd]`, copied once per run of `stream_skip` before; then only the
  destination becomes the view);
- the offsets agree (`same_bytes`): the row-major offset of the destination's element
  (its order's strides) minus that of the element the copy loads (an affine index in
  the loop variables and floor divisions of them, `c2 - 64 floor(c2 / 64)`) is zero as
  a linear form over those atoms, every coefficient a polynomial of the sizes that
  cancels exactly. So every element of the destination lies at the bytes of the source
  element the copy would store there: reading those bytes is reading the copy;
- one of the two is a temporary to alias, never aliased itself nor an alias's (but for
  an argument no kernel writes, which may have several views): the
  destination (then the source may be any buffer), or else the source (then the
  destination is an output); neither is a carry's argument or output that the loop
  binds to one buffer (`held`: the output is written in the argument's bytes);
- the source is an argument no kernel writes, or is written only as the `out` of GEMM
  kernels, all before the copy and none a recomputation (a loop kernel's output could be
  kept in registers by a backend's grouping, and `plan` moves a recomputation late past
  kernels that do not read its output: neither looks through aliases); the destination is written
  by the copy alone; nothing after the copy writes either, and nothing before it reads
  the destination; neither is an update's value (`plan` retargets those).
Then from the copy on the two hold the same values, so the copy goes and its readers
keep their loads (of the alias, at the same offsets). Exact: no value changes, the same
bytes are read. `plan` gives an alias its buffer's slot (the two alive as one).

Terminates: one pass over each program's kernels (and each loop's step), each rewrite
removing a kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tgc.ir.passes import Pass
from tgc.ir.sizes import Size, size_collect, size_op
from tgc.lower.lowered import Cond, FloorDiv, GemmKernel, Ix, Load, LoopKernel, Lowered, Mask, StepLoop, Uses
from tgc.options import Options


@dataclass(frozen=True)
class Aliases(Pass[Lowered, Lowered]):
    """Remove copies that only split or merge edges where the bytes agree (views)."""

    name = "alias"
    takes = gives = "lowered"

    def run(self, low: Lowered, options: Options) -> Lowered:
        out = low.staged("alias")
        _alias(out, frozenset())
        return out


def _alias(low: Lowered, held: frozenset[str]) -> None:
    kernels = []
    for k in low.kernels:
        if isinstance(k, StepLoop):
            step = k.step.staged("alias")
            outs = {b.index: b.name for b in step.buffers.values() if b.kind == "out"}
            args = list(step.module.args)
            inplace = [c for c in range(k.carries) if k.outs[c].buf == k.args[c].buf]
            _alias(step, frozenset([outs[c] for c in inplace] + [args[c] for c in inplace]))
            k = replace(k, step=step)
        kernels.append(k)
    low.kernels = kernels
    uses = Uses(low.kernels)
    updates = {u.target for u in low.module.updates}
    update_values = {k.body.buf for k in low.kernels if isinstance(k, LoopKernel) and isinstance(k.body, Load)
                     and k.out in updates}
    for i, c in enumerate(list(uses.slots)):
        src = copy_source(low, c)
        if src is None:
            continue
        dst = c.out
        pair = _which(low, src, dst, held)
        if pair is None or {src, dst} & (updates | update_values):
            continue
        if any(b.alias in (src, dst) for b in low.buffers.values()) and not (
                pair == (dst, src) and low.buffers[src].kind == "arg" and not uses.writers(src)):
            continue   # (an argument no kernel writes may have several views: a causal stream's
            # runs each read a prefix of the keys)
        if not _writes_allow(low, uses, i, src, dst) or not same_bytes(low, c):
            continue
        view, base = pair
        if view != dst and prefix(low, src, dst):
            continue   # the source would view the output's bytes and more
        low.buffers[view].alias = base
        uses.set(i, None)
    low.kernels = uses.kernels()


def _which(low: Lowered, src: str, dst: str, held: frozenset[str]) -> tuple[str, str] | None:
    """(the temporary that becomes the alias, the buffer it views), or None."""
    s, d = low.buffers[src], low.buffers[dst]
    if s.alias is not None or d.alias is not None or s.dtype != d.dtype or src in held:
        return None
    if d.kind == "temp":
        return dst, src
    if s.kind == "temp" and d.kind == "out" and dst not in held:
        return src, dst
    return None


def _writes_allow(low: Lowered, uses: Uses, i: int, src: str, dst: str) -> bool:
    s = low.buffers[src]
    src_writers = uses.writers(src)
    if s.kind == "arg":
        if src_writers:
            return False
    elif not src_writers or src_writers[-1] >= i or not all(
            isinstance(uses.slots[j], GemmKernel) and uses.slots[j].out == src
            and uses.slots[j].note != "recompute" for j in src_writers):
        return False   # (plan moves a recomputation late, past kernels that do not read its
        # output by name: not past the alias's readers)
    return uses.writers(dst) == [i] and not uses.readers(dst, hi=i)


def plain_copy(low: Lowered, c) -> str | None:
    """The buffer that loop kernel `c` copies into its whole output, element for element
    (one load at an index of the loop variables, stored at the identity index over the
    output's edges), or None."""
    if not isinstance(c, LoopKernel) or c.reduce or c.red or c.scatter or c.epilogue is not None or c.bounds:
        return None
    load = _load(c)
    if load is None or load.buf == c.out or c.out not in low.buffers:
        return None
    vars_ = [_var(ix) for _, ix in c.index]
    if None in vars_ or sorted(vars_) != sorted(c.loops) or len(set(vars_)) != len(vars_):
        return None
    if any(not _equal(c.sizes[v], low.size(e)) for (e, _), v in zip(c.index, vars_)):
        return None
    if isinstance(c.body, Mask) and not all(_holds(cond, c.sizes) for cond in c.body.conds):
        return None
    return load.buf


def _load(c: LoopKernel) -> Load | None:
    """The copy's load: its body, or under a mask (`_holds` checks the mask)."""
    body = c.body.arg if isinstance(c.body, Mask) else c.body
    return body if isinstance(body, Load) else None


def _var(ix: Ix) -> str | None:
    """The loop variable `ix` is, with a constant that is zero however it is written
    (`(-1) * (hd * 0)`: a symbolic program's unsimplified offsets), else None."""
    if len(ix.terms) == 1 and isinstance(ix.terms[0][0], str) and _equal(ix.terms[0][1], 1) and _zero(ix.const):
        return ix.terms[0][0]
    return None


def _holds(cond: Cond, sizes) -> bool:
    """Whether `cond` holds over the whole loop range of its one variable v: `v + k >= 0`
    with k zero, `v + k < 0` with k = -size(v) (a symbolic program's split leaves such
    masks on a copy, `c2 >= 0` and `c2 - hd * head < 0`)."""
    ix = cond.ix
    if len(ix.terms) != 1 or not isinstance(ix.terms[0][0], str) or not _equal(ix.terms[0][1], 1):
        return False
    v = ix.terms[0][0]
    if v not in sizes:
        return False
    if cond.op == ">=":
        return _zero(ix.const)
    if cond.op == "<":
        return _zero(size_op("+", ix.const, sizes[v]))
    return False


def copy_source(low: Lowered, c) -> str | None:
    """`plain_copy`'s source, when it and the copy's output have their orders, one type
    and one byte size, or the output fewer bytes than the source, both sizes known
    (a prefix: `prefix`); else None."""
    if plain_copy(low, c) is None:
        return None
    src, out = low.buffers[_load(c).buf], low.buffers[c.out]
    if src.order is None or out.order is None or src.dtype != out.dtype:
        return None
    if not _equal(low.nbytes(src), low.nbytes(out)) and not prefix(low, src.name, out.name):
        return None
    return src.name


def prefix(low: Lowered, base: str, view: str) -> bool:
    """Whether buffer `view` has fewer bytes than `base`, both sizes known integers (the
    copy of a causal run's keys, `%w[s.1, hd] = %k[s.1, hd]` with `s.1` the first 1024 of
    8192 keys: its bytes are `k`'s first ones, once `same_bytes` shows the offsets agree)."""
    a, b = low.nbytes(low.buffers[view]), low.nbytes(low.buffers[base])
    return isinstance(a, int) and isinstance(b, int) and a < b


def _strides(low: Lowered, order) -> dict[str, Size]:
    out: dict[str, Size] = {}
    at: Size = 1
    for e in reversed(order):
        out[e] = at
        at = size_op("*", at, low.size(e))
    return out


def _offset(low: Lowered, order, index) -> Ix:
    strides = _strides(low, order)
    total = Ix()
    for e, ix in index:
        total = total.plus(ix.scaled(strides[e]))
    return total


def _equal(a: Size, b: Size) -> bool:
    """Whether two sizes are equal at every binding of the dims: the same expression, or
    polynomials whose difference collects to 0 (`size_collect`: exact integer terms)."""
    return a == b or size_collect(size_op("-", a, b)) == 0


def _zero(s: Size) -> bool:
    return _equal(s, 0)


def same_bytes(low: Lowered, c: LoopKernel) -> bool:
    """Whether copy `c` stores each element of its output at the row-major offset (in
    the output's order) of the element it loads (in the source's order): the offsets'
    difference, a linear form over the loop variables and floor divisions, is zero
    term by term, each coefficient a polynomial of the sizes that cancels."""
    load = _load(c)
    diff = _offset(low, low.buffers[load.buf].order, load.index).plus(
        _offset(low, low.buffers[c.out].order, c.index), -1)
    return _zero(diff.const) and all(_zero(coef) for _, coef in diff.terms)


def split_order(low: Lowered, c: LoopKernel, dst_order) -> tuple[str, ...] | None:
    """The order of copy `c`'s source that puts each element at its destination's
    offset when the destination has order `dst_order`: each destination edge replaced
    by the source edges its index splits it into (`floor(c2 / 64)` before
    `c2 - 64 floor(c2 / 64)`), or None when the copy is no such split."""
    parts: dict[str, list[tuple[int, str]]] = {}
    var_edge = {_var(ix): e for e, ix in c.index}
    for e, ix in _load(c).index:
        whole = _var(ix)
        if whole is not None:
            parts.setdefault(var_edge.get(whole, ""), []).append((0, e))
            continue
        atoms = [a for a, _ in ix.terms]
        floors = [a for a in atoms if isinstance(a, FloorDiv)]
        names = [a for a in atoms if isinstance(a, str)]
        if len(floors) != 1 or not _zero(ix.const) or _var(floors[0].num) is None:
            return None
        v = _var(floors[0].num)
        if names == [] and len(ix.terms) == 1 and _equal(ix.terms[0][1], 1):
            parts.setdefault(var_edge.get(v, ""), []).append((0, e))   # the outer part
        elif names == [v] and _equal(ix.coef(v), 1):
            parts.setdefault(var_edge.get(v, ""), []).append((1, e))   # the inner part
        else:
            return None
    if "" in parts or set(parts) != set(dst_order):
        return None
    return tuple(e for d in dst_order for _, e in sorted(parts[d]))
