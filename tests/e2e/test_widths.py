"""Per-tensor widths in f64 programs: `f32` (and `c64`) declarations and conversions are
honoured (tgc.ir.dtypes.at_width, tgc.ir.lowp.emulate_low with round32): each f32
value is rounded to f32 where it is produced, the call takes and returns float32
(complex64) arrays for it, gradients have their variable's type, and mixed f32/f64
operands promote to f64. Oracles: the IR interpreter, bit for bit against the lowered
interpreter and the CPU backend on correctly rounded operations; PyTorch computing the
same mixed program with float32 and float64 tensors (its own promotion); numpy."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

import tgc
from tgc.cli import main as cli
from tgc.frontend import compile_source
from tgc.ir.interp import EvalError, evaluate
from tgc.lower.interp import run_lowered
from tgc.manager import run_pipeline
from tgc.options import Options
from tgc.pipeline import lower_module

F64 = Options(dtype="f64")


def torch_or_skip():
    return pytest.importorskip("torch", reason="torch is the oracle of mixed f32/f64 arithmetic")


def optimized(src: str, opts: Options = F64):
    return run_pipeline(compile_source(src, "t.tg", opts), opts).module


def three_ways(src: str, inputs: dict, opts: Options = F64):
    """The IR interpreter's, the lowered interpreter's and the CPU backend's results on
    the same optimized module."""
    m = optimized(src, opts)
    ref = evaluate(m, inputs)
    low = run_lowered(lower_module(m, opts), inputs)
    got = tgc.compile(src, dtype=opts.dtype, options=opts)(**{k: np.copy(v) for k, v in inputs.items()})
    return ref, low, got


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


def f32_values(rng, shape):
    """f32 values of several scales (products of two land on halfway points often)."""
    return (rng.standard_normal(shape) * np.exp2(rng.integers(-8, 8, shape))).astype(np.float32)


ELEMENTWISE = """
dim n = 256
input x: f32[i: n]
input y: f32[i]
input z[i]
out mul = x * y
out add = x + y
out sub = x - 2 * y
out div = x / y
out sq = sqrt(abs(x))
out lit = x * 0.1
out mixed = x * z
out cvt = f32(z) * x
out up = f64(x) * f64(y)
out mx = max(x, y)
"""


def test_elementwise_f32_in_f64_bit_exact_three_ways_and_against_torch():
    rng = np.random.default_rng(1)
    x, y, z = f32_values(rng, 256), f32_values(rng, 256), rng.standard_normal(256)
    ref, low, got = three_ways(ELEMENTWISE, {"x": x, "y": y, "z": z})
    wide = {"mixed", "up"}
    for k in ref:
        want = np.float64 if k in wide else np.float32
        assert ref[k].dtype == want and got[k].dtype == want, (k, ref[k].dtype, got[k].dtype)
        assert same_bits(ref[k], got[k]) and same_bits(np.asarray(ref[k], np.float64), low[k]), k
    assert not same_bits(got["up"], got["mul"].astype(np.float64))   # f64(x) * f64(y) is not rounded
    torch = torch_or_skip()
    X, Y, Z = torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(z)
    oracle = {"mul": X * Y, "add": X + Y, "sub": X - 2 * Y, "div": X / Y, "sq": torch.sqrt(torch.abs(X)),
              "lit": X * 0.1, "mixed": X * Z, "cvt": Z.float() * X, "up": X.double() * Y.double(),
              "mx": torch.maximum(X, Y)}
    for k, v in oracle.items():
        assert v.numpy().dtype == got[k].dtype, k                     # torch's promotion is tgc's
        if k in ("div", "sq", "lit"):   # within an ulp: torch's sqrt is not correctly rounded
            # here, and the optimizer computes x / y as x * (1 / y) and folds 0.1 into a sum's
            # coefficient (kept in f64, as in an f32 program)
            np.testing.assert_allclose(got[k], v.numpy(), rtol=2.0 ** -22, atol=0)
        else:
            assert same_bits(got[k], v.numpy()), k
    assert same_bits(got["sq"], np.sqrt(np.abs(x)))                  # numpy's float32 sqrt is
    # --fp-strict keeps every operation as written: the division is correctly rounded too
    strict = tgc.compile(ELEMENTWISE, dtype="f64", options=F64.with_(fp_strict=True))(x=x, y=y, z=z)
    assert same_bits(strict["div"], x / y) and same_bits(strict["lit"], (x.astype(np.float64) * 0.1).astype(np.float32))


def test_promotion_and_widths_of_declarations_and_conversions():
    m = compile_source("""
dim n = 4, m = 3
input q[j: m]
input a: f32[i: n]
input b: f64[i]
input c[i]
input h: bf16[i]
out ab = a + b
out ac = a * c
out lit = a * 0.5 + 1
out aa = sum[i](a * a)
out ca = f32(c)
out ah = a * h
out up = f64(a)
out r = a[i = j + 1]
""", "t.tg", F64)
    assert {a.name: a.dtype for a in m.args.values()} == {"q": "f64", "a": "f32", "b": "f64", "c": "f64",
                                                          "h": "bf16"}
    types = {o.name: o.value.dtype for o in m.outputs}
    assert types == {"ab": "f64", "ac": "f64", "lit": "f32", "aa": "f32", "ca": "f32", "ah": "f32", "up": "f64",
                     "r": "f32"}
    # an f32 program computes in f32: f64 declarations and conversions have its width
    m32 = compile_source("dim n = 2\ninput a: f64[i: n]\nout y = f64(a) * 2", "t.tg", Options())
    assert m32.args["a"].dtype == "f32" and m32.outputs[0].value.dtype == "f32"


REDUCE = """
dim b = 33, k = 70, m = 21
input A: f32[b, k]
input B: f32[k, m]
input w[m]
C = A @ B
out C
out e = exp(A * 0.25)
out s = sum[b](C * C)
out t = tanh(C) @ w
"""


def test_products_reductions_and_functions_close_to_torch_float32():
    rng = np.random.default_rng(2)
    inputs = {"A": f32_values(rng, (33, 70)) / 16, "B": f32_values(rng, (70, 21)) / 16,
              "w": rng.standard_normal(21)}
    ref, low, got = three_ways(REDUCE, inputs)
    assert {k: got[k].dtype for k in got} == {"C": np.float32, "e": np.float32, "s": np.float32, "t": np.float64}
    for k in ref:   # sums in another order, libm's exp: to the last f32 bit
        np.testing.assert_allclose(got[k], ref[k], rtol=3e-7, atol=1e-30, err_msg=k)
        np.testing.assert_allclose(low[k], ref[k], rtol=3e-7, atol=1e-30, err_msg=k)
    torch = torch_or_skip()
    A, B, w = (torch.from_numpy(inputs[k]) for k in "ABw")
    C = A @ B
    oracle = {"C": C, "e": torch.exp(A * 0.25), "s": (C * C).sum(0), "t": (torch.tanh(C) * w).sum(-1)}
    for k, v in oracle.items():   # torch sums in f32: to its rounding, relative to the output's scale
        assert v.numpy().dtype == got[k].dtype, k
        scale = float(np.abs(v.numpy()).max())
        np.testing.assert_allclose(got[k], v.numpy(), rtol=2e-6, atol=2e-6 * scale, err_msg=k)
    # the product is computed in f64 and rounded once: numpy's float64 product, rounded
    exact = (inputs["A"].astype(np.float64) @ inputs["B"].astype(np.float64)).astype(np.float32)
    np.testing.assert_allclose(got["C"], exact, rtol=2.0 ** -23, atol=0)


GRADS = """
dim b = 6, f = 5, h = 4
input x: f32[b, f]
param W: f32[f, h]
param V[h]
input y[b]
hid = tanh(x @ W)
pred = sum[h](hid * V)
loss = sum[b]((pred - y) ^ 2)
out loss
out gW = grad(loss, W)
out gV = grad(loss, V)
out gx = grad(loss, x)
out hid
"""


def test_gradients_with_respect_to_f32_values_have_their_type_and_match_torch():
    m = compile_source(GRADS, "t.tg", F64)
    types = {o.name: o.value.dtype for o in m.outputs}
    assert types == {"loss": "f64", "gW": "f32", "gV": "f64", "gx": "f32", "hid": "f32"}
    rng = np.random.default_rng(4)
    inputs = {"x": f32_values(rng, (6, 5)) / 64, "W": f32_values(rng, (5, 4)) / 64, "V": rng.standard_normal(4),
              "y": rng.standard_normal(6)}
    ref, low, got = three_ways(GRADS, inputs)
    for k in ref:
        assert got[k].dtype == ref[k].dtype == np.dtype(np.float32 if types[k] == "f32" else np.float64), k
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-6, atol=1e-9, err_msg=k)
    torch = torch_or_skip()
    x = torch.from_numpy(inputs["x"]).requires_grad_()
    W = torch.from_numpy(inputs["W"]).requires_grad_()
    V = torch.from_numpy(inputs["V"]).requires_grad_()
    hid = torch.tanh(x @ W)                          # float32
    loss = (((hid * V).sum(-1) - torch.from_numpy(inputs["y"])) ** 2).sum()   # float64 (promoted)
    loss.backward()
    assert hid.dtype == torch.float32 and loss.dtype == torch.float64 and W.grad.dtype == torch.float32
    oracle = {"loss": loss, "gW": W.grad, "gV": V.grad, "gx": x.grad, "hid": hid}
    for k, v in oracle.items():
        want = v.detach().numpy()
        assert want.dtype == got[k].dtype, k
        # torch rounds the cotangents of f32 values to f32 on the way; tgc keeps them f64
        # until the gradient takes its variable's type: equal to f32 rounding
        np.testing.assert_allclose(got[k], want, rtol=2e-6, atol=1e-8, err_msg=k)


SGD = """
dim n = 8
input x: f32[i: n]
input t[i]
param W: f32[i]
state m: f32[i]
input lr: f32
loss = sum[i]((W * x - t) ^ 2)
out loss
update m = 0.9 * m + grad(loss, W)
update W = W - lr * grad(loss, W)
"""


def test_runtime_takes_and_returns_float32_arrays_and_updates_in_place():
    p = tgc.compile(SGD, dtype="f64")
    rng = np.random.default_rng(5)
    x, t, W0, m0 = f32_values(rng, 8), rng.standard_normal(8), f32_values(rng, 8), f32_values(rng, 8)
    W, m = W0.copy(), m0.copy()
    r = p(x=x, t=t, W=W, m=m, lr=0.1)                # a Python number for lr: rounded to f32
    assert r["W"] is W and r["m"] is m and W.dtype == m.dtype == np.float32 and r["loss"].dtype == np.float64
    want = evaluate(optimized(SGD), {"x": x, "t": t, "W": W0, "m": m0, "lr": np.float32(0.1)})
    assert same_bits(W, want["W"]) and same_bits(m, want["m"]) and same_bits(r["loss"], want["loss"])
    g = 2 * ((W0 * x).astype(np.float64) - t) * x          # the f64 gradient; rounded once to f32
    np.testing.assert_allclose(W, W0 - np.float32(0.1) * g.astype(np.float32), rtol=2 ** -22)
    np.testing.assert_allclose(m, 0.9 * m0 + g, rtol=2 ** -22)
    # a float64 array for an f32 argument only read: rounded to f32 on the way in; for an
    # updated one, refused (docs/dtypes.md, "What a call takes")
    x64 = x.astype(np.float64) * (1 + 2.0 ** -30)       # within half an f32 ulp of x
    r64 = p(x=x64, t=t, W=W0.copy(), m=m0.copy(), lr=0.1)
    assert same_bits(r64["W"], want["W"]) and same_bits(r64["loss"], want["loss"])
    W64 = W0.astype(np.float64)
    with pytest.raises(EvalError, match="'W' is updated in place, so it must be float32, not float64"):
        p(x=x, t=t, W=W64, m=m0.copy(), lr=0.1)
    assert same_bits(W64, W0.astype(np.float64))
    info = {a["name"]: a["dtype"] for a in p.info()["arguments"]}
    assert info == {"x": "f32", "t": "f64", "W": "f32", "m": "f32", "lr": "f32"}
    assert p.info()["outputs"][0]["dtype"] == "f64" and p.info()["updates"][0]["dtype"] == "f32"
    assert "f32" in str(p)


def test_cli_info_and_run_show_and_give_the_declared_types(tmp_path):
    src = tmp_path / "w.tg"
    src.write_text("dim n = 3\ninput x: f32[n]\ninput y[n]\nout a = x * x\nout b = x * y\n")
    r = CliRunner().invoke(cli, ["info", str(src), "--dtype", "f64", "--format", "json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert [a["dtype"] for a in info["arguments"]] == ["f32", "f64"]
    assert [o["dtype"] for o in info["outputs"]] == ["f32", "f64"]
    x = np.array([1 + 2.0 ** -20, 3.0, 0.1], np.float64)
    np.savez(tmp_path / "in.npz", x=x, y=np.ones(3))
    for backend in ("interp", "cpu"):
        out = tmp_path / f"{backend}.npz"
        r = CliRunner().invoke(cli, ["run", str(src), "--dtype", "f64", "--inputs", str(tmp_path / "in.npz"),
                                     "--backend", backend, "-o", str(out)])
        assert r.exit_code == 0, r.output
        got = np.load(out)
        assert got["a"].dtype == np.float32 and got["b"].dtype == np.float64, backend
        x32 = x.astype(np.float32).astype(np.float64)
        np.testing.assert_array_equal(got["a"], (x32 * x32).astype(np.float32))
        np.testing.assert_array_equal(got["b"], x32)


COMPLEX = """
dim n = 5, m = 3
input z: c64[n]
param U: c64[n, m]
input w: c128[m]
input x[n]
v = U @ z
out v
out q = v * w
out y = z * 2j + 1
out r = real(z)
out s = (1 + 0.5j) * x
loss = sum(abs(v * w) ^ 2)
out gU = grad(loss, U)
out gz = grad(loss, z)
"""


def test_c64_in_an_f64_program_holds_complex64_values():
    p = tgc.compile(COMPLEX, dtype="f64")
    info = {a["name"]: a["dtype"] for a in p.info()["arguments"]}
    assert info == {"z": "c64", "U": "c64", "w": "c128", "x": "f64"}
    outs = {o["name"]: o["dtype"] for o in p.info()["outputs"]}
    assert outs == {"v": "c64", "q": "c128", "y": "c64", "r": "f32", "s": "c128", "gU": "c64", "gz": "c64"}
    rng = np.random.default_rng(6)
    cplx = lambda *s: rng.standard_normal(s) + 1j * rng.standard_normal(s)  # noqa: E731
    z, U, w, x = cplx(5).astype(np.complex64), cplx(5, 3).astype(np.complex64), cplx(3), rng.standard_normal(5)
    r = p(z=z, U=U.copy(), w=w, x=x)
    assert {k: v.dtype for k, v in r.items()} == {
        "v": np.complex64, "q": np.complex128, "y": np.complex64, "r": np.float32, "s": np.complex128,
        "gU": np.complex64, "gz": np.complex64}
    v = (U.astype(np.complex128).T @ z.astype(np.complex128)).astype(np.complex64)
    np.testing.assert_allclose(r["v"], v, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(r["q"], r["v"].astype(np.complex128) * w, rtol=1e-12)   # v is complex64
    np.testing.assert_array_equal(r["y"], z * np.complex64(2j) + np.complex64(1))
    np.testing.assert_array_equal(r["r"], z.real)
    np.testing.assert_allclose(r["s"], (1 + 0.5j) * x, rtol=1e-15)
    # a complex128 array for a c64 input is rounded to complex64 on the way in
    r2 = p(z=z.astype(np.complex128) + 1e-12, U=U.copy(), w=w, x=x)
    np.testing.assert_array_equal(r2["v"], r["v"])
    torch = torch_or_skip()
    Z, Ut = torch.from_numpy(z).requires_grad_(), torch.from_numpy(U.copy()).requires_grad_()
    V = Ut.T @ Z
    loss = ((V * torch.from_numpy(w)).abs() ** 2).sum()
    loss.backward()
    assert Ut.grad.dtype == torch.complex64
    np.testing.assert_allclose(r["gU"], Ut.grad.numpy(), rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(r["gz"], Z.grad.numpy(), rtol=2e-5, atol=1e-5)


def test_c128_in_an_f32_program_has_the_program_width():
    p = tgc.compile("dim n = 3\ninput z: c128[n]\nout y = z * z\n")
    z = np.array([1 + 1e-9j, 2, 3j])
    r = p(z=z)
    assert r["y"].dtype == np.complex64
    np.testing.assert_allclose(r["y"], (z * z).astype(np.complex64), rtol=1e-6)


def random_program(rng) -> str:
    """A program over f32 and f64 inputs in an f64 program: correctly rounded
    elementwise operations and conversions, each result an output."""
    leaves = ["x", "y", "z", "u", "0.1"]
    ops = ["{a} + {b}", "{a} * {b}", "{a} - {b}", "{a} / ({b} * {b} + 1)", "max({a}, {b})", "f32({a})",
           "f64({a})", "sqrt(abs({a}))", "where({a} > 0, {a}, {b})", "-{a}"]

    def expr(depth):
        if depth == 0 or rng.random() < 0.2:
            return str(rng.choice(leaves))
        return str(rng.choice(ops)).format(a=expr(depth - 1), b=expr(depth - 1))

    outs = [f"out o{i} = x * 0 + {expr(4)}" for i in range(4)]
    return "dim n = 32\ninput x: f32[i: n]\ninput y: f32[i]\ninput z[i]\ninput u: f64[i]\n" + "\n".join(outs) + "\n"


@pytest.mark.parametrize("seed", range(12))
def test_random_mixed_width_programs_agree_bit_for_bit(seed):
    """Interpreter, lowered interpreter and CPU agree: f32 outputs bit for bit, f64 ones
    to f64 rounding (the CPU's f64 arithmetic may contract a * b + c into an FMA); each
    output has the type promotion gives it."""
    rng = np.random.default_rng(seed)
    src = random_program(rng)
    inputs = {"x": f32_values(rng, 32), "y": f32_values(rng, 32), "z": rng.standard_normal(32),
              "u": rng.standard_normal(32) * 1e3}
    ref, low, got = three_ways(src, inputs)
    for k in ref:
        assert got[k].dtype == ref[k].dtype, (k, src)
        if ref[k].dtype == np.float32:
            assert same_bits(ref[k], got[k]), (k, src)
            assert same_bits(np.asarray(ref[k], np.float64), low[k]), (k, src)
        else:
            scale = max(1.0, float(np.abs(ref[k]).max()))
            np.testing.assert_allclose(got[k], ref[k], rtol=1e-13, atol=1e-13 * scale, err_msg=src)
            np.testing.assert_allclose(low[k], ref[k], rtol=1e-13, atol=1e-13 * scale, err_msg=src)
    assert any(ref[k].dtype == np.float32 for k in ref) or seed != 0


def test_save_and_load_params_keep_f32_and_c64_in_an_f64_program(tmp_path):
    p = tgc.compile("dim n = 3\nparam W: f32[n]\nparam U: c64[n]\nparam V[n]\nout y = real(U) * W + V\n",
                    dtype="f64")
    params = {"W": np.array([0.1, 2, -3], np.float32), "U": np.array([1 + 2j, -3j, 0.5], np.complex64),
              "V": np.array([0.1, 0.2, 0.3])}
    tgc.save_params(tmp_path / "p.npz", p, params)
    back = tgc.load_params(tmp_path / "p.npz", p)
    assert {k: v.dtype for k, v in back.items()} == {"W": np.float32, "U": np.complex64, "V": np.float64}
    for k, v in params.items():
        np.testing.assert_array_equal(back[k], v)
    np.testing.assert_array_equal(p(**back)["y"], (params["U"].real * params["W"]).astype(np.float64)
                                  + params["V"])


@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="cuda-sim's emulator compiles with g++")
def test_cuda_sim_gives_the_cpu_backends_bits():
    """The CUDA backend's code (run on this CPU by cuda-sim) sees the same emulation."""
    rng = np.random.default_rng(1)
    inputs = {"x": f32_values(rng, 256), "y": f32_values(rng, 256), "z": rng.standard_normal(256)}
    cpu = tgc.compile(ELEMENTWISE, dtype="f64")(**inputs)
    sim = tgc.compile(ELEMENTWISE, backend="cuda-sim", dtype="f64")(**inputs)
    for k, v in cpu.items():
        got = np.asarray(sim[k])
        assert got.dtype == v.dtype and same_bits(got, v), k


def test_a_type_wider_than_the_program_warns_where_it_is_named(tmp_path):
    """An f32 program holds f64 and c128 declarations and conversions at its own width;
    `tgc check` warns at each place (once) and says how to keep the width."""
    import subprocess
    import sys

    def tgc_cli(*args):
        return subprocess.run([sys.executable, "-m", "tgc.cli", *map(str, args)], capture_output=True, text=True,
                              cwd=tmp_path)

    src = tmp_path / "w.tg"
    src.write_text("dim n = 3\ninput a: f64[n]\ninput b[n]\ninput z: c128[n]\n"
                   "fn twice(v) = f64(v) + f64(v)\n"
                   "out y = a + twice(b) + twice(b * 2) + real(c128(b)) + real(z)\n")
    r = tgc_cli("check", "w.tg")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "warning:" in line]
    assert lines == [
        "w.tg:2:7: warning: input 'a': f64 is wider than this program's float type f32: it holds f32 values "
        "(compile with --dtype f64 to keep its width)",
        "w.tg:4:7: warning: input 'z': c128 is wider than this program's float type f32: it holds c64 values "
        "(compile with --dtype f64 to keep its width)",
        "w.tg:5:15: warning: 'f64(...)' is wider than this program's float type f32: it holds f32 values "
        "(compile with --dtype f64 to keep its width)",
        "w.tg:5:24: warning: 'f64(...)' is wider than this program's float type f32: it holds f32 values "
        "(compile with --dtype f64 to keep its width)",   # each place once, though twice is called twice
        "w.tg:6:44: warning: 'c128(...)' is wider than this program's float type f32: it holds c64 values "
        "(compile with --dtype f64 to keep its width)",
    ], r.stderr
    r = tgc_cli("check", "w.tg", "--dtype", "f64")
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
