"""Size expressions: the integer arithmetic of dims.

A size is an `int`, the name of a dim (`str`), or a `SizeOp` combining two sizes with
`+ - * /` (`/` must divide exactly) or `min` (lowering's: a count of blocks that is
never more than the rows they divide, `min(32, batch)`). Literal sub-expressions are folded when built,
so a size that does not mention a symbolic dim is always a plain `int`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Union


class SizeError(ValueError):
    """A size expression that cannot be evaluated (unknown dim, inexact division)."""


class UnboundDim(SizeError):
    """A symbolic dim that nothing gave a size."""


@dataclass(frozen=True)
class SizeOp:
    op: str  # one of + - * / min
    lhs: "Size"
    rhs: "Size"


Size = Union[int, str, SizeOp]

_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}
MAX_SIZE = 2**62  # sizes, their products and their index arithmetic are int64 in compiled code


def _apply(op: str, a: int, b: int) -> int:
    if op == "min":
        return min(a, b)
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0:
        raise SizeError("division by zero in a size")
    if a % b:
        raise SizeError(f"{a} is not divisible by {b}")
    return a // b


def size_op(op: str, a: Size, b: Size) -> Size:
    """Build `a op b`, folding literals and the identities x+0, x*1, x/1."""
    if isinstance(a, int) and isinstance(b, int):
        return _apply(op, a, b)
    if op == "min":
        return a if a == b else SizeOp(op, a, b)
    if op in "+-" and b == 0:
        return a
    if op == "+" and a == 0:
        return b
    if op in "*/" and b == 1:
        return a
    if op == "*" and a == 1:
        return b
    return SizeOp(op, a, b)


def size_estimate(s: Size, env: Mapping[str, int]) -> int:
    """`s` for cost estimates at representative sizes: like `size_eval`, but `/` rounds
    down and the result is at least 1, so a size that only divides at some sizes has
    an estimate at every size."""
    if not isinstance(s, SizeOp):
        return max(1, size_eval(s, env))
    a, b = size_estimate(s.lhs, env), size_estimate(s.rhs, env)
    return max(1, a // b if s.op == "/" else _apply(s.op, a, b))


def size_eval(s: Size, env: Mapping[str, int]) -> int:
    """The value of `s` with symbolic dims taken from `env` (SizeError if missing)."""
    if isinstance(s, int):
        return s
    if isinstance(s, str):
        if s not in env:
            raise UnboundDim(f"dim '{s}' is not bound")
        return env[s]
    return _apply(s.op, size_eval(s.lhs, env), size_eval(s.rhs, env))


def size_eval_checked(s: Size, env: Mapping[str, int], what: str = "") -> int:
    """`size_eval`, with every intermediate value within +-MAX_SIZE (compiled code
    computes sizes in int64); otherwise a SizeError (its text starts with `what`)."""
    if isinstance(s, SizeOp):
        v = _apply(s.op, size_eval_checked(s.lhs, env, what), size_eval_checked(s.rhs, env, what))
    else:
        v = size_eval(s, env)
    if not -MAX_SIZE <= v <= MAX_SIZE:
        raise SizeError(f"{what + ': ' if what else ''}{size_str(s)} is {v}, over the size limit of 2^62")
    return v


def check_count(what: str, sizes, env: Mapping[str, int], itemsize: int) -> int:
    """The element count of a tensor of these sizes; SizeError if it, or its bytes
    (`itemsize` each), exceeds MAX_SIZE."""
    n = 1
    for s in sizes:
        n *= size_eval_checked(s, env, what)
        if n * itemsize > MAX_SIZE:
            raise SizeError(f"{what} would take more than 2^62 bytes (the size limit)")
    return n


def size_dims(s: Size) -> list[str]:
    """The dim names that `s` mentions, in order of first appearance."""
    if isinstance(s, int):
        return []
    if isinstance(s, str):
        return [s]
    out = size_dims(s.lhs)
    return out + [d for d in size_dims(s.rhs) if d not in out]


def size_collect(s: Size) -> Size:
    """`s` with its like terms collected, when it is a polynomial of dims (only `+ - *`):
    `batch * 48 * 11 + batch * 11 + 48` becomes `539 * batch + 48`; terms of higher
    degree first, then by name. Any other size comes back as it is. The same value at
    every binding of the dims: integer sums and products are exact."""
    terms = _polynomial(s)
    if terms is None:
        return s
    out: Size = 0
    for mono, k in sorted(terms.items(), key=lambda t: (-len(t[0]), t[0])):
        if not k:
            continue
        term: Size = abs(k)
        for d in mono:
            term = size_op("*", term, d)
        out = term if out == 0 and k > 0 else size_op("+" if k > 0 else "-", out, term)
    return out


def _polynomial(s: Size) -> dict[tuple[str, ...], int] | None:
    """`s` as {sorted dim names: coefficient}, or None if it divides or takes a min."""
    if isinstance(s, int):
        return {(): s}
    if isinstance(s, str):
        return {(s,): 1}
    if s.op not in "+-*":
        return None
    a, b = _polynomial(s.lhs), _polynomial(s.rhs)
    if a is None or b is None:
        return None
    out: dict[tuple[str, ...], int] = {}
    if s.op == "*":
        for ma, ka in a.items():
            for mb, kb in b.items():
                m = tuple(sorted(ma + mb))
                out[m] = out.get(m, 0) + ka * kb
    else:
        out = dict(a)
        for m, k in b.items():
            out[m] = out.get(m, 0) + (k if s.op == "+" else -k)
    return out


def size_str(s: Size, parent: int = 0, right: bool = False) -> str:
    """Text with the fewest parentheses that parses back to the same tree."""
    if isinstance(s, int):
        return str(s) if s >= 0 or parent == 0 else f"({s})"
    if isinstance(s, str):
        return s
    if s.op == "min":
        return f"min({size_str(s.lhs)}, {size_str(s.rhs)})"
    p = _PREC[s.op]
    text = f"{size_str(s.lhs, p)} {s.op} {size_str(s.rhs, p, True)}"
    return f"({text})" if p < parent or (p == parent and right) else text


def parse_size(text: str) -> Size:
    """Parse the text `size_str` writes: ints, names, + - * /, min(a, b) and parentheses."""
    import re

    toks = re.findall(r"\d+|[A-Za-z_][A-Za-z0-9_'.]*|[-+*/(),]|\S", text)
    pos = 0

    def peek() -> str | None:
        return toks[pos] if pos < len(toks) else None

    def take() -> str:
        nonlocal pos
        if pos >= len(toks):
            raise SizeError(f"incomplete size expression '{text}'")
        pos += 1
        return toks[pos - 1]

    def atom() -> Size:
        t = take()
        if t == "(":
            v = expr(1)
            if take() != ")":
                raise SizeError(f"expected ')' in size expression '{text}'")
            return v
        if t == "-":
            return size_op("-", 0, atom())
        if t.isdigit():
            return int(t)
        if t == "min" and peek() == "(":
            take()
            a = expr(1)
            if take() != ",":
                raise SizeError(f"expected ',' in size expression '{text}'")
            b = expr(1)
            if take() != ")":
                raise SizeError(f"expected ')' in size expression '{text}'")
            return size_op("min", a, b)
        if re.match(r"[A-Za-z_]", t):
            return t
        raise SizeError(f"unexpected '{t}' in size expression '{text}'")

    def expr(min_prec: int) -> Size:
        lhs = atom()
        while peek() in _PREC and _PREC[peek()] >= min_prec:
            op = take()
            lhs = size_op(op, lhs, expr(_PREC[op] + 1))
        return lhs

    result = expr(1)
    if pos != len(toks):
        raise SizeError(f"unexpected '{toks[pos]}' in size expression '{text}'")
    return result
