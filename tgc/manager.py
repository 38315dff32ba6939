"""The pass manager: runs a list of named passes on the IR and on the lowered program,
with dumps, timing and checks.

One loop (`run_passes`) runs every pass, whatever its level (`Pass.takes`/`gives`: the
IR module, or the lowered program of `tgc.lower.lowered`): it checks that each pass
reads what the one before it gives, prints the program before/after the passes
`options` names through `emit` (banner, text), times each pass when asked, verifies
the result (`tgc.ir.verify` after every IR pass; `tgc.lower.verify` after the last
lowering stage of a list, and after every one with `options.verify_each`: it costs
about a tenth of the lowering), and with `options.verify_each` compares values: a module is evaluated in float64 on
seeded random inputs before and after every IR pass; a lowered program is run by the
lowered-program interpreter (`tgc.lower.interp`) and compared with the module's
values. It fails with the pass and the output whose value changed.

`run_pipeline(module, options, emit)` runs the IR passes (`options.passes`, or the
default pipeline); `run_target(module, options, emit)` the target passes after them
(the program a backend compiles: under --fp-strict, an f32 program's f64 emulation,
and the float type it gives); `run_lowering(program, options, emit)` the lowering stages
(`options.stages`, or the stage list it is given: the backend's), from a module or
from a lowered program read back from text (then only the stages after the one it
was dumped after). A pass in a list may set its options (its dataclass fields) as in
mlir-opt: `group{blocks=8}`; `parse_pass_list` reads such lists and says which
passes and fields exist when one does not.

Terminates: one run of each pass in the list.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import time
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from tgc.ir.diag import did_you_mean
from tgc.ir.inputs import random_inputs
from tgc.ir.interp import evaluate
from tgc.ir.module import Module
from tgc.ir.passes import Pass
from tgc.ir.printer import print_module
from tgc.ir.values import DERIVATIVE_OPS
from tgc.ir.dtypes import LOW_FLOATS, ROUNDINGS
from tgc.ir.verify import verify
from tgc.lower.lowered import Lowered, StepLoop, print_lowered
from tgc.lower.verify import VerifyError, verify_lowered
from tgc.options import Options
from tgc.registry import LOWERING, PASSES, PREPARE, pipeline, stages as stage_list, target as target_passes
from tgc.lower.cost import lowered_stats
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
    memory: object = None               # with options.memory_budget: what was recomputed (a tgc.budget.MemoryPlan)


class PassListError(ValueError):
    """A pass list that names an unknown pass or field, or runs a pass on the wrong level."""


_SPEC = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?:\{(.*)\})?\s*$", re.S)


def _split_top(text: str, sep: str = ",") -> list[str]:
    """`text` split at `sep` outside braces."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth < 0:
                raise PassListError(f"unbalanced '}}' in pass list '{text}'")
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise PassListError(f"unclosed '{{' in pass list '{text}'")
    parts.append("".join(cur))
    return parts


@functools.lru_cache(maxsize=None)
def pass_fields(cls: type[Pass]) -> dict[str, Any]:
    """A pass's options: field name -> its type."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _value(cls: type[Pass], name: str, typ: Any, text: str):
    args = typing.get_args(typ)
    kinds = [a for a in args if a is not type(None)] if args else [typ]
    if text.lower() == "none" and type(None) in args:
        return None
    for kind in kinds:
        try:
            if kind is bool:
                if text.lower() in ("true", "1", "false", "0"):
                    return text.lower() in ("true", "1")
                continue
            return kind(text)
        except (TypeError, ValueError):
            continue
    names = " or ".join(getattr(k, "__name__", str(k)) for k in kinds) + (" or none" if type(None) in args else "")
    raise PassListError(f"pass '{cls.name}': option '{name}' takes {names}, not '{text}'")


def parse_pass_spec(text: str, known: Mapping[str, type[Pass]] = PASSES) -> tuple[str, dict[str, Any]]:
    """'group{blocks=8}' -> ('group', {'blocks': 8}), reading names from `known` (the
    neutral passes by default; `tgc.backends.base.pass_registry()` has every
    backend's stages too); unknown passes and fields raise PassListError listing the
    known ones."""
    if text in known:   # the common case: a plain name
        return text, {}
    m = _SPEC.match(text)
    if not m:
        raise PassListError(f"cannot read pass '{text.strip()}' (a pass is NAME or NAME{{field=value,...}})")
    name, body = m.group(1), m.group(2)
    cls = known.get(name)
    if cls is None:
        raise PassListError(f"unknown pass '{name}' (known: {', '.join(known)})" + did_you_mean(name, known))
    fields = pass_fields(cls)
    values: dict[str, Any] = {}
    for item in _split_top(body or ""):
        if not item.strip():
            continue
        key, eq, val = item.partition("=")
        key, val = key.strip(), val.strip()
        if not eq or not key:
            raise PassListError(f"pass '{name}': cannot read option '{item.strip()}' (write field=value)")
        if key not in fields:
            have = ", ".join(fields) if fields else "none"
            raise PassListError(f"pass '{name}' has no option '{key}' (its options: {have})" + did_you_mean(key, fields))
        values[key] = _value(cls, key, fields[key], val)
    return name, values


def spec_text(name: str, values: dict[str, Any], known: Mapping[str, type[Pass]] = PASSES) -> str:
    """The canonical spelling of a pass with options (fields in declaration order)."""
    if not values:
        return name
    order = [f for f in pass_fields(known[name]) if f in values]
    return f"{name}{{{','.join(f'{k}={values[k]}' for k in order)}}}"


def parse_pass_list(text: str, known: Mapping[str, type[Pass]] = PASSES) -> tuple[str, ...]:
    """'a, b{x=1}, c' -> ('a', 'b{x=1}', 'c'), each pass spelled canonically; unknown
    passes or fields (names read from `known`, as `parse_pass_spec` does) raise
    PassListError (a ValueError) listing the known ones."""
    return tuple(spec_text(*parse_pass_spec(item, known), known) for item in _split_top(text) if item.strip())


def split_levels(specs: tuple[str, ...], known: Mapping[str, type[Pass]] = PASSES
                 ) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
    """A pass list as (IR passes, lowering stages or None when it names none); a module
    pass after a lowering stage is an error."""
    ir: list[str] = []
    low: list[str] = []
    for spec in specs:
        name = parse_pass_spec(spec, known)[0]
        if known[name].takes == "module" and known[name].gives == "module":
            if low:
                raise PassListError(f"pass '{name}' works on the IR: it cannot follow the lowering stage "
                                    f"'{parse_pass_spec(low[-1], known)[0]}'")
            ir.append(spec)
        else:
            low.append(spec)
    return tuple(ir), (tuple(low) if low else None)


def make_pass(spec: str, known: Mapping[str, type[Pass]] = PASSES) -> Pass:
    name, values = parse_pass_spec(spec, known)
    return known[name](**values)


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
        elif any(v.op == "map" and v.attrs[0] == "round32" for v in low.module.values()):
            tol = max(tol, 2.0 ** -22)  # likewise an f32 rounding (f32 values of an f64 program)
        for name, ref in self.reference.items():
            scale = float(np.nanmax(np.abs(ref), initial=0.0)) if np.isfinite(ref).any() else 0.0
            if not np.allclose(got[name], ref, rtol=tol, atol=tol * max(1.0, scale), equal_nan=True):
                err = float(np.nanmax(np.abs(got[name] - ref)))
                raise PassError(f"lowering stage '{stage}' changed the value of '{name}' "
                                f"(max abs difference {err:.3g})")


def _size(ir) -> int:
    """Ops of a module, kernels (group members counted) of a lowered program."""
    if isinstance(ir, Module):
        return _op_count(ir)
    return sum(len(getattr(k, "members", (k,))) for k in ir.kernels)


def _level(ir) -> str:
    return "module" if isinstance(ir, Module) else "lowered"


def _text(ir, options: Options) -> str:
    """A dump for --print-ir-*: a lowered program without its module (the IR dumps
    before it show that; `tgc dump-ir --after STAGE` prints it whole)."""
    return print_module(ir, options.locs) if isinstance(ir, Module) else print_lowered(ir, module=False)


def run_passes(ir, specs: tuple, options: Options, emit: Emit | None = None,
               checker: "_Checker | None" = None, stats: list[PassStat] | None = None,
               measure: Callable = lambda ir: None, known: Mapping[str, type[Pass]] = PASSES):
    """Run the passes `specs` names on `ir` (a Module or a Lowered), in order; the result.
    A spec is a pass's text (`group{blocks=8}`, a name in `known`) or a `Pass` object.

    Each pass must read the level the one before it gives (PassListError otherwise)."""
    return _run_passes(ir, specs, options, emit, checker, stats, measure, known)[0]


def _run_passes(ir, specs: tuple, options: Options, emit: Emit | None = None,
                checker: "_Checker | None" = None, stats: list[PassStat] | None = None,
                measure: Callable = lambda ir: None, known: Mapping[str, type[Pass]] = PASSES):
    """`run_passes`, and the options the result is of: a pass that changes the float type
    (`Pass.float_type`) has the passes after it run with the new one."""
    passes = [(spec.name, spec) if isinstance(spec, Pass) else (parse_pass_spec(spec, known)[0], make_pass(spec, known))
              for spec in specs]
    level = _level(ir)
    for name, p in passes:
        if p.takes != level:
            need = "a lowered program: run 'fuse' before it" if p.takes == "lowered" else \
                "the IR module, and this program is already lowered"
            raise PassListError(f"pass '{name}' needs {need}")
        level = p.gives
    for name, p in passes:
        if emit and name in options.print_ir_before:
            emit(f"IR before {name}", _text(ir, options))
        before = _size(ir) if options.time_passes or options.stats else 0
        start = time.perf_counter()
        dtype = p.float_type(options)
        why = None if any(spec is p for spec in specs) else p.options_error(ir)   # a `-p` text's options
        if why:
            raise PassListError(f"pass '{name}': {why}")
        ir = _run_one(p, ir, options)
        seconds = time.perf_counter() - start
        if dtype != options.dtype:
            options = options.with_(dtype=dtype)
        if isinstance(ir, Module):
            try:
                verify(ir)
            except ValueError as e:
                raise PassError(f"pass '{name}' produced invalid IR: {e}") from None
            if checker and p.rounds:
                checker.reference = checker.values(ir)   # rounds by design: later passes keep its values
            elif checker:
                checker.check(ir, name)
        else:
            if checker or p is passes[-1][1]:   # the structural check: after the last stage, or every one
                try:
                    verify_lowered(ir)
                except VerifyError as e:
                    raise PassError(f"lowering stage '{name}' made an invalid program: {e}") from None
            if checker:
                checker.check_lowered(ir, name)
        if stats is not None and (options.time_passes or options.stats):
            stats.append(PassStat(name, seconds, before, _size(ir), measure(ir)))
        if emit and (options.print_ir_after_all or name in options.print_ir_after):
            emit(f"IR after {name}", _text(ir, options))
    return ir, options


def _run_one(p, ir, options: Options):
    """Pass `p` on `ir`; a lowering stage on a lowered program runs on every loop's step
    first (innermost first: `plan` gives the enclosing program the steps' slots)."""
    if p.takes == "lowered" and any(isinstance(k, StepLoop) for k in ir.kernels):
        from dataclasses import replace

        ir = replace(ir, kernels=[replace(k, step=_run_one(p, k.step, options)) if isinstance(k, StepLoop) else k
                                  for k in ir.kernels])
    return p.run(ir, options)


def run_pipeline(module: Module, options: Options, emit: Emit | None = None) -> PipelineResult:
    """The IR passes `options` asks for (its list, or the default pipeline) on `module`."""
    result = PipelineResult(module)
    checker = _Checker(module, options.verify_seed) if options.verify_each else None
    measure = (lambda m: module_stats(m, options.rep_size)) if options.stats else (lambda m: None)
    result.initial = measure(module)
    result.module = keep_result_types(module, run_passes(module, pipeline(options), options, emit, checker,
                                                         result.stats, measure))
    return result


def keep_result_types(before: Module, after: Module) -> Module:
    """`after` with each output of another float type than in `before` converted back to it.

    A rewrite may drop the operand that set a value's type by promotion: `0 + x` of an f64
    zero (`f64(w - stop(w))`) and a bf16 `x` is `x`, exact but bf16. Inside the program that
    is harmless; at an output it would change the program's interface (the array type a
    call returns, the C type in `tgc build`'s header: docs/dtypes.md). The conversion back
    is a widening of an exact value, so values do not change. One pass over the outputs:
    it terminates."""
    from tgc.ir import values as V
    from tgc.ir.dtypes import CONVERSIONS

    want = {o.name: o.value.dtype for o in before.outputs}
    outs, changed = [], False
    for o in after.outputs:
        t = want.get(o.name)
        if t is not None and o.value.dtype != t and f"to_{t}" in CONVERSIONS and o.value.dtype in CONVERSIONS.values():
            o = dataclasses.replace(o, value=V.map_(f"to_{t}", o.value, loc=o.value.loc))
            changed = True
        outs.append(o)
    return dataclasses.replace(after, outputs=outs) if changed else after


@dataclass
class LoweringResult:
    lowered: Lowered
    stats: list[PassStat] = field(default_factory=list)   # with options.stats, each has the kernels' cost


def run_lowering(program, options: Options, emit: Emit | None = None, stages: tuple[str, ...] = LOWERING,
                 stop_after: str | None = None, known: Mapping[str, type[Pass]] = PASSES) -> LoweringResult:
    """The lowering stages on `program`: a module (after the IR pipeline and the target
    passes), or a lowered program (read back from text: then the stages after the one
    it was dumped after).

    The stages are `options.stages` if set, else `stages` (the backend's list); on a
    module, the passes of `tgc.registry.PREPARE` run first whatever the list is
    (bf16/f16 values emulated in the program's float type, rewrite rules a pass list
    may have left expanded). `stop_after` ends after that stage or pass (what `tgc
    dump-ir --after fuse|layout|group` prints). Stage names are read from `known`
    (the caller gives `tgc.backends.base.pass_registry()` for a backend's own
    stages). With `options.verify_each`, the
    program after each stage is run by the numpy lowered-program interpreter and
    compared with the module's values."""
    names = stage_list(options, stages)
    if isinstance(program, Module):
        module = program
        names = PREPARE + tuple(names)
    else:
        module = program.module
        if options.stages is None:   # the default stages that follow the one it was dumped after
            done = [parse_pass_spec(n, known)[0] for n in names]
            names = names[done.index(program.stage) + 1:] if program.stage in done else ()
    if stop_after is not None:
        plain = [parse_pass_spec(n, known)[0] for n in names]
        if stop_after in plain:
            names = names[: plain.index(stop_after) + 1]
    checker = _Checker(module, options.verify_seed) if options.verify_each else None
    result = LoweringResult(program)   # type: ignore[arg-type]  (a module until fuse has run)
    measure = (lambda low: lowered_stats(low, options.rep_size) if isinstance(low, Lowered) else None) \
        if options.stats else (lambda low: None)   # kernels' costs (the IR table counts the module's ops)
    result.lowered = run_passes(program, tuple(names), options, emit, checker, result.stats, measure, known)
    return result


def run_target(module: Module, options: Options, emit: Emit | None = None) -> tuple[Module, Options]:
    """The program a backend compiles, from `module` after the IR pipeline: the target
    passes (`tgc.registry.target`: under --fp-strict, an f32 program's f64 emulation),
    and the options to lower and compile it with (its float type)."""
    checker = _Checker(module, options.verify_seed) if options.verify_each else None
    return _run_passes(module, target_passes(options), options, emit, checker)


def lower_module(module: Module, options: Options, emit: Emit | None = None, stop_after: str = "plan",
                 stages: tuple[str, ...] = LOWERING, known: Mapping[str, type[Pass]] = PASSES) -> Lowered:
    """`module` (after the IR pipeline) lowered by the lowering stages up to `stop_after`
    (names read from `known`, as `run_lowering` does)."""
    low = run_lowering(module, options, emit, stages, stop_after, known).lowered
    if not isinstance(low, Lowered):
        raise PassListError("the lowering stages do not include 'fuse': the program is still IR")
    if stop_after == "plan" and low.stage != "plan":
        raise PassListError(f"the lowering stages end with '{low.stage}': a backend compiles a planned program "
                            "(end the list with 'plan')")
    return low
