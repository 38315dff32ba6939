"""Every pass by name, and the default pipeline. Adding a pass is one line here."""
from __future__ import annotations

from tgc.passes.adjoint import Adjoint
from tgc.passes.base import Pass
from tgc.passes.normalize import Normalize
from tgc.passes.tangent import Tangent

PASSES: dict[str, type[Pass]] = {p.name: p for p in (Normalize, Adjoint, Tangent)}

DEFAULT_PIPELINE: tuple[str, ...] = ("normalize", "adjoint", "tangent")
