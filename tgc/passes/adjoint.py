"""adjoint: reverse mode. Resolves every `grad` and `vjp` into a cotangent program.

Rewrites: `vjp(f, x, v)` becomes the cotangent of `x` when `f` is seeded with `v`:
one cotangent per value, the sum (one `add`) of the contributions of all its
consumers, propagated in reverse topological order over the active values only
(on a path from `x` to `f`: constants and unrelated branches get no cotangent).
Each contribution comes from the consumer's rule in `tgc.passes.derivatives`.
`grad(f, x)` is the vjp seeded with 1 for a scalar `f`, else with the identity
`[e = e.1] ...` over f's edges and fresh copies of them, renamed back at the end
(the Jacobian). Extra edges of `v` (a batch of cotangents) are likewise renamed to
fresh edges while the rules run, so they never meet an intermediate value's edge.

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
from tgc.passes.base import Pass
from tgc.passes.derivatives import active_values, fit, fresh_edges, inverse, rule_for, total
from tgc.passes.tangent import jvp_value


def reverse(f: Value, x: Value, seed: Value) -> Value | None:
    """The cotangent of `x` when `f`'s cotangent is `seed` (None: exactly zero)."""
    act = active_values(f, x)
    if id(f) not in act:
        return None
    batch = set(seed.edges) - set(f.edges)
    parts: dict[int, list[Value]] = {id(f): [seed]}
    for v in reversed(topo_order([f])):
        if v is x:  # every value after x in this order does not depend on x
            break
        ct = total(parts.pop(id(v), ()))
        if ct is None:
            continue
        rule = rule_for(v)
        for i in rule.positions(v):
            o = v.operands[i]
            c = rule.vjp(v, i, ct) if id(o) in act else None
            if c is not None:
                parts.setdefault(id(o), []).append(fit(c, set(o.edges) | batch))
    return total(parts.get(id(x), ()))


def _pull(f: Value, x: Value, seed: Value, fresh: dict[str, str]) -> Value:
    ct = reverse(f, x, seed)
    if ct is None:
        ct = V.const(0.0, f.dtype, set(x.edges) | set(fresh.values()))
    return V.rename(ct, inverse(fresh))


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
    """The module with those derivative nodes expanded, innermost first."""
    out = module.replace_values({})  # a copy: fresh edges are registered in it
    todo = _to_resolve(module.roots(), tuple(kinds))
    memo: dict[int, Value] = {}
    for v in topo_order(module.roots()):
        ops = tuple(memo[id(o)] for o in v.operands)
        memo[id(v)] = EXPAND[v.op](out, *ops) if id(v) in todo else rebuild_same(v, ops)
    return out.replace_values(memo)


@dataclass(frozen=True)
class Adjoint(Pass):
    """Reverse mode: grad/vjp -> cotangent programs (and any derivative beneath them)."""

    name = "adjoint"

    def run(self, module: Module, options: Options) -> Module:
        return resolve(module, ("grad", "vjp"))
