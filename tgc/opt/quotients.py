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
operand scaled along its summed edge) stays a product. Two reciprocals of one product
divide in turn, never as the product of the reciprocals: `x (1/y)(1/y)` is
`(x / y) / y`, as PyTorch's derivative of `x / y` computes it.

Exact in real arithmetic (a (1/b) = a / b; summing commutes with dividing by a value
constant along the sum), and in floating point it replaces two roundings by one: each
quotient is IEEE's correctly rounded a / b, as the source wrote it. A reciprocal
guarded by a derivative's `mul0` (0 where the cotangent is 0, even where 1/b is inf) is
not a contraction's factor and stays. The backends divide with their own correctly
rounded division (the CPU's `fdiv` without `arcp`).

Terminates: every rewrite removes a reciprocal factor from a contraction and creates
none (a division is a `map`, which this table does not rewrite). Runs once, after the
last pass that rewrites by the canonical rules (`simplify`, `stabilize`, `factor`),
which would turn the divisions back into products.
"""
from __future__ import annotations

from dataclasses import dataclass

from tgc.ir import values as V
from tgc.ir.module import Module
from tgc.ir.passes import Pass
from tgc.ir.values import Value, rebuild
from tgc.options import Options
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


def quotients(v: Value, ops: tuple[Value, ...]) -> Value:
    """`v` with new operands `ops`; a contraction with its reciprocal factors as divisions
    (see the module's docstring)."""
    if v.op != "contract":
        return V.rebuild_same(v, ops)
    ops, keep = list(ops), set(v.edges)
    outside: list[Value] = []   # divisors of the whole product, in order
    k = 0
    while k < len(ops):
        b = _denominator(ops[k])
        if b is None:
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
    memo = rebuild(module.roots(), quotients)
    return prune_edges(module.replace_values(memo))


@dataclass(frozen=True)
class Quotients(Pass):
    """Reciprocal factors of products as divisions: a / b rounds once, (x / y) / y."""

    name = "quotients"

    def run(self, module: Module, options: Options) -> Module:
        return _run(module)
