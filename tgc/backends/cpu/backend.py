"""The CPU backend as the registry sees it (`tgc.backends.base.Backend`): its own
lowering stages, `narrow` (bf16/f16 values in 2-byte buffers: `tgc.lower.narrow`),
`gemm_operands` (bf16 GEMMs, or operands widened for BLAS), `implicit` (GEMMs that
pack a gather copy's window from its source: `tgc.backends.cpu.implicit`), the neutral
`unsplit` (an elementwise reader of a product through a split of its edges computed over
the product's edges, then a copy: `tgc.lower.unsplit`), the neutral
`epilogue` (elementwise readers of a GEMM's product folded into it: `tgc.lower.epilogue`,
run on the GEMM's tiles by `tgc.backends.cpu.gemm_epilogue`), the neutral `alias` (copies
that only split or merge edges become views: `tgc.lower.alias`) and `group` (cache
blocking: `tgc.backends.cpu.group`) and its text form, LLVM code
JIT-loaded in this process (`kernels.compile_kernels`), cache keys that name
the host CPU and its features, and the files of `tgc build` (`aot`: a shared library
with its C header, an object file, LLVM IR, assembly, or the header alone)."""
from __future__ import annotations

from tgc.backends.base import Backend
from tgc.backends.cpu.gemm_operands import GemmOperands
from tgc.backends.cpu.group import GROUP_FORM, Group
from tgc.backends.cpu.implicit import IMPLICIT_FORM, Implicit
from tgc.lower.accumulate import Accumulate
from tgc.lower.alias import Aliases
from tgc.lower.epilogue import GemmEpilogue
from tgc.lower.narrow import Narrow
from tgc.lower.pieces import Pieces
from tgc.lower.unsplit import Unsplit


class CpuBackend(Backend):
    name = "cpu"
    stages = (Narrow, GemmOperands, Implicit, Accumulate, Unsplit, GemmEpilogue, Aliases, Pieces, Group)
    kernel_forms = (GROUP_FORM, IMPLICIT_FORM)
    source_cache = True
    specializes = True
    emits = ("so", "obj", "llvm", "asm", "h")

    def companions(self, output: str, emit: str) -> dict[str, str]:
        from pathlib import Path

        from tgc.backends.cpu.header import c_identifier

        if emit != "so":
            return {}
        return {"the header": str(Path(output).with_name(c_identifier(output) + ".h"))}   # libmlp.so -> mlp.h

    def build(self, module, low, options, emit, output, source):
        from tgc.backends.cpu import aot
        from tgc.backends.cpu.header import c_identifier

        prefix = c_identifier(output)
        try:
            files = {output: aot.build(module, low, options, emit, prefix, source)}
        except aot.NoSystemBlas as e:
            raise ValueError(f"--blas: {e}") from None
        for path in self.companions(output, emit).values():
            files[path] = aot.build(module, low, options, "h", prefix, source)
        return files

    def cache_parts(self) -> tuple[str, ...]:
        from tgc.backends.cpu.kernels import cache_parts

        return cache_parts()

    def compile(self, module, low, options, artifacts=None):
        from tgc.backends.cpu.kernels import compile_kernels

        return compile_kernels(module, low, options, artifacts)
