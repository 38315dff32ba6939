"""The library entry points the CLI and the Python API share.

`load(path, options)` reads a `.tg` program (front end) or a `.tgir` file (IR
parser) into a module; `lower(module, options, emit)` runs the pass pipeline.
"""
from __future__ import annotations

import sys
from pathlib import Path

from tgc.ir.diag import CompileError, Loc
from tgc.ir.module import Module
from tgc.ir.parser import parse_module
from tgc.options import Options
from tgc.passes.manager import PipelineResult, run_pipeline


def read_text(path: str) -> str:
    """The file's text ('-' is stdin); unreadable or non-UTF-8 input is a located error."""
    if path == "-":
        data = sys.stdin.buffer.read()
    else:
        try:
            data = Path(path).read_bytes()
        except IsADirectoryError:
            raise CompileError("is a directory, not a file", Loc(path, 1, 1)) from None
        except OSError as e:
            raise CompileError(f"cannot read file: {e.strerror or e}", Loc(path, 1, 1)) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise CompileError(f"invalid UTF-8 byte 0x{data[e.start]:02x}", Loc(path, line, col)) from None


def is_ir_file(path: str) -> bool:
    return path.endswith(".tgir")


def load_program(path: str, options: Options) -> "Elaborated":
    """Parse and check a `.tg` program ('-' is stdin), or read a `.tgir` module;
    with the files it read and its warnings."""
    from tgc.frontend.elaborate import Elaborated, elaborate_source

    name = "<stdin>" if path == "-" else path
    if is_ir_file(path):
        return Elaborated(parse_module(read_text(path), name), [] if path == "-" else [path])
    if path == "-":
        return elaborate_source(read_text(path), name, options)
    from tgc.frontend.elaborate import elaborate_file

    return elaborate_file(path, options)


def load(path: str, options: Options) -> Module:
    """The module of a `.tg` program or a `.tgir` file."""
    return load_program(path, options).module


def lower(module: Module, options: Options, emit=None) -> PipelineResult:
    return run_pipeline(module, options, emit)
