"""Complex numbers (c64, c128): values and derivatives against numpy and torch.autograd,
the IR interpreter, the lowered interpreter and the CPU backend against each other,
the IR's text round trip, `--verify-each`, `tgc run` with npz files, and the errors."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

import tgc
from tgc import pipeline
from tgc.cli import main
from tgc.frontend import compile_source
from tgc.ir.diag import CompileError
from tgc.ir.interp import evaluate
from tgc.lower.interp import run_lowered
from tgc.ir.parser import parse_module
from tgc.ir.printer import print_module
from tgc.options import Options
from tgc.pipeline import lower_module
from passes_util import optimize

SIM = shutil.which("g++") is not None   # cuda-sim compiles the CUDA module with g++ (OpenMP)
CDT = {"f32": np.complex64, "f64": np.complex128}
TOL = {"f32": 2e-5, "f64": 1e-12}


def crandn(rng, *shape, dtype="f64"):
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(CDT[dtype])


def wide(src: str, dtype: str) -> str:
    """`src` with its complex data of the program's width: `c64` declarations become
    `c128` in an f64 program (where a `c64` tensor would hold complex64 values)."""
    return src.replace(": c64[", ": c128[") if dtype == "f64" else src


def all_paths(src: str, inputs: dict, dtype: str):
    """(name, result) of the IR interpreter, the lowered interpreter, the CPU backend and,
    where g++ is (the emulator compiles with it), the CUDA backend under cuda-sim; the
    program's complex declarations of its width (`wide`)."""
    src = wide(src, dtype)
    opts = Options(dtype=dtype)
    m = pipeline.lower(compile_source(src, "<complex>", opts), opts).module
    yield "interp", evaluate(m, {k: np.copy(v) for k, v in inputs.items()}, dtype=dtype)
    yield "lowered", run_lowered(lower_module(m, opts), {k: np.copy(v) for k, v in inputs.items()})
    yield "cpu", tgc.compile(src, dtype=dtype)(**{k: np.copy(v) for k, v in inputs.items()})
    if SIM:   # the CUDA backend's generated code, run on this CPU by the emulator
        yield "cuda-sim", tgc.compile(src, backend="cuda-sim", dtype=dtype)(**{k: np.copy(v) for k, v in inputs.items()})


def close(got, want, dtype, what=""):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, what
    scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
    err = float(np.max(np.abs(got - want), initial=0.0)) / scale
    assert err <= TOL[dtype], f"{what}: error {err:.3g}"


ELEMENTWISE = """
dim n = 6
input z: c64[n]
input w: c64[n]
input x[n]
out p = z * w
out q = z @ w
out d = z / w
out xd = x / w
out a = abs(z)
out e = exp(z)
out l = log(z)
out g = angle(z)
out c = conj(z) + real(w) - 2 * imag(w)
out s = (1 + 0.5j) * x + z ^ 3 - 2j
out ni = z ^ -2 + z ^ 0
out m = mean(z) + sum[n](x * z)
out cx = c128(x) + c64(2)
out wh = where(x > 0, z, x)
"""


def numpy_elementwise(z, w, x):
    return dict(p=z * w, q=(z * w).sum(), d=z / w, xd=x / w, a=abs(z), e=np.exp(z), l=np.log(z), g=np.angle(z),
                c=np.conj(z) + w.real - 2 * w.imag, s=(1 + 0.5j) * x + z ** 3 - 2j, ni=z ** -2 + 1,
                m=z.mean() + (x * z).sum(), cx=x + 2 + 0j, wh=np.where(x > 0, z, x))


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_elementwise_and_contractions_agree_with_numpy_on_every_path(dtype):
    rng = np.random.default_rng(1)
    z, w = crandn(rng, 6, dtype=dtype), crandn(rng, 6, dtype=dtype)
    x = rng.standard_normal(6).astype(dtype.replace("f", "float"))
    want = numpy_elementwise(z.astype(complex), w.astype(complex), x.astype(float))
    for path, got in all_paths(ELEMENTWISE, dict(z=z, w=w, x=x), dtype):
        for k, v in want.items():
            kind = "c" if np.iscomplexobj(v) else "f"
            assert got[k].dtype.kind == kind and got[k].dtype.itemsize == (8 if dtype == "f32" else 16) // (
                1 if kind == "c" else 2), (path, k, got[k].dtype)
            close(got[k], v, dtype, f"{path}: {k}")


def test_edge_operations_gathers_and_stop_act_on_complex_values():
    src = """dim n = 5, m = 3
input z: c64[n]
input ids: i32[m]
out g = z[n = ids]
out s = z[n = n + 1] * [n < 4]
out t = stop(z) - 1j * z[n -> k][k -> n]
out r = max[n](real(z)) + sum[n](imag(z))
out sc = z[n = ids] @ [n = ids]                   # a gather, then a scatter-add back
"""
    rng = np.random.default_rng(10)
    z, ids = crandn(rng, 5, dtype="f32"), np.array([4, 0, 2], np.int32)
    for path, got in all_paths(src.replace("dim n = 5, m = 3", "dim n = 5, m = 3, k = 5"), dict(z=z, ids=ids), "f32"):
        np.testing.assert_array_equal(got["g"], z[ids], err_msg=path)
        np.testing.assert_array_equal(got["s"], np.append(z[1:], 0), err_msg=path)
        close(got["t"], z - 1j * z, "f32", path)
        close(got["r"], z.real.max() + z.imag.sum(), "f32", path)
        want = np.zeros(5, np.complex64)
        np.add.at(want, ids, z[ids])
        close(got["sc"], want, "f32", path)


def test_angle_and_log_in_every_quadrant_on_the_axes_and_at_zero():
    vals = np.array([1, 1j, -1, -1j, 0, 1 + 1e-300j, -1 + 1e-12j, -1 - 1e-12j, 3 + 4j, -3 + 4j,
                     -3 - 4j, 3 - 4j, 1e-8 + 1j, 1e200 + 1e199j, 2.5e-300 + 0j], np.complex128)
    src = "dim n = 15\ninput z: c128[n]\nout g = angle(z)\nout l = log(z + 0 * [n = 4])\n"
    for path, got in all_paths(src, {"z": vals}, "f64"):
        np.testing.assert_allclose(got["g"], np.angle(vals), rtol=4e-16, atol=0, err_msg=path)
        ok = (np.arange(15) != 4) & (abs(vals) < 1e150) & (abs(vals) > 1e-150)   # |z|^2 in range; log 0 below
        np.testing.assert_allclose(got["l"][ok].imag, np.log(vals[ok]).imag, rtol=4e-16, err_msg=path)
        assert got["l"][4].real == -np.inf and got["l"][4].imag == 0


OPS = {   # .tg form and numpy reference of each step of a random program
    "add": ("{a} + {b}", lambda a, b: a + b), "sub": ("{a} - {b}", lambda a, b: a - b),
    "mul": ("{a} * {b}", lambda a, b: a * b), "div": ("{a} / ({b} + 3)", lambda a, b: a / (b + 3)),
    "conj": ("conj({a}) * 0.5j", lambda a, b: np.conj(a) * 0.5j), "sq": ("{a} ^ 2 / 4", lambda a, b: a ** 2 / 4),
    "exp": ("exp({a} / 4)", lambda a, b: np.exp(a / 4)), "re": ("real({a}) + {b}", lambda a, b: a.real + b),
    "abs": ("abs({a}) * {b}", lambda a, b: abs(a) * b), "dot": ("({a} @ {b}) * {b}", lambda a, b: (a * b).sum() * b),
}


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(sorted(OPS)), st.integers(0, 9), st.integers(0, 9)), min_size=1,
                max_size=8), st.integers(0, 2 ** 16))
def test_random_complex_programs_agree_with_numpy(steps, seed):
    """Random chains of complex operations (each step reads two earlier values): the
    IR interpreter in f64 against numpy's complex128 arithmetic."""
    rng = np.random.default_rng(seed)
    vals = {"z": crandn(rng, 4), "w": crandn(rng, 4), "x": rng.standard_normal(4) + 0j}
    lines = ["dim n = 4", "input z: c128[n]", "input w: c128[n]", "input x[n]"]
    for i, (op, ia, ib) in enumerate(steps):
        names = list(vals)
        a, b = names[ia % len(names)], names[ib % len(names)]
        form, ref = OPS[op]
        lines.append(f"v{i} = {form.format(a=a, b=b)}")
        vals[f"v{i}"] = ref(vals[a], vals[b])
    last = f"v{len(steps) - 1}"
    lines.append(f"out y = {last} + 0 * z")
    m = compile_source("\n".join(lines) + "\n", "<random>", Options(dtype="f64"))
    got = evaluate(pipeline.lower(m, Options(dtype="f64")).module,
                   dict(z=vals["z"], w=vals["w"], x=vals["x"].real), dtype="f64")["y"]
    want = vals[last] + 0 * vals["z"]
    if np.all(np.isfinite(want)) and np.abs(want).max() < 1e100:
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * max(1.0, np.abs(want).max()))


def test_ir_prints_and_reads_back_and_passes_verify_each():
    opts = Options(dtype="f64")
    m = compile_source(ELEMENTWISE, "<complex>", opts)
    optimized = optimize(m)                        # the default pipeline, with --verify-each
    text = print_module(optimized)
    assert "re.im" in text
    again = parse_module(text)
    assert print_module(again) == text
    rng = np.random.default_rng(2)
    inputs = dict(z=crandn(rng, 6), w=crandn(rng, 6), x=rng.standard_normal(6))
    a, b = evaluate(optimized, inputs, dtype="f64"), evaluate(again, inputs, dtype="f64")
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_gradient_of_a_real_loss_against_finite_differences():
    """grad(L, z) = dL/dRe z + i dL/dIm z, checked part by part with central differences."""
    src = """dim n = 5
input z: c128[n]
input w: c128[n]
L = sum(abs(exp(z * w) - z) ^ 2) + sum(angle(z + 3)) + sum(real(log(z)))
out L
out g = grad(L, z)
"""
    rng = np.random.default_rng(3)
    z, w = 0.5 * crandn(rng, 5), 0.5 * crandn(rng, 5)
    prog = tgc.compile(src, dtype="f64")
    g = prog(z=z, w=w)["g"]
    h = 1e-6
    for k in range(5):
        for unit in (1, 1j):
            dz = np.zeros(5, complex)
            dz[k] = unit * h
            fd = (prog(z=z + dz, w=w)["L"] - prog(z=z - dz, w=w)["L"]) / (2 * h)
            part = g[k].real if unit == 1 else g[k].imag
            assert abs(fd - part) < 1e-7 * max(1, abs(part)), (k, unit, fd, part)


def test_abs_and_angle_have_gradient_zero_at_zero_as_torch():
    src = "dim n = 3\ninput z: c128[n]\nout ga = grad(sum(abs(z)), z)\nout gg = grad(sum(angle(z)), z)\n"
    z = np.array([0, 1 + 1j, -2j])
    for path, got in all_paths(src, {"z": z}, "f64"):
        np.testing.assert_allclose(got["ga"], [0, (1 + 1j) / np.sqrt(2), -1j], atol=1e-15, err_msg=path)
        np.testing.assert_allclose(got["gg"], [0, -0.5 + 0.5j, 0.5], atol=1e-15, err_msg=path)   # i / conj(z)


def test_update_of_a_complex_param_is_written_in_place():
    src = """dim n = 4
param z: c64[n]
input t: c64[n]
input lr
loss = sum(abs(z - t) ^ 2)
out loss
update z = z - lr * grad(loss, z)
"""
    rng = np.random.default_rng(4)
    z, t = crandn(rng, 4, dtype="f32"), crandn(rng, 4, dtype="f32")
    z0 = z.copy()
    result = tgc.compile(src)(z=z, t=t, lr=0.25)
    assert result["z"] is z
    np.testing.assert_allclose(z, z0 - 0.25 * 2 * (z0 - t), rtol=1e-6)   # torch's z.grad = 2 (z - t)
    z128 = z0.astype(np.complex128)     # another width: refused (a converted copy would take the update)
    with pytest.raises(tgc.EvalError, match="'z' is updated in place, so it must be complex64, not complex128"):
        tgc.compile(src)(z=z128, t=t.astype(np.complex128), lr=0.5)
    np.testing.assert_array_equal(z128, z0)


@pytest.mark.parametrize("fp_strict", [False, True])
def test_forward_only_calls_and_fp_strict_take_complex_arrays(fp_strict):
    src = "dim n = 4\nparam z: c64[n]\ninput w: c64[n]\nout p = z * w\nupdate z = z * 1j\n"
    prog = tgc.compile(src, options=Options(fp_strict=fp_strict))
    z, w = np.array([1 + 2j, 3, 4j, -1], np.complex64), np.full(4, 2 - 1j, np.complex64)
    z0 = z.copy()
    r = prog(z=z, w=w, updates=False)
    assert set(r) == {"p"} and r["p"].dtype == np.complex64
    np.testing.assert_array_equal(z, z0)
    r = prog(z=z, w=w)
    np.testing.assert_array_equal(r["p"], z0 * w)      # exact: each part is one product and one sum
    assert r["z"] is z
    np.testing.assert_array_equal(z, z0 * 1j)


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_save_and_load_params_keep_complex_arrays(tmp_path, suffix):
    prog = tgc.compile("dim n = 3\nparam z: c64[n]\nout y = z * z\n")
    z = np.array([1 + 2j, -3j, 0.5], np.complex64)
    tgc.save_params(tmp_path / f"p{suffix}", prog, {"z": z})     # stored as float pairs, edges [n, re.im]
    back = tgc.load_params(tmp_path / f"p{suffix}", prog)["z"]
    assert back.dtype == np.complex64 and back.flags.writeable
    np.testing.assert_array_equal(back, z)
    np.testing.assert_allclose(prog(z=back)["y"], z * z, rtol=1e-6)


def test_grad_emits_a_tg_program_over_the_float_pairs(tmp_path):
    src = tmp_path / "c.tg"
    src.write_text("dim n = 3\ninput z: c64[n]\nout L = sum(abs(exp(z)) ^ 2)\n")
    r = CliRunner().invoke(main, ["grad", str(src), "--wrt", "z"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "dim re_im = 2" in r.output and "input z[n, re_im]" in r.output
    emitted = compile_source(r.output, "<emitted>", Options(dtype="f64"))
    z = np.array([1 + 2j, -0.5j, 0.25], complex)
    pairs = np.stack([z.real, z.imag], -1)
    got = evaluate(pipeline.lower(emitted, Options(dtype="f64")).module, {"z": pairs}, dtype="f64")
    grad = [v for k, v in got.items() if k != "L"][0]
    np.testing.assert_allclose(grad[..., 0] + 1j * grad[..., 1], 2 * np.exp(2 * z.real), rtol=1e-12)


def test_tgc_grad_of_a_complex_output_asks_for_a_cotangent(tmp_path):
    src = tmp_path / "c.tg"
    src.write_text("dim n = 3\ninput z: c64[n]\ninput s\nout y = sum(z) * s\n")
    r = CliRunner().invoke(main, ["grad", str(src), "--wrt", "s", "--of", "y"])
    assert r.exit_code == 1
    assert "--of y: the output is complex; its derivative needs an explicit cotangent v" in r.output


def test_tgc_run_reads_and_writes_complex_npz(tmp_path):
    src = tmp_path / "c.tg"
    src.write_text("dim n = 3\ninput z: c64[n]\nout y = z * 1j + conj(z)\nout r = abs(z)\n")
    rng = np.random.default_rng(5)
    z = crandn(rng, 3, dtype="f32")
    np.savez(tmp_path / "in.npz", z=z)
    for backend in ("interp", "cpu"):
        out = tmp_path / f"out_{backend}.npz"
        r = CliRunner().invoke(main, ["run", str(src), "--inputs", str(tmp_path / "in.npz"), "--backend", backend,
                                      "-o", str(out)], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        got = np.load(out)
        assert got["y"].dtype == np.complex64 and got["r"].dtype == np.float32
        np.testing.assert_allclose(got["y"], z * 1j + np.conj(z), rtol=1e-6)
        np.testing.assert_allclose(got["r"], abs(z), rtol=1e-6)


ERRORS = [
    ("out y = z < 1", "1:9", "comparison '<' is not defined for complex values"),
    ("out y = max[n](z)", "1:9", "'max' is not defined for complex values"),
    ("out y = max(z, x)", "1:9", "'max' is not defined for complex values"),
    ("out y = erf(z)", "1:9", "'erf' is not defined for complex values"),
    ("out y = tanh(2j)", "1:9", "'tanh' is not defined for complex values"),
    ("out y = where(z, x, x)", "1:15", "the condition of 'where' is not defined for complex values"),
    ("out y = grad(sum(z * z), z)", "1:9", "needs an explicit cotangent v, written vjp(f, x, v)"),
    ("out y = z ^ x", "1:13", "a complex power takes an integer literal exponent"),
    ("out y = z ^ 0.5", "1:13", "a complex power takes an integer literal exponent"),
    ("out y = x ^ z", "1:9", "a complex power takes an integer literal exponent"),
    ("out y = jvp(x * x, x, z)", "1:23", "the tangent of real 'x' must be real, not complex"),
    ("update p = p + z", "1:12", "the update of real 'p' is complex"),
]


@pytest.mark.parametrize("line,where,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_real_only_operations_on_complex_values_are_located_errors(line, where, message):
    src = "dim n = 3\ninput z: c64[n]\ninput x[n]\nparam p[n]\n" + line + "\n"
    with pytest.raises(CompileError) as e:
        compile_source(src, "e.tg", Options())
    text = str(e.value)
    assert text.startswith(f"e.tg:{4 + int(where.split(':')[0])}:{where.split(':')[1]}: error: "), text
    assert message in text


def test_tgc_check_shows_the_error_with_its_caret_line(tmp_path):
    src = tmp_path / "bad.tg"
    src.write_text("dim n = 3\ninput z: c64[n]\nout y = erf(z)\n")
    r = CliRunner().invoke(main, ["check", str(src)])     # click 8.2+: r.output holds stderr too
    assert r.exit_code == 1
    assert f"{src}:3:9: error: 'erf' is not defined for complex values" in r.output
    assert "out y = erf(z)\n" in r.output and "        ^" in r.output


def test_a_real_array_for_a_complex_input_is_a_clear_error():
    from tgc.ir.interp import EvalError

    src = "dim n = 4\ninput z: c64[n]\nout y = z * 2\n"
    with pytest.raises(EvalError, match=r"input 'z' is complex \(\[n\]\): pass a complex array"):
        tgc.compile(src)(z=np.ones(4, np.float32))
    m = compile_source(src, "<c>", Options())
    with pytest.raises(EvalError, match="pass a complex array"):
        evaluate(m, {"z": np.ones(4)}, dtype="f32")
    pairs = np.arange(8, dtype=np.float32).reshape(4, 2)      # the float pairs themselves are taken
    np.testing.assert_array_equal(tgc.compile(src)(z=pairs)["y"], 2 * (pairs[:, 0] + 1j * pairs[:, 1]))


def test_unknown_dtype_lists_the_complex_types():
    with pytest.raises(CompileError, match="unknown dtype 'c32'; expected one of: .*c64, c128") as e:
        compile_source("input z: c32\n", "e.tg", Options())
    assert str(e.value).startswith("e.tg:1:10: error:")


# ---------------------------------------------------------------- against torch.autograd

torch = pytest.importorskip("torch", reason="torch is the oracle of complex derivatives")


def torch_grad(fn, *args):
    """fn's value and the gradients torch gives for each complex argument (z.grad)."""
    ts = [torch.tensor(a, requires_grad=True) for a in args]
    out = fn(*ts)
    out.backward()
    return out.detach().numpy(), [t.grad.numpy() for t in ts]


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_products_abs_exp_gradients_match_torch(dtype):
    src = """dim i = 4, j = 3
input a: c64[i, j]
input b: c64[j]
y = a @ b                                      # a complex matrix-vector product
L = sum(abs(exp(0.3 * y)) ^ 2) + sum(real(y * conj(b @ [j = i])))
out L
out ga = grad(L, a)
out gb = grad(L, b)
"""
    rng = np.random.default_rng(6)
    a, b = crandn(rng, 4, 3, dtype=dtype), crandn(rng, 3, dtype=dtype)

    def fn(a, b):
        y = a @ b
        bi = torch.cat([b, torch.zeros(1, dtype=b.dtype)])
        return (torch.exp(0.3 * y).abs() ** 2).sum() + (y * bi.conj()).real.sum()

    L, (ga, gb) = torch_grad(fn, a.astype(complex), b.astype(complex))
    for path, got in all_paths(src, dict(a=a, b=b), dtype):
        close(got["L"], L, dtype, f"{path} L")
        close(got["ga"], ga, dtype, f"{path} ga")
        close(got["gb"], gb, dtype, f"{path} gb")


def test_vjp_of_a_complex_function_matches_torch_autograd_grad():
    src = """dim n = 5
input z: c128[n]
input w: c128[n]
input v: c128[n]
f = exp(z) * w / (z + 3) + log(z) ^ 2
out f
out g = vjp(f, z, v)
out gr = vjp(f, z, real(v))                   # a real cotangent: imaginary part 0
out t = jvp(f, z, v)                           # the pushforward of the tangent v
"""
    rng = np.random.default_rng(7)
    z, w, v = crandn(rng, 5), crandn(rng, 5), crandn(rng, 5)
    zt = torch.tensor(z, requires_grad=True)
    f = torch.exp(zt) * torch.tensor(w) / (zt + 3) + torch.log(zt) ** 2
    g, = torch.autograd.grad(f, zt, torch.tensor(v), retain_graph=True)
    gr, = torch.autograd.grad(f, zt, torch.tensor(v.real + 0j), retain_graph=True)
    jvp = torch.func.jvp(lambda z: torch.exp(z) * torch.tensor(w) / (z + 3) + torch.log(z) ** 2,
                         (torch.tensor(z),), (torch.tensor(v),))[1]
    for path, got in all_paths(src, dict(z=z, w=w, v=v), "f64"):
        close(got["f"], f.detach().numpy(), "f64", path)
        close(got["g"], g.numpy(), "f64", f"{path} vjp")
        close(got["gr"], gr.numpy(), "f64", f"{path} vjp, real v")
        close(got["t"], jvp.numpy(), "f64", f"{path} jvp")


def test_unitary_layer_and_its_gradients_match_torch():
    """y = U x with U = exp(i H) for Hermitian H given by its eigenvectors Q: U = Q diag(e^{i t}) Q^H;
    a loss of |y|^2 against a target, differentiated with respect to x, t and Q."""
    src = """dim b = 3, n = 4, k = 4
input x: c64[b, n]
input t[k]
input Q: c64[n, k]
input target[b, n]
U = Q @ (exp(1j * t) * conj(Q[n -> m]))         # U[n, m] = sum_k Q[n,k] e^{i t_k} conj(Q[m,k])
y = U @ x[n -> m]                                # [b, n]
loss = sum(abs(y) ^ 2 - target) ^ 2 / size(b)
out loss
out norm = sum[n](abs(y) ^ 2) - sum[n](abs(x) ^ 2)   # U is unitary: 0
out gx = grad(loss, x)
out gt = grad(loss, t)
out gQ = grad(loss, Q)
"""
    src = src.replace("dim b = 3, n = 4, k = 4", "dim b = 3, n = 4, k = 4\ndim m = 4")
    rng = np.random.default_rng(8)
    x = crandn(rng, 3, 4)
    Q = np.linalg.qr(crandn(rng, 4, 4))[0]
    t, target = rng.standard_normal(4), rng.standard_normal((3, 4))

    def fn(x, t, Q):
        U = Q @ torch.diag(torch.exp(1j * t)) @ Q.conj().T
        y = x @ U.T
        return ((y.abs() ** 2 - torch.tensor(target)).sum()) ** 2 / 3

    L, (gx, gt, gQ) = torch_grad(fn, x, t, Q)
    for path, got in all_paths(src, dict(x=x, t=t, Q=Q, target=target), "f64"):
        close(got["loss"], L, "f64", path)
        close(got["norm"], np.zeros(3), "f64", f"{path} norm")
        close(got["gx"], gx, "f64", f"{path} gx")
        close(got["gt"], gt, "f64", f"{path} gt")
        close(got["gQ"], gQ, "f64", f"{path} gQ")


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_fft_as_a_contraction_with_a_dft_matrix_built_by_exp(dtype):
    """X[k] = sum_n x[n] exp(-2 pi i n k / N), the DFT matrix from exp of an imaginary
    phase; against numpy's FFT, and the gradient of a real loss against torch.fft."""
    N = 8
    src = f"""dim n = {N}, k = {N}
input x: c64[n]
input nk[n, k]                  # n * k, an input: the program stays general
F = exp(-2j * 3.141592653589793 / size(n) * nk)
X = x @ F
out X
L = sum(abs(X) ^ 2 * nk[n = 1]) + sum(real(X) * imag(X))
out L
out gx = grad(L, x)
"""
    rng = np.random.default_rng(9)
    x = crandn(rng, N, dtype=dtype)
    nk = np.outer(np.arange(N), np.arange(N)).astype(dtype.replace("f", "float"))

    def fn(x):
        X = torch.fft.fft(x)
        w = torch.arange(N, dtype=torch.float64)
        return (X.abs() ** 2 * w).sum() + (X.real * X.imag).sum()

    L, (gx,) = torch_grad(fn, x.astype(complex))
    tol = {"f32": 2e-4, "f64": 1e-11}[dtype]    # f32: the phase 2 pi n k / N rounds before exp
    for path, got in all_paths(src, dict(x=x, nk=nk), dtype):
        np.testing.assert_allclose(got["X"], np.fft.fft(x.astype(complex)), atol=tol * N, err_msg=path)
        np.testing.assert_allclose(got["L"], L, rtol=tol, err_msg=path)
        np.testing.assert_allclose(got["gx"], gx, atol=tol * np.abs(gx).max(), err_msg=path)


def test_torch_function_backward_with_complex_tensors():
    """tgc.torch.function: complex torch tensors in and out, and the backward pass (the
    derived vjp, whose cotangent for a complex output is torch's) gives torch's z.grad."""
    import tgc.torch

    prog = tgc.compile("dim n = 4\ninput z: c128[n]\ninput x[n]\nout f = exp(z) * x\nout L = sum(abs(z) ^ 2 * x)\n",
                       dtype="f64")
    f = tgc.torch.function(prog)
    g = torch.Generator().manual_seed(11)
    z = torch.randn(4, dtype=torch.complex128, generator=g, requires_grad=True)
    x = torch.randn(4, dtype=torch.float64, generator=g, requires_grad=True)
    out = f(z=z, x=x)
    assert out["f"].dtype == torch.complex128
    ((out["f"].abs() ** 2).sum() + out["L"]).backward()
    z2, x2 = z.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    (((torch.exp(z2) * x2).abs() ** 2).sum() + (z2.abs() ** 2 * x2).sum()).backward()
    close(z.grad.numpy(), z2.grad.numpy(), "f64", "z.grad")
    close(x.grad.numpy(), x2.grad.numpy(), "f64", "x.grad")


def test_a_custom_vjp_rule_on_complex_values_follows_the_same_convention():
    """`with vjp(g) = ...` on a complex function: the rule gives torch's cotangent of the
    argument (for z^2: g conj(2 z)), and the gradient equals the derived one."""
    src = """dim n = 3
input z: c128[n]
fn sq(a) = a * a with vjp(g) = 2 * conj(a) * g
out custom = grad(sum(abs(sq(z)) ^ 2), z)
out derived = grad(sum(abs(z * z) ^ 2), z)
"""
    z = crandn(np.random.default_rng(12), 3)
    for path, got in all_paths(src, {"z": z}, "f64"):
        close(got["custom"], got["derived"], "f64", path)
        close(got["derived"], 4 * np.abs(z) ** 2 * z, "f64", path)    # d|z|^4 = 4 |z|^2 z (torch's z.grad)


@pytest.mark.parametrize("declared,dtype,width", [("c64", "f64", np.complex64), ("c128", "f32", np.complex64),
                                                  ("c64", "f32", np.complex64), ("c128", "f64", np.complex128)])
def test_a_complex_declaration_has_its_width_at_most_the_programs(declared, dtype, width):
    """As `f32`/`f64` declarations do, `c64`/`c128` name the complex type of their width,
    capped at the program's float type (docs/language.md): c64 has f32 parts, in an f64
    program too; c128 has f64 parts in an f64 program and f32 ones in an f32 program. The
    caller gets that width back."""
    z = np.array([1 + 1e-12j, -2.5 + 3j], np.complex128)
    got = tgc.compile(f"dim n\ninput z: {declared}[n]\nout y = z * z\n", dtype=dtype)(z=z)["y"]
    assert got.dtype == width
    tol = TOL["f32" if width == np.complex64 else "f64"]
    np.testing.assert_allclose(got, (z.astype(width) * z.astype(width)), rtol=tol)
