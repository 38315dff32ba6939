"""Diagnostics forms (caret, underline, notes, warnings, colour), pass timing,
IR pictures (dot, json) and shell completion."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tgc.cli import main

ROOT = Path(__file__).parents[2]
MLP = str(ROOT / "examples/mlp.tg")


def tgc(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def test_error_underlines_the_whole_range_and_adds_notes(tmp_path):
    f = tmp_path / "e.tg"
    f.write_text("dim n = 3, m = 4\ninput A[i: n]\ninput B[i: m]\n")
    r = tgc("check", f)
    assert r.exit_code == 1
    lines = r.output.splitlines()
    assert lines[0] == f"{f}:3:9: error: edge 'i' is used with two sizes: m = 4 here, n = 3 before"
    assert lines[1] == " input B[i: m]" and lines[2] == "         ^~~~"
    assert lines[3] == f"{f}:2:9: note: 'i' got its size here"


def test_warnings_werror_and_colour(tmp_path):
    f = tmp_path / "w.tg"
    f.write_text("dim n = 3\ninput x[n], unused[n]\nh = x * 2\nout y = x\n")
    r = tgc("check", f)
    assert r.exit_code == 0
    assert f"{f}:2:13: warning: input 'unused' is never used" in r.output
    assert f"{f}:3:1: warning: 'h' is never used" in r.output
    assert tgc("check", "-Werror", f).exit_code == 1
    assert tgc("check", "-w", f).output == ""
    coloured = tgc("--color=always", "check", f).output
    assert "\x1b[1;35mwarning:\x1b[0m" in coloured
    assert "\x1b[" not in tgc("--color=never", "check", f).output
    env = dict(os.environ, NO_COLOR="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "tgc.cli", "check", str(f)], capture_output=True, text=True, env=env)
    assert "\x1b[" not in p.stderr


def test_time_passes_table():
    r = CliRunner().invoke(main, ["dump-ir", MLP, "--time-passes", "-o", os.devnull])
    assert r.exit_code == 0
    text = r.output
    assert "tgc pass execution timing" in text
    for name in ("normalize", "adjoint", "simplify", "total"):
        assert name in text


def test_print_ir_after_all_names_each_pass():
    r = CliRunner().invoke(main, ["dump-ir", MLP, "--print-ir-after-all", "-o", os.devnull])
    assert r.exit_code == 0
    for name in ("normalize", "adjoint", "tangent", "simplify", "factor"):
        assert f"// ----- IR after {name} -----" in r.output


def test_dot_and_json_pictures():
    dot = tgc("dump-ir", MLP, "--format", "dot").output
    assert dot.startswith("digraph tgc {") and dot.rstrip().endswith("}")
    assert '"%x" [label="input x\\n[batch, features]", shape=box];' in dot
    assert "-> \"out loss\"" in dot
    doc = json.loads(tgc("dump-ir", MLP, "--format", "json").output)
    assert [a["name"] for a in doc["args"]] == ["x", "y", "W1", "b1", "W2", "b2", "lr"]
    assert {o["name"] for o in doc["outputs"]} == {"loss", "correct", "probs"}
    ids = {v["id"] for v in doc["values"]} | {a["name"] for a in doc["args"]}
    assert all(op in ids for v in doc["values"] for op in v["operands"])


@pytest.mark.slow
def test_shell_completion_scripts():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for shell in ("bash", "zsh", "fish"):
        p = subprocess.run([sys.executable, "-c", "from tgc.cli import main; main(prog_name='tgc')"],
                           capture_output=True, text=True, env={**env, "_TGC_COMPLETE": f"{shell}_source"})
        assert p.returncode == 0 and "tgc" in p.stdout and len(p.stdout) > 100, shell


# ---- found by a toolchain probe ------------------------------------------------------------------


def test_build_refuses_outputs_that_are_one_file_and_keeps_old_files_on_failure(tmp_path):
    src = tmp_path / "m.tg"
    src.write_text(Path(MLP).read_text())
    for args, words in ((["-o", src], "the output"), (["-o", tmp_path / "col.h"], "the header"),
                        (["-o", tmp_path / "libm.so", "-MF", tmp_path / "libm.so"], "the depfile"),
                        (["-o", tmp_path / "libm.so", "-MF", tmp_path / "m.h"], "the depfile")):
        r = tgc("build", src, *args)
        assert r.exit_code == 2 and words in r.output and "would overwrite" in r.output, r.output
    assert src.read_text() == Path(MLP).read_text()
    # the header's path is a folder: the build fails, and the old library stays
    (tmp_path / "q.h").mkdir()
    (tmp_path / "libq.so").write_text("OLD")
    r = tgc("build", src, "-o", tmp_path / "libq.so")
    assert r.exit_code == 2 and "q.h" in r.output and ".tmp" not in r.output, r.output
    assert (tmp_path / "libq.so").read_text() == "OLD"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_build_names_and_streams(tmp_path):
    src = tmp_path / "model.v2.tg"
    src.write_text(Path(MLP).read_text())
    assert tgc("build", src, "-o", tmp_path / "libmodel.v2.so").exit_code == 0
    assert (tmp_path / "model_v2.h").exists() and "model_v2_run" in (tmp_path / "model_v2.h").read_text()
    r = tgc("build", src, "--emit", "llvm", "-o", "-")
    assert r.exit_code == 0 and "define" in r.output and not Path("-").exists()
    r = tgc("build", src, "-o", "-")
    assert r.exit_code == 2 and "standard output" in r.output
    r = tgc("build", src, "-o", tmp_path / "libt.so", "-MD", "-MT", "a b", "-MT", "$(X)")
    assert (tmp_path / "libt.d").read_text().startswith("a b $(X):"), (tmp_path / "libt.d").read_text()


def test_run_input_problems_are_errors_not_crashes(tmp_path):
    import zipfile

    import numpy as np

    np.save(tmp_path / "x.npy", np.zeros(3))
    with zipfile.ZipFile(tmp_path / "junk.npz", "w") as z:
        z.writestr("x.npy", b"garbage")
    for args, code, words in ((["--inputs", tmp_path / "x.npy"], 3, "not an .npz archive"),
                              (["--inputs", tmp_path / "junk.npz"], 3, "cannot read inputs"),
                              (["--inputs", MLP], 3, "not an .npz archive of arrays"),
                              (["--random-inputs", "--seed", "-1"], 2, "--seed"),
                              (["--random-inputs", "--dim", "batch=99999999999999999999"], 2, "2^62"),
                              (["--random-inputs", "-o", "-"], 2, "standard output")):
        r = tgc("run", MLP, *args)
        assert r.exit_code == code and words in r.output and "internal" not in r.output, (args, r.output)
    r = tgc("dump-ir", MLP, "--after", "fuse", "-p", "normalize")
    assert r.exit_code == 1 and "'grad' is left in the program" in r.output
    r = tgc("dump-ir", MLP, "--format", "json", "--after-all")
    assert r.exit_code == 2 and "--format json" in r.output


def test_opt_reads_dumps_back_and_runs_the_default_pipeline(tmp_path):
    ir = tmp_path / "m.tgir"
    ir.write_bytes(b"\xef\xbb\xbf" + tgc("dump-ir", MLP, "--after", "elaborate").output.encode())
    assert tgc("opt", ir).output == tgc("dump-ir", MLP).output
    low = tmp_path / "low.txt"
    low.write_text(tgc("dump-ir", MLP, "--after", "fuse").output)
    assert tgc("opt", low).output == tgc("dump-ir", MLP, "--after", "plan").output   # the stages after fuse
    as_ir = tmp_path / "low.tgir"
    as_ir.write_text(low.read_text())
    r = tgc("info", as_ir)
    assert r.exit_code == 1 and "this is a lowered program (a dump of a lowering stage), not IR" in r.output
    for name in ("low.tgl", "low.tg"):   # any other suffix is read as .tg source: the same message, not a
        other = tmp_path / name         # syntax error at the first '/'
        other.write_text(low.read_text())
        for command in ("run", "check", "build"):
            r = tgc(command, other)
            assert r.exit_code == 1 and "this is a lowered program (a dump of a lowering stage)" in r.output \
                and "tgc opt" in r.output, (name, command, r.output)


def test_ids_beyond_int32_are_refused_by_both_backends(tmp_path):
    import numpy as np

    emb = str(ROOT / "examples/embedding.tg")
    from tgc import pipeline
    from tgc.options import Options

    m = pipeline.load(emb, Options())
    ids = [a for a in m.args.values() if a.dtype == "i32"][0]
    dims = {d: 4 for d in m.symbolic_dims()}
    want = tuple(int(m.size(e)) if isinstance(m.size(e), int) else dims[m.edges[e]] for e in ids.order)
    np.save(tmp_path / "ids.npy", np.full(want, 2**33 + 3, np.int64))
    for backend in ("interp", "cpu"):
        r = tgc("run", emb, "--random-inputs", "--input", f"{ids.name}={tmp_path / 'ids.npy'}", "--backend", backend)
        assert r.exit_code == 3 and "do not fit in int32" in r.output, (backend, r.output)


def test_an_ir_file_is_built_in_its_own_float_type_unless_dtype_says(tmp_path):
    import numpy as np

    ir = tmp_path / "e64.tgir"
    ir.write_text(tgc("dump-ir", MLP, "--dtype", "f64").output)
    for dtype, want in ((None, np.float64), ("f32", np.float32)):
        out = tmp_path / f"r{dtype}.npz"
        r = tgc("run", ir, "--random-inputs", "-o", out, *(["--dtype", dtype] if dtype else []))
        assert r.exit_code == 0, r.output
        with np.load(out) as z:
            assert z["loss"].dtype == want
    assert "f64" in tgc("opt", ir, "-p", "").output
    assert tgc("build", ir, "-o", tmp_path / "libe.so").exit_code == 0
    assert "Floats are double" in (tmp_path / "e.h").read_text()
