"""Random draws in LLVM IR: `tgc.ir.philox`'s algorithm run by an LLVM arithmetic.

The algorithm is the IR's own (`tgc.ir.philox.draw`); this module only says how each
of its operations is an LLVM instruction: words are i64 values (a u32 in the low half;
a 32x32 -> 64-bit product is one `mul`), floats are doubles. Every instruction is an
exactly specified one (integer ops, `fadd fsub fmul fdiv` without fast-math flags,
`llvm.sqrt`, `uitofp` of integers below 2**53, bit casts), so the bits are those of
the numpy interpreters, whatever LLVM vectorizes or the thread count.
"""
from __future__ import annotations

import llvmlite.ir as ir

from tgc.ir import philox

I64 = ir.IntType(64)
F64 = ir.DoubleType()


class LLVMArith:
    def __init__(self, b: ir.IRBuilder):
        self.b = b

    def const(self, c: int):
        return ir.Constant(I64, c)

    def add(self, a, b):
        return self.b.add(a, b)

    def mul(self, a, b):
        return self.b.mul(a, b)

    def and_(self, a, b):
        return self.b.and_(a, b)

    def or_(self, a, b):
        return self.b.or_(a, b)

    def xor(self, a, b):
        return self.b.xor(a, b)

    def shr(self, a, n: int):
        return self.b.lshr(a, ir.Constant(I64, n))

    def shl(self, a, n: int):
        return self.b.shl(a, ir.Constant(I64, n))

    def int_to_f64(self, a):
        return self.b.uitofp(a, F64)

    def fconst(self, c: float):
        return ir.Constant(F64, c)

    def fadd(self, a, b):
        return self.b.fadd(a, b)

    def fsub(self, a, b):
        return self.b.fsub(a, b)

    def fmul(self, a, b):
        return self.b.fmul(a, b)

    def fdiv(self, a, b):
        return self.b.fdiv(a, b)

    def fneg(self, a):
        return self.b.fneg(a)

    def sqrt(self, a):
        mod = self.b.module
        fn = mod.globals.get("llvm.sqrt.f64") or ir.Function(mod, ir.FunctionType(F64, [F64]), "llvm.sqrt.f64")
        return self.b.call(fn, [a])

    def flt(self, a, b):
        return self.b.fcmp_ordered("<", a, b)

    def fselect(self, c, a, b):
        return self.b.select(c, a, b)

    def frexp(self, u):
        """u = m 2^e, m in [1/2, 1), for a normal positive double: from its bits."""
        b = self.b
        bits = b.bitcast(u, I64)
        e = b.sub(b.and_(b.lshr(bits, ir.Constant(I64, 52)), ir.Constant(I64, 0x7FF)), ir.Constant(I64, 1022))
        m = b.or_(b.and_(bits, ir.Constant(I64, (1 << 52) - 1)), ir.Constant(I64, 1022 << 52))
        return b.bitcast(m, F64), b.sitofp(e, F64)

    def select4(self, q, options):
        b = self.b
        out = options[3]
        for i in (2, 1, 0):
            out = b.select(b.icmp_unsigned("==", q, ir.Constant(I64, i)), options[i], out)
        return out

    def to_float(self, x, dtype: str):
        return self.b.fptrunc(x, ir.FloatType()) if dtype == "f32" else x


def emit_draw(b: ir.IRBuilder, kind: str, folds: tuple, key, counter, fp):
    """The draw at i64 `counter` from the i64 (sign-extended i32) `key`, as a value of `fp`;
    `folds` are ints, or i64 values (an i32 input's, sign-extended: `fold(key, n)`)."""
    dtype = "f32" if isinstance(fp, ir.FloatType) else "f64"
    return philox.draw(LLVMArith(b), kind, dtype, key, folds, counter)
