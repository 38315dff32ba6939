"""The CPU backend as the registry sees it (`tgc.backends.base.Backend`): its own
lowering stages, `narrow` (bf16/f16 values in 2-byte buffers: `tgc.lower.narrow`),
`gemm_operands` (bf16 GEMMs, or operands widened for BLAS) and `group` (cache
blocking: `tgc.backends.cpu.group`) and its text form, LLVM code
JIT-loaded in this process (`kernels.compile_kernels`), and cache keys that name
the host CPU and its features."""
from __future__ import annotations

from tgc.backends.base import Backend
from tgc.backends.cpu.gemm_operands import GemmOperands
from tgc.backends.cpu.group import Group, read_group
from tgc.lower.narrow import Narrow


class CpuBackend(Backend):
    name = "cpu"
    stages = (Narrow, GemmOperands, Group)
    kernel_forms = {"group": read_group}
    source_cache = True

    def cache_parts(self) -> tuple[str, ...]:
        from tgc.backends.cpu.kernels import cache_parts

        return cache_parts()

    def compile(self, module, low, options, artifacts=None):
        from tgc.backends.cpu.kernels import compile_kernels

        return compile_kernels(module, low, options, artifacts)
