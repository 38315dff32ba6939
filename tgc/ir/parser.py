"""Read the textual IR that `tgc.ir.printer` writes back into a `Module`.

Every value is rebuilt through the typed builders of `tgc.ir.values`, so the types
written in the text are checked against the types the ops derive; any mismatch or
malformed line is a `CompileError` located at that line of the IR text.
"""
from __future__ import annotations

import re

from tgc.ir import ops, values as V
from tgc.ir.dtypes import TYPES
from tgc.ir.diag import CompileError, Loc
from tgc.ir.module import FACT_RELS, Arg, Fact, Module, Output, Update
from tgc.ir.sizes import SizeError, parse_size, size_dims
from tgc.ir.verify import VerifyError, check_value, verify

NAME = r"[A-Za-z_][\w'.]*"
_DIM = re.compile(rf"dim\s+({NAME})(?:\s*=\s*(.+))?$")
_EDGE = re.compile(rf"edge\s+({NAME})\s*:\s*({NAME})$")
_ARG = re.compile(rf"(input|param|state)\s+({NAME})\s*:\s*(\w+)\[([^\]]*)\]$")
_VALUE = re.compile(r"%(\w+)\s*=\s*(\w+)(?:\[([^\]]*)\])?\s*(.*?)\s*:\s*(\w+)\[([^\]]*)\]"
                    r"(?:\s+loc\((.*):(\d+):(\d+)\))?$")
_OUT = re.compile(rf"out\s+({NAME})\s*=\s*%({NAME}|\d+)\s*:\s*\[([^\]]*)\]$")
_UPDATE = re.compile(rf"update\s+({NAME})\s*=\s*%({NAME}|\d+)$")
_ASSUME = re.compile(rf"assume\[(\w+)\]\s*%({NAME}|\d+)\s*,\s*%({NAME}|\d+)\s*\"([^\"]*)\""
                     r"(?:\s+loc\((.*):(\d+):(\d+)\))?$")
_BODY = re.compile(r"body\s+(\w+)\s+carries\s*=\s*(\d+)\s+slices\s*=\s*(\d+)\s*\{$")
_YIELD = re.compile(r"yield\s+(.*)$")
_REL_OF = {name: rel for rel, name in FACT_RELS.items()}


def _edge_list(text: str) -> list[str]:
    return [e.strip() for e in text.split(",") if e.strip()]


class _Reader:
    def __init__(self, filename: str):
        self.filename = filename
        self.m = Module()
        self.env: dict[str, V.Value] = {}
        self.line = 0
        self.lines: dict[int, int] = {}  # id(value) -> line that defined it
        self.bodies: dict[str, V.LoopBody] = {}   # loop bodies read so far, by name
        self.open: tuple | None = None   # the body being read: (name, carries, slices, outer env, results)

    def error(self, message: str, col: int = 1) -> CompileError:
        return CompileError(message, Loc(self.filename, self.line, col))

    def ref(self, name: str) -> V.Value:
        if name not in self.env:
            raise self.error(f"use of undefined value '%{name}'")
        return self.env[name]

    def read(self, text: str) -> Module:
        if text.startswith("\ufeff"):   # a byte order mark, as in .tg files
            text = text[1:]
        for self.line, raw in enumerate(text.splitlines(), 1):
            if raw.startswith("// lowered"):
                raise self.error("this is a lowered program (a dump of a lowering stage), not IR: "
                                 "`tgc opt` reads it; this command takes .tg source or IR")
            keep = raw.lstrip().startswith(("%", "assume"))   # an assume's quoted text may hold '#'
            code = raw.split("#", 1)[0] if not keep else raw
            col = _non_ascii(code)
            if col is not None:
                raise self.error(f"unexpected character {code[col]!r} (IR text is ASCII outside quoted text "
                                 f"and a loc's file name)", col + 1)
            line = code.strip()
            if line:
                try:
                    self.statement(line)
                except (V.IRError, SizeError, ValueError) as e:
                    if isinstance(e, CompileError):
                        raise
                    raise self.error(str(e)) from None
        if self.open is not None:
            raise self.error(f"body '{self.open[0]}' is not closed with '}}'")
        try:
            verify(self.m)
        except VerifyError as e:
            self.line = self.lines.get(id(e.value), self.line)
            raise self.error(str(e)) from None
        return self.m

    def statement(self, line: str) -> None:
        if self.open is not None:
            self.body_statement(line)
            return
        for pattern, handler in ((_VALUE, self.value), (_DIM, self.dim), (_EDGE, self.edge),
                                 (_ARG, self.arg), (_OUT, self.out), (_UPDATE, self.update),
                                 (_ASSUME, self.assume), (_BODY, self.body)):
            match = pattern.match(line)
            if match:
                handler(*match.groups())
                return
        raise self.error(f"cannot parse IR line: {line}")

    def body(self, name: str, carries: str, slices: str) -> None:
        if name in self.bodies:
            raise self.error(f"body '{name}' is defined twice")
        self.open = (name, int(carries), int(slices), self.env, None)
        self.env = {}

    def body_statement(self, line: str) -> None:
        """A line inside a body block: a value, its `yield`, or the closing brace."""
        name, carries, slices, outer, results = self.open
        found = _YIELD.match(line)
        if found:
            refs = [self.ref(r.strip().lstrip("%")) for r in found.group(1).split(",") if r.strip()]
            self.open = (name, carries, slices, outer, refs)
        elif line == "}":
            if results is None:
                raise self.error(f"body '{name}' has no 'yield'")
            params = sorted((v for v in self.env.values() if v.op == "loopvar"), key=lambda v: v.attrs[0])
            self.bodies[name] = V.loop_body(params, results, carries, slices)
            self.open, self.env = None, outer
        elif _VALUE.match(line):
            if results is not None:
                raise self.error(f"a value after the 'yield' of body '{name}'")
            self.value(*_VALUE.match(line).groups())
        else:
            raise self.error(f"cannot parse IR line in body '{name}': {line}")

    def dim(self, name: str, size: str | None) -> None:
        if name in self.m.edges:
            raise self.error(f"'{name}' is declared twice")
        value = None if size is None else parse_size(size)
        unknown = [d for d in size_dims(value) if d not in self.m.dims] if value is not None else []
        if unknown:
            raise self.error(f"dim '{name}' = {size} uses '{unknown[0]}', which is not a dim declared before it")
        self.m.dims[name] = value
        self.m.edges[name] = name

    def edge(self, name: str, dim: str) -> None:
        if dim not in self.m.dims:
            raise self.error(f"edge '{name}' has unknown dim '{dim}'")
        if name in self.m.edges:
            raise self.error(f"'{name}' is declared twice")
        self.m.edges[name] = dim

    def arg(self, kind: str, name: str, dtype: str, edges: str) -> None:
        order = tuple(_edge_list(edges))
        self.check_edges(order)
        self.dtype(dtype)
        self.m.args[name] = Arg(name, kind, dtype, order)
        self.env[name] = V.arg(name, dtype, order)

    def dtype(self, name: str) -> str:
        if name not in TYPES:
            raise self.error(f"unknown type '{name}' (known: {', '.join(TYPES)})")
        return name

    def check_edges(self, edges) -> None:
        for e in edges:
            if e not in self.m.edges:
                raise self.error(f"unknown edge '{e}'")

    def value(self, name, op, attrs, operands, dtype, edges, lfile, lline, lcol) -> None:
        if name in self.env:
            raise self.error(f"value '%{name}' is defined twice")
        loc = Loc(lfile, int(lline), int(lcol)) if lfile else None
        args = [self.ref(o.strip().lstrip("%")) for o in operands.split(",") if o.strip()]
        typ = V.TensorType.of(self.dtype(dtype), _edge_list(edges))
        self.check_edges(typ.edges)
        v = self.loop(attrs, args, loc) if op == "loop" else _build(op, attrs, args, typ, loc)
        if v.op == "arg" and self.open is not None:
            raise self.error("a loop body reads only its parameters (loopvar), not arguments")
        if v.type != typ:
            raise self.error(f"'{op}' gives type {v.type}, the text says {typ}")
        try:
            check_value(self.m, v, derivatives=True)
        except VerifyError as e:
            raise self.error(str(e)) from None
        self.env[name] = v
        self.lines.setdefault(id(v), self.line)

    def loop(self, attrs: str | None, args: list[V.Value], loc) -> V.Value:
        parts = [p.strip() for p in (attrs or "").split(",")]
        if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] != "reverse") or not parts[2].isdigit():
            raise self.error("a loop's attributes are [body, edge, output] or [body, edge, output, reverse]")
        if parts[0] not in self.bodies:
            raise self.error(f"unknown loop body '{parts[0]}'")
        return V.loop(self.bodies[parts[0]], parts[1], args, int(parts[2]), len(parts) == 4, loc)

    def out(self, name: str, ref: str, order: str) -> None:
        v = self.ref(ref)
        order_t = tuple(_edge_list(order))
        if sorted(order_t) != list(v.edges):
            raise self.error(f"output '{name}' order [{order}] does not match its edges {list(v.edges)}")
        self.m.outputs.append(Output(name, v, order_t))

    def update(self, target: str, ref: str) -> None:
        if target not in self.m.args:
            raise self.error(f"update of unknown argument '{target}'")
        self.m.updates.append(Update(target, self.ref(ref)))


    def assume(self, rel: str, lhs: str, rhs: str, text: str, lfile, lline, lcol) -> None:
        if rel not in _REL_OF:
            raise self.error(f"unknown relation '{rel}' (known: {', '.join(_REL_OF)})")
        loc = Loc(lfile, int(lline), int(lcol)) if lfile else None
        self.m.facts.append(Fact(_REL_OF[rel], self.ref(lhs), self.ref(rhs), text, loc))


def _build(op: str, attrs: str | None, args: list[V.Value], typ: V.TensorType, loc) -> V.Value:
    return ops.parse_value(V, op, attrs, args, typ, loc)   # each op's text codec: tgc.ir.ops.OPS


_ASCII_EXEMPT = re.compile(r'"[^"]*"|(?<=loc\().*(?=:[^:]*:[^:]*\)\s*$)')   # quoted text, a loc's file name


def _non_ascii(line: str) -> int | None:
    """The index of the first non-ASCII character of `line` outside quoted text and a
    loc's file name, or None. Names, numbers and types of IR text are ASCII, as in .tg
    source: `int` and `float` would read other scripts' digits (`\u0663`) as numbers."""
    if line.isascii():
        return None
    blanked = _ASCII_EXEMPT.sub(lambda m: " " * len(m.group()), line)
    return next((i for i, ch in enumerate(blanked) if not ch.isascii()), None)


def parse_module(text: str, filename: str = "<ir>") -> Module:
    """Parse IR text; CompileError (with the IR line) on anything malformed."""
    return _Reader(filename).read(text)
