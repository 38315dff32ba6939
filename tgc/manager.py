"""The pass manager: runs a list of named passes, with dumps, timing and checks.

`run_pipeline(module, options, emit)` runs `options.passes` (or the default
pipeline), printing IR before/after the passes `options` names through `emit`
(banner, text), timing each pass when asked, and — with `options.verify_each` —
evaluating the module before and after every pass in float64 on seeded random
inputs, failing with the pass and output whose value changed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from tgc.ir.interp import evaluate

from tgc.ir.inputs import random_inputs
from tgc.ir.module import Module
from tgc.ir.printer import print_module
from tgc.ir.values import DERIVATIVE_OPS
from tgc.ir.dtypes import LOW_FLOATS, ROUNDINGS
from tgc.ir.verify import verify
from tgc.options import Options
from tgc.registry import PASSES, pipeline
from tgc.opt.stats import ModuleStats, module_stats

Emit = Callable[[str, str], None]


class PassError(RuntimeError):
    """A pass broke the module (verifier) or changed its value (--verify-each)."""


@dataclass
class PassStat:
    name: str
    seconds: float
    ops_before: int
    ops_after: int
    cost: ModuleStats | None = None  # with options.stats: the module after the pass


@dataclass
class PipelineResult:
    module: Module
    stats: list[PassStat] = field(default_factory=list)
    initial: ModuleStats | None = None  # with options.stats: the module before any pass


def parse_pass_list(text: str) -> tuple[str, ...]:
    """'a,b, c' -> ('a', 'b', 'c'); unknown names raise ValueError listing the known ones."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for n in names:
        if n not in PASSES:
            raise ValueError(f"unknown pass '{n}' (known: {', '.join(PASSES)})")
    return names


def _op_count(m: Module) -> int:
    return sum(1 for v in m.values() if v.op not in ("arg",))


class _Checker:
    """Reference values of the module on fixed random inputs, compared after each pass."""

    def __init__(self, module: Module, seed: int):
        dims = {d: 3 + i % 3 for i, d in enumerate(module.symbolic_dims())}
        self.inputs = random_inputs(module, module.bind_dims(dims), seed, "f64")
        self.dims = dims
        self.reference = self.values(module)

    def values(self, m: Module) -> dict[str, np.ndarray] | None:
        if any(v.op in DERIVATIVE_OPS for v in m.values()):
            return None
        return evaluate(m, self.inputs, dtype="f64", dims=self.dims)

    def check(self, m: Module, pass_name: str) -> None:
        now = self.values(m)
        if now is None:
            return
        if self.reference is None:
            self.reference = now
            return
        for name, ref in self.reference.items():
            got = now[name]
            if not np.allclose(got, ref, rtol=1e-9, atol=1e-9, equal_nan=True):
                err = float(np.nanmax(np.abs(got - ref)))
                raise PassError(f"pass '{pass_name}' changed the value of '{name}' (max abs difference {err:.3g})")


    def check_lowered(self, low, stage: str) -> None:
        """The lowered program after `stage`, run by the numpy lowered-program
        interpreter in its own float type, against the module's float64 values (to
        1e-9 in f64; to 1e-3 of each output's largest magnitude in f32)."""
        from tgc.lower.interp import run_lowered

        if self.reference is None:
            return
        inputs = {k: (v.astype(low.dtype.replace("f", "float")) if v.dtype.kind == "f" else v)
                  for k, v in self.inputs.items()}
        try:
            got = run_lowered(low, inputs, self.dims)
        except Exception as e:  # noqa: BLE001 -- any failure is the stage's
            raise PassError(f"lowering stage '{stage}' made a program that does not run: {e}") from None
        tol = 1e-9 if low.dtype == "f64" else 1e-3
        if any(v.dtype in LOW_FLOATS for v in low.module.values()) or any(
                v.op == "map" and v.attrs[0] in ROUNDINGS for v in low.module.values()):
            tol = max(tol, 2.0 ** -7)   # a bf16/f16 rounding the f64 run takes the other way: one ulp
        for name, ref in self.reference.items():
            scale = float(np.nanmax(np.abs(ref), initial=0.0)) if np.isfinite(ref).any() else 0.0
            if not np.allclose(got[name], ref, rtol=tol, atol=tol * max(1.0, scale), equal_nan=True):
                err = float(np.nanmax(np.abs(got[name] - ref)))
                raise PassError(f"lowering stage '{stage}' changed the value of '{name}' "
                                f"(max abs difference {err:.3g})")


def run_pipeline(module: Module, options: Options, emit: Emit | None = None) -> PipelineResult:
    names = pipeline(options)
    result = PipelineResult(module)
    checker = _Checker(module, options.verify_seed) if options.verify_each else None
    measure = (lambda m: module_stats(m, options.rep_size)) if options.stats else (lambda m: None)
    result.initial = measure(module)
    for name in names:
        if emit and name in options.print_ir_before:
            emit(f"IR before {name}", print_module(module, options.locs))
        before = _op_count(module) if options.time_passes or options.stats else 0
        start = time.perf_counter()
        module = PASSES[name]().run(module, options)
        seconds = time.perf_counter() - start
        try:
            verify(module)
        except ValueError as e:
            raise PassError(f"pass '{name}' produced invalid IR: {e}") from None
        if checker and PASSES[name].rounds:
            checker.reference = checker.values(module)   # rounds by design: later passes keep its values
        elif checker:
            checker.check(module, name)
        if options.time_passes or options.stats:
            result.stats.append(PassStat(name, seconds, before, _op_count(module), measure(module)))
        if emit and (options.print_ir_after_all or name in options.print_ir_after):
            emit(f"IR after {name}", print_module(module, options.locs))
    result.module = module
    return result
