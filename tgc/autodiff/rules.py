"""Derivative rules of the leaf primitives: one table, a few lines per primitive.

`RULES` maps an op name (for `map`, its fn) to a `Rule`:

- `diff`: the operand positions that can carry a derivative; the others (indices,
  conditions, comparisons, `stop`) get none, which is also what activity analysis
  reads: a value is active only through a `diff` operand.
- `vjp(v, i, ct)`: the cotangent contribution of `v`'s cotangent `ct` to operand `i`.
- `jvp(v, ts)`: the tangent of `v`, `ts[i]` the tangent of operand `i` or None (zero).

`ct` and the tangents carry `v`'s edges plus the batch edges of the seed; a rule may
return a value with extra or missing edges, and the driver `fit`s it (sums or
broadcasts) to the operand's edges plus the batch edges. None means exactly zero.

NaN safety (LANGUAGE.md section 8): a cotangent or tangent meets a possibly
infinite partial only through `mul0(ct, partial)`, exact 0 where `ct` is 0; an
elementwise product is `mul00(ct, other)`, exact 0 where either is 0; `where`,
`max` and `min` select with `where`, never multiply, so the branch not taken
adds nothing. Composites (softmax, layernorm, ...) have no rules: they are inlined.

Custom rules (`custom`, a call of a .tg function that gives its own `with vjp(g)` or
`with jvp(dx, ...)`): the rule is the function's clause, kept as IR over `slot`
placeholders, and `instantiate` substitutes the actual cotangent or tangents for the
placeholders. The result is ordinary IR, so a second derivative differentiates the
clause like any other code. A rule the function does not give is a located error
naming the function and the rule.
"""
from __future__ import annotations

import math
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

from tgc.ir import values as V
from tgc.ir.diag import CompileError
from tgc.ir.dtypes import CONVERSIONS, ROUNDINGS
from tgc.ir.module import Module
from tgc.ir.values import Value, topo_order

Vjp = Callable[[Value, int, Value], Optional[Value]]
Jvp = Callable[[Value, Sequence[Optional[Value]]], Optional[Value]]


@dataclass(frozen=True)
class Rule:
    diff: tuple[int, ...] | None  # None: every operand
    vjp: Vjp | None = None
    jvp: Jvp | None = None

    def positions(self, v: Value) -> Sequence[int]:
        return range(len(v.operands)) if self.diff is None else self.diff


ZERO = Rule(())


# ---- small builders ------------------------------------------------------------

def _c(v: Value, x: float) -> Value:
    return V.const(x, v.dtype)


def _neg(x: Value) -> Value:
    return V.add([x], [-1.0])


def _fn(fn: str, *xs: Value) -> Value:
    return V.map_(fn, *xs)


def _mul0(t: Value, partial: Value) -> Value:
    """t * partial, exactly 0 where t is 0 (even where partial is inf or NaN)."""
    return _fn("mul0", t, partial)


def _times(t: Value, other: Value) -> Value | None:
    """t * other, exactly 0 where either is 0 (an elementwise product's chain rule).
    One primitive, `mul00`, whose own derivative is a product's: a `where(other, ...,
    0)` guard would have had none where other = 0, and lost second derivatives there
    (the Hessian of sum(x * x) was 0 at x = 0)."""
    if other.op == "const":
        return None if other.attrs[0] == 0.0 else _mul0(t, other)
    return _fn("mul00", t, other)


def total(parts: Iterable[Value | None]) -> Value | None:
    """The sum of the non-None parts (None when there are none)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else V.add(parts)


def fit(t: Value, edges: Iterable[str]) -> Value:
    """`t` summed over edges it has beyond `edges`, broadcast over those it lacks."""
    want = tuple(sorted(set(edges)))
    return t if t.edges == want else V.contract([t], want)


def _batch(v: Value, t: Value) -> set[str]:
    """The batch edges of `t`, a cotangent or tangent of `v`."""
    return set(t.edges) - set(v.edges)


def _keep(v: Value, t: Value) -> set[str]:
    """The edges of v's tangent, given the tangent `t` of its operand."""
    return set(v.edges) | _batch(v.operands[0], t)


# ---- rule families ---------------------------------------------------------------

Partial = Callable[..., Value]


def pointwise(*partials: Partial | None) -> Rule:
    """A map fn whose partial w.r.t. operand i is `partials[i](v, *operands)`."""
    def vjp(v, i, ct):
        return _mul0(ct, partials[i](v, *v.operands))

    def jvp(v, ts):
        return total(_mul0(t, partials[i](v, *v.operands)) for i, t in enumerate(ts) if t is not None)
    return Rule(tuple(i for i, p in enumerate(partials) if p), vjp, jvp)


def _product(v: Value, i: int, t: Value, keep: set[str], reverse: bool = False) -> Value | None:
    """t times every operand of the contraction `v` but the i-th, summed to `keep`.

    A product that sums is one unguarded contraction (a GEMM), except where one
    operand already spans the product (`sum(w * t)`, `W[m, n] @ t[n]`: no outer
    product to avoid): then the guarded elementwise product is summed, so that a tangent
    or cotangent that is inf where the weight is an exact 0 (d sqrt(x) at x = 0) adds
    nothing (LANGUAGE.md section 8). In reverse mode only where the cotangent is
    broadcast over the weight (a vector-matrix shape: `W @ x`'s cotangent to `x`); a
    cotangent that spans the product itself (a weight gradient, `sum[b](ct * xn)`) keeps
    the plain contraction, a performance choice: an inf there meeting an exact-0 operand
    still gives NaN (tests/e2e/test_spec_combos.py says which cases are covered)."""
    others = [o for j, o in enumerate(v.operands) if j != i]
    union = set(t.edges).union(*(o.edges for o in others))
    if not union <= keep:
        spans = [o for o in others if union <= set(o.edges)] if reverse else \
            [o for o in [t] + others if union <= set(o.edges)]
        if not spans or (reverse and union <= set(t.edges)):
            return V.contract([t] + others, keep)  # it sums: one contraction (a GEMM), unguarded
        for o in others:
            t = _times(t, o) if t is not None else None
        return None if t is None else V.contract([t], tuple(sorted(keep & union)))
    for o in others:  # elementwise: guarded products
        t = _times(t, o) if t is not None else None
    return t


def _contract_vjp(v: Value, i: int, ct: Value) -> Value | None:
    return _product(v, i, ct, set(v.operands[i].edges) | _batch(v, ct), reverse=True)


def _contract_jvp(v: Value, ts) -> Value | None:
    return total(_product(v, i, t, set(v.edges) | _batch(v.operands[i], t))
                 for i, t in enumerate(ts) if t is not None)


def _add_vjp(v: Value, i: int, ct: Value) -> Value | None:
    c = v.attrs[0][i]
    return None if c == 0 else ct if c == 1 else V.add([ct], [c])


def _add_jvp(v: Value, ts) -> Value | None:
    live = [(c, t) for c, t in zip(v.attrs[0], ts) if t is not None and c != 0]
    return V.add([t for _, t in live], [c for c, _ in live]) if live else None


def select(cond: Callable[[Value], Value], branches: tuple[int, int]) -> Rule:
    """`where(cond, a, b)`: a gets where(cond, ct, 0), b gets where(cond, 0, ct)."""
    def vjp(v, i, ct):
        z = _c(v, 0.0)
        return _fn("where", cond(v), ct, z) if i == branches[0] else _fn("where", cond(v), z, ct)

    def jvp(v, ts):
        a, b = (ts[j] if ts[j] is not None else _c(v, 0.0) for j in branches)
        return _fn("where", cond(v), a, b)
    return Rule(branches, vjp, jvp)


def _extreme_weights(v: Value) -> Value:
    """max[e]/min[e]: 1/count at each position attaining the extreme, else 0 (ties share)."""
    hit = _fn("eq", v.operands[0], v)
    return _fn("div", hit, V.contract([hit], v.edges))


def _minus1(b: Value) -> Value:
    if b.op == "const":
        return V.const(b.attrs[0] - 1.0, b.dtype, b.edges)
    return V.add([b, _c(b, 1.0)], [1.0, -1.0])


def _pow_exponent_partial(v: Value, a: Value, b: Value) -> Value:
    """d(a^b)/db = a^b log a: exactly 0 where a^b is 0 (a = 0 < b), and 0 at a = 0 <= b,
    where a^0 = 1 and log 0 = -inf would give -inf (PyTorch's and JAX's convention: the
    derivative of 0^b is taken from b > 0, where 0^b is constant 0). Complex powers keep
    a^b log a."""
    partial = _mul0(v, _fn("log", a))
    if v.dtype.startswith("c"):
        return partial
    zero = _c(v, 0.0)
    return _fn("where", V.mul([_fn("eq", a, zero), _fn("ge", b, zero)]), zero, partial)


def _matched(table: Value, ids: Value) -> set[str]:
    """The edges a gather matches between table and ids (a scatter keeps them)."""
    return set(table.edges) & set(ids.edges)


def _segment_weights(v: Value) -> Value:
    """A segment max/min: 1/count at each term attaining its segment's extreme, else 0
    (ties share, as `_extreme_weights` of the dense `max[e](where([n = ids], x, -inf))`).
    The extreme and the count are gathered back to the terms: O(terms), never a
    segments x terms tensor."""
    x, ids = v.operands
    edge, keep = v.attrs[0], _matched(v, ids)
    hit = _fn("eq", x, V.gather(v, ids, edge))
    count = V.scatter(hit, ids, edge, keep)
    return _fn("div", hit, V.gather(count, ids, edge))


def _scatter_vjp(v: Value, ct: Value) -> Value:
    """A scatter-add is transposed by a gather; a segment max/min sends each segment's
    cotangent, gathered, to the terms that attain the extreme."""
    back = V.gather(ct, v.operands[1], v.attrs[0])
    return back if v.attrs[1] == "sum" else _mul0(back, _segment_weights(v))


def _scatter_jvp(v: Value, t: Value) -> Value:
    ids = v.operands[1]
    if v.attrs[1] != "sum":
        t = V.mul([t, _segment_weights(v)])
    return V.scatter(t, ids, v.attrs[0], _matched(v, ids))


def _recip(v: Value, b: Value) -> Value:
    """1/b, as `v` itself when v = 1/b."""
    a = v.operands[0]
    if v.operands[1] is b and a.op == "const" and a.attrs[0] == 1.0 and not a.edges:
        return v
    return _fn("div", _c(v, 1.0), b)


def _div_part(v: Value, i: int, t: Value) -> Value:
    """The chain rule of v = a/b for the cotangent or tangent `t` of operand i:
    t/b for a, -(t v)/b for b (d/db = -a/b^2 = -v/b), the latter with `t` multiplied in
    first. The partial -v/b alone overflows where its product with t does not: the
    optimizer writes every a/b as a (1/b), so v/b is (1/b)(1/b), inf in f32 once
    |b| < 5.4e-20, where PyTorch's -(grad (a/b))/b is finite (t = a, v = 1/b = 1e20 at
    a = b = 1e-20). Each factor is a guarded product (`mul0`): exact 0 where t is."""
    if i == 0:
        return _mul0(t, _recip(v, v.operands[1]))
    return _neg(_mul0(_mul0(t, v), _recip(v, v.operands[1])))


def _summed(fn: Callable[[Value, int, Value], Value | None]) -> Jvp:
    """The jvp that sums `fn(v, i, t_i)` over the operands that have a tangent."""
    return lambda v, ts: total(fn(v, i, t) for i, t in enumerate(ts) if t is not None)


# The `custom` names of the rules that derivative rules make (`_tanh_partial`): the
# derivative passes replace them by their values once no derivative is left
# (`tgc.autodiff.driver.derivative_rules_done`).
DERIVED_RULES = ("tanh'",)

# Whether the derivative being built may be differentiated again. The driver
# (`tgc.autodiff.driver.resolve`), the one place derivatives nest, sets it while it
# expands a derivative node that another derivative node reads. Elsewhere (a first
# derivative; `tgc explain`'s plan of a loop's backward step) the rules above would never
# be read, and a loop's backward step would keep the values they read (tanh's argument)
# for nothing. Not an option: the same derivative program either way, once the rules
# are gone.
TAKEN_AGAIN: ContextVar[bool] = ContextVar("tgc_derivative_taken_again", default=False)


def _tanh_partial(v: Value, a: Value) -> Value:
    """tanh'(a) for v = tanh(a): the value (1 - v)(1 + v), with the derivative of sech^2(a).

    The value is PyTorch's tanh backward (0 where tanh rounds to +-1, |a| > 9 in f32; the
    exact 4 sigmoid(2a) sigmoid(-2a) made gelu's backward 1.5x slower). Its own derivative,
    which a second derivative (a Hessian) takes, is a custom rule (`custom`, as a function
    `with vjp/jvp` has): -2 v s with s = 4 sigmoid(2a) sigmoid(-2a), sech^2 accurate in
    both tails, so gelu''(6) is -6.8e-9 (PyTorch: -7.3e-9, its double backward writes sech
    as 1 / cosh), not 0, which differentiating (1 - v)(1 + v) gives (-2 v (1 - v)(1 + v)).
    The derivative passes replace the rule by its value once no derivative is left
    (`tgc.autodiff.driver.derivative_rules_done`): a program's tanh' and a first
    derivative (gelu's backward) are what they were, and s is computed only in a
    derivative of tanh'. The rule's value is the derivative of the custom's value in real
    arithmetic, so reverse and forward mode and any nesting agree."""
    p = V.mul([V.add([_c(v, 1.0), v], [1.0, -1.0]), V.add([_c(v, 1.0), v])])
    if not TAKEN_AGAIN.get():
        return p
    s = V.mul([_c(v, 4.0), _fn("sigmoid", V.mul([_c(v, 2.0), a])), _fn("sigmoid", V.mul([_c(v, -2.0), a]))])
    ds = V.mul([_c(v, -2.0), v, s])                     # d sech^2(a) / da = -2 tanh(a) sech^2(a)
    ct, tan = "tanh'.ct", "tanh'.t"
    return V.custom(p, [a], [V.mul([V.slot(ct, v.dtype, p.edges), ds])],
                    V.mul([V.slot(tan, v.dtype, a.edges), ds]), "tanh'", ct, (tan,))


# ---- the table ------------------------------------------------------------------------

_PRODUCT = Rule((0, 1), lambda v, i, ct: _times(ct, v.operands[1 - i]),
                _summed(lambda v, i, t: _times(t, v.operands[1 - i])))

_2_SQRT_PI = 2.0 / math.sqrt(math.pi)

RULES: dict[str, Rule] = {
    # leaves and zero-derivative ops
    **{op: ZERO for op in ("arg", "const", "size", "indicator", "stop", "random")},   # a draw is a constant
    **{fn: ZERO for fn in ("sign", "lt", "le", "gt", "ge", "eq", "ne")},
    # sum_i c_i x_i: each operand gets c_i ct
    "add": Rule(None, _add_vjp, _add_jvp),
    # product summed over the edges not kept: ct times the other operands
    "contract": Rule(None, _contract_vjp, _contract_jvp),
    # max[e]/min[e]: the extreme positions share the cotangent evenly
    "reduce": Rule((0,), lambda v, i, ct: _mul0(ct, _extreme_weights(v)),
                   lambda v, ts: V.contract([ts[0], _extreme_weights(v)], _keep(v, ts[0]))),
    # table[edge = ids]: transposed by scatter-add, and scatter by gather
    "gather": Rule((0,), lambda v, i, ct: V.scatter(ct, v.operands[1], v.attrs[0], _matched(*v.operands)),
                   lambda v, ts: V.gather(ts[0], v.operands[1], v.attrs[0])),
    "scatter": Rule((0,), lambda v, i, ct: _scatter_vjp(v, ct), lambda v, ts: _scatter_jvp(v, ts[0])),
    # rename: the inverse rename
    "rename": Rule((0,), lambda v, i, ct: V.rename(ct, inverse(dict(v.attrs[0]))),
                   lambda v, ts: V.rename(ts[0], dict(v.attrs[0]))),
    # where(c, a, b); max/min send a tie to the first argument
    "where": select(lambda v: v.operands[0], (1, 2)),
    "max": select(lambda v: _fn("ge", *v.operands), (0, 1)),
    "min": select(lambda v: _fn("le", *v.operands), (0, 1)),
    # mul0(a, b) = mul00(a, b) = a b: products
    # checkpoint(x) and a recomputation's recompute(x) are x: the cotangent passes through
    "checkpoint": Rule((0,), lambda v, i, ct: ct, lambda v, ts: ts[0]),
    "recompute": Rule((0,), lambda v, i, ct: ct, lambda v, ts: ts[0]),
    "mul0": _PRODUCT,
    "mul00": _PRODUCT,
    # elementwise functions: their partial derivatives
    "exp": pointwise(lambda v, a: v),                                   # exp' = exp
    "log": pointwise(lambda v, a: _fn("div", _c(v, 1.0), a)),           # log' = 1/a
    "sqrt": pointwise(lambda v, a: _fn("div", _c(v, 0.5), v)),          # sqrt' = 1/(2 sqrt a)
    # tanh' = (1 - tanh)(1 + tanh) = 1 - tanh^2: 0 where tanh rounds to +-1 (|a| > 9 in
    # f32), as PyTorch's. The factored form rounds twice, 1 - t^2 without a fused
    # multiply-add loses the bits of t^2 near |t| = 1 (1e-4 relative at a = 4.4, 30x
    # PyTorch's fused error); the exact 4 s(2a) s(-2a) costs an exp and two divisions,
    # so only tanh''s own derivative uses it (_tanh_partial)
    "tanh": pointwise(lambda v, a: _tanh_partial(v, a)),
    "erf": pointwise(lambda v, a: V.mul([_c(v, _2_SQRT_PI), _fn("exp", V.mul([_c(v, -1.0), a, a]))])),
    "log1p": pointwise(lambda v, a: _fn("div", _c(v, 1.0), V.add([_c(v, 1.0), a]))),  # 1/(1 + a)
    "expm1": pointwise(lambda v, a: _fn("exp", a)),                     # exp(a); v + 1 would cancel for a << 0
    # atan' = 1/(1 + a^2), asinh' = 1/sqrt(1 + a^2), as PyTorch computes them (0 where a^2 overflows)
    "atan": pointwise(lambda v, a: _fn("div", _c(v, 1.0), V.add([_c(v, 1.0), V.mul([a, a])]))),
    "asinh": pointwise(lambda v, a: _fn("div", _c(v, 1.0), _fn("sqrt", V.add([_c(v, 1.0), V.mul([a, a])])))),
    "sin": pointwise(lambda v, a: _fn("cos", a)),
    "cos": pointwise(lambda v, a: _neg(_fn("sin", a))),
    "abs": pointwise(lambda v, a: _fn("sign", a)),                      # sign, 0 at 0
    "div": Rule((0, 1), lambda v, i, ct: _div_part(v, i, ct),            # ct/b, -(ct v)/b
                _summed(lambda v, i, t: _div_part(v, i, t))),
    "pow": pointwise(lambda v, a, b: _mul0(b, _fn("pow", a, _minus1(b))),  # b a^(b-1), 0 where b = 0
                     _pow_exponent_partial),                            # a^b log a, 0 where a^b = 0 or a = 0 <= b
}


# conversions and roundings pass a derivative through, converted to the receiver's type
# (a gradient has its variable's type; roundings are straight-through: they exist only
# after the pipeline, in a backend's emulation of bf16/f16)
for _fn_name in (*CONVERSIONS, *ROUNDINGS):
    RULES[_fn_name] = Rule((0,), lambda v, i, ct: V.convert(ct, v.operands[0].dtype),
                           lambda v, ts: V.convert(ts[0], v.dtype))


# ---- custom rules (functions with their own derivative) ------------------------------

def instantiate(rule: Value, slots: dict[str, Value], known: Iterable[Value] = ()) -> Value:
    """`rule` with each slot named in `slots` replaced by its value.

    A replacement may carry batch edges beyond the slot's own (a batch of cotangents or
    tangents, always fresh edges): they propagate to every value that depends on it, and
    a contraction keeps them (a new edge is never summed). Every other op re-derives its
    type from its operands. Exact: the same ops on the substituted values. The values of
    `known` hold no slot (a call's arguments and value, made before its rules), so the
    walk stops there: it costs the clause and the body it reads, not the whole program."""
    memo: dict[int, Value] = {id(k): k for k in known}
    for v in topo_order([rule], stop=memo):
        if v.op == "slot" and v.attrs[0] in slots:
            memo[id(v)] = slots[v.attrs[0]]
            continue
        ops = tuple(memo[id(o)] for o in v.operands)
        if v.op == "contract" and ops != v.operands:
            new = set().union(*(o.edges for o in ops)) - set().union(*(o.edges for o in v.operands))
            memo[id(v)] = V.contract(ops, set(v.edges) | new, v.loc)
        else:
            memo[id(v)] = V.rebuild_same(v, ops)
    return memo[id(rule)]


def _missing(v: Value, rule: str, mode: str) -> CompileError:
    fn = v.attrs[0]
    given = "vjp" if v.attrs[2] else "jvp"
    return CompileError(f"{mode} mode needs the {rule} of '{fn}', which gives only its own {given} "
                        f"(add `with {rule}(...) = ...` to '{fn}', or differentiate in {'forward' if mode == 'reverse' else 'reverse'} mode)",
                        v.loc)


def _custom_vjp(v: Value, i: int, ct: Value) -> Value | None:
    y, args, vjps, _ = V.custom_parts(v)
    if vjps is None:
        raise _missing(v, "vjp", "reverse")
    return instantiate(vjps[i - 1], {v.attrs[2]: ct}, (y, *args))


def _custom_jvp(v: Value, ts) -> Value | None:
    y, args, _, jvp = V.custom_parts(v)
    if jvp is None:
        raise _missing(v, "jvp", "forward")
    tans = {name: ts[1 + i] if ts[1 + i] is not None else V.const(0.0, a.dtype, a.edges)
            for i, (name, a) in enumerate(zip(v.attrs[3], args))}
    return instantiate(jvp, tans, (y, *args))


class _CustomRule(Rule):
    """The arguments (operands 1..n) carry the derivative; the body's value and the rules do not."""

    def positions(self, v: Value) -> Sequence[int]:
        return range(1, 1 + v.attrs[1])


RULES["custom"] = _CustomRule((), _custom_vjp, _custom_jvp)
RULES["slot"] = ZERO


# ---- loops: the derivative of a loop is a loop (tgc.autodiff.loops) ------------------------

class _LoopRule(Rule):
    """Every float operand (initial carries, stacked slices, invariants) carries a
    derivative; the derivative loops are built by `tgc.autodiff.loops`, which the
    sweeps call themselves (they pass themselves in, for the body)."""

    def positions(self, v: Value) -> Sequence[int]:
        return [i for i, o in enumerate(v.operands) if o.dtype != "i32"]


def _by_sweep(*args):
    raise AssertionError("a loop's derivative is built by tgc.autodiff.loops, called by the sweep")


RULES["loop"] = _LoopRule((), _by_sweep, _by_sweep)
RULES["loopvar"] = ZERO   # a body's parameter: its derivative is the derivative loop's business


# ---- fused primitives of the stabilize pass ----------------------------------------------

def _by_kind(rules: dict[str, Rule]) -> Rule:
    """A reduce rule that dispatches on the reduction's kind."""
    return Rule((0,), lambda v, i, ct: rules[v.attrs[0]].vjp(v, i, ct),
                lambda v, ts: rules[v.attrs[0]].jvp(v, ts))


def _softmax(v: Value) -> Value:
    """logsumexp[e](x)' = softmax[e](x) = exp(d - logsumexp[e](d)), d = x - stop(max[e](x)):
    finite, in [0, 1], and computed from the shifted logits, so its error is relative to
    the result (exp(x - logsumexp(x)) loses eps |x| in the exponent)."""
    x = v.operands[0]
    if not V.is_shift(x):
        x = V.add([x, V.stop(V.reduce("max", x, v.attrs[1]))], [1.0, -1.0])
        v = V.reduce("logsumexp", x, v.attrs[1])
    return _fn("exp", V.add([x, v], [1.0, -1.0]))


RULES.update({
    "sigmoid": pointwise(lambda v, a: V.mul([v, _fn("sigmoid", _neg(a))])),  # s (1 - s), as s(a) s(-a): no cancellation
    "softplus": pointwise(lambda v, a: _fn("sigmoid", a)),                            # sigmoid
    "reduce": _by_kind({
        "max": RULES["reduce"], "min": RULES["reduce"],
        # logsumexp[e]: ct times the softmax weights, a guarded product: a row of all
        # -inf has weights exp(-inf - -inf) = NaN, and a zero cotangent adds exactly 0
        "logsumexp": Rule((0,), lambda v, i, ct: _mul0(ct, _softmax(v)),
                          lambda v, ts: V.contract([ts[0], _softmax(v)], set(v.edges) | _batch(v.operands[0], ts[0]))),
    }),
})


def rule_for(v: Value) -> Rule:
    key = v.attrs[0] if v.op == "map" else v.op
    if key not in RULES:
        raise V.IRError(f"no derivative rule for '{key}'")
    return RULES[key]


def active_values(f: Value, x: Value | Sequence[Value]) -> set[int]:
    """ids of the values of f's graph that depend on x (or on any of a sequence of
    values) through differentiable operands."""
    act = {id(x)} if isinstance(x, Value) else {id(u) for u in x}
    for v in topo_order([f]):
        if any(id(v.operands[i]) in act for i in rule_for(v).positions(v)):
            act.add(id(v))
    return act


def fresh_edges(module: Module, edges: Iterable[str]) -> dict[str, str]:
    """A new, unused edge of the same size for each of `edges` (registered in `module`)."""
    return {e: module.fresh_edge(e, module.edges[e]) for e in sorted(edges)}


def inverse(mapping: dict[str, str]) -> dict[str, str]:
    return {d: s for s, d in mapping.items()}
