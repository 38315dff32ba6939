"""Algebra of indicator relations for `simplify`: solving, substituting, bounding.

An equality `t = s + k` defines each edge with coefficient +-1 on one side only as
an affine function of the others; substituting that function into another relation
eliminates the edge (`sum_s [t = s + k] [s = u + j] = [t = u + j + k]` when
`0 <= u + j < size(s)` always holds). Bounds are exact integer intervals over the
edges' ranges `0 <= e < size(e)`, available when every size involved is known.
"""
from __future__ import annotations

from typing import Mapping

from tgc.ir.affine import Affine, Relation
from tgc.ir.module import Module
from tgc.ir.sizes import SizeError, size_eval, size_op


def static_env(m: Module) -> dict[str, int]:
    """Sizes of the dims that are known at compile time."""
    env: dict[str, int] = {}
    for dim, s in m.dims.items():
        if s is not None:
            try:
                env[dim] = size_eval(s, env)
            except SizeError:
                pass
    return env


def is_delta(rel: Relation) -> tuple[str, str] | None:
    """(i, j) for the delta `[i = j]`, else None."""
    if rel.ops != ("=",) or rel.exprs[0].const != 0 or rel.exprs[1].const != 0:
        return None
    a, b = rel.exprs
    if len(a.terms) == 1 and len(b.terms) == 1 and a.terms[0][1] == 1 and b.terms[0][1] == 1:
        return a.terms[0][0], b.terms[0][0]
    return None


def solve(rel: Relation, edge: str) -> Affine | None:
    """f with `rel` equivalent to `edge = f`, when edge has coefficient +-1 on one side only."""
    if rel.ops != ("=",):
        return None
    lhs, rhs = rel.exprs
    if lhs.coef(edge) != 0 and rhs.coef(edge) != 0:
        return None
    if rhs.coef(edge) != 0:
        lhs, rhs = rhs, lhs
    c = lhs.coef(edge)
    if c not in (1, -1):
        return None
    rest = Affine.make([(e, k) for e, k in lhs.terms if e != edge], lhs.const)
    f = rhs.plus(rest, -1)  # c edge + rest = rhs  =>  edge = c (rhs - rest)
    return f if c == 1 else f.scaled(-1)


def substitute(rel: Relation, edge: str, f: Affine) -> Relation:
    """`rel` with `edge` replaced by the affine expression f."""
    return Relation(tuple(_subst(a, edge, f) for a in rel.exprs), rel.ops)


def _subst(a: Affine, edge: str, f: Affine) -> Affine:
    c = a.coef(edge)
    if c == 0:
        return a
    rest = Affine.make([(e, k) for e, k in a.terms if e != edge], a.const)
    scaled = Affine.make([(e, size_op("*", c, k)) for e, k in f.terms], size_op("*", c, f.const))
    return rest.plus(scaled)


def bounds(a: Affine, sizes: Mapping[str, int], env: Mapping[str, int]) -> tuple[int, int] | None:
    """[min, max] of `a` over 0 <= e < sizes[e], or None if a size is unknown."""
    try:
        lo = hi = size_eval(a.const, env)
        for e, coef in a.terms:
            c, n = size_eval(coef, env), sizes[e]
            lo, hi = lo + min(0, c * (n - 1)), hi + max(0, c * (n - 1))
        return lo, hi
    except (SizeError, KeyError):
        return None


def in_range(f: Affine, n: int | None, sizes, env) -> bool:
    """0 <= f < n for every index of f's edges (provably)."""
    b = bounds(f, sizes, env)
    return b is not None and n is not None and b[0] >= 0 and b[1] < n


def truth(rel: Relation, sizes, env) -> bool | None:
    """True/False when `rel` holds everywhere/nowhere over the edges' ranges, else None."""
    verdicts = []
    for op, a, b in zip(rel.ops, rel.exprs, rel.exprs[1:]):
        r = bounds(a.plus(b, -1), sizes, env)
        if r is None:
            return None
        verdicts.append(_link(op, *r))
    if False in verdicts:
        return False
    if all(v is True for v in verdicts):
        return True
    return None


def _link(op: str, lo: int, hi: int) -> bool | None:
    """Whether `d op 0` holds for every / no d in [lo, hi] (None: it depends)."""
    table = {"<": (hi < 0, lo >= 0), "<=": (hi <= 0, lo > 0), ">": (lo > 0, hi <= 0),
             ">=": (lo >= 0, hi < 0), "=": (lo == hi == 0, lo > 0 or hi < 0),
             "!=": (lo > 0 or hi < 0, lo == hi == 0)}
    always, never = table[op]
    return True if always else False if never else None


def edge_sizes(m: Module, env: Mapping[str, int]) -> dict[str, int]:
    out = {}
    for e in m.edges:
        try:
            out[e] = size_eval(m.size(e), env)
        except SizeError:
            pass
    return out
