"""benchmarks/fma_mix.py: every variant of the own kernel's FMA loop assembles, runs
and is timed (a few K steps, one run; no timing is asserted)."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from tgc.backends.cpu.llvm_env import has_feature

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not has_feature("avx512f"), reason="the loops are AVX-512 assembly")
def test_every_variant_runs(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        fma_mix = importlib.import_module("fma_mix")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    per_fma = fma_mix.run(16, reps=1, passes=2)
    assert set(per_fma) == set(fma_mix.VARIANTS)
    assert all(s > 0 for s in per_fma.values())
    out = capsys.readouterr().out
    assert all(name in out for name in fma_mix.VARIANTS)
