"""Every neutral pass by name (IR passes and lowering stages), the default pipeline,
and the neutral lowering stages. Adding a pass is one line here.

`PASSES` is fixed when this module is imported and never changes. A backend's own
lowering stages (the CPU's `group`) are not in it, since this module may not import a
backend (stage order): `tgc.backends.base.pass_registry()` is every pass, these and
every backend's stages, built once; the pass manager's functions take the table to
read names from (`known=`, default `PASSES`), and the pipeline and the command line
give it that one."""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from tgc.autodiff.driver import Adjoint, Tangent
from tgc.autodiff.gradient import GradientModule
from tgc.opt.autocast import Autocast
from tgc.opt.centered import Centered
from tgc.opt.carry_sums import CarrySums
from tgc.ir.emulate import EmulateF32
from tgc.ir.lowp import EmulateLow
from tgc.ir.passes import Pass
from tgc.opt.dims import FixDims
from tgc.opt.expand_rules import WithoutRules
from tgc.opt.prune import DropUnreadArgs, ForwardOnly
from tgc.opt.factor import Factor
from tgc.opt.normalize import Normalize
from tgc.opt.quotients import Quotients
from tgc.opt.scatter import Scatter
from tgc.opt.simplify import Simplify
from tgc.opt.stabilize import Stabilize
from tgc.opt.step_sums import StepSums
from tgc.opt.stream import Stream
from tgc.opt.unroll import Unroll
from tgc.lower.fuse import Fuse
from tgc.lower.epilogue import GemmEpilogue
from tgc.lower.layout import Layout
from tgc.lower.narrow import Narrow
from tgc.lower.plan import Plan

PASSES: Mapping[str, type[Pass]] = MappingProxyType({
    p.name: p for p in (Normalize, Adjoint, Tangent, Simplify, Stabilize, Factor, Scatter, Autocast, Unroll, Stream,
                        Centered, Quotients, StepSums, CarrySums,
                        FixDims, ForwardOnly, GradientModule, DropUnreadArgs, EmulateF32, EmulateLow, WithoutRules,
                        Fuse, Layout, GemmEpilogue, Narrow, Plan)})

# Canonical form; fused stable ops before differentiating (so derivatives come from their
# stable rules); derivatives; exact algebra (the derivatives' guards go); patterns the guards
# hid; contraction order (it leaves pairwise contractions that normalize would merge); then
# quotients as divisions (the canonical rules, which write them as products, are done);
# a loop's f32 running sums compensated (`carry_sums`: after every canonical rewrite, which
# would merge its additions; before `stream`, whose own loops it leaves).
# Loops of known trip count are unrolled after the derivatives (`unroll`: the backends run
# no loop yet), so the algebra after it sees every step.
DEFAULT_PIPELINE: tuple[str, ...] = (
    "normalize", "stabilize", "adjoint", "tangent", "unroll", "simplify", "stabilize", "factor", "centered", "quotients",
    "step_sums", "carry_sums", "stream")

# --fp-strict: only what the program needs to run (its derivatives), in canonical form
# without reassociation (`Options.fp_strict` makes normalize keep every sum and product
# as the source nests it); integer indicators as gathers and scatters (`scatter` is
# normalize plus those exact re-indexings), before and after differentiating.
STRICT_PIPELINE: tuple[str, ...] = ("normalize", "scatter", "adjoint", "tangent", "unroll", "scatter")


def pipeline(options) -> tuple[str, ...]:
    """The passes `options` asks for: its own list, else the default (or strict) one."""
    if options.passes is not None:
        return options.passes
    names = STRICT_PIPELINE if options.fp_strict else DEFAULT_PIPELINE
    return names + ("autocast",) if options.autocast else names   # mixed precision: last


def target(options) -> tuple[str, ...]:
    """The passes between the IR pipeline and the lowering that make the program a
    backend compiles, for `tgc.compile` and `tgc build` alike: under --fp-strict, an
    f32 program's f64 emulation (`emulate_f32`, whose result is an f64 program: the
    lowering and the code run in f64, and give the interpreter's bits)."""
    return ("emulate_f32",) if options.fp_strict and options.dtype == "f32" else ()


# What every lowering runs on the module first, whatever its stage list (`-p` or
# `Options.stages` included): bf16/f16 values held in the float type (`emulate_low`),
# custom derivative rules expanded (`without_rules`; a pass list without normalize may
# leave them).
PREPARE: tuple[str, ...] = ("emulate_low", "without_rules")

# The neutral lowering stages after the IR pipeline, in order: the module as kernels
# over buffers (fuse), axis and loop orders (layout), in-place updates and the workspace
# (plan). A backend runs its own list (`Backend.lowering()`: the CPU adds `group` before
# plan); `Options.stages` overrides both.
LOWERING: tuple[str, ...] = ("fuse", "layout", "plan")


def with_stages(stages) -> Mapping[str, type[Pass]]:
    """`PASSES` and the backends' own lowering stages `stages` (Pass classes, in the
    order they run), listed before plan; the same class named twice counts once, two
    classes of one name are an error."""
    own: dict[str, type[Pass]] = {}
    for cls in stages:
        known = PASSES.get(cls.name) or own.get(cls.name)
        if known is not None and known is not cls:
            raise ValueError(f"two passes are called '{cls.name}': {known.__module__} and {cls.__module__}")
        if known is None:
            own[cls.name] = cls
    items = list(PASSES.items())
    at = next((i for i, (n, _) in enumerate(items) if n == "plan"), len(items))
    return MappingProxyType(dict(items[:at] + list(own.items()) + items[at:]))


def stages(options, default: tuple[str, ...] = LOWERING) -> tuple[str, ...]:
    """The lowering stages `options` asks for: its own list, else `default` (a backend's)."""
    return options.stages if options.stages is not None else default
