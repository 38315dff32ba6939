"""Diagnostics forms (caret, underline, notes, warnings, colour), pass timing,
IR pictures (dot, json) and shell completion."""
import json
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from tgc.cli import main

ROOT = Path(__file__).parent.parent
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


def test_shell_completion_scripts():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for shell in ("bash", "zsh", "fish"):
        p = subprocess.run([sys.executable, "-c", "from tgc.cli import main; main(prog_name='tgc')"],
                           capture_output=True, text=True, env={**env, "_TGC_COMPLETE": f"{shell}_source"})
        assert p.returncode == 0 and "tgc" in p.stdout and len(p.stdout) > 100, shell
