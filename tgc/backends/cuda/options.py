"""The CUDA backends' settings (cuda, cuda-sim; docs/cuda.md), nested in
`tgc.options.Options` as `options.cuda`. Plain data, no imports."""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class CudaOptions:
    """How the CUDA backends launch kernels; `with_(name=value)` copies."""

    row_min: int = 128   # a reduction over at least this many elements per output runs one block per output (else one thread)
    arch: str = "sm_90"  # the GPU architecture `tgc build --target cuda` compiles for (nvcc -arch)

    def with_(self, **changes) -> "CudaOptions":
        """A copy with the given fields changed."""
        return replace(self, **changes)
