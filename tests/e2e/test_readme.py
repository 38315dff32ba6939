"""The README runs as written: its Python snippet, its tour (into a scratch folder),
its set-up commands (the test command is the one CI runs), and it points only to
files a clone has."""
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
