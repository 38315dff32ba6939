"""The driver both derivative passes share: `adjoint` (reverse mode: every `grad` and
`vjp`) and `tangent` (forward mode: every `jvp`) are `resolve` with their kinds.

Rewrites: `resolve` walks the module in topological order and expands the derivative
nodes of the pass's kinds *and every derivative node beneath them*, whatever their
kind, with `tgc.autodiff.reverse` (grad, vjp) and `tgc.autodiff.forward` (jvp). An
operand is rebuilt before its user, so each node is expanded after those inside it and
its rules only ever see primitive ops. `adjoint` then `tangent` therefore leaves no
derivative node: after `adjoint` no grad/vjp is left, and the jvps left have none
beneath them. The grads of one scalar function (seeded with 1, no fresh edges) share
one reverse sweep over all their arguments.

Exact: a derivative node is replaced by its derivative program, built from the leaf
rules (`tgc.autodiff.rules`); a loop that the forward loop of a reverse loop extends is
read from that loop (`tgc.autodiff.loops.one_forward_loop`: the same steps, computed
once); nothing else changes.

Terminates: the driver visits each node of the finite module once, and each expansion
terminates (see `reverse` and `forward`).

Imports: rules < remat < forward < reverse < driver (no cycle).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from tgc.autodiff.forward import jvp_value
from tgc.autodiff.loops import one_forward_loop
from tgc.autodiff.reverse import _identity, _pull, grad_value, reverse_many, vjp_value
from tgc.ir.module import Module
from tgc.ir.passes import Pass
from tgc.autodiff.rules import DERIVED_RULES, TAKEN_AGAIN
from tgc.ir.values import DERIVATIVE_OPS, Value, reaches, rebuild_same, topo_order
from tgc.options import Options

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
    final = _final(module, values)
    for v in values:
        ops = tuple(memo[id(o)] for o in v.operands)
        if id(v) not in todo:
            memo[id(v)] = rebuild_same(v, ops)
            continue
        token = TAKEN_AGAIN.set(id(v) not in final)
        try:
            if v.op == "grad" and not ops[0].edges:
                f, x = ops
                cts = sweeps.get(id(v.operands[0]))
                if cts is None:
                    cts = sweeps[id(v.operands[0])] = reverse_many(f, wrt[id(v.operands[0])], _identity({}, f.dtype))
                memo[id(v)] = _pull(f, x, _identity({}, f.dtype), {}, cts[id(x)])
            else:
                memo[id(v)] = EXPAND[v.op](out, *ops)
        finally:
            TAKEN_AGAIN.reset(token)
    return one_forward_loop(out.replace_values(memo))


def _final(module: Module, values: list[Value]) -> set[int]:
    """The derivative nodes whose derivative nothing differentiates again: no other
    derivative node reads them (`rules.TAKEN_AGAIN`), the grads that share a sweep
    (one function) all alike. None where a loop's body holds a derivative node (its
    place in the nesting is not looked for: the rules are made, which is always right,
    and `derivative_rules_done` removes them)."""
    derivs = [v for v in values if v.op in DERIVATIVE_OPS]
    if sum(1 for _ in derivs) != _count_all(module):
        return set()
    under = {id(w) for w in topo_order([o for d in derivs for o in d.operands])}
    final = {id(d) for d in derivs if id(d) not in under}
    by_f: dict[int, list[Value]] = {}
    for d in derivs:
        if d.op == "grad":
            by_f.setdefault(id(d.operands[0]), []).append(d)
    for group in by_f.values():     # one reverse sweep serves them all: final only if all are
        if any(id(d) not in final for d in group):
            final -= {id(d) for d in group}
    return final


def _count_all(module: Module) -> int:
    """The derivative nodes of `module`, those in loop bodies included."""
    n = 0
    seen: set[int] = set()
    stack = list(module.roots())
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        n += v.op in DERIVATIVE_OPS
        stack.extend(v.operands)
        if v.op == "loop":
            stack.extend(v.attrs[0].results)
    return n


def derivative_rules_done(module: Module) -> Module:
    """`module` without the custom rules the derivative rules themselves made (tanh''s,
    `tgc.autodiff.rules.DERIVED_RULES`) once no derivative node is left anywhere (a
    loop's body included) to read them: each such `custom` is replaced by its value
    (exact), so the passes after the derivative passes (`unroll`'s size of a step, a
    loop's kept values) see what they saw before those rules existed. A function's own
    rules (`with vjp`) stay for `without_rules`, as before."""
    if reaches(module.roots(), lambda v: v.op in DERIVATIVE_OPS) or \
            not reaches(module.roots(), _derived_rule):
        return module
    from tgc.opt.rewrite import map_bodies   # the optimizer's body walker (opt imports autodiff)

    module = map_bodies(module, derivative_rules_done)
    memo: dict[int, Value] = {}
    for v in topo_order(module.roots()):
        memo[id(v)] = memo[id(v.operands[0])] if _derived_rule(v) else \
            rebuild_same(v, tuple(memo[id(o)] for o in v.operands))
    return module.replace_values(memo)


def _derived_rule(v: Value) -> bool:
    return v.op == "custom" and v.attrs[0] in DERIVED_RULES


@dataclass(frozen=True)
class Adjoint(Pass):
    """Reverse mode: grad/vjp -> cotangent programs (and any derivative beneath them)."""

    name = "adjoint"

    def run(self, module: Module, options: Options) -> Module:
        return derivative_rules_done(resolve(module, ("grad", "vjp")))


@dataclass(frozen=True)
class Tangent(Pass):
    """Forward mode: jvp -> tangent programs (and any derivative beneath them)."""

    name = "tangent"

    def run(self, module: Module, options: Options) -> Module:
        return derivative_rules_done(resolve(module, ("jvp",)))
