"""Integer affine expressions over edge indices, and relations between them.

`Affine` is `sum(coef * edge) + const`, where coefficients and the constant are
sizes (`tgc.ir.sizes`): integers, or dim sizes such as `hd` in `hd*head + hd`.
`Relation` is a chain `e0 op0 e1 op1 e2 ...` with ops `= != < <= > >=`; it holds
where every link holds. An indicator tensor is 1 where its relation holds, else 0,
over the edges the relation names; reindexing is contraction with one.

Text form (the IR's): a term is `edge`, `COEF*edge` (COEF an int, a dim name, or a
parenthesized size), an integer, or `size(dim)`; terms are joined by ` + `/` - `.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from tgc.ir.sizes import Size, SizeError, SizeOp, parse_size, size_eval, size_op, size_str



@dataclass(frozen=True)
class Affine:
    terms: tuple[tuple[str, Size], ...]  # (edge, coefficient), sorted by edge, no zero coefs
    const: Size = 0

    @staticmethod
    def make(terms: Mapping[str, Size] | list[tuple[str, Size]], const: Size = 0) -> "Affine":
        acc: dict[str, Size] = {}
        for edge, coef in (terms.items() if isinstance(terms, Mapping) else terms):
            acc[edge] = size_op("+", acc[edge], coef) if edge in acc else coef
        return Affine(tuple(sorted((e, c) for e, c in acc.items() if c != 0)), const)

    def edges(self) -> tuple[str, ...]:
        return tuple(e for e, _ in self.terms)

    def coef(self, edge: str) -> Size:
        return dict(self.terms).get(edge, 0)

    def scaled(self, k: int) -> "Affine":
        if k == -1:
            return Affine.make([(e, _signed(-1, c)) for e, c in self.terms], _signed(-1, self.const))
        return Affine.make([(e, size_op("*", k, c)) for e, c in self.terms], size_op("*", k, self.const))

    def plus(self, other: "Affine", sign: int = 1) -> "Affine":
        other = other if sign == 1 else other.scaled(-1)
        return Affine.make(list(self.terms) + list(other.terms), size_op("+", self.const, other.const))

    def renamed(self, mapping: Mapping[str, str]) -> "Affine":
        return Affine.make([(mapping.get(e, e), c) for e, c in self.terms], self.const)

    def evaluate(self, index: Mapping[str, object], dims: Mapping[str, int]):
        """Value at integer (or numpy-array) edge indices `index`, dims bound by `dims`."""
        total = size_eval(self.const, dims)
        for edge, coef in self.terms:
            total = total + size_eval(coef, dims) * index[edge]
        return total

    def __str__(self) -> str:
        parts: list[tuple[int, str]] = []
        for edge, coef in self.terms:
            parts.append(_signed_term(coef, edge))
        if self.const != 0:
            parts.append(_signed_term(self.const, None))
        return join_signed(parts)


def join_signed(parts: list[tuple[int, str]]) -> str:
    """`a - b + c` from (sign, magnitude text) terms; "0" for none."""
    if not parts:
        return "0"
    text = ("-" if parts[0][0] < 0 else "") + parts[0][1]
    for sign, body in parts[1:]:
        text += (" - " if sign < 0 else " + ") + body
    return text


def _signed(sign: int, s: Size) -> Size:
    """`s` or `-s`, keeping a negated symbolic size in the form `0 - s`."""
    if sign > 0:
        return s
    if isinstance(s, SizeOp) and s.op == "-" and s.lhs == 0:
        return s.rhs
    return size_op("-", 0, s)


def _signed_term(coef: Size, edge: str | None) -> tuple[int, str]:
    sign = 1
    if isinstance(coef, int) and coef < 0:
        sign, coef = -1, -coef
    elif isinstance(coef, SizeOp) and coef.op == "-" and coef.lhs == 0:
        sign, coef = -1, coef.rhs
    if edge is None:
        return sign, (str(coef) if isinstance(coef, int) else f"size({size_str(coef)})")
    if coef == 1:
        return sign, edge
    c = size_str(coef)
    return sign, (f"{c}*{edge}" if isinstance(coef, (int, str)) else f"({c})*{edge}")


@dataclass(frozen=True)
class Relation:
    exprs: tuple[Affine, ...]
    ops: tuple[str, ...]

    def edges(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for e in self.exprs:
            for edge in e.edges():
                seen[edge] = None
        return tuple(sorted(seen))

    def renamed(self, mapping: Mapping[str, str]) -> "Relation":
        return Relation(tuple(e.renamed(mapping) for e in self.exprs), self.ops)

    def holds(self, index: Mapping[str, object], dims: Mapping[str, int]):
        """Boolean (or boolean array) where the whole chain holds."""
        import numpy as np

        vals = [e.evaluate(index, dims) for e in self.exprs]
        result = True
        for op, a, b in zip(self.ops, vals, vals[1:]):
            result = np.logical_and(result, _compare(op, a, b))
        return result

    def __str__(self) -> str:
        text = str(self.exprs[0])
        for op, e in zip(self.ops, self.exprs[1:]):
            text += f" {op} {e}"
        return text


def _compare(op: str, a, b):
    return {"=": lambda: a == b, "!=": lambda: a != b, "<": lambda: a < b,
            "<=": lambda: a <= b, ">": lambda: a > b, ">=": lambda: a >= b}[op]()


_NAME = re.compile(r"\s*(\d+|[A-Za-z_][\w'.]*)(\*([A-Za-z_][\w'.]*))?\s*")
_STAR_NAME = re.compile(r"\*([A-Za-z_][\w'.]*)\s*")


def _closing(text: str, start: int) -> int:
    """The index just past the parenthesis that closes the one at `start` (sizes nest:
    `size(t + (-1))`, `(min(a, b))*s`), or -1."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    return -1


def parse_affine(text: str) -> Affine:
    """Parse the text `str(Affine)` writes: terms `size(SIZE)`, `(SIZE)*edge`, `k*edge`,
    `dim*edge`, an integer or an edge, joined by + and -."""
    text = text.strip()
    terms: list[tuple[str, Size]] = []
    const: Size = 0
    sign, pos = 1, 0
    if text.startswith("-"):
        sign, pos = -1, 1

    def bad() -> SizeError:
        return SizeError(f"bad affine expression '{text}'")

    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if text.startswith("size(", pos) or text.startswith("(", pos):
            opened = pos + 4 if text.startswith("size(", pos) else pos
            end = _closing(text, opened)
            if end < 0:
                raise bad()
            inner = parse_size(text[opened + 1:end - 1])
            if opened > pos:   # size(SIZE): a constant
                const = size_op("+" if sign > 0 else "-", const, inner)
                m = re.compile(r"\s*").match(text, end)
            else:              # (SIZE)*edge
                m = _STAR_NAME.match(text, end)
                if not m:
                    raise bad()
                terms.append((m.group(1), _signed(sign, inner)))
        else:
            m = _NAME.match(text, pos)
            if not m:
                raise bad()
            if m.group(3) is not None:
                terms.append((m.group(3), _signed(sign, parse_size(m.group(1)))))
            elif m.group(1).isdigit():
                const = size_op("+", const, sign * int(m.group(1)))
            else:
                terms.append((m.group(1), sign))
        pos = m.end()
        if pos == len(text):
            return Affine.make(terms, const)
        if text[pos] not in "+-":
            raise bad()
        sign, pos = (1 if text[pos] == "+" else -1), pos + 1


_REL_SPLIT = re.compile(r"\s(!=|<=|>=|=|<|>)\s")


def parse_relation(text: str) -> Relation:
    parts = _REL_SPLIT.split(text.strip())
    exprs = tuple(parse_affine(p) for p in parts[0::2])
    ops = tuple(parts[1::2])
    if len(exprs) < 2:
        raise SizeError(f"a relation needs an operator: '{text}'")
    return Relation(exprs, ops)
