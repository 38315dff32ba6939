"""gemm_operands: each GEMM reads operands of a type its code reads.

After `narrow` (tgc/lower/narrow.py), a GEMM may read a bf16 or f16 buffer. The CPU
backend has two kinds of real GEMM:

- the bf16 GEMM (`gemm_bf16.bf16_kernel`: AVX-512 BF16's `vdpbf16ps`, products of bf16
  pairs summed in f32), for a product of two bf16 operands in an f32 program, without
  taps or shifts, of at least `options.cpu.bf16_gemm_min_flops` flops summed over at
  least `options.cpu.bf16_gemm_min_k` elements (its packing, per call, costs more than
  it saves on small or shallow products), when `options.cpu.bf16_gemm`
  allows it: "auto" where the host CPU
  reports `avx512bf16` (`llvm.get_host_cpu_features()`), "on" always (code for
  another CPU, e.g. a library built for Sapphire Rapids), "off" never. numpy's
  OpenBLAS exports no bf16 GEMM (`sbgemm`), so there is no BLAS path for it;
- cblas sgemm/dgemm (and the small-tile loops) on float buffers, for every other one.

A bf16 GEMM may also read an f32 buffer and round it as it packs it (`GemmKernel.rounded`,
`round_bf16(%W[...])` in the lowered text): where an operand is a temporary that one
loop fills with the rounding of a whole f32 buffer (autocast's `to_bf16` of a weight,
an input or a GEMM's result) and only bf16 GEMMs read it, they read the f32 buffer
instead and the loop and its 2-byte copy go (`read_rounded_sources`, with
`options.cpu.bf16_gemm_rounds`; off by default: measured slower, docs/dtypes.md). The
GEMMs multiply the same bf16 values.

For the second kind, each bf16/f16 operand is made a float one: a temporary that only
such GEMMs read goes back to the float type (its writer then stores the rounded values
in f32, as without `narrow`); any other (an argument, or a temporary that loops or a
bf16 GEMM also read) is widened by a copy kernel into a new float temporary placed
before the first GEMM that reads it. Values do not change (widening is exact), so the
stage is exact; it terminates after one visit of each kernel. The widening itself is
neutral (`tgc.lower.narrow.widen_gemm_operands`, which CUDA's `cublas_operands` uses too).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tgc.ir.sizes import size_estimate
from tgc.ir.passes import Pass
from tgc.lower.lowered import GemmKernel, Ix, Load, LoopKernel, Lowered, Map, View
from tgc.lower.narrow import widen_gemm_operands
from tgc.options import Options


@dataclass(frozen=True)
class GemmOperands(Pass[Lowered, Lowered]):
    """Widen bf16/f16 GEMM operands unless the GEMM reads bf16 itself (vdpbf16ps)."""

    name = "gemm_operands"
    takes = gives = "lowered"

    def run(self, low: Lowered, options: Options) -> Lowered:
        out = low.staged("gemm_operands")
        read_rounded_sources(out, options)
        widen_operands(out, options)
        return out


def bf16_gemms(options: Options) -> bool:
    """Whether bf16 products run as bf16 GEMMs (`options.cpu.bf16_gemm`)."""
    mode = options.cpu.bf16_gemm
    if mode == "auto":
        from tgc.backends.cpu.llvm_env import has_feature

        return has_feature("avx512bf16")
    return mode == "on"


def is_bf16_gemm(low: Lowered, k, options: Options) -> bool:
    """Whether GEMM `k` runs as a bf16 GEMM (see the module's docstring)."""
    return (isinstance(k, GemmKernel) and k.cplx is None and not k.taps and not k.shifts
            and low.dtype == "f32" and all(low.buffers[v.buf].dtype == "bf16" or r for v, r in zip((k.a, k.b), k.rounded))
            and bf16_gemms(options)
            and flops(low, k, options.rep_size) >= options.cpu.bf16_gemm_min_flops
            and depth(low, k, options.rep_size) >= options.cpu.bf16_gemm_min_k)


def flops(low: Lowered, k: GemmKernel, rep: int) -> int:
    """2 x batch x m x n x k of the product, symbolic dims taken at `rep`."""
    env = {d: rep for d, s in low.module.dims.items() if s is None}
    total = 2
    for e in k.batch + k.m + k.n + k.k:
        total *= size_estimate(low.size(e), env)
    return total


def rounding_source(low: Lowered, k) -> str | None:
    """S when loop kernel `k` is `T[e...] = round_bf16(S[e...])` over all of T (S an
    f32 buffer with T's edges, read at the same index: the rounding of a whole
    buffer), else None."""
    if (not isinstance(k, LoopKernel) or k.reduce or k.scatter or k.epilogue is not None or k.bounds
            or not isinstance(k.body, Map) or k.body.fn != "round_bf16" or not isinstance(k.body.args[0], Load)):
        return None
    src, t = k.body.args[0], low.buffers[k.out]
    same = tuple((e, Ix.var(e)) for e in sorted(t.edges))
    s = low.buffers[src.buf]
    if (s.dtype != "f32" or sorted(s.edges) != sorted(t.edges) or tuple(k.index) != same
            or tuple(src.index) != same or set(k.loops) != set(t.edges)):
        return None
    return src.buf


def read_rounded_sources(low: Lowered, options: Options) -> None:
    """In place: a bf16 GEMM operand that is a temporary holding the rounding of a
    whole f32 buffer S (`rounding_source`: autocast's `to_bf16` of a weight, an input
    or a GEMM's result), read only by bf16 GEMMs, is replaced by S itself, marked
    `rounded` (the bf16 kernel rounds each element as it packs it, with the bits of
    `round_bf16`), when S is written by no kernel between the rounding and the GEMM
    and S's order is a matrix for the GEMM; the rounding kernel and the temporary go.
    The GEMMs multiply the same bf16 values, so the stage stays exact; it saves the
    rounding loop's pass over S and the stores and loads of its 2-byte copy."""
    from tgc.backends.cpu.gemm_dispatch import operand_forms

    if not options.cpu.bf16_gemm_rounds:
        return
    kernels = list(low.kernels)
    bf16 = {i for i, k in enumerate(kernels) if is_bf16_gemm(low, k, options)}
    writers: dict[str, list[int]] = {}
    readers: dict[str, list[int]] = {}
    for i, k in enumerate(kernels):
        for w in k.writes():
            writers.setdefault(w, []).append(i)
        for r in k.buffers_read():
            readers.setdefault(r, []).append(i)
    dropped: set[int] = set()
    for name, buf in list(low.buffers.items()):
        if buf.kind != "temp" or buf.dtype != "bf16" or len(writers.get(name, ())) != 1:
            continue
        w = writers[name][0]
        src = rounding_source(low, kernels[w])
        users = readers.get(name, [])
        if src is None or not users or not set(users) <= bf16:
            continue
        if any(w < j < max(users) for j in writers.get(src, ())):
            continue   # S changes before a GEMM reads it
        new = {}
        for j in users:
            k = kernels[j]
            rounded = tuple(r or v.buf == name for v, r in zip((k.a, k.b), k.rounded))
            k = replace(k, a=View(src, k.a.edges) if k.a.buf == name else k.a,
                        b=View(src, k.b.edges) if k.b.buf == name else k.b, rounded=rounded)
            try:
                operand_forms(low, k)
            except ValueError:   # S's order is no matrix for this product
                break
            new[j] = k
        else:
            for j, k in new.items():
                kernels[j] = k
            dropped.add(w)
            del low.buffers[name]
    low.kernels = [k for i, k in enumerate(kernels) if i not in dropped]


def depth(low: Lowered, k: GemmKernel, rep: int) -> int:
    """The product's K: its summed edges' sizes multiplied, symbolic dims taken at `rep`."""
    env = {d: rep for d, s in low.module.dims.items() if s is None}
    total = 1
    for e in k.k:
        total *= size_estimate(low.size(e), env)
    return total


def widen_operands(low: Lowered, options: Options) -> None:
    """In place: every bf16/f16 operand of a GEMM that is not a bf16 GEMM, made float
    (`tgc.lower.narrow.widen_gemm_operands`)."""
    widen_gemm_operands(low, {i for i, k in enumerate(low.kernels) if is_bf16_gemm(low, k, options)}, "BLAS")
