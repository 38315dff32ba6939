"""The one place that loads, optimizes, lowers and compiles: the entry points that
`tgc.compile`, `tgc.torch`, the command line (`run`, `build`, `info`, `explain`,
`grad`, `dump-ir`) and a program's own `without_updates` share.

- `load(path, options)` / `load_program`: a `.tg` program (front end) or a `.tgir`
  file (IR parser) into a module; `load_source(source, backend, dtype, dims,
  options)` for anything `tgc.compile` takes (a path, .tg text, IR text, a Module),
  with its dims fixed, or a first-level cache hit;
- `lower(module, options, emit)`: the IR pass pipeline (optimization, autodiff);
- `lower_module(module, options, backend)`: the lowering stages, with the backend's
  own (`lowering(backend)` names them);
- `target(module, options)`: the program a backend compiles, after the IR pipeline:
  the target passes (an f32 program under --fp-strict is its f64 emulation), for
  `compile_module` and `tgc build` alike;
- `compile_module(module, options, backend)`: a callable `Program` of a module after
  the IR pipeline: its target, lowered, compiled by the backend (`tgc.backends.base`),
  wrapped by the neutral runtime (`tgc.runtime.program`);
- `compile_cached(module, options, backend, key)`: a module through the pipeline and
  the backend, with the code cache's first level (a data-parallel phase's build:
  `tgc.distributed` wraps compiled programs from outside; the pipeline knows nothing
  of processes);
- `compile_source(source, backend, dtype, dims, options)`: all of it, from a source
  (what `tgc.compile` is).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tgc.autodiff.gradient import gradient_module  # noqa: F401 (the entry points' transforms, as functions)
from tgc.ir.module import Module
from tgc.opt.dims import fix_dims  # noqa: F401
from tgc.opt.prune import drop_unread_args, forward_only, read_args, used_dims  # noqa: F401
from tgc.options import Options
from tgc.manager import PipelineResult, run_pipeline
from tgc.ir.collector import gc_paused

if TYPE_CHECKING:   # the front end is imported where a program is loaded
    from tgc.frontend.elaborate import Elaborated


def read_text(path: str) -> str:
    """The file's text ('-' is stdin): `tgc.frontend.parser.read_source`, the one
    reader of source files (byte order marks, NUL bytes, UTF-8 errors located)."""
    from tgc.frontend.parser import read_source

    return read_source(path)[0]


def is_ir_file(path: str) -> bool:
    return path.endswith(".tgir")


def float_type(path: str, asked: str | None, text: str | None = None) -> str:
    """The float type to build `path` (whose `text` may be read already) with: `asked`
    (--dtype), else a .tgir file's own (its IR spells every type), else f32."""
    if asked:
        return asked
    if text is not None or is_ir_file(path):
        import re

        text = read_text(path) if text is None else text
        found = re.search(r"^\s*(?:input|param|state)\s+\S+\s*:\s*(f32|f64)\b", text, re.M)
        if found:
            return found.group(1)
    return "f32"


def load_program(path: str, options: Options, text: str | None = None) -> "Elaborated":
    """Parse and check a `.tg` program ('-' is stdin), or read a `.tgir` module;
    with the files it read and its warnings. With `text`, `path` is only its name:
    "<ir>" (IR text) or any other (.tg source text)."""
    from tgc.frontend.elaborate import Elaborated, elaborate_source

    name = "<stdin>" if path == "-" else path
    if text is not None and path != "<ir>":
        return elaborate_source(text, name, options)
    if is_ir_file(path) or path == "<ir>":
        from tgc.ir.parser import parse_module  # only for IR input

        text = read_text(path) if text is None else text
        return Elaborated(parse_module(text, name), [] if path in ("-", "<ir>") else [path], texts={name: text})
    if path == "-":
        return elaborate_source(read_text(path), name, options)
    from tgc.frontend.elaborate import elaborate_file

    return elaborate_file(path, options)


# The passes `check_program` runs after the front end: the derivatives (adjoint, tangent,
# on the normalized module they take in every pipeline) are where a missing custom rule
# (`forward mode needs the jvp of 'f'...`) is found.
CHECK_PASSES: tuple[str, ...] = ("normalize", "adjoint", "tangent")


def check_program(path: str, options: Options) -> "Elaborated":
    """`load_program`, then the derivative passes (`CHECK_PASSES`), so that `tgc check`
    reports every mistake a build would (a derivative a custom function does not give
    is an error only once the derivative is taken). The result is the elaborated
    program; the differentiated module is discarded (and costs a few ms). A program
    that takes no derivative (no grad, jvp or vjp, in a loop body neither) has none to
    miss, and the passes are not run: their work grows with the program (`normalize`
    merges each link of a chain of products into the next), not only with its
    derivatives."""
    from tgc.manager import run_passes

    loaded = load_program(path, options)
    if takes_derivatives(loaded.module):
        run_passes(loaded.module, CHECK_PASSES, options)
    return loaded


def takes_derivatives(module: Module) -> bool:
    """Whether a grad, jvp or vjp is among the module's values or its loop bodies'."""
    from tgc.ir.values import DERIVATIVE_OPS, reaches

    roots = module.roots() + [v for f in module.facts for v in (f.lhs, f.rhs)]
    return reaches(roots, lambda v: v.op in DERIVATIVE_OPS)


def load(path: str, options: Options) -> Module:
    """The module of a `.tg` program or a `.tgir` file."""
    return load_program(path, options).module


@gc_paused()   # compiling builds large acyclic graphs: see gc_paused
def lower(module: Module, options: Options, emit=None, backend: str = "cpu") -> PipelineResult:
    """The pipeline on `module`; with `options.memory_budget`, checkpoints chosen so that
    the workspace `backend`'s lowering plans fits (tgc.budget: the result's `memory` says
    what).

    The options are `backend`'s for the IR pipeline (`Backend.pipeline_options`: the
    CUDA backends keep the softmax-contraction chains their flash stage fuses whole,
    `Options.stream_fused_edge`). Where they differ from the given ones and the program
    keeps a value of a streaming size (`stream_min_elements_masked` elements or more),
    the backend's lowering of it is checked against the program the given options make:
    when its workspace is larger (a kept chain the backend did not fuse after all), the
    given options' program is the result. The kept program is lowered once to see
    whether a buffer of that size is left; only then is the other made and compared."""
    from tgc.backends.base import get_backend

    resolved = get_backend(backend).pipeline_options(options)
    result = _ir_pipeline(module, resolved, emit, backend)
    if resolved != options and _holds_large(result.module, resolved):
        kept = _lowered(result.module, options, backend)
        if kept is None or _largest(kept) >= _least(options):   # a large buffer is left: compare
            plain = _ir_pipeline(module, options, emit, backend)
            low = _lowered(plain.module, options, backend)
            if kept is None or low is None or _workspace(low) < _workspace(kept):
                return plain
    return result


def _ir_pipeline(module: Module, options: Options, emit, backend: str) -> PipelineResult:
    if options.memory_budget is not None:
        from tgc.budget import lower_within_budget

        return lower_within_budget(module, options, emit, backend)
    return run_pipeline(module, options, emit)


def _sizes(module: Module) -> dict[str, int] | None:
    """Every dim's size with the symbolic ones at 1 (as `stream` counts them), or None."""
    try:
        return module.bind_dims({d: 1 for d in module.symbolic_dims()})
    except Exception:  # noqa: BLE001 -- a dim that does not divide at 1: no estimate
        return None


def _least(options: Options) -> int:
    """The fewest elements a value `stream` takes has."""
    return min(options.stream_min_elements, options.stream_min_elements_masked)


def _holds_large(module: Module, options: Options) -> bool:
    """Whether a top-level value of `module` has at least the elements `stream` takes
    (symbolic dims at 1, as `stream` counts them)."""
    env = _sizes(module)
    if env is None:
        return True
    edges = {e: env.get(d, 1) for e, d in module.edges.items()}
    for v in module.values():
        n = 1
        for e in v.edges:
            n *= edges.get(e, 1)
        if n >= _least(options):
            return True
    return False


def _lowered(module: Module, options: Options, backend: str):
    """`backend`'s lowered program of `module` (after the IR pipeline) and the sizes
    of its dims (symbolic ones at 1), or None where those have no value."""
    env = _sizes(module)
    if env is None:
        return None
    compiled, opts = target(module, options)
    return lower_module(compiled, opts, backend), env


def _largest(lowered) -> int:
    """The elements of the largest temporary of a `_lowered` program."""
    from tgc.ir.sizes import size_estimate

    low, env = lowered
    most = 0
    for b in low.buffers.values():
        if b.kind == "temp":
            n = 1
            for s in low.sizes(b.edges):
                n *= size_estimate(s, env)
            most = max(most, n)
    return most


def _workspace(lowered) -> int:
    """The workspace bytes of a `_lowered` program (each slot its largest buffer)."""
    from tgc.ir.sizes import size_estimate

    low, env = lowered
    return sum(max((size_estimate(b, env) for b in slot), default=0) for slot in low.slots)


@gc_paused()   # compiling builds large acyclic graphs: see gc_paused
def target(module: Module, options: Options, emit=None) -> tuple[Module, Options]:
    """The program a backend compiles from `module` after the IR pipeline, and the
    options to lower and compile it with: the target passes (`tgc.registry.target`;
    under --fp-strict, an f32 program's f64 emulation). `tgc.compile` and `tgc build`
    both go through here, so a built library computes what a compiled program does."""
    from tgc.manager import run_target

    return run_target(module, options, emit)


def lowering(backend: str = "cpu") -> tuple[str, ...]:
    """The lowering stages the backend named runs, in order (fuse, layout, its own, plan)."""
    from tgc.backends.base import get_backend

    return get_backend(backend).lowering()


@gc_paused()   # compiling builds large acyclic graphs: see gc_paused
def lower_module(module: Module, options: Options, backend: str = "cpu", emit=None, stop_after: str = "plan"):
    """The lowered program of `module` (after the IR pipeline) for `backend`: the
    neutral stages and the backend's own, run by the pass manager
    (`tgc.manager.lower_module`; `options.stages` overrides the list)."""
    from tgc.backends.base import get_backend, pass_registry
    from tgc.manager import lower_module as run_stages

    be = get_backend(backend)
    return run_stages(module, be.lowering_options(options), emit, stop_after, be.lowering(), pass_registry())


# The passes of the IR pipeline that only act at known sizes: a specialization runs them
# again once its dims are fixed (`specialized_module`).
SIZED_PASSES: tuple[str, ...] = ("stream",)
# The algebra that folds a dim's size once it is known: run before SIZED_PASSES where
# the generic module still reads a size (`size[hd]`) and holds no loop, in the
# pipeline's order.
SIZE_FOLDING_PASSES: tuple[str, ...] = ("simplify", "factor")


def specialized_module(module: Module, dims: dict, options: Options) -> Module:
    """`module` (after the IR pipeline) with `dims` fixed, as a specialization to those
    sizes runs it (`tgc.runtime.specialize`, `tgc explain --specialized`): `fix_dims`,
    then the pipeline's `SIZED_PASSES` again. `stream` only blocks an edge of known
    size, so over a symbolic sequence length a causal attention's [t, s] matrices were
    kept whole in every call, the specialized ones too (805 MB at t = 8192 where
    `tgc.compile(dims=)` streams it in 41 MB).

    Where the generic module reads the size of a symbolic edge (the `1 / sqrt(size(hd))`
    of an attention whose head width is symbolic), `simplify` and `factor` run first,
    as they did on a program written with that size: the size becomes a constant and
    the scale moves off the mask. Without them the algebra had folded the scale into
    the causal mask (`mask / sqrt(size(hd))`, an `[s, t]` product), which `stream` does
    not read as a mask, and the specialization kept the whole `[t, s]` matrices (1.68 GB
    at t = 4096, 4 heads x batch 2, against 15 MB with `hd` fixed in the source).
    Not where the module holds a loop (a `repeat`, or the generic program's own
    streams): run again on a streamed module, the algebra undid its streams (GPT-2's
    layer at t = 64 specialized to batch 1 kept its [t, s] matrices whole); such a
    program's specialization streams only what `stream` alone finds."""
    from tgc.manager import run_passes
    from tgc.registry import pipeline as pipeline_passes

    fixed = fix_dims(module, dims)
    values = module.values()
    reads_size = any(v.op == "size" for v in values) and not any(v.op == "loop" for v in values)
    again = tuple(p for p in pipeline_passes(options)
                  if p in SIZED_PASSES or (reads_size and p in SIZE_FOLDING_PASSES))
    again = tuple(dict.fromkeys(again))   # the pipeline runs simplify twice: once is enough here
    return run_passes(fixed, again, options) if again else fixed


@gc_paused()   # compiling builds large acyclic graphs: see gc_paused
def compile_module(module: Module, options: Options, backend: str = "cpu", artifacts=None, low=None):
    """A callable `Program` of `module` (after the IR pipeline) on `backend`: the
    target passes (`target`), the lowering, the backend's code.

    An f32 program under --fp-strict runs as its f64 emulation (`tgc.ir.emulate`):
    it takes f32 arrays (updates are written back into them) and returns f32 outputs.
    `artifacts` and `low`: a first-level cache hit's object files and lowered program."""
    from tgc.backends.base import get_backend
    from tgc.runtime.program import Program

    be = get_backend(backend)

    def build_forward():   # `Program.without_updates`: the same pipeline on the pruned module
        from tgc.manager import run_passes

        return compile_module(lower(run_passes(module, ("forward_only",), options), options, backend=backend).module,
                              options, backend)

    def build_specialized(dims, worth=None):   # `Program`'s specializations: the module with these dims fixed
        fixed, low = specialized_module(module, dims, options), None
        if worth is not None:   # lowered first: None, nothing compiled, when `worth(lowered)` is false
            compiled, opts = target(fixed, options)
            low = lower_module(compiled, opts, backend)
            if not worth(low):
                return None
        return compile_module(fixed, options, backend, low=low)

    compiled, opts = target(module, options)
    if low is None:
        low = lower_module(compiled, opts, backend)
    kernels = be.compile(compiled, low, opts, artifacts)
    specialize = build_specialized if be.specializes else None
    program = Program(compiled, opts, low, kernels, build_forward, specialize)
    if opts.dtype != options.dtype:   # the f64 emulation of an f32 program: f32 arrays in and out
        import numpy as np

        program.out_dtype = np.dtype(np.float32)
        program._origin = (module, options)
    return program


def run_compiled(module: Module, inputs, options: Options, backend: str = "cpu") -> dict:
    """Compile `module` (after the IR pipeline) and run it once on `inputs`.
    Symbolic dims come from the inputs' shapes, then from `options.dims`."""
    program = compile_module(module, options, backend)
    return program.run(dict(inputs), dict(options.dims) or None)


@gc_paused()   # compiling builds large acyclic graphs: see gc_paused
def compile_source(source, backend: str = "cpu", dtype: str | None = None, dims=None, options: Options | None = None):
    """`tgc.compile`: a path, .tg text, IR text or a Module to a callable `Program`
    (its docstring says what each argument is). The first-level cache (source ->
    program, `tgc.backends.cache`) is looked up before anything is parsed, for a
    backend whose `source_cache` says so (the CPU's), and not under a memory budget."""
    src = load_source(source, backend, dtype, dims, options)
    if src.program is not None:
        return src.program
    return compile_cached(src.module, src.options, backend, src.key, src.reads, lookup=False, stacklevel=3)


@dataclass
class Source:
    """What `load_source` read: `program`, a first-level cache hit (then nothing else
    was read), or the `module` with the dims the call fixed (`fix_dims`), the
    `options` to build it with (their `dims` empty), the source's cache key and the
    files it read (`key`, `reads`: None where the source is not cached)."""
    program: object = None
    module: Module | None = None
    options: Options | None = None
    key: str | None = None
    reads: object = None


def load_source(source, backend: str = "cpu", dtype: str | None = None, dims=None, options: Options | None = None,
                lookup: bool = True) -> Source:
    """Anything `tgc.compile` takes (a path, .tg text, IR text, a Module; the arguments
    as its), checked and loaded, with its dims fixed, for `backend`; with `lookup`,
    a first-level cache hit instead when there is one. A data-parallel step
    (`tgc.distributed`) starts from here too, with `lookup=False`."""
    import os

    from tgc.backends.base import get_backend

    if not isinstance(source, (str, bytes, bytearray, os.PathLike, Module)):
        raise TypeError(f"source: a path, .tg or IR text (str), or a Module; not {type(source).__name__}")
    if options is not None and not isinstance(options, Options):
        raise TypeError(f"options= takes a tgc.options.Options, not {type(options).__name__} "
                        "(Options(dtype='f64', ...) or Options().with_(...))")
    if dims is not None and not hasattr(dims, "items"):
        raise TypeError(f"dims= takes a dict {{name: size}}, not {type(dims).__name__}")
    be = get_backend(backend)
    if dtype is None:   # the options' float type (f32 by default)
        dtype = options.dtype if options is not None else "f32"
    if dtype not in ("f32", "f64"):
        raise ValueError(f"dtype '{dtype}': the float type is 'f32' or 'f64'")
    if options is not None and options.autocast not in (None, "bf16", "f16"):
        raise ValueError(f"autocast '{options.autocast}': mixed precision is 'bf16' or 'f16' (or None)")
    if isinstance(source, (bytes, bytearray)):
        raise TypeError("source: a path, .tg or IR text (str), or a Module; not bytes (decode it first)")
    options = options or Options()
    options = options.with_(dtype=dtype, dims=tuple(sorted(dims.items())) if dims is not None else options.dims)
    if isinstance(source, Module):
        return _fixed(source, options)
    if isinstance(source, os.PathLike) or (isinstance(source, str) and "\n" not in source
                                              and (source.endswith((".tg", ".tgir")) or os.path.exists(source))):
        path = os.fspath(source)
        kind, name, text = ("ir" if is_ir_file(path) else "tg"), path, None
        if path != "-":
            try:  # keyed on the file's bytes; an unreadable file is reported by the loader below
                import hashlib

                from tgc.fsutil import read_source_bytes

                text = "sha256:" + hashlib.sha256(read_source_bytes(path)).hexdigest()
            except (OSError, ValueError):
                pass
    elif is_ir_text(source):
        kind, name, text = "ir", "<ir>", source
    else:
        kind, name, text = "tg", "<source>", source
    # the first-level cache: source -> program, before the front end and the passes
    key = _source_key(kind, name, text, options, be) if be.source_cache and options.memory_budget is None else None
    if key is not None and lookup:
        program = _cached(key, options, be)
        if program is not None:
            return Source(program)
    loaded = load_program(name, options, None if name not in ("<ir>", "<source>") else source)
    reads = None
    if key is not None:
        from tgc.backends.cache import Reads

        reads = Reads.of(loaded)
    return _fixed(loaded.module, options, key, reads)


def _fixed(module: Module, options: Options, key=None, reads=None) -> Source:
    """The source's module with the dims `options` names fixed (`fix_dims`, run by the
    pass manager), and the options to build it with."""
    from tgc.manager import run_passes
    from tgc.opt.dims import FixDims

    module = run_passes(module, (FixDims.of(dict(options.dims)),), options)
    return Source(None, module, options.with_(dims=()), key, reads)


def is_ir_text(source: str) -> bool:
    """Whether `source` (text, not a path) is IR as `tgc dump-ir` prints it."""
    import re

    return re.search(r"^\s*(%\w+\s*=|out\s+\S+\s*=\s*%)", source, re.M) is not None


def _source_key(kind, name, text, options, be):
    if text is None:
        return None
    from tgc.backends import cache

    if cache.cache_dir() is None or not cache.source_cacheable(options):
        return None
    try:
        folders = ()
        if kind == "tg":   # where its imports are looked for, resolved as this compile resolves them
            from tgc.frontend.folders import import_folders

            folders = tuple(str(f) for f in import_folders(name, options.import_dirs))
        return cache.source_key(kind, name, text, options, be.cache_parts(), folders)
    except Exception:  # noqa: BLE001 -- no key, no first-level cache
        return None


def _cached(key, options, be):
    """The program of a first-level cache hit, or None. The entry's IR is lowered
    again; its code is used only for the same lowered program."""
    from tgc.backends import cache

    hit = cache.lookup_program(key)
    if hit is None:
        return None
    try:
        from tgc.ir.parser import parse_module

        opts = options.with_(dims=())
        module = parse_module(hit.ir, "<cache>")
        low = lower_module(module, opts, be.name)
        if cache.lowered_digest(low) != hit.lowered_sha256:
            return None
        return compile_module(module, opts, be.name, artifacts=hit.objs, low=low)
    except Exception:  # noqa: BLE001 -- a damaged entry: the full build runs
        return None


def compile_cached(module: Module, options: Options, backend: str = "cpu", key: str | None = None, reads=None,
                   lookup: bool = True, stacklevel: int = 2):
    """`module` (before the IR pipeline) through the pipeline and `backend`. With `key`
    (a first-level cache key) and `reads` (the files its source read, `cache.Reads`), a
    cached program is used if there is one, and the new one is stored under it
    (`lookup=False`: the caller has looked already). Under a memory budget that cannot be met, a
    `MemoryBudgetWarning` says what was done (`stacklevel` as `warnings.warn`'s, from
    the caller of this function)."""
    from tgc.backends import cache
    from tgc.backends.base import get_backend

    be = get_backend(backend)
    if key is not None and be.source_cache and lookup:
        hit = _cached(key, options, be)
        if hit is not None:
            return hit
    lowered = lower(module, options, backend=be.name)
    if lowered.memory is not None and not lowered.memory.met:
        import warnings

        from tgc.budget import MemoryBudgetWarning

        warnings.warn(lowered.memory.summary(), MemoryBudgetWarning, stacklevel=stacklevel + 1)
    program = compile_module(lowered.module, options, be.name)
    program._memory_plan = lowered.memory
    objs = program._kernels.artifacts
    if key is not None and reads is not None and be.source_cache and objs is not None:
        cache.store_program(key, reads, program.module, program.lowered, objs)
    return program


def tg_source(module: Module, options: Options) -> str:
    """`module` as .tg source (`tgc grad --emit tg`): its loops, a derivative's too, as
    `repeat` and `scan` (`tgc.frontend.emit_loops`). A loop that has no such form (its
    step passes on an i32 value beside others) is written out step by step where its size
    is known (`unroll{all=true}`), with a comment line that says so and why; over a
    symbolic edge, or where `unroll` cannot write it out, it is the error."""
    from tgc.frontend.emit_tg import emit_tg
    from tgc.ir.diag import CompileError
    from tgc.ir.values import IRError
    from tgc.manager import run_passes

    try:
        return emit_tg(module)
    except CompileError as missing:
        if not any(v.op == "loop" for v in module.values()):
            raise
        try:
            unrolled = run_passes(module, ("unroll{all=true}",), options)
        except CompileError:   # a loop over a symbolic edge: the missing form is the error
            raise CompileError(f"{missing.message}; use --emit ir, or give the loop's dim a size so that "
                               "the loop is written out step by step", missing.loc) from None
        except IRError as written_out:   # a loop that `unroll` cannot write out either
            raise CompileError(f"{missing.message}, and it cannot be written out step by step "
                               f"({written_out}); use --emit ir", missing.loc) from None
        why = missing.message
    head, rest = emit_tg(unrolled).split("\n", 1)
    return f"{head}\n# loops written out step by step: {why}\n{rest}"
