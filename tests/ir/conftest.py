"""A lit-style collector: every `.tg`/`.tgir`/`.tgl` (lowered program) file here or in a
folder below (`lowered/`) with `RUN:` lines is a test.

Each `RUN:` line is a shell pipeline with `%s` (this file) substituted and `tgc`,
`filecheck` and `not` (succeed only if the command fails) resolved to this Python;
its `CHECK:` lines are matched by the PyPI `filecheck` package.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = re.compile(r"^\s*(?:#|//)\s*RUN:\s*(.*)$")


def pytest_collect_file(parent, file_path: Path):
    if file_path.suffix in (".tg", ".tgir", ".tgl") and "RUN:" in file_path.read_text(errors="replace"):
        return LitFile.from_parent(parent, path=file_path)
    return None


class LitFile(pytest.File):
    def collect(self):
        yield LitItem.from_parent(self, name=self.path.name)


def _substitute(command: str, path: Path) -> str:
    py = shlex.quote(sys.executable)
    command = command.replace("%s", shlex.quote(str(path)))
    command = re.sub(r"(^|\|\s*|&&\s*)not\s+", r"\1" + f"{py} {shlex.quote(str(Path(__file__).with_name('not.py')))} ", command)
    command = re.sub(r"(^|\s|\|)tgc\s", rf"\1{py} -m tgc.cli ", command)
    command = re.sub(r"(^|\s|\|)filecheck\s", rf"\1{py} -m filecheck ", command)
    return command


class LitItem(pytest.Item):
    def runtest(self):
        lines = [m.group(1) for m in map(RUN.match, self.path.read_text().splitlines()) if m]
        env = dict(os.environ, PYTHONPATH=str(ROOT), NO_COLOR="1")
        for line in lines:
            command = _substitute(line, self.path)
            p = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True,
                               cwd=self.path.parent, env=env)
            if p.returncode != 0:
                raise LitFailure(line, command, p.stdout + p.stderr)

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, LitFailure):
            line, command, output = excinfo.value.args
            return f"RUN: {line}\n$ {command}\n{output}"
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, 0, f"lit: {self.path.name}"


class LitFailure(Exception):
    pass
