"""Which parametrized cases are `slow` (registered in pyproject.toml).

Whole-program tests run every example; three of them (the two GPTs and the digits
convolution net) take most of such a test's time, since their builds are an order of
magnitude bigger than the rest. `heavy(params)` marks those cases `slow`, so that
the quick run (`pytest` without `--run-slow`) still runs every other example through the same test.
"""
from __future__ import annotations

from pathlib import Path

import pytest

HEAVY_PROGRAMS = frozenset({"gpt", "train_sort_gpt", "train_digits", "gpt_adamw"})

SIZED_BY_THE_CALLER = frozenset({"gpt2"})
"""Examples whose sizes the build or the call gives (`dims=`, `-D`): gpt2.tg's are all
symbolic. A compiled backend unrolls its `repeat[layer]`, so it builds it only with
`layer` given, and its width `c = head * hd` does not say `head` and `hd`, so they are
not bound from the arguments' shapes. The whole-program tests that build every example
unsized, or bind its dims from random arguments, leave these out (`sized_by_themselves`);
tests/e2e/test_gpt2.py runs gpt2 at a given size on the interpreter, the CPU and cuda-sim."""


def _stem(p) -> str:
    return Path(p).stem if isinstance(p, (str, Path)) else str(p)


def sized_by_themselves(paths) -> list:
    """`paths` without the programs of SIZED_BY_THE_CALLER."""
    return [p for p in paths if _stem(p) not in SIZED_BY_THE_CALLER]


def heavy(params, key=_stem) -> list:
    """`params` with the heavy programs' cases marked slow (`key(p)` names a case's program;
    a tuple is the values of several argnames)."""
    def slow(p):
        return pytest.param(*(p if isinstance(p, tuple) else (p,)), marks=pytest.mark.slow)
    return [slow(p) if key(p) in HEAVY_PROGRAMS else p for p in params]
