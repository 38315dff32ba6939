"""Complex numbers (`c64`, `c128`) in the front end, as real tensors with a parts edge.

A complex tensor is elaborated into a real tensor of the program's float type with
one more edge, `re.im` (size 2: index 0 the real part, 1 the imaginary part), which
is always last in ABI order. So a complex argument is stored interleaved, exactly as
numpy's complex64/complex128 arrays are: the runtime views a caller's complex array
as floats with a trailing axis of 2, without a copy. The name `re.im` cannot be
written in a program (a source name has no dot), so no user edge clashes with it.

Everything after the front end -- the IR, differentiation, the optimizer, the IR and
lowered interpreters and the CPU backend -- sees only real values and works
unchanged. Whatever acts on the other edges alone is already right for complex
values: `+ -`, a real scale factor, `sum[e]`, renames, gathers, `where`, `stop`.
A real operand meeting a complex one in `+ -` or `where` is promoted (imaginary part
0). This module builds the rest from real operations on the parts (`x` = real, `y` =
imaginary), taken out by a contraction with the indicator [re.im = k] and put back
together by `where([re.im = 0], re, im)` (a selection, so an inf or NaN in one part
never reaches the other):

- `a * b`, `a @ b` (both complex): (ar br - ai bi) + i (ar bi + ai br), each of the
  four products the same contraction as the real one (so `@` is four real GEMMs);
- `a / b`: (a conj(b') / |b'|^2) / m with b' = b / m, m = max(|br|, |bi|) (held by
  `stop`: the value does not depend on it); `z ^ n`: repeated squaring for an integer
  literal n (and 1 / z^-n for n < 0);
- `conj`, `real`, `imag`; `abs z` = m sqrt((x/m)^2 + (y/m)^2) (`scaled`); `exp z` =
  e^x (cos y + i sin y); `log z` = log|z| + i angle(z); `angle z` = atan2(y, x) (below);
- `sin z` = sin x cosh y + i cos x sinh y, `cos z` = cos x cosh y - i sin x sinh y
  (cosh from two exps, sinh = cosh tanh: accurate near 0); `sqrt z` the principal
  root by t = sqrt((|x| + |z|) / 2), then y / 2t for the other part (no cancellation).

Exactness: every formula is the textbook one, evaluated in the program's float type,
so results agree with numpy's complex arithmetic to rounding (a few ulps), not bit
for bit. Division, abs and log scale by the larger part first, as numpy's and
PyTorch's (hypot, Smith's division), so that no |z|^2 leaves the float type's range
(it did beyond about 1e19 and below 1e-19 in f32: abs(1e-30 + 1e-30i) was 0 with a NaN
derivative, 1e20 / 1e20 was 0). Derivatives
are those of the real computation with respect to the parts, which is PyTorch's
convention: for a real L, grad(L, z) = dL/dx + i dL/dy (torch's z.grad), and
vjp(f, z, v) = sum over f's elements of Re(conj(v) df) -- with v's parts as the
cotangents of f's parts. No complex derivative rule is written: the real rules of
mul, add, exp, sin, cos, sqrt, log and div compose into them.

`angle` has no real primitive (there is no atan). It is found by Newton's method on
f(t) = x sin t - y cos t, whose root is atan2(y, x): a first guess within 0.005 of
it (atan(t) ~ t (pi/4 + 0.273 (1 - t)) on [0, 1], placed in its octant), then three
steps. Each step takes the error e to about e^3/3 (f(t) = |z| sin(t - phi) has no
second-order term): 0.005, 4e-8, 2e-23, so the third starts at the rounding of f64
(or f32) and the angle is within a few ulps. The guess and the first two steps are
under `stop`: only the last step is differentiated, and at its converged start it
gives exactly d angle = (x dy - y dx) / |z|^2. angle(0) is 0, as numpy says, and
its derivative there 0, as torch's (the derivative of abs at 0 is 0 too).

Termination: each operation builds a fixed number of values (the angle's loop is
three unrolled steps; `z ^ n` at most 2 log2 |n| products, |n| <= MAX_POWER).
"""
from __future__ import annotations

import math

from tgc.frontend import ast
from tgc.ir import values as V
from tgc.ir.affine import Affine, Relation
from tgc.ir.complex_io import RI   # the parts edge: index 0 real, 1 imaginary
from tgc.ir.module import Module

COMPLEX_DTYPES = ("c64", "c128")
# functions of complex values (besides the elementwise ones of UNARY they redefine)
FUNCTIONS = ("real", "imag", "conj", "angle", "c64", "c128")
ON_COMPLEX = ("exp", "log", "abs", "sqrt", "sin", "cos")  # UNARY functions that take complex values too
MAX_POWER = 1 << 16          # the largest |n| of `z ^ n`


def is_complex(v: V.Value) -> bool:
    return RI in v.edges


def ensure_edge(m: Module) -> str:
    """Register the parts edge (a dim of size 2) in `m`; its name."""
    if RI not in m.edges:
        m.dims[RI] = 2
        m.edges[RI] = RI
    return RI


def abi_order(m: Module, edges) -> tuple[str, ...]:
    """`edges` in declaration order, the parts edge last."""
    return tuple(e for e in m.order_edges(edges) if e != RI) + ((RI,) if RI in edges else ())


class Complex:
    """Builds complex values for one module, of real parts of type `dtype`."""

    def __init__(self, m: Module, dtype: str):
        self.m, self.dtype = m, dtype

    # ---- parts ---------------------------------------------------------------------

    def unit(self, k: int, loc, dtype: str | None = None) -> V.Value:
        """The indicator [re.im = k]: 1 at part k, 0 at the other; of type `dtype` (the
        parts' width: c64 values in an f64 program have f32 parts), else the program's."""
        ensure_edge(self.m)
        rel = Relation((Affine.make([(RI, 1)]), Affine.make([], k)), ("=",))
        return V.indicator(rel, dtype or self.dtype, loc=loc)

    def part(self, z: V.Value, k: int, loc) -> V.Value:
        """The real (k = 0) or imaginary (k = 1) part of a complex value."""
        return V.contract([z, self.unit(k, loc, z.dtype)], [e for e in z.edges if e != RI], loc=loc)

    def parts(self, z: V.Value, loc) -> tuple[V.Value, V.Value]:
        return self.part(z, 0, loc), self.part(z, 1, loc)

    def make(self, re: V.Value | None, im: V.Value | None, loc) -> V.Value:
        """re + i im (a missing part is 0): where([re.im = 0], re, im), which selects,
        so an inf or NaN in one part stays out of the other (a product with the
        indicators would make inf * 0 = NaN there)."""
        given = [p for p in (re, im) if p is not None]
        dtype = V.promoted(given) if given else self.dtype   # the parts' width
        zero = V.const(0.0, dtype, loc=loc)
        return V.map_("where", self.unit(0, loc, dtype), zero if re is None else re, zero if im is None else im,
                      loc=loc)

    def promote(self, v: V.Value, loc) -> V.Value:
        """`v` as a complex value: itself if complex, else v + 0i."""
        return v if is_complex(v) else self.make(v, None, loc)

    def imag_const(self, value: float, loc) -> V.Value:
        return self.make(None, V.const(value, self.dtype, loc=loc), loc)

    # ---- arithmetic ------------------------------------------------------------------

    def add(self, a: V.Value, b: V.Value, sign: float, loc) -> V.Value:
        return V.add([self.promote(a, loc), self.promote(b, loc)], [1.0, sign], loc=loc)

    def mul(self, a: V.Value, b: V.Value, keep, loc) -> V.Value:
        """The product of two complex values, keeping edges `keep` (the rest summed)."""
        keep = [e for e in keep if e != RI]
        (ar, ai), (br, bi) = self.parts(a, loc), self.parts(b, loc)

        def c(p, q):
            return V.contract([p, q], keep, loc=loc)

        re = V.add([c(ar, br), c(ai, bi)], [1.0, -1.0], loc=loc)
        im = V.add([c(ar, bi), c(ai, br)], loc=loc)
        return self.make(re, im, loc)

    def conj(self, z: V.Value, loc) -> V.Value:
        if not is_complex(z):
            return z
        sign = V.add([self.unit(0, loc, z.dtype), self.unit(1, loc, z.dtype)], [1.0, -1.0], loc=loc)
        return V.mul([z, sign], loc=loc)

    def div(self, a: V.Value, b: V.Value, loc) -> V.Value:
        if not is_complex(b):
            return V.map_("div", a, b, loc=loc)
        a = self.promote(a, loc)
        edges = sorted((set(a.edges) | set(b.edges)) - {RI})
        x, y, m = self.scaled(b, loc)
        bs = self.make(x, y, loc)                            # b / m, |b / m| in [1, sqrt 2]
        num = self.mul(a, self.conj(bs, loc), edges, loc)
        q = V.map_("div", num, V.add([V.mul([x, x], loc=loc), V.mul([y, y], loc=loc)], loc=loc), loc=loc)
        return V.map_("div", q, m, loc=loc)

    def power(self, z: V.Value, n: int, loc) -> V.Value:
        """z ^ n for an integer n, by repeated squaring (at most 2 log2 |n| products)."""
        if n == 0:
            return self.make(V.const(1.0, z.dtype, [e for e in z.edges if e != RI], loc=loc), None, loc)
        result, base, k = None, z, abs(n)
        while True:
            if k & 1:
                result = base if result is None else self.mul(result, base, result.edges, loc)
            k >>= 1
            if not k:
                break
            base = self.mul(base, base, base.edges, loc)
        if n < 0:
            one = self.make(V.const(1.0, z.dtype, loc=loc), None, loc)
            result = self.div(one, result, loc)
        return result

    # ---- functions -------------------------------------------------------------------

    def scaled(self, z: V.Value, loc) -> tuple[V.Value, V.Value, V.Value]:
        """(x / m, y / m, m) for z = x + iy, m = max(|x|, |y|) (1 where z = 0): parts
        whose squares stay in range whatever |z| (x^2 + y^2 itself overflows beyond
        1e19 in f32 and underflows below 1e-19). m is under `stop`: every use computes
        a value independent of m in real arithmetic (m sqrt((x/m)^2 + (y/m)^2) = |z|),
        so its derivative with m held is the derivative."""
        x, y = self.parts(z, loc)
        f = lambda *a: V.map_(*a, loc=loc)   # noqa: E731
        m = f("max", f("abs", x), f("abs", y))
        m = V.stop(V.add([m, f("eq", m, self.c(0.0, loc))], loc=loc), loc=loc)   # 1 where z = 0
        return f("div", x, m), f("div", y, m), m

    def abs(self, z: V.Value, loc) -> V.Value:
        """|z| = m sqrt((x/m)^2 + (y/m)^2) (`scaled`: in range for any finite z, as
        numpy's and PyTorch's hypot; sqrt(x^2 + y^2) was 0 below 1e-19 in f32, with a NaN
        derivative, and inf beyond 1e19); inf where a part is."""
        x, y, m = self.scaled(z, loc)
        r = V.mul([m, V.map_("sqrt", V.add([V.mul([x, x], loc=loc), V.mul([y, y], loc=loc)], loc=loc), loc=loc)],
                  loc=loc)
        return V.map_("where", V.map_("eq", m, self.c(math.inf, loc), loc=loc), m, r, loc=loc)

    def exp(self, z: V.Value, loc) -> V.Value:
        x, y = self.parts(z, loc)
        e = V.map_("exp", x, loc=loc)
        return self.make(V.mul([e, V.map_("cos", y, loc=loc)], loc=loc),
                         V.mul([e, V.map_("sin", y, loc=loc)], loc=loc), loc)

    def cosh_sinh(self, y: V.Value, loc) -> tuple[V.Value, V.Value]:
        """cosh y = (e^y + e^-y) / 2 (no cancellation) and sinh y = cosh y tanh y, which
        keeps sinh's relative accuracy near 0, where (e^y - e^-y) / 2 would cancel."""
        e = V.map_("exp", y, loc=loc)
        inv = V.map_("exp", V.add([y], [-1.0], loc=loc), loc=loc)
        cosh = V.add([e, inv], [0.5, 0.5], loc=loc)
        return cosh, V.mul([cosh, V.map_("tanh", y, loc=loc)], loc=loc)

    def sin(self, z: V.Value, loc) -> V.Value:
        """sin(x + iy) = sin x cosh y + i cos x sinh y."""
        x, y = self.parts(z, loc)
        ch, sh = self.cosh_sinh(y, loc)
        return self.make(V.mul([V.map_("sin", x, loc=loc), ch], loc=loc),
                         V.mul([V.map_("cos", x, loc=loc), sh], loc=loc), loc)

    def cos(self, z: V.Value, loc) -> V.Value:
        """cos(x + iy) = cos x cosh y - i sin x sinh y."""
        x, y = self.parts(z, loc)
        ch, sh = self.cosh_sinh(y, loc)
        return self.make(V.mul([V.map_("cos", x, loc=loc), ch], loc=loc),
                         V.add([V.mul([V.map_("sin", x, loc=loc), sh], loc=loc)], [-1.0], loc=loc), loc)

    def sqrt(self, z: V.Value, loc) -> V.Value:
        """The principal square root, without cancellation: t = sqrt((|x| + |z|) / 2),
        then t + i y / 2t for x >= 0 and |y| / 2t + i (+-t, the sign of y) for x < 0
        (the root with a real part >= 0, as numpy's). 0 at 0 (no division by t = 0)."""
        x, y = self.parts(z, loc)
        f = lambda *a: V.map_(*a, loc=loc)   # noqa: E731
        r = self.abs(z, loc)
        t = f("sqrt", V.add([f("abs", x), r], [0.5, 0.5], loc=loc))
        zero = f("eq", t, self.c(0.0, loc))
        other = f("where", zero, self.c(0.0, loc),
                  f("div", y, V.add([t, zero], [2.0, 1.0], loc=loc)))   # y / 2t, 0 where t = 0
        neg = f("lt", x, self.c(0.0, loc))
        re = f("where", neg, f("abs", other), t)
        im = f("where", neg, f("where", f("lt", y, self.c(0.0, loc)), V.add([t], [-1.0], loc=loc), t), other)
        return self.make(re, im, loc)

    def log(self, z: V.Value, loc) -> V.Value:
        return self.make(V.map_("log", self.abs(z, loc), loc=loc), self.angle(z, loc), loc)

    def angle(self, z: V.Value, loc) -> V.Value:
        """atan2(imag, real) by Newton's method (see the module's docstring)."""
        if not is_complex(z):   # angle of a real: 0 for x >= 0, pi for x < 0
            return V.mul([V.const(math.pi, self.dtype, loc=loc), V.map_("lt", z, self.c(0.0, loc), loc=loc)],
                         loc=loc)
        x, y = self.parts(z, loc)
        t = V.stop(self.guess(x, y, loc), loc=loc)
        for _ in range(2):
            t = V.stop(self.newton(x, y, t, loc), loc=loc)
        return self.newton(x, y, t, loc)

    def c(self, value: float, loc) -> V.Value:
        return V.const(value, self.dtype, loc=loc)

    def guess(self, x: V.Value, y: V.Value, loc) -> V.Value:
        """atan2(y, x) within 0.005: a = atan(min/max of |x|, |y|) by
        a = t (pi/4 + 0.273 (1 - t)), then placed in the octant of (x, y)."""
        f = lambda *a: V.map_(*a, loc=loc)   # noqa: E731
        ax, ay = f("abs", x), f("abs", y)
        lo, hi = f("min", ax, ay), f("max", ax, ay)
        zero = f("eq", hi, self.c(0.0, loc))
        t = f("div", lo, V.add([hi, zero], loc=loc))          # 0 where x = y = 0
        a = V.mul([t, V.add([self.c(math.pi / 4 + 0.273, loc), t], [1.0, -0.273], loc=loc)], loc=loc)
        a = f("where", f("gt", ay, ax), V.add([self.c(math.pi / 2, loc), a], [1.0, -1.0], loc=loc), a)
        a = f("where", f("lt", x, self.c(0.0, loc)), V.add([self.c(math.pi, loc), a], [1.0, -1.0], loc=loc), a)
        return f("where", f("lt", y, self.c(0.0, loc)), V.add([a], [-1.0], loc=loc), a)

    def newton(self, x: V.Value, y: V.Value, t: V.Value, loc) -> V.Value:
        """One Newton step for x sin t - y cos t = 0 from t (no step where x = y = 0)."""
        s, co = V.map_("sin", t, loc=loc), V.map_("cos", t, loc=loc)
        num = V.add([V.mul([x, s], loc=loc), V.mul([y, co], loc=loc)], [1.0, -1.0], loc=loc)
        den = V.add([V.mul([x, co], loc=loc), V.mul([y, s], loc=loc)], loc=loc)
        zero = V.map_("eq", den, self.c(0.0, loc), loc=loc)
        step = V.map_("where", zero, self.c(0.0, loc), V.map_("div", num, V.add([den, zero], loc=loc), loc=loc),
                      loc=loc)   # no step, and no derivative (torch's), where x = y = 0
        return V.add([t, step], [1.0, -1.0], loc=loc)


def power_literal(node) -> int | None:
    """The integer a `^`'s exponent is written as (`3`, `-2`, `(4)`), else None."""
    sign = 1
    if isinstance(node, ast.Neg):
        sign, node = -1, node.x
    if isinstance(node, ast.Num) and float(node.value).is_integer() and abs(node.value) <= MAX_POWER:
        return sign * int(node.value)
    return None
