"""`checkpoint(x)`: x, recomputed by the backward pass instead of kept (LANGUAGE.md
section 11, "Checkpoints"; tgc/autodiff/remat.py).

Spec level: the form elaborates, prints and reads back, and its mistakes are errors.
Values and derivatives are those without the checkpoint, on the IR interpreter, the
lowered-program interpreter and the CPU backend, and agree with finite differences.
The compiled step recomputes the checkpointed values in its backward part (kernels
noted "recompute", run just before their first reader), so the planned workspace of
a residual MLP with big hidden activations is smaller.
"""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

import tgc
from tgc import pipeline
from tgc.cli import main
from tgc.explain import explain
from tgc.frontend import compile_source
from tgc.ir.diag import CompileError
from tgc.ir.interp import evaluate
from tgc.ir.inputs import random_inputs
from tgc.lower.interp import run_lowered
from tgc.ir.parser import parse_module
from tgc.ir.printer import print_module
from tgc.options import Options
from tgc.pipeline import lower_module

from passes_util import central_difference, optimize, tg

# three residual blocks r + relu(r @ A) @ B; the hidden activations (batch x h) are
# the big values, the residual stream (batch x d) is kept anyway
RESIDUAL = """\
dim batch = {batch}, d = {d}, h = {h}, classes = 5
input x[batch, d]
input y[batch, classes]
param A1[d, h], B1[h, d], A2[d, h], B2[h, d], A3[d, h], B3[h, d], C[d, classes]
input lr
r1 = x + {c}(relu(x @ A1)) @ B1
r2 = r1 + {c}(relu(r1 @ A2)) @ B2
r3 = r2 + {c}(relu(r2 @ A3)) @ B3
loss = mean[batch](cross_entropy[classes](r3 @ C, y))
out loss
update C = C - lr * grad(loss, C)
update B3 = B3 - lr * grad(loss, B3)
update A3 = A3 - lr * grad(loss, A3)
update B2 = B2 - lr * grad(loss, B2)
update A2 = A2 - lr * grad(loss, A2)
update B1 = B1 - lr * grad(loss, B1)
update A1 = A1 - lr * grad(loss, A1)
"""
PARAMS = ("C", "B3", "A3", "B2", "A2", "B1", "A1")


def residual(checkpoint: bool, batch=16, d=6, h=12) -> str:
    return RESIDUAL.format(batch=batch, d=d, h=h, c="checkpoint" if checkpoint else "")


def _inputs(m, seed=0):
    inputs = random_inputs(m, m.bind_dims({}), seed, "f64")
    inputs["lr"] = np.array(0.1)
    return inputs


def _copy(inputs):
    return {k: np.array(v, copy=True) for k, v in inputs.items()}


# ---- the form -----------------------------------------------------------------------------


def test_checkpoint_elaborates_prints_and_reads_back():
    m = tg("dim n = 3\ninput x[n]\nout y = checkpoint(exp(x)) * 2\n")
    text = print_module(m)
    assert "map[checkpoint]" in text
    assert print_module(parse_module(text)) == text
    np.testing.assert_allclose(evaluate(m, {"x": np.arange(3.0)})["y"], 2 * np.exp(np.arange(3.0)))


@pytest.mark.parametrize("src, message", [
    ("out y = checkpoint(x, x)", "'checkpoint' takes 1 argument, got 2"),
    ("out y = checkpoint[n](x)", "'checkpoint' takes no edge arguments"),
    ("out y = recompute(x)", "unknown function 'recompute'"),
])
def test_mistakes_are_errors(src, message):
    with pytest.raises(CompileError, match=message.replace("[", r"\[").replace("(", r"\(")):
        tg(f"dim n = 3\ninput x[n]\n{src}\n")


def test_without_a_derivative_it_is_dropped():
    m = optimize(tg("dim n = 3\ninput x[n]\nout y = checkpoint(exp(x))\n"))
    assert all(v.op != "map" or v.attrs[0] not in ("checkpoint", "recompute") for v in m.values())


# ---- the backward reads a recomputed copy -----------------------------------------------


def test_backward_reads_recomputed_copies():
    """After the pipeline, the gradients read `recompute(...)` copies of the hidden
    activations; the forward loss does not."""
    m = optimize(tg(residual(True)))
    fns = [v.attrs[0] for v in m.values() if v.op == "map"]
    assert "checkpoint" not in fns and "recompute" in fns
    loss = next(o.value for o in m.outputs if o.name == "loss")
    from tgc.ir.values import topo_order
    assert all(not (v.op == "map" and v.attrs[0] == "recompute") for v in topo_order([loss]))


@pytest.mark.slow
def test_values_and_gradients_are_unchanged_on_every_backend():
    plain, ck = (tgc.compile(residual(c), dtype="f64") for c in (False, True))
    inputs = _inputs(plain.module)
    reference = evaluate(plain.module, _copy(inputs))
    runs = {"interp": evaluate(ck.module, _copy(inputs)),
            "lowered": run_lowered(ck.lowered, _copy(inputs), {}),
            "cpu": ck(**_copy(inputs))}
    for name, got in runs.items():
        for k in reference:
            np.testing.assert_allclose(got[k], reference[k], rtol=1e-12, atol=1e-12, err_msg=f"{name}: {k}")
    # the checkpoint changes which kernels run, not what they compute
    np.testing.assert_array_equal(runs["lowered"]["A1"], run_lowered(plain.lowered, _copy(inputs), {})["A1"])


def test_gradients_match_finite_differences():
    src = residual(True).split("out loss")[0] + "out loss\nout gA1 = grad(loss, A1)\nout gB2 = grad(loss, B2)\n"
    m = optimize(tg(src))
    inputs = _inputs(m, seed=4)
    got = evaluate(m, inputs, dtype="f64")
    rng = np.random.default_rng(0)
    for name in ("A1", "B2"):
        direction = rng.standard_normal(inputs[name].shape)
        fd = central_difference(m, inputs, "loss", name, direction, 1e-6)
        np.testing.assert_allclose(np.sum(got["g" + name] * direction), fd, rtol=1e-6)


def test_second_order_derivatives_pass_through():
    src = ("dim n = 5\ninput x[n], v[n]\n"
           "out hv = jvp(grad(sum({c}(tanh(x)) * {c}(exp(x / 4))), x), x, v)\n")
    a, b = (optimize(tg(src.format(c=c))) for c in ("", "checkpoint"))
    inputs = {"x": np.linspace(-1, 1, 5), "v": np.arange(5.0)}
    np.testing.assert_allclose(evaluate(b, inputs)["hv"], evaluate(a, inputs)["hv"], rtol=1e-13)


def test_fp_strict_keeps_values():
    plain, ck = (tgc.compile(residual(c), dtype="f64", options=Options(fp_strict=True)) for c in (False, True))
    inputs = _inputs(plain.module)
    want, got = plain(**_copy(inputs)), ck(**_copy(inputs))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


# ---- memory -----------------------------------------------------------------------------


def _report(src: str) -> dict:
    opts = Options()
    low = lower_module(pipeline.lower(compile_source(src, "<t>", opts), opts).module, opts)
    return explain(low, {})


def test_planned_workspace_is_smaller():
    """Batch 512, hidden 256: each hidden activation is 512 KiB in f32. Kept, the three
    blocks' activations are alive together in the backward pass; recomputed, only one
    block's at a time."""
    plain, ck = (_report(residual(c, batch=512, d=32, h=256)) for c in (False, True))
    assert ck["workspace"]["bytes"] < 0.7 * plain["workspace"]["bytes"]
    assert ck["peak"]["bytes"] < 0.7 * plain["peak"]["bytes"]
    assert plain["recompute"] == [] and "no recomputation" in plain["recompute_note"]
    assert len(ck["recompute"]) >= 3 and "recompute checkpointed values" in ck["recompute_note"]
    # each recomputation runs in the backward part, after the loss
    loss_at = next(k["index"] for k in ck["kernels"] if "%loss" in k["text"])
    assert all(r["kernel"] > loss_at for r in ck["recompute"])


def test_small_recomputations_are_inlined_and_reported():
    r = _report(residual(True, batch=64, d=8, h=32))
    assert r["recompute"] == [] and "recomputed inside the backward kernels" in r["recompute_note"]


def test_explain_cli_names_the_recomputation(tmp_path):
    f = tmp_path / "res.tg"
    f.write_text(residual(True, batch=512, d=32, h=256))
    r = CliRunner().invoke(main, ["explain", str(f)])
    assert r.exit_code == 0, r.output
    assert "# recompute" in r.output and "kernels recompute checkpointed values" in r.output


def test_grad_emit_tg_reads_back(tmp_path):
    f = tmp_path / "g.tg"
    f.write_text("dim n = 4, h = 6\ninput x[n]\nparam W[n, h], V[h]\n"
                 "loss = sum(checkpoint(tanh(x @ W)) * V)\nout loss\n")
    r = CliRunner().invoke(main, ["grad", str(f), "--wrt", "W", "--emit", "tg"])
    assert r.exit_code == 0, r.output
    assert "recompute" not in r.output
    back = tg(r.output.replace("# generated by tgc\n", ""))
    x, W, V = np.linspace(-1, 1, 4), np.linspace(-0.5, 0.5, 24).reshape(4, 6), np.arange(6.0)
    want = np.outer(x, V * (1 - np.tanh(x @ W) ** 2))
    np.testing.assert_allclose(evaluate(optimize(back), {"x": x, "W": W, "V": V})["dW"], want, rtol=1e-12)


def test_second_order_reverse_over_reverse_and_a_checkpointed_argument():
    src = ("dim n = 5, k = 3\ninput x[n], v[n]\nparam W[n, k]\n"
           "loss = sum({c}(tanh(x @ W)) * {c}(W) @ [k = k])\ng = grad(loss, x)\n"
           "out gg = grad(sum(g * v), x)\nout gw = grad(sum(g * v), W)\n")
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal(5), "v": rng.standard_normal(5), "W": rng.standard_normal((5, 3))}
    want, got = (evaluate(optimize(tg(src.format(c=c))), inputs) for c in ("", "checkpoint"))
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-13, atol=1e-15)
