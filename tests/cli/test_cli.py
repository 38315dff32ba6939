"""The `tgc` command line, through click's runner and as a real subprocess."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tgc.cli import main

from system_blas import NO_SYSTEM_BLAS, links_system_openblas

ROOT = Path(__file__).parents[2]
MLP = str(ROOT / "examples/mlp.tg")
EXAMPLES = sorted(str(p) for p in (ROOT / "examples").glob("*.tg"))


def tgc(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)


def test_version_and_help_with_examples():
    assert tgc("--version").output.startswith("tgc, version")
    for cmd in ("check", "dump-ir", "opt", "run", "passes"):
        r = tgc(cmd, "--help")
        assert r.exit_code == 0
        assert cmd == "passes" or "Example" in r.output


def test_check_all_examples():
    r = tgc("check", *EXAMPLES)
    assert r.exit_code == 0, r.output
    assert r.output == ""


def test_check_warns_of_the_statements_an_import_skips(tmp_path):
    """An import brings only dims and functions: an imported file's `input`, `out`,
    `update` (and every other statement but dim, fn and import) is skipped. `check`
    says so at each, in the imported file, as a warning (an error with -Werror); the
    program itself is unchanged and runs."""
    (tmp_path / "lib.tg").write_text("dim n = 3\nfn double(v) = v * 2\ninput x[n]\nparam w[n]\n"
                                     "h = x * w\nout y = double(x) + h\nupdate w = w - 0.1 * x\n")
    main_tg = tmp_path / "main.tg"
    main_tg.write_text('import "lib.tg"\ninput z[n]\nout q = double(z)\n')
    lib = tmp_path / "lib.tg"
    r = tgc("check", str(main_tg))
    assert r.exit_code == 0, r.output
    for where, what in (("3:7", "input 'x'"), ("4:7", "param 'w'"), ("5:1", "binding 'h'"),
                        ("6:5", "out 'y'"), ("7:8", "update of 'w'")):
        assert (f"{lib}:{where}: warning: {what} in an imported file is skipped: an import brings only "
                "dims and functions") in r.output, r.output
    assert f"{lib}:1:" not in r.output and f"{lib}:2:" not in r.output and r.output.count("warning:") == 5
    r = tgc("check", "-Werror", str(main_tg))
    assert r.exit_code == 1 and f"{lib}:6:5: error: out 'y' in an imported file is skipped" in r.output, r.output
    r = tgc("run", str(main_tg), "--random-inputs")
    assert r.exit_code == 0 and r.output.startswith("q[n] ") and "y[" not in r.output, r.output
    # a file checked on its own is a program: nothing is skipped, nothing said
    r = tgc("check", str(lib))
    assert r.exit_code == 0 and r.output == "", r.output


def test_check_error_is_located_with_exit_1(tmp_path):
    bad = tmp_path / "bad.tg"
    bad.write_text("dim n = 3\ninput x[n]\nout y = x + q\n")
    r = tgc("check", str(bad))
    assert r.exit_code == 1
    assert f"{bad}:3:13: error: unknown name 'q'" in r.output
    assert " out y = x + q" in r.output and "^" in r.output


@pytest.mark.parametrize("src, where, message", [
    ("dim a = 3\ninput x[a]\nfn f(x) = x with jvp(d) = d\nout y[a] = grad(sum(f(x)), x)\n", "4:21",
     "reverse mode needs the vjp of 'f', which gives only its own jvp"),
    ("dim a = 3\ninput x[a]\nfn f(x) = x * x with vjp(g) = 3 * g\nout y = jvp(sum(f(x)), x, x)\n", "4:17",
     "forward mode needs the jvp of 'f', which gives only its own vjp"),
])
def test_check_finds_a_missing_derivative_rule_as_a_build_does(tmp_path, src, where, message):
    """A custom function's missing rule is found when the derivative is taken: `check`
    takes the program's derivatives too, so it fails where `run` and `build` fail."""
    bad = tmp_path / "bad.tg"
    bad.write_text(src)
    r = tgc("check", str(bad))
    assert r.exit_code == 1, r.output
    assert f"{bad}:{where}: error: {message}" in r.output
    r = tgc("run", str(bad), "--random-inputs")
    assert r.exit_code == 1 and f"{bad}:{where}: error: {message}" in r.output


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: Path(p).name)
def test_dump_ir_round_trips_through_opt(example, tmp_path):
    out = tmp_path / "a.tgir"
    r = tgc("dump-ir", example, "-o", str(out))
    assert r.exit_code == 0, r.output
    r2 = tgc("opt", str(out), "-p", "")
    assert r2.exit_code == 0, r2.output
    assert r2.output == out.read_text()
    r3 = tgc("dump-ir", example, "--after", "elaborate")
    assert r3.exit_code == 0
    assert tgc("opt", "-", "-p", "", input=r3.output).output == r3.output


def test_dump_ir_after_all_and_print_ir_after():
    r = tgc("dump-ir", MLP, "--after-all")
    assert r.exit_code == 0
    assert "// ----- IR after elaborate -----" in r.output
    assert "// ----- IR after normalize -----" in r.output
    r = CliRunner(mix_stderr=False).invoke(main, ["dump-ir", MLP, "--print-ir-after", "normalize"]) \
        if "mix_stderr" in CliRunner.__init__.__code__.co_varnames else tgc("dump-ir", MLP, "--print-ir-after", "normalize")
    assert "IR after normalize" in (r.stderr if hasattr(r, "stderr") and r.stderr_bytes is not None else r.output)


def test_dump_ir_fixes_dims_as_build_does():
    r = tgc("dump-ir", MLP, "-D", "batch=7")
    assert r.exit_code == 0, r.output
    assert "dim batch = 7" in r.output.splitlines()
    assert "dim batch = 7" not in tgc("dump-ir", MLP).output
    r = tgc("dump-ir", MLP, "-D", "nosuchdim=2")
    assert r.exit_code == 2 and "no dim 'nosuchdim'" in r.output


def test_usage_errors_exit_2():
    assert tgc("dump-ir", MLP, "--after", "nosuchpass").exit_code == 2
    assert tgc("opt", "x.tgir", "-p", "nosuchpass").exit_code == 2
    assert tgc("run", MLP, "--dim", "batch").exit_code == 2
    assert tgc("frobnicate").exit_code == 2


def test_passes_lists_the_default_pipeline():
    r = tgc("passes")
    assert "normalize" in r.output and "default pipeline:" in r.output
    assert "lowering for cpu (dump-ir --backend cpu --after STAGE): fuse,layout,narrow,gemm_operands,implicit,accumulate,unsplit,epilogue,alias,pieces,group,plan" in r.output
    assert "lowering for cuda (dump-ir --backend cuda --after STAGE): fuse,layout,narrow,cublas_operands,inline_elementwise,flash,accumulate,rowgroup,plan" in r.output
    # each pass's whole first paragraph, not its first line cut mid-sentence
    assert "unroll              Short loops of known trip count -> their steps, normalized (`all`: every loop of known trip count, for a backend that runs no loops)." in r.output


def test_run_writes_npz_in_abi_order(tmp_path):
    out = tmp_path / "o.npz"
    r = tgc("run", MLP, "--random-inputs", "--dim", "batch=5", "--dtype", "f64", "-o", str(out))
    assert r.exit_code == 0, r.output
    with np.load(out) as f:
        names = set(f.files)
        assert f["loss"].shape == ()
        assert f["W1"].shape == (13, 64)
    assert {"loss", "W1", "b1", "W2", "b2"} <= names


def test_run_prints_a_summary():
    r = tgc("run", MLP, "--random-inputs")
    assert r.exit_code == 0, r.output
    assert r.output.startswith("loss[] float32 shape=()")


def test_run_input_errors_exit_3(tmp_path):
    src = tmp_path / "p.tg"
    src.write_text("dim n\ninput a[n], b[n]\nout c = a + b\n")
    np.save(tmp_path / "a.npy", np.ones(3))
    np.save(tmp_path / "b.npy", np.ones(4))
    r = tgc("run", str(src), "--input", f"a={tmp_path/'a.npy'}")
    assert r.exit_code == 3 and "missing input 'b'" in r.output
    r = tgc("run", str(src), "--input", f"a={tmp_path/'a.npy'}", "--input", f"b={tmp_path/'b.npy'}")
    assert r.exit_code == 3 and "edge 'n'" in r.output


def test_subprocess_exit_codes(tmp_path):
    bad = tmp_path / "bad.tg"
    bad.write_bytes(b"dim n = 3\n\xff\xfe\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "tgc.cli", "check", str(bad)], capture_output=True, text=True, env=env)
    assert p.returncode == 1
    assert f"{bad}:2:1: error:" in p.stderr
    assert "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "tgc.cli", "check", str(tmp_path)], capture_output=True, text=True, env=env)
    assert p.returncode in (1, 2) and "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "tgc", "check", str(bad)], capture_output=True, text=True, env=env)
    assert p.returncode == 1 and f"{bad}:2:1: error:" in p.stderr   # `python -m tgc` is the same command


@pytest.mark.parametrize("stage", ["fuse", "layout", "plan"])
def test_dump_ir_after_lowering_stages(stage):
    r = tgc("dump-ir", MLP, "--after", stage)
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"// lowered after {stage}")
    assert "loop" in r.output or "gemm" in r.output


def test_every_option_of_every_command_is_explained():
    """`tgc CMD --help` says what each option does, and `tgc --help` gives each
    command's summary whole (click cuts a long first sentence with "...")."""
    import click

    for name, cmd in main.commands.items():
        for param in cmd.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert param.help, (name, param.opts)
    listing = tgc("--help").output.split("Commands:")[1]
    assert "..." not in listing and all(name in listing for name in main.commands), listing


def _help_examples() -> list:
    """(command, line) of every example in `tgc CMD --help`, comments dropped."""
    cases = []
    for name, cmd in sorted(main.commands.items()):
        text = tgc(name, "--help").output
        if "Example" not in text:
            continue
        section = text.split("Example", 1)[1].split("Options:")[0]
        for line in section.splitlines():
            line = line.split("#")[0].strip()
            if line.startswith("tgc "):
                # seconds each: a native build (LLVM), a memory-budget search, a compiled run
                slow = name == "build" or "--memory-budget" in line or (name == "run" and "interp" not in line)
                cases.append(pytest.param(line, id=f"{name}: {line[4:60]}", marks=[pytest.mark.slow] * slow))
    return cases


@pytest.mark.parametrize("line", _help_examples())
def test_the_help_examples_run(line, tmp_path, monkeypatch):
    """Each example of `tgc CMD --help` runs, in a folder holding the repository's
    examples/ and benchmarks/, `model.tg` and `mlp.tg` (the MLP), and the inputs the
    run examples name; a pipe between tgc commands runs as one."""
    import shlex
    import shutil

    if "--target cuda" in line and shutil.which("nvcc") is None:
        pytest.skip("tgc build --target cuda compiles with nvcc, which this machine lacks")
    if "--blas=system" in line and not links_system_openblas():
        pytest.skip(NO_SYSTEM_BLAS)
    if "| dot" in line:
        pytest.skip("the Graphviz half of the pipe: test_the_tour_runs_as_written draws it where dot is")
    monkeypatch.chdir(tmp_path)
    for folder in ("examples", "benchmarks"):
        (tmp_path / folder).symlink_to(ROOT / folder)
    for name in ("model.tg", "mlp.tg"):
        shutil.copy(MLP, tmp_path / name)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 13), dtype=np.float32), np.eye(3, dtype=np.float32)[[0, 1, 2, 0]]
    np.save("x.npy", x), np.save("y.npy", y)
    np.savez("data.npz", x=x, y=y, W1=rng.standard_normal((13, 64), dtype=np.float32),
             b1=np.zeros(64, np.float32), W2=rng.standard_normal((64, 3), dtype=np.float32),
             b2=np.zeros(3, np.float32), lr=np.float32(0.1))
    if "result.npz" in line.split("-o")[0]:
        assert tgc("run", "examples/mlp.tg", "--inputs", "data.npz", "-o", "result.npz").exit_code == 0
    if "opt mlp.tgir" in line:
        assert tgc("dump-ir", "examples/mlp.tg", "--after", "adjoint", "-o", "mlp.tgir").exit_code == 0
    given = None
    for part in line.split("|"):
        r = tgc(*shlex.split(part)[1:], input=given)
        assert r.exit_code == 0, (part, r.output)
        given = r.stdout


def test_a_missing_input_file_is_said_as_a_missing_inputs_archive_is(tmp_path):
    """`--input x=FILE.npy` that does not exist: one plain reason, as `--inputs` gives,
    not Python's "[Errno 2] ...: 'path'" repeating the path."""
    for args, what in ((["--input", f"x={tmp_path / 'no.npy'}"], f"input 'x' from '{tmp_path / 'no.npy'}'"),
                       (["--inputs", str(tmp_path / "no.npz")], f"inputs from '{tmp_path / 'no.npz'}'")):
        r = CliRunner().invoke(main, ["run", MLP, *args])
        assert r.exit_code == 3, r.output
        assert r.output.strip().splitlines()[-1] == f"error: cannot read {what}: No such file or directory"
