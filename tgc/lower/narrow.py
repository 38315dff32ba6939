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
the backend's choice (the CPU's `gemm_operands` stage, CUDA's `cublas_operands`);
both then make the other GEMMs' 2-byte operands float ones with `widen_gemm_operands`
below (exact: widening changes no value).

Backends that run it: the CPU and the CUDA backends (their stage lists); a backend
without it sees only buffers of the program's float type, and the runtime converts
bf16/f16 arguments and outputs at the call. Terminates: one visit of each buffer and
of each kernel, in order (a copy's source is written before it).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tgc.ir.dtypes import LOW_FLOATS, ROUNDINGS
from tgc.ir.passes import Pass
from tgc.lower.lowered import Buffer, GemmKernel, Ix, Load, LoopKernel, Lowered, Map, Mask, StepLoop, View
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
    widen_step_arguments(low)
    writers: dict[str, int] = {}
    for k in low.kernels:
        for w in k.writes():
            writers[w] = writers.get(w, 0) + 1
    bound = {b.buf for k in low.kernels if isinstance(k, StepLoop) for b in k.args + k.outs}   # a step's types
    for k in low.kernels:
        if not isinstance(k, LoopKernel) or k.reduce or k.scatter or k.epilogue is not None or k.out in bound:
            continue
        b = low.buffers[k.out]
        if b.kind == "arg" or writers[k.out] != 1 or b.dtype != low.dtype:
            continue
        t = value_type(low, k.body)
        if t is not None and (b.kind == "temp" or m.outputs[b.index].low == t):
            b.dtype = t


def widen_step_arguments(low: Lowered) -> None:
    """In place: a loop step's argument bound to a 2-byte argument buffer (a bf16/f16
    param stacked on the loop edge) is bound instead to a float temporary that a copy
    kernel (note "<type> widened for a loop's step") fills just before the loop: a step
    is lowered as a program of its own whose arguments are of the float type
    (`tgc.lower.steps`). Exact: widening changes no value."""
    kernels = []
    for k in low.kernels:
        if isinstance(k, StepLoop):
            binds = list(k.args)
            for j, bind in enumerate(binds):
                buf = low.buffers[bind.buf]
                if j < k.carries or buf.kind != "arg" or buf.dtype not in LOW_FLOATS:
                    continue
                wide = low.fresh("w")
                low.buffers[wide] = Buffer(wide, low.dtype, buf.edges, "temp", order=buf.order)
                index = tuple((e, Ix.var(e)) for e in buf.edges)
                sizes = {e: low.size(e) for e in buf.edges}
                kernels.append(LoopKernel(wide, index, tuple(buf.order or buf.edges), sizes, Load(bind.buf, index),
                                          note=f"{buf.dtype} widened for a loop's step"))
                binds[j] = replace(bind, buf=wide)
            k = replace(k, args=tuple(binds))
        kernels.append(k)
    low.kernels = kernels


def widen_gemm_operands(low: Lowered, keep: set[int], why: str) -> None:
    """In place: every bf16/f16 operand of a GEMM whose index is not in `keep` (the
    GEMMs that read 2-byte operands as they are) made a float one. A temporary that
    only such GEMMs read goes back to the float type (its writer then stores the
    rounded values as floats); any other (an argument, or a temporary that loops or a
    kept GEMM also read) is widened by a copy kernel (note "<type> widened for
    <why>") into a new float temporary placed before the first GEMM that reads it.
    Exact: values do not change. Terminates: one visit of each kernel."""
    narrow_reads: dict[str, list[int]] = {}   # narrow buffer -> the float GEMMs reading it
    readers: dict[str, set[int]] = {}
    for i, k in enumerate(low.kernels):
        for r in k.buffers_read():
            readers.setdefault(r, set()).add(i)
        if isinstance(k, GemmKernel) and i not in keep:
            for v in (k.a, k.b):
                if low.buffers[v.buf].dtype in LOW_FLOATS:
                    narrow_reads.setdefault(v.buf, []).append(i)
    copies: dict[int, list[LoopKernel]] = {}
    mapping: dict[str, str] = {}
    for name, gemms in narrow_reads.items():
        buf = low.buffers[name]
        if buf.kind == "temp" and readers[name] == set(gemms):
            buf.dtype = low.dtype   # its writer stores the (rounded) values as floats
            continue
        wide = low.fresh("w")
        low.buffers[wide] = Buffer(wide, low.dtype, buf.edges, "temp", order=buf.order)
        index = tuple((e, Ix.var(e)) for e in buf.edges)
        sizes = {e: low.size(e) for e in buf.edges}
        copies.setdefault(min(gemms), []).append(
            LoopKernel(wide, index, tuple(buf.order or buf.edges), sizes, Load(name, index), note=f"{buf.dtype} widened for {why}"))
        mapping[name] = wide
    kernels = []
    for i, k in enumerate(low.kernels):
        kernels += copies.get(i, [])
        if isinstance(k, GemmKernel) and i not in keep and (k.a.buf in mapping or k.b.buf in mapping):
            k = replace(k, a=View(mapping.get(k.a.buf, k.a.buf), k.a.edges),
                        b=View(mapping.get(k.b.buf, k.b.buf), k.b.edges))
        kernels.append(k)
    low.kernels = kernels
