"""Accuracy, special values and vectorization of tgc.backends.cpu.vecmath.

Each function is JIT-compiled inside a loop kernel ``void k(T* out, const T* in,
i64 n)`` and run over wide input ranges through ctypes. Errors are in ulps of the
result's precision, against a reference that is more precise than the result:
numpy float64 for f32, numpy longdouble (x87 80-bit libm) for f64, and a
positive-term series in longdouble for erf (numpy has no erf).
"""

import ctypes

import llvmlite.ir as ir
import numpy as np
import pytest

from tgc.backends.cpu import llvm_env, vecmath

FP = {np.float32: ir.FloatType(), np.float64: ir.DoubleType()}

# Asserted maximum errors (ulps): the maxima measured by denser runs (see the
# vecmath docstring) plus a small margin. sin/cos: f32 |x| < 1e5, f64 |x| < 1e6 here.
BOUNDS = {
    ('exp', np.float32): 1.25, ('exp', np.float64): 1.25,
    ('log', np.float32): 1.0, ('log', np.float64): 1.0,
    ('tanh', np.float32): 1.6, ('tanh', np.float64): 1.6,
    ('erf', np.float32): 1.5, ('erf', np.float64): 1.5,
    ('sin', np.float32): 1.75, ('sin', np.float64): 1.75,
    ('cos', np.float32): 1.75, ('cos', np.float64): 1.75,
    ('sqrt', np.float32): 0.501, ('sqrt', np.float64): 0.501,
    ('log1p', np.float32): 2.5, ('log1p', np.float64): 2.5,
    ('expm1', np.float32): 2.5, ('expm1', np.float64): 2.5,
}


def kernel_module(dtype, names=vecmath.NAMES, scalef=None):
    """An IR module with one loop kernel ``k_<name>`` per function."""
    module = ir.Module(name=f'vecmath_{np.dtype(dtype).name}')
    fp, i64, ptr = FP[dtype], ir.IntType(64), ir.PointerType()
    for name in names:
        fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [ptr, ptr, i64]), f'k_{name}')
        out, inp, n = fn.args
        out.add_attribute('noalias')
        inp.add_attribute('noalias')
        entry, loop, done = (fn.append_basic_block(s) for s in ('entry', 'loop', 'done'))
        b = ir.IRBuilder(entry)
        b.cbranch(b.icmp_signed('>', n, i64(0)), loop, done)
        b.position_at_end(loop)
        i = b.phi(i64)
        x = b.load(b.gep(inp, [i], source_etype=fp), typ=fp)
        y = b.call(vecmath.declare_math(module, name, fp, scalef), [x])
        b.store(y, b.gep(out, [i], source_etype=fp))
        i_next = b.add(i, i64(1))
        i.add_incoming(i64(0), entry)
        i.add_incoming(i_next, loop)
        b.cbranch(b.icmp_signed('<', i_next, n), loop, done)
        b.position_at_end(done)
        b.ret_void()
    return module


_SIG = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class Kernels:
    def __init__(self, dtype, opt=3, scalef=None):
        self.dtype = dtype
        self.jit = llvm_env.jit(str(kernel_module(dtype, scalef=scalef)), opt)
        self.fns = {n: _SIG(self.jit.address(f'k_{n}')) for n in vecmath.NAMES}

    def __call__(self, name, x):
        x = np.ascontiguousarray(x, dtype=self.dtype)
        out = np.empty_like(x)
        self.fns[name](out.ctypes.data, x.ctypes.data, x.size)
        return out


@pytest.fixture(scope='module', params=[(np.float32, None), (np.float64, None),
                                        (np.float32, False), (np.float64, False)],
                ids=['f32', 'f64', 'f32-no-scalef', 'f64-no-scalef'])
def kernels(request):
    """The host's functions, and those scaling by two multiplies instead of
    llvm.ldexp (what a host without AVX-512 gets)."""
    dtype, scalef = request.param
    return Kernels(dtype, scalef=scalef)


# ---------------------------------------------------------------- references

def _erf_series(x):
    """erf in longdouble: 2/sqrt(pi) exp(-x^2) sum_n x (2x^2)^n / (1*3*...*(2n+1)),
    all terms positive (no cancellation); |x| >= 7 gives +-1."""
    x = np.asarray(x, dtype=np.longdouble)
    ax = np.minimum(np.abs(x), np.longdouble(7))
    term, total, two_x2 = ax.copy(), ax.copy(), 2 * ax * ax
    for n in range(1, 200):
        term = term * two_x2 / (2 * n + 1)
        total = total + term
    two_over_sqrt_pi = np.longdouble('1.1283791670955125738961589031215451717')
    val = two_over_sqrt_pi * np.exp(-ax * ax) * total
    val = np.where(np.abs(x) >= 7, 1, val)
    return np.where(np.isnan(x), np.nan, np.copysign(val, x))


_NP = {'exp': np.exp, 'log': np.log, 'tanh': np.tanh, 'sin': np.sin, 'cos': np.cos,
       'sqrt': np.sqrt, 'erf': _erf_series, 'log1p': np.log1p, 'expm1': np.expm1}


def reference(name, x):
    wide = np.float64 if x.dtype == np.float32 else np.longdouble
    with np.errstate(all='ignore'):
        return _NP[name](x.astype(wide))


def ulp_errors(got, ref):
    """|got - ref| in ulps of got's precision at ref; 0 where both are the same
    special value, inf where only one is special or they differ in kind."""
    dtype = got.dtype
    with np.errstate(all='ignore'):
        ref_r = ref.astype(dtype)
        ulp = np.spacing(np.abs(ref_r)).astype(ref.dtype)
        err = np.abs(got.astype(ref.dtype) - ref) / ulp
    same_special = (np.isnan(got) & np.isnan(ref_r)) | (np.isinf(got) & (got == ref_r))
    err = np.where(same_special, 0.0, err)
    return np.where(np.isnan(err) | (np.isinf(ref_r) & ~same_special), np.inf, err)


# ---------------------------------------------------------------- inputs

def _random_bits(dtype, n, lo_exp, hi_exp, rng, signed=True):
    """Floats with exponents uniform in [lo_exp, hi_exp) and random mantissas."""
    m = rng.random(n) + 1.0
    x = np.ldexp(m, rng.integers(lo_exp, hi_exp, n)).astype(dtype)
    if signed:
        x = np.where(rng.random(n) < 0.5, -x, x)
    return x


def _all_positive(dtype, n, rng):
    """Uniform over the bit patterns of positive finite floats (subnormals included)."""
    itype = np.uint32 if dtype == np.float32 else np.uint64
    top = np.array(np.inf, dtype=dtype).view(itype)
    return rng.integers(0, int(top), n, dtype=itype).view(dtype)


def inputs(name, dtype, n=1_000_000, seed=0):
    rng = np.random.default_rng(seed)
    f = np.finfo(dtype)
    wide = {
        'exp': rng.uniform(-110 if dtype == np.float32 else -750,
                           90 if dtype == np.float32 else 712, n),
        'log': _all_positive(dtype, n, rng),
        'tanh': rng.uniform(-25, 25, n),
        'erf': rng.uniform(-7, 7, n),
        'sin': rng.uniform(-1e5, 1e5, n) if dtype == np.float32 else rng.uniform(-1e6, 1e6, n),
        'sqrt': _all_positive(dtype, n, rng),
        # (-1, 1] uniformly, then the positive floats: log1p's accurate region and its tail
        'log1p': np.concatenate([-rng.uniform(-1, 1, n // 2), _all_positive(dtype, n - n // 2, rng)]),
        'expm1': rng.uniform(-110 if dtype == np.float32 else -750,
                             90 if dtype == np.float32 else 712, n),
    }
    wide['cos'] = wide['sin']
    near0 = _random_bits(dtype, n // 4, f.minexp - f.nmant, 3, rng)
    around1 = rng.uniform(0.25, 4, n // 4)
    return np.concatenate([wide[name].astype(dtype), near0, around1.astype(dtype)])


SPECIALS = [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0]


def specials(dtype):
    f = np.finfo(dtype)
    return np.array(SPECIALS + [f.smallest_subnormal, -f.smallest_subnormal,
                                f.smallest_normal, f.max, -f.max, f.tiny / 3], dtype=dtype)


# ---------------------------------------------------------------- tests

@pytest.mark.slow
@pytest.mark.parametrize('name', vecmath.NAMES)
def test_accuracy(kernels, name):
    x = np.concatenate([inputs(name, kernels.dtype), specials(kernels.dtype)])
    if name in ('sin', 'cos'):  # beyond the reduction's range: f64 NaN, f32 its own test; both below
        x = x[~(np.abs(x) > vecmath.TRIG_MAX[np.finfo(kernels.dtype).bits])]
    err = ulp_errors(kernels(name, x), reference(name, x))
    worst = int(np.argmax(err))
    print(f'{name} {np.dtype(kernels.dtype).name}: max {err[worst]:.3f} ulp at x={x[worst]!r}')
    assert err[worst] <= BOUNDS[name, kernels.dtype], (x[worst], err[worst])


@pytest.mark.parametrize('name', vecmath.NAMES)
def test_special_values_match_numpy(kernels, name):
    x = specials(kernels.dtype)
    if name in ('sin', 'cos') and kernels.dtype == np.float64:  # f.max is beyond the f64 range: NaN
        x = x[~(np.abs(x) == np.finfo(kernels.dtype).max)]
    got, ref = kernels(name, x), reference(name, x).astype(kernels.dtype)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(got[~finite & ~np.isnan(ref)], ref[~finite & ~np.isnan(ref)])
    zero = ref == 0
    np.testing.assert_array_equal(np.signbit(got[zero]), np.signbit(ref[zero]))


@pytest.mark.parametrize('dtype', [np.float32, np.float64], ids=['f32', 'f64'])
def test_saturation_and_limits(dtype):
    k = Kernels(dtype)
    f = np.finfo(dtype)
    big = np.array([1e3, 1e30, f.max, np.inf], dtype=dtype)
    assert np.all(k('exp', big) == np.inf)
    assert np.all(k('exp', -big) == 0)
    assert np.all(k('tanh', big) == 1) and np.all(k('tanh', -big) == -1)
    assert np.all(k('erf', big) == 1) and np.all(k('erf', -big) == -1)
    assert np.all(k('log', -big) != k('log', -big))
    trig_max = vecmath.TRIG_MAX[np.finfo(dtype).bits]
    beyond = np.array([trig_max * 1.01, -trig_max * 1.01, f.max], dtype=dtype)
    if dtype == np.float64:   # f64 beyond 2^50 pi/2: NaN; f32 reduces every size (test below)
        assert np.all(np.isnan(k('sin', beyond))) and np.all(np.isnan(k('cos', beyond)))
    else:
        for name in ('sin', 'cos'):
            assert np.all(ulp_errors(k(name, beyond), reference(name, beyond)) <= 1.0)
    assert np.all(np.isnan(k('sin', np.array([np.inf, -np.inf, np.nan], dtype=dtype))))


@pytest.mark.parametrize('dtype, limit, bound', [(np.float32, 6.5e6, 2.5),
                                                (np.float64, 1.7e15, 1.75)], ids=['f32', 'f64'])
def test_sin_cos_far_range(dtype, limit, bound):
    """sin/cos stay accurate up to the documented reduction limits."""
    k = Kernels(dtype)
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.uniform(-limit, limit, 500_000),
                        np.exp(rng.uniform(0, np.log(limit), 500_000))]).astype(dtype)
    for name in ('sin', 'cos'):
        err = ulp_errors(k(name, x), reference(name, x))
        print(f'{name} {np.dtype(dtype).name} |x|<{limit:g}: max {err.max():.3f} ulp')
        assert err.max() <= bound


@pytest.mark.parametrize('exponent', [23, 40, 70, 100, 127])
def test_f32_sin_cos_beyond_the_reduction_range(exponent):
    """An f32 sin/cos of any finite size is the correctly reduced value (as numpy's f64
    sin of the same number, and PyTorch's): every 8th f32 of the binade [2^e, 2^(e+1)),
    and its negation, within 1 ulp."""
    k = Kernels(np.float32)
    bits = np.arange(0, 1 << 23, 8, dtype=np.uint32) | np.uint32((exponent + 127) << 23)
    x = bits.view(np.float32)
    x = np.concatenate([x, -x])
    for name in ('sin', 'cos'):
        err = ulp_errors(k(name, x), reference(name, x))
        print(f'{name} f32 in [2^{exponent}, 2^{exponent + 1}): max {err.max():.3f} ulp')
        assert err.max() <= 1.0


def test_opt0_same_results():
    """The O0 pipeline (always-inliner, no vectorization) computes the same values."""
    x = inputs('erf', np.float32, n=4096)
    fast, slow = Kernels(np.float32, 3), Kernels(np.float32, 0)
    for name in vecmath.NAMES:
        np.testing.assert_array_equal(fast(name, x), slow(name, x))


def test_declare_math_is_idempotent():
    module = ir.Module()
    a = vecmath.declare_math(module, 'exp', ir.FloatType())
    assert vecmath.declare_math(module, 'exp', ir.FloatType()) is a
    assert vecmath.declare_math(module, 'exp', ir.DoubleType()) is not a
    with pytest.raises(ValueError):
        vecmath.declare_math(module, 'gamma', ir.FloatType())


def test_no_libm_calls_and_vectorized_to_512_bits():
    if not llvm_env.has_feature('avx512f'):
        pytest.skip('host CPU has no AVX-512')
    for dtype in (np.float32, np.float64):
        asm = llvm_env.emit_asm(str(kernel_module(dtype)), 3)
        for name in vecmath.NAMES:
            body = asm.split(f'k_{name}:', 1)[1].split('.Lfunc_end', 1)[0]
            assert 'zmm' in body, name
            assert 'call' not in body, name

