"""Ctrl-C at any moment of a `tgc` command, its imports included, ends with
"interrupted" on stderr and status 130, never a traceback."""
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

# The `tgc` console script, with one line first that says when the interpreter's own
# start-up is over and tgc's code begins: the delays below count from there.
CHILD = ("import os, sys; os.write(1, b'started\\n'); sys.argv[0] = 'tgc'; "
         "from tgc.cli import console; console()")


def _interrupt_after(delay: float, *args: str) -> tuple[int | None, str, bool]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-c", CHILD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env, cwd=ROOT)
    assert p.stdout.readline() == b"started\n"
    time.sleep(delay)
    finished = p.poll() is not None
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)
    return p.returncode, err.decode(), finished


@pytest.mark.parametrize("delay", [0.05, 0.1, 0.2, 0.3, 0.35, 0.4, 0.5, 0.6])
def test_ctrl_c_while_importing_or_running_exits_130(delay):
    status, err, finished = _interrupt_after(delay, "run", "examples/gpt.tg", "--random-inputs", "--no-update")
    assert "Traceback" not in err, err
    if finished:   # done before the signal came: nothing to interrupt
        assert status == 0, err
    else:
        assert status == 130 and err.strip().splitlines()[-1] == "interrupted", (status, err)


def test_the_console_script_is_the_one_that_handles_ctrl_c():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tgc"] == "tgc.cli:console"
    assert "console()" in (ROOT / "tgc/cli/__main__.py").read_text()
