"""The cuda and cuda-sim backends through the API and the command line: updates in
place, forward-only calls, gather bounds errors through the device error word,
--fp-strict, prelude functions and their derivatives, the emulator's cache and its
execution model (shared memory, barriers, shuffles), and the clear error of
`backend="cuda"` where CuPy or a GPU is missing."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.backends.base import BackendUnavailable
from tgc.backends.cuda import runtime
from tgc.ir.interp import EvalError
from tgc.options import Options

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="cuda-sim needs g++ with OpenMP")

MLP = """\
dim batch
dim features = 8, hidden = 16
input x[batch, features]
param W[features, hidden]
input lr
y = tanh(x @ W)
loss = sum(y * y)
out loss
out y
update W = W - lr * grad(loss, W)
"""

GATHER = """\
dim batch
dim vocab = 10, emb = 6
input ids: i32[batch]
param E[vocab, emb]
input lr
rows = E[vocab = ids]
loss = sum(rows * rows)
out loss
update E = E - lr * grad(loss, E)
"""


def test_updates_in_place_forward_only_and_batch_sizes():
    prog = tgc.compile(MLP, dtype="f64", backend="cuda-sim")
    assert "cuda-sim" in repr(prog)
    rng = np.random.default_rng(0)
    for batch in (3, 40):   # one build, two batch sizes (grid-stride loops over more items than threads)
        x, W = rng.standard_normal((batch, 8)), rng.standard_normal((8, 16))
        W0 = W.copy()
        got = prog(x=x, W=W, lr=0.01)
        y = np.tanh(x @ W0)
        np.testing.assert_allclose(got["y"], y, rtol=1e-12)
        np.testing.assert_allclose(got["loss"], np.sum(y * y), rtol=1e-12)
        np.testing.assert_allclose(W, W0 - 0.01 * (x.T @ (2 * y * (1 - y * y))), rtol=1e-10)
        assert got["W"] is W
    W1 = W.copy()
    fwd = prog(x=x, W=W, updates=False)
    assert set(fwd) == {"loss", "y"} and np.array_equal(W, W1)


def test_an_f64_array_is_read_as_f32_but_not_updated_as_one():
    """docs/dtypes.md, "What a call takes": as on the CPU."""
    prog = tgc.compile(MLP, dtype="f32", backend="cuda-sim")
    x, W = np.ones((2, 8)), np.full((8, 16), 0.1)
    with pytest.raises(EvalError, match="'W' is updated in place, so it must be float32, not float64"):
        prog(x=x, W=W, lr=0.5)
    assert np.all(W == 0.1)
    W32 = W.astype(np.float32)
    got = prog(x=x, W=W32, lr=0.5)
    assert got["W"] is W32 and not np.allclose(W32, 0.1)
    cpu = tgc.compile(MLP, dtype="f32")(x=x, W=W.astype(np.float32), lr=0.5)
    np.testing.assert_allclose(W32, cpu["W"], rtol=1e-5)


def test_gather_out_of_range_is_reported_and_nothing_is_written():
    sim, cpu = tgc.compile(GATHER, backend="cuda-sim"), tgc.compile(GATHER)
    E = np.arange(60, dtype=np.float32).reshape(10, 6)
    ids = np.array([1, 10, 3], np.int32)
    with pytest.raises(EvalError) as got:
        sim(ids=ids, E=E, lr=0.1)
    with pytest.raises(EvalError) as want:
        cpu(ids=ids, E=E.copy(), lr=0.1)
    assert str(got.value) == str(want.value)
    assert "'ids'[batch=1] = 10" in str(got.value) and "nothing was written" in str(got.value)
    assert np.array_equal(E, np.arange(60, dtype=np.float32).reshape(10, 6))
    ok = sim(ids=np.array([1, 9, 1], np.int32), E=E, lr=0.5)   # the error word is fresh for each call
    assert ok["loss"] > 0 and np.array_equal(E[0], np.arange(6, dtype=np.float32))


def test_fp_strict_f32_matches_the_cpu_backend():
    opts = Options(fp_strict=True)
    sim = tgc.compile(str(ROOT / "examples/layernorm.tg"), backend="cuda-sim", options=opts)
    cpu = tgc.compile(str(ROOT / "examples/layernorm.tg"), options=opts)
    rng = np.random.default_rng(1)
    inputs = {s.name: rng.standard_normal([5 if not isinstance(n, int) else n for n in s.shape]).astype(np.float32)
              for s in cpu.inputs}
    got, want = sim.run({k: v.copy() for k, v in inputs.items()}), cpu.run({k: v.copy() for k, v in inputs.items()})
    for k in want:
        assert got[k].dtype == np.float32
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


PRELUDE_CALLS = {
    "relu": "relu(x)", "sigmoid": "sigmoid(x)", "softplus": "softplus(x)", "gelu": "gelu(x)",
    "gelu_erf": "gelu_erf(x)", "silu": "silu(x)", "logsumexp": "logsumexp[c](x)",
    "softmax": "softmax[c](x)", "log_softmax": "log_softmax[c](x)", "layernorm": "layernorm[c](x, w, b)",
    "rmsnorm": "rmsnorm[c](x, w)", "cross_entropy": "cross_entropy[c](x, softmax[c](y))",
    "mse": "mse(x, y)", "attention": "attention[s, c](x, k, v)",
}


def test_prelude_functions_and_their_derivatives():
    from tests.backends.test_cuda_sim_programs import compare
    from tgc.frontend import compile_source

    lines = ["dim r, c = 6, s = 4", "input x[r, c], y[r, c], w[c], b[c], k[s, c], v[s, c], u[r, c]"]
    for fn, call in sorted(PRELUDE_CALLS.items()):   # one program: one emulator build
        lines += [f"f_{fn} = {call}", f"out f_{fn}", f"out g_{fn} = grad(sum(f_{fn} * f_{fn}), x)",
                  f"out t_{fn} = jvp(f_{fn}, x, u)"]
    options = Options(dtype="f64")
    module = pipeline.lower(compile_source("\n".join(lines) + "\n", "prelude.tg", options), options).module
    compare(module, "f64", seed=3)


def test_sim_library_is_cached_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv("TGC_CACHE_DIR", str(tmp_path))
    prog = tgc.compile(MLP, backend="cuda-sim")
    entries = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("cudasim-"))
    assert len(entries) == 2 and entries[0].endswith(".sha256") and entries[1].endswith(".so")
    again = tgc.compile(MLP, backend="cuda-sim")    # a hit: nothing new is written
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("cudasim-")) == entries
    x, W = np.ones((2, 8), np.float32), np.ones((8, 16), np.float32)
    assert prog(x=x, W=W.copy(), lr=0.1)["loss"] == again(x=x, W=W.copy(), lr=0.1)["loss"]
    so = next(tmp_path.glob("cudasim-*.so"))
    (tmp_path / "damaged").write_bytes(b"damaged")    # a damaged entry is rebuilt, never loaded
    os.replace(tmp_path / "damaged", so)              # (replaced: the loaded library keeps its pages)
    third = tgc.compile(MLP, backend="cuda-sim")
    assert third(x=x, W=W.copy(), lr=0.1)["loss"] == prog(x=x, W=W.copy(), lr=0.1)["loss"]


ROW_SOFTMAX = r"""
extern "C" __global__ void row_softmax(const float* x, float* y, int cols) {
    __shared__ float part[32];
    const float* row = x + (long long)blockIdx.x * cols;
    float m = -__builtin_huge_valf();
    for (int j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, row[j]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = m;
    __syncthreads();
    m = part[0];
    for (unsigned w = 1; w < blockDim.x / 32; ++w) m = fmaxf(m, part[w]);
    __syncthreads();
    float s = 0.0f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) s += __expf(row[j] - m);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = s;
    __syncthreads();
    s = 0.0f;
    for (unsigned w = 0; w < blockDim.x / 32; ++w) s += part[w];
    for (int j = threadIdx.x; j < cols; j += blockDim.x) y[(long long)blockIdx.x * cols + j] = __expf(row[j] - m) / s;
}
#ifdef TGC_CUDA_SIM
extern "C" void launch(const float* x, float* y, int cols, unsigned rows, unsigned block) {
    TGC_SIM_LAUNCH(rows, block, row_softmax(x, y, cols));
}
#endif
"""


def test_emulator_runs_shared_memory_barriers_and_shuffles(tmp_path):
    cu, so = tmp_path / "softmax.cu", tmp_path / "softmax.so"
    cu.write_text(ROW_SOFTMAX)
    subprocess.run(["g++", *runtime.SIM_FLAGS, "-include", str(runtime.SIM_HEADER), "-DTGC_CUDA_SIM", str(cu),
                    "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    rows, cols = 5, 200
    x = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32) * 4
    y = np.zeros_like(x)
    lib.launch(x.ctypes.data_as(ctypes.c_void_p), y.ctypes.data_as(ctypes.c_void_p), ctypes.c_int(cols),
               ctypes.c_uint(rows), ctypes.c_uint(64))
    e = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)
    if shutil.which("nvcc"):   # the same text is CUDA
        done = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "--Werror", "all-warnings", "-o",
                               str(tmp_path / "s.cubin"), str(cu)], capture_output=True, text=True)
        assert done.returncode == 0 and not done.stderr.strip(), done.stderr


def _gpu_works() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 -- no CuPy, no driver, no device
        return False


@pytest.mark.skipif(_gpu_works(), reason="a GPU is usable here: tests/backends/test_cuda_gpu.py runs it")
def test_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    with pytest.raises(BackendUnavailable, match=r"^backend 'cuda' needs CuPy and an NVIDIA GPU: "):
        tgc.compile(MLP, backend="cuda")
    src = tmp_path / "m.tg"
    src.write_text(MLP)
    done = subprocess.run([sys.executable, "-m", "tgc.cli", "run", str(src), "--random-inputs", "--dim", "batch=2",
                           "--backend", "cuda"], capture_output=True, text=True)
    assert done.returncode == 3
    assert done.stderr.startswith("error: backend 'cuda' needs CuPy and an NVIDIA GPU: ")
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_cli_runs_cuda_sim_like_cpu(tmp_path):
    src = tmp_path / "m.tg"
    src.write_text(MLP)
    outs = {}
    for backend in ("cpu", "cuda-sim"):
        out = tmp_path / f"{backend}.npz"
        subprocess.run([sys.executable, "-m", "tgc.cli", "run", str(src), "--random-inputs", "--dim", "batch=3",
                        "--backend", backend, "-o", str(out)], check=True)
        outs[backend] = dict(np.load(out))
    assert set(outs["cpu"]) == set(outs["cuda-sim"]) == {"loss", "y", "W"}
    for k, v in outs["cpu"].items():
        np.testing.assert_allclose(outs["cuda-sim"][k], v, rtol=1e-5, atol=1e-6, err_msg=k)


def test_unknown_backend_lists_the_backends():
    with pytest.raises(ValueError, match="the backends are: cpu, cuda, cuda-sim"):
        tgc.compile(MLP, backend="tpu")


def test_unsupported_forms_are_a_clear_error():
    from tgc.backends.cuda import codegen
    from tgc.backends.cpu.group import LoopGroup
    from tgc.pipeline import lower_module

    module = pipeline.lower(pipeline.load(str(ROOT / "examples/layernorm.tg"), Options()), Options()).module
    low = lower_module(module, Options())          # the CPU's lowering: with loop groups
    assert any(isinstance(k, LoopGroup) for k in low.kernels)
    with pytest.raises(BackendUnavailable, match=r"^not supported by the cuda backend yet: LoopGroup kernels"):
        codegen.generate(low)
