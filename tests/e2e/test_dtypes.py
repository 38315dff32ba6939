"""Element types bf16 and f16 (tgc.ir.dtypes, tgc.ir.lowp): storage in bf16/f16,
arithmetic in f32 rounded once per value, promotion, conversions, gradients' types,
runtime I/O of ml_dtypes arrays, and the agreement of the IR interpreter, the lowered
interpreter and the CPU backend (bit for bit where the f32 computation is
exact-rounded). PyTorch's bf16/f16 arithmetic is the oracle where it is installed."""
from __future__ import annotations

import io
import shutil

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

import tgc
from tgc.cli import main as cli
from tgc.frontend import compile_source
from tgc.ir.diag import CompileError
from tgc.ir.dtypes import promote, round_to
from tgc.ir.interp import EvalError, evaluate
from tgc.lower.interp import run_lowered
from tgc.ir.parser import parse_module
from tgc.ir.printer import print_module
from tgc.options import Options
from tgc.manager import run_pipeline
from tgc.pipeline import lower_module

BF16 = ml_dtypes.bfloat16
NP = {"bf16": np.dtype(BF16), "f16": np.dtype(np.float16)}


def torch_or_skip():
    return pytest.importorskip("torch", reason="torch is the oracle of bf16/f16 arithmetic")


def pipeline(src: str, **options):
    opts = Options().with_(**options)
    m = compile_source(src, "t.tg", opts)
    return run_pipeline(m, opts).module


def three_ways(src: str, inputs: dict, **options) -> tuple[dict, dict, dict]:
    """The IR interpreter's, the lowered interpreter's and the CPU backend's results on
    the same optimized module; the CUDA backend's under cuda-sim is checked against the
    CPU's on the way (same types, values to a bf16/f16 ulp)."""
    opts = Options().with_(**options)
    m = pipeline(src, **options)
    ref = evaluate(m, inputs)
    low = run_lowered(lower_module(m, opts), inputs)
    got = tgc.compile(src, options=opts)(**{k: v.copy() for k, v in inputs.items()})
    if shutil.which("g++") is not None:   # cuda-sim (its emulator compiles with g++)
        sim = tgc.compile(src, backend="cuda-sim", options=opts)(**{k: v.copy() for k, v in inputs.items()})
        for k, v in got.items():   # the same types; values to a bf16/f16 ulp (libm's transcendentals)
            assert sim[k].dtype == v.dtype, (k, sim[k].dtype, v.dtype)
            a, b = np.asarray(sim[k], np.float64), np.asarray(v, np.float64)
            assert np.allclose(a, b, rtol=2 ** -7, atol=1e-6, equal_nan=True), (k, np.abs(a - b).max())
    return ref, low, got


def same_bits(a, b) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


def values(rng, n, t):
    """bf16/f16 values: normal, tiny, large, halfway points after the product..."""
    x = rng.standard_normal(n) * np.exp2(rng.integers(-6, 6, n))
    return round_to(x, t)


ELEMENTWISE = """
dim n = 64
input x: {t}[i: n]
input y: {t}[i]
out mul = x * y
out add = x + y
out sub = x - 2 * y
out div = x / y
out sq = x * x * y
out mx = max(x, y)
out cvt = f32(x) * f32(y)
"""


@pytest.mark.parametrize("t", ["bf16", "f16"])
def test_elementwise_bit_exact_three_ways_and_against_torch(t):
    rng = np.random.default_rng(1)
    x, y = values(rng, 64, t), values(rng, 64, t)
    ref, low, got = three_ways(ELEMENTWISE.format(t=t), {"x": x, "y": y})
    for k in ref:
        want_type = np.float32 if k == "cvt" else NP[t]
        assert ref[k].dtype == want_type and got[k].dtype == want_type, k
        assert same_bits(ref[k], got[k]) and same_bits(ref[k], low[k]), k
    torch = torch_or_skip()
    tt = {"bf16": torch.bfloat16, "f16": torch.float16}[t]
    X = torch.from_numpy(x.astype(np.float32)).to(tt)
    Y = torch.from_numpy(y.astype(np.float32)).to(tt)
    # torch rounds each bf16/f16 op from its f32 result, once; a product x * x * y is one
    # contraction in tgc, so it is rounded once (its f32 product is exact-rounded)
    F = X.float() * X.float() * Y.float()
    oracle = {"mul": X * Y, "add": X + Y, "sub": X - 2 * Y, "div": X / Y, "sq": F.to(tt),
              "mx": torch.maximum(X, Y), "cvt": X.float() * Y.float()}
    for k, v in oracle.items():
        assert same_bits(got[k], v.float().numpy()), k


CONVERT = """
dim n = 16
input x[i: n]
out b = bf16(x)
out h = f16(x)
out back = f32(bf16(x)) - x
"""


def test_conversions_round_to_nearest_even_like_torch():
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9, 65504.0, 65520.0, 1e6, 3.4e38,
                  -0.0, np.inf, -np.inf, np.nan, 2**-24, 2**-25 * 1.5, 1e-40, -1 - 2**-8], np.float32)
    ref, low, got = three_ways(CONVERT, {"x": x})
    for k in ref:
        assert same_bits(ref[k], got[k]) and same_bits(ref[k], low[k]), k
    assert got["b"].dtype == NP["bf16"] and got["h"].dtype == NP["f16"]
    assert got["b"][1] == 1.0 and got["b"][2] == 1 + 2**-6   # ties to even, both ways
    assert np.isinf(got["h"][5]) and got["h"][4] == 65504     # f16 overflows to inf
    torch = torch_or_skip()
    X = torch.from_numpy(x)
    assert same_bits(got["b"], X.to(torch.bfloat16).float().numpy())
    assert same_bits(got["h"], X.to(torch.float16).float().numpy())


def test_promotion_table():
    assert promote("bf16", "bf16") == "bf16" and promote("f16", "f16") == "f16"
    assert promote("bf16", "f16") == "f32" and promote("f16", "bf16") == "f32"
    assert promote("bf16", "f32") == "f32" and promote("f16", "f64") == "f64"
    m = compile_source("""
dim n = 4
input a: bf16[i: n]
input b: f16[i]
input c[i]
out ab = a + b
out ac = a * c
out lit = a * 0.1 + 1
out aa = sum[i](a * a)
out ca = bf16(c)
""", "t.tg", Options())
    types = {o.name: o.value.dtype for o in m.outputs}
    assert types == {"ab": "f32", "ac": "f32", "lit": "bf16", "aa": "bf16", "ca": "bf16"}
    # in an f64 program, f32 is honoured (tests/e2e/test_widths.py) and f64 is the program's type
    outs = compile_source("dim n = 2\ninput a: f16[i: n]\nout y = f32(a)\nout z = f64(a)", "t.tg",
                          Options(dtype="f64")).outputs
    assert [o.value.dtype for o in outs] == ["f32", "f64"]


def test_literal_does_not_promote_and_is_not_rounded_first():
    # a * 0.1: the f32 product with the f32 literal, rounded once to bf16 (not 0.1 in bf16)
    x = round_to(np.linspace(-3, 3, 16), "bf16")
    ref, _, got = three_ways("dim n = 16\ninput x: bf16[i: n]\nout y = x * 0.1", {"x": x})
    want = round_to(x.astype(np.float32) * np.float32(0.1), "bf16")
    assert same_bits(got["y"], want) and same_bits(ref["y"], want)


GRADS = """
dim n = 8
input x: bf16[i: n]
param W: f16[i]
param V: bf16[i]
input dW: f16[i]
loss = sum[i](f32(W) * f32(W) * x + tanh(f32(V)) * x)
out gW = grad(loss, W)
out gV = grad(loss, V)
out t = jvp(loss, W, dW)
out h = vjp(W * x, W, x)
"""


def test_gradients_have_their_variables_type_and_match_finite_differences():
    m = compile_source(GRADS, "t.tg", Options())
    assert {o.name: o.value.dtype for o in m.outputs} == {"gW": "f16", "gV": "bf16", "t": "f32", "h": "f16"}
    rng = np.random.default_rng(3)
    inputs = {"x": values(rng, 8, "bf16"), "W": values(rng, 8, "f16"), "V": values(rng, 8, "bf16"),
              "dW": values(rng, 8, "f16")}
    ref, low, got = three_ways(GRADS, inputs)
    x, W, V = (inputs[k].astype(np.float64) for k in "xWV")
    # derivatives of the f32 loss, in f64, by central differences of the exact function
    loss = lambda W, V: np.sum(W * W * x + np.tanh(V) * x)   # noqa: E731
    h = 1e-6
    eye = np.eye(8)
    fdW = np.array([(loss(W + h * e, V) - loss(W - h * e, V)) / (2 * h) for e in eye])
    fdV = np.array([(loss(W, V + h * e) - loss(W, V - h * e)) / (2 * h) for e in eye])
    np.testing.assert_allclose(got["gW"].astype(np.float64), fdW, rtol=2**-10, atol=1e-3)
    np.testing.assert_allclose(got["gV"].astype(np.float64), fdV, rtol=2**-7, atol=1e-2)
    np.testing.assert_allclose(got["t"], fdW @ inputs["dW"].astype(np.float64), rtol=1e-4, atol=1e-3)
    assert got["gW"].dtype == NP["f16"] and got["gV"].dtype == NP["bf16"] and got["h"].dtype == NP["f16"]
    for k in ("gW", "h"):   # products: exact-rounded, so bit-exact everywhere
        assert same_bits(ref[k], got[k]) and same_bits(ref[k], low[k]), k
    np.testing.assert_allclose(got["gV"].astype(np.float64), ref["gV"].astype(np.float64), rtol=2**-7)


SGD = """
dim n = 8
input x: bf16[i: n]
param W: bf16[i]
input lr
loss = sum[i](f32(W * x) * f32(W * x))
out l = loss
update W = W - lr * grad(loss, W)
"""


def test_runtime_takes_and_returns_bf16_arrays_and_updates_them_in_place():
    p = tgc.compile(SGD)
    rng = np.random.default_rng(0)
    x, W = values(rng, 8, "bf16"), values(rng, 8, "bf16")
    W0 = W.copy()
    ref = evaluate(pipeline(SGD), {"x": x, "W": W0, "lr": np.float32(0.1)})
    out = p(x=x, W=W, lr=0.1)
    assert out["W"] is W and W.dtype == NP["bf16"]          # written back, in bf16, in place
    assert same_bits(W, ref["W"]) and same_bits(out["l"], ref["l"])
    assert not same_bits(W, W0)
    # an f32 array for a bf16 input is rounded to bf16 on the way in
    x32 = x.astype(np.float32) * np.float32(1 + 2**-11)   # within half a bf16 ulp of x: rounds to x
    assert same_bits(x32.astype(NP["bf16"]), x)
    out32 = p(x=x32, W=W0.copy(), lr=0.1)
    assert same_bits(out32["W"], ref["W"]) and same_bits(out32["l"], ref["l"])
    W1 = W0.astype(np.float32)        # but an updated bf16 param must be a bf16 array
    with pytest.raises(EvalError, match="'W' is updated in place, so it must be bfloat16, not float32"):
        p(x=x32, W=W1, lr=0.1)
    assert same_bits(W1, W0)
    with pytest.raises(EvalError, match="float array"):
        p(x=np.arange(8, dtype=np.complex64), W=W, lr=0.1)


def test_torch_bf16_tensors_through_dlpack():
    torch = torch_or_skip()
    p = tgc.compile(SGD)
    rng = np.random.default_rng(0)
    x, W = values(rng, 8, "bf16"), values(rng, 8, "bf16")
    ref = p(x=x, W=W.copy(), lr=0.1)
    tx = torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    tW = torch.from_numpy(W.view(np.int16).copy()).view(torch.bfloat16)
    out = p(x=tx, W=tW, lr=0.1)
    assert same_bits(tW.float().numpy(), ref["W"])          # the tensor itself was updated
    assert same_bits(out["l"], ref["l"])


def test_npz_inputs_and_outputs_hold_bf16(tmp_path):
    src = tmp_path / "p.tg"
    src.write_text("dim n = 4\ninput x: bf16[i: n]\ninput y: f16[i]\nout z = x * x\nout w = y + y\n")
    x = round_to([1.5, -2.25, 3.0, 1 / 3], "bf16")
    y = np.array([0.5, 1e-3, 3.0, 7.0], np.float16)
    np.savez(tmp_path / "in.npz", x=x, y=y)
    for backend in ("cpu", "interp"):
        r = CliRunner().invoke(cli, ["run", str(src), "--inputs", str(tmp_path / "in.npz"), "--backend", backend,
                                     "-o", str(tmp_path / f"{backend}.npz")])
        assert r.exit_code == 0, r.output
        out = np.load(tmp_path / f"{backend}.npz")
        z = out["z"].view(BF16)   # numpy saves bfloat16 as raw 2-byte items
        assert same_bits(z, round_to(x.astype(np.float32) ** 2, "bf16"))
        assert out["w"].dtype == np.float16 and same_bits(out["w"], y + y)
    r = CliRunner().invoke(cli, ["run", str(src), "--inputs", str(tmp_path / "in.npz")])
    assert r.exit_code == 0 and "bfloat16" in r.output and "float16" in r.output


def test_ir_text_round_trip_and_verify_each():
    m = pipeline(GRADS, passes=None)
    text = print_module(m)
    assert "bf16[" in text and "f16[" in text and "to_f32" in text
    assert print_module(parse_module(text)) == text
    run_pipeline(compile_source(GRADS, "t.tg", Options()), Options(verify_each=True))
    lower_module(m, Options(verify_each=True))


def test_fp_strict_keeps_bf16_bit_exact():
    # --fp-strict: every op as written, f32 values emulated in f64; bf16 values still
    # rounded through f32 once, as the interpreter does on the unoptimized program
    src = "dim n = 32\ninput x: bf16[i: n]\ninput y: bf16[i]\nout z = (x + y) * (x - y) / y\nout s = sum[i](x * y)"
    rng = np.random.default_rng(5)
    inputs = {"x": values(rng, 32, "bf16"), "y": values(rng, 32, "bf16")}
    ref = evaluate(compile_source(src, "t.tg", Options()), inputs)
    got = tgc.compile(src, options=Options(fp_strict=True))(**inputs)
    for k in ref:
        assert same_bits(ref[k], got[k]), k


@pytest.mark.parametrize("src, where, message", [
    ("dim n = 4\ninput x: bf8[i: n]\nout y = x", (2, 10), "unknown dtype 'bf8'"),
    ("dim n = 4\ninput ids: i32[i: n]\nout y = bf16(ids)", (3, 14), "i32"),
    ("dim n = 4\ninput x: bf16[i: n]\nout y = f16(x, x)", (3, 9), "'f16' takes 1 argument, got 2"),
    ("dim n = 4\ninput z: c64[i: n]\nout y = f32(z)", (3, 9), "'f32' is not defined for complex values"),
])
def test_errors_are_located(src, where, message):
    with pytest.raises(CompileError) as info:
        compile_source(src, "t.tg", Options())
    e = info.value
    assert (e.loc.line, e.loc.col) == where and message in str(e)


def test_cli_reports_type_errors_with_caret(tmp_path):
    f = tmp_path / "bad.tg"
    f.write_text("dim n = 4\ninput x: bf8[i: n]\nout y = x\n")
    r = CliRunner().invoke(cli, ["check", str(f)])
    assert r.exit_code == 1
    assert "bad.tg:2:10: error: unknown dtype 'bf8'" in r.output and "^~~" in r.output


# ---- mixed precision (--autocast) -------------------------------------------------------

MLP = """
dim batch = 16, features = 24, hidden = 32, classes = 5
input x[batch, features]
input y[batch, classes]
param W1[features, hidden]
param W2[hidden, classes]
input lr
h = tanh(x @ W1)
logits = h @ W2
loss = mean[batch](cross_entropy[classes](logits, y))
out loss
update W1 = W1 - lr * grad(loss, W1)
update W2 = W2 - lr * grad(loss, W2)
"""


def mlp_inputs(seed=0):
    rng = np.random.default_rng(seed)
    y = np.eye(5, dtype=np.float32)[rng.integers(0, 5, 16)]
    return {"x": rng.standard_normal((16, 24)).astype(np.float32), "y": y,
            "W1": (rng.standard_normal((24, 32)) * 0.3).astype(np.float32),
            "W2": (rng.standard_normal((32, 5)) * 0.3).astype(np.float32), "lr": np.float32(0.5)}


@pytest.mark.parametrize("t", ["bf16", "f16"])
def test_autocast_converts_matrix_products_only(t):
    from tgc.opt.autocast import is_matmul

    m = pipeline(MLP, autocast=t)
    gemms = [v for v in m.values() if is_matmul(v)]
    assert len(gemms) >= 5   # x W1, h W2 and the backward products (dlogits W2^T, x^T dh, h^T dlogits)
    for v in gemms:
        assert v.dtype == "f32" and all(o.dtype == t for o in v.operands if o.op not in ("const", "indicator")), v
    # nothing else reads a bf16/f16 value: reductions, the loss, the updates stay f32
    for v in m.values():
        if not is_matmul(v) and v.op != "map":
            assert all(o.dtype == "f32" or o.dtype == "i32" for o in v.operands), v
        if v.op == "reduce":
            assert v.dtype == "f32"
    assert all(o.value.dtype == "f32" for o in m.outputs) and all(u.value.dtype == "f32" for u in m.updates)
    assert not any(v.dtype == t for v in pipeline(MLP).values())    # off by default


def test_autocast_min_flops_keeps_small_products_in_f32():
    """`autocast_min_flops`: only products of at least that many FLOPs (as `tgc explain`
    counts them) take bf16 operands; above every product, the program is the f32 one."""
    from tgc.opt.autocast import is_matmul
    from tgc.opt.stats import rep_sizes, value_flops

    def converted(m):
        return [v for v in m.values() if is_matmul(v)
                and any(o.op == "map" and o.attrs[0] == "to_bf16" for o in v.operands)]
    every = pipeline(MLP, autocast="bf16")
    sizes = rep_sizes(every, 64)
    flops = sorted({value_flops(v, sizes) for v in converted(every)})
    assert len(flops) >= 2
    some = pipeline(MLP, autocast="bf16", autocast_min_flops=flops[-1])
    sizes = rep_sizes(some, 64)
    assert converted(some) and all(value_flops(v, sizes) >= flops[-1] for v in converted(some))
    assert len(converted(some)) < len(converted(every))
    none = pipeline(MLP, autocast="bf16", autocast_min_flops=flops[-1] + 1)
    assert not converted(none) and not any(v.dtype == "bf16" for v in none.values())
    inputs = mlp_inputs()
    got = tgc.compile(MLP, options=Options(autocast="bf16", autocast_min_flops=1 << 40))(
        **{k: np.copy(v) for k, v in inputs.items()})
    want = tgc.compile(MLP)(**{k: np.copy(v) for k, v in inputs.items()})
    for k in want:
        assert np.array_equal(got[k], want[k]), k


def test_autocast_step_close_to_f32_and_interpreter_agrees():
    inputs = mlp_inputs()
    f32 = tgc.compile(MLP)(**{k: np.copy(v) for k, v in inputs.items()})
    opts = Options(autocast="bf16")
    got = tgc.compile(MLP, options=opts)(**{k: np.copy(v) for k, v in inputs.items()})
    ref = evaluate(pipeline(MLP, autocast="bf16"), {k: np.copy(v) for k, v in inputs.items()})
    for k in ("loss", "W1", "W2"):
        np.testing.assert_allclose(got[k], f32[k], rtol=2e-2, atol=2e-2)        # bf16 operands: ~2^-8 each
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6)        # the same roundings, f32 sums
    assert not np.array_equal(got["loss"], f32["loss"])                        # it did round
    run_pipeline(compile_source(MLP, "t.tg", opts), opts.with_(verify_each=True))


def test_autocast_matmul_matches_torch_bf16_products_with_f32_accumulation():
    torch = torch_or_skip()
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((48, 64)).astype(np.float32), rng.standard_normal((64, 40)).astype(np.float32)
    src = "dim m = 48, k = 64, n = 40\ninput a[m, k]\ninput b[k, n]\nout c[m, n] = a @ b"
    got = tgc.compile(src, options=Options(autocast="bf16"))(a=a, b=b)["c"]
    A, B = torch.from_numpy(a).bfloat16().float(), torch.from_numpy(b).bfloat16().float()
    np.testing.assert_allclose(got, (A @ B).numpy(), rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tc = torch.from_numpy(a) @ torch.from_numpy(b)                         # torch rounds its result to bf16
    np.testing.assert_allclose(got, tc.float().numpy(), rtol=2**-7, atol=2**-7 * np.abs(got).max())


def test_autocast_option_is_checked_and_cli_flag_works(tmp_path):
    with pytest.raises(ValueError, match="autocast"):
        tgc.compile(MLP, options=Options(autocast="f8"))
    f = tmp_path / "mlp.tg"
    f.write_text(MLP)
    r = CliRunner().invoke(cli, ["dump-ir", str(f), "--autocast", "bf16"])
    assert r.exit_code == 0 and "to_bf16" in r.output
    r = CliRunner().invoke(cli, ["run", str(f), "--random-inputs", "--backend", "cpu", "--autocast", "f16"])
    assert r.exit_code == 0, r.output


def test_loss_scaling_program_of_the_docs():
    """docs/dtypes.md's f16 loss scaling, run: the step is the f32 step's (to f16), and an
    overflowing scale reports `bad` and leaves W as it was."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "dtypes.md").read_text()
    src = text.split("## Loss scaling")[1].split("```\n")[1]
    p = tgc.compile(src)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, 16)).astype(np.float16)
    y = np.eye(4, dtype=np.float32)[rng.integers(0, 4, 8)]
    W0 = (rng.standard_normal((16, 4)) * 0.5).astype(np.float16)
    W = W0.copy()
    out = p(x=x, y=y, W=W, lr=0.5, scale=1024.0)
    assert out["bad"] == 0 and W.dtype == np.float16 and not np.array_equal(W, W0)
    # the same step in f64, rounded to f16
    logits = x.astype(np.float64) @ W0.astype(np.float64)
    pr = np.exp(logits - logits.max(1, keepdims=True))
    pr /= pr.sum(1, keepdims=True)
    gW = x.astype(np.float64).T @ (pr - y) / 8
    np.testing.assert_allclose(W.astype(np.float64), W0 - 0.5 * gW, rtol=2e-3, atol=2e-3)
    W = W0.copy()
    out = p(x=x, y=y, W=W, lr=0.5, scale=1e8)   # the scaled f16 gradient overflows
    assert out["bad"] == 1 and np.array_equal(W, W0)


def test_grad_emit_tg_keeps_types_and_values(tmp_path):
    """`tgc grad --emit tg` of a bf16 program: the .tg it writes declares bf16, spells
    the conversions, and computes the same gradient as the IR it came from."""
    f = tmp_path / "g.tg"
    f.write_text("dim n = 8\ninput x: bf16[i: n]\nparam W: bf16[i]\n"
                 "loss = sum[i](f32(W * x) * tanh(f32(W)))\nout loss\n")
    r = CliRunner().invoke(cli, ["grad", str(f), "--wrt", "W", "--emit", "tg", "-o", str(tmp_path / "d.tg")])
    assert r.exit_code == 0, r.output
    text = (tmp_path / "d.tg").read_text()
    assert "input x: bf16[" in text and "param W: bf16[" in text and "bf16(" in text and "to_" not in text
    rng = np.random.default_rng(6)
    inputs = {"x": values(rng, 8, "bf16"), "W": values(rng, 8, "bf16")}
    got = tgc.compile(str(tmp_path / "d.tg"))(**inputs)["dW"]
    direct = tgc.compile(f.read_text().replace("out loss", "out dW = grad(loss, W)"))(**inputs)["dW"]
    assert got.dtype == NP["bf16"] and same_bits(got, direct)


def test_bf16_scalar_from_a_python_number_and_forward_only_call():
    src = "dim n = 4\ninput x: bf16[i: n]\ninput s: bf16\nparam W: bf16[i]\nout y = x * s\nupdate W = W - 0.5 * x"
    p = tgc.compile(src)
    x = round_to([1, 2, 3, 1 / 3], "bf16")
    W = np.ones(4, BF16)
    out = p(x=x, s=0.1, W=W)
    s = round_to(0.1, "bf16").astype(np.float32)          # 0.1 rounded to bf16 first
    assert same_bits(out["y"], round_to(x.astype(np.float32) * s, "bf16"))
    assert same_bits(W, round_to(1 - 0.5 * x.astype(np.float32), "bf16"))
    forward = p.run({"x": x, "s": 0.1}, updates=False)
    assert set(forward) == {"y"} and same_bits(forward["y"], out["y"]) and forward["y"].dtype == NP["bf16"]


def test_save_and_load_bf16_params(tmp_path):
    src = "dim n = 4\ninput x: bf16[i: n]\nparam W: bf16[i]\nparam V: f16[i]\nparam U[i]\nout y = f32(x * W) + f32(V) * U"
    p = tgc.compile(src)
    W, V, U = round_to([0.1, 0.2, 0.3, 0.4], "bf16"), np.array([1, 2, 3, 1e-5], np.float16), np.ones(4, np.float32)
    tgc.save_params(tmp_path / "p.npz", p, {"W": W, "V": V, "U": U})
    back = tgc.load_params(tmp_path / "p.npz", p)
    assert back["W"].dtype == NP["bf16"] and back["V"].dtype == NP["f16"] and back["U"].dtype == np.float32
    assert same_bits(back["W"], W) and same_bits(back["V"], V)
    tgc.save_params(tmp_path / "p.safetensors", p, {"W": W, "V": V, "U": U})   # safetensors too (BF16, F16)
    back = tgc.load_params(tmp_path / "p.safetensors", p)
    assert same_bits(back["W"], W) and same_bits(back["V"], V) and back["U"].dtype == np.float32
    np.savez(tmp_path / "f32.npz", W=W.astype(np.float32), V=V, U=U)
    with pytest.raises(tgc.ParamsError, match="'W' is f32, the program's 'W' is bf16"):
        tgc.load_params(tmp_path / "f32.npz", p)
    assert tgc.load_params(tmp_path / "f32.npz", p, cast=True)["W"].dtype == NP["bf16"]



def test_a_gradient_keeps_its_variables_type_when_simplify_moves_the_rounding():
    """grad(sum[m](x @ W), W) is x broadcast over m: simplify moves the bf16 rounding
    inside the broadcast, which computes in f32; the output is still bf16 (the
    variable's type) in the optimized module and on every evaluator."""
    src = ("dim k = 3, m = 2\ninput x: bf16[k]\nparam W: bf16[k, m]\n"
           "out g = grad(sum[m](x @ W), W)\n")
    x = np.array([0.5, -1.25, 3.0], BF16)
    inputs = {"x": x, "W": np.ones((3, 2), BF16)}
    assert pipeline(src).outputs[0].value.dtype == "bf16"
    want = np.repeat(x.astype(np.float32)[:, None], 2, 1)
    for got in three_ways(src, inputs):
        assert same_bits(got["g"], want)
    assert tgc.compile(src)(**inputs)["g"].dtype == BF16


@pytest.mark.parametrize("low", ["bf16", "f16"])
def test_a_conversion_converts_the_rounded_value(low):
    """`f32(x * x)` with a bf16/f16 `x` is the product rounded to bf16/f16, then
    widened: an f32 value (it was once the unrounded f32 product, rounded again after
    the conversion and returned as bf16), and a sum of it accumulates the rounded
    products in f32."""
    src = f"dim i = 3, j = 4\ninput x: {low}[i, j]\nout s = f32(x * x)\nout r = sum[j](f32(x * x))\n"
    x = (np.arange(12).reshape(3, 4) * 1.37).astype(NP[low])
    square = (x.astype(np.float32) ** 2).astype(NP[low]).astype(np.float32)
    for run in (lambda: evaluate(compile_source(src, "t.tg", Options()), {"x": x}),
                lambda: tgc.compile(src)(x=x)):
        out = run()
        assert out["s"].dtype == np.float32 and out["r"].dtype == np.float32
        np.testing.assert_array_equal(out["s"], square)
        np.testing.assert_allclose(out["r"], square.sum(1), rtol=1e-6)
