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

A loop's body (`tgc.ir.values.LoopBody`) is a block of its own, written before the
values and numbered on its own: every parameter, the body's values, and `yield` of
its results (carries first); a loop names it in its attributes, with its edge and
which output it is (`reverse`: the indices run downwards):

    body b0 carries=1 slices=1 {
      %0 = loopvar[0] : f32[c]
      %1 = loopvar[1] : f32[c]
      %2 = contract %0, %1 : f32[c]
      yield %2
    }
    %3 = loop[b0, layer, 0] %x, %w : f32[c]

Values are numbered in a deterministic topological order; arguments are `%name`.
`tgc.ir.parser.parse` reads this text back, and `print(parse(t)) == t`.
"""
from __future__ import annotations

from tgc.ir import ops
from tgc.ir.diag import Loc
from tgc.ir.module import FACT_RELS, Module
from tgc.ir.sizes import size_str
from tgc.ir.values import LoopBody, Value, topo_order


def attr_text(v: Value) -> str:
    """The bracketed attribute text of an op, '' when it has none (`tgc.ir.ops.OPS`)."""
    return ops.attr_text(v.op, v.attrs)


def loc_text(loc: Loc | None) -> str:
    return f" loc({loc.file}:{loc.line}:{loc.col})" if loc else ""


def loop_bodies(roots: list[Value]) -> list[LoopBody]:
    """Every loop body under `roots`, an inner body before the bodies that use it."""
    out: list[LoopBody] = []
    seen: set[LoopBody] = set()

    def visit(values: list[Value]) -> None:
        for v in topo_order(values):
            if v.op == "loop" and v.attrs[0] not in seen:
                body = v.attrs[0]
                seen.add(body)
                visit(list(body.results))
                out.append(body)

    visit(roots)
    return out


def _value_lines(values, names: dict[int, str], bodies: dict, locs: bool, indent: str = "") -> list[str]:
    body: list[str] = []
    for v in values:
        if v.op == "arg":
            names[id(v)] = f"%{v.attrs[0]}"
            continue
        if id(v) in names:
            continue
        names[id(v)] = f"%{len(body)}"
        operands = ", ".join(names[id(o)] for o in v.operands)
        sep = " " if operands else ""
        attrs = f"[{bodies[v.attrs[0]]}, {ops.OPS['loop'].text(v.attrs)}]" if v.op == "loop" else attr_text(v)
        body.append(f"{indent}{names[id(v)]} = {v.op}{attrs}{sep}{operands} : {v.type}"
                    + (loc_text(v.loc) if locs else ""))
    return body


def _body_lines(b: LoopBody, name: str, bodies: dict, locs: bool) -> list[str]:
    names: dict[int, str] = {}
    lines = [f"body {name} carries={b.carries} slices={b.slices} {{"]
    lines += _value_lines(list(b.params) + [v for v in topo_order(list(b.results)) if v.op != "loopvar"],
                          names, bodies, locs, "  ")
    lines.append(f"  yield {', '.join(names[id(r)] for r in b.results)}")
    lines.append("}")
    return lines


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
    roots = m.roots() + [x for f in m.facts for x in (f.lhs, f.rhs)]
    values = topo_order(roots) if m.facts else m.values()
    bodies: dict[LoopBody, str] = {}
    for b in loop_bodies(roots):
        bodies[b] = f"b{len(bodies)}"
        lines += [""] + _body_lines(b, bodies[b], bodies, locs)
    body = _value_lines(values, names, bodies, locs)
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
