"""The IR reader under mutated text: `tgc opt` on token mutations of `dump-ir` outputs
(several examples, after elaborate, after adjoint, and the optimized IR) accepts a
mutant (and its reprint reads back) or stops with a located error, exit 1: never an
internal error (`reader_mutations.check_opt`).

The quick run reads a few hundred seeded mutants (-p '': read, verify, reprint); the
slow sweep reads thousands from every example and also runs the default pipeline on
them. The regressions are mutants the sweep once found that were internal errors.
"""
from __future__ import annotations

import zlib
from pathlib import Path

import pytest

from reader_mutations import check_opt, dump, mutants, runner
from tgc.cli import main

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["examples/mlp.tg", "examples/conv1d.tg", "examples/custom_grad.tg"]
EVERY = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").glob("*.tg")
               if p.stem not in ("gpt", "train_sort_gpt"))
STAGES = ["elaborate", "adjoint", None]   # None: the IR after the default pipeline


@pytest.fixture(scope="module")
def dumps():
    cache: dict = {}

    def get(path: str, stage: str | None) -> str:
        if (path, stage) not in cache:
            cache[path, stage] = dump(str(ROOT / path), stage)
        return cache[path, stage]
    return get


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("path", QUICK)
def test_mutated_ir_is_read_or_a_located_error(dumps, path, stage):
    text = dumps(path, stage)
    outcomes = [check_opt(m, "", f"{path} after {stage}, seed {i}: {kind}")
                for i, (kind, m) in enumerate(mutants(text, seed=zlib.crc32(f"{path} {stage}".encode()), count=20))]
    assert "error" in outcomes    # the mutations reach the reader's checks


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("path", EVERY)
def test_mutated_ir_sweep(dumps, path, stage):
    text = dumps(path, stage)
    for i, (kind, m) in enumerate(mutants(text, seed=1000 + len(path), count=300)):
        check_opt(m, "" if i % 3 else None, f"{path} after {stage}, mutant {i}: {kind}")


MLP_ADJOINT = """dim batch
dim features = 4
input x : f32[batch, features]
%t1 = map[exp] %x : f32[batch, features]
%t2 = contract %t1, %t1 : f32[batch]
out y = %t2 : [batch]
"""


@pytest.mark.parametrize("edit, message", [
    (("dim features = 4", "dim features = map"), "dim 'features' = map uses 'map', which is not a dim declared"),
    (("dim features = 4", "dim features = batch * nan"), "uses 'nan', which is not a dim declared"),
    (("dim features = 4", "dim batch = 4"), "'batch' is declared twice"),
    (("%t1 = map[exp] %x : f32", "%t1 = map[exp] %x : c64"), "unknown type 'c64'"),
    (("%t1 = map[exp] %x : f32", "%t1 = map[exp] %x : bool"), "unknown type 'bool'"),
    (("input x : f32", "input x : batch"), "unknown type 'batch'"),
    (("map[exp] %x", "map[exp]"), "'exp' takes 1 argument"),   # its operand dropped
    (("map[exp] %x", "stop %x, %x"), "'stop' takes 1 operand, not 2"),
    (("map[exp] %x", "rename[features -> f2]"), "'rename' takes 1 operand, not 0"),
    (("map[exp] %x", "gather[features] %x"), "'gather' takes 2 operands, not 1"),
    (("map[exp] %x", "custom[foo; 1; ct; ] %x"), "'custom' with 1 arguments, a vjp takes 3 operands, not 1"),
    (("map[exp] %x", "custom[foo; 1; ; a] %x"), "'custom' with 1 arguments, a jvp takes 3 operands, not 1"),
    (("map[exp] %x", "custom[foo; -1; ; a] %x"), "'custom' with -1 arguments"),
    # digits are ASCII, as in .tg source: int() and float() would take these
    (("dim features = 4", "dim features = \u0664"), "unexpected character '\u0664'"),
    (("map[exp] %x : f32", "map[exp] %x : f\uff13\uff12"), "unexpected character '\uff13'"),
    (("%t2 = contract %t1, %t1", "%t2 = contract %t1, %t1 loc(t.tg:\u0663:1)"), "unexpected character '\u0663'"),
])
def test_malformed_ops_and_types_are_located_errors(edit, message):
    assert check_opt(MLP_ADJOINT, "", "the unmutated text") == "accepted"
    old, new = edit
    assert old in MLP_ADJOINT
    text = MLP_ADJOINT.replace(old, new, 1)
    assert check_opt(text, "", "regression") == "error"
    line = next(i for i, s in enumerate(text.splitlines(), 1) if new in s)
    out = runner.invoke(main, ["opt", "-", "-p", ""], input=text).output
    assert f"<stdin>:{line}:" in out and message in out, out


def test_non_ascii_is_read_in_a_locs_file_name_and_comments():
    """IR text is ASCII but for quoted text, comments and a loc's file name (a path)."""
    from tgc.ir.parser import parse_module

    text = MLP_ADJOINT.replace("f32[batch, features]\n%t2", "f32[batch, features] loc(/tmp/\u00e9t\u00e9/m.tg:3:5)\n%t2")
    text = text.replace("dim batch\n", "dim batch   # \u0663 rows\n")
    assert "loc(/tmp/\u00e9t\u00e9/m.tg:3:5)" in text and "\u0663" in text
    assert [o.name for o in parse_module(text, "m.tgir").outputs] == ["y"]
