"""emulate_f32: an f32 program as an f64 one that rounds every value to f32 (--fp-strict).

`--fp-strict` promises, for an f32 program, the values of the reference interpreter on
the unoptimized program: each op computed in float64 and rounded once to f32
(`tgc.ir.interp`). A backend gets there by running this module instead: the same
values in f64, each wrapped in `round32` (f64 -> nearest f32 -> f64) where its op can
produce a value that f32 cannot hold; constants are rounded to f32 once. Every op of
the f64 program then sees exactly the f32 operands the interpreter sees, and computes
its result in f64 before rounding, as the interpreter does: its transcendental
functions, sums (BLAS ones included) and products agree with the interpreter's f64
ones far below f32's rounding, so the rounded results are the same bits except where
an exact result lies within an f64 ulp of a point halfway between two floats.

Arguments become f64 (the runtime converts the caller's f32 arrays and writes
updates back; outputs are rounded values, returned as f32). Terminates: one visit
per value.

As a pass (`EmulateF32`, `emulate_f32`), it is the target pass that --fp-strict runs
on an f32 program after the IR pipeline, for every backend and for `tgc build` alike
(`tgc.registry.target`): what it gives is the program a backend compiles, of float
type f64 (`Pass.float_type`), so the lowering and the code run in f64. It changes
values by design (each rounded to f32, as the interpreter rounds): --verify-each
compares the passes after it with its result (`rounds`). On an f64 program it
changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from tgc.ir import values as V
from tgc.ir.module import Module
from tgc.ir.passes import Pass
from tgc.ir.values import TensorType, Value
from tgc.options import Options

# ops whose value on f32 operands is always an f32 (a selection, a copy, a comparison)
_EXACT_OPS = frozenset({"arg", "const", "indicator", "gather", "rename", "stop", "random", "custom", "slot",
                        "loopvar"})
_EXACT_FNS = frozenset({"max", "min", "abs", "sign", "where", "lt", "le", "gt", "ge", "eq", "ne", "round32"})


def _exact(v: Value) -> bool:
    if v.op in _EXACT_OPS:
        return True
    if v.op == "map":
        return v.attrs[0] in _EXACT_FNS
    return v.op == "reduce" and v.attrs[0] in ("max", "min")


def emulate_f32(module: Module) -> Module:
    """The f64 module whose values are the f32 module's, each rounded to f32."""
    def emulated(v: Value, ops: tuple[Value, ...]) -> Value:
        attrs = (float(np.float32(v.attrs[0])),) if v.op == "const" else v.attrs
        if v.op == "random" and v.dtype == "f32":
            attrs = attrs[:2] + ("f32",)   # f32 draws, held exactly in f64
        dtype = "f64" if v.dtype == "f32" else v.dtype
        new = Value.make(v.op, ops, attrs, TensorType(dtype, v.edges), v.loc)
        return new if dtype != "f64" or _exact(v) else V.map_("round32", new)

    memo: dict[int, Value] = {}
    V.rebuild_through_loops(module.values(), emulated, memo)   # every loop's step too
    out = module.replace_values(memo)
    out.args = {n: replace(a, dtype="f64") if a.dtype == "f32" else a for n, a in module.args.items()}
    return out


@dataclass(frozen=True)
class EmulateF32(Pass[Module, Module]):
    """An f32 program as its f64 emulation: every value rounded to f32 (--fp-strict)."""

    name = "emulate_f32"
    rounds = True

    def run(self, module: Module, options: Options) -> Module:
        return emulate_f32(module) if options.dtype == "f32" else module

    def float_type(self, options: Options) -> str:
        return "f64" if options.dtype == "f32" else options.dtype
