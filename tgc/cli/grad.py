"""`tgc grad`: print the derivative program of a .tg file."""
from __future__ import annotations

import click

from tgc import pipeline
from tgc.cli.errors import SOURCE, handle_errors
from tgc.cli.outputs import check_outputs, sources, write_output
from tgc.ir.printer import print_module
from tgc.options import Options


@click.command()
@click.argument("file", type=SOURCE)
@click.option("--wrt", multiple=True, required=True, metavar="NAME",
              help="Differentiate with respect to this input, param or state (repeatable).")
@click.option("--of", "of", metavar="OUTPUT", help="The output to differentiate (default: the only scalar one).")
@click.option("--mode", type=click.Choice(["rev", "fwd"]), default="rev", show_default=True,
              help="Reverse mode (adjoint) or forward mode (tangent).")
@click.option("--emit", type=click.Choice(["tg", "ir"]), default="tg", show_default=True,
              help="tg: .tg source that `tgc check` accepts; ir: the textual IR.")
@click.option("--dtype", type=click.Choice(["f32", "f64"]), default="f32", show_default=True,
              help="The float type the program is derived and optimized in (--emit ir prints it).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, allow_dash=True), help="Write here (atomically).")
@click.option("-I", "import_dirs", multiple=True, type=click.Path(file_okay=False), metavar="DIR",
              help="Also allow imports from DIR (imports are otherwise kept inside the importing file's folder).")
@handle_errors
def grad(file, wrt, of, mode, emit, dtype, output, import_dirs=()) -> None:
    """Print the derivative of an output of FILE with respect to --wrt.

    The derivative is derived symbolically and optimized by the default pipeline;
    each result is named dNAME and has NAME's edges (plus the output's, for a Jacobian).
    Arguments the derivative does not read are left out (one that alone gives a
    symbolic dim its size stays), so the result passes `tgc check -Werror`. The
    derivative's loops print as `repeat`/`scan` (docs/grad.md, "Loops").

    \b
    Examples:
      tgc grad examples/mlp.tg --wrt W1
      tgc grad examples/mlp.tg --wrt W1 --wrt b1 --emit ir
      tgc grad examples/mlp.tg --of loss --wrt b2 --mode fwd
    """
    from tgc.autodiff.gradient import GradientModule
    from tgc.manager import run_passes

    options = Options(dtype=dtype, import_dirs=tuple(import_dirs))
    loaded = pipeline.load_program(file, options)
    check_outputs([("the output", output)], sources(loaded.files))
    module = run_passes(loaded.module, (GradientModule(" ".join(dict.fromkeys(wrt)), of, mode),), options)
    module = run_passes(pipeline.lower(module, options).module, ("drop_unread_args",), options)
    text = pipeline.tg_source(module, options) if emit == "tg" else print_module(module)
    write_output(output, text)

