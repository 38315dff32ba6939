"""The `tgc` command line (`tgc.cli.app`): thin click commands over the library,
one module per command family, with one error boundary (`tgc.cli.errors`).

`console()` is the `tgc` command itself (the console script and `python -m tgc.cli`):
it installs the Ctrl-C handling (`tgc.cli.interrupt`) before it imports anything
heavy, so this module imports nothing else; `main`, the click group, is imported on
first use.

Stage: the last; it may import every other part of tgc, and nothing imports it."""

__all__ = ["console", "main"]


def console() -> None:
    """Run the `tgc` command line on `sys.argv`: a Ctrl-C at any moment, while
    importing too, ends it with "interrupted" and status 130. A standard output that
    cannot be written outside a command's own error boundary (click's `--help` and
    `--version`, `tgc passes` into a full device) ends with one `error:` line and
    status 2, as inside a command, not a traceback; a closed pipe ends quietly
    (click's own rule: status 1)."""
    import errno
    import os
    import sys

    from tgc.cli.interrupt import install, interrupted_exits

    install()
    with interrupted_exits():
        from tgc.cli.app import main

        try:
            main()
        except OSError as e:
            if e.errno == errno.EPIPE:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                sys.exit(1)
            where = f"'{e.filename}'" if e.filename else "the standard output"
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second failure at exit
                sys.stderr.write(f"error: cannot write {where}: {e.strerror or e}\n")
                sys.stderr.flush()
            except OSError:
                pass
            sys.exit(2)


def __getattr__(name: str):
    """`main`, the click group of every command (imported on first use)."""
    if name == "main":
        from tgc.cli.app import main

        return main
    raise AttributeError(f"module 'tgc.cli' has no attribute {name!r}")
