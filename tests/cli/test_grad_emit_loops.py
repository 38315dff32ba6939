"""`tgc grad --emit tg` prints a derivative's loops as `repeat` and `scan`
(tgc.frontend.emit_loops): the printed program checks, reads back, and computes the
derivative tgc compiled, over 1, 2 and N steps of a symbolic depth, in reverse mode
(grad, a Jacobian) and forward mode; IR loops with invariants, several carries, extra
stacked results, a downward order and a narrower float type print too; a loop whose
step passes on an i32 value beside others is written out where its size is known, and
is a located error otherwise. The golden text: grad_emit_tg_repeat.tg, grad_emit_tg_scan.tg."""
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import tgc
from tgc import pipeline
from tgc.cli import main
from tgc.frontend import compile_file, compile_source
from tgc.frontend.emit_tg import emit_tg
from tgc.ir.interp import evaluate
from tgc.ir.parser import parse_module
from tgc.manager import run_pipeline
from tgc.options import Options

F64 = Options(dtype="f64")
ROOT = Path(__file__).parents[2]

PROGRAM = """\
dim layer, b = 2, c = 3, c2 = 3
input x[b, c]
param w[layer, c, c2], g[layer, c]
fn block(h, w, g) {{
  z = tanh(sum[c](h * w) + g[c = c2])
  return z[c2 = c] * 0.9 + h * 0.1
}}
{loop}
"""
LOOPS = {
    "repeat": "y = repeat[layer](block, x, w, g)\nout loss = sum(y * y * y)\nout y",
    "scan": "hs = scan[layer](block, x, w, g)\nout loss = sum(hs * hs * hs)\nout hs[layer, b, c]",
}


def inputs(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((2, 3)), "w": rng.standard_normal((n, 3, 3)) * 0.7,
            "g": rng.standard_normal((n, 3))}


def grad_text(path, *args) -> str:
    r = CliRunner().invoke(main, ["grad", str(path), "--dtype", "f64", *args])
    assert r.exit_code == 0, r.output
    return r.output


@pytest.mark.parametrize("mode", ["rev", "fwd"])
@pytest.mark.parametrize("form", ["repeat", "scan"])
def test_printed_derivative_loops_compute_the_derivative(form, mode, tmp_path):
    path = tmp_path / f"{form}.tg"
    path.write_text(PROGRAM.format(loop=LOOPS[form]))
    text = grad_text(path, "--wrt", "w", "--wrt", "x", "--wrt", "g", "--of", "loss", "--mode", mode)
    assert f"{form}[layer](step" in text and "[layer = 0]" not in text   # loops, not written out
    if mode == "rev":
        assert "[layer = size(layer) - 1 - layer]" in text   # the reverse loop, over the flipped steps
    printed = tmp_path / "d.tg"
    printed.write_text(text)
    assert CliRunner().invoke(main, ["check", "-Werror", str(printed)]).exit_code == 0
    again = compile_file(str(printed), F64)
    derived = run_pipeline(pipeline.gradient_module(compile_file(str(path), F64), ["w", "x", "g"], "loss", mode),
                           F64).module
    for n in (1, 2, 5):
        ins = inputs(n, seed=n)
        want = evaluate(derived, ins, dtype="f64")
        got = evaluate(again, ins, dtype="f64")
        assert set(got) == {"dw", "dx", "dg"}
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-10, atol=1e-12, err_msg=f"{k}, {n} steps")


def test_printed_jacobian_of_a_loop(tmp_path):
    """Reverse mode of a non-scalar output: the reverse loop carries a cotangent with
    the output's edges as a batch (a Jacobian), packed with the stacked d-slices."""
    path = tmp_path / "jac.tg"
    path.write_text(PROGRAM.format(loop=LOOPS["repeat"] + "\nout yb = sum[c](y)"))
    text = grad_text(path, "--wrt", "w", "--of", "yb")
    assert "scan[layer](step" in text and "[layer = 0]" not in text
    again = compile_source(text, "jac.tg", F64)
    derived = run_pipeline(pipeline.gradient_module(compile_file(str(path), F64), ["w"], "yb", "rev"), F64).module
    ins = inputs(3)
    want, got = evaluate(derived, ins, dtype="f64"), evaluate(again, ins, dtype="f64")
    assert got["dw"].shape == (2, 3, 3, 3)
    np.testing.assert_allclose(got["dw"], want["dw"], rtol=1e-10, atol=1e-12)


# Two carries (h, q), a loop-invariant p, a stacked scalar beside them, the loop run
# downwards; and the upward `scan` of its first carry alone (it reads neither q nor the
# scalar, so only h is carried).
LOOP_IR = """\
dim layer
dim b = 2
dim c = 3
input x : f64[b, c]
input y : f64[c]
input w : f64[layer, c]
input p : f64[c]

body b0 carries=2 slices=1 {{
  %0 = loopvar[0] : f64[b, c]
  %1 = loopvar[1] : f64[c]
  %2 = loopvar[2] : f64[c]
  %3 = loopvar[3] : f64[c]
  %4 = contract %0, %2 : f64[b, c]
  %5 = add[1.0, 1.0] %4, %3 : f64[b, c]
  %6 = map[tanh] %5 : f64[b, c]
  %7 = contract %1, %3 : f64[c]
  %8 = add[1.0, 0.5] %7, %2 : f64[c]
  %9 = contract %0, %1 : f64[]
  %10 = {scalar}
  yield %6, %8, %10, %6
}}

%0 = loop[b0, layer, 0, reverse] %x, %y, %w, %p : f64[b, c]
%1 = loop[b0, layer, 2, reverse] %x, %y, %w, %p : {stype}[layer]
%2 = loop[b0, layer, 1, reverse] %x, %y, %w, %p : f64[c]
%3 = loop[b0, layer, 3] %x, %y, %w, %p : f64[b, c, layer]

out a = %0 : [b, c]
out s = %1 : [layer]
out q = %2 : [c]
out h = %3 : [b, c, layer]
"""
SCALAR = {"f64": "add[1.0] %9 : f64[]", "f32": "map[to_f32] %9 : f32[]"}


@pytest.mark.parametrize("stype", ["f64", "f32"])
def test_ir_loops_with_invariants_carries_and_a_downward_order(stype):
    """f32: a value narrower than the program's type travels in the packed carry as f64
    and is read back as f32 (exact)."""
    m = parse_module(LOOP_IR.format(scalar=SCALAR[stype], stype=stype))
    text = emit_tg(m)
    assert "p * [layer = layer]" in text and text.count("p * [layer = layer]") == 1   # the invariant, stacked once
    assert "w[layer = size(layer) - 1 - layer]" in text and "dim pack = 10" in text
    assert "scan[layer](step_1, x, w, " in text   # h's own loop carries h alone
    if stype == "f32":
        assert "f64(" in text and "= f32(" in text
    again = compile_source(text, "loops.tg", F64)
    rng = np.random.default_rng(1)
    ins = {"x": rng.standard_normal((2, 3)), "y": rng.standard_normal(3), "w": rng.standard_normal((4, 3)),
           "p": rng.standard_normal(3)}
    want, got = evaluate(m, ins, dtype="f64"), evaluate(again, ins, dtype="f64")
    for k in want:
        assert got[k].dtype == want[k].dtype
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-14, err_msg=k)


I32_CARRY = """\
dim layer{size}
dim b = 2
dim v = 4
input x : f64[b]
input ids : i32[b]
input t : f64[v]
input w : f64[layer, b]

body b0 carries=2 slices=1 {{
  %0 = loopvar[0] : f64[b]
  %1 = loopvar[1] : i32[b]
  %2 = loopvar[2] : f64[b]
  %3 = loopvar[3] : f64[v]
  %4 = gather[v] %3, %1 : f64[b]
  %5 = contract %0, %2 : f64[b]
  %6 = add[1.0, 1.0] %5, %4 : f64[b]
  %7 = map[tanh] %6 : f64[b]
  yield %7, %1
}}

%0 = loop[b0, layer, 0] %x, %ids, %w, %t : f64[b]
%1 = contract %0, %0 : f64[]

out a = %0 : [b]
out l = %1 : []
"""


def test_an_i32_value_in_a_packed_carry_is_written_out_or_an_error():
    """The loop's first carry reads the second, an i32 one, in every step (a gather by
    it): a packed carry of the program's float type cannot hold it. Over a symbolic edge
    that is a located error; where the size is known, the loop is written out, with a
    comment line that says why."""
    m = parse_module(I32_CARRY.format(size=""))
    with pytest.raises(tgc.CompileError, match=r"one of type i32, has no \.tg form.*--emit ir"):
        pipeline.tg_source(m, F64)
    m = parse_module(I32_CARRY.format(size=" = 3"))
    text = pipeline.tg_source(m, F64)
    assert text.splitlines()[1].startswith("# loops written out step by step: a loop over 'layer' ")
    assert "repeat[" not in text and "[layer = 2]" in text
    ins = {"x": np.array([0.3, -0.2]), "ids": np.array([1, 3], np.int32), "t": np.array([0.1, 0.2, -0.3, 0.4]),
           "w": np.random.default_rng(2).standard_normal((3, 2))}
    want, got = evaluate(m, ins, dtype="f64"), evaluate(compile_source(text, "i32.tg", F64), ins, dtype="f64")
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-14, err_msg=k)



def test_reverse_mode_through_a_loop_with_an_i32_carry_matches_finite_differences(tmp_path):
    """An i32 carry (ids a step passes on) has no cotangent: the backward loop carries
    a zero of the float type in its place, and the gradient of the float carry's loss
    is the finite differences' (the interpreter, f64)."""
    src = tmp_path / "i32.tgir"
    src.write_text(I32_CARRY.format(size=""))
    m = parse_module(src.read_text())
    rng = np.random.default_rng(0)
    ins = {"x": rng.standard_normal(2), "ids": np.array([1, 3], np.int32), "t": rng.standard_normal(4),
           "w": rng.standard_normal((3, 2))}
    d = parse_module(grad_text(src, "--wrt", "w", "--of", "l", "--emit", "ir"))
    got = evaluate(d, ins, dtype="f64")["dw"]
    fd, eps = np.zeros_like(ins["w"]), 1e-6
    for i in np.ndindex(fd.shape):
        plus, minus = ins["w"].copy(), ins["w"].copy()
        plus[i] += eps
        minus[i] -= eps
        fd[i] = (evaluate(m, {**ins, "w": plus}, dtype="f64")["l"] - evaluate(m, {**ins, "w": minus}, dtype="f64")["l"]) / (2 * eps)
    np.testing.assert_allclose(got, fd, atol=1e-9)

def test_the_sorting_gpt_gradient_of_one_param_prints_only_what_it_reads(tmp_path):
    """With --wrt wq alone, the reverse loop's other stacked cotangents are left out, and
    so are the values only they read from the forward loop: the printed program has no
    unread binding (`tgc check -Werror`). Its values: test_grad_cli.py (the whole step)."""
    out = tmp_path / "dwq.tg"
    r = CliRunner().invoke(main, ["grad", str(ROOT / "examples/train_sort_gpt.tg"), "--wrt", "wq", "--of", "loss",
                                  "-o", str(out)])
    assert r.exit_code == 0, r.output
    text = out.read_text()
    assert "repeat[layer](step" in text and "scan[layer](step" in text and "[layer = 0]" not in text
    r = CliRunner().invoke(main, ["check", "-Werror", str(out)])
    assert r.exit_code == 0, r.output
