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
(the caller's array, now holding the new values).

The call's fast path (small programs: ~2-5 us of Python instead of ~25): inputs that
are already exact-dtype, C-contiguous ndarrays (writable where updated) skip
conversion; the shape checks and the dims, output shapes and workspace size are
computed once per combination of input shapes (`_Plan`); the aliasing test is
skipped while the buffers are those of a call that passed it; and the native
`tgc_run_objects` reads the arrays' data pointers itself. Anything else, and every
error message, goes through the checked path above, before anything is written.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import numpy as np

from tgc.ir.interp import EvalError
from tgc.ir.lowered import Lowered
from tgc.ir.module import Module
from tgc.ir.sizes import Size, SizeError, UnboundDim, size_eval
from tgc.options import Options

NP = {"f32": np.float32, "f64": np.float64, "i32": np.int32}
ALIGN = 64
PLANS = 64          # shape combinations remembered per program (fast path)


def _data_pointer_reader():
    """A fast `a -> address of a's data` (`a.ctypes.data` costs ~1.2 us a call).

    numpy's PyArrayObject starts with PyObject_HEAD, then `char *data`; reading that
    field directly costs ~0.2 us. Checked here on a few arrays and views; where it
    disagrees with `a.ctypes.data` (another numpy or interpreter layout), the slow
    reader is used. Returns (reader, the field's offset or None)."""
    slow = lambda a: a.ctypes.data  # noqa: E731
    try:
        offset = object.__basicsize__  # PyObject_HEAD
        from_address = ctypes.c_void_p.from_address

        def fast(a):
            return from_address(id(a) + offset).value or 0

        base = np.arange(64, dtype=np.float64)
        probes = [base, base[3:], base[5:9].reshape(2, 2), np.zeros(0, np.float32), np.asarray(1.5, np.float32),
                  np.empty((7, 3), np.int32)]
        if all(fast(a) == (a.ctypes.data or 0) for a in probes):
            return fast, offset
    except Exception:  # noqa: BLE001 -- any surprise: the documented reader
        pass
    return slow, None


_data_ptr, _DATA_OFFSET = _data_pointer_reader()


@dataclass
class _Plan:
    """What a call with one combination of input shapes needs, computed once."""
    env: dict
    dim_values: object          # ctypes int64 array, the symbolic dims
    out_shapes: list
    ws_need: int
    dims_addr: int
    out_specs: list             # (shape, numpy dtype) per output
    clean: list | None = None   # the data pointers of the last call found free of aliasing


@dataclass(frozen=True)
class TensorSpec:
    name: str
    kind: str                   # input | param | state | output
    edges: tuple[str, ...]      # ABI order
    shape: tuple[Size, ...]     # an int, or a symbolic size expression per axis
    dtype: str                  # f32 | f64 | i32
    updated: bool = False       # a param/state written by `update`


def build(module: Module, options: Options) -> "Program":
    return build_with_object(module, options)[0]


def build_with_object(module: Module, options: Options) -> tuple["Program", bytes]:
    """The program and its object code (which `from_object` loads again)."""
    from tgc.passes.plan import lower_module

    low = lower_module(module, options)
    obj = _machine_code(module, low, options)
    return from_object(module, options, low, obj), obj


def from_object(module: Module, options: Options, low: Lowered, obj: bytes) -> "Program":
    """A program from its parts: the module after the IR pipeline, the lowered program,
    and the object code generated for them (`build_with_object`)."""
    from tgc.backends.cpu import blas, fntable, llvm_env, parallel

    jit = llvm_env.jit_object(obj)
    table = fntable.make_table({**blas.gemm_addresses(), **parallel.gomp_addresses()})
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(jit.address("tgc_init"))(ctypes.addressof(table))
    return Program(module, options, low, jit)


def _machine_code(module: Module, low: Lowered, options: Options) -> bytes:
    """The program's object code, from the on-disk cache or freshly compiled (then cached)."""
    from tgc.backends.cpu import codegen, llvm_env
    from tgc.ir.printer import print_module
    from tgc.runtime import cache

    key = cache.cache_key(print_module(module), options, llvm_env.host_cpu())
    obj = cache.lookup(key)
    if obj is not None:
        return obj
    obj = llvm_env.emit_object(codegen.generate(low, options, objects_entry=True), max(options.opt_level, 1))
    cache.store(key, obj)
    return obj


class Program:
    """A callable compiled program. Thread-safe; calls are serialized."""

    def __init__(self, module: Module, options: Options, low: Lowered, jit):
        self.module, self.options, self.lowered = module, options, low
        self._jit = jit  # keeps the code alive
        vp, i64p = ctypes.c_void_p, ctypes.c_void_p
        self._run = ctypes.CFUNCTYPE(ctypes.c_int32, i64p, vp, vp, vp)(jit.address("tgc_run"))
        self._ws_bytes = ctypes.CFUNCTYPE(ctypes.c_int64, i64p)(jit.address("tgc_workspace_bytes"))
        self._run_objects = None  # tgc_run_objects: reads the arrays' data pointers natively
        if _DATA_OFFSET is not None:
            try:
                self._run_objects = ctypes.CFUNCTYPE(ctypes.c_int32, vp, vp, vp, ctypes.c_int64)(
                    jit.address("tgc_run_objects"))
            except KeyError:
                pass
        self._lock = threading.Lock()
        self._workspace = np.empty(0, np.uint8)
        self.dtype = options.dtype
        targets = {u.target for u in module.updates}
        self.inputs = [TensorSpec(a.name, a.kind, a.order, tuple(module.size(e) for e in a.order),
                                  "i32" if a.dtype == "i32" else self.dtype, a.name in targets)
                       for a in module.args.values()]
        self.outputs = [TensorSpec(o.name, "output", o.order, tuple(module.size(e) for e in o.order), self.dtype)
                        for o in module.outputs]
        self.updates = [u.target for u in module.updates]
        # fast path (see run): per input, its name, numpy dtype and whether it is updated
        self._names = tuple(s.name for s in self.inputs)
        self._name_set = frozenset(self._names)
        self._want = tuple((s.name, np.dtype(NP[s.dtype]), s.updated) for s in self.inputs)
        self._upd_idx = tuple(i for i, s in enumerate(self.inputs) if s.updated)
        self._ro_idx = tuple(i for i, s in enumerate(self.inputs) if not s.updated)
        self._out_names = tuple(s.name for s in self.outputs)
        self._out_dtypes = tuple(np.dtype(NP[s.dtype]) for s in self.outputs)
        self._plans: dict = {}
        self._arg_ptrs = (ctypes.c_void_p * max(len(self.inputs), 1))()
        self._out_ptrs = (ctypes.c_void_p * max(len(self.outputs), 1))()
        self._arg_addr, self._out_addr = ctypes.addressof(self._arg_ptrs), ctypes.addressof(self._out_ptrs)
        self._objs = (ctypes.c_size_t * max(len(self.inputs) + len(self.outputs), 1))()
        self._objs_addr = ctypes.addressof(self._objs)
        self._ws_addr = 0

    @property
    def llvm_ir(self) -> str:
        """The LLVM IR text of this program (generated again on request)."""
        from tgc.backends.cpu import codegen

        return codegen.generate(self.lowered, self.options)

    def __call__(self, **arrays) -> dict[str, np.ndarray]:
        return self.run(arrays)

    def __repr__(self) -> str:
        ins = ", ".join(f"{s.name}[{', '.join(s.edges)}]" for s in self.inputs)
        outs = ", ".join(f"{s.name}[{', '.join(s.edges)}]" for s in self.outputs)
        return f"<tgc.Program ({ins}) -> ({outs}) {self.dtype}>"

    # ------------------------------------------------------------ validation

    def _convert(self, spec: TensorSpec, value) -> np.ndarray:
        if spec.updated and not isinstance(value, np.ndarray):
            raise EvalError(f"'{spec.name}' is updated in place: pass a numpy array, not {type(value).__name__}")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and spec.dtype != "i32":
            return np.asarray(value, NP[spec.dtype])
        a = np.asarray(value)
        if spec.dtype == "i32":
            if a.dtype.kind not in "iu":
                raise EvalError(f"input '{spec.name}' holds ids (i32): pass integers, not {a.dtype}")
            if a.dtype != np.int32 and a.size and (a.min() < -2**31 or a.max() >= 2**31):
                raise EvalError(f"input '{spec.name}': ids do not fit in int32")
        elif a.dtype.kind != "f":
            raise EvalError(f"input '{spec.name}' must be a float array ({spec.dtype}), not {a.dtype}")
        if spec.updated and not a.flags.writeable:
            raise EvalError(f"'{spec.name}' is updated in place but the array is read-only")
        return np.require(a, NP[spec.dtype], "C")

    def _bind(self, arrays: dict, dims: dict | None) -> dict[str, int]:
        m = self.module
        env: dict[str, int] = dict(dims or {})
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
        for spec in self.inputs:
            want = tuple(size_eval(s, env) for s in spec.shape)
            if arrays[spec.name].shape != want:
                edges = ", ".join(f"{e}={n}" for e, n in zip(spec.edges, want))
                raise EvalError(f"input '{spec.name}' has shape {arrays[spec.name].shape}, expected {want} ([{edges}])")
        return env

    def _prepare(self, given: dict) -> tuple[dict, dict]:
        names = [s.name for s in self.inputs]
        missing = [n for n in names if n not in given]
        if missing:
            raise EvalError(f"missing input '{missing[0]}' (the program takes: {', '.join(names)})")
        extra = [n for n in given if n not in names]
        if extra:
            raise EvalError(f"unexpected input '{extra[0]}' (the program takes: {', '.join(names)})")
        arrays = {s.name: self._convert(s, given[s.name]) for s in self.inputs}
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

    def run(self, arrays: dict, dims: dict | None = None) -> dict[str, np.ndarray]:
        # The fast path takes inputs that are already what the native code reads (an
        # ndarray of the exact dtype, C-contiguous, writable where updated), which
        # `_prepare` would pass through unchanged; anything else, and every error
        # message, goes through the checked path.
        if dims is None and arrays.keys() == self._name_set:
            vals = []
            for name, want, updated in self._want:
                a = arrays[name]
                if type(a) is not np.ndarray or (a.dtype is not want and a.dtype != want):
                    break
                flags = a.flags
                if not flags.c_contiguous or (updated and not flags.writeable):
                    break
                vals.append(a)
            else:
                return self._run_fast(vals)
        return self._run_checked(arrays, dims)

    def _plan(self, vals: list, key: tuple) -> _Plan:
        """Bind and check the shapes of a call (as `_bind` does), remembered by shape."""
        env = self._bind(dict(zip(self._names, vals)), None)
        sym = self.module.symbolic_dims()
        dim_values = (ctypes.c_int64 * max(len(sym), 1))(*[env[d] for d in sym])
        out_shapes = [tuple(size_eval(x, env) for x in s.shape) for s in self.outputs]
        addr = ctypes.addressof(dim_values)
        plan = _Plan(env, dim_values, out_shapes, int(self._ws_bytes(addr)), addr,
                     list(zip(out_shapes, self._out_dtypes)))
        if len(self._plans) >= PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def _unaliased(self, vals: list, ptrs: list) -> None:
        """Copy each input sharing memory with an update target, so it is read with its
        old values (np.may_share_memory's bounds test; every array here is contiguous)."""
        upd = [(ptrs[j], ptrs[j] + vals[j].nbytes) for j in self._upd_idx if vals[j].nbytes]
        for i in self._ro_idx:
            n = vals[i].nbytes
            if not n:
                continue
            lo, hi = ptrs[i], ptrs[i] + n
            for ulo, uhi in upd:
                if ulo < hi and lo < uhi:
                    vals[i] = vals[i].copy()
                    ptrs[i] = _data_ptr(vals[i])
                    break

    def _run_fast(self, vals: list) -> dict[str, np.ndarray]:
        key = tuple([a.shape for a in vals])
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(vals, key)
        if self._upd_idx:
            ptrs = [_data_ptr(a) for a in vals]
            # the same buffers as a call found free of aliasing need no check (the
            # shapes, hence the byte extents, are the plan's)
            if ptrs != plan.clean:
                before = list(ptrs)
                self._unaliased(vals, ptrs)
                if ptrs == before:
                    plan.clean = before
        empty = np.empty
        outs = [empty(shape, dt) for shape, dt in plan.out_specs]
        with self._lock:
            if self._workspace.size < plan.ws_need + ALIGN:
                self._workspace = np.empty(plan.ws_need + ALIGN, np.uint8)
                addr = self._workspace.ctypes.data
                self._ws_addr = addr + (-addr) % ALIGN
            if self._run_objects is not None:
                # vals and outs hold the objects alive through the call
                objs = vals + outs
                self._objs[:len(objs)] = list(map(id, objs))
                rc = self._run_objects(plan.dims_addr, self._objs_addr, self._ws_addr, _DATA_OFFSET)
            else:
                self._arg_ptrs[:len(vals)] = [_data_ptr(a) for a in vals]
                self._out_ptrs[:len(outs)] = [_data_ptr(a) for a in outs]
                rc = self._run(plan.dims_addr, self._arg_addr, self._out_addr, self._ws_addr)
        if rc != 0:
            raise self._check_error(rc, dict(zip(self._names, vals)), plan.env)
        result = dict(zip(self._out_names, outs))
        for i in self._upd_idx:
            result[self._names[i]] = vals[i]
        return result

    def _run_checked(self, arrays: dict, dims: dict | None = None) -> dict[str, np.ndarray]:
        args, write_back = self._prepare(arrays)
        env = self._bind(args, dims)
        sym = self.module.symbolic_dims()
        dim_values = (ctypes.c_int64 * max(len(sym), 1))(*[env[d] for d in sym])
        outs = {s.name: np.empty(tuple(size_eval(x, env) for x in s.shape), NP[s.dtype]) for s in self.outputs}
        arg_ptrs = (ctypes.c_void_p * max(len(args), 1))(*[a.ctypes.data for a in args.values()])
        out_ptrs = (ctypes.c_void_p * max(len(outs), 1))(*[a.ctypes.data for a in outs.values()])
        with self._lock:
            ws = self._workspace_for(dim_values)
            rc = self._run(ctypes.addressof(dim_values), ctypes.addressof(arg_ptrs),
                           ctypes.addressof(out_ptrs), ws)
        if rc != 0:
            raise self._check_error(rc, args, env)
        for name, original in write_back.items():
            np.copyto(original, args[name], casting="unsafe")
        result = dict(outs)
        for target in self.updates:
            result[target] = write_back.get(target, args[target])
        return result

    def _workspace_for(self, dim_values) -> int:
        need = int(self._ws_bytes(ctypes.addressof(dim_values)))
        if self._workspace.size < need + ALIGN:
            self._workspace = np.empty(need + ALIGN, np.uint8)
            addr = self._workspace.ctypes.data
            self._ws_addr = addr + (-addr) % ALIGN
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
        return EvalError(f"gather index out of range: '{check.buf}'[{where}] = {value}, "
                         f"but the {check.note} has size {n}; nothing was written")
