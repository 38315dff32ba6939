"""--fp-strict: no algebra, reassociation or FMA; the CPU build gives the bits of the
reference interpreter on the unoptimized program (derivatives resolved, nothing else).

For f32 the CPU runs the f64 emulation of `tgc.ir.emulate` (every value rounded to
f32, as the interpreter rounds each op's float64 result), so the outputs are the same
bits. For f64 the ops and their order are the source's; transcendental functions and
BLAS sums are other libraries' than numpy's, so they agree to rounding, not to the bit.
"""
import ctypes
import re
from pathlib import Path

import numpy as np
import pytest

import tgc
from marks import heavy, sized_by_themselves
from passes_util import body, tg
from tgc import pipeline
from tgc.frontend import compile_file, compile_source
from tgc.ir.interp import evaluate
from tgc.ir.inputs import random_inputs
from tgc.options import Options
from tgc.ir.emulate import emulate_f32
from tgc.manager import run_pipeline

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = sized_by_themselves(sorted((ROOT / "examples").glob("*.tg"))) + sorted((ROOT / "tests/programs/good").glob("*.tg"))[:20]
STRICT = Options(dtype="f32", fp_strict=True)


def _strict_ir(src_or_path, dtype="f32"):
    opts = STRICT.with_(dtype=dtype)
    m = (compile_file(str(src_or_path), opts) if isinstance(src_or_path, Path)
         else compile_source(src_or_path, "<test>", opts))
    return pipeline.lower(m, opts).module


@pytest.mark.parametrize("path", heavy(PROGRAMS), ids=lambda p: p.stem)
def test_the_cpu_build_gives_the_interpreters_bits_in_f32(path):
    m = _strict_ir(path)
    dims = {d: 3 for d in m.symbolic_dims()}
    inputs = random_inputs(m, m.bind_dims(dims), 0, "f32")
    want = evaluate(m, {k: v.copy() for k, v in inputs.items()}, dtype="f32", dims=dims)
    prog = tgc.compile(str(path), dtype="f32", options=STRICT)
    got = prog.run({k: v.copy() for k, v in inputs.items()}, dims or None)
    for name in want:
        assert got[name].dtype == np.float32, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=f"{path.name}: {name}")


@pytest.mark.parametrize("path", heavy(PROGRAMS[:8]), ids=lambda p: p.stem)
def test_f64_agrees_to_rounding(path):
    m = _strict_ir(path, "f64")
    dims = {d: 3 for d in m.symbolic_dims()}
    inputs = random_inputs(m, m.bind_dims(dims), 1, "f64")
    want = evaluate(m, {k: v.copy() for k, v in inputs.items()}, dtype="f64", dims=dims)
    got = tgc.compile(str(path), dtype="f64", options=STRICT.with_(dtype="f64")).run(
        {k: v.copy() for k, v in inputs.items()}, dims or None)
    for name in want:
        scale = max(float(np.max(np.abs(want[name]), initial=0.0)), 1e-300)
        np.testing.assert_allclose(got[name], want[name], rtol=1e-13, atol=1e-13 * scale, err_msg=name)


def test_the_strict_pipeline_keeps_the_source_order():
    """Sums and scalings stay nested as written: nothing distributed, flattened or folded
    (the operands of one binary sum or product may swap: that is exact)."""
    src = "dim n = 3\ninput a[n], b[n], c[n]\nout y = 2 * (a - b) + 2 * b\nout z = (a + b) + c\nout w = 3 * (a * b)\n"
    m = run_pipeline(tg(src), Options(dtype="f64", fp_strict=True)).module
    assert body(m) == """\
%0 = add[-1.0, 1.0] %b, %a : f64[n]
%1 = add[2.0] %0 : f64[n]
%2 = add[2.0] %b : f64[n]
%3 = add[1.0, 1.0] %1, %2 : f64[n]
%4 = add[1.0, 1.0] %b, %a : f64[n]
%5 = add[1.0, 1.0] %c, %4 : f64[n]
%6 = contract %b, %a : f64[n]
%7 = add[3.0] %6 : f64[n]
out y = %3 : [n]
out z = %5 : [n]
out w = %7 : [n]"""


def test_emulation_rounds_what_f32_cannot_hold():
    m = emulate_f32(_strict_ir("dim n = 3\ninput a[n], b[n]\nout y = max(a, b) * 0.1 + exp(min(a, 0.1)) * b\n"))
    assert all(a.dtype == "f64" for a in m.args.values())
    text = body(m)
    assert "map[max]" in text and "round32] %" in text
    assert "const[0.10000000149011612]" in text       # a constant operand: 0.1 as an f32
    assert "add[0.1]" in text                         # a coefficient: in f64, as the interpreter has it
    rounded = {v.operands[0].op if v.op == "map" and v.attrs[0] == "round32" else None for v in m.values()}
    assert {"contract", "add"} <= rounded and "map" in rounded   # products, sums, exp


def test_updates_are_written_into_the_callers_f32_arrays():
    src = "dim n = 4\nparam W[n]\ninput x[n], lr\nloss = sum(W * x)\nout loss\nupdate W = W - lr * grad(loss, W)\n"
    prog = tgc.compile(src, dtype="f32", options=STRICT)
    w, x = np.arange(4, dtype=np.float32), np.full(4, 0.1, np.float32)
    out = prog(W=w, x=x, lr=np.float32(0.5))
    assert out["W"] is w and out["loss"].dtype == np.float32
    np.testing.assert_array_equal(w, np.arange(4, dtype=np.float32) - np.float32(0.5) * x)


def test_the_command_line_flag(tmp_path):
    """`tgc run --fp-strict`: the CPU build's outputs are the interpreter's, bit for bit."""
    from click.testing import CliRunner

    from tgc.cli import main

    outs = {}
    for backend in ("interp", "cpu"):
        out = tmp_path / f"{backend}.npz"
        r = CliRunner().invoke(main, ["run", str(ROOT / "examples/mlp.tg"), "--random-inputs", "--fp-strict",
                                      "--backend", backend, "-o", str(out)])
        assert r.exit_code == 0, r.output
        outs[backend] = dict(np.load(out))
    assert outs["cpu"].keys() == outs["interp"].keys()
    for name, a in outs["interp"].items():
        np.testing.assert_array_equal(outs["cpu"][name], a, err_msg=name)
    r = CliRunner().invoke(main, ["dump-ir", str(ROOT / "examples/mlp.tg"), "--fp-strict", "--after", "normalize"])
    assert r.exit_code == 0 and "grad" in r.output   # the first normalize of the strict pipeline


# Where the f32 build and the interpreter part: transcendentals (tgc's own polynomials
# against numpy's float64 ones, rounded once) and a long sum; and an update in place.
STRICT_BUILD = """\
dim n = 257
input a[n], b[n]
param w[n]
out y[n] = tanh(a) * exp(b) + log(1 + a * a)
out s = sum[n](exp(a) * b)
update w = w - 0.1 * sigmoid(a) * b
"""

C_FLOATS = {"float": np.float32, "double": np.float64}


def _abi(header: str, prefix: str, kind: str) -> list[tuple[str, type]]:
    """(name, numpy type) of each argument (kind ARG) or output (OUT) in ABI order, as
    the generated header's comments declare them."""
    found = re.findall(rf"#define {prefix.upper()}_{kind}_\w+ (\d+)\s+/\* (?:\w+ )?(\w+): (\w+) ", header)
    return [(name, C_FLOATS[ctype]) for _, name, ctype in sorted(found, key=lambda f: int(f[0]))]


def test_a_strict_built_library_gives_the_interpreters_bits(tmp_path):
    """`tgc build --fp-strict` of an f32 program runs the pipeline `tgc.compile` runs (its
    f64 emulation): the library, called through ctypes with the ABI its header declares,
    returns the reference interpreter's bits, as the compiled program does."""
    from click.testing import CliRunner

    from tgc.cli import main

    src = tmp_path / "strict.tg"
    src.write_text(STRICT_BUILD)
    result = CliRunner().invoke(main, ["build", str(src), "--fp-strict", "-o", str(tmp_path / "libstrict.so")])
    assert result.exit_code == 0, result.output
    m = _strict_ir(src)
    inputs = random_inputs(m, m.bind_dims({}), 3, "f32")
    want = evaluate(m, {k: v.copy() for k, v in inputs.items()}, dtype="f32")
    header = (tmp_path / "strict.h").read_text()
    args = {name: np.ascontiguousarray(inputs[name], dtype) for name, dtype in _abi(header, "strict", "ARG")}
    outs = {name: np.zeros(want[name].shape, dtype) for name, dtype in _abi(header, "strict", "OUT")}
    assert list(args) == ["a", "b", "w"] and list(outs) == ["y", "s"]
    lib = ctypes.CDLL(str(tmp_path / "libstrict.so"))
    assert lib.strict_init_default() == 0
    lib.strict_workspace_bytes.restype = ctypes.c_int64
    ws = np.zeros(lib.strict_workspace_bytes((ctypes.c_int64 * 1)(0)) + 64, np.uint8)
    status = lib.strict_run((ctypes.c_int64 * 1)(0), (ctypes.c_void_p * 3)(*[a.ctypes.data for a in args.values()]),
                            (ctypes.c_void_p * 2)(*[o.ctypes.data for o in outs.values()]),
                            ctypes.c_void_p(ws.ctypes.data + (-ws.ctypes.data) % 64))
    assert status == 0
    for name in ("y", "s"):
        np.testing.assert_array_equal(outs[name].astype(np.float32), want[name], err_msg=name)
        np.testing.assert_array_equal(outs[name], outs[name].astype(np.float32), err_msg=f"{name}: not an f32 value")
    np.testing.assert_array_equal(args["w"].astype(np.float32), want["w"], err_msg="w (updated in place)")
    compiled = tgc.compile(str(src), options=STRICT).run({k: v.copy() for k, v in inputs.items()})
    for name in ("y", "s"):
        np.testing.assert_array_equal(compiled[name], want[name], err_msg=f"tgc.compile: {name}")


@pytest.mark.xfail(strict=True, reason="normalize (tgc/opt/canon.py, add and contract) drops a term whose "
                   "coefficients cancel and folds a product with a constant 0 to 0, in every pipeline, so "
                   "`x - x` and `x * 0` are 0 for a NaN or infinite x; IEEE and PyTorch give NaN. A documented "
                   "choice (docs/language.md section 12, 'Exact algebra reads values as real numbers'): "
                   "a derivative's exact zeros rely on it")
@pytest.mark.parametrize("strict", [False, True])
def test_x_minus_x_and_x_times_0_propagate_nan_and_inf(strict):
    p = tgc.compile("dim n = 3\ninput x[n]\nout e[n] = x - x\nout z[n] = x * 0\n", dtype="f64",
                    options=Options(fp_strict=strict))
    x = np.array([np.nan, np.inf, 1.0])
    r = p(x=x)
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(r["e"], x - x)
        np.testing.assert_array_equal(r["z"], x * 0)
