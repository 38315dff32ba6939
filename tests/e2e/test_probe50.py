"""Probe of stop 50: an outsider's programs and hostile inputs, from shared/LANGUAGE.md
and the README only, run through `tgc run`, `tgc build` and the Python API. Each test
here failed before its fix (the commit that adds it says which)."""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

import tgc
from tgc.cli import main
from tgc.ir.input_checks import EvalError


def many_edges(n: int, prefix: str) -> tuple[str, str]:
    """`dim p0 = 1, ...` and the edge list `p0, p1, ...` of n edges of size 1."""
    names = [f"{prefix}{i}" for i in range(n)]
    return ", ".join(f"{e} = 1" for e in names), ", ".join(names)


def test_run_random_inputs_with_more_edges_than_numpy_axes_is_a_clear_error(tmp_path):
    """Section 4 puts no bound on a tensor's edges; numpy holds at most 64 axes, so
    `tgc run --random-inputs` of a 100-edge input cannot make it: a runtime error (3)
    that says so, not an internal compiler error (4) with numpy's message."""
    dims, edges = many_edges(100, "e")
    src = tmp_path / "wide.tg"
    src.write_text(f"dim {dims}\ninput x[{edges}]\nout y = sum(x)\n")
    r = CliRunner().invoke(main, ["run", str(src), "--random-inputs"])
    assert r.exit_code == 3, r.output
    assert "input 'x' has 100 edges" in r.output and "internal" not in r.output


def test_interp_value_with_more_edges_than_numpy_axes_is_a_clear_error():
    """An outer product of two 35-edge tensors has 70 edges: the cpu backend runs it,
    the interpreter (numpy, at most 64 axes) says it cannot, instead of numpy's
    'maximum supported dimension' as an internal error."""
    da, ea = many_edges(35, "a")
    db, eb = many_edges(35, "b")
    src = f"dim {da}, {db}\ninput x[{ea}], y[{eb}]\nout s = sum(exp(x * y))\n"
    x, y = np.full((1,) * 35, 0.5), np.full((1,) * 35, 2.0)
    got = tgc.compile(src, backend="cpu", dtype="f64")(x=x, y=y)["s"]
    assert got == pytest.approx(np.e)
    with pytest.raises(EvalError, match="at most 64 edges per value; the cpu backend runs it"):
        tgc.compile(src, backend="interp", dtype="f64")(x=x, y=y)


def test_grad_emits_valid_tg_for_a_complex_program(tmp_path):
    """`tgc grad --emit tg` promises source `tgc check` accepts. For a program with
    complex values it declared the parts edge's twin as `dim re = re.im` (the internal
    dim name, with its dot), a parse error; the emitted derivative (over float pairs)
    must also give the gradient the program's own `grad` gives."""
    src = tmp_path / "c.tg"
    src.write_text("dim n = 4\nparam w[n], u[n]\nz = exp(1j * w) * (u + 2j)\n"
                   "out loss = sum(abs(z * z + 1j) + real(conj(z) * (1 + 1j)) + angle(z))\n")
    out = tmp_path / "g.tg"
    runner = CliRunner()
    r = runner.invoke(main, ["grad", str(src), "--wrt", "w", "--wrt", "u", "--dtype", "f64", "-o", str(out)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(main, ["check", str(out)])
    assert r.exit_code == 0, r.output
    rng = np.random.default_rng(0)
    w, u = rng.standard_normal(4), rng.standard_normal(4)
    want = tgc.compile(src.read_text() + "out gw = grad(loss, w)\nout gu = grad(loss, u)\n", dtype="f64")(w=w, u=u)
    got = tgc.compile(str(out), dtype="f64")(w=w, u=u)
    np.testing.assert_allclose(got["dw"], want["gw"], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got["du"], want["gu"], rtol=1e-12, atol=1e-14)


def test_ir_dump_of_a_symbolic_size_constant_reads_back(tmp_path):
    """`[t = size(t) - 1]` over a symbolic `t` (the last step of a scan) prints in the IR
    as `indicator[t = size(t + (-1))]`; the IR reader took no parenthesis inside
    `size(...)` and refused its own dump ('bad affine expression'). Read back, the dump
    computes what the source does."""
    src = tmp_path / "p.tg"
    src.write_text("dim t, n = 3\ninput x[t, n]\nfn acc(h, a) = h + a\n"
                   "hs = scan[t](acc, 0 * x[t = 0], x)\nout last = sum[t](hs * [t = size(t) - 1])\n")
    x = np.random.default_rng(0).standard_normal((5, 3))
    want = tgc.compile(str(src), dtype="f64")(x=x)["last"]
    np.testing.assert_allclose(want, x.sum(0), rtol=1e-12)
    for after in ("elaborate", None):
        ir = tmp_path / f"p_{after}.tgir"
        r = CliRunner().invoke(main, ["dump-ir", str(src), "--dtype", "f64", "-o", str(ir),
                                      *(["--after", after] if after else [])])
        assert r.exit_code == 0, r.output
        assert "size(t + (-1))" in ir.read_text()
        np.testing.assert_allclose(tgc.compile(str(ir), dtype="f64")(x=x)["last"], want, rtol=1e-12)


@pytest.mark.parametrize("command", [["run", "--random-inputs"], ["build", "-o", "{tmp}/libw.so"], ["explain"]])
def test_a_type_held_narrower_than_named_is_warned_by_every_command_that_builds(tmp_path, command):
    """docs/language.md section 14: `f64` in an f32 program holds f32 values, and "the
    compiler warns at each place that names such a type". Only `tgc check` did: `tgc
    run`, `build` and `explain` computed in f32 and said nothing."""
    src = tmp_path / "w.tg"
    src.write_text("dim n = 3\ninput a: f64[n], b[n]\nout c = a + b\n")
    args = [c.replace("{tmp}", str(tmp_path)) for c in command]
    r = CliRunner().invoke(main, [args[0], str(src), *args[1:]])
    assert r.exit_code == 0, r.output
    assert "w.tg:2:7: warning: input 'a': f64 is wider than this program's float type f32" in r.output
    r = CliRunner().invoke(main, [args[0], str(src), *args[1:], "--dtype", "f64"])
    assert r.exit_code == 0 and "warning" not in r.output, r.output
