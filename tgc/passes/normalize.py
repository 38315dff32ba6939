"""normalize: rebuild every value through the typed builders (canonical form, CSE).

Rewrites: each value is rebuilt bottom-up from its (already canonical) operands,
so structurally equal values become one (hash-consing) and unreachable values
are dropped. Terminates: one visit per value of a finite DAG.
"""
from __future__ import annotations

from dataclasses import dataclass

from tgc.ir.module import Module
from tgc.ir.values import rebuild, rebuild_same
from tgc.options import Options
from tgc.passes.base import Pass


@dataclass(frozen=True)
class Normalize(Pass):
    """Canonical form: rebuild through the builders, sharing equal values."""

    name = "normalize"

    def run(self, module: Module, options: Options) -> Module:
        return module.replace_values(rebuild(module.roots(), rebuild_same))
