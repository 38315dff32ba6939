"""Progress on long work: one status line on stderr, for people at a terminal.

`status("compiling")` is a context manager. If the block takes longer than
`DELAY` seconds and stderr is a terminal, a line `tgc: compiling... 1.5 s` appears
and counts up until the block ends, and is then erased, so nothing of it is left
in the scrollback or in a log. Off a terminal (make, CI, pipes) it prints nothing.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

DELAY = 0.5      # seconds of silence before the line appears
STEP = 0.25      # seconds between updates of the count


def _enabled(stream) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


@contextlib.contextmanager
def status(what: str, stream=None):
    stream = stream or sys.stderr
    if not _enabled(stream):
        yield
        return
    done = threading.Event()
    start = time.monotonic()
    shown = []

    def show() -> None:
        if done.wait(DELAY):
            return
        while not done.is_set():
            stream.write(f"\rtgc: {what}... {time.monotonic() - start:.1f} s\x1b[K")
            stream.flush()
            shown.append(True)
            done.wait(STEP)

    thread = threading.Thread(target=show, name="tgc-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if shown:
            stream.write("\r\x1b[K")
            stream.flush()
