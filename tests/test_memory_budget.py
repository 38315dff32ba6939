"""`--memory-budget` / `Options(memory_budget=...)` (tgc/budget.py): the planner
recomputes saved values in the backward pass until the workspace fits, says what it
chose, changes no value, and warns with the best it reached when nothing fits."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.frontend import compile_source
from tgc.ir.inputs import random_inputs
from tgc.ir.interp import evaluate
from tgc.options import Options
from tgc.budget import MemoryBudgetWarning

FORMS = {"prelude": "attention[s, c2](q{i}, k{i}, v{i})",
         "written": "sum[s](softmax[s](dot[c2](q{i}, k{i}) / sqrt(size(c2))) * v{i})"}


def attention_stack(layers: int, form: str) -> str:
    """`layers` residual attention layers (attention through the prelude, or written out)
    and one SGD step on every weight."""
    lines = ["dim batch", "dim t = 24, s = t, c = 16", "input x0[batch, t, c]", "input lr"]
    lines += [f"param Wq{i}[c, c2: c], Wk{i}[c, c2], Wv{i}[c, c2], Wo{i}[c2, c]" for i in range(1, layers + 1)]
    for i in range(1, layers + 1):
        lines += [f"q{i} = x{i - 1} @ Wq{i}", f"k{i} = (x{i - 1} @ Wk{i})[t -> s]", f"v{i} = (x{i - 1} @ Wv{i})[t -> s]",
                  f"x{i} = x{i - 1} + ({FORMS[form].format(i=i)}) @ Wo{i}"]
    lines += [f"loss = mean(x{layers} * x{layers})", "out loss"]
    lines += [f"update W{w}{i} = W{w}{i} - lr * grad(loss, W{w}{i})" for i in range(1, layers + 1) for w in "qkvo"]
    return "\n".join(lines) + "\n"


def _plan(src: str, budget: int):
    return pipeline.lower(compile_source(src, "a.tg", Options()), Options(memory_budget=budget)).memory


def _inputs(src: str, batch: int = 64):
    m = compile_source(src, "a.tg", Options())
    x = random_inputs(m, m.bind_dims({"batch": batch}), 3, "f32")
    for k in x:
        if k.startswith("W"):
            x[k] = (x[k] * 0.25).astype(np.float32)   # scores of order 1: softmax not saturated
    x["lr"] = np.float32(0.1)
    return x


def test_the_planner_measures_with_the_chosen_backends_lowering():
    """The workspace the planner measures is the one the backend compiled for plans
    (its own stages: the CPU's loop groups, CUDA's row groups), as `tgc explain
    --backend` reports it; the two backends' differ on this program."""
    from tgc.explain import explain

    m = compile_source(attention_stack(2, "prelude"), "a.tg", Options())
    plain = pipeline.lower(m, Options()).module
    measured = {}
    for backend in ("cpu", "cuda-sim"):
        plan = pipeline.lower(m, Options(memory_budget=1 << 40), backend=backend).memory
        # as the budgeted program compiles (the CPU group's in-place outputs off under a budget)
        low = pipeline.lower_module(plain, Options(memory_budget=1 << 40), backend)
        assert plan.before == explain(low, plain.bind_dims(plan.dims))["workspace"]["bytes"], backend
        measured[backend] = plan.before
    assert measured["cpu"] != measured["cuda-sim"]


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_budget_recomputes_attention_probabilities(form):
    src = attention_stack(2, form)
    free = _plan(src, 1 << 40)
    assert free.met and free.before == free.after and not free.chosen and "fits" in free.summary()
    # 71%: recomputing reaches 1.40 MB of the 1.99 MB free workspace (2.04 MB without the
    # GEMM epilogues of tgc.lower.epilogue, which already take their products' buffers away)
    budget = free.before * 71 // 100
    program = tgc.compile(src, options=Options(memory_budget=budget))
    plan = program.memory_plan
    assert plan.met and plan.after <= budget < plan.before == free.before, plan.summary()
    assert plan.dims == {"batch": 64}
    # the probabilities: a [batch, query, key] matrix (edges t and a copy of t)
    assert any(c.what.startswith("exp ") and len(c.edges) == 3 and "batch" in c.edges for c in plan.chosen), \
        plan.lines()
    assert all(line.startswith("  recompute ") for line in plan.lines())
    # the same values as without a budget (the kernels differ, so sums may round differently)
    plain = tgc.compile(src)
    a, b = _inputs(src), _inputs(src)
    got, want = program(**a), plain(**b)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # and the interpreter's, to rounding
    opts = Options(dtype="f64")
    ref = evaluate(pipeline.lower(compile_source(src, "a.tg", opts), opts).module,
                   {k: np.asarray(v, np.float64) for k, v in _inputs(src).items()}, dtype="f64")
    np.testing.assert_allclose(want["loss"], ref["loss"], rtol=1e-4)


def test_an_unreachable_budget_warns_with_the_best_reached():
    src = attention_stack(2, "prelude")
    with pytest.warns(MemoryBudgetWarning, match=r"the budget is NOT met \(best reached: "):
        program = tgc.compile(src, options=Options(memory_budget=1000))
    plan = program.memory_plan
    assert not plan.met and 1000 < plan.after < plan.before
    a, b = _inputs(src), _inputs(src)
    np.testing.assert_allclose(program(**a)["loss"], tgc.compile(src)(**b)["loss"], rtol=1e-6)


def test_without_a_derivative_there_is_nothing_to_recompute():
    # (tanh's operand of the second product is a temporary: the first product goes into it)
    src = "dim batch\ndim c = 32\ninput x[batch, c]\nparam W[c, d: c]\nout y = tanh(x @ W)[d -> c] @ W\n"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ok = tgc.compile(src, options=Options(memory_budget=1 << 30))
    assert ok.memory_plan.met and not ok.memory_plan.chosen
    with pytest.warns(MemoryBudgetWarning, match="NOT met"):
        tgc.compile(src, options=Options(memory_budget=10))
    assert tgc.compile(src).memory_plan is None


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tgc.cli", *args], capture_output=True, text=True)


@pytest.mark.slow
def test_command_line(tmp_path):
    src = tmp_path / "a.tg"
    src.write_text(attention_stack(2, "prelude"))
    # 3/4 of the workspace: recomputing two saved values meets it (1.40 of 1.99 MB; the
    # GEMM epilogues left 1.99 MB where 70% had been the test's margin before them)
    half = str(_plan(src.read_text(), 1 << 40).before * 3 // 4)
    done = _cli("explain", str(src), "--memory-budget", half, "--format", "json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["memory_budget"]["met"] and report["workspace"]["bytes"] == report["memory_budget"]["after"]
    assert report["workspace"]["bytes"] <= int(half) and report["recompute"]
    text = _cli("explain", str(src), "--memory-budget", half).stdout
    assert "memory budget" in text and "recompute " in text
    out = tmp_path / "r.npz"
    done = _cli("run", str(src), "--random-inputs", "--dim", "batch=64", "--backend", "cpu", "--dtype", "f64",
                "--memory-budget", str(2 * int(half)), "-o", str(out))   # f64: twice the bytes
    assert done.returncode == 0, done.stderr
    assert "note: memory budget" in done.stderr and "recompute " in done.stderr
    plain = tmp_path / "p.npz"
    assert _cli("run", str(src), "--random-inputs", "--dim", "batch=64", "--backend", "cpu", "--dtype", "f64",
                "-o", str(plain)).returncode == 0
    for k, v in np.load(plain).items():
        np.testing.assert_allclose(np.load(out)[k], v, rtol=1e-9, atol=1e-9 * np.abs(v).max(), err_msg=k)
    done = _cli("build", str(src), "-o", str(tmp_path / "liba.so"), "--memory-budget", "1k")
    assert done.returncode == 0 and "warning: memory budget 1 kB" in done.stderr, done.stderr
    bad = _cli("run", str(src), "--memory-budget", "lots")
    assert bad.returncode == 2 and "is not a byte count" in bad.stderr


def test_byte_counts():
    from tgc.cli.flags import _Bytes

    b = _Bytes()
    assert [b.convert(v, None, None) for v in ("6700000", "6.7M", "6.4MiB", "64k", "2Gi", "512B")] == \
        [6700000, 6700000, int(6.4 * 2 ** 20), 64000, 2 * 2 ** 30, 512]
