"""Depfiles name the compiler too: the prelude and tgc's version stamp (its
`__init__.py`), so that make rebuilds what an older tgc built."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

import tgc
from tgc.cli import main
from tgc.depfile import compiler_dependencies

ROOT = Path(__file__).parent.parent
PACKAGE = Path(tgc.__file__).resolve().parent
PRELUDE = PACKAGE / "frontend" / "prelude.tg"
STAMP = PACKAGE / "__init__.py"


def test_compiler_dependencies():
    assert compiler_dependencies(True) == [str(PRELUDE), str(STAMP)]
    assert compiler_dependencies(False) == [str(STAMP)]
    assert PRELUDE.is_file() and "__version__ =" in STAMP.read_text()


def build_ir(src: Path, out: Path, *flags: str) -> str:
    r = CliRunner().invoke(main, ["build", str(src), "--emit", "ir", "-o", str(out), "-MD", *flags])
    assert r.exit_code == 0, r.output
    return out.with_suffix(".d").read_text()


def test_depfiles_list_the_prelude_and_the_stamp(tmp_path):
    dep = build_ir(ROOT / "examples/mlp.tg", tmp_path / "mlp.tgir", "-MP")
    assert f"  {PRELUDE}" in dep and f"  {STAMP}" in dep
    assert f"\n{PRELUDE}:\n" in dep and f"\n{STAMP}:\n" in dep          # -MP: phony rules for them too
    # IR input reads no prelude
    dep = build_ir(tmp_path / "mlp.tgir", tmp_path / "again.tgir")
    assert str(PRELUDE) not in dep and f"  {STAMP}" in dep


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_rebuilds_after_an_upgrade(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src, out = Path("m.tg"), Path("m.tgir")
    src.write_text("dim n = 3\ninput x[n]\nout y = relu(x)\n")
    build_ir(src, out)
    (tmp_path / "Makefile").write_text("m.tgir: m.tg\n\ttouch m.tgir\n-include m.d\n")

    def up_to_date() -> bool:
        return subprocess.run(["make", "-q", "m.tgir"], cwd=tmp_path, capture_output=True).returncode == 0

    newest = max(os.stat(p).st_mtime for p in (src, PRELUDE, STAMP))
    os.utime(out, (newest + 10, newest + 10))
    assert up_to_date()
    # an older output than the installed tgc (as after `pip install -U tgc`) is out of date
    stamp = os.stat(STAMP).st_mtime
    os.utime(out, (stamp - 10, stamp - 10))
    os.utime(src, (stamp - 20, stamp - 20))
    assert not up_to_date()
