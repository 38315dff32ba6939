"""The one typed options object that travels through the whole pipeline.

Every stage reads what it needs from `Options`; nothing else configures the
compiler (no module-level knobs). Tests switch a stage off by passing options.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Options:
    dtype: str = "f32"                       # the program's float type: f32 | f64
    passes: tuple[str, ...] | None = None    # None: the default pipeline
    opt_level: int = 2                       # -O0..-O3
    dims: tuple[tuple[str, int], ...] = ()   # symbolic dims bound at build time (-D)
    verify_each: bool = False                # interpret before/after every pass and compare
    verify_seed: int = 0
    print_ir_before: frozenset[str] = field(default_factory=frozenset)
    print_ir_after: frozenset[str] = field(default_factory=frozenset)
    print_ir_after_all: bool = False
    time_passes: bool = False
    locs: bool = False                       # print loc(...) in IR dumps

    def with_(self, **changes) -> "Options":
        return replace(self, **changes)
