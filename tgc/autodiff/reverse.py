"""Reverse mode: the cotangent programs of `grad` and `vjp` (the `adjoint` pass runs
them through `tgc.autodiff.driver`).

Rewrites: `vjp(f, x, v)` becomes the cotangent of `x` when `f` is seeded with `v`:
one cotangent per value, the sum (one `add`) of the contributions of all its
consumers, propagated in reverse topological order over the active values only
(on a path from `x` to `f`: constants and unrelated branches get no cotangent).
Each contribution comes from the consumer's rule in `tgc.autodiff.rules`; the
outputs of one loop (`tgc.autodiff.loops.loop_groups`) contribute together, from one
backward loop seeded with all their cotangents, once the last of them is known.
`grad(f, x)` is the vjp seeded with 1 for a scalar `f`, else with the identity
`[e = e.1] ...` over f's edges and fresh copies of them, renamed back at the end
(the Jacobian). Extra edges of `v` (a batch of cotangents) are likewise renamed to
fresh edges while the rules run, so they never meet an intermediate value's edge.
The grads of one scalar `f` (all seeded with 1) share one sweep over the values
active for any of their arguments: a value's cotangent is the same whichever
argument asks, so n parameters cost one sweep, not n.

Terminates: an expansion visits each value of a finite graph once and builds no
derivative node.
"""
from __future__ import annotations


from tgc.ir import values as V
from tgc.ir.affine import Affine, Relation
from tgc.ir.module import Module
from tgc.ir.values import Value, topo_order
from tgc.autodiff.loops import loop_groups, loops_vjp
from tgc.autodiff.rules import active_values, fit, fresh_edges, inverse, rule_for, total
from tgc.autodiff.remat import rematerialize


def reverse(f: Value, x: Value, seed: Value) -> Value | None:
    """The cotangent of `x` when `f`'s cotangent is `seed` (None: exactly zero)."""
    return reverse_many(f, [x], seed)[id(x)]


def reverse_many(f: Value, xs: list[Value], seed: Value,
                 more: tuple[tuple[Value, Value], ...] = ()) -> dict[int, Value | None]:
    """id(x) -> the cotangent of x (None: exactly zero), for every x of `xs`, from one
    sweep: a value's cotangent does not depend on which x is asked for, and the
    activity of the union only adds values whose cotangents reach none of the others.

    `more` seeds further values `(g, seed_g)` in the same sweep (a loop body's several
    results, `tgc.autodiff.loops`): a value reached from several seeds gets their sum
    before its rule runs, which a custom vjp clause needs (it need not be linear: a
    clip of the sum is not the sum of the clips)."""
    seeds = [(f, seed), *more]
    roots = [g for g, _ in seeds]
    act = _active(roots, xs)
    want = {id(x) for x in xs}
    out: dict[int, Value | None] = dict.fromkeys(want)
    if not any(id(g) in act for g in roots):
        return out
    batch = set(seed.edges) - set(f.edges)
    parts: dict[int, list[Value]] = {}
    for g, s in seeds:
        if id(g) in act:
            parts.setdefault(id(g), []).append(s)
    left = len(want)
    order = topo_order(roots)
    # outputs of one loop (or of a loop and the forward loop that keeps its steps' values)
    # get one backward loop, seeded with all their cotangents once the last is known
    groups = loop_groups([v for v in order if v.op == "loop" and id(v) in act and id(v) not in want])
    waiting: dict[int, int] = {}
    for g in groups.values():
        waiting[g] = waiting.get(g, 0) + 1
    pending: dict[int, list[tuple[Value, Value]]] = {}
    for v in reversed(order):
        ct = total(parts.pop(id(v), ()))
        if id(v) in want:  # every value after the last x in this order depends on none of them
            out[id(v)] = ct
            left -= 1
            if not left:
                break
            continue
        if id(v) in groups:   # the group's outputs come before any of their (shared) operands
            g = groups[id(v)]
            if ct is not None:
                pending.setdefault(g, []).append((v, ct))
            waiting[g] -= 1
            if waiting[g] or g not in pending:
                continue
            cs = loops_vjp(pending.pop(g), reverse_many)
            for i in rule_for(v).positions(v):
                o = v.operands[i]
                if id(o) in act and cs[i] is not None:
                    parts.setdefault(id(o), []).append(fit(cs[i], set(o.edges) | batch))
            continue
        if ct is None:
            continue
        rule = rule_for(v)
        for i in rule.positions(v):
            o = v.operands[i]
            c = None if id(o) not in act else rule.vjp(v, i, ct)
            if c is not None:
                parts.setdefault(id(o), []).append(fit(c, set(o.edges) | batch))
    return rematerialize(roots, out)


def _active(roots: list[Value], xs: list[Value]) -> set[int]:
    """The values of the roots' graphs that depend on any of `xs` (rules' `active_values`)."""
    if len(roots) == 1:
        return active_values(roots[0], xs)
    return set().union(*(active_values(g, xs) for g in roots))


def _pull(f: Value, x: Value, seed: Value, fresh: dict[str, str], ct=False) -> Value:
    """x's cotangent (`ct` when given, a `reverse` result) with the fresh edges renamed back."""
    if ct is False:
        ct = reverse(f, x, seed)
    if ct is None:
        ct = V.const(0.0, x.dtype, set(x.edges) | set(fresh.values()))
    return V.convert(V.rename(ct, inverse(fresh)), x.dtype)   # a gradient has its variable's type


def _identity(fresh: dict[str, str], dtype: str) -> Value:
    """1 where every edge equals its fresh copy: the product of deltas [e = e.1]."""
    deltas = [V.indicator(Relation((Affine.make({e: 1}), Affine.make({n: 1})), ("=",)), dtype)
              for e, n in fresh.items()]
    if not deltas:
        return V.const(1.0, dtype)
    return deltas[0] if len(deltas) == 1 else V.mul(deltas)


def grad_value(module: Module, f: Value, x: Value) -> Value:
    fresh = fresh_edges(module, f.edges)
    return _pull(f, x, _identity(fresh, f.dtype), fresh)


def vjp_value(module: Module, f: Value, x: Value, v: Value) -> Value:
    fresh = fresh_edges(module, set(v.edges) - set(f.edges))
    return _pull(f, x, V.rename(v, fresh), fresh)
