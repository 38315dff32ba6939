"""Elaborate expressions: resolve names, check edges and sizes, build IR values.

Every surface form maps onto the IR's few primitives: `+ -` are `add`, `*` and
`@` are contractions (`@` sums the shared edges), reductions by sum are
contractions, `/ ^`, comparisons and the elementwise primitives are `map`, a
reindex is a contraction with an indicator, and function calls are inlined.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from tgc.frontend import ast
from tgc.frontend.complexes import MAX_POWER, Complex, is_complex, power_literal
from tgc.frontend.scope import FnInfo, Scope, describe
from tgc.ir import values as V
from tgc.ir.affine import Affine, Relation
from tgc.ir.diag import CompileError, Diagnostic, Loc, did_you_mean
from tgc.ir.dtypes import at_width
from tgc.ir.module import Module
from tgc.ir.ops import INFIX, SURFACE_UNARY
from tgc.ir.sizes import MAX_SIZE, Size, size_op, size_str

PRELUDE_FILE = str(Path(__file__).with_name("prelude.tg"))
UNARY = SURFACE_UNARY   # the one-argument functions the language calls by name (tgc.ir.ops.FNS)
OPERATORS = {op: fn for fn, op in INFIX.items()}   # "/": "div", "^": "pow", "<": "lt", ... (tgc.ir.ops)
COMPARE = {op: fn for op, fn in OPERATORS.items() if op not in "/^"}
REDUCTIONS = ("sum", "mean", "max", "min")


@dataclass(frozen=True)
class Loop:
    """One instance of a `for p in LIST` block or of a `sum[p in LIST](x)`: the
    tensor `p` stands for now, and every tensor of the list (what `[p in ...]` may name)."""

    current: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class Ctx:
    """Where an expression is elaborated: the top level, an instance of a for block
    or an inlined function body."""

    values: Mapping[str, V.Value]
    edges: Mapping[str, str | tuple[str, ...]] = field(default_factory=dict)  # edge parameter -> actual edge(s)
    fns: Mapping[str, FnInfo] = field(default_factory=dict)
    stack: tuple[str, ...] = ()  # functions being inlined, outermost first
    call_locs: tuple[Loc, ...] = ()
    loops: Mapping[str, Loop] = field(default_factory=dict)  # loop variable -> its instance


LOOPS = ("repeat", "scan")   # repeat[e](f, init, a1, ..., an), scan[e](...): tgc.frontend.functions

MAX_FLAT_FACTORS = 32  # operands of one product the front end builds by flattening


def factors(v: V.Value) -> list[V.Value]:
    """The operands of a plain product (a contraction that sums nothing), else [v]:
    products and their sums become one n-ary contraction, never materialized."""
    if v.op == "contract" and set(v.edges) == {e for o in v.operands for e in o.edges}:
        return list(v.operands)
    return [v]


def product_operands(a: V.Value, b: V.Value) -> list[V.Value]:
    """The operands of `a * b` (or `a @ b`): both sides' factors, flattened while the
    product has at most MAX_FLAT_FACTORS operands. Without the bound a chain
    `v_i = v_(i-1) * c` builds products of 1, 2, ..., n operands, quadratic work in n;
    with it each statement does bounded work. `normalize` merges single-use nested
    products anyway, so the bound changes only where a shared product is inlined."""
    fa = factors(a) if len(a.operands) < MAX_FLAT_FACTORS else [a]
    fb = factors(b) if len(b.operands) < MAX_FLAT_FACTORS else [b]
    if len(fa) + len(fb) <= MAX_FLAT_FACTORS:
        return fa + fb
    return [a] + fb if len(fa) >= len(fb) else fa + [b]


@dataclass(frozen=True)
class Forms:
    """The forms elaborated outside this module, which import it (builtin calls in
    `builtins`, edge operations in `edgeops`, calls of `fn`s in `functions`): the
    elaborator receives them from `tgc.frontend.elaborate`, so that no module of the
    front end imports one that imports it back."""

    call_builtin: Callable
    edge_ops: Callable
    inline_call: Callable
    loop_call: Callable   # repeat[e](f, ...) and scan[e](f, ...)


class Elaborator:
    """Turns expression ASTs into IR values for one module."""

    def __init__(self, module: Module, scope: Scope, dtype: str, forms: "Forms"):
        self.m, self.scope, self.dtype = module, scope, dtype
        self.cx = Complex(module, dtype)  # builds complex values from real parts
        self.literals: dict[int, tuple[V.Value, bool]] = {}   # id -> (value, is_literal): literal_width
        self.used: set[str] = set()  # top-level tensor names read somewhere
        self.methods: dict[type, object] = {}  # node class -> its _Class function, found once
        self.custom_calls = 0  # calls of functions with their own derivative (their placeholders' names)
        self.inlined_calls = 0  # calls inlined so far (tgc.frontend.functions.MAX_INLINED_CALLS)
        self.capped: list[Diagnostic] = []   # warnings: a type named wider than the program's (`at_width`)
        self.every_param: list[Loc] = []   # where a list `params` was read (no param may be declared after)
        self.call_builtin, self.edge_ops, self.inline_call = forms.call_builtin, forms.edge_ops, forms.inline_call
        self.loop_call = forms.loop_call

    # ---- helpers ------------------------------------------------------------------

    def width(self, named: str, loc, what: str, complex_: bool = False) -> str:
        """The float type `named` (a complex type's parts when `complex_`) has in this
        program (`at_width`); a type wider than the program's float type holds the
        program's width, which a warning says (once per place)."""
        got = at_width(named, self.dtype)
        if got != named:
            held = {"f32": "c64", "f64": "c128"}[got] if complex_ else got
            warning = Diagnostic("warning", f"{what} is wider than this program's float type {self.dtype}: "
                                            f"it holds {held} values (compile with --dtype {named} to keep "
                                            f"its width)", loc)
            if warning not in self.capped:
                self.capped.append(warning)
        return got


    def error(self, message: str, node, ctx: Ctx | None = None, notes=()) -> CompileError:
        """A located error; inside the prelude, located at the user's call instead."""
        notes = list(notes)
        loc = node.loc
        if ctx is not None and ctx.stack:
            user = [i for i, c in enumerate(ctx.call_locs) if c.file != PRELUDE_FILE]
            if loc is not None and loc.file == PRELUDE_FILE and user:
                i = user[-1]
                return CompileError(f"in call of '{ctx.stack[i]}': {message}", ctx.call_locs[i], notes)
            notes.append(Diagnostic("note", f"in function '{ctx.stack[-1]}', inlined here", ctx.call_locs[-1]))
        return CompileError(message, loc, notes)

    def build(self, node, ctx: Ctx, fn, *args, **kwargs) -> V.Value:
        """Call an IR builder, reporting its type errors at `node`."""
        try:
            return fn(*args, loc=node.loc, **kwargs)
        except V.IRError as e:
            raise self.error(str(e), node, ctx) from None

    def edge(self, name: str, node, ctx: Ctx) -> str:
        """The actual edge a name denotes here (edge parameters substituted)."""
        actual = ctx.edges.get(name, name)
        if isinstance(actual, tuple):
            raise self.error(f"edge parameter '{name}' stands for several edges here ({', '.join(actual)}); "
                             "only an edge list (sum[...], rand[...], a call's edges) takes several", node, ctx)
        if actual not in self.m.edges:
            kind = self.scope.kinds.get(name)
            if kind in ("tensor", "fn") or name in ctx.values:
                raise self.error(f"'{name}' is {describe(kind or 'tensor')}, not an edge", node, ctx)
            raise self.error(f"unknown edge '{name}'" + did_you_mean(name, [*self.m.edges, *ctx.edges]), node, ctx)
        return actual

    def edge_names(self, name: str, node, ctx: Ctx) -> list[str]:
        """The edges a name in an edge list denotes: one, or all of those an edge
        parameter that collected several edge arguments stands for."""
        actual = ctx.edges.get(name, name)
        if isinstance(actual, tuple):
            return list(actual)
        return [self.edge(name, node, ctx)]

    def float_value(self, v: V.Value, node, ctx: Ctx) -> V.Value:
        if v.dtype == "i32":
            raise self.error("an integer (i32) tensor can only be used as gather indices (x[node = ids]) "
                             "or in an indicator ([node = ids])", node, ctx)
        return v

    def real_only(self, what: str, node, ctx: Ctx, *values: V.Value) -> None:
        """A located error if any of `values` is complex: `what` takes real values only."""
        if any(is_complex(v) for v in values):
            raise self.error(f"{what} is not defined for complex values (take real(), imag() or abs() first)",
                             node, ctx)

    def size_text(self, edge: str) -> str:
        s = self.m.size(edge)
        return str(s) if isinstance(s, int) else size_str(s)

    # ---- expressions ------------------------------------------------------------

    def expr(self, node, ctx: Ctx) -> V.Value:
        method = self.methods.get(type(node))
        if method is None:
            method = getattr(type(self), f"_{type(node).__name__}", None)
            if method is None:
                raise self.error(f"unexpected {type(node).__name__} in an expression", node, ctx)
            self.methods[type(node)] = method
        return method(self, node, ctx)

    def fexpr(self, node, ctx: Ctx) -> V.Value:
        """An expression that must be float."""
        v = self.expr(node, ctx)
        return v if v.type.dtype != "i32" else self.float_value(v, node, ctx)

    def _Num(self, node: ast.Num, ctx: Ctx) -> V.Value:
        return V.const(float(node.value), self.dtype, loc=node.loc)

    def _Name(self, node: ast.Name, ctx: Ctx) -> V.Value:
        if ctx.loops:
            name = self.instance_name(node.id, ctx)
            if name != node.id:
                return self.tensor(name, node, ctx)
        if node.id in ctx.values:
            if not ctx.stack:
                self.used.add(node.id)
            return ctx.values[node.id]
        kind = self.scope.kinds.get(node.id)
        if node.id in ctx.edges or kind in ("edge", "dim"):
            raise self.error(f"'{node.id}' is an edge, not a tensor (use size({node.id}) for its size)", node, ctx)
        if kind == "fn" or node.id in ctx.fns:
            raise self.error(f"'{node.id}' is a function; call it with arguments", node, ctx)
        if kind == "tensor" and ctx.stack:
            raise self.error(f"'{node.id}' is not visible inside function '{ctx.stack[-1]}': "
                             "pass it as a parameter", node, ctx)
        head, dot, var = node.id.rpartition(".")
        if dot and not ctx.loops:
            example = next((a.name for a in self.m.args.values() if a.kind == "param"), "w")
            raise self.error(f"unknown name '{node.id}' (`{head}.{var}` stands for a per-param state inside "
                             f"`for {var} in ...` only; elsewhere, name one in full: `{head}.{example}`)", node, ctx)
        raise self.error(f"unknown name '{node.id}'" + did_you_mean(node.id, ctx.values), node, ctx)

    # ---- for blocks: one instance per listed tensor ------------------------------------

    @staticmethod
    def instance_name(name: str, ctx: Ctx) -> str:
        """The tensor `name` denotes in this instance: a loop variable `p` the listed
        tensor it stands for (`wq`), a name `m.p` the per-param state `m.wq`; any other
        name itself."""
        loop = ctx.loops.get(name)
        if loop is not None:
            return loop.current
        head, dot, var = name.rpartition(".")
        loop = ctx.loops.get(var) if dot else None
        return f"{head}.{loop.current}" if loop is not None else name

    def tensor(self, name: str, node, ctx: Ctx) -> V.Value:
        """The declared tensor `name` that a loop variable or `m.p` denotes here."""
        value = self.scope.tensors.get(name)
        if value is None:
            raise self.error(f"'{node.id}' is '{name}' here, which is not declared"
                             + (f" (declare `state {node.id}` in the for block)" if "." in node.id else ""),
                             node, ctx)
        self.used.add(name)
        return value

    def tensor_list(self, var: ast.Name, names: tuple, ctx: Ctx) -> tuple[str, ...]:
        """The tensors a `for` block or a `sum[p in ...]` ranges over: `params` (every
        param declared so far), or listed params and states, each once."""
        if var.id in ctx.loops:
            raise self.error(f"'{var.id}' already ranges over a list here: name this variable otherwise", var, ctx)
        kind = self.scope.kinds.get(var.id)
        if kind is not None or var.id in ctx.values or "." in var.id:
            raise self.error(f"the variable '{var.id}' of a list must be a new name; '{var.id}' is "
                             f"{describe(kind or 'tensor')}", var, ctx)
        if len(names) == 1 and names[0].id == "params" and "params" not in self.scope.kinds:
            found = tuple(a.name for a in self.m.args.values() if a.kind == "param")
            if not found:
                raise self.error("the list 'params' is empty: no param is declared before it", names[0], ctx)
            self.every_param.append(names[0].loc)
            return found
        out: list[str] = []
        for n in names:
            if n.id == "params" and "params" not in self.scope.kinds:
                raise self.error("'params' stands for every param alone; list names otherwise", n, ctx)
            arg = self.m.args.get(n.id)
            if arg is None or arg.kind == "input":
                kind = self.scope.kinds.get(n.id)
                what = ("an input" if arg is not None else "a binding" if kind == "tensor"
                        else describe(kind) if kind else "unknown")
                raise self.error(f"a list ranges over params and states; '{n.id}' is {what}", n, ctx)
            if n.id in out:
                raise self.error(f"'{n.id}' is listed twice", n, ctx)
            out.append(n.id)
        return tuple(out)

    def _Member(self, node: ast.Member, ctx: Ctx) -> V.Value:
        loop = ctx.loops.get(node.var.id)
        if loop is None:
            raise self.error(f"'[{node.var.id} in ...]' is used outside a for block or sum over "
                             f"'{node.var.id}'", node.var, ctx)
        chosen = set()
        for n in node.names:
            arg = self.m.args.get(n.id)
            if n.id not in loop.names and (arg is None or arg.kind == "input"):
                # a param or state the list leaves out is 0 in every instance (LANGUAGE.md 12)
                raise self.error(f"'{n.id}' is neither in the list that '{node.var.id}' ranges over "
                                 f"({', '.join(loop.names)}) nor a param or state", n, ctx)
            chosen.add(n.id)
        return V.const(1.0 if loop.current in chosen else 0.0, self.dtype, loc=node.loc)

    def _ListSum(self, node: ast.ListSum, ctx: Ctx) -> V.Value:
        if ctx.stack:
            raise self.error("sum[p in LIST] reads the program's tensors: it cannot be used inside a function",
                             node, ctx)
        names = self.tensor_list(node.var, node.names, ctx)
        terms = []
        for name in names:
            inner = dataclasses.replace(ctx, loops={**ctx.loops, node.var.id: Loop(name, names)})
            v = self.fexpr(node.x, inner)
            self.real_only("sum[p in LIST]", node, ctx, v)
            if v.edges:
                raise self.error(f"sum[{node.var.id} in ...] adds scalars, but its term for '{name}' has edges "
                                 f"[{', '.join(v.edges)}]: reduce them (sum(...))", node.x, ctx)
            terms.append(v)
        return self.build(node, ctx, V.add, terms)

    def _Imag(self, node: ast.Imag, ctx: Ctx) -> V.Value:
        return self.cx.imag_const(node.value, node.loc)

    def _Neg(self, node: ast.Neg, ctx: Ctx) -> V.Value:
        if isinstance(node.x, ast.Num):
            return V.const(-float(node.x.value), self.dtype, loc=node.loc)
        return self.build(node, ctx, V.add, [self.fexpr(node.x, ctx)], [-1.0])

    def _BinOp(self, node: ast.BinOp, ctx: Ctx) -> V.Value:
        a, b = self.fexpr(node.lhs, ctx), self.fexpr(node.rhs, ctx)
        if is_complex(a) or is_complex(b):
            return self.complex_binop(node, a, b, ctx)
        if node.op in "+-":
            return self.build(node, ctx, V.add, [a, b], [1.0, 1.0 if node.op == "+" else -1.0])
        if node.op == "*":
            return self.build(node, ctx, V.mul, product_operands(a, b))
        if node.op == "@":
            keep = set(a.edges) ^ set(b.edges)
            return self.build(node, ctx, V.contract, product_operands(a, b), keep)
        return self.build(node, ctx, V.map_, OPERATORS[node.op], a, b)

    def complex_binop(self, node: ast.BinOp, a: V.Value, b: V.Value, ctx: Ctx) -> V.Value:
        """`a op b` with a complex operand (the other is promoted where it matters)."""
        a, b = self.literal_width(a, b)
        cx = self.cx
        if node.op in "+-":
            return self.build(node, ctx, lambda loc: cx.add(a, b, 1.0 if node.op == "+" else -1.0, loc))
        if node.op in "*@" and not (is_complex(a) and is_complex(b)):   # a real factor scales both parts
            return self._real_product(node, a, b, ctx)
        if node.op == "*":
            return self.build(node, ctx, lambda loc: cx.mul(a, b, set(a.edges) | set(b.edges), loc))
        if node.op == "@":
            return self.build(node, ctx, lambda loc: cx.mul(a, b, set(a.edges) ^ set(b.edges), loc))
        if node.op == "/":
            return self.build(node, ctx, lambda loc: cx.div(a, b, loc))
        n = power_literal(node.rhs)
        if is_complex(b) or n is None:
            raise self.error("a complex power takes an integer literal exponent (`z ^ 3`, `z ^ -2`, at most "
                             f"{MAX_POWER} in size); write exp(w * log(z)) for others",
                             node.rhs if not is_complex(b) else node, ctx)
        return self.build(node, ctx, lambda loc: cx.power(a, n, loc))

    def literal_width(self, a: V.Value, b: V.Value) -> tuple[V.Value, V.Value]:
        """`a` and `b`, a number written in the program (`2j`, `1 + 0.5j`: no argument in
        it) converted to the other operand's narrower float type: like a real number, a
        complex one does not widen (`z * 2j` is c64 for a c64 `z` in an f64 program)."""
        la, lb = self.is_literal(a), self.is_literal(b)
        if la != lb:
            lit, other = (a, b) if la else (b, a)
            if other.dtype == "f32" and lit.dtype == "f64":
                lit = V.const(lit.attrs[0], "f32", lit.edges, loc=lit.loc) if lit.op == "const" \
                    else V.convert(lit, "f32", loc=lit.loc)
                return (lit, b) if la else (a, lit)
        return a, b

    def is_literal(self, v: V.Value) -> bool:
        """Whether `v` reads no argument and draws nothing (a number the program writes)."""
        memo, stack = self.literals, [v]
        while stack:
            u = stack[-1]
            if id(u) in memo:
                stack.pop()
                continue
            pending = [o for o in u.operands if id(o) not in memo] if u.op not in ("arg", "random") else []
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            memo[id(u)] = (u, u.op not in ("arg", "random") and all(memo[id(o)][1] for o in u.operands))
        return memo[id(v)][1]

    def _real_product(self, node: ast.BinOp, a: V.Value, b: V.Value, ctx: Ctx) -> V.Value:
        if node.op == "*":
            return self.build(node, ctx, V.mul, product_operands(a, b))
        keep = set(a.edges) ^ set(b.edges)
        return self.build(node, ctx, V.contract, product_operands(a, b), keep)

    def _Compare(self, node: ast.Compare, ctx: Ctx) -> V.Value:
        a, b = self.fexpr(node.lhs, ctx), self.fexpr(node.rhs, ctx)
        self.real_only(f"comparison '{node.op}'", node, ctx, a, b)
        return self.build(node, ctx, V.map_, COMPARE[node.op], a, b)

    def _Indicator(self, node: ast.Indicator, ctx: Ctx) -> V.Value:
        ids = self.integer_indicator(node, ctx)
        if ids is not None:
            return ids
        rel = Relation(tuple(self.affine(t, ctx) for t in node.terms), tuple(node.ops))
        named = self.named_edges(node.terms, ctx)
        if not named:
            raise self.error("an indicator must name at least one edge", node, ctx)
        return self.spread(V.indicator(rel, self.dtype, loc=node.loc), named, node.loc)

    def integer_indicator(self, node: ast.Indicator, ctx: Ctx) -> V.Value | None:
        """`[node = ids]` (or `[ids = node]`) with `ids` an i32 tensor: 1 where node ==
        ids[...], over `node` and the edges of ids. It is the scatter of ones along
        `node` that keeps every edge of ids; the passes turn its contractions into
        gathers and scatters (`tgc.opt.scatter`). None for any other indicator."""
        if len(node.terms) != 2 or tuple(node.ops) != ("=",):
            return None
        names = [self._bare_name(t, ctx) for t in node.terms]
        tensors = [i for i, n in enumerate(names) if n is not None and self._is_tensor(n, ctx)]
        if not tensors:
            return None
        if len(tensors) == 2:
            raise self.error("an indicator relates an edge to integer data: one side must be an edge",
                             node, ctx)
        i = tensors[0]
        other = node.terms[1 - i]
        if names[1 - i] is None:
            raise self.error(f"an indicator with integer data '{names[i]}' relates it to one edge, "
                             f"written alone (e.g. [node = {names[i]}])", other, ctx)
        edge = self.edge(names[1 - i], other, ctx)
        ids = self.expr(ast.Name(names[i], loc=node.terms[i].loc), ctx)
        if ids.dtype != "i32":
            raise self.error(f"an indicator's data must be an i32 tensor; '{names[i]}' is a float tensor "
                             f"(declare it `input {names[i]}: i32[...]`)", node.terms[i], ctx)
        if edge in ids.edges:
            raise self.error(f"the indicator's edge '{names[1 - i]}' is also an edge of '{names[i]}'",
                             other, ctx)
        ones = V.const(1.0, self.dtype, ids.edges, loc=node.loc)
        return self.build(node, ctx, V.scatter, ones, ids, edge, ids.edges)

    @staticmethod
    def _bare_name(t: ast.Affine, ctx: Ctx) -> str | None:
        """The name an index expression is, when it is one name alone (coefficient 1)."""
        if len(t.terms) != 1:
            return None
        term = t.terms[0]
        if term.coef != 1 or term.size_of is not None or term.edge is None:
            return None
        return term.edge

    def _is_tensor(self, name: str, ctx: Ctx) -> bool:
        if name in ctx.edges:
            return False
        return name in ctx.values or self.scope.kinds.get(name) == "tensor"

    def named_edges(self, affines, ctx: Ctx) -> list[str]:
        """The edges index expressions name, in order, those with a 0 coefficient too."""
        out: list[str] = []
        for a in affines:
            for t in a.terms:
                e = t.edge and self.edge(t.edge, t, ctx)
                if e and e not in out:
                    out.append(e)
        return out

    def spread(self, v: V.Value, edges, loc) -> V.Value:
        """`v` over `edges` too, the same along each it lacks (an edge named only with
        coefficient 0: `[t = 0*j + 3]` is 1 where t = 3, for every j)."""
        lacking = [e for e in edges if e not in v.edges]
        if not lacking:
            return v
        return V.mul([v, V.const(1.0, self.dtype, lacking, loc=loc)], loc=loc)

    def _EdgeOps(self, node: ast.EdgeOps, ctx: Ctx) -> V.Value:
        return self.edge_ops(self, node, ctx)

    def _Call(self, node: ast.Call, ctx: Ctx) -> V.Value:
        if node.fn in LOOPS:
            return self.loop_call(self, node, ctx)
        if node.fn in ctx.fns:
            return self.inline_call(self, node, ctx)
        return self.call_builtin(self, node, ctx)

    # ---- affine index expressions ------------------------------------------------------

    def size_of(self, name: str, node, ctx: Ctx) -> Size:
        """The size a coefficient or `size(e)` names: a dim's or an edge's."""
        actual = ctx.edges.get(name, name)
        if actual in self.m.edges:
            return self.m.size(actual)
        raise self.error(f"unknown dim or edge '{name}'" + did_you_mean(name, [*self.m.edges, *ctx.edges]), node, ctx)

    def affine(self, node: ast.Affine, ctx: Ctx) -> Affine:
        terms: list[tuple[str, Size]] = []
        const: Size = 0
        for t in node.terms:
            coef: Size = t.coef
            if t.size_of is not None:
                if t.by_name and t.edge is not None and ctx.edges.get(t.size_of, t.size_of) not in self.m.dims:
                    raise self.error(f"the coefficient '{t.size_of}' of '{t.edge}' is not a dim: a coefficient is "
                                     f"an integer, a dim or size(e); a product of two edges is not affine", t, ctx)
                coef = size_op("*", coef, self.size_of(t.size_of, t, ctx))
            if t.edge is None:
                const = size_op("+", const, coef)
            else:
                terms.append((self.edge(t.edge, t, ctx), coef))
        aff = Affine.make(terms, const)
        self._check_index_range(aff, node, ctx)
        return aff

    def _check_index_range(self, aff: Affine, node: ast.Affine, ctx: Ctx) -> None:
        """An index expression whose value can leave [-MAX_SIZE, MAX_SIZE] is an error: the
        backends compute indices in int64, where it would wrap into range. The bound is
        |const| + sum |coef| (size - 1) over the terms whose coefficient and size are known;
        a known coefficient beyond MAX_SIZE is out of range whatever the edge's size."""
        bound = abs(aff.const) if isinstance(aff.const, int) else 0
        for edge, coef in aff.terms:
            n = self.m.size(edge)
            if isinstance(coef, int) and isinstance(n, int):
                bound += abs(coef) * (n - 1)
            elif isinstance(coef, int):
                bound = max(bound, abs(coef))
        if bound > MAX_SIZE:
            raise self.error(f"index expression out of range: its value can reach {bound} in magnitude, "
                             f"past {MAX_SIZE}", node, ctx)
