"""Complex products as one cgemm/zgemm cell (tgc/lower/complex_gemm.py): which
products lowering recognizes (the forward's, the adjoint's, conjugated operands), and
their values and gradients against numpy and torch.autograd on the IR interpreter, the
lowered interpreter and the CPU backend; `--blas none` keeps four real products."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

import tgc
from tgc import pipeline as driver
from tgc.frontend import compile_source
from tgc.ir.interp import evaluate
from tgc.lower.lowered import GemmKernel
from tgc.lower.interp import run_lowered
from tgc.options import Options
from tgc.pipeline import lower_module

SIM = shutil.which("g++") is not None   # cuda-sim compiles the CUDA module with g++ (OpenMP)
CDT = {"f32": np.complex64, "f64": np.complex128}
TOL = {"f32": 2e-5, "f64": 1e-12}


def crandn(rng, *shape, dtype="f64"):
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(CDT[dtype])


def wide(src: str, dtype: str) -> str:
    """`src` with complex data of the program's width (`c64` is complex64 in an f64 program)."""
    return src.replace(": c64[", ": c128[") if dtype == "f64" else src


def lowered(src: str, **opts):
    src = wide(src, opts.get("dtype", "f32"))
    o = Options().with_(**opts)
    m = driver.lower(compile_source(src, "<cgemm>", o), o).module
    return m, lower_module(m, o)


def gemms(low):
    return [k for k in low.kernels if isinstance(k, GemmKernel)]


def close(x, ref, dtype):
    assert x.dtype == CDT[dtype]
    assert np.abs(x - ref).max() <= TOL[dtype] * max(1.0, np.abs(ref).max())


def all_paths(src, inputs, dtype, **opts):
    src = wide(src, dtype)
    o = Options(dtype=dtype, **opts)
    m, low = lowered(src, dtype=dtype, **opts)
    yield "interp", evaluate(m, dict(inputs), dtype=dtype)
    yield "lowered", run_lowered(low, dict(inputs))
    yield "cpu", tgc.compile(src, dtype=dtype, options=o)(**inputs)
    if SIM:   # the CUDA backend (four real products there) under the emulator
        yield "cuda-sim", tgc.compile(src, backend="cuda-sim", dtype=dtype)(**inputs)


PRODUCT = """dim i, j, k
input a: c64[i, j]
input b: c64[j, k]
out c = {expr}
"""
FORMS = {
    "a @ b": lambda a, b: a @ b,
    "conj(a) @ b": lambda a, b: np.conj(a) @ b,
    "a @ conj(b)": lambda a, b: a @ np.conj(b),
    "conj(a @ b)": lambda a, b: np.conj(a @ b),
    "(2 * a) @ b": lambda a, b: 2 * a @ b,
}


@pytest.mark.parametrize("expr", FORMS)
def test_a_complex_product_is_one_complex_gemm(expr):
    _, low = lowered(PRODUCT.format(expr=expr))
    ks = gemms(low)
    assert len(ks) == 1 and ks[0].cplx is not None, [k.text() for k in ks]
    assert not any(getattr(k, "note", "") == "transposing copy for BLAS" for k in low.kernels)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("expr", FORMS)
def test_complex_products_against_numpy(expr, dtype):
    rng = np.random.default_rng(1)
    a, b = crandn(rng, 40, 70, dtype=dtype), crandn(rng, 70, 30, dtype=dtype)
    ref = FORMS[expr](a.astype(np.complex128), b.astype(np.complex128))
    for name, r in all_paths(PRODUCT.format(expr=expr), {"a": a, "b": b}, dtype):
        close(r["c"], ref, dtype)


def test_blas_none_keeps_four_real_products():
    _, low = lowered(PRODUCT.format(expr="a @ b"), blas="none")
    ks = gemms(low)
    assert len(ks) == 4 and all(k.cplx is None for k in ks)
    _, low = lowered(PRODUCT.format(expr="a @ b"), complex_gemm=False)
    assert all(k.cplx is None for k in gemms(low))


def test_transposed_operands_and_result():
    """b stored [k, j] (its K innermost) and the result with i innermost."""
    src = """dim i, j, k
input a: c128[j, i]
input b: c128[k, j]
out c[k, i] = a @ b
"""
    rng = np.random.default_rng(2)
    a, b = crandn(rng, 30, 20), crandn(rng, 25, 30)
    _, low = lowered(src, dtype="f64")
    assert [k.cplx for k in gemms(low)] == [(False, False)]
    ref = b @ a
    for name, r in all_paths(src, {"a": a, "b": b}, "f64"):
        close(r["c"], ref, "f64")


def dft(n):
    t = np.arange(n)
    return np.exp(-2j * np.pi * np.outer(t, t) / n)


def test_dft_matrix_fft_and_a_unitary_layer():
    """x @ F is numpy's FFT along the rows; a unitary Q keeps each row's norm."""
    src = """dim b, n, m
input x: c128[b, n]
input F: c128[n, m]
input Q: c128[m, m2]
y = x @ F
out f = y
out z = (y @ Q)
"""
    src = src.replace("dim b, n, m", "dim b, n, m, m2")
    rng = np.random.default_rng(3)
    x = crandn(rng, 16, 64)
    q, _ = np.linalg.qr(crandn(rng, 64, 64))
    _, low = lowered(src, dtype="f64")
    assert sum(k.cplx is not None for k in gemms(low)) == 2
    for name, r in all_paths(src, {"x": x, "F": dft(64), "Q": q}, "f64"):
        close(r["f"], np.fft.fft(x, axis=1), "f64")
        close(r["z"], np.fft.fft(x, axis=1) @ q, "f64")
        assert np.allclose(np.linalg.norm(r["z"], axis=1), np.linalg.norm(r["f"], axis=1))


GRAD = """dim i, j, k
input a: c64[i, j]
input b: c64[j, k]
input w: c64[i, k]
c = a @ b
L = sum(abs(c) ^ 2) + sum(real(conj(w) * c))
out ga = grad(L, a)
out gb = grad(L, b)
"""


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_gradients_are_complex_gemms_and_match_torch(dtype):
    torch = pytest.importorskip("torch", reason="torch.autograd is the oracle")
    _, low = lowered(GRAD, dtype=dtype)
    assert sum(k.cplx is not None for k in gemms(low)) == 3, [k.text() for k in gemms(low)]
    rng = np.random.default_rng(4)
    a, b, w = crandn(rng, 30, 40, dtype=dtype), crandn(rng, 40, 20, dtype=dtype), crandn(rng, 30, 20, dtype=dtype)
    ta, tb = (torch.tensor(v.astype(np.complex128), requires_grad=True) for v in (a, b))
    tc = ta @ tb
    loss = (tc.abs() ** 2).sum() + (torch.tensor(w.astype(np.complex128)).conj() * tc).real.sum()
    loss.backward()
    for name, r in all_paths(GRAD, {"a": a, "b": b, "w": w}, dtype):
        close(r["ga"], ta.grad.numpy(), dtype)
        close(r["gb"], tb.grad.numpy(), dtype)


@pytest.mark.skipif(shutil.which("cc") is None, reason="tgc build links with the system C compiler (cc)")
@pytest.mark.parametrize("blas", ["numpy", "none"])
def test_built_library_computes_the_complex_product(tmp_path, blas):
    """`tgc build --blas numpy` binds numpy's cgemm/zgemm into the table (one complex
    GEMM); `--blas none` keeps four real products in generated loops. Run through ctypes."""
    import ctypes

    from click.testing import CliRunner
    from tgc.cli import main

    src = tmp_path / "cm.tg"
    src.write_text(wide(PRODUCT.format(expr="conj(a) @ b"), "f64").replace("dim i, j, k", "dim i = 40, j = 70, k = 30"))
    r = CliRunner().invoke(main, ["build", str(src), "-o", str(tmp_path / "libcm.so"), "--dtype", "f64",
                                  f"--blas={blas}"])
    assert r.exit_code == 0, r.output
    lib = ctypes.CDLL(str(tmp_path / "libcm.so"))
    assert lib.cm_init_default() == 0
    rng = np.random.default_rng(6)
    a, b = crandn(rng, 40, 70), crandn(rng, 70, 30)
    c = np.zeros((40, 30), np.complex128)
    dims = (ctypes.c_int64 * 1)(0)
    args = (ctypes.c_void_p * 2)(a.ctypes.data, b.ctypes.data)
    outs = (ctypes.c_void_p * 1)(c.ctypes.data)
    lib.cm_workspace_bytes.restype = ctypes.c_int64
    ws = np.zeros(lib.cm_workspace_bytes(dims) + 64, np.uint8)
    addr = ws.ctypes.data + (-ws.ctypes.data) % 64
    assert lib.cm_run(dims, args, outs, ctypes.c_void_p(addr)) == 0
    close(c, np.conj(a) @ b, "f64")
