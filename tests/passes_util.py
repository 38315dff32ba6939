"""Helpers of the optimization tests (`tests/opt/test_passes_*.py`): passes run with --verify-each.

`optimize(module, passes)` runs `passes` through `run_pipeline` with
`Options(verify_each=True)` (the float64 interpreter before/after every pass on seeded
random inputs: a pass that changes a value fails the test) and returns the module.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tgc.frontend import compile_source
from tgc.ir.interp import evaluate
from tgc.ir.inputs import random_inputs
from tgc.ir.module import Module
from tgc.ir.parser import parse_module
from tgc.ir.printer import print_module
from tgc.options import Options
from tgc.manager import run_pipeline
from tgc.registry import DEFAULT_PIPELINE

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"


def tg(text: str, dtype: str = "f64") -> Module:
    """The module of a .tg program."""
    return compile_source(text, "<test>", Options(dtype=dtype))


def tgir(text: str) -> Module:
    """The module of IR text."""
    return parse_module(text)


def optimize(module: Module, passes=DEFAULT_PIPELINE, seeds=(0, 1), **options) -> Module:
    """Run `passes` with --verify-each (once per seed given); the optimized module."""
    result = None
    for seed in seeds:
        opts = Options(passes=tuple(passes), verify_each=True, verify_seed=seed).with_(**options)
        result = run_pipeline(module, opts).module
    return result


def ir(module: Module) -> str:
    return print_module(module)


def body(module: Module) -> str:
    """The value lines of the printed module (no declarations)."""
    return "\n".join(l for l in ir(module).splitlines() if l.startswith("%") or l.startswith(("out ", "update ")))


def ops(module: Module, op: str | None = None, fn: str | None = None) -> list:
    return [v for v in module.values() if v.op != "arg" and (op is None or v.op == op)
            and (fn is None or (v.attrs and v.attrs[0] == fn))]


def same_values(a: Module, b: Module, dims=None, seed: int = 3) -> None:
    """a and b compute the same outputs (float64, random inputs)."""
    dims = dims or {d: 4 for d in a.symbolic_dims()}
    inputs = random_inputs(a, a.bind_dims(dims), seed, "f64")
    ra, rb = evaluate(a, inputs, dtype="f64", dims=dims), evaluate(b, inputs, dtype="f64", dims=dims)
    for k in ra:  # rounding differs: relative to the output's scale
        scale = float(np.max(np.abs(ra[k]), initial=1.0))
        np.testing.assert_allclose(rb[k], ra[k], rtol=1e-9, atol=1e-10 * scale, err_msg=k)


def run_f64(m: Module, inputs) -> dict[str, np.ndarray]:
    """The interpreter's values in float64."""
    return evaluate(m, inputs, dtype="f64")


def central_difference(m: Module, inputs, out: str, x: str, d, h: float) -> np.ndarray:
    """d out / d x along direction `d`, by a central difference of step `h` (float64)."""
    plus, minus = dict(inputs), dict(inputs)
    plus[x], minus[x] = inputs[x] + h * d, inputs[x] - h * d
    return (run_f64(m, plus)[out] - run_f64(m, minus)[out]) / (2 * h)
