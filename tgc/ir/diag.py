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


def _file_lines(file: str, sources: dict[str, str]) -> list[str] | None:
    text = sources.get(file)
    if text is None:   # only a regular file of bounded size, never a device or FIFO
        from tgc.fsutil import read_source_bytes

        try:
            data = read_source_bytes(file)
        except (OSError, ValueError):
            return None
        if b"\0" in data:
            return None
        text = data.decode("utf-8", errors="replace")
    return text.splitlines()


def _source_line(loc: Loc, sources: dict[str, str], lines: dict[str, list[str] | None] | None) -> str | None:
    if lines is None:
        found = _file_lines(loc.file, sources)
    else:   # one read and split per file for a batch of diagnostics, not one per diagnostic
        if loc.file not in lines:
            lines[loc.file] = _file_lines(loc.file, sources)
        found = lines[loc.file]
    if found is not None and 1 <= loc.line <= len(found):
        return found[loc.line - 1]
    return None


_COLORS = {"error": "\033[1;31m", "warning": "\033[1;35m", "note": "\033[1;36m"}
_BOLD, _GREEN, _RESET = "\033[1m", "\033[1;32m", "\033[0m"


def render(diag: Diagnostic, sources: dict[str, str] | None = None, color: bool = False,
           lines: dict[str, list[str] | None] | None = None) -> str:
    """gcc-style text for one diagnostic: header, source line, caret and underline.

    `lines`, a dict the caller keeps for a batch of diagnostics, caches each file's
    lines: rendering n diagnostics of one file then reads and splits it once."""
    paint = (lambda code, text: f"{code}{text}{_RESET}") if color else (lambda code, text: text)
    severity = paint(_COLORS.get(diag.severity, _BOLD), f"{diag.severity}:")
    if diag.loc is None:
        return f"{severity} {diag.message}"
    loc = diag.loc
    out = [f"{paint(_BOLD, f'{loc}:')} {severity} {diag.message}"]
    line = _source_line(loc, sources or {}, lines)
    if line is not None:
        shown, pad = _window(line.expandtabs(1), loc.col)
        width = _underline_width(loc, len(shown), pad)
        out.append(f" {shown}")
        out.append(" " + " " * pad + paint(_GREEN, "^" + "~" * (width - 1)))
    return "\n".join(out)


def _window(line: str, col: int) -> tuple[str, int]:
    """The line (or a 200-character window of a huge one) and the caret's offset in it."""
    if len(line) <= 200:
        return line, max(col - 1, 0)
    start = max(0, col - 100)
    return line[start:start + 200], max(col - 1 - start, 0)


def _underline_width(loc: Loc, shown: int, pad: int) -> int:
    """Columns the range covers on its first line (to the line's end if it goes on)."""
    if loc.end_line is None or loc.end_col is None:
        return 1
    end = loc.end_col - loc.col if loc.end_line == loc.line else shown - pad
    return max(1, min(end, shown - pad))


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

    def format(self, sources: dict[str, str] | None = None, color: bool = False) -> str:
        lines: dict[str, list[str] | None] = {}
        return "\n".join(render(d, sources, color, lines) for d in self.diagnostics())


def did_you_mean(name: str, known) -> str:
    """"; did you mean 'x'?" for the name of `known` (any iterable of names) closest
    to the misspelt `name` (difflib's ratio of at least 0.6), or "" when none is close."""
    import difflib

    candidates = sorted({k for k in known if isinstance(k, str) and k != name})
    close = difflib.get_close_matches(name, candidates, n=1)
    return f"; did you mean '{close[0]}'?" if close else ""
