"""The status line of long work (`tgc.progress`): shown on a terminal after a delay, erased after."""
from __future__ import annotations

import io
import time

from tgc import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_long_work_shows_a_counting_line_and_erases_it(monkeypatch):
    monkeypatch.setattr(progress, "DELAY", 0.01)
    monkeypatch.setattr(progress, "STEP", 0.01)
    term = Terminal()
    with progress.status("compiling", term):
        time.sleep(0.1)
    text = term.getvalue()
    assert "\rtgc: compiling... " in text and " s\x1b[K" in text
    assert text.endswith("\r\x1b[K")


def test_short_work_and_no_terminal_print_nothing(monkeypatch):
    term, log = Terminal(), io.StringIO()
    with progress.status("compiling", term):
        pass
    monkeypatch.setattr(progress, "DELAY", 0.0)
    with progress.status("compiling", log):
        time.sleep(0.05)
    assert term.getvalue() == "" and log.getvalue() == ""
