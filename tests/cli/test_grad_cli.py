"""`tgc grad` and the .tg emitter: derivative programs in surface syntax that
`tgc check` accepts and that compute the same values."""
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tgc import pipeline
from tgc.cli import main
from tgc.frontend import compile_file, compile_source
from tgc.ir.interp import evaluate
from tgc.ir.inputs import random_inputs
from tgc.lower.interp import run_lowered
from tgc.options import Options
from tgc.manager import run_pipeline

from marks import sized_by_themselves

ROOT = Path(__file__).parents[2]
EXAMPLES = sorted(sized_by_themselves((ROOT / "examples").glob("*.tg")))
F64 = Options(dtype="f64")


def values(module, seed=0):
    dims = {d: 3 for d in module.symbolic_dims()}
    inputs = random_inputs(module, module.bind_dims(dims), seed, "f64")
    return inputs, dims, evaluate(module, inputs, dtype="f64", dims=dims)


def run_printed(module, inputs, dims):
    """A printed program's values. One whose loops pass several values from step to
    step packs them onto one edge with indicators (tgc.frontend.emit_loops), which the
    reference interpreter builds densely (its size times the values'): such a program
    runs in the lowered interpreter, where they are index arithmetic."""
    if not any(v.op == "loop" for v in module.values()):
        return evaluate(module, inputs, dtype="f64", dims=dims)
    low = pipeline.lower_module(pipeline.lower(module, F64).module, F64)
    return run_lowered(low, {k: np.copy(inputs[k]) for k in module.args}, dims)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_emitted_tg_computes_the_same(path):
    module = run_pipeline(compile_file(str(path), F64), F64).module
    text = pipeline.tg_source(module, F64)
    again = compile_source(text, "generated.tg", F64)
    inputs, dims, want = values(module)
    got = run_printed(again, inputs, dims)
    looped = "repeat[" in text or "scan[" in text   # the loops' steps computed apart: sums may round apart
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10 if looped else 1e-12,
                                   atol=1e-10 if looped else 1e-12, err_msg=name)


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_grad_command_emits_a_checkable_equivalent_program(mode, tmp_path):
    r = CliRunner().invoke(main, ["grad", str(ROOT / "examples/mlp.tg"), "--wrt", "W1", "--mode", mode, "--dtype", "f64"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "dmlp.tg"
    out.write_text(r.output)
    # arguments the derivative does not read (lr) are left out: no warning
    assert CliRunner().invoke(main, ["check", "-Werror", str(out)]).exit_code == 0
    generated = compile_file(str(out), F64)
    assert "lr" not in generated.args
    original = compile_file(str(ROOT / "examples/mlp.tg"), F64)
    reference = run_pipeline(pipeline.gradient_module(original, ["W1"], None, "rev"), F64).module
    inputs, dims, want = values(reference)
    got = evaluate(generated, {k: inputs[k] for k in generated.args}, dtype="f64", dims=dims)
    np.testing.assert_allclose(got["dW1"], want["dW1"], rtol=1e-10, atol=1e-12)
    # and the gradient itself is right: a finite difference along a random direction
    W1 = inputs["W1"]
    direction = np.random.default_rng(3).standard_normal(W1.shape)
    eps = 1e-6
    def loss(w):
        return evaluate(run_pipeline(original, F64).module, {**{k: v for k, v in inputs.items()}, "W1": w},
                        dtype="f64", dims=dims)["loss"]
    fd = (loss(W1 + eps * direction) - loss(W1 - eps * direction)) / (2 * eps)
    assert np.sum(want["dW1"] * direction) == pytest.approx(fd, rel=1e-6, abs=1e-9)


def test_grad_ir_output_and_of_errors(tmp_path):
    r = CliRunner().invoke(main, ["grad", str(ROOT / "examples/mlp.tg"), "--wrt", "W1", "--wrt", "b1", "--emit", "ir"])
    assert r.exit_code == 0, r.output
    assert "out dW1 = " in r.output and "out db1 = " in r.output and "grad" not in r.output
    src = tmp_path / "two.tg"
    src.write_text("dim n = 3\nparam w[n]\nout a = sum(w)\nout b = sum(w * w)\n")
    r = CliRunner().invoke(main, ["grad", str(src), "--wrt", "w"])
    assert r.exit_code == 1 and "(a, b)" in r.output
    r = CliRunner().invoke(main, ["grad", str(src), "--wrt", "w", "--of", "b"])
    assert r.exit_code == 0 and "out dw[n]" in r.output
    r = CliRunner().invoke(main, ["grad", str(src), "--wrt", "nope", "--of", "b"])
    assert r.exit_code == 1 and "--wrt nope" in r.output


DEEP = """\
dim layer{size}, b = 2, c = 3, c2 = 3
input x[b, c]
param w[layer, c, c2]
fn block(h, w) = tanh(sum[c](h * w))[c2 -> c] * 0.9 + h * 0.1
y = repeat[layer](block, x, w)
out loss = sum(y * y)
"""


def test_grad_of_a_loop_prints_the_reverse_loop(tmp_path):
    """Over a symbolic dim the derivative of a `repeat` is a loop run backwards: `--emit
    ir` prints it as one (a body block and a `reverse` loop) and `--emit tg` as a `scan`
    over the flipped steps (tgc.frontend.emit_loops); both read back to the gradient of
    the loop written out."""
    from tgc.ir.parser import parse_module

    path = tmp_path / "deep.tg"
    path.write_text(DEEP.format(size=""))
    written_out = compile_source(DEEP.format(size=" = 4").replace(
        "y = repeat[layer](block, x, w)",
        "y = block(block(block(block(x, w[layer = 0]), w[layer = 1]), w[layer = 2]), w[layer = 3])"), "out.tg", F64)
    want = run_pipeline(pipeline.gradient_module(written_out, ["w"], None, "rev"), F64).module
    inputs, dims, expected = values(want)
    r = CliRunner().invoke(main, ["grad", str(path), "--wrt", "w", "--emit", "ir", "--dtype", "f64"])
    assert r.exit_code == 0, r.output
    assert "body b0 carries=1" in r.output and ", reverse] " in r.output and "out dw = " in r.output
    got = parse_module(r.output)
    np.testing.assert_allclose(evaluate(got, inputs, dtype="f64", dims={"layer": 4})["dw"], expected["dw"],
                               rtol=1e-12, atol=1e-14)
    r = CliRunner().invoke(main, ["grad", str(path), "--wrt", "w", "--dtype", "f64"])
    assert r.exit_code == 0, r.output
    assert "scan[layer](step, " in r.output and "[layer = size(layer) - 1 - layer]" in r.output
    printed = tmp_path / "dw.tg"
    printed.write_text(r.output)
    assert CliRunner().invoke(main, ["check", "-Werror", str(printed)]).exit_code == 0
    got = evaluate(compile_file(str(printed), F64), inputs, dtype="f64", dims={"layer": 4})
    np.testing.assert_allclose(got["dw"], expected["dw"], rtol=1e-10, atol=1e-14)
