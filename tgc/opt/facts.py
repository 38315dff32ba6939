"""What a value provably is, for the rules that need it: finite, its sign, its range.

`Facts.finite(v)`: v is finite everywhere, in the module's float type, whenever the
module's inputs are finite. (A program's own infinities — log 0, 1/0, a derivative's
1/sqrt 0 — are what LANGUAGE.md section 8 guards against; an input that is already
inf or NaN is outside what the rules promise.) `exp` overflows at moderate arguments
(88.7 in f32, 709.8 in f64), so `exp(y)` is finite only where an upper bound of `y`
keeps it below that: `exp(x - max x)`, `exp(-x^2)`, `exp(tanh x)` are, `exp(3x)` is not
(its guard stays: the gradient of `where(x < 30, exp(3x), 0)` at x = 40 is 0, not NaN).
Products and powers of finite values are taken to be finite: they overflow only at
inputs beyond 1e19 (f32), which the rules do not promise to survive.
`Facts.sign(v)`: "pos" (> 0), "nonneg" (>= 0) or None (unknown).
`Facts.upper(v)`: an upper bound of v (inf when none is known). Given the module's
edge sizes (`sizes`: each edge's fixed size, or 2^62, the limit every call checks
before it runs, `tgc.ir.sizes.MAX_SIZE`), a sum over edges is at most their sizes'
product times the bound of its terms (at least 0): a count `sum[e]([n = ids])`, a
scatter of ones, is at most size(e). Without `sizes` a sum has no bound.

An argument is otherwise unknown in sign and range; the program's declared facts
(`assume x > 0`, `assume y >= 0`, `assume p <= 1`; `tgc.ir.assume.arg_bounds`) give
its sign and upper bound, which the rules may then use: they are exact for inputs
where the facts hold.

All are computed bottom-up once per value (a DAG walk), so they terminate.
"""
from __future__ import annotations

import math

import numpy as np

from tgc.ir.ops import FNS
from tgc.ir.sizes import MAX_SIZE
from tgc.ir.values import Value, is_shift

POS, NONNEG = "pos", "nonneg"
INF = math.inf
# the largest argument whose exp is finite, per float type
EXP_MAX = {"f32": math.log(float(np.finfo(np.float32).max)), "f64": math.log(float(np.finfo(np.float64).max))}
# each elementwise function's facts (finite, sign, bound) are its entry in tgc.ir.ops.FNS


def edge_bounds(module) -> dict[str, float]:
    """edge -> an upper bound of its size in `module` (a `tgc.ir.module.Module`): its
    size where fixed, else MAX_SIZE (2^62), which every call checks its dims against
    before anything runs (`Module.bind_dims`)."""
    out = {}
    for e, dim in module.edges.items():
        if dim in module.dims:
            s = module.dims[dim]
            out[e] = float(s) if isinstance(s, int) else float(MAX_SIZE)
    return out


def _meet(*signs: str | None) -> str | None:
    """The sign every one of `signs` guarantees."""
    if all(s == POS for s in signs):
        return POS
    if all(s in (POS, NONNEG) for s in signs):
        return NONNEG
    return None


class Facts:
    def __init__(self, bounds: dict[str, tuple[str | None, float]] | None = None,
                 sizes: dict[str, float] | None = None):
        self._memo: dict[int, tuple[Value, bool, str | None, float]] = {}
        self._args = bounds or {}  # argument name -> (sign, upper bound) from `assume`
        self._sizes = sizes or {}  # edge -> an upper bound of its size (`edge_bounds`)

    def _get(self, v: Value) -> tuple[bool, str | None, float]:
        hit = self._memo.get(id(v))
        if hit is None:
            memo, stack = self._memo, [v]
            while stack:  # operands first, never below a value already known
                u = stack[-1]
                if id(u) in memo:
                    stack.pop()
                    continue
                todo = [o for o in u.operands if id(o) not in memo]
                if todo:
                    stack.extend(reversed(todo))
                    continue
                stack.pop()
                fin, sign = self._compute(u)
                hi = self._upper(u)
                if u.op == "map" and FNS[u.attrs[0]].finite == "overflow":   # exp: finite below its overflow
                    fin = fin and hi < INF
                memo[id(u)] = (u, fin, sign, hi)
            hit = memo[id(v)]
        return hit[1], hit[2], hit[3]

    def finite(self, v: Value) -> bool:
        return self._get(v)[0]

    def sign(self, v: Value) -> str | None:
        return self._get(v)[1]

    def upper(self, v: Value) -> float:
        return self._get(v)[2]

    def positive(self, v: Value) -> bool:
        return self.sign(v) == POS

    def nonneg(self, v: Value) -> bool:
        return self.sign(v) in (POS, NONNEG)

    def _upper(self, v: Value) -> float:
        """An upper bound of v (inf: none known), from its operands' bounds and signs."""
        his = [self._memo[id(o)][3] for o in v.operands]
        if v.op == "const":
            return v.attrs[0] if not math.isnan(v.attrs[0]) else INF
        if v.op == "arg" and v.attrs[0] in self._args:
            return self._args[v.attrs[0]][1]
        if v.op == "indicator" or (v.op == "random" and v.attrs[0] == "rand"):
            return 1.0   # rand is in [0, 1)
        if v.op == "size":
            return self._sizes.get(v.attrs[0], INF)
        if v.op == "scatter" and v.attrs[1] == "sum":   # each element sums some of ct's values
            return self._sum_upper(v, his[0])
        if v.op in ("rename", "stop", "gather") or (v.op == "contract" and len(v.operands) == 1
                                                    and set(v.edges) >= set(v.operands[0].edges)):
            return his[0]
        if v.op == "reduce":
            return his[0] if v.attrs[0] in ("max", "min") else INF
        if v.op == "add":
            return self._add_upper(v, his)
        if v.op == "contract":
            return self._sum_upper(v, self._product_upper(v, his))
        if v.op == "map":
            return self._map_upper(v, his)
        return INF

    @staticmethod
    def _map_upper(v: Value, his: list[float]) -> float:
        """A function's bound (tgc.ir.ops: `bound`, or `increasing` applied to its
        operand's bound; one that overflows (exp) only below EXP_MAX); a selection's
        largest selected bound."""
        fn = v.attrs[0]
        f = FNS[fn]
        if f.bound is not None:
            return f.bound
        if fn in ("max", "where"):
            return max(his[-2:])
        if fn == "min":
            return min(his)
        if f.increasing is None or his[0] == INF or math.isnan(his[0]):
            return INF
        if f.finite == "overflow" and not his[0] <= EXP_MAX.get(v.dtype, EXP_MAX["f32"]):
            return INF
        try:
            hi = f.increasing(his[0])
        except (ValueError, OverflowError):   # outside its domain (log of a bound <= 0)
            return INF
        return hi if not math.isnan(hi) else INF

    def _add_upper(self, v: Value, his: list[float]) -> float:
        """Sum of c * bound: an upper bound for c > 0, and for c < 0 when the term is >= 0
        (its bound is then 0); a shift x - max_E(x) is <= 0."""
        if is_shift(v):
            return 0.0
        total = 0.0
        for o, c, hi in zip(v.operands, v.attrs[0], his):
            if c > 0:
                total += c * hi
            elif not self.nonneg(o):
                return INF
        return total if not math.isnan(total) else INF

    def _sum_upper(self, v: Value, hi: float) -> float:
        """A bound of v, a sum of terms each at most `hi` over the edges its operands have
        and it does not (a contraction's summed edges; a scatter's ids' edges that it
        does not keep): at most the product of their sizes' bounds terms, and a sum of
        k such terms is at most k * hi <= that product times max(hi, 0)."""
        summed = set().union(*(o.edges for o in v.operands)) - set(v.edges)
        if not summed:
            return hi
        if hi <= 0:   # a sum of terms <= 0 (an empty sum included)
            return 0.0
        count = 1.0
        for e in summed:
            count *= self._sizes.get(e, INF)
        total = count * hi
        return total if not math.isnan(total) else INF

    def _product_upper(self, v: Value, his: list[float]) -> float:
        """An elementwise product of nonnegative factors: the product of their bounds; of
        one factor that is <= 0 (bound <= 0) with nonnegative ones: <= 0."""
        signs = [self._memo[id(o)][2] for o in v.operands]
        if all(s in (POS, NONNEG) for s in signs):
            total = 1.0
            for hi in his:
                total *= hi
            return total if not math.isnan(total) else INF
        unsigned = [hi for hi, s in zip(his, signs) if s not in (POS, NONNEG)]
        return 0.0 if len(unsigned) == 1 and unsigned[0] <= 0 else INF

    def _compute(self, v: Value) -> tuple[bool, str | None]:
        ops = [self._memo[id(o)][1:3] for o in v.operands]
        fin = all(f for f, _ in ops)
        if v.op in ("arg", "size", "indicator", "const"):
            return self._leaf(v)
        if v.op == "random":   # rand in [0, 1), randn finite (|randn| < 8.6), both never NaN
            return True, NONNEG if v.attrs[0] == "rand" else None
        if v.op == "add":
            coefs = v.attrs[0]
            signs = [s if c > 0 else None for c, (_, s) in zip(coefs, ops)]
            pos = any(s == POS for s in signs) and _meet(*signs) is not None
            return fin, POS if pos else _meet(*signs)
        if v.op == "contract":
            return fin, self._product_sign(v, ops)
        if v.op == "map":
            return self._map(v.attrs[0], v, ops)
        if v.op == "reduce":  # logsumexp of a shift (max 0) is >= log 1
            shifted = v.attrs[0] == "logsumexp" and is_shift(v.operands[0])
            return fin, NONNEG if shifted else ops[0][1]
        if v.op in ("rename", "stop", "gather"):
            return ops[0]
        if v.op == "scatter":
            if v.attrs[1] != "sum":   # a segment max/min: -inf/inf where no id points
                return False, None
            return fin, _meet(ops[0][1], NONNEG)
        return False, None

    def _leaf(self, v: Value) -> tuple[bool, str | None]:
        if v.op == "arg":  # inputs are finite; i32 ids are indices; a float's sign is assumed or unknown
            return True, NONNEG if v.dtype == "i32" else self._args.get(v.attrs[0], (None,))[0]
        if v.op == "const":
            x = v.attrs[0]
            return math.isfinite(x), POS if x > 0 else NONNEG if x == 0 else None
        return True, POS if v.op == "size" else NONNEG

    def _product_sign(self, v: Value, ops) -> str | None:
        """A product is >= 0 when its unsigned factors pair up (x * x), > 0 when all are."""
        unsigned: dict[int, int] = {}
        for o, (_, s) in zip(v.operands, ops):
            if s is None:
                unsigned[id(o)] = unsigned.get(id(o), 0) + 1
        if any(n % 2 for n in unsigned.values()):
            return None
        if unsigned:
            return NONNEG
        return _meet(*(s for _, s in ops)) if ops else POS

    def _map(self, fn: str, v: Value, ops) -> tuple[bool, str | None]:
        """Finite and sign of an elementwise function, as its entry in tgc.ir.ops says."""
        f = FNS[fn]
        fin = all(fi for fi, _ in ops)
        signs = [s for _, s in ops]
        if f.finite == "rule" or f.sign == "rule":
            return self._div(signs, fin) if fn == "div" else self._pow(v, ops)
        finite = {"always": True, "total": fin, "overflow": fin,   # overflow: bounded too, see _get
                  "nonneg_arg": fin and signs[0] is not None, "pos_arg": fin and signs[0] == POS,
                  "unknown": False}[f.finite]
        if f.sign == "select":
            return finite, self._select_sign(fn, signs)
        return finite, {"pos": POS, "nonneg": NONNEG, "keep": signs[0] if signs else None,
                        "keep_nonneg": signs[0] or NONNEG if signs else NONNEG, "none": None}[f.sign]

    @staticmethod
    def _div(signs, fin: bool) -> tuple[bool, str | None]:
        return fin and signs[1] == POS, _meet(signs[0], signs[1]) if signs[1] == POS else None

    def _select_sign(self, fn: str, signs) -> str | None:
        if fn == "max":
            return POS if POS in signs else NONNEG if NONNEG in signs else None
        if fn == "where":
            return _meet(signs[1], signs[2])
        return _meet(*signs)  # min, mul0 (a product)

    def _pow(self, v: Value, ops) -> tuple[bool, str | None]:
        (fa, sa), (fb, _) = ops
        b = v.operands[1]
        k = b.attrs[0] if b.op == "const" else None
        if k is not None and k >= 0 and float(k).is_integer():
            even = int(k) % 2 == 0
            return fa, POS if sa == POS else NONNEG if even or sa == NONNEG else None
        if sa == POS:
            return fa and fb, POS
        return False, None
