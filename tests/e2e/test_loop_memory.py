"""What each step of a differentiated loop keeps for the backward pass (issue 31, item 2):
by default every value of the step that the backward step reads; under a memory budget
too small for that, only the incoming carries, the step recomputed in the reverse loop
(`tgc.autodiff.loops`, `tgc.budget`); `checkpoint` inside the body applies per step.
`tgc explain` says which, and the gradients are the same either way."""
from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner

import tgc
from tgc import pipeline
from tgc.cli import main
from tgc.explain import loop_steps
from tgc.frontend import compile_source
from tgc.options import Options

MLP = """\
dim batch = 4, c = 8, f = 16, layer = 6
input x[batch, c], target[batch, c]
param w1[layer, c, f], b1[layer, f], w2[layer, f, c]
fn block(h, w1, b1, w2) {{
  z = {z}
  return h + z @ w2
}}
y = repeat[layer](block, x, w1, b1, w2)
loss = mean((y - target) ^ 2)
out loss
out gw1 = grad(loss, w1)
out gb1 = grad(loss, b1)
out gw2 = grad(loss, w2)
out gx = grad(loss, x)
"""
PLAIN = MLP.format(z="tanh(h @ w1 + b1)")
CHECKPOINTED = MLP.format(z="checkpoint(tanh(h @ w1 + b1))")


def explain_json(path, *args) -> dict:
    r = CliRunner().invoke(main, ["explain", str(path), "--format", "json", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def inputs(seed=0) -> dict:
    rng = np.random.default_rng(seed)
    shapes = {"x": (4, 8), "target": (4, 8), "w1": (6, 8, 16), "b1": (6, 16), "w2": (6, 16, 8)}
    return {k: rng.standard_normal(s) * 0.4 for k, s in shapes.items()}


def test_a_budget_keeps_only_the_carries_and_lowers_the_peak(tmp_path):
    path = tmp_path / "mlp.tg"
    path.write_text(PLAIN)
    free = explain_json(path)
    [loop] = free["loops"]
    assert loop["keep"] == "values" and loop["steps"] == 6 and not loop["unrolled"]
    # the carry f32[batch, c] and tanh's f32[batch, f] per step
    assert [(k["what"], k["bytes"]) for k in loop["kept"]] == [("carry", 6 * 4 * 8 * 4), ("tanh", 6 * 4 * 16 * 4)]
    budget = free["workspace"]["bytes"] - 1
    tight = explain_json(path, "--memory-budget", str(budget))
    assert tight["memory_budget"]["met"] and tight["workspace"]["bytes"] <= budget
    assert tight["peak"]["bytes"] < free["peak"]["bytes"]
    [loop] = tight["loops"]
    assert loop["keep"] == "carries" and [k["bytes"] for k in loop["kept"]] == [6 * 4 * 8 * 4]
    assert loop["recomputed_values"] > 0
    assert "keep only the carries" in tight["memory_budget"]["chosen"][0]["what"]
    r = CliRunner().invoke(main, ["explain", str(path), "--memory-budget", str(budget)])
    assert "loop over 'layer' (6 steps): the backward pass keeps each step's incoming carry (f32[batch, c], " \
        "768 B in all) and recomputes the step's other" in r.output


def test_gradients_are_the_same_in_either_form_and_match_finite_differences():
    ins = inputs()
    keep = tgc.compile(PLAIN, backend="cpu", options=Options(dtype="f64"))
    free = explain_budget = pipeline.lower(compile_source(PLAIN, "mlp.tg", Options(dtype="f64")),
                                           Options(dtype="f64", memory_budget=1 << 40)).memory
    assert not free.chosen
    tight = tgc.compile(PLAIN, backend="cpu", options=Options(dtype="f64", memory_budget=explain_budget.before - 1))
    assert tight.memory_plan.chosen and "keep only the carries" in tight.memory_plan.chosen[0].what
    a = keep(**{k: v.copy() for k, v in ins.items()})
    b = tight(**{k: v.copy() for k, v in ins.items()})
    for k in ("loss", "gw1", "gb1", "gw2", "gx"):
        np.testing.assert_allclose(np.asarray(b[k]), np.asarray(a[k]), rtol=1e-10, atol=1e-12, err_msg=k)
    rng = np.random.default_rng(1)
    for prog in (keep, tight):
        for name, grad in (("w1", "gw1"), ("b1", "gb1"), ("w2", "gw2"), ("x", "gx")):
            for _ in range(2):
                idx = tuple(int(rng.integers(0, s)) for s in ins[name].shape)
                eps = 1e-6
                hi = {k: v.copy() for k, v in ins.items()}
                lo = {k: v.copy() for k, v in ins.items()}
                hi[name][idx] += eps
                lo[name][idx] -= eps
                fd = (float(prog(**hi)["loss"]) - float(prog(**lo)["loss"])) / (2 * eps)
                assert abs(fd - np.asarray(a[grad])[idx]) < 1e-7 * max(1.0, abs(fd)), (name, idx)


def test_a_checkpoint_in_the_body_applies_per_step(tmp_path):
    options = Options(dtype="f64", passes=("normalize",))
    # checkpoint(tanh(h @ w1 + b1)) recomputes the product, the sum and tanh (what exists only
    # to compute it) from the carry h and the step's params
    for src, kept, recomputed in ((PLAIN, ["carry", "tanh"], 0), (CHECKPOINTED, ["carry"], 3)):
        primal = pipeline.lower(compile_source(src, "mlp.tg", options), options).module
        [loop] = loop_steps(primal, {}, unrolled=False)
        assert [k["what"] for k in loop["kept"]] == kept, src
        assert loop["recomputed_values"] >= recomputed and (recomputed or loop["recomputed_values"] == 0)
    # the gradients are the same
    ins = inputs(2)
    a = tgc.compile(PLAIN, backend="cpu", options=Options(dtype="f64"))(**{k: v.copy() for k, v in ins.items()})
    b = tgc.compile(CHECKPOINTED, backend="cpu", options=Options(dtype="f64"))(**{k: v.copy() for k, v in ins.items()})
    for k in ("loss", "gw1", "gb1", "gw2", "gx"):
        np.testing.assert_allclose(np.asarray(b[k]), np.asarray(a[k]), rtol=1e-10, atol=1e-12, err_msg=k)


def test_the_forward_steps_run_once():
    """The primal loop and the forward loop that stacks what each step keeps are one loop
    (`tgc.autodiff.loops.one_forward_loop`), through every later pass."""
    from tgc.lower.lowered import StepLoop
    from tgc.pipeline import lower_module

    src = MLP.format(z="gelu(layernorm[c](h, 1, 0) @ w1 + b1)")   # a body the later passes rewrite
    options = Options(dtype="f64", unroll_max_ops=0)   # no loop unrolled
    low = lower_module(pipeline.lower(compile_source(src, "mlp.tg", options), options).module, options)
    loops = [k for k in low.kernels if isinstance(k, StepLoop)]
    assert sorted(k.reverse for k in loops) == [False, True]


def test_every_derivative_is_the_same_when_the_steps_keep_only_their_carries():
    """tests/e2e/test_loops.py's program (a repeat and a scan; grad, jvp, an HVP) with
    every loop's steps checkpointed, as the planner chooses under a budget."""
    from tests.e2e.test_loops import inputs, program
    from tgc.budget import _with_checkpoints
    from tgc.ir.interp import evaluate

    options = Options(dtype="f64", passes=("normalize",))
    primal = pipeline.lower(compile_source(program(3), "<t>", options), options).module
    loops = [v for v in primal.values() if v.op == "loop"]
    assert loops
    rest = Options(dtype="f64", passes=("adjoint", "tangent"))
    keep = pipeline.lower(primal, rest).module
    chosen = _with_checkpoints(primal, loops)
    plans = loop_steps(chosen, {}, unrolled=False)
    assert plans and all(lp["keep"] == "carries" for lp in plans)
    assert any(lp["keep"] == "values" for lp in loop_steps(primal, {}, unrolled=False))
    carries = pipeline.lower(chosen, rest).module
    ins = inputs(3)
    a = evaluate(keep, {k: v.copy() for k, v in ins.items()}, dtype="f64")
    b = evaluate(carries, {k: v.copy() for k, v in ins.items()}, dtype="f64")
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-11, atol=1e-12, err_msg=k)
