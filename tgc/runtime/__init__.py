"""Running compiled programs: build, validate inputs, call (see `program.py`).

Stage: after `tgc.backends`, before `tgc.pipeline`; imports the backends, `tgc.lower`,
`tgc.ir`, the leaves and `tgc.info` (which needs only the IR). Still crossing
forward: `Program.without_updates()` compiles through `tgc.pipeline`."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from tgc.ir.module import Module
from tgc.options import Options
from tgc.runtime.program import Program, TensorSpec, build

__all__ = ["Program", "TensorSpec", "build", "run_compiled"]


def run_compiled(module: Module, inputs: Mapping[str, np.ndarray], options: Options) -> dict[str, np.ndarray]:
    """Compile `module` (after the IR pipeline) for the CPU and run it once on `inputs`.

    Symbolic dims come from the inputs' shapes, then from `options.dims`.
    """
    program = build(module, options)
    return program.run(dict(inputs), dict(options.dims) or None)
