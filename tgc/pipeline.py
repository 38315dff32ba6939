"""The library entry points the CLI and the Python API share.

`load(path, options)` reads a `.tg` program (front end) or a `.tgir` file (IR
parser) into a module; `lower(module, options, emit)` runs the pass pipeline.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from tgc.ir.diag import CompileError, Loc
from tgc.ir.module import Module
from tgc.ir.sizes import MAX_SIZE, size_str
from tgc.ir.values import topo_order
from tgc.options import Options
from tgc.manager import PipelineResult, run_pipeline

if TYPE_CHECKING:   # the front end is imported where a program is loaded
    from tgc.frontend.elaborate import Elaborated


def read_text(path: str) -> str:
    """The file's text ('-' is stdin); unreadable or non-UTF-8 input is a located error."""
    from tgc.fsutil import NotASource, read_source_bytes

    try:
        data = read_source_bytes(None if path == "-" else path)
    except IsADirectoryError:
        raise CompileError("is a directory, not a file", Loc(path, 1, 1)) from None
    except NotASource as e:
        raise CompileError(f"cannot read file: {e}", Loc(path, 1, 1)) from None
    except OSError as e:
        raise CompileError(f"cannot read file: {e.strerror or e}", Loc(path, 1, 1)) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise CompileError(f"invalid UTF-8 byte 0x{data[e.start]:02x}", Loc(path, line, col)) from None


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


def load_program(path: str, options: Options) -> "Elaborated":
    """Parse and check a `.tg` program ('-' is stdin), or read a `.tgir` module;
    with the files it read and its warnings."""
    from tgc.frontend.elaborate import Elaborated, elaborate_source

    name = "<stdin>" if path == "-" else path
    if is_ir_file(path):
        from tgc.ir.parser import parse_module  # only for .tgir input

        return Elaborated(parse_module(read_text(path), name), [] if path == "-" else [path])
    if path == "-":
        return elaborate_source(read_text(path), name, options)
    from tgc.frontend.elaborate import elaborate_file

    return elaborate_file(path, options)


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
        raise CompileError(f"--of {of}: no such output (outputs: {', '.join(outputs) or 'none'})")
    f = outputs[of].value
    if RI in f.edges:
        raise CompileError(f"--of {of}: the output is complex; its derivative needs an explicit cotangent v: "
                           f"write vjp({of}, x, v) in the program")
    m = Module(dict(module.dims), dict(module.edges), dict(module.args))
    for name in wrt:
        arg = module.args.get(name)
        if arg is None or arg.dtype == "i32":
            raise CompileError(f"--wrt {name}: not a float input, param or state of the program")
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
    unknown = [d for d in dims if d not in module.dims]
    if unknown:
        raise ValueError(f"the program has no dim '{unknown[0]}'")
    import numbers

    for d, n in dims.items():
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 0 < n <= MAX_SIZE:
            raise ValueError(f"dim '{d}' = {n!r}: a size is a positive integer (at most 2^62)")
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
