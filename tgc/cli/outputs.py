"""The one check of where a command writes: no output is a file the command reads
(its source, an import, an input archive) or another of its outputs.

Every command that writes files (`build`, `run -o`, `dump-ir -o`, `grad -o`,
`opt -o`, `explain --timeline`) calls `check_outputs` before it computes anything,
as gcc refuses `-o` naming its own source. Two paths are one file by device and
inode (`tgc.fsutil.file_identity`), so a symlink, a hard link or another relative
spelling is caught too. A device or FIFO output (/dev/null, /dev/stdout) is written
into, never replaced, so it clashes with nothing; nor does standard input or output
("-").
"""
from __future__ import annotations

from collections.abc import Iterable

import click

from tgc.fsutil import file_identity, is_special, write_atomic

STDIO = ("-", "<stdin>")


def check_outputs(outputs: Iterable[tuple[str, str | None]], reads: Iterable[tuple[str, str | None]],
                  hint: str = "-o") -> None:
    """A usage error (of `hint`) when an output (what, path) is one file with a file the
    command reads (what, path) or with an earlier output. None or "-" paths are left out."""
    seen: dict[tuple, str] = {}
    for what, path in reads:
        if path is not None and path not in STDIO:
            seen.setdefault(file_identity(path), f"{what} '{path}'")
    for what, path in outputs:
        if path is None or path in STDIO or is_special(path):
            continue
        key = file_identity(path)
        if key in seen:
            raise click.BadParameter(f"{what} '{path}' would overwrite {seen[key]}", param_hint=hint)
        seen[key] = f"{what} '{path}'"


def sources(files: Iterable[str]) -> list[tuple[str, str]]:
    """The files a program was read from (`Elaborated.files`), as reads for `check_outputs`."""
    return [("the source", f) for f in files if f not in STDIO]


def write_output(path: str | None, text: str) -> None:
    """`text` to standard output (no path, or "-"), else to `path` atomically."""
    if path in (None, "-"):
        click.echo(text, nl=False)
    else:
        write_atomic(path, text)
