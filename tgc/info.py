"""A program's interface: what a caller passes and gets back.

`describe(module, dtype)` gives, as plain data (JSON-ready), the dims (symbolic,
fixed, or derived from others), every argument (input, param, state) in ABI order,
every output, and every update, each with its edges in ABI order, the size along each
edge (an int, or the text of a size expression of symbolic dims) and its dtype.
`format_info` lays the same out as text. `tgc info` prints one or the other, and
`print(program)` the text of a compiled program, so that a caller can see what to
pass without reading the source.
"""
from __future__ import annotations

from tgc.ir.dtypes import narrower
from tgc.ir.complex_io import RI, is_complex_order
from tgc.ir.module import Module
from tgc.ir.sizes import Size, size_str


def _size(s: Size) -> int | str:
    return s if isinstance(s, int) else size_str(s)


def describe(module: Module, dtype: str) -> dict:
    """The interface of `module` whose floats are `dtype` (f32 or f64); bf16/f16
    arguments and outputs are listed as such, and so are f32 (and c64) ones of an f64
    program."""
    targets = {u.target for u in module.updates}

    def tensor(name: str, order: tuple[str, ...], elem: str) -> dict:
        width = at(elem) if elem != "i32" else elem
        cplx = is_complex_order(order)   # a complex array: its float pairs' last edge is not an axis
        order = order[:-1] if cplx else order
        return {"name": name, "edges": list(order), "shape": [_size(module.size(e)) for e in order],
                "dtype": "i32" if elem == "i32" else ({"f32": "c64", "f64": "c128"}[width] if cplx
                                                      else width)}

    def at(elem: str) -> str:   # the type a caller sees: a narrower declared type, else the program's
        return elem if elem in narrower(dtype) else dtype

    seen = {e for a in module.args.values() for e in a.order} | {e for o in module.outputs for e in o.order}
    dims = []
    for d, s in module.dims.items():
        if d == RI:
            continue
        kind = "symbolic" if s is None else "fixed" if isinstance(s, int) else "derived"
        edges = [e for e, dim in module.edges.items() if dim == d and e != d and e in seen]
        dims.append({"name": d, "kind": kind, "size": None if s is None else _size(s), "edges": edges})
    arguments = [{"position": i, "kind": a.kind, **tensor(a.name, a.order, a.dtype), "updated": a.name in targets}
                 for i, a in enumerate(module.args.values())]
    outputs = [{"position": i, **tensor(o.name, o.order, o.value.dtype)} for i, o in enumerate(module.outputs)]
    updates = [{"target": u.target, "result": module.update_key(u.target), "kind": module.args[u.target].kind,
                **{k: v for k, v in tensor(u.target, module.args[u.target].order, module.args[u.target].dtype).items()
                   if k != "name"}}
               for u in module.updates]
    return {"dtype": dtype, "dims": dims, "arguments": arguments, "outputs": outputs, "updates": updates}


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _list(items) -> str:
    return "[" + ", ".join(str(x) for x in items) + "]"


def format_info(info: dict, title: str | None = None) -> str:
    """`describe`'s data as text: one table each for dims, arguments, outputs and updates."""
    lines = [f"{title or 'program'}: {info['dtype']}", ""]
    if info["dims"]:
        lines.append("dims (a symbolic one is bound at each call from the arguments' shapes):")
        lines += _table([[d["name"], "symbolic" if d["kind"] == "symbolic" else f"= {d['size']}",
                          ("(derived) " if d["kind"] == "derived" else "")
                          + (f"edges {', '.join(d['edges'])}" if d["edges"] else "")]
                         for d in info["dims"]])
        lines.append("")
    lines.append("arguments (ABI order; each array's axes follow its edges):")
    if info["arguments"]:
        lines += _table([["#", "kind", "name", "edges", "shape", "dtype", ""]]
                        + [[str(a["position"]), a["kind"], a["name"], _list(a["edges"]), _list(a["shape"]), a["dtype"],
                            "updated in place" if a["updated"] else ""] for a in info["arguments"]])
    else:
        lines.append("  (none)")
    lines.append("")
    lines.append("outputs:")
    if info["outputs"]:
        lines += _table([["#", "name", "edges", "shape", "dtype"]]
                        + [[str(o["position"]), o["name"], _list(o["edges"]), _list(o["shape"]), o["dtype"]]
                           for o in info["outputs"]])
    else:
        lines.append("  (none)")
    if info["updates"]:
        lines.append("")
        lines.append("updates (written in place; a call's result holds each new value under 'result'):")
        lines += _table([["target", "kind", "result", "edges", "shape", "dtype"]]
                        + [[u["target"], u["kind"], u["result"], _list(u["edges"]), _list(u["shape"]), u["dtype"]]
                           for u in info["updates"]])
    return "\n".join(lines) + "\n"
