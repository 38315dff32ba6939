"""The IR verifier: the invariants every pass must keep.

- every edge of every value is declared, and has one size;
- a rename maps an edge to one of the same size;
- arguments match their declarations; outputs list exactly their value's edges;
- an update targets a param or state and has its edges and dtype;
- after differentiation (`derivatives=False`) no grad/jvp/vjp node is left;
- a loop's edge is declared, and its body reads only its own parameters (no
  argument), with every edge declared, checked like the module's values.

Types themselves are re-derived by the builders, so they are right by construction.
"""
from __future__ import annotations

from tgc.ir.module import Module
from tgc.ir.values import DERIVATIVE_OPS, Value, topo_order


class VerifyError(ValueError):
    def __init__(self, message: str, value: Value | None = None):
        super().__init__(message)
        self.value = value


def _same_size(m: Module, a: str, b: str) -> bool:
    return m.size(a) == m.size(b)


def check_value(m: Module, v: Value, derivatives: bool) -> None:
    for e in v.edges:
        if e not in m.edges:
            raise VerifyError(f"edge '{e}' is not declared", v)
    if v.op == "arg":
        a = m.args.get(v.attrs[0])
        if a is None:
            raise VerifyError(f"argument '{v.attrs[0]}' is not declared", v)
        if a.dtype != v.dtype or sorted(a.order) != list(v.edges):
            raise VerifyError(f"argument '{a.name}' is used with type {v.type}", v)
    elif v.op == "rename":
        for s, d in v.attrs[0]:
            if not _same_size(m, s, d):
                raise VerifyError(f"rename '{s} -> {d}' changes the size", v)
    elif v.op == "size" and v.attrs[0] not in m.edges:
        raise VerifyError(f"size of undeclared edge '{v.attrs[0]}'", v)
    elif v.op in DERIVATIVE_OPS and not derivatives:
        raise VerifyError(f"'{v.op}' left after differentiation", v)
    elif v.op == "loop":
        if v.attrs[1] not in m.edges:
            raise VerifyError(f"loop over undeclared edge '{v.attrs[1]}'", v)
        _check_body(m, v.attrs[0], derivatives)


def _check_body(m: Module, body, derivatives: bool) -> None:
    for u in topo_order(list(body.results)):
        if u.op == "arg":
            raise VerifyError(f"a loop body reads argument '{u.attrs[0]}'; it reads only its parameters", u)
        if u.op in DERIVATIVE_OPS:
            raise VerifyError(f"a loop body holds '{u.op}': derivatives inside a loop's step are not supported", u)
        check_value(m, u, derivatives)


def verify(m: Module, derivatives: bool = True) -> None:
    """Raise VerifyError on the first broken invariant."""
    for edge, dim in m.edges.items():
        if dim not in m.dims:
            raise VerifyError(f"edge '{edge}' has undeclared dim '{dim}'")
    for v in m.values():
        check_value(m, v, derivatives)
    names = [o.name for o in m.outputs]
    for o in m.outputs:
        if names.count(o.name) > 1:
            raise VerifyError(f"output '{o.name}' is defined twice", o.value)
        if sorted(o.order) != list(o.value.edges):
            raise VerifyError(f"output '{o.name}' order {list(o.order)} is not its edges {list(o.value.edges)}", o.value)
    for u in m.updates:
        a = m.args.get(u.target)
        if a is None or a.kind == "input":
            raise VerifyError(f"update target '{u.target}' is not a param or state", u.value)
        if sorted(a.order) != list(u.value.edges):
            raise VerifyError(f"update of '{u.target}' has edges {list(u.value.edges)}, the target {sorted(a.order)}", u.value)
