"""The syntax tree of a .tg file, as `tgc.frontend.parser.parse` builds it.

Every node is a frozen dataclass with a `loc: Loc` (keyword-only, ignored by `==`,
so tests can compare trees built by hand). A statement's loc starts at the name it
declares or targets (`f` in `fn f(...)`, `z` in `out z`, the string of an import)
and ends with the statement. Sequences are tuples. Names are unresolved strings:
the elaborator decides what they denote.

    Program(items: tuple[Stmt, ...])
  statements (Stmt)
    DimDecl(name: str, expr: Expr | None)           `dim a, b = 2` gives two DimDecls
    TensorDecl(kind: str, name: str, dtype: str | None, edges: tuple[EdgeSpec, ...])
        kind "input" | "param" | "state"; dtype "i32" | "f32" | "f64" | None;
        edges () for a scalar; `input a[i], b` gives two TensorDecls
    EdgeSpec(name: str, dim: str | None)            `i` or `i: n`; also dim_loc (the
        Loc of `n`, or None), keyword-only and ignored by `==` like loc
    FnDef(name: str, edge_params: tuple[Name, ...], params: tuple[Param, ...],
          body: tuple[Bind, ...], result: Expr, rules: tuple[Rule, ...])
        `= expr` form: body (); rules () when the function gives no derivative
    Rule(kind: str, binders: tuple[Name, ...], exprs: tuple[Expr, ...], tuple_form: bool)
        `with vjp(g) = e` / `with vjp(g) = (e1, e2)` / `with jvp(dx, dy) = e`
    Param(name: str, default: Expr | None)
    Import(path: str)                               the string without its quotes
    Bind(name: str, expr: Expr)
    Out(name: str, order: tuple[Name, ...] | None, expr: Expr | None)
    Update(name: str, expr: Expr)
    Assume(op: str, lhs: Expr, rhs: Expr)           op one of = < <= > >= != (`==` is `=`);
        loc spans the relation, from LHS to RHS
    For(var: Name, names: tuple[Name, ...], body: tuple[Stmt, ...])
        `for p in wq, wk { ... }`; names (Name("params"),) for `for p in params`;
        body holds TensorDecl, Bind, Out and Update; loc starts at the variable
  expressions (Expr)
    Num(value: int | float)                         int for `3`; float for `0.5`, `1e3`, `inf`
    Name(id: str)
    BinOp(op: str, lhs: Expr, rhs: Expr)            op one of + - * / @ ^
    Neg(x: Expr)
    Compare(op: str, lhs: Expr, rhs: Expr)          op one of < <= > >= == !=
    Call(fn: str, edges: tuple[Name, ...] | None, args: tuple[Expr, ...],
         kwargs: tuple[Kwarg, ...])                 edges None when no `[...]`
    Kwarg(name: str, value: Expr)
    EdgeOps(x: Expr, items: tuple[Rename | Reindex, ...])
    Rename(src: str, dst: str)                      `i -> j`; also dst_loc (the Loc of
        `j`), keyword-only and ignored by `==` (loc starts at `i`)
    Reindex(edge: str, rhs: Expr)                   `t = s + k` or a gather `vocab = ids`
    Indicator(terms: tuple[Affine, ...], ops: tuple[str, ...])
        `[a op0 b op1 c]`, len(ops) == len(terms) - 1; ops = != < <= > >= (`==` is `=`)
    Member(var: Name, names: tuple[Name, ...])     `[p in wq, wk]`
    ListSum(var: Name, names: tuple[Name, ...], x: Expr)   `sum[p in params](x)`
  affine index expressions
    Affine(terms: tuple[AffineTerm, ...])           the sum of its terms
    AffineTerm(coef: int, size_of: str | None, edge: str | None)
        coef * size(size_of) * edge: `2*s` is (2, None, "s"), `hd*head` is
        (1, "hd", "head"), `size(t1)` is (1, "t1", None), `-1` is (-1, None, None)

`to_affine(expr)` turns a reindex's right side into an `Affine` (the parser does
the same for indicators); it raises a located `CompileError` when it is not one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tgc.ir.diag import CompileError, Loc

NOLOC = Loc("<none>", 0, 0)


@dataclass(frozen=True)
class Node:
    """Base of all nodes: a source span, not part of equality."""

    loc: Loc = field(default=NOLOC, compare=False, repr=False, kw_only=True)


# ---- statements -------------------------------------------------------------


@dataclass(frozen=True)
class Program(Node):
    """A whole file: its statements in source order."""

    items: tuple


@dataclass(frozen=True)
class DimDecl(Node):
    """`dim name` (symbolic, expr None) or `dim name = expr` (an integer expression
    of Num, Name, and BinOp with + - * /)."""

    name: str
    expr: object


@dataclass(frozen=True)
class EdgeSpec(Node):
    """One edge of a declaration: `i` (a declared dim or edge) or `i: n` (a new
    edge `i` of the size of dim `n`)."""

    name: str
    dim: str | None
    dim_loc: Loc | None = field(default=None, compare=False, repr=False, kw_only=True)


@dataclass(frozen=True)
class TensorDecl(Node):
    """`input|param|state name[: dtype][[edges]]`; edges in ABI order, () if scalar."""

    kind: str
    name: str
    dtype: str | None
    edges: tuple


@dataclass(frozen=True)
class Param(Node):
    """A function parameter, with its default value expression if any."""

    name: str
    default: object


@dataclass(frozen=True)
class Bind(Node):
    """`name = expr`, at top level or inside a function block."""

    name: str
    expr: object


@dataclass(frozen=True)
class FnDef(Node):
    """`fn name[edge_params](params) = result` or
    `fn name[edge_params](params) { body...; return result }`."""

    name: str
    edge_params: tuple
    params: tuple
    body: tuple
    result: object
    rules: tuple = ()
    variadic: bool = False  # `fn f[e...]`: the last edge parameter collects extra edge arguments


@dataclass(frozen=True)
class Rule(Node):
    """`with vjp(g) = expr` (or a tuple `(dx, dy)`, one per parameter) or
    `with jvp(dx, dy) = expr`: a function's own derivative. kind "vjp" | "jvp"."""

    kind: str
    binders: tuple
    exprs: tuple
    tuple_form: bool = False


@dataclass(frozen=True)
class Import(Node):
    """`import "path"`; path as written, without quotes."""

    path: str


@dataclass(frozen=True)
class Out(Node):
    """`out name`, `out name[order]`, `out name = expr`, `out name[order] = expr`."""

    name: str
    order: tuple | None
    expr: object


@dataclass(frozen=True)
class Update(Node):
    """`update name = expr`."""

    name: str
    expr: object


@dataclass(frozen=True)
class Assume(Node):
    """`assume lhs op rhs`: a fact about the inputs, holding elementwise."""

    op: str
    lhs: object
    rhs: object


@dataclass(frozen=True)
class For(Node):
    """`for var in names { body }`: a template of statements, instantiated once per
    listed tensor (`names` is `(Name("params"),)` for every param)."""

    var: object
    names: tuple
    body: tuple


# ---- expressions ------------------------------------------------------------


@dataclass(frozen=True)
class Num(Node):
    """A number literal: int when written without '.', 'e' or 'inf', else float."""

    value: int | float


@dataclass(frozen=True)
class Name(Node):
    """A name: tensor, binding, parameter, or (in edge lists) an edge."""

    id: str


@dataclass(frozen=True)
class BinOp(Node):
    """`lhs op rhs` for op in + - * / @ ^."""

    op: str
    lhs: object
    rhs: object


@dataclass(frozen=True)
class Neg(Node):
    """`-x`."""

    x: object


@dataclass(frozen=True)
class Compare(Node):
    """`lhs op rhs` for op in < <= > >= == != (never chained)."""

    op: str
    lhs: object
    rhs: object


@dataclass(frozen=True)
class Kwarg(Node):
    """A keyword argument `name = value` of a call."""

    name: str
    value: object


@dataclass(frozen=True)
class Call(Node):
    """`fn(args, kwargs)` or `fn[edges](args, kwargs)`; keyword arguments come last."""

    fn: str
    edges: tuple | None
    args: tuple
    kwargs: tuple


@dataclass(frozen=True)
class Rename(Node):
    """Edge-op item `src -> dst`."""

    src: str
    dst: str
    dst_loc: Loc | None = field(default=None, compare=False, repr=False, kw_only=True)


@dataclass(frozen=True)
class Reindex(Node):
    """Edge-op item `edge = rhs`: a reindex if rhs is affine in edges (see
    `to_affine`), a gather if rhs names an i32 tensor."""

    edge: str
    rhs: object


@dataclass(frozen=True)
class EdgeOps(Node):
    """`x[item, ...]`: renames and reindexes applied together to x."""

    x: object
    items: tuple


@dataclass(frozen=True)
class AffineTerm(Node):
    """coef * size(size_of) * edge, where a missing size_of or edge counts as 1."""

    coef: int
    size_of: str | None
    edge: str | None
    by_name: bool = False   # size_of written as a bare name (a dim), not as size(e)


@dataclass(frozen=True)
class Affine(Node):
    """An integer affine index expression: the sum of its terms."""

    terms: tuple


@dataclass(frozen=True)
class Imag(Node):
    """An imaginary literal, `2j` or `0.5j`: its value times the imaginary unit."""

    value: float


@dataclass(frozen=True)
class Indicator(Node):
    """`[t0 op0 t1 op1 t2 ...]`: 1 where every link holds, else 0."""

    terms: tuple
    ops: tuple


@dataclass(frozen=True)
class Member(Node):
    """`[var in a, b]`: 1 in the instances of a for block (or list sum) for the
    listed tensors, else 0."""

    var: object
    names: tuple


@dataclass(frozen=True)
class ListSum(Node):
    """`sum[var in names](x)`: the scalar `x` added over the listed tensors."""

    var: object
    names: tuple
    x: object


_new = object.__new__
_setattr = object.__setattr__


def build(cls: type, fields: dict) -> Node:
    """A node of class `cls` whose fields (all of them, `loc` included) are `fields`:
    what `cls(**fields)` builds, in a third of the time. A node keeps its fields in its
    instance `__dict__` (no slots, no `__post_init__`), where the frozen dataclass
    `__init__` writes them one `object.__setattr__` at a time; this sets the dict at
    once. The parser builds most nodes so; `fields` becomes the node's own dict."""
    node = _new(cls)
    _setattr(node, "__dict__", fields)
    return node


def with_loc(node: Node, loc: Loc) -> Node:
    """`node` with another loc, its other fields shared: `dataclasses.replace(node,
    loc=loc)`, built as `build` builds (the parser widens the span of every
    parenthesized expression)."""
    fields = dict(node.__dict__)
    fields["loc"] = loc
    return build(type(node), fields)


# ---- affine index expressions -------------------------------------------------


def to_affine(expr) -> Affine:
    """The affine form of an index expression, or a located CompileError.

    Terms: `edge`, `coef*edge`, integers, `size(e)`, joined by + and -, with
    unary minus; a coefficient (integers, dim names, `size(e)`) comes first, so
    in a product the last factor may be an edge and the others are sizes."""
    if isinstance(expr, BinOp) and expr.op in "+-":
        rhs = to_affine(expr.rhs)
        if expr.op == "-":
            rhs = _negate(rhs)
        return Affine(to_affine(expr.lhs).terms + rhs.terms, loc=expr.loc)
    if isinstance(expr, Neg):
        return Affine(_negate(to_affine(expr.x)).terms, loc=expr.loc)
    return Affine((_term(expr),), loc=expr.loc)


def _negate(a: Affine) -> Affine:
    return Affine(tuple(AffineTerm(-t.coef, t.size_of, t.edge, t.by_name, loc=t.loc) for t in a.terms), loc=a.loc)


def _term(expr) -> AffineTerm:
    """One product term: sizes and integers first, then at most one edge, last."""
    factors = _factors(expr)
    edge = factors.pop().id if isinstance(factors[-1], Name) else None
    if edge is None and any(isinstance(f, Name) for f in factors):
        raise CompileError("the edge of an index term comes last, after its "
                           "coefficient: write `2*s`, not `s*2`", expr.loc)
    coef, size_of, by_name = 1, None, False
    for f in factors:
        k, s = _coefficient(f)
        if s is not None and size_of is not None:
            raise CompileError("an index term may have only one size factor", expr.loc)
        if s is not None:
            size_of, by_name = s, _is_name(f)
        coef *= k
    return AffineTerm(coef, size_of, edge, by_name, loc=expr.loc)


def _is_name(expr) -> bool:
    while isinstance(expr, Neg):
        expr = expr.x
    return isinstance(expr, Name)


def _factors(expr) -> list:
    out = []
    while isinstance(expr, BinOp) and expr.op == "*":
        out.append(expr.rhs)
        expr = expr.lhs
    out.append(expr)
    return out[::-1]


def _coefficient(expr) -> tuple[int, str | None]:
    """(integer, size name or None) for a factor before the edge: an integer,
    a dim name, size(e), or one of these negated."""
    if isinstance(expr, Num) and isinstance(expr.value, int):
        return expr.value, None
    if isinstance(expr, Name):
        return 1, expr.id
    if isinstance(expr, Call) and _is_size_call(expr):
        return 1, expr.args[0].id
    if isinstance(expr, Neg):
        coef, size_of = _coefficient(expr.x)
        return -coef, size_of
    raise CompileError(
        "not an affine index expression: terms are edges, integers, size(e) and "
        "coefficient*edge with the coefficient first", expr.loc)


def _is_size_call(call: Call) -> bool:
    return (call.fn == "size" and call.edges is None and not call.kwargs
            and len(call.args) == 1 and isinstance(call.args[0], Name))
