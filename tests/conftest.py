"""What every test folder shares: the `verified` fixture and the lit-style collector.

- `verified`: the optimization tests run every pass with --verify-each. The helpers live
  in `passes_util` (importable by every test module: pytest puts this folder, the one
  of the rootdir's conftest, on sys.path); `verified` is its `optimize`: run passes
  through `run_pipeline(..., Options(verify_each=True))`.
- `slow`: tests marked slow are deselected unless `--run-slow` is given (the README's
  and CI's whole run) or a `-m` expression chooses for itself (`-m slow`), so a plain
  `python -m pytest` is the quick run.
- `--backends-from DIR`: backend folders outside tgc/ (a test's toy backend) are
  registered before collection, so the tests parametrized over the registered
  backends (`backends_util`) run them too.
- lit: every `.tg`/`.tgir`/`.tgl` (lowered program) file under tests/ with `RUN:` lines
  is a test, kept beside the Python tests of its stage (tests/frontend: diagnostics,
  tests/opt, tests/autodiff, tests/lower: one pass's output, and `lowered_*.tgl`: stages
  run from lowered text). Each `RUN:` line is a shell pipeline with `%s` (this
  file) substituted and `tgc`, `filecheck` and `not` (succeed only if the command fails,
  `tests/not.py`) resolved to this Python; its `CHECK:` lines are matched by the PyPI
  `filecheck` package. Files without `RUN:` (the program corpus, golden IR, fuzz
  regressions) are data, not tests.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from passes_util import optimize

ROOT = Path(__file__).resolve().parents[1]
NOT = Path(__file__).resolve().with_name("not.py")
RUN = re.compile(r"^\s*(?:#|//)\s*RUN:\s*(.*)$")


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true",
                     help="also run the tests marked slow: the whole suite, as the README and CI run it")
    parser.addoption("--backends-from", action="append", default=[], metavar="DIR",
                     help="register the backend folders in DIR (added to tgc.backends.__path__) before "
                          "collecting: every test parametrized over the backends runs them too")


def pytest_configure(config):
    extra = [str(Path(d).resolve()) for d in config.getoption("--backends-from")]
    if extra:
        import tgc.backends
        from tgc.backends.base import refresh

        tgc.backends.__path__.extend(extra)
        refresh()


def _slow_deselected(config) -> bool:
    return not config.getoption("--run-slow") and not config.option.markexpr


def pytest_report_header(config):
    if _slow_deselected(config):
        return "tests marked slow are deselected: --run-slow runs the whole suite"
    return None


def pytest_collection_modifyitems(config, items):
    if not _slow_deselected(config):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.fixture
def verified():
    """`optimize(module, passes)`, every pass checked by the float64 interpreter."""
    return optimize


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
    command = re.sub(r"(^|\|\s*|&&\s*)not\s+", r"\1" + f"{py} {shlex.quote(str(NOT))} ", command)
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


@pytest.fixture(autouse=True)
def _torch_default_dtype_restored():
    """A test that sets torch's default dtype (an f64 oracle) leaves it as it found it:
    the setting is global, and a later test on the same worker would make f64 tensors."""
    torch = sys.modules.get("torch")
    before = torch.get_default_dtype() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_default_dtype(before if before is not None else torch.float32)
