"""Counter-based random numbers: Philox 4x32-10, and the floats drawn from it.

This module is the one definition of what `rand[e, ...](key)` and
`randn[e, ...](key)` are. The algorithm is written once, over an abstract
arithmetic `A` (integer ops on unsigned 32-bit words held in 64-bit integers, and
float64 ops), and run by two arithmetics: numpy's here (`NumpyArith`, used by the
IR interpreter and the lowered interpreter) and LLVM IR's in the CPU backend
(`tgc.backends.cpu.philox`). Both execute the same operations in the same order,
each an exactly specified IEEE operation (integer ops; float `+ - * /` and `sqrt`,
correctly rounded; int -> float conversions of integers below 2**53, exact), with
no fused multiply-add and no library function. So every backend computes the same
bits: a value depends only on the key and on the element's counter.

- **Philox 4x32-10** (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
  SC'11): a 4x32-bit counter and a 2x32-bit key, ten rounds of two 32x32->64-bit
  multiplies (0xD2511F53, 0xCD9E8D57), the key bumped by the Weyl increments
  (0x9E3779B9, 0xBB67AE85) between rounds. `philox` reproduces the published
  known-answer vectors (tests/e2e/test_random.py).
- **Keys.** An `i32` key `k` is the Philox key (k mod 2**32, 0). `fold(key, n)` is
  the first two words of Philox(counter = (n mod 2**32, n >> 32, 1, 0), key): word 2
  of a fold's counter is 1 and of a draw's 0, so no fold output is a draw's output
  under the same key.
- **Counters.** A draw over edges e1 < e2 < ... (sorted by name: the IR has no axis
  order) gives the element at indices (i1, i2, ...) the row-major linear index
  i1*n2*n3... + i2*n3... + ... as its 64-bit counter (lo, hi, 0, 0). So the value
  depends on the element's index along each edge and the edges' sizes, never on
  layout, fusion, backend or thread count.
- **Uniform** in [0, 1): f32 takes the top 24 bits of word 0, `(w0 >> 8) * 2**-24`;
  f64 takes 53 bits of words 0 and 1, `((w0 >> 5) * 2**26 + (w1 >> 6)) * 2**-53`.
  Exact in the type: every value is a multiple of the type's 2**-24 or 2**-53.
- **Normal** by Box-Muller, computed in float64 and rounded once to the type:
  `sqrt(-2 log u) * cos(2 pi t)` with u = (U + 1) 2**-n in (0, 1] (so log(0) never
  occurs: the largest radius is sqrt(2 n log 2), 5.8 for f32 and 8.6 for f64) and
  t = T 2**-n in [0, 1), U and T n-bit integers (n = 24 from words 0, 1 for f32;
  n = 53 from words 0-1 and 2-3 for f64). The angle is reduced with integers:
  2 pi t = q pi/2 + a exactly, |a| <= pi/4. log, cos and sin are polynomials here
  (log through m 2**e, m in [sqrt(1/2), sqrt(2)), and 2 atanh((m-1)/(m+1)); cos and
  sin by their Taylor series to degree 16 and 17), accurate to a few float64 ulps:
  their own definition, not a libm's, so no backend's vector math can change a bit.

Terminates: straight-line code (ten rounds, fixed polynomial degrees).
"""
from __future__ import annotations

import math

import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
MASK32 = 0xFFFFFFFF

# 2 atanh(s) = s * sum_k 2 z^k / (2k + 1), z = s^2 <= 0.0295: 12 terms reach 1e-19
_LOG_COEFS = tuple(2.0 / (2 * k + 1) for k in range(12))
# sin a = a * sum_k (-1)^k z^k / (2k+1)!, cos a = sum_k (-1)^k z^k / (2k)!, z = a^2 <= (pi/4)^2
_SIN_COEFS = tuple((-1) ** k / math.factorial(2 * k + 1) for k in range(9))
_COS_COEFS = tuple((-1) ** k / math.factorial(2 * k) for k in range(9))
_LN2 = math.log(2.0)
_SQRT_HALF = math.sqrt(0.5)


def philox(A, ctr, key):
    """Philox 4x32-10 of four counter words and two key words (u32 values of `A`)."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    mask = A.const(MASK32)
    for r in range(10):
        if r:
            k0 = A.and_(A.add(k0, A.const(W0)), mask)
            k1 = A.and_(A.add(k1, A.const(W1)), mask)
        p0 = A.mul(A.const(M0), c0)
        p1 = A.mul(A.const(M1), c2)
        hi0, lo0 = A.shr(p0, 32), A.and_(p0, mask)
        hi1, lo1 = A.shr(p1, 32), A.and_(p1, mask)
        c0, c1, c2, c3 = A.xor(A.xor(hi1, c1), k0), lo1, A.xor(A.xor(hi0, c3), k1), lo0
    return c0, c1, c2, c3


def derive_key(A, key, folds: tuple):
    """The Philox key of an i32 key (a signed value of `A`) folded with `folds` in order:
    each an integer literal (a Python int) or an i32 value of `A` (signed, as the key),
    which folds as its 32 bits (n mod 2**32), as a literal in [0, 2**31) does."""
    mask = A.const(MASK32)
    k = (A.and_(key, mask), A.const(0))
    for n in folds:
        if isinstance(n, int):
            lo, hi = A.const(n & MASK32), A.const((n >> 32) & MASK32)
        else:
            lo, hi = A.and_(n, mask), A.const(0)
        w = philox(A, (lo, hi, A.const(1), A.const(0)), k)
        k = (w[0], w[1])
    return k


def draw(A, kind: str, dtype: str, key, folds: tuple, counter):
    """The value of draw `kind` ('rand' or 'randn') at a 64-bit `counter` (a value of `A`),
    as a float of `A` of `dtype` ('f32' or 'f64'); `folds` as `derive_key` takes them."""
    k = derive_key(A, key, folds)
    mask = A.const(MASK32)
    w = philox(A, (A.and_(counter, mask), A.shr(counter, 32), A.const(0), A.const(0)), k)
    if kind == "rand":
        u, n = _bits(A, dtype, w[0], w[1])
        return A.to_float(A.fmul(A.int_to_f64(u), A.fconst(2.0 ** -n)), dtype)
    return A.to_float(_normal(A, dtype, w), dtype)


def _bits(A, dtype: str, a, b):
    """An n-bit integer from one word (f32: 24 bits) or two (f64: 53 bits), and n."""
    if dtype == "f32":
        return A.shr(a, 8), 24
    return A.or_(A.shl(A.shr(a, 5), 26), A.shr(b, 6)), 53


def _normal(A, dtype: str, w):
    """sqrt(-2 log u) cos(2 pi t) in float64 (see the module docstring)."""
    U, n = _bits(A, dtype, w[0], w[1])
    T, _ = _bits(A, dtype, w[2], w[3]) if dtype == "f64" else _bits(A, dtype, w[1], w[0])
    u = A.fmul(A.int_to_f64(A.add(U, A.const(1))), A.fconst(2.0 ** -n))     # (0, 1], exact
    radius = A.sqrt(A.fmul(A.fconst(-2.0), _log(A, u)))
    half = 1 << (n - 3)                                # 2 pi t = q pi/2 + a, |a| <= pi/4:
    S = A.add(T, A.const(half))                        # t + 1/8 = (q + r) / 4, r in [0, 1)
    q = A.and_(A.shr(S, n - 2), A.const(3))
    f = A.fsub(A.int_to_f64(A.and_(S, A.const((1 << (n - 2)) - 1))), A.fconst(float(half)))   # exact
    a = A.fmul(f, A.fconst(math.pi / 2 * 2.0 ** -(n - 2)))
    z = A.fmul(a, a)
    c = _horner(A, _COS_COEFS, z)
    s = A.fmul(a, _horner(A, _SIN_COEFS, z))
    return A.fmul(radius, A.select4(q, (c, A.fneg(s), A.fneg(c), s)))


def _log(A, u):
    """log u for a normal float64 u > 0."""
    m, e = A.frexp(u)                                  # u = m 2^e, m in [1/2, 1), both exact
    small = A.flt(m, A.fconst(_SQRT_HALF))
    m = A.fselect(small, A.fmul(m, A.fconst(2.0)), m)
    e = A.fselect(small, A.fsub(e, A.fconst(1.0)), e)
    s = A.fdiv(A.fsub(m, A.fconst(1.0)), A.fadd(m, A.fconst(1.0)))   # |s| <= 0.1716
    return A.fadd(A.fmul(e, A.fconst(_LN2)), A.fmul(s, _horner(A, _LOG_COEFS, A.fmul(s, s))))


def _horner(A, coefs, z):
    acc = A.fconst(coefs[-1])
    for c in reversed(coefs[:-1]):
        acc = A.fadd(A.fmul(acc, z), A.fconst(c))
    return acc


class NumpyArith:
    """`A` over numpy: integers as uint64 arrays (wrapping), floats as float64 arrays."""

    def const(self, c: int):
        return np.uint64(c)

    def add(self, a, b):
        return np.add(a, b, dtype=np.uint64)

    def mul(self, a, b):
        return np.multiply(a, b, dtype=np.uint64)

    def and_(self, a, b):
        return np.bitwise_and(a, b, dtype=np.uint64)

    def or_(self, a, b):
        return np.bitwise_or(a, b, dtype=np.uint64)

    def xor(self, a, b):
        return np.bitwise_xor(a, b, dtype=np.uint64)

    def shr(self, a, n: int):
        return np.right_shift(a, np.uint64(n), dtype=np.uint64)

    def shl(self, a, n: int):
        return np.left_shift(a, np.uint64(n), dtype=np.uint64)

    def int_to_f64(self, a):
        return np.asarray(a, np.uint64).astype(np.float64)

    def fconst(self, c: float):
        return np.float64(c)

    def fadd(self, a, b):
        return np.add(a, b, dtype=np.float64)

    def fsub(self, a, b):
        return np.subtract(a, b, dtype=np.float64)

    def fmul(self, a, b):
        return np.multiply(a, b, dtype=np.float64)

    def fdiv(self, a, b):
        return np.divide(a, b, dtype=np.float64)

    def fneg(self, a):
        return np.negative(a, dtype=np.float64)

    def sqrt(self, a):
        return np.sqrt(a, dtype=np.float64)

    def flt(self, a, b):
        return np.less(a, b)

    def fselect(self, c, a, b):
        return np.where(c, a, b)

    def frexp(self, u):
        m, e = np.frexp(np.asarray(u, np.float64))
        return m, e.astype(np.float64)

    def select4(self, q, options):
        q = np.asarray(q)
        return np.choose(q.astype(np.intp), [np.broadcast_to(o, q.shape) for o in options])

    def to_float(self, x, dtype: str):
        return np.asarray(x, np.float64).astype(np.float32 if dtype == "f32" else np.float64)


NUMPY = NumpyArith()


def philox_block(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, ...]:
    """Philox4x32-10 of one counter and key, as Python ints (for tests and tools)."""
    out = philox(NUMPY, tuple(np.uint64(c) for c in counter), tuple(np.uint64(k) for k in key))
    return tuple(int(w) for w in out)


def draw_numpy(kind: str, dtype: str, key: int, folds: tuple, counters: np.ndarray) -> np.ndarray:
    """The draw at every counter of `counters` (an integer array of any shape); `folds`
    are ints, or numpy integers for folds by an i32 input's value (`fold(key, n)`)."""
    with np.errstate(all="ignore"):
        k = np.asarray(np.int64(key)).astype(np.uint64)
        fs = tuple(n if isinstance(n, int) else np.asarray(np.int64(n)).astype(np.uint64) for n in folds)
        return draw(NUMPY, kind, dtype, k, fs, np.asarray(counters).astype(np.uint64))


class _Counter:
    """`A` that counts operations instead of computing: (integer ops, float ops)."""

    def __init__(self):
        self.ints = self.floats = 0

    def __getattr__(self, name: str):
        floats = name.startswith("f") and name not in ("fconst", "frexp") or name in ("sqrt", "int_to_f64")

        def op(*args):
            if name not in ("const", "fconst", "to_float"):
                if floats:
                    self.floats += 1
                else:
                    self.ints += 1
            return (0.0, 0.0) if name == "frexp" else 0
        return op


def op_counts(kind: str, dtype: str, folds: int = 0) -> tuple[int, int]:
    """(integer ops, float ops) of one draw, counted by running `draw` (for cost models)."""
    c = _Counter()
    draw(c, kind, dtype, 0, (0,) * folds, 0)
    return c.ints, c.floats
