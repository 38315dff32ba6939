"""Seeded random inputs of a module: what the tests, `--verify-each` and `tgc run
--random-inputs` run a program on.

Floats are standard normal (bf16/f16 inputs rounded to their type), ids uniform over
the edges they index; then the values are moved onto the program's simple declared
facts (`tgc.ir.assume.satisfy`), so that a program with `assume` runs on inputs that
satisfy it.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from tgc.ir.assume import satisfy
from tgc.ir.dtypes import narrower, round_to
from tgc.ir.input_checks import EvalError
from tgc.ir.interp import MAX_AXES
from tgc.ir.module import Arg, Module
from tgc.ir.values import Value, topo_order


def random_inputs(module: Module, env: Mapping[str, int], seed: int = 0,
                  dtype: str | None = None) -> dict[str, np.ndarray]:
    """Seeded random inputs of the right shapes: floats ~ N(0,1), ids uniform in range,
    then moved onto the program's simple declared facts (`tgc.ir.assume.satisfy`)."""
    rng = np.random.default_rng(seed)
    out = {}
    for a in module.args.values():
        shape = tuple(env[module.edges[e]] for e in a.order)
        if len(shape) > MAX_AXES:
            raise EvalError(f"input '{a.name}' has {len(shape)} edges: a numpy array has at most {MAX_AXES} "
                            f"axes (`tgc build` makes a library that takes it from C)")
        if a.dtype == "i32":
            out[a.name] = rng.integers(0, _id_bound(module, a, env), size=shape).astype(np.int32)
        else:
            # bf16/f16 keep their type, and f32 in an f64 program (tgc.ir.dtypes.narrower)
            t = a.dtype if a.dtype in narrower(dtype or a.dtype) else dtype or a.dtype
            out[a.name] = round_to(rng.standard_normal(shape), t)
    if module.facts:
        satisfy(module, out)
    return out


def _id_bound(module: Module, arg: Arg, env: Mapping[str, int]) -> int:
    """The smallest size among the edges this i32 input gathers or scatters along (or 1),
    in a loop's step too (where its ids are the step's slice of the input)."""
    bounds = []

    def walk(values, outer: dict[int, Value | None]) -> None:
        for v in values:
            if v.op in ("gather", "scatter"):
                ids = v.operands[1]
                ids = outer.get(ids.attrs[0]) if ids.op == "loopvar" else ids
                if ids is not None and ids.op == "arg" and ids.attrs[0] == arg.name:
                    bounds.append(env[module.edges[v.attrs[0]]])
            elif v.op == "loop":
                inner = {k: (outer.get(o.attrs[0]) if o.op == "loopvar" else o) for k, o in enumerate(v.operands)}
                walk(topo_order(list(v.attrs[0].results)), inner)

    walk(module.values(), {})
    return min(bounds) if bounds else 1
