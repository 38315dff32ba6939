"""The dispatch by node class (tgc.lower.lowered.ExprVisitor): every evaluator of lowered expressions
(the lowered interpreter, the verifier and both code generators) has a method for
every node class, and one that lacks a method says which."""
from __future__ import annotations

import pytest

from tgc.lower.lowered import (ATOM_NODES, EXPR_NODES, NODE_METHODS, Acc, Add, Atom, Const, Expr, ExprVisitor,
                               FloorDiv, IdLoad, Ix, Map, Mul, VisitError)


def _visitors() -> list[type]:
    import tgc.backends.cpu.loops  # noqa: F401  (each defines a visitor)
    import tgc.backends.cuda.codegen  # noqa: F401
    import tgc.lower.interp  # noqa: F401
    import tgc.lower.verify  # noqa: F401

    out, todo = [], list(ExprVisitor.__subclasses__())
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo += cls.__subclasses__()
    return [c for c in out if c.__module__.startswith("tgc.")]


def test_the_tables_are_the_node_unions():
    from typing import get_args

    assert EXPR_NODES == get_args(Expr) and ATOM_NODES == get_args(Atom)
    assert set(NODE_METHODS) == set(EXPR_NODES) | set(ATOM_NODES)
    assert len(set(NODE_METHODS.values())) == len(NODE_METHODS)
    assert NODE_METHODS[str] == "atom_var" and NODE_METHODS[FloorDiv] == "atom_floor_div"
    assert {NODE_METHODS[c] for c in EXPR_NODES} >= {"expr_load", "expr_size_of", "expr_rand", "expr_mask"}


def test_every_visitor_covers_every_node_class():
    visitors = {c.__qualname__: c for c in _visitors()}
    assert {"_Machine", "_Verifier", "LoopGen", "_Gen"} <= set(visitors)
    for name, cls in visitors.items():
        assert cls.missing() == [], f"{cls.__module__}.{name} lacks {cls.missing()}"
        for node, method in NODE_METHODS.items():
            assert cls._expr_table.get(node, cls._atom_table.get(node)) is getattr(cls, method)


class _Partial(ExprVisitor):
    """Evaluates constants and sums of them only."""

    def expr_const(self, e: Const) -> float:
        return e.value

    def expr_add(self, e: Add) -> float:
        return sum(c * self.expr(a) for c, a in zip(e.coefs, e.args))

    def atom_var(self, a: str, env: dict) -> int:
        return env[a]


def test_dispatch_calls_the_method_for_the_class():
    v = _Partial()
    assert v.expr(Add((1.0, -2.0), (Const(3.0), Const(0.5)))) == 2.0
    assert v.atom("i", {"i": 7}) == 7


def test_a_missing_method_says_which_visitor_node_and_method():
    v = _Partial()
    assert "expr_mul" in _Partial.missing() and "expr_const" not in _Partial.missing()
    with pytest.raises(VisitError, match=r"_Partial has no method 'expr_mul': it cannot visit a Mul node"):
        v.expr(Add((1.0,), (Mul((Const(1.0), Const(2.0))),)))
    with pytest.raises(VisitError, match=r"_Partial has no method 'atom_floor_div'.* FloorDiv node"):
        v.atom(FloorDiv(Ix.var("i"), 2), {"i": 1})
    with pytest.raises(VisitError, match=r"_Partial has no method 'expr_acc'.* Acc node"):
        v.expr(Acc())


def test_something_that_is_not_a_node_is_refused():
    v = _Partial()
    with pytest.raises(VisitError, match=r"_Partial: Ix is not a lowered expression node"):
        v.expr(Ix.var("i"))
    with pytest.raises(VisitError, match=r"_Partial: Map is not an index atom"):
        v.atom(Map("exp", (Const(0.0),)), {})
    with pytest.raises(VisitError, match=r"_Partial: IdLoad is not a lowered expression node"):
        v.expr(IdLoad("ids", ()))
