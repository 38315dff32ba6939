"""gemm_operands: each GEMM reads operands of a type its code reads.

After `narrow` (tgc/lower/narrow.py), a GEMM may read a bf16 or f16 buffer. The CPU
backend has two kinds of real GEMM:

- the bf16 GEMM (`gemm.bf16_kernel`: AVX-512 BF16's `vdpbf16ps`, products of bf16
  pairs summed in f32), for a product of two bf16 operands in an f32 program, without
  taps or shifts, of at least `options.cpu.bf16_gemm_min_flops` flops (its packing,
  per call, costs more than it saves on small products), when `options.cpu.bf16_gemm`
  allows it: "auto" where the host CPU
  reports `avx512bf16` (`llvm.get_host_cpu_features()`), "on" always (code for
  another CPU, e.g. a library built for Sapphire Rapids), "off" never. numpy's
  OpenBLAS exports no bf16 GEMM (`sbgemm`), so there is no BLAS path for it;
- cblas sgemm/dgemm (and the small-tile loops) on float buffers, for every other one.

For the second kind, each bf16/f16 operand is made a float one: a temporary that only
such GEMMs read goes back to the float type (its writer then stores the rounded values
in f32, as without `narrow`); any other (an argument, or a temporary that loops or a
bf16 GEMM also read) is widened by a copy kernel into a new float temporary placed
before the first GEMM that reads it. Values do not change (widening is exact), so the
stage is exact; it terminates after one visit of each kernel. The widening itself is
neutral (`tgc.lower.narrow.widen_gemm_operands`, which CUDA's `cublas_operands` uses too).
"""
from __future__ import annotations

from dataclasses import dataclass

from tgc.ir.sizes import size_estimate
from tgc.ir.passes import Pass
from tgc.lower.lowered import GemmKernel, Lowered
from tgc.lower.narrow import widen_gemm_operands
from tgc.options import Options


@dataclass(frozen=True)
class GemmOperands(Pass[Lowered, Lowered]):
    """Widen bf16/f16 GEMM operands unless the GEMM reads bf16 itself (vdpbf16ps)."""

    name = "gemm_operands"
    takes = gives = "lowered"

    def run(self, low: Lowered, options: Options) -> Lowered:
        out = low.staged("gemm_operands")
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
            and low.dtype == "f32" and low.buffers[k.a.buf].dtype == "bf16"
            and low.buffers[k.b.buf].dtype == "bf16" and bf16_gemms(options)
            and flops(low, k, options.rep_size) >= options.cpu.bf16_gemm_min_flops)


def flops(low: Lowered, k: GemmKernel, rep: int) -> int:
    """2 x batch x m x n x k of the product, symbolic dims taken at `rep`."""
    env = {d: rep for d, s in low.module.dims.items() if s is None}
    total = 2
    for e in k.batch + k.m + k.n + k.k:
        total *= size_estimate(low.size(e), env)
    return total


def widen_operands(low: Lowered, options: Options) -> None:
    """In place: every bf16/f16 operand of a GEMM that is not a bf16 GEMM, made float
    (`tgc.lower.narrow.widen_gemm_operands`)."""
    widen_gemm_operands(low, {i for i, k in enumerate(low.kernels) if is_bf16_gemm(low, k, options)}, "BLAS")
