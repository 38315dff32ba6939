"""Pausing Python's cyclic garbage collector while the compiler builds its graphs.

Parsing, elaborating, the IR pipeline, lowering and code generation each build large
acyclic structures (tokens, syntax trees, IR values, lowered kernels, LLVM text):
reference counting frees them, and every full collection would traverse all of them
and free nothing. On deep programs those traversals grow with the heap, so they made
compile time grow faster than the program (`benchmarks/deep_compile.py`: gpt2 written
out with 48 layers compiles in 16.4 s of CPU with the collector on, 9.1 s paused; its
peak resident memory 757 -> 820 MB; a third of `tgc check`'s time on 10^5 statements).
"""
from __future__ import annotations

import contextlib
import gc
import threading

_GC_LOCK = threading.Lock()
_gc_pauses = [0, False]   # [pauses in progress, whether the collector was on before the first]


@contextlib.contextmanager
def gc_paused():
    """No automatic garbage collection inside (the module docstring says why); cyclic
    garbage made meanwhile is collected after, by the collector's next run. Nested and
    concurrent pauses (threads) are counted: the collector is switched back on, if it
    was on, when the last one ends. Also a decorator (`@gc_paused()`)."""
    with _GC_LOCK:
        if _gc_pauses[0] == 0:
            _gc_pauses[1] = gc.isenabled()
            gc.disable()
        _gc_pauses[0] += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _gc_pauses[0] -= 1
            if _gc_pauses[0] == 0 and _gc_pauses[1]:
                gc.enable()
