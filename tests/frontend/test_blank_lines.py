"""Blank and comment-only lines cost the front end nothing per line: a run of them
is one newline token (matched without backtracking state), so a source of megabytes
of them parses in time and memory bounded by its size, and what follows keeps its
line numbers."""
from __future__ import annotations

import random
import time
import tracemalloc

import pytest

from tgc.frontend.parser import _lark, parse
from tgc.ir.diag import CompileError

FILLERS = ("\n", "   \n", "# a comment\n", "\t# an indented comment # with a hash\n", "\r\n", "#\n")


def _filler(size: int, seed: int = 1) -> str:
    rng = random.Random(seed)
    parts, n = [], 0
    while n < size:
        parts.append(rng.choice(FILLERS))
        n += len(parts[-1])
    return "".join(parts)


def test_a_run_of_blank_and_comment_lines_is_one_newline_token():
    text = "dim n = 3" + "\n" + _filler(10_000) + "input x[n]\n"
    newlines = [t for t in _lark().lex(text) if t.type == "_NL"]
    assert len(newlines) == 2
    assert newlines[0].line == 1 and newlines[1].line == text.count("\n")


def test_megabytes_of_blank_lines_and_comments_parse_in_bounded_time_and_memory():
    filler = _filler(5_000_000)
    text = "dim n = 3\n" + filler + "input x[n]\nout y = x + q\n"
    line = text.count("\n")   # the last line's number
    _lark()
    tracemalloc.start()
    start = time.process_time()
    try:
        with pytest.raises(CompileError) as e:
            from tgc.frontend.elaborate import elaborate_source
            from tgc.options import Options

            elaborate_source(text, "big.tg", Options())
        seconds = time.process_time() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seconds < 10, seconds
    assert peak < 10 * len(text), peak   # the text itself, its lines for the diagnostic, little else
    assert (e.value.loc.line, e.value.loc.col) == (line, 13) and "unknown name 'q'" in e.value.message


@pytest.mark.parametrize("filler", ["\n\n", "\n  # c\n\n", "\r\n# c\r\n\r\n", "\n#\n\t\n# x # y\n"])
def test_lines_after_blank_runs_keep_their_numbers(filler):
    text = f"dim n = 3{filler}input x[n]{filler}fn f(v) {{{filler}  w = v * 2{filler}  return w{filler}}}" \
           f"{filler}out y = f(x){filler}out z = x # end"
    program = parse(text, "t.tg")
    lines = text.split("\n")
    starts = [lines[item.loc.line - 1][item.loc.col - 1:] for item in program.items]
    assert [s[0] for s in starts] == ["n", "x", "f", "y", "z"], starts   # each item is located at its name
    assert starts[-1] == "z = x # end"
    with pytest.raises(CompileError) as e:
        parse(text + filler + "out = 1\n", "t.tg")
    assert e.value.loc.line == (text + filler).count("\n") + 1 and e.value.loc.col == 5


def test_a_comment_at_the_end_of_the_file_without_a_newline():
    for text in ("dim n = 3\n# last", "dim n = 3\n\n   # last", "dim n = 3 # last"):
        assert len(parse(text, "t.tg").items) == 1
