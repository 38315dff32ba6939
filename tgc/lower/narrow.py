"""narrow: bf16/f16 values stored as 2-byte elements.

`tgc.ir.lowp.emulate_low` holds every bf16/f16 value in the program's float type,
rounded (`round_bf16`/`round_f16`). Held in 4 (or 8) bytes, such a value costs the
memory traffic of an f32 one. This stage gives a buffer the element type bf16 or f16
(`Buffer.dtype`; 2 bytes an element) where every value written into it is one of that
type:

- an argument declared bf16/f16 (the caller's array is passed as it is);
- a temporary or an output written by one loop kernel without a reduction or a
  scatter (it stores each element once, whole), whose body is the rounding to that
  type (`round_bf16(...)`), a load from a buffer of that type (a copy), or such a
  value under a mask (0 is exact in either type); an output only when it is declared
  of that type (`Output.low`, which `emulate_low` sets: `f32(bf16(x))` holds bf16
  values but is an f32 output).

A buffer read back widens each element exactly (a bf16 or f16 value is exact in f32
and f64), and a store narrows a value that is already of the buffer's type, so no
value changes: the stage is exact. A reduction's or a scatter's output, and a GEMM's,
keeps the float type, since partial sums pass through it (`tgc.lower.verify` checks
that no such kernel writes a 2-byte buffer). Which buffers a GEMM may read as bf16 is
the backend's choice (the CPU's `gemm_operands` stage).

Backends that run it: the CPU (its stage list); a backend without it sees only
buffers of the program's float type, and the runtime converts bf16/f16 arguments and
outputs at the call. Terminates: one visit of each buffer and of each kernel, in
order (a copy's source is written before it).
"""
from __future__ import annotations

from dataclasses import dataclass

from tgc.ir.dtypes import LOW_FLOATS, ROUNDINGS
from tgc.ir.passes import Pass
from tgc.lower.lowered import Load, LoopKernel, Lowered, Map, Mask
from tgc.options import Options


@dataclass(frozen=True)
class Narrow(Pass[Lowered, Lowered]):
    """Store bf16/f16 arguments and rounded elementwise values in 2-byte buffers."""

    name = "narrow"
    takes = gives = "lowered"

    def run(self, low: Lowered, options: Options) -> Lowered:
        out = low.staged("narrow")
        narrow(out)
        return out


def value_type(low: Lowered, body) -> str | None:
    """bf16 or f16 when every value of `body` is of that type, else None."""
    if isinstance(body, Map) and body.fn in ROUNDINGS:
        return ROUNDINGS[body.fn]
    if isinstance(body, Load):
        t = low.buffers[body.buf].dtype
        return t if t in LOW_FLOATS else None
    if isinstance(body, Mask):
        return value_type(low, body.arg)
    return None


def narrow(low: Lowered) -> None:
    """Set, in place, the element type of each buffer that may hold 2-byte values."""
    m = low.module
    for name, b in low.buffers.items():
        if b.kind == "arg" and m.args[name].dtype in LOW_FLOATS:
            b.dtype = m.args[name].dtype
    writers: dict[str, int] = {}
    for k in low.kernels:
        for w in k.writes():
            writers[w] = writers.get(w, 0) + 1
    for k in low.kernels:
        if not isinstance(k, LoopKernel) or k.reduce or k.scatter or k.epilogue is not None:
            continue
        b = low.buffers[k.out]
        if b.kind == "arg" or writers[k.out] != 1 or b.dtype != low.dtype:
            continue
        t = value_type(low, k.body)
        if t is not None and (b.kind == "temp" or m.outputs[b.index].low == t):
            b.dtype = t
