"""Every pass by name (IR passes and lowering stages), the default pipeline, and the
default lowering stages. Adding a pass is one line here."""
from __future__ import annotations

from tgc.autodiff.driver import Adjoint, Tangent
from tgc.opt.autocast import Autocast
from tgc.ir.passes import Pass
from tgc.opt.factor import Factor
from tgc.opt.normalize import Normalize
from tgc.opt.scatter import Scatter
from tgc.opt.simplify import Simplify
from tgc.opt.stabilize import Stabilize
from tgc.lower.fuse import Fuse
from tgc.lower.group import Group
from tgc.lower.layout import Layout
from tgc.lower.plan import Plan

PASSES: dict[str, type[Pass]] = {p.name: p for p in (Normalize, Adjoint, Tangent, Simplify, Stabilize, Factor, Scatter,
                                                    Autocast, Fuse, Layout, Group, Plan)}

# Canonical form; fused stable ops before differentiating (so derivatives come from their
# stable rules); derivatives; exact algebra (the derivatives' guards go); patterns the guards
# hid; contraction order last (it leaves pairwise contractions that normalize would merge).
DEFAULT_PIPELINE: tuple[str, ...] = (
    "normalize", "stabilize", "adjoint", "tangent", "simplify", "stabilize", "factor")

# --fp-strict: only what the program needs to run (its derivatives), in canonical form
# without reassociation (`Options.fp_strict` makes normalize keep every sum and product
# as the source nests it); integer indicators as gathers and scatters (`scatter` is
# normalize plus those exact re-indexings), before and after differentiating.
STRICT_PIPELINE: tuple[str, ...] = ("normalize", "scatter", "adjoint", "tangent", "scatter")


def pipeline(options) -> tuple[str, ...]:
    """The passes `options` asks for: its own list, else the default (or strict) one."""
    if options.passes is not None:
        return options.passes
    names = STRICT_PIPELINE if options.fp_strict else DEFAULT_PIPELINE
    return names + ("autocast",) if options.autocast else names   # mixed precision: last


# The lowering stages after the IR pipeline, in order: the module as kernels over buffers
# (fuse), axis and loop orders (layout), loop groups (group), in-place updates and the
# workspace (plan). A backend may run its own list (`Options.stages` overrides both).
LOWERING: tuple[str, ...] = ("fuse", "layout", "group", "plan")


def stages(options, default: tuple[str, ...] = LOWERING) -> tuple[str, ...]:
    """The lowering stages `options` asks for: its own list, else `default` (a backend's)."""
    return options.stages if options.stages is not None else default
