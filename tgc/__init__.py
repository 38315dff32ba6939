"""tgc: a compiler for tensor programs whose axes are named edges.

    import numpy as np, tgc
    program = tgc.compile("model.tg")              # or .tg source text, IR text, a Module
    print(program)                                 # what to pass: names, edges, shapes, dtypes
    result = program(x=x, W=W, lr=0.1)             # {output: array, ..., update target: array}
    result = program(x=x, W=W, updates=False)      # forward only: no update is applied
    tgc.save_params("model.safetensors", program, {"W": W})
    W = tgc.load_params("model.safetensors", program)["W"]

The API:

- `compile(source, ...)` builds a `Program` (native code for this CPU);
- `Program`: call it with one array per argument, by name; `inputs`, `outputs`,
  `ir()`, `plan()`, `without_updates()`;
- `TensorSpec`: one argument or output (name, kind, edges in ABI order, shape, dtype);
- `Options`: compiler settings (passes, threads, `fp_strict`, ...);
- `save_params` / `load_params`: a program's params and states to and from
  safetensors or npz files, checked against the program on load;
- `tgc.distributed`: data-parallel training steps over MPI or NCCL
  (`compile(..., data_parallel=comm)`; docs/distributed.md);
- errors: `CompileError` (the program is wrong), `EvalError` (a call's arrays are
  wrong), `ParamsError` (a parameter file does not fit).

The language is described in docs/language.md; the command line in `tgc --help`.
"""
from __future__ import annotations

from tgc.options import Options

__version__ = "0.1.0"

__all__ = ["compile", "Program", "TensorSpec", "Options", "save_params", "load_params",
           "CompileError", "EvalError", "ParamsError", "__version__"]

# Names imported on first use, so that `import tgc` stays cheap (the command line
# imports it for the version alone).
_LAZY = {"Program": "tgc.runtime.program", "TensorSpec": "tgc.runtime.program",
         "save_params": "tgc.params", "load_params": "tgc.params", "ParamsError": "tgc.params",
         "EvalError": "tgc.ir.interp", "CompileError": "tgc.ir.diag"}


def __getattr__(name: str):
    """The public names not imported yet (`Program`, `save_params`, ...), on first use."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tgc' has no attribute {name!r}")


def __dir__() -> list[str]:
    """Every name `tgc` offers, imported or not (for `dir()` and `help()`)."""
    return sorted(set(globals()) | set(_LAZY))


def compile(source, backend: str = "cpu", dtype: str = "f32", dims=None, options=None, data_parallel=None,
            **data_parallel_options):
    """Compile a program to native code for this CPU; returns a callable `Program`.

    `source`: a path to a `.tg` or `.tgir` file, `.tg` source text, IR text (as
    `tgc dump-ir` prints it), or a `tgc.ir.module.Module`. `dtype` is the float
    type, "f32" or "f64". `dims` ({name: size}) fixes symbolic dims at build time;
    dims left symbolic are bound at each call from the inputs' shapes, so one build
    serves every batch size. `options` (an `Options`) sets everything else.
    `backend` is "cpu" (native code for this CPU), "cuda" (an NVIDIA GPU through
    CuPy: docs/cuda.md) or "cuda-sim" (the CUDA module run on this CPU by an
    emulator). Errors in the program raise `CompileError`; a backend that cannot
    run here raises `tgc.backends.base.BackendUnavailable`.

    `data_parallel` (an mpi4py communicator, or a CuPy NCCL communicator for "cuda")
    makes a `tgc.distributed.DataParallel` step: the batch split over the ranks, the
    gradients averaged, the updates run on every rank (docs/distributed.md). Its
    keywords: `shard` (the split dim, "batch"), `deterministic` (sum in rank order),
    `bucket_bytes`, `sums` (outputs summed, not averaged).

    Compiled code is cached on disk (see the README), so compiling the same program
    again is fast.
    """
    import os
    import re

    from tgc.ir.module import Module

    from tgc.backends.base import BACKENDS

    if backend not in BACKENDS:
        raise ValueError(f"backend '{backend}' is not available (have: {', '.join(BACKENDS)})")
    if dtype not in ("f32", "f64"):
        raise ValueError(f"dtype '{dtype}': the float type is 'f32' or 'f64'")
    if options is not None and options.autocast not in (None, "bf16", "f16"):
        raise ValueError(f"autocast '{options.autocast}': mixed precision is 'bf16' or 'f16' (or None)")
    if isinstance(source, (bytes, bytearray)):
        raise TypeError("source: a path, .tg or IR text (str), or a Module; not bytes (decode it first)")
    if data_parallel_options and data_parallel is None:
        raise TypeError(f"compile() got an unexpected keyword argument '{next(iter(data_parallel_options))}'")
    options = (options or Options()).with_(dtype=dtype, dims=tuple(sorted((dims or {}).items())))
    if isinstance(source, Module):
        return _build(source, dims, options, None, backend=backend, data_parallel=data_parallel,
                      dp_options=data_parallel_options)
    if isinstance(source, os.PathLike) or (isinstance(source, str) and "\n" not in source
                                              and source.endswith((".tg", ".tgir"))):
        path = os.fspath(source)
        kind, name, text = ("ir" if path.endswith(".tgir") else "tg"), path, None
        if path != "-":
            try:  # keyed on the file's bytes; an unreadable file is reported by the loader below
                import hashlib

                from tgc.fsutil import read_source_bytes

                text = "sha256:" + hashlib.sha256(read_source_bytes(path)).hexdigest()
            except (OSError, ValueError):
                pass
    elif re.search(r"^\s*(%\w+\s*=|out\s+\S+\s*=\s*%)", source, re.M):
        kind, name, text = "ir", "<ir>", source
    else:
        kind, name, text = "tg", "<source>", source
    # the first-level cache: source -> program, before the front end and the passes
    key = _source_key(kind, name, text, options) if backend == "cpu" and options.memory_budget is None else None
    if key is not None and data_parallel is None:
        program = _cached(key, options)
        if program is not None:
            return program
    from tgc import pipeline

    if name not in ("<ir>", "<source>"):    # a file (or stdin)
        loaded = pipeline.load_program(name, options)
        module, files = loaded.module, list(loaded.files)
    elif kind == "ir":
        from tgc.ir.parser import parse_module

        module, files = parse_module(source, name), []
    else:
        from tgc.frontend.elaborate import elaborate_source

        loaded = elaborate_source(source, name, options)
        module, files = loaded.module, [f for f in loaded.files if f != name]
    return _build(module, dims, options, key, files, backend, data_parallel, data_parallel_options)


def _source_key(kind, name, text, options):
    if text is None:
        return None
    from tgc.runtime import cache

    if cache.cache_dir() is None or not cache.source_cacheable(options):
        return None
    try:
        from tgc.backends.cpu import llvm_env

        return cache.source_key(kind, name, text, options, llvm_env.host_cpu())
    except Exception:  # noqa: BLE001 -- no key, no first-level cache
        return None


def _cached(key, options):
    """The program of a first-level cache hit, or None. The entry's IR is lowered
    again; its code is used only for the same lowered program."""
    from tgc.runtime import cache

    hit = cache.lookup_program(key)
    if hit is None:
        return None
    try:
        from tgc.ir.parser import parse_module
        from tgc.manager import lower_module
        from tgc.runtime.program import from_cached_object

        opts = options.with_(dims=())
        module = parse_module(hit.ir, "<cache>")
        low = lower_module(module, opts)
        if cache.lowered_digest(low) != hit.lowered_sha256:
            return None
        return from_cached_object(module, opts, low, hit.objs)
    except Exception:  # noqa: BLE001 -- a damaged entry: the full build runs
        return None


def _build(module, dims, options, key, files=(), backend="cpu", data_parallel=None, dp_options=None):
    from tgc import pipeline
    from tgc.runtime import cache
    from tgc.runtime.program import build_with_object

    module = pipeline.fix_dims(module, dims or {})
    opts = options.with_(dims=())
    if data_parallel is not None:   # split at the gradient boundary before the pipeline
        from tgc.distributed import DataParallel

        return DataParallel(module, data_parallel, opts, backend, **(dp_options or {}), cache_key=key,
                            files=files)
    lowered = pipeline.lower(module, opts)
    if lowered.memory is not None and not lowered.memory.met:
        import warnings

        from tgc.budget import MemoryBudgetWarning

        warnings.warn(lowered.memory.summary(), MemoryBudgetWarning, stacklevel=3)
    if backend != "cpu":   # cuda, cuda-sim: their modules are cached by content where they load
        from tgc.backends.cuda.runtime import build

        program = build(lowered.module, opts, backend)
        program._memory_plan = lowered.memory
        return program
    program, obj = build_with_object(lowered.module, opts)
    program._memory_plan = lowered.memory
    if key is not None:
        deps = cache.file_hashes(files)
        if deps is not None:
            cache.store_program(key, deps, program.module, program.lowered, obj)
    return program
