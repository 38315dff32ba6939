"""Contraction order for `factor`: pairwise steps of least FLOPs under a memory bound.

Every search goes through opt_einsum's `contract_path` with `memory_limit` (no
intermediate larger than the bound, in elements). Dense operands with the same edges
are multiplied together first (Hadamard products, as opt_einsum's greedy search
does: free, and the result is no larger); then dense contractions of at most
`MAX_DP` operands use its dynamic programming optimizer ("dp"), larger ones its
greedy one (dp is exponential in the operands: a product of 12 factors that share
one edge took 2 s, each more factor 3.3 times longer). A contraction with indicator operands uses
`IndicatorAware`, an exhaustive search over subsets (greedy beyond `MAX_EXACT`
operands) with the cost model of `tgc.opt.stats`, where an indicator is index
arithmetic rather than a dense tensor (opt_einsum's own costs would count it as one).
An operand is `(edges, is_indicator)`; paths are in opt_einsum's format.

Terminates: the subset search visits each pair of disjoint subsets once; greedy
removes one operand per step.
"""
from __future__ import annotations

import collections
import functools
from collections import Counter
from typing import Mapping, Sequence


import math

Leaf = tuple[frozenset[str], bool]
MAX_EXACT = 10
MAX_DP = 8


def prod(edges, sizes: Mapping[str, int]) -> int:
    return math.prod(sizes[e] for e in edges)


def pair_cost(a: set[str], a_ind: bool, b: set[str], b_ind: bool, out: set[str], sizes) -> int:
    """FLOPs of contracting a with b into `out`; an indicator is index arithmetic."""
    if a_ind and b_ind:
        return 0
    if a_ind or b_ind:
        return max(prod(b if a_ind else a, sizes), prod(out, sizes))
    return prod(a | b, sizes)


def memory_limit(leaves: Sequence[Leaf], keep: set[str], sizes) -> int:
    """No intermediate larger than the largest dense operand, the result, or an indicator's view."""
    dense = [prod(e, sizes) for e, ind in leaves if not ind]
    views = [prod(e, sizes) // max(sizes[x] for x in e) for e, ind in leaves if ind and e]
    return max(dense + views + [prod(keep, sizes), 1])


def presummed(leaves: Sequence[Leaf], keep: set[str]) -> list[Leaf]:
    """Each dense leaf without the edges only it carries (summed first, on its own).
    An edge is another's when `keep` has it or more than one leaf carries it (counted
    once: a product of n elementwise factors is n leaves, not n^2 edge visits)."""
    carriers = Counter(x for e, _ in leaves for x in e)
    out = []
    for e, ind in leaves:
        out.append((e if ind else frozenset(x for x in e if x in keep or carriers[x] > 1), ind))
    return out


def contraction_cost(leaves: Sequence[Leaf], keep: set[str], sizes) -> int:
    """FLOPs of a contraction at its best order: private sums first, then the path."""
    carried = set().union(*(e for e, _ in leaves))
    keep = set(keep) & carried
    pre = sum(prod(e, sizes) for (e, ind), (p, _) in zip(leaves, presummed(leaves, keep)) if p != e)
    leaves = presummed(leaves, keep)
    path = find_path(leaves, keep, sizes, memory_limit(leaves, keep, sizes))
    return pre + path_cost(leaves, keep, sizes, path)


def find_path(leaves: Sequence[Leaf], keep: set[str], sizes: Mapping[str, int], limit: int) -> list[tuple[int, ...]]:
    """The pairwise order for contracting `leaves` into the edges `keep` (all carried)."""
    if len(leaves) <= 2:   # one order only: no search (nor opt_einsum's import, 6 ms)
        return [tuple(range(len(leaves)))]
    if any(ind for _, ind in leaves):
        return _searched(leaves, keep, sizes, limit)
    hadamard, leaves = _hadamard_first(leaves)
    if len(leaves) == 1:   # one product: summed at the end if it carries more than `keep`
        return hadamard + ([(0,)] if set(leaves[0][0]) != set(keep) else [])
    if len(leaves) == 2:
        return hadamard + [(0, 1)]
    return hadamard + _searched(leaves, keep, sizes, limit)


def _hadamard_first(leaves: Sequence[Leaf]) -> tuple[list[tuple[int, ...]], list[Leaf]]:
    """Steps multiplying dense leaves with the same edges together, and the live leaves
    after them (those left alone in their order, then the products)."""
    groups: dict[frozenset[str], list[int]] = {}
    for i, (e, _) in enumerate(leaves):
        groups.setdefault(e, []).append(i)
    # slots: the leaves, then each product in the order made; a step names the live
    # positions of its two slots (`_Live` counts the live slots before one)
    n = len(leaves)
    made = sum(len(m) - 1 for m in groups.values() if len(m) > 1)
    live = _Live(n + made)
    for i in range(n):
        live.add(i)
    edges_of = [e for e, _ in leaves] + [None] * made
    steps: list[tuple[int, ...]] = []
    for edges, members in groups.items():
        if len(members) < 2:
            continue
        tags = collections.deque(members)
        while len(tags) > 1:
            a, b = tags.popleft(), tags.popleft()
            steps.append(tuple(sorted((live.rank(a), live.rank(b)))))
            live.remove(a)
            live.remove(b)
            slot = n + len(steps) - 1
            live.add(slot)
            edges_of[slot] = edges
            tags.append(slot)
    return steps, [(edges_of[i], leaves[i][1] if i < n else False) for i in live.slots()]


class _Live:
    """A set of slots 0..size-1 with the rank of a slot among the live ones (a
    Fenwick tree: each operation O(log size))."""

    def __init__(self, size: int):
        self.tree = [0] * (size + 1)
        self.live = [False] * size

    def _update(self, i: int, d: int) -> None:
        i += 1
        while i < len(self.tree):
            self.tree[i] += d
            i += i & -i

    def add(self, i: int) -> None:
        self.live[i] = True
        self._update(i, 1)

    def remove(self, i: int) -> None:
        self.live[i] = False
        self._update(i, -1)

    def rank(self, i: int) -> int:
        """The live slots before slot i."""
        total = 0
        while i > 0:
            total += self.tree[i]
            i -= i & -i
        return total

    def slots(self) -> list[int]:
        return [i for i, on in enumerate(self.live) if on]


def _searched(leaves: Sequence[Leaf], keep: set[str], sizes: Mapping[str, int], limit: int) -> list[tuple[int, ...]]:
    import opt_einsum as oe   # here: most programs never search a path

    names = sorted(set(keep).union(*(e for e, _ in leaves)))
    sym = {e: oe.get_symbol(i) for i, e in enumerate(names)}
    inputs = ",".join("".join(sym[e] for e in sorted(e_)) for e_, _ in leaves)
    eq = f"{inputs}->{''.join(sym[e] for e in sorted(keep))}"
    shapes = [tuple(sizes[e] for e in sorted(e_)) for e_, _ in leaves]
    flags = [ind for _, ind in leaves]
    optimize = indicator_aware()(flags) if any(flags) else "dp" if len(leaves) <= MAX_DP else "greedy"
    try:
        path, _ = oe.contract_path(eq, *shapes, shapes=True, optimize=optimize, memory_limit=limit)
    except RuntimeError:   # no order keeps every intermediate under the limit: the cheapest order
        path, _ = oe.contract_path(eq, *shapes, shapes=True, optimize=optimize)
    return [tuple(step) for step in path]


def path_cost(leaves: Sequence[Leaf], keep: set[str], sizes, path) -> int:
    """FLOPs of following `path` (the stats cost model)."""
    live = [(set(e), ind) for e, ind in leaves]
    carriers = Counter(x for e, _ in live for x in e)   # edge -> the live operands with it
    total = 0
    for step in path:
        picked = [live[i] for i in step]
        for i in sorted(step, reverse=True):
            del live[i]
        for e, _ in picked:
            carriers.subtract(e)
        out = {x for x in set().union(*(e for e, _ in picked)) if x in keep or carriers[x] > 0}
        carriers.update(out)
        if len(picked) == 1:
            total += max(prod(picked[0][0], sizes), prod(out, sizes))
        else:
            (a, ai), (b, bi) = picked
            total += pair_cost(a, ai, b, bi, out, sizes)
        live.append((out, all(i for _, i in picked)))
    return total


@functools.cache
def indicator_aware() -> type:
    """The class of an opt_einsum path optimizer whose cost model knows indicators
    are not dense (made on first use, with opt_einsum's import)."""
    import opt_einsum as oe

    class IndicatorAware(oe.paths.PathOptimizer):
        def __init__(self, indicator_flags: Sequence[bool]):
            self.flags = list(indicator_flags)

        def __call__(self, inputs, output, size_dict, memory_limit=None):
            leaves = [(frozenset(i), f) for i, f in zip(inputs, self.flags)]
            if len(leaves) > MAX_EXACT:
                return _greedy(leaves, set(output), size_dict, memory_limit)
            return _exact(leaves, set(output), size_dict, memory_limit)

    return IndicatorAware


def _exact(leaves, output, sizes, limit):
    n = len(leaves)
    full = (1 << n) - 1
    edges = {}

    def out_edges(mask):
        if mask not in edges:
            inside = set().union(*(leaves[i][0] for i in range(n) if mask >> i & 1))
            outside = set(output).union(*(leaves[i][0] for i in range(n) if not mask >> i & 1))
            edges[mask] = inside & outside
        return edges[mask]

    def ind(mask):
        return all(leaves[i][1] for i in range(n) if mask >> i & 1)

    best = {1 << i: (0, None) for i in range(n)}
    for mask in sorted(range(1, full + 1), key=lambda m: (bin(m).count("1"), m)):
        if mask in best:
            continue
        out = out_edges(mask)
        if limit and mask != full and not ind(mask) and prod(out, sizes) > limit:
            continue
        sub = (mask - 1) & mask
        while sub:
            other = mask ^ sub
            if sub < other and sub in best and other in best:
                cost = best[sub][0] + best[other][0] + pair_cost(
                    out_edges(sub), ind(sub), out_edges(other), ind(other), out, sizes)
                if mask not in best or cost < best[mask][0]:
                    best[mask] = (cost, (sub, other))
            sub = (sub - 1) & mask
    if full in best:
        return _to_path(best, full, n)
    return _exact(leaves, output, sizes, None) if limit else _greedy(leaves, output, sizes, None)


def _to_path(best, full, n):
    live = [1 << i for i in range(n)]
    path = []

    def emit(mask):
        split = best[mask][1]
        if split is None:
            return
        emit(split[0])
        emit(split[1])
        i, j = sorted((live.index(split[0]), live.index(split[1])))
        path.append((i, j))
        del live[j], live[i]
        live.append(mask)
    emit(full)
    return path


def _greedy(leaves, output, sizes, limit):
    """Repeatedly the connected pair of least work plus the size of what it leaves behind."""
    live = [(set(e), ind) for e, ind in leaves]
    path = []
    while len(live) > 1:
        options = []
        for i in range(len(live)):
            for j in range(i + 1, len(live)):
                rest = set(output).union(*(e for k, (e, _) in enumerate(live) if k not in (i, j)))
                out = (live[i][0] | live[j][0]) & rest
                cost = pair_cost(live[i][0], live[i][1], live[j][0], live[j][1], out, sizes)
                too_big = bool(limit) and prod(out, sizes) > limit and len(live) > 2
                options.append((too_big, not live[i][0] & live[j][0], cost + prod(out, sizes), i, j, out))
        *_, i, j, out = min(options, key=lambda t: t[:5])
        path.append((i, j))
        ind = live[i][1] and live[j][1]
        del live[j], live[i]
        live.append((out, ind))
    return path
