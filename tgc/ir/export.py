"""Other views of a module: Graphviz DOT (the tensor network) and JSON (for tools).

DOT: a node per value labelled with its op and edges; each arrow carries the
operand's edge names; arguments are boxes and outputs/updates double octagons.
JSON: dims, edges, args, values (id, op, attrs, operands, dtype, edges), outputs
and updates — deterministic, with values in the printer's order.
"""
from __future__ import annotations

import json

from tgc.ir.module import Module
from tgc.ir.printer import attr_text
from tgc.ir.sizes import size_str


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _numbering(m: Module) -> dict[int, str]:
    names: dict[int, str] = {}
    n = 0
    for v in m.values():
        if v.op == "arg":
            names[id(v)] = v.attrs[0]
        else:
            names[id(v)] = str(n)
            n += 1
    return names


def to_dot(m: Module) -> str:
    names = _numbering(m)
    lines = ["digraph tgc {", "  rankdir=TB;", '  node [fontname="monospace"];']
    for v in m.values():
        node = _quote(f"%{names[id(v)]}")
        edges = ", ".join(v.edges)
        if v.op == "arg":
            label, shape = f"{m.args[v.attrs[0]].kind} {v.attrs[0]}\n[{edges}]", "box"
        else:
            label, shape = f"%{names[id(v)]} = {v.op}{attr_text(v)}\n[{edges}]", "ellipse"
        lines.append(f"  {node} [label={_quote(label)}, shape={shape}];")
        for o in v.operands:
            lines.append(f"  {_quote('%' + names[id(o)])} -> {node} [label={_quote(', '.join(o.edges))}];")
    roots = [(f"out {o.name}", o.value) for o in m.outputs] + [(f"update {u.target}", u.value) for u in m.updates]
    for label, v in roots:
        lines.append(f"  {_quote(label)} [shape=doubleoctagon];")
        lines.append(f"  {_quote('%' + names[id(v)])} -> {_quote(label)} [label={_quote(', '.join(v.edges))}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_json(m: Module) -> str:
    names = _numbering(m)
    values = [{"id": names[id(v)], "op": v.op, "attrs": attr_text(v)[1:-1] if attr_text(v) else "",
               "operands": [names[id(o)] for o in v.operands], "dtype": v.dtype, "edges": list(v.edges)}
              for v in m.values() if v.op != "arg"]
    doc = {
        "dims": {d: (None if s is None else (s if isinstance(s, int) else size_str(s))) for d, s in m.dims.items()},
        "edges": dict(m.edges),
        "args": [{"name": a.name, "kind": a.kind, "dtype": a.dtype, "order": list(a.order)} for a in m.args.values()],
        "values": values,
        "outputs": [{"name": o.name, "value": names[id(o.value)], "order": list(o.order)} for o in m.outputs],
        "updates": [{"target": u.target, "value": names[id(u.value)]} for u in m.updates],
    }
    return json.dumps(doc, indent=1) + "\n"
