"""factor: n-ary contractions -> pairwise ones in the order of least cost; common factors out.

Rewrites, in two phases:

1. Un-distribution (on the canonical form): terms of a sum that share factors
   have them taken out, `x @ A + x @ B -> x @ (A + B)`, when that costs fewer
   FLOPs (`tgc.opt.stats`'s model, each contraction at its best order) --
   never when it would build a larger tensor that costs more -- or, at equal cost,
   when the sum is a difference of two or more products and nothing else:
   `a x - a y -> a (x - y)` rounds the difference of x and y instead of cancelling
   the separately rounded a x and a y (softmax's gradient p (g - sum(p g)); in f32
   near-one-hot rows with g near 1e4 lost every digit the other way). Of the candidate
   groups (the terms sharing a factor), the largest saving wins, the first in
   `sort_key` order of equal ones; a candidate saves at most what its group's
   terms and sums cost, so candidates are built from the largest such bound down
   and one whose bound cannot beat the best found is not built (the same result,
   without building every candidate of a long sum). The groups weighed and the values
   built for them are memoized for the pass: a sum rewritten keeps the groups it did
   not take out, and weighs them again without rebuilding them (a chain of n steps
   under a gradient: one sum of n terms, n / 31 groups taken out one by one).
2. Ordering: every contraction of three or more operands becomes a tree of
   pairwise contractions in the order `tgc.opt.paths` finds (opt_einsum,
   memory-bounded: no intermediate larger than the largest dense operand or the
   result; indicators costed as index arithmetic). Consecutive products that sum
   nothing stay one elementwise product, which `fuse` runs as one loop. Each
   pairwise contraction computes under canonical edge names, so the same
   sub-contraction built for two consumers is one value. Of equally cheap orders
   the search keeps the first; the index operands are first put in the order of
   the axes they index in the declared arrays, outermost first
   (`_outer_indicators_first`), so the tie does not depend on the canonical order's
   digests. Any order is exact up to the reassociation of the sums.

Symbolic dims are costed at `Options.rep_size` (64 by default). The output is
the one non-canonical form in the pipeline: `normalize` would merge the pairwise
contractions again, so `factor` runs last.

Terminates: un-distribution strictly lowers the cost of the sum it rewrites, or at
equal cost replaces all its terms by one product (and
the canonical rewriting around it terminates); ordering visits each value once
and each path step removes an operand.
"""
from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass

from tgc.ir import values as V
from tgc.ir.module import Module
from tgc.ir.values import Value, rebuild
from tgc.options import Options
from tgc.ir.passes import Pass
from tgc.opt.canon import Canon, sort_key
from tgc.opt.paths import find_path, memory_limit
from tgc.opt.rewrite import Ctx, map_bodies, prune_edges, rewrite
from tgc.opt.stats import is_index, prod, rep_sizes, value_flops


def _factors(t: Value) -> list[Value]:
    return list(t.operands) if t.op == "contract" else [t]


def _leaves(factors) -> list[tuple[frozenset[str], bool]]:
    return [(frozenset(f.edges), is_index(f)) for f in factors]


# ---- phase 1: common factors out of sums -----------------------------------------------------

def _minus(bag: list[Value], take: list[Value]) -> list[Value]:
    """`bag` without one occurrence of each of `take` (the first ones), in order."""
    drop = set(map(id, take))
    if len(drop) == len(take):   # each taken once: the first occurrence of each goes
        rest = []
        for f in bag:
            if id(f) in drop:
                drop.discard(id(f))
            else:
                rest.append(f)
        return rest
    drop = Counter(map(id, take))
    rest = []
    for f in bag:
        if drop[id(f)] > 0:
            drop[id(f)] -= 1
        else:
            rest.append(f)
    return rest


def _common(bags: list[list[Value]]) -> list[Value]:
    """The factors every bag has (as many times as each has them), in the first's order."""
    ids = [set(map(id, bag)) for bag in bags]
    if all(len(i) == len(bag) for i, bag in zip(ids, bags)):   # no factor twice in a bag: sets do
        shared = set.intersection(*ids)
        return [f for f in bags[0] if id(f) in shared]
    common = list(bags[0])
    for bag in bags[1:]:
        left = Counter(map(id, bag))
        kept = []
        for f in common:
            if left[id(f)] > 0:
                left[id(f)] -= 1
                kept.append(f)
        common = kept
    return common


def _roles_agree(common, terms) -> bool:
    """Every edge of the common factors is kept in all the terms or summed in all."""
    for e in set().union(*(f.edges for f in common)):
        if len({e in t.edges for t in terms}) > 1:
            return False
    return True


def _undistributed(ctx: Ctx, common, terms, coefs) -> Value:
    """`sum_k coefs[k] terms[k]` with the factors `common` taken out: `common * (sum_k
    coefs[k] rest_k)`, the inner sum settled by `undistribute`. Memoized per (common,
    terms, coefs) (`ctx.cache["taken_out"]`): when a sum is rewritten, the new sum keeps
    the terms of every candidate group not taken out, and weighing them again rebuilt
    the same products (hash-consed: the same values) once per group taken out before, so
    a chain of n steps whose gradient is one sum of n terms in n / 31 nested groups built
    O(n^2) products. The builders are deterministic, so the memo changes no result."""
    memo = ctx.cache.setdefault("taken_out", {})
    k = (tuple(map(id, common)), tuple(map(id, terms)), tuple(coefs))
    got = memo.get(k)
    if got is not None and all(a is b for a, b in zip(got[0], common)) and all(
            a is b for a, b in zip(got[1], terms)):
        return got[2]
    out = _build_undistributed(ctx, common, terms, coefs)
    memo[k] = (list(common), list(terms), out)
    return out


def _build_undistributed(ctx: Ctx, common, terms, coefs) -> Value:
    ctx.cache["built"] = ctx.cache.get("built", 0) + 1   # work counted (tests: linear in n)
    edges = set().union(*(f.edges for f in common))
    inner = []
    for t in terms:
        rest = _minus(_factors(t), common)
        keep = (set(t.edges) | edges) & set().union(*(f.edges for f in rest)) if rest else set()
        inner.append(ctx.c.contract(rest, keep) if rest else V.const(1.0, t.dtype))
    total = ctx.c.add(inner, coefs)
    if total.op == "add":  # settled now, so that the cost weighed is the cost of the result
        total = undistribute(ctx, total) or total
    return ctx.c.contract(common + [total], set().union(*(t.edges for t in terms)))


def _cost(v: Value, sizes, memo: dict) -> int:
    """Cost of v's own op, a contraction at its best order (its operands given); a
    contraction's is found once per value (`memo`: id -> (value, cost), one rewrite's),
    and once per shape: what `value_flops` gives a contraction depends only on its
    operands' edges and index flags, in order, and its own edges (`memo[SHAPES]`; the
    products of a chain's gradient are n-factor products of one vector, for every n)."""
    if v.op == "contract":
        got = memo.get(id(v))
        if got is None or got[0] is not v:
            shape = (tuple((frozenset(o.edges), is_index(o)) for o in v.operands), v.edges)
            shapes = memo.setdefault(_SHAPES, {})
            flops = shapes.get(shape)
            if flops is None:
                flops = shapes[shape] = value_flops(v, sizes)
            got = memo[id(v)] = (v, flops)
        return got[1]
    if v.op == "add":
        return max(1, len(v.operands) - 1) * prod(v.edges, sizes)
    return 0


def _new_cost(v: Value, sizes, exists, seen: set[int], memo: dict) -> int:
    """Cost of the values v needs that neither `exists` (a predicate) nor are in `seen`
    (ids of those counted)."""
    if id(v) in seen:
        return 0
    seen.add(id(v))
    if exists(v):
        return 0
    return _cost(v, sizes, memo) + sum(_new_cost(o, sizes, exists, seen, memo) for o in v.operands)


_SHAPES = "shapes"   # `_cost`'s memo of costs by contraction shape (a key no id is)


# sum_k c_k (F R_k) = F (sum_k c_k R_k)   (F: factors the terms share; only when cheaper)
def undistribute(ctx: Ctx, v: Value) -> Value | None:
    """`v` (a sum) with the cheapest group of its terms' common factors taken out, or None.
    Memoized per sum (values are hash-consed): the inner sum of each candidate is
    settled by this function too, and a chain of sums nested in each other's terms (the
    gradient of a residual chain of steps) would otherwise settle each inner sum once per
    candidate of every sum around it, exponentially in the depth."""
    memo = ctx.cache.setdefault("undistributed", {})
    got = memo.get(id(v))
    if got is not None and got[0] is v:
        return got[1]
    out = _undistribute(ctx, v)
    memo[id(v)] = (v, out)
    return out


def _outer_sum(new: Value, common, terms, sizes) -> bool:
    """Whether `new`'s inner sum is an outer sum: it has more elements than each of its
    own terms and each of the terms factored (`v - o` of a `[s, hd]` and a `[t, hd]`,
    a `[s, t, hd]` sum). Such a sum is never taken out, whatever the FLOP count says: its
    elements are FLOPs of an elementwise loop where the old terms were GEMMs, and it is
    larger than any value of the program around it (attention's backward with a padding
    mask and `loss = sum(o * o)`: `sum[hd](o * v) - sum[hd](o * o)` became
    `sum[hd](o * (v - o))`, a `[batch, hd, head, s, t]` sum, 1.5% fewer FLOPs by the
    model, that `stream` could not block either: 553 MB at t = 4096 against 84 MB)."""
    if new.op != "contract":
        return False
    shared = set(map(id, common))
    inner = [o for o in new.operands if id(o) not in shared and o.op == "add"]
    for total in inner:
        n = prod(total.edges, sizes)
        if all(n > prod(x.edges, sizes) for x in list(total.operands) + list(terms)):
            return True
    return False


_TIE = 0.5   # the saving credited to a difference factored at equal cost: below any real one


def _mixed_signs(coefs) -> bool:
    return any(c > 0 for c in coefs) and any(c < 0 for c in coefs)


def _undistribute(ctx: Ctx, v: Value) -> Value | None:
    if "sizes" not in ctx.cache:
        values = ctx.module.values()
        ctx.cache.update(sizes=rep_sizes(ctx.module, ctx.options.rep_size),
                         users=Counter(id(o) for x in values for o in x.operands))
    sizes, users = ctx.cache["sizes"], ctx.cache["users"]
    costs = ctx.cache.setdefault("costs", {})
    terms, coefs = list(v.operands), list(v.attrs[0])
    factors = [_factors(t) for t in terms]
    # what exists already is v's graph: v, its terms and their factors for certain; a
    # value newer than v for certain not; a leaf other than a sum or product costs
    # nothing either way; any other is looked up in v's graph, walked only as deep as
    # values as old as it (older ones cannot hold it: operands are older than their
    # users), so a deep chain's sums do not each walk the whole graph
    surely = {id(v)} | {id(t) for t in terms} | {id(f) for fs in factors for f in fs}
    known = {id(v)}                            # ids of v's graph walked so far
    stack = [v]                                # walked, operands not looked at yet
    later: list[tuple[int, int, Value]] = []   # max-heap by serial: met, not walked yet

    def exists(x: Value) -> bool:
        if id(x) in surely or id(x) in known:
            return True
        if x.serial > v.serial or (not x.operands and x.op not in ("add", "contract")):
            return False
        while later and -later[0][0] >= x.serial:
            y = heapq.heappop(later)[2]
            if id(y) not in known:
                known.add(id(y))
                stack.append(y)
        while stack:
            for o in stack.pop().operands:
                if id(o) in known:
                    continue
                if o.serial < x.serial:
                    heapq.heappush(later, (-o.serial, id(o), o))
                else:
                    known.add(id(o))
                    stack.append(o)
        return id(x) in known
    holders: dict[int, list[int]] = {}   # id of a factor -> the terms that have it
    for k, fs in enumerate(factors):
        for f in fs:
            got = holders.setdefault(id(f), [])
            if not got or got[-1] != k:
                got.append(k)
    # each candidate's group and the most it can save (what the group's dead terms and
    # sums cost: the new values cost >= 0)
    # (what a group's terms give depends on those terms only: memoized by them, as a
    # rewritten sum keeps the groups not taken out, see `_undistributed`)
    weighed = ctx.cache.setdefault("groups", {})
    cands, groups = [], set()
    for rank, o in enumerate(sorted({id(f): f for fs in factors for f in fs}.values(), key=sort_key)):
        group = holders[id(o)]
        if len(group) < 2 or tuple(group) in groups:   # a group met before: the same candidate, later
            continue
        groups.add(tuple(group))
        ids = tuple(id(terms[k]) for k in group)
        got = weighed.get(ids)
        if got is None or not all(a is terms[k] for a, k in zip(got[0], group)):
            common = [f for f in _common([factors[k] for k in group]) if f.edges]  # scalars: no gain
            if not common or not _roles_agree(common, [terms[k] for k in group]):
                common = None
            dead = [terms[k] for k in group if users[id(terms[k])] <= 1]  # no other user: its work is saved
            got = weighed[ids] = ([terms[k] for k in group], common, sum(_cost(t, sizes, costs) for t in dead))
        common = got[1]
        if common is None:
            continue
        old = got[2] + (len(group) - 1) * prod(v.edges, sizes)
        cands.append((old, rank, group, common))
    # the largest saving wins, the first candidate (in `sort_key` order) of equal ones;
    # tried most hopeful first, a candidate that cannot beat the best is not built
    cands.sort(key=lambda c: (-c[0], c[1]))
    best = None   # (saving, rank, group, new)
    for old, rank, group, common in cands:
        if best is not None and (old < best[0] or (old == best[0] and rank > best[1])):
            if old < best[0]:
                break
            continue
        new = _undistributed(ctx, common, [terms[k] for k in group], [coefs[k] for k in group])
        if _outer_sum(new, common, [terms[k] for k in group], sizes):
            # the factors but one, where that sum is no outer one (p (dP - sum(p dP)) of
            # attention's backward, `o` left in the terms); else the group is not taken out
            for f in common:
                fewer = [x for x in common if x is not f]
                if not fewer or not _roles_agree(fewer, [terms[k] for k in group]):
                    continue
                new = _undistributed(ctx, fewer, [terms[k] for k in group], [coefs[k] for k in group])
                if not _outer_sum(new, fewer, [terms[k] for k in group], sizes):
                    break
            else:
                continue
        saving = old - _new_cost(new, sizes, exists, set(), costs)
        # a difference of products that is the whole sum is factored at no extra cost too:
        # a (x - y) rounds the difference of x and y, not of the rounded a x and a y, whose
        # cancellation is not bounded by |a (x - y)| (softmax's gradient p (g - sum(p g)),
        # not p g - p sum(p g)). Not a part of a longer sum: that sum is computed in f64
        # (`lowered.wide_sum`), where a x and a y each rounded once lose nothing more.
        if saving == 0 and len(group) == len(terms) and _mixed_signs([coefs[k] for k in group]):
            saving = _TIE
        if saving > 0 and (best is None or saving > best[0] or (saving == best[0] and rank < best[1])):
            best = (saving, rank, group, new)
    if best is None:
        return None
    _, _, group, new = best
    rest = [k for k in range(len(terms)) if k not in group]
    return ctx.c.add([terms[k] for k in rest] + [new], [coefs[k] for k in rest] + [1.0])


# ---- phase 2: pairwise order ----------------------------------------------------------------

def _presum(c: Canon, ops: tuple[Value, ...], keep: set[str]) -> list[Value]:
    """Each dense operand summed first over the edges no other operand (or the result) has."""
    out = []
    for k, o in enumerate(ops):
        others = keep.union(*(x.edges for j, x in enumerate(ops) if j != k))
        private = set(o.edges) - others
        out.append(c.contract([o], set(o.edges) - private) if private and not is_index(o) else o)
    return out


def axis_depths(module: Module) -> dict[str, int]:
    """dim -> how far from the innermost axis it lies in the arrays the module declares
    (arguments and outputs): 0 for a last axis; the largest over the arrays."""
    depth: dict[str, int] = {}
    orders = [a.order for a in module.args.values()] + [o.order for o in module.outputs]
    for order in orders:
        for i, e in enumerate(order):
            d = module.edges.get(e, e)
            depth[d] = max(depth.get(d, -1), len(order) - 1 - i)
    return depth


def _outer_indicators_first(module: Module, depths: dict[str, int], ops: list[Value]) -> list[Value]:
    """`ops` with its index operands (indicators) reordered among their own places, the
    one over the outermost declared axis first (`axis_depths`; stable otherwise).

    The path search keeps the first of equally cheap orders, and the first index
    operand is the one contracted with a dense operand first. A 2-D convolution's
    input gradient sums its kh and kw taps in two steps that cost the same: the tap
    folded into the product first shifts its operand along that axis. Shifted along
    the rows (an outer axis), the product's columns stay whole image rows and the
    shift is an offset by whole rows (`taps`); shifted along the innermost axis, a
    column block can only be one row (32 columns at 32 x 32) and the product is a
    batch of small ones. Without this the choice followed the canonical order, a
    digest of the operands: the same program with its sizes symbolic took the
    column shift (13.3 Mcycles for the product instead of 8.3 on one thread)."""
    slots = [k for k, o in enumerate(ops) if is_index(o)]
    if len(slots) < 2:
        return ops

    def depth(o: Value) -> int:
        return max((depths.get(module.edges.get(e.split(".")[0], e.split(".")[0]), -1) for e in o.edges), default=-1)

    ranked = sorted((ops[k] for k in slots), key=lambda o: -depth(o))
    out = list(ops)
    for k, o in zip(slots, ranked):
        out[k] = o
    return out


def _split(c: Canon, sizes, v: Value, ops: tuple[Value, ...], module: Module | None = None,
           depths: dict[str, int] | None = None) -> Value:
    if v.op != "contract" or len(ops) < 2:
        return V.rebuild_same(v, ops)
    keep = set(v.edges)
    ops = _presum(c, ops, keep)
    carried = set().union(*(o.edges for o in ops))
    if len(ops) == 2:
        return c.broadcast(c.contract(ops, keep & carried), keep)
    if module is not None and depths:
        ops = _outer_indicators_first(module, depths, ops)
    leaves = _leaves(ops)
    path = find_path(leaves, keep & carried, sizes, memory_limit(leaves, keep & carried, sizes))
    live: list[tuple[Value, list[Value] | None]] = [(o, None) for o in ops]  # (value, its elementwise factors)
    for step in path:
        picked = [live[i] for i in step]
        for i in sorted(step, reverse=True):
            del live[i]
        later = keep.union(*(x.edges for x, _ in live))
        union = set().union(*(x.edges for x, _ in picked))
        out = union & later
        elementwise = out == union
        factors = [f for x, fs in picked for f in (fs if elementwise and fs else [x])]
        live.append((c.contract(factors, out), factors if elementwise else None))
    return c.broadcast(live[0][0], keep)


def order_contractions(module: Module, options: Options) -> Module:
    out = module.replace_values({})
    c = Canon(out, merge=None)  # pairwise contractions stay pairwise
    sizes = rep_sizes(out, options.rep_size)
    depths = axis_depths(out)
    memo = rebuild(out.roots(), lambda v, ops: _split(c, sizes, v, ops, out, depths))
    return prune_edges(out.replace_values(memo))


@dataclass(frozen=True)
class Factor(Pass):
    """Contractions -> pairwise in the cheapest memory-bounded order; common factors out."""

    name = "factor"

    def run(self, module: Module, options: Options) -> Module:
        module = rewrite(module, {"add": [undistribute]}, options)
        return _ordered(module, options)


def _ordered(module: Module, options: Options) -> Module:
    """`order_contractions` on `module` and on every loop's step (a loop that stays one
    is lowered from its body: its products need their order as much)."""
    return order_contractions(map_bodies(module, lambda sub: _ordered(sub, options)), options)
