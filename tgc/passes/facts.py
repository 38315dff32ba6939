"""What a value provably is, for the rules that need it: finite, and its sign.

`Facts.finite(v)`: v is finite everywhere, in exact arithmetic, whenever the module's
inputs are finite. (A program's own infinities — log 0, 1/0, a derivative's 1/sqrt 0 —
are what LANGUAGE.md section 8 guards against; an input that is already inf or NaN,
or a float overflow of a finite exact value, is outside what the rules promise.)
`Facts.sign(v)`: "pos" (> 0), "nonneg" (>= 0) or None (unknown).

Both are computed bottom-up once per value (a DAG walk), so they terminate.
"""
from __future__ import annotations

import math

from tgc.ir.values import Value

POS, NONNEG = "pos", "nonneg"

# map fns that are finite on finite arguments, and those finite on every argument
_TOTAL = {"exp", "tanh", "erf", "sin", "cos", "abs", "sign", "max", "min", "mul0", "mul00", "where",
          "sigmoid", "softplus"}
_ALWAYS_FINITE = {"lt", "le", "gt", "ge", "eq", "ne", "sign"}
_POSITIVE = {"exp", "sigmoid", "softplus"}


def _meet(*signs: str | None) -> str | None:
    """The sign every one of `signs` guarantees."""
    if all(s == POS for s in signs):
        return POS
    if all(s in (POS, NONNEG) for s in signs):
        return NONNEG
    return None


class Facts:
    def __init__(self):
        self._memo: dict[int, tuple[Value, bool, str | None]] = {}

    def _get(self, v: Value) -> tuple[bool, str | None]:
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
                memo[id(u)] = (u, *self._compute(u))
            hit = memo[id(v)]
        return hit[1], hit[2]

    def finite(self, v: Value) -> bool:
        return self._get(v)[0]

    def sign(self, v: Value) -> str | None:
        return self._get(v)[1]

    def positive(self, v: Value) -> bool:
        return self.sign(v) == POS

    def nonneg(self, v: Value) -> bool:
        return self.sign(v) in (POS, NONNEG)

    def _compute(self, v: Value) -> tuple[bool, str | None]:
        ops = [self._memo[id(o)][1:] for o in v.operands]
        fin = all(f for f, _ in ops)
        if v.op in ("arg", "size", "indicator", "const"):
            return self._leaf(v)
        if v.op == "add":
            coefs = v.attrs[0]
            signs = [s if c > 0 else None for c, (_, s) in zip(coefs, ops)]
            pos = any(s == POS for s in signs) and _meet(*signs) is not None
            return fin, POS if pos else _meet(*signs)
        if v.op == "contract":
            return fin, self._product_sign(v, ops)
        if v.op == "map":
            return self._map(v.attrs[0], v, ops)
        if v.op == "reduce":
            return fin, ops[0][1]
        if v.op in ("rename", "stop", "gather"):
            return ops[0]
        if v.op == "scatter":
            return fin, _meet(ops[0][1], NONNEG)
        return False, None

    def _leaf(self, v: Value) -> tuple[bool, str | None]:
        if v.op == "arg":  # inputs are finite; i32 ids are indices
            return True, NONNEG if v.dtype == "i32" else None
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
        fin = all(f for f, _ in ops)
        signs = [s for _, s in ops]
        if fn in _ALWAYS_FINITE:
            return True, NONNEG if fn != "sign" else None
        if fn in _POSITIVE:
            return fin, POS
        if fn == "abs":
            return fin, NONNEG
        if fn in ("max", "where", "min", "mul0", "mul00"):
            return fin, self._select_sign(fn, signs)
        if fn in _TOTAL:
            return fin, signs[0] if fn in ("tanh", "erf") and signs[0] else None
        if fn == "sqrt":
            return fin and signs[0] is not None, signs[0] if signs[0] else NONNEG
        if fn == "log":
            return fin and signs[0] == POS, None
        if fn == "div":
            return fin and signs[1] == POS, _meet(signs[0], signs[1]) if signs[1] == POS else None
        if fn == "pow":
            return self._pow(v, ops)
        return False, None

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
