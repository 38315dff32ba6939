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


# A build whose outputs' fsync blocks until the parent has sent its signal: the
# moment the temporary files beside the outputs exist.
SLOW_FSYNC = ("import os, sys, time; real = os.fsync\n"
              "def fsync(fd):\n"
              "    os.write(1, b'writing\\n'); time.sleep(30); real(fd)\n"
              "os.fsync = fsync; sys.argv[0] = 'tgc'\n"
              "from tgc.cli import console; console()")


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_build_stopped_while_writing_leaves_no_temporary_file(tmp_path, sig, status):
    """`make` or `timeout` stopping `tgc build` (SIGTERM, or Ctrl-C's SIGINT) while it
    writes its outputs: the temporary files beside them are removed (SIGTERM's default
    action ended the process without clean-up, leaving `.libm.so.*.tmp` behind), the
    outputs are not created, and the status is the signal's (128 + its number)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-c", SLOW_FSYNC, "build", str(ROOT / "examples/mlp.tg"), "-o",
                          str(tmp_path / "libm.so"), "-MD"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert p.stdout.readline() == b"writing\n"
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == status, err.decode()
    assert "Traceback" not in err.decode(), err.decode()
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)
