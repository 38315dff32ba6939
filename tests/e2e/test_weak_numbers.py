"""An expression built only from numbers and sizes is weak, as a number is
(docs/dtypes.md): `x / sqrt(size(hd))`, `x * sqrt(2)`, `x * (1 / size(d))`, `x * 2 ^ 0.5`
have `x`'s type. Before, a function of weak values was strong (the program's float type),
so `x / sqrt(size(hd))` of a bf16 `x` was f32, and the prelude's `attention` on bf16
q, k, v returned f32 where PyTorch (`q @ k.T / math.sqrt(d)`, SDPA) keeps bf16.

Oracles: the output's type is the input's; the values are PyTorch's at that type within
the f32 rule of the numerics suite (`tests/e2e/test_numerics_f32.py`): tgc's error
against float64 at most 10x PyTorch's bf16/f16 error (or tiny); and on every backend
the interpreter's values."""
from __future__ import annotations

import math
import shutil

import ml_dtypes
import numpy as np
import pytest

import tgc

torch = pytest.importorskip("torch", reason="PyTorch is a test oracle only: install torch==2.13.0 to run these")
import torch.nn.functional as F  # noqa: E402

from numerics_util import normwise_err  # noqa: E402

LOW = {"bf16": (np.dtype(ml_dtypes.bfloat16), torch.bfloat16), "f16": (np.dtype(np.float16), torch.float16)}
BACKENDS = ["interp", "cpu",
            pytest.param("cuda-sim", marks=[pytest.mark.slow, pytest.mark.skipif(
                shutil.which("g++") is None, reason="cuda-sim needs g++ with OpenMP")])]
FACTOR = 10.0
ABS_OK = 1e-6

# (tgc expression of x: T[t, d], torch reference of the tensor x at its type, d = 16)
SCALED = {
    "x / sqrt(size(d))": lambda x: x / math.sqrt(16),
    "x * sqrt(2)": lambda x: x * math.sqrt(2),
    "x * (1 / size(d))": lambda x: x * (1 / 16),
    "x * 2 ^ 0.5": lambda x: x * 2 ** 0.5,
    "x - 0.5 * 3": lambda x: x - 0.5 * 3,
    "x * exp(-size(d) / 8)": lambda x: x * math.exp(-16 / 8),
}


def _inputs(names_shapes: dict, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s) for n, s in names_shapes.items()}


def _check(src: str, inputs: dict, ref, ty: str, backend: str) -> None:
    """`src` on `backend` with `inputs` rounded to `ty`: the output `y` is of type `ty`
    and within the f32 rule of PyTorch's `ref` at that type (float64 the wanted values)."""
    np_t, torch_t = LOW[ty]
    low = {k: v.astype(np_t) for k, v in inputs.items()}
    got = tgc.compile(src, backend=backend)(**low)["y"]
    assert got.dtype == np_t, f"{backend}: y is {got.dtype}, the inputs are {ty}"
    want = ref(**{k: torch.from_numpy(v.astype(np.float64)) for k, v in low.items()}).numpy()
    theirs = ref(**{k: torch.from_numpy(v.astype(np.float64)).to(torch_t) for k, v in low.items()})
    assert theirs.dtype == torch_t    # the oracle keeps the type too
    torch_err = normwise_err(theirs.to(torch.float64).numpy(), want)
    tgc_err = normwise_err(got.astype(np.float64), want)
    assert tgc_err <= max(FACTOR * torch_err, ABS_OK), (backend, ty, tgc_err, torch_err)


@pytest.mark.parametrize("ty", ["bf16", "f16"])
@pytest.mark.parametrize("expr", list(SCALED))
def test_a_number_expression_keeps_the_low_type(expr, ty):
    """`x / sqrt(size(d))` and the like of a bf16/f16 `x` are of `x`'s type (they were f32)."""
    src = f"dim t = 4, d = 16\ninput x: {ty}[t, d]\nout y = {expr}\n"
    _check(src, _inputs({"x": (4, 16)}), lambda x: SCALED[expr](x), ty, "interp")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ty", ["bf16", "f16"])
def test_scaled_product_on_the_backends(backend, ty):
    src = f"dim t = 4, d = 16\ninput x: {ty}[t, d]\nout y = x / sqrt(size(d)) + x * sqrt(2)\n"
    _check(src, _inputs({"x": (4, 16)}), lambda x: x / math.sqrt(16) + x * math.sqrt(2), ty, backend)


_PRELUDE = {
    "attention": ("dim t = 6, s = 8, hd = 16\ninput q: {T}[t, hd]\ninput k: {T}[s, hd]\ninput v: {T}[s, hd]\n"
                  "out y = attention[s, hd](q, k, v)\n",
                  {"q": (6, 16), "k": (8, 16), "v": (8, 16)},
                  lambda q, k, v: torch.softmax(q @ k.T / math.sqrt(16), dim=-1) @ v),
    "sdpa": ("dim t = 6, s = 8, hd = 16\ninput q: {T}[t, hd]\ninput k: {T}[s, hd]\ninput v: {T}[s, hd]\n"
             "out y = sum[s](softmax[s](dot[hd](q, k) / sqrt(size(hd))) * v)\n",
             {"q": (6, 16), "k": (8, 16), "v": (8, 16)},
             lambda q, k, v: F.scaled_dot_product_attention(q[None], k[None], v[None])[0]),
    "softmax": ("dim t = 4, d = 16\ninput x: {T}[t, d]\nout y = softmax[d](x / sqrt(size(d)))\n",
                {"x": (4, 16)}, lambda x: torch.softmax(x / math.sqrt(16), dim=-1)),
    "layernorm": ("dim t = 4, d = 16\ninput x: {T}[t, d]\ninput w: {T}[d]\ninput b: {T}[d]\n"
                  "out y = layernorm[d](x, w, b)\n",
                  {"x": (4, 16), "w": (16,), "b": (16,)},
                  lambda x, w, b: F.layer_norm(x, (16,), w, b)),
    "gelu": ("dim t = 4, d = 16\ninput x: {T}[t, d]\nout y = gelu(x)\n",
             {"x": (4, 16)}, lambda x: F.gelu(x, approximate="tanh")),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ty", ["bf16", "f16"])
@pytest.mark.parametrize("name", list(_PRELUDE))
def test_prelude_functions_keep_the_low_type(name, ty, backend):
    """The prelude's attention (`dot / sqrt(size(e))`), softmax, layernorm and gelu on
    bf16/f16 inputs return the inputs' type, as PyTorch's do, with PyTorch's accuracy."""
    src, shapes, ref = _PRELUDE[name]
    _check(src.format(T=ty), _inputs(shapes, seed=len(name)), ref, ty, backend)


@pytest.mark.parametrize("backend", ["interp", "cpu"])
def test_an_f64_number_expression_leaves_f32_alone(backend):
    """In an f64 program, `x / sqrt(size(d))` of an f32 `x` is f32 (the weak expression is
    f64); its value is the f64 quotient rounded once to f32."""
    src = "dim d = 16\ninput x: f32[d]\nout y = x / sqrt(size(d)) + x * sqrt(2)\n"
    x = np.random.default_rng(1).standard_normal(16).astype(np.float32)
    got = tgc.compile(src, backend=backend, dtype="f64")(x=x)["y"]
    assert got.dtype == np.float32
    want = x.astype(np.float64) / 4 + x.astype(np.float64) * math.sqrt(2)
    np.testing.assert_allclose(got, want, rtol=4e-7, atol=0)


def test_a_weak_expression_is_flagged_once():
    """The IR's rule (`tgc.ir.values.Value.weak`): a constant, a size, or an edgeless
    elementwise op/add/contract whose operands are all weak; a conversion, an argument,
    an indicator, a draw or an edged expression is strong. Promotion skips weak operands."""
    from tgc.ir import values as V

    x = V.arg("x", "bf16", ("d",))
    n = V.size("d", "f32")
    r = V.map_("sqrt", n)
    assert n.weak and r.weak and V.const(2.0, "f32").weak
    assert V.contract([V.const(1.0, "f32"), V.map_("div", V.const(1.0, "f32"), n)], ()).weak
    assert not x.weak and not V.convert(r, "f64").weak
    assert V.const(1.0, "f32", ("d",)).weak                      # a constant, edged or not
    assert not V.add([V.const(1.0, "f32", ("d",)), r]).weak      # an edged expression is strong
    assert V.promoted([x, r]) == "bf16" and V.mul([x, r]).dtype == "f32"   # computed in f32
    assert V.promoted([V.arg("z", "f32", ()), V.map_("sqrt", V.size("d", "f64"))]) == "f32"
    # a long chain is flagged as it is built: no recursion
    y = n
    for _ in range(50_000):
        y = V.map_("sqrt", V.add([y, V.const(1.0, "f32")]))
    assert y.weak and V.promoted([x, y]) == "bf16"


@pytest.mark.parametrize("backend", ["interp", "cpu"])
@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("expr", ["max(x, sqrt(size(d)) / 2)", "where(x > 0, x, sqrt(size(d)) / 2)"])
def test_a_selection_of_a_weak_expression_is_rounded(expr, dtype, backend):
    """`max(x, sqrt(size(d)) / 2)` of a bf16 `x` (d symbolic: the quotient stays an
    expression) is bf16 (it was f32): the selection is exact for `x`'s elements, but the
    quotient is a weak value of a wider type, so the emulation rounds the selected value
    to bf16 (it rounded only for a constant operand), as PyTorch's
    `torch.maximum(x, torch.tensor(math.sqrt(6) / 2))` does. Read back through a
    widening conversion, which keeps the value as it is."""
    bf16 = np.dtype(ml_dtypes.bfloat16)
    src = f"dim d\ninput x: bf16[d]\ny = {expr}\nout z = f64(y) * 3\nout y\n"
    x = np.array([-1.0, 0.5, 1.21875, 1.25, 2.0, -0.25]).astype(bf16)
    got = tgc.compile(src, backend=backend, dtype=dtype)(x=x)
    assert got["y"].dtype == bf16
    s = np.float64(np.float32(math.sqrt(6) / 2).astype(bf16))
    xs = x.astype(np.float64)
    want = np.maximum(xs, s) if expr.startswith("max") else np.where(xs > 0, xs, s)
    np.testing.assert_array_equal(got["y"].astype(np.float64), want)
    np.testing.assert_allclose(np.asarray(got["z"], np.float64), want * 3, rtol=1e-6)
