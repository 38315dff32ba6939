"""The `interp` runner: `tgc.compile(..., backend="interp")` (and `tgc run --backend
interp`) runs the program on the reference IR interpreter (`tgc.ir.interp`), every op
computed in float64 and rounded once to its value's type, as `tgc run`'s interpreter
does.

It is a `Backend` without a folder of its own: `get_backend("interp")` finds it in
`RUNNERS` (`tgc.backends.base`), and `backend_names()`, which the backend tests
parametrize over, does not list it (those tests run the interpreter themselves, beside
every backend). Its lowering is the neutral one (fuse, layout, plan), which gives the
neutral runtime the program's signature and its gather checks; the kernels are not
run: `InterpKernels.run` evaluates the lowered program's IR module on the buffers the
runtime bound (complex values as float pairs, bf16/f16 ones in float arrays) and
writes the outputs and the updates' new values into them."""
from __future__ import annotations

import numpy as np

from tgc.backends.base import Backend, Kernels, failed_check


class InterpBackend(Backend):
    """The reference IR interpreter as a backend: no stages of its own, no files to build."""

    name = "interp"

    def compile(self, module, low, options, artifacts=None) -> "InterpKernels":
        return InterpKernels(low, "f32" if options.dtype == "f32" else None)


def _pairs(a: np.ndarray) -> np.ndarray:
    """A complex result as float pairs (the runtime's form); anything else as given."""
    return a.reshape(a.shape + (1,)).view(a.real.dtype) if a.dtype.kind == "c" else a


class InterpKernels(Kernels):
    """`low.module` evaluated by `tgc.ir.interp` on the runtime's buffers; `dtype` "f32"
    rounds every float value to f32 (an f32 program), None keeps the values' types."""

    backend = "interp"

    def __init__(self, low, dtype: str | None):
        self.lowered, self.dtype = low, dtype

    def run(self, args: dict, outs: dict, env: dict, notify=None) -> int:
        from tgc.ir.interp import evaluate

        low = self.lowered
        failed = failed_check(low, args, env)
        if failed:
            return failed
        m = low.module
        dims = {d: env[d] for d in m.dims if d in env}
        result = evaluate(m, args, dtype=self.dtype, dims=dims)
        for name, out in outs.items():
            np.copyto(out, _pairs(result[name]), casting="unsafe")
        for u in m.updates:
            np.copyto(args[u.target], _pairs(result[m.update_key(u.target)]), casting="unsafe")
        return 0
