"""scatter: contractions and masked reductions of integer indicators as gathers, scatters
and segment reductions.

An integer indicator `[node = ids]` (ids: i32 over edges I) is, in the IR, the
scatter of ones along `node` that keeps every edge of I (`S[node, I] = 1 where
node == ids[I]`, see `tgc.frontend.expressions`); more generally a scatter-add
that keeps all of I is `c[I, rest] * [node = ids[I]]`. Dense, it has nodes x |I|
entries. The rules below remove it from the forms a program uses it in:

    contract(X..., S) summing node   = contract(gather(X_j, ids, node)..., c)
        (each X_j that has `node` is read at node = ids[I]; if none has it, the ones
        over `node`, gathered, stand for the sum over node of the indicator: 1 per
        element of I, bounds-checked like the rest)
    contract(X..., S) keeping node, summing some of I
                                     = scatter(contract(gathered X..., c) over
                                               (kept edges - node) + I, ids, node,
                                               kept edges of I)
    contract(..., x * S, ...)        = contract(..., x, S, ...)   (x * S opened: it
        is exact, S being 0 or 1, and lets the two rules above see S)
    max_R(where(S, a, -inf))         = scatter_max(max_{R - I}(gather(a)), ids, node,
                                                    I - R)      (node not in R,
        R meeting I), and min with inf: a segment reduction, -inf/inf where no id
        points, as the dense form gives.

A contraction that keeps `node` and all of I (the indicator used elementwise) is
left dense: that is the size of its result anyway.

Exact in floating point: each rule is a re-indexing. The dense form multiplies by
exact 0s and 1s and adds exact zeros (x * 0 = 0, LANGUAGE.md's rule that the
front end and simplify use as well); the rewritten form skips those terms and adds
the others in the same order of the summed edges, or takes the max/min over the
same set of values (max and min are exact, NaN propagating in both). Every
rewritten form is O(|I| x features): no nodes x |I| tensor is formed.

Terminates: each contraction rule removes one integer indicator from a
contraction's operands (the gathers it adds are not contraction operands), the
opening rule removes a nested product, and the reduction rule removes a `reduce`
of a `where` of an indicator; the measure (indicators in contractions, nested
indicator products, masked reductions) strictly decreases. The pass runs the rules
through `tgc.opt.rewrite` (with simplify's table in the default pipeline, where
`stabilize` and `simplify` include them; this pass alone is for --fp-strict).
"""
from __future__ import annotations

from dataclasses import dataclass

from tgc.ir import values as V
from tgc.ir.module import Module
from tgc.ir.values import Value
from tgc.options import Options
from tgc.ir.passes import Pass
from tgc.opt.rewrite import Ctx, rewrite


def integer_indicator(v: Value) -> bool:
    """v = c * [node = ids]: a scatter-add that keeps every edge of its ids."""
    return (v.op == "scatter" and v.attrs[1] == "sum"
            and set(v.operands[1].edges) <= set(v.edges))


def _is_one(v: Value) -> bool:
    return v.op == "const" and v.attrs[0] == 1.0


def _pure_product(v: Value) -> bool:
    return v.op == "contract" and set(v.edges) == {e for o in v.operands for e in o.edges}


# contract(..., x * S, ...) = contract(..., x, S, ...)   (x * S is x or exactly 0)
def open_indicator_product(ctx: Ctx, v: Value) -> Value | None:
    for i, o in enumerate(v.operands):
        if _pure_product(o) and len(o.operands) == 2 and any(map(integer_indicator, o.operands)) \
                and not set(o.edges) <= set(v.edges):
            ops = list(v.operands[:i]) + list(o.operands) + list(v.operands[i + 1:])
            return ctx.c.contract(ops, v.edges)
    return None


# contract(X..., c * [node = ids]) = gathers (node summed) or a scatter (node kept)
def contract_indicator(ctx: Ctx, v: Value) -> Value | None:
    keep = set(v.edges)
    for i, s in enumerate(v.operands):
        if not integer_indicator(s):
            continue
        c, ids = s.operands
        node, I = s.attrs[0], set(ids.edges)
        if node in keep and I <= keep:
            continue   # the indicator used elementwise: dense is its size
        others = [o for j, o in enumerate(v.operands) if j != i]
        gathered = [V.gather(o, ids, node) if node in o.edges else o for o in others]
        if not _is_one(c):
            gathered.append(c)
        if node not in keep:
            if not any(node in o.edges for o in others):
                gathered.append(V.gather(V.const(1.0, v.dtype, [node]), ids, node))
            return ctx.c.contract(gathered, keep)
        if not gathered:
            gathered = [V.const(1.0, v.dtype, I)]
        ct = ctx.c.contract(gathered, (keep - {node}) | I)
        return V.scatter(ct, ids, node, keep & I)
    return None


_FILL = {"max": float("-inf"), "min": float("inf")}


# max_R(where([node = ids], a, -inf)) = segment max (min with inf)
def segment_reduce(ctx: Ctx, v: Value) -> Value | None:
    kind, R = v.attrs[0], set(v.attrs[1])
    w = v.operands[0]
    if kind not in _FILL or w.op != "map" or w.attrs[0] != "where":
        return None
    s, a, fill = w.operands
    if not (integer_indicator(s) and _is_one(s.operands[0])
            and set(s.operands[0].edges) <= set(s.operands[1].edges) and fill.op == "const"
            and fill.attrs[0] == _FILL[kind] and not fill.edges):
        return None
    ids = s.operands[1]
    node, I = s.attrs[0], set(ids.edges)
    if node in R or not (R & I):
        return None
    if node in a.edges:
        a = V.gather(a, ids, node)
    inner = ctx.c.reduce(kind, a, R - I) if R - I else a
    return V.scatter(inner, ids, node, I - R, kind=kind)


SCATTER = {
    "contract": [open_indicator_product, contract_indicator],
    "reduce": [segment_reduce],
}


@dataclass(frozen=True)
class Scatter(Pass):
    """Integer indicators: contractions as gathers/scatters, masked max/min as segment reductions."""

    name = "scatter"

    def run(self, module: Module, options: Options) -> Module:
        return rewrite(module, SCATTER, options)
