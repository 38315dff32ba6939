"""emulate_low: bf16/f16 values (and f32 ones in an f64 program) as values of the
program's float type, each rounded.

f32 values in an f64 program (`input x: f32[n]` with `--dtype f64`, `f32(e)`) are
emulated exactly as bf16/f16 ones are, by the same code: `tgc.ir.dtypes.narrower(fp)`
names the types held rounded in `fp`, and `round32` is f32's rounding. An op on f32
operands has IR type f32 (f32 computes in itself); held in f64 it is the f64 result
rounded to f32, which the interpreter computes too (float64, rounded to the value's
type), so the two agree bit for bit on every correctly rounded operation (+ - * /
sqrt and conversions: f64 has more than twice f32's precision, so rounding the f64
result again gives the f32 one) and to the last f32 bit elsewhere.

A value of type bf16 or f16 means: its op computed in f32 (the compute type,
`tgc.ir.dtypes`) and rounded once to bf16/f16 (to nearest, ties to even). The
reference interpreter computes each op in float64 and rounds through f32 to the
value's type; this pass gives the backends a module without bf16/f16 values, where
every such value is computed in the program's float type `fp` and wrapped in
`round_bf16`/`round_f16` (round to the nearest bf16/f16 through f32, kept in `fp`).
Every op of the result therefore sees exactly the bf16/f16 operands the interpreter
sees, and rounds its f32 result exactly once to the value's type, as the interpreter
does: the two agree bit for bit wherever the f32 computation is exact-rounded (every
elementwise +, -, *, / and conversion; sums in another order, BLAS ones included,
and transcendental functions may differ in the last f32 bit before rounding, and so
rarely by one bf16/f16 ulp). The rounding sits on every value, so fusion, layout and
grouping, which only move values around, keep it: the rule "every IR value of type
bf16/f16 is rounded" survives any fusion.

Ops whose result a bf16/f16 already holds (an argument, a selection, a copy, a
comparison, max/min) are not rounded again; constants are rounded once here. A
conversion to bf16/f16 is a rounding; a conversion to the program's float type is
the value itself (a bf16/f16 value is held exactly in f32 and f64). Where values are
stored is lowering's business: `tgc.lower.narrow` gives 2-byte buffers to the bf16/f16
arguments and to the values computed elementwise and rounded (a backend that runs it,
the CPU's, then reads and writes bf16/f16 elements); every other buffer holds `fp`, and
the runtime (`tgc.runtime.program`) converts a bf16/f16 argument or output whose buffer
holds `fp` on the way in and out. Terminates: one visit per value, in topological order.

As a pass (`EmulateLow`, `emulate_low`), it is the first step of every lowering
(`tgc.registry.PREPARE`, run on the module before `fuse` whatever the stage list):
it changes no value the interpreter gives (the roundings it writes are the ones the
value types stand for), and a module without such values is returned as it is.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tgc.ir import values as V
from tgc.ir.dtypes import CONVERSIONS, LOW_FLOATS, narrower, promote, round_to, rounding
from tgc.ir.module import Module
from tgc.ir.passes import Pass
from tgc.ir.values import TensorType, Value
from tgc.options import Options

_EXACT_OPS = frozenset({"arg", "const", "indicator", "gather", "rename", "stop", "loopvar"})
_COPY_OPS = frozenset({"stop", "rename", "gather"})   # ops whose type is their first operand's
_ROUNDED_OPS = frozenset({"add", "contract", "map", "reduce", "scatter"})   # ops whose result the front end rounds


def has_low(module: Module, fp: str = "f32") -> bool:
    """Whether any value (in a loop's step too) or argument of the module is of a type
    narrower than `fp` (bf16, f16; f32 too when `fp` is f64), or converts to one."""
    held = narrower(fp)
    return any(a.dtype in held for a in module.args.values()) or V.reaches(
        module.roots(), lambda v: v.dtype in held or (v.op == "map" and CONVERSIONS.get(v.attrs[0]) in held))


_WEAK_IN = frozenset({"add", "contract", "map", "reduce", "scatter"})


def narrow_constants(module: Module) -> Module:
    """The f64 module with every number that an f32 operation reads made an f32 constant:
    in an f64 program, `x * 0.1` for an f32 `x` is f32 (a number is weak, section 11 of
    the language) and is computed, as in an f32 program and as PyTorch computes a float32
    tensor times a Python number, with 0.1 rounded to f32 (`V.const` of type f32; the
    interpreter and `emulate_low` round its value). Terminates: one visit per value."""
    memo: dict[int, Value] = {}
    changed = False
    for v in module.values():
        ops = tuple(memo[id(o)] for o in v.operands)
        if v.dtype == "f32" and v.op in _WEAK_IN:
            ops = tuple(V.const(o.attrs[0], "f32", o.edges, loc=o.loc) if o.op == "const" and o.dtype == "f64"
                        else o for o in ops)
        if ops != v.operands:
            changed = True
            memo[id(v)] = Value.make(v.op, ops, v.attrs, v.type, v.loc)
        else:
            memo[id(v)] = v
    return module.replace_values(memo) if changed else module


def _exact(v: Value) -> bool:
    if v.op in _EXACT_OPS:
        return True
    if v.op == "map":
        return v.attrs[0] in V.EXACT_FNS
    return v.op == "reduce" and v.attrs[0] in ("max", "min")


def _convert(x: Value, target: str, fp: str) -> Value:
    """`x` (already emulated, held in `fp`) converted to `target`: rounded to a type
    narrower than `fp`, else the value itself (to the program's float type; `to_f64`
    in an f32 program names it too)."""
    return V.map_(rounding(target), x) if target in narrower(fp) else x


def language_type(v: Value) -> str | None:
    """The bf16/f16 type the language gives `v` where its IR type is the compute type
    (an op on bf16/f16 operands), else None. Weak values (`Value.weak`: numbers, sizes and
    edgeless expressions of them) take no part (`x * 0.1` and `x / sqrt(size(e))` are bf16
    for a bf16 `x`), and neither do indicators (0/1: `x[t = s + k]` and `x * [s <= t]`
    select; an expression of indicators, `1 - [s <= t]`, is a tensor of the program's
    type, as a mask is in PyTorch), and a `where`'s condition takes no part
    (`where(c, x, -x)` is bf16 for bf16 `x`, any `c`)."""
    if v.op not in _ROUNDED_OPS or (v.op == "map" and v.attrs[0] in CONVERSIONS):
        return None
    operands = v.operands[1:] if v.op == "map" and v.attrs[0] == "where" else v.operands   # not the condition
    floats = [o for o in operands if o.dtype != "i32"]
    strong = [o.dtype for o in floats if not (o.weak or o.op == "indicator")] or [o.dtype for o in floats]
    lang = strong[0] if strong else v.dtype
    for d in strong[1:]:
        lang = promote(lang, d)
    return lang if lang in LOW_FLOATS and v.dtype != lang else None


def rounded(v: Value) -> Value:
    """`v` rounded to its language type, where that is bf16/f16 and its IR type is the
    compute type (what `explicit_rounding` makes of it); else `v`. A conversion in the
    source (`f32(x * x)`) converts this value, not the unrounded product."""
    lang = language_type(v)
    return V.map_(f"to_{lang}", v, loc=v.loc) if lang else v


def explicit_rounding(module: Module) -> Module:
    """The module with each bf16/f16 expression's rounding made explicit.

    An op on bf16/f16 operands computes in f32 (`tgc.ir.values`: its IR type is the
    compute type); in the language, its result has the operands' promoted type, so
    the front end follows each such op whose promoted type is bf16/f16 with
    `to_bf16`/`to_f16` (`rounded`). The optimizer then sees where values are rounded
    and adds no rounding: the values it creates (a reciprocal, a partial product, a
    derivative) are f32. A rounding the front end already made explicit (a
    conversion's operand) is not repeated: rounding twice to one type is rounding once.
    A loop's step is rounded the same way (its values are ops like any other; the front
    end rounds a step as it builds the loop, `explicitly_rounded`, and again here, which
    changes nothing). A copy of such an expression (`stop`, a rename, a gather: `_COPY_OPS`) has the
    rounded operand's type, as a copy of a bf16/f16 argument has (`stop(x * W)` is f16,
    and so is the prelude's softmax of `x * W`, which reads `x - stop(max[e](x))`)."""
    memo: dict[int, Value] = {}
    V.rebuild_through_loops(module.values(), _with_rounding, memo)   # every loop's step too
    return module.replace_values(memo)


def explicitly_rounded(y: Value) -> Value:
    """`y` (a loop step's result, built before the module is finished) with its
    bf16/f16 roundings explicit, as `explicit_rounding` makes them: a step returns a
    value of its carry's language type (`h + tanh(h)` of a bf16 carry is bf16)."""
    memo: dict[int, Value] = {}
    V.rebuild_through_loops(V.topo_order([y]), _with_rounding, memo)
    return memo[id(y)]


def _with_rounding(v: Value, ops: tuple[Value, ...]) -> Value:
    """`v` over its operands with explicit roundings `ops`, followed by its own. Applied
    again to its own result it changes nothing (hash-consing gives the same values)."""
    if v.op == "map" and v.attrs[0] in CONVERSIONS and ops[0].dtype == CONVERSIONS[v.attrs[0]]:
        return ops[0]   # to_T(y) of a y now rounded to T (or of type T): that value
    if ops == v.operands:
        new = v
    elif v.op in _COPY_OPS:   # a copy of its (now rounded) operand has its type
        new = Value.make(v.op, ops, v.attrs, TensorType.of(ops[0].dtype, v.edges), v.loc)
    else:
        new = Value.make(v.op, ops, v.attrs, v.type, v.loc)
    lang = language_type(new)
    return V.map_(f"to_{lang}", new, loc=v.loc) if lang else new


def emulate_low(module: Module, fp: str) -> Module:
    """The module whose values of a type narrower than `fp` (bf16/f16; f32 in an f64
    program) are held in `fp` (f32 or f64), each rounded. Values of type `fp` are left as
    they are, and so is an f64 value in an f32 program (lowering holds it in `fp`: f64 has
    the width of an f32 program there). The arguments keep their declared types: an op
    reading a bf16 argument has type `fp` (the IR's ops on bf16 operands have their
    compute type already), and a backend that stores bf16 arguments in 2-byte buffers
    widens each element as it loads it; an f32 argument of an f64 program is held in
    f64 (the runtime rounds the caller's values to f32 as it converts them). A loop's
    step parameters are held in `fp` too, and a loop operand of a narrower type (such
    an argument) is passed through its rounding, an exact widening."""
    held = narrower(fp)

    def emulated(v: Value, ops: tuple[Value, ...]) -> Value:
        if v.op == "map" and v.attrs[0] in CONVERSIONS:
            return _convert(ops[0], CONVERSIONS[v.attrs[0]], fp)
        if v.op == "loopvar" and v.dtype in held:
            # a loop step's parameter is held in fp as the values it takes (the loop's
            # operands: `operand` below), already of its type: no rounding, which would
            # make it no parameter (and the loop would keep its unemulated step)
            return Value.make(v.op, ops, v.attrs, TensorType.of(fp, v.edges), v.loc)
        if v.dtype not in held or v.op == "arg":
            # i32; the program's float type (an f64 value of an f32 program too: lowering
            # holds every float in fp); a bf16/f16 argument keeps its type: its buffer may
            # hold 2-byte elements (tgc.lower.narrow), and every op reading it is computed
            # in fp (its result type), as in the source
            return Value.make(v.op, ops, v.attrs, v.type, v.loc) if ops != v.operands else v
        attrs = v.attrs
        if v.op == "const":
            attrs = (float(round_to(v.attrs[0], v.dtype)),)
        elif v.op == "random" and fp == "f64":
            attrs = attrs[:2] + ("f32",)     # drawn in f32 (bf16/f16's compute type, or f32), then rounded
        new = Value.make(v.op, ops, attrs, TensorType.of(fp, v.edges), v.loc)
        # a selection's value is one of its operands' (exact), unless an operand is a weak
        # value of a wider type (`where(c, x, 0.1)` or `max(x, sqrt(2))` of an f32 x)
        exact = ((_exact(v) and not any(o.weak and o.dtype != v.dtype for o in v.operands))
                 or (v.op == "random" and v.dtype == "f32"))
        return new if exact else V.map_(rounding(v.dtype), new)

    def operand(o: Value) -> Value:
        """A loop's operand of a type held in fp (a bf16 argument) as its exact widening."""
        if o.dtype not in held:
            return o
        return Value.make("map", (o,), (rounding(o.dtype),), TensorType.of(fp, o.edges), o.loc)

    memo: dict[int, Value] = {}
    V.rebuild_through_loops(module.values(), emulated, memo, operand=operand)   # every loop's step too
    out = module.replace_values(memo)
    # an output's declared type, where its value is now held in fp (`tgc.lower.narrow`
    # may then store a bf16/f16 one in 2 bytes; an f32 output holding bf16 values stays f32)
    out.outputs = [replace(o, low=old.value.dtype) if old.value.dtype in held else o
                   for o, old in zip(out.outputs, module.outputs)]
    return out


@dataclass(frozen=True)
class EmulateLow(Pass[Module, Module]):
    """bf16/f16 values (and f32 ones of an f64 program) held in the float type, rounded."""

    name = "emulate_low"

    def run(self, module: Module, options: Options) -> Module:
        return emulate_low(module, options.dtype) if has_low(module, options.dtype) else module
