"""The lowered-program reader under mutated text: `tgc opt` on token mutations of
`dump-ir --after STAGE` outputs (the CPU's lowering stages) accepts a mutant (it
verifies, and its reprint reads back) or stops with a located error, exit 1: never an
internal error (`reader_mutations.check_opt`).

The quick run reads a small program's dumps after fuse and after plan (-p '': read,
verify, reprint); the slow sweep reads every example's dumps after every stage and
also runs the remaining stages on some mutants.
"""
from __future__ import annotations

import zlib
from pathlib import Path

import pytest

from reader_mutations import check_opt, dump, mutants, runner
from tgc import pipeline
from tgc.cli import main

from marks import sized_by_themselves

ROOT = Path(__file__).resolve().parents[2]
SMALL = """dim rows, d = 8, h = 4, n = 5
input x[rows, d], W[d, h]
input ids: i32[n]
param b[h]
out y[rows] = sum[d](tanh(x * 2) + 1)
out z[rows, h] = softmax[h](x @ W + b)
out s[rows, d] = x[d = d - 1] * x
out g[n, d] = x[rows = ids]
"""
EVERY = sorted(str(p.relative_to(ROOT)) for p in sized_by_themselves((ROOT / "examples").glob("*.tg"))
               if p.stem not in ("gpt", "train_sort_gpt", "train_digits"))


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("lowered") / "small.tg"
    path.write_text(SMALL)
    return str(path)


@pytest.mark.parametrize("stage", ["fuse", "plan"])
def test_mutated_lowered_program_is_read_or_a_located_error(small, stage):
    text = dump(small, stage)
    outcomes = [check_opt(m, "", f"after {stage}, mutant {i}: {kind}")
                for i, (kind, m) in enumerate(mutants(text, seed=zlib.crc32(stage.encode()), count=25))]
    assert "error" in outcomes    # the mutations reach the reader's checks


@pytest.mark.slow
@pytest.mark.parametrize("stage", pipeline.lowering("cpu"))
@pytest.mark.parametrize("path", EVERY)
def test_mutated_lowered_sweep(path, stage):
    text = dump(str(ROOT / path), stage)
    for i, (kind, m) in enumerate(mutants(text, seed=zlib.crc32(f"{path} {stage}".encode()), count=80)):
        check_opt(m, "" if i % 4 else None, f"{path} after {stage}, mutant {i}: {kind}")


@pytest.mark.parametrize("stage", ["fuse", "plan"])
def test_a_size_naming_no_dim_is_a_located_error(small, stage):
    text = dump(small, stage)
    line = next(i for i, s in enumerate(text.splitlines(), 1) if "for rows < rows, d < 8" in s)
    for name in ("inf", "nan", "map", "x"):
        bad = text.replace("for rows < rows, d < 8", f"for rows < rows, d < {name}", 1)
        result = runner.invoke(main, ["opt", "-", "-p", ""], input=bad)
        assert result.exit_code == 1 and f"<stdin>:{line}:" in result.output, result.output
        assert f"unknown dim '{name}' in a size" in result.output
        assert check_opt(bad, None, f"{name} as a loop size") == "error"


def test_an_index_coefficient_naming_no_dim_is_a_located_error():
    """`c2 - temp*floor(...)` (a mutant of attention's dump after group): a named
    coefficient of an index is a size, one of the module's dims, as anywhere else."""
    text = dump(str(ROOT / "examples" / "attention.tg"), "group")
    line = next(i for i, s in enumerate(text.splitlines(), 1) if "16*floor" in s)
    bad = text.replace("16*floor", "temp*floor", 1)
    result = runner.invoke(main, ["opt", "-", "-p", ""], input=bad)
    assert result.exit_code == 1 and f"<stdin>:{line}:" in result.output, result.output
    assert "unknown dim 'temp' in a size" in result.output
