"""Ctrl-C: every `tgc` command ends with "interrupted" on stderr and exit status 130
(the status of a process that SIGINT stopped), never with a traceback.

`install()` runs first in the `tgc` command (`tgc.cli.console`), before the heavy
imports, and replaces Python's SIGINT handler: while a module is being imported, a
KeyboardInterrupt would surface as another error (numpy turns one raised inside its
import into an ImportError) or leave a module half-initialized, so the process exits
at once; nothing is being written then (outputs are written atomically, and no import
happens while a temporary file is open). Anywhere else it raises KeyboardInterrupt as
Python's handler does, so that `finally` clauses and `tgc.fsutil`'s clean-up run,
and `interrupted_exits` (around the whole command line) or `tgc.cli.errors.handle_errors`
(around each command) turns it into the message and the status. Only `os`, `signal` and
`sys` are imported here.

SIGTERM (`timeout`, a stopped CI job, `kill`) is handled the same way with status 143
(128 + 15) and "terminated": Python's default action ended the process at once, with
no clean-up, so a build stopped while writing left its temporary files beside its
outputs. Outside an import it raises SystemExit(143), which every `except
BaseException` clean-up sees and no `except Exception` catches.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys

EXIT_INTERRUPTED = 130
MESSAGE = "interrupted"
EXIT_TERMINATED = 143
TERMINATED = "terminated"


def install() -> None:
    """Handle SIGINT and SIGTERM as the module docstring says (from the main thread)."""
    signal.signal(signal.SIGINT, _on_sigint)
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame) -> None:
    if _importing(frame):
        exit_now(TERMINATED, EXIT_TERMINATED)
    print(TERMINATED, file=sys.stderr, flush=True)
    raise SystemExit(EXIT_TERMINATED)


def _on_sigint(signum, frame) -> None:
    if _importing(frame):
        exit_now()
    raise KeyboardInterrupt


def _importing(frame) -> bool:
    """Whether an import is in progress in `frame` or a frame that called it."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def exit_now(message: str = MESSAGE, status: int = EXIT_INTERRUPTED) -> None:
    """Print the message and end the process with the interrupted status (or the given
    ones), running nothing else (what was printed is flushed first)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 -- a closed or broken stream: nothing to keep
            pass
    try:
        os.write(2, f"{message}\n".encode())
    finally:
        os._exit(status)


@contextlib.contextmanager
def interrupted_exits():
    """A KeyboardInterrupt inside becomes the message on stderr and SystemExit(130)."""
    try:
        yield
    except KeyboardInterrupt:
        print(MESSAGE, file=sys.stderr, flush=True)
        sys.exit(EXIT_INTERRUPTED)


def waiting(fn):
    """`fn()` on a worker thread while the main thread waits for it: its result, or
    its exception raised again here.

    For a compiled program's call: a call that runs for minutes holds the main thread in
    native code, where Python runs no signal handler, so Ctrl-C and SIGTERM (`timeout`)
    went unanswered until it returned. Waiting here, the handlers run at once, and the
    command ends at once with the signal's message and status (`exit_now`): the native
    code cannot be stopped halfway, so it ends with the process. Nothing is lost: a call
    writes no file (a command writes its outputs after the call returns)."""
    import threading

    box: dict = {}

    def work():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 -- handed to the main thread
            box["error"] = e

    worker = threading.Thread(target=work, name="tgc-call", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.1)
    except KeyboardInterrupt:
        exit_now()
    except SystemExit as e:   # SIGTERM's handler: "terminated" is printed already
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 -- a closed or broken stream: nothing to keep
                pass
        os._exit(e.code if isinstance(e.code, int) else EXIT_TERMINATED)
    if "error" in box:
        raise box.pop("error")
    return box.get("value")
