"""cublas_operands: each GEMM cell of the CUDA backends reads operands of a type its
cuBLAS call takes.

After `narrow` (tgc/lower/narrow.py) a GEMM cell may read bf16 or f16 buffers. A cell
that is one cuBLAS call (`gemm.py`) runs as

- `cublasGemmStridedBatchedEx` with 2-byte inputs (`CUDA_R_16BF` or `CUDA_R_16F`), an
  f32 output (`CUDA_R_32F`) and f32 products and sums (`CUBLAS_COMPUTE_32F`: the
  tensor cores' bf16/f16 path) when both operands are bf16, or both f16, in an f32
  program (`is_ex_gemm`): autocast's products, or products of declared bf16/f16
  tensors. cuBLAS reads them as they are;
- `cublas<s|d|c|z>gemmStridedBatched` on float operands otherwise (one bf16 and one
  f32 operand, bf16 with f16, f64 programs, complex cells): each 2-byte operand is
  made a float one by `tgc.lower.narrow.widen_gemm_operands` (a temporary only such
  cells read goes back to the float type, any other is widened by a copy kernel).

A cell with taps or shifts (a convolution) becomes a generated loop kernel
(`codegen.gemm_as_loop`), whose loads widen 2-byte elements themselves: it keeps its
operands. Exact: widening changes no value, and the GemmEx products of bf16/f16
values are exact in f32 (8 + 8 and 11 + 11 significant bits), so only the f32
summation order differs from sgemm on the widened values. Terminates: one visit of
each kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

from tgc.ir.dtypes import LOW_FLOATS
from tgc.ir.passes import Pass
from tgc.lower.epilogue import expand
from tgc.lower.lowered import GemmKernel, Lowered
from tgc.lower.narrow import widen_gemm_operands
from tgc.options import Options


def is_ex_gemm(low: Lowered, k) -> bool:
    """Whether GEMM cell `k` runs as `cublasGemmStridedBatchedEx` on its 2-byte
    operands (two bf16 or two f16 buffers, an f32 output, a real product, one call)."""
    if not isinstance(k, GemmKernel) or k.cplx is not None or k.taps or k.shifts or low.dtype != "f32":
        return False
    ta, tb = low.buffers[k.a.buf].dtype, low.buffers[k.b.buf].dtype
    return ta == tb and ta in LOW_FLOATS and low.buffers[k.out].dtype == "f32"


def keeps_operands(low: Lowered, k) -> bool:
    """Whether GEMM cell `k` reads 2-byte operands as they are: a GemmEx call, or a
    cell with taps or shifts (a generated loop kernel, whose loads widen)."""
    return is_ex_gemm(low, k) or (isinstance(k, GemmKernel) and bool(k.taps or k.shifts))


@dataclass(frozen=True)
class CublasOperands(Pass[Lowered, Lowered]):
    """Widen the bf16/f16 operands of GEMM cells that are not GemmEx calls."""

    name = "cublas_operands"
    takes = gives = "lowered"

    def run(self, low: Lowered, options: Options) -> Lowered:
        out = expand(low).staged("cublas_operands")   # GEMM epilogues as loops after their GEMMs (tgc.lower.epilogue)
        keep = {i for i, k in enumerate(out.kernels) if keeps_operands(out, k)}
        widen_gemm_operands(out, keep, "cuBLAS")
        return out
