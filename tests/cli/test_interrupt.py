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


# `tgc run` with one line first that says when the compiled call begins (the moment the
# command is inside the program's native code), on a program that runs for minutes.
SLOW_RUN = ("import os, sys; sys.argv[0] = 'tgc'\n"
            "from tgc.runtime.program import Program\n"
            "real = Program.run\n"
            "def run(self, *args, **kwargs):\n"
            "    os.write(1, b'running\\n'); return real(self, *args, **kwargs)\n"
            "Program.run = run\n"
            "from tgc.cli import console; console()")
LONG_LOOP = "dim L = 10000000000, n = 4\ninput h0[n]\nfn f(h) = tanh(h * 0.5 + 1)\nout y = repeat[L](f, h0)\n"


@pytest.mark.parametrize("sig, status, message", [(signal.SIGINT, 130, "interrupted"),
                                                  (signal.SIGTERM, 143, "terminated")])
def test_a_long_native_call_is_stopped_by_ctrl_c_and_sigterm(tmp_path, sig, status, message):
    """A compiled step that runs for minutes (10^10 loop steps): the signal comes while
    the main thread is in the native call, where Python runs no signal handler. Ctrl-C
    and `timeout`'s SIGTERM went unanswered until the call returned (minutes); the
    command now ends within seconds, with the signal's status and message."""
    (tmp_path / "long.tg").write_text(LONG_LOOP)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-c", SLOW_RUN, "run", str(tmp_path / "long.tg"), "--random-inputs"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert p.stdout.readline() == b"running\n"
        time.sleep(0.5)   # inside the native loop by now
        p.send_signal(sig)
        _, err = p.communicate(timeout=20)
    finally:
        p.kill()
        p.wait()
    assert p.returncode == status, err.decode()
    assert "Traceback" not in err.decode() and err.decode().strip().splitlines()[-1] == message, err.decode()
