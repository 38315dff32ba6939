"""A compiled program in this process: lowering, LLVM, JIT, input checks, the call.

`build(module, options)` takes a module after the IR pipeline (no grad/jvp/vjp
left), lowers it (fuse, layout, group, plan), generates LLVM IR (`tgc.backends.cpu`),
JIT-compiles it and hands it the function table (numpy's OpenBLAS, libgomp).

`Program(**arrays)` (or `.run(arrays, dims)`) checks every input before anything
is written, then makes one native call:

- names: exactly the program's arguments;
- dtypes: a float argument takes a float array of either width (the other width
  is cast, a copy) or a Python int/float; an i32 argument takes any integer array
  whose values fit in int32; anything else (bool, complex, objects, floats for ids)
  is refused;
- layout: arrays that are not C-contiguous are copied (results are the same);
- sizes: each axis must have its edge's size; a symbolic dim takes the size of the
  first array that has it, and every other array must agree (or pass `dims=`);
- updates: a param or state with an `update` is written in place; it must be a
  writable numpy array; if it had to be cast or copied, the new values are copied
  back into the caller's array after the call. Another argument sharing memory
  with an update target is copied first, so it is read with its old values;
- gather ids out of range: an EvalError, and no output or update is written.

Returns a dict: each output (a new array, ABI order), then each update target
(the caller's array, now holding the new values). Large outputs are recycled: when
a call's outputs total at least RECYCLE_BYTES, the program keeps them, and a later
call with the same shapes writes into them again once nothing else refers to any of
them (the caller dropped that result); otherwise it allocates new ones. Fresh
memory costs a page fault per 4 KiB on its first write, which for a 4096 x 1024
softmax was up to half of the call.

The call's fast path (~2-4 us of Python instead of ~25): the dims, output shapes,
workspace size and what each argument must be are computed once per combination of
the shapes that bind the symbolic dims (`_Plan`); the native `tgc_run_objects` then
checks every argument object itself (ndarray, dtype, C-contiguous, writable where
updated, shape; updated buffers overlapping nothing else) and reads its data
pointer. Anything it refuses, and every error message, goes through the checked path
above, before anything is written.
"""
from __future__ import annotations

import ctypes
import sys
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np

from tgc.ir.dtypes import LOW_FLOATS, TYPES, is_low_array, round_to
from tgc.ir.complex_io import as_complex, as_pairs, complex_args, complex_results, not_pairs
from tgc.ir.interp import EvalError, check_ids_fit
from tgc.lower.lowered import Lowered
from tgc.ir.module import Module
from tgc.ir.sizes import MAX_SIZE, Size, SizeError, UnboundDim, check_count, size_eval, size_eval_checked, size_str
from tgc.options import Options

NP = {"f32": np.float32, "f64": np.float64, "i32": np.int32}
ALIGN = 64
PLANS = 64          # shape combinations remembered per program (fast path)
RECYCLE_BYTES = 1 << 20   # outputs at least this large (per call) are recycled
RECYCLE_KEPT = 2          # ... from up to this many earlier calls


def _array_layout() -> tuple[int, ...] | None:
    """Byte offsets in numpy's PyArrayObject of ob_type, data, nd, dimensions, descr
    and flags (the C struct numpy has kept since 1.7), then of the item array in a
    list object; checked here against the Python view of a few arrays, views and a
    list; None where any disagrees (then every call takes the checked path)."""
    head = object.__basicsize__              # PyObject_HEAD: ob_refcnt, ob_type
    ptr = ctypes.sizeof(ctypes.c_void_p)
    offsets = (ptr, head, head + ptr, head + 2 * ptr, head + 5 * ptr, head + 6 * ptr, head + ptr)
    read_p, read_i = ctypes.c_void_p.from_address, ctypes.c_int.from_address
    try:
        base = np.arange(64, dtype=np.float64)
        probes = [base, base[3:], base[5:9].reshape(2, 2), base[::2], np.zeros(0, np.float32),
                  np.asarray(1.5, np.float32), np.empty((7, 3), np.int32)]
        for a in probes:
            addr = id(a)
            dims = read_p(addr + offsets[3]).value
            shape = tuple(ctypes.c_int64.from_address(dims + 8 * i).value for i in range(a.ndim)) if a.ndim else ()
            if (read_p(addr + offsets[0]).value != id(type(a)) or (read_p(addr + offsets[1]).value or 0) !=
                    (a.ctypes.data or 0) or read_i(addr + offsets[2]).value != a.ndim or shape != a.shape
                    or read_p(addr + offsets[4]).value != id(a.dtype)
                    or read_i(addr + offsets[5]).value != a.flags.num):
                return None
        items = read_p(id(probes) + offsets[6]).value
        if [read_p(items + ptr * i).value for i in range(len(probes))] != list(map(id, probes)):
            return None
    except Exception:  # noqa: BLE001 -- any surprise: no fast path
        return None
    return offsets


C_CONTIGUOUS, WRITEABLE = 0x1, 0x400     # NPY_ARRAY_* flag bits
_LAYOUT = _array_layout()


@dataclass
class _Plan:
    """What a call with one combination of the dim-binding shapes needs, computed once."""
    env: dict
    dim_values: object          # ctypes int64 array, the symbolic dims
    ws_need: int
    dims_addr: int
    out_specs: list             # (shape, numpy dtype) per output
    expect: object              # ctypes int64 array: what tgc_run_objects checks per argument
    frame: object               # ctypes int64 array: tgc_run_objects' frame
    frame_addr: int
    recycle: bool = False       # outputs large enough to keep (RECYCLE_BYTES)
    kept: list = field(default_factory=list)   # earlier calls' output lists, oldest first


@dataclass(frozen=True)
class TensorSpec:
    """One argument or output of a compiled program, as a caller sees it.

    `kind` is input, param, state or output; `edges` are in ABI order (the order of
    the array's axes); `shape` gives each axis's size: an int, or a size expression
    of the symbolic dims (a dim's name, or `SizeOp`); `dtype` is f32, f64 or i32;
    `updated` marks a param or state that an `update` writes in place."""
    name: str
    kind: str                   # input | param | state | output
    edges: tuple[str, ...]      # ABI order
    shape: tuple[Size, ...]     # an int, or a symbolic size expression per axis
    dtype: str                  # f32 | f64 | i32
    updated: bool = False       # a param/state written by `update`


def _dlpack_view(name: str, value):
    """A CPU array that is not numpy's but speaks DLPack (a torch CPU tensor) as a
    numpy array over the same memory, so that an update writes into it; others as given.
    A torch bfloat16 tensor, which numpy's DLPack import refuses, is viewed as int16
    through DLPack and then as ml_dtypes.bfloat16 (still no copy)."""
    if isinstance(value, np.ndarray) or not hasattr(value, "__dlpack__"):
        return value
    try:
        if str(getattr(value, "dtype", "")) == "torch.bfloat16" and "torch" in sys.modules:
            # numpy's DLPack has no bfloat16: the same memory as int16, viewed as ml_dtypes'
            return np.from_dlpack(value.view(sys.modules["torch"].int16)).view(TYPES["bf16"].numpy)
        return np.from_dlpack(value)
    except (RuntimeError, BufferError, TypeError, ValueError) as e:
        raise EvalError(f"input '{name}': {type(value).__name__} does not give its memory to numpy ({e}); "
                        f"pass a CPU tensor (detached from autograd), or a numpy array") from None


def build(module: Module, options: Options) -> "Program":
    """Lower, generate, JIT-compile and load `module` (after the IR pipeline)."""
    return build_with_object(module, options)[0]


def build_with_object(module: Module, options: Options) -> tuple["Program", tuple[bytes, ...]]:
    """The program and its object files (which `from_object` loads again).

    An f32 program under --fp-strict runs as its f64 emulation (`tgc.ir.emulate`):
    it takes f32 arrays (updates are written back into them) and returns f32 outputs."""
    from tgc.manager import lower_module

    if options.fp_strict and options.dtype == "f32":
        from tgc.ir.emulate import emulate_f32

        program, objs = build_with_object(emulate_f32(module), options.with_(dtype="f64"))
        program.out_dtype = np.dtype(np.float32)
        program._origin = (module, options)
        return program, objs

    low = lower_module(module, options)
    objs = _machine_code(module, low, options, cached=True)
    if objs is not None:
        try:
            return from_cached_object(module, options, low, objs), objs
        except Exception:  # noqa: BLE001 -- a cached entry that does not load is a miss
            pass
    objs = _machine_code(module, low, options, cached=False)
    return from_object(module, options, low, objs), objs


_LOADED: set[bytes] = set()        # digests of object sets this process has loaded safely
_LOADED_LOCK = threading.Lock()


def from_cached_object(module: Module, options: Options, low: Lowered, objs: tuple[bytes, ...]) -> "Program":
    """`from_object` for object files read from the cache, which may be damaged in
    ways no checksum sees: they are loaded (and `tgc_init` run) first in a forked child,
    and only if that child survives, here. RuntimeError if it did not."""
    import hashlib

    digest = hashlib.sha256(b"".join(len(o).to_bytes(8, "little") + o for o in objs)).digest()
    with _LOADED_LOCK:
        known = digest in _LOADED
    if not known:
        from tgc.backends.cpu import blas, llvm_env, parallel

        blas.gemm_addresses(), parallel.gomp_addresses()   # found once, here, not in every child
        if llvm_env.survives_in_child(lambda: from_object(module, options, low, objs)) is False:
            raise RuntimeError("cached object files do not load")
    program = from_object(module, options, low, objs)
    with _LOADED_LOCK:
        _LOADED.add(digest)
    return program


def from_object(module: Module, options: Options, low: Lowered, objs: tuple[bytes, ...]) -> "Program":
    """A program from its parts: the module after the IR pipeline, the lowered program,
    and the object files generated for them (`build_with_object`)."""
    from tgc.backends.cpu import blas, fntable, llvm_env, parallel

    jit = llvm_env.jit_objects(objs)
    gemms = blas.gemm_addresses() if options.blas != "none" else {}   # none: generated loops only
    table = fntable.make_table({**gemms, **parallel.gomp_addresses()})
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(jit.address("tgc_init"))(ctypes.addressof(table))
    return Program(module, options, low, jit)


def _machine_code(module: Module, low: Lowered, options: Options, cached: bool) -> tuple[bytes, ...] | None:
    """The program's object files: `cached`, from the on-disk cache (None on a miss);
    else freshly compiled (then cached), generated in as many units as `compile_jobs`
    allows and compiled at once."""
    from tgc.backends.cpu import codegen, llvm_env
    from tgc.ir.printer import print_module
    from tgc.runtime import cache

    key = cache.cache_key(print_module(module), options, llvm_env.host_cpu())
    if cached:
        return cache.lookup(key)
    jobs = options.compile_jobs or llvm_env.usable_cores()
    first, rest = codegen.generate_units_first_last(low, options, objects_entry=True, units=jobs)
    objs = tuple(llvm_env.emit_objects([first] + rest, max(options.opt_level, 1), jobs=jobs))
    cache.store(key, objs)
    return objs


class Program:
    """A compiled program, callable from Python. Thread-safe; calls are serialized.

    Made by `tgc.compile`. Call it with one array per argument, by name:

        result = program(x=x, W=W, lr=0.1)           # or program.run({...})
        result["loss"]                               # outputs by name

    `inputs` and `outputs` describe the arguments and results (`TensorSpec`: edges in
    ABI order, shape, dtype); `print(program)` lists them, with the dims; `ir()` and
    `plan()` give the optimized IR and the lowered plan as text. A call with
    `updates=False` skips the program's `update`s and whatever only they need.
    `tgc.save_params` and `tgc.load_params` write and read its params and states.
    Built with `Options(memory_budget=BYTES)`, `memory_plan` says what the backward pass
    recomputes to fit (`memory_plan.summary()`).
    """

    # bf16/f16 arguments and outputs by name (set per program in __init__; a backend's
    # program that shares this call path without them has none)
    low_types: dict[str, str] = {}
    _low_outs: dict[str, str] = {}
    _out_dtype: np.dtype | None = None
    _plain = False   # a call goes straight to `_call` (see `out_dtype`)
    _memory_plan = None   # set by tgc.compile with Options(memory_budget=...)

    @property
    def memory_plan(self):
        """With `Options(memory_budget=...)`: what the planner chose, a
        `tgc.budget.MemoryPlan` (`summary()`, `lines()`, `as_dict()`: the workspace
        before and after, the values recomputed, whether the budget is met); else None."""
        return self._memory_plan

    def __init__(self, module: Module, options: Options, low: Lowered, jit):
        self.module, self.options, self.lowered = module, options, low
        self._origin = (module, options)    # what `without_updates` prunes and builds again
        self._forward: Program | None = None
        self._forward_lock = threading.Lock()
        self._jit = jit  # keeps the code alive; freed with the program (nothing else holds its addresses)
        weakref.finalize(self, jit.close)
        vp, i64p = ctypes.c_void_p, ctypes.c_void_p
        self._run = ctypes.CFUNCTYPE(ctypes.c_int32, i64p, vp, vp, vp)(jit.address("tgc_run"))
        self._ws_bytes = ctypes.CFUNCTYPE(ctypes.c_int64, i64p)(jit.address("tgc_workspace_bytes"))
        self._run_objects = None  # tgc_run_objects: checks the arrays and reads their pointers natively
        if _LAYOUT is not None:
            self._run_objects = ctypes.CFUNCTYPE(ctypes.c_int32, vp, ctypes.py_object)(jit.address("tgc_run_objects"))
            self._layout = (ctypes.c_int64 * len(_LAYOUT))(*_LAYOUT)
        self._lock = threading.Lock()
        self._workspace = np.empty(0, np.uint8)
        self._ws_size = -1                  # usable bytes at _ws_addr
        self._ws_cell = ctypes.c_int64(0)   # the workspace's address, read through by every frame
        self.dtype = options.dtype
        self._signature(module)
        # fast path (see run): the inputs that bind the symbolic dims key the plans
        self._upd_idx = tuple(i for i, s in enumerate(self.inputs) if s.updated)
        self._upd_results = tuple((self._update_keys[self._names[i]], i) for i in self._upd_idx)   # (result key, argument)
        self._out_names = tuple(s.name for s in self.outputs)
        self._out_dtypes = tuple(np.dtype(NP[s.dtype]) for s in self.outputs)
        self._key_idx = self._binding_inputs()
        # float scalars a caller may pass as Python numbers (a learning rate): made 0-d
        # arrays for the fast path, as `_convert` does for the checked one
        self._scalar_idx = tuple((i, np.dtype(NP[s.dtype])) for i, s in enumerate(self.inputs)
                                 if not s.shape and not s.updated and s.dtype != "i32")
        # bf16/f16 arguments and outputs (tgc.ir.lowp): the compiled code holds them
        # in the program's float type; calls convert them on the way in and out
        self.low_types: dict[str, str] = {a.name: a.dtype for a in module.args.values() if a.dtype in LOW_FLOATS}
        self._low_outs = {o.name: o.value.dtype for o in module.outputs if o.value.dtype in LOW_FLOATS}
        self.low_types.update(self._low_outs)
        self._fast = self._run_objects is not None and self._key_idx is not None and not self.low_types
        self._plans: dict = {}
        self._ws_addr = 0
        self.out_dtype = None   # --fp-strict f32: the f64 emulation's outputs as f32

    @property
    def out_dtype(self) -> np.dtype | None:
        """The dtype a call's outputs are converted to (f32 for the f64 emulation of an
        f32 program under --fp-strict), or None: as computed."""
        return self._out_dtype

    @out_dtype.setter
    def out_dtype(self, value: np.dtype | None) -> None:
        # Setting it (in __init__, or after, by the --fp-strict build) also decides once
        # whether a call may skip `run`'s per-call dispatch: no complex argument or
        # result, no facts to check, no bf16/f16 or f32 conversion of the outputs. Then
        # `_run_real` would only call `_call`. The wine MLP's step (benchmarks/run.py)
        # ran 402 Python bytecodes per call through the dispatch, 324 without it.
        self._out_dtype = value
        self._plain = (value is None and not self._low_outs and not self._complex_args
                       and not self._complex_results and not (self.options.check_assumptions and self.module.facts))

    def _signature(self, module: Module) -> None:
        """What every backend's program takes and gives, from the module: the input
        and output specs in ABI order, the update targets and their result keys."""
        targets = {u.target for u in module.updates}
        self._inputs = [TensorSpec(a.name, a.kind, a.order, tuple(module.size(e) for e in a.order),
                                   "i32" if a.dtype == "i32" else self.dtype, a.name in targets)
                        for a in module.args.values()]
        self._outputs = [TensorSpec(o.name, "output", o.order, tuple(module.size(e) for e in o.order), self.dtype)
                         for o in module.outputs]
        self._updates = [u.target for u in module.updates]
        self._update_keys = {u.target: module.update_key(u.target) for u in module.updates}
        self._names = tuple(s.name for s in self._inputs)
        # complex arguments and results: passed as float pairs (tgc/ir/complex_io.py)
        self._complex_args, self._complex_results = complex_args(module), complex_results(module)

    @property
    def inputs(self) -> list[TensorSpec]:
        """The arguments a call takes, in ABI order (the program's declaration order):
        every input, param and state, each a `TensorSpec` (name, kind, edges, shape,
        dtype, and whether an `update` writes it in place)."""
        return self._inputs

    @property
    def outputs(self) -> list[TensorSpec]:
        """The program's outputs (`out` statements), in order, each a `TensorSpec`.
        A call's result holds them, then the new value of each update target."""
        return self._outputs

    @property
    def updates(self) -> list[str]:
        """The params and states that a call updates in place, in `update` order."""
        return self._updates

    @property
    def float_dtype(self) -> str:
        """The float type callers pass and get (f32 or f64). An f32 program built with
        `fp_strict` runs as its f64 emulation, but takes and returns f32 arrays."""
        return "f32" if self.out_dtype == np.dtype(np.float32) else self.dtype

    def update_key(self, target: str) -> str:
        """The name under which a call's result holds the new value of `target`: the
        target's own, or `target'` when an output also has that name."""
        return self._update_keys[target]

    def ir(self) -> str:
        """The program's IR after the optimization pipeline, as text (the format
        `tgc dump-ir` prints and `tgc opt` reads)."""
        from tgc.ir.printer import print_module

        return print_module(self._origin[0])

    def plan(self) -> str:
        """The lowered program as text: buffers, workspace slots and kernels (what
        `tgc dump-ir --after plan` prints)."""
        from tgc.lower.lowered import print_lowered

        return print_lowered(self.lowered)

    def info(self) -> dict:
        """The program's interface as data (what `tgc info --format json` prints): its
        dims, arguments, outputs and updates, with edges, sizes and dtypes."""
        from tgc.info import describe

        return describe(self._origin[0], self.float_dtype)

    def _rebuild(self, module: Module, options: Options) -> "Program":
        """A program of this backend for another module (the forward-only one)."""
        return build(module, options)

    def without_updates(self) -> "Program":
        """The forward-only program: this one without its `update`s, without what only
        they computed, and without the arguments only they read (a learning rate,
        say). Compiled on first use (through the same pipeline), then kept; the
        program itself when it has no updates. `run(..., updates=False)` calls it."""
        if not self._updates:
            return self
        with self._forward_lock:
            if self._forward is None:
                from tgc import pipeline

                module, options = self._origin
                pruned = pipeline.lower(pipeline.forward_only(module), options).module
                self._forward = self._rebuild(pruned, options)
            return self._forward

    def _binding_inputs(self) -> tuple[int, ...] | None:
        """Indices of the inputs whose shapes fix every symbolic dim (the first to
        carry each), or None when some dim is carried by none (passed as dims=)."""
        m, found = self.module, []
        for d in m.symbolic_dims():
            i = next((i for i, s in enumerate(self.inputs) if any(m.edges[e] == d for e in s.edges)), None)
            if i is None:
                return None
            found.append(i)
        return tuple(sorted(set(found)))

    def profile(self, reset: bool = False) -> list[tuple[int, int, str]]:
        """(cycles, kernel index, the kernel's first line) per kernel, most cycles
        first: the time-stamp-counter cycles each kernel took over every call so far
        (compiled with `Options(profile=True)`; `reset` zeroes the counters)."""
        if not self.options.profile:
            raise ValueError("compile with Options(profile=True) to profile kernels")
        kernels = self.lowered.kernels
        addr = ctypes.CFUNCTYPE(ctypes.c_void_p)(self._jit.address("tgc_profile"))()
        counts = (ctypes.c_int64 * max(len(kernels), 1)).from_address(addr)
        out = sorted(((counts[i], i, k.text().splitlines()[0]) for i, k in enumerate(kernels)), reverse=True)
        if reset:
            ctypes.memset(addr, 0, ctypes.sizeof(counts))
        return out

    @property
    def llvm_ir(self) -> str:
        """The LLVM IR text of this program (generated again on request)."""
        from tgc.backends.cpu import codegen

        return codegen.generate(self.lowered, self.options)

    def __call__(self, /, **arrays) -> dict[str, np.ndarray]:
        """Run the program once on `arrays` (one keyword per argument, by name):
        `program(x=x, W=W, lr=0.1)` is `program.run({"x": x, "W": W, "lr": 0.1})`.

        `updates=False` makes the forward-only call (see `run`), unless the program
        has an argument named `updates` (use `run` then)."""
        if self._plain and "updates" not in arrays:
            return self._call(arrays, None)
        updates = True
        if "updates" in arrays and "updates" not in self._names:
            updates = arrays.pop("updates")
        return self.run(arrays, updates=updates)

    def __repr__(self) -> str:
        ins = ", ".join(f"{s.name}[{', '.join(s.edges)}]" for s in self.inputs)
        outs = ", ".join(f"{s.name}[{', '.join(s.edges)}]" for s in self.outputs)
        return f"<tgc.Program ({ins}) -> ({outs}) {self.dtype}>"

    def __str__(self) -> str:
        """The program's interface, as `tgc info` prints it."""
        from tgc.info import format_info

        return format_info(self.info())

    # ------------------------------------------------------------ validation

    def _convert(self, spec: TensorSpec, value) -> np.ndarray:
        if spec.updated and not isinstance(value, np.ndarray):
            raise EvalError(f"'{spec.name}' is updated in place: pass a numpy array (or a CPU tensor with "
                            f"__dlpack__, such as torch's), not {type(value).__name__}")
        try:
            if isinstance(value, (int, float)) and not isinstance(value, bool) and spec.dtype != "i32":
                if spec.name in self.low_types:   # a Python number for a bf16/f16 scalar: rounded to it
                    return np.asarray(round_to(float(value), self.low_types[spec.name]), NP[spec.dtype])
                return np.asarray(value, NP[spec.dtype])
            a = np.asarray(value)
        except (ValueError, OverflowError, TypeError) as e:   # a ragged list, a huge Python int
            raise EvalError(f"input '{spec.name}' is not an array of numbers: {e}") from None
        if spec.dtype == "i32":
            if a.dtype.kind not in "iu":
                raise EvalError(f"input '{spec.name}' holds ids (i32): pass integers, not {a.dtype}")
            check_ids_fit(spec.name, a)
        elif spec.name in self.low_types:   # bf16/f16: rounded to it, then held in the program's type
            if a.dtype.kind != "f" and not is_low_array(a):
                raise EvalError(f"input '{spec.name}' must be a float array ({self.low_types[spec.name]}), "
                                f"not {a.dtype}")
            if spec.updated and not a.flags.writeable:
                raise EvalError(f"'{spec.name}' is updated in place but the array is read-only")
            return np.require(round_to(a, self.low_types[spec.name]), NP[spec.dtype], "C")
        elif a.dtype.kind != "f":
            raise EvalError(f"input '{spec.name}' must be a float array ({spec.dtype}), not {a.dtype}")
        if spec.updated and not a.flags.writeable:
            raise EvalError(f"'{spec.name}' is updated in place but the array is read-only")
        return np.require(a, NP[spec.dtype], "C")

    def _bind(self, arrays: dict, dims: dict | None) -> dict[str, int]:
        m = self.module
        env: dict[str, int] = dict(dims or {})
        for d, n in env.items():
            if d not in m.dims:
                raise EvalError(f"dims=: the program has no dim '{d}'")
            if m.dims[d] is not None and m.dims[d] != n:   # fixed, or derived from other dims
                raise EvalError(f"dims=: dim '{d}' is {size_str(m.dims[d])}, not a symbolic dim to bind to {n}")
        src = {d: "dims=" for d in env}
        for spec in self.inputs:
            shape = arrays[spec.name].shape
            if len(shape) != len(spec.edges):
                raise EvalError(f"input '{spec.name}' has {len(shape)} axes, expected {len(spec.edges)} "
                                f"([{', '.join(spec.edges)}])")
            for e, n in zip(spec.edges, shape):
                d = m.edges[e]
                if m.dims[d] is None:
                    if env.setdefault(d, int(n)) != n:
                        raise EvalError(f"input '{spec.name}': edge '{e}' has size {n}, but dim '{d}' is "
                                        f"{env[d]} (from {src[d]})")
                    src.setdefault(d, f"input '{spec.name}'")
        try:
            env = m.bind_dims(env)
        except UnboundDim as e:
            raise EvalError(f"{e}: no input has it; pass its size with dims=") from None
        except SizeError as e:
            raise EvalError(str(e)) from None
        try:
            self._check_sizes(env)
        except SizeError as e:
            raise EvalError(str(e)) from None
        for spec in self.inputs:
            want = tuple(size_eval(s, env) for s in spec.shape)
            if arrays[spec.name].shape != want:
                edges = ", ".join(f"{e}={n}" for e, n in zip(spec.edges, want))
                raise EvalError(f"input '{spec.name}' has shape {arrays[spec.name].shape}, expected {want} ([{edges}])")
        return env

    def _check_sizes(self, env: dict) -> None:
        """SizeError unless every buffer's elements and bytes, every index size, and
        the workspace stay within MAX_SIZE (the native code's int64 arithmetic)."""
        low = self.lowered
        for e in low.edges:
            size_eval_checked(low.size(e), env, f"edge '{e}'")
        for b in low.buffers.values():
            check_count(f"buffer '{b.name}'", low.sizes(b.edges), env, 8 if b.dtype == "f64" else 4)
        total = 0
        for sizes in low.slots:
            total += max(size_eval_checked(s, env, "the workspace") for s in sizes) + ALIGN
            if total > MAX_SIZE:
                raise SizeError("the workspace would take more than 2^62 bytes (the size limit)")

    def _prepare(self, given: dict) -> tuple[dict, dict]:
        names = [s.name for s in self.inputs]
        missing = [n for n in names if n not in given]
        if missing:
            raise EvalError(f"missing input '{missing[0]}' (the program takes: {', '.join(names)})")
        extra = [n for n in given if n not in names]
        if extra:
            raise EvalError(f"unexpected input '{extra[0]}' (the program takes: {', '.join(names)})")
        given = {k: _dlpack_view(k, v) for k, v in given.items()}
        arrays = {s.name: self._convert(s, given[s.name]) for s in self.inputs}
        targets = [s.name for s in self.inputs if s.updated]
        for i, a in enumerate(targets):
            for b in targets[i + 1:]:
                if np.may_share_memory(given[a], given[b]) or np.may_share_memory(arrays[a], arrays[b]):
                    raise EvalError(f"update targets '{a}' and '{b}' share memory: pass separate arrays "
                                    f"(each is written in place)")
        write_back = {s.name: given[s.name] for s in self.inputs
                      if s.updated and arrays[s.name] is not given[s.name]}
        for s in self.inputs:
            if s.updated:
                continue
            for t in self.inputs:
                if t.updated and np.may_share_memory(arrays[s.name], arrays[t.name]):
                    arrays[s.name] = arrays[s.name].copy()
        return arrays, write_back

    # ------------------------------------------------------------ the call

    def run(self, arrays: dict, dims: dict | None = None, updates: bool = True) -> dict[str, np.ndarray]:
        """Run the program once; returns {name: array}.

        `arrays` maps every argument's name (see `inputs`) to an array whose axes are
        its edges in ABI order (a Python number for a scalar). Float arguments take
        float arrays of either width; i32 arguments take integers. `dims` binds
        symbolic dims that no argument's shape gives. Everything is checked before
        anything runs (an `EvalError` says what is wrong).

        The result holds each output (a new array), then, for each `update`, the new
        value of its target under the target's name (`W'` when an output is also
        named `W`): the very array the caller passed, written in place. A CPU tensor
        that speaks DLPack (torch's, detached from autograd) is taken without a copy,
        and an updated one is written in place too (see also `tgc.torch.function`).

        With `updates=False`, the call applies no update and computes nothing that only
        the updates need: it runs `without_updates()` (compiled on first use). Its
        result holds the outputs only, equal to a full call's; arguments only the
        updates read may be left out, and no argument is written.
        """
        if updates is True and self._plain:
            return self._call(arrays, dims)
        if not isinstance(updates, bool):
            raise TypeError(f"updates= takes True or False, not {type(updates).__name__}")
        if self._complex_args or self._complex_results:
            return self._run_complex(arrays, dims, updates)
        return self._run_real(arrays, dims, updates)

    def _run_complex(self, arrays: dict, dims: dict | None, updates: bool) -> dict[str, np.ndarray]:
        """A call with complex arguments or results (tgc/ir/complex_io.py): each complex
        array goes in as float pairs, a view of the caller's (a copy only when its width
        or layout differs, written back if it is updated), and complex results come
        back as complex views of the float pairs."""
        if not isinstance(arrays, dict):
            arrays = dict(arrays)
        for k in self._complex_args & arrays.keys():
            why = not_pairs(k, arrays[k], self.module.args[k].order)
            if why:
                raise EvalError(why)
        pairs = {k: as_pairs(_dlpack_view(k, v), self.float_dtype) if k in self._complex_args else v
                 for k, v in arrays.items()}
        result = self._run_real(pairs, dims, updates)
        for k in self._complex_results & result.keys():
            result[k] = as_complex(result[k])
        for target in (self._updates if updates else ()):
            given, key = arrays.get(target), self._update_keys[target]
            if target in self._complex_args and isinstance(given, np.ndarray) and given.dtype.kind == "c":
                if not np.shares_memory(given, result[key]):
                    given[...] = result[key]
                result[key] = given
        return result

    def _run_real(self, arrays: dict, dims: dict | None, updates: bool) -> dict[str, np.ndarray]:
        if self.options.check_assumptions and self.module.facts:
            self._check_facts(arrays, dims)
        if not updates and self._updates:
            return self._run_forward(arrays, dims)
        result = self._call(arrays, dims)
        if self.out_dtype is None and not self._low_outs:
            return result
        updated = set(self._update_keys.values())
        low = self._low_outs   # bf16/f16 outputs: rounded already, so exact in their type
        return {k: v if k in updated else v.astype(TYPES[low[k]].numpy) if k in low
                else v.astype(self.out_dtype) if self.out_dtype is not None else v for k, v in result.items()}

    def _check_facts(self, arrays: dict, dims: dict | None) -> None:
        """With `Options.check_assumptions`: every declared fact on these inputs, before
        anything runs (an EvalError names the first that fails; tgc.ir.assume)."""
        from tgc.ir.assume import check_facts

        given = {n: np.asarray(a) for n, a in arrays.items()}
        check_facts(self.module, given, dims, self.dtype)

    def _run_forward(self, arrays: dict, dims: dict | None) -> dict[str, np.ndarray]:
        extra = [n for n in arrays if n not in self._names]
        if extra:
            raise EvalError(f"unexpected input '{extra[0]}' (the program takes: {', '.join(self._names)})")
        forward = self.without_updates()
        return forward.run({n: arrays[n] for n in forward._names if n in arrays}, dims)

    def _call(self, arrays: dict, dims: dict | None) -> dict[str, np.ndarray]:
        # The fast path: the plan for the shapes that bind the dims, then one native
        # call that checks every argument itself; what it refuses (it then ran
        # nothing), and every error message, goes through the checked path.
        if dims is None and self._fast and len(arrays) == len(self._names):
            try:
                vals = [arrays[n] for n in self._names]
                for i, dt in self._scalar_idx:
                    if type(vals[i]) is not np.ndarray and (type(vals[i]) in (float, int)
                                                           or isinstance(vals[i], (np.floating, np.integer))):
                        vals[i] = np.array(vals[i], dt)
                key = tuple([vals[i].shape for i in self._key_idx])
            except (KeyError, AttributeError, OverflowError):   # a huge int: the checked path explains
                return self._run_checked(arrays, dims)
            plan = self._plans.get(key)
            if plan is not None:
                result = self._run_fast(vals, plan)
                if result is not None:
                    return result
        return self._run_checked(arrays, dims)

    def _remember(self, env: dict) -> None:
        """The fast path's plan for these dims (`_Plan`), keyed by the binding shapes."""
        sym = self.module.symbolic_dims()
        dim_values = (ctypes.c_int64 * max(len(sym), 1))(*[env[d] for d in sym])
        addr = ctypes.addressof(dim_values)
        expect: list[int] = [len(self.inputs)]   # the count first: tgc_run_objects loops over it
        shapes = []
        for spec in self.inputs:
            shape = [size_eval(x, env) for x in spec.shape]
            dt = np.dtype(NP[spec.dtype])
            mask = C_CONTIGUOUS | (WRITEABLE if spec.updated else 0)
            expect += [id(np.ndarray), id(dt), mask, len(shape), int(np.prod(shape, dtype=np.int64)) * dt.itemsize]
            expect += shape
            shapes.append(tuple(shape))
        table = (ctypes.c_int64 * max(len(expect), 1))(*expect)
        frame = (ctypes.c_int64 * 4)(addr, ctypes.addressof(self._ws_cell), ctypes.addressof(self._layout),
                                     ctypes.addressof(table))
        outs = [(tuple(size_eval(x, env) for x in o.shape), dt) for o, dt in zip(self.outputs, self._out_dtypes)]
        nbytes = sum(int(np.prod(shape, dtype=np.int64)) * dt.itemsize for shape, dt in outs)
        plan = _Plan(env, dim_values, int(self._ws_bytes(addr)), addr, outs, table, frame, ctypes.addressof(frame),
                     recycle=nbytes >= RECYCLE_BYTES)
        if len(self._plans) >= PLANS:
            self._plans.clear()
        self._plans[tuple(shapes[i] for i in self._key_idx)] = plan

    def _run_fast(self, vals: list, plan: _Plan) -> dict[str, np.ndarray] | None:
        with self._lock:
            outs = self._recycled(plan) if plan.recycle else None
            if outs is None:
                outs = [np.empty(shape, dt) for shape, dt in plan.out_specs]
            if self._ws_size < plan.ws_need:
                self._workspace_addr(plan.ws_need)
            rc = self._run_objects(plan.frame_addr, vals + outs)
            # the result refers to the outputs before another call may look for free ones
            result = dict(zip(self._out_names, outs))
            if plan.recycle and rc == 0:
                plan.kept.append(outs)
                del plan.kept[:-RECYCLE_KEPT]
        if rc < 0:
            return None
        if rc > 0:
            raise self._check_error(rc, dict(zip(self._names, vals)), plan.env)
        for key, i in self._upd_results:
            result[key] = vals[i]
        return result

    @staticmethod
    def _recycled(plan: _Plan) -> list | None:
        """An earlier call's outputs that only `plan.kept` still refers to (taken out
        of it), or None. Under the lock: nobody else can reach such an array."""
        for i, outs in enumerate(plan.kept):
            # references: the list `outs`, the loop variable, getrefcount's argument
            if all(sys.getrefcount(a) == 3 for a in outs):
                del plan.kept[i]
                return outs
        return None

    def _run_checked(self, arrays: dict, dims: dict | None = None) -> dict[str, np.ndarray]:
        args, write_back = self._prepare(arrays)
        env = self._bind(args, dims)
        if dims is None and self._fast:
            self._remember(env)  # the next call with these shapes takes the fast path
        sym = self.module.symbolic_dims()
        dim_values = (ctypes.c_int64 * max(len(sym), 1))(*[env[d] for d in sym])
        outs = {s.name: np.empty(tuple(size_eval(x, env) for x in s.shape), NP[s.dtype]) for s in self.outputs}
        arg_ptrs = (ctypes.c_void_p * max(len(args), 1))(*[a.ctypes.data for a in args.values()])
        out_ptrs = (ctypes.c_void_p * max(len(outs), 1))(*[a.ctypes.data for a in outs.values()])
        with self._lock:
            ws = self._workspace_addr(int(self._ws_bytes(ctypes.addressof(dim_values))))
            rc = self._run(ctypes.addressof(dim_values), ctypes.addressof(arg_ptrs),
                           ctypes.addressof(out_ptrs), ws)
        if rc != 0:
            raise self._check_error(rc, args, env)
        for name, original in write_back.items():
            np.copyto(original, args[name], casting="unsafe")
        result = dict(outs)
        for target in self.updates:
            result[self._update_keys[target]] = write_back.get(target, args[target])
        return result

    def _workspace_addr(self, need: int) -> int:
        """The 64-byte aligned address of at least `need` scratch bytes (grown on demand)."""
        if self._workspace.size < need + ALIGN:
            self._workspace = np.empty(need + ALIGN, np.uint8)
            addr = self._workspace.ctypes.data
            self._ws_addr = self._ws_cell.value = addr + (-addr) % ALIGN
            self._ws_size = need
        return self._ws_addr

    def _check_error(self, rc: int, args: dict, env: dict) -> EvalError:
        check = self.lowered.checks[rc - 1]
        ids = args[check.buf]
        n = size_eval(check.size, env)
        bad = np.argwhere((ids < 0) | (ids >= n))
        pos = tuple(int(i) for i in bad[0]) if len(bad) else ()
        edges = self.module.args[check.buf].order
        where = ", ".join(f"{e}={i}" for e, i in zip(edges, pos))
        value = int(ids[pos]) if len(bad) else "?"
        kind = "scatter" if check.note.startswith("scatter") else "gather"   # what reads the ids
        return EvalError(f"{kind} index out of range: '{check.buf}'[{where}] = {value}, "
                         f"but the {check.note} has size {n}; nothing was written")
