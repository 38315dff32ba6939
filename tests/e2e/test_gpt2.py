"""examples/gpt2.tg, the GPT-2-shaped model and AdamW step: it checks, its interface at
GPT-2 small's sizes is GPT-2 small's, and at a reduced size (every size is a symbolic
dim, given with `dims=` as `-D` gives it to a build) one compiled step agrees with the
reference interpreter and a few steps lower the loss.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import tgc
from tgc import pipeline
from tgc.cli import main
from tgc.frontend import compile_file
from tgc.ir.interp import evaluate
from tgc.options import Options

GPT2 = Path(__file__).resolve().parents[2] / "examples" / "gpt2.tg"
GPT2_SMALL = {"layer": 12, "head": 12, "hd": 64, "t": 1024, "vocab": 50257}
REDUCED = {"layer": 2, "head": 2, "hd": 16, "t": 16, "vocab": 50}     # width 32
BATCH = 3


def test_it_checks_and_is_short():
    r = CliRunner().invoke(main, ["check", "-Werror", str(GPT2)])
    assert r.exit_code == 0, r.output
    lines = GPT2.read_text().splitlines()
    assert len(lines) < 60
    assert len([line for line in lines if line.strip() and not line.lstrip().startswith("#")]) < 40   # code


def test_at_gpt2_small_sizes_its_params_are_gpt2_smalls():
    flags = [f for d, n in GPT2_SMALL.items() for f in ("-D", f"{d}={n}")]
    r = CliRunner().invoke(main, ["info", str(GPT2), "--format", "json", *flags])
    assert r.exit_code == 0, r.output
    args = json.loads(r.output)["arguments"]
    shapes = {a["name"]: a["shape"] for a in args if a["kind"] == "param"}
    assert shapes["wte"] == [50257, 768] and shapes["wpe"] == [1024, 768] and shapes["wfc"] == [12, 768, 3072]
    assert sum(math.prod(s) for s in shapes.values()) == 124_439_808        # GPT-2 small, head tied
    states = {a["name"] for a in args if a["kind"] == "state"}
    assert states == {"step"} | {f"{m}.{p}" for p in shapes for m in "mv"}   # AdamW's moments, per param


def _start(program, dims: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """GPT-2's initialization at `dims`: weights N(0, 0.02), biases 0, LayerNorm scales
    1; zero optimizer states; a batch of random tokens and their successors."""
    rng = np.random.default_rng(seed)
    arrays = program.init_state(dims)
    for spec in program.inputs:
        if spec.kind == "param":
            if spec.name.startswith("ln"):
                arrays[spec.name] = np.ones(spec.shape) if spec.name.endswith("_w") else np.zeros(spec.shape)
            elif spec.name.startswith("b"):
                arrays[spec.name] = np.zeros(spec.shape)
            else:
                arrays[spec.name] = 0.02 * rng.standard_normal(spec.shape)
    ftype = arrays["step"].dtype                          # the program's float type
    arrays = {k: v.astype(ftype) for k, v in arrays.items()}
    tokens = rng.integers(0, dims["vocab"], (BATCH, dims["t"] + 1)).astype(np.int32)
    return {**arrays, "ids": tokens[:, :-1].copy(), "targets": tokens[:, 1:].copy(),
            "lr": np.asarray(3e-3, ftype), "wd": np.asarray(0.1, ftype)}


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda-sim", marks=pytest.mark.slow)])
def test_one_step_at_a_reduced_size_is_the_interpreters(backend):
    program = tgc.compile(GPT2, backend=backend, dtype="f64", dims=REDUCED)
    args = _start(program, REDUCED)
    options = Options(dtype="f64", passes=("normalize", "adjoint", "tangent"))   # the interpreter runs the loop
    module = pipeline.lower(compile_file(str(GPT2), options), options).module
    want = evaluate(module, {k: v.copy() for k, v in args.items()}, dtype="f64", dims=REDUCED)
    got = program(**args)                                   # updates `args` in place
    assert float(got["loss"]) == pytest.approx(float(want["loss"]), rel=1e-11)
    assert float(got["loss"]) == pytest.approx(math.log(REDUCED["vocab"]), rel=0.05)   # near uniform at the start
    for u in module.updates:
        np.testing.assert_allclose(args[u.target], want[u.target], rtol=1e-9,
                                   atol=1e-12 * max(1.0, np.abs(want[u.target]).max()), err_msg=u.target)
    assert float(args["step"]) == 1


def test_a_few_steps_lower_the_loss():
    program = tgc.compile(GPT2, dtype="f64", dims=REDUCED)       # the build of the test above, cached
    args = _start(program, REDUCED, seed=1)
    losses = [float(program(**args)["loss"]) for _ in range(8)]    # one batch, again and again
    assert all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0], losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
