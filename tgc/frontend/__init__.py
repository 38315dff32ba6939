"""The front end: .tg source text to a syntax tree (parser), then to IR (elaborator).

Stage: after `tgc.ir`, before `tgc.opt`; imports `tgc.ir` and the leaves
(`tgc.options`, `tgc.fsutil`) only."""
from __future__ import annotations

from tgc.frontend.folders import import_folders  # noqa: F401 (part of the front end's interface)
from tgc.ir.module import Module
from tgc.options import Options


def compile_source(text: str, filename: str = "<source>", options: Options | None = None) -> Module:
    """Parse and check a program's text; a located CompileError on any mistake."""
    from tgc.frontend.elaborate import elaborate_source

    return elaborate_source(text, filename, options or Options()).module


def compile_file(path: str, options: Options | None = None) -> Module:
    """Parse and check a `.tg` file (and its imports)."""
    from tgc.frontend.elaborate import elaborate_file

    return elaborate_file(path, options or Options()).module
