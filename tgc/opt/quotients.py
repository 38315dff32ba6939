"""quotients: a product's reciprocal factors become divisions again.

The canonical form writes every quotient `a / b` as the product `a (1/b)` (the rules of
`tgc.opt.rules`), so that quotients meet their factors: `x (1/x) = 1`, softmax's
`exp(d) (1/sum exp(d))`, common factors of a sum. Computed that way, a quotient rounds
twice and can overflow where `a / b` does not: `1/b` is inf in f32 for |b| < 2.9e-39
(`1e-39 / 1e-39` gave inf, not 1) and loses bits as a subnormal for |b| > 8.5e37, and a
derivative's `(1/b)(1/b)` is inf for |b| < 5.4e-20 (`d/dy (x / y)` at x = y = 1e-20 is
-1e20, PyTorch's value, not -inf). Once the algebra is done, this pass turns each
reciprocal factor `1/b` of a contraction back into a division:

    sum_E f g (1/b)  =  sum_E (f / b) g    f the smallest other factor with every edge of b
    prod  f g (1/b)  =  (prod f g) / b     no such f, and b has no summed edge
    (1/b) (1/c)      =  (1 / b) / c        no other factor: the divisions in turn

A reciprocal with a summed edge and no factor that carries all of b's edges (a GEMM
operand scaled along its summed edge) stays a product, and so does a reciprocal with
fewer edges than its product that is provably a normal float of at most 2^40 (`_hoisted`:
layernorm's per-row 1/sqrt(var + eps), which a backend computes once per row). Two
reciprocals of one product divide in turn, never as the product of the reciprocals:
`x (1/y)(1/y)` is `(x / y) / y`, as PyTorch's derivative of `x / y` computes it.

Exact in real arithmetic (a (1/b) = a / b; summing commutes with dividing by a value
constant along the sum), and in floating point it replaces two roundings by one: each
quotient is IEEE's correctly rounded a / b, as the source wrote it. A reciprocal
guarded by a derivative's `mul0` (0 where the cotangent is 0, even where 1/b is inf) is
not a contraction's factor and stays. The backends divide with their own correctly
rounded division (the CPU's `fdiv` without `arcp`).

Terminates: one bottom-up rebuild (loop bodies first, each once); each contraction's
loop removes a reciprocal factor per round and creates none. Runs once, after the
last pass that rewrites by the canonical rules (`simplify`, `stabilize`, `factor`),
which would turn the divisions back into products.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tgc.ir import values as V
from tgc.ir.assume import arg_bounds
from tgc.ir.module import Module
from tgc.ir.passes import Pass
from tgc.ir.values import Value, rebuild
from tgc.options import Options
from tgc.opt.facts import Facts
from tgc.opt.rewrite import map_bodies, prune_edges


def _denominator(v: Value) -> Value | None:
    """b where v is 1/b (or a renaming of 1/b: then b renamed the same way)."""
    mapping = None
    if v.op == "rename":
        mapping, v = dict(v.attrs[0]), v.operands[0]
    if v.op != "map" or v.attrs[0] != "div":
        return None
    one, b = v.operands
    if one.op != "const" or one.attrs[0] != 1.0 or one.edges:
        return None
    return b if mapping is None else V.rename(b, mapping)


def _product(ops: list[Value], keep: set[str], like: Value) -> Value:
    if len(ops) == 1 and set(ops[0].edges) == keep:
        return ops[0]
    return V.contract(ops, keep, like.loc)


SAFE = 2.0 ** -40   # a reciprocal kept as a factor is at most 2^40: its square is finite


def _lower(facts: Facts, b: Value) -> float:
    """A positive lower bound of b (0: none known): a positive constant, a sum with
    positive coefficients of such bounds and of terms >= 0, the square root of one."""
    if b.op == "const":
        return max(b.attrs[0], 0.0)
    if b.op == "rename":
        return _lower(facts, b.operands[0])
    if b.op == "map" and b.attrs[0] == "sqrt":
        return math.sqrt(_lower(facts, b.operands[0]))
    if b.op == "add" and all(c > 0 for c in b.attrs[0]):
        total = 0.0
        for o, c in zip(b.operands, b.attrs[0]):
            if not facts.nonneg(o):
                return 0.0
            total += c * _lower(facts, o)
        return total
    return 0.0


def _hoisted(facts: Facts, b: Value, edges) -> bool:
    """1/b stays a factor of a product over `edges`: it has fewer edges (one reciprocal
    serves many elements, the loop-invariant factor a backend hoists: a layernorm's
    1/sqrt(var + eps) per row, 1.5x faster than a division per element at 64 x 256) and
    provably is at most 2^40 and a normal float (b >= 2^-40, and b <= 2^40 or b a square
    root: at most 2^64 in f32, 2^512 in f64): it cannot overflow or lose bits as a
    subnormal, its square is finite, and multiplying by it costs one rounding more than
    dividing (1.5 ulp against 0.5)."""
    if not set(b.edges) < set(edges) or _lower(facts, b) < SAFE:
        return False
    root = b.operands[0] if b.op == "rename" else b
    return (root.op == "map" and root.attrs[0] == "sqrt") or facts.upper(b) <= 1.0 / SAFE


def quotients(facts: Facts, v: Value, ops: tuple[Value, ...]) -> Value:
    """`v` with new operands `ops`; a contraction with its reciprocal factors as divisions
    (see the module's docstring)."""
    if v.op != "contract":
        return V.rebuild_same(v, ops)
    ops, keep = list(ops), set(v.edges)
    outside: list[Value] = []   # divisors of the whole product, in order
    k = 0
    while k < len(ops):
        b = _denominator(ops[k])
        if b is None or _hoisted(facts, b, keep | set().union(*(o.edges for o in ops))):
            k += 1
            continue
        cover = [j for j, f in enumerate(ops) if j != k and _denominator(f) is None
                 and set(f.edges) >= set(b.edges) and f.dtype == ops[k].dtype]
        if cover:
            j = min(cover, key=lambda j: (len(ops[j].edges), j))
            ops[j] = V.map_("div", ops[j], b, loc=v.loc)
        elif set(b.edges) <= keep and (len(ops) > 1 or outside):
            outside.append(b)
        else:
            k += 1
            continue
        del ops[k]
    if not outside:
        return _product(ops, keep, v) if ops != list(v.operands) else v
    y = _product(ops, keep, v) if ops else V.const(1.0, v.dtype)
    for b in outside:
        y = V.map_("div", y, b, loc=v.loc)
    return y if set(y.edges) == keep else V.contract([y], keep, v.loc)


def _run(module: Module) -> Module:
    module = map_bodies(module, _run)
    facts = Facts(arg_bounds(module))
    memo = rebuild(module.roots(), lambda v, ops: quotients(facts, v, ops))
    return prune_edges(module.replace_values(memo))


@dataclass(frozen=True)
class Quotients(Pass):
    """Reciprocal factors of products as divisions: a / b rounds once, (x / y) / y."""

    name = "quotients"

    def run(self, module: Module, options: Options) -> Module:
        return _run(module)
