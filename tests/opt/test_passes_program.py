"""The passes that were transforms of the entry points: fix_dims, forward_only,
drop_unread_args, gradient_module (what a caller asks to build), emulate_f32 (the
target pass of --fp-strict), emulate_low and without_rules (before every lowering).
Each: its IR on a small program (golden), its values against the reference
interpreter, and that the command line sees it (tgc passes, --after, --print-ir-*)."""
import numpy as np
from click.testing import CliRunner

from passes_util import body, tg
from tgc.cli import main
from tgc.ir.inputs import random_inputs
from tgc.ir.interp import evaluate
from tgc.manager import run_passes
from tgc.options import Options

SRC = "dim n\ndim m = 2 * n\ninput x[n], u[m]\nparam w[n]\nout y = sum[n](w * x)\nupdate w = w - 0.5 * x\n"
F32 = Options(dtype="f32")
PASSES = ("fix_dims", "forward_only", "gradient_module", "drop_unread_args", "emulate_f32", "emulate_low",
          "without_rules")


def _run(m, spec, options=F32):
    return run_passes(m, (spec,), options)


def _values(m, dims=None, seed=0, dtype="f32"):
    dims = dims or {d: 3 for d in m.symbolic_dims()}
    inputs = random_inputs(m, m.bind_dims(dims), seed, dtype)
    return inputs, evaluate(m, {k: v.copy() for k, v in inputs.items()}, dtype=dtype, dims=dims)


def test_fix_dims_fixes_the_dim_and_the_dims_derived_from_it():
    m = tg(SRC, "f32")
    fixed = _run(m, "fix_dims{sizes=n=3}")
    assert fixed.dims == {"n": 3, "m": 6} and not fixed.symbolic_dims()
    assert body(fixed) == body(m)
    inputs, want = _values(m, {"n": 3})
    got = evaluate(fixed, inputs, dtype="f32")
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_fix_dims_refuses_a_size_that_is_not_one():
    import pytest

    with pytest.raises(ValueError, match="is not NAME=SIZE"):
        _run(tg(SRC, "f32"), "fix_dims{sizes=n}")
    with pytest.raises(ValueError, match="dim 'm' is derived"):
        _run(tg(SRC, "f32"), "fix_dims{sizes=m=5}")


def test_forward_only_drops_the_updates_and_what_only_they_read():
    m = tg(SRC, "f32")
    fwd = _run(m, "forward_only")
    assert body(fwd) == "%0 = contract %w, %x : f32[]\nout y = %0 : []"
    assert list(fwd.args) == ["x", "w"] and not fwd.updates
    inputs, want = _values(m)
    assert evaluate(fwd, {k: inputs[k] for k in fwd.args}, dtype="f32", dims={"n": 3})["y"] == want["y"]


def test_drop_unread_args_keeps_every_value_and_the_read_arguments():
    m = tg(SRC, "f32")
    for spec in ("drop_unread_args", "drop_unread_args{keep_dims=false}"):
        kept = _run(m, spec)
        assert list(kept.args) == ["x", "w"] and body(kept) == body(m)
    keeps = tg("dim n\ninput x[n], z[n]\nout y = sum[n](x) + sum[n](z)\nout c = 2.0\n", "f32")
    only_c = _run(_run(keeps, "forward_only"), "drop_unread_args")
    assert list(only_c.args) == ["x", "z"]   # both read


def test_gradient_module_writes_the_derivative_as_an_output():
    m = tg(SRC, "f32")
    g = _run(m, "gradient_module{wrt=w}")
    assert body(g) == "%0 = contract %w, %x : f32[]\n%1 = grad %0, %w : f32[n]\nout dw = %1 : [n]"
    derived = run_passes(g, ("normalize", "adjoint", "simplify"), F32)
    inputs, _ = _values(derived)
    got = evaluate(derived, inputs, dtype="f32", dims={"n": 3})
    np.testing.assert_array_equal(got["dw"], inputs["x"])   # d sum(w x) / dw = x
    fwd = run_passes(_run(m, "gradient_module{wrt=w,mode=fwd}"), ("normalize", "tangent", "simplify"), F32)
    np.testing.assert_array_equal(evaluate(fwd, inputs, dtype="f32", dims={"n": 3})["dw"], inputs["x"])


def test_emulate_f32_is_the_interpreters_f32_in_f64():
    m = tg("dim n = 7\ninput a[n], b[n]\nout y = exp(a) * b + tanh(a)\nout s = sum[n](a * b)\n", "f32")
    em = _run(m, "emulate_f32")
    assert body(em) == """\
%0 = map[exp] %a : f64[n]
%1 = map[round32] %0 : f64[n]
%2 = contract %1, %b : f64[n]
%3 = map[round32] %2 : f64[n]
%4 = map[tanh] %a : f64[n]
%5 = map[round32] %4 : f64[n]
%6 = add[1.0, 1.0] %3, %5 : f64[n]
%7 = map[round32] %6 : f64[n]
%8 = contract %a, %b : f64[]
%9 = map[round32] %8 : f64[]
out y = %7 : [n]
out s = %9 : []"""
    inputs, want = _values(m)
    got = evaluate(em, {k: v.astype(np.float64) for k, v in inputs.items()}, dtype="f64")
    for k in want:
        np.testing.assert_array_equal(got[k].astype(np.float32), want[k])
    assert _run(m, "emulate_f32", Options(dtype="f64")) is m   # an f64 program: nothing to emulate


def test_a_pass_that_changes_the_float_type_lowers_in_the_new_one():
    from tgc.lower.lowered import Lowered

    m = tg("dim n = 4\ninput a[n]\nout y = exp(a)\n", "f32")
    low = run_passes(m, ("emulate_f32", "fuse", "layout", "plan"), F32)
    assert isinstance(low, Lowered) and low.dtype == "f64"


def test_emulate_low_rounds_each_bf16_value_as_its_type_says():
    m = tg("dim n = 5\ninput x : bf16[n]\nout y = exp(x) * x\n", "f32")
    em = _run(m, "emulate_low")
    assert body(em) == """\
%0 = map[exp] %x : f32[n]
%1 = map[round_bf16] %0 : f32[n]
%2 = contract %1, %x : f32[n]
%3 = map[round_bf16] %2 : f32[n]
out y = %3 : [n]"""
    inputs, want = _values(m)
    got = evaluate(em, inputs, dtype="f32")
    np.testing.assert_array_equal(np.asarray(got["y"], np.float32), np.asarray(want["y"], np.float32))
    plain = tg("dim n = 5\ninput x[n]\nout y = exp(x)\n", "f32")
    assert _run(plain, "emulate_low") is plain


CUSTOM = """\
fn f(x) = exp(x) with vjp(g) = g * 2 * exp(x)
dim n = 4
input a[n]
out y = sum[n](f(a))
"""


def test_without_rules_leaves_the_bodies():
    m = tg(CUSTOM, "f32")
    assert any(v.op == "custom" for v in m.values())
    out = _run(m, "without_rules")
    assert body(out) == "%0 = map[exp] %a : f32[n]\n%1 = contract %0 : f32[]\nout y = %1 : []"
    inputs, want = _values(m)
    assert evaluate(out, inputs, dtype="f32")["y"] == want["y"]
    graded = tg(CUSTOM.replace("out y = sum[n](f(a))", "out y = sum[n](f(a))\nout d = grad(y, a)"), "f32")
    assert _run(graded, "without_rules") is graded   # the rules are still needed


# ---------------------------------------------------------------- the command line

def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_tgc_passes_lists_them(tmp_path):
    r = cli("passes")
    assert r.exit_code == 0
    listed = [line.split()[0] for line in r.output.splitlines() if line and not line.startswith(" ")]
    assert set(PASSES) <= set(listed)
    assert "target, after the pipeline (--fp-strict, an f32 program): emulate_f32" in r.output
    assert "before every lowering: emulate_low,without_rules" in r.output


def test_dump_ir_stops_after_them_and_prints_around_them(tmp_path):
    src = tmp_path / "p.tg"
    src.write_text("dim n = 3\ninput a[n], b[n]\nout y = exp(a) * b\n")
    r = cli("dump-ir", src, "--fp-strict", "--after", "emulate_f32")
    assert r.exit_code == 0 and "input a : f64[n]" in r.output and "map[round32]" in r.output
    r = cli("dump-ir", src, "--after", "without_rules")
    assert r.exit_code == 0 and "input a : f32[n]" in r.output and "buffer" not in r.output
    r = CliRunner().invoke(main, ["dump-ir", str(src), "--fp-strict", "--after", "fuse",
                                  "--print-ir-after", "emulate_f32,emulate_low", "--verify-each"])
    assert r.exit_code == 0, r.output
    assert "// ----- IR after emulate_f32 -----" in r.stderr and "// ----- IR after emulate_low -----" in r.stderr
    assert "// lowered after fuse (f64)" in r.stdout


def test_opt_runs_them_by_name(tmp_path):
    (tmp_path / "p.tg").write_text(SRC)
    src = tmp_path / "p.tgir"
    src.write_text(cli("dump-ir", tmp_path / "p.tg", "--after", "elaborate").output)
    r = cli("opt", src, "-p", "forward_only,fix_dims{sizes=n=2},drop_unread_args")
    assert r.exit_code == 0, r.output
    assert "dim n = 2" in r.output and "update" not in r.output and "input u" not in r.output


def test_fix_dims_sizes_that_do_not_fit_the_program_are_a_pass_list_error(tmp_path):
    """`tgc opt -p 'fix_dims{sizes=...}'` with a size that is not a number, not positive,
    not ASCII digits, or a dim the program lacks: a usage error (status 2) naming the
    pass, not an internal compiler error (status 4) or a ValueError out of int()."""
    import pytest

    from tgc.manager import PassListError

    for sizes, why in (("n=x", "is not NAME=SIZE"), ("n=²", "is not NAME=SIZE"), ("n=--4", "is not NAME=SIZE"),
                       ("n=0", "a size is a positive integer"), ("k=3", "no dim 'k'"),
                       ("m=5", "dim 'm' is derived")):
        with pytest.raises(PassListError, match=why):
            _run(tg(SRC, "f32"), f"fix_dims{{sizes={sizes}}}")
    from tgc.ir.printer import print_module

    path = tmp_path / "p.tgir"
    path.write_text(print_module(tg(SRC, "f32")))
    r = CliRunner().invoke(main, ["opt", str(path), "-p", "fix_dims{sizes=n=x}"])
    assert r.exit_code == 2 and "pass 'fix_dims'" in r.output and "internal compiler error" not in r.output, r.output


def test_gradient_module_mode_that_is_not_one_is_a_pass_list_error():
    """`-p 'gradient_module{wrt=w,mode=bogus}'`: a usage error naming the modes, not an
    internal compiler error from the ValueError `run` raises."""
    import pytest

    from tgc.manager import PassListError

    with pytest.raises(PassListError, match="pass 'gradient_module': mode is 'rev' or 'fwd', not 'bogus'"):
        _run(tg(SRC, "f32"), "gradient_module{wrt=w,mode=bogus}")
