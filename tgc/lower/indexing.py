"""Index arithmetic for `fuse`: indicators become substitutions and bounds, never tensors.

A contraction `sum_S prod(factors) * prod([relations])` is rewritten so that every
equality link of a relation that determines a summed edge `s` (coefficient +-1)
substitutes `s` away (one loop less) and leaves the range condition
`0 <= value(s) < size(s)`; a summed edge `h` that then appears as
`0 <= Y - K*h < K` (splitting an edge into digits, i.e. merging edges) becomes
`h = floor(Y / K)` with the bound `0 <= Y < K*size(h)`. Every other link stays a
condition. Sizes are normalized (fixed dims replaced by their values) so that
coefficients compare structurally.

Terminates: each step eliminates one summed edge, and there are finitely many.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from tgc.ir.affine import Affine, Relation
from tgc.lower.lowered import Cond, FloorDiv, IdLoad, Ix, neg
from tgc.ir.module import Module
from tgc.ir.sizes import Size, SizeOp, size_op


def norm_size(m: Module, s: Size) -> Size:
    """`s` with every fixed dim replaced by its (normalized) definition."""
    if isinstance(s, int):
        return s
    if isinstance(s, str):
        d = m.dims.get(s)
        return s if d is None else norm_size(m, d)
    return size_op(s.op, norm_size(m, s.lhs), norm_size(m, s.rhs))


def edge_size(m: Module, edge: str) -> Size:
    return norm_size(m, m.size(edge))


def affine_ix(m: Module, a: Affine, env: Mapping[str, Ix]) -> Ix:
    out = Ix((), norm_size(m, a.const))
    for edge, coef in a.terms:
        out = out.plus(env[edge].scaled(norm_size(m, coef)))
    return out


def relation_conds(m: Module, rel: Relation, env: Mapping[str, Ix]) -> list[Cond]:
    return [Cond(affine_ix(m, a, env).plus(affine_ix(m, b, env), -1), op)
            for a, op, b in zip(rel.exprs, rel.ops, rel.exprs[1:])]


@dataclass
class Solution:
    sol: dict[str, Ix]          # eliminated placeholder -> its value
    conds: list[Cond]           # what must hold for the term to be nonzero
    remaining: list[str]        # placeholders still summed over (loops)
    false: bool = False         # the term is identically zero


def _direct(ix: Ix, p: str) -> bool:
    """`p` is a plain term of `ix`, not hidden inside a gathered id or a division."""
    inside = set()
    for a, _ in ix.terms:
        if not isinstance(a, str):
            inside |= Ix.of(a).vars()
    return p not in inside and p in dict(ix.terms)


def _pivot(ix: Ix, free: Sequence[str], divide: bool = False) -> str | None:
    for p in free:
        k = ix.coef(p)
        if _direct(ix, p) and (k in (1, -1) or (divide and isinstance(k, int) and k != 0)):
            return p
    return None


def solve(m: Module, relations: Sequence[Relation], env: Mapping[str, Ix],
          summed: Mapping[str, str], sizes: Mapping[str, Size], divide: bool = False) -> Solution:
    """Eliminate summed edges. `env` maps every edge (kept and summed) to an index;
    a summed edge maps to `Ix.var(summed[edge])`, a placeholder; `sizes` gives each
    placeholder's extent."""
    links = [c for rel in relations for c in relation_conds(m, rel, env)]
    return solve_conds(links, [summed[e] for e in summed], sizes, divide)


def solve_conds(links: Sequence[Cond], places: Sequence[str], sizes: Mapping[str, Size],
                divide: bool = False) -> Solution:
    """`solve` on relation links already in index form; `places`: the summed
    placeholders, in elimination preference order. With `divide`, a link may also
    determine a placeholder with another integer coefficient: `k*p + R = 0` gives
    `p = floor(N / |k|)` (N = -R, or R when k < 0) under the condition
    `N - |k| floor(N / |k|) = 0` (N divisible by |k|), which is exact: where it holds
    the division has no remainder, and where it does not no integer p satisfies the
    link, so the term is zero (a stride-2 convolution's input gradient sums over its
    3 kernel taps, the output position following from each, not over every output
    position with a mask)."""
    sol: dict[str, Ix] = {}
    conds: list[Cond] = []
    ranges: list[tuple[Ix, Size]] = []
    for c in links:
        ix = c.ix.subst(sol)
        p = _pivot(ix, [q for q in places if q not in sol], divide) if c.op == "=" else None
        if p is None:
            conds.append(Cond(ix, c.op))
            continue
        k = ix.coef(p)
        rest = ix.plus(Ix.var(p).scaled(k), -1)   # ix = k p + rest
        if k in (1, -1):
            value, divisible = rest.scaled(-k), None
        else:
            num, d = rest.scaled(-1 if k > 0 else 1), abs(k)
            value = Ix.of(FloorDiv(num, d))
            divisible = Cond(num.plus(value.scaled(d), -1), "=")
        _bind(sol, conds, ranges, p, value)
        if divisible is not None:
            conds.append(divisible)
        ranges.append((value, sizes[p]))
    _digits(sol, conds, ranges, [q for q in places if q not in sol], sizes)
    for value, size in ranges:
        conds += [Cond(value, ">="), Cond(value.plus_const(neg(size)), "<")]
    remaining = [q for q in places if q not in sol]
    return Solution(sol, conds, remaining)


def _bind(sol, conds, ranges, p: str, value: Ix) -> None:
    """Record `p = value` and substitute it everywhere already collected."""
    sub = {p: value}
    for q in list(sol):
        sol[q] = sol[q].subst(sub)
    sol[p] = value
    conds[:] = [c.subst(sub) for c in conds]
    ranges[:] = [(v.subst(sub), s) for v, s in ranges]


def _digits(sol, conds, ranges, free: list[str], sizes) -> None:
    """`0 <= Y - K*h < K` determines `h = floor(Y / K)`: eliminate such `h`."""
    changed = True
    while changed:
        changed = False
        for i, (value, k) in enumerate(ranges):
            for h in free:
                if h in sol or not _direct(value, h) or value.coef(h) != neg(k):
                    continue
                y = Ix(tuple(t for t in value.terms if t[0] != h), value.const)
                ranges[i] = (y, size_op("*", k, sizes[h]))
                _bind(sol, conds, ranges, h, Ix.of(FloorDiv(y, k)))
                changed = True
                break
            if changed:
                break


def simplify_conds(conds: Sequence[Cond], var_size: Mapping[str, Size]) -> list[Cond] | None:
    """Drop conditions that always hold; None when one never holds."""
    out: list[Cond] = []
    for c in conds:
        verdict = _decide(c, var_size)
        if verdict is False:
            return None
        if verdict is None and c not in out:
            out.append(c)
    return out


def _range(ix: Ix, var_size: Mapping[str, Size]) -> tuple[int, int] | None:
    """[lo, hi] of `ix` over all loop values, when every size is known."""
    if not isinstance(ix.const, int):
        return None
    lo = hi = ix.const
    for a, k in ix.terms:
        n = var_size.get(a) if isinstance(a, str) else None
        if not isinstance(k, int) or not isinstance(n, int) or n <= 0:
            return None
        lo, hi = lo + min(0, k * (n - 1)), hi + max(0, k * (n - 1))
    return lo, hi


def _decide(c: Cond, var_size: Mapping[str, Size]) -> bool | None:
    ix = c.ix
    r = _range(ix, var_size)
    if r is not None:
        lo, hi = r
        always = {"=": lo == hi == 0, "!=": lo > 0 or hi < 0, "<": hi < 0, "<=": hi <= 0,
                  ">": lo > 0, ">=": lo >= 0}[c.op]
        never = {"=": lo > 0 or hi < 0, "!=": lo == hi == 0, "<": lo >= 0, "<=": lo > 0,
                 ">": hi <= 0, ">=": hi < 0}[c.op]
        return True if always else False if never else None
    nonneg = all(isinstance(a, (str, IdLoad)) and isinstance(k, int) and k > 0 for a, k in ix.terms)
    if c.op == ">=" and nonneg and isinstance(ix.const, int) and ix.const >= 0:
        return True
    var = _single_var(ix)
    if c.op == "<" and var is not None and var in var_size:
        bound = size_op("+", var_size[var], ix.const)  # v + c < 0 for all v < size iff size + c <= 0
        if bound == 0 or _cancels(var_size[var], ix.const) or (isinstance(bound, int) and bound <= 0):
            return True
    return None


def _single_var(ix: Ix) -> str | None:
    if len(ix.terms) == 1 and ix.terms[0][1] == 1 and isinstance(ix.terms[0][0], str):
        return ix.terms[0][0]
    return None


def _cancels(size: Size, const: Size) -> bool:
    """const == -size, structurally."""
    return isinstance(const, SizeOp) and const.rhs == size and (
        (const.op == "*" and const.lhs == -1) or (const.op == "-" and const.lhs == 0))
