"""unroll: a short loop whose trip count is known becomes its steps, in canonical form.

A loop that stays reaches the backends as a loop (`tgc.lower.steps`: its step is
compiled once); unrolling it instead costs compile time and code in proportion to
its trip count, and gains fusion across the steps. The cost model is one rule: a
loop over an edge of fixed size n (a literal dim, or one fixed by the caller's
`dims=`) whose step holds s ops is unrolled when n * s <= `options.unroll_max_ops`
(a small cell over a few steps; a transformer block over its layers stays a loop),
unless it slices an i32 operand (ids read per step stay a loop's slices).
A backend that runs no loops has every loop of fixed size unrolled before it
lowers (`tgc.pipeline.lower_module`).

It runs after the derivative passes, so the loop and its derivative loops are what
autodiff built (`tgc.autodiff.loops`); each loop it unrolls becomes n copies of its
body, in the loop's order:

- step i reads each stacked operand's slice `x[e = i]` (a contraction with the
  indicator `[e = i]`; for a loop's stacked result unrolled here, step i's value
  itself, so that a derivative's steps, which read the carries the forward loop kept,
  recompute exactly the forward's values, which hash-consing then shares) and each
  carry as the step before left it;
- a stacked result is the sum over i of step i's value times `[e = i]`;
- the loop's carries are the last step's.

Loops inside a body are unrolled with it (the pass repeats until none it should
unroll is left). A loop over a symbolic edge stays. The unrolled module is normalized (the
canonical form the later passes expect of their input).

Exact: each step computes the body's ops on the values the loop would give it, and
a slice or a stacking by indicators selects exact values (products with 1 and sums
with 0). Terminates: each round removes the outermost loops of known size, and the
bodies nest finitely.
"""
from __future__ import annotations

from dataclasses import dataclass

from tgc.ir import values as V
from tgc.ir.diag import CompileError
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

    def slice(self, x: Value, edge: str, i: int, loc=None) -> Value:
        found = self.steps.get(id(x))
        if found is not None and found[1] == edge:
            return found[2][i]
        return _slice(x, edge, i, loc)


def _slice(x: Value, edge: str, i: int, loc=None) -> Value:
    """x[edge = i]: x without `edge`, at index i."""
    if x.dtype == "i32":   # i32 ids are arguments, never slices of one: the loop must stay
        raise CompileError(f"a loop over '{edge}' whose step reads slices of i32 data (gather ids, random "
                           f"keys) runs only as a loop, and this backend runs no loops", loc)
    # a product of bf16/f16 has the compute type: the slice (one element of x each, exact)
    # is converted back to x's type, the type of the step's parameter it stands for
    return V.convert(V.contract([x, _at(edge, i, x.dtype)], [e for e in x.edges if e != edge]), x.dtype)


def _steps(v: Value, n: int, stacked: _Stacked) -> list[Value]:
    """The outputs of `v`'s loop, unrolled over its n steps."""
    body, edge, reverse, _ = v.attrs
    ops = v.operands
    carry = list(ops[:body.carries])
    ys: list[list[tuple[int, Value]]] = [[] for _ in range(body.stacked)]   # (index, step's value)
    for i in (range(n - 1, -1, -1) if reverse else range(n)):
        args = carry + [stacked.slice(o, edge, i, v.loc) if body.role(k) == "slice" else o
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
        # (a bf16 step value's stack: products and sums of bf16 have the compute type;
        # each element is one step's value, so the conversion back is exact)
        out = V.convert(out, steps[0][1].dtype)
        stacked.add(out, edge, [y for _, y in sorted(steps, key=lambda t: t[0])])
        outs.append(out)
    return outs


def step_ops(v: Value) -> int:
    """How many ops one step of loop `v` computes."""
    return len(topo_order(list(v.attrs[0].results)))


def reads_i32_slices(v: Value) -> bool:
    """Loop `v`'s steps read slices of an i32 operand (gather ids, random keys)."""
    body = v.attrs[0]
    return any(o.dtype == "i32" and body.role(k) == "slice" for k, o in enumerate(v.operands) if k >= body.carries)


def fixed_loops(module: Module, max_ops: int | None = None) -> list[Value]:
    """The loops of `module` whose edge has a known size n (and, with `max_ops`, whose n
    steps hold at most that many ops and read no i32 slice: an i32 value is an argument,
    never a slice of one, so such a loop stays a loop, which every backend runs)."""
    out = []
    for v in module.values():
        n = module.size(v.attrs[1]) if v.op == "loop" else None
        if isinstance(n, int) and (max_ops is None or (n * step_ops(v) <= max_ops and not reads_i32_slices(v))):
            out.append(v)
    return out


def unroll(module: Module, max_ops: int | None = None) -> Module:
    """`module` with every loop over an edge of known size unrolled (with `max_ops`:
    those `fixed_loops` names)."""
    stacked = _Stacked()
    while fixed_loops(module, max_ops):
        done: dict[tuple, list[Value]] = {}
        memo: dict[int, Value] = {}
        chosen = {id(v) for v in fixed_loops(module, max_ops)}
        for v in module.values():
            ops = tuple(memo[id(o)] for o in v.operands)
            n = module.size(v.attrs[1]) if id(v) in chosen else None
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
    """Short loops of known trip count -> their steps, normalized (`all`: every loop
    of known trip count, for a backend that runs no loops)."""

    name = "unroll"
    all: bool = False

    def run(self, module: Module, options: Options) -> Module:
        limit = None if self.all else options.unroll_max_ops
        if fixed_loops(module, limit):
            from tgc.opt.rewrite import rewrite

            module = rewrite(unroll(module, limit), {}, options)
        if self.all:
            check_no_loops(module)
        return module


def check_no_loops(module: Module) -> None:
    """A located error for a loop left for a backend that runs no loops: its trip count
    is symbolic, and only a size given at build time unrolls it."""
    for v in module.values():
        if v.op == "loop":
            edge = v.attrs[1]
            dim = module.edges[edge]
            raise CompileError(f"a loop over '{edge}', whose size is symbolic, runs on this backend only "
                               f"unrolled, which needs its size when it is built "
                               f"(dims={{'{dim}': N}} in tgc.compile, --dim {dim}=N on the command line)", v.loc)
