"""What every backend is: the `Backend` interface, the registry of backends by name,
and the error a backend raises when it cannot run here.

A backend is a folder `tgc/backends/NAME/` whose `__init__.py` declares
`BACKENDS = {"name": "module:Class", ...}` (strings, so that listing the backends
imports no code generator). `backend_names()` finds every such folder;
`get_backend(name)` imports the class on first use and keeps one instance. So a new
backend needs only its folder: `tgc.compile(..., backend=)`, `tgc run --backend`
and `tgc build --target` select through this registry, and the tests parametrized
over `backend_names()` run it (`tests/backends_util.py`). `refresh()` finds the
folders again after one is added to `tgc.backends.__path__` (a test's own backend:
tests/backends/plugins/toy). The smallest complete backend, the template for a new
one, is `lowered` (tgc/backends/lowered: the lowered program's interpreter);
docs/backends.md says how to add one.

A `Backend` says:
- `name`;
- `stages`: its own lowering stages (`Pass` classes on `Lowered`), run after the
  neutral `fuse` and `layout` and before `plan` (`lowering()` gives the names in
  order; the CPU's `group` is one); `pass_registry()` is every pass by name, the
  neutral ones (`tgc.registry.PASSES`) and every backend's stages, built once, so
  that a pass list (`-p`, `Options.stages`) may name any of them whichever backends
  were loaded before;
- `pipeline_options(options)`: the options the IR pipeline runs with for it (the
  CUDA backends keep the chains their flash stage fuses whole: `Options.stream_fused_edge`);
- `kernel_forms`: the text forms of its own kinds of kernel (`tgc.lower.text.KernelForm`s:
  grammar rules and a reader; the CPU's `group`), registered with the lowered
  program's reader (`tgc.lower.text.register_kernel_form`) by `get_backend` too;
- `compile(module, low, options)`: the executable kernels of a lowered program, an
  object the neutral runtime (`tgc.runtime.program.Program`) calls with buffers
  that it has bound, checked and allocated (`Kernels` below);
- `specializes`: whether a program of symbolic dims also compiles itself for the
  sizes it is called with again and again (`tgc.runtime.specialize`; the CPU's,
  whose compiles take a second or two, are cached on disk);
- `unavailable()`: why it cannot run on this machine (CUDA: no CuPy or GPU; cuda-sim:
  no g++), or None, checked without compiling anything (`compile` raises
  `BackendUnavailable` for the same reasons);
- `cache_parts()`: what the code depends on besides the IR and the options (its
  name; the CPU adds the host CPU's name and features), for the code cache's keys;
- `emits` and `build(module, low, options, emit, output, source)`: the files `tgc build
  --target NAME` writes (the CPU: a shared library and its C header, an object file,
  LLVM IR or assembly; CUDA: a cubin, PTX or CUDA C and a JSON manifest). A backend
  with no `emits` (cuda-sim) runs programs but builds nothing.

This module imports nothing heavy: the command line's error boundary uses it.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil

NEUTRAL_BEFORE = ("fuse", "layout")   # lowering stages every backend runs before its own
NEUTRAL_AFTER = ("plan",)             # ... and after them


class BackendUnavailable(RuntimeError):
    """The backend cannot run on this machine (no CuPy, no GPU, no C++ compiler);
    the message says why. The command line exits with status 3 for it."""


class Backend:
    """One target. Subclasses set `name` and `stages` and define `compile`."""

    name: str = ""
    stages: tuple = ()               # its own lowering stages (Pass classes), between layout and plan
    kernel_forms: tuple = ()         # its own kinds of kernel in the lowered text (tgc.lower.text.KernelForm)
    source_cache: bool = False       # whether `tgc.compile` keeps its programs in the first-level cache
    specializes: bool = False        # whether its programs compile themselves for the sizes they are called with (tgc.runtime.specialize)
    emits: tuple[str, ...] = ()      # the artifact kinds `tgc build --target NAME --emit` writes; the first is the default

    def lowering(self) -> tuple[str, ...]:
        """Every lowering stage's name, in the order they run."""
        return NEUTRAL_BEFORE + tuple(s.name for s in self.stages) + NEUTRAL_AFTER

    def pipeline_options(self, options):
        """The options the IR pipeline runs with for this backend (`tgc.pipeline.lower`
        resolves them, so that `tgc.compile`, `tgc explain` and `tgc build` optimize a
        program alike for it): the given ones. A backend that runs some cluster better
        than the target-independent rewrite does says so here (the CUDA backends: the
        softmax-contraction chains their flash stage fuses are not streamed)."""
        return options

    def lowering_options(self, options):
        """The options its lowering runs with (a backend may switch off a neutral
        stage's feature it cannot compile); the given ones."""
        return options

    def cache_parts(self) -> tuple[str, ...]:
        """What a compiled program depends on besides the IR and the options."""
        return (self.name,)

    def unavailable(self) -> str | None:
        """Why this backend cannot run on this machine (no GPU, no C++ compiler), or
        None: a cheap check, before anything is lowered or compiled, of what `compile`
        would raise `BackendUnavailable` for (a test skips with it)."""
        return None

    def compile(self, module, low, options, artifacts=None) -> "Kernels":
        """The executable kernels of `low` (lowered from `module`, the module after
        the IR pipeline). `artifacts` are what an earlier compile left in
        `Kernels.artifacts` (object files, from the cache); None: compile anew."""
        raise NotImplementedError

    def companions(self, output: str, emit: str) -> dict[str, str]:
        """{what: path} of the files `build` writes beside `output` (a header, a
        manifest), so that the command line can check them before compiling."""
        return {}

    def build(self, module, low, options, emit: str, output: str, source: str) -> dict[str, bytes]:
        """The files of `tgc build --target NAME --emit EMIT -o OUTPUT` for `module`
        after the IR pipeline and the target passes (`tgc.pipeline.target`, which also
        gives the `options` it is built with: under --fp-strict an f32 program is its
        f64 emulation) and `low`, its lowered program (`tgc.pipeline.lower_module`
        with this backend: the one lowering, which the backend only emits):
        {path: bytes}, `output` first, then its companions.
        `source` is the program's file name (for comments in what is written).
        ValueError: a combination of flags this backend cannot write."""
        raise ValueError(f"backend '{self.name}' builds no files (it runs programs in this process)")

    def __repr__(self) -> str:
        return f"<backend {self.name}>"


def failed_check(low, args: dict, env: dict) -> int:
    """The 1-based index of the first of `low.checks` (a gather's ids against its edge's
    size) that host arrays `args` fail, or 0: what a host-side backend's `run` returns
    before it computes anything, as the compiled entries do."""
    from tgc.ir.sizes import size_eval

    for i, check in enumerate(low.checks):
        ids, n = args[check.buf], size_eval(check.size, env)
        if ((ids < 0) | (ids >= n)).any():
            return i + 1
    return 0


class Kernels:
    """A backend's compiled program as the neutral runtime calls it: "run these
    kernels on these buffers". The runtime binds the signature, takes the dims from
    the shapes, checks and converts the inputs, allocates the outputs (`empty`), and
    handles updates, complex and bf16/f16 arguments; `run` runs every kernel.

    Optional: `prepare` (inputs that live on a device), a fast path
    (`fast_path`, `plan`, `run_fast`: the CPU's), `profile`, and any attribute
    a program of the backend offers (`llvm_ir`, `cuda_source`, ...), which
    `Program` forwards."""

    backend: str = ""
    artifacts: tuple | None = None   # what a later compile may reuse (cached object files)
    fast_path: bool = False          # `plan` and `run_fast` exist and may be used
    notifies: bool = False           # `run` (and `run_fast`) take `notify` (see `run`)

    def prepare(self, program, given: dict):
        """(arrays, write_back) for a call, or None: the runtime's host checks apply."""
        return None

    def empty(self, shape, dtype):
        import numpy as np

        return np.empty(shape, dtype)

    def to_host(self, a):
        return a

    def device_pairs(self, name: str, value, dtype: str, updated: bool):
        """A complex argument that lives on this backend's device, as float pairs of
        `dtype` over its memory, or None: host data, which the runtime views itself
        (`tgc.ir.complex_io.as_pairs`)."""
        return None

    def device_complex(self, a):
        """A float-pairs result on this backend's device as a complex view, or None."""
        return None

    def as_low(self, a, dtype: str):
        """An output held in floats whose values are of the narrower type `dtype` (bf16,
        f16, or f32 in an f64 program: rounded already), as an array of that type
        (exact); a device backend gives its own array of it."""
        from tgc.ir.dtypes import TYPES

        return a.astype(TYPES[dtype].numpy)

    def run(self, args: dict, outs: dict, env: dict, notify=None) -> int:
        """Run every kernel: `args` and `outs` by name, `env` every dim's size.
        Returns 0, or 1 + the index of the `Check` (lowered.checks) that failed;
        then nothing was written.

        With `notifies`, `notify = (marks, fn)` asks for `fn(i, outs)` on the calling
        thread as soon as kernel i (an index into `lowered.kernels`, one of `marks`)
        has run, before the next kernel starts: whatever kernels up to i wrote is
        there to read (on a device: queued on the current stream, to be ordered
        after on it). An exception in fn is raised once the run has finished. A
        backend without `notifies` is given no `notify` (`Program.run` calls the
        marks after the whole run instead)."""
        raise NotImplementedError

    def profile(self, reset: bool = False):
        raise ValueError(f"profiling is not available on the {self.backend} backend")

    def step_profile(self):
        raise ValueError(f"profiling is not available on the {self.backend} backend")

    def region_calls(self):
        raise ValueError(f"profiling is not available on the {self.backend} backend")

    def thread_profile(self):
        raise ValueError(f"profiling is not available on the {self.backend} backend")


_REGISTRY: dict[str, str] | None = None
# Runners without a folder: found by `get_backend` and listed in its error, but not by
# `backend_names()` (the backend tests run the reference interpreter themselves)
RUNNERS = {"interp": "tgc.backends.interp:InterpBackend"}
_LOADED: dict[str, Backend] = {}


def _registry() -> dict[str, str]:
    """{backend name: "module:Class"}, from every backend folder's `BACKENDS`."""
    global _REGISTRY
    if _REGISTRY is None:
        import tgc.backends as pkg

        found: dict[str, str] = {}
        for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
            if info.ispkg:
                mod = importlib.import_module(f"tgc.backends.{info.name}")
                found.update(getattr(mod, "BACKENDS", {}))
        _REGISTRY = found
    return _REGISTRY


def refresh() -> tuple[str, ...]:
    """Find the backend folders again, after a folder was added to (or removed from)
    `tgc.backends.__path__`, as a test does to register a backend of its own: the
    registry and the pass registry are built anew, and a loaded backend whose folder
    is gone is forgotten. Returns `backend_names()`."""
    global _REGISTRY
    _REGISTRY = None
    pass_registry.cache_clear()
    names = backend_names()
    for name in [n for n in _LOADED if n not in names]:
        del _LOADED[name]
    return names


def backend_names() -> tuple[str, ...]:
    """Every backend's name: cpu, cuda, cuda-sim, lowered, and any other folder's."""
    return tuple(_registry())


def build_targets() -> tuple[str, ...]:
    """The backends `tgc build --target` can write files for (those with `emits`)."""
    return tuple(name for name in backend_names() if get_backend(name).emits)


def get_backend(name: str) -> Backend:
    """The backend called `name` (a folder's, or a runner's: `RUNNERS`); ValueError,
    listing every name, when there is none."""
    if name in _LOADED:
        return _LOADED[name]
    where = (_registry().get(name) or RUNNERS.get(name)) if isinstance(name, str) else None
    if where is None:
        raise ValueError(f"backend {name!r} is not available; the backends are: "
                         f"{', '.join((*backend_names(), *RUNNERS))}")
    module, cls = where.split(":")
    backend = getattr(importlib.import_module(module), cls)()
    from tgc.lower.text import register_kernel_form, register_stage_name

    for stage in backend.stages:
        register_stage_name(stage.name)
    for form in backend.kernel_forms:
        register_kernel_form(form)
    _LOADED[name] = backend
    return backend


@functools.cache
def pass_registry():
    """Every pass by name: the neutral ones (`tgc.registry.PASSES`) and every
    backend's own lowering stages (before plan, in the backends' order), built once
    (loading every backend). The pass manager reads pass lists with it."""
    from tgc.registry import with_stages

    return with_stages(stage for name in backend_names() for stage in get_backend(name).stages)
