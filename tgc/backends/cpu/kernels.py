"""The CPU backend's compiled program: LLVM object code JIT-loaded in this process,
run on the buffers the neutral runtime (`tgc.runtime.program.Program`) has bound
and checked.

`compile_kernels(module, low, options, objs)` generates LLVM IR (`codegen`),
compiles it into object files (from the code cache when it has them: `_machine_code`),
JIT-loads them and hands them the function table (numpy's OpenBLAS, libgomp).
Object files read from the cache are first loaded in a forked child
(`from_cached_object`), as they may be damaged in ways no checksum sees. The code
names the program it was compiled for: its `tgc_fingerprint` is the code cache's key
of the module, options and CPU (`tgc.backends.cache.cache_key`), and code whose
fingerprint is not the program's key is refused before anything in it runs (an
entry that holds another program's code is a miss, and the program is compiled).

`CpuKernels.run` is the checked call: one native `tgc_run(dims, args, outs,
workspace)`. The fast path (~2-4 us of Python instead of ~25): `plan` computes once
per combination of the dim-binding shapes the dims, output shapes, workspace size
and what each argument must be (`_Plan`); then `run_fast` makes one native
`tgc_run_objects` call that checks every argument object itself (ndarray, dtype,
C-contiguous, writable where updated, shape; updated buffers overlapping nothing
else) and reads its data pointer. What it refuses (it then ran nothing) goes
through the runtime's checked path. Large outputs are recycled: when a call's outputs
total at least `options.cpu.recycle_min_bytes`, the plan keeps them (from up to
`recycle_kept` calls), and a later call with the same
shapes writes into them again once nothing else refers to any of them (the caller
dropped that result); fresh memory costs a page fault per 4 KiB on its first write,
which for a 4096 x 1024 softmax was up to half of the call.

Both calls take `notify = (marks, fn)` (`Kernels.run`): the marks go to the code's
`tgc_set_notify` as one byte per kernel, with a ctypes callback that the native
`tgc_run` calls after each marked kernel. ctypes released the GIL for the native
call; the callback takes it again only for fn, on the calling thread, so the rest of
the call runs without it (a data-parallel step reduces its buckets meanwhile).
"""
from __future__ import annotations

import ctypes
import functools
import sys
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np

from tgc.backends.base import Kernels
from tgc.ir.module import Module
from tgc.ir.sizes import size_eval
from tgc.lower.lowered import Lowered
from tgc.options import Options

NP = {"f32": np.float32, "f64": np.float64, "i32": np.int32}
ALIGN = 64                # the workspace's alignment (the runtime's size checks count it per slot)


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
    out_names: tuple            # the outputs' names, in order
    recycle: bool = False       # outputs large enough to keep (`CpuOptions.recycle_min_bytes`)
    kept: list = field(default_factory=list)   # earlier calls' output lists, oldest first




def compile_kernels(module: Module, low: Lowered, options: Options, objs=None) -> "CpuKernels":
    """The kernels of `low`: from `objs` (object files a first-level cache entry
    holds), else from the code cache, else compiled now (and cached)."""
    from tgc.backends import cache
    from tgc.ir.printer import print_module

    key = cache.cache_key(print_module(module), options, cache_parts())
    if objs is not None:
        return from_cached_object(options, low, objs, key)
    objs = cache.lookup(key)
    if objs is not None:
        try:
            return from_cached_object(options, low, objs, key)
        except Exception:  # noqa: BLE001 -- a cached entry that does not load, or is another program's: a miss
            pass
    objs = _machine_code(low, options, key)
    return from_object(options, low, objs, key)


_LOADED: set[bytes] = set()        # digests of object sets this process has loaded safely
_LOADED_LOCK = threading.Lock()


def from_cached_object(options: Options, low: Lowered, objs: tuple[bytes, ...], key: str) -> "CpuKernels":
    """`from_object` for object files read from the cache, which may be damaged in
    ways no checksum sees: they are loaded (and `tgc_init` run) first in a forked child,
    and only if that child survives, here. RuntimeError if it did not, or if their
    fingerprint is not `key`."""
    import hashlib

    digest = hashlib.sha256(b"".join(len(o).to_bytes(8, "little") + o for o in objs)).digest()
    with _LOADED_LOCK:
        known = digest in _LOADED
    if not known:
        from tgc.backends.cpu import blas, llvm_env, parallel

        blas.gemm_addresses(), parallel.gomp_addresses()   # found once, here, not in every child
        if llvm_env.survives_in_child(lambda: from_object(options, low, objs, key)) is False:
            raise RuntimeError("cached object files do not load")
    kernels = from_object(options, low, objs, key)
    with _LOADED_LOCK:
        _LOADED.add(digest)
    return kernels


def from_object(options: Options, low: Lowered, objs: tuple[bytes, ...], key: str) -> "CpuKernels":
    """The kernels from their object files: JIT-loaded, their fingerprint checked to be
    `key` (RuntimeError if not, before any of their code runs), `tgc_init` given the
    function table."""
    from tgc.backends.cpu import blas, fntable, llvm_env, parallel

    jit = llvm_env.jit_objects(objs)
    found = _fingerprint(jit)
    if found != key.encode("ascii"):
        jit.close()
        raise RuntimeError(f"the object files are another program's (fingerprint {found[:16]!r}..., "
                           f"not {key[:16]}...)")
    gemms = blas.gemm_addresses() if options.cpu.blas != "none" else {}   # none: generated loops only
    table = fntable.make_table({**gemms, **parallel.gomp_addresses()})
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(jit.address("tgc_init"))(ctypes.addressof(table))
    if options.cpu.profile:   # the threads' CPU clock (Program.thread_profile)
        ctypes.CFUNCTYPE(None, ctypes.c_void_p)(jit.address(parallel.CLOCK_SETTER))(parallel.clock_address())
    kernels = CpuKernels(low, options, jit)
    kernels.artifacts = tuple(objs)
    return kernels


def _fingerprint(jit) -> bytes:
    """The loaded code's `tgc_fingerprint`, read as data (b"" when it has none)."""
    from tgc.backends.cpu.codegen import FINGERPRINT, FINGERPRINT_BYTES

    addr = jit.engine.get_global_value_address(FINGERPRINT)
    return ctypes.string_at(addr, FINGERPRINT_BYTES) if addr else b""


def _machine_code(low: Lowered, options: Options, key: str) -> tuple[bytes, ...]:
    """The program's object files, compiled now with the fingerprint `key` (the code
    cache's key) and cached under it: generated in as many units as
    `options.cpu.compile_jobs` allows and compiled at once."""
    from tgc.backends.cpu import codegen, llvm_env
    from tgc.backends import cache

    jobs = options.cpu.compile_jobs or llvm_env.usable_cores()
    first, rest = codegen.generate_units_first_last(low, options, objects_entry=True, units=jobs,
                                                     fingerprint=key)
    objs = tuple(llvm_env.emit_objects([first] + rest, max(options.opt_level, 1), jobs=jobs))
    cache.store(key, objs)
    return objs


def cache_parts() -> tuple[str, ...]:
    """The CPU backend's code cache key parts: its name, the host CPU and its features."""
    from tgc.backends.cpu import llvm_env

    cpu, features = llvm_env.host_cpu()
    return ("cpu", cpu, features)


class CpuKernels(Kernels):
    """A JIT-loaded program: `run` (checked), `plan`/`run_fast` (the fast path),
    `profile`, `llvm_ir`. Thread-safe: calls are serialized (one workspace)."""

    backend = "cpu"

    def __init__(self, low: Lowered, options: Options, jit):
        self.lowered, self.options = low, options
        self._jit = jit  # keeps the code alive; freed with the kernels (nothing else holds its addresses)
        weakref.finalize(self, jit.close)
        vp = ctypes.c_void_p
        self._run = ctypes.CFUNCTYPE(ctypes.c_int32, vp, vp, vp, vp)(jit.address("tgc_run"))
        self._ws_bytes = ctypes.CFUNCTYPE(ctypes.c_int64, vp)(jit.address("tgc_workspace_bytes"))
        self._run_objects = None  # tgc_run_objects: checks the arrays and reads their pointers natively
        if _LAYOUT is not None:
            self._run_objects = ctypes.CFUNCTYPE(ctypes.c_int32, vp, ctypes.py_object)(jit.address("tgc_run_objects"))
            self._layout = (ctypes.c_int64 * len(_LAYOUT))(*_LAYOUT)
        self.fast_path = self._run_objects is not None
        try:   # tgc_set_notify (codegen): callbacks after marked kernels, for `notify`
            self._set_notify = ctypes.CFUNCTYPE(None, vp, vp)(jit.address("tgc_set_notify"))
        except KeyError:
            self._set_notify = None
        self.notifies = self._set_notify is not None
        self._lock = threading.Lock()
        self._workspace = np.empty(0, np.uint8)
        self._ws_size = -1                  # usable bytes at _ws_addr
        self._ws_addr = 0
        self._ws_cell = ctypes.c_int64(0)   # the workspace's address, read through by every frame
        self._sym = low.module.symbolic_dims()

    # ------------------------------------------------------------ the checked call

    def run(self, args: dict, outs: dict, env: dict, notify=None) -> int:
        sym = self._sym
        dim_values = (ctypes.c_int64 * max(len(sym), 1))(*[env[d] for d in sym])
        arg_ptrs = (ctypes.c_void_p * max(len(args), 1))(*[a.ctypes.data for a in args.values()])
        out_ptrs = (ctypes.c_void_p * max(len(outs), 1))(*[a.ctypes.data for a in outs.values()])
        with self._lock:
            ws = self._workspace_addr(int(self._ws_bytes(ctypes.addressof(dim_values))))
            call = functools.partial(self._run, ctypes.addressof(dim_values), ctypes.addressof(arg_ptrs),
                                     ctypes.addressof(out_ptrs), ws)
            return call() if notify is None else self._notifying(call, notify, outs)

    def _notifying(self, call, notify, outs: dict) -> int:
        """`call()` (one native run, under the lock) with `tgc_set_notify` set for it:
        `notify = (marks, fn)` has fn(i, outs) called on this thread right after each
        kernel i in `marks`; cleared after. Native code cannot take a Python exception:
        the callback keeps the first one, and it is raised here once the run returns."""
        marks, fn = notify
        n = max(len(self.lowered.kernels), 1)
        table = (ctypes.c_uint8 * n)()
        for i in marks:
            if not 0 <= i < len(self.lowered.kernels):
                raise ValueError(f"notify: kernel {i} does not exist (the program has {len(self.lowered.kernels)})")
            table[i] = 1
        failed: list = []

        def after(i: int) -> None:
            if failed:
                return
            try:
                fn(i, outs)
            except BaseException as e:  # noqa: BLE001 -- raised again below, after the native call
                failed.append(e)
        cb = ctypes.CFUNCTYPE(None, ctypes.c_int32)(after)
        self._set_notify(ctypes.cast(cb, ctypes.c_void_p), ctypes.addressof(table))
        try:
            rc = call()
        finally:
            self._set_notify(None, None)
        if failed:
            raise failed[0]
        return rc

    def _workspace_addr(self, need: int) -> int:
        """The 64-byte aligned address of at least `need` scratch bytes (grown on demand)."""
        if self._workspace.size < need + ALIGN:
            self._workspace = np.empty(need + ALIGN, np.uint8)
            addr = self._workspace.ctypes.data
            self._ws_addr = self._ws_cell.value = addr + (-addr) % ALIGN
            self._ws_size = need
        return self._ws_addr

    # ------------------------------------------------------------ the fast path

    def plan(self, program, env: dict) -> "_Plan":
        """The fast path's plan for these dims (`_Plan`); `program` gives the
        signature (inputs, outputs and their numpy dtypes)."""
        sym = self._sym
        dim_values = (ctypes.c_int64 * max(len(sym), 1))(*[env[d] for d in sym])
        addr = ctypes.addressof(dim_values)
        expect: list[int] = [len(program.inputs)]   # the count first: tgc_run_objects loops over it
        for spec in program.inputs:
            shape = [size_eval(x, env) for x in spec.shape]
            dt = program.element_dtype(spec)   # bf16/f16 arguments: 2-byte arrays (tgc.lower.narrow)
            mask = C_CONTIGUOUS | (WRITEABLE if spec.updated else 0)
            expect += [id(np.ndarray), id(dt), mask, len(shape), int(np.prod(shape, dtype=np.int64)) * dt.itemsize]
            expect += shape
        table = (ctypes.c_int64 * max(len(expect), 1))(*expect)
        frame = (ctypes.c_int64 * 4)(addr, ctypes.addressof(self._ws_cell), ctypes.addressof(self._layout),
                                     ctypes.addressof(table))
        outs = [(tuple(size_eval(x, env) for x in o.shape), program.element_dtype(o)) for o in program.outputs]
        nbytes = sum(int(np.prod(shape, dtype=np.int64)) * dt.itemsize for shape, dt in outs)
        return _Plan(env, dim_values, int(self._ws_bytes(addr)), addr, outs, table, frame, ctypes.addressof(frame),
                     tuple(o.name for o in program.outputs), recycle=nbytes >= self.options.cpu.recycle_min_bytes)

    def run_fast(self, vals: list, plan: "_Plan", notify=None) -> tuple[int, dict | None]:
        """(rc, the outputs by name): rc 0 ran; > 0 a check failed (nothing written);
        < 0 the native checks refused an argument (nothing ran). `notify` as `run`'s."""
        with self._lock:
            outs = self._recycled(plan) if plan.recycle else None
            if outs is None:
                outs = [np.empty(shape, dt) for shape, dt in plan.out_specs]
            if self._ws_size < plan.ws_need:
                self._workspace_addr(plan.ws_need)
            if notify is None:
                rc = self._run_objects(plan.frame_addr, vals + outs)
            else:
                call = functools.partial(self._run_objects, plan.frame_addr, vals + outs)
                rc = self._notifying(call, notify, dict(zip(plan.out_names, outs)))
            # the result refers to the outputs before another call may look for free ones
            result = dict(zip(plan.out_names, outs))
            if plan.recycle and rc == 0:
                plan.kept.append(outs)
                del plan.kept[:-self.options.cpu.recycle_kept]
        return rc, result

    @staticmethod
    def _recycled(plan: "_Plan") -> list | None:
        """An earlier call's outputs that only `plan.kept` still refers to (taken out
        of it), or None. Under the lock: nobody else can reach such an array."""
        for i, outs in enumerate(plan.kept):
            # references: the list `outs`, the loop variable, getrefcount's argument
            if all(sys.getrefcount(a) == 3 for a in outs):
                del plan.kept[i]
                return outs
        return None

    # ------------------------------------------------------------ what a CPU program offers

    def profile(self, reset: bool = False) -> list[tuple[int, int, str]]:
        """(cycles, kernel index, the kernel's first line) per kernel, most cycles
        first: the time-stamp-counter cycles each kernel took over every call so far
        (compiled with `CpuOptions(profile=True)`; `reset` zeroes the counters)."""
        if not self.options.cpu.profile:
            raise ValueError("compile with Options(cpu=CpuOptions(profile=True)) to profile kernels")
        from tgc.backends.cpu.codegen import PROFILE_COLUMNS, step_profile_kernels

        kernels = self.lowered.kernels
        steps = step_profile_kernels(self.lowered)
        addr = ctypes.CFUNCTYPE(ctypes.c_void_p)(self._jit.address("tgc_profile"))()
        counts = (ctypes.c_int64 * (PROFILE_COLUMNS * max(len(kernels) + len(steps), 1))).from_address(addr)
        out = sorted(((counts[i], i, k.text().splitlines()[0]) for i, k in enumerate(kernels)), reverse=True)
        if reset:
            ctypes.memset(addr, 0, ctypes.sizeof(counts))
        return out

    def step_profile(self) -> list[tuple[int, str]]:
        """(cycles, the kernel's first line) per kernel of a loop's step, in the order
        the loops run them (a step's cycles summed over its steps; `profile`'s counters
        of the loops include them)."""
        if not self.options.cpu.profile:
            raise ValueError("compile with Options(cpu=CpuOptions(profile=True)) to profile kernels")
        from tgc.backends.cpu.codegen import step_profile_kernels

        n, steps = len(self.lowered.kernels), step_profile_kernels(self.lowered)
        addr = ctypes.CFUNCTYPE(ctypes.c_void_p)(self._jit.address("tgc_profile"))()
        counts = (ctypes.c_int64 * max(n + len(steps), 1)).from_address(addr)
        return [(counts[n + j], k.text().splitlines()[0]) for j, k in enumerate(steps)]

    def region_calls(self) -> list[int]:
        """Per counter of `profile` (the program's kernels in order, then `step_profile`'s),
        how many of its calls so far ran in a parallel region of their own: a GEMM's
        calls that the contention rule or its thresholds left on one thread are not
        counted (0 for every other kernel; `profile(reset=True)` zeroes these too)."""
        if not self.options.cpu.profile:
            raise ValueError("compile with Options(cpu=CpuOptions(profile=True)) to profile kernels")
        from tgc.backends.cpu.codegen import step_profile_kernels

        n = max(len(self.lowered.kernels) + len(step_profile_kernels(self.lowered)), 1)
        addr = ctypes.CFUNCTYPE(ctypes.c_void_p)(self._jit.address("tgc_profile"))()
        counts = (ctypes.c_int64 * (2 * n)).from_address(addr)
        return [counts[n + j] for j in range(len(self.lowered.kernels) + len(step_profile_kernels(self.lowered)))]

    def thread_profile(self) -> list[tuple[int, int, int, int]]:
        """Per counter of `profile` (the program's kernels in order, then `step_profile`'s),
        what the threads did of it over every call so far, in ns of CPU time (each
        thread's `clock_gettime(CLOCK_THREAD_CPUTIME_ID)`: time slices that other
        processes took are not counted): (thread 0's over the kernel, thread 0's busy
        time, the other threads' busy time summed, thread 0's time in the kernel's
        regions). Thread 0's busy time is its time outside the kernel's regions plus
        that in their bodies; the others' is theirs in the bodies. Thread 0's time in
        its regions less its busy time in them is what starting and ending them cost it
        (spinning while it waits for a worker, too). One thread: the first two are
        equal and the others 0. A loop's counter counts its step kernels' regions as
        theirs (they have their own counters)."""
        if not self.options.cpu.profile:
            raise ValueError("compile with Options(cpu=CpuOptions(profile=True)) to profile kernels")
        from tgc.backends.cpu.codegen import PROFILE_COLUMNS, step_profile_kernels

        n = max(len(self.lowered.kernels) + len(step_profile_kernels(self.lowered)), 1)
        addr = ctypes.CFUNCTYPE(ctypes.c_void_p)(self._jit.address("tgc_profile"))()
        counts = (ctypes.c_int64 * (PROFILE_COLUMNS * n)).from_address(addr)
        out = []
        for i in range(len(self.lowered.kernels) + len(step_profile_kernels(self.lowered))):
            cpu0, own, rest, region = (counts[2 * n + 4 * i + j] for j in range(4))
            out.append((cpu0, cpu0 - region + own, rest, region))
        return out

    @property
    def llvm_ir(self) -> str:
        """The LLVM IR text of this program (generated again on request)."""
        from tgc.backends.cpu import codegen

        return codegen.generate(self.lowered, self.options)
