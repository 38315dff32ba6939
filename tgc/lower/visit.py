"""One dispatch by node class for everything that evaluates a lowered expression.

The lowered interpreter (`tgc.lower.interp`), the CPU's loop generator
(`tgc.backends.cpu.loops`) and the CUDA generator (`tgc.backends.cuda.codegen`) each
turn an expression tree of `tgc.lower.lowered` into something of their own (numpy
arrays, LLVM values, C text). Each subclasses `ExprVisitor` and defines one method per
node class; `ExprVisitor` looks the method up by the node's class in a table built
once per subclass, so there is no chain of `isinstance` tests to keep in step.

Two families of nodes, each with its own entry point:

- expressions (`lowered.Expr`: `Load`, `Const`, `SizeOf`, `Add`, `Mul`, `Map`,
  `Mask`, `Acc`, `Rand`): `visitor.expr(e, *ctx)` calls `expr_<node>(e, *ctx)`,
  the node's class name in snake case (`SizeOf` -> `expr_size_of`);
- index atoms (`lowered.Atom`: a loop variable `str`, `IdLoad`, `FloorDiv`):
  `visitor.atom(a, *ctx)` calls `atom_var`, `atom_id_load` or `atom_floor_div`.

`ctx` is whatever the visitor threads through the tree (the interpreter's index
grids and active mask, the CPU's loop variables and the reduced value, the CUDA
generator's `_Ctx`); the dispatch passes it on untouched. The tables come from the
`Expr` and `Atom` unions themselves (`NODE_METHODS`), so a node class added there
is a method every visitor lacks: `missing()` lists them (tests/lower/test_visit.py
asks it of every visitor), and visiting such a node raises `VisitError` naming the
visitor, the node class and the method to write. The dispatch is one dict lookup
on the exact class and one call; the table is built when the subclass is defined
(`__init_subclass__`), so a method assigned to the class afterwards is not seen.
"""
from __future__ import annotations

import re
from typing import Callable, ClassVar, get_args

from tgc.lower.lowered import Atom, Expr


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


EXPR_NODES: tuple[type, ...] = get_args(Expr)
ATOM_NODES: tuple[type, ...] = get_args(Atom)

NODE_METHODS: dict[type, str] = {
    **{node: "expr_" + _snake(node.__name__) for node in EXPR_NODES},
    **{node: "atom_" + ("var" if node is str else _snake(node.__name__)) for node in ATOM_NODES},
}
"""The method a visitor defines for each node class."""


class VisitError(TypeError):
    """A visitor met a node it has no method for, or something that is not a node."""


def _lacking(visitor: type, node: type, name: str) -> Callable:
    def fail(self, e, *ctx):
        raise VisitError(f"{visitor.__name__} has no method '{name}': it cannot visit a "
                         f"{node.__name__} node ({e!r})")
    return fail


class ExprVisitor:
    """Base of every evaluator of lowered expressions: subclasses define `expr_<node>`
    and `atom_<node>` methods (see the module docstring) and call `self.expr(e, *ctx)`
    and `self.atom(a, *ctx)` to evaluate a subtree."""

    _expr_table: ClassVar[dict[type, Callable]] = {}
    _atom_table: ClassVar[dict[type, Callable]] = {}

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        table = {node: getattr(cls, name, None) or _lacking(cls, node, name) for node, name in NODE_METHODS.items()}
        cls._expr_table = {node: table[node] for node in EXPR_NODES}
        cls._atom_table = {node: table[node] for node in ATOM_NODES}

    @classmethod
    def missing(cls) -> list[str]:
        """The node methods this visitor does not define (every one should be)."""
        return [name for name in NODE_METHODS.values() if getattr(cls, name, None) is None]

    def expr(self, e: Expr, *ctx):
        """`e` evaluated by the method for its class."""
        try:
            method = self._expr_table[type(e)]
        except KeyError:
            raise VisitError(f"{type(self).__name__}: {type(e).__name__} is not a lowered expression node "
                             f"({e!r})") from None
        return method(self, e, *ctx)

    def atom(self, a: Atom, *ctx):
        """The index atom `a` evaluated by the method for its class."""
        try:
            method = self._atom_table[type(a)]
        except KeyError:
            raise VisitError(f"{type(self).__name__}: {type(a).__name__} is not an index atom ({a!r})") from None
        return method(self, a, *ctx)
