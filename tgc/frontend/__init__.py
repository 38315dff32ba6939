"""The front end: .tg source text to a syntax tree (parser), then to IR (elaborator).

Stage: after `tgc.ir`, before `tgc.opt`; imports `tgc.ir` and the leaves
(`tgc.options`, `tgc.fsutil`) only."""
from __future__ import annotations

from pathlib import Path

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


def import_folders(filename: str | Path, import_dirs=()) -> list[Path]:
    """The folders an import in the file `filename` is looked for in, in order: the
    file's own folder, then each -I folder; a relative name resolves against the
    working directory (so the same name may mean other files elsewhere)."""
    return [Path(filename).parent.resolve()] + [Path(d).resolve() for d in import_dirs]
