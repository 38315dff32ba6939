"""The IR's elementwise leaf functions (`map` fns, `tgc.ir.ops.FNS`) as LLVM instructions.

`EMITTERS` is the CPU's template per function, keyed by the names of `tgc.ir.ops`.
Transcendentals (`Fn.vecmath`: exp log sqrt tanh erf sin cos log1p expm1) come from
`vecmath` (straight-line IR, inlined, so loops that call them vectorize); a function
with only a math library spelling (`Fn.libm`) is a call of libm (scalar: its loop
does not vectorize); the rest are single instructions or intrinsics. Comparisons give
1.0/0.0; `max`/`min` propagate NaN like numpy (`llvm.maximum`/`llvm.minimum`);
`where(c, a, b)` takes `a` where `c != 0` (NaN counts as true, as in numpy);
`mul0(a, b)` is `a * b` but exactly 0 where `a == 0`, `mul00(a, b)` where either is. `sigmoid` and `softplus` go
through `e = exp(-|x|)`, which never overflows: `sigmoid = 1/(1+e)` (x >= 0) or
`e/(1+e)`, `softplus = max(x, 0) + log1p(e)` with `log1p(e) = log(u) * e / (u - 1)`,
`u = 1 + e` (exact where `u` rounds to 1: then it is `e`). `pow(x, y)` with a small
integer or +-0.5 constant exponent is multiplications/sqrt; otherwise
`exp(y * log|x|)`, signed for negative x with an integer y, NaN for negative x with
a fractional y, and 1 for y == 0 (numpy's `power` on floats); an f32 pow takes
its exp and log in f64 (see `_exp_y_log_abs`). `round32(x)` rounds
an f64 to the nearest f32 and back; `round_bf16(x)`/`round_f16(x)` round x (through
f32) to the nearest bfloat16/half and back (bf16/f16 values, `tgc.ir.lowp`).
"""
from __future__ import annotations

import llvmlite.ir as ir

from tgc.backends.cpu.vecmath import declare_math
from tgc.ir.ops import FNS, VECMATH   # the functions tgc.backends.cpu.vecmath computes

CMP = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
FLAGS = ("contract",)


def intrinsic(b: ir.IRBuilder, name: str, fp, nargs: int) -> ir.Function:
    suffix = "f32" if isinstance(fp, ir.FloatType) else "f64"
    full = f"llvm.{name}.{suffix}"
    mod = b.module
    fn = mod.globals.get(full)
    if fn is None:
        fn = ir.Function(mod, ir.FunctionType(fp, [fp] * nargs), full)
    return fn


def emit_map(b: ir.IRBuilder, fn: str, args: list, fp, const_exponent: float | None = None):
    """The value of elementwise function `fn` (a name of tgc.ir.ops.FNS) on `args`;
    `const_exponent`: pow's exponent when it is a constant."""
    if fn in VECMATH:
        return b.call(declare_math(b.module, fn, fp), args)
    emit = EMITTERS.get(fn)
    if emit is None:
        raise ValueError(f"no code for elementwise function '{fn}'")
    return emit(b, args, fp, const_exponent)


def _cmp(fn: str):
    op = CMP[fn]

    def emit(b: ir.IRBuilder, args, fp, _):
        c = b.fcmp_unordered(op, *args) if fn == "ne" else b.fcmp_ordered(op, *args)
        return b.select(c, ir.Constant(fp, 1.0), ir.Constant(fp, 0.0))
    return emit


def _sign(b: ir.IRBuilder, args, fp, _):
    x, zero = args[0], ir.Constant(fp, 0.0)
    neg = b.select(b.fcmp_ordered("<", x, zero), ir.Constant(fp, -1.0), x)
    return b.select(b.fcmp_ordered(">", x, zero), ir.Constant(fp, 1.0), neg)


def _mul0(b: ir.IRBuilder, args, fp, _):
    a, c = args
    zero = ir.Constant(fp, 0.0)
    return b.select(b.fcmp_ordered("==", a, zero), zero, b.fmul(a, c, flags=FLAGS))


def _mul00(b: ir.IRBuilder, args, fp, _):
    a, c = args
    zero = ir.Constant(fp, 0.0)
    either = b.or_(b.fcmp_ordered("==", a, zero), b.fcmp_ordered("==", c, zero))
    return b.select(either, zero, b.fmul(a, c, flags=FLAGS))


def _round_f16(b: ir.IRBuilder, args, fp, _):
    """through f32 to the nearest f16 (vcvtps2ph with F16C) and back"""
    x = b.fptrunc(args[0], ir.FloatType()) if not isinstance(fp, ir.FloatType) else args[0]
    return b.fpext(b.fptrunc(x, ir.HalfType()), fp)


def _call_intrinsic(name: str, nargs: int):
    return lambda b, args, fp, _: b.call(intrinsic(b, name, fp, nargs), args)


def libm_function(b: ir.IRBuilder, name: str, fp, nargs: int) -> ir.Function:
    """The C math library's function `name` (its double spelling; float appends `f`),
    declared in the builder's module: resolved in the process by the JIT, and by
    `-lm` when `tgc.backends.cpu.aot` links a shared library."""
    full = name + ("f" if isinstance(fp, ir.FloatType) else "")
    fn = b.module.globals.get(full)
    if fn is None:
        fn = ir.Function(b.module, ir.FunctionType(fp, [fp] * nargs), full)
        fn.attributes.add("nounwind")
    return fn


def _call_libm(name: str, nargs: int):
    return lambda b, args, fp, _: b.call(libm_function(b, name, fp, nargs), args)


# The CPU's template per elementwise function of tgc.ir.ops.FNS that no stage removes
# before backends (the vector-math ones, `Fn.vecmath`, call tgc.backends.cpu.vecmath):
# (builder, args, float type, pow's constant exponent or None) -> value.
EMITTERS = {
    # the functions tgc.ir.ops names a math library spelling for, and neither vector math
    # nor an intrinsic: a call of libm (an entry below replaces it: pow)
    **{f.name: _call_libm(f.libm, f.arity) for f in FNS.values()
       if f.libm and not (f.vecmath or f.intrinsic or f.lowered_by)},
    # the functions tgc.ir.ops names an LLVM intrinsic for (abs: fabs, max: maximum, ...)
    **{f.name: _call_intrinsic(f.intrinsic, f.arity) for f in FNS.values() if f.intrinsic},
    "sign": _sign,
    "sigmoid": lambda b, args, fp, _: emit_sigmoid(b, args[0], fp),
    "softplus": lambda b, args, fp, _: emit_softplus(b, args[0], fp),
    "div": lambda b, args, fp, _: b.fdiv(*args, flags=FLAGS),
    "pow": lambda b, args, fp, k: emit_pow(b, args[0], args[1], fp, k),
    **{fn: _cmp(fn) for fn in CMP},
    "mul0": _mul0,
    "mul00": _mul00,
    "where": lambda b, args, fp, _: b.select(b.fcmp_unordered("!=", args[0], ir.Constant(fp, 0.0)), args[1], args[2]),
    # to the nearest f32 and back (--fp-strict's f32 emulation)
    "round32": lambda b, args, fp, _: b.fpext(b.fptrunc(args[0], ir.FloatType()), fp),
    "round_f16": _round_f16,
    "round_bf16": lambda b, args, fp, _: emit_round_bf16(b, args[0], fp),
}


def emit_round_bf16(b: ir.IRBuilder, x, fp):
    """x through f32 to the nearest bfloat16, ties to even, and back: the f32 bits plus
    0x7fff plus the lowest kept bit, cut to the top 16 (a carry rounds up into the
    exponent, up to inf); NaN stays NaN (made quiet). Integer ops, so it vectorizes
    on any x86 (ml_dtypes and PyTorch round the same way)."""
    i32 = ir.IntType(32)
    f = b.fptrunc(x, ir.FloatType()) if not isinstance(fp, ir.FloatType) else x
    bits = b.bitcast(f, i32)
    lsb = b.and_(b.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 1))
    up = b.add(b.add(bits, ir.Constant(i32, 0x7FFF)), lsb)
    nan = b.fcmp_unordered("uno", f, f)
    kept = b.select(nan, b.or_(bits, ir.Constant(i32, 0x00400000)), up)
    r = b.bitcast(b.and_(kept, ir.Constant(i32, -65536)), ir.FloatType())
    return r if isinstance(fp, ir.FloatType) else b.fpext(r, fp)


# ---------------------------------------------------------------- 2-byte storage (tgc.lower.narrow)

I16 = ir.IntType(16)


def storage_type(dtype: str, fp):
    """The LLVM type of one element of a buffer of type `dtype` in a program whose float
    type is `fp`: bf16 as its 16 bits (i16), f16 as `half`, floats as `fp`, ids as i32."""
    return {"bf16": I16, "f16": ir.HalfType(), "i32": ir.IntType(32)}.get(dtype, fp)


def widen(b: ir.IRBuilder, x, dtype: str, fp):
    """A loaded element of a `dtype` buffer as a value of `fp`, exactly: bf16's 16 bits
    are the top half of the f32 with the same value (zext, shl 16, bitcast); f16 is
    `fpext` (F16C's vcvtph2ps)."""
    if dtype == "bf16":
        i32 = ir.IntType(32)
        f = b.bitcast(b.shl(b.zext(x, i32), ir.Constant(i32, 16)), ir.FloatType())
        return f if isinstance(fp, ir.FloatType) else b.fpext(f, fp)
    if dtype == "f16":
        return b.fpext(x, fp)
    return x


def narrow_to(b: ir.IRBuilder, x, dtype: str, fp):
    """A value of `fp` as an element of a `dtype` buffer. `tgc.lower.narrow` lets only
    values already of that type (rounded by round_bf16/round_f16, or loaded from such a
    buffer) reach a 2-byte buffer, so this is exact: bf16 keeps the top 16 bits of the
    f32 (its low 16 are zero; a NaN keeps its quiet bit), f16 is `fptrunc`."""
    if dtype == "bf16":
        i32 = ir.IntType(32)
        f = x if isinstance(fp, ir.FloatType) else b.fptrunc(x, ir.FloatType())
        return b.trunc(b.lshr(b.bitcast(f, i32), ir.Constant(i32, 16)), I16)
    if dtype == "f16":
        return b.fptrunc(x, ir.HalfType())
    return x


def _ipow(b: ir.IRBuilder, x, n: int, fp):
    """x**n for a small integer n by repeated squaring."""
    result, base, k = None, x, abs(n)
    while k:
        if k & 1:
            result = base if result is None else b.fmul(result, base)
        k >>= 1
        if k:
            base = b.fmul(base, base)
    result = result if result is not None else ir.Constant(fp, 1.0)
    return b.fdiv(ir.Constant(fp, 1.0), result) if n < 0 else result


def emit_pow(b: ir.IRBuilder, x, y, fp, const: float | None):
    if const is not None and abs(const) <= 16 and const == int(const):   # inf, nan: the general path
        return _ipow(b, x, int(const), fp)
    if const in (0.5, -0.5):
        r = b.call(declare_math(b.module, "sqrt", fp), [x])
        return r if const > 0 else b.fdiv(ir.Constant(fp, 1.0), r)
    one, zero = ir.Constant(fp, 1.0), ir.Constant(fp, 0.0)
    r = _exp_y_log_abs(b, x, y, fp)
    fl = b.call(intrinsic(b, "floor", fp, 1), [y])
    integral = b.fcmp_ordered("==", fl, y)
    half = b.fmul(y, ir.Constant(fp, 0.5))
    odd = b.fcmp_ordered("!=", b.call(intrinsic(b, "floor", fp, 1), [half]), half)
    signed = b.select(b.and_(integral, odd), b.fneg(r), r)
    neg_base = b.select(integral, signed, ir.Constant(fp, float("nan")))
    r = b.select(b.fcmp_ordered("<", x, zero), neg_base, r)
    return b.select(b.fcmp_ordered("==", y, zero), one, r)


def _exp_y_log_abs(b: ir.IRBuilder, x, y, fp):
    """|x|^y as exp(y * log|x|), for f32 in f64: the rounding of y * log|x| is an
    absolute error that exp turns into a relative one |y log x| times f32's epsilon
    (2.5e-6 for 1e-10^2.5, where PyTorch's powf is correctly rounded); in f64 the
    result is f32's correct rounding but for rare ties."""
    wide = ir.DoubleType() if isinstance(fp, ir.FloatType) else fp
    if wide is not fp:
        x, y = b.fpext(x, wide), b.fpext(y, wide)
    ax = b.call(intrinsic(b, "fabs", wide, 1), [x])
    r = b.call(declare_math(b.module, "exp", wide), [b.fmul(y, b.call(declare_math(b.module, "log", wide), [ax]))])
    return b.fptrunc(r, fp) if wide is not fp else r


def _exp_neg_abs(b: ir.IRBuilder, x, fp):
    ax = b.call(intrinsic(b, "fabs", fp, 1), [x])
    return b.call(declare_math(b.module, "exp", fp), [b.fneg(ax)])


def emit_sigmoid(b: ir.IRBuilder, x, fp):
    one = ir.Constant(fp, 1.0)
    e = _exp_neg_abs(b, x, fp)
    d = b.fadd(one, e)
    return b.select(b.fcmp_ordered(">=", x, ir.Constant(fp, 0.0)), b.fdiv(one, d), b.fdiv(e, d))


def emit_softplus(b: ir.IRBuilder, x, fp):
    one, zero = ir.Constant(fp, 1.0), ir.Constant(fp, 0.0)
    e = _exp_neg_abs(b, x, fp)
    u = b.fadd(one, e)
    ratio = b.fdiv(b.fmul(b.call(declare_math(b.module, "log", fp), [u]), e), b.fsub(u, one))
    log1p = b.select(b.fcmp_ordered("==", u, one), e, ratio)
    pos = b.call(intrinsic(b, "maximum", fp, 2), [x, zero])
    return b.fadd(pos, log1p)
