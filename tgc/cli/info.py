"""`tgc info`: a program's interface (dims, arguments, outputs, updates), as text or JSON."""
from __future__ import annotations

import json

import click

from tgc import pipeline
from tgc.cli.errors import SOURCE, handle_errors
from tgc.cli.flags import DIM_FLAGS, dims_option
from tgc.options import Options


@click.command(short_help="Print FILE's dims, arguments, outputs and updates.")
@click.argument("file", type=SOURCE)
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="text: tables for people; json: one object for tools.")
@click.option("--dtype", type=click.Choice(["f32", "f64"]),
              help="The float type (default: f32, or a .tgir file's own).")
@dims_option("Fix a symbolic dim, as `tgc build -D` does", "defines")
@click.option("-I", "import_dirs", multiple=True, type=click.Path(file_okay=False), metavar="DIR",
              help="Also allow imports from DIR (imports are otherwise kept inside the importing file's folder).")
@handle_errors
def info(file, fmt, dtype, defines, import_dirs=()) -> None:
    """Print FILE's interface: its dims, then every input, param and state in ABI
    order, every output and every update, with edges, sizes and dtype.

    A size is a number, or an expression of symbolic dims (bound at each call from
    the arguments' shapes). The arguments' order is the order of a built library's
    C arrays; from Python and `tgc run`, arguments are passed by name.

    \b
    Examples:
      tgc info examples/mlp.tg
      tgc info examples/gpt.tg --format json
      tgc info examples/mlp.tg -D batch=32
    """
    from tgc.info import describe, format_info
    from tgc.manager import run_passes
    from tgc.opt.dims import FixDims

    options = Options(dtype=pipeline.float_type(file, dtype), import_dirs=tuple(import_dirs))
    module = pipeline.load(file, options)
    try:
        module = run_passes(module, (FixDims.of(defines),), options)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=DIM_FLAGS) from None
    data = describe(module, options.dtype)
    if fmt == "json":
        click.echo(json.dumps({"file": file, **data}, indent=2))
    else:
        click.echo(format_info(data, file), nl=False)
