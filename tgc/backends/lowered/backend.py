"""The `lowered` backend (see this folder's `__init__`): `LoweredBackend.compile`
gives `LoweredKernels`, whose `run` hands the buffers the neutral runtime bound,
checked and allocated to the lowered-program interpreter (`tgc.lower.interp.run_bound`)
and writes what it computed into them.

What the runtime expects of `Kernels.run`, and how this one meets it:
- a failed `Check` (gather ids out of range): return 1 + its index, having written
  nothing; the checks run here before any kernel;
- outputs: written into `outs` (allocated by the runtime in each output's ABI order,
  of `Program.element_dtype`); the interpreter gives each in that order;
- updates: the new value written into the target's array in `args` (the runtime
  copies it back to the caller's array when it had to convert it);
- complex arguments and results arrive and leave as float pairs, bf16/f16 ones in
  float arrays, or 2-byte ones when the stages put them in 2-byte buffers (`narrow`);
  the interpreter widens what it reads and the copies round what it writes.

It has no fast path, no profile and no `notify` (the runtime calls a mark's
function after the whole run)."""
from __future__ import annotations

import numpy as np

from tgc.backends.base import Backend, Kernels, failed_check


class LoweredBackend(Backend):
    """The lowered-program interpreter as a backend: no stages of its own, no files to build."""

    name = "lowered"

    def compile(self, module, low, options, artifacts=None) -> "LoweredKernels":
        return LoweredKernels(low, self.name)


class LoweredKernels(Kernels):
    """`low` run by `tgc.lower.interp` on the runtime's buffers."""

    def __init__(self, low, backend: str):
        self.lowered, self.backend = low, backend

    def run(self, args: dict, outs: dict, env: dict, notify=None) -> int:
        from tgc.lower.interp import run_bound

        low = self.lowered
        failed = failed_check(low, args, env)
        if failed:
            return failed
        result = run_bound(low, args, env)
        for name, out in outs.items():
            np.copyto(out, result[name], casting="unsafe")
        m = low.module
        for u in m.updates:
            np.copyto(args[u.target], result[m.update_key(u.target)], casting="unsafe")
        return 0
