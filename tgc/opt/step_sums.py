"""step_sums: a sum over a loop's stacked results is summed step by step, in the loop.

A loop stacks a result along its edge `e` (reverse mode's loop over a transformer's
layers stacks each layer's weight gradient `dW[layer, ...]`), and a contraction after
the loop sums products of such results over `e` and at least one more edge (global-norm
clipping's `sum(dW^2)`). As written, the loop writes every step's result and the
contraction reads all of them again, after the loop, from a buffer `trip` times the
step's size. This pass gives the loop's body one more stacked result, the step's own
contraction (the same factors, their slices, summed over the same edges but `e`), and
sums those partial results over `e` after the loop:

    contract[E](y1, ..., yn)  =  contract[E](s),   s = loop output: contract[E](r1, ..., rn) per step

where `y1..yn` are stacked results of one loop (the same body, edge, direction and
operands), `r1..rn` the body's results they stack, and `E` the kept edges (without
`e`). The step computes its share right after the result is made, while it is in
cache; what the loop stacks besides is `trip` partial sums of the kept edges' size.

Exact in real arithmetic (a sum over `e` and the other edges is the sum over `e` of
the sums over the other edges). In floating point the terms are added in another
grouping: each step's partial sum is rounded to the program's type once, then the
partials are summed; this is a reassociation of a sum, which the floating-point
contract allows (no cancellation is introduced where the terms are squares, and a sum
accumulates accurately either way: docs/optimization.md). The loop's other results,
and so the gradients themselves, are unchanged: the body keeps every result it had,
in the same order, and computes them as before.

Applies only where the contraction sums an edge besides `e` (otherwise the partials
would be as large as the results: a copy more, no read less), its operands are all
stacked results of the one loop, each of its kept edges is an operand's, and its type is
f32 or f64. A body's own loops are treated first, as programs of their own.

Terminates: one bottom-up rebuild; each loop gets one new body, once (the new results'
contractions are inside it and are not candidates again in this run).
"""
from __future__ import annotations

from dataclasses import dataclass

from tgc.ir import values as V
from tgc.ir.module import Module
from tgc.ir.passes import Pass
from tgc.ir.values import Value
from tgc.options import Options
from tgc.opt.rewrite import map_bodies


def _loop(v: Value) -> tuple:
    """The loop a `loop` value is an output of: its body, edge, direction and operands."""
    body, edge, reverse, _ = v.attrs
    return (body, edge, reverse) + tuple(map(id, v.operands))


def _stacked(v: Value) -> bool:
    return v.op == "loop" and v.attrs[3] >= v.attrs[0].carries


def _matmul(v: Value) -> bool:
    """`v` is a matrix product: two factors, a summed edge, and each factor an edge of
    the result that the other lacks (a GEMM's output, in cache right after it is made;
    not a row sum such as a layernorm's weight gradient, which the group stage joins
    with the sums around it)."""
    if v.op != "contract" or len(v.operands) != 2:
        return False
    a, b = (set(o.edges) for o in v.operands)
    kept = set(v.edges)
    return bool((a | b) - kept) and bool((a - b) & kept) and bool((b - a) & kept)


def candidate(v: Value) -> tuple | None:
    """The loop whose stacked results `v` sums step by step, where the pass applies
    (the module's docstring), else None."""
    if v.op != "contract" or v.dtype not in ("f32", "f64") or not v.operands:
        return None
    if not all(_stacked(o) and o.dtype == v.dtype for o in v.operands):
        return None
    key = _loop(v.operands[0])
    if any(_loop(o) != key for o in v.operands[1:]):
        return None
    edge = key[1]
    edges = set().union(*(o.edges for o in v.operands))
    if edge in v.edges or not set(v.edges) <= edges or not edges - set(v.edges) - {edge}:
        return None
    return key


def _run(module: Module) -> Module:
    module = map_bodies(module, _run)
    found: dict[tuple, list[Value]] = {}
    for v in module.values():
        key = candidate(v)
        if key is not None:
            found.setdefault(key, []).append(v)
    if not found:
        return module
    bodies: dict[tuple, V.LoopBody] = {}
    index: dict[tuple, dict[int, int]] = {}   # loop -> old output index -> new one
    out: dict[int, int] = {}   # id(contraction) -> the output index of its partial sums
    for key, sums in found.items():
        body = key[0]
        after: dict[int, list[Value]] = {}   # old result index -> the partial sums right after it
        made: dict[int, Value] = {}
        for c in sums:
            r = V.contract([body.results[o.attrs[3]] for o in c.operands], c.edges, c.loc)
            last = max(o.attrs[3] for o in c.operands)
            if not _matmul(body.results[last]):
                last = len(body.results) - 1
            if r not in after.setdefault(last, []):
                after[last].append(r)
            made[id(c)] = r
        results, moved = [], {}
        for k, r in enumerate(body.results):
            moved[k] = len(results)
            results.append(r)
            results.extend(after.get(k, ()))
        bodies[key], index[key] = V.loop_body(body.params, results, body.carries, body.slices), moved
        for c in sums:
            out[id(c)] = results.index(made[id(c)], body.carries)

    def fn(v: Value, ops: tuple[Value, ...]) -> Value:
        if v.op == "loop" and _loop(v) in bodies:
            _, edge, reverse, k = v.attrs
            return V.loop(bodies[_loop(v)], edge, ops, index[_loop(v)][k], reverse, v.loc)
        if id(v) in out:
            s = V.loop_output(ops[0], out[id(v)])
            return V.contract([s], v.edges, v.loc)
        return V.rebuild_same(v, ops)

    return module.replace_values(V.rebuild(module.roots(), fn))


@dataclass(frozen=True)
class StepSums(Pass):
    """Sums over a loop's stacked results computed in its steps: no second read after it."""

    name = "step_sums"

    def run(self, module: Module, options: Options) -> Module:
        return _run(module)
