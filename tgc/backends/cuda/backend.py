"""The CUDA backends as the registry sees them (`tgc.backends.base.Backend`):
"cuda" (a GPU through CuPy) and "cuda-sim" (the same module run on this CPU by an
emulator). No stage of their own: they compile the neutrally lowered program. Their
compiled modules are cached where they load (CuPy's cache, the emulator's shared
objects by content), so `tgc.compile`'s first-level cache does not keep them."""
from __future__ import annotations

from tgc.backends.base import Backend


def lowering_options(options):
    """The options the CUDA backends lower with: a complex product stays elementwise
    loops (there is no complex GEMM cell on the GPU)."""
    return options.with_(complex_gemm=False)


class CudaBackend(Backend):
    name = "cuda"
    emits = ("cubin", "ptx", "cu")

    def companions(self, output: str, emit: str) -> dict[str, str]:
        from pathlib import Path

        if output == "-":
            raise ValueError("-o: --target cuda writes a manifest beside the output: give a file name")
        return {"the manifest": str(Path(output).with_suffix(".json"))}

    def build(self, module, options, emit, output, source):
        from tgc.backends.cuda import aot

        data, manifest = aot.build(module, options, emit)
        return {output: data, self.companions(output, emit)["the manifest"]: manifest}

    def lowering_options(self, options):
        return lowering_options(options)

    def compile(self, module, low, options, artifacts=None):
        from tgc.backends.cuda.runtime import compile_kernels

        return compile_kernels(low, options, self.name)


class CudaSimBackend(CudaBackend):
    name = "cuda-sim"
    emits = ()   # the emulator runs programs; `--target cuda` builds the same module
