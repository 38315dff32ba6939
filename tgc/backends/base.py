"""What every backend shares: the names `tgc.compile(..., backend=)` and `tgc run
--backend` accept, and the error a backend raises when it cannot run here.

The backends: "cpu" (LLVM, `tgc.backends.cpu`), "cuda" (CuPy on an NVIDIA GPU) and
"cuda-sim" (the same CUDA module run on this CPU by an emulator), both in
`tgc.backends.cuda`. This module imports nothing heavy: the command line's error
boundary uses it.
"""
from __future__ import annotations

BACKENDS = ("cpu", "cuda", "cuda-sim")


class BackendUnavailable(RuntimeError):
    """The backend cannot run on this machine (no CuPy, no GPU, no C++ compiler);
    the message says why. The command line exits with status 3 for it."""
