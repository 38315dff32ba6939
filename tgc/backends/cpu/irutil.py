"""Small helpers for building LLVM IR with llvmlite: types, counted loops, sizes.

`Frame` is one function under construction: an `entry` block that stays open
(unterminated) while the body is emitted, so loop-invariant values — dim sizes,
strides, allocas — can be added there on demand and dominate every use; `finish`
branches from it to the body.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Sequence

import llvmlite.ir as ir

from tgc.ir.module import Module
from tgc.ir.sizes import Size

I1, I32, I64 = ir.IntType(1), ir.IntType(32), ir.IntType(64)
PTR = ir.PointerType()


def fp_type(dtype: str):
    return {"f32": ir.FloatType(), "f64": ir.DoubleType(), "i32": I32}[dtype]


def define(module: ir.Module, name: str, ret, params: Sequence, internal: bool = True) -> ir.Function:
    fn = ir.Function(module, ir.FunctionType(ret, list(params)), name)
    if internal:
        fn.linkage = "internal"
    fn.attributes.add("nounwind")
    return fn


def optimize_not(fn: ir.Function) -> None:
    """Leave `fn` out of LLVM's optimization: code that runs once per call or per
    thread and only loads and calls (`tgc_run_objects` took ~25 ms to optimize and
    ~4 ms so, and a call measured the same)."""
    fn.attributes.add("optnone")
    fn.attributes.add("noinline")


def export(fn: ir.Function, into: ir.Module) -> ir.Function:
    """Give `fn` hidden visibility (other objects of the program may call it; a
    shared object does not export it) and declare it in `into`."""
    fn.linkage = "hidden"
    decl = ir.Function(into, fn.function_type, fn.name)
    decl.linkage = "hidden"
    return decl


class Frame:
    """A function being emitted: open entry block + body builder + cached sizes."""

    def __init__(self, fn: ir.Function, module: Module, dims_ptr, edges=None):
        self.fn, self.m, self.dims_ptr = fn, module, dims_ptr
        self.edges = edges or {}    # sizes of edges the module lacks (`Lowered.edges`)
        self.entry = ir.IRBuilder(fn.append_basic_block("entry"))
        self.body_start = fn.append_basic_block("body")
        self.b = ir.IRBuilder(self.body_start)
        self._sizes: dict = {}
        self.symbolic = module.symbolic_dims()

    def finish(self) -> None:
        self.entry.branch(self.body_start)

    def size(self, s: Size):
        """The i64 value of a size expression (computed once, in the entry block)."""
        if isinstance(s, int):
            return I64(s)
        if s in self._sizes:
            return self._sizes[s]
        e = self.entry
        if isinstance(s, str):
            d = self.m.dims.get(s)
            if d is None:
                ptr = e.gep(self.dims_ptr, [I64(self.symbolic.index(s))], source_etype=I64)
                value = e.load(ptr, typ=I64, name=f"dim.{s}")
            else:
                value = self.size(d)
        else:
            lhs, rhs = self.size(s.lhs), self.size(s.rhs)
            if s.op == "min":
                value = e.select(e.icmp_signed("<", lhs, rhs), lhs, rhs)
            else:
                value = {"+": e.add, "-": e.sub, "*": e.mul, "/": e.sdiv}[s.op](lhs, rhs)
        self._sizes[s] = value
        return value

    def edge_size(self, edge: str):
        return self.size(self.edges[edge] if edge in self.edges else self.m.size(edge))

    def strides(self, order: Sequence[str]) -> dict[str, ir.Value]:
        """Element strides of a row-major buffer with axes `order`."""
        key = ("strides", tuple(order))
        if key not in self._sizes:
            out, s = {}, I64(1)
            for e in reversed(order):
                out[e] = s
                s = self.entry.mul(s, self.edge_size(e))
            self._sizes[key] = out
        return self._sizes[key]

    def count(self, edges: Sequence[str]):
        value = I64(1)
        for e in edges:
            value = self.entry.mul(value, self.edge_size(e))
        return value

    def alloca(self, typ, name: str = ""):
        return self.entry.alloca(typ, name=name)


def loop_hints(module: ir.Module, unroll: bool = True, fold_tail: bool = False):
    """`llvm.loop` metadata for a loop's latch branch (a self-referential node; one per
    module and combination), or None when there is nothing to ask: `unroll=False`,
    do not unroll it; `fold_tail`, vectorize it with masked lanes for the last
    iterations instead of a scalar remainder loop."""
    if unroll and not fold_tail:
        return None
    cache = module.__dict__.setdefault("_tgc_loop_hints", {})
    key = (unroll, fold_tail)
    if key not in cache:
        def hint(name, *value):
            return module.add_metadata([ir.MetaDataString(module, name), *value])
        hints = ([] if unroll else [hint("llvm.loop.unroll.disable")]) + \
            ([hint("llvm.loop.vectorize.predicate.enable", ir.IntType(1)(1))] if fold_tail else [])
        node = module.add_metadata(hints)
        node.operands = (node,) + tuple(node.operands)
        cache[key] = node
    return cache[key]


@contextmanager
def for_range(b: ir.IRBuilder, lo, hi, name: str = "i", unroll: bool = True, fold_tail: bool = False):
    """`for (i = lo; i < hi; ++i)`: yields i; the builder ends after the loop. With
    `unroll=False`, LLVM is asked not to unroll it; with `fold_tail`, to vectorize it
    with masked last iterations instead of a scalar remainder (see `loop_hints`)."""
    pre = b.block
    fn = pre.function
    head = fn.append_basic_block(f"{name}.head")
    body = fn.append_basic_block(f"{name}.body")
    done = fn.append_basic_block(f"{name}.done")
    b.branch(head)
    b.position_at_end(head)
    i = b.phi(I64, name=name)
    i.add_incoming(lo, pre)
    b.cbranch(b.icmp_signed("<", i, hi), body, done)
    b.position_at_end(body)
    yield i
    nxt = b.add(i, I64(1), flags=["nsw"])
    i.add_incoming(nxt, b.block)
    latch = b.branch(head)
    hints = loop_hints(b.module, unroll, fold_tail)
    if hints is not None:
        latch.set_metadata("llvm.loop", hints)
    b.position_at_end(done)


def offset(b: ir.IRBuilder, parts: Sequence[tuple]):
    """sum(index * stride) as i64 (`parts`: (index value, stride value))."""
    total = None
    for ix, stride in parts:
        term = ix if (isinstance(stride, ir.Constant) and stride.constant == 1) else b.mul(ix, stride, flags=["nsw"])
        total = term if total is None else b.add(total, term, flags=["nsw"])
    return total if total is not None else I64(0)


def gather_intrinsic(mod, fp, vl):
    """`llvm.masked.gather` of `vl` lanes of `fp` (declared in `mod` once)."""
    tag = "f32" if isinstance(fp, ir.FloatType) else "f64"
    vt = ir.VectorType(fp, vl)
    name = f"llvm.masked.gather.v{vl}{tag}.v{vl}p0"
    ty = ir.FunctionType(vt, [ir.VectorType(PTR, vl), I32, ir.VectorType(I1, vl), vt])
    return mod.globals.get(name) or ir.Function(mod, ty, name)


def splat(b, x, vt):
    """The vector of type `vt` with `x` in every lane."""
    undef = ir.Constant(vt, ir.Undefined)
    v = b.insert_element(undef, x, I32(0))
    return b.shuffle_vector(v, undef, ir.Constant(ir.VectorType(I32, vt.count), [0] * vt.count))


def masked_intrinsics(mod, fp, vl):
    """(masked load, masked store, fma) of `vl` lanes of `fp` (declared in `mod` once)."""
    tag = "f32" if isinstance(fp, ir.FloatType) else "f64"
    vt, mt = ir.VectorType(fp, vl), ir.VectorType(I1, vl)
    names = (f"llvm.masked.load.v{vl}{tag}.p0", f"llvm.masked.store.v{vl}{tag}.p0", f"llvm.fma.v{vl}{tag}")
    out = []
    for name, ty in zip(names, (ir.FunctionType(vt, [PTR, I32, mt, vt]),
                                ir.FunctionType(ir.VoidType(), [vt, PTR, I32, mt]),
                                ir.FunctionType(vt, [vt, vt, vt]))):
        out.append(mod.globals.get(name) or ir.Function(mod, ty, name))
    return out
