"""The one place that loads, optimizes, lowers and compiles: the entry points that
`tgc.compile`, `tgc.torch`, the command line (`run`, `build`, `info`, `explain`,
`grad`, `dump-ir`) and a program's own `without_updates` share.

- `load(path, options)` / `load_program`: a `.tg` program (front end) or a `.tgir`
  file (IR parser) into a module; `load_source(source, options)` for anything
  `tgc.compile` takes (a path, .tg text, IR text, a Module);
- `lower(module, options, emit)`: the IR pass pipeline (optimization, autodiff);
- `lower_module(module, options, backend)`: the lowering stages, with the backend's
  own (`lowering(backend)` names them);
- `compile_module(module, options, backend)`: a callable `Program` of a module after
  the IR pipeline: lowered, compiled by the backend (`tgc.backends.base`), wrapped by
  the neutral runtime (`tgc.runtime.program`); an f32 program under --fp-strict is
  built as its f64 emulation here, for every backend;
- `compile_cached(module, options, backend, key)`: a module through the pipeline and
  the backend, with the code cache's first level (a data-parallel phase's build);
- `compile_source(source, backend, dtype, dims, options)`: all of it, from a source
  (what `tgc.compile` is).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from tgc.ir.diag import CompileError, did_you_mean
from tgc.ir.module import Module
from tgc.ir.sizes import MAX_SIZE, size_str
from tgc.ir.values import topo_order
from tgc.options import Options
from tgc.manager import PipelineResult, run_pipeline

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
    program; the differentiated module is discarded (and costs a few ms)."""
    from tgc.manager import run_passes

    loaded = load_program(path, options)
    run_passes(loaded.module, CHECK_PASSES, options)
    return loaded


def load(path: str, options: Options) -> Module:
    """The module of a `.tg` program or a `.tgir` file."""
    return load_program(path, options).module


def lower(module: Module, options: Options, emit=None) -> PipelineResult:
    """The pipeline on `module`; with `options.memory_budget`, checkpoints chosen so that
    the workspace fits (tgc.budget: the result's `memory` says what)."""
    if options.memory_budget is not None:
        from tgc.budget import lower_within_budget

        return lower_within_budget(module, options, emit)
    return run_pipeline(module, options, emit)


def lowering(backend: str = "cpu") -> tuple[str, ...]:
    """The lowering stages the backend named runs, in order (fuse, layout, its own, plan)."""
    from tgc.backends.base import get_backend

    return get_backend(backend).lowering()


def lower_module(module: Module, options: Options, backend: str = "cpu", emit=None, stop_after: str = "plan"):
    """The lowered program of `module` (after the IR pipeline) for `backend`: the
    neutral stages and the backend's own, run by the pass manager
    (`tgc.manager.lower_module`; `options.stages` overrides the list)."""
    from tgc.backends.base import get_backend
    from tgc.manager import lower_module as run_stages

    be = get_backend(backend)
    return run_stages(module, be.lowering_options(options), emit, stop_after, be.lowering())


def compile_module(module: Module, options: Options, backend: str = "cpu", artifacts=None, low=None):
    """A callable `Program` of `module` (after the IR pipeline) on `backend`.

    An f32 program under --fp-strict runs as its f64 emulation (`tgc.ir.emulate`):
    it takes f32 arrays (updates are written back into them) and returns f32 outputs.
    `artifacts` and `low`: a first-level cache hit's object files and lowered program."""
    from tgc.backends.base import get_backend
    from tgc.runtime.program import Program

    be = get_backend(backend)

    def build_forward():   # `Program.without_updates`: the same pipeline on the pruned module
        return compile_module(lower(forward_only(module), options).module, options, backend)

    def build_specialized(dims):   # `Program`'s specializations: the module with these dims fixed
        return compile_module(fix_dims(module, dims), options, backend)

    if options.fp_strict and options.dtype == "f32":
        from tgc.ir.emulate import emulate_f32

        import numpy as np

        program = compile_module(emulate_f32(module), options.with_(dtype="f64"), backend)
        program.out_dtype = np.dtype(np.float32)
        program._origin = (module, options)
        program._build_forward = build_forward
        return program
    if low is None:
        low = lower_module(module, options, backend)
    kernels = be.compile(module, low, options, artifacts)
    return Program(module, options, low, kernels, build_forward, build_specialized if be.specializes else None)


def run_compiled(module: Module, inputs, options: Options, backend: str = "cpu") -> dict:
    """Compile `module` (after the IR pipeline) and run it once on `inputs`.
    Symbolic dims come from the inputs' shapes, then from `options.dims`."""
    program = compile_module(module, options, backend)
    return program.run(dict(inputs), dict(options.dims) or None)


def compile_source(source, backend: str = "cpu", dtype: str | None = None, dims=None, options: Options | None = None,
                   data_parallel=None, data_parallel_options=None):
    """`tgc.compile`: a path, .tg text, IR text or a Module to a callable `Program`
    (its docstring says what each argument is); with a communicator `data_parallel`,
    a `tgc.distributed.DataParallel` step. The first-level cache (source -> program,
    `tgc.backends.cache`) is looked up before anything is parsed, for a backend whose
    `source_cache` says so (the CPU's), and not under a memory budget."""
    import os

    from tgc.backends.base import get_backend

    be = get_backend(backend)
    if dtype is None:   # the options' float type (f32 by default)
        dtype = options.dtype if options is not None else "f32"
    if dtype not in ("f32", "f64"):
        raise ValueError(f"dtype '{dtype}': the float type is 'f32' or 'f64'")
    if options is not None and options.autocast not in (None, "bf16", "f16"):
        raise ValueError(f"autocast '{options.autocast}': mixed precision is 'bf16' or 'f16' (or None)")
    if isinstance(source, (bytes, bytearray)):
        raise TypeError("source: a path, .tg or IR text (str), or a Module; not bytes (decode it first)")
    if data_parallel_options and data_parallel is None:
        raise TypeError(f"compile() got an unexpected keyword argument '{next(iter(data_parallel_options))}'")
    options = options or Options()
    options = options.with_(dtype=dtype, dims=tuple(sorted(dims.items())) if dims is not None else options.dims)
    dims = dict(options.dims) or None
    dp = (data_parallel, dict(data_parallel_options or {}))
    if isinstance(source, Module):
        return _build(source, dims, options, None, None, be, dp)
    if isinstance(source, os.PathLike) or (isinstance(source, str) and "\n" not in source
                                              and source.endswith((".tg", ".tgir"))):
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
    if key is not None and data_parallel is None:
        program = _cached(key, options, be)
        if program is not None:
            return program
    loaded = load_program(name, options, None if name not in ("<ir>", "<source>") else source)
    reads = None
    if key is not None:
        from tgc.backends.cache import Reads

        reads = Reads.of(loaded)
    return _build(loaded.module, dims, options, key, reads, be, dp)


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
            from tgc.frontend import import_folders

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


def _build(module, dims, options, key, reads, be, dp=(None, {})):
    module = fix_dims(module, dims or {})
    opts = options.with_(dims=())
    data_parallel, dp_options = dp
    if data_parallel is not None:   # split at the gradient boundary before the pipeline
        from tgc.distributed import DataParallel

        return DataParallel(module, data_parallel, opts, be.name, **dp_options, cache_key=key, reads=reads)
    return compile_cached(module, opts, be.name, key, reads, lookup=False, stacklevel=5)


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
    lowered = lower(module, options)
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


def gradient_module(module: Module, wrt: list[str], of: str | None, mode: str) -> Module:
    """A module whose outputs are d(of)/d(x) for each x in `wrt` (still underived).

    `of` defaults to the only scalar output. Reverse mode uses `grad`; forward mode
    seeds `jvp` with an identity over fresh copies of x's edges, then renames back.
    """
    from tgc.ir import values as V
    from tgc.ir.affine import Affine, Relation
    from tgc.ir.complex_io import RI
    from tgc.ir.module import Output

    scalars = [o.name for o in module.outputs if not o.value.edges]
    outputs = {o.name: o for o in module.outputs}
    if of is None:
        if len(scalars) != 1:
            raise CompileError(f"--of is needed: the program has {len(scalars)} scalar outputs"
                               + (f" ({', '.join(scalars)})" if scalars else ""))
        of = scalars[0]
    if of not in outputs:
        raise CompileError(f"--of {of}: no such output (outputs: {', '.join(outputs) or 'none'})"
                           + did_you_mean(of, outputs))
    f = outputs[of].value
    if RI in f.edges:
        raise CompileError(f"--of {of}: the output is complex; its derivative needs an explicit cotangent v: "
                           f"write vjp({of}, x, v) in the program")
    m = Module(dict(module.dims), dict(module.edges), dict(module.args))
    for name in wrt:
        arg = module.args.get(name)
        if arg is None or arg.dtype == "i32":
            raise CompileError(f"--wrt {name}: not a float input, param or state of the program" + did_you_mean(
                name, [a.name for a in module.args.values() if a.dtype != "i32"]))
        x = V.arg(name, arg.dtype, arg.order)
        if set(f.edges) & set(x.edges):
            raise CompileError(f"--of {of} and --wrt {name} share an edge; rename one of them first")
        if mode == "rev":
            value = V.grad(f, x)
        else:
            copies = {e: m.fresh_edge(e, m.edges[e]) for e in x.edges}
            seed = V.mul([V.indicator(Relation((Affine.make([(e, 1)]), Affine.make([(c, 1)])), ("=",)), f.dtype)
                          for e, c in copies.items()]) if copies else V.const(1.0, f.dtype)
            value = V.rename(V.jvp(f, x, seed), {c: e for e, c in copies.items()})
        m.outputs.append(Output(_fresh_output(m, f"d{name}"), value, tuple(module.order_edges(f.edges)) + arg.order))
    return m


def _fresh_output(m: Module, base: str) -> str:
    taken = set(m.args) | set(m.edges) | {o.name for o in m.outputs}
    name, n = base, 1
    while name in taken:
        name, n = f"{base}_{n}", n + 1
    return name


def fix_dims(module: Module, dims: dict[str, int]) -> Module:
    """A copy of `module` with the symbolic dims named in `dims` given fixed sizes."""
    for d, n in dims.items():   # a fixed or derived dim may be named with its own size (checked below)
        why = module.dim_error(d, n, bind=False)
        if why:
            raise ValueError(why)
    given = {d: int(n) for d, n in dims.items() if module.dims[d] is None}
    new = dict(module.dims)
    new.update(given)
    from tgc.ir.sizes import SizeError, UnboundDim, size_eval_checked

    env = {d: n for d, n in new.items() if isinstance(n, int)}
    for d, s in new.items():   # a derived dim these sizes fix is fixed too (and must fit)
        if s is not None and not isinstance(s, int):
            try:
                env[d] = size_eval_checked(s, env, f"dim '{d}'")
            except UnboundDim:
                continue
            except SizeError as e:
                raise ValueError(str(e)) from None
            if not 0 < env[d] <= MAX_SIZE:
                raise ValueError(f"dim '{d}' is {env[d]}: a size is a positive integer (at most 2^62)")
            new[d] = env[d]
    for d, n in dims.items():   # a fixed or derived dim may be named with the size it has
        if d not in given and env.get(d) != n:
            have = f"is {env[d]}" if d in env else f"is derived from other dims ({size_str(module.dims[d])})"
            raise ValueError(f"dim '{d}' {have}, not {n}")
    return Module(new, dict(module.edges), dict(module.args), list(module.outputs), list(module.updates),
                  list(module.facts))


def read_args(module: Module) -> set[str]:
    """The arguments some output or update reads."""
    return {v.attrs[0] for v in module.values() if v.op == "arg"}


def used_dims(module: Module) -> set[str]:
    """The dims the outputs and updates depend on: those of every edge their values,
    attributes (reductions, reindexing, sizes) and ABI orders mention, and the dims
    those are derived from. Over-approximates: any name in an attribute counts."""
    import dataclasses

    found: set[str] = set()

    def walk(x) -> None:
        if isinstance(x, str):
            if x in module.edges:
                found.add(module.edges[x])
            elif x in module.dims:
                found.add(x)
        elif isinstance(x, (tuple, list, frozenset, set)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for k, y in x.items():
                walk(k)
                walk(y)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))

    for v in module.values():
        walk(v.edges)
        walk(v.attrs)
    walk([o.order for o in module.outputs])
    walk([module.args[u.target].order for u in module.updates])
    todo = list(found)
    while todo:
        s = module.dims.get(todo.pop())
        if s is not None and not isinstance(s, int):
            before = set(found)
            walk(s)
            todo += list(found - before)
    return found


def drop_unread_args(module: Module, keep_dims: bool = True) -> Module:
    """A copy of `module` without the arguments that nothing reads.

    With `keep_dims`, an unread argument stays when it is the only one to carry a
    symbolic dim that the program uses (a call binds that dim from its shape)."""
    read = read_args(module)
    needed = used_dims(module) if keep_dims else set()
    carried = {module.edges[e] for n in read for e in module.args[n].order if module.dims[module.edges[e]] is None}
    args = {}
    for name, a in module.args.items():
        dims = {module.edges[e] for e in a.order if module.dims[module.edges[e]] is None}
        if name in read or (dims & needed) - carried:
            args[name] = a
            carried |= dims
    facts = [f for f in module.facts   # a fact on a dropped argument goes with it
             if all(v.attrs[0] in args for v in topo_order([f.lhs, f.rhs]) if v.op == "arg")]
    return Module(dict(module.dims), dict(module.edges), args, list(module.outputs), list(module.updates), facts)


def forward_only(module: Module) -> Module:
    """`module` without its updates and without the arguments only they read: the
    forward (evaluation) program. Values that only the updates needed are no longer
    reachable from any root, so the pipeline and the lowering never see them."""
    pruned = Module(dict(module.dims), dict(module.edges), dict(module.args), list(module.outputs), [],
                    list(module.facts))
    return drop_unread_args(pruned)
