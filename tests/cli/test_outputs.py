"""Where commands write: an output is never a file the command reads (by inode, so
symlinks, hard links and other spellings count), and a device or FIFO output gets
nothing written beside it (no header, manifest or depfile)."""
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tgc.cli import main

ROOT = Path(__file__).parents[2]
PROGRAM = "dim n = 3\ninput x[n]\nparam w[n]\nout loss = sum[n](w * x * x)\nupdate w = w - 0.1 * grad(loss, w)\n"


def tgc(*args, cwd=None):
    runner = CliRunner()
    if cwd is None:
        return runner.invoke(main, [str(a) for a in args])
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return runner.invoke(main, [str(a) for a in args])
    finally:
        os.chdir(old)


@pytest.fixture
def src(tmp_path):
    (tmp_path / "sub").mkdir()
    f = tmp_path / "m.tg"
    f.write_text(PROGRAM)
    return f


def _same_file_spellings(src: Path) -> list[str]:
    """Paths to `src` other than its own: relative through a folder, a symlink, a hard link."""
    folder = src.parent
    os.symlink(src, folder / "link.tg")
    os.link(src, folder / "hard.tg")
    return [str(folder / "sub" / ".." / src.name), str(folder / "link.tg"), str(folder / "hard.tg")]


@pytest.mark.parametrize("command", [["run", "--random-inputs"], ["dump-ir"], ["grad", "--wrt", "w"],
                                     ["build", "--emit", "llvm"]])
def test_no_command_writes_over_its_source(src, command):
    for out in [str(src), *_same_file_spellings(src)]:
        r = tgc(command[0], src, *command[1:], "-o", out)
        # run's -o must be named .npz, so a source's name is refused before anything is read
        said = "-o writes an .npz archive" if command[0] == "run" else "would overwrite the source"
        assert r.exit_code == 2 and said in r.output, (out, r.output)
        assert src.read_text() == PROGRAM
    assert os.path.islink(src.parent / "link.tg")


def test_no_command_writes_over_an_import(tmp_path):
    (tmp_path / "lib.tg").write_text("fn double(v) = v * 2\n")
    main_tg = tmp_path / "main.tg"
    main_tg.write_text('import "lib.tg"\ndim n = 3\ninput x[n]\nout y = double(x)\n')
    for command in (["run", "--random-inputs"], ["dump-ir"], ["grad", "--wrt", "x", "--of", "y"]):
        r = tgc(command[0], "main.tg", *command[1:], "-o", "lib.tg", cwd=tmp_path)
        said = "-o writes an .npz archive" if command[0] == "run" else "would overwrite the source"
        assert r.exit_code == 2 and said in r.output and "lib.tg'" in r.output, r.output
    assert (tmp_path / "lib.tg").read_text() == "fn double(v) = v * 2\n"


def test_opt_and_explain_do_not_write_over_their_input(src, tmp_path):
    ir = tmp_path / "m.tgir"
    assert tgc("dump-ir", src, "--after", "elaborate", "-o", ir).exit_code == 0
    text = ir.read_text()
    r = tgc("opt", ir, "-o", tmp_path / "sub" / ".." / "m.tgir")
    assert r.exit_code == 2 and "would overwrite" in r.output and ir.read_text() == text
    os.symlink(src, tmp_path / "m.svg")
    r = tgc("explain", src, "--timeline", tmp_path / "m.svg")
    assert r.exit_code == 2 and "would overwrite" in r.output and src.read_text() == PROGRAM


def test_run_does_not_write_over_its_inputs(src, tmp_path):
    x = tmp_path / "x.npy"
    np.save(x, np.ones(3, np.float32))
    np.savez(tmp_path / "in.npz", w=np.ones(3, np.float32))
    r = tgc("run", src, "--inputs", tmp_path / "in.npz", "-o", tmp_path / "sub" / ".." / "in.npz", "--input", f"x={x}")
    assert r.exit_code == 2 and "would overwrite the inputs" in r.output, r.output
    xz = tmp_path / "x.npz"   # an .npy input named .npz (np.load reads it by its contents)
    np.save(xz, np.ones(3, np.float32))
    os.replace(str(xz) + ".npy", xz)
    r = tgc("run", src, "--inputs", tmp_path / "in.npz", "--input", f"x={xz}", "-o", xz)
    assert r.exit_code == 2 and "would overwrite input 'x'" in r.output, r.output
    assert np.load(xz).tolist() == [1, 1, 1]
    r = tgc("run", src, "--inputs", tmp_path / "in.npz", "--input", f"x={x}", "-o", x)
    assert r.exit_code == 2 and "-o writes an .npz archive" in r.output, r.output
    assert np.load(x).tolist() == [1, 1, 1]
    r = tgc("run", src, "--inputs", tmp_path / "in.npz", "--input", f"x={x}", "-o", tmp_path / "out.npz")
    assert r.exit_code == 0, r.output


def test_a_device_output_gets_no_companions(src, tmp_path):
    """/dev/null through a symlink: the library goes into it, and neither the header
    beside it nor the depfile -MD would put beside it is written (nor anything in /dev)."""
    dev = tmp_path / "libm.so"
    os.symlink(os.devnull, dev)
    before = set(os.listdir(tmp_path))
    r = tgc("build", src, "-o", dev, "-MD")
    assert r.exit_code == 0, r.output
    assert set(os.listdir(tmp_path)) == before and os.path.islink(dev)
    assert not os.path.exists(os.devnull + ".h") and not os.path.exists("/dev/m.h")
    # an explicit -MF is still written
    r = tgc("build", src, "-o", dev, "-MF", tmp_path / "m.d")
    assert r.exit_code == 0 and (tmp_path / "m.d").exists(), r.output


def test_a_fifo_output_is_written_into_without_companions(src, tmp_path):
    import threading

    fifo = tmp_path / "libf.so"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(Path(fifo).read_bytes()))
    reader.start()
    r = tgc("build", src, "-o", fifo, "-MD")
    reader.join(timeout=60)
    assert r.exit_code == 0, r.output
    assert got and got[0].startswith(b"\x7fELF")
    assert sorted(os.listdir(tmp_path)) == ["libf.so", "m.tg", "sub"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device whose writes fail)")
@pytest.mark.parametrize("args", [["--help"], ["--version"], ["passes"], ["build", "--help"], ["check", "-h"],
                                  ["dump-ir", "examples/mlp.tg"], ["info", "examples/mlp.tg"],
                                  ["grad", "examples/mlp.tg", "--wrt", "W1"]])
def test_a_standard_output_that_cannot_be_written_is_an_error_not_a_traceback(args):
    """Output written outside a command's own error boundary (click's --help and
    --version, `tgc passes`) into a full device ends with one `error:` line and status 2,
    as a command's own output does, not a Python traceback; the line says it is the
    standard output (a command's own said "cannot access: ...", naming nothing)."""
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "tgc", *args], stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines() == ["error: cannot write the standard output: No space left on device"]


@pytest.mark.skipif(sys.getfilesystemencoding() != "utf-8", reason="a file system whose names are UTF-8")
def test_a_written_text_that_carries_a_file_name_that_is_not_utf8(tmp_path):
    """`tgc explain m\\xffp.tg --timeline t.svg`: the SVG names the source; its text
    was encoded strictly (an internal compiler error, status 4). Text outputs keep
    such a name's own bytes, as the terminal output does."""
    import shutil
    import subprocess

    name = os.fsdecode(b"m\xffp.tg")
    shutil.copy(Path(__file__).parents[2] / "examples/mlp.tg", tmp_path / name)
    p = subprocess.run([sys.executable, "-m", "tgc", "explain", name, "--timeline", "t.svg"], cwd=tmp_path,
                       capture_output=True, timeout=300)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    assert b"m\xffp.tg" in (tmp_path / "t.svg").read_bytes()


@pytest.mark.parametrize("name", ["out.txt", "out", "out.npy", "out.safetensors", "out.npz.tmp"])
def test_run_output_must_be_named_npz(src, tmp_path, name):
    """`tgc run -o` writes an .npz archive, and `--inputs` reads a file by its suffix:
    any other name (`out.txt` used to get a zip under that name) is a usage error
    (status 2) that names the rule, and nothing is written."""
    out = tmp_path / name
    before = set(os.listdir(tmp_path))
    r = tgc("run", src, "--random-inputs", "-o", out)
    assert r.exit_code == 2, r.output
    assert "-o writes an .npz archive" in r.output and "Traceback" not in r.output
    assert set(os.listdir(tmp_path)) == before


def test_run_output_named_npz_in_any_case_is_written(src, tmp_path):
    out = tmp_path / "OUT.NPZ"
    r = tgc("run", src, "--random-inputs", "-o", out)
    assert r.exit_code == 0, r.output
    with np.load(out) as data:
        assert set(data.files) == {"loss", "w"}
