"""Vectorizable elementwise math in LLVM IR: exp log tanh erf sin cos sqrt log1p expm1,
f32 and f64.

Why: LLVM's ``llvm.exp``/``expf`` calls stay scalar inside vectorized loops (16 calls
per 512-bit iteration). The functions here are straight-line IR -- fma polynomials,
integer bit manipulation on the float's bits, ``select`` for the special cases, no
libm calls, no branches -- emitted as ``internal alwaysinline`` functions, so a loop
that calls one vectorizes to the host's widest registers once it is inlined.

Usage: ``f = declare_math(module, 'exp', ir.FloatType())`` then ``builder.call(f, [x])``
inside the loop body; the O1..O3 pipeline of ``llvm_env.optimize`` inlines and
vectorizes. No fast-math flags are needed or used. Callers must not put
``nnan``/``ninf`` (or ``fast``) on instructions feeding these functions: the special
cases below are ``select``s that those flags would fold away.

Algorithms (coefficients from ``vecmath_fit.py``: near-minimax weighted fits of the
relative error, solved in float64 with residuals refined in 40-digit mpmath and
Lawson reweighting, then rounded to the target precision):
  exp   n = round(x/ln2) via the 1.5*2^p shifter in one fma; r = x - n*ln2 (two-part
        Cody-Waite with fma); exp(r) = 1 + r + r^2 Q(r) (Q of degree 4 | 9; "a | b"
        means f32 | f64 throughout); times 2^n as two
        exponent-field powers of two, so results in the subnormal range and next to
        overflow round once and correctly.
  log   x = 2^e m, m in [sqrt(1/2), sqrt(2)) from the bits (subnormal x pre-scaled);
        f = m-1, s = f/(2+f), log(1+f) = f - f^2/2 + s (f^2/2 + R(s^2)) (R deg 3 | 7);
        plus e*ln2 in two parts.
  tanh  |x| < 0.625: x + x^3 P(x^2) (deg 4 | 10); else sign(x) (1 - 2/(exp(2|x|)+1)).
  erf   |x| < 0.921875: x + x P(x^2) (deg 6 | 11); else sign(x) (1 - exp(-x^2) R(t)),
        t = (|x|-3)/(|x|+3), R approximating erfcx (deg 6 | 12); |x| clamped at 4 | 6,
        where erf rounds to 1.
  sin, cos  j = round(x*2/pi) via the shifter; r = x - j*pi/2 with three-part
        Cody-Waite (fma, first step exact); sin r = r + r^3 S(r^2) (deg 3 | 6), cos r =
        1 - r^2/2 + r^4 C(r^2) (deg 2 | 5), fitted on |r| <= 1 so that a quotient j off
        by one (x*2/pi rounded, large |x|) stays accurate; j mod 4 selects and negates.
  sqrt  ``llvm.sqrt`` (correctly rounded; vectorizes to vsqrtps/pd).
  log1p u = 1 + x rounded; log(u) * (x / (u - 1)) (Goldberg): the quotient is 1
        corrected by u's rounding error, so the result keeps log's accuracy at small x;
        x itself where u rounds to 1.
  expm1 u = exp(x); (u - 1) * (x / log(u)) (Kahan): the errors of u cancel between the
        two factors; x where u rounds to 1, -1 where u - 1 rounds to -1.

Special values (all as numpy): exp(NaN) = NaN, exp(+inf) = inf, exp(-inf) = 0, exp
overflows to inf above 88.72 | 709.78 and underflows through the subnormals to +0
below -103.97 | -745.13. log(+-0) = -inf, log(x<0) = log(-inf) = NaN, log(inf) = inf,
log(NaN) = NaN, subnormal x exact. log1p(-1) = -inf, log1p(x<-1) = NaN, log1p(inf) =
inf, keeps -0 and is exact on subnormals; expm1(-inf) = -1, expm1 overflows to inf
where exp does, keeps -0 and is exact on subnormals. tanh(+-inf) = +-1, saturates to +-1 beyond
9.01 | 19.06, keeps the sign of -0. erf(+-inf) = +-1, keeps -0. sin/cos(+-inf) = NaN.
Subnormal inputs and outputs are handled exactly as IEEE arithmetic does (no
flush-to-zero is assumed or set); under FTZ/DAZ they become zeros like any other code.
(A subnormal result costs a microcode assist, ~10x the time of its vector; an exp
input below the underflow threshold, e.g. a masked -inf, does not.)

sin/cos range: the reduction is accurate while j is an exact small integer and the
first Cody-Waite step is exact: |x| <= 2^22 * pi/2 (~6.6e6) in f32, |x| <= 2^50 * pi/2
(~1.8e15) in f64. Within range the error grows slowly with |x| in f32 (the
neglected fourth part of pi/2 times j): see the table. Beyond it an f32 x is reduced
in f64 against 192 bits of 2/pi (`_sincos_wide_f32`: exact products with 24-bit
chunks, summed mod 4), then the f64 polynomials: 0.50 ulp measured on every 8th f32 of
the binades 2^23, 2^40, 2^70, 2^100 and 2^127 against numpy's f64 sin/cos. Both
reductions are computed for every lane (the loop is vectorized; a select picks one),
so f32 sin/cos cost about 10x their in-range-only form (2^20 floats, one thread: sin
0.35 -> 3.9 ms, cos 0.34 -> 3.9 ms; f64 unchanged), the price of no NaN for a large
argument. An f64 x beyond 2^50 * pi/2 gives NaN (not reduced: it would need products
wider than f64).

Measured maximum error in ulps, against the unrounded reference (a correctly
rounded result shows up to 0.5). f32: every 61st bit pattern of all 2^32 floats,
plus exhaustive windows (exp on [-1, 1], [-104, -87], [80, 89]; log on [0.5, 2];
tanh on +-[0.3, 1.5]; erf on +-[0.5, 1.5] and +-[2.5, 4.1]; sin/cos on [0, 8] and
+-[65536, 131072]) against numpy float64. f64: 10^7 random inputs per function over
the domains of tests/backends/test_cpu_vecmath.py, against numpy longdouble (x87
80-bit libm) and, for erf, a positive-term series in longdouble (checked against
mpmath to 0.01 ulp):
    function  f32                              f64
    exp       1.00                             1.03
    log       0.84                             0.83
    tanh      1.33                             1.34
    erf       1.19                             1.26
    sin       1.47 (|x|<=1e5), 1.96 (<=6.6e6)  1.48 (|x|<=1e6), 1.45 (<=1.7e15)
    cos       1.48 (|x|<=1e5), 2.19 (<=6.6e6)  1.48 (|x|<=1e6), 1.44 (<=1.7e15)
    sqrt      0.50 (correctly rounded)         0.50
    log1p     2.33 *                           2.22 *
    expm1     2.36 *                           2.31 *
(* log1p and expm1: the 1.5 million inputs of the test's domains only, f32 against
numpy float64, f64 against longdouble; not the dense runs of the others.)
(exp scales by 2^n with one llvm.ldexp on AVX-512 hosts, rounded once, and with two
multiplies elsewhere; the table's runs used the multiplies.)
The largest errors of tanh and erf sit just above their polynomial/exp-form split;
those of sin/cos come from the rounding of the reduced argument r.
"""

import llvmlite.ir as ir

H = float.fromhex

# Polynomial coefficients, ascending powers, from ``python -m tgc.backends.cpu.vecmath_fit``.
_COEFFS = {
    ('exp', 32): ('0x1.fffffcp-2', '0x1.555492p-3', '0x1.5558f2p-5', '0x1.1239dep-7',
                  '0x1.6a23fp-10'),
    ('exp', 64): ('0x1.000000000000ap-1', '0x1.55555555554fap-3', '0x1.5555555550873p-5',
                  '0x1.1111111127b49p-7', '0x1.6c16c1842b25cp-10', '0x1.a01a012a92732p-13',
                  '0x1.a0199a0b94e18p-16', '0x1.71df24cbc280bp-19', '0x1.28ad7204e5c5dp-22',
                  '0x1.ad803faae4f5fp-26'),
    ('log', 32): ('0x1.55557ap-1', '0x1.995ecep-2', '0x1.31e11ap-2'),
    ('log', 64): ('0x1.5555555555592p-1', '0x1.999999997fec6p-2', '0x1.24924941e259cp-2',
                  '0x1.c71c52152fbdep-3', '0x1.74663c873f6b9p-3', '0x1.39a1f6e5d22e8p-3',
                  '0x1.2f03113fbc9b4p-3'),
    ('tanh', 32): ('-0x1.555532p-2', '0x1.110726p-3', '-0x1.b83c36p-5', '0x1.5225c6p-6',
                   '-0x1.75de6ap-8'),
    ('tanh', 64): ('-0x1.55555555554ffp-2', '0x1.111111110acbap-3', '-0x1.ba1ba1b5058c2p-5',
                   '0x1.664f477abd171p-6', '-0x1.226e162944351p-7', '0x1.d6cf27c0165ccp-9',
                   '-0x1.7d68a04cf1884p-10', '0x1.336601704f869p-11', '-0x1.df54f654bfd66p-13',
                   '0x1.43900986231dcp-14', '-0x1.0da52445b62e8p-16'),
    ('sin', 32): ('-0x1.555556p-3', '0x1.1110ecp-7', '-0x1.9ffe54p-13', '0x1.69b0d8p-19'),
    ('sin', 64): ('-0x1.5555555555555p-3', '0x1.111111111109ep-7', '-0x1.a01a01a00aae6p-13',
                  '0x1.71de3a45e52ecp-19', '-0x1.ae6445a2b2c2ep-26', '0x1.611a4ccba341ap-33',
                  '-0x1.a83cece69ab36p-41'),
    ('cos', 32): ('0x1.555524p-5', '-0x1.6bfa78p-10', '0x1.960332p-16'),
    ('cos', 64): ('0x1.5555555555487p-5', '-0x1.6c16c16c01cb3p-10', '0x1.a01a0186775aep-16',
                  '-0x1.27e4ebfe09967p-22', '0x1.1ee3aa3f73f4dp-29', '-0x1.8d28b126aaa3ap-37'),
    ('erf_small', 32): ('0x1.06eba8p-3', '-0x1.812744p-2', '0x1.ce2e2p-4', '-0x1.b8107ap-6',
                        '0x1.54dadp-8', '-0x1.aae94cp-11', '0x1.5f1092p-14'),
    ('erf_small', 64): ('0x1.06eba8214db69p-3', '-0x1.812746b0379dfp-2', '0x1.ce2f21a042580p-4',
                        '-0x1.b82ce31266020p-6', '0x1.565bcd084e524p-8', '-0x1.c02db2ba768b9p-11',
                        '0x1.f9a2fbd5145b5p-14', '-0x1.f4ce9613f8fdcp-17', '0x1.b9ae21d332a61p-20',
                        '-0x1.5d3e019043ba2p-23', '0x1.e052876befb7dp-27', '-0x1.c9e7ec1d3e1fdp-31'),
    ('erf_tail', 32): ('0x1.6e97eep-3', '-0x1.4e1372p-2', '0x1.f6b68p-3', '-0x1.350a82p-3',
                       '0x1.1b6fbep-4', '-0x1.d65b56p-6', '0x1.319a94p-11'),
    ('erf_tail', 64): ('0x1.6e9827d229ccdp-3', '-0x1.4e102b9cf9f34p-2', '0x1.f6ff2040b6086p-3',
                       '-0x1.336ffbf064797p-3', '0x1.258b140813b7ep-4', '-0x1.8fa5754859cbcp-6',
                       '0x1.17cb9003a86a0p-8', '0x1.73985d8b14177p-11', '-0x1.37420cf38657fp-11',
                       '0x1.ba61fe54ebc4cp-15', '0x1.392909b2adccdp-14', '-0x1.22675aeed3cafp-18',
                       '-0x1.8e347cfff7e87p-18'),
}

# Per-precision constants. ln2 and pi/2 are split into parts of the working precision
# (hi = the value rounded, lo = the rounded remainder, ...), exact to ~3x the precision.
_K = {
    32: dict(mant=23, bias=127, shift=H('0x1.8p23'), log2e=H('0x1.715476p0'),
             ln2=(H('0x1.62e43p-1'), H('-0x1.05c61p-29')),
             exp_lo=-105.0, exp_hi=89.0, min_normal=H('0x1p-126'),
             sqrt_half_bits=0x3F3504F3, one_bits=0x3F800000,
             two_over_pi=H('0x1.45f306p-1'),
             pio2=(H('0x1.921fb6p0'), H('-0x1.777a5cp-25'), H('-0x1.ee59dap-50')),
             trig_max=H('0x1p22') * 1.5707963267948966,
             tanh_split=0.625, erf_split=0.921875, erf_hi=4.0),
    64: dict(mant=52, bias=1023, shift=H('0x1.8p52'), log2e=H('0x1.71547652b82fep0'),
             ln2=(H('0x1.62e42fefa39efp-1'), H('0x1.abc9e3b39803fp-56')),
             exp_lo=-746.0, exp_hi=710.0, min_normal=H('0x1p-1022'),
             sqrt_half_bits=0x3FE6A09E667F3BCD, one_bits=0x3FF0000000000000,
             two_over_pi=H('0x1.45f306dc9c883p-1'),
             pio2=(H('0x1.921fb54442d18p0'), H('0x1.1a62633145c07p-54'),
                   H('-0x1.f1976b7ed8fbcp-110')),
             trig_max=H('0x1p50') * 1.5707963267948966,
             tanh_split=0.625, erf_split=0.921875, erf_hi=6.0),
}

NAMES = ('exp', 'log', 'tanh', 'erf', 'sin', 'cos', 'sqrt', 'log1p', 'expm1')
# |x| beyond which sin/cos return NaN, by float width
TRIG_MAX = {bits: k['trig_max'] for bits, k in _K.items()}


class _Ops:
    """Builder shorthand for one float type: constants, fma, bit casts, selects."""

    def __init__(self, builder: ir.IRBuilder, fp, scalef: bool):
        self.b, self.fp, self.scalef = builder, fp, scalef
        self.bits = 32 if isinstance(fp, ir.FloatType) else 64
        self.int = ir.IntType(self.bits)
        self.k = _K[self.bits]

    def c(self, value):
        return ir.Constant(self.fp, value)

    def ci(self, value):
        return ir.Constant(self.int, value)

    def coeffs(self, name):
        return [self.c(H(h)) for h in _COEFFS[name, self.bits]]

    def intrinsic(self, name, nargs):
        module = self.b.module
        full = f'llvm.{name}.f{self.bits}'
        fnty = ir.FunctionType(self.fp, [self.fp] * nargs)
        fn = module.globals.get(full)
        if fn is None:
            fn = ir.Function(module, fnty, full)
        elif fn.function_type != fnty:  # e.g. llvmlite's declare_intrinsic('llvm.fma')
            raise TypeError(f'{full} is declared in this module as {fn.function_type}')
        return fn

    def fma(self, a, b, c):
        return self.b.call(self.intrinsic('fma', 3), [a, b, c])

    def fabs(self, x):
        return self.b.call(self.intrinsic('fabs', 1), [x])

    def copysign(self, mag, sign):
        return self.b.call(self.intrinsic('copysign', 2), [mag, sign])

    def horner(self, t, cs):
        p = cs[-1]
        for c in reversed(cs[:-1]):
            p = self.fma(p, t, c)
        return p

    def as_int(self, x):
        return self.b.bitcast(x, self.int)

    def as_fp(self, i):
        return self.b.bitcast(i, self.fp)

    def where(self, op, a, b, then, other):
        """select(a <op> b, then, other) with an ordered compare (false on NaN)."""
        return self.b.select(self.b.fcmp_ordered(op, a, b), then, other)

    def pow2(self, n):
        """2.0**n from an integer n in the normal exponent range."""
        biased = self.b.add(n, self.ci(self.k['bias']))
        return self.as_fp(self.b.shl(biased, self.ci(self.k['mant'])))

    def ldexp(self, x, n):
        """x * 2**n, rounded once (llvm.ldexp: one vscalef on AVX-512, where exp
        took 38 us per 135168 floats on one thread, 47 with two multiplies by
        powers of two; without AVX-512 LLVM may expand it into library calls, so it is
        used only with `scalef`)."""
        i32 = ir.IntType(32)
        n32 = n if self.int.width == 32 else self.b.trunc(n, i32)
        tag = 'f32' if self.k['mant'] == 23 else 'f64'
        name = f'llvm.ldexp.{tag}.i32'
        mod = self.b.module
        fn = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(self.fp, [self.fp, i32]), name)
        return self.b.call(fn, [x, n32])

    def round_shift(self, x, scale):
        """(j as float, j as integer) with j = round(x * scale), |j| < 2**(mant-1)."""
        b, shift = self.b, self.c(self.k['shift'])
        kf = self.fma(x, self.c(scale), shift)
        j = b.sub(self.as_int(kf), self.as_int(shift))
        return b.fsub(kf, shift), j


def _exp_core(o: _Ops, x):
    """exp(x) for x already clamped to [exp_lo, exp_hi] (or NaN)."""
    b, k = o.b, o.k
    nf, n = o.round_shift(x, k['log2e'])
    hi, lo = k['ln2']
    r = o.fma(nf, o.c(-hi), x)
    r = o.fma(nf, o.c(-lo), r)
    q = o.horner(r, o.coeffs('exp'))
    p = b.fadd(o.c(1.0), o.fma(b.fmul(r, r), q, r))
    if o.scalef:
        return o.ldexp(p, n)
    n1 = b.ashr(n, o.ci(1))
    n2 = b.sub(n, n1)
    return b.fmul(b.fmul(p, o.pow2(n1)), o.pow2(n2))


def _exp(o: _Ops, x):
    """exp(x); below exp_lo (where exp rounds to +0, e.g. a softmax's masked -inf) the
    lane computes exp(0) and is then set to 0, so it takes no subnormal-arithmetic
    microcode assist (~10x slower on Intel) that computing the underflow would."""
    zero = o.c(0.0)
    under = o.b.fcmp_ordered('<', x, o.c(o.k['exp_lo']))
    x = o.b.select(under, zero, x)
    x = o.where('>', x, o.c(o.k['exp_hi']), o.c(o.k['exp_hi']), x)
    return o.b.select(under, zero, _exp_core(o, x))


def _log_parts(o: _Ops, x):
    """(e as float, f) with x = 2**e * (1 + f), 1 + f in [sqrt(1/2), sqrt(2))."""
    b, k = o.b, o.k
    tiny = b.fcmp_ordered('<', x, o.c(k['min_normal']))
    xs = b.select(tiny, b.fmul(x, o.c(2.0 ** k['mant'])), x)
    e_adj = b.select(tiny, o.ci(-k['mant']), o.ci(0))
    ix = b.add(o.as_int(xs), o.ci(k['one_bits'] - k['sqrt_half_bits']))
    e = b.sub(b.lshr(ix, o.ci(k['mant'])), o.ci(k['bias']))
    e = b.add(e, e_adj)
    m_bits = b.and_(ix, o.ci((1 << k['mant']) - 1))
    m = o.as_fp(b.add(m_bits, o.ci(k['sqrt_half_bits'])))
    return b.sitofp(e, o.fp), b.fsub(m, o.c(1.0))


def _log(o: _Ops, x):
    b, k = o.b, o.k
    ef, f = _log_parts(o, x)
    s = b.fdiv(f, b.fadd(o.c(2.0), f))
    z = b.fmul(s, s)
    r = b.fmul(z, o.horner(z, o.coeffs('log')))
    hfsq = b.fmul(o.c(0.5), b.fmul(f, f))
    hi, lo = k['ln2']
    y = o.fma(s, b.fadd(hfsq, r), b.fmul(ef, o.c(lo)))
    y = b.fsub(f, b.fsub(hfsq, y))
    y = o.fma(ef, o.c(hi), y)
    inf = float('inf')
    y = o.where('==', x, o.c(inf), o.c(inf), y)
    y = o.where('==', x, o.c(0.0), o.c(-inf), y)
    return b.select(b.fcmp_unordered('<', x, o.c(0.0)), o.c(float('nan')), y)


def _tanh(o: _Ops, x):
    b = o.b
    ax = o.fabs(x)
    u = b.fmul(x, x)
    small = o.fma(b.fmul(x, u), o.horner(u, o.coeffs('tanh')), x)
    e = _exp(o, b.fmul(ax, o.c(2.0)))
    big = b.fsub(o.c(1.0), b.fdiv(o.c(2.0), b.fadd(e, o.c(1.0))))
    return o.copysign(o.where('<', ax, o.c(o.k['tanh_split']), small, big), x)


def _erf(o: _Ops, x):
    b, k = o.b, o.k
    ax = o.fabs(x)
    small = o.fma(x, o.horner(b.fmul(x, x), o.coeffs('erf_small')), x)
    xc = o.where('>', ax, o.c(k['erf_hi']), o.c(k['erf_hi']), ax)
    t = b.fdiv(b.fsub(xc, o.c(3.0)), b.fadd(xc, o.c(3.0)))
    r = o.horner(t, o.coeffs('erf_tail'))
    e = _exp_core(o, b.fneg(b.fmul(xc, xc)))
    big = o.fma(b.fneg(e), r, o.c(1.0))
    return o.where('<', ax, o.c(k['erf_split']), small, o.copysign(big, x))


def _sincos_poly(o: _Ops, r, q):
    """sin(r + q * pi/2) for a reduced |r| <= ~pi/4 and an integer quadrant q."""
    b = o.b
    u = b.fmul(r, r)
    s = o.fma(b.fmul(r, u), o.horner(u, o.coeffs('sin')), r)
    c = o.fma(u, o.fma(u, o.horner(u, o.coeffs('cos')), o.c(-0.5)), o.c(1.0))
    odd = b.icmp_unsigned('!=', b.and_(q, o.ci(1)), o.ci(0))
    neg = b.icmp_unsigned('!=', b.and_(q, o.ci(2)), o.ci(0))
    v = b.select(odd, c, s)
    return b.select(neg, b.fneg(v), v)


# 2/pi in binary, 24 bits a chunk: chunk i is the integer of bits 24i+1 .. 24i+24 after
# the point (weight 2^-24(i+1)); eight chunks reach 2^-192, past what an f32 of exponent
# up to 2^127 needs (its product with the bits above 2^(e-2) is a multiple of 4)
_TWO_OVER_PI_24 = (0xA2F983, 0x6E4E44, 0x1529FC, 0x2757D1, 0xF534DD, 0xC0DB62, 0x95993C, 0x439041)


def _sincos_wide_f32(o: _Ops, x, quadrant_offset):
    """sin(x + quadrant_offset * pi/2) of an f32 x of any size, reduced in f64 (Payne-
    Hanek's idea in floating point): x * c_i is exact for each 24-bit chunk c_i of 2/pi
    (24 x 24 bits < 53), its integer part (rint, exact) is summed mod 4 apart from its
    fraction (exact, |.| <= 1/2), and the fractions' sum is kept in [-1/2, 1/2] by taking
    its integer part out after each term, so each addition rounds by at most 2^-54: the
    reduced argument S * pi/2 is off by about 2^-51 absolute, a few f32 ulps of sin even
    at the f32 inputs closest to a multiple of pi/2. Then the f64 polynomials."""
    b = o.b
    d = ir.DoubleType()
    o64 = _Ops(b, d, o.scalef)
    xd = b.fpext(x, d)
    rint = o64.intrinsic('rint', 1)
    acc_s, acc_j = o64.c(0.0), o64.c(0.0)
    for i, chunk in enumerate(_TWO_OVER_PI_24):
        p = b.fmul(xd, o64.c(chunk * 2.0 ** (-24 * (i + 1))))       # exact
        p = o64.fma(b.call(o64.intrinsic('floor', 1), [b.fmul(p, o64.c(0.25))]), o64.c(-4.0), p)   # mod 4, exact
        pj = b.call(rint, [p])
        acc_j = b.fadd(acc_j, pj)                                     # small integers: exact
        acc_s = b.fadd(acc_s, b.fsub(p, pj))                          # |.| <= 1: rounds by <= 2^-54
        k = b.call(rint, [acc_s])
        acc_s, acc_j = b.fsub(acc_s, k), b.fadd(acc_j, k)
    r = b.fmul(acc_s, o64.c(o64.k['pio2'][0]))
    # a NaN or inf x gives a NaN r and an undefined quadrant; the result is NaN either way
    jq = b.fptosi(b.select(b.fcmp_ordered('ord', acc_j, acc_j), acc_j, o64.c(0.0)), o64.int)
    q = b.add(jq, o64.ci(quadrant_offset))
    return b.fptrunc(_sincos_poly(o64, r, q), o.fp)


def _sincos(o: _Ops, x, quadrant_offset):
    """sin(x + quadrant_offset * pi/2)."""
    b, k = o.b, o.k
    jf, j = o.round_shift(x, k['two_over_pi'])
    r = x
    for part in k['pio2']:
        r = o.fma(jf, o.c(-part), r)
    v = _sincos_poly(o, r, b.add(j, o.ci(quadrant_offset)))
    if quadrant_offset == 0:  # sin(-0) = -0, which the reduction's fma loses
        v = o.where('==', x, o.c(0.0), x, v)
    far = o.c(float('nan')) if o.bits == 64 else _sincos_wide_f32(o, x, quadrant_offset)
    return o.where('>', o.fabs(x), o.c(k['trig_max']), far, v)


def _sqrt(o: _Ops, x):
    return o.b.call(o.intrinsic('sqrt', 1), [x])


def _log1p(o: _Ops, x):
    """log(1 + x) as log(u) * (x / (u - 1)), u = 1 + x rounded: x / (u - 1) is 1 up to
    u's rounding error, which it undoes (Goldberg); written as that quotient, not
    log(u) * x / (u - 1), so that a large x does not overflow. x where u rounds to 1
    (exact: log1p(x) = x there), inf at inf (where the quotient is inf / inf)."""
    b = o.b
    one, inf = o.c(1.0), o.c(float('inf'))
    u = b.fadd(x, one)
    r = b.fmul(_log(o, u), b.fdiv(x, b.fsub(u, one)))
    r = o.where('==', u, one, x, r)
    return o.where('==', x, inf, inf, r)


def _expm1(o: _Ops, x):
    """exp(x) - 1 as (u - 1) * (x / log(u)), u = exp(x) (Kahan): u's error appears in
    both factors and cancels. x where u rounds to 1 (exact: expm1(x) = x there), -1
    where u - 1 rounds to -1 (large negative x, -inf), inf where u overflows; NaN
    stays NaN (every compare is false)."""
    b = o.b
    one, inf = o.c(1.0), o.c(float('inf'))
    u = _exp(o, x)
    um1 = b.fsub(u, one)
    r = b.fmul(um1, b.fdiv(x, _log(o, u)))
    r = o.where('==', um1, o.c(-1.0), o.c(-1.0), r)
    r = o.where('==', u, inf, inf, r)
    return o.where('==', u, one, x, r)


_EMITTERS = {
    'exp': _exp, 'log': _log, 'tanh': _tanh, 'erf': _erf,
    'sin': lambda o, x: _sincos(o, x, 0), 'cos': lambda o, x: _sincos(o, x, 1),
    'sqrt': _sqrt, 'log1p': _log1p, 'expm1': _expm1,
}


def declare_math(module: ir.Module, name: str, fp, scalef: bool | None = None) -> ir.Function:
    """The function ``tgc.<name>.f32|f64`` of ``module``: defined (internal,
    alwaysinline) on first request, returned as is afterwards. ``scalef``: scale by
    powers of two with ``llvm.ldexp`` (default: when the host has AVX-512)."""
    if name not in _EMITTERS:
        raise ValueError(f'unknown math function {name!r}; have {", ".join(NAMES)}')
    if not isinstance(fp, (ir.FloatType, ir.DoubleType)):
        raise TypeError(f'math functions take float or double, not {fp}')
    bits = 32 if isinstance(fp, ir.FloatType) else 64
    fname = f'tgc.{name}.f{bits}'
    existing = module.globals.get(fname)
    if existing is not None:
        return existing
    fn = ir.Function(module, ir.FunctionType(fp, [fp]), fname)
    fn.linkage = 'internal'
    fn.attributes.add('alwaysinline')
    fn.attributes.add('nounwind')
    builder = ir.IRBuilder(fn.append_basic_block('entry'))
    if scalef is None:
        from tgc.backends.cpu.llvm_env import has_feature
        scalef = has_feature('avx512f')
    builder.ret(_EMITTERS[name](_Ops(builder, fp, scalef), fn.args[0]))
    return fn
