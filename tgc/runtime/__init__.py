"""The neutral runtime: a compiled program as Python calls it (`program.Program`:
signature, dims from shapes, input checks, updates, forward-only calls, complex and
bf16/f16 arguments, for every backend), and the on-disk code cache (`cache`).
Imports no backend: `tgc.pipeline` picks one and hands its kernels in."""
from __future__ import annotations

from tgc.runtime.program import Program, TensorSpec

__all__ = ["Program", "TensorSpec"]
