"""Rematerialization: the backward pass recomputes `checkpoint(x)` instead of keeping it.

`adjoint` calls `rematerialize(f, cotangents)` after each reverse sweep over the
primal graph of `f`. For every `checkpoint(x)` in that graph (the `map[checkpoint]`
marker the front end builds), the backward part (the cotangent values, which are not
in the primal graph) stops reading the primal values of the checkpoint's *region*
and reads a recomputed copy instead. So the primal values of the region are last
read by the forward pass and die there; the copy is computed from what the backward
keeps anyway, when the backward needs it.

The region of `checkpoint(x)`: the marker and x, then, walking down x's graph from
the top, every value that is not a leaf (argument, constant, size, indicator), that
a region value uses, and that either only region values use in the primal graph (it
exists only to compute x) or that the backward never reads (keeping it for the copy
would cost what the checkpoint saves). The region's other operands are the boundary:
the copy reads them as they are (kept, as the backward reads them anyway or the
forward uses them elsewhere).

The copy is the region rebuilt with every boundary operand `b` read as
`recompute(b)` (`map[recompute]`, the identity; constants and i32 ids are read as
they are: a copy built from those alone would be the original, which is then read). Values are hash-consed, so without
that marker the copy would be the region's values themselves; with it, the copy is
distinct through every later pass (no rule removes `recompute`) and lowering reads
`recompute(b)` as `b` itself (`tgc.lower.views.is_identity`: a view of b's buffer, no copy).

Exact: the copy computes the same operations on the same values in the same order
as the original, and `checkpoint` and `recompute` are identities, so values and
derivatives are bit-for-bit those without the checkpoint (later passes treat the
copy like any other value). Terminates: one walk over the finite primal graph per
checkpoint and one rebuild of the finite cotangent graph.
"""
from __future__ import annotations

from collections import defaultdict

from tgc.ir import values as V
from tgc.ir.values import Value, rebuild_same, topo_order

LEAVES = ("arg", "const", "size", "indicator")


def is_checkpoint(v: Value) -> bool:
    return v.op == "map" and v.attrs[0] == "checkpoint"


def regions(primal: list[Value], backward: list[Value]) -> set[int]:
    """ids of the primal values (`primal`: f's graph, operands first) that the backward
    (`backward`: the cotangents' graphs) must not read."""
    in_primal = {id(v) for v in primal}
    primal_users: dict[int, list[int]] = defaultdict(list)
    for v in primal:
        for o in v.operands:
            primal_users[id(o)].append(id(v))
    read_back: set[int] = {id(o) for v in backward if id(v) not in in_primal for o in v.operands}
    region: set[int] = set()
    for c in (v for v in primal if is_checkpoint(v)):
        region.add(id(c))
        add_region(c.operands[0], primal_users, read_back, region)
    return region


def add_region(x: Value, primal_users: dict[int, list[int]], read_back: set[int], region: set[int]) -> None:
    """Add to `region` the ids of x and of the values below it that `checkpoint(x)`
    recomputes (the module docstring's rule; `tgc.budget` asks it of candidates)."""
    if x.op not in LEAVES:
        region.add(id(x))
    for v in reversed(topo_order([x])):   # users before operands
        users = primal_users[id(v)]
        if v.op in LEAVES or not any(u in region for u in users):   # a leaf, or below the boundary
            continue
        if all(u in region for u in users) or id(v) not in read_back:
            region.add(id(v))


def rematerialize(f: Value | list[Value], cotangents: dict[int, Value | None]) -> dict[int, Value | None]:
    """`cotangents` (id -> value, from a reverse sweep over f, or over several roots)
    reading recomputed copies of the checkpoints' regions instead of their primal values."""
    primal = topo_order(f if isinstance(f, list) else [f])
    if not any(is_checkpoint(v) for v in primal):
        return cotangents
    roots = [ct for ct in cotangents.values() if ct is not None]
    region = regions(primal, topo_order(roots))
    in_primal = {id(v) for v in primal}
    copies: dict[int, Value] = {}

    def read(o: Value) -> Value:
        """What the copy reads for the primal operand o."""
        if id(o) in region:
            return copies[id(o)]
        if o.op in LEAVES[1:] or o.dtype == "i32":   # constants; ids (only gathers read them)
            return o
        return V.map_("recompute", o)

    for v in primal:   # operands first: every region operand is copied before its users
        if id(v) in region:
            copies[id(v)] = rebuild_same(v, tuple(read(o) for o in v.operands))

    def fn(v: Value, ops: tuple[Value, ...]) -> Value:
        if id(v) in in_primal:
            return v
        return rebuild_same(v, tuple(copies.get(id(o), n) for o, n in zip(v.operands, ops)))

    memo = V.rebuild(roots, fn)
    return {k: None if ct is None else copies.get(id(ct), memo[id(ct)]) for k, ct in cotangents.items()}
