"""Elaborate a parsed program into an IR module.

Statements are processed in order (functions are hoisted): dims and edges are
declared into one namespace, tensors become arguments, bindings become values,
imports bring another file's dims and functions (its other statements are
skipped, each with a warning), and `out`/`update` become the module's roots. Function definitions are checked where written and inlined at
their calls. Every mistake is a located `CompileError`.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import sys
from collections import ChainMap
from dataclasses import dataclass, field
from pathlib import Path

from tgc.frontend import ast
from tgc.frontend.folders import import_folders
from tgc.frontend.complexes import COMPLEX_DTYPES, abi_order, ensure_edge, is_complex
from tgc.frontend.builtins import call_builtin
from tgc.frontend.edgeops import apply_edge_ops
from tgc.frontend.expressions import Ctx, Elaborator, Forms, Loop
from tgc.frontend.functions import check_definition, check_names, check_recursion, inline_call, loop_call
from tgc.frontend.parser import parse, read_source
from tgc.ir.collector import gc_paused
from tgc.frontend.scope import FnInfo, Scope
from tgc.ir import values as V
from tgc.ir.diag import CompileError, Diagnostic, Loc, did_you_mean
from tgc.ir.dtypes import TYPES
from tgc.ir.module import Arg, Fact, Module, Output, Update
from tgc.ir.sizes import MAX_SIZE, Size, SizeError, size_op, size_str
from tgc.options import Options

PRELUDE = Path(__file__).with_name("prelude.tg")


@dataclass
class Elaborated:
    module: Module
    files: list[str] = field(default_factory=list)  # the program's file and every import
    warnings: list[Diagnostic] = field(default_factory=list)
    texts: dict[str, str] = field(default_factory=dict)  # each of `files`: the text read from it
    absent: list[str] = field(default_factory=list)  # paths an import looked at first and found no file at
    widened: list[Diagnostic] = field(default_factory=list)  # of `warnings`, the types named wider than the program's: their values are held at its width, which every command that builds says (tgc.cli.errors.report_widened)


def _shorten(text: str, limit: int = 80) -> str:
    """`text` with unprintable characters escaped, or its start and end around '...'
    when it is longer than `limit`."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-limit // 2:]}"


@functools.lru_cache(maxsize=1)
def _prelude() -> dict[str, FnInfo]:
    text, name = read_source(PRELUDE)
    table: dict[str, FnInfo] = {}
    for item in parse(text, name).items:
        if isinstance(item, ast.FnDef):
            check_definition(item)
            table[item.name] = FnInfo(item, table)
    check_recursion(table, list(table))
    return table


FORMS = Forms(call_builtin, apply_edge_ops, inline_call, loop_call)


class ProgramBuilder:
    def __init__(self, options: Options):
        self.m = Module()
        self.scope = Scope()
        self.el = Elaborator(self.m, self.scope, options.dtype, FORMS)
        self.fns: dict[str, FnInfo] = dict(_prelude())
        self.user_fns: list[str] = []
        self.grads: dict[str, V.Value] = {}  # bindings written `name = grad(f, x)`
        self.files: list[str] = []
        self.import_stack: list[tuple[Path, Loc | None]] = []
        self.import_dirs = tuple(options.import_dirs)
        self.imported: set[Path] = set()
        self.sources: dict[str, str] = {}  # file name -> its text (an assume keeps its own)
        self.absent: list[str] = []   # paths an import looked at before the file it found
        self.skipped: list[Diagnostic] = []   # warnings: an imported file's statements other than dim and fn
        self.unused_locals: list[Diagnostic] = []   # warnings: bindings of a for block never read

    @functools.cached_property
    def ctx(self) -> Ctx:
        """The top level's context, made once: it holds the builder's own dicts of
        tensors and functions, which grow as the statements are elaborated."""
        return Ctx(self.scope.tensors, {}, self.fns)

    # ---- files and imports ----------------------------------------------------------

    def file(self, text: str, name: str, top: bool) -> None:
        """Imports first, then every function (hoisted and checked), then the rest in order."""
        program = parse(text, name)
        self.files.append(name)
        self.sources[name] = text
        here = Path(name)
        for item in program.items:
            if isinstance(item, ast.Import):
                self._Import(item, here)
        defined = [item.name for item in program.items if isinstance(item, ast.FnDef)]
        for item in program.items:
            if isinstance(item, ast.FnDef):
                self.function(item)
        check_recursion(self.fns, defined)
        for item in program.items:
            if isinstance(item, (ast.FnDef, ast.Import)):
                continue
            if top or isinstance(item, ast.DimDecl):
                getattr(self, f"_{type(item).__name__}")(item, here)
            else:   # an import brings dims and functions only: say what it leaves out, where
                self.skipped.append(Diagnostic("warning", f"{_statement(item)} in an imported file is skipped: "
                                               "an import brings only dims and functions", item.loc))
        if top:  # after every call: those report their own errors with the call's context
            for fn in self.user_fns:
                check_names(self.fns[fn].defn, self.fns, self.scope.kinds)

    def _Import(self, item: ast.Import, here: Path) -> None:
        """Import a .tg file by a path relative to the importing file; it must lie
        inside that file's folder, or inside a folder given with -I (there also by a
        path relative to that folder). Nothing else is read, so no error can show a
        line of another kind of file."""
        if not item.path.endswith(".tg"):
            raise CompileError(f"cannot import '{item.path}': imports name .tg files", item.loc)
        try:   # a name the OS refuses (too long, a NUL, a loop of links) is the user's error
            bases = import_folders(here, self.import_dirs)
            looked = [b / item.path for b in bases]
            found = next((i for i, p in enumerate(looked) if p.is_file()), None)
            path = here.parent / item.path if found is None else looked[found]
            key = path.resolve()
        except (OSError, ValueError, RuntimeError) as e:   # RuntimeError: pathlib's symlink loop
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            why = "a loop of symbolic links" if isinstance(e, RuntimeError) else why
            raise CompileError(f"cannot import '{_shorten(item.path)}': {why}", item.loc) from None
        if not any(key.is_relative_to(b) for b in bases):
            raise CompileError(f"cannot import '{item.path}': it lies outside the importing file's folder "
                               f"({bases[0]}); allow its folder with -I DIR", item.loc)
        chain = [p for p, _ in self.import_stack]
        if key in chain or key == Path(self.files[0]).resolve():
            names = " -> ".join(str(p.name) for p in [Path(self.files[0])] + chain + [key])
            raise CompileError(f"import cycle: {names}", item.loc)
        self.absent += [str(p) for p in looked[:found or 0]]
        if key in self.imported:
            return
        if not path.is_file():
            raise CompileError(f"cannot find imported file '{item.path}' (looked for {path})", item.loc)
        self.imported.add(key)
        text, name = read_source(path)
        self.import_stack.append((key, item.loc))
        try:
            self.file(text, name, top=False)
        except CompileError as e:
            e.notes.append(Diagnostic("note", "in the file imported here", item.loc))
            raise
        finally:
            self.import_stack.pop()

    # ---- declarations -----------------------------------------------------------

    def function(self, d: ast.FnDef) -> None:
        self.scope.declare(d.name, "fn", d.loc)
        check_definition(d)
        self.fns[d.name] = FnInfo(d, self.fns)
        self.user_fns.append(d.name)

    def _DimDecl(self, d: ast.DimDecl, here: Path) -> None:
        size = None if d.expr is None else self.dim_size(d.expr)
        if isinstance(size, int) and size <= 0:
            raise CompileError(f"dim '{d.name}' must have a positive size, not {size}", d.expr.loc)
        if isinstance(size, int) and size > MAX_SIZE:
            raise CompileError(f"dim '{d.name}' is too large ({size}; at most {MAX_SIZE})", d.expr.loc)
        self.scope.declare(d.name, "dim", d.loc)
        self.m.dims[d.name] = size
        self.m.edges[d.name] = d.name

    def dim_size(self, e) -> Size:
        if isinstance(e, ast.Num):
            if not isinstance(e.value, int):
                raise CompileError(f"a dim size must be an integer, not {e.value}", e.loc)
            return e.value
        if isinstance(e, ast.Name):
            if e.id not in self.m.edges:
                raise CompileError(f"unknown dim '{e.id}'" + did_you_mean(e.id, self.m.edges), e.loc)
            return self.m.size(e.id)
        if isinstance(e, ast.BinOp) and e.op in "+-*/":
            a, b = self.dim_size(e.lhs), self.dim_size(e.rhs)
            if e.op == "/" and b == 0:
                raise CompileError("division by zero in a dim expression", e.loc)
            try:
                return size_op(e.op, a, b)
            except SizeError:
                if b == 0:
                    raise CompileError("division by zero in a dim expression", e.loc) from None
                raise CompileError(f"{a} / {b} does not divide exactly: dim sizes are integers", e.loc) from None
        raise CompileError("a dim size is an integer expression of dims with + - * /", e.loc)

    def _TensorDecl(self, d: ast.TensorDecl, here: Path) -> None:
        self.check_dotted(d.name, d.kind, d.loc)
        if d.kind == "param" and self.el.every_param:
            raise CompileError(f"param '{d.name}' is declared after a list 'params' that stands for every param "
                               "declared before it: declare the params first", d.loc,
                               [Diagnostic("note", "the list 'params' is here", self.el.every_param[0])])
        # a float type at most the program's width (f32 in an f64 program is f32; f64 in an
        # f32 program is f32); a complex one's parts likewise (c64: f32 parts)
        named = {"c64": "f32", "c128": "f64"}.get(d.dtype, d.dtype)
        dtype = (self.el.dtype if named is None else named if named == "i32"
                 else self.el.width(named, d.loc, f"{d.kind} '{d.name}': {d.dtype}", d.dtype in COMPLEX_DTYPES))
        if dtype == "i32" and d.kind != "input":
            raise CompileError(f"a {d.kind} must be a float tensor; only inputs can be i32", d.loc)
        order = []
        for spec in d.edges:
            edge = self.edge_spec(spec)
            if edge in order:
                raise CompileError(f"edge '{spec.name}' appears twice in '{d.name}'", spec.loc)
            order.append(edge)
        if d.dtype in COMPLEX_DTYPES:   # interleaved parts: a last edge of size 2 (tgc/frontend/complexes.py)
            order.append(ensure_edge(self.m))
        self.check_fixed_bytes(f"{d.kind} '{d.name}'", order, dtype, d.loc)
        self.scope.declare(d.name, "tensor", d.loc)
        self.m.args[d.name] = Arg(d.name, d.kind, dtype, tuple(order), d.loc)
        self.scope.tensors[d.name] = V.arg(d.name, dtype, order, d.loc)

    def check_dotted(self, name: str, kind: str, loc: Loc) -> None:
        """A name `m.wq` declared outside a for block (as `tgc grad --emit tg` writes
        the per-param states it reads) names a declared tensor after its '.'."""
        head, dot, tail = name.rpartition(".")
        if dot and tail not in self.m.args:
            raise CompileError(f"'{kind} {name}' outside a for block: '{tail}' is no declared tensor (per-param "
                               f"states are declared as `state {head}.p` inside `for p in LIST {{ ... }}`)", loc)

    def check_fixed_bytes(self, what: str, edges, dtype: str, loc: Loc | None) -> None:
        """A tensor whose every edge has a fixed size must fit the size limit (2^62
        bytes, the one the runtime enforces on each call): otherwise no call could
        ever run, so it is the source's error, reported where the tensor is declared."""
        sizes = [self.m.size(e) for e in edges]
        if not all(isinstance(s, int) for s in sizes):
            return
        count = 1
        for s in sizes:
            count *= s
        bits = TYPES[dtype].bits    # an f32 value of an f64 program has an f64 buffer (docs/dtypes.md)
        if TYPES[dtype].is_float and not TYPES[dtype].low:
            bits = max(bits, TYPES[self.el.dtype].bits)
        if count * (bits // 8) > MAX_SIZE:
            shape = " x ".join(str(s) for s in sizes)
            raise CompileError(f"{what} would take more than 2^62 bytes ({shape} {dtype} elements; "
                               f"the size limit)", loc)

    def edge_spec(self, spec: ast.EdgeSpec) -> str:
        if spec.dim is None:
            if spec.name not in self.m.edges:
                raise CompileError(f"unknown edge '{spec.name}' (declare it with `dim {spec.name}` "
                                   f"or give its size as `{spec.name}: DIM`)" + did_you_mean(spec.name, self.m.edges),
                                   spec.loc)
            return spec.name
        if spec.dim not in self.m.edges:
            raise CompileError(f"unknown dim '{spec.dim}'" + did_you_mean(spec.dim, self.m.edges),
                               spec.dim_loc or spec.loc)
        dim = self.m.edges[spec.dim]
        if spec.name in self.m.edges:
            if self.m.size(spec.name) != self.m.size(spec.dim):
                old = self.size_text(spec.name, self.m.edges[spec.name])
                new = self.size_text(spec.dim, self.m.edges[spec.dim])
                raise CompileError(f"edge '{spec.name}' is used with two sizes: {new} here, {old} before",
                                   spec.loc, [Diagnostic("note", f"'{spec.name}' got its size here",
                                                         self.scope.locs.get(spec.name))])
            return spec.name
        self.scope.declare(spec.name, "edge", spec.loc)
        self.m.edges[spec.name] = dim
        return spec.name

    def size_text(self, edge: str, dim: str | None = None) -> str:
        """An edge's size for messages: `n = 3`, or the expression of symbolic dims."""
        s = self.m.size(edge)
        text = str(s) if isinstance(s, int) else size_str(s)
        return f"{dim} = {text}" if dim and dim != text else text

    # ---- bindings, outputs, updates ---------------------------------------------------

    def _Bind(self, b: ast.Bind, here: Path) -> None:
        value = self.el.expr(b.expr, self.ctx)
        self.scope.declare(b.name, "tensor", b.loc)
        self.scope.tensors[b.name] = value
        if self.is_grad_call(b.expr, value):
            self.grads[b.name] = value

    def _Out(self, o: ast.Out, here: Path, ctx: Ctx | None = None) -> None:
        ctx = ctx or self.ctx
        if any(out.name == o.name for out in self.m.outputs):
            raise CompileError(f"output '{o.name}' is declared twice", o.loc)
        if not ctx.loops and o.expr is not None:
            self.check_dotted(o.name, "out", o.loc)
        if o.expr is None:
            if o.name not in self.scope.tensors:
                kind = self.scope.kinds.get(o.name) or ("fn" if o.name in self.fns else None)
                if kind:
                    what = {"edge": "an edge", "dim": "a dim (an edge)", "fn": "a function"}[kind]
                    raise CompileError(f"'{o.name}' is {what}, not a tensor: only tensors can be outputs", o.loc)
                raise CompileError(f"unknown name '{o.name}'" + did_you_mean(o.name, self.scope.tensors), o.loc)
            value = self.scope.tensors[o.name]
            self.el.used.add(o.name)
        else:
            value = self.el.expr(o.expr, ctx)
            self.scope.declare(o.name, "tensor", o.loc)
            self.scope.tensors[o.name] = value
        if value.dtype == "i32":
            raise CompileError("outputs are float tensors; an i32 tensor cannot be an output", o.loc)
        self.check_fixed_bytes(f"output '{o.name}'", value.edges, value.dtype, o.loc)
        self.m.outputs.append(Output(o.name, value, self.output_order(o, value), o.loc))

    def output_order(self, o: ast.Out, value: V.Value) -> tuple[str, ...]:
        if o.order is not None:
            return self.explicit_order(o, value)
        grad = value if self.is_grad_call(o.expr, value) else self.grads.get(o.name) if o.expr is None else None
        if grad is not None:
            x = self.m.args[grad.operands[1].attrs[0]]
            return self.m.order_edges(grad.operands[0].edges) + x.order
        return abi_order(self.m, value.edges)

    def is_grad_call(self, e, value: V.Value) -> bool:
        """`e` is written `grad(f, x)`: its output order is x's declaration order."""
        return isinstance(e, ast.Call) and e.fn == "grad" and value.op == "grad"

    def explicit_order(self, o: ast.Out, value: V.Value) -> tuple[str, ...]:
        """The order written on `out`: exactly the value's edges, each once."""
        have = ", ".join(self.m.order_edges(value.edges))
        order: list[str] = []
        for e in o.order:
            edge = self.el.edge(e.id, e, self.ctx)
            if edge not in value.edges:
                raise CompileError(f"output '{o.name}' has no edge '{e.id}' (its edges: [{have}])", e.loc)
            if edge in order:
                raise CompileError(f"edge '{e.id}' is listed twice in the order of '{o.name}'", e.loc)
            order.append(edge)
        if is_complex(value):   # the parts edge cannot be written: it is last
            order.append(ensure_edge(self.m))
        missing = [e for e in self.m.order_edges(value.edges) if e not in order]
        if missing:
            raise CompileError(f"the order of output '{o.name}' misses edge '{missing[0]}' (its edges: [{have}])",
                               o.order[0].loc if o.order else o.loc)
        return tuple(order)

    def _Update(self, u: ast.Update, here: Path, ctx: Ctx | None = None) -> None:
        ctx = ctx or self.ctx
        arg = self.m.args.get(u.name)
        if arg is None:
            kind = self.scope.kinds.get(u.name)
            what = f"'{u.name}' is not a param or state" if kind else f"unknown name '{u.name}'" + did_you_mean(
                u.name, [a.name for a in self.m.args.values() if a.kind != "input"])
            raise CompileError(f"cannot update: {what}", u.loc)
        if arg.kind == "input":
            raise CompileError(f"cannot update input '{u.name}': only params and states are updated", u.loc,
                               [Diagnostic("note", f"'{u.name}' is declared here", arg.loc)])
        if any(up.target == u.name for up in self.m.updates):
            raise CompileError(f"'{u.name}' is updated twice", u.loc)
        value = self.el.fexpr(u.expr, ctx)
        if is_complex(value) != is_complex(self.scope.tensors[u.name]):
            if is_complex(value):
                raise CompileError(f"the update of real '{u.name}' is complex: take real() of it", u.expr.loc)
            value = self.el.cx.promote(value, u.loc)
        extra = [e for e in value.edges if e not in arg.order]
        if extra:
            raise CompileError(f"the update of '{u.name}' has edge '{extra[0]}', which '{u.name}' "
                               f"does not have ([{', '.join(arg.order)}])", u.expr.loc)
        if len(value.edges) < len(arg.order):
            value = V.contract([value], arg.order, loc=u.loc)
        value = V.convert(value, arg.dtype, loc=u.loc)   # stored in the target's type (rounded)
        self.m.updates.append(Update(u.name, value, u.loc))

    # ---- for blocks ------------------------------------------------------------------

    def _For(self, f: ast.For, here: Path) -> None:
        """`for p in LIST { ... }`: the body elaborated once per listed tensor, with `p`
        standing for it. Its bindings are local to each instance; `state m.p` declares
        the state `m.<tensor>` with the tensor's edges and dtype; `update` and `out`
        name `p`, `m.p` or `o.p` (one target per instance)."""
        names = self.el.tensor_list(f.var, f.names, self.ctx)
        locals_: dict[str, Loc] = {}
        for item in f.body:
            self.check_local(item, f, locals_)
        used_before = {n for n in locals_ if n in self.el.used}
        for name in names:
            local: dict[str, V.Value] = {}
            ctx = Ctx(ChainMap(local, self.scope.tensors), {}, self.fns,
                      loops={f.var.id: Loop(name, names)})
            for item in f.body:
                self.instance_statement(item, f, ctx, local)
        for n, loc in locals_.items():   # bindings of the body that no instance reads
            if n not in self.el.used and n not in used_before:
                self.unused_locals.append(Diagnostic("warning", f"'{n}' is never used", loc))
            if n not in used_before:
                self.el.used.discard(n)

    def check_local(self, item, f: ast.For, locals_: dict[str, Loc]) -> None:
        """What a for block may hold: per-instance states `state m.p`, local bindings
        with new names, and updates and outputs."""
        var = f.var.id
        if isinstance(item, ast.TensorDecl):
            head, dot, tail = item.name.rpartition(".")
            if item.kind != "state" or tail != var or not dot:
                raise CompileError(f"a for block declares only per-instance states, `state NAME.{var}`; "
                                   f"not {item.kind} '{item.name}'", item.loc)
            if item.edges or item.dtype:
                raise CompileError(f"'state {item.name}' has the edges and dtype of '{var}': give it none", item.loc)
        elif isinstance(item, ast.Bind):
            # a program binding's name may be taken: the local hides it inside the block
            binding = self.scope.kinds.get(item.name) == "tensor" and item.name not in self.m.args
            if item.name == var or (item.name in self.scope.kinds and not binding) or item.name in locals_:
                where = locals_.get(item.name) or self.scope.locs.get(item.name)
                notes = [Diagnostic("note", f"'{item.name}' was first declared here", where)] if where else []
                raise CompileError(f"'{item.name}' is already declared: a binding in a for block takes a new name",
                                   item.loc, notes)
            locals_[item.name] = item.loc
        elif isinstance(item, ast.Out):
            if item.name.rpartition(".")[2] != var or "." not in item.name:
                raise CompileError(f"an output in a for block is named per instance, `out NAME.{var} = ...`; "
                                   f"not '{item.name}'", item.loc)

    def instance_statement(self, item, f: ast.For, ctx: Ctx, local: dict[str, V.Value]) -> None:
        """One statement of one instance of a for block."""
        rename = functools.partial(self.el.instance_name, ctx=ctx)
        try:
            if isinstance(item, ast.TensorDecl):
                self.instance_state(rename(item.name), ctx, item.loc)
            elif isinstance(item, ast.Bind):
                local[item.name] = self.el.expr(item.expr, ctx)
            elif isinstance(item, ast.Update):
                target = rename(item.name)
                if target != item.name and target not in self.m.args:
                    raise CompileError(f"cannot update '{item.name}': it is '{target}' here, which is not declared "
                                       f"(declare `state {item.name}` first in the for block)", item.loc)
                self._Update(dataclasses.replace(item, name=target), Path(), ctx)
            elif isinstance(item, ast.Out):
                o = dataclasses.replace(item, name=rename(item.name))
                self._Out(o, Path(), ctx)
        except CompileError as e:
            current = ctx.loops[f.var.id].current
            e.notes.append(Diagnostic("note", f"in the instance of the for block for '{current}'", f.loc))
            raise

    def instance_state(self, name: str, ctx: Ctx, loc: Loc) -> None:
        """The state `m.wq` of one instance: the edges and dtype of its tensor."""
        of = self.m.args[next(iter(ctx.loops.values())).current]
        self.scope.declare(name, "tensor", loc)
        self.m.args[name] = Arg(name, "state", of.dtype, of.order, loc)
        self.scope.tensors[name] = V.arg(name, of.dtype, of.order, loc)

    def _Assume(self, a: ast.Assume, here: Path) -> None:
        """A fact about the inputs: both sides are float expressions of the program's
        arguments (no derivative), broadcast by edge name as in `lhs - rhs`."""
        sides = [self.el.fexpr(a.lhs, self.ctx), self.el.fexpr(a.rhs, self.ctx)]
        seen = V.topo_order(sides)
        deriv = next((v for v in seen if v.op in V.DERIVATIVE_OPS), None)
        if deriv is not None:
            raise CompileError(f"an assumption is a fact about the inputs; it cannot take a derivative "
                               f"('{deriv.op}')", deriv.loc or a.loc)
        if not any(v.op == "arg" for v in seen):
            raise CompileError("an assumption states a fact about the inputs, but this one reads no input, "
                               "param or state", a.loc)
        self.m.facts.append(Fact(a.op, sides[0], sides[1], self.source_text(a.loc), a.loc))

    def source_text(self, loc: Loc) -> str:
        """The program text that `loc` spans, its whitespace runs made one space."""
        lines = self.sources.get(loc.file, "").splitlines()[loc.line - 1:loc.end_line or loc.line]
        if not lines:
            return ""
        if loc.end_line and loc.end_col:
            lines[-1] = lines[-1][:loc.end_col - 1]
        lines[0] = lines[0][loc.col - 1:]
        text = " ".join(" ".join(lines).split())
        return text.replace('"', "'")

    def finish(self) -> Module:
        self.check_c_names([(a.name, a.loc) for a in self.m.args.values()], "argument")
        self.check_c_names([(o.name, o.loc) for o in self.m.outputs], "output")
        names = {o.name: o for o in self.m.outputs}
        for u in self.m.updates:   # the new value of an output's namesake is reported as `name'`
            key = self.m.update_key(u.target)
            if key != u.target and key in names:
                raise CompileError(f"output '{key}' takes the name under which the update of '{u.target}' is "
                                   f"returned (output '{u.target}' holds its value before the step)", names[key].loc)
        from tgc.ir.lowp import explicit_rounding, has_low, narrow_constants

        if has_low(self.m):   # bf16/f16 ops: computed in the float type, then converted (rounded)
            self.m = explicit_rounding(self.m)
        if self.el.dtype == "f64":   # numbers in f32 operations are f32 (as in an f32 program)
            self.m = narrow_constants(self.m)
        return self.m

    @staticmethod
    def check_c_names(named: list[tuple[str, Loc | None]], what: str) -> None:
        """No two arguments (or outputs) whose names are one identifier in C, where the
        header writes every character but letters, digits and '_' as '_' (`m.wq` and
        `m_wq` are both `m_wq`)."""
        seen: dict[str, tuple[str, Loc | None]] = {}
        for name, loc in named:
            c = re.sub(r"[^A-Za-z0-9_]", "_", name)
            if c in seen and seen[c][0] != name:
                first, first_loc = seen[c]
                notes = [Diagnostic("note", f"'{first}' is declared here", first_loc)] if first_loc else []
                raise CompileError(f"{what} '{name}' and {what} '{first}' have one name in C, '{c}' (the "
                                   f"header of `tgc build` writes '.' and \"'\" as '_'): rename one", loc, notes)
            seen.setdefault(c, (name, loc))

    def warnings(self) -> list[Diagnostic]:
        """Inputs and bindings that nothing reads; types named wider than the program's."""
        out = []
        outputs = {o.name for o in self.m.outputs}
        for name, kind in self.scope.kinds.items():
            if kind != "tensor" or name in self.el.used or name in outputs:
                continue
            arg = self.m.args.get(name)
            what = f"{arg.kind} '{name}'" if arg else f"'{name}'"
            out.append(Diagnostic("warning", f"{what} is never used", self.scope.locs[name]))
        return self.skipped + out + self.unused_locals + self.el.capped


def _statement(item) -> str:
    """A top-level statement as a warning names it."""
    if isinstance(item, ast.TensorDecl):
        return f"{item.kind} '{item.name}'"
    if isinstance(item, ast.Out):
        return f"out '{item.name}'"
    if isinstance(item, ast.Update):
        return f"update of '{item.name}'"
    if isinstance(item, ast.Bind):
        return f"binding '{item.name}'"
    if isinstance(item, ast.Assume):
        return "assume"
    if isinstance(item, ast.For):
        return "for block"
    return "statement"


def elaborate_source(text: str, filename: str, options: Options) -> Elaborated:
    """Parse and elaborate a program given as text (imports resolve beside `filename`)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20000))
    try:
        with gc_paused():
            b = ProgramBuilder(options)
            b.file(text, filename, top=True)
            return Elaborated(b.finish(), b.files, b.warnings(), {f: b.sources[f] for f in b.files}, b.absent,
                              list(b.el.capped))
    except RecursionError:  # the limits on nesting and calls should come first; this is the backstop
        raise CompileError("the program is nested too deeply to compile (expressions inside calls inside "
                           "expressions ...): split it into several bindings", Loc(filename, 1, 1)) from None
    finally:
        sys.setrecursionlimit(limit)


def elaborate_file(path: str, options: Options) -> Elaborated:
    text, name = read_source(path)
    return elaborate_source(text, name, options)
