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


def _stem(p) -> str:
    return Path(p).stem if isinstance(p, (str, Path)) else str(p)


def heavy(params, key=_stem) -> list:
    """`params` with the heavy programs' cases marked slow (`key(p)` names a case's program;
    a tuple is the values of several argnames)."""
    def slow(p):
        return pytest.param(*(p if isinstance(p, tuple) else (p,)), marks=pytest.mark.slow)
    return [slow(p) if key(p) in HEAVY_PROGRAMS else p for p in params]
