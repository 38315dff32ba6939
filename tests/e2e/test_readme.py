"""The README runs as written: its Python snippet, its tour (into a scratch folder),
its set-up commands (the test command is the one CI runs), and it points only to
files a clone has. So do docs/ and benchmarks/README.md where a check is cheap: the
paths, Python names and command-line flags they name exist, their whole programs
check, and the outputs they show (tgc grad's loop derivative, tgc explain's loop
line, the optimizer's before/after table) are what tgc prints now."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    return README[start:end if end >= 0 else None]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def env() -> dict:
    """This interpreter's environment, with its scripts (`tgc`) first on PATH."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def test_the_python_snippet_runs_as_written():
    (snippet,) = blocks(README, "python")
    r = subprocess.run([sys.executable, "-c", snippet], cwd=ROOT, capture_output=True, text=True, env=env(),
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert "arguments (ABI order" in r.stdout and re.search(r"^loss \d", r.stdout, re.M)


def test_set_up_uses_a_venv_and_ci_runs_the_same_test_command():
    (setup,) = blocks(section("Set-up"), "sh")
    lines = [line.split("#")[0].strip() for line in setup.strip().splitlines()]
    assert lines[0] == "python3 -m venv .venv && . .venv/bin/activate"
    install, test = lines[1], lines[2]
    assert install.startswith("python -m pip install -e . && python examples/")
    assert (ROOT / install.split("python ")[-1].split()[0]).is_file()
    assert "torch==2.13.0" in test and test.endswith("python -m pytest --run-slow -n auto")
    ci = (ROOT / ".ci/run").read_text().splitlines()
    assert test in ci


@pytest.mark.slow
def test_the_first_set_up_command_runs():
    (setup,) = blocks(section("Set-up"), "sh")
    command = setup.strip().splitlines()[1].split("#")[0].split("&&")[1].strip()
    r = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, env=env(), timeout=600)
    assert r.returncode == 0, r.stderr
    assert "held-out exact-sequence accuracy after 600 steps: 100.0%" in r.stdout, r.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None, reason="tgc build links with cc")
def test_the_tour_runs_as_written_into_a_scratch_folder(tmp_path):
    (tour,) = blocks(section("A tour"), "sh")
    assert "/tmp/tour" in tour and "command -v dot" in tour
    script = tour.replace("/tmp/tour", str(tmp_path / "tour"))
    before = set(os.listdir(ROOT))
    r = subprocess.run(["bash", "-e", "-c", script], cwd=ROOT, capture_output=True, text=True, env=env(),
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert set(os.listdir(ROOT)) == before                     # nothing new in the repository
    made = set(os.listdir(tmp_path / "tour"))
    assert {"mlp.tgir", "mlp.dot", "step1.npz", "libmlp.so", "mlp.h"} <= made
    assert ("mlp.svg" in made) == (shutil.which("dot") is not None)


def test_the_tours_next_step_lowers_the_loss_it_states(tmp_path):
    """The tour's first step and "the next step" (a fixed learning rate, the same
    seeded batch) give the losses the text after the tour states, the second lower."""
    (tour,) = blocks(section("A tour"), "sh")
    lines = [line for line in tour.splitlines() if line.startswith("mkdir") or "lr.npy" in line]
    assert len(lines) == 4 and "-o /tmp/tour/step1.npz" in lines[2] and "--inputs /tmp/tour/step1.npz" in lines[3]
    script = "\n".join(lines).replace("/tmp/tour", str(tmp_path))
    r = subprocess.run(["bash", "-e", "-c", script], cwd=ROOT, capture_output=True, text=True, env=env(), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    import numpy as np

    first = float(np.load(tmp_path / "step1.npz")["loss"])
    second = float(re.search(r"^loss\[\] float32 shape=\(\) = \[(\S+)\]", r.stdout, re.M).group(1))
    stated = re.search(r"its loss\s+is lower \(([\d.]+), after the first step's ([\d.]+),", README)
    assert stated, "the README states both losses"
    assert f"{second:.1f}" == stated.group(1) and f"{first:.1f}" == stated.group(2)
    assert second < first


@pytest.mark.slow
def test_the_training_tables_seed_0_figures_are_what_the_scripts_print(tmp_path):
    """The command the text under the table names, for each script, prints the figure
    of the "reaches (seed 0)" column."""
    table = section("Training")
    row = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(train_\w+)\.py` \|[^|]*\|[^|]*\| ([^|]*) \|", table, re.M)}
    assert "`python examples/train_NAME.py --no-torch --threads 1 [--seed S]`" in " ".join(table.split())
    low, high = map(int, re.search(r"first at step (\d+)-(\d+) ", row["train_sort_gpt"]).groups())
    want = {"train_sort_gpt": "|".join(str(s) for s in range(low, high + 1, 50)),   # evaluated every 50 steps
            "train_digits": re.search(r"([\d.]+)% test accuracy", row["train_digits"]).group(1),
            "train_wine": re.search(r"(\d+)% of the 45 test wines", row["train_wine"]).group(1)}
    for name, figure in want.items():
        r = subprocess.run([sys.executable, f"examples/{name}.py", "--no-torch", "--threads", "1", "--seed", "0",
                            "--out", str(tmp_path / name)], cwd=ROOT, capture_output=True, text=True, env=env(),
                           timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        printed = {"train_sort_gpt": rf"sorted right first at step ({figure}) ",
                   "train_digits": rf"test accuracy after 600 steps \([\d.]+ epochs\): {re.escape(figure)}0?%",
                   "train_wine": rf"test accuracy after 300 steps: {figure}\.0% of 45 wines"}[name]
        assert re.search(printed, r.stdout), (name, r.stdout[-1500:])


def test_no_pointer_outside_the_repository():
    for path in [ROOT / "README.md", ROOT / "docs/language.md"]:
        text = path.read_text()
        assert "shared/" not in text and "LANGUAGE.md" not in text and "DESIGN.md" not in text, path
    assert "docs/language.md" in section("Layout")


# --- docs/ and benchmarks/README.md: what they name exists, and what they show is printed

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks/README.md"]
LLVM_NAMES = {"tgc.run", "tgc.sN", "tgc.region", "tgc.parallel_now", "tgc.gemm.bf16"}
"""Names in the docs that look like Python but are the LLVM functions the CPU backend
generates (tgc/backends/cpu/codegen.py, sizecheck.py, gemm_bf16.py)."""


def spans(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every `inline code` span of a doc."""
    text = path.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in re.finditer(r"`([^`\n]+)`", text)]


def doc_blocks(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every fenced block of a doc."""
    text = path.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1))
            for m in re.finditer(r"^```\w*\n(.*?)^```", text, re.S | re.M)]


def test_the_docs_name_only_paths_that_exist():
    missing = []
    for doc in DOCS:
        for line, code in spans(doc):
            for p in re.findall(r"(?<![\w/.])((?:tgc|tests|benchmarks|examples|scripts|docs|grammar)/[\w./{},*-]+)", code):
                p = p.rstrip(".,")
                # NAME, W and out/NAME are placeholders; tgc/1 thread, tgc/numpy, ... are table columns
                if re.search(r"NAME|/W\.tg$|^tgc/(bound|numpy|torch|t\.compile|1)$", p):
                    continue
                brace = re.search(r"\{([^}]*)\}", p)
                for one in [p[:brace.start()] + alt + p[brace.end():] for alt in brace.group(1).split(",")] if brace else [p]:
                    if not (any(ROOT.glob(one)) if "*" in one else (ROOT / one).exists()):
                        missing.append(f"{doc.relative_to(ROOT)}:{line}: {one}")
    assert not missing, "\n".join(missing)


def test_the_docs_python_names_resolve():
    import importlib

    unresolved = []
    for doc in DOCS:
        for line, code in spans(doc):
            for name in re.findall(r"(?<![\w.])(tgc(?:\.\w+)+)", code):
                if name in LLVM_NAMES or name.startswith("tgc.torch"):   # tgc.torch needs PyTorch
                    continue
                parts = name.split(".")
                for i in range(len(parts), 0, -1):
                    try:
                        obj = importlib.import_module(".".join(parts[:i]))
                        break
                    except ImportError:
                        continue
                for attr in parts[i:]:
                    obj = getattr(obj, attr, None)
                if obj is None:
                    unresolved.append(f"{doc.relative_to(ROOT)}:{line}: {name}")
    assert not unresolved, "\n".join(unresolved)


def test_every_tgc_flag_the_docs_name_is_an_option_of_its_command():
    from click.testing import CliRunner

    from tgc.cli import main

    helps = {name: CliRunner().invoke(main, [name, "--help"]).output for name in main.commands}
    wrong = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"(?:`|^)tgc ([a-z-]+)\b([^`\n]*)", text, re.M):
            if m.group(1) not in helps:
                continue
            for flag in re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", m.group(2)):
                flag = flag.split("=")[0]
                if not re.match(r"-O\d$", flag) and not re.search(rf"(?<![\w-]){re.escape(flag)}\b", helps[m.group(1)]):
                    wrong.append(f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: "
                                 f"tgc {m.group(1)} has no {flag}")
    assert not wrong, "\n".join(wrong)


def test_every_benchmark_flag_the_docs_name_is_an_argument_of_its_script():
    wrong = []
    for doc in DOCS:
        for line, code in spans(doc):
            m = re.match(r"(?:python )?(benchmarks/\w+\.py)(.*)", code)
            if not m:
                continue
            source = (ROOT / m.group(1)).read_text()
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", m.group(2)):
                if f'"{flag}"' not in source and f"'{flag}'" not in source:
                    wrong.append(f"{doc.relative_to(ROOT)}:{line}: {m.group(1)} has no {flag}")
    assert not wrong, "\n".join(wrong)


def test_the_docs_whole_programs_check(tmp_path):
    """Every fenced block of the docs that is a whole program (a `dim`, and an `out` or
    `update`) passes `tgc check` as written."""
    from click.testing import CliRunner

    from tgc.cli import main

    programs = [(doc, line, code) for doc in DOCS for line, code in doc_blocks(doc)
                if re.search(r"^dim ", code, re.M) and re.search(r"^(out|update) ", code, re.M)
                and "\n..." not in code and not code.startswith("# generated")]
    assert len(programs) >= 4, programs
    for doc, line, code in programs:
        src = tmp_path / f"{doc.stem}_{line}.tg"
        src.write_text(code)
        r = CliRunner().invoke(main, ["check", str(src)])
        assert r.exit_code == 0, (f"{doc.relative_to(ROOT)}:{line}", r.output)


def test_grads_loop_example_is_what_tgc_grad_prints(tmp_path):
    """docs/grad.md's loop example: each line it shows of the printed derivative (its
    "..." standing for lines left out) is a line tgc grad prints, in that order."""
    from click.testing import CliRunner

    from tgc.cli import main

    doc = ROOT / "docs/grad.md"
    text = doc.read_text()
    command = re.search(r"`tgc grad FILE ([^`]+)` of", text).group(1)
    (_, program), (_, shown) = [b for b in doc_blocks(doc) if "repeat[layer]" in b[1]][:2]
    src = tmp_path / "loop.tg"
    src.write_text(program)
    r = CliRunner().invoke(main, ["grad", str(src), *command.split()])
    assert r.exit_code == 0, r.output
    printed = [line.strip() for line in r.output.splitlines()]
    at = 0
    lines = [line.split("#")[0].strip() for line in shown.splitlines()]
    lines = [line for line in lines if line and line != "..."]
    assert len(lines) >= 20
    for line in lines:
        assert line in printed[at:], (line, r.output)
        at = printed.index(line, at) + 1


OPT_TABLE = re.compile(r"^\| (\w+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d, /]+) \|$", re.M)
OPT_ROWS = OPT_TABLE.findall((ROOT / "docs/optimization.md").read_text())


@pytest.mark.parametrize("row", [pytest.param(r, id=r[0]) for r in OPT_ROWS])
def test_optimizations_before_after_table_is_what_the_stats_print(row):
    """docs/optimization.md, "Before/after, every example": a row is the last line of
    `tgc dump-ir --stats` before (`-p adjoint,tangent`) and after the default pipeline."""
    from click.testing import CliRunner

    from tgc.cli import main

    name, *numbers = row
    got = []
    for passes in (["-p", "adjoint,tangent"], []):
        r = CliRunner().invoke(main, ["dump-ir", str(ROOT / f"examples/{name}.tg"), *passes, "--stats"])
        assert r.exit_code == 0, r.output
        last = [line for line in r.stderr.splitlines() if line.strip()][-1].split()
        got.append(last[:4])
    (ob, fb, bb, lb), (oa, fa, ba, la) = got
    largest = lb if lb == la else f"{lb} / {la}"
    assert numbers == [ob, oa, fb, fa, bb, ba, largest], (name, numbers)


def test_optimizations_table_lists_every_example():
    assert {r[0] for r in OPT_ROWS} == {p.stem for p in (ROOT / "examples").glob("*.tg")}


def test_languages_loop_memory_line_is_what_tgc_explain_prints():
    """docs/language.md, "Loops over an edge": the line it shows of `tgc explain
    examples/train_sort_gpt.tg -D batch=64`."""
    from click.testing import CliRunner

    from tgc.cli import main

    text = (ROOT / "docs/language.md").read_text()
    command = re.search(r"`tgc explain (examples/train_sort_gpt\.tg -D batch=64)` prints", text).group(1).split()
    shown = re.search(r"prints\n\n```\n(.*?)\n```", text[text.index("`tgc explain examples/train_sort_gpt"):], re.S)
    r = CliRunner().invoke(main, ["explain", str(ROOT / command[0]), *command[1:]])
    assert r.exit_code == 0, r.output
    assert shown.group(1) in r.output.splitlines(), r.output


def test_optimizations_per_pass_stats_and_hand_written_ratios_are_what_tgc_prints():
    """docs/optimization.md: the per-pass table of `tgc dump-ir examples/gpt.tg --stats`,
    and the FLOPs of the derived against the hand-written backward passes (layernorm,
    softmax, gelu) in "Measured targets"."""
    from click.testing import CliRunner

    from tgc.cli import main

    text = (ROOT / "docs/optimization.md").read_text()
    shown = re.search(r"`tgc dump-ir examples/gpt\.tg --stats`:\n\n```\n(.*?)```", text, re.S).group(1)
    r = CliRunner().invoke(main, ["dump-ir", str(ROOT / "examples/gpt.tg"), "--stats"])
    assert r.exit_code == 0 and r.stderr == shown, r.stderr

    def flops(path):
        r = CliRunner().invoke(main, ["dump-ir", str(ROOT / path), "--stats"])
        return r.stderr.strip().splitlines()[-1].split()[1]

    for name in ("layernorm", "softmax", "gelu"):
        row = re.search(rf"^\| {name} backward within 1\.3x[^|]*\| ([\d,]+) vs ([\d,]+)", text, re.M)
        assert row.groups() == (flops(f"tests/golden/{name}_grad.tg"), flops(f"tests/golden/{name}_hand.tg")), name


def test_every_pass_the_docs_dump_after_exists():
    """`dump-ir --after NAME` (or `--after a|b|c`) in the docs names a pass or a lowering
    stage of some backend."""
    from tgc.backends.base import pass_registry

    known = {"elaborate", *pass_registry()}
    named = [(doc, line, name) for doc in DOCS for line, code in spans(doc)
             for m in re.finditer(r"--after ([\w|]+)", code) for name in m.group(1).split("|")]
    assert len(named) >= 10
    unknown = [f"{doc.relative_to(ROOT)}:{line}: {name}" for doc, line, name in named
               if name not in known and not name.isupper()]   # STAGE: a placeholder
    assert not unknown, unknown


def test_the_layouts_folders_and_files_exist():
    """Every folder and file the README's "Layout" tree names is in the repository
    (a file by its name in its folder, or anywhere under tgc/)."""
    (tree,) = blocks(section("Layout"), "")
    missing, folder = [], None
    for line in tree.splitlines():
        head = re.match(r"(\S+)\s", line)
        if head:
            folder = head.group(1)
            if not (ROOT / folder).exists():
                missing.append(folder)
        base = ROOT / (folder if folder.endswith("/") else str(Path(folder).parent))
        for name in re.findall(r"\b(\w+\.(?:py|lark|tg|json))\b", line):
            if not (base / name).exists() and not any((ROOT / "tgc").rglob(name)):
                missing.append(f"{name} (near {folder})")
    assert not missing, missing
