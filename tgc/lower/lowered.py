"""Lowered forms: the kernels, buffers and workspace plan that `fuse`, `layout`,
a backend's own stages (the CPU's `group`) and `plan` produce, and their
text form (`print_lowered`, what `tgc dump-ir --after fuse|layout|group|plan` prints;
`tgc.lower.text` reads it back, and `tgc.lower.verify` states the rules a program must keep).

Backend-neutral: a program is a list of kernels over named buffers.

- A `Buffer` is a materialized tensor: an argument, an output, or a temporary in
  the workspace. Its `order` (the physical axis order, outermost first) is set by
  `layout` (arguments and outputs: their ABI order); its `slot` by `plan`.
- A `LoopKernel` computes `out[index] = epilogue(R_red(body))` over a loop nest:
  `loops` are loop variables (named like the edges they run over), `red` the
  reduced ones, `reduce` one of '' (no reduction), 'sum', 'max', 'min'. `body` and
  `epilogue` are expression trees (`Load`, `Const`, `Map`, ... below); `Acc` in the
  epilogue is the reduced value. A `scatter` kernel zeroes `out` and then adds
  `body` into `out[index]`, whose index goes through gathered ids; with `reduce`
  'max' or 'min' (a segment reduction) it fills `out` with -inf or inf and keeps
  the maximum or minimum instead (NaN propagates).
- A `GemmKernel` is `out[batch, m, n] = sum_k a[batch, m, k] * b[batch, k, n]`
  over edge groups; `a`/`b` are `View`s (a buffer seen through an edge renaming).
  With `taps` and `shifts` it is a loop of GEMMs on shifted views (a convolution:
  `y[b, o, s] = sum_k W[k, o, c] @ x[b, c, s + k - 2]`, the range of `s` clipped
  per tap), accumulating into `out`.
  With `acc` (`gemm %c += a @ b`, `tgc.lower.accumulate`) `out` keeps its value and the
  product is added into it: every call runs with beta = 1, none zeroes `out` first.
  Its `prefix` pairs (product edge, buffer edge) add it into the leading block of a
  longer edge of `out` (`prefix(s.1 in s)`: indices 0 .. size(s.1) - 1 of `s`).
  With an `epilogue` (`EpilogueOut`s, from `tgc.lower.epilogue`), each element of the
  product is also the `Acc` of expressions over the product's edges (as loop
  variables): `then %y[e...] = expr` stores `expr` into output `y`, which has exactly
  the product's edges, as the product is stored. The outputs are computed in order at
  each element: an expression reads the outputs before it (their new values) and its
  own output (its old value) only at the element's own index, `out` never (it reads
  `Acc`), other buffers at any index of those variables. `out` holds the product, or,
  when `out` is one of the outputs, that output's value (then only the outputs after
  it load `out`: its new value; the product lives on as `Acc`).
- A backend's own lowering stage may add kinds of kernel (the CPU's `group` adds
  `tgc.backends.cpu.group.LoopGroup`). Neutral code reaches every kernel through
  `buffers_read()`, `writes()`, `buffers_used()`, `text()`, and for a kind of its
  own `renamed(mapping)`, `can_retarget(low, target, tmp)` (plan's in-place
  updates) and `interpret(interp)` (the lowered interpreter).
- A `StepLoop` runs a loop over an edge (`repeat`, `scan`): `step`, a lowered program
  of its own, compiled once, runs `trip` times (the index i counts down with
  `reverse`). Each of its arguments and outputs is bound to a buffer of the enclosing
  program: a stacked one (the loop edge outermost in its order) at offset i times the
  slice, the others whole. After each step, output k < `carries` (the carry's new
  value) is copied into the buffer argument k is bound to (the carry); so a step
  never writes what it reads, and the last step leaves the result in the carry's
  buffer. The step's temporaries live in the enclosing workspace, from slot
  `slot_base` on (`plan`).
- A temporary with an `alias` holds no bytes of its own: it is buffer `alias`'s bytes
  (the same row-major offsets, another edge set: heads `[t, head, hd]` read as the
  width `[t, c]`), each in its own order: writing either writes both
  (`tgc.lower.alias`); or, both sizes known, the first of more bytes (a prefix: a
  causal run's keys of `k`). The buffer it views is no alias itself.
- A `Check` makes the program fail (nonzero status, before any write) when an id
  buffer holds a value outside `[0, size)`.

Indices (`Ix`) are integer affine combinations of atoms — a loop variable, an id
loaded from an i32 buffer (`IdLoad`), or a floor division (`FloorDiv`) — with
`Size` coefficients, so symbolic dims stay symbolic until run time. A `Cond` is
`ix op 0`; `Mask(conds, e)` is `e` where every cond holds, else 0 (and `e` is not
evaluated there: its loads may be out of range).

What evaluates an expression (the lowered interpreter, each code generator) does so
with a method per node class of `Expr` and `Atom`, dispatched by `ExprVisitor` (below).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
import re
from typing import Callable, ClassVar, Collection, Mapping, Sequence, Union, get_args

from tgc.ir.dtypes import itemsize
from tgc.ir.module import Module
from tgc.ir.printer import print_module
from tgc.ir.sizes import Size, SizeOp, size_op, size_str

# ---------------------------------------------------------------- indices


@dataclass(frozen=True)
class IdLoad:
    buf: str
    index: tuple[tuple[str, "Ix"], ...]  # (buffer edge, index), sorted by edge

    def __str__(self) -> str:
        return f"%{self.buf}[{_index_text(self.index)}]"


@dataclass(frozen=True)
class FloorDiv:
    num: "Ix"
    den: Size

    def __str__(self) -> str:
        return f"floor(({self.num}) / {size_str(self.den)})"


Atom = Union[str, IdLoad, FloorDiv]


def _atom_key(a: Atom) -> tuple[int, str]:
    return (0, a) if isinstance(a, str) else (1, str(a))


def neg(s: Size) -> Size:
    """-s, undoing a negation rather than stacking one."""
    if isinstance(s, SizeOp) and ((s.op == "*" and s.lhs == -1) or (s.op == "-" and s.lhs == 0)):
        return s.rhs
    return size_op("*", -1, s)


def smul(k: Size, s: Size) -> Size:
    """k * s, with the sign of -1 folded (see `neg`)."""
    if k == -1:
        return neg(s)
    if s == -1:
        return neg(k)
    return size_op("*", k, s)


@dataclass(frozen=True)
class Ix:
    """sum(coef * atom) + const."""
    terms: tuple[tuple[Atom, Size], ...] = ()
    const: Size = 0

    @staticmethod
    def make(terms: Sequence[tuple[Atom, Size]], const: Size = 0) -> "Ix":
        acc: dict[Atom, Size] = {}
        for atom, coef in terms:
            acc[atom] = size_op("+", acc[atom], coef) if atom in acc else coef
        kept = sorted(((a, c) for a, c in acc.items() if c != 0), key=lambda t: _atom_key(t[0]))
        return Ix(tuple(kept), const)

    @staticmethod
    def var(name: str) -> "Ix":
        return Ix(((name, 1),), 0)

    @staticmethod
    def of(atom: Atom) -> "Ix":
        return Ix(((atom, 1),), 0)

    def plus(self, other: "Ix", sign: int = 1) -> "Ix":
        o = other if sign == 1 else other.scaled(-1)
        return Ix.make(list(self.terms) + list(o.terms), size_op("+", self.const, o.const))

    def plus_const(self, c: Size) -> "Ix":
        return Ix(self.terms, size_op("+", self.const, c))

    def scaled(self, k: Size) -> "Ix":
        return Ix.make([(a, smul(k, c)) for a, c in self.terms], smul(k, self.const))

    def coef(self, atom: Atom) -> Size:
        return dict(self.terms).get(atom, 0)

    def as_var(self) -> str | None:
        """The loop variable when this index is exactly one, else None."""
        if len(self.terms) == 1 and self.const == 0 and self.terms[0][1] == 1 and isinstance(self.terms[0][0], str):
            return self.terms[0][0]
        return None

    def vars(self) -> set[str]:
        out: set[str] = set()
        for a, _ in self.terms:
            if isinstance(a, str):
                out.add(a)
            elif isinstance(a, IdLoad):
                for _, ix in a.index:
                    out |= ix.vars()
            else:
                out |= a.num.vars()
        return out

    def subst(self, mapping: Mapping[str, "Ix"]) -> "Ix":
        if not mapping:
            return self
        out = Ix((), self.const)
        for a, c in self.terms:
            out = out.plus(_subst_atom(a, mapping).scaled(c))
        return out

    def __str__(self) -> str:
        parts: list[str] = []
        for a, c in self.terms:
            body = str(a) if c == 1 else f"-{a}" if c == -1 else f"{_coef_text(c)}*{a}"
            parts.append(body)
        if self.const != 0 or not parts:
            parts.append(str(self.const) if isinstance(self.const, int) else f"({size_str(self.const)})")
        return " + ".join(parts).replace("+ -", "- ")


def _coef_text(c: Size) -> str:
    """A term's coefficient: a symbolic constant term is always in parentheses (`x + (n)`),
    so that a bare name is always a loop variable."""
    return str(c) if isinstance(c, (int, str)) else f"({size_str(c)})"


def _subst_atom(a: Atom, mapping: Mapping[str, Ix]) -> Ix:
    if isinstance(a, str):
        return mapping.get(a, Ix.var(a))
    if isinstance(a, IdLoad):
        return Ix.of(IdLoad(a.buf, tuple((e, ix.subst(mapping)) for e, ix in a.index)))
    return Ix.of(FloorDiv(a.num.subst(mapping), a.den))


def _index_text(index) -> str:
    return ", ".join(str(ix) for _, ix in index)


@dataclass(frozen=True)
class Cond:
    ix: Ix
    op: str  # = != < <= > >=  (compared with 0)

    def subst(self, mapping: Mapping[str, Ix]) -> "Cond":
        return Cond(self.ix.subst(mapping), self.op)

    def __str__(self) -> str:
        return f"{self.ix} {self.op} 0"


# ---------------------------------------------------------------- expressions


@dataclass(frozen=True)
class Load:
    buf: str
    index: tuple[tuple[str, Ix], ...]  # (buffer edge, index), sorted by edge


@dataclass(frozen=True)
class Const:
    value: float


@dataclass(frozen=True)
class SizeOf:
    size: Size


@dataclass(frozen=True)
class Add:
    coefs: tuple[float, ...]
    args: tuple["Expr", ...]


WIDE_SUM = 3   # an f32 `Add` of at least this many terms is computed in f64 (`wide_sum`)


def wide_sum(e: Add, dtype: str) -> bool:
    """Whether the sum `e` of a program of float type `dtype` is computed in f64 and
    rounded once, by every backend: an f32 sum of at least WIDE_SUM terms, each widened
    (a product's factors before they are multiplied, so a product of two f32 values
    is exact) and scaled in f64. The canonical form orders a flattened sum's terms
    (not the source: `a + (b - c)` becomes `add[1, 1, -1](a, b, c)`); summed in f32,
    its error is relative to its largest partial sum, which depends on that order (with
    b, c near 1e4 and a near 1e-2, a + b - c lost a, where PyTorch's b - c is exact).
    In f64 the error stays below f32's rounding of the result unless the terms cancel
    to 2^-29 of their size. A sum of two terms rounds once in f32 already. Chosen from
    the expression alone, so an expression has the same bits in every kernel."""
    return dtype == "f32" and len(e.args) >= WIDE_SUM


def wide_term_factors(low: "Lowered | None", term: "Expr") -> bool:
    """Whether the product `term` of a wide sum (`wide_sum`) has its factors widened to
    f64 before they are multiplied, rather than multiplied in f32 and the rounded
    product widened: a product of three or more factors, or any product with
    `Options.sum_exact_products` (the rule until stop 52) or no `low` (an exp's sum,
    `wide_exp`, keeps exact products). A product of two factors is rounded in f32.
    What makes a wide sum necessary is the order of its additions: the canonical order
    is not the source's, so an f32 partial sum can hold a large term that a later one
    cancels, and a small one is lost (`a + (b - c)`). A term's own value does not depend
    on that order: PyTorch rounds each multiplication of a product as tgc's f32 product
    does, so a product rounded in f32 (one rounding per multiplication, the same factor
    order in every kernel: `factor_order`) and then added in f64 errs by at most the
    roundings PyTorch's own product has, plus one rounding of the sum, whatever the
    order of the terms; two equal products still cancel to 0. Two factors only: their
    f32 product is the same in either order, PyTorch's to the bit; three or more are
    in canonical order, not the source's, and (a * b) * c can overflow where the
    source's a * (b * c) does not (`test_f32_product_reordered_does_not_overflow`), so
    those stay widened. Widening two factors bought exact products, beyond PyTorch's
    accuracy, for two conversions and an f64 multiply per factor in a 16-lane loop
    (the GELU backward's GEMM epilogue: about a third of its instructions)."""
    if not isinstance(term, Mul):
        return False
    return low is None or low.sum_exact_products or len(term.args) > 2


def wide_exp(e: "Map", dtype: str, lse: Collection[str]) -> bool:
    """Whether `e` is an f32 softmax weight `exp(d - lse)`: an `exp` of a sum with a term
    read from `lse`, the buffers that hold a log-sum-exp (`logsumexp_outputs`). An
    interpreter and the CUDA kernels take that sum in f64 and do not round it before
    the exp. Rounded to f32 first, `d - lse` (`d` the row's shifted logits) gives a
    weight far out in the tail (`d` = -85) 85 ulps of relative error, where PyTorch's
    `exp(d) / sum` has a few, and a value of e^85 that it multiplies carries it to the
    result (tests/e2e/test_numerics_f32.py, softmax_far_tail_weight: 17x PyTorch's
    error). The CPU's loop groups compute these weights as `exp(d - m) / s`
    (`tgc.backends.cpu.group`, exp_once), which is as accurate. An `fp_strict` program
    has no logsumexp kernel (its softmax is the source's exp(x - m) / sum), so its
    values keep every rounding."""
    if dtype != "f32" or e.fn != "exp" or len(e.args) != 1 or not isinstance(e.args[0], Add):
        return False
    return any(isinstance(a, Load) and a.buf in lse for a in e.args[0].args)


def logsumexp_outputs(low: "Lowered") -> frozenset[str]:
    """The buffers of `low` that hold a log-sum-exp (`wide_exp`; the IR's rule is
    `tgc.ir.values.holds_logsumexp`): those its logsumexp kernels write, members of a
    backend's groups (`members`: the CPU's LoopGroup, CUDA's RowGroup) included; those
    a kernel writes as the log of a loop's carry (the online softmax's `log(l)`, l the
    running sum of exp(X - m) its first key loop carries: `tgc.opt.stream_keys`); the
    copies of these; and a step's arguments bound to one of the enclosing program's
    (`Buffer.lse`: the second key loop reads the first one's lse from outside)."""
    ks = [m for k in low.kernels for m in (getattr(k, "members", None) or (k,))]
    carries = {b.buf for k in ks if isinstance(k, StepLoop) for b in k.args[:k.carries]}
    out = {n for n, b in low.buffers.items() if b.lse}
    for k in ks:
        if not isinstance(k, LoopKernel):
            continue
        body = k.body
        if (k.reduce == "logsumexp"
                or (not k.reduce and isinstance(body, Map) and body.fn == "log" and len(body.args) == 1
                    and isinstance(body.args[0], Load) and body.args[0].buf in carries)
                or (not k.reduce and isinstance(body, Load) and body.buf in out)):
            out.add(k.out)
    return frozenset(out)


@dataclass(frozen=True)
class Mul:
    args: tuple["Expr", ...]


@dataclass(frozen=True)
class Map:
    fn: str
    args: tuple["Expr", ...]


@dataclass(frozen=True)
class Mask:
    conds: tuple[Cond, ...]
    arg: "Expr"


@dataclass(frozen=True)
class Acc:
    pass


@dataclass(frozen=True)
class Rand:
    """A Philox draw (tgc.ir.philox): `kind` ('rand' or 'randn') from the key `key` (an
    index: the i32 key loaded as an `IdLoad`) folded with `folds` (integers, or indices:
    an i32 input's value loaded as an `IdLoad`), at the 64-bit `counter` (the element's
    row-major index over the draw's edges, sorted by name)."""
    kind: str
    folds: tuple["int | Ix", ...]
    key: Ix
    counter: Ix
    draw: str = ""   # '' (the program's float type) or 'f32' (f32 draws in an f64 program)


Expr = Union[Load, Const, SizeOf, Add, Mul, Map, Mask, Acc, Rand]


# ---------------------------------------------------------------- visiting
#
# One dispatch by node class for everything that walks a lowered expression.
#
# The lowered interpreter (`tgc.lower.interp`), the verifier (`tgc.lower.verify`),
# the CPU's loop generator (`tgc.backends.cpu.loops`) and the CUDA generator
# (`tgc.backends.cuda.codegen`) each turn an expression tree into something of their
# own (numpy arrays, findings, LLVM values, C text), and so do the queries here
# (`children`, `expr_text`, `rename_buffers`) and elsewhere (`tgc.lower.cost`'s
# operation count, the loop variables an expression reads). Each subclasses `ExprVisitor` and defines one method per
# node class; `ExprVisitor` looks the method up by the node's class in a table built
# once per subclass, so there is no chain of `isinstance` tests to keep in step.
#
# Two families of nodes, each with its own entry point:
#
# - expressions (`Expr`: `Load`, `Const`, `SizeOf`, `Add`, `Mul`, `Map`,
#   `Mask`, `Acc`, `Rand`): `visitor.expr(e, *ctx)` calls `expr_<node>(e, *ctx)`,
#   the node's class name in snake case (`SizeOf` -> `expr_size_of`);
# - index atoms (`Atom`: a loop variable `str`, `IdLoad`, `FloorDiv`):
#   `visitor.atom(a, *ctx)` calls `atom_var`, `atom_id_load` or `atom_floor_div`.
#
# `ctx` is whatever the visitor threads through the tree (the interpreter's index
# grids and active mask, the CPU's loop variables and the reduced value, the CUDA
# generator's `_Ctx`); the dispatch passes it on untouched. The tables come from the
# `Expr` and `Atom` unions themselves (`NODE_METHODS`), so a node class added there
# is a method every visitor lacks: `missing()` lists them (tests/lower/test_visit.py
# asks it of every visitor), and visiting such a node raises `VisitError` naming the
# visitor, the node class and the method to write. The dispatch is one dict lookup
# on the exact class and one call; the table is built when the subclass is defined
# (`__init_subclass__`), so a method assigned to the class afterwards is not seen.


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


class _Children(ExprVisitor):
    """The direct subexpressions of a node (an index atom has none)."""

    def expr_add(self, e) -> tuple[Expr, ...]:
        return e.args

    expr_mul = expr_map = expr_add

    def expr_mask(self, e: Mask) -> tuple[Expr, ...]:
        return (e.arg,)

    def expr_load(self, e) -> tuple[Expr, ...]:
        return ()

    expr_const = expr_size_of = expr_acc = expr_rand = expr_load
    atom_var = atom_id_load = atom_floor_div = expr_load


_CHILDREN = _Children()


def children(e: Expr) -> tuple[Expr, ...]:
    return _CHILDREN.expr(e)


def walk(e: Expr):
    """Every node of the tree, parents first."""
    yield e
    for c in children(e):
        yield from walk(c)


class _Text(ExprVisitor):
    """An expression's text in `print_lowered` (what `tgc.lower.text` reads back)."""

    def expr_load(self, e: Load) -> str:
        return f"%{e.buf}[{_index_text(e.index)}]"

    def expr_const(self, e: Const) -> str:
        return repr(e.value)

    def expr_size_of(self, e: SizeOf) -> str:
        return f"size({size_str(e.size)})"

    def expr_acc(self, e: Acc) -> str:
        return "acc"

    def expr_rand(self, e: Rand) -> str:
        folds = "".join(f", fold {n}" for n in e.folds)
        return f"{e.kind}({e.key}{folds}; {e.counter}){' as ' + e.draw if e.draw else ''}"

    def expr_mask(self, e: Mask) -> str:
        return f"mask[{', '.join(map(str, e.conds))}]({self.expr(e.arg)})"

    def _args(self, e) -> str:
        return ", ".join(self.expr(a) for a in e.args)

    def expr_add(self, e: Add) -> str:
        return f"add[{', '.join(repr(c) for c in e.coefs)}]({self._args(e)})"

    def expr_mul(self, e: Mul) -> str:
        return f"mul({self._args(e)})"

    def expr_map(self, e: Map) -> str:
        return f"{e.fn}({self._args(e)})"

    def atom_var(self, a: str) -> str:
        return a

    def atom_id_load(self, a: IdLoad) -> str:
        return str(a)

    atom_floor_div = atom_id_load


_TEXT = _Text()


def expr_text(e: Expr) -> str:
    return _TEXT.expr(e)


# ---------------------------------------------------------------- buffers and kernels


@dataclass
class Buffer:
    name: str
    dtype: str                      # f32 | f64 | i32, or bf16 | f16: 2-byte elements (tgc.lower.narrow)
    edges: tuple[str, ...]          # sorted
    kind: str                       # arg | out | temp
    index: int = -1                 # position in the args / outputs ABI lists
    order: tuple[str, ...] | None = None
    slot: int | None = None
    prefer: tuple[str, ...] | None = None  # an order layout should try first
    # a temporary whose bytes are buffer `alias`'s, in its own order (`tgc.lower.alias`:
    # a split or merge of edges as strides, no copy)
    alias: str | None = None
    # a loop step's argument bound to a log-sum-exp of the enclosing program (`holds_logsumexp`):
    # softmax weights exp(d - lse) that read it take the sum unrounded (`wide_exp`)
    lse: bool = False

    def text(self) -> str:
        where = {"arg": f"arg {self.index}", "out": f"out {self.index}", "temp": "temp"}[self.kind]
        text = f"buffer %{self.name} : {self.dtype}[{', '.join(self.edges)}] {where}"
        if self.order is not None:
            text += f" order [{', '.join(self.order)}]"
        if self.prefer is not None:
            text += f" prefer [{', '.join(self.prefer)}]"
        if self.alias is not None:
            text += f" alias %{self.alias}"
        if self.lse:
            text += " logsumexp"
        if self.slot is not None:
            text += f" slot {self.slot}"
        return text


@dataclass(frozen=True)
class View:
    """A buffer seen with renamed edges: `edges` maps view edge -> buffer edge."""
    buf: str
    edges: tuple[tuple[str, str], ...]

    def buf_edge(self, e: str) -> str:
        return dict(self.edges)[e]

    def view_order(self, order: Sequence[str]) -> tuple[str, ...]:
        back = {b: v for v, b in self.edges}
        return tuple(back[b] for b in order)

    def __str__(self) -> str:
        return f"%{self.buf}[{', '.join(v if v == b else f'{b} -> {v}' for v, b in self.edges)}]"


@dataclass
class LoopKernel:
    out: str
    index: tuple[tuple[str, Ix], ...]   # out buffer edge -> index
    loops: tuple[str, ...]              # loop variables, outermost first
    sizes: dict[str, Size]              # extent of each loop variable
    body: Expr
    reduce: str = ""                    # '' | sum | max | min | logsumexp | maxshift
    # (maxshift: the max a softmax or logsumexp subtracts before its exp; it may skip NaNs and
    # order -0 and +0 either way, as exp(x - m) is NaN for a NaN x whatever m is)
    red: tuple[str, ...] = ()
    epilogue: Expr | None = None
    scatter: bool = False
    note: str = ""                      # what it computes, for dumps
    # tighter ranges for some reduced loops: var -> (lower bounds, upper bounds); the
    # loop runs over [max(0, *lower), min(size, *upper)) (the rest of it adds zeros)
    bounds: dict[str, tuple[tuple[Ix, ...], tuple[Ix, ...]]] = field(default_factory=dict)

    def buffers_read(self) -> set[str]:
        reads = self._reads()
        return set(reads) | ({self.out} if self.scatter else set())

    def writes(self) -> set[str]:
        return {self.out}

    def buffers_used(self) -> list[str]:
        """`out`, then every buffer read, in order of first appearance."""
        return list(dict.fromkeys([self.out, *self._reads()]))

    def _reads(self) -> dict[str, None]:
        """The buffers read, in order of first appearance (do not modify it). Kept with
        the kernel until one of the fields it comes from is replaced (expressions,
        indices and bounds are immutable values: the key is their identity): passes
        that ask every later kernel what it reads, once per GEMM, would otherwise walk
        every expression again (48 unrolled GPT blocks: O(kernels^2) expression walks)."""
        key = (id(self.body), id(self.epilogue), id(self.index), id(self.bounds),
               tuple((v, id(b)) for v, b in self.bounds.items()))
        cached = self.__dict__.get("_reads_cache")
        if cached is not None and cached[0] == key:
            return cached[1]
        out: dict[str, None] = {}
        for root in [self.body] + ([self.epilogue] if self.epilogue is not None else []):
            _READS.expr(root, out)
        _READS.ixs((ix for _, ix in self.index), out)
        _READS.ixs((ix for lo, hi in self.bounds.values() for ix in lo + hi), out)
        self.__dict__["_reads_cache"] = (key, out, self.body, self.epilogue, self.index, tuple(self.bounds.values()))
        return out

    def text(self) -> str:
        head = f"loop %{self.out}[{_index_text(self.index)}]"
        red = f" {self.reduce}[{', '.join(self.red)}]" if self.reduce and not self.scatter else \
            f" sum[{', '.join(self.red)}]" if self.red else ""
        head += f" {self.reduce or '+'}=" if self.scatter else " ="
        body = f"{red} {expr_text(self.body)}"
        if self.epilogue is not None:
            body = f" {expr_text(self.epilogue)}  where acc ={body}"
        loops = ", ".join(self._loop_text(v) for v in self.loops)
        return f"{head}{body}\n      for {loops}" + (f"    # {self.note}" if self.note else "")


    def _loop_text(self, v: str) -> str:
        lo, hi = self.bounds.get(v, ((), ()))
        if not lo and not hi:
            return f"{v} < {size_str(self.sizes[v])}"
        lows = ", ".join(["0"] + [str(x) for x in lo])
        highs = ", ".join([size_str(self.sizes[v])] + [str(x) for x in hi])
        return f"{v} in [max({lows}), min({highs}))"


class _Reads(ExprVisitor):
    """The buffers an expression reads, its loads' and the id buffers its indices read,
    added to `out` in order of first appearance (a node before its operands)."""

    def ixs(self, ixs, out: dict[str, None]) -> None:
        for ix in ixs:
            for a, _ in ix.terms:
                self.atom(a, out)

    def expr_load(self, e: Load, out: dict[str, None]) -> None:
        out[e.buf] = None
        self.ixs((ix for _, ix in e.index), out)

    def expr_mask(self, e: Mask, out: dict[str, None]) -> None:
        self.ixs((c.ix for c in e.conds), out)
        self.expr(e.arg, out)

    def expr_rand(self, e: Rand, out: dict[str, None]) -> None:
        self.ixs((e.key, e.counter, *(n for n in e.folds if isinstance(n, Ix))), out)

    def expr_add(self, e, out: dict[str, None]) -> None:
        for a in e.args:
            self.expr(a, out)

    expr_mul = expr_map = expr_add

    def expr_const(self, e, out: dict[str, None]) -> None:
        pass

    expr_size_of = expr_acc = atom_var = expr_const

    def atom_id_load(self, a: IdLoad, out: dict[str, None]) -> None:
        out[a.buf] = None
        self.ixs((i for _, i in a.index), out)

    def atom_floor_div(self, a: FloorDiv, out: dict[str, None]) -> None:
        self.ixs([a.num], out)


_READS = _Reads()


@dataclass
class GemmKernel:
    out: str
    a: View
    b: View
    batch: tuple[str, ...]
    m: tuple[str, ...]
    n: tuple[str, ...]
    k: tuple[str, ...]
    note: str = ""
    # summed edges looped outside the calls (each call accumulates into `out`)
    taps: tuple[str, ...] = ()
    # (operand 'a' | 'b', view edge, shift): the operand is read at `edge + shift`
    # (shift: an index over batch and tap edges); each call clips the edge's range
    # to where every shifted index is in bounds (the rest of the sum is zeros)
    shifts: tuple[tuple[str, str, Ix], ...] = ()
    # a complex product (cgemm/zgemm): None for a real one, else whether each operand
    # is conjugated. Its three buffers hold float pairs along `re.im`, their innermost
    # axis; both views map `re.im` to itself, and the groups never hold it. `alpha`
    # scales the product (real).
    cplx: tuple[bool, bool] | None = None
    alpha: float = 1.0
    # whether each operand (a, b) is rounded to bf16 as it is read (a backend's bf16
    # GEMM packing an f32 buffer: no rounded copy is stored); its buffer holds f32
    rounded: tuple[bool, bool] = (False, False)
    # what is computed from each element of the product as it is stored (`GemmEpilogue`:
    # outputs over the product's edges); () for none
    epilogue: tuple["EpilogueOut", ...] = ()
    # `out += a @ b` (beta = 1): `out`'s old value is the first term of every element's
    # sum (`tgc.lower.accumulate`); no taps, shifts, complex pairs, rounding or epilogue
    acc: bool = False
    # (product edge, `out`'s edge): with `acc`, the product adds into the first
    # size(product edge) indices of that longer edge of `out` (its other indices keep their values)
    prefix: tuple[tuple[str, str], ...] = ()

    def out_edge(self, e: str) -> str:
        """`out`'s edge that product edge `e` lies along (itself, or its `prefix` edge)."""
        return dict(self.prefix).get(e, e)

    def out_view(self) -> View:
        """`out` as a view with the product's edges (`View.edges`: product edge -> buffer edge)."""
        return View(self.out, tuple((e, self.out_edge(e)) for e in self.out_edges()))

    def buffers_read(self) -> set[str]:
        return {self.a.buf, self.b.buf} | set(self._epilogue_reads()) | ({self.out} if self.acc else set())

    def writes(self) -> set[str]:
        return {self.out} | {o.buf for o in self.epilogue}

    def out_edges(self) -> tuple[str, ...]:
        """The product's edges (its batch, M and N groups): an epilogue's loop variables."""
        return self.batch + self.m + self.n

    def _epilogue_reads(self) -> dict[str, None]:
        out: dict[str, None] = {}
        for o in self.epilogue:
            _READS.expr(o.expr, out)
        return out

    def matrix_order(self, order: Sequence[str] | None) -> tuple[str, ...] | None:
        """A buffer's (or view's) order as the matrix sees it: a complex product's
        elements are the pairs, so its `re.im` axis, which must be the innermost, is
        not a matrix axis (None when it is not innermost: no complex matrix)."""
        if order is None or self.cplx is None:
            return None if order is None else tuple(order)
        if not order or order[-1] != "re.im":
            return None
        return tuple(order[:-1])

    def accumulates(self) -> bool:
        """Every call adds into `out` (beta = 1): `out` is zeroed first (`zeroes`), or,
        with `acc`, holds the value the product is added to."""
        return bool(self.taps or self.shifts or self.acc)

    def zeroes(self) -> bool:
        """`out` is zeroed before the calls that add into it (taps or shifts, no `acc`)."""
        return bool(self.taps or self.shifts) and not self.acc

    def buffers_used(self) -> list[str]:
        return list(dict.fromkeys([self.out, self.a.buf, self.b.buf, *(o.buf for o in self.epilogue),
                                   *self._epilogue_reads()]))

    def text(self) -> str:
        head = self._head_text()
        if not self.epilogue:
            return head
        ix = ", ".join(sorted(self.out_edges()))
        return head + "".join(f"\n      then %{o.buf}[{ix}] = {expr_text(o.expr)}" for o in self.epilogue)

    def _head_text(self) -> str:
        g = " ".join(f"{n}({', '.join(es)})" for n, es in
                     (("batch", self.batch), ("m", self.m), ("n", self.n), ("k", self.k)))
        if self.taps:
            g += f" taps({', '.join(self.taps)})"
        for role, e, ix in self.shifts:
            g += f" shift({role}.{e} + {ix})".replace("+ -", "- ")
        if self.prefix:
            g += f" prefix({', '.join(f'{p} in {b}' for p, b in self.prefix)})"
        if self.cplx is None:
            a, b = (f"round_bf16({x})" if r else str(x) for x, r in zip((self.a, self.b), self.rounded))
            eq = "+=" if self.acc else "="
            return f"gemm %{self.out} {eq} {a} @ {b}  {g}" + (f"    # {self.note}" if self.note else "")
        a, b = (f"conj({x})" if c else str(x) for x, c in zip((self.a, self.b), self.cplx))
        scale = "" if self.alpha == 1.0 else f"{self.alpha!r} * "
        return f"cgemm %{self.out} = {scale}{a} @ {b}  {g}" + (f"    # {self.note}" if self.note else "")


@dataclass(frozen=True)
class EpilogueOut:
    """One output of a GEMM's epilogue: `buf[e...] = expr` at every element of the
    product, `e...` its edges (the GEMM's batch, M and N edges, the loop variables of
    `expr`), `Acc` in `expr` the product's value there."""
    buf: str
    expr: "Expr"


class _AccAsLoad(ExprVisitor):
    """An expression with `Acc` as the load of `buf` at `index` (indices kept)."""

    def __init__(self, buf: str, index) -> None:
        self.buf, self.index = buf, index

    def expr_acc(self, e):
        return Load(self.buf, self.index)

    def expr_add(self, e):
        return replace(e, args=tuple(self.expr(a) for a in e.args))

    expr_mul = expr_map = expr_add

    def expr_mask(self, e):
        return replace(e, arg=self.expr(e.arg))

    def expr_load(self, e):
        return e

    expr_const = expr_size_of = expr_rand = atom_var = atom_id_load = atom_floor_div = expr_load


def epilogue_loops(low: "Lowered", g: GemmKernel, product: str | None = None) -> list[LoopKernel]:
    """The loop kernels `g`'s epilogue stands for, in order (what the lowered interpreter
    runs, and a backend without a store epilogue: `tgc.lower.epilogue.expand`): each
    output over the product's edges (in `g.out`'s order, outermost first), `acc` read
    from `product` (default `g.out`: a buffer holding the product the whole time)."""
    if not g.epilogue:
        return []
    buf = low.buffers[g.out]
    loops = tuple(buf.order) if buf.order is not None else tuple(buf.edges)
    sizes = {e: low.size(e) for e in loops}
    index = tuple((e, Ix.var(e)) for e in sorted(loops))
    acc = _AccAsLoad(product or g.out, index)
    return [LoopKernel(o.buf, index, loops, sizes, acc.expr(o.expr), note="epilogue") for o in g.epilogue]


@dataclass(frozen=True)
class Bind:
    """What a step's argument or output is in the enclosing program: buffer `buf`, or,
    `stacked`, its slice at the step's index along the loop edge (its outermost axis).
    With `split` (an edge E of `buf`), the buffer is not stored over the loop edge: every
    edge before E in its order has size 1 and the step reads E's block at the step's
    index (`E = Ec + B*i`, the step's argument over Ec, B its size): the same bytes as a
    stacked slice, at offset i times the slice's size (tgc.lower.steps: a key block of a
    stored `[s, hd]` read in place, no copy)."""
    buf: str
    stacked: bool = False
    split: str = ""

    def __str__(self) -> str:
        return f"%{self.buf}" + (f"[{self.split}]" if self.split else "[i]" if self.stacked else "")


@dataclass
class StepLoop:
    kind: ClassVar[str] = "steps"   # what `tgc explain` calls it
    edge: str                       # the loop edge (its stacked buffers' outermost axis)
    trip: Size                      # how many steps
    reverse: bool                   # steps run for i = trip - 1, ..., 0
    step: "Lowered"                 # one step: its args and outputs are `args` and `outs`
    args: tuple[Bind, ...]          # per step argument (ABI index)
    outs: tuple[Bind, ...]          # per step output (ABI index)
    carries: int                    # outs[k] is copied into args[k].buf after each step, k < carries
    note: str = ""
    slot_base: int = 0              # the step's slot s is the enclosing program's slot_base + s

    def buffers_read(self) -> set[str]:
        return {b.buf for b in self.args}

    def writes(self) -> set[str]:
        return {b.buf for b in self.outs} | {b.buf for b in self.args[:self.carries]}

    def buffers_used(self) -> list[str]:
        return list(dict.fromkeys([b.buf for b in self.outs] + [b.buf for b in self.args]))

    def renamed(self, mapping: Mapping[str, str]) -> "StepLoop":
        def bind(b: Bind) -> Bind:
            return Bind(mapping.get(b.buf, b.buf), b.stacked, b.split)
        return replace(self, args=tuple(map(bind, self.args)), outs=tuple(map(bind, self.outs)))

    def can_retarget(self, low: "Lowered", target: str, tmp: str) -> bool:
        return False

    def text(self) -> str:
        way = "reverse " if self.reverse else ""
        head = (f"steps {way}over {self.edge} < {size_str(self.trip)} carries {self.carries}"
                f" args({', '.join(map(str, self.args))}) outs({', '.join(map(str, self.outs))})"
                f" slots from {self.slot_base} {{" + (f"    # {self.note}" if self.note else ""))
        inner = print_lowered(self.step).rstrip("\n").split("\n")
        return "\n".join([head] + ["    " + line if line else "" for line in inner] + ["  }"])


def step_loops(low: "Lowered"):
    """Every `StepLoop` of `low` and of the steps inside it, outermost first, with the
    program it belongs to: (program, loop)."""
    for k in low.kernels:
        if isinstance(k, StepLoop):
            yield low, k
            yield from step_loops(k.step)


Kernel = Union[LoopKernel, GemmKernel]   # a backend's own stage may add kinds of its own (the CPU's LoopGroup)



@dataclass(frozen=True)
class Check:
    buf: str        # an i32 buffer
    size: Size      # every id must lie in [0, size)
    note: str = ""


@dataclass
class Lowered:
    """A whole program after `fuse` (then `layout`, `group`, `plan`)."""
    module: Module
    dtype: str                                   # the program's float type
    buffers: dict[str, Buffer] = field(default_factory=dict)
    kernels: list[Kernel] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    slots: list[tuple[Size, ...]] = field(default_factory=list)  # bytes; a slot holds the max
    stage: str = "fuse"
    edges: dict[str, Size] = field(default_factory=dict)    # edges lowering made (not the module's)
    sum_exact_products: bool = False             # Options.sum_exact_products (`wide_term_factors`)

    def size(self, edge: str) -> Size:
        return self.edges[edge] if edge in self.edges else self.module.size(edge)

    def staged(self, stage: str) -> "Lowered":
        """A copy for the next lowering stage to rewrite: its own buffers (each copied),
        kernel list and edge sizes; the kernels are shared (stages replace kernels, never change them)."""
        return replace(self, buffers={n: replace(b) for n, b in self.buffers.items()},
                       kernels=list(self.kernels), edges=dict(self.edges), stage=stage)

    def sizes(self, edges: Sequence[str]) -> list[Size]:
        return [self.size(e) for e in edges]

    def nbytes(self, buf: Buffer) -> Size:
        total: Size = itemsize(buf.dtype)
        for s in self.sizes(buf.edges):
            total = size_op("*", total, s)
        return total

    def storage(self, name: str) -> str:
        """The buffer whose bytes buffer `name` is: its `alias`, or itself."""
        alias = self.buffers[name].alias
        return name if alias is None else alias

    def fresh(self, stem: str) -> str:
        n = len(self.buffers)
        while f"{stem}{n}" in self.buffers:
            n += 1
        return f"{stem}{n}"


def print_lowered(low: Lowered, module: bool = True) -> str:
    """The lowered program as text (`tgc.lower.text.parse_lowered` reads it back): the
    header line, the edges lowering made, buffers, workspace slots, id checks, kernels,
    and (with `module`) the IR module it was lowered from, which gives the dims, the
    arguments, outputs and updates, and the values `--verify-each` compares with."""
    lines = [f"// lowered after {low.stage} ({low.dtype})"]
    lines += [f"edge {e} = {size_str(s)}" for e, s in low.edges.items()]
    lines += [b.text() for b in low.buffers.values()]
    for i, sizes in enumerate(low.slots):
        lines.append(f"slot {i} : bytes max({', '.join(size_str(s) for s in sizes)})")
    lines.append("")
    for c in low.checks:
        lines.append(f"check 0 <= %{c.buf} < {size_str(c.size)}" + (f"    # {c.note}" if c.note else ""))
    for i, k in enumerate(low.kernels):
        lines.append(f"k{i}: {k.text()}")
    if module:
        lines += ["", "module {", print_module(low.module).rstrip("\n"), "}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- who reads and writes what


class Uses:
    """A kernel list that a pass edits in place, with the positions of the kernels that
    read and that write each buffer, so that "which later kernel reads b" costs the
    readers of b, not a scan of every later kernel (asked once per GEMM, such scans made
    `epilogue` and `accumulate` quadratic in the program's length). `slots[i]` is kernel
    i, or None once removed (positions never shift); `set(i, k)` replaces or removes one
    and keeps the index; `kernels()` is the list without the removed ones, in order."""

    def __init__(self, kernels: Sequence):
        self.slots: list = list(kernels)
        self._reads: dict[str, list[int]] = {}
        self._writes: dict[str, list[int]] = {}
        for i, k in enumerate(self.slots):
            self._index(i, k, True)

    def _index(self, i: int, k, add: bool) -> None:
        for table, bufs in ((self._reads, k.buffers_read()), (self._writes, k.writes())):
            for b in bufs:
                at = table.setdefault(b, [])
                j = bisect.bisect_left(at, i)
                if add:
                    at.insert(j, i)
                else:
                    del at[j]

    def set(self, i: int, k) -> None:
        """Slot i holds `k` (None: removed)."""
        if self.slots[i] is not None:
            self._index(i, self.slots[i], False)
        self.slots[i] = k
        if k is not None:
            self._index(i, k, True)

    def kernels(self) -> list:
        return [k for k in self.slots if k is not None]

    def readers(self, buf: str, lo: int = -1, hi: int | None = None) -> list[int]:
        """Positions of the kernels reading `buf` strictly between `lo` and `hi`, ascending."""
        return self._between(self._reads.get(buf, ()), lo, hi)

    def writers(self, buf: str, lo: int = -1, hi: int | None = None) -> list[int]:
        """Positions of the kernels writing `buf` strictly between `lo` and `hi`, ascending."""
        return self._between(self._writes.get(buf, ()), lo, hi)

    @staticmethod
    def _between(at: Sequence[int], lo: int, hi: int | None) -> list[int]:
        start = bisect.bisect_right(at, lo)
        stop = len(at) if hi is None else bisect.bisect_left(at, hi)
        return list(at[start:stop])


# ---------------------------------------------------------------- GEMM matrix views


def group_run(order: Sequence[str], group: Sequence[str]) -> tuple[str, ...] | None:
    """The group's edges in the order they appear in `order`, if they are adjacent."""
    pos = sorted(order.index(e) for e in group)
    if pos and pos[-1] - pos[0] != len(pos) - 1:
        return None
    return tuple(order[p] for p in pos)


def matrix_form(order: Sequence[str], rows: Sequence[str], cols: Sequence[str]):
    """How a buffer with axis `order` (view edges) holds a matrix [rows, cols]:
    (rows_run, cols_run, cols_inner) with each group's edges in memory order, and
    whether `cols` is the contiguous (innermost) group; None if it cannot (a group
    is split, or the innermost axis belongs to neither group)."""
    r, c = group_run(order, rows), group_run(order, cols)
    if r is None or c is None or not order:
        return None
    tail = tuple(order[len(order) - len(c):]) if c else ()
    if c and tail == c:
        return r, c, True
    tail = tuple(order[len(order) - len(r):]) if r else ()
    if r and tail == r:
        return r, c, False
    return None


# ---------------------------------------------------------------- rewriting


def rename_buffers(k: Kernel, mapping: Mapping[str, str]) -> Kernel:
    """`k` reading (and writing) the buffers `mapping` names instead (same edges)."""
    if not isinstance(k, (LoopKernel, GemmKernel)):   # a backend's own kind renames itself
        return k.renamed(mapping)
    if isinstance(k, GemmKernel):
        def view(v: View) -> View:
            return View(mapping.get(v.buf, v.buf), v.edges)
        r = _Renamer(mapping)
        epilogue = tuple(EpilogueOut(mapping.get(o.buf, o.buf), r.expr(o.expr)) for o in k.epilogue)
        return replace(k, out=mapping.get(k.out, k.out), a=view(k.a), b=view(k.b), epilogue=epilogue)

    r = _Renamer(mapping)
    ix, index, expr = r.ix, r.index, r.expr
    bounds = {v: (tuple(map(ix, lo)), tuple(map(ix, hi))) for v, (lo, hi) in k.bounds.items()}
    return replace(k, out=mapping.get(k.out, k.out), index=index(k.index), body=expr(k.body),
                   epilogue=None if k.epilogue is None else expr(k.epilogue), bounds=bounds)


class _Renamer(ExprVisitor):
    """An expression or index reading the buffers `mapping` names instead."""

    def __init__(self, mapping: Mapping[str, str]) -> None:
        self.mapping = mapping

    def ix(self, i: Ix) -> Ix:
        return Ix.make([(self.atom(a), c) for a, c in i.terms], i.const)

    def index(self, idx):
        return tuple((e, self.ix(i)) for e, i in idx)

    def expr_load(self, e: Load) -> Load:
        return Load(self.mapping.get(e.buf, e.buf), self.index(e.index))

    def expr_mask(self, e: Mask) -> Mask:
        return Mask(tuple(Cond(self.ix(c.ix), c.op) for c in e.conds), self.expr(e.arg))

    def expr_add(self, e):
        return replace(e, args=tuple(self.expr(a) for a in e.args))

    expr_mul = expr_map = expr_add

    def expr_rand(self, e: Rand) -> Rand:
        return replace(e, key=self.ix(e.key), counter=self.ix(e.counter),
                       folds=tuple(self.ix(n) if isinstance(n, Ix) else n for n in e.folds))

    def expr_const(self, e):
        return e

    expr_size_of = expr_acc = atom_var = expr_const

    def atom_id_load(self, a: IdLoad) -> IdLoad:
        return IdLoad(self.mapping.get(a.buf, a.buf), self.index(a.index))

    def atom_floor_div(self, a: FloorDiv) -> FloorDiv:
        return FloorDiv(self.ix(a.num), a.den)
