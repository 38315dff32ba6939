"""The rules of `simplify`: exact algebra, one table, each rule with its algebra.

`SIMPLIFY` maps an op (for `map`, its fn) to the rules tried on it, in order; each
returns the replacement or None (see `tgc.opt.rewrite`). Rules run on canonical
values (`tgc.opt.canon`), so e.g. constants in products are already a coefficient.

Conditions use `ctx.facts` (finite, sign). A rule that holds only on a closed set
(`x >= 0`) could change a derivative at its boundary, so it waits until no
derivative is left to take (`ctx.derivatives_left`); so does dropping `stop`.

Declared facts (`assume`, `tgc.ir.assume`) enter through `ctx.facts` (the signs and
bounds of arguments) and `assumed` (a value the program declares equal to a constant).

Measure: every rule either removes an op (a map, an indicator, a factor, a stop, a
value declared constant)
or replaces it by ops of strictly lower rank in `tgc.opt.canon`'s sense (a power
by a product, a division by a product with a reciprocal `1/b`, which no rule
rewrites again), so rewriting terminates.
"""
from __future__ import annotations

import math

from tgc.ir import values as V
from tgc.ir.values import Value
from tgc.ir.assume import equalities
from tgc.opt.canon import key
from tgc.opt.products import split_product
from tgc.opt.relations import in_range, is_delta, solve, substitute, truth
from tgc.opt.rewrite import Ctx
from tgc.opt.scatter import SCATTER


def _zero(v: Value) -> Value:
    return V.const(0.0, v.dtype, v.edges)


def _is_const(v: Value, x: float | None = None) -> bool:
    return v.op == "const" and (x is None or v.attrs[0] == x)


def _is_map(v: Value, fn: str) -> bool:
    return v.op == "map" and v.attrs[0] == fn


def recip(ctx: Ctx, b: Value) -> Value:
    return ctx.c.map("div", V.const(1.0, b.dtype), b)


def _closed_ok(ctx: Ctx) -> bool:
    """Rules true only on a closed set may run: no derivative is left to take."""
    return not ctx.derivatives_left


# ---- elementwise functions -------------------------------------------------------------------

# mul0(0, b) = 0                    (exactly, whatever b is)
# mul0(a, 0) = 0                    (a finite)
# mul0(k, b) = k b                  (k a nonzero constant)
# mul0(a, b) = a b                  (b finite: where a = 0 both are 0)
def mul0(ctx: Ctx, v: Value) -> Value | None:
    a, b = v.operands
    if _is_const(a, 0.0) or (_is_const(b, 0.0) and ctx.facts.finite(a)):
        return _zero(v)
    if (_is_const(a) and math.isfinite(a.attrs[0])) or ctx.facts.finite(b):
        return ctx.c.contract([a, b], v.edges)
    return None


# mul00(a, b) = mul0(a, b)          (a finite: where b = 0, a b is 0 too)
# mul00(a, b) = mul0(b, a)          (b finite)
def mul00(ctx: Ctx, v: Value) -> Value | None:
    a, b = v.operands
    if ctx.facts.finite(a):
        return ctx.c.map("mul0", a, b)
    if ctx.facts.finite(b):
        return ctx.c.map("mul0", b, a)
    return None


def _vanishes_with(ctx: Ctx, a: Value, c: Value) -> bool:
    """a is 0 wherever c is 0."""
    if a is c or (_is_map(a, "mul0") and a.operands[0] is c) or (_is_map(a, "mul00") and c in a.operands):
        return True
    if _is_map(a, "mul0") and a.operands[1] is c and ctx.facts.finite(a.operands[0]):
        return True
    if a.op == "add" and len(a.operands) == 1:
        return _vanishes_with(ctx, a.operands[0], c)
    rest = split_product(a, c)
    return rest is not None and all(ctx.facts.finite(o) for o in rest)


# where(k, a, b) = a if k != 0 else b    (k a constant)
# where(c, a, a) = a
# where(c, a, 0) = a                     (a is 0 wherever c is)
# where([R], a, 0) = [R] a               (an indicator is 0 or 1; a finite)
def where(ctx: Ctx, v: Value) -> Value | None:
    c, a, b = v.operands
    if _is_const(c):
        return ctx.c.broadcast(a if c.attrs[0] != 0 else b, v.edges)
    if a is b:
        return ctx.c.broadcast(a, v.edges)
    if _is_const(b, 0.0):
        if _vanishes_with(ctx, a, c):
            return ctx.c.broadcast(a, v.edges)
        if c.op == "indicator" and ctx.facts.finite(a):
            return ctx.c.contract([c, a], v.edges)
    return None


# exp(log x) = x                    (x >= 0: exp(log 0) = 0)
def exp_log(ctx: Ctx, v: Value) -> Value | None:
    x = v.operands[0]
    if _is_map(x, "log") and ctx.facts.nonneg(x.operands[0]) and _closed_ok(ctx):
        return x.operands[0]
    return None


# log(exp x) = x
def log_exp(ctx: Ctx, v: Value) -> Value | None:
    x = v.operands[0]
    return x.operands[0] if _is_map(x, "exp") else None


# a / k = (1/k) a                   (k a nonzero finite constant)
# a / b = a (1/b)                   (so quotients are products, and meet their factors;
#                                   once no derivative is left: a quotient differentiated
#                                   as a product gets d/db from 1/b's -(1/b)(1/b), inf in
#                                   f32 at |b| < 5.4e-20, where a/b's own rule, -(ct a/b)/b,
#                                   is finite. `stabilize` splits a quotient by a sum of
#                                   exps before differentiating: its patterns need it)
def div(ctx: Ctx, v: Value) -> Value | None:
    a, b = v.operands
    if _is_const(b) and b.attrs[0] != 0 and math.isfinite(b.attrs[0]):
        return ctx.c.broadcast(ctx.c.scale(1.0 / b.attrs[0], a), v.edges)
    if _is_const(a, 1.0) or ctx.derivatives_left:
        return None
    return quotient(ctx, v)


def quotient(ctx: Ctx, v: Value) -> Value:
    """a / b as the product a (1/b)."""
    a, b = v.operands
    return ctx.c.contract([a, recip(ctx, b)], v.edges)


_POW_FORMS = {
    0.0: lambda ctx, x: V.const(1.0, x.dtype, x.edges),        # x^0 = 1
    1.0: lambda ctx, x: x,                                      # x^1 = x
    2.0: lambda ctx, x: ctx.c.contract([x, x], x.edges),        # x^2 = x x
    3.0: lambda ctx, x: ctx.c.contract([x, x, x], x.edges),     # x^3 = x x x
    4.0: lambda ctx, x: ctx.c.contract([x] * 4, x.edges),       # x^4 = x x x x
    -1.0: lambda ctx, x: recip(ctx, x),                         # x^-1 = 1/x
    0.5: lambda ctx, x: ctx.c.map("sqrt", x),                   # x^0.5 = sqrt x
    -0.5: lambda ctx, x: recip(ctx, ctx.c.map("sqrt", x)),      # x^-0.5 = 1/sqrt x
}


# x^k for the constants k above: products, reciprocals and square roots
def pow_(ctx: Ctx, v: Value) -> Value | None:
    x, b = v.operands
    if not _is_const(b) or b.attrs[0] not in _POW_FORMS:
        return None
    return ctx.c.broadcast(_POW_FORMS[b.attrs[0]](ctx, x), v.edges)


# max(x, x) = x, min(x, x) = x
# max(0, x) = max(x, 0) = x         (x >= 0)
def extreme(ctx: Ctx, v: Value) -> Value | None:
    a, b = v.operands
    if a is b:
        return a
    if v.attrs[0] == "max" and _closed_ok(ctx):
        for z, x in ((a, b), (b, a)):
            if _is_const(z, 0.0) and ctx.facts.nonneg(x):
                return ctx.c.broadcast(x, v.edges)
    return None


# abs(x) = x                        (x >= 0)
def abs_(ctx: Ctx, v: Value) -> Value | None:
    x = v.operands[0]
    return x if ctx.facts.nonneg(x) and _closed_ok(ctx) else None


# ---- products: deltas, indicators, factors that cancel --------------------------------------------

def _without(ops, *positions) -> list[Value]:
    return [o for k, o in enumerate(ops) if k not in positions]


def _ones(v: Value, edges) -> Value:
    """A factor 1 over `edges`: keeps the count of an edge no other factor carries."""
    return V.const(1.0, v.dtype, edges)


# sum_i [i = j] x = x[i -> j]       (a delta summed over one of its edges is a rename)
def delta(ctx: Ctx, v: Value) -> Value | None:
    keep = set(v.edges)
    for p, d in enumerate(v.operands):
        pair = is_delta(d.attrs[0]) if d.op == "indicator" else None
        for s, t in ((pair, pair[::-1]) if pair else ()):
            others = _without(v.operands, p)
            if s in keep or ctx.module.size(s) != ctx.module.size(t):
                continue
            if any(s in o.edges and t in o.edges for o in others):
                continue  # a diagonal, not a rename
            new = [ctx.c.rename(o, {s: t}) if s in o.edges else o for o in others]
            return ctx.c.contract(new + [_ones(v, [t])], keep)
    return None


# [R] [R] = [R]                     (an indicator is 0 or 1)
def idempotent(ctx: Ctx, v: Value) -> Value | None:
    for p, o in enumerate(v.operands):
        if o.op == "indicator" and o in v.operands[p + 1:]:
            return ctx.c.contract(_without(v.operands, p), v.edges)
    return None


# sum_s [s = f] [R(s)] = [R(f)]     (s in no other factor; 0 <= f < size(s) always)
# sum_s [s = f] = 1                 (likewise, s in no other factor at all)
def compose(ctx: Ctx, v: Value) -> Value | None:
    ops, keep = list(v.operands), set(v.edges)
    inds = [k for k, o in enumerate(ops) if o.op == "indicator"]
    dense = set().union(*(o.edges for o in ops if o.op != "indicator"))
    sizes, env = ctx.sizes(), ctx.env()
    for a in inds:
        for s in ops[a].edges:
            if s in keep or s in dense:
                continue
            f = solve(ops[a].attrs[0], s)
            if f is None or not in_range(f, sizes.get(s), sizes, env):
                continue
            others = [k for k in inds if k != a and s in ops[k].edges]
            new = _composed(ctx, v, ops, a, others, s, f, dense)
            if new is not None:
                return new
    return None


def _composed(ctx: Ctx, v: Value, ops, a: int, others: list[int], s: str, f, dense) -> Value | None:
    keep = set(v.edges)
    if len(others) > 1:
        return None
    if not others:
        rest = set(ops[a].edges) - {s}
        return ctx.c.contract(_without(ops, a) + [_ones(v, rest)], keep)
    b = others[0]
    rel = substitute(ops[b].attrs[0], s, f)

    def work(edges):  # dense contractions an indicator would tie together
        return len([e for e in edges if e in dense and e not in keep])
    if work(rel.edges()) > max(work(ops[a].edges), work(ops[b].edges)):
        return None
    lost = (set(ops[a].edges) | set(ops[b].edges)) - {s} - set(rel.edges())
    new = _without(ops, a, b) + [V.indicator(rel, v.dtype), _ones(v, lost)]
    return ctx.c.contract(new, keep)


# x (1/x) = 1                       (x > 0 and finite)
# sqrt(x) sqrt(x) = x               (x >= 0)
# x^a x^b = x^(a + b)               (x > 0)
def cancel(ctx: Ctx, v: Value) -> Value | None:
    """The first pair that cancels, found through the operands' identities: linear in
    the factors (a product of N factors meets this rule at each of its N sizes)."""
    pair = _cancelling(ctx, v.operands)
    if pair is None:
        return None
    p, q, new = pair
    x = v.operands[p]
    return ctx.c.contract(_without(v.operands, p, q) + new + [_ones(v, x.edges)], v.edges)


def _cancelling(ctx: Ctx, ops) -> tuple[int, int, list[Value]] | None:
    first: dict[int, int] = {}
    for k, o in enumerate(ops):
        first.setdefault(id(o), k)
    for q, y in enumerate(ops):
        if _is_map(y, "div") and _is_const(y.operands[0], 1.0):
            x = y.operands[1]
            p = first.get(id(x))
            if p is not None and p != q and ctx.facts.positive(x) and ctx.facts.finite(x):
                return p, q, []
    sqrt: dict[int, int] = {}
    pows: dict[int, int] = {}
    for q, y in enumerate(ops):
        if _is_map(y, "sqrt"):
            p = sqrt.setdefault(id(y), q)
            if p != q and ctx.facts.nonneg(y.operands[0]) and _closed_ok(ctx):
                return p, q, [y.operands[0]]
        elif _is_map(y, "pow") and _is_const(y.operands[1]):
            base = y.operands[0]
            p = pows.setdefault(id(base), q)
            if p != q and ctx.facts.positive(base):
                k = ops[p].operands[1].attrs[0] + y.operands[1].attrs[0]
                return p, q, [ctx.c.map("pow", base, V.const(k, y.dtype))]
    return None


# ---- reductions, indicators, stop -----------------------------------------------------------------

# max[e](x) = x, min[e](x) = x      (x constant along e: a broadcast)
def reduce_broadcast(ctx: Ctx, v: Value) -> Value | None:
    kind, edges = v.attrs
    x = v.operands[0]
    if kind not in ("max", "min") or x.op != "contract" or len(x.operands) != 1:
        return None
    y = x.operands[0]
    if not set(y.edges) <= set(x.edges) or set(edges) & set(y.edges):
        return None
    return ctx.c.broadcast(y, v.edges)


# [R] = 1 where R always holds, 0 where it never does
def indicator_truth(ctx: Ctx, v: Value) -> Value | None:
    t = truth(v.attrs[0], ctx.sizes(), ctx.env())
    return None if t is None else V.const(1.0 if t else 0.0, v.dtype, v.edges)


# checkpoint(x) = x                 (once no derivative is left to take: adjoint has made
#                                   the backward read recomputed copies, autodiff/remat.py)
def drop_checkpoint(ctx: Ctx, v: Value) -> Value | None:
    return None if ctx.derivatives_left else v.operands[0]


# stop(x) = x                       (once no derivative is left to take)
def drop_stop(ctx: Ctx, v: Value) -> Value | None:
    return None if ctx.derivatives_left else v.operands[0]


# e = c                             (a declared fact `assume e = c`, c a constant; once no
#                                   derivative is left: the fact holds on the inputs, not
#                                   around them, so it says nothing about a derivative)
def assumed(ctx: Ctx, v: Value) -> Value | None:
    if not ctx.module.facts or v.op == "const" or not _closed_ok(ctx):
        return None
    known = ctx.cache.get("assumed")
    if known is None:
        known = ctx.cache["assumed"] = {}
        for side, c in equalities(ctx.module):
            canon = V.rebuild([side], ctx.c.rebuild)[id(side)]
            known[key(canon)] = c
    c = known.get(key(v))
    return None if c is None else V.const(c, v.dtype, v.edges)


SIMPLIFY = {
    "*": [assumed],
    "mul0": [mul0],
    "mul00": [mul00],
    "where": [where],
    "exp": [exp_log],
    "log": [log_exp],
    "div": [div],
    "pow": [pow_],
    "max": [extreme],
    "min": [extreme],
    "abs": [abs_],
    "contract": [delta, idempotent, compose, cancel, *SCATTER["contract"]],
    "reduce": [reduce_broadcast, *SCATTER["reduce"]],
    "indicator": [indicator_truth],
    "stop": [drop_stop],
    "checkpoint": [drop_checkpoint],
}
