"""unroll: a loop whose trip count is known becomes its steps, in canonical form.

The backends run no loop yet: this pass is how a program with `repeat` or `scan`
reaches them. It runs after the derivative passes, so the loop and its derivative
loops are what autodiff built (`tgc.autodiff.loops`); each loop over an edge of
fixed size n (a literal dim, or one fixed by the caller's `dims=`) becomes n copies
of its body, in the loop's order:

- step i reads each stacked operand's slice `x[e = i]` (a contraction with the
  indicator `[e = i]`) and each carry as the step before left it;
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


def _slice(x: Value, edge: str, i: int) -> Value:
    """x[edge = i]: x without `edge`, at index i."""
    if x.dtype == "i32":   # i32 ids are not multiplied: they are gathered by the step index
        raise V.IRError("a loop over i32 stacked operands cannot be unrolled yet")
    return V.contract([x, _at(edge, i, x.dtype)], [e for e in x.edges if e != edge])


def _steps(v: Value, n: int) -> list[Value]:
    """The outputs of `v`'s loop, unrolled over its n steps."""
    body, edge, reverse, _ = v.attrs
    ops = v.operands
    carry = list(ops[:body.carries])
    ys: list[list[Value]] = [[] for _ in range(body.stacked)]
    for i in (range(n - 1, -1, -1) if reverse else range(n)):
        args = carry + [_slice(o, edge, i) if body.role(k) == "slice" else o
                        for k, o in enumerate(ops) if k >= body.carries]
        memo = {id(p): a for p, a in zip(body.params, args)}
        for u in topo_order(list(body.results)):
            if id(u) not in memo:
                memo[id(u)] = rebuild_same(u, tuple(memo[id(o)] for o in u.operands))
        results = [memo[id(r)] for r in body.results]
        carry = results[:body.carries]
        for j, y in enumerate(results[body.carries:]):
            ys[j].append(V.mul([y, _at(edge, i, y.dtype)]))
    return carry + [V.add(parts) if len(parts) > 1 else parts[0] for parts in ys]


def fixed_loops(module: Module) -> list[Value]:
    """The loops of `module` whose edge has a known size."""
    return [v for v in module.values() if v.op == "loop" and isinstance(module.size(v.attrs[1]), int)]


def unroll(module: Module) -> Module:
    """`module` with every loop over an edge of known size unrolled."""
    while fixed_loops(module):
        done: dict[tuple, list[Value]] = {}
        memo: dict[int, Value] = {}
        for v in module.values():
            ops = tuple(memo[id(o)] for o in v.operands)
            n = module.size(v.attrs[1]) if v.op == "loop" else None
            if isinstance(n, int):
                key = (v.attrs[0], v.attrs[1], v.attrs[2]) + tuple(map(id, ops))
                if key not in done:
                    done[key] = _steps(V.rebuild_same(v, ops), n)
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
