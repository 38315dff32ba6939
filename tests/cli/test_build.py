"""`tgc build` and Makefile use: the .so and header from C and ctypes, depfiles,
byte-identical outputs, atomic outputs, exit codes, and examples/Makefile."""
import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tgc.cli import main
from tgc.frontend import compile_file
from tgc.ir.interp import evaluate
from tgc.options import Options
from tgc.manager import run_pipeline

ROOT = Path(__file__).parents[2]
MLP = ROOT / "examples/mlp.tg"
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc)")
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def tgc(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def subprocess_tgc(*args, cwd=None, seed="0"):
    env = dict(os.environ, PYTHONHASHSEED=seed)
    return subprocess.run([sys.executable, "-m", "tgc.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True)


def mlp_inputs(batch: int) -> dict:
    """The inputs examples/c/mlp_main.c builds, in numpy (float32, as C computes them)."""
    def filled(n, scale, freq, phase):
        return (scale * np.sin(freq * np.arange(n, dtype=np.float64) + phase)).astype(np.float32)
    y = np.zeros((batch, 3), np.float32)
    y[np.arange(batch), np.arange(batch) % 3] = 1
    return {"x": filled(batch * 13, 1.0, 0.37, 0.1).reshape(batch, 13), "y": y,
            "W1": filled(13 * 64, 0.3, 0.71, 0.2).reshape(13, 64), "b1": filled(64, 0.05, 0.13, 0.3),
            "W2": filled(64 * 3, 0.3, 0.53, 0.4).reshape(64, 3), "b2": filled(3, 0.05, 1.1, 0.5),
            "lr": np.float32(0.1)}


def reference_step(inputs):
    module = run_pipeline(compile_file(str(MLP), Options(dtype="f64")), Options(dtype="f64")).module
    return evaluate(module, inputs, dtype="f64")


@needs_cc
def test_c_driver_uses_the_library_and_header(tmp_path):
    r = tgc("build", MLP, "-o", tmp_path / "libmlp.so")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "mlp.h").exists()
    exe = tmp_path / "mlp_main"
    subprocess.run(["cc", "-O2", "-std=c11", "-Wall", "-Werror", f"-I{tmp_path}", "-o", exe,
                    ROOT / "examples/c/mlp_main.c", f"-L{tmp_path}", "-lmlp", f"-Wl,-rpath,{tmp_path}", "-lm"],
                   check=True)
    out = subprocess.run([exe, "5"], capture_output=True, text=True, check=True).stdout
    step0 = dict(re.findall(r"(\w+(?:\[0\])?) ([-\d.e+]+)", out.splitlines()[0]))
    want = reference_step(mlp_inputs(5))
    assert float(step0["loss"]) == pytest.approx(float(want["loss"]), rel=1e-5)
    assert float(step0["probs_mean"]) == pytest.approx(float(want["probs"].mean()), rel=1e-5)
    assert float(step0["W2[0]"]) == pytest.approx(float(want["W2"][0, 0]), rel=1e-5)
    assert float(step0["b1[0]"]) == pytest.approx(float(want["b1"][0]), rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("output, header, prefix", [
    ("libmlp.so", "mlp.h", "MLP_"), ("lib my.so", "my.h", "MY_"), ("lib-x.so", "x.h", "X_"),
    ("lib2d.so", "m_2d.h", "M_2D_"), ("lib__.so", "model.h", "MODEL_")])
def test_header_names_are_valid_unreserved_c(tmp_path, output, header, prefix):
    """The header and its macros are named from the library: characters C does not allow
    become `_`, and none starts with `_` (C reserves `_` + capital: `lib my.so` gave `_MY_`)."""
    r = tgc("build", MLP, "-o", tmp_path / output)
    assert r.exit_code == 0, r.output
    text = (tmp_path / header).read_text()
    macros = re.findall(r"#define (\w+)", text)
    assert macros and all(re.fullmatch(r"[A-Z][A-Z0-9_]*", m) for m in macros), macros
    assert f"#define {prefix}NUM_ARGS " in text


@needs_cc
@pytest.mark.parametrize("blas", ["none", "numpy"])
def test_shared_library_through_ctypes(tmp_path, blas):
    assert tgc("build", MLP, "-o", tmp_path / "libmlp.so", "--dtype", "f64", f"--blas={blas}").exit_code == 0
    lib = ctypes.CDLL(str(tmp_path / "libmlp.so"))
    assert lib.mlp_init_default() == 0
    inputs = {k: np.array(v, np.float64, order="C") for k, v in mlp_inputs(4).items()}
    want = reference_step({k: v.copy() for k, v in inputs.items()})
    dims = (ctypes.c_int64 * 1)(4)
    order = ["x", "y", "W1", "b1", "W2", "b2", "lr"]
    args = (ctypes.c_void_p * 7)(*[inputs[n].ctypes.data for n in order])
    loss, correct, probs = np.zeros(()), np.zeros(4), np.zeros((4, 3))
    outs = (ctypes.c_void_p * 3)(loss.ctypes.data, correct.ctypes.data, probs.ctypes.data)
    lib.mlp_workspace_bytes.restype = ctypes.c_int64
    ws = np.zeros(lib.mlp_workspace_bytes(dims) + 64, np.uint8)
    addr = ws.ctypes.data + (-ws.ctypes.data) % 64
    assert lib.mlp_run(dims, args, outs, ctypes.c_void_p(addr)) == 0
    np.testing.assert_allclose(loss, want["loss"], rtol=1e-12)
    np.testing.assert_allclose(probs, want["probs"], rtol=1e-12)
    np.testing.assert_allclose(inputs["W1"], want["W1"], rtol=1e-12)  # updated in place


@pytest.mark.slow
@needs_cc
def test_builds_are_byte_identical_across_processes(tmp_path):
    # the GPT as a library and as IR; the textual and object forms of the LLVM module
    # (each the .so's own module, emitted another way) on a smaller program
    builds = (("gpt", "so", "libgpt.so"), ("gpt", "ir", "gpt.tgir"), ("mlp", "llvm", "mlp.ll"),
              ("mlp", "asm", "mlp.s"), ("mlp", "obj", "mlp.o"))
    for seed in ("1", "2"):
        d = tmp_path / seed
        d.mkdir()
        for example, emit, name in builds:
            p = subprocess_tgc("build", ROOT / f"examples/{example}.tg", "--emit", emit, "-o", d / name, seed=seed)
            assert p.returncode == 0, p.stderr
    for f in sorted((tmp_path / "1").iterdir()):
        assert f.read_bytes() == (tmp_path / "2" / f.name).read_bytes(), f.name


def test_depfile_lists_nested_imports(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib/b.tg").write_text("fn twice(x) = 2 * x\n")
    (tmp_path / "lib/a.tg").write_text('import "b.tg"\nfn four(x) = twice(twice(x))\n')
    (tmp_path / "main model.tg").write_text('import "lib/a.tg"\ndim n = 3\ninput x[n]\nout y = four(x)\n')
    r = tgc("build", tmp_path / "main model.tg", "--emit", "ir", "-o", tmp_path / "m.tgir", "-MD")
    assert r.exit_code == 0, r.output
    dep = (tmp_path / "m.d").read_text()
    assert dep.startswith(f"{tmp_path}/m.tgir:")
    assert "main\\ model.tg" in dep and "lib/a.tg" in dep and "lib/b.tg" in dep
    assert "\nlib" not in dep.replace(str(tmp_path), "")  # no phony targets without -MP
    r = tgc("build", tmp_path / "main model.tg", "--emit", "ir", "-o", tmp_path / "m.tgir",
            "-MF", tmp_path / "deps.mk", "-MT", "custom", "-MP")
    assert r.exit_code == 0
    dep = (tmp_path / "deps.mk").read_text()
    assert dep.startswith("custom:")
    assert f"\n{tmp_path}/lib/a.tg:\n" in dep and f"\n{tmp_path}/lib/b.tg:\n" in dep


def test_a_failed_build_leaves_no_output(tmp_path, monkeypatch):
    from tgc.backends.cpu import aot

    out = tmp_path / "libmlp.so"
    out.write_bytes(b"older build")

    def broken(*args, **kwargs):
        raise aot.BuildError("linking failed: simulated")

    monkeypatch.setattr(aot, "link_shared", broken)
    r = tgc("build", MLP, "-o", out, "-MD")
    assert r.exit_code == 4
    assert out.read_bytes() == b"older build"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["libmlp.so"]  # no header, depfile or temp file


def test_exit_codes(tmp_path, monkeypatch):
    bad = tmp_path / "bad.tg"
    bad.write_text("dim n = 3\nout y = q\n")
    assert tgc("build", bad, "--emit", "ir", "-o", tmp_path / "x.tgir").exit_code == 1
    assert not (tmp_path / "x.tgir").exists()
    assert tgc("build", MLP, "-D", "batch").exit_code == 2
    assert tgc("build", MLP, "-D", "nodim=3", "--emit", "ir", "-o", tmp_path / "y").exit_code == 2
    assert tgc("build", MLP, "--emit", "ir", "-D", "batch=4", "-o", tmp_path / "ok.tgir").exit_code == 0
    assert "dim batch = 4" in (tmp_path / "ok.tgir").read_text()
    r = tgc("build", MLP, "--emit", "ir", "-D", f"batch={2 ** 61}", "-o", tmp_path / "big.tgir")
    assert r.exit_code == 2 and "input 'x' would take more than 2^62 bytes" in r.output, r.output
    assert not (tmp_path / "big.tgir").exists()
    src = tmp_path / "g.tg"
    src.write_text("dim v = 3, n = 2\ninput E[v]\ninput ids: i32[n]\nout y[n] = E[v = ids]\n")
    np.savez(tmp_path / "in.npz", E=np.ones(3), ids=np.array([0, 7], np.int32))
    r = tgc("run", src, "--inputs", tmp_path / "in.npz")
    assert r.exit_code == 3 and "out of range" in r.output
    from tgc import pipeline

    def crash(*a, **k):
        raise ZeroDivisionError("simulated bug")

    monkeypatch.setattr(pipeline, "lower", crash)
    r = tgc("build", MLP, "--emit", "ir", "-o", tmp_path / "z")
    assert r.exit_code == 4
    assert r.output.startswith("internal compiler error: ZeroDivisionError: simulated bug")
    assert "Traceback" not in r.output and "`tgc --debug ...`" in r.output   # a flag that exists
    r = tgc("--debug", "build", MLP, "--emit", "ir", "-o", tmp_path / "z")
    assert r.exit_code == 4 and "Traceback" in r.output


@pytest.mark.slow
@needs_cc
@needs_make
def test_examples_makefile_builds_runs_and_rebuilds_only_dependents(tmp_path):
    work = tmp_path / "examples"
    shutil.copytree(ROOT / "examples", work, ignore=shutil.ignore_patterns("out"))
    env = dict(os.environ, TGC=f"{sys.executable} -m tgc.cli")
    make = ["make", "-C", str(work), f"TGC={sys.executable} -m tgc.cli"]
    p = subprocess.run(make + ["-j4"], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "step 1 loss" in p.stdout
    built = sorted(f.name for f in (work / "out").glob("lib*.so"))
    assert built == sorted(f"lib{p.stem}.so" for p in (ROOT / "examples").glob("*.tg"))
    again = subprocess.run(make, capture_output=True, text=True, env=env)
    assert "tgc.cli build" not in again.stdout and "Nothing to be done" in again.stdout, again.stdout
    os.utime(work / "lib/transformer.tg")
    again = subprocess.run(make, capture_output=True, text=True, env=env)
    rebuilt = re.findall(r"build (\S+)\.tg", again.stdout)
    importers = sorted(p.stem for p in work.glob("*.tg") if 'import "lib/transformer.tg"' in p.read_text())
    assert "gpt" in importers and sorted(rebuilt) == importers, again.stdout
    assert subprocess.run(make + ["clean"], capture_output=True).returncode == 0
    assert not list((work / "out").iterdir())


FAKE_TGC = """#!/bin/sh
# `tgc build SRC -o out/libNAME.so ...`: the library, its header and its depfile
out=$4; name=$(basename "$out" .so); name=${name#lib}
sleep 0.1
echo library > "$out"; echo header > "$(dirname "$out")/$name.h"; echo "$out: $2" > "${out%.so}.d"
"""
FAKE_CC = """#!/bin/sh
# `cc ... -o out/mlp_main ...`: a driver that prints what the real one does
while [ "$1" != "-o" ]; do shift; done
printf '#!/bin/sh\\necho step 1 loss 1.0\\n' > "$2" && chmod +x "$2"
"""
SLOW_RM = "#!/bin/sh\nsleep 1\nexec rm -f \"$@\"\n"


@needs_make
def test_examples_makefile_clean_keeps_training_outputs_and_clean_all_runs_in_order(tmp_path):
    """examples/Makefile with stand-ins for tgc and cc (the rules, not the compiler):
    `clean` removes the build products only, not the training scripts' out/NAME/;
    `make clean all -j4` cleans before any build starts (a slow rm would otherwise
    delete what the parallel builds wrote); the driver's run is a file, so a second
    make has nothing to do."""
    work = tmp_path / "examples"
    shutil.copytree(ROOT / "examples", work, ignore=shutil.ignore_patterns("out"))
    tools = {}
    for name, text in (("tgc", FAKE_TGC), ("cc", FAKE_CC), ("rm", SLOW_RM)):
        tools[name] = tmp_path / f"fake-{name}"
        tools[name].write_text(text)
        tools[name].chmod(0o755)
    make = ["make", "-C", str(work), f"TGC={tools['tgc']}", f"CC={tools['cc']}", f"RM={tools['rm']}"]
    kept = work / "out/train_sort_gpt/params.safetensors"
    kept.parent.mkdir(parents=True)
    kept.write_text("trained")

    def run(*goals):
        p = subprocess.run(make + list(goals), capture_output=True, text=True)
        assert p.returncode == 0, p.stdout + p.stderr
        return p.stdout

    def products():
        return sorted(f.name for f in (work / "out").iterdir() if f.is_file())

    assert "step 1 loss" in run("-j4")
    built = products()
    libs = sorted(f"lib{p.stem}.so" for p in work.glob("*.tg"))
    assert set(libs) <= set(built) and "mlp_main.txt" in built and "mlp.h" in built
    assert "Nothing to be done for 'all'" in run()
    run("clean")
    assert products() == [] and kept.read_text() == "trained"
    run("clean", "all", "-j4")
    assert products() == built and kept.read_text() == "trained"
    assert "Nothing to be done for 'all'" in run()


def test_build_targets_come_from_the_backend_registry(tmp_path, monkeypatch):
    """`--target` chooses a backend by name: one more folder's backend with `emits`
    is a build target, with its own artifact kinds and companion files, and nothing
    in the command line names it."""
    from tgc.backends import base

    class Toy(base.Backend):
        name = "toy"
        emits = ("txt",)

        def companions(self, output, emit):
            return {"the notes": output + ".notes"}

        def build(self, module, low, options, emit, output, source):   # given the program lowered for it
            return {output: f"{source} as {emit} after {low.stage}\n".encode(), output + ".notes": b"toy\n"}

    monkeypatch.setattr(base, "_REGISTRY", {**base._registry(), "toy": "unused:Toy"})
    monkeypatch.setitem(base._LOADED, "toy", Toy())
    assert "toy" in base.build_targets() and "cuda-sim" not in base.build_targets()
    out = tmp_path / "m.txt"
    r = tgc("build", MLP, "--target", "toy", "-o", out, "-MD")
    assert r.exit_code == 0, r.output
    assert out.read_text() == "mlp.tg as txt after plan\n"
    assert (tmp_path / "m.txt.notes").read_text() == "toy\n" and (tmp_path / "m.d").exists()
    r = tgc("build", MLP, "--target", "toy", "--emit", "so", "-o", tmp_path / "x.so")
    assert r.exit_code == 2 and "--emit so is not an output of --target toy (it writes: txt, ir)" in r.output
    r = tgc("build", MLP, "--target", "cuda-sim", "-o", tmp_path / "y")
    assert r.exit_code == 2 and "'cuda-sim' is not one of" in r.output
    assert not (tmp_path / "x.so").exists() and not (tmp_path / "y").exists()


@pytest.mark.parametrize("flag", ["-O7", "-Os", "-Ofast", "-O"])
def test_an_optimization_level_it_lacks_is_named_in_the_usage_error(flag):
    """`tgc build -O7` said "No such option '-O'" (click reads -O7 as -O and 7): the
    usage error names the flag given and the levels there are."""
    r = tgc("build", MLP, flag, "--emit", "h", "-o", "-")
    assert r.exit_code == 2, r.output
    assert f"no such option: {flag} (the optimization levels are -O0, -O1, -O2, -O3)" in r.output, r.output


def test_an_option_value_that_starts_with_dash_O_is_a_value(tmp_path, monkeypatch):
    """`-o -Oname.h` names a file: the -O check reads only flags, not option values."""
    monkeypatch.chdir(tmp_path)
    r = tgc("build", MLP, "--emit", "h", "-o", "-Oname.h")
    assert r.exit_code == 0 and (tmp_path / "-Oname.h").exists(), r.output


@pytest.mark.skipif(sys.getfilesystemencoding() != "utf-8", reason="a file system whose names are UTF-8")
def test_a_source_name_that_is_not_utf8_builds_with_its_depfile(tmp_path):
    """A source file whose name has a byte that is not UTF-8 (b'\\xff'): the build
    succeeds (the header's comment encoded the name's surrogate: an internal compiler
    error), the header names it with the byte escaped, and the depfile names the file
    by its own bytes, so make finds it."""
    name = os.fsdecode(b"m\xffp.tg")
    shutil.copy(MLP, tmp_path / name)
    r = subprocess_tgc("build", name, "-MD", "-o", "libm.so", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert b"generated by tgc from m\\xffp.tg." in (tmp_path / "m.h").read_bytes()
    assert b"  m\xffp.tg \\\n" in (tmp_path / "libm.d").read_bytes()
