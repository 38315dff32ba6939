"""Development-time tool: derives the polynomial coefficients pasted into vecmath.py.

Not imported by the compiler. Run ``python -m tgc.backends.cpu.vecmath_fit`` (needs
mpmath) to print the tables again.

Method: each kernel ``g`` (the part of a function that remains after the exact
leading terms are split off, e.g. ``(exp(r) - 1 - r) / r**2``) is fitted by a
polynomial ``sum c_k t**k`` on ``n`` Chebyshev nodes of its interval, minimising the
weighted error ``w(t) * (g(t) - p(t))``, where ``w`` turns that error into the
relative error of the final function value. The weighted least-squares problem is
solved in float64 with iterative refinement of the residual in 40-digit mpmath
arithmetic, and Lawson's reweighting drives the solution towards minimax. The
coefficients are then rounded to the target precision and the error re-measured.
"""

import mpmath as mp
import numpy as np

mp.mp.dps = 40


def _nodes(a, b, n):
    a, b = mp.mpf(a), mp.mpf(b)
    return [a + (b - a) * (1 - mp.cos(mp.pi * (i + 0.5) / n)) / 2 for i in range(n)]


def _residual(rows, target, c):
    return np.array([float(t - mp.fsum(r * x for r, x in zip(row, c)))
                     for row, t in zip(rows, target)])


def fit(g, a, b, degree, w, n=300, iters=12):
    """Near-minimax coefficients (mpf, ascending powers) of g on [a, b] under weight w."""
    ts = _nodes(a, b, n)
    rows = [[w(t) * t ** k for k in range(degree + 1)] for t in ts]
    target = [w(t) * g(t) for t in ts]
    matrix = np.array([[float(x) for x in row] for row in rows])
    c, lw = [mp.mpf(0)] * (degree + 1), np.ones(n)
    for _ in range(iters):
        for _ in range(3):
            res = _residual(rows, target, c)
            s = np.sqrt(lw)
            d = np.linalg.lstsq(matrix * s[:, None], res * s, rcond=None)[0]
            c = [x + mp.mpf(float(dx)) for x, dx in zip(c, d)]
        res = np.abs(_residual(rows, target, c))
        lw = lw * res / np.sum(lw * res)
    return c


def max_error_ulps(g, a, b, c, w, dtype, n=1500):
    """Max weighted error, in units of half an epsilon, with c rounded to dtype."""
    cr = [mp.mpf(float(dtype(float(x)))) for x in c]
    ts = [mp.mpf(a) + (mp.mpf(b) - a) * i / (n - 1) for i in range(n)]
    err = max(abs(w(t) * (g(t) - mp.polyval(cr[::-1], t))) for t in ts)
    return float(err) / (float(np.finfo(dtype).eps) / 2)


def _sq(f):
    """h(u) = f(sqrt(u)), the even-function variable change."""
    return lambda u: f(mp.sqrt(u))


ERF_SPLIT, ERF_K = 0.921875, 3.0


def _erfcx_t(t):
    x = ERF_K * (1 + t) / (1 - t)
    return mp.erfc(x) * mp.exp(x * x)


def _erf_tail_w(t):
    x = ERF_K * (1 + t) / (1 - t)
    return mp.exp(-x * x) / mp.erf(x)


def _t(x):
    return (x - ERF_K) / (x + ERF_K)


def problems():
    """name -> (g, a, b, weight, {bits: degree})."""
    ln2, smax = mp.log(2), (mp.sqrt(2) - 1) / (mp.sqrt(2) + 1)
    eps = mp.mpf(10) ** -30
    return {
        # exp(r) = 1 + r + r^2 Q(r),  |r| <= ln2/2
        'exp': (lambda r: (mp.exp(r) - 1 - r) / r ** 2 if r else mp.mpf(1) / 2,
                -ln2 / 2, ln2 / 2, lambda r: r * r / mp.exp(r), {32: 4, 64: 9}),
        # log(1+f) = 2s + s R(z), z = s^2, R(z) = z P(z),  s = f / (2 + f)
        'log': (lambda z: (2 * mp.atanh(mp.sqrt(z)) - 2 * mp.sqrt(z)) / mp.sqrt(z) ** 3
                if z else mp.mpf(2) / 3,
                0, smax ** 2, lambda z: mp.sqrt(z) ** 3 / (2 * mp.atanh(mp.sqrt(z))) if z else 0,
                {32: 2, 64: 6}),
        # tanh(x) = x + x^3 P(x^2),  |x| < 0.625
        'tanh': (_sq(lambda x: (mp.tanh(x) - x) / x ** 3 if x else mp.mpf(-1) / 3),
                 0, 0.625 ** 2, _sq(lambda x: x ** 3 / mp.tanh(x) if x else 0), {32: 4, 64: 10}),
        # sin(r) = r + r^3 S(r^2),  |r| <= 1: pi/4 plus the slack of a reduction whose
        # quotient j is off by one when x*2/pi rounds (large |x|)
        'sin': (_sq(lambda x: (mp.sin(x) - x) / x ** 3 if x else mp.mpf(-1) / 6),
                0, 1, _sq(lambda x: x ** 3 / mp.sin(x) if x else 0), {32: 3, 64: 6}),
        # cos(r) = 1 - r^2/2 + r^4 C(r^2),  |r| <= 1
        'cos': (_sq(lambda x: (mp.cos(x) - 1 + x * x / 2) / x ** 4 if x else mp.mpf(1) / 24),
                0, 1, _sq(lambda x: x ** 4 / mp.cos(x)), {32: 2, 64: 5}),
        # erf(x) = x + x P(x^2),  |x| < ERF_SPLIT
        'erf_small': (_sq(lambda x: mp.erf(x) / x - 1 if x else 2 / mp.sqrt(mp.pi) - 1),
                      0, ERF_SPLIT ** 2, _sq(lambda x: x / mp.erf(x) if x > eps else mp.sqrt(mp.pi) / 2),
                      {32: 6, 64: 11}),
        # erf(x) = 1 - exp(-x^2) R(t), t = (x - 3) / (x + 3), x in [ERF_SPLIT, 4 | 6]
        'erf_tail32': (_erfcx_t, _t(ERF_SPLIT), _t(4.0), _erf_tail_w, {32: 6}),
        'erf_tail64': (_erfcx_t, _t(ERF_SPLIT), _t(6.0), _erf_tail_w, {64: 12}),
    }


def main():
    for name, (g, a, b, w, degrees) in problems().items():
        for bits, degree in degrees.items():
            dtype = np.float32 if bits == 32 else np.float64
            c = fit(g, a, b, degree, w)
            err = max_error_ulps(g, a, b, c, w, dtype)
            hexes = ', '.join(repr(float(dtype(float(x))).hex()) for x in c)
            print(f'# {name} f{bits}: degree {degree}, fit error {err:.3g} ulp')
            print(f'({hexes}),')


if __name__ == '__main__':
    main()
