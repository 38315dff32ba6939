"""stabilize: exp-ratio and log patterns -> fused, numerically stable ops.

Rewrites (each an identity of functions, so both values and derivatives are kept;
1 counts as exp(0)):

    log(sum_E exp(d))                      = logsumexp_E(d)
    logsumexp_E(x - m) + m                 = logsumexp_E(x)          (m = max_E x)
    1 / sum_E exp(d)                       = exp(-logsumexp_E(d))
    exp(a) exp(b)                          = exp(a + b)              (b has no edge a lacks)
    exp(a) / (exp(a) + exp(b))             = sigmoid(a - b)
    1 / (1 + exp(b))                       = sigmoid(-b)
    exp(a) sigmoid(-a)                     = sigmoid(a)
    (exp(a) - exp(b)) / (exp(a) + exp(b))  = tanh((a - b) / 2)
    log(exp(a) + exp(b))                   = b + softplus(a - b)
    log(sigmoid(a))                        = -softplus(-a)
    1 - sigmoid(a)                         = sigmoid(-a)
    (g' + k p) - p sum_E(g' + k p)         = g' - p sum_E(g')          (p a softmax over E)

So softmax `exp(d) / sum_E exp(d)` with `d = x - stop(max_E x)` becomes
`exp(d - logsumexp_E(d))`, log_softmax `d - logsumexp_E(d)`, the prelude's sigmoid
and softplus their fused ops; in derived backward graphs the same patterns (a
reciprocal of a sum of exps times an exp) become the same stable forms. The
patterns match the canonical forms of `simplify`, whose rules run here too.

Otherwise the shift stays: `logsumexp_E(x - m)` is not rewritten to `logsumexp_E(x) - m`.
That is an identity of real numbers, but then `d - logsumexp_E(d)` becomes
`x - logsumexp_E(x)`, whose two terms are as large as the logits: in f32 its error
is eps |x| (5e-4 at logits near 1e4), where `(x - m) - log sum exp(x - m)` keeps the
error relative to the result (docs/optimization.md, the floating-point contract).

The table's last rewrite is log_softmax's backward `g - p sum_E(g)` where its cotangent g holds the
softmax p itself (entropy's `-p log p - p`): since sum_E p = 1 exactly, the term k p
contributes k p (1 - sum_E p) = 0, and dropping it keeps the small rest from being
added to p first (where p rounds to 1, `-p - p log p` lost `p log p`).

Terminates: each pattern removes an exp, a log, a reciprocal of a sum of exps, a
shift, or a softmax term of a cotangent: a measure that strictly decreases; simplify's
rules decrease theirs (`tgc.opt.rules`).
"""
from __future__ import annotations

from dataclasses import dataclass

from tgc.ir import values as V
from tgc.ir.module import Module
from tgc.ir.values import Value
from tgc.options import Options
from tgc.ir.passes import Pass
from tgc.opt.canon import key
from tgc.ir.values import is_shift
from tgc.opt.rewrite import Ctx, rewrite
from tgc.opt.rules import SIMPLIFY, quotient

Term = tuple[Value | None, float]  # coef * exp(arg); arg None: exp(0) = 1


def _is_recip(v: Value) -> bool:
    return v.op == "map" and v.attrs[0] == "div" and v.operands[0].op == "const" and v.operands[0].attrs[0] == 1.0


def _exp_sum(s: Value) -> tuple[Value, set[str]] | None:
    """(d, E) for s = sum_E exp(d)."""
    if s.op != "contract" or len(s.operands) != 1:
        return None
    z = s.operands[0]
    if z.op != "map" or z.attrs[0] != "exp" or not set(s.edges) < set(z.edges):
        return None
    return z.operands[0], set(z.edges) - set(s.edges)


def _exps(v: Value) -> list[Term] | None:
    """v as a sum of coef * exp(arg) terms, when it is one."""
    if v.op == "map" and v.attrs[0] == "exp":
        return [(v.operands[0], 1.0)]
    if v.op != "add":
        return None
    out: list[Term] = []
    for t, c in zip(v.operands, v.attrs[0]):
        if t.op == "map" and t.attrs[0] == "exp":
            out.append((t.operands[0], c))
        elif t.op == "const" and not t.edges:
            out.append((None, c * t.attrs[0]))
        else:
            return None
    return out


def _arg(ctx: Ctx, a: Value | None, like: Value) -> Value:
    return a if a is not None else V.const(0.0, like.dtype)


def _minus(ctx: Ctx, a: Value | None, b: Value | None, like: Value) -> Value:
    return ctx.c.add([_arg(ctx, a, like), _arg(ctx, b, like)], [1.0, -1.0])


def _terms(a: Value | None) -> tuple:
    """Simplest first: a constant, then fewer add terms, then structure."""
    if a is None:
        return (0, "")
    return (len(a.operands) if a.op == "add" else 1, key(a))


# log(sum_E exp(d)) = logsumexp_E(d)
# log(exp(a) + exp(b)) = b + softplus(a - b)       (b the simpler argument)
# log(sigmoid(a)) = -softplus(-a)
def log_(ctx: Ctx, v: Value) -> Value | None:
    s = v.operands[0]
    if s.op == "map" and s.attrs[0] == "sigmoid":
        return ctx.c.scale(-1.0, ctx.c.map("softplus", ctx.c.scale(-1.0, s.operands[0])))
    found = _exp_sum(s)
    if found is not None:
        return ctx.c.reduce("logsumexp", *found)
    terms = _exps(s)
    if terms is None or len(terms) != 2 or any(c != 1.0 for _, c in terms):
        return None
    (b, _), (a, _) = sorted(terms, key=lambda t: _terms(t[0]))
    soft = ctx.c.map("softplus", _minus(ctx, a, b, v))
    return ctx.c.broadcast(ctx.c.add([_arg(ctx, b, v), soft]), v.edges)


# logsumexp_E(x - m) + m = logsumexp_E(x)       (m = max_E x, constant along E: the prelude's logsumexp)
def lse_of_shift(ctx: Ctx, v: Value) -> Value | None:
    terms = list(zip(v.operands, v.attrs[0]))
    for i, (t, c) in enumerate(terms):
        if t.op != "reduce" or t.attrs[0] != "logsumexp" or not is_shift(t.operands[0]):
            continue
        x, m = t.operands[0].operands if t.operands[0].attrs[0][1] == -1.0 else t.operands[0].operands[::-1]
        j = next((j for j, (u, k) in enumerate(terms) if u is m and k == c), None)
        if j is None:
            continue
        rest = [(u, k) for n, (u, k) in enumerate(terms) if n not in (i, j)]
        lse = ctx.c.reduce("logsumexp", x, t.attrs[1])
        return ctx.c.broadcast(ctx.c.add([lse] + [u for u, _ in rest], [c] + [k for _, k in rest]), v.edges)
    return None


# c - c sigmoid(a) = c sigmoid(-a)               (1 - s(a) cancels where s(a) is near 1)
def one_minus_sigmoid(ctx: Ctx, v: Value) -> Value | None:
    terms = list(zip(v.operands, v.attrs[0]))
    const = [(i, t.attrs[0] * c) for i, (t, c) in enumerate(terms) if t.op == "const" and not t.edges]
    if not const:
        return None
    i, k = const[0]
    for j, (t, c) in enumerate(terms):
        if t.op == "map" and t.attrs[0] == "sigmoid" and c == -k:
            rest = [(u, e) for n, (u, e) in enumerate(terms) if n not in (i, j)]
            s = ctx.c.map("sigmoid", ctx.c.scale(-1.0, t.operands[0]))
            return ctx.c.broadcast(ctx.c.add([s] + [u for u, _ in rest], [k] + [e for _, e in rest]), v.edges)
    return None


def _softmax_edges(p: Value) -> set[str] | None:
    """E where p = exp(d - logsumexp_E(d)), a softmax over E (sum_E p = 1), else None."""
    if p.op != "map" or p.attrs[0] != "exp":
        return None
    z = p.operands[0]
    if z.op != "add" or len(z.operands) != 2 or sorted(z.attrs[0]) != [-1.0, 1.0]:
        return None
    d, lse = z.operands if z.attrs[0][1] == -1.0 else z.operands[::-1]
    if lse.op != "reduce" or lse.attrs[0] != "logsumexp" or lse.operands[0] is not d:
        return None
    return set(lse.attrs[1])


def _summed_against(t: Value, g: Value, p: Value, edges: set[str]) -> dict[str, str] | None:
    """The renaming m where t = p sum_E(g), written as the product of p and g with E
    renamed apart (m: E -> E') and summed, or None."""
    if t.op != "contract" or len(t.operands) != 2 or p not in t.operands:
        return None
    h = t.operands[1] if t.operands[0] is p else t.operands[0]
    if h.op != "rename" or h.operands[0] is not g:
        return None
    m = dict(h.attrs[0])
    if set(m) != edges or set(m.values()) & set(t.edges) or not set(g.edges) - edges <= set(t.edges):
        return None
    return m


# g - p sum_E(g) = g' - p sum_E(g')     (g = g' + k p, p a softmax over E: sum_E p = 1, so the
#                                      k p term gives k p - k p sum_E p = 0; the backward of a
#                                      log_softmax meets it where the cotangent holds p itself:
#                                      entropy's -p - p log p, whose -p, added to the small
#                                      p log p first, lost it where p rounds to 1)
def softmax_projection(ctx: Ctx, v: Value) -> Value | None:
    terms = list(zip(v.operands, v.attrs[0]))
    for i, (g, a) in enumerate(terms):
        if g.op != "add":
            continue
        for j, (t, b) in enumerate(terms):
            if j == i or b != -a or t.op != "contract":
                continue
            p = next((o for o in t.operands if o in g.operands and _softmax_edges(o) is not None), None)
            if p is None or set(p.edges) != set(g.edges):
                continue
            edges = _softmax_edges(p)
            m = _summed_against(t, g, p, edges)
            if m is None:
                continue
            rest = [(u, k) for u, k in zip(g.operands, g.attrs[0]) if u is not p]
            if not rest:
                new_g = V.const(0.0, g.dtype, g.edges)
                new_t = V.const(0.0, t.dtype, t.edges)
            else:
                new_g = ctx.c.broadcast(ctx.c.add([u for u, _ in rest], [k for _, k in rest]), g.edges)
                new_t = ctx.c.contract([ctx.c.rename(new_g, m), p], t.edges)
            others = [(u, k) for n, (u, k) in enumerate(terms) if n not in (i, j)]
            return ctx.c.broadcast(ctx.c.add([new_g, new_t] + [u for u, _ in others],
                                             [a, -a] + [k for _, k in others]), v.edges)
    return None


# 1 / sum_E exp(d) = exp(-logsumexp_E(d))
# 1 / (1 + exp(b)) = sigmoid(-b)
def recip_(ctx: Ctx, v: Value) -> Value | None:
    if not _is_recip(v):
        return None
    s = v.operands[1]
    found = _exp_sum(s)
    if found is not None:
        return ctx.c.map("exp", ctx.c.scale(-1.0, ctx.c.reduce("logsumexp", *found)))
    terms = _exps(s)
    if terms is None or sorted(terms, key=lambda t: _terms(t[0]))[0] != (None, 1.0) or len(terms) != 2:
        return None
    b, c = [t for t in terms if t[0] is not None][0]
    return ctx.c.map("sigmoid", ctx.c.scale(-1.0, b)) if c == 1.0 else None


# a / (sum of exps) = a (1/(sum of exps))   (before differentiating too: the patterns above
#                                        and below read the reciprocal; simplify's `div`
#                                        splits every other quotient once no derivative is left)
def exp_quotient(ctx: Ctx, v: Value) -> Value | None:
    a, b = v.operands
    if not ctx.derivatives_left or _is_recip(v) or (_exp_sum(b) is None and _exps(b) is None):
        return None
    return quotient(ctx, v)


def _pair(ctx: Ctx, x: Value, y: Value, like: Value) -> Value | None:
    """The stable form of the product x y, for the pairs in the table above."""
    if x.op == "map" and x.attrs[0] == "exp":
        a = x.operands[0]
        if y.op == "map" and y.attrs[0] == "exp" and set(y.edges) <= set(x.edges):
            return ctx.c.map("exp", ctx.c.add([a, y.operands[0]]))
        if y.op == "map" and y.attrs[0] == "sigmoid" and y.operands[0] is ctx.c.scale(-1.0, a):
            return ctx.c.map("sigmoid", a)
    num, den = _exps(x), _exps(y.operands[1]) if _is_recip(y) else None
    if num is None or den is None or len(den) != 2 or any(c != 1.0 for _, c in den):
        return None
    args = [a for a, _ in den]
    if len(num) == 1 and num[0][1] == 1.0 and num[0][0] in args and num[0][0] is not None:
        b = args[1] if args[0] is num[0][0] else args[0]
        return ctx.c.map("sigmoid", _minus(ctx, num[0][0], b, like))
    if len(num) == 2 and sorted(c for _, c in num) == [-1.0, 1.0]:
        (p, _), (q, _) = sorted(num, key=lambda t: -t[1])
        if {id(p), id(q)} == {id(a) for a in args}:
            return ctx.c.map("tanh", ctx.c.scale(0.5, _minus(ctx, p, q, like)))
    return None


# exp(a) exp(b), exp(a) sigmoid(-a), exp(a) / (exp(a) + exp(b)), (exp(a) - exp(b)) / (exp(a) + exp(b))
def products(ctx: Ctx, v: Value) -> Value | None:
    ops = v.operands
    for p, x in enumerate(ops):
        for q, y in enumerate(ops):
            new = _pair(ctx, x, y, v) if p != q else None
            if new is not None:
                rest = [o for k, o in enumerate(ops) if k not in (p, q)]
                lost = (set(x.edges) | set(y.edges)) - set(new.edges)
                return ctx.c.contract(rest + [new, V.const(1.0, v.dtype, lost)], v.edges)
    return None


PATTERNS = {"log": [log_], "div": [recip_, exp_quotient], "add": [lse_of_shift, one_minus_sigmoid, softmax_projection], "contract": [products]}
STABILIZE = {k: PATTERNS.get(k, []) + SIMPLIFY.get(k, []) for k in sorted(set(PATTERNS) | set(SIMPLIFY))}


@dataclass(frozen=True)
class Stabilize(Pass):
    """Fused stable ops for exp-ratio/log patterns: logsumexp, softmax, sigmoid, softplus."""

    name = "stabilize"

    def run(self, module: Module, options: Options) -> Module:
        return rewrite(module, STABILIZE, options)
