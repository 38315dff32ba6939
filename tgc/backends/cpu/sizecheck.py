"""The checked C entry points: `tgc_run` and `tgc_workspace_bytes` as a C caller sees them.

A C caller passes the symbolic dims itself, so the library cannot rely on Python's
checks: a dim <= 0, a derived size, element count, byte count or workspace size
over 2^62 (`tgc.ir.sizes.MAX_SIZE`, so that no int64 index arithmetic in the kernels
can wrap), or a NULL pointer would otherwise run kernels with wrapped sizes or
dereference NULL. The generated bodies are internal (`tgc.run`, `tgc.workspace_bytes`);
the exported functions made here check first:

    tgc_workspace_bytes(dims): -1 (TGC_ERR_SIZE) if dims is NULL or the sizes fail
        the checks, else the inner function's bytes;
    tgc_run(dims, args, outs, workspace): TGC_ERR_NULL (-4) if dims (with symbolic
        dims), args, outs, any argument or output pointer, or the workspace (when
        one is needed) is NULL; TGC_ERR_SIZE (-3) if the sizes fail the checks;
        else the inner run. Nothing is read or written before these checks pass.

Every size expression is evaluated with LLVM's overflow-checked arithmetic, each
intermediate value kept within +-2^62, divisions checked for exactness. So is the
largest magnitude of every index expression that depends on a symbolic size
(`tgc.ir.module.index_exprs`: `x[t = 1099511627776*s + 3]` at n = 2^23 + 2 passes
2^63, where int64 indexing wrapped into range and read out of bounds): past 2^62 the
call is refused, as the Python runtime refuses it.
"""
from __future__ import annotations

import llvmlite.ir as ir

from tgc.backends.cpu.irutil import optimize_not
from tgc.lower.lowered import Lowered
from tgc.ir.module import index_exprs
from tgc.ir.sizes import MAX_SIZE, Size, SizeOp

ERR_SIZE, ERR_NULL = -3, -4
INNER_RUN, INNER_WORKSPACE = "tgc.run", "tgc.workspace_bytes"
ALIGN = 64
I1, I32, I64 = ir.IntType(1), ir.IntType(32), ir.IntType(64)
PTR = ir.PointerType()


def entry_points(mod: ir.Module, low: Lowered) -> None:
    """Define the exported, checked `tgc_run` and `tgc_workspace_bytes` in `mod`,
    which must hold the inner functions."""
    ok_fn = _sizes_ok(mod, low)
    inner_ws, inner_run = mod.get_global(INNER_WORKSPACE), mod.get_global(INNER_RUN)
    symbolic = bool(low.module.symbolic_dims())

    ws = ir.Function(mod, ir.FunctionType(I64, [PTR]), "tgc_workspace_bytes")
    ws.attributes.add("nounwind")
    b = ir.IRBuilder(ws.append_basic_block("entry"))
    bad = _null(b, ws.args[0]) if symbolic else I1(0)
    with b.if_then(bad, likely=False):
        b.ret(I64(-1))
    with b.if_then(b.icmp_signed("==", b.call(ok_fn, [ws.args[0]]), I32(0)), likely=False):
        b.ret(I64(-1))
    b.ret(b.call(inner_ws, [ws.args[0]]))

    run = ir.Function(mod, ir.FunctionType(I32, [PTR] * 4), "tgc_run")
    run.attributes.add("nounwind")
    dims, args, outs, work = run.args
    b = ir.IRBuilder(run.append_basic_block("entry"))
    bad = _null(b, dims) if symbolic else I1(0)
    n_args = sum(1 for buf in low.buffers.values() if buf.kind == "arg")
    n_outs = sum(1 for buf in low.buffers.values() if buf.kind == "out")
    for table, n in ((args, n_args), (outs, n_outs)):
        if n:
            bad = b.or_(bad, _null(b, table))
    with b.if_then(bad, likely=False):
        b.ret(I32(ERR_NULL))
    for table, n in ((args, n_args), (outs, n_outs)):
        for i in range(n):
            p = b.load(b.gep(table, [I64(i)], source_etype=PTR), typ=PTR)
            bad = b.or_(bad, _null(b, p))
    with b.if_then(bad, likely=False):
        b.ret(I32(ERR_NULL))
    with b.if_then(b.icmp_signed("==", b.call(ok_fn, [dims]), I32(0)), likely=False):
        b.ret(I32(ERR_SIZE))
    need = b.call(inner_ws, [dims])
    with b.if_then(b.and_(b.icmp_signed(">", need, I64(0)), _null(b, work)), likely=False):
        b.ret(I32(ERR_NULL))
    b.ret(b.call(inner_run, [dims, args, outs, work]))


def _null(b: ir.IRBuilder, p) -> ir.Value:
    return b.icmp_unsigned("==", b.ptrtoint(p, I64), I64(0))


def _sizes_ok(mod: ir.Module, low: Lowered) -> ir.Function:
    """i32 tgc.sizes_ok(dims): 1 if every dim is positive and every size fits (see
    the module docstring), else 0. Straight-line code: no size is trusted. A check
    whose operands are all fixed sizes is decided here, in exact integer arithmetic
    (the same outcome as the generated check: a fixed-size program's function is
    `ret 1`), and a buffer whose element type and sizes an earlier one had is not
    checked again (an unrolled GPT of 24 blocks: 53,000 lines of checks, as large as
    the rest of its entry function, for sizes that were all known)."""
    fn = ir.Function(mod, ir.FunctionType(I32, [PTR]), "tgc.sizes_ok")
    fn.linkage = "internal"
    fn.attributes.add("nounwind")
    optimize_not(fn)   # once per call, thousands of checks for a GPT: optimized, it took 1.7 s to compile
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    m = low.module
    symbolic = m.symbolic_dims()
    values: dict = {}
    bad: list = [False]   # True (a fixed size fails), or the i1 of the checks so far

    def flag(cond) -> None:
        if isinstance(cond, bool):
            bad[0] = bad[0] or cond
        elif bad[0] is not True:
            bad[0] = cond if bad[0] is False else b.or_(bad[0], cond)

    def within(v):
        if isinstance(v, int):
            flag(not -MAX_SIZE <= v <= MAX_SIZE)
            return v
        flag(b.icmp_signed(">", v, I64(MAX_SIZE)))
        flag(b.icmp_signed("<", v, I64(-MAX_SIZE)))
        return v

    def magnitude(v):
        if isinstance(v, int):
            return abs(v)
        return b.select(b.icmp_signed("<", v, I64(0)), b.sub(I64(0), v), v)   # |v| <= 2^62: no overflow

    def fixed(op: str, x: int, y: int) -> int:
        """`arith` of two fixed values, as the generated code computes it."""
        if op == "min":
            return min(x, y)
        if op == "/":
            flag(y == 0 or x % y != 0)   # (the value after a failed check does not matter)
            return within(x if y == 0 else -x if y == -1 else x // y)
        v = {"+": x + y, "-": x - y, "*": x * y}[op]
        flag(not -2 ** 63 <= v < 2 ** 63)   # LLVM's overflow bit (then the value is wrong, but flagged)
        return within(v)

    def arith(op: str, x, y):
        if isinstance(x, int) and isinstance(y, int):
            return fixed(op, x, y)
        x, y = (I64(v) if isinstance(v, int) else v for v in (x, y))
        if op == "min":
            return b.select(b.icmp_signed("<", x, y), x, y)
        if op == "/":
            zero, minus_one = b.icmp_signed("==", y, I64(0)), b.icmp_signed("==", y, I64(-1))
            flag(zero)
            safe = b.select(b.or_(zero, minus_one), I64(1), y)   # no division by 0, no INT64_MIN / -1
            flag(b.icmp_signed("!=", b.srem(x, safe), I64(0)))
            return within(b.select(minus_one, b.sub(I64(0), x), b.sdiv(x, safe)))
        pair = {"+": b.sadd_with_overflow, "-": b.ssub_with_overflow, "*": b.smul_with_overflow}[op](x, y)
        flag(b.extract_value(pair, 1))
        return within(b.extract_value(pair, 0))

    def size(s: Size):
        if isinstance(s, int):
            return s
        if s in values:
            return values[s]
        if isinstance(s, str):
            d = m.dims.get(s)
            if d is None:
                v = within(b.load(b.gep(fn.args[0], [I64(symbolic.index(s))], source_etype=I64), typ=I64))
            else:
                v = size(d)
        else:
            assert isinstance(s, SizeOp)
            v = arith(s.op, size(s.lhs), size(s.rhs))
        values[s] = v
        return v

    for d in m.dims:
        v = size(d)
        flag(v <= 0 if isinstance(v, int) else b.icmp_signed("<=", v, I64(0)))
    for e in low.edges:
        size(low.size(e))
    seen = set()
    for buf in low.buffers.values():
        key = (buf.dtype == "f64", tuple(low.sizes(buf.edges)))
        if key in seen:
            continue
        seen.add(key)
        n = 8 if buf.dtype == "f64" else 4
        for s in key[1]:
            n = arith("*", n, size(s))
    for aff in index_exprs(m):   # as the runtime's check: no index expression past 2^62
        bound = magnitude(size(aff.const))
        for edge, coef in aff.terms:
            bound = arith("+", bound, arith("*", magnitude(size(coef)), arith("-", size(m.size(edge)), 1)))
    total = 0
    for sizes in low.slots:
        best = 0
        for s in sizes:
            v = size(s)
            if isinstance(v, int) and isinstance(best, int):
                best = max(v, best)
            else:
                v, best = (I64(x) if isinstance(x, int) else x for x in (v, best))
                best = b.select(b.icmp_signed(">", v, best), v, best)
        total = arith("+", total, arith("+", best, ALIGN))
    if isinstance(bad[0], bool):
        b.ret(I32(0 if bad[0] else 1))
    else:
        b.ret(b.select(bad[0], I32(0), I32(1)))
    return fn
