"""The whole default pipeline on every example and corpus program: the same values as the
derived program with no optimization at all (float64, random inputs)."""
from pathlib import Path

import pytest

from passes_util import ROOT, optimize, same_values
from tgc.frontend import compile_file
from tgc.options import Options
from tgc.registry import DEFAULT_PIPELINE

PROGRAMS = sorted((ROOT / "examples").glob("*.tg")) + sorted((ROOT / "tests/programs/good").glob("*.tg"))


@pytest.mark.parametrize("path", PROGRAMS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_pipeline_keeps_values(path: Path):
    m = compile_file(str(path), Options(dtype="f64"))
    reference = optimize(m, ("adjoint", "tangent"), seeds=(0,))
    same_values(reference, optimize(m, DEFAULT_PIPELINE, seeds=(0,)))
