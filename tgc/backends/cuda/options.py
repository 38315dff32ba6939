"""The CUDA backends' settings (cuda, cuda-sim; docs/cuda.md), nested in
`tgc.options.Options` as `options.cuda`. Plain data, no imports. docs/cuda.md
("Tuned numbers") gives what each tuned default trades and its measurement."""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class CudaOptions:
    """How the CUDA backends launch kernels; `with_(name=value)` copies."""

    row_min: int = 128   # a reduction over at least this many elements per output runs one block per output (else one thread)
    row_groups: bool = True   # the `rowgroup` stage: a row's reductions and their consumers as one kernel
    warp_rows: int = 256      # a row group whose rows have at most this many elements runs a warp per row (else a block)
    graphs: bool = True       # on a GPU, a call without id checks is captured once as a CUDA graph and replayed
    row_regs: int = 8         # a row group keeps up to this many of a row's elements per thread in registers
    column_tiles: bool = True  # a column sum of at least row_min rows runs as column tiles (else one block per output)
    inline_elementwise: bool = True   # the `inline_elementwise` stage: an elementwise temporary computed where read
    arch: str = "sm_90"  # the GPU architecture `tgc build --target cuda` compiles for (nvcc -arch)
    grid_per_sm: int = 16     # on a GPU, a launch takes at most this many blocks per multiprocessor (grid-stride loops do the rest)
    bindings_kept: int = 4    # bindings of the dims kept per program (runtime._Binding: workspace, steps, graphs), most recently used first
    graphs_kept: int = 4      # CUDA graphs kept per binding (by the addresses of the arguments and outputs); a binding with more misses than hits after twice this many captures stops capturing
    outputs_kept: int = 4     # output sets kept per binding, to be written again once the caller drops them

    def with_(self, **changes) -> "CudaOptions":
        """A copy with the given fields changed."""
        return replace(self, **changes)
