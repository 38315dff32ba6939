"""adjoint: reverse mode. Resolves every `grad` and `vjp` into a cotangent program.

Rewrites: `vjp(f, x, v)` becomes the cotangent of `x` when `f` is seeded with `v`:
one cotangent per value, the sum (one `add`) of the contributions of all its
consumers, propagated in reverse topological order over the active values only
(on a path from `x` to `f`: constants and unrelated branches get no cotangent).
Each contribution comes from the consumer's rule in `tgc.autodiff.rules`.
`grad(f, x)` is the vjp seeded with 1 for a scalar `f`, else with the identity
`[e = e.1] ...` over f's edges and fresh copies of them, renamed back at the end
(the Jacobian). Extra edges of `v` (a batch of cotangents) are likewise renamed to
fresh edges while the rules run, so they never meet an intermediate value's edge.
The grads of one scalar `f` (all seeded with 1) share one sweep over the values
active for any of their arguments: a value's cotangent is the same whichever
argument asks, so n parameters cost one sweep, not n.

Nesting (this module holds the driver both derivative passes share): `resolve`
walks the module in topological order and expands the derivative nodes of the
pass's kinds *and every derivative node beneath them*, whatever their kind; an
operand is rebuilt before its user, so each node is expanded after those inside
it and its rules only ever see primitive ops. `adjoint` then `tangent` therefore
leaves no derivative node: after `adjoint` no grad/vjp is left, and the jvps left
have none beneath them.

Terminates: the driver visits each node of the finite module once; an expansion
visits each value of a finite graph once and builds no derivative node.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from tgc.ir import values as V
from tgc.ir.affine import Affine, Relation
from tgc.ir.module import Module
from tgc.ir.values import DERIVATIVE_OPS, Value, rebuild_same, topo_order
from tgc.options import Options
from tgc.ir.passes import Pass
from tgc.autodiff.rules import active_values, fit, fresh_edges, inverse, rule_for, total
from tgc.autodiff.remat import rematerialize
from tgc.autodiff.forward import jvp_value


def reverse(f: Value, x: Value, seed: Value) -> Value | None:
    """The cotangent of `x` when `f`'s cotangent is `seed` (None: exactly zero)."""
    return reverse_many(f, [x], seed)[id(x)]


def reverse_many(f: Value, xs: list[Value], seed: Value) -> dict[int, Value | None]:
    """id(x) -> the cotangent of x (None: exactly zero), for every x of `xs`, from one
    sweep: a value's cotangent does not depend on which x is asked for, and the
    activity of the union only adds values whose cotangents reach none of the others."""
    act = active_values(f, xs)
    want = {id(x) for x in xs}
    out: dict[int, Value | None] = dict.fromkeys(want)
    if id(f) not in act:
        return out
    batch = set(seed.edges) - set(f.edges)
    parts: dict[int, list[Value]] = {id(f): [seed]}
    left = len(want)
    for v in reversed(topo_order([f])):
        ct = total(parts.pop(id(v), ()))
        if id(v) in want:  # every value after the last x in this order depends on none of them
            out[id(v)] = ct
            left -= 1
            if not left:
                break
            continue
        if ct is None:
            continue
        rule = rule_for(v)
        for i in rule.positions(v):
            o = v.operands[i]
            c = rule.vjp(v, i, ct) if id(o) in act else None
            if c is not None:
                parts.setdefault(id(o), []).append(fit(c, set(o.edges) | batch))
    return rematerialize(f, out)


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


EXPAND = {"grad": grad_value, "vjp": vjp_value, "jvp": jvp_value}


def _to_resolve(roots: list[Value], kinds: Iterable[str]) -> set[int]:
    """The derivative nodes of `kinds`, and every derivative node beneath them."""
    tops = [v for v in topo_order(roots) if v.op in kinds]
    return {id(v) for v in topo_order(tops) if v.op in DERIVATIVE_OPS}


def resolve(module: Module, kinds: Iterable[str]) -> Module:
    """The module with those derivative nodes expanded, innermost first.

    The grads of one scalar function (seeded with 1, no fresh edges) share one
    reverse sweep (`reverse_many`) over all their arguments: a program's gradients
    with respect to many parameters cost one sweep, not one each."""
    out = module.replace_values({})  # a copy: fresh edges are registered in it
    values = topo_order(module.roots())
    todo = _to_resolve(module.roots(), tuple(kinds))
    wrt: dict[int, list[Value]] = {}  # id(f) as written -> the x of each grad(f, x) to expand
    for v in values:
        if id(v) in todo and v.op == "grad" and id(v.operands[1]) not in {id(x) for x in wrt.get(id(v.operands[0]), ())}:
            wrt.setdefault(id(v.operands[0]), []).append(v.operands[1])
    sweeps: dict[int, dict[int, Value | None]] = {}  # id(f) as written -> reverse_many's result
    memo: dict[int, Value] = {}
    for v in values:
        ops = tuple(memo[id(o)] for o in v.operands)
        if id(v) not in todo:
            memo[id(v)] = rebuild_same(v, ops)
        elif v.op == "grad" and not ops[0].edges:
            f, x = ops
            cts = sweeps.get(id(v.operands[0]))
            if cts is None:
                cts = sweeps[id(v.operands[0])] = reverse_many(f, wrt[id(v.operands[0])], _identity({}, f.dtype))
            memo[id(v)] = _pull(f, x, _identity({}, f.dtype), {}, cts[id(x)])
        else:
            memo[id(v)] = EXPAND[v.op](out, *ops)
    return out.replace_values(memo)


@dataclass(frozen=True)
class Adjoint(Pass):
    """Reverse mode: grad/vjp -> cotangent programs (and any derivative beneath them)."""

    name = "adjoint"

    def run(self, module: Module, options: Options) -> Module:
        return resolve(module, ("grad", "vjp"))
