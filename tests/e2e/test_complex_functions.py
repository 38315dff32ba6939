"""Complex `sqrt`, `sin` and `cos`: values against numpy (every quadrant, both axes,
the branch cut, tiny and large parts) on the IR interpreter, the lowered interpreter
and the CPU backend, and their conjugate-Wirtinger gradients against torch.autograd."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.frontend import compile_source
from tgc.ir.interp import evaluate
from tgc.lower.interp import run_lowered
from tgc.pipeline import lower_module
from tgc.options import Options

SIM = shutil.which("g++") is not None   # cuda-sim compiles the CUDA module with g++ (OpenMP)
CDT = {"f32": np.complex64, "f64": np.complex128}
TOL = {"f32": 3e-6, "f64": 4e-15}

SRC = """dim n
input z: c64[n]
out s = sqrt(z)
out si = sin(z)
out co = cos(z)
"""


def points():
    """Every quadrant, both axes and the branch cut (a zero part is +0: the sign of a
    zero is not looked at); parts down to 1e-12, whose squares stay normal in f32."""
    axis = [1e-12, 1e-8, 0.3, 1.0, 2.5, 30.0]
    xs = [0.0] + [s * a for a in axis for s in (1, -1)]
    return np.array([complex(x, y) for x in xs for y in xs])


def wide(src, dtype):
    """`src` with complex data of the program's width (`c64` is complex64 in an f64 program)."""
    return src.replace(": c64[", ": c128[") if dtype == "f64" else src


def paths(src, inputs, dtype):
    src = wide(src, dtype)
    opts = Options(dtype=dtype)
    m = pipeline.lower(compile_source(src, "<cfun>", opts), opts).module
    yield "interp", evaluate(m, dict(inputs), dtype=dtype)
    yield "lowered", run_lowered(lower_module(m, opts), dict(inputs))
    yield "cpu", tgc.compile(src, dtype=dtype)(**inputs)
    if SIM:   # the CUDA backend's generated code under the emulator
        yield "cuda-sim", tgc.compile(src, backend="cuda-sim", dtype=dtype)(**inputs)


def rel_close(got, ref, tol):
    """Each part within tol of the reference, relative to |ref| (so a tiny part next to
    a large one is compared at the large one's scale, as rounding allows)."""
    scale = np.maximum(np.abs(ref), np.finfo(np.float64).tiny)
    err = np.maximum(np.abs(got.real - ref.real), np.abs(got.imag - ref.imag)) / scale
    assert err.max() <= tol, (err.max(), ref[err.argmax()], got[err.argmax()])


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_values_match_numpy(dtype):
    z = points().astype(CDT[dtype])
    zz = z.astype(np.complex128)
    refs = {"s": np.sqrt(zz), "si": np.sin(zz), "co": np.cos(zz)}
    for name, r in paths(SRC, {"z": z}, dtype):
        for k, ref in refs.items():
            assert r[k].dtype == CDT[dtype]
            rel_close(r[k].astype(np.complex128), ref, TOL[dtype])


def test_sqrt_takes_the_principal_root_on_the_negative_axis():
    z = np.array([-4 + 0j, -4 + 1e-300j, -4 - 1e-300j, 0j], np.complex128)
    z[0] = complex(-4.0, -0.0)   # -0 counts as +0 (numpy's root would be -2j)
    r = tgc.compile(wide(SRC, "f64"), dtype="f64")(z=z)["s"]
    np.testing.assert_allclose(r, [2j, 2j, -2j, 0], atol=1e-15)
    assert (r.real >= 0).all()


def test_sin_and_cos_keep_the_relative_accuracy_of_a_tiny_imaginary_part():
    z = np.array([0.5 + 1e-12j, 2 - 3e-9j], np.complex128)
    r = tgc.compile(wide(SRC, "f64"), dtype="f64")(z=z)
    np.testing.assert_allclose(r["si"].imag, np.sin(z).imag, rtol=1e-14)
    np.testing.assert_allclose(r["co"].imag, np.cos(z).imag, rtol=1e-14)


GRAD = """dim n
input z: c64[n]
input w: c64[n]
L = sum(real(conj(w) * sqrt(z))) + sum(abs(sin(z)) ^ 2) + sum(imag(cos(z) * w))
out g = grad(L, z)
f = sqrt(z) * sin(z) + cos(z)
out v = vjp(f, z, w)
"""


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_gradients_match_torch(dtype):
    torch = pytest.importorskip("torch", reason="torch.autograd is the oracle")
    rng = np.random.default_rng(5)
    z = (rng.standard_normal(40) + 1j * rng.standard_normal(40)).astype(CDT[dtype])
    w = (rng.standard_normal(40) + 1j * rng.standard_normal(40)).astype(CDT[dtype])
    tz = torch.tensor(z.astype(np.complex128), requires_grad=True)
    tw = torch.tensor(w.astype(np.complex128))
    L = (tw.conj() * tz.sqrt()).real.sum() + (tz.sin().abs() ** 2).sum() + (tz.cos() * tw).imag.sum()
    (g,) = torch.autograd.grad(L, tz)
    f = tz.sqrt() * tz.sin() + tz.cos()
    (v,) = torch.autograd.grad(f, tz, tw)
    tol = {"f32": 2e-4, "f64": 1e-11}[dtype]
    for name, r in paths(GRAD, {"z": z, "w": w}, dtype):
        np.testing.assert_allclose(r["g"], g.numpy(), rtol=tol, atol=tol)
        np.testing.assert_allclose(r["v"], v.numpy(), rtol=tol, atol=tol)
