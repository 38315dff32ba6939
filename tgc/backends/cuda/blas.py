"""cuBLAS for the GEMM cells on a GPU: the strided batched calls that `gemm.plan` describes.

Two ways to reach the library, chosen once per process (`for_device`):

- `DirectCublas`: the libcublas that CuPy loaded, called through ctypes on a handle of
  tgc's own, with a workspace of its own from CuPy's pool. A CUDA graph captures its
  calls: cuBLAS's guide (section "CUDA Graphs Support") allows stream capture of these
  routines; `alpha` and `beta` are host pointers, so their values are recorded in the
  graph; a workspace the caller owns keeps the capture free of memory nodes.
- `CupyCublas`: CuPy's bindings (`cupy.cuda.cublas`) on CuPy's handle, where no
  libcublas is mapped in the process (the host stand-in of the tests). They set the
  handle's stream before every call and refuse to while the stream is being captured
  (NotImplementedError), so a program with GEMM cells is not captured through them
  (`capturable` False: its calls launch each kernel).

Either gives `caller(call, dtype)`: `fn(pa, pb, pc)` running the call on device
addresses, on the stream last set with `set_stream` (once per program call, before
its GEMMs, and before a capture begins).
"""
from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

from .gemm import CUBLAS_GEMM_DEFAULT, GemmCall, ex_types

# cuBLAS's guide recommends at least 32 MiB of workspace on Hopper (4 MiB before it)
# for the best kernels; one per handle, allocated once per thread and device.
WORKSPACE_BYTES = 32 << 20

_OP = {(False, False): 0, (True, False): 1, (True, True): 2}   # CUBLAS_OP_N, _T, _C


class CublasError(RuntimeError):
    pass


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasError(f"{what} failed: cublasStatus_t {status}")


def _mapped_library() -> str | None:
    """The path of the libcublas this process has mapped (CuPy's, once its cuBLAS
    bindings are imported), or None."""
    try:
        import cupy_backends.cuda.libs.cublas  # noqa: F401 -- maps libcublas
    except ImportError:
        return None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if os.path.basename(path).startswith("libcublas.so"):
                    return path
    except OSError:
        return None
    return None


class CupyCublas:
    """CuPy's cuBLAS bindings on CuPy's handle (not capturable: see the module)."""
    capturable = False

    def __init__(self, cupy):
        self.cupy = cupy

    def set_stream(self, stream_ptr: int) -> None:
        self.cupy.cuda.cublas.setStream(self.cupy.cuda.device.get_cublas_handle(), stream_ptr)

    def caller(self, call: GemmCall, dtype):
        cublas = self.cupy.cuda.cublas
        handle = self.cupy.cuda.device.get_cublas_handle()
        dt = np.dtype(dtype)
        one, zero = np.full(1, call.alpha, dt), np.full(1, call.beta, dt)
        pone, pzero = one.ctypes.data, zero.ctypes.data
        op = {(False, False): cublas.CUBLAS_OP_N, (True, False): cublas.CUBLAS_OP_T, (True, True): cublas.CUBLAS_OP_C}
        ex = ex_types(call)
        m, n, k, batch = call.m, call.n, call.k, call.batch
        lda, sa, ldb, sb, ldc, sc = call.lda, call.stride_a, call.ldb, call.stride_b, call.ldc, call.stride_c
        if ex is not None:   # bf16/f16 inputs, f32 output and compute (tensor cores)
            atype, btype, ctype, compute = ex
            ta, tb, fn = op[call.transa, False], op[call.transb, False], cublas.gemmStridedBatchedEx

            def go(pa: int, pb: int, pc: int, _keep=(one, zero)) -> None:
                fn(handle, ta, tb, m, n, k, pone, pa, atype, lda, sa, pb, btype, ldb, sb, pzero, pc, ctype, ldc, sc,
                   batch, compute, CUBLAS_GEMM_DEFAULT)
            return go
        fn = {np.dtype(np.float32): cublas.sgemmStridedBatched, np.dtype(np.float64): cublas.dgemmStridedBatched,
              np.dtype(np.complex64): cublas.cgemmStridedBatched, np.dtype(np.complex128): cublas.zgemmStridedBatched}[dt]
        ta, tb = op[call.transa, call.conja], op[call.transb, call.conjb]

        def go(pa: int, pb: int, pc: int, _keep=(one, zero)) -> None:
            fn(handle, ta, tb, m, n, k, pone, pa, lda, sa, pb, ldb, sb, pzero, pc, ldc, sc, batch)
        return go


_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
_STRIDED = [_P, _I, _I, _I, _I, _I, _P, _P, _I, _L, _P, _I, _L, _P, _P, _I, _L, _I]
_STRIDED_EX = [_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _L, _P, _I, _I, _L, _P, _P, _I, _I, _L, _I, _I, _I]
_NAMES = {np.dtype(np.float32): "cublasSgemmStridedBatched", np.dtype(np.float64): "cublasDgemmStridedBatched",
          np.dtype(np.complex64): "cublasCgemmStridedBatched", np.dtype(np.complex128): "cublasZgemmStridedBatched"}


class DirectCublas:
    """libcublas through ctypes on a handle of tgc's own (capturable: see the module).
    One handle and workspace per thread (cuBLAS handles are not to be shared by
    threads that set their streams)."""
    capturable = True

    def __init__(self, cupy, path: str):
        self.cupy = cupy
        self.lib = lib = ctypes.CDLL(path)
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(_P)]
        lib.cublasSetStream_v2.argtypes = [_P, _P]
        for name in _NAMES.values():
            getattr(lib, name).argtypes = _STRIDED
        lib.cublasGemmStridedBatchedEx.argtypes = _STRIDED_EX
        self._local = threading.local()

    def _handle(self) -> ctypes.c_void_p:
        h = getattr(self._local, "handle", None)
        if h is None:
            h = _P()
            _check(self.lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
            ws = self.cupy.empty((WORKSPACE_BYTES,), np.uint8)
            if hasattr(self.lib, "cublasSetWorkspace_v2"):
                self.lib.cublasSetWorkspace_v2.argtypes = [_P, _P, ctypes.c_size_t]
                _check(self.lib.cublasSetWorkspace_v2(h, ws.data.ptr, WORKSPACE_BYTES), "cublasSetWorkspace")
            self._local.handle, self._local.workspace = h, ws
        return h

    def set_stream(self, stream_ptr: int) -> None:
        _check(self.lib.cublasSetStream_v2(self._handle(), stream_ptr), "cublasSetStream")

    def caller(self, call: GemmCall, dtype):
        lib, dt = self.lib, np.dtype(dtype)
        ex = ex_types(call)
        scalar = np.float32 if ex is not None else dt
        one, zero = np.full(1, call.alpha, scalar), np.full(1, call.beta, scalar)
        pone, pzero = one.ctypes.data, zero.ctypes.data
        m, n, k, batch = call.m, call.n, call.k, call.batch
        lda, sa, ldb, sb, ldc, sc = call.lda, call.stride_a, call.ldb, call.stride_b, call.ldc, call.stride_c
        local, handle = self._local, self._handle
        if ex is not None:   # bf16/f16 inputs, f32 output and compute (tensor cores)
            atype, btype, ctype, compute = ex
            ta, tb, fn = _OP[call.transa, False], _OP[call.transb, False], lib.cublasGemmStridedBatchedEx

            def go(pa: int, pb: int, pc: int, _keep=(one, zero)) -> None:
                _check(fn(getattr(local, "handle", None) or handle(), ta, tb, m, n, k, pone, pa, atype, lda, sa, pb, btype, ldb, sb, pzero, pc,
                          ctype, ldc, sc, batch, compute, CUBLAS_GEMM_DEFAULT), "cublasGemmStridedBatchedEx")
            return go
        fn, name = getattr(lib, _NAMES[dt]), _NAMES[dt]
        ta, tb = _OP[call.transa, call.conja], _OP[call.transb, call.conjb]

        def go(pa: int, pb: int, pc: int, _keep=(one, zero)) -> None:
            _check(fn(getattr(local, "handle", None) or handle(), ta, tb, m, n, k, pone, pa, lda, sa, pb, ldb, sb, pzero, pc, ldc, sc, batch), name)
        return go


_CHOSEN: dict = {}


def for_device(cupy):
    """The process's way to cuBLAS (`DirectCublas` where CuPy's libcublas is mapped,
    else `CupyCublas`), made once per CuPy module."""
    key = id(cupy)
    blas = _CHOSEN.get(key)
    if blas is None or blas.cupy is not cupy:
        cupy.cuda.device.get_cublas_handle()   # CuPy's cuBLAS loaded (and initialized) first
        path = _mapped_library()
        blas = _CHOSEN[key] = DirectCublas(cupy, path) if path else CupyCublas(cupy)
    return blas


def run(blas, call: GemmCall, a, b, c, offsets=(0, 0, 0)) -> None:
    """The call on device arrays `a`, `b`, `c` (each from its element offset) on the
    current stream: `blas.caller` once."""
    blas.set_stream(blas.cupy.cuda.get_current_stream().ptr)
    pa, pb, pc = (x.data.ptr + o * x.itemsize for x, o in zip((a, b, c), offsets))
    blas.caller(call, c.dtype)(pa, pb, pc)
