"""The CUDA backends as the registry sees them (`tgc.backends.base.Backend`):
"cuda" (a GPU through CuPy) and "cuda-sim" (the same module run on this CPU by an
emulator). Their lowering stages are the neutral `narrow` (bf16/f16 values in 2-byte
buffers: `tgc.lower.narrow`), then their own `cublas_operands` (which GEMM cells run
as `cublasGemmStridedBatchedEx` on 2-byte operands, the others' widened:
`tgc.backends.cuda.operands`), `inline_elementwise` (an elementwise temporary computed
again in its readers: `tgc.backends.cuda.inline`), `flash` (attention's softmax-contraction
chain as one kernel: `tgc.backends.cuda.flash`), the neutral `accumulate` (`c + a @ b` as a
GEMM with beta = 1 where the sum is in place or a loop's carry: `tgc.lower.accumulate`) and `rowgroup` (`tgc.backends.cuda.rows`: a row's
reductions and consumers as one kernel), with its text form. Their
compiled modules are cached where they load (CuPy's cache, the emulator's shared
objects by content), so `tgc.compile`'s first-level cache does not keep them."""
from __future__ import annotations

from tgc.backends.base import Backend
from tgc.backends.cuda.flash import FLASH_FORM, FLASHBACK_FORM, MAX_EDGE, FlashChains
from tgc.backends.cuda.operands import CublasOperands
from tgc.backends.cuda.inline import InlineElementwise
from tgc.backends.cuda.rows import ROWGROUP_FORM, RowGroups
from tgc.lower.accumulate import Accumulate
from tgc.lower.narrow import Narrow


class CudaBackend(Backend):
    name = "cuda"
    stages = (Narrow, CublasOperands, InlineElementwise, FlashChains, Accumulate, RowGroups)
    kernel_forms = (ROWGROUP_FORM, FLASH_FORM, FLASHBACK_FORM)
    emits = ("cubin", "ptx", "cu")

    def pipeline_options(self, options):
        """`stream_fused_edge` set to the edges the `flash` stage takes (`flash.MAX_EDGE`) where it runs (`CudaOptions.flash`, not
        under --fp-strict, the default stage list): the IR pipeline then leaves a
        softmax-then-contract cluster whole for that stage to fuse (one kernel per
        pass, no `[t, s]` buffer) instead of streaming it over query blocks, at every
        length; a cluster it would not fuse still streams (`tgc.opt.stream`)."""
        stages = options.stages
        if options.cuda.flash and not options.fp_strict \
                and (stages is None or any(st.split("{")[0].strip() == "flash" for st in stages)):
            return options.with_(stream_fused_edge=MAX_EDGE)
        return options

    def companions(self, output: str, emit: str) -> dict[str, str]:
        from pathlib import Path

        if output == "-":
            raise ValueError("-o: --target cuda writes a manifest beside the output: give a file name")
        return {"the manifest": str(Path(output).with_suffix(".json"))}

    def build(self, module, low, options, emit, output, source):
        from tgc.backends.cuda import aot

        data, manifest = aot.build(low, options, emit)
        return {output: data, self.companions(output, emit)["the manifest"]: manifest}

    def unavailable(self):
        from tgc.backends.cuda.runtime import unavailable

        return unavailable(self.name)

    def compile(self, module, low, options, artifacts=None):
        from tgc.backends.cuda.runtime import compile_kernels

        return compile_kernels(low, options, self.name)


class CudaSimBackend(CudaBackend):
    name = "cuda-sim"
    emits = ()   # the emulator runs programs; `--target cuda` builds the same module
