"""Read the lowered program's text (`print_lowered` writes it) back into a `Lowered`.

The text is the header line `// lowered after STAGE (DTYPE)`, the edges lowering
made, buffer declarations, workspace slots, id checks, the kernels (`k0: ...`), and a
`module { ... }` block holding the IR module the program was lowered from (read by
`tgc.ir.parser`; it gives the dims, arguments, outputs and updates, and the values
`--verify-each` compares a lowering stage with). The rest is parsed by lark's LALR
parser over `lowered.lark` extended by the loaded backends' own kinds of kernel
(`KernelForm`s, registered by `tgc.backends.base.get_backend`); a tree walk then
builds the kernels.

A loop's step (`StepLoop`) is a whole program, written as the block indented under
its `steps ... {` line and closed by the line `  }`; it is taken out and read as a
program (its lines keep their numbers) before the grammar sees the rest.

An index is written without its buffer edges (`%x[b, i + 1]`): they are the buffer's
declared edges (sorted), or a group register's (`reg %t3[rows]`). So the walk reads
declarations first, then kernels. `parse_lowered(print_lowered(low))` equals `low`
(its module up to source locations, which the text leaves out); the property test
`tests/lower/test_lowered_text.py` checks it after every stage for every example.

Errors are `CompileError`s at the line and column of the text (a malformed line, an
index with the wrong number of entries, an undeclared buffer); `parse_lowered` then
runs `tgc.lower.verify.verify_lowered`, and locates its errors at the kernel's line.

Terminates: one parse, one walk of the tree.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import re
from functools import lru_cache
from typing import Callable
from pathlib import Path

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from tgc.ir.diag import CompileError, Loc
from tgc.ir.parser import parse_module
from tgc.ir.sizes import Size, SizeError, size_op
from tgc.lower.lowered import (Acc, Add, Buffer, Check, Cond, Const, FloorDiv, GemmKernel, IdLoad, Ix, Load,
                               LoopKernel, Lowered, Map, Mask, Mul, Rand, SizeOf, StepLoop, View, smul)
from tgc.lower.lowered import Bind, EpilogueOut

HEADER = re.compile(r"^//\s*lowered after (\w+) \((\w+)\)\s*$")

@dataclass(frozen=True)
class KernelForm:
    """A backend's own kind of kernel in the lowered text (the CPU's loop `group`).
    `grammar`: lark rules, the first named `rule` (what follows the kernel's label),
    the others its own pieces, named `rule_...` (the forms of every loaded backend
    share one grammar); they may use the rules and terminals of `lowered.lark`
    (`loop`, `gemm`, `outer`, `regs`, `note`, `size`, `NAME`, `_NL`, ...). `read(walk,
    tree)`: the kernel, given the walk's helpers (`loop`, `gemm`, `size`, `names`,
    `note`, `error`, the `regs` being read). The backend registers its forms when it is
    loaded (`tgc.backends.base.get_backend`); this module imports no backend."""

    rule: str
    grammar: str
    read: Callable[["_Builder", Tree], object]


KERNEL_FORMS: dict[str, KernelForm] = {}   # every registered form by its rule


def register_stage_name(name: str) -> None:
    """A backend's own lowering stage, which a header line may name."""
    if name not in STAGES:
        STAGES.insert(len(STAGES) - 1, name)   # before plan


def register_kernel_form(form: KernelForm) -> None:
    """Read the kernels of `form` (a backend's own kind): the reader's grammar gains its
    rules (the parser is built again on the next read)."""
    known = KERNEL_FORMS.get(form.rule)
    if known is not None and known != form:
        raise ValueError(f"two backends define the lowered kernel form '{form.rule}'")
    KERNEL_FORMS[form.rule] = form


STAGES = ["fuse", "layout", "epilogue", "plan"]   # the neutral stages; a backend adds its own (register_stage_name)


def is_lowered_text(text: str) -> bool:
    """Whether `text` is a lowered program (it has the header line)."""
    return any(HEADER.match(line) for line in text.splitlines())


def _parser() -> Lark:
    """The parser of the neutral grammar and every registered kernel form."""
    return _parser_of(tuple(sorted(KERNEL_FORMS.values(), key=lambda f: f.rule)))


@lru_cache(maxsize=4)
def _parser_of(forms: tuple[KernelForm, ...]) -> Lark:
    """LALR tables are built once per set of forms (in memory: some 0.2-0.4 s)."""
    grammar = (Path(__file__).with_name("lowered.lark")).read_text()
    if forms:
        grammar += f"\n%extend kernel: LABEL ({' | '.join(f.rule for f in forms)})\n"
        grammar += "\n".join(f.grammar.strip() for f in forms) + "\n"
    return Lark(grammar, parser="lalr", lexer="contextual", propagate_positions=True, maybe_placeholders=False)


def parse_lowered(text: str, filename: str = "<lowered>", verify: bool = True) -> Lowered:
    """The `Lowered` program `text` spells; CompileError (located) on any mistake."""
    if text.startswith("\ufeff"):
        text = text[1:]
    lines, steps = _take_steps(text.splitlines(), filename)
    head = [(i, m) for i, m in ((i, HEADER.match(line)) for i, line in enumerate(lines)) if m]
    if not head:
        raise CompileError("not a lowered program: it needs the line '// lowered after STAGE (f32|f64)'",
                           Loc(filename, 1, 1))
    stage, dtype = head[0][1].groups()
    if stage not in STAGES:
        raise CompileError(f"unknown lowering stage '{stage}' (known: {', '.join(STAGES)})",
                           Loc(filename, head[0][0] + 1, 1))
    if dtype not in ("f32", "f64"):
        raise CompileError(f"a lowered program's float type is f32 or f64, not '{dtype}'",
                           Loc(filename, head[0][0] + 1, 1))
    module_text, body = _split_module(lines, filename)
    module = parse_module(module_text, filename)
    try:
        tree = _parser().parse(body)
    except UnexpectedInput as e:
        raise CompileError(_lark_message(e), Loc(filename, e.line if e.line > 0 else len(lines), max(e.column, 1))) \
            from None
    builder = _Builder(filename, module, dtype, stage)
    builder.steps_read = steps
    low = builder.build(tree)
    if verify:
        from tgc.lower.verify import VerifyError, verify_lowered

        try:
            verify_lowered(low)
        except VerifyError as e:
            line = builder.kernel_lines[e.kernel] if e.kernel is not None else 1
            raise CompileError(str(e), Loc(filename, line, 1)) from None
    return low


STEPS_HEAD = re.compile(r"^k[0-9]+:\s*steps\b.*\{\s*(#.*)?$")


def _take_steps(lines: list[str], filename: str) -> tuple[list[str], dict[int, Lowered]]:
    """The lines with each loop's step (the block indented under a `steps` line, up to
    its line `  }`) blanked, and the steps read as programs, by the index of their
    `steps` line. A step's lines keep their numbers (its errors are located in the file)."""
    out, steps = list(lines), {}
    i = 0
    while i < len(lines):
        if not STEPS_HEAD.match(lines[i]):
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "  }"), None)
        if end is None:
            raise CompileError("a loop's step is not closed by a line '  }'", Loc(filename, i + 1, 1))
        inner = [""] * (i + 1) + [line[4:] if line.startswith("    ") else line.strip() for line in lines[i + 1:end]]
        steps[i] = parse_lowered("\n".join(inner) + "\n", filename, verify=False)
        for j in range(i + 1, end + 1):
            out[j] = ""
        i = end + 1
    return out, steps


def _split_module(lines: list[str], filename: str) -> tuple[str, str]:
    """(the module block's IR text, the rest), each with the other's lines blanked, so
    that line numbers stay those of the file."""
    start = next((i for i, line in enumerate(lines) if line.strip() == "module {"), None)
    if start is None:
        raise CompileError("a lowered program needs its module: a 'module {' ... '}' block of IR",
                           Loc(filename, len(lines) or 1, 1))
    end = next((i for i in range(len(lines) - 1, start, -1) if lines[i].strip() == "}"), None)   # its loop bodies close too
    if end is None:
        raise CompileError("the 'module {' block is not closed by a line '}'", Loc(filename, start + 1, 1))
    inside = set(range(start, end + 1))
    ir = [""] * len(lines)
    for i in range(start + 1, end):
        if not lines[i].lstrip().startswith("//"):
            ir[i] = lines[i]
    rest = ["" if i in inside else line for i, line in enumerate(lines)]
    return "\n".join(ir) + "\n", "\n".join(rest) + "\n"


def _lark_message(e: UnexpectedInput) -> str:
    if isinstance(e, UnexpectedCharacters):
        return f"unexpected character {e.char!r} in lowered program"
    if isinstance(e, UnexpectedEOF):
        return "unexpected end of the lowered program"
    if isinstance(e, UnexpectedToken):
        tok = e.token
        what = "end of line" if tok.type == "_NL" else "end of input" if tok.type == "$END" else repr(str(tok))
        expected = sorted(_readable(t) for t in (e.accepts or e.expected) if not t.startswith(("_", "$")))
        more = ", ..." if len(expected) > 10 else ""
        kinds = "; a backend's own kind of kernel reads once its backend is loaded" \
            if {"LOOP", "STEPS"} <= set(e.expected) else ""   # a kernel's kind after its label
        return f"unexpected {what} in lowered program (expected {', '.join(expected[:10])}{more}{kinds})"
    return str(e)


def _readable(terminal: str) -> str:
    try:
        pattern = _parser().get_terminal(terminal).pattern
    except KeyError:
        return terminal
    return repr(pattern.value) if pattern.type == "str" else terminal.lower()


class _Builder:
    """Walks the parse tree into a `Lowered`: declarations first, then kernels."""

    def __init__(self, filename: str, module, dtype: str, stage: str):
        self.filename = filename
        self.low = Lowered(module, dtype, stage=stage)
        self.regs: dict[str, tuple[str, ...]] = {}   # the registers of the group being read
        self.kernel_lines: list[int] = []
        self.meta_line = 1

    def error(self, message: str, node=None) -> CompileError:
        line, col = self.meta_line, 1
        if isinstance(node, Token) and node.line is not None:
            line, col = node.line, node.column
        elif isinstance(node, Tree) and getattr(node.meta, "line", None) is not None:
            line, col = node.meta.line, node.meta.column
        return CompileError(message, Loc(self.filename, line, col))

    def build(self, tree: Tree) -> Lowered:
        items = tree.children
        for item in items:
            if item.data != "kernel":
                self.meta_line = item.meta.line
                getattr(self, item.data)(item)
        for item in items:
            if item.data == "kernel":
                self.meta_line = item.meta.line
                self.kernel_lines.append(item.meta.line)
                self.low.kernels.append(self.kernel(item))
        return self.low

    # ---------------------------------------------------------------- declarations

    def edge_decl(self, t: Tree) -> None:
        name, size = t.children
        if str(name) in self.low.edges:
            raise self.error(f"edge '{name}' is declared twice", name)
        self.low.edges[str(name)] = self.size(size)

    def buffer(self, t: Tree) -> None:
        buf, dtype, names, place, *rest = t.children
        name = str(buf)[1:]
        if name in self.low.buffers:
            raise self.error(f"buffer '%{name}' is declared twice", buf)
        kind = {"arg_place": "arg", "out_place": "out", "temp_place": "temp"}[place.data]
        b = Buffer(name, str(dtype), self.names(names), kind, int(place.children[0]) if place.children else -1)
        for r in rest:
            if r.data == "order":
                b.order = self.names(r.children[0])
            elif r.data == "prefer":
                b.prefer = self.names(r.children[0])
            elif r.data == "alias":
                b.alias = str(r.children[0])[1:]
            elif r.data == "lse":
                b.lse = True
            else:
                b.slot = int(r.children[0])
        self.low.buffers[name] = b

    def slot(self, t: Tree) -> None:
        index, *sizes = t.children
        if int(index) != len(self.low.slots):
            raise self.error(f"slot {index} is out of order (slots are numbered from 0: expected "
                             f"{len(self.low.slots)})", index)
        self.low.slots.append(tuple(self.size(s) for s in sizes))

    def check(self, t: Tree) -> None:
        zero, buf, size, note = t.children
        if int(zero) != 0:
            raise self.error("an id check reads 'check 0 <= %ids < SIZE'", zero)
        self.low.checks.append(Check(self.buffer_name(buf), self.size(size), self.note(note)))

    # ---------------------------------------------------------------- kernels

    def kernel(self, t: Tree):
        body = t.children[1]
        if body.data in KERNEL_FORMS:
            return KERNEL_FORMS[body.data].read(self, body)
        return getattr(self, body.data)(body)

    def steps(self, t: Tree) -> StepLoop:
        way, edge, trip, carries, args, outs, base, note = (
            t.children if len(t.children) == 8 else [None, *t.children])
        if way is not None and str(way) != "reverse":
            raise self.error(f"a loop's steps run forward, or 'reverse', not '{way}'", way)
        step = self.steps_read.get(t.meta.line - 1)
        if step is None:
            raise self.error("a loop needs its step: a lowered program indented under this line", t)
        return StepLoop(str(edge), self.size(trip), way is not None, step, self.binds(args), self.binds(outs),
                        int(carries), self.note(note), int(base))

    def binds(self, t: Tree) -> tuple[Bind, ...]:
        out = []
        for b in t.children:
            buf, *at = b.children
            # '[i]': the slice at the step's index; '[E]': the block of the buffer's edge E there
            split = str(at[0]) if at and str(at[0]) != "i" else ""
            out.append(Bind(self.buffer_name(buf), bool(at), split))
        return tuple(out)

    def loop(self, t: Tree) -> LoopKernel:
        buf, ixs, rhs, loops, note = t.children
        out = self.buffer_name(buf)
        index = self.index(out, ixs, buf)
        reduce, red, epilogue, scatter = "", (), None, False
        kids = rhs.children
        if rhs.data == "epilogue":
            epi, reduction, body_t = kids
            epilogue = self.expr(epi)
            reduce, red = self.reduction(reduction)
        else:
            if rhs.data == "scatter_kind":
                scatter, reduce = True, str(kids[0])
                kids = kids[1:]
            elif rhs.data == "scatter_add":
                scatter = True
            if len(kids) == 2:
                kind, red = self.reduction(kids[0])
                if not scatter:
                    reduce = kind
            body_t = kids[-1]
        names: list[str] = []
        sizes: dict[str, Size] = {}
        bounds: dict = {}
        for v in loops.children:
            name = str(v.children[0])
            if name in sizes:
                raise self.error(f"loop variable '{name}' appears twice", v.children[0])
            names.append(name)
            if v.data == "whole":
                sizes[name] = self.size(v.children[1])
                continue
            rest = v.children[2:]
            at = next(i for i, c in enumerate(rest) if not (isinstance(c, Tree) and c.data == "ix"))
            sizes[name] = self.size(rest[at])
            bounds[name] = (tuple(self.ix(c) for c in rest[:at]), tuple(self.ix(c) for c in rest[at + 1:]))
        return LoopKernel(out, index, tuple(names), sizes, self.expr(body_t), reduce, red, epilogue, scatter,
                          self.note(note), bounds)

    def reduction(self, t: Tree) -> tuple[str, tuple[str, ...]]:
        kind, names = t.children
        return str(kind), self.names(names)

    def cgemm(self, t: Tree) -> GemmKernel:
        """`cgemm %c = [alpha *] [conj(]a[)] @ [conj(]b[)] ...`: a complex product."""
        children = list(t.children)
        alpha = 1.0
        if isinstance(children[2], Tree) and children[2].data == "alpha":
            alpha = float(children.pop(2).children[0])
        conj = tuple(children[i].data == "conj_view" for i in (2, 3))
        children[2], children[3] = Tree("gview", [children[2].children[0]]), Tree("gview", [children[3].children[0]])
        real = self.gemm(Tree("gemm", children))
        return replace(real, cplx=conj, alpha=alpha)

    def gemm(self, t: Tree) -> GemmKernel:
        buf, eq, ga, gb, batch, m, n, k, *rest = t.children
        acc = str(eq) == "+="
        rounded = tuple(g.data == "rounded_view" for g in (ga, gb))
        a, b = ga.children[0], gb.children[0]
        taps: tuple[str, ...] = ()
        prefix: tuple[tuple[str, str], ...] = ()
        shifts = []
        note = ""
        outs = []
        for r in rest:
            if r.data == "then_out":
                obuf, ixs, e = r.children
                name = self.buffer_name(obuf)
                outs.append((name, self.index(name, ixs, obuf), e, obuf))
            elif r.data == "taps":
                taps = self.names(r.children[0])
            elif r.data == "prefix":
                names = [str(x) for x in r.children]
                prefix = tuple(zip(names[0::2], names[1::2]))
            elif r.data == "shift":
                where, *signed = r.children
                role, dot, edge = str(where).partition(".")
                if role not in ("a", "b") or not dot or not edge:
                    raise self.error(f"a GEMM shift names its operand and edge (a.EDGE or b.EDGE), not '{where}'",
                                     where)
                shifts.append((role, edge, self.signed_terms(signed)))
            else:
                note = self.note(r)
        g = GemmKernel(self.buffer_name(buf), self.view(a), self.view(b), self.names(batch), self.names(m),
                       self.names(n), self.names(k), note, taps, tuple(shifts), rounded=rounded, acc=acc,
                       prefix=prefix)
        epilogue = []
        for name, index, e, at in outs:
            if any(ix != Ix.var(edge) for edge, ix in index) or set(dict(index)) != set(g.out_edges()):
                raise self.error(f"an epilogue's output %{name} is written at the product's own index "
                                 f"[{', '.join(sorted(g.out_edges()))}]", at)
            epilogue.append(EpilogueOut(name, self.expr(e)))
        return replace(g, epilogue=tuple(epilogue))

    def view(self, t: Tree) -> View:
        buf, *edges = t.children
        pairs = []
        for e in edges:
            if e.data == "same_edge":
                pairs.append((str(e.children[0]), str(e.children[0])))
            else:
                pairs.append((str(e.children[1]), str(e.children[0])))
        return View(self.buffer_name(buf), tuple(pairs))

    # ---------------------------------------------------------------- expressions

    def expr(self, t):
        d = t.data
        c = t.children
        if d == "load":
            buf = self.buffer_name(c[0])
            return Load(buf, self.index(buf, c[1], c[0]))
        if d == "const":
            return Const(float(c[0]))
        if d == "sizeof":
            return SizeOf(self.size(c[0]))
        if d == "acc":
            return Acc()
        if d == "mask":
            return Mask(tuple(self.cond(x) for x in c[:-1]), self.expr(c[-1]))
        if d == "add":
            coefs = tuple(float(x) for x in c[:-1])
            args = self.exprs(c[-1])
            if len(coefs) != len(args):
                raise self.error(f"add has {len(coefs)} coefficients for {len(args)} terms", t)
            return Add(coefs, args)
        if d == "mul":
            return Mul(self.exprs(c[0]))
        if d == "rand":
            kind, key, *rest = c
            folds = tuple(int(f.children[0]) for f in rest if isinstance(f, Tree) and f.data == "fold")
            counter = next(x for x in rest if isinstance(x, Tree) and x.data == "ix")
            draw = next((str(x.children[0]) for x in rest if isinstance(x, Tree) and x.data == "draw"), "")
            return Rand(str(kind), folds, self.ix(key), self.ix(counter), draw)
        if d == "map":
            return Map(str(c[0]), self.exprs(c[1]))
        raise self.error(f"internal: unknown expression '{d}'", t)

    def exprs(self, t: Tree) -> tuple:
        return tuple(self.expr(x) for x in t.children)

    def cond(self, t: Tree) -> Cond:
        ix, op, zero = t.children
        if int(zero) != 0:
            raise self.error("a mask condition compares an index with 0", zero)
        return Cond(self.ix(ix), str(op))

    # ---------------------------------------------------------------- indices

    def index(self, buf: str, t: Tree, at) -> tuple[tuple[str, Ix], ...]:
        """An index over `buf`'s edges (in their sorted order, as the text lists them)."""
        edges = self.regs[buf] if buf in self.regs else self.low.buffers[buf].edges
        ixs = [self.ix(x) for x in t.children]
        if len(ixs) != len(edges):
            raise self.error(f"%{buf} has {len(edges)} edges ({', '.join(edges)}), the index has {len(ixs)} entries",
                             at)
        return tuple(zip(edges, ixs))

    def ix(self, t: Tree) -> Ix:
        c = list(t.children)
        negate = bool(c) and isinstance(c[0], Token) and c[0].type == "NEG"
        if negate:
            c = c[1:]
        signed = [Token("SIGN", "-" if negate else "+")] + c
        return self.signed_terms(signed)

    def signed_terms(self, c: list) -> Ix:
        terms = []
        const: Size = 0
        for sign, term in zip(c[0::2], c[1::2]):
            atom, coef = self.term(term)
            if str(sign) == "-":
                coef = -coef if isinstance(coef, int) else smul(-1, coef)
            if atom is None:
                const = size_op("+", const, coef) if const != 0 else coef
            else:
                terms.append((atom, coef))
        return Ix.make(terms, const)

    def term(self, t: Tree):
        d, c = t.data, t.children
        if d == "t_atom":
            return self.atom(c[0]), 1
        if d == "t_int_coef":
            return self.atom(c[1]), int(c[0])
        if d == "t_name_coef":   # a dim of the module, as in any size
            return self.atom(c[1]), self.dim(c[0])
        if d == "t_size_coef":
            return self.atom(c[1]), self.size(c[0])
        if d == "t_int":
            return None, int(c[0])
        return None, self.size(c[0])

    def atom(self, t: Tree):
        if t.data == "var":
            return str(t.children[0])
        if t.data == "idload":
            buf = self.buffer_name(t.children[0])
            return IdLoad(buf, self.index(buf, t.children[1], t.children[0]))
        return FloorDiv(self.ix(t.children[0]), self.size(t.children[1]))

    # ---------------------------------------------------------------- small things

    def size(self, t) -> Size:
        if isinstance(t, Token):   # a lone INT or NAME (`?` rules inline single children)
            return int(t) if t.type == "INT" else self.dim(t)
        d, c = t.data, t.children
        try:
            if d == "int_size":
                return int(c[0])
            if d == "name_size":
                return self.dim(c[0])
            if d == "negsize":
                return size_op("-", 0, self.size(c[0]))
            if d == "minsize":
                return size_op("min", self.size(c[0]), self.size(c[1]))
            if d == "binop":
                return size_op(str(c[1]), self.size(c[0]), self.size(c[2]))
        except SizeError as e:
            raise self.error(str(e), t) from None
        raise self.error(f"internal: unknown size '{d}'", t)

    def dim(self, tok: Token) -> str:
        """A size's name: one of the module's dims (what sizes are made of)."""
        if str(tok) not in self.low.module.dims:
            raise self.error(f"unknown dim '{tok}' in a size (the module's dims: "
                             f"{', '.join(self.low.module.dims) or 'none'})", tok)
        return str(tok)

    def names(self, t: Tree) -> tuple[str, ...]:
        return tuple(str(x) for x in t.children)

    def note(self, t: Tree) -> str:
        return str(t.children[0])[2:].rstrip() if t.children else ""

    def buffer_name(self, tok: Token) -> str:
        name = str(tok)[1:]
        if name not in self.low.buffers and name not in self.regs:
            raise self.error(f"undeclared buffer '%{name}'", tok)
        return name
