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

`recompute_cheap` applies the same copying without a checkpoint to a loop's backward
step (`tgc.autodiff.loops`): a value the step would keep for it that is a cheap
elementwise function of one other kept value of its edges (and of kept values over
fewer of its edges, broadcast: a layernorm's normalized rows from the centered rows
and the rows' standard deviation) is recomputed from those values instead.

Exact: the copy computes the same operations on the same values in the same order
as the original, and `checkpoint` and `recompute` are identities, so values and
derivatives are bit-for-bit those without the checkpoint (later passes treat the
copy like any other value). Terminates: one walk over the finite primal graph per
checkpoint and one rebuild of the finite cotangent graph.
"""
from __future__ import annotations

from collections import defaultdict

from tgc.ir import values as V
from tgc.ir.ops import EXPENSIVE
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


# A kept value is recomputed from another when its expression over it is this small:
# at most CHEAP_OPS elementwise ops, none of them a transcendental (`EXPENSIVE`).
CHEAP_OPS = 8


def _elementwise(v: Value) -> bool:
    """`v` computes each element from its operands' elements at the same index (no sum,
    no gather, no draw, no marker)."""
    if v.op == "add":
        return True
    if v.op == "map":
        return v.attrs[0] not in ("checkpoint", "recompute")
    if v.op == "contract":
        return set(v.edges) == {e for o in v.operands for e in o.edges}
    return False


def _cheap_region(k: Value, stored: set[int], in_graph: set[int]) -> list[Value] | None:
    """The values (operands first) of k's expression down to one stored value of k's
    edges (and constants, and stored values over some of k's edges: a layernorm's
    row statistics, broadcast), when that expression is cheap and elementwise (its
    values over some of k's edges, of k's type); else None."""
    region: list[Value] = []
    boundary: set[int] = set()    # the stored value of k's own edges
    broadcast: set[int] = set()   # stored values of fewer edges (kept anyway: row statistics)
    seen: set[int] = set()
    edges = set(k.edges)

    def walk(v: Value) -> bool:
        if id(v) in seen:
            return True
        seen.add(id(v))
        if v.op in ("const", "size"):
            return True
        if v.dtype != k.dtype or not set(v.edges) <= edges:
            return False
        if id(v) in stored and v is not k:
            (boundary if v.edges == k.edges else broadcast).add(id(v))
            return True
        if id(v) not in in_graph or not _elementwise(v):
            return False
        if not all(walk(o) for o in v.operands):
            return False
        region.append(v)
        return True

    if not walk(k) or len(boundary) != 1 or len(region) > CHEAP_OPS:
        return None
    if any(v.op == "map" and v.attrs[0] in EXPENSIVE for v in region):
        return None
    return region


def recompute_cheap(graph: list[Value], roots: list[Value], kept: list[Value],
                    results: tuple[Value, ...]) -> list[Value]:
    """`roots` (a loop's backward step, reading `kept`, values of the step's `graph`)
    with each kept value that is a cheap elementwise function of one other kept value
    read as a recomputed copy of that function instead: the forward loop stacks one
    buffer fewer, for a few flops where the backward reads it (gelu: of the
    pre-activation u, t = tanh(..) and s = 0.5 + 0.5 * t, s is recomputed from t).
    The function may also read kept values over some of its edges (broadcast, kept
    anyway): a layernorm's normalized rows `(x - mean) * (1 / std)` are recomputed
    from the centered rows and the row's std, both kept for the backward, so the
    forward loop no longer writes a [rows, width] buffer that the backward reads
    (nanoGPT-char: two per layer, 37.7 MB a step written and read).
    Cheap: its expression down to that value (through values not kept) has at most
    `CHEAP_OPS` elementwise ops of its own edges and type, none a transcendental
    (recomputing gelu's tanh as well measured slower on the CPU: the copy, read three
    times, gets a kernel and a buffer of its own). The step's results are stacked
    anyway and are never recomputed.

    Exact: the copy applies the same ops, in the same order, to the same stored value
    (read as `recompute(b)`, the identity, so that hash-consing does not merge the copy
    back into the original), as in `rematerialize`, so it has the kept value's value;
    later passes treat it like any other value (`normalize` sorts the terms of the
    sum that reads it by their structure, which the copy changes: the program adds
    them in another order than without the rule, within rounding; the layernorm's
    copy `(x - mean) * (1 / std)`, no longer also a value of the forward, is rewritten
    by the later passes as `(x - mean) / std`, within an ulp of it). Terminates: one
    pass over `kept` in graph order, each region a walk over the finite graph."""
    in_graph = {id(v) for v in graph}
    is_result = {id(r) for r in results}
    stored = {id(k) for k in kept}
    regions_of: dict[int, list[Value]] = {}
    for k in kept:   # operands first: a value recomputed here is seen through by its users
        if id(k) in is_result:
            continue
        region = _cheap_region(k, stored, in_graph)
        if region is not None:
            stored.discard(id(k))
            regions_of[id(k)] = region
    if not regions_of:
        return roots
    copies: dict[int, Value] = {}

    def read(o: Value) -> Value:
        if id(o) in copies:
            return copies[id(o)]
        if o.op in ("const", "size"):
            return o
        return V.map_("recompute", o)

    for region in regions_of.values():
        for v in region:
            if id(v) not in copies:
                copies[id(v)] = rebuild_same(v, tuple(read(o) for o in v.operands))

    def fn(v: Value, ops: tuple[Value, ...]) -> Value:
        if id(v) in regions_of:
            return copies[id(v)]
        if id(v) in in_graph:
            return v
        return rebuild_same(v, ops)

    memo = V.rebuild(roots, fn)
    return [memo[id(r)] for r in roots]
