"""The cuda backend's host side (`runtime._CupyDevice`, `CudaKernels` under the neutral `Program` with device
arrays) without a GPU: a small stand-in for CuPy whose arrays are host memory and
whose `RawModule` runs the module's kernels through the cuda-sim emulator, with the
GPU's launch geometry (256 threads per block, up to 2112 blocks). What runs is the
code a GPU call runs: device-array input handling (CuPy arrays, DLPack, numpy copied),
updates in place on the caller's device arrays, the workspace, the kernel argument
order, the error word, the cuBLAS calls' arguments (its stand-in executes the
column-major semantics on the memory the pointers span). What it cannot show is
NVRTC, the driver and cuBLAS themselves (tests/backends/test_cuda_gpu.py does, on
a GPU)."""
from __future__ import annotations

import ctypes
import shutil
import sys
import types

import numpy as np
import pytest


import tgc
from tgc.backends.cuda import blas, gemm, runtime
from tgc.ir.interp import EvalError

from layer_programs import DEEP

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++ with OpenMP")


class ndarray(np.ndarray):
    """A 'device' array: host memory; `.get()` copies it to a numpy array, `.data.ptr`
    is its address (as CuPy's MemoryPointer)."""

    def get(self, stream=None):
        return np.array(self, copy=True).view(np.ndarray)

    def set(self, a, stream=None) -> None:
        self[...] = a

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


def _dev(a) -> ndarray:
    return np.asarray(a).view(ndarray)


class _RawModule:
    def __init__(self, code: str, options=()):
        assert "--std=c++17" in options
        self.lib = runtime._load_sim(code)
        self.launches: list[tuple[str, int, int]] = []

    def get_function(self, name: str):
        fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint,
                              ctypes.c_uint)(("tgc_launch_" + name, self.lib))

        def launch(grid: tuple, block: tuple, args: tuple) -> None:
            *bufs, err = [a for a in args if isinstance(a, np.ndarray)]
            dims = [int(a) for a in args if isinstance(a, np.int64)]
            assert all(isinstance(a, ndarray) for a in bufs + [err]), "every buffer is a device array"
            assert len(bufs) + len(dims) + 1 == len(args)

            # the addresses, not the arrays, as a captured graph holds them
            ptrs = (ctypes.c_void_p * max(len(bufs), 1))(*[a.ctypes.data for a in bufs])
            dvals = (ctypes.c_longlong * max(len(dims), 1))(*dims)
            eptr = err.ctypes.data

            def run() -> None:
                self.launches.append((name, grid[0], block[0]))
                fn(ctypes.addressof(ptrs), ctypes.addressof(dvals), eptr, grid[0], block[0])
            _on_stream(run)
        return launch


# CUDA graphs (cupy.cuda.Stream.begin_capture / end_capture, Graph.launch): a capturing
# stream records each launch and cuBLAS call (with the addresses it was given) instead
# of running it; the graph replays the records in order.
_STREAMS: list = []
CAPTURED: list = []


class _Graph:
    def __init__(self, ops: list):
        self.ops = ops

    def launch(self, stream=None) -> None:
        assert stream is not None and stream.ops is None, "replayed on a stream that is not capturing"
        for op in self.ops:
            op()


class _Stream:
    def __init__(self, null: bool = False, non_blocking: bool = False):
        self.ptr, self.ops = (0 if null else id(self)), None

    def __enter__(self):
        _STREAMS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _STREAMS.pop()

    def begin_capture(self, mode=None) -> None:
        assert self.ptr != 0, "cannot capture on the default (legacy) stream"
        assert _STREAMS and _STREAMS[-1] is self and self.ops is None
        self.ops = []

    def end_capture(self) -> _Graph:
        ops, self.ops = self.ops, None
        CAPTURED.append(ops)
        return _Graph(ops)


_NULL_STREAM = _Stream(null=True)


def _current_stream() -> _Stream:
    return _STREAMS[-1] if _STREAMS else _NULL_STREAM


def _on_stream(op) -> None:
    """Run `op` now, or record it when the current stream is capturing."""
    s = _current_stream()
    if s.ops is not None:
        s.ops.append(op)
    else:
        op()


class CudaProducer:
    """A DLPack producer whose memory is on a CUDA device (kDLCUDA), as a torch CUDA
    tensor says; here host memory, which the stand-in's device shares. It records the
    stream each export was asked for."""

    def __init__(self, a: np.ndarray):
        self.host, self.streams = a, []

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        return self.host.__dlpack__()


def _from_dlpack(x):
    """cupy.from_dlpack: the consumer passes its current stream to the producer."""
    if isinstance(x, CudaProducer):
        x.__dlpack__(stream=_current_stream().ptr)
        return _dev(x.host)
    return _dev(np.from_dlpack(x))


def _memset_async(ptr: int, value: int, size: int, stream: int) -> None:
    def run() -> None:
        ctypes.memset(ptr, value, size)
    _on_stream(run)


GEMM_CALLS: list = []


def _gemm_strided_batched(dtype):
    """cublas<t>gemmStridedBatched on host addresses: the column-major semantics of
    `gemm.run_numpy` over the memory the pointers and leading dimensions span (t: s, d,
    and the complex c, z, whose op may be the conjugate transpose, CUBLAS_OP_C)."""
    dt = np.dtype(dtype)
    part = ctypes.c_float if dt in (np.float32, np.complex64) else ctypes.c_double
    per = 2 if dt.kind == "c" else 1

    def fn(handle, ta, tb, m, n, k, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc, sc, batch):
        assert handle == "handle" and ta in (0, 1, 2) and tb in (0, 1, 2)
        assert per == 2 or 2 not in (ta, tb), "CUBLAS_OP_C is for complex GEMMs"
        scalar = lambda ptr: np.ctypeslib.as_array((part * per).from_address(ptr)).view(dt)[0]  # noqa: E731
        al, be = scalar(alpha), scalar(beta)
        assert be in (0, 1) and np.imag(al) == 0   # 1: an accumulating GEMM (C += op(A) op(B))

        def mem(ptr, rows, cols, ld, stride):
            extent = stride * (batch - 1) + ld * (cols - 1) + rows
            return np.ctypeslib.as_array((part * (extent * per)).from_address(ptr)).view(dt)
        a = mem(A, k, m, lda, sa) if ta else mem(A, m, k, lda, sa)
        b = mem(B, n, k, ldb, sb) if tb else mem(B, k, n, ldb, sb)
        c = mem(C, m, n, ldc, sc)
        call = gemm.GemmCall(bool(ta), bool(tb), m, n, k, "a", lda, sa, "b", ldb, sb, ldc, sc, batch,
                             conja=ta == 2, conjb=tb == 2, alpha=float(np.real(al)), beta=float(np.real(be)))

        def run() -> None:
            GEMM_CALLS.append(call)
            gemm.run_numpy(call, a, b, c)
        _on_stream(run)
    return fn


EX_ARGS: list = []


def _gemm_strided_batched_ex(handle, ta, tb, m, n, k, alpha, A, atype, lda, sa, B, btype, ldb, sb, beta, C, ctype,
                             ldc, sc, batch, compute, algo):
    """cublasGemmStridedBatchedEx on host addresses, for the types tgc passes (bf16 or
    f16 inputs: CUDA_R_16BF 14, CUDA_R_16F 2; f32 output CUDA_R_32F 0 and alpha/beta;
    CUBLAS_COMPUTE_32F 68), with `gemm.run_numpy`'s semantics."""
    import ml_dtypes

    assert handle == "handle" and ta in (0, 1) and tb in (0, 1) and algo == -1
    names = {14: "bf16", 2: "f16"}
    dts = {14: np.dtype(ml_dtypes.bfloat16), 2: np.dtype(np.float16)}
    al = np.ctypeslib.as_array((ctypes.c_float * 1).from_address(alpha))[0]
    be = np.ctypeslib.as_array((ctypes.c_float * 1).from_address(beta))[0]
    assert al == 1 and be in (0, 1)

    def mem(ptr, rows, cols, ld, stride, part, dt):
        extent = stride * (batch - 1) + ld * (cols - 1) + rows
        return np.ctypeslib.as_array((part * extent).from_address(ptr)).view(dt)
    a = mem(A, k, m, lda, sa, ctypes.c_uint16, dts[atype]) if ta else mem(A, m, k, lda, sa, ctypes.c_uint16, dts[atype])
    b = mem(B, n, k, ldb, sb, ctypes.c_uint16, dts[btype]) if tb else mem(B, k, n, ldb, sb, ctypes.c_uint16, dts[btype])
    c = mem(C, m, n, ldc, sc, ctypes.c_float, np.float32)
    call = gemm.GemmCall(bool(ta), bool(tb), m, n, k, "a", lda, sa, "b", ldb, sb, ldc, sc, batch,
                         atype=names[atype], btype=names[btype], beta=float(be))

    def run() -> None:
        GEMM_CALLS.append(call)
        EX_ARGS.append((atype, btype, ctype, compute))
        gemm.run_numpy(call, a, b, c)
    _on_stream(run)


_GEMMS = {"sgemmStridedBatched": _gemm_strided_batched(np.float32),
          "dgemmStridedBatched": _gemm_strided_batched(np.float64),
          "cgemmStridedBatched": _gemm_strided_batched(np.complex64),
          "zgemmStridedBatched": _gemm_strided_batched(np.complex128),
          "gemmStridedBatchedEx": _gemm_strided_batched_ex}


def _capturing(ptr: int) -> bool:
    return any(s.ptr == ptr and s.ops is not None for s in _STREAMS)


def _set_stream(handle, stream: int) -> None:
    """As CuPy's binding: refused while the stream is being captured."""
    if _capturing(stream):
        raise NotImplementedError("calling cuBLAS API during stream capture is currently unsupported")


def _refused_in_capture(fn):
    """A CuPy binding: it sets the handle's stream to the current one first."""
    def call(handle, *args):
        _set_stream(handle, _current_stream().ptr)
        return fn(handle, *args)
    return call


class _DirectCublas(blas.CupyCublas):
    """`blas.DirectCublas`'s stand-in: the same calls, with no refusal while capturing."""
    capturable = True

    def __init__(self, cupy):
        super().__init__(cupy)
        self.cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
            cublas=types.SimpleNamespace(CUBLAS_OP_N=0, CUBLAS_OP_T=1, CUBLAS_OP_C=2, setStream=lambda h, s: None,
                                         **_GEMMS),
            device=cupy.cuda.device, get_current_stream=_current_stream))


def _fake_cupy() -> types.ModuleType:
    cp = types.ModuleType("cupy")
    cp.ndarray = ndarray
    cp.asarray = lambda a, dtype=None: a if isinstance(a, ndarray) and dtype is None else _dev(np.array(a, dtype))
    cp.ascontiguousarray = lambda a: _dev(np.ascontiguousarray(a))   # as CuPy's: a 0-d array gets one axis
    cp.from_dlpack = _from_dlpack
    cp.empty = lambda shape, dtype: np.empty(shape, dtype).view(ndarray)
    cp.zeros = lambda shape, dtype: np.zeros(shape, dtype).view(ndarray)
    cp.asnumpy = lambda a: np.array(a, copy=True).view(np.ndarray)
    cp.matmul = lambda a, b: _dev(np.matmul(a, b))
    cp.conj = lambda a: _dev(np.conj(a))
    cp.where = lambda c, a, b: _dev(np.where(c, a, b))
    cp.lib = types.SimpleNamespace(stride_tricks=types.SimpleNamespace(
        as_strided=lambda a, shape, strides: np.lib.stride_tricks.as_strided(a, shape, strides).view(ndarray)))
    cp.ones = lambda shape, dtype=np.float64: np.ones(shape, dtype).view(ndarray)
    cp.RawModule = _RawModule
    cublas = types.SimpleNamespace(CUBLAS_OP_N=0, CUBLAS_OP_T=1, CUBLAS_OP_C=2, setStream=_set_stream,
                                   **{name: _refused_in_capture(fn) for name, fn in _GEMMS.items()})
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1, getDevice=lambda: 0,
                                    getDeviceProperties=lambda i: {"multiProcessorCount": 132},
                                    memsetAsync=_memset_async)
    cp.cuda = types.SimpleNamespace(runtime=runtime, cublas=cublas,
                                    device=types.SimpleNamespace(get_cublas_handle=lambda: "handle"),
                                    get_current_stream=_current_stream, Stream=_Stream)
    return cp


@pytest.fixture
def cupy(monkeypatch):
    cp = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cp.cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.cublas", cp.cuda.cublas)
    direct = _DirectCublas(cp)   # the GPU's way (ctypes on tgc's own handle); CuPy's bindings: `cupy_bindings`
    monkeypatch.setattr(blas, "for_device", lambda module: direct)
    GEMM_CALLS.clear()
    EX_ARGS.clear()
    CAPTURED.clear()
    return cp


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


def test_device_arrays_in_and_out_and_updates_in_place(cupy):
    prog = tgc.compile(MLP, dtype="f64", backend="cuda")
    assert prog.backend == "cuda"
    rng = np.random.default_rng(0)
    x, W = rng.standard_normal((300, 8)), rng.standard_normal((8, 16))
    W0 = W.copy()
    dW = cupy.asarray(W)
    got = prog(x=x, W=dW, lr=0.01)          # x: numpy, copied to the device
    y = np.tanh(x @ W0)
    assert isinstance(got["y"], ndarray) and isinstance(got["loss"], ndarray)
    np.testing.assert_allclose(got["y"].get(), y, rtol=1e-12)
    np.testing.assert_allclose(float(got["loss"].get()), np.sum(y * y), rtol=1e-12)
    assert got["W"] is dW
    np.testing.assert_allclose(dW.get(), W0 - 0.01 * (x.T @ (2 * y * (1 - y * y))), rtol=1e-10)
    assert len(GEMM_CALLS) == prog.gemm_counts["strided"] == 2   # x @ W and the gradient x^T @ dy, through cuBLAS
    launches = prog._kernels._device.module.launches
    assert launches and all(block == 256 for _, _, block in launches)
    assert max(grid for _, grid, _ in launches) == -(-300 * 16 // 256)   # one thread per element of y


def test_update_targets_must_be_device_arrays(cupy):
    prog = tgc.compile(MLP, backend="cuda")
    x = np.ones((2, 8), np.float32)
    with pytest.raises(EvalError, match="'W' is updated in place: pass a device array"):
        prog(x=x, W=np.ones((8, 16), np.float32), lr=0.1)
    with pytest.raises(EvalError, match="'W' is updated in place, so it must be float32, not float64"):
        prog(x=x, W=cupy.asarray(np.ones((8, 16))), lr=0.1)      # f64: a cast would be a copy
    with pytest.raises(EvalError, match="'W' is updated in place: pass a C-contiguous f32 device array"):
        prog(x=x, W=cupy.asarray(np.ones((8, 32), np.float32))[:, ::2], lr=0.1)   # a strided view
    with pytest.raises(EvalError, match="input 'x' must be a float array"):
        prog(x=cupy.asarray(np.ones((2, 8), np.int64)), W=cupy.asarray(np.ones((8, 16), np.float32)), lr=0.1)


def test_dlpack_input_and_gather_error_word(cupy):
    torch = pytest.importorskip("torch", reason="torch gives a DLPack tensor")
    src = "dim b\ndim v = 10, e = 6\ninput ids: i32[b]\nparam E[v, e]\nout r = E[v = ids] * 2\n"
    prog = tgc.compile(src, backend="cuda")
    E = torch.arange(60, dtype=torch.float32).reshape(10, 6)
    out = prog(ids=np.array([1, 9], np.int32), E=E)
    np.testing.assert_array_equal(out["r"].get(), 2 * E.numpy()[[1, 9]])
    with pytest.raises(EvalError, match=r"gather index out of range: 'ids'\[b=1\] = 10"):
        prog(ids=np.array([1, 10], np.int32), E=E)
    assert prog._kernels.graph_counts["replays"] == 2     # checks and all, one graph per call


@pytest.mark.parametrize("graphs", [True, False])
def test_a_failed_gather_check_writes_nothing(cupy, graphs):
    """The host reads the error word once, after the call (a graph's replay, or every
    kernel launched), without waiting for the checks: every kernel after the checks
    sees the word set and returns at once, so the updated param is unchanged."""
    from tgc.options import Options

    src = ("dim b\ndim v = 10, e = 6\ninput ids: i32[b]\nparam E[v, e]\nout r = E[v = ids] * 2\n"
           "update E = E + 1\n")
    prog = tgc.compile(src, backend="cuda", options=Options().with_(graphs=graphs))
    E = cupy.asarray(np.arange(60, dtype=np.float32).reshape(10, 6))
    ids = cupy.asarray(np.array([1, 9], np.int32))
    np.testing.assert_array_equal(prog(ids=ids, E=E)["r"].get(), 2 * np.arange(60).reshape(10, 6)[[1, 9]])
    before = E.get()
    ids[1] = 10
    for _ in range(2):
        with pytest.raises(EvalError, match=r"gather index out of range: 'ids'\[b=1\] = 10"):
            prog(ids=ids, E=E)
        np.testing.assert_array_equal(E.get(), before)
    names = [n for n, _, _ in prog._kernels._device.module.launches]
    assert names[-1] == "k1" and names[-3].startswith("check")    # every kernel ran, after the check
    assert (prog._kernels.graph_counts["captures"] > 0) == graphs


def test_cuda_dlpack_producers_are_taken_on_the_current_stream(cupy):
    """A DLPack producer on a CUDA device (a torch CUDA tensor) is taken without a
    copy, its export asked for on the current stream, and written in place when it is
    an update target; a CPU torch tensor that requires grad is detached and copied."""
    torch = pytest.importorskip("torch", reason="a CPU tensor that requires grad is this test's input")
    prog = tgc.compile(MLP, dtype="f64", backend="cuda")
    x, W = np.ones((3, 8)), np.full((8, 16), 0.25)
    dW = CudaProducer(W.copy())
    got = prog(x=CudaProducer(x), W=dW, lr=0.5)
    y = np.tanh(x @ W)
    np.testing.assert_allclose(got["y"].get(), y, rtol=1e-12)
    np.testing.assert_allclose(dW.host, W - 0.5 * (x.T @ (2 * y * (1 - y * y))), rtol=1e-10)   # in place
    assert dW.streams == [0]                      # the legacy default stream: the current one here
    xt = torch.ones((3, 8), dtype=torch.float64, requires_grad=True)
    got = prog(x=xt, W=cupy.asarray(W), lr=0.0)
    np.testing.assert_allclose(got["y"].get(), y, rtol=1e-12)


def test_assumptions_are_checked_on_device_arrays(cupy):
    """`check_assumptions` reads the facts' inputs back from the device (a CuPy array,
    a DLPack producer on a CUDA device) before anything runs."""
    src = "dim b = 2, v = 3\ninput y[b, v]\ninput x[v]\nassume sum[v](y) = 1\nassume x > 0\nout r = sum[v](y) + x\n"
    prog = tgc.compile(src, backend="cuda", options=tgc.Options(check_assumptions=True))
    y = np.full((2, 3), 1 / 3, np.float32)
    got = prog(y=CudaProducer(y.copy()), x=cupy.asarray(np.ones(3, np.float32)))
    np.testing.assert_allclose(got["r"].get(), np.full((2, 3), 2.0), rtol=1e-6)
    with pytest.raises(EvalError, match="x > 0"):
        prog(y=CudaProducer(y.copy()), x=CudaProducer(np.array([1, 0, 1], np.float32)))


def test_without_cupy_the_error_is_clear(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)     # import cupy fails
    with pytest.raises(tgc.backends.base.BackendUnavailable, match="CuPy is not installed"):
        tgc.compile(MLP, backend="cuda")


def test_attention_on_the_gpu_path_matches_interpreter(cupy):
    """Batched GEMMs (batch and head, with a looped batch edge) through the cuBLAS
    stand-in, and every kernel with the GPU's geometry."""
    from pathlib import Path

    from tgc import pipeline
    from tgc.ir.interp import evaluate
    from tgc.ir.inputs import random_inputs
    from tgc.options import Options

    options = Options(dtype="f64")
    path = Path(__file__).resolve().parents[2] / "examples/attention.tg"
    module = pipeline.lower(pipeline.load(str(path), options), options).module
    dims = {d: 3 for d in module.symbolic_dims()}
    inputs = random_inputs(module, module.bind_dims(dims), 0, "f64")
    want = evaluate(module, {k: v.copy() for k, v in inputs.items()}, dtype="f64", dims=dims)
    prog = tgc.compile(module, dtype="f64", backend="cuda")
    got = prog.run({k: cupy.asarray(v.copy()) for k, v in inputs.items()}, dims)
    for name, ref in want.items():
        np.testing.assert_allclose(got[name].get(), ref, rtol=1e-9, atol=1e-9, err_msg=name)
    assert prog.gemm_counts == {"strided": 18, "views": 0} and len(GEMM_CALLS) > 18   # looped calls


def test_a_call_is_captured_once_as_a_cuda_graph_and_replayed(cupy):
    """A graph holds addresses: the first call with a binding of the dims and a set of
    argument and output addresses captures every launch (on a stream of its own) and
    replays it; a call with the same arrays, holding new values, replays it without a
    copy; new dims capture again."""
    prog = tgc.compile(MLP, dtype="f64", backend="cuda")
    rng = np.random.default_rng(1)
    W = cupy.asarray(rng.standard_normal((8, 16)))
    xs = {5: cupy.asarray(np.zeros((5, 8))), 7: cupy.asarray(np.zeros((7, 8)))}
    for step, batch in enumerate((5, 5, 5, 7, 5)):
        x = rng.standard_normal((batch, 8))
        xs[batch][...] = x                   # new values in the same device array
        W0 = W.get()
        got = prog(x=xs[batch], W=W, lr=0.01)
        y = np.tanh(x @ W0)
        np.testing.assert_allclose(got["y"].get(), y, rtol=1e-12)
        np.testing.assert_allclose(float(got["loss"].get()), np.sum(y * y), rtol=1e-12)
        np.testing.assert_allclose(W.get(), W0 - 0.01 * (x.T @ (2 * y * (1 - y * y))), rtol=1e-10)
        assert got["W"] is W
        del got                              # the outputs are dropped: the next call reuses them
    counts = prog._kernels.graph_counts
    assert counts["replays"] == 5 and counts["captures"] <= 3      # batch 5 (the first call's outputs: the
    assert len(CAPTURED) == counts["captures"] and all(CAPTURED)   # neutral runtime's), batch 7
    captures = counts["captures"]
    for _ in range(3):
        prog(x=xs[5], W=W, lr=0.01)
    assert counts["captures"] == captures and counts["replays"] == 8   # same arrays: replays only
    # an output held by the caller is not overwritten by the next call (it gets new outputs)
    a = prog(x=cupy.asarray(np.ones((5, 8))), W=W, lr=0.0)["y"]
    b = prog(x=cupy.asarray(np.zeros((5, 8))), W=W, lr=0.0)
    assert not np.array_equal(a.get(), b["y"].get()) and np.array_equal(b["y"].get(), np.zeros((5, 16)))
    np.testing.assert_allclose(a.get(), np.tanh(np.ones((5, 8)) @ W.get()), rtol=1e-12)


def test_a_replay_copies_nothing(cupy):
    """A replay is one graph launch: no copy in or out but a host scalar's value (`lr`,
    into a device scalar of the binding), no allocation."""
    prog = tgc.compile(MLP, dtype="f64", backend="cuda")
    x, W = cupy.asarray(np.ones((6, 8))), cupy.asarray(np.full((8, 16), 0.1))
    for _ in range(3):
        prog(x=x, W=W, lr=0.0)
    captured = len(CAPTURED)
    launches = prog._kernels._device.module.launches
    before, allocs = len(launches), []
    empty = cupy.empty
    cupy.empty = lambda shape, dtype: allocs.append(shape) or empty(shape, dtype)
    copies = []
    orig = ndarray.__setitem__
    ndarray.__setitem__ = lambda self, k, v: copies.append(self.shape) or orig(self, k, v)
    try:
        for _ in range(4):
            y = prog(x=x, W=W, lr=0.0)["y"]
            del y
    finally:
        ndarray.__setitem__ = orig
        cupy.empty = empty
    assert copies == [()] * 4 and not allocs   # lr's value only; the dropped outputs are written again
    kernels = sum(1 for x in prog.cuda_module.launches if x.kind != "gemm")
    assert len(CAPTURED) == captured and len(launches) == before + 4 * kernels   # four replays, no capture


def test_a_binding_whose_addresses_keep_changing_stops_capturing(cupy):
    prog = tgc.compile(MLP, dtype="f64", backend="cuda")
    kept = prog.options.cuda.graphs_kept
    W = cupy.asarray(np.full((8, 16), 0.1))
    held = []
    for i in range(4 * kept):
        x = np.full((6, 8), float(i))
        held.append(cupy.asarray(x))        # new arrays, all alive: new addresses every call
        got = prog(x=held[-1], W=W, lr=0.0)
        np.testing.assert_allclose(got["y"].get(), np.tanh(x @ W.get()), rtol=1e-12)
        held.append(got)
    assert prog._kernels.graph_counts["captures"] == 2 * kept


def test_graphs_off_and_views_gemms_launch_each_kernel(cupy):
    from tgc.options import Options

    prog = tgc.compile(MLP, dtype="f64", backend="cuda", options=Options().with_(graphs=False))
    prog(x=cupy.asarray(np.ones((3, 8))), W=cupy.asarray(np.ones((8, 16))), lr=0.1)
    assert prog._kernels.graph_counts == {"captures": 0, "replays": 0} and not CAPTURED
    # a GEMM on conjugated views (matmul's temporaries): never captured
    prog = tgc.compile("dim i, j, k\ninput a: c64[i, j]\ninput b: c64[j, k]\nout c = conj(a) @ b\n", backend="cuda")
    a = (np.arange(6) + 1j).reshape(2, 3).astype(np.complex64)
    for _ in range(2):
        c = prog(a=a, b=a.T.copy())["c"]
        np.testing.assert_allclose(c.get() if hasattr(c, "get") else c, np.conj(a) @ a.T, rtol=1e-6)
    assert prog._kernels.graph_counts == {"captures": 0, "replays": 0}


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_complex_products_through_cgemm_and_zgemm(cupy, dtype):
    """A complex product is one complex GEMM cell: cublasCgemm/Zgemm where cuBLAS can
    read each operand (a conjugated one only transposed: CUBLAS_OP_C), else matmul on
    conjugated complex views; the adjoint's products conjugate with CUBLAS_OP_C."""
    cdt = np.complex64 if dtype == "f32" else np.complex128
    c = "c64" if dtype == "f32" else "c128"   # c64 holds complex64 values in an f64 program too
    rng = np.random.default_rng(3)
    crandn = lambda *s: (rng.standard_normal(s) + 1j * rng.standard_normal(s)).astype(cdt)  # noqa: E731
    tol = 2e-5 if dtype == "f32" else 1e-12
    forms = {"a @ b": (lambda a, b: a @ b, 1), "(2 * a) @ b": (lambda a, b: 2 * a @ b, 1),
             "conj(a) @ b": (lambda a, b: np.conj(a) @ b, 0), "a @ conj(b)": (lambda a, b: a @ np.conj(b), 0)}
    for expr, (ref, strided) in forms.items():
        prog = tgc.compile(f"dim i, j, k\ninput a: {c}[i, j]\ninput b: {c}[j, k]\nout c = {expr}\n",
                           backend="cuda", dtype=dtype)
        a, b = crandn(3, 5), crandn(5, 4)
        GEMM_CALLS.clear()
        got = prog(a=a, b=b)["c"]
        got = got.get() if hasattr(got, "get") else got
        assert np.abs(got - ref(a, b)).max() <= tol * max(1.0, np.abs(ref(a, b)).max()), expr
        assert prog.gemm_counts == {"strided": strided, "views": 1 - strided} and len(GEMM_CALLS) == strided, expr
    # a gradient through a complex product: its adjoint's products read conj(a), conj(b) transposed
    src = f"dim i, j, k\ninput a: {c}[i, j]\nparam b: {c}[j, k]\nloss = sum(abs(a @ b))\nout g = grad(loss, b)\n"
    prog = tgc.compile(src, backend="cuda", dtype=dtype)
    a, b = crandn(4, 3), crandn(3, 5)
    GEMM_CALLS.clear()
    got = prog(a=a, b=cupy.asarray(b))["g"]
    got = got.get() if hasattr(got, "get") else got
    cpu = tgc.compile(src, dtype=dtype)(a=a, b=b)["g"]
    assert np.abs(got - cpu).max() <= 10 * tol * max(1.0, np.abs(cpu).max())
    assert any(call.conja or call.conjb for call in GEMM_CALLS), "the adjoint's product conjugates in cuBLAS"


def test_complex_device_arrays_are_float_pairs_in_place(cupy):
    """A complex device array goes in as float pairs over its memory (an updated one is
    written in place) and complex results come back as complex device arrays."""
    src = "dim i, j\nparam z: c64[i, j]\ninput s\nout w = z * s\nupdate z = conj(z)\n"
    prog = tgc.compile(src, backend="cuda")
    z0 = (np.arange(6) + 1j * np.arange(6, 12)).reshape(2, 3).astype(np.complex64)
    z = cupy.asarray(z0.copy())
    got = prog(z=z, s=2.0)
    assert isinstance(got["w"], ndarray) and got["w"].dtype == np.complex64
    np.testing.assert_allclose(got["w"].get(), 2 * z0, rtol=1e-6)
    np.testing.assert_allclose(z.get(), np.conj(z0), rtol=1e-6)          # in place, in the caller's array
    with pytest.raises(EvalError, match="'z' is updated in place, so it must be complex64, not complex128"):
        prog(z=cupy.asarray(z0.astype(np.complex128)), s=2.0)


SGD_BF16 = """\
dim n = 256, c = 16
input x: bf16[b: n, i: c]
param W: bf16[i, o: c]
input lr
y = tanh(x @ W)
loss = mean[b](sum[o](f32(y) * f32(y)))
out y
out loss
out s = bf16(sum[o](f32(y)))
update W = W - lr * grad(loss, W)
"""


def test_bf16_buffers_and_gemm_ex_on_the_gpu_path(cupy):
    """bf16 arguments as uint16 bits on the device (no conversion; an updated one
    written in place), a float device array rounded to bf16 on the device, bf16
    outputs as uint16 bits, and the product as cublasGemmStridedBatchedEx with bf16
    inputs, f32 output and CUBLAS_COMPUTE_32F: the bits cuda-sim computes."""
    import ml_dtypes

    rng = np.random.default_rng(4)
    x = rng.standard_normal((256, 16)).astype(ml_dtypes.bfloat16)
    w = (0.5 * rng.standard_normal((16, 16))).astype(ml_dtypes.bfloat16)
    sim = tgc.compile(SGD_BF16, backend="cuda-sim")
    w_sim = w.copy()
    want = sim(x=x, W=w_sim, lr=0.5)
    prog = tgc.compile(SGD_BF16, backend="cuda", options=tgc.Options().with_(graphs=False))
    assert prog.lowered.buffers["x"].dtype == "bf16" and prog.lowered.buffers["y"].dtype == "bf16"
    dx, dw = _dev(x.view(np.uint16)), _dev(w.view(np.uint16))
    got = prog(x=dx, W=dw, lr=0.5)
    assert got["W"] is dw and got["y"].dtype == np.uint16 and got["s"].dtype == np.uint16
    for k in ("y", "s", "W"):   # bf16, as bits
        assert want[k].dtype == ml_dtypes.bfloat16 and got[k].dtype == np.uint16, k
        assert np.array_equal(got[k].get(), want[k].view(np.uint16)), k
    # the loss is f32: a mean of f32(y) * f32(y), the conversions kept
    assert want["loss"].dtype == np.float32 and got["loss"].dtype == np.float32
    assert np.array_equal(got["loss"].get(), want["loss"])
    # x @ W: GemmEx; the gradient x^T g with g f32 (the cotangent of an f32 product) is
    # sgemm on x widened by a copy kernel
    assert EX_ARGS and all(a == (14, 14, 0, 68) for a in EX_ARGS)
    assert {(c.atype, c.btype) for c in GEMM_CALLS} == {("bf16", "bf16"), ("", "")}
    assert any(k.note == "bf16 widened for cuBLAS" for k in prog.lowered.kernels if hasattr(k, "note"))
    # a float device array for a bf16 argument: rounded on the device, as the host rounds it
    xf = rng.standard_normal((256, 16)).astype(np.float32)
    xf[0, :3] = [np.nan, np.inf, 3.0e38]
    got = prog(x=_dev(xf), W=_dev(w.copy().view(np.uint16)), lr=0.0)
    want = sim(x=xf, W=w.copy(), lr=0.0)
    assert np.array_equal(got["y"].get(), want["y"].view(np.uint16))
    with pytest.raises(EvalError, match="updated in place"):
        prog(x=dx, W=_dev(np.asarray(w, np.float32)), lr=0.5)


def test_bf16_program_replays_as_a_cuda_graph_and_takes_torch_bf16_through_dlpack(cupy):
    """The bf16 program captured once and replayed (the GemmEx call recorded in the
    graph), the param's uint16 bits updated in place by the replay; a torch bf16
    tensor for a bf16 input comes in through DLPack as its 16 bits."""
    import ml_dtypes

    torch = pytest.importorskip("torch", reason="a torch bf16 tensor is this test's input")
    rng = np.random.default_rng(6)
    x = rng.standard_normal((256, 16)).astype(ml_dtypes.bfloat16)
    w = (0.5 * rng.standard_normal((16, 16))).astype(ml_dtypes.bfloat16)
    sim = tgc.compile(SGD_BF16, backend="cuda-sim")
    prog = tgc.compile(SGD_BF16, backend="cuda")
    w_sim, dw = w.copy(), _dev(w.copy().view(np.uint16))
    xt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    for step in range(3):
        want = sim(x=x, W=w_sim, lr=0.25)
        got = prog(x=xt if step else _dev(x.view(np.uint16)), W=dw, lr=0.25)
        assert got["W"] is dw
        for k in ("y", "s", "W"):
            assert np.array_equal(got[k].get(), want[k].view(np.uint16)), (k, step)
        assert np.array_equal(got["loss"].get(), want["loss"]), ("loss", step)   # f32
    assert prog._kernels.graph_counts["replays"] == 3   # a capture per new input array (x, then xt)
    assert EX_ARGS and all(a == (14, 14, 0, 68) for a in EX_ARGS)


def test_host_benchmark_counts_one_graph_launch_and_no_allocation_per_call():
    """benchmarks/cuda_host.py's stand-in (kernels and cuBLAS calls only counted): the
    64x256 layernorm row launches its kernels one by one without a graph and is one
    graph launch with one; after the warm-up neither captures nor allocates (the
    dropped outputs are written again)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        import cuda_host
    finally:
        sys.path.pop(0)
    before = sys.modules.get("cupy")
    with cuda_host.installed():
        plain = cuda_host.measure("layernorm 64x256", graphs=False, calls=5, repeat=2)
        graph = cuda_host.measure("layernorm 64x256", graphs=True, calls=5, repeat=2)
    assert plain["launches"] == 3 and plain["graphs"] == 0 and plain["allocs"] == 0   # the row group, dw, db
    assert graph["launches"] == 0 and graph["graphs"] == 1 and graph["allocs"] == 0 and graph["captured"] == 0
    assert sys.modules.get("cupy") is before      # the stand-in is gone again


def test_looped_gemm_ex_offsets_count_two_byte_elements(cupy):
    """Attention under --autocast bf16: GemmEx calls looped over a batch edge, each
    operand's offset in its own element size (2 bytes for the bf16 operands, 4 for the
    f32 output), as cuda-sim computes them."""
    from pathlib import Path

    from tgc import pipeline
    from tgc.ir.inputs import random_inputs
    from tgc.options import Options

    options = Options(autocast="bf16")
    path = Path(__file__).resolve().parents[2] / "examples/attention.tg"
    module = pipeline.lower(pipeline.load(str(path), options), options).module
    dims = {d: 3 for d in module.symbolic_dims()}
    inputs = random_inputs(module, module.bind_dims(dims), 0, "f32")
    want = tgc.compile(path, backend="cuda-sim", options=options).run({k: v.copy() for k, v in inputs.items()}, dims)
    prog = tgc.compile(path, backend="cuda", options=options)
    got = prog.run({k: cupy.asarray(v.copy()) for k, v in inputs.items()}, dims)
    assert EX_ARGS and len(GEMM_CALLS) > prog.gemm_counts["strided"]    # GemmEx calls, some looped
    for name, ref in want.items():
        np.testing.assert_allclose(got[name].get(), ref, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_loop_runs_as_a_launch_loop_and_replays_as_one_graph(cupy):
    """A loop over an edge (and its reverse loop in the gradient) on the GPU path: the
    step's kernels and its GEMM (a strided call at the slice's address) launched for
    each index, the carries copied by kernels; the call with a binding of the dims is
    captured once, the host loop unrolled into the graph (its trip count is the
    binding's), and replayed; another depth is another binding."""
    prog = tgc.compile(DEEP, dtype="f64", backend="cuda")
    assert any(x.kind == "steps" for x in prog.cuda_module.launches)
    sim = tgc.compile(DEEP, dtype="f64", backend="cuda-sim")
    rng = np.random.default_rng(7)
    for depth in (3, 2):
        x = cupy.asarray(rng.standard_normal((5, 8)))
        w0 = 0.3 * rng.standard_normal((depth, 8, 8))
        w, w_sim = cupy.asarray(w0.copy()), w0.copy()
        for step in range(3):
            want = sim(x=x.get(), w=w_sim, lr=0.05)
            got = prog(x=x, w=w, lr=0.05)
            assert got["w"] is w
            for k in ("loss", "y", "w"):
                np.testing.assert_allclose(got[k].get(), want[k], rtol=1e-12, atol=1e-12, err_msg=(k, depth, step))
            del got
    counts = prog._kernels.graph_counts
    assert counts["captures"] >= 2 and counts["replays"] == 6
    assert len(CAPTURED[0]) > len(CAPTURED[-1])   # depth 3's graph holds more launches than depth 2's
    assert prog.gemm_counts["strided"] > 0


def test_a_loop_program_whose_capture_fails_launches_each_kernel(cupy, monkeypatch):
    """A capture refused for a program with loops: that binding launches kernel by
    kernel from then on, with the same results."""
    def refuse(self):
        self.ops = None
        raise RuntimeError("capture refused")
    monkeypatch.setattr(_Stream, "end_capture", refuse)
    prog = tgc.compile(DEEP, dtype="f64", backend="cuda")
    sim = tgc.compile(DEEP, dtype="f64", backend="cuda-sim")
    rng = np.random.default_rng(8)
    x, w0 = rng.standard_normal((4, 8)), 0.3 * rng.standard_normal((2, 8, 8))
    w, w_sim = cupy.asarray(w0.copy()), w0.copy()
    for _ in range(2):
        want = sim(x=x, w=w_sim, lr=0.1)
        got = prog(x=cupy.asarray(x), w=w, lr=0.1)
        for k in ("loss", "y", "w"):
            np.testing.assert_allclose(got[k].get(), want[k], rtol=1e-12, atol=1e-12, err_msg=k)
    assert prog._kernels.graph_counts == {"captures": 0, "replays": 0}


def test_cupy_bindings_refuse_capture_so_gemm_programs_launch_each_kernel(cupy, monkeypatch):
    """Where cuBLAS is reached through CuPy's bindings (they refuse any call while a
    stream is captured), a program with GEMM cells is launched kernel by kernel, with
    the same results; a scalar device array keeps its shape (no axis)."""
    monkeypatch.setattr(blas, "for_device", lambda module: blas.CupyCublas(module))
    prog = tgc.compile(MLP, dtype="f64", backend="cuda")
    rng = np.random.default_rng(3)
    x, W0 = rng.standard_normal((5, 8)), rng.standard_normal((8, 16))
    W = cupy.asarray(W0.copy())
    for _ in range(2):
        W1 = W.get()
        got = prog(x=cupy.asarray(x), W=W, lr=cupy.asarray(np.float64(0.01)))
        y = np.tanh(x @ W1)
        np.testing.assert_allclose(got["y"].get(), y, rtol=1e-12)
        np.testing.assert_allclose(W.get(), W1 - 0.01 * (x.T @ (2 * y * (1 - y * y))), rtol=1e-10)
    assert prog._kernels.graph_counts == {"captures": 0, "replays": 0} and not CAPTURED


def test_a_capture_that_fails_launches_each_kernel_and_says_why(cupy, monkeypatch):
    """Any refusal during a capture (here cuBLAS's): nothing ran, the call launches each
    kernel instead, and the program says why (`graph_refusal`)."""
    def refuse(*args):
        raise RuntimeError("refused")
    monkeypatch.setattr(_DirectCublas, "caller", lambda self, call, dtype: refuse)
    prog = tgc.compile("dim n = 4\ninput x[n]\nout y = exp(x)\n", dtype="f64", backend="cuda")
    np.testing.assert_allclose(prog(x=cupy.asarray(np.ones(4)))["y"].get(), np.full(4, np.e))   # no GEMM: captured
    assert prog._kernels.graph_counts["captures"] == 1
    mlp = tgc.compile(MLP, dtype="f64", backend="cuda")
    with pytest.raises(RuntimeError, match="refused"):   # the GEMM itself refuses outside a capture too
        mlp(x=cupy.asarray(np.ones((5, 8))), W=cupy.asarray(np.ones((8, 16))), lr=0.0)
    assert mlp._kernels.graph_refusal == "RuntimeError: refused"
    assert mlp._kernels.graph_counts["captures"] == 0
