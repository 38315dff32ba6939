"""Every pass by name, and the default pipeline. Adding a pass is one line here."""
from __future__ import annotations

from tgc.passes.base import Pass
from tgc.passes.normalize import Normalize

PASSES: dict[str, type[Pass]] = {p.name: p for p in (Normalize,)}

DEFAULT_PIPELINE: tuple[str, ...] = ("normalize",)
