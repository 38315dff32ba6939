"""Functions: checked once where they are defined, inlined at every call.

A body sees its parameters, its own bindings, its edge parameters, the program's
dims and edges, and the functions visible where it was written; local names
shadow global ones. Functions are not recursive: a cycle in the call graph is an
error at the call that closes it.
"""
from __future__ import annotations

import dataclasses

from tgc.frontend import ast
from tgc.frontend.expressions import Ctx, Elaborator
from tgc.frontend.scope import PRIMITIVES, FnInfo
from tgc.ir import values as V
from tgc.ir.diag import CompileError, Diagnostic


def _children(node):
    for f in dataclasses.fields(node):
        if f.name == "loc":
            continue
        value = getattr(node, f.name)
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, ast.Node):
                yield item


def _calls(node) -> list[ast.Call]:
    """Every call inside `node`, iteratively (bodies can be deeply nested)."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Call):
            out.append(n)
        stack.extend(_children(n))
    return out[::-1]


def _body_nodes(d: ast.FnDef) -> list:
    return [p.default for p in d.params if p.default is not None] + [b.expr for b in d.body] + [d.result]


def check_recursion(fns: dict[str, FnInfo], names: list[str]) -> None:
    """A located error at the call that closes a cycle among `names`' functions."""
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(name: str, path: list[tuple[str, ast.Call]]) -> None:
        state[name] = 1
        info = fns[name]
        for node in _body_nodes(info.defn):
            for call in _calls(node):
                if fns.get(call.fn) is None or fns[call.fn] is not info.visible.get(call.fn):
                    continue
                if state.get(call.fn) == 1:
                    chain = " -> ".join([p for p, _ in path] + [name, call.fn])
                    msg = (f"function '{name}' calls itself" if call.fn == name
                           else f"recursive functions: {chain}")
                    raise CompileError(msg + " (functions are not recursive)", call.loc,
                                       [Diagnostic("note", f"'{call.fn}' is defined here", fns[call.fn].defn.loc)])
                if state.get(call.fn) is None:
                    visit(call.fn, path + [(name, call)])
        state[name] = 2

    for name in names:
        if state.get(name) is None:
            visit(name, [])


def check_definition(d: ast.FnDef) -> None:
    """Parameters, edge parameters and bindings of one function are distinct."""
    seen: dict[str, object] = {}
    for item in list(d.edge_params) + list(d.params) + list(d.body):
        name = item.id if isinstance(item, ast.Name) else item.name
        if name in PRIMITIVES:
            raise CompileError(f"'{name}' is a built-in function and cannot be redefined", item.loc)
        if name in seen:
            raise CompileError(f"'{name}' is already defined in function '{d.name}'", item.loc,
                               [Diagnostic("note", "first defined here", seen[name].loc)])
        seen[name] = item


def check_names(d: ast.FnDef, fns, kinds) -> None:
    """A located error for a name in `d`'s body that no call could resolve: a value that
    is neither a parameter nor an earlier binding of the body, or an unknown function.
    Inlining finds the same at every call; this also covers functions never called.
    (Edge names are left to the calls: they may name edges of the calling program.)"""
    from tgc.frontend.builtins import ARITY

    params = {p.name for p in d.params}
    scopes = [(p.default, params) for p in d.params if p.default is not None]
    for i, b in enumerate(d.body):
        scopes.append((b.expr, params | {x.name for x in d.body[:i]}))
    scopes.append((d.result, params | {b.name for b in d.body}))
    for node, local in scopes:
        for use in _value_uses(node):
            if isinstance(use, ast.Call):
                if use.fn not in fns and use.fn not in ARITY:
                    raise CompileError(f"unknown function '{use.fn}'", use.loc)
            elif use.id not in local:
                raise CompileError(_not_local(use.id, d.name, kinds.get(use.id), use.id in fns), use.loc)


def _not_local(name: str, fn: str, kind: str | None, is_fn: bool) -> str:
    """The message the elaborator gives for a name a body cannot see (see Elaborator._Name)."""
    if kind in ("edge", "dim"):
        return f"'{name}' is an edge, not a tensor (use size({name}) for its size)"
    if kind == "fn" or is_fn:
        return f"'{name}' is a function; call it with arguments"
    if kind == "tensor":
        return f"'{name}' is not visible inside function '{fn}': pass it as a parameter"
    return f"unknown name '{name}'"


def _value_uses(node):
    """The names in value position and the calls inside an expression, in source order.
    Edge positions are skipped: call edge lists, renames, indicators, `size(e)`, and the
    right side of a reindex (an affine expression of edges, or a gather's index tensor)."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Name):
            out.append(n)
        elif isinstance(n, ast.Call):
            out.append(n)
            if n.fn != "size":
                stack.extend(reversed(list(n.args) + [k.value for k in n.kwargs]))
        elif isinstance(n, ast.EdgeOps):
            stack.append(n.x)
        elif isinstance(n, (ast.BinOp, ast.Compare)):
            stack.extend((n.rhs, n.lhs))
        elif isinstance(n, ast.Neg):
            stack.append(n.x)
    return sorted(out, key=lambda n: (n.loc.line, n.loc.col))


def _bind_args(el: Elaborator, node: ast.Call, d: ast.FnDef, ctx: Ctx) -> dict[str, ast.Node]:
    if len(node.args) > len(d.params):
        raise el.error(f"'{d.name}' takes {len(d.params)} argument{'s' * (len(d.params) != 1)}, "
                       f"got {len(node.args)}", node, ctx)
    given: dict[str, ast.Node] = {p.name: a for p, a in zip(d.params, node.args)}
    names = [p.name for p in d.params]
    for kw in node.kwargs:
        if kw.name not in names:
            raise el.error(f"'{d.name}' has no parameter '{kw.name}'", kw, ctx)
        if kw.name in given:
            raise el.error(f"argument '{kw.name}' of '{d.name}' is given twice", kw, ctx)
        given[kw.name] = kw.value
    for p in d.params:
        if p.name not in given and p.default is None:
            raise el.error(f"missing argument '{p.name}' in call of '{d.name}'", node, ctx)
    return given


def _edge_args(el: Elaborator, node: ast.Call, d: ast.FnDef, ctx: Ctx) -> dict[str, str | tuple[str, ...]]:
    """Edge parameter -> actual edge. The last parameter of a function declared with
    `e...` collects every remaining edge argument (`dropout[batch, hidden](h, key, p)`
    binds `e` to both): it then stands for all of them in edge lists, and is an error
    where one edge is needed."""
    args = [(a, x) for a in node.edges or () for x in el.edge_names(a.id, a, ctx)]
    want, got = len(d.edge_params), len(args)
    if got < want or (got > want and not d.variadic):
        if want == 0:
            raise el.error(f"'{d.name}' takes no edge arguments", node, ctx)
        more = " or more" if d.variadic else ""
        raise el.error(f"'{d.name}' takes {want}{more} edge argument{'s' * (want != 1 or d.variadic)} "
                       f"([{', '.join(e.id for e in d.edge_params)}{'...' * d.variadic}]), got {got}", node, ctx)
    mapping: dict[str, str | tuple[str, ...]] = {}
    for p, (_, actual) in zip(d.edge_params, args):
        mapping[p.id] = actual
    if got > want:
        rest = tuple(x for _, x in args[want - 1:])
        if len(set(rest)) != len(rest):
            raise el.error(f"an edge is given twice to '{d.name}'", node, ctx)
        mapping[d.edge_params[-1].id] = rest
    return mapping


def inline_call(el: Elaborator, node: ast.Call, ctx: Ctx) -> V.Value:
    info = ctx.fns[node.fn]
    d = info.defn
    if node.fn in ctx.stack:
        raise el.error(f"function '{node.fn}' calls itself (functions are not recursive)", node, ctx)
    edges = _edge_args(el, node, d, ctx)
    given = _bind_args(el, node, d, ctx)
    values = {name: el.expr(arg, ctx) for name, arg in given.items()}
    inner = Ctx(values, edges, info.visible, ctx.stack + (node.fn,), ctx.call_locs + (node.loc,))
    for p in d.params:
        if p.name not in values:
            values[p.name] = el.expr(p.default, inner)
    for b in d.body:
        values[b.name] = el.expr(b.expr, inner)
    return el.expr(d.result, inner)
