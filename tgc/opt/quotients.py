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

A factor `(1/b)[n = ids]`, a reciprocal gathered (a mean over a graph's in-edges: the
algebra moves a per-node `1/deg` into the sum over edges), is the reciprocal of
`b[n = ids]`. A reciprocal with a summed edge and no factor that carries all of b's
edges (a GEMM operand scaled along its summed edge) stays a product, and so does a
reciprocal with fewer edges than its product that is provably a normal float of at
most 2^40 (`_hoisted`: layernorm's per-row 1/sqrt(var + eps), a graph convolution's
per-node 1/max(deg, 1), which a backend computes once per row or node). Provably:

- b >= 2^-40 (`_lower`: a positive constant, a sum of such and of terms >= 0, a square
  root of one, `max(a, c)` at least the larger of the two bounds), so 1/b <= 2^40 and
  its square is finite;
- b <= 2^62 (`Facts.upper` with the module's edge sizes) or b a square root (at most
  2^64 in f32), so 1/b >= 2^-64 is normal (f32's smallest normal is 2^-126). A count is
  such a b: a sum of terms in [0, 1] (indicators, a scatter of ones) over an edge has
  at most size(e) terms, its fixed size or at most 2^62 (MAX_SIZE, which every call
  checks its sizes against before it runs); `max(deg, 1)` is then in [1, 2^62]. The
  bound is exact arithmetic's: rounding moves a computed sum above it by little (at
  most 2^-24 relative per addition that rounds up, and in f32 an added term of at most
  1 stops moving a partial sum past 2^24), far inside the margin from 2^62 to 2^126.
  A count over two symbolic edges (up to 2^124), a sum of terms up to 2 over one
  (2^63), a sum of unbounded values, a floor below 2^-40 or none: no such proof, and
  the quotient divides per element.

Two reciprocals of one product divide in turn, never as the product of the reciprocals:
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
from tgc.ir.sizes import MAX_SIZE
from tgc.opt.facts import Facts, edge_bounds
from tgc.opt.rewrite import map_bodies, prune_edges


def _denominator(v: Value) -> Value | None:
    """b where v is 1/b, or a renaming or a gather of one (then b renamed or gathered the
    same way: `(1/b)[n = ids]` is `1/b[n = ids]`, a mean's reciprocal per edge)."""
    if v.op in ("rename", "gather"):
        b = _denominator(v.operands[0])
        if b is None:
            return None
        if v.op == "rename":
            return V.rename(b, dict(v.attrs[0]))
        return V.gather(b, v.operands[1], v.attrs[0], v.loc)
    if v.op != "map" or v.attrs[0] != "div":
        return None
    one, b = v.operands
    if one.op != "const" or one.attrs[0] != 1.0 or one.edges:
        return None
    return b


def _product(ops: list[Value], keep: set[str], like: Value) -> Value:
    if len(ops) == 1 and set(ops[0].edges) == keep:
        return ops[0]
    return V.contract(ops, keep, like.loc)


SAFE = 2.0 ** -40   # a reciprocal kept as a factor is at most 2^40: its square is finite
LARGEST = float(MAX_SIZE)   # and at least 2^-62: it and its square are normal floats
REAL = ("f32", "f64")   # a reciprocal's type: bf16 and f16 arithmetic is f32, rounded by to_bf16/to_f16


def _lower(facts: Facts, b: Value) -> float:
    """A positive lower bound of b (0: none known): a positive constant, a sum with
    positive coefficients of such bounds and of terms >= 0, the square root of one, the
    larger of two values (`max(deg, 1)` >= 1), the smaller of two such bounds."""
    if b.op == "const":
        return max(b.attrs[0], 0.0)
    if b.op in ("rename", "gather"):
        return _lower(facts, b.operands[0])
    if b.op == "map" and b.attrs[0] == "sqrt":
        return math.sqrt(_lower(facts, b.operands[0]))
    if b.op == "map" and b.attrs[0] in ("max", "min"):
        pick = max if b.attrs[0] == "max" else min
        return pick(_lower(facts, o) for o in b.operands)
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
    1/sqrt(var + eps) per row, 1.5x faster than a division per element at 64 x 256; a
    graph convolution's 1/max(deg, 1) per node) and provably is a normal float of at
    most 2^40: b >= 2^-40, and b <= 2^62 or b a square root (at most 2^64 in f32, 2^512
    in f64), so 1/b lies in [2^-64, 2^40] and its square is finite. A count is at most
    2^62: `Facts.upper` bounds a sum of terms in [0, 1] (indicators, ones) by its edges'
    sizes, each fixed or at most 2^62 (`MAX_SIZE`, checked before every call). A
    reciprocal is an f32 or f64 value (bf16 and f16 arithmetic is f32, its rounding to
    the storage type an explicit `to_bf16`/`to_f16`, which is no reciprocal), whose
    normal range (2^-126 .. 2^128 in f32) holds these and the squares of those of at
    least 2^-62. Such a reciprocal cannot overflow or lose bits as a subnormal, and
    multiplying by it costs one rounding more than dividing (1.5 ulp against 0.5)."""
    if not set(b.edges) < set(edges) or _lower(facts, b) < SAFE:
        return False
    root = b
    while root.op in ("rename", "gather"):
        root = root.operands[0]
    return (root.op == "map" and root.attrs[0] == "sqrt") or facts.upper(b) <= LARGEST


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
        if b is None or (ops[k].dtype in REAL and _hoisted(facts, b, keep | set().union(*(o.edges for o in ops)))):
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
    facts = Facts(arg_bounds(module), edge_bounds(module))
    memo = rebuild(module.roots(), lambda v, ops: quotients(facts, v, ops))
    return prune_edges(module.replace_values(memo))


@dataclass(frozen=True)
class Quotients(Pass):
    """Reciprocal factors of products as divisions: a / b rounds once, (x / y) / y."""

    name = "quotients"

    def run(self, module: Module, options: Options) -> Module:
        return _run(module)
