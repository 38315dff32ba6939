"""Every pass by name, and the default pipeline. Adding a pass is one line here."""
from __future__ import annotations

from tgc.autodiff.driver import Adjoint, Tangent
from tgc.opt.autocast import Autocast
from tgc.ir.passes import Pass
from tgc.opt.factor import Factor
from tgc.opt.normalize import Normalize
from tgc.opt.scatter import Scatter
from tgc.opt.simplify import Simplify
from tgc.opt.stabilize import Stabilize

PASSES: dict[str, type[Pass]] = {p.name: p for p in (Normalize, Adjoint, Tangent, Simplify, Stabilize, Factor, Scatter,
                                                    Autocast)}

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
