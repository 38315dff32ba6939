"""Products up to renaming: whether one product is a factor of another (for `simplify`).

`split_product(a, c)` finds the factors `rest` with `a = c * contract(rest)`, matching c's
factors to a's up to a consistent renaming of c's summed edges (a backtracking search
over the few factors of a product, so it terminates).
"""
from __future__ import annotations

from tgc.ir.values import Value
from tgc.opt.canon import base


def split_product(a: Value, c: Value) -> list[Value] | None:
    """The factors `rest` with a = c * contract(rest), c's edges all kept in a.

    c's factors are matched to a's up to a consistent renaming of c's summed edges
    onto summed edges of a that no other factor of a carries. None if there is none.
    """
    ops_a = list(a.operands) if a.op == "contract" else [a]
    keep_c = set(c.edges)
    if not keep_c <= set(a.edges):
        return None
    if c in ops_a:  # c itself a factor
        return _minus_one(ops_a, c)
    ops_c = list(c.operands) if c.op == "contract" else [c]
    summed_a = set().union(*(o.edges for o in ops_a)) - set(a.edges)
    found = _match(ops_c, ops_a, keep_c, summed_a, {})
    if found is None:
        return None
    rest, sigma = found
    if set(sigma.values()) & set().union(*(o.edges for o in rest)):
        return None
    return rest


def _minus_one(ops: list[Value], x: Value) -> list[Value]:
    rest = list(ops)
    rest.remove(x)
    return rest


def _match(ops_c, pool, keep_c, summed_a, sigma):
    """Backtracking: (unmatched pool, summed-edge map) matching every op of ops_c."""
    if not ops_c:
        return pool, sigma
    o, later = ops_c[0], ops_c[1:]
    bo, po = base(o)
    for k, x in enumerate(pool):
        bx, px = base(x)
        if bx is not bo:
            continue
        trial = _extend(sigma, {po.get(n, n): px.get(n, n) for n in bo.edges}, keep_c, summed_a)
        if trial is not None:
            found = _match(later, pool[:k] + pool[k + 1:], keep_c, summed_a, trial)
            if found is not None:
                return found
    return None


def _extend(sigma, pairs, keep_c, summed_a):
    out = dict(sigma)
    for e, f in pairs.items():
        if e in keep_c:
            if f != e:
                return None
        elif f not in summed_a or out.setdefault(e, f) != f or list(out.values()).count(f) > 1:
            return None
    return out
