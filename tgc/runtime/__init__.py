"""The neutral runtime: a compiled program as Python calls it (`program.Program`:
signature, dims from shapes, input checks, updates, forward-only calls, complex and
bf16/f16 arguments, for every backend; `specialize`: the programs it compiles for
the sizes it is called with again and again).

Stage: after `tgc.backends`, before `tgc.pipeline`; imports `tgc.lower`, `tgc.ir`,
the leaves and `tgc.info`, and no backend: `tgc.pipeline` picks one and hands its
`Kernels` in (and the forward-only program's builder)."""
from __future__ import annotations

from tgc.runtime.program import Program, TensorSpec

__all__ = ["Program", "TensorSpec"]
