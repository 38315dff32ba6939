"""The program's one namespace: dims, edges, tensors and functions share it.

`Scope` records what each global name denotes and where it was declared, so that
a clash is reported at the new declaration with a note at the old one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tgc.frontend import ast
from tgc.ir.diag import CompileError, Diagnostic, Loc
from tgc.ir.ops import SURFACE_UNARY
from tgc.ir.values import Value

PRIMITIVES = frozenset({
    "sum", "mean", "max", "min", *SURFACE_UNARY, "where", "stop", "size", "grad", "jvp", "vjp", "rand",
    "randn", "fold", "repeat", "scan",
})   # the elementwise ones (exp, log, ...: tgc.ir.ops.SURFACE_UNARY) are defined with the IR's functions


@dataclass
class FnInfo:
    """A function definition and the functions visible where it was written."""

    defn: ast.FnDef
    visible: dict[str, "FnInfo"]


@dataclass
class Scope:
    kinds: dict[str, str] = field(default_factory=dict)  # name -> dim | edge | tensor | fn
    locs: dict[str, Loc | None] = field(default_factory=dict)
    tensors: dict[str, Value] = field(default_factory=dict)
    fns: dict[str, FnInfo] = field(default_factory=dict)

    def declare(self, name: str, kind: str, loc: Loc | None) -> None:
        """Claim `name` for `kind`, or a located error naming the earlier declaration."""
        if name in PRIMITIVES:
            raise CompileError(f"'{name}' is a built-in function and cannot be redefined", loc)
        old = self.kinds.get(name)
        if old is not None:
            what = "declared" if old == kind else f"declared as {_article(old)}"
            notes = [Diagnostic("note", f"'{name}' was first declared here", self.locs[name])] \
                if self.locs.get(name) else []
            raise CompileError(f"'{name}' is already {what}", loc, notes)
        self.kinds[name] = kind
        self.locs[name] = loc


def _article(kind: str) -> str:
    return {"edge": "an edge", "dim": "a dim", "tensor": "a tensor", "fn": "a function"}[kind]


def describe(kind: str | None) -> str:
    return _article(kind) if kind else "unknown"
