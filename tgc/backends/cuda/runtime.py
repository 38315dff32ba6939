"""Kernels of the CUDA backends: the generated module run on a GPU through CuPy
(`backend="cuda"`), or on this CPU by the cuda-sim emulator (`backend="cuda-sim"`).

`compile_kernels(low, options, backend)` takes the program lowered by the neutral
stages (fuse, layout, plan; no loop groups, which are the CPU's own stage),
generates one CUDA module (`codegen.generate`) and loads it on a `_Device`:

- `_SimDevice` compiles the module text unchanged with the host C++ compiler and
  the emulation header (`g++ -fopenmp -x c++ -O2 -shared -fPIC -include sim.h`),
  caches the shared object on disk by content (`tgc.backends.cache`'s directory,
  checksummed), and loads it with ctypes; arrays are numpy's; numpy runs each GEMM
  cell's strided batched call (`gemm.run_numpy`) in place of cuBLAS;
- `_CupyDevice` loads the same text with `cupy.RawModule` (NVRTC; CuPy caches the
  compiled module on disk by source, options and GPU architecture), keeps arrays on
  the device, and runs GEMM cells through cuBLAS (`blas`: ctypes on a handle of tgc's own, which a CUDA graph can capture).

The neutral runtime (`tgc.runtime.program.Program`) checks and converts the inputs,
binds the dims and allocates the outputs (`CudaKernels.empty`); `CudaKernels.run` is
the same orchestration for both devices, on what a binding of the dims keeps
(`_Binding`: one workspace, each `plan` slot at a 256-byte aligned offset; the error
word; each launch as a step with its geometry and arguments fixed, each GEMM cell's
call planned; a loop over an edge as a host loop over its steps, `_steps_fn`): the
check kernels, then every launch in order, each a grid-stride loop
over its work items, `CudaOptions.block_threads` threads per block and at most `CudaOptions.grid_per_sm`
blocks per multiprocessor on a GPU, small grids under the emulator (`SIM_BLOCK`, `SIM_GRID`),
which is slow. The error word is read once: under cuda-sim right after the checks (an
out-of-range id is the runtime's `EvalError` before any other kernel runs), on a GPU
after the call, every kernel after the checks returning at once when a check failed,
so nothing is written either way. A reduction over at least `CudaOptions.row_min`
elements per output runs its one-block-per-output variant (`codegen`'s `row` kernels;
`SIM_ROW_BLOCK` threads under the emulator). A row group runs its warp-per-row kernel
for rows of at most `CudaOptions.warp_rows` elements, else its block-per-row kernel with
`CudaOptions.row_block(length)` threads.
On a GPU a call is captured once per binding and set of argument and output addresses
as a CUDA graph and replayed without a copy (`_run_graph`); the neutral runtime's fast
path (`plan`, `run_fast`) takes device arrays that match the binding without its
general checks and reuses outputs the caller dropped; complex GEMM cells are
cgemm/zgemm calls.

bf16/f16 buffers (the `narrow` stage) are 2-byte arrays: `ml_dtypes.bfloat16` and
`np.float16` under cuda-sim (the caller's arrays, passed without a copy, as on the
CPU), `uint16` holding the bfloat16 bits and `float16` on a GPU (CuPy has no bfloat16
type). GEMM cells on two bf16 or two f16 operands are `cublasGemmStridedBatchedEx`
calls (`gemm.ex_types`; numpy on the widened operands under cuda-sim).

Inputs and outputs: under cuda-sim, as the CPU backend's `Program` (numpy in and
out, updates in place). On a GPU, an input may be a CuPy array, anything with
`__cuda_array_interface__` (zero-copy) or DLPack (`__dlpack__`, e.g. a torch CUDA
tensor), or a numpy array (copied to the device); outputs are CuPy arrays; an
update is written in place into the caller's device array (a numpy array or an
array that had to be cast or copied is refused for an update target). A bf16 argument
takes a CuPy `uint16` array of bfloat16 bits as it is (a torch bf16 tensor through
DLPack is seen so), or any float array, rounded to bf16 on the device (a copy; refused
for an update target); a bf16 output is a CuPy `uint16` array of bfloat16 bits
(`cupy.asnumpy(y).view(ml_dtypes.bfloat16)` on the host; `torch.from_dlpack(y).view(
torch.bfloat16)`). f16 ones are CuPy `float16` arrays.
"""
from __future__ import annotations

import contextlib
import ctypes
from dataclasses import replace
import functools
import hashlib
import math
import operator
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

from tgc.backends.base import BackendUnavailable, Kernels
from tgc.backends.cuda import blas, codegen, flashgen, gemm
from tgc.backends.cuda.launches import all_launches
from tgc.ir.complex_io import COMPLEX_OF, FLOAT_OF
from tgc.ir.dtypes import LOW_FLOATS, TYPES
from tgc.ir.input_checks import EvalError, check_element_type, check_names, check_updated_dtype, dlpack_view
from tgc.ir.sizes import size_eval
from tgc.ir.module import Module
from tgc.options import Options

NP = {"f32": np.float32, "f64": np.float64, "i32": np.int32}
BF16 = np.dtype(TYPES["bf16"].numpy)   # ml_dtypes.bfloat16

SIM_HEADER = Path(__file__).with_name("sim.h")
SIM_FLAGS = ("-fopenmp", "-x", "c++", "-O2", "-shared", "-fPIC", "-w")
SIM_BLOCK, SIM_GRID = 32, 4          # emulated launches: a few blocks of a warp
SIM_ROW_BLOCK = 64                   # emulated one-block-per-row reductions: two warps (an OpenMP team)
WS_ALIGN = 256
# the emulator's grid and block sizes are globals of each loaded library (a library is
# shared by every program with the same module text): one emulated call at a time
_SIM_LOCK = threading.Lock()


def compile_kernels(low, options: Options, backend: str) -> "CudaKernels":
    """Generate the CUDA module of `low` (lowered without the CPU's stages) and load
    it on the device `backend` names ("cuda" or "cuda-sim")."""
    device = _CupyDevice(options) if backend == "cuda" else _SimDevice()
    cm = codegen.generate(low, cuda=options.cuda)
    device.load(cm, options)
    return CudaKernels(low, options, cm, device)


def unavailable(backend: str) -> str | None:
    """Why `backend` ("cuda" or "cuda-sim") cannot run here, or None: the checks its
    device makes before anything is compiled (CuPy and a GPU; a C++ compiler)."""
    try:
        _CupyDevice(Options()) if backend == "cuda" else _compiler()
    except BackendUnavailable as e:
        return str(e)
    return None


def lower(module: Module, options: Options):
    """The lowered program the CUDA backends compile: the neutral stages fuse, layout
    and plan with their own between (`CudaBackend.stages`; no stage of the CPU's)."""
    from tgc.backends.base import get_backend, pass_registry
    from tgc.manager import lower_module

    be = get_backend("cuda-sim")
    return lower_module(module, be.lowering_options(options), stages=be.lowering(), known=pass_registry())


# ---------------------------------------------------------------- devices


class _SimDevice:
    """The emulator: numpy arrays, kernels compiled for this CPU from the same text."""
    name = "cuda-sim"
    xp = np
    gemm_capturable = True   # (nothing is captured here)

    def load(self, cm: codegen.CudaModule, options: Options) -> None:
        self.lib = _load_sim(cm.source)
        self.fns = {}
        proto = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint)
        for name in cm.kernel_names():
            self.fns[name] = proto(("tgc_launch_" + name, self.lib))

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def np_type(self, dtype: str) -> np.dtype:
        """The array type of a buffer of element type `dtype` (bf16: ml_dtypes')."""
        return np.dtype(TYPES[dtype].numpy if dtype in LOW_FLOATS else NP[dtype])

    def widen(self, x):
        """A 2-byte array's values as f32 (exact)."""
        return x.astype(np.float32)

    def err_word(self):
        return np.zeros(1, np.int32)

    def read_err(self, err) -> int:
        return int(err[0])

    def clear_err(self, err) -> None:
        err[0] = 0

    def gemm_stream(self) -> None:
        """(numpy runs the GEMM cells: no stream)"""

    def launcher(self, name: str, total: int, row: bool | str, dims: list[int], err, names: tuple,
                 threads: int = 0):
        """`go(bufs)`: kernel `name` launched on the buffers `names` over `total` work
        items with the emulator's geometry (`threads`: a block-per-row launch's block
        size, at most the emulator's), the dims and the error word fixed."""
        block = min(threads, SIM_ROW_BLOCK) if threads else SIM_ROW_BLOCK if row else SIM_BLOCK
        grid = max(1, min(SIM_GRID, _blocks(total, block, row)))
        fn = self.fns[name]
        dvals = (ctypes.c_longlong * max(len(dims), 1))(*dims)
        dptr, eptr = ctypes.addressof(dvals), err.ctypes.data
        array = ctypes.c_void_p * max(len(names), 1)

        def go(bufs: dict, _keep=dvals) -> None:
            ptrs = array(*[bufs[n].ctypes.data for n in names])
            fn(ctypes.addressof(ptrs), dptr, eptr, grid, block)
        return go

    def to_host(self, a) -> np.ndarray:
        return a


class _CupyDevice:
    """A GPU through CuPy: `cupy.RawModule` kernels, cuBLAS through `cupy.matmul`."""
    name = "cuda"

    def __init__(self, options: Options):
        try:
            import cupy
        except ImportError as e:
            raise BackendUnavailable(f"backend 'cuda' needs CuPy and an NVIDIA GPU: CuPy is not installed ({e}); "
                                     f"pip install -e '.[cuda]', or use backend 'cuda-sim'") from None
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # noqa: BLE001 -- CuPy's CUDARuntimeError and friends
            raise BackendUnavailable(f"backend 'cuda' needs CuPy and an NVIDIA GPU: {e}") from None
        if count < 1:
            raise BackendUnavailable("backend 'cuda' needs CuPy and an NVIDIA GPU: no device found")
        self.cp = self.xp = cupy
        self.grid_max = options.cuda.grid_per_sm * _sm_count(cupy)
        self.block_threads = options.cuda.block_threads

    def load(self, cm: codegen.CudaModule, options: Options) -> None:
        opts = ("--std=c++17",) + (("--fmad=false",) if options.fp_strict else ())
        try:
            self.module = self.cp.RawModule(code=cm.source, options=opts)
            self.fns = {name: self.module.get_function(name) for name in cm.kernel_names()}
        except Exception as e:  # noqa: BLE001 -- NVRTC or driver errors
            raise BackendUnavailable(f"backend 'cuda' needs CuPy and an NVIDIA GPU: loading the module failed: {e}") \
                from None

    def empty(self, shape, dtype):
        return self.cp.empty(shape, np.uint16 if np.dtype(dtype) == BF16 else dtype)

    def np_type(self, dtype: str) -> np.dtype:
        """The array type of a buffer of element type `dtype`: bf16 as uint16 bits."""
        return np.dtype(np.uint16 if dtype == "bf16" else np.float16 if dtype == "f16" else NP[dtype])

    def widen(self, x):
        """A 2-byte array's values as f32 (exact): bf16 bits shifted to the top of an f32."""
        if x.dtype == np.uint16:
            return (x.astype(np.uint32) << 16).view(np.float32)
        return x.astype(np.float32)

    def bf16_bits(self, a):
        """A float device array rounded to bfloat16 (through f32, nearest even; NaN kept
        a quiet NaN, as `tgc_bf16f`), as its uint16 bits."""
        f = _contiguous(self.cp, a.astype(np.float32))
        u = f.view(np.uint32)
        r = self.cp.where(f != f, u | np.uint32(0x00400000), u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))
        return (r >> 16).astype(np.uint16)

    def err_word(self):
        return self.cp.zeros(1, np.int32)

    def read_err(self, err) -> int:
        """The error word, copied on the current stream once the work before it is
        done (the host waits here: once per call, for programs with checks)."""
        return int(err.get(stream=self.cp.cuda.get_current_stream())[0])

    def clear_err(self, err) -> None:
        """The error word zeroed on the current stream (ordered with the launches)."""
        self.cp.cuda.runtime.memsetAsync(err.data.ptr, 0, err.nbytes, self.cp.cuda.get_current_stream().ptr)

    @property
    def blas(self):
        """The process's way to cuBLAS (`blas.for_device`)."""
        return blas.for_device(self.cp)

    @property
    def gemm_capturable(self) -> bool:
        """Whether a CUDA graph can capture the GEMM cells' cuBLAS calls."""
        return self.blas.capturable

    def gemm_stream(self) -> None:
        """cuBLAS's handle set to the current stream (once per call, before its GEMMs;
        before a capture begins, on the capturing stream)."""
        self.blas.set_stream(self.cp.cuda.get_current_stream().ptr)

    def put(self, dst, value) -> None:
        """A host value copied into a device array of its shape and type, on the
        current stream (ordered after the work queued before it, no wait)."""
        dst.set(value, stream=self.cp.cuda.get_current_stream())

    def launcher(self, name: str, total: int, row: bool | str, dims: list[int], err, names: tuple,
                 threads: int = 0):
        """`go(bufs)`: kernel `name` launched on the buffers `names` over `total` work
        items, `block_threads` threads per block (or `threads`: a block-per-row launch's) and at
        most `grid_max` blocks (grid-stride loops do the rest), the dims and the error
        word fixed as the arguments' tail."""
        threads = min(threads, self.block_threads) if threads else self.block_threads
        grid = (max(1, min(self.grid_max, _blocks(total, threads, row))),)
        block = (threads,)
        fn = self.fns[name]
        tail = tuple(np.int64(d) for d in dims) + (err,)
        if not names:
            return lambda bufs: fn(grid, block, tail)
        if len(names) == 1:
            only = names[0]

            def go(bufs: dict) -> None:
                fn(grid, block, (bufs[only], *tail))
            return go
        get = operator.itemgetter(*names)

        def go(bufs: dict) -> None:
            fn(grid, block, get(bufs) + tail)
        return go

    def to_host(self, a) -> np.ndarray:
        """A copy on the host of a device array (CuPy's, or any the inputs may be:
        DLPack on a CUDA device, `__cuda_array_interface__`); host data as given."""
        if not isinstance(a, self.cp.ndarray):
            d = _device_array(self.cp, a)
            if d is None:
                return a
            a = d
        return self.cp.asnumpy(a)


def _contiguous(cp, a):
    """`a` if it is C-contiguous, else a C-contiguous copy. (CuPy's `ascontiguousarray`
    returns a 0-d array with one axis, as numpy's did: a scalar input must keep none.)"""
    return a if a.flags.c_contiguous else cp.ascontiguousarray(a)


def _device_array(cp, v):
    """A CuPy array of the device memory `v` holds (no copy), or None for host data.
    DLPack first, on the current stream (CuPy's `from_dlpack` passes it, so the
    producer's pending work is ordered before ours), for an object that says its
    memory is on a CUDA device (`__dlpack_device__`: kDLCUDA 2, kDLCUDAManaged 13);
    then `__cuda_array_interface__`. A torch tensor that requires grad is detached
    first (both protocols refuse it); a torch bf16 tensor is taken as its int16 bits
    (CuPy has no bfloat16), as uint16."""
    if isinstance(v, np.ndarray):
        return None
    v = _detached(v)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(v, torch.Tensor):
        if v.dtype == torch.bfloat16:
            v = v.view(torch.int16)
            a = _device_array(cp, v)
            return None if a is None else a.view(np.uint16)
    try:
        where = v.__dlpack_device__()[0] if hasattr(v, "__dlpack_device__") else None
    except Exception:  # noqa: BLE001 -- a producer that cannot say: the other protocol, or host data
        where = None
    if where in (2, 13) and hasattr(v, "__dlpack__"):
        return cp.from_dlpack(v)
    try:
        if hasattr(v, "__cuda_array_interface__"):
            return cp.asarray(v)
    except Exception:  # noqa: BLE001 -- an interface that refuses (a CPU tensor's raises)
        pass
    return None


def _detached(v):
    """A torch tensor that requires grad, detached (the same memory); others as given."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(v, torch.Tensor) and v.requires_grad:
        return v.detach()
    return v


def _sm_count(cupy) -> int:
    """The current device's multiprocessors (132 on an H100 or H200 SXM)."""
    try:
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
        return max(1, int(props["multiProcessorCount"]))
    except Exception:  # noqa: BLE001 -- a runtime without the query: an H100's count
        return 132


def _blocks(total: int, block: int, row: bool | str) -> int:
    """The blocks that give each of `total` items its thread (`row` False), its block
    (True: one block per output or row) or its warp ("warp": one warp per row)."""
    if row == "warp":
        return -(-total // max(1, block // 32))
    return total if row else -(-total // block)


# ---------------------------------------------------------------- the emulator's shared objects


def _compiler() -> str:
    for cxx in ("g++", "c++"):
        path = shutil.which(cxx)
        if path:
            return path
    raise BackendUnavailable("backend 'cuda-sim' needs a C++ compiler with OpenMP (g++): none found")


@functools.lru_cache(maxsize=4)
def _compiler_version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout


def _load_sim(source: str) -> ctypes.CDLL:
    """The emulator's shared object for `source`: from the cache (by content: the
    source, the header, the flags and the compiler's version) or compiled now."""
    from tgc.backends import cache

    cxx = _compiler()
    version = _compiler_version(cxx)
    h = hashlib.sha256()
    for part in (source, SIM_HEADER.read_text(), " ".join(SIM_FLAGS), version):
        h.update(part.encode())
        h.update(b"\0")
    key = h.hexdigest()
    folder = cache.cache_dir()
    if folder is not None:
        so, digest = folder / f"cudasim-{key}.so", folder / f"cudasim-{key}.sha256"
        try:
            if (so.is_file() and not so.is_symlink() and digest.is_file()
                    and hashlib.sha256(so.read_bytes()).hexdigest() == digest.read_text().strip()):
                return ctypes.CDLL(str(so))
        except OSError:
            pass
    with tempfile.TemporaryDirectory(prefix="tgc-cudasim-") as tmp:
        cu, out = Path(tmp) / "module.cu", Path(tmp) / "module.so"
        cu.write_text(source)
        cmd = [cxx, *SIM_FLAGS, "-include", str(SIM_HEADER), "-DTGC_CUDA_SIM", str(cu), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"internal: the cuda-sim module does not compile:\n{done.stderr[-4000:]}")
        data = out.read_bytes()
        if folder is not None:
            from tgc.fsutil import write_atomic

            try:
                write_atomic(folder / f"cudasim-{key}.so", data, mode=0o600, durable=False)
                write_atomic(folder / f"cudasim-{key}.sha256", hashlib.sha256(data).hexdigest(), mode=0o600,
                             durable=False)
                return ctypes.CDLL(str(folder / f"cudasim-{key}.so"))
            except OSError:
                pass
        return ctypes.CDLL(str(out))   # loaded before the folder goes: the mapping stays valid


# ---------------------------------------------------------------- the program


class _Binding:
    """What the calls with one binding of the dims share: the workspace and the
    temporaries over it, the error word, the dims' values, the steps (each launch
    with its geometry and arguments fixed, each GEMM cell's call planned), the
    CUDA graphs by the addresses of the arguments and outputs, and, for the fast
    path, the expected arguments and the outputs kept for reuse."""
    __slots__ = ("key", "env", "ws", "offsets", "temps", "err", "dims", "capture", "steps", "checks", "graphs",
                 "hits", "misses", "ins", "outs", "kept", "upd", "updated", "in_names", "checked_ptrs", "early_read",
                 "scalars")

    def __init__(self, key: tuple, env: dict, ws, offsets: list, temps: dict, err, dims: list, capture: bool):
        self.key, self.env, self.ws, self.temps, self.err, self.dims = key, env, ws, temps, err, dims
        self.offsets = offsets          # each workspace slot's byte offset (a loop's step's slots too)
        self.capture = capture          # calls run as CUDA graphs (GPU, `CudaOptions.graphs`, capturable steps)
        self.steps: list | None = None  # [(kernel index, or -1 for a check; fn(bufs))], made on the first call
        self.checks = 0                 # the first steps that are checks
        self.early_read = False         # launching each kernel, the error word read right after the checks
        self.graphs: dict = {}          # argument and output addresses -> (graph, its capture stream)
        self.hits = self.misses = 0
        self.ins: list | None = None    # the fast path's (shape, strides, dtype, scalar slot) per input
        self.in_names: tuple = ()
        self.scalars: tuple = ()        # (name, device scalar) of the 0-d inputs a host value may give
        self.upd: tuple = ()            # per input: updated in place
        self.updated = False
        self.checked_ptrs: list = []    # the last argument addresses found not to share an updated array's memory
        self.outs: list = []            # (name, shape, dtype) per output
        self.kept: list = []            # earlier calls' (outputs, their addresses), reused once only this list refers to them


class CudaKernels(Kernels):
    """The kernels of the cuda or cuda-sim backend, as the neutral runtime calls them
    (`tgc.runtime.program.Program`: same checks, same result dict). `cuda_source` is
    the generated CUDA C module."""

    def __init__(self, low, options: Options, cm: codegen.CudaModule, device):
        self.lowered, self.options = low, options
        self.module = low.module
        self._lock = threading.Lock()
        self._cm, self._device = cm, device
        self.backend = device.name
        self.gemm_counts = {"strided": 0, "views": 0}   # GEMM cells run as one strided batched call, or on views
        self.graph_counts = {"captures": 0, "replays": 0}
        self.graph_refusal: str | None = None   # why a capture failed (its binding then launches each kernel)   # CUDA graphs captured and calls replayed (GPU)
        self._bindings: dict = {}        # sorted dims -> _Binding, most recently used last
        # the buffers that are arguments or outputs, with the names the call's dicts use
        module = low.module
        self._arg_bufs = tuple((n, n) for n, b in low.buffers.items() if b.kind == "arg")
        self._out_bufs = tuple((n, module.outputs[b.index].name) for n, b in low.buffers.items() if b.kind == "out")
        self._in_names = tuple(module.args)
        self._loops = any(x.kind == "steps" for x in cm.launches)   # loops over an edge: host launch loops
        self._out_names = tuple(o.name for o in module.outputs)

    @property
    def cuda_source(self) -> str:
        """The generated CUDA C module (`Program.cuda_source`)."""
        return self._cm.source

    @property
    def cuda_module(self) -> codegen.CudaModule:
        """The generated module with its launch list (`Program.cuda_module`)."""
        return self._cm

    @property
    def llvm_ir(self) -> str:
        raise ValueError(f"the {self.backend} backend generates CUDA C (cuda_source), not LLVM IR")

    def prepare(self, program, given: dict):
        """On a GPU: device arrays in the program's dtypes, C-contiguous (None under
        cuda-sim: the runtime's host checks apply)."""
        return self._prepare_device(program, given) if self._device.name == "cuda" else None

    def empty(self, shape, dtype):
        return self._device.empty(shape, dtype)

    def as_low(self, a, dtype: str):
        """An output held in floats whose values are of the narrower type `dtype` (bf16,
        f16, or f32 in an f64 program), as an array of that type (exact): on a GPU, bf16
        as uint16 bits."""
        if self._device.name == "cuda" and dtype == "bf16":
            return self._device.bf16_bits(a)
        return a.astype(TYPES[dtype].numpy)

    def to_host(self, a):
        return self._device.to_host(a)

    def device_pairs(self, name: str, value, dtype: str, updated: bool):
        """On a GPU, a complex device array as float pairs over its memory (a copy only
        when its width or layout differs, refused for an update target); a float device
        array as given (pairs already); None for host data."""
        if self._device.name != "cuda":
            return None
        cp = self._device.cp
        a = value if isinstance(value, cp.ndarray) else _device_array(cp, value)
        if a is None or a.dtype.kind != "c":
            return a
        want = np.dtype(COMPLEX_OF[dtype])
        c = a if a.dtype == want and a.flags.c_contiguous else _contiguous(cp, a.astype(want))
        if updated and c is not a:
            raise EvalError(f"'{name}' is updated in place: pass a C-contiguous {want.name} device array")
        return c.reshape(c.shape + (1,)).view(FLOAT_OF[dtype])

    def device_complex(self, a):
        """On a GPU, a float-pairs device array as a complex view of its memory."""
        if self._device.name != "cuda" or not isinstance(a, self._device.cp.ndarray):
            return None
        if a.dtype.kind == "c":
            return a
        a = _contiguous(self._device.cp, a)
        return a.view(np.complex64 if a.dtype == np.float32 else np.complex128)[..., 0]

    def _prepare_device(self, program, given: dict) -> tuple[dict, dict]:
        """The GPU's `_prepare`: device arrays in the program's dtypes, C-contiguous."""
        cp = self._device.cp
        check_names([s.name for s in program.inputs], given)
        arrays = {}
        for s in program.inputs:
            v = given[s.name]
            store = program._store.get(s.name)      # a 2-byte buffer's type (`narrow`), or None
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                v = np.asarray(v, NP[s.dtype])
            a = v if isinstance(v, cp.ndarray) else _device_array(cp, v)
            if s.updated and a is None:
                raise EvalError(f"'{s.name}' is updated in place: pass a device array (CuPy, "
                                f"__cuda_array_interface__ or DLPack), not {type(v).__name__}")
            if a is None:                              # the CPU checks, then one copy to the device
                host = program._convert(s, dlpack_view(s.name, _detached(v)))
                a = cp.asarray(host.view(np.uint16) if host.dtype == BF16 else host)
            if store is not None:                      # a bf16/f16 buffer: 2-byte elements
                arrays[s.name] = self._narrow_arg(s, a, np.dtype(store))
                continue
            check_element_type(s.name, a.dtype, s.dtype)
            if s.updated:   # the very buffer the kernels write: of the program's type
                check_updated_dtype(s.name, a.dtype, np.dtype(NP[s.dtype]))
            conv = _contiguous(cp, a.astype(NP[s.dtype], copy=False))
            if s.updated and conv is not a:
                raise EvalError(f"'{s.name}' is updated in place: pass a C-contiguous {s.dtype} device array")
            arrays[s.name] = conv
        return arrays, {}

    def _narrow_arg(self, s, a, store: np.dtype):
        """A bf16/f16 argument's device array: bf16 as uint16 bits (a uint16 array is
        taken as such bits), f16 as float16; any other float array rounded through f32
        (a copy, refused for an update target)."""
        dev = self._device
        want = np.dtype(np.uint16) if store == BF16 else np.dtype(np.float16)
        if s.updated:
            check_updated_dtype(s.name, a.dtype, want, "a uint16 array of bfloat16 bits" if store == BF16 else None)
        if a.dtype != want:
            check_element_type(s.name, a.dtype, "bf16" if store == BF16 else "f16",
                               "bf16, or uint16 bfloat16 bits" if store == BF16 else None)
        if a.dtype == want:
            conv = _contiguous(dev.cp, a)
        elif store == BF16:
            conv = dev.bf16_bits(a)
        else:
            conv = _contiguous(dev.cp, a.astype(np.float32).astype(np.float16))
        if s.updated and conv is not a:
            raise EvalError(f"'{s.name}' is updated in place: pass a C-contiguous device array of its type "
                            f"({'uint16 bfloat16 bits' if store == BF16 else 'float16'})")
        return conv

    notifies = True

    @property
    def fast_path(self) -> bool:
        """On a GPU, calls whose device arrays match the last binding's shapes skip the
        neutral runtime's checks (`plan`, `run_fast`); cuda-sim takes numpy arrays
        through those checks."""
        return self._device.name == "cuda"

    def run(self, args: dict, outs: dict, env: dict, notify=None) -> int:
        """Every launch in order; the check kernels first, and the device's error word
        read once after them, before anything is written (its value is the runtime's
        rc: 1 + the failed check). `notify = (marks, fn)`: fn(i, outs) for each marked
        kernel i once every launch of kernels up to i is made (under cuda-sim: has
        run; on a GPU: is queued on the current stream), before the next kernel's.
        On a GPU, a call without `notify` runs as a CUDA graph (`_run_graph`) when
        `CudaOptions.graphs` says so."""
        pending = sorted(notify[0]) if notify is not None else []
        failed: list = []

        def tell(upto: int) -> None:   # every mark below `upto`, in order
            while pending and pending[0] < upto:
                i = pending.pop(0)
                if not failed:
                    try:
                        notify[1](i, outs)
                    except BaseException as e:  # noqa: BLE001 -- raised once the run is done, as the CPU's
                        failed.append(e)
        with self._lock, (_SIM_LOCK if self._device.name == "cuda-sim" else contextlib.nullcontext()):
            rc = self._run_bound(self._binding(env), args, outs, tell if notify is not None else None)
        if failed:
            raise failed[0]
        return rc

    def _run_bound(self, b: "_Binding", args: dict, outs: dict, tell=None, key: tuple | None = None) -> int:
        """The call on binding `b`: a replay of its graph for these addresses (`key`:
        the arguments' then the outputs' data pointers, in signature order; computed
        here when not given), else the steps (captured first, where graphs apply)."""
        if tell is None and b.capture and b.steps is not None:
            if key is None:
                key = tuple([args[n].data.ptr for n in self._in_names] + [outs[n].data.ptr for n in self._out_names])
            entry = b.graphs.get(key)
            if entry is not None:
                b.hits += 1
                return self._replay(b, entry)
        bufs = dict(b.temps)
        for buf, name in self._arg_bufs:
            bufs[buf] = args[name]
        for buf, name in self._out_bufs:
            bufs[buf] = outs[name]
        if b.steps is None:
            self._bind_steps(b, bufs)
        rc = None
        if tell is None and b.capture:
            if key is None:
                key = tuple([args[n].data.ptr for n in self._in_names] + [outs[n].data.ptr for n in self._out_names])
            rc = self._run_graph(b, bufs, key)
        if rc is None:
            rc = self._launch_all(b, bufs, tell)
        return rc

    # ------------------------------------------------------------ bindings of the dims

    def _binding(self, env: dict) -> "_Binding":
        """What a call with these dims reuses (`_Binding`): made on the first call with
        them, the `CudaOptions.bindings_kept` most recently used kept."""
        key = tuple(sorted(env.items()))
        b = self._bindings.pop(key, None)
        if b is None:
            b = self._new_binding(key, env)
        self._bindings[key] = b            # most recently used last
        while len(self._bindings) > self.options.cuda.bindings_kept:
            self._bindings.pop(next(iter(self._bindings)))
        return b

    def _new_binding(self, key: tuple, env: dict) -> "_Binding":
        """The workspace and the temporaries' views over it, the error word and the
        dims' values: allocated once per binding, not per call."""
        low, dev = self.lowered, self._device
        offsets, total = [], 0
        for sizes in low.slots:
            offsets.append(total)
            need = max([size_eval(s, env) for s in sizes] + [1])
            total += -(-need // WS_ALIGN) * WS_ALIGN
        ws = dev.empty((max(total, 1),), np.uint8)
        temps = self._temps(low, env, ws, offsets, 0)
        cols = [self._col_chunks(x, env) for x in all_launches(self._cm.launches)]
        rows = [x.scratch(env) for x in all_launches(self._cm.launches) if x.slots]   # row groups' column partials
        rows += [math.prod(size_eval(e, env) for e in x.elems) for x in all_launches(self._cm.launches)
                 if x.wide_at(env, self.options.cuda.wide_scatter_terms)]   # f32 scatter-adds' f64 copies
        if any(chunks for chunks, _ in cols) or rows:   # the column sums' partials (one scratch: they run in turn)
            temps[codegen.COL_SCRATCH] = dev.empty((max(1, *(n for _, n in cols), *rows),), np.float64)
        graphs = dev.name == "cuda" and self.options.cuda.graphs
        b = _Binding(key, dict(env), ws, offsets, temps, dev.err_word(), [env[d] for d in self._cm.dims],
                     capture=graphs)
        b.early_read = dev.name == "cuda-sim"   # (reading it costs nothing there, and the rest need not run)
        return b

    def _temps(self, low, env: dict, ws, offsets: list, base: int) -> dict:
        """The temporaries of `low` (the program, or a loop's step whose slots start at
        `base`) as views of the workspace, in their axis orders."""
        temps = {}
        for name, buf in low.buffers.items():
            if buf.kind in ("arg", "out"):
                continue
            order = buf.order if buf.order is not None else buf.edges
            shape = tuple(size_eval(low.size(e), env) for e in order)
            count = int(np.prod(shape, dtype=np.int64))
            dt = self._device.np_type(buf.dtype)
            start = offsets[base + buf.slot]
            temps[name] = ws[start:start + count * dt.itemsize].view(dt).reshape(shape)
        return temps

    def _bind_steps(self, b: "_Binding", bufs: dict) -> None:
        """Each launch of the list as a step for this binding (`_bind`); the checks
        are the first steps."""
        low = self.lowered
        kinds = {n: buf.kind for n, buf in low.buffers.items()}
        steps = self._bind(b, self._cm.launches, low, bufs, 0, kinds, b.temps)
        b.checks = sum(1 for index, _ in steps if index == -1)   # the first steps
        b.steps = steps

    def _bind(self, b: "_Binding", launches: list, low, bufs: dict, base: int, kinds: dict, fixed: dict) -> list:
        """[(kernel index, or -1 for a check; fn(bufs))]: each launch of `launches` (of
        program `low`: the whole program, or a loop's step whose slots start at `base`)
        with its kernel variant, geometry and dims' arguments fixed (`launcher`), a
        GEMM cell's strided call and its offsets planned once (`_gemm_plan`), a loop
        as a host loop over its steps (`_steps_fn`); `bufs` (this call's) give the
        layouts; `kinds`: what each buffer is in the whole program (arg, out, temp);
        `fixed`: the buffers whose arrays are the binding's (the workspace's views), the
        same in every call."""
        dev, env, steps = self._device, b.env, []
        has_checks = bool(self.lowered.checks)
        for x in launches:
            if x.kind == "steps":
                go = self._steps_fn(b, x, low, bufs, base, kinds, fixed)
                if go is not None:
                    steps.append((x.index, go))
                continue
            if x.kind == "gemm":
                step = self._gemm_step(x.gemm, bufs, env, low)
                if step is None:
                    b.capture = False      # matmul on views: temporaries the capture would hold without owning
                    step = functools.partial(self._gemm, x.gemm, env=env, low=low)
                elif not dev.gemm_capturable:
                    b.capture = False      # CuPy's cuBLAS bindings refuse calls while a stream is captured
                elif has_checks and kinds.get(x.gemm.out) == "arg":
                    b.capture = False      # a GEMM writing an argument would not see a failed check
                    b.early_read = True
                steps.append((x.index, step))
                continue
            total = 1
            for s in x.total:
                total *= size_eval(s, env)
            if total <= 0:
                continue
            if x.kind == "flash":   # attention's chain: a block per tile of rows (flashgen)
                rows = size_eval(x.total[-1], env)
                blocks = total // rows * -(-rows // x.inner[0])
                steps.append((x.index, dev.launcher(x.name, blocks, True, b.dims, b.err, x.bufs,
                                                    flashgen.FLASH_THREADS)))
                continue
            if x.kind == "rows":   # a row group: a warp per row for short rows, else a block
                inner = 1
                for s in x.inner:
                    inner *= size_eval(s, env)
                warp = inner <= self.options.cuda.warp_rows
                name, row = (x.warp, "warp") if warp else (x.name, True)
                threads = 0 if warp else self.options.cuda.row_block(inner)   # the block fits the row
            elif x.wide_at(env, self.options.cuda.wide_scatter_terms):   # an f32 scatter-add's f64 form
                if x.kind == "zero":
                    steps.append((x.index, dev.launcher(x.wide, total, False, b.dims, b.err, (codegen.COL_SCRATCH,))))
                    continue
                elems = math.prod(size_eval(e, env) for e in x.elems)
                steps.append((x.index, dev.launcher(x.wide, total, False, b.dims, b.err,
                                                    x.bufs + (codegen.COL_SCRATCH,))))
                steps.append((x.index, dev.launcher(x.wide_round, elems, False, b.dims, b.err,
                                                    (x.bufs[0], codegen.COL_SCRATCH))))
                continue
            else:
                chunks, _ = self._col_chunks(x, env)
                if chunks:   # a column sum: tiles of columns, partials per chunk of rows, added in order
                    names = x.bufs + (codegen.COL_SCRATCH,)
                    blocks = -(-total // codegen.COL_TILE) * chunks    # one per (tile, chunk)
                    steps.append((x.index, dev.launcher(x.col, blocks, True, b.dims, b.err, names)))
                    if chunks > 1:
                        steps.append((x.index, dev.launcher(x.col_sum, total, False, b.dims, b.err, names)))
                    continue
                row, threads = False, 0
                if x.row:
                    row = self._reduced(x, env) >= self.options.cuda.row_min
                name = x.row if row else x.name
            steps.append((-1 if x.kind == "check" else x.index, dev.launcher(name, total, row, b.dims, b.err, x.bufs, threads)))
        return steps

    def _steps_fn(self, b: "_Binding", x: codegen.Launch, low, bufs: dict, base: int, kinds: dict, fixed: dict):
        """A loop over an edge as one step `fn(bufs)` (None when it has no steps): for
        each index i (counting down for a reverse loop), the step's launches (bound once,
        `_bind`) on its temporaries (its own workspace slots) and the bound buffers, a
        stacked one as its slice i (the loop edge is its outermost axis: a view at
        i times the slice's size), then the carries' copy kernels. The trip count
        is fixed by the binding's dims, so a CUDA graph holds the whole loop. The
        slices of the buffers in `fixed` are made once per binding; the others' (the
        call's arguments and outputs) at each step."""
        k, step = x.loop, x.loop.step
        trip = size_eval(k.trip, b.env)
        if trip <= 0:
            return None
        base = base + k.slot_base
        outs = {buf.index: n for n, buf in step.buffers.items() if buf.kind == "out"}
        binds = [(n, bind) for n, bind in zip(step.module.args, k.args)] + \
            [(outs[j], bind) for j, bind in enumerate(k.outs)]
        temps = self._temps(step, b.env, b.ws, b.offsets, base)
        if codegen.COL_SCRATCH in bufs:
            temps[codegen.COL_SCRATCH] = bufs[codegen.COL_SCRATCH]
        inner_kinds = {n: buf.kind for n, buf in step.buffers.items()}
        inner_kinds.update({n: kinds.get(bind.buf, "temp") for n, bind in binds})

        def view(a, bind, i: int, name: str = ""):
            if bind.split:   # the block of an edge whose outer edges have size 1 (Bind.split): slice i of trip
                sb = step.buffers[name]
                return a.reshape(trip, -1)[i].reshape(tuple(size_eval(step.size(e), b.env)
                                                            for e in (sb.order or sb.edges)))
            return a[i, ...] if bind.stacked else a   # a view, a 0-d one too
        per_step = []   # index -> the step's temporaries and its slices of the binding's buffers
        for i in range(trip):
            d = dict(temps)
            d.update({n: view(fixed[bind.buf], bind, i, n) for n, bind in binds if bind.buf in fixed})
            per_step.append(d)
        varying = [(n, bind) for n, bind in binds if bind.buf not in fixed]

        def views(bufs: dict, i: int) -> dict:
            d = dict(per_step[i])
            for n, bind in varying:
                d[n] = view(bufs[bind.buf], bind, i, n)
            return d
        body = [go for _, go in self._bind(b, x.body, step, views(bufs, 0), base, inner_kinds, temps)]
        carry = [go for _, go in self._bind(b, x.carry, low, bufs, base - k.slot_base, kinds, fixed)]
        order = range(trip - 1, -1, -1) if k.reverse else range(trip)

        def go(bufs: dict) -> None:
            for i in order:
                d = views(bufs, i)
                for fn in body:
                    fn(d)
                for fn in carry:
                    fn(bufs)
        return go

    @staticmethod
    def _reduced(x: codegen.Launch, env: dict) -> int:
        """The reduced points per output of a reduction's launch."""
        red = 1
        for s in x.red:
            red *= size_eval(s, env)
        return red

    def _col_chunks(self, x: codegen.Launch, env: dict) -> tuple[int, int]:
        """(chunks, scratch doubles) of a launch that runs as a column sum with these
        dims (its reductions over at least `CudaOptions.row_min` points per output,
        as for the one-block-per-output variant it replaces; `CudaOptions.column_tiles`), else (0, 0)."""
        if not x.col or not self.options.cuda.column_tiles or self._reduced(x, env) < self.options.cuda.row_min:
            return 0, 0
        ncols = 1
        for s in x.total:
            ncols *= size_eval(s, env)
        chunks = codegen.col_chunks(self._reduced(x, env), ncols)
        return chunks, (chunks * ncols if chunks > 1 else 0)

    def _gemm_step(self, k, bufs: dict, env: dict, low):
        """GEMM cell `k` as a step `fn(bufs)` for this binding (its strided batched
        call, the looped batch edges' offsets, the device's caller fixed), or None
        when it has no strided call (`_gemm` multiplies views then)."""
        call, looped, operands, views, size = self._gemm_plan(k, bufs, env, low)
        if call is None:
            return None
        roles = (call.a, call.b, "out")
        names = tuple(operands[r][0] for r in roles)
        offsets = [tuple(sum(i * operands[r][1].get(e, 0) for e, i in zip(looped, point)) for r in roles)
                   for point in np.ndindex(*[size[e] for e in looped])]
        counts = self.gemm_counts
        if self._device.name == "cuda":
            isz = [views[n].itemsize for n in names]   # a complex cell's: the complex element's; GemmEx: 2-byte A, B
            byte_offsets = [tuple(o * i for o, i in zip(offs, isz)) for offs in offsets]
            fn = self._device.blas.caller(call, views[names[2]].dtype)
            if len(byte_offsets) == 1 and byte_offsets[0] == (0, 0, 0):
                def step(bufs: dict) -> None:
                    counts["strided"] += 1
                    fn(bufs[names[0]].data.ptr, bufs[names[1]].data.ptr, bufs[names[2]].data.ptr)
                return step

            def step(bufs: dict) -> None:
                counts["strided"] += 1
                pa, pb, pc = bufs[names[0]].data.ptr, bufs[names[1]].data.ptr, bufs[names[2]].data.ptr
                for oa, ob, oc in byte_offsets:
                    fn(pa + oa, pb + ob, pc + oc)
            return step
        cdt = None if k.cplx is None else (np.complex64 if self.lowered.dtype == "f32" else np.complex128)

        def step(bufs: dict) -> None:
            counts["strided"] += 1
            arrays = [bufs[n] if cdt is None else bufs[n].reshape(-1).view(cdt) for n in names]
            for offs in offsets:
                gemm.run_numpy(call, *arrays, offs)
        return step

    def _launch_all(self, b: "_Binding", bufs: dict, tell=None) -> int:
        """Every step, launched one by one. The error word is read once: after the
        checks (the call stops there if one failed) under cuda-sim, for a call that
        notifies, and where a GEMM writes an argument; else after the call, without
        a wait in between (the kernels after a failed check write nothing)."""
        dev, steps, n = self._device, b.steps, b.checks
        late = False
        if n:
            dev.clear_err(b.err)
            if tell is None and not b.early_read:
                late = True
            else:
                for _, go in steps[:n]:
                    go(bufs)
                rc = dev.read_err(b.err)   # once per call, before anything is written
                if rc:
                    return rc
                steps = steps[n:]
        dev.gemm_stream()
        if tell is None:
            for _, go in steps:
                go(bufs)
            return dev.read_err(b.err) if late else 0
        for index, go in steps:
            tell(index)
            go(bufs)
        tell(len(self.lowered.kernels))
        return 0

    def _run_graph(self, b: "_Binding", bufs: dict, key: tuple) -> int | None:
        """The call as a CUDA graph of every step, the checks included (a failed check
        sets the error word and every later kernel returns at once; the word is read
        once, after the replay). A graph holds the addresses it was captured with, so
        it is kept per binding and per the addresses of the call's arguments and
        outputs, and a replay copies nothing: a loop that passes the same arrays (or
        arrays CuPy's pool hands out again at the same addresses) replays one graph.
        At most `CudaOptions.graphs_kept` per binding; a binding whose addresses keep
        changing (more misses than hits after twice that many captures) stops capturing
        (None: its calls launch each kernel). Capture runs on a stream of its own
        (CUDA cannot capture the legacy default stream); the graph is launched on the
        current stream. A binding whose capture fails (nothing ran) launches each
        kernel from then on; `graph_refusal` says why."""
        if b.misses >= 2 * self.options.cuda.graphs_kept and b.misses > b.hits:
            b.capture = False
            return None
        b.misses += 1
        try:
            entry = self._capture(b, bufs)
        except Exception as e:  # noqa: BLE001 -- the driver's, cuBLAS's or CuPy's refusal: nothing ran
            b.capture = False   # launched kernel by kernel from then on
            self.graph_refusal = f"{type(e).__name__}: {e}"
            return None
        self.graph_counts["captures"] += 1
        b.graphs[key] = entry
        while len(b.graphs) > self.options.cuda.graphs_kept:   # the least recently captured goes
            b.graphs.pop(next(iter(b.graphs)))
        return self._replay(b, entry)

    def _replay(self, b: "_Binding", entry: tuple) -> int:
        """One launch of a captured graph on the current stream; the error word
        cleared before and read after it when the program has checks."""
        dev = self._device
        if b.checks:
            dev.clear_err(b.err)
        entry[0].launch(stream=dev.cp.cuda.get_current_stream())
        self.graph_counts["replays"] += 1
        return dev.read_err(b.err) if b.checks else 0

    def _capture(self, b: "_Binding", bufs: dict) -> tuple:
        """(graph, its capture stream): every step recorded on a capturing stream,
        nothing run yet."""
        cp, dev = self._device.cp, self._device
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            dev.gemm_stream()   # (a cuBLAS handle's stream is not set while capturing)
            stream.begin_capture()
            try:
                for _, go in b.steps:
                    go(bufs)
            finally:
                graph = stream.end_capture()
        return graph, stream

    # ------------------------------------------------------------ the fast path (GPU)

    def plan(self, program, env: dict) -> "_Binding":
        """The fast path's plan for these dims: their binding, with what `run_fast`
        checks each argument against (shape, C-contiguous strides, device type) and
        the outputs' shapes."""
        b = self._binding(env)
        dev = self._device
        if b.ins is None:
            ins = []
            for s in program.inputs:
                stored = self.lowered.buffers[s.name].dtype   # a bf16/f16 argument's 2-byte type (`narrow`)
                dt = dev.np_type(stored) if stored in LOW_FLOATS else np.dtype(NP[s.dtype])
                shape = tuple(size_eval(x, env) for x in s.shape)
                strides = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) * dt.itemsize for i in range(len(shape)))
                scalar = dev.empty((), dt) if not shape and not s.updated and stored not in LOW_FLOATS else None
                ins.append((shape, strides, dt, scalar))
            b.ins = ins
            b.upd = tuple(s.updated for s in program.inputs)
            b.updated = any(b.upd)
            b.in_names = tuple(s.name for s in program.inputs)
            b.scalars = tuple((n, x[3]) for n, x in zip(b.in_names, ins) if x[3] is not None)
            b.outs = [(o.name, tuple(size_eval(x, env) for x in o.shape), program.element_dtype(o))
                      for o in program.outputs]
        return b

    def run_fast(self, vals: list, b: "_Binding", notify=None) -> tuple[int, dict | None]:
        """(rc, the outputs by name): 0 ran; < 0 refused (an argument that is not a
        C-contiguous device array of its shape and type, a host value other than a
        scalar, an updated array sharing memory with another argument; a failed check:
        the checked path runs the call again and explains). Nothing ran when refused."""
        nd, dev = self._device.cp.ndarray, self._device
        ptrs = []
        for (shape, strides, dt, scalar), v in zip(b.ins, vals):
            if isinstance(v, nd):
                if v.shape != shape or v.strides != strides or v.dtype != dt:
                    return -1, None
                ptrs.append(v.data.ptr)
            elif scalar is not None and type(v) is np.ndarray and v.dtype == dt and v.shape == ():
                dev.put(scalar, v)
                ptrs.append(scalar.data.ptr)
            else:
                return -1, None
        if b.updated and ptrs != b.checked_ptrs:
            if self._updates_share(b, vals):
                return -1, None
            b.checked_ptrs = ptrs
        with self._lock:
            kept = self._recycled(b)
            if kept is None:
                outs = {name: dev.empty(shape, dt) for name, shape, dt in b.outs}
                kept = (outs, [o.data.ptr for o in outs.values()])
            key = tuple(ptrs + kept[1])
            entry = b.graphs.get(key) if b.capture else None
            if entry is not None:            # the common case: a replay, nothing else to look at
                b.hits += 1
                rc = self._replay(b, entry)
            else:
                args = dict(zip(b.in_names, vals))
                for name, scalar in b.scalars:
                    if not isinstance(args[name], nd):
                        args[name] = scalar
                rc = self._run_bound(b, args, kept[0], None, key)
            if rc:
                return -1, None
            b.kept.append(kept)
            del b.kept[:-self.options.cuda.outputs_kept]
            return 0, dict(kept[0])   # the caller's dict (the runtime adds the updated arrays to it)

    def _updates_share(self, b: "_Binding", vals: list) -> bool:
        """Whether an updated array's memory overlaps another argument's."""
        nd = self._device.cp.ndarray
        spans = [(v.data.ptr, v.data.ptr + v.nbytes, upd) for upd, v in zip(b.upd, vals) if isinstance(v, nd) and v.nbytes]
        reach, reach_upd = -1, False
        for start, end, upd in sorted(spans):
            if start < reach and (upd or reach_upd):
                return True
            if end > reach:
                reach, reach_upd = end, upd
        return False

    @staticmethod
    def _recycled(b: "_Binding") -> dict | None:
        """An earlier call's outputs that only `b.kept` still refers to (taken out of
        it), or None: the caller dropped them, so the next call writes them again at
        the same addresses (and replays the same graph)."""
        for i, kept in enumerate(b.kept):
            # references: the dict's, the loop variable, getrefcount's argument
            if all(sys.getrefcount(a) == 3 for a in kept[0].values()):
                del b.kept[i]
                return kept
        return None

    def _gemm_plan(self, k, bufs: dict, env: dict, low):
        """(the strided batched call or None, the batch edges looped around it, the
        operands' {view edge: element stride}, the arrays the call reads, the sizes)
        of GEMM cell `k` on these buffers. A complex cell's arrays are its buffers seen
        as flat complex arrays (float pairs along `re.im`, innermost), strides in pairs;
        its conjugations ride on cuBLAS's conjugate transpose, so a conjugated operand
        the call would read untransposed has no call. `low`: the program (or loop's
        step) the cell is in."""
        size = {e: size_eval(low.size(e), env) for e in k.batch + k.m + k.n + k.k}
        cplx = k.cplx is not None
        shaped = bufs
        if cplx:
            cdt = np.complex64 if low.dtype == "f32" else np.complex128
            bufs = {b: shaped[b].reshape(-1).view(cdt) for b in (k.a.buf, k.b.buf, k.out)}

        def strides(buf: str, rename: dict) -> dict:
            arr = shaped[buf]
            order = low.buffers[buf].order or low.buffers[buf].edges
            if cplx:
                assert order[-1] == "re.im", "a complex GEMM cell's buffers hold pairs innermost"
                by_edge = {e: s // (2 * arr.itemsize) for e, s in zip(order[:-1], arr.strides[:-1])}
            else:
                by_edge = {e: s // arr.itemsize for e, s in zip(order, arr.strides)}
            return {v: by_edge[b] for v, b in rename.items() if b in by_edge}

        out_edges = low.buffers[k.out].edges
        out_view = dict(k.out_view().edges) if k.prefix else {e: e for e in out_edges}   # product edge -> buffer edge
        operands = {"a": (k.a.buf, strides(k.a.buf, dict(k.a.edges))), "b": (k.b.buf, strides(k.b.buf, dict(k.b.edges))),
                    "out": (k.out, strides(k.out, out_view))}
        planned = gemm.plan_looped(k, operands, size)
        if planned is not None and cplx:
            call, looped = planned
            conj = {"a": k.cplx[0], "b": k.cplx[1]}
            call = replace(call, conja=conj[call.a], conjb=conj[call.b], alpha=k.alpha)
            planned = None if (call.conja and not call.transa) or (call.conjb and not call.transb) else (call, looped)
        call, looped = planned if planned is not None else (None, ())
        if call is not None and k.acc:   # `out += a @ b`: beta = 1
            call = replace(call, beta=1.0)
        if call is not None and not cplx:   # bf16/f16 operands (`cublas_operands` kept them): a GemmEx call
            types = {r: low.buffers[operands[r][0]].dtype for r in ("a", "b")}
            if types["a"] in LOW_FLOATS:
                call = replace(call, atype=types[call.a], btype=types[call.b])
        return call, looped, operands, bufs, size

    def _gemm(self, k, bufs: dict, env: dict, low) -> None:
        """out[batch, m, n] = a[batch, m, k] @ b[batch, k, n]: one strided batched GEMM
        (`_gemm_plan`, `gemm.plan`: cuBLAS on a GPU, numpy on the same strides under
        cuda-sim) where the layouts allow, else `matmul` on strided views of the
        buffers (an operand without an edge is broadcast along it)."""
        xp = self._device.xp
        strided = xp.lib.stride_tricks.as_strided
        cplx = k.cplx is not None
        call, looped, operands, bufs, size = self._gemm_plan(k, bufs, env, low)
        planned = None if call is None else (call, looped)
        if planned is not None:
            call, looped = planned
            self.gemm_counts["strided"] += 1
            run = gemm.run_numpy if self._device.name == "cuda-sim" else functools.partial(blas.run, self._device.blas)
            roles = (call.a, call.b, "out")
            for point in np.ndindex(*[size[e] for e in looped]):
                offsets = tuple(sum(i * operands[r][1].get(e, 0) for e, i in zip(looped, point)) for r in roles)
                run(call, *(bufs[operands[r][0]] for r in roles), offsets)
            return
        self.gemm_counts["views"] += 1

        def view(buf: str, st: dict, axes: tuple) -> object:
            isz = bufs[buf].itemsize
            return strided(bufs[buf], [size[e] for e in axes], [st[e] * isz if e in st else 0 for e in axes])

        prod = lambda es: int(np.prod([size[e] for e in es], dtype=np.int64))  # noqa: E731
        bsz, msz, nsz, ksz = prod(k.batch), prod(k.m), prod(k.n), prod(k.k)
        a = view(k.a.buf, operands["a"][1], k.batch + k.m + k.k).reshape(bsz, msz, ksz)
        b = view(k.b.buf, operands["b"][1], k.batch + k.k + k.n).reshape(bsz, ksz, nsz)
        c = view(k.out, operands["out"][1], k.batch + k.m + k.n)
        if low.buffers[k.a.buf].dtype in LOW_FLOATS:   # a GemmEx cell's operands: f32 products and sums
            a, b = self._device.widen(a), self._device.widen(b)
        if cplx:
            a, b = (xp.conj(x) if conj else x for x, conj in zip((a, b), k.cplx))
            c[...] = (k.alpha * xp.matmul(a, b)).reshape(c.shape)
            return
        p = xp.matmul(a, b).reshape(c.shape)
        c[...] = c + p if k.acc else p
