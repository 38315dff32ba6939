"""`tgc info` and a compiled program's own description: `print(program)`, `program.info()`,
`program.ir()` and `program.plan()`."""
from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

import tgc
from tgc.cli import main
from tgc.ir.parser import parse_module

ROOT = Path(__file__).parent.parent
MLP = ROOT / "examples/mlp.tg"


def info(*args) -> str:
    r = CliRunner().invoke(main, ["info", *map(str, args)])
    assert r.exit_code == 0, r.output
    return r.output


def test_json_lists_everything_in_abi_order():
    data = json.loads(info(MLP, "--format", "json"))
    assert data["file"] == str(MLP) and data["dtype"] == "f32"
    assert data["dims"][0] == {"name": "batch", "kind": "symbolic", "size": None, "edges": []}
    assert {"name": "hidden", "kind": "fixed", "size": 64, "edges": []} in data["dims"]
    args = data["arguments"]
    assert [(a["position"], a["kind"], a["name"]) for a in args] == [
        (0, "input", "x"), (1, "input", "y"), (2, "param", "W1"), (3, "param", "b1"),
        (4, "param", "W2"), (5, "param", "b2"), (6, "input", "lr")]
    assert args[0]["edges"] == ["batch", "features"] and args[0]["shape"] == ["batch", 13]
    assert args[2]["updated"] and not args[0]["updated"] and args[6]["shape"] == []
    assert all(a["dtype"] == "f32" for a in args)
    assert [o["name"] for o in data["outputs"]] == ["loss", "correct", "probs"]
    assert data["outputs"][2]["shape"] == ["batch", 3]
    assert [(u["target"], u["result"], u["kind"]) for u in data["updates"]] == [
        ("W1", "W1", "param"), ("b1", "b1", "param"), ("W2", "W2", "param"), ("b2", "b2", "param")]


def test_sizes_derived_fixed_and_ids(tmp_path):
    src = tmp_path / "p.tg"
    src.write_text("dim n\ndim m = 2 * n\ndim v = 5\ninput ids: i32[n]\nparam E[v, k: m]\n"
                   "state s[n]\nout e = E[v = ids]\nout s\nupdate s = s + 1\n")
    data = json.loads(info(src, "--format", "json", "--dtype", "f64"))
    dims = {d["name"]: d for d in data["dims"]}
    assert dims["m"] == {"name": "m", "kind": "derived", "size": "2 * n", "edges": ["k"]}
    args = {a["name"]: a for a in data["arguments"]}
    assert args["ids"]["dtype"] == "i32" and args["E"]["dtype"] == "f64"
    assert args["E"]["shape"] == [5, "2 * n"] and args["s"]["kind"] == "state"
    assert data["updates"] == [{"target": "s", "result": "s'", "kind": "state", "edges": ["n"],
                                "shape": ["n"], "dtype": "f64"}]
    # -D fixes a dim (and what derives from it)
    fixed = json.loads(info(src, "--format", "json", "-D", "n=4"))
    assert {a["name"]: a["shape"] for a in fixed["arguments"]}["E"] == [5, 8]
    text = info(src)
    assert "2 * n" in text and "s'" in text and "i32" in text


def test_text_tables():
    text = info(MLP)
    lines = text.splitlines()
    assert lines[0] == f"{MLP}: f32"
    assert any(line.split()[:3] == ["0", "input", "x"] and "[batch, features]" in line and "[batch, 13]" in line
               for line in lines)
    assert any(line.split()[:3] == ["2", "param", "W1"] and "updated in place" in line for line in lines)
    assert "outputs:" in lines and any(line.startswith("updates") for line in lines)


def test_errors_and_ir_input(tmp_path):
    r = CliRunner().invoke(main, ["info", str(tmp_path / "missing.tg")])
    assert r.exit_code != 0
    r = CliRunner().invoke(main, ["info", str(MLP), "-D", "hidden=3"])
    assert r.exit_code == 2 and "-D" in r.output
    ir = tmp_path / "m.tgir"
    assert CliRunner().invoke(main, ["dump-ir", str(MLP), "-o", str(ir)]).exit_code == 0
    data = json.loads(info(ir, "--format", "json"))
    assert [a["name"] for a in data["arguments"]] == ["x", "y", "W1", "b1", "W2", "b2", "lr"]


def test_program_describes_itself():
    prog = tgc.compile(MLP)
    text = str(prog)
    assert text == tgc.info.format_info(prog.info())
    assert "[batch, features]" in text and "updated in place" in text
    assert prog.info()["arguments"] == json.loads(info(MLP, "--format", "json"))["arguments"]
    # the IR parses back; the plan is the lowered program
    module = parse_module(prog.ir(), "<ir>")
    assert list(module.args) == ["x", "y", "W1", "b1", "W2", "b2", "lr"]
    assert prog.plan().startswith("// lowered after plan") and "\nk0: " in prog.plan()
    assert repr(prog).startswith("<tgc.Program (")
