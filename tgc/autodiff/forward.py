"""Forward mode: the tangent program of `jvp(f, x, dx)` (the `tangent` pass runs it
through `tgc.autodiff.driver`).

Rewrites: `jvp(f, x, dx)` becomes the tangent of `f` along `dx`, built forward in
topological order over the active values only (those of f's graph that depend on
`x`) whose tangent `f`'s reads, each tangent given by the value's rule in
`tgc.autodiff.rules` (a custom call's tangent by its own jvp rule: its body is
not differentiated). Extra
edges of `dx` (a batch of tangents) are renamed to fresh edges while the rules run,
so they never meet an edge of an intermediate value, and renamed back at the end.

Nesting: both `tangent` and `adjoint` run the one driver, `tgc.autodiff.driver.resolve`,
which resolves the nodes of its kinds and every derivative node beneath them, innermost
first; so a jvp of a grad works here, and a grad of a jvp in `adjoint`.

Terminates: one visit per value of f's finite graph per jvp node; the rules build no
derivative nodes.
"""
from __future__ import annotations

from tgc.ir import values as V
from tgc.ir.module import Module
from tgc.ir.values import Value, topo_order
from tgc.autodiff.loops import loop_jvp
from tgc.autodiff.rules import active_values, fit, fresh_edges, inverse, rule_for


def forward(f: Value, x: Value, dx: Value, more: tuple[tuple[Value, Value], ...] = ()) -> Value | None:
    """The tangent of `f` when `x` moves along `dx` (None: exactly zero).

    `more` moves further values `(y, dy)` at once (a loop body's several parameters,
    `tgc.autodiff.loops`): a value that depends on several of them gets one tangent from
    all of theirs, which a custom jvp clause needs (it need not be linear in them)."""
    moving = [(x, dx), *more]
    act = active_values(f, [y for y, _ in moving])
    batch = set(dx.edges) - set(x.edges)
    tangents = {id(y): dy for y, dy in moving}
    order = topo_order([f])
    needed = _needed(f, order)
    for v in order:
        if id(v) not in act or id(v) not in needed or id(v) in tangents:
            continue
        rule = rule_for(v)
        ts = [tangents.get(id(o)) if i in rule.positions(v) else None for i, o in enumerate(v.operands)]
        t = None if all(t is None for t in ts) else loop_jvp(v, ts, forward) if v.op == "loop" else rule.jvp(v, ts)
        if t is not None:
            tangents[id(v)] = fit(t, set(v.edges) | batch)
    return tangents.get(id(f))


def _needed(f: Value, order: list[Value]) -> set[int]:
    """ids of the values whose tangent f's tangent reads: f, and the operands at the
    derivative positions of needed values. A custom call's body and rules are not
    needed (its tangent comes from its jvp rule), nor is anything only they use."""
    needed = {id(f)}
    for v in reversed(order):
        if id(v) in needed:
            needed.update(id(v.operands[i]) for i in rule_for(v).positions(v))
    return needed


def jvp_value(module: Module, f: Value, x: Value, dx: Value) -> Value:
    """The value of `jvp(f, x, dx)`; registers fresh batch edges in `module`."""
    fresh = fresh_edges(module, set(dx.edges) - set(x.edges))
    t = forward(f, x, V.rename(dx, fresh))
    if t is None:
        t = V.const(0.0, f.dtype, set(f.edges) | set(fresh.values()))
    return V.convert(V.rename(t, inverse(fresh)), f.dtype)   # a tangent has its function's type
