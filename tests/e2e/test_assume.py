"""`assume RELATION`: declared facts about the inputs (LANGUAGE.md section 11, "Facts").

Spec level: the statement parses and elaborates, its mistakes are located errors, the
module records the facts (printed in the IR and read back). The optimizer uses them:
`assume sum[v](y) = 1` makes the CE∘softmax Hessian-vector product y-free, `assume
w > 0` lets sqrt(w) sqrt(w) be w. Values agree between the IR interpreter, the
lowered-program interpreter and the CPU backend, and with finite differences. Facts
are checked at run time only when asked (`--check-assumptions`,
`Options(check_assumptions=True)`).
"""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

import tgc
from tgc.cli import main
from tgc.ir.assume import check_facts
from tgc.ir.diag import CompileError
from tgc.ir.interp import EvalError, evaluate
from tgc.ir.inputs import random_inputs
from tgc.lower.interp import run_lowered
from tgc.ir.parser import parse_module
from tgc.ir.printer import print_module

from passes_util import body, central_difference, ops, optimize, tg

HVP = """\
dim b = 3, v = 6
input y[b, v]
input z[b, v]
input dz[b, v]
{assume}
loss = sum[b](cross_entropy[v](z, y))
out hv = jvp(grad(loss, z), z, dz)
"""
FACT = "assume sum[v](y) = 1"


def _hvp(with_fact: bool, dtype: str = "f64"):
    return tg(HVP.format(assume=FACT if with_fact else ""), dtype)


def _distributions(rng, shape, axis=-1):
    p = rng.random(shape) + 0.1
    return p / p.sum(axis=axis, keepdims=True)


# ---- the statement -----------------------------------------------------------------------


def test_facts_are_recorded_printed_and_read_back():
    m = tg("dim b = 2, v = 3\ninput y[b, v]\ninput x[v]\nassume sum[v](y) = 1\n"
           "assume y >= 0\nassume 0 < x\nassume x != 2 * x\nout r = y * x\n")
    assert [(f.rel, f.text) for f in m.facts] == [
        ("=", "sum[v](y) = 1"), (">=", "y >= 0"), ("<", "0 < x"), ("!=", "x != 2 * x")]
    assert [f.loc.line for f in m.facts] == [4, 5, 6, 7]
    text = print_module(m)
    assert 'assume[eq] %1, %2 "sum[v](y) = 1"' in text
    assert 'assume[ge] %y, %3 "y >= 0"' in text
    assert 'assume[lt] %3, %x "0 < x"' in text
    back = parse_module(text)
    assert print_module(back) == text
    assert [(f.rel, f.text) for f in back.facts] == [(f.rel, f.text) for f in m.facts]


def test_double_equals_and_multiline_relation():
    m = tg("dim v = 3\ninput y[v]\nassume sum[v](\n  y) == 1\nout r = y\n")
    assert m.facts[0].rel == "=" and m.facts[0].text == "sum[v]( y) == 1"


@pytest.mark.parametrize("src, message, col", [
    ("assume 1 > 0", "reads no input", 8),
    ("assume q > 0", "unknown name 'q'", 8),
    ("assume grad(sum(x * x), x) > 0", "cannot take a derivative ('grad')", 8),
    ("assume x", "expected", 9),
    ("assume = x", "unexpected", 8),
])
def test_mistakes_are_located_errors(src, message, col):
    with pytest.raises(CompileError) as e:
        tg(f"dim v = 3\ninput x[v]\n{src}\nout r = x\n")
    assert message in str(e.value)
    assert (e.value.loc.line, e.value.loc.col) == (3, col)


def test_assume_is_a_keyword():
    with pytest.raises(CompileError):
        tg("dim v = 3\ninput x[v]\nassume = x\nout assume = x\n")


def test_cli_error_has_file_line_col_and_caret(tmp_path):
    f = tmp_path / "bad.tg"
    f.write_text("dim v = 3\ninput x[v]\nassume 2 > 1\nout r = x\n")
    r = CliRunner().invoke(main, ["check", str(f)])
    assert r.exit_code != 0
    assert f"{f}:3:8: error: an assumption states a fact about the inputs" in r.output
    assert "^" in r.output


# ---- what the optimizer makes of them ----------------------------------------------------

HVP_GOLDEN = """\
%0 = reduce[max: v] %z : f64[b]
%1 = add[1.0, -1.0] %z, %0 : f64[b, v]
%2 = reduce[logsumexp: v] %1 : f64[b]
%3 = add[-1.0, 1.0] %2, %1 : f64[b, v]
%4 = map[exp] %3 : f64[b, v]
%5 = contract %dz, %4 : f64[b]
%6 = add[1.0, -1.0] %dz, %5 : f64[b, v]
%7 = contract %4, %6 : f64[b, v]
%8 = contract %y : f64[b]
%9 = const[1.0] : f64[]
out hv = %7 : [b, v]"""


def test_known_sum_makes_the_softmax_hessian_y_free():
    """s * (dz - s @ dz), s = softmax(z): the two y-free terms (golden IR); without
    the fact, the product keeps the factor sum[v](y)."""
    with_fact, without = optimize(_hvp(True)), optimize(_hvp(False))
    assert body(with_fact) == HVP_GOLDEN   # %8 = %9 is the fact, printed after the outputs
    assert all(v.op != "arg" or v.attrs[0] != "y" for v in with_fact.values())
    assert "contract %y : f64[b]" in body(without)
    assert len(ops(with_fact)) < len(ops(without))


def test_known_sum_values_agree_with_finite_differences():
    rng = np.random.default_rng(1)
    m, plain = optimize(_hvp(True)), optimize(_hvp(False))
    inputs = {"y": _distributions(rng, (3, 6)), "z": rng.standard_normal((3, 6)), "dz": rng.standard_normal((3, 6))}
    got = evaluate(m, inputs, dtype="f64")["hv"]
    np.testing.assert_allclose(got, evaluate(plain, inputs, dtype="f64")["hv"], rtol=1e-12, atol=1e-14)
    grad = optimize(tg(HVP.replace("out hv = jvp(grad(loss, z), z, dz)", "out g = grad(loss, z)").format(assume=FACT)))
    fd = central_difference(grad, inputs, "g", "z", inputs["dz"], 1e-5)
    np.testing.assert_allclose(got, fd, rtol=1e-6, atol=1e-8)


def test_fact_is_not_used_before_derivatives():
    """sum[v](y) = 1 holds on the inputs, not around them: the gradient with respect
    to y keeps its terms."""
    src = "dim v = 4\ninput y[v]\ninput z[v]\nassume sum[v](y) = 1\nout g = grad(sum[v](y) * sum[v](z), y)\n"
    m = optimize(tg(src))
    r = evaluate(m, {"y": np.full(4, 0.25), "z": np.arange(4.0)}, dtype="f64")
    np.testing.assert_allclose(r["g"], np.full(4, 6.0))


def test_sign_facts_feed_the_rules():
    src = "dim v = 4\ninput w[v]\n{a}\nout r = sqrt(w) * sqrt(w)\nout l = log(exp(w))\n"
    with_fact, without = optimize(tg(src.format(a="assume w > 0"))), optimize(tg(src.format(a="")))
    assert "%0 = map[sqrt]" not in body(with_fact) and "out r = %w" in body(with_fact)
    assert "map[sqrt]" in body(without)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_backends_agree(dtype):
    """IR interpreter, lowered-program interpreter and CPU backend, with the fact."""
    rng = np.random.default_rng(2)
    src = HVP.format(assume=FACT)
    program = tgc.compile(src, dtype=dtype)
    t = np.float32 if dtype == "f32" else np.float64
    inputs = {"y": _distributions(rng, (3, 6)).astype(t), "z": rng.standard_normal((3, 6)).astype(t),
              "dz": rng.standard_normal((3, 6)).astype(t)}
    reference = evaluate(optimize(_hvp(False)), inputs, dtype="f64")["hv"]
    tol = 1e-5 if dtype == "f32" else 1e-12
    np.testing.assert_allclose(evaluate(program.module, inputs)["hv"], reference, rtol=tol, atol=tol)
    np.testing.assert_allclose(run_lowered(program.lowered, inputs, {})["hv"], reference, rtol=tol, atol=tol)
    np.testing.assert_allclose(program(**inputs)["hv"], reference, rtol=tol, atol=tol)


def test_random_inputs_meet_the_facts():
    m = tg("dim b = 5, v = 7\ninput y[b, v]\ninput x[v]\ninput u[v]\nassume sum[v](y) = 2\n"
           "assume y >= 0\nassume x > 1\nassume u <= -1\nout r = y * x * u\n")
    for seed in range(3):
        inputs = random_inputs(m, m.bind_dims({}), seed, "f64")
        np.testing.assert_allclose(inputs["y"].sum(axis=1), 2.0)
        assert (inputs["y"] >= 0).all() and (inputs["x"] > 1).all() and (inputs["u"] <= -1).all()
        check_facts(m, inputs)


def test_verify_each_passes_with_facts():
    optimize(_hvp(True), seeds=(0, 1, 2))


# ---- checked at run time only when asked ------------------------------------------------

VIOL = """\
dim b = 2, v = 3
input y[b, v]
input x[v]
assume sum[v](y) = 1
assume x > 0
out r = sum[v](y) + x
"""
GOOD = {"y": np.full((2, 3), 1 / 3, np.float32), "x": np.ones(3, np.float32)}
BAD_SUM = {"y": np.array([[.2, .3, .5], [.2, .3, .6]], np.float32), "x": np.ones(3, np.float32)}
BAD_SIGN = {"y": GOOD["y"], "x": np.array([1, 0, 1], np.float32)}


def test_program_checks_only_when_asked():
    checked = tgc.compile(VIOL, options=tgc.Options(check_assumptions=True))
    np.testing.assert_allclose(checked(**GOOD)["r"], 2.0)
    with pytest.raises(EvalError, match=r"assumption 'sum\[v\]\(y\) = 1' \(.*:4:8\) does not hold at \[b=1\]"):
        checked(**BAD_SUM)
    with pytest.raises(EvalError, match=r"assumption 'x > 0' \(.*:5:8\) does not hold at \[v=1\]"):
        checked(**BAD_SIGN)
    # unchecked: the compiled program trusts the fact (sum[v](y) became 1)
    np.testing.assert_allclose(tgc.compile(VIOL)(**BAD_SUM)["r"], 2.0)


def test_equality_tolerance_scales_with_the_terms_summed():
    m = tg("dim v = 1000\ninput y[v]\nassume sum[v](y) = 1\nout r = y\n", "f32")
    y = np.full(1000, 1e-3, np.float32)
    check_facts(m, {"y": y}, dtype="f32")            # rounding of 1000 terms: accepted
    with pytest.raises(EvalError):
        check_facts(m, {"y": y * np.float32(1.001)}, dtype="f32")


@pytest.mark.parametrize("backend", ["interp", "cpu"])
def test_cli_check_assumptions(tmp_path, backend):
    f = tmp_path / "viol.tg"
    f.write_text(VIOL)
    for name, arrays in (("good", GOOD), ("bad", BAD_SUM)):
        np.savez(tmp_path / f"{name}.npz", **arrays)
    run = ["run", str(f), "--backend", backend]
    ok = CliRunner().invoke(main, run + ["--inputs", str(tmp_path / "good.npz"), "--check-assumptions"])
    assert ok.exit_code == 0, ok.output
    bad = CliRunner().invoke(main, run + ["--inputs", str(tmp_path / "bad.npz"), "--check-assumptions"])
    assert bad.exit_code == 3
    assert f"error: assumption 'sum[v](y) = 1' ({f}:4:8) does not hold at [b=1]" in bad.output
    unchecked = CliRunner().invoke(main, run + ["--inputs", str(tmp_path / "bad.npz")])
    assert unchecked.exit_code == 0
    generated = CliRunner().invoke(main, run + ["--random-inputs", "--check-assumptions"])   # they meet the facts
    assert generated.exit_code == 0, generated.output
