"""Exit codes and the error boundary shared by every `tgc` command."""
from __future__ import annotations

import functools
import os
import sys
import traceback

import click

from tgc.backends.base import BackendUnavailable
from tgc.cli import interrupt
from tgc.ir.diag import CompileError, render
from tgc.ir.interp import EvalError
from tgc.manager import PassListError

EXIT_USER, EXIT_USAGE, EXIT_RUNTIME, EXIT_INTERNAL = 1, 2, 3, 4

# A source file argument. A missing, unreadable or directory path is reported when the
# file is read, as a located error like any other problem with the source (exit 1).
SOURCE = click.Path(allow_dash=True)


def _root_param(name: str):
    ctx = click.get_current_context(silent=True)
    return ctx.find_root().params.get(name) if ctx else None


def _debug() -> bool:
    return bool(os.environ.get("TGC_DEBUG")) or bool(_root_param("debug"))


def use_color() -> bool:
    """--color=always|never, or (auto) when stderr is a terminal and NO_COLOR is unset."""
    mode = _root_param("color") or "auto"
    if mode != "auto":
        return mode == "always"
    return sys.stderr.isatty() and not os.environ.get("NO_COLOR")


def report(diagnostics) -> None:
    """Print diagnostics to stderr in the gcc format."""
    color = use_color()
    lines: dict = {}
    for d in diagnostics:
        click.echo(render(d, color=color, lines=lines), err=True, color=color)


def _writing_stdout(e: OSError) -> bool:
    """Whether `e` came out of a write to the standard output (`click.echo`, or any
    frame whose `file` is that stream)."""
    tb = e.__traceback__
    while tb is not None:
        f = tb.tb_frame.f_locals.get("file")
        try:
            if f is not None and f.fileno() == sys.__stdout__.fileno():
                return True
        except (AttributeError, OSError, ValueError):
            pass
        tb = tb.tb_next
    return False


def handle_errors(fn):
    """Turn user errors into diagnostics and exit codes; anything else is an ICE."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CompileError as e:
            report(e.diagnostics())
            sys.exit(EXIT_USER)
        except PassListError as e:   # a pass list that cannot run on this program (-p)
            click.echo(f"error: {e}", err=True)
            sys.exit(EXIT_USAGE)
        except (EvalError, BackendUnavailable) as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(EXIT_RUNTIME)
        except BrokenPipeError:  # the reader went away (`tgc ... | head`): stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(EXIT_USER)
        except KeyboardInterrupt:   # the conventional status of a process stopped by SIGINT
            click.echo(interrupt.MESSAGE, err=True)
            sys.exit(interrupt.EXIT_INTERRUPTED)
        except (click.exceptions.Exit, click.ClickException, SystemExit):
            raise
        except OSError as e:  # a file the command was asked to write or read
            if e.filename:
                click.echo(f"error: cannot access '{e.filename}': {e.strerror or e}", err=True)
            elif _writing_stdout(e):   # what was printed could not be written (a full device)
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second failure at exit
                click.echo(f"error: cannot write the standard output: {e.strerror or e}", err=True)
            else:
                click.echo(f"error: {e.strerror or e}", err=True)
            sys.exit(EXIT_USAGE)
        except MemoryError:
            click.echo("error: out of memory (are the inputs or dims too large?)", err=True)
            sys.exit(EXIT_RUNTIME)
        except RecursionError:
            click.echo("error: the program is nested too deeply to compile", err=True)
            sys.exit(EXIT_USER)
        except Exception as e:  # noqa: BLE001 - the last line of defence
            if _debug():
                traceback.print_exc()
            first = (str(e).splitlines() or [""])[0]
            click.echo(f"internal compiler error: {type(e).__name__}: {first}", err=True)
            click.echo("hint: rerun as `tgc --debug ...` (or with TGC_DEBUG=1) for the traceback, "
                       "and report it with the input file", err=True)
            sys.exit(EXIT_INTERNAL)

    return wrapper


