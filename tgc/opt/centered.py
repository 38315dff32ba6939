"""centered: a sum of squares of a centered value gets the corrected two-pass form.

A value centered along edges F is `c = x - mean_F(x)`: an add whose terms with every
edge of F (x's) and whose sums over F (the mean's) cancel when summed over F, so that
`sum_F(c) = 0` in exact arithmetic. A contraction that sums the square of such a value
over F (and perhaps more edges), its other factors constant along F, is the variance's
numerator, `sum_E r c c` (E a superset of F, r the other factors). This pass rewrites

    sum_E r c c   ->   sum_E r c c  -  sum_{E \\ F} r (sum_F c) (mean_F c)

Exact in real arithmetic: `sum_F c = 0`, so the new term is 0. In floating point it is
the corrected two-pass variance (Chan, Golub and LeVeque): the computed mean is rounded
(`mu = m + d`, |d| up to half an ulp of m: 2^-8 at m = 1e5 in f32), so the computed
`c = x - mu` is off by -d in every element (the subtraction itself is exact where x is
within a factor of two of mu), and `sum_F c^2 = |F| (var + d^2)`: at x = 1e5 + N(0, 1)
the f32 variance came out 1 + 1.1e-5. The computed `sum_F c` is `-|F| d` up to the
rounding of a sum of |F| terms of the size of the deviations, so the new term removes
`|F| d^2` and leaves an error of order eps var: 1e-8 there, as PyTorch's f32 `var`
(which accumulates in f64). Where the mean is exact (d = 0) the term is 0 up to
rounding errors of order eps^2 var.

Where it applies: where a result reads the sum of squares other than alongside c (some
output or update depends on the sum, and not on c by another path): a variance, a
standard deviation, a loss of them, and their derivatives. In a loop's body, whose
results are read after the loop, only where nothing but sums of its squares reads c. Layernorm is left as it is:
its output `c / sqrt(var + eps)` and its derivatives read c, whose error d relative to
the spread (4e-3 at 1e5, PyTorch's `F.layer_norm` has it too) no correction of the
variance removes, and the variance's d^2 is below it; there the sum over F would only
cost a pass over each row (3-5% of a 4096 x 1024 layernorm's forward and backward: the
CPU runs each of a row group's sums as a loop of its own).

The pattern is matched on the values as the pipeline leaves them after `factor` (a
mean is `add[1, -1/n](x, sum_F x)`, or with a symbolic F `x - (sum_F x) / size(F)`;
x may itself be a sum, flattened into c or not); a derivative that reads the variance
reads it as one value, the corrected one. Runs after the last pass that rewrites by the canonical rules (they
would cancel the new term against the old, knowing `sum_F c = 0`), not under
`--fp-strict` (its pipeline computes as the source is written). Without other factors
the corrected sum is a sum of squares (of c - mean_F c): `max(., 0)` clips a rounding
below 0 (a row of equal values) and tells `Facts` its sign (so `quotients` keeps a
`1/sqrt(var + eps)` a per-row factor); max keeps a NaN.

Terminates: one bottom-up rebuild (loop bodies first, each once); the new values are
not visited again. Running the pass twice changes nothing the second time: a sum of
squares that is already an operand of its own correction is left as it is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tgc.ir import values as V
from tgc.ir.module import Module
from tgc.ir.passes import Pass
from tgc.ir.values import Value, rebuild
from tgc.opt.canon import static_size
from tgc.opt.rewrite import map_bodies, prune_edges
from tgc.options import Options

REAL = ("f32", "f64")
TOL = 1e-9   # relative: the mean's coefficient -1/n as a float, times n, is 1 to rounding


def _scale(s: Value) -> tuple[float, frozenset[str]] | None:
    """(k, D) where the edgeless s is k / prod_{e in D} size(e), else None."""
    if s.edges:
        return None
    if s.op == "const":
        return s.attrs[0], frozenset()
    if s.op == "map" and s.attrs[0] == "div":
        a, b = s.operands
        if a.op == "const" and not a.edges and b.op == "size":
            return a.attrs[0], frozenset([b.attrs[0]])
    return None


def _sum_form(u: Value) -> tuple[Value, frozenset[str], float, frozenset[str]] | None:
    """(y, F, k, D) where u = k * sum_F(y) / prod_{e in D} size(e), D a subset of F:
    a plain sum over F, scaled, or divided by the sizes of its edges (a mean over a
    symbolic edge, `sum_F(y) / size(F)` or `(1 / size(F)) sum_F(y)`); else None."""
    k, d = 1.0, frozenset()
    while True:
        if u.op == "add" and len(u.operands) == 1:
            k, u = k * u.attrs[0][0], u.operands[0]
        elif u.op == "map" and u.attrs[0] == "div":
            b = u.operands[1]
            if b.op == "size":
                d = d | {b.attrs[0]}
            elif b.op == "const" and not b.edges and b.attrs[0] != 0:
                k = k / b.attrs[0]
            else:
                return None
            u = u.operands[0]
        elif u.op == "contract" and len(u.operands) > 1:
            scales = [_scale(o) for o in u.operands]
            rest = [o for o, sc in zip(u.operands, scales) if sc is None]
            if len(rest) != 1:
                return None
            for sc in scales:
                if sc is not None:
                    k, d = k * sc[0], d | sc[1]
            if set(rest[0].edges) == set(u.edges):
                u = rest[0]
                continue
            y = rest[0]
            break
        elif u.op == "contract":
            y = u.operands[0]
            break
        else:
            return None
    f = frozenset(y.edges) - frozenset(u.edges)
    if not f or not set(u.edges) <= set(y.edges) or not d <= f:
        return None
    return y, f, k, d


def _linear(v: Value, coef: float, into: dict[int, list]) -> None:
    """Add coef * v to `into` (id -> [value, coefficient]), sums expanded."""
    if v.op == "add":
        for o, c in zip(v.operands, v.attrs[0]):
            _linear(o, coef * c, into)
        return
    entry = into.setdefault(id(v), [v, 0.0])
    entry[1] += coef


def centered_along(m: Module, c: Value) -> frozenset[str] | None:
    """F where c is centered along F (its sum over F is 0 in exact arithmetic), else None."""
    if c.op != "add" or c.dtype not in REAL:
        return None
    f = None
    means = []
    for u, a in zip(c.operands, c.attrs[0]):
        form = _sum_form(u)
        if form is not None and set(form[1]) <= set(c.edges) and not set(form[1]) & set(u.edges):
            if f is not None and form[1] != f:
                return None
            f = form[1]
            means.append((form, a))
    if f is None:
        return None
    sizes = {e: static_size(m, e) for e in f}
    atoms: dict[int, list] = {}   # sum_F(c) as a combination of sums over F of these
    for (y, _, k, d), a in means:
        if any(sizes[e] is None for e in f - d):
            return None
        _linear(y, a * k * math.prod(sizes[e] for e in f - d), atoms)   # |F| / prod_{e in D} size(e)
    for u, a in zip(c.operands, c.attrs[0]):
        form = _sum_form(u)
        if form is None or form[1] != f or set(f) & set(u.edges):
            _linear(u, a, atoms)
    for v, k in atoms.values():
        if not set(f) <= set(v.edges):
            return None   # a term constant along F (its sum is |F| times it): not a mean's
    biggest = max(abs(a) for a in c.attrs[0])
    if any(abs(k) > TOL * biggest for _, k in atoms.values()):
        return None
    return f


def _factors(v: Value) -> list[Value]:
    """v's factors: an elementwise product's operands (its own, recursively), else [v]."""
    if v.op == "contract" and set(v.edges) == set().union(*(o.edges for o in v.operands)):
        return [f for o in v.operands for f in _factors(o)]
    return [v]


def _squared(m: Module, v: Value) -> tuple[Value, frozenset[str], list[Value]] | None:
    """(c, F, rest) where v = sum_E rest c c as in the module's docstring."""
    if v.op != "contract" or v.dtype not in REAL:
        return None
    factors = [f for o in v.operands for f in _factors(o)]
    summed = set().union(*(f.edges for f in factors)) - set(v.edges)
    seen: set[int] = set()
    for c in factors:
        if id(c) in seen or sum(f is c for f in factors) < 2:
            continue
        seen.add(id(c))
        f = centered_along(m, c)
        if f is None or not f <= summed:
            continue
        rest = list(factors)
        for _ in range(2):
            rest.pop(next(i for i, g in enumerate(rest) if g is c))
        if any(set(f) & set(r.edges) for r in rest):
            continue
        return c, f, rest
    return None


def correction(m: Module, v: Value) -> Value | None:
    """The corrected value of the sum of squares v, or None where v is none."""
    found = _squared(m, v)
    if found is None:
        return None
    c, f, rest = found
    t = V.contract([c], set(c.edges) - f, v.loc)   # sum_F c: -|F| d
    sizes = [static_size(m, e) for e in sorted(f)]
    mean = V.add([t], [1.0 / math.prod(s for s in sizes if s is not None)], v.loc) \
        if any(s is not None for s in sizes) else t
    for e, s in zip(sorted(f), sizes):
        if s is None:
            mean = V.map_("div", mean, V.size(e, v.dtype), loc=v.loc)
    # (sum_F c) (mean_F c), not (sum_F c)^2 / |F|: the square overflows first (at 1e23,
    # ulp-sized deviations over 4096 terms: sum c = 4e19, its square inf)
    tt = V.contract([t, mean], t.edges, v.loc)
    term = tt if not rest and set(tt.edges) == set(v.edges) else V.contract(rest + [tt], v.edges, v.loc)
    new = V.add([v, term], [1.0, -1.0], v.loc)
    # without other factors the corrected sum is a sum of squares (of c - mean_F c), >= 0:
    # a rounding below 0 (rows of equal values) is clipped, and `Facts` knows the sign
    # (`quotients` keeps layernorm's 1/sqrt(var + eps) a per-row factor); max keeps NaN
    return V.map_("max", new, V.const(0.0, v.dtype), loc=v.loc) if not rest else new


def _closure(start: list[Value], users: dict[int, list[Value]], skip: int) -> set[int]:
    """The ids of `start` and of every value that reads one of them, transitively,
    except through the value `skip`."""
    seen: set[int] = set()
    todo = [v for v in start if id(v) != skip]
    while todo:
        v = todo.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        todo.extend(u for u in users.get(id(v), ()) if id(u) != skip)
    return seen


def _wanted(m: Module, values: list[Value], body: bool) -> set[int]:
    """The sums of squares to correct: those that match, are not corrected yet (an
    operand of their own correction), and that a result reads other than alongside c:
    some output or update depends on the sum but not on c by another path. In a loop's
    body (`body`), whose results the program after the loop may read alongside c (a
    layernorm's 1/sqrt(var + eps), stacked for the backward, which reads c too), only
    where nothing but sums of its squares reads c."""
    made = {id(v) for v in values}
    users: dict[int, list[Value]] = {}
    for v in values:
        for o in dict.fromkeys(v.operands):
            users.setdefault(id(o), []).append(v)
    roots = m.roots()
    out = set()
    for v in values:
        found = _squared(m, v) if v.op == "contract" else None
        if found is None or id(correction(m, v)) in made:
            continue
        if body:
            if all(u.op == "contract" and (sq := _squared(m, u)) is not None and sq[0] is found[0]
                   for u in users.get(id(found[0]), ())):
                out.add(id(v))
            continue
        with_c = _closure([found[0]], users, id(v))
        with_v = _closure([v], users, -1)
        if any(id(r) in with_v and id(r) not in with_c for r in roots):
            out.add(id(v))
    return out


def _run(module: Module, body: bool = False) -> Module:
    module = map_bodies(module, lambda b: _run(b, True))
    wanted = _wanted(module, module.values(), body)
    if not wanted:
        return module

    def fn(v: Value, ops: tuple[Value, ...]) -> Value:
        new = V.rebuild_same(v, ops)
        fixed = correction(module, new) if id(v) in wanted else None
        return new if fixed is None else fixed

    memo = rebuild(module.roots(), fn)
    return prune_edges(module.replace_values(memo))


@dataclass(frozen=True)
class Centered(Pass):
    """Sums of squares of centered values (a variance) in the corrected two-pass form."""

    name = "centered"

    def run(self, module: Module, options: Options) -> Module:
        return _run(module)
