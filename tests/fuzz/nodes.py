"""Fuzzed programs as structure: expression trees and statements, rendered to .tg text.

The generator builds these and the shrinker edits them (drop a statement, replace a
subexpression by an operand or a leaf, shrink a dim), so a failing program is reduced
by its structure and not by its text. Rendering puts parentheses only where the
precedence of LANGUAGE.md section 5 needs them, so the parser's precedence is
exercised too.

A `Node` carries the generator's bookkeeping beside its syntax: `edges` (its edge
set), `scale` (a rough bound on its magnitude) and `sparse` (whether it may hold
exact zeros or ties, from padding, masks or steps). The shrinker ignores them: every
candidate it makes is checked by the front end itself.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

# precedence levels of LANGUAGE.md section 5 (higher binds tighter)
CMP, ADD, MUL, NEG, POW, POST, ATOM = 1, 2, 3, 4, 5, 6, 7
_LEVEL = {"<": CMP, "<=": CMP, ">": CMP, ">=": CMP, "==": CMP, "!=": CMP,
          "+": ADD, "-": ADD, "*": MUL, "/": MUL, "@": MUL, "^": POW}


@dataclass(eq=False)
class Node:
    """One expression. `op` is one of:

    - `name` (attrs: the name), `num` (attrs: the literal's text), `raw` (attrs: text of
      an atom such as an indicator `[s <= t]` or `size(e)`), all leaves;
    - `neg` (one kid), `bin` (attrs: the operator; two kids);
    - `call` (attrs: function name, its edge arguments or None, keyword names per kid:
      None for a positional argument);
    - `eops` (attrs: the items, each `("rename", a, b)`, `("reindex", t, affine text)`
      or `("gather", v, ids name)`; one kid, the operand).
    """
    op: str
    kids: list["Node"] = field(default_factory=list)
    attrs: tuple = ()
    edges: frozenset = frozenset()
    scale: float = 1.0
    sparse: bool = False

    def level(self) -> int:
        if self.op == "bin":
            return _LEVEL[self.attrs[0]]
        if self.op == "neg":
            return NEG
        if self.op in ("call", "eops"):
            return POST
        return ATOM

    def with_kids(self, kids: list["Node"]) -> "Node":
        return dataclasses.replace(self, kids=list(kids))

    def render(self) -> str:
        op = self.op
        if op in ("name", "num", "raw"):
            return str(self.attrs[0])
        if op == "neg":
            inner = _wrap(self.kids[0], NEG)
            return "-" + (" " + inner if inner.startswith("-") else inner)
        if op == "bin":
            sym = self.attrs[0]
            lvl = _LEVEL[sym]
            if sym == "^":
                left, right = _wrap(self.kids[0], POST), _wrap(self.kids[1], NEG)
            elif lvl == CMP:
                left, right = _wrap(self.kids[0], ADD), _wrap(self.kids[1], ADD)
            else:  # left-associative
                left, right = _wrap(self.kids[0], lvl), _wrap(self.kids[1], lvl + 1)
            return f"{left} {sym} {right}"
        if op == "call":
            fname, edge_args, kw = self.attrs
            args = ", ".join(k.render() if n is None else f"{n} = {k.render()}" for n, k in zip(kw, self.kids))
            eas = f"[{', '.join(edge_args)}]" if edge_args else ""
            return f"{fname}{eas}({args})"
        if op == "eops":
            items = []
            for it in self.attrs[0]:
                if it[0] == "rename":
                    items.append(f"{it[1]} -> {it[2]}")
                else:
                    items.append(f"{it[1]} = {it[2]}")
            return f"{_wrap(self.kids[0], POST)}[{', '.join(items)}]"
        raise ValueError(op)

    def walk(self):
        yield self
        for k in self.kids:
            yield from k.walk()


def _wrap(node: Node, need: int) -> str:
    text = node.render()
    return text if node.level() >= need else f"({text})"


# ---- helpers that build nodes -----------------------------------------------------------

def name(n: str, edges=frozenset(), scale: float = 1.0, sparse: bool = False) -> Node:
    return Node("name", [], (n,), frozenset(edges), scale, sparse)


def num(v: float) -> Node:
    text = repr(float(v)) if not float(v).is_integer() else str(int(v))
    return Node("num", [], (text,), frozenset(), abs(float(v)), v == 0)


def raw(text: str, edges=frozenset(), scale: float = 1.0, sparse: bool = False) -> Node:
    return Node("raw", [], (text,), frozenset(edges), scale, sparse)


def neg(a: Node) -> Node:
    return Node("neg", [a], (), a.edges, a.scale, a.sparse)


def bin_(sym: str, a: Node, b: Node, edges=None, scale=None, sparse=None) -> Node:
    e = a.edges | b.edges if edges is None else frozenset(edges)
    if scale is None:
        scale = {"+": a.scale + b.scale, "-": a.scale + b.scale, "*": a.scale * b.scale}.get(sym, 1.0)
    if sparse is None:
        sparse = a.sparse or b.sparse if sym in "+-" else (a.sparse or b.sparse)
    return Node("bin", [a, b], (sym,), e, scale, sparse)


def call(fname: str, args: list[Node], edge_args=None, kw=None, edges=frozenset(), scale=1.0, sparse=False) -> Node:
    kw = tuple(kw) if kw is not None else (None,) * len(args)
    return Node("call", list(args), (fname, tuple(edge_args) if edge_args else None, kw),
                frozenset(edges), scale, sparse)


def eops(a: Node, items, edges, scale=None, sparse=True) -> Node:
    return Node("eops", [a], (tuple(items),), frozenset(edges), a.scale if scale is None else scale, sparse)


# ---- programs ---------------------------------------------------------------------------

@dataclass
class Decl:
    kind: str                   # input | param | state
    name: str
    edges: tuple[str, ...]      # ABI order
    dtype: str | None = None    # "i32" or None (the program's float type)


@dataclass
class Fn:
    name: str
    edge_params: tuple[str, ...]
    params: list[tuple[str, Node | None]]       # (name, default)
    binds: list[tuple[str, Node]]               # a block's own bindings (empty: one-line form)
    ret: Node
    block: bool = False
    rule: str = ""              # its own derivative, `with vjp(g) = ...` (LANGUAGE.md section 11)


@dataclass
class Stmt:
    kind: str                   # bind | out | update | raw (`name` is the text: a `for` block)
    name: str
    expr: Node | None = None    # None: `out NAME` of an existing binding
    order: tuple[str, ...] | None = None   # an out's explicit ABI order


@dataclass
class Program:
    dims: list[tuple[str, str | None]]          # (name, expression text or None: symbolic)
    aliases: dict[str, str]                     # edge -> dim, declared `edge: dim` at first use
    decls: list[Decl]
    fns: list[Fn]
    stmts: list[Stmt]
    bind: dict[str, int]                        # sizes of the symbolic dims at run time
    seed: int = 0                               # the seed of the inputs
    note: str = ""                              # a comment line for the header

    def copy(self) -> "Program":
        return Program(list(self.dims), dict(self.aliases), [dataclasses.replace(d) for d in self.decls],
                       [dataclasses.replace(f, params=list(f.params), binds=list(f.binds)) for f in self.fns],
                       [dataclasses.replace(s) for s in self.stmts], dict(self.bind), self.seed, self.note)

    def render(self) -> str:
        lines = []
        if self.note:
            lines += [f"# {line}" if line else "#" for line in self.note.splitlines()]
        if self.bind:
            lines.append("# run with: " + ", ".join(f"{k}={v}" for k, v in sorted(self.bind.items())))
        for n, expr in self.dims:
            lines.append(f"dim {n}" if expr is None else f"dim {n} = {expr}")
        declared: set[str] = set()
        for d in self.decls:
            specs = []
            for e in d.edges:
                if e in self.aliases and e not in declared:
                    specs.append(f"{e}: {self.aliases[e]}")
                else:
                    specs.append(e)
                declared.add(e)
            ty = f": {d.dtype}" if d.dtype else ""
            shape = f"[{', '.join(specs)}]" if specs else ""
            lines.append(f"{d.kind} {d.name}{ty}{shape}")
        body = self.render_body()
        for e, d in self.aliases.items():   # an alias no declaration carries: a carrier input
            if e not in declared and re.search(rf"(?<![\w']){re.escape(e)}(?![\w'])", body):
                lines.append(f"input edge_{e}[{e}: {d}]")
        return "\n".join(lines) + "\n" + body

    def render_body(self) -> str:
        lines = []
        for f in self.fns:
            eps = f"[{', '.join(f.edge_params)}]" if f.edge_params else ""
            ps = ", ".join(p if dflt is None else f"{p} = {dflt.render()}" for p, dflt in f.params)
            rule = f" {f.rule}" if f.rule else ""
            if f.block or f.binds:
                lines.append(f"fn {f.name}{eps}({ps}) {{")
                lines += [f"  {b} = {e.render()}" for b, e in f.binds]
                lines.append(f"  return {f.ret.render()}")
                lines.append("}" + rule)
            else:
                lines.append(f"fn {f.name}{eps}({ps}) = {f.ret.render()}{rule}")
        for s in self.stmts:
            order = f"[{', '.join(s.order)}]" if s.order else ""
            if s.kind == "bind":
                lines.append(f"{s.name} = {s.expr.render()}")
            elif s.kind == "out":
                lines.append(f"out {s.name}{order}" + ("" if s.expr is None else f" = {s.expr.render()}"))
            elif s.kind == "raw":   # verbatim text: a `for` block
                lines.append(s.name)
            else:
                lines.append(f"update {s.name} = {s.expr.render()}")
        return "\n".join(lines) + "\n"


def parse_bind_comment(text: str) -> dict[str, int]:
    """The symbolic dim sizes of a rendered program (its `# run with:` line), else {}."""
    for line in text.splitlines():
        if line.startswith("# run with:"):
            return {k.strip(): int(v) for k, v in (p.split("=") for p in line[len("# run with:"):].split(","))}
    return {}


def parse_seed_comment(text: str) -> int:
    """The seed of a rendered program's inputs (its `# inputs seed:` line), else 0."""
    for line in text.splitlines():
        if line.startswith("# inputs seed:"):
            return int(line.split(":", 1)[1])
    return 0
