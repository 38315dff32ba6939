"""The training examples (`examples/train_*.py`) train, and their .tg steps are right.

Each script runs in `--quick` mode in a subprocess, as a user runs it: it exits 0, its
loss goes down, and it writes parameters that `tgc.load_params` reads back, its plot
(or a note without matplotlib) and a summary. Without the optional packages (tqdm,
matplotlib, PyTorch, scikit-learn) the scripts still run, with one note each, or stop
with a clear message where the data need scikit-learn.

The optimizers written in .tg (AdamW in train_sort_gpt.tg, Adam in train_digits.tg) are
checked against PyTorch's (`torch.optim.AdamW` / `Adam`) on the scripts' own PyTorch
twins of the models, in float64: two steps from random weights, then every parameter,
both moments and the step counter. That also shows the twins are the same models, so
the step times the scripts print side by side compare like with like.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tgc

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _module(name: str):
    """examples/NAME.py, imported (its main() is not run)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _run(script: str, *args: str, block: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run examples/SCRIPT with `args`; the modules in `block` cannot be imported."""
    path = str(EXAMPLES / script)
    code = ("import runpy, sys\n"
            f"for m in {block!r}: sys.modules[m] = None\n"
            f"sys.argv = [{path!r}, *{list(args)!r}]\n"
            f"runpy.run_path({path!r}, run_name='__main__')\n")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)


# ---------------------------------------------------------------- the scripts run and train

SCRIPTS = {"train_wine.py": (), "train_digits.py": ("sklearn",), "train_sort_gpt.py": ()}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_quick_run_trains_and_writes_its_outputs(script, tmp_path):
    for needed in SCRIPTS[script]:
        if not _have(needed):
            pytest.skip(f"{script} needs {needed} (pip install -e '.[examples]')")
    r = _run(script, "--quick", "--seed", "3", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    losses = summary["losses"]
    assert len(losses) == summary["steps"] >= 10 and all(np.isfinite(losses))
    third = len(losses) // 3
    assert np.mean(losses[-third:]) < 0.9 * np.mean(losses[:third]), losses
    assert summary["evaluations"] and summary["evaluations"][-1]["step"] == summary["steps"]

    program = tgc.compile(EXAMPLES / ("mlp.tg" if script == "train_wine.py" else script.replace(".py", ".tg")))
    saved = tgc.load_params(tmp_path / "params.safetensors", program)
    assert set(saved) == {s.name for s in program.inputs if s.kind in ("param", "state")}
    if "step" in saved:
        assert saved["step"] == summary["steps"]              # the optimizer's step counter, in .tg state

    if _have("matplotlib"):
        assert (tmp_path / "training.png").stat().st_size > 10_000
    else:
        assert "note: matplotlib is not installed" in r.stdout
    if _have("torch"):
        # the PyTorch twin starts from the same weights and sees the same batches
        assert summary["torch_steps"] >= 5 and summary["torch_step_ms"] > 0
        k = summary["torch_steps"]
        assert summary["torch_losses"][-1] == pytest.approx(losses[k - 1], rel=1e-3)
        assert "step time, batch" in r.stdout and "tgc/PyTorch" in r.stdout
    else:
        assert "note: PyTorch is not installed" in r.stdout


@pytest.mark.slow
def test_same_seed_same_run(tmp_path):
    runs = []
    for out in ("a", "b"):
        r = _run("train_wine.py", "--quick", "--steps", "12", "--no-torch", "--out", str(tmp_path / out),
                 block=("matplotlib",))
        assert r.returncode == 0, r.stderr
        runs.append(json.loads((tmp_path / out / "summary.json").read_text()))
    assert runs[0]["losses"] == runs[1]["losses"] and runs[0]["evaluations"] == runs[1]["evaluations"]


def test_runs_without_the_optional_packages(tmp_path):
    r = _run("train_wine.py", "--quick", "--out", str(tmp_path), block=("tqdm", "matplotlib", "torch", "sklearn"))
    assert r.returncode == 0, r.stdout + r.stderr
    for missing in ("tqdm", "matplotlib", "PyTorch", "scikit-learn"):
        assert f"note: {missing} is not installed" in r.stdout, r.stdout
    assert "synthetic stand-in" in r.stdout
    assert "step     20/20  loss " in r.stdout                  # plain progress lines
    assert (tmp_path / "params.safetensors").exists() and not (tmp_path / "training.png").exists()


def test_digits_without_scikit_learn_says_what_to_install(tmp_path):
    r = _run("train_digits.py", "--quick", "--out", str(tmp_path), block=("sklearn",))
    assert r.returncode == 1
    assert "needs scikit-learn" in r.stderr and "pip install" in r.stderr and "Traceback" not in r.stderr


def test_bad_arguments_are_usage_errors():
    r = _run("train_wine.py", "--steps", "0")
    assert r.returncode == 2 and "--steps must be at least 1" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------- the .tg optimizers against PyTorch's

def _start(program, seed: int) -> dict:
    """Random params (N(0, 0.3^2)) and zero states for `program`, float64."""
    rng = np.random.default_rng(seed)
    return {s.name: (np.zeros(s.shape) if s.kind == "state" else 0.3 * rng.standard_normal(s.shape))
            for s in program.inputs if s.kind in ("param", "state")}


def _kind(program, name: str) -> str:
    return next(s.kind for s in program.inputs if s.name == name)


def _moment(arrays: dict, which: str, param: str) -> np.ndarray:
    """A moment of `param`: `m.NAME` (declared by a for block) or `m_NAME` (written out)."""
    return arrays[f"{which}.{param}"] if f"{which}.{param}" in arrays else arrays[f"{which}_{param}"]


def _against_torch(module, program, arrays: dict, inputs: dict, torch_inputs: tuple, steps: int = 2,
                   rtol: float = 1e-9):
    """Take `steps` steps of `program` (float64) and of the script `module`'s PyTorch
    twin from the same `arrays` (params, zero states), then compare the losses, every
    parameter and both moments."""
    params = {k: v for k, v in arrays.items() if _kind(program, k) == "param"}
    P, torch_step, opt = module.torch_trainer(params, dtype="float64")
    for _ in range(steps):
        want_loss = torch_step(*torch_inputs)
        got = program(**inputs, **arrays)
        assert float(got["loss"]) == pytest.approx(want_loss, rel=1e-12)
    assert float(arrays["step"]) == steps
    for k, p in P.items():
        state = opt.state[p]
        for mine, theirs in ((arrays[k], p), (_moment(arrays, "m", k), state["exp_avg"]),
                             (_moment(arrays, "v", k), state["exp_avg_sq"])):
            theirs = theirs.detach().numpy()
            np.testing.assert_allclose(mine, theirs, rtol=rtol, atol=rtol * np.abs(theirs).max(), err_msg=k)


@pytest.mark.slow
def test_sort_gpt_adamw_step_is_torchs():
    pytest.importorskip("torch", reason="PyTorch is the oracle of this test")
    m = _module("train_sort_gpt")
    program = tgc.compile(EXAMPLES / "train_sort_gpt.tg", dtype="f64")
    b = m.batch(np.random.default_rng(5).integers(0, m.VOCAB, (5, m.N)).astype(np.int32))
    lr = 0.01
    _against_torch(m, program, _start(program, 5), {**b, "lr": lr, "wd": m.WEIGHT_DECAY}, (b, lr))


@pytest.mark.slow
def test_digits_adam_step_is_torchs():
    pytest.importorskip("torch", reason="PyTorch is the oracle of this test")
    m = _module("train_digits")
    program = tgc.compile(EXAMPLES / "train_digits.tg", dtype="f64")
    rng = np.random.default_rng(6)
    x = rng.uniform(0, 1, (7, 8, 8))
    y = m.one_hot(rng.integers(0, 10, 7)).astype(np.float64)
    _against_torch(m, program, _start(program, 6), {"x": x, "y": y, "lr": m.LR}, (x, y))


def test_wine_sgd_step_is_torchs():
    pytest.importorskip("torch", reason="PyTorch is the oracle of this test")
    m = _module("train_wine")
    rng = np.random.default_rng(7)
    program = tgc.compile(EXAMPLES / "mlp.tg", dtype="f64")
    params = m.init(program, 0)
    params = {k: v.astype(np.float64) + 0.1 * rng.standard_normal(v.shape) for k, v in params.items()}
    P, torch_step, _ = m.torch_trainer(params, dtype="float64")
    x, y = rng.standard_normal((9, 13)), np.eye(3)[rng.integers(0, 3, 9)]
    for _ in range(2):
        want = torch_step(x, y)
        assert float(program(x=x, y=y, lr=m.LR, **params)["loss"]) == pytest.approx(want, rel=1e-12)
    for k, p in P.items():
        np.testing.assert_allclose(params[k], p.detach().numpy(), rtol=1e-10, atol=1e-12, err_msg=k)
