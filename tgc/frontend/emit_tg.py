"""Write a module back as `.tg` source: readable, checkable, and computing the same.

Used by `tgc grad --emit tg` to show a derivative program in surface syntax. Each
non-trivial value becomes one binding; edges the compiler invented (`t.1`) get
valid names and are declared as dims of the same size; IR forms without a direct
surface form are spelled with primitives (`mul0(a, b)` as `where(a != 0, a * b, 0)`,
a scatter-add as a contraction with an integer indicator `[e = ids]`, a segment
max/min as a `max`/`min` of a `where` masked by one, a broadcast as a product with
`[e = e]`). Loops are written as `repeat` and `scan` with a step function
(`tgc.frontend.emit_loops`, which says how a derivative's loops are spelled).
"""
from __future__ import annotations

import math

from tgc.ir.dtypes import CONVERSIONS, LOW_FLOATS
from tgc.ir.affine import Affine, join_signed
from tgc.ir.module import Module
from tgc.ir.sizes import Size, SizeOp, size_str
from tgc.ir.ops import INFIX   # the functions the language writes as operators
from tgc.frontend.emit_loops import LoopPrinter
from tgc.ir.values import Value, topo_order


class _Writer:
    def __init__(self, m: Module):
        self.m = m
        self.lines: list[str] = []
        self.top = self.lines   # the program's lines (`lines` is a step function's while one is written)
        self.taken = set(m.dims) | set(m.edges) | set(m.args) | {o.name for o in m.outputs}
        self.edge_names = {e: self.fresh(e.replace(".", "_")) if not _valid(e) else e for e in m.edges}
        self.names: dict[int, str] = {}
        self.size_dims: dict[SizeOp, str] = {}
        self.count = 0
        self.fn_lines: list[str] = []        # the step functions, written before the bindings
        self.head = 0                        # how many lines the declarations are
        floats = [a.dtype for a in m.args.values()] + [v.dtype for v in m.values()]
        self.loops = LoopPrinter(self, m.roots(), "f64" if "f64" in floats else "f32")

    def fresh(self, base: str) -> str:
        name, n = base, 0
        while name in self.taken:
            n += 1
            name = f"{base}_{n}"
        self.taken.add(name)
        return name

    def e(self, edge: str) -> str:
        return self.edge_names[edge]

    def declarations(self) -> None:
        for d, s in self.m.dims.items():
            # a name no source has (`re.im`, a complex value's parts edge) under its valid spelling
            self.lines.append(f"dim {self.e(d)}" if s is None else f"dim {self.e(d)} = {size_str(s)}")
        declared = set(self.m.dims)
        for a in self.m.args.values():
            for edge in a.order:
                declared.add(edge)
        for edge, dim in self.m.edges.items():
            if edge not in declared:
                self.lines.append(f"dim {self.e(edge)} = {self.e(dim)}")
                declared.add(edge)
        seen = set(self.m.dims) | {e for e in self.m.edges if e not in _arg_edges(self.m)}
        # an f64 program's f32 arguments keep their type (in an f32 program every float is f32)
        typed = ("i32", *LOW_FLOATS) + (("f32",) if any(a.dtype == "f64" for a in self.m.args.values())
                                         or any(v.dtype == "f64" for v in self.m.values()) else ())
        for a in self.m.args.values():
            specs = []
            for edge in a.order:
                specs.append(self.e(edge) if edge in seen else f"{self.e(edge)}: {self.e(self.m.edges[edge])}")
                seen.add(edge)
            dtype = f": {a.dtype}" if a.dtype in typed else ""
            edges = f"[{', '.join(specs)}]" if specs else ""
            self.lines.append(f"{a.kind} {a.name}{dtype}{edges}")

    def ref(self, v: Value) -> str:
        """A name or literal for `v`, binding it first if needed."""
        if id(v) in self.names:
            return self.names[id(v)]
        if v.op == "arg":
            return v.attrs[0]
        if v.op == "const" and not v.edges:
            return _number(v.attrs[0])
        if v.op == "size":
            return f"size({self.e(v.attrs[0])})"
        if v.op == "loop":   # binds every output of the loop that is read (tgc.frontend.emit_loops)
            self.loops.write(v)
        else:
            self.names[id(v)] = self.bind(self.expr(v))
        return self.names[id(v)]

    def bind(self, text: str) -> str:
        """A new binding of `text` in the current scope; its name."""
        name = self.fresh(f"v{self.count}")
        self.count += 1
        self.lines.append(f"{name} = {text}")
        return name

    def expr(self, v: Value) -> str:
        ops = [self.ref(o) for o in v.operands]
        if v.dtype not in LOW_FLOATS and v.op in ("add", "contract", "map", "reduce", "scatter"):
            # an op on bf16/f16 operands that the IR keeps unrounded (in f32): in .tg the
            # expression would be rounded, so its low operands are converted first
            ops = [f"{v.dtype}({t})" if o.dtype in LOW_FLOATS and not (v.op == "map" and v.attrs[0] in CONVERSIONS)
                   else t for o, t in zip(v.operands, ops)]
        return getattr(self, f"_{v.op}")(v, ops)

    def _const(self, v, ops):
        return " * ".join([_number(v.attrs[0])] + [f"[{self.e(e)} = {self.e(e)}]" for e in v.edges])

    def _add(self, v, ops):
        text = ""
        for c, o in zip(v.attrs[0], ops):
            sign = "-" if c < 0 else "+"
            body = o if abs(c) == 1 else f"{_number(abs(c))} * {o}"
            text = (f"-{body}" if sign == "-" else body) if not text else f"{text} {sign} {body}"
        return text

    def _contract(self, v, ops):
        present = set().union(*(o.edges for o in v.operands))
        factors = list(ops) + [f"[{self.e(e)} = {self.e(e)}]" for e in v.edges if e not in present]
        product = " * ".join(factors)
        summed = sorted(present - set(v.edges))
        return f"sum[{', '.join(self.e(e) for e in summed)}]({product})" if summed else product

    def _map(self, v, ops):
        fn = v.attrs[0]
        if fn in INFIX:
            return f"({ops[0]} {INFIX[fn]} {ops[1]})"
        if fn == "mul0":
            return f"where({ops[0]} != 0, {ops[0]} * {ops[1]}, 0)"
        if fn == "mul00":
            return f"where({ops[0]} != 0, where({ops[1]} != 0, {ops[0]} * {ops[1]}, 0), 0)"
        if fn == "recompute":   # a backward recomputation's marker (autodiff/remat.py): its operand
            return ops[0]
        if fn in CONVERSIONS:   # to_bf16(x) is spelled bf16(x)
            return f"{CONVERSIONS[fn]}({ops[0]})"
        return f"{fn}({', '.join(ops)})"

    def _reduce(self, v, ops):
        kind, edges = v.attrs
        if kind == "logsumexp":
            text = ops[0]
            for e in edges:
                text = f"logsumexp[{self.e(e)}]({text})"
            return text
        return f"{kind}[{', '.join(self.e(e) for e in edges)}]({ops[0]})"

    def _random(self, v, ops):
        key = ops[0]
        for n in v.attrs[1]:   # an integer, or '$i': by the value of operand i (an i32 input)
            key = f"fold({key}, {ops[int(n[1:])] if isinstance(n, str) else n})"
        return f"{v.attrs[0]}[{', '.join(self.e(e) for e in v.edges)}]({key})"

    def _indicator(self, v, ops):
        r = v.attrs[0]
        text = self.affine(r.exprs[0])
        for op, a in zip(r.ops, r.exprs[1:]):
            text += f" {op} {self.affine(a)}"
        return f"[{text}]"

    def affine(self, a: Affine) -> str:
        """An index expression in .tg's terms: `edge`, `k*edge`, `k*d*edge`, `k`, `k*size(d)`."""
        parts = [self.term(k, base, self.e(edge)) for edge, c in a.terms for k, base in _monomials(c)]
        parts += [self.term(k, base, None) for k, base in _monomials(a.const)]
        return join_signed(parts)

    def term(self, k: int, base: Size | None, edge: str | None) -> tuple[int, str]:
        """(sign, text) of `k * base * edge`; a base that is not a dim's name (a product or
        quotient of sizes) gets a dim of its own, so that it is one factor."""
        factors = [] if abs(k) == 1 else [str(abs(k))]
        if isinstance(base, SizeOp):
            base = self.size_dim(base)
        if base is not None:
            factors.append(base if edge else f"size({base})")
        factors += [edge] if edge else []
        return (-1 if k < 0 else 1), "*".join(factors) or "1"

    def size_dim(self, size: SizeOp) -> str:
        """The name of a dim declared equal to `size` (declared once per size)."""
        if size not in self.size_dims:
            name = self.size_dims[size] = self.fresh("dsize")
            self.top.insert(self._dims_end(), f"dim {name} = {size_str(size)}")
            self.head += 1
        return self.size_dims[size]

    def _gather(self, v, ops):
        return f"{ops[0]}[{self.e(v.attrs[0])} = {ops[1]}]"

    def _scatter(self, v, ops):
        """A scatter-add as a contraction with the integer indicator [edge = ids], a segment
        max/min as the max/min of a `where` masked by it (docs/language.md, section 6)."""
        ids = v.operands[1]
        ind = f"[{self.e(v.attrs[0])} = {ops[1]}]"
        summed = [self.e(e) for e in ids.edges if e not in v.edges]
        kind = v.attrs[1]
        if kind != "sum":
            body = f"where({ind}, {ops[0]}, {'-inf' if kind == 'max' else 'inf'})"
        else:
            body = f"{ops[0]} * {ind}"
        return f"{kind}[{', '.join(summed)}]({body})" if summed else body

    def _dims_end(self) -> int:
        return sum(1 for line in self.top if line.startswith("dim "))

    def _rename(self, v, ops):
        return f"{ops[0]}[{', '.join(f'{self.e(s)} -> {self.e(d)}' for s, d in v.attrs[0])}]"

    def _stop(self, v, ops):
        return f"stop({ops[0]})"

    def _grad(self, v, ops):
        return f"grad({ops[0]}, {ops[1]})"

    def _jvp(self, v, ops):
        return f"jvp({', '.join(ops)})"

    def _vjp(self, v, ops):
        return f"vjp({', '.join(ops)})"


def _arg_edges(m: Module) -> set[str]:
    return {e for a in m.args.values() for e in a.order}


def _valid(name: str) -> bool:
    return name.replace("_", "a").replace("'", "a").isalnum() and not name[0].isdigit()


def _number(x: float) -> str:
    if math.isnan(x):
        return "(inf - inf)"
    if math.isinf(x):
        return "inf" if x > 0 else "(-inf)"
    text = repr(int(x)) if x == int(x) and abs(x) < 1e15 else repr(x)
    return text if x >= 0 else f"({text})"


def _monomials(s: Size, sign: int = 1) -> list[tuple[int, Size | None]]:
    """`sign * s` as a sum of `k * base`: base None (k is the integer), a dim's name, or a
    size that is no sum and no integer multiple (a product or quotient of dims)."""
    if isinstance(s, int):
        return [(sign * s, None)] if s else []
    if isinstance(s, str):
        return [(sign, s)]
    if s.op in "+-":
        return _monomials(s.lhs, sign) + _monomials(s.rhs, sign if s.op == "+" else -sign)
    if s.op == "*" and isinstance(s.lhs, int):
        return [(k * s.lhs, b) for k, b in _monomials(s.rhs, sign)]
    if s.op == "*" and isinstance(s.rhs, int):
        return [(k * s.rhs, b) for k, b in _monomials(s.lhs, sign)]
    return [(sign, s)]


def emit_tg(m: Module) -> str:
    """The module as `.tg` source text."""
    w = _Writer(m)
    w.declarations()
    w.head = len(w.lines)
    outs = []
    for o in m.outputs:
        outs.append(f"out {o.name}[{', '.join(w.e(e) for e in o.order)}] = {w.ref(o.value)}"
                    if o.order else f"out {o.name} = {w.ref(o.value)}")
    ups = [f"update {u.target} = {w.ref(u.value)}" for u in m.updates]
    head = w.head
    return "\n".join(["# generated by tgc", *w.lines[:head], *w.fn_lines, *w.lines[head:], *outs, *ups]) + "\n"
