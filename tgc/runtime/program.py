"""A compiled program in this process: lowering, LLVM, JIT, input checks, the call.

`build(module, options)` takes a module after the IR pipeline (no grad/jvp/vjp
left), lowers it (fuse, layout, plan), generates LLVM IR (`tgc.backends.cpu`),
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
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import numpy as np

from tgc.ir.interp import EvalError
from tgc.ir.lowered import Lowered
from tgc.ir.module import Module
from tgc.ir.sizes import Size, SizeError, size_eval
from tgc.options import Options

NP = {"f32": np.float32, "f64": np.float64, "i32": np.int32}
ALIGN = 64


@dataclass(frozen=True)
class TensorSpec:
    name: str
    kind: str                   # input | param | state | output
    edges: tuple[str, ...]      # ABI order
    shape: tuple[Size, ...]     # an int, or a symbolic size expression per axis
    dtype: str                  # f32 | f64 | i32
    updated: bool = False       # a param/state written by `update`


def build(module: Module, options: Options) -> "Program":
    from tgc.backends.cpu import blas, codegen, fntable, llvm_env, parallel
    from tgc.passes.plan import lower_module

    low = lower_module(module, options)
    jit = _machine_code(module, low, options)
    table = fntable.make_table({**blas.gemm_addresses(), **parallel.gomp_addresses()})
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(jit.address("tgc_init"))(ctypes.addressof(table))
    return Program(module, options, low, jit)


def _machine_code(module: Module, low: Lowered, options: Options):
    """The program's machine code, from the on-disk cache or freshly compiled (then cached)."""
    from tgc.backends.cpu import codegen, llvm_env
    from tgc.ir.printer import print_module
    from tgc.runtime import cache

    key = cache.cache_key(print_module(module), options, llvm_env.host_cpu())
    obj = cache.lookup(key)
    if obj is not None:
        return llvm_env.jit_object(obj)
    obj = llvm_env.emit_object(codegen.generate(low, options), max(options.opt_level, 1))
    cache.store(key, obj)
    return llvm_env.jit_object(obj)


class Program:
    """A callable compiled program. Thread-safe; calls are serialized."""

    def __init__(self, module: Module, options: Options, low: Lowered, jit):
        self.module, self.options, self.lowered = module, options, low
        self._jit = jit  # keeps the code alive
        vp, i64p = ctypes.c_void_p, ctypes.c_void_p
        self._run = ctypes.CFUNCTYPE(ctypes.c_int32, i64p, vp, vp, vp)(jit.address("tgc_run"))
        self._ws_bytes = ctypes.CFUNCTYPE(ctypes.c_int64, i64p)(jit.address("tgc_workspace_bytes"))
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
        except SizeError as e:
            raise EvalError(f"{e}: no input has it; pass its size with dims=") from None
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
        return addr + (-addr) % ALIGN

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
