"""Source locations and compile errors in the gcc format.

Every user-facing error of the compiler is a `CompileError` carrying one or more
`Diagnostic`s; `format()` renders them as

    file.tg:LINE:COL: error: message
        the source line
        ^~~~~

Locations are 1-based (line and column), as gcc and editors expect.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Loc:
    """A point (or range) in a source file; `end_*` are inclusive-exclusive."""

    file: str
    line: int
    col: int
    end_line: int | None = None
    end_col: int | None = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Diagnostic:
    severity: str  # "error" | "warning" | "note"
    message: str
    loc: Loc | None = None


def _source_line(loc: Loc, sources: dict[str, str]) -> str | None:
    text = sources.get(loc.file)
    if text is None:
        try:
            with open(loc.file, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            return None
    lines = text.splitlines()
    if 1 <= loc.line <= len(lines):
        return lines[loc.line - 1]
    return None


def render(diag: Diagnostic, sources: dict[str, str] | None = None) -> str:
    """gcc-style text for one diagnostic: header, source line, caret and underline."""
    if diag.loc is None:
        return f"{diag.severity}: {diag.message}"
    loc = diag.loc
    out = [f"{loc}: {diag.severity}: {diag.message}"]
    line = _source_line(loc, sources or {})
    if line is not None:
        line = line.expandtabs(1)
        if len(line) > 200:  # keep huge lines readable: a window around the caret
            start = max(0, loc.col - 100)
            shown, pad = line[start:start + 200], loc.col - 1 - start
        else:
            shown, pad = line, loc.col - 1
        width = 1
        if loc.end_line == loc.line and loc.end_col is not None and loc.end_col > loc.col:
            width = loc.end_col - loc.col
        width = max(1, min(width, len(shown) - pad if len(shown) > pad else 1))
        out.append(f" {shown}")
        out.append(" " + " " * max(pad, 0) + "^" + "~" * (width - 1))
    return "\n".join(out)


@dataclass
class CompileError(Exception):
    """An error in the user's program: one primary diagnostic plus notes."""

    message: str
    loc: Loc | None = None
    notes: list[Diagnostic] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __str__(self) -> str:
        return f"{self.loc}: error: {self.message}" if self.loc else self.message

    def diagnostics(self) -> list[Diagnostic]:
        return [Diagnostic("error", self.message, self.loc), *self.notes]

    def format(self, sources: dict[str, str] | None = None) -> str:
        return "\n".join(render(d, sources) for d in self.diagnostics())
