"""The textual form of a module: one declaration or op per line.

    dim batch
    dim features = 13
    edge i : n
    input x : f32[batch, features]          # ABI order
    %0 = contract %x, %W : f32[batch, hidden]
    %1 = add[1.0, -1.0] %0, %b : f32[batch, hidden]
    out y = %1 : [batch, hidden]            # ABI order
    update W = %5
    assume[eq] %6, %7 "sum[v](y) = 1"       # a declared fact: relation, sides, as written

Values are numbered in a deterministic topological order; arguments are `%name`.
`tgc.ir.parser.parse` reads this text back, and `print(parse(t)) == t`.
"""
from __future__ import annotations

from tgc.ir import ops
from tgc.ir.diag import Loc
from tgc.ir.module import FACT_RELS, Module
from tgc.ir.sizes import size_str
from tgc.ir.values import Value, topo_order


def attr_text(v: Value) -> str:
    """The bracketed attribute text of an op, '' when it has none (`tgc.ir.ops.OPS`)."""
    return ops.attr_text(v.op, v.attrs)


def loc_text(loc: Loc | None) -> str:
    return f" loc({loc.file}:{loc.line}:{loc.col})" if loc else ""


def print_module(m: Module, locs: bool = False) -> str:
    lines: list[str] = []
    for dim, s in m.dims.items():
        lines.append(f"dim {dim}" if s is None else f"dim {dim} = {size_str(s)}")
    for edge, dim in m.edges.items():
        if edge != dim:
            lines.append(f"edge {edge} : {dim}")
    for a in m.args.values():
        lines.append(f"{a.kind} {a.name} : {a.dtype}[{', '.join(a.order)}]")
    names: dict[int, str] = {}
    body: list[str] = []
    values = topo_order(m.roots() + [x for f in m.facts for x in (f.lhs, f.rhs)]) if m.facts else m.values()
    for v in values:
        if v.op == "arg":
            names[id(v)] = f"%{v.attrs[0]}"
            continue
        names[id(v)] = f"%{len(body)}"
        operands = ", ".join(names[id(o)] for o in v.operands)
        sep = " " if operands else ""
        body.append(f"{names[id(v)]} = {v.op}{attr_text(v)}{sep}{operands} : {v.type}"
                    + (loc_text(v.loc) if locs else ""))
    if body:
        lines.append("")
        lines.extend(body)
    if m.outputs or m.updates or m.facts:
        lines.append("")
    for o in m.outputs:
        lines.append(f"out {o.name} = {names[id(o.value)]} : [{', '.join(o.order)}]")
    for u in m.updates:
        lines.append(f"update {u.target} = {names[id(u.value)]}")
    for f in m.facts:
        lines.append(f"assume[{FACT_RELS[f.rel]}] {names[id(f.lhs)]}, {names[id(f.rhs)]} \"{f.text}\""
                     + (loc_text(f.loc) if locs else ""))
    return "\n".join(lines) + "\n"
