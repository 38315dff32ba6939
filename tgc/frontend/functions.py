"""Functions: checked once where they are defined, inlined at every call.

A body sees its parameters, its own bindings, its edge parameters, the program's
dims and edges, and the functions visible where it was written; local names
shadow global ones. Functions are not recursive: a cycle in the call graph is an
error at the call that closes it.

A function may give its own derivative (`with vjp(g) = ...`, `with jvp(dx, ...) =
...`): a clause sees what the result sees plus its own variables. At each call the
clauses are elaborated with the actual arguments, over `slot` placeholders for the
cotangent and tangents, their edges checked against the arguments' and the result's,
and the call's value becomes a `custom` value that carries them (see
`tgc.ir.values.custom`); the adjoint and tangent passes apply them.
"""
from __future__ import annotations

import dataclasses

from tgc.frontend import ast
from tgc.frontend.builtins import ARITY
from tgc.frontend.expressions import LOOPS, Ctx, Elaborator
from tgc.frontend.scope import PRIMITIVES, FnInfo
from tgc.ir import values as V
from tgc.ir.dtypes import LOW_FLOATS
from tgc.ir.diag import CompileError, Diagnostic, did_you_mean


MAX_CALL_DEPTH = 256  # most function calls open at once (f calls g calls ...): past it, a located error, not a stack overflow
MAX_INLINED_CALLS = 100_000  # most calls one program inlines: a call tree that doubles per level (f(f(a)))
                             # asks for 2^depth; past it, a located error, not minutes and gigabytes


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
    return ([p.default for p in d.params if p.default is not None] + [b.expr for b in d.body] + [d.result]
            + [e for r in d.rules for e in r.exprs])


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
    for r in d.rules:
        _check_rule(d, r, seen)


def _check_rule(d: ast.FnDef, r: ast.Rule, seen: dict[str, object]) -> None:
    """A rule's variables are new names, one cotangent for a vjp and one tangent per
    parameter for a jvp; a vjp gives one derivative per parameter (a tuple for several)."""
    n = len(d.params)
    if n == 0:
        raise CompileError(f"'{d.name}' has no parameters: there is nothing for its {r.kind} to differentiate", r.loc)
    for b in r.binders:
        if b.id in PRIMITIVES:
            raise CompileError(f"'{b.id}' is a built-in function and cannot name a {r.kind} variable", b.loc)
        if b.id in seen:
            raise CompileError(f"'{b.id}' is already defined in function '{d.name}'", b.loc,
                               [Diagnostic("note", "first defined here", seen[b.id].loc)])
    names = ", ".join(p.name for p in d.params)
    if r.kind == "vjp":
        if len(r.binders) != 1:
            raise CompileError(f"a vjp clause takes one variable, the cotangent of the result "
                               f"(`with vjp(g) = ...`), not {len(r.binders)}", r.binders[1].loc)
        if len(r.exprs) != n:
            what = f"a tuple of {n} (one per parameter: {names})" if n > 1 else f"one (for '{names}')"
            raise CompileError(f"the vjp of '{d.name}' gives {len(r.exprs)} derivative{'s' * (len(r.exprs) != 1)}, "
                               f"it needs {what}", r.exprs[0].loc)
    else:
        if len(r.binders) != n:
            raise CompileError(f"the jvp of '{d.name}' takes {n} tangent{'s' * (n != 1)}, one per parameter "
                               f"({names}), not {len(r.binders)}", r.loc)
        if r.tuple_form:
            raise CompileError("a jvp clause gives one expression, the tangent of the result, "
                               "not a tuple", r.exprs[0].loc)


def check_names(d: ast.FnDef, fns, kinds) -> None:
    """A located error for a name in `d`'s body that no call could resolve: a value that
    is neither a parameter nor an earlier binding of the body, or an unknown function.
    Inlining finds the same at every call; this also covers functions never called.
    (Edge names are left to the calls: they may name edges of the calling program.)"""
    params = {p.name for p in d.params}
    scopes = [(p.default, params) for p in d.params if p.default is not None]
    for i, b in enumerate(d.body):
        scopes.append((b.expr, params | {x.name for x in d.body[:i]}))
    scopes.append((d.result, params | {b.name for b in d.body}))
    for r in d.rules:
        scopes += [(e, params | {b.name for b in d.body} | {b.id for b in r.binders}) for e in r.exprs]
    for node, local in scopes:
        for use in _value_uses(node):
            if isinstance(use, ast.Call):
                if use.fn not in fns and use.fn not in ARITY and use.fn not in LOOPS:
                    raise CompileError(f"unknown function '{use.fn}'" + did_you_mean(use.fn, [*fns, *ARITY, *LOOPS]), use.loc)
            elif use.id not in local:
                raise CompileError(_not_local(use.id, d.name, kinds.get(use.id), use.id in fns, local), use.loc)


def _not_local(name: str, fn: str, kind: str | None, is_fn: bool, local=()) -> str:
    """The message the elaborator gives for a name a body cannot see (see Elaborator._Name)."""
    if kind in ("edge", "dim"):
        return f"'{name}' is an edge, not a tensor (use size({name}) for its size)"
    if kind == "fn" or is_fn:
        return f"'{name}' is a function; call it with arguments"
    if kind == "tensor":
        return f"'{name}' is not visible inside function '{fn}': pass it as a parameter"
    return f"unknown name '{name}'" + did_you_mean(name, local)


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
            if n.fn in LOOPS:   # the first argument names the step function
                stack.extend(reversed(list(n.args[1:])))
            elif n.fn != "size":
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
    return _inline(el, node, node.fn, values, edges, ctx)


def _inline(el: Elaborator, node: ast.Call, fn: str, values: dict[str, V.Value], edges, ctx: Ctx) -> V.Value:
    """The value of function `fn`'s body with its parameters bound to `values` (the
    others take their defaults) and its edge parameters to `edges`."""
    info = ctx.fns[fn]
    d = info.defn
    if len(ctx.stack) >= MAX_CALL_DEPTH:
        raise el.error(f"function calls nested too deeply (over {MAX_CALL_DEPTH} calls open at once, "
                       f"here calling '{fn}'): call fewer functions inside one another", node, ctx)
    el.inlined_calls += 1
    if el.inlined_calls > MAX_INLINED_CALLS:
        raise el.error(f"the program inlines over {MAX_INLINED_CALLS} function calls (every call is inlined: "
                       f"a function that calls another twice doubles its calls), here calling '{fn}'; "
                       f"run repeated layers with repeat[...] or scan[...]", node, ctx)
    inner = Ctx(values, edges, info.visible, ctx.stack + (fn,), ctx.call_locs + (node.loc,))
    for p in d.params:
        if p.name not in values:
            values[p.name] = el.expr(p.default, inner)
    for b in d.body:
        values[b.name] = el.expr(b.expr, inner)
    y = el.expr(d.result, inner)
    return _with_rules(el, node, d, inner, y) if d.rules else y


def _with_rules(el: Elaborator, call: ast.Call, d: ast.FnDef, inner: Ctx, y: V.Value) -> V.Value:
    """The call's value `y` with the function's own derivative rules, elaborated for
    this call's arguments over fresh placeholders; each rule's edges are checked."""
    el.custom_calls += 1
    k = el.custom_calls
    args = [inner.values[p.name] for p in d.params]
    vjps = jvp = None
    ct, tans = "", ()
    for r in d.rules:
        if r.kind == "vjp":
            g = r.binders[0].id
            ct = f"{d.name}.{g}.{k}"
            ctx = _with_values(inner, {g: V.slot(ct, y.dtype, y.edges, loc=r.binders[0].loc)})
            vjps = []
            for p, a, e in zip(d.params, args, r.exprs):
                v = el.fexpr(e, ctx)
                extra = sorted(set(v.edges) - set(a.edges))
                if extra:
                    raise el.error(f"the derivative for '{p.name}' in the vjp of '{d.name}' has edge '{extra[0]}', "
                                   f"which '{p.name}' lacks (its edges: [{', '.join(a.edges)}])", e, ctx)
                vjps.append(v)
        else:
            tans = tuple(f"{d.name}.{b.id}.{k}" for b in r.binders)
            ctx = _with_values(inner, {b.id: V.slot(t, y.dtype, a.edges, loc=b.loc)
                                       for b, t, a in zip(r.binders, tans, args)})
            jvp = el.fexpr(r.exprs[0], ctx)
            extra = sorted(set(jvp.edges) - set(y.edges))
            if extra:
                raise el.error(f"the jvp of '{d.name}' has edge '{extra[0]}', which its result lacks "
                               f"(the result's edges: [{', '.join(y.edges)}])", r.exprs[0], ctx)
    return el.build(call, inner, V.custom, y, args, vjps, jvp, d.name, ct, tans)


def _with_values(ctx: Ctx, extra: dict[str, V.Value]) -> Ctx:
    return Ctx({**ctx.values, **extra}, ctx.edges, ctx.fns, ctx.stack, ctx.call_locs)


def loop_call(el: Elaborator, node: ast.Call, ctx: Ctx) -> V.Value:
    """`repeat[e](f, init, a1, ..., an)` and `scan[e](f, init, ...)`: one loop over `e`
    (`tgc.ir.values.loop`) whose body is `f` elaborated once, over parameters that
    stand for the carry and for each `ak` without `e`. `repeat` is the last carry,
    `scan` every step's carry, stacked along `e`."""
    form = node.fn
    usage = f"{form}[e](f, init, a1, ..., an)"
    if node.kwargs:
        raise el.error(f"'{form}' takes no keyword arguments: {usage}", node.kwargs[0], ctx)
    if not node.edges or len(node.edges) != 1:
        raise el.error(f"'{form}' takes one edge, the edge it runs over: {usage}", node, ctx)
    if len(node.args) < 2:
        raise el.error(f"'{form}' takes a function, an initial value and stacked arguments: {usage}", node, ctx)
    e = el.edge(node.edges[0].id, node.edges[0], ctx)
    f = node.args[0]
    if not isinstance(f, ast.Name) or f.id not in ctx.fns:
        raise el.error(f"the first argument of '{form}' is the name of a function (fn), the step: {usage}", f, ctx)
    d = ctx.fns[f.id].defn
    if f.id in ctx.stack:
        raise el.error(f"function '{f.id}' calls itself (functions are not recursive)", f, ctx)
    if d.edge_params:
        raise el.error(f"the step '{f.id}' of '{form}' takes edge parameters; a step takes tensors only", f, ctx)
    args = [el.expr(a, ctx) for a in node.args[1:]]
    if any(w.dtype in LOW_FLOATS for w in V.topo_order(args)):
        from tgc.ir.lowp import explicitly_rounded

        # a bf16/f16 expression (computed in f32) enters the loop with its roundings explicit
        # (as explicit_rounding makes them later), so the step's parameters have its language
        # type (as they do for a bf16 argument)
        args = [explicitly_rounded(a) for a in args]
    required = [p for p in d.params if p.default is None]
    if not len(required) <= len(args) <= len(d.params):
        raise el.error(f"the step '{f.id}' takes {len(d.params)} argument{'s' * (len(d.params) != 1)} "
                       f"(the carry, then one per stacked argument); '{form}' gives it {len(args)}", node, ctx)
    init, stacked = args[0], args[1:]
    if e in init.edges:
        raise el.error(f"the initial value of '{form}' has the loop edge '{e}'; the carry has no loop edge",
                       node.args[1], ctx)
    for a, n in zip(stacked, node.args[2:]):
        if e not in a.edges:
            shared = f"{n.id} * [{e} = {e}]" if isinstance(getattr(n, "id", None), str) else f"x * [{e} = {e}]"
            raise el.error(f"a stacked argument of '{form}' has no edge '{e}' (its edges: [{', '.join(a.edges)}]): "
                           f"each step reads its slice along '{e}'; a tensor every step shares is passed "
                           f"repeated along it, `{shared}`", n, ctx)
    # an argument written `x * [e = e]` (x repeated along e: a weight every step shares) is
    # passed to the loop as x itself, the same at every step (an invariant), so that
    # neither it nor its gradient is held once per step
    shared = [_repeated_along(a, e) for a in stacked]
    order = [k for k, x in enumerate(shared) if x is None] + [k for k, x in enumerate(shared) if x is not None]
    operands = [stacked[k] if shared[k] is None else shared[k] for k in order]
    slot = {k: V.loopvar(n, o.dtype, [x for x in o.edges if x != e]) for n, (k, o) in enumerate(zip(order, operands), 1)}
    for _ in range(3):
        carry = V.loopvar(0, init.dtype, init.edges)
        values = {p.name: v for p, v in zip(d.params, [carry] + [slot[k] for k in range(len(stacked))])}
        y = _inline(el, node, f.id, values, {}, ctx)
        if any(w.dtype in LOW_FLOATS for w in V.topo_order([y])):   # bf16/f16 in the step: rounded as outside a loop
            from tgc.ir.lowp import explicitly_rounded

            y = explicitly_rounded(y)
        if y.type == init.type or set(y.edges) != set(init.edges) or _wider(init.dtype, y.dtype) != y.dtype:
            break
        # the step promotes the carry to a wider type (a bf16 init, f32 stacked params):
        # the carry has that type from the start, as `h = f(h, ...)` would after one step
        init = V.convert(init, y.dtype, loc=init.loc)
    if y.type != init.type:
        raise el.error(f"the step '{f.id}' returns {y.type}, but the carry is {init.type}: a step returns "
                       f"a value with its initial value's edges and type", node, ctx)
    slices = sum(x is None for x in shared)
    body = V.loop_body([carry] + [slot[k] for k in order], [y] * (1 + (form == "scan")), 1, slices)   # the carry's type is checked
    return el.build(node, ctx, V.loop, body, e, [init] + operands, 1 if form == "scan" else 0)


def _wider(a: str, b: str) -> str | None:
    """The promotion of two float types, None for types outside the real-float table."""
    from tgc.ir.dtypes import TYPES, promote

    return promote(a, b) if a in TYPES and b in TYPES else None


def _repeated_along(a: V.Value, e: str) -> V.Value | None:
    """x where `a` is `x * [e = e]`, `x` without the edge `e` (repeated along it: the
    indicator is 1 at every index), else None."""
    if a.op != "contract" or len(a.operands) != 2:
        return None
    for ind, x in (a.operands, a.operands[::-1]):
        if ind.op != "indicator" or e in x.edges or set(a.edges) != set(x.edges) | {e} or a.dtype != x.dtype:
            continue
        rel = ind.attrs[0]
        if rel.edges() == (e,) and set(rel.ops) == {"="} and all(r == rel.exprs[0] for r in rel.exprs):
            return x
    return None
