"""tgc: a compiler for tensor programs whose axes are named edges.

    import numpy as np, tgc
    program = tgc.compile("model.tg")              # or .tg source text, IR text, a Module
    print(program)                                 # what to pass: names, edges, shapes, dtypes
    result = program(x=x, W=W, lr=0.1)             # {output: array, ..., update target: array}
    result = program(x=x, W=W, updates=False)      # forward only: no update is applied
    tgc.save_params("model.safetensors", program, {"W": W})
    W = tgc.load_params("model.safetensors", program)["W"]

The API:

- `compile(source, ...)` builds a `Program` (native code for this CPU, or another backend's);
- `Program`: call it with one array per argument, by name; `inputs`, `outputs`,
  `ir()`, `plan()`, `without_updates()`, `init_state()` (every state, zero-filled);
- `TensorSpec`: one argument or output (name, kind, edges in ABI order, shape, dtype);
- `Options`: compiler settings (passes, `fp_strict`, `cpu=CpuOptions(threads=...)`, ...);
- `save_params` / `load_params`: a program's params and states to and from
  safetensors or npz files, checked against the program on load;
- `tgc.distributed`: data-parallel training steps over MPI or NCCL
  (`compile(..., data_parallel=comm)`; docs/distributed.md);
- errors: `CompileError` (the program is wrong), `EvalError` (a call's arrays are
  wrong), `ParamsError` (a parameter file does not fit).

The language is described in docs/language.md; the command line in `tgc --help`.
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["compile", "Program", "TensorSpec", "Options", "CpuOptions", "CudaOptions", "save_params", "load_params",
           "CompileError", "EvalError", "ParamsError", "__version__"]

# Names imported on first use, so that `import tgc` imports nothing: the command line
# (`tgc.cli.console`) handles Ctrl-C from its first line, and it runs after this.
_LAZY = {"Options": "tgc.options", "CpuOptions": "tgc.options", "CudaOptions": "tgc.options",
         "Program": "tgc.runtime.program", "TensorSpec": "tgc.runtime.program",
         "save_params": "tgc.params", "load_params": "tgc.params", "ParamsError": "tgc.params",
         "EvalError": "tgc.ir.input_checks", "CompileError": "tgc.ir.diag"}


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


def compile(source, backend: str = "cpu", dtype: str | None = None, dims=None, options=None, data_parallel=None,
            **data_parallel_options):
    """Compile a program (by default to native code for this CPU); returns a callable `Program`.

    `source`: a path to a `.tg` or `.tgir` file (a one-line string that names an
    existing file is a path whatever its suffix), `.tg` source text, IR text (as
    `tgc dump-ir` prints it), or a `tgc.ir.module.Module`. `dtype` is the float
    type, "f32" or "f64" (default: the options' `dtype`, f32 unless set there).
    `dims` ({name: size}, default: the options' `dims`) fixes symbolic dims at build time;
    dims left symbolic are bound at each call from the inputs' shapes, so one build
    serves every batch size. `options` (an `Options`) sets everything else.
    `backend` is "cpu" (native code for this CPU), "cuda" (an NVIDIA GPU through
    CuPy: docs/cuda.md), "cuda-sim" (the CUDA module run on this CPU by an
    emulator), "lowered" (the lowered program run kernel by kernel by its numpy
    interpreter: the reference, slow), "interp" (the IR interpreter, as `tgc run
    --backend interp`) or any other backend folder's
    (`tgc.backends.base.backend_names()`, docs/backends.md); any other name is a
    ValueError that lists them.
    Errors in the program raise `CompileError`; a backend that cannot run here
    raises `tgc.backends.base.BackendUnavailable`.

    `data_parallel` (an mpi4py communicator, or a CuPy NCCL communicator for "cuda")
    makes a `tgc.distributed.DataParallel` step: the batch split over the ranks, the
    gradients averaged, the updates run on every rank (docs/distributed.md). Its
    keywords: `shard` (the split dim, "batch"), `deterministic` (sum in rank order),
    `bucket_bytes`, `sums` (outputs summed, not averaged), `overlap` (reduce each
    bucket while the backward pass goes on; True).

    Compiled code is cached on disk (see the README), so compiling the same program
    again is fast.
    """
    if data_parallel is not None:   # wraps programs the pipeline compiles, from outside
        from tgc.distributed import data_parallel_step

        return data_parallel_step(source, data_parallel, backend, dtype, dims, options, **data_parallel_options)
    if data_parallel_options:
        raise TypeError(f"compile() got an unexpected keyword argument '{next(iter(data_parallel_options))}'")
    from tgc import pipeline

    return pipeline.compile_source(source, backend, dtype, dims, options)
