"""Host time per call of the cuda backend, without a GPU: the Python that runs between
the caller and the driver (input checks, the dims' binding, buffers, launch arguments,
the cuBLAS calls' arguments, graph capture and replay), measured with a stand-in for
CuPy whose kernels, cuBLAS calls and graph launches do nothing but count.

    python benchmarks/cuda_host.py                 # the GPT step, the layernorm rows, the 64x256 rows
    python benchmarks/cuda_host.py --only gpt --calls 200

For each row, with and without CUDA graphs (`CudaOptions.graphs`): microseconds of
host time per call, as this thread's CPU time (`host us`: what a machine shared with
other work does not inflate) and as wall time (the median of `--repeat` samples of
`--calls` calls each, after warm-up calls that compile and capture); kernel launches,
cuBLAS calls, graph launches and graph captures per call; device allocations per call
(`cp.empty` and `cp.zeros` by the runtime, the outputs included: 0 once the dropped
outputs are reused). The stand-in's arrays are host memory, so a
device-to-device copy a call makes (`a[...] = b`) is a real memcpy here and shows in
the time. What a GPU adds is not here: CuPy's own cost per kernel launch (a few
microseconds each) and the driver's. Targets (issue 34): <= 1 ms per GPT step without
a graph, <= 50 us per call with one.

The rows' programs and inputs are benchmarks/run.py's (`cases()`); the inputs are
made device arrays once, as a training loop holds them, and each call's result is
dropped before the next call, as a loop that reads only its loss does.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

ROWS = ("gpt", "layernorm 4096x1024", "layernorm 64x256", "gelu 64x256", "softmax 64x256")


class ndarray(np.ndarray):
    """A stand-in device array: host memory, `.data.ptr` its address, `.get()` a copy."""

    def get(self, stream=None):
        return np.array(self, copy=True).view(np.ndarray)

    def set(self, a, stream=None) -> None:
        self[...] = a

    @property
    def data(self):
        """As CuPy's `MemoryPointer` (a plain attribute there: made once here, as
        numpy's `ctypes.data` costs microseconds that a GPU call would not spend)."""
        d = self.__dict__.get("_data")
        if d is None:
            d = self.__dict__["_data"] = types.SimpleNamespace(ptr=self.__array_interface__["data"][0])
        return d


class Counts:
    """What the runtime asked of the stand-in since the last `reset`."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.launches = self.gemms = self.graphs = self.allocs = self.captured = 0


COUNTS = Counts()
_STREAMS: list = []


class _Graph:
    def __init__(self, ops: int):
        self.ops = ops

    def launch(self, stream=None) -> None:
        COUNTS.graphs += 1


class _Stream:
    def __init__(self, null: bool = False, non_blocking: bool = False):
        self.ptr, self.capturing = (0 if null else id(self)), False

    def __enter__(self):
        _STREAMS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _STREAMS.pop()

    def begin_capture(self, mode=None) -> None:
        self.capturing, self.start = True, COUNTS.launches + COUNTS.gemms

    def end_capture(self) -> _Graph:
        self.capturing = False
        COUNTS.captured += 1
        return _Graph(COUNTS.launches + COUNTS.gemms - self.start)

    def synchronize(self) -> None:
        pass


_NULL = _Stream(null=True)


def _launch(grid, block, args) -> None:
    COUNTS.launches += 1


class _RawModule:
    def __init__(self, code: str = "", options=()):
        pass

    def get_function(self, name: str):
        return _launch


def _gemm(*args) -> None:
    COUNTS.gemms += 1


def _alloc(fill):
    def make(shape, dtype=np.float32):
        COUNTS.allocs += 1
        return fill(shape, dtype).view(ndarray)
    return make


def fake_cupy() -> types.ModuleType:
    """The stand-in module (installed as `cupy` by `installed`)."""
    cp = types.ModuleType("cupy")
    cp.ndarray = ndarray
    cp.asarray = lambda a, dtype=None: a if isinstance(a, ndarray) and dtype is None else \
        np.array(a, dtype).view(ndarray)
    cp.ascontiguousarray = lambda a: a if a.flags.c_contiguous else np.ascontiguousarray(a).view(ndarray)
    cp.from_dlpack = lambda x: np.from_dlpack(x).view(ndarray)
    cp.empty, cp.zeros = _alloc(np.empty), _alloc(np.zeros)
    cp.asnumpy = lambda a: np.array(a, copy=True).view(np.ndarray)
    cp.RawModule = _RawModule
    cp.lib = types.SimpleNamespace(stride_tricks=types.SimpleNamespace(
        as_strided=lambda a, shape, strides: np.lib.stride_tricks.as_strided(a, shape, strides).view(ndarray)))
    cublas = types.SimpleNamespace(CUBLAS_OP_N=0, CUBLAS_OP_T=1, CUBLAS_OP_C=2, setStream=lambda handle, stream: None,
                                   sgemmStridedBatched=_gemm, dgemmStridedBatched=_gemm, cgemmStridedBatched=_gemm,
                                   zgemmStridedBatched=_gemm, gemmStridedBatchedEx=_gemm)
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1, memsetAsync=lambda ptr, value, size, stream: None,
                                    getDeviceProperties=lambda i: {"multiProcessorCount": 132, "name": b"stand-in"},
                                    getDevice=lambda: 0)
    cp.cuda = types.SimpleNamespace(runtime=runtime, cublas=cublas,
                                    device=types.SimpleNamespace(get_cublas_handle=lambda: "handle"),
                                    get_current_stream=lambda: _STREAMS[-1] if _STREAMS else _NULL, Stream=_Stream)
    return cp


class installed:
    """`with installed():` the stand-in is `cupy` (and `cupy.cuda`, `cupy.cuda.cublas`)."""

    def __enter__(self):
        cp = fake_cupy()
        self.saved = {k: sys.modules.get(k) for k in ("cupy", "cupy.cuda", "cupy.cuda.cublas")}
        sys.modules.update({"cupy": cp, "cupy.cuda": cp.cuda, "cupy.cuda.cublas": cp.cuda.cublas})
        return cp

    def __exit__(self, *exc) -> None:
        for k, v in self.saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def _case(row: str):
    import run

    workload, _, size = row.partition(" ")
    return next(c for c in run.cases() if c.workload == workload and (not size or c.size == size))


def measure(row: str, graphs: bool, calls: int = 100, repeat: int = 5) -> dict:
    """{"us": host microseconds per call, "launches", "gemms", "graphs", "allocs": per
    call} for a benchmark row (e.g. "gpt", "layernorm 64x256") under the stand-in,
    which must be installed."""
    import run
    import tgc
    from tgc.options import Options

    case = _case(row)
    arrays = case.inputs(np.random.default_rng(0))
    cp = sys.modules["cupy"]
    dev = {k: cp.asarray(v) if v.ndim else v for k, v in arrays.items()}   # a scalar stays a host number
    prog = tgc.compile(str(run.WORK / f"{case.workload}.tg"), backend="cuda", dtype="f32",
                       options=Options().with_(graphs=graphs))
    for _ in range(3):                   # compile, capture, settle
        prog(**dev)
    wall, cpu = [], []
    for _ in range(repeat):
        COUNTS.reset()
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            prog(**dev)
        cpu.append((time.thread_time() - c0) / calls)
        wall.append((time.perf_counter() - t0) / calls)
    per = {k: getattr(COUNTS, k) / calls for k in ("launches", "gemms", "graphs", "allocs", "captured")}
    return {"us": statistics.median(cpu) * 1e6, "wall_us": statistics.median(wall) * 1e6, **per}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="rows, comma-separated (e.g. gpt,'layernorm 64x256')")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    rows = args.only.split(",") if args.only else ROWS
    head = (f"{'row':<22}{'graph':>6}{'host us':>9}{'wall us':>9}{'launches':>9}{'cublas':>7}{'graphs':>7}"
            f"{'captures':>9}{'allocs':>7}")
    print(head)
    print("-" * len(head))
    with installed():
        for row in rows:
            for graphs in (False, True):
                m = measure(row, graphs, args.calls, args.repeat)
                print(f"{row:<22}{'yes' if graphs else 'no':>6}{m['us']:>9.1f}{m['wall_us']:>9.1f}{m['launches']:>9.1f}"
                      f"{m['gemms']:>7.1f}{m['graphs']:>7.1f}{m['captured']:>9.2f}{m['allocs']:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
