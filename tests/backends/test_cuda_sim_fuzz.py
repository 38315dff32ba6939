"""The differential fuzzer's programs on cuda-sim: a seeded slice of random programs
(`tests/fuzz/gen.py`) and every saved regression, each against the reference
interpreter in float64 (the CPU backend's fuzz tests compare the interpreter with
the torch oracle; this adds the CUDA kernels). A slice of 40 seeds: each program is
one emulator build (~0.5 s of g++)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from tgc import pipeline
from tgc.frontend import compile_source
from tgc.options import Options

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))

from backends.test_cuda_sim_programs import compare  # noqa: E402
from fuzz.gen import generate  # noqa: E402
from fuzz.nodes import parse_bind_comment  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="cuda-sim needs g++ with OpenMP")
SLICE = 40
QUICK = 8          # seeds below QUICK also run in the quick run (without --run-slow); the rest are marked slow
REGRESSIONS = sorted((ROOT / "tests" / "fuzz" / "regressions").glob("*.tg"))


@pytest.fixture(autouse=True, scope="module")
def _no_disk_cache():
    """One-off programs are not written to the compile cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TGC_CACHE", "off")
        yield


def _check(text: str, dims: dict, name: str) -> None:
    options = Options(dtype="f64")
    module = pipeline.lower(compile_source(text, name, options), options).module
    compare(module, "f64", dims=dims)


@pytest.mark.parametrize("seed", [s if s < QUICK else pytest.param(s, marks=pytest.mark.slow) for s in range(SLICE)])
def test_slice(seed):
    prog = generate(seed)
    _check(prog.render(), prog.bind, f"seed{seed}.tg")


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.name for p in REGRESSIONS])
def test_regression(path):
    text = path.read_text()
    _check(text, parse_bind_comment(text), path.name)
