"""unroll: a loop whose trip count is known becomes its steps, in canonical form.

The backends run no loop yet: this pass is how a program with `repeat` or `scan`
reaches them. It runs after the derivative passes, so the loop and its derivative
loops are what autodiff built (`tgc.autodiff.loops`); each loop over an edge of
fixed size n (a literal dim, or one fixed by the caller's `dims=`) becomes n copies
of its body, in the loop's order:

- step i reads each stacked operand's slice `x[e = i]` (a contraction with the
  indicator `[e = i]`; for a loop's stacked result unrolled here, step i's value
  itself, so that a derivative's steps, which read the carries the forward loop kept,
  recompute exactly the forward's values, which hash-consing then shares) and each
  carry as the step before left it;
- a stacked result is the sum over i of step i's value times `[e = i]`;
- the loop's carries are the last step's.

Loops inside a body are unrolled with it (the pass repeats until none of known size
is left). A loop over a symbolic edge stays: the reference interpreter runs it, and
lowering reports it (`tgc.lower.fuse`). The unrolled module is normalized (the
canonical form the later passes expect of their input).

Exact: each step computes the body's ops on the values the loop would give it, and
a slice or a stacking by indicators selects exact values (products with 1 and sums
with 0). Terminates: each round removes the outermost loops of known size, and the
bodies nest finitely.
"""
from __future__ import annotations

from dataclasses import dataclass

from tgc.ir import values as V
from tgc.ir.affine import Affine, Relation
from tgc.ir.module import Module
from tgc.ir.passes import Pass
from tgc.ir.values import Value, rebuild_same, topo_order
from tgc.options import Options


def _at(edge: str, i: int, dtype: str) -> Value:
    """The indicator [edge = i]."""
    return V.indicator(Relation((Affine.make({edge: 1}), Affine.make({}, i)), ("=",)), dtype)


class _Stacked:
    """The per-step values of the stacked results this pass has built, by the result."""

    def __init__(self):
        self.steps: dict[int, tuple[Value, str, list[Value]]] = {}   # id -> (the value, its edge, steps)

    def add(self, v: Value, edge: str, steps: list[Value]) -> None:
        self.steps[id(v)] = (v, edge, steps)

    def slice(self, x: Value, edge: str, i: int) -> Value:
        found = self.steps.get(id(x))
        if found is not None and found[1] == edge:
            return found[2][i]
        return _slice(x, edge, i)


def _slice(x: Value, edge: str, i: int) -> Value:
    """x[edge = i]: x without `edge`, at index i."""
    if x.dtype == "i32":   # i32 ids are not multiplied: they are gathered by the step index
        raise V.IRError("a loop over i32 stacked operands cannot be unrolled yet")
    return V.contract([x, _at(edge, i, x.dtype)], [e for e in x.edges if e != edge])


def _steps(v: Value, n: int, stacked: _Stacked) -> list[Value]:
    """The outputs of `v`'s loop, unrolled over its n steps."""
    body, edge, reverse, _ = v.attrs
    ops = v.operands
    carry = list(ops[:body.carries])
    ys: list[list[tuple[int, Value]]] = [[] for _ in range(body.stacked)]   # (index, step's value)
    for i in (range(n - 1, -1, -1) if reverse else range(n)):
        args = carry + [stacked.slice(o, edge, i) if body.role(k) == "slice" else o
                        for k, o in enumerate(ops) if k >= body.carries]
        memo = {id(p): a for p, a in zip(body.params, args)}
        for u in topo_order(list(body.results)):
            if id(u) not in memo:
                memo[id(u)] = rebuild_same(u, tuple(memo[id(o)] for o in u.operands))
        results = [memo[id(r)] for r in body.results]
        carry = results[:body.carries]
        for j, y in enumerate(results[body.carries:]):
            ys[j].append((i, y))
    outs = list(carry)
    for steps in ys:
        parts = [V.mul([y, _at(edge, i, y.dtype)]) for i, y in steps]
        out = V.add(parts) if len(parts) > 1 else parts[0]
        stacked.add(out, edge, [y for _, y in sorted(steps, key=lambda t: t[0])])
        outs.append(out)
    return outs


def fixed_loops(module: Module) -> list[Value]:
    """The loops of `module` whose edge has a known size."""
    return [v for v in module.values() if v.op == "loop" and isinstance(module.size(v.attrs[1]), int)]


def unroll(module: Module) -> Module:
    """`module` with every loop over an edge of known size unrolled."""
    stacked = _Stacked()
    while fixed_loops(module):
        done: dict[tuple, list[Value]] = {}
        memo: dict[int, Value] = {}
        for v in module.values():
            ops = tuple(memo[id(o)] for o in v.operands)
            n = module.size(v.attrs[1]) if v.op == "loop" else None
            if isinstance(n, int):
                key = (v.attrs[0], v.attrs[1], v.attrs[2]) + tuple(map(id, ops))
                if key not in done:
                    done[key] = _steps(V.rebuild_same(v, ops), n, stacked)
                memo[id(v)] = done[key][v.attrs[3]]
            else:
                memo[id(v)] = rebuild_same(v, ops)
        module = module.replace_values(memo)
    return module


@dataclass(frozen=True)
class Unroll(Pass):
    """Loops of known trip count -> their steps (what the backends run), normalized."""

    name = "unroll"

    def run(self, module: Module, options: Options) -> Module:
        if not fixed_loops(module):
            return module
        from tgc.opt.rewrite import rewrite

        return rewrite(unroll(module), {}, options)
