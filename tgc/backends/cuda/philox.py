"""Random draws in CUDA C: `tgc.ir.philox`'s algorithm run by a C arithmetic.

The algorithm is the IR's own (`tgc.ir.philox.draw`); this module only says how each
of its operations is written in CUDA C, one statement per operation, in a
`__device__` function per distinct draw (kind, float type, folds) of a module:

- words are `unsigned long long` (a u32 in the low half; a 32x32 -> 64-bit product
  is one multiply, wrapping as numpy's uint64 and LLVM's i64 do);
- floats are `double`, and every float operation is a CUDA intrinsic with its
  rounding written out (`__dadd_rn`, `__dsub_rn`, `__dmul_rn`, `__ddiv_rn`,
  `__dsqrt_rn`): nvcc never contracts those into a fused multiply-add, which it
  does by default to `a * b + c`; under cuda-sim `sim.h` defines them as the plain
  IEEE operations (g++ without -mfma emits no FMA);
- `frexp` comes from the bits (`__double_as_longlong`), as in the LLVM arithmetic;
  integer -> double conversions are of integers below 2**53 (exact).

So the bits are those of the numpy interpreters and the CPU backend. A fold by an i32
input's value (`fold(key, n)`) is a parameter of the function. Terminates: the draw is
straight-line code.
"""
from __future__ import annotations

import re

from tgc.ir import philox


class CArith:
    """`A` that writes C statements into `lines` and returns the names of their results."""

    def __init__(self):
        self.lines: list[str] = []
        self.n = 0

    def _let(self, ctype: str, expr: str) -> str:
        name = f"v{self.n}"
        self.n += 1
        self.lines.append(f"const {ctype} {name} = {expr};")
        return name

    def _u(self, expr: str) -> str:
        return self._let("unsigned long long", expr)

    def _d(self, expr: str) -> str:
        return self._let("double", expr)

    def const(self, c: int) -> str:
        return f"{c}ULL"

    def add(self, a, b):
        return self._u(f"{a} + {b}")

    def mul(self, a, b):
        return self._u(f"{a} * {b}")

    def and_(self, a, b):
        return self._u(f"{a} & {b}")

    def or_(self, a, b):
        return self._u(f"{a} | {b}")

    def xor(self, a, b):
        return self._u(f"{a} ^ {b}")

    def shr(self, a, n: int):
        return self._u(f"{a} >> {n}")

    def shl(self, a, n: int):
        return self._u(f"{a} << {n}")

    def int_to_f64(self, a):
        return self._d(f"(double){a}")

    def fconst(self, c: float) -> str:
        return f"({float(c)!r})"

    def fadd(self, a, b):
        return self._d(f"__dadd_rn({a}, {b})")

    def fsub(self, a, b):
        return self._d(f"__dsub_rn({a}, {b})")

    def fmul(self, a, b):
        return self._d(f"__dmul_rn({a}, {b})")

    def fdiv(self, a, b):
        return self._d(f"__ddiv_rn({a}, {b})")

    def fneg(self, a):
        return self._d(f"-{a}")

    def sqrt(self, a):
        return self._d(f"__dsqrt_rn({a})")

    def flt(self, a, b):
        return self._let("bool", f"{a} < {b}")

    def fselect(self, c, a, b):
        return self._d(f"{c} ? {a} : {b}")

    def frexp(self, u):
        """u = m 2^e, m in [1/2, 1), for a normal positive double: from its bits."""
        bits = self._u(f"(unsigned long long)__double_as_longlong({u})")
        e = self._d(f"(double)((long long)((({bits}) >> 52) & 0x7FFULL) - 1022LL)")
        m = self._d(f"__longlong_as_double((long long)((({bits}) & 0xFFFFFFFFFFFFFULL) | (1022ULL << 52)))")
        return m, e

    def select4(self, q, options):
        c0, c1, c2, c3 = options
        return self._d(f"{q} == 0ULL ? {c0} : {q} == 1ULL ? {c1} : {q} == 2ULL ? {c2} : {c3}")

    def to_float(self, x, dtype: str):
        return self._let("float", f"__double2float_rn({x})") if dtype == "f32" else x


def device_function(name: str, kind: str, dtype: str, folds: tuple) -> str:
    """The `__device__` function `name(key, counter, n0, n1, ...)` returning the draw of
    `kind` in `dtype` ('f32' or 'f64'); `folds` are ints (literal folds) or None, a fold
    by the value of the next `long long n<i>` parameter (an i32 input's, sign-extended)."""
    A = CArith()
    params = ["long long key", "long long counter"]
    fs = []
    for n in folds:
        if n is None:
            p = f"n{len(params) - 2}"
            params.append(f"long long {p}")
            fs.append(f"(unsigned long long){p}")
        else:
            fs.append(int(n))
    value = philox.draw(A, kind, dtype, "(unsigned long long)key", tuple(fs), "(unsigned long long)counter")
    ctype = "float" if dtype == "f32" else "double"
    body = "\n".join("    " + line for line in _live(A.lines, value))
    return f"__device__ {ctype} {name}({', '.join(params)}) {{\n{body}\n    return {value};\n}}"


def _live(lines: list[str], result: str) -> list[str]:
    """`lines` without the definitions nothing reads (words the algorithm computes and
    drops, e.g. a Philox block's unused outputs: nvcc warns about them)."""
    used = set(re.findall(r"\bv\d+\b", result))
    keep = []
    for line in reversed(lines):
        name, _, expr = line[len("const "):].partition(" = ")
        if name.split()[-1] in used:
            keep.append(line)
            used |= set(re.findall(r"\bv\d+\b", expr))
    return keep[::-1]
