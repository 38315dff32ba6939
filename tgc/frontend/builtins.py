"""Calls of the language's primitives: elementwise functions, reductions,
`where`, `stop`, `checkpoint`, `size`, the conversions `f32(x)`, `f64(x)`, `bf16(x)`,
`f16(x)`, the derivative operators `grad`, `jvp`, `vjp`, and the random draws
`rand[e, ...](key)`, `randn[e, ...](key)` with keys `fold(key, n)`."""
from __future__ import annotations

from tgc.frontend import ast
from tgc.frontend.complexes import FUNCTIONS as COMPLEX_FUNCTIONS, ON_COMPLEX, RI, is_complex
from tgc.frontend.expressions import REDUCTIONS, Ctx, Elaborator, factors
from tgc.ir import values as V
from tgc.ir.diag import did_you_mean
from tgc.ir.dtypes import FLOATS
from tgc.ir.ops import SURFACE_ARITY

# the elementwise functions called by name (exp(x), where(c, a, b): tgc.ir.ops.FNS), then the rest
ARITY = {**{f: (n,) for f, n in SURFACE_ARITY.items()}, "stop": (1,), "checkpoint": (1,), "size": (1,),
         "grad": (2,), "jvp": (3,), "vjp": (3,), "sum": (1,), "mean": (1,),
         "max": (1, 2), "min": (1, 2), "rand": (1,), "randn": (1,), "fold": (2,),
         **{t: (1,) for t in FLOATS},   # conversions: f32(x), f64(x), bf16(x), f16(x)
         **{f: (1,) for f in COMPLEX_FUNCTIONS}}
RANDOM = ("rand", "randn")


def _check_shape(el: Elaborator, node: ast.Call, ctx: Ctx) -> None:
    if node.kwargs:
        raise el.error(f"'{node.fn}' takes no keyword arguments", node.kwargs[0], ctx)
    n = len(node.args)
    if n not in ARITY[node.fn]:
        want = " or ".join(str(a) for a in ARITY[node.fn])
        raise el.error(f"'{node.fn}' takes {want} argument{'s' if want != '1' else ''}, got {n}", node, ctx)
    if node.edges is not None and node.fn not in REDUCTIONS + RANDOM:
        raise el.error(f"'{node.fn}' takes no edge arguments", node, ctx)


def call_builtin(el: Elaborator, node: ast.Call, ctx: Ctx) -> V.Value:
    if node.fn not in ARITY:
        kind = el.scope.kinds.get(node.fn)
        if kind in ("tensor", "edge", "dim") or node.fn in ctx.values:
            raise el.error(f"'{node.fn}' is not a function", node, ctx)
        raise el.error(f"unknown function '{node.fn}'" + did_you_mean(node.fn, [*ARITY, *ctx.fns]), node, ctx)
    _check_shape(el, node, ctx)
    if node.fn == "size":
        return _size(el, node, ctx)
    if node.fn in ("grad", "jvp", "vjp"):
        return _derivative(el, node, ctx)
    if node.fn in REDUCTIONS:
        return _reduction(el, node, ctx)
    if node.fn in RANDOM:
        return _random(el, node, ctx)
    if node.fn == "fold":
        return _fold(el, node, ctx)
    args = [el.fexpr(a, ctx) for a in node.args]
    if node.fn == "stop":
        return V.stop(args[0], loc=node.loc)
    if node.fn == "checkpoint":   # x, recomputed by the backward pass (tgc/autodiff/remat.py)
        return V.map_("checkpoint", args[0], loc=node.loc)
    if node.fn in FLOATS:   # the type named, at most the program's width (as declarations)
        el.real_only(f"'{node.fn}'", node, ctx, args[0])
        from tgc.ir.lowp import explicitly_rounded

        # the operand with its bf16/f16 roundings explicit, nested ones too (tanh of a bf16
        # product is bf16 only once the product is rounded): the conversion sees its type
        return V.convert(explicitly_rounded(args[0]), el.width(node.fn, node.loc, f"'{node.fn}(...)'"), loc=node.loc)
    if node.fn in COMPLEX_FUNCTIONS or (node.fn in ON_COMPLEX and is_complex(args[0])):
        return _complex_function(el, node, args[0], ctx)
    if node.fn == "where":
        el.real_only("the condition of 'where'", node.args[0], ctx, args[0])
        if is_complex(args[1]) or is_complex(args[2]):
            args = [args[0]] + [el.cx.promote(a, node.loc) for a in args[1:]]
    else:
        el.real_only(f"'{node.fn}'", node, ctx, *args)
    return el.build(node, ctx, V.map_, node.fn, *args)


def _complex_function(el: Elaborator, node: ast.Call, z: V.Value, ctx: Ctx) -> V.Value:
    """real imag conj angle c64 c128 of any float value; exp log abs of a complex one."""
    cx, fn = el.cx, node.fn
    if fn in ("c64", "c128"):   # parts of the width named, at most the program's
        part = el.width("f32" if fn == "c64" else "f64", node.loc, f"'{fn}(...)'", complex_=True)
        return cx.promote(V.convert(z, part, loc=node.loc), node.loc)
    if fn in ("real", "imag"):
        if is_complex(z):
            return cx.part(z, 0 if fn == "real" else 1, node.loc)
        return z if fn == "real" else V.const(0.0, z.dtype, z.edges, loc=node.loc)
    return el.build(node, ctx, getattr(cx, fn), z)


def _size(el: Elaborator, node: ast.Call, ctx: Ctx) -> V.Value:
    arg = node.args[0]
    if not isinstance(arg, ast.Name):
        raise el.error("size() takes an edge name", arg, ctx)
    return V.size(el.edge(arg.id, arg, ctx), el.dtype, loc=node.loc)


def _reduction(el: Elaborator, node: ast.Call, ctx: Ctx) -> V.Value:
    if len(node.args) == 2:
        if node.edges is not None:
            raise el.error(f"two-argument '{node.fn}' is elementwise and takes no edges", node, ctx)
        a, b = (el.fexpr(x, ctx) for x in node.args)
        el.real_only(f"'{node.fn}'", node, ctx, a, b)
        return el.build(node, ctx, V.map_, node.fn, a, b)
    x = el.fexpr(node.args[0], ctx)
    if node.edges is None:
        edges = list(x.edges)
    else:
        edges = []
        for e in node.edges:
            for actual in el.edge_names(e.id, e, ctx):
                if actual not in x.edges:
                    what = f"'{actual}'" if actual == e.id else f"'{actual}' (edge parameter '{e.id}')"
                    raise el.error(f"cannot reduce over edge {what}: the argument has edges "
                                   f"[{', '.join(x.edges)}]", e, ctx)
                if actual in edges:
                    raise el.error(f"edge '{e.id}' is listed twice", e, ctx)
                edges.append(actual)
    if node.fn in ("max", "min"):
        el.real_only(f"'{node.fn}'", node, ctx, x)
        return el.build(node, ctx, V.reduce, node.fn, x, edges) if edges else x
    if node.edges is None:   # every edge but a complex value's parts
        edges = [e for e in edges if e != RI]
    total = V.contract(factors(x), [e for e in x.edges if e not in edges], loc=node.loc)
    if node.fn == "sum" or not edges:
        return total
    sizes = [V.size(e, el.dtype, loc=node.loc) for e in edges]
    count = sizes[0] if len(sizes) == 1 else V.contract(sizes, [], loc=node.loc)
    return V.map_("div", total, count, loc=node.loc)


def _wrt(el: Elaborator, node, ctx: Ctx) -> V.Value:
    """The `x` of a derivative: a name denoting an input, param or state."""
    v = el.expr(node, ctx)
    if v.op != "arg":
        what = f"'{node.id}'" if isinstance(node, ast.Name) else "this expression"
        raise el.error(f"cannot differentiate with respect to {what}: it is not an input, param or state", node, ctx)
    if v.dtype == "i32":
        raise el.error("cannot differentiate with respect to an integer (i32) input", node, ctx)
    return v


def _derivative(el: Elaborator, node: ast.Call, ctx: Ctx) -> V.Value:
    f = el.fexpr(node.args[0], ctx)
    x = _wrt(el, node.args[1], ctx)
    if node.fn == "grad" and is_complex(f):
        raise el.error("grad of a complex value: its derivative needs an explicit cotangent v, "
                       "written vjp(f, x, v) (grad(L, x) is for a real L)", node, ctx)
    if node.fn == "grad":
        shared = sorted(set(f.edges) & set(x.edges))
        if shared:
            raise el.error(f"grad of a non-scalar: the function and '{x.attrs[0]}' share edge "
                           f"'{shared[0]}'; rename one of them first", node, ctx)
        return el.build(node, ctx, V.grad, f, x)
    third = el.fexpr(node.args[2], ctx)
    if is_complex(third) and not is_complex(x if node.fn == "jvp" else f):
        what = f"the tangent of real '{x.attrs[0]}'" if node.fn == "jvp" else "the cotangent of a real function"
        raise el.error(f"{what} must be real, not complex", node.args[2], ctx)
    if is_complex(x if node.fn == "jvp" else f):   # a real (co)tangent of a complex value: imaginary part 0
        third = el.cx.promote(third, node.loc)
    if node.fn == "jvp":
        missing = sorted(set(x.edges) - set(third.edges))
        if missing:
            raise el.error(f"the tangent of '{x.attrs[0]}' must have its edges "
                           f"[{', '.join(x.edges)}]; it lacks '{missing[0]}'", node.args[2], ctx)
        return el.build(node, ctx, V.jvp, f, x, third)
    missing = sorted(set(f.edges) - set(third.edges))
    if missing:
        raise el.error(f"the cotangent must have the function's edges [{', '.join(f.edges)}]; "
                       f"it lacks '{missing[0]}'", node.args[2], ctx)
    return el.build(node, ctx, V.vjp, f, x, third)


def _key(el: Elaborator, node, ctx: Ctx) -> V.Value:
    """A key: an i32 scalar input (or a step's i32 scalar argument, inside a `repeat` or
    `scan` step), or a key derived from one by `fold`."""
    v = el.expr(node, ctx)
    if v.op not in ("arg", "loopvar", "fold") or v.dtype != "i32" or v.edges:
        raise el.error("a random key must be an i32 scalar input (or a step's i32 scalar argument) "
                       "or fold(key, n)", node, ctx)
    return v


def _random(el: Elaborator, node: ast.Call, ctx: Ctx) -> V.Value:
    if node.edges is None:
        raise el.error(f"'{node.fn}' needs the edges to draw over: {node.fn}[e, ...](key)", node, ctx)
    edges: list[str] = []
    for e in node.edges:
        for actual in el.edge_names(e.id, e, ctx):
            if actual in edges:
                raise el.error(f"edge '{e.id}' is listed twice", e, ctx)
            edges.append(actual)
    key = _key(el, node.args[0], ctx)
    return el.build(node, ctx, V.random, node.fn, key, (), el.dtype, edges)


def _fold(el: Elaborator, node: ast.Call, ctx: Ctx) -> V.Value:
    key = _key(el, node.args[0], ctx)
    n = node.args[1]
    if isinstance(n, ast.Num):
        if not (float(n.value).is_integer() and 0 <= float(n.value) < 2 ** 31):
            raise el.error("fold takes a key and an integer literal in [0, 2^31) or an i32 scalar input", n, ctx)
        return el.build(node, ctx, V.fold, key, int(float(n.value)))
    v = el.expr(n, ctx)
    if v.op not in ("arg", "loopvar") or v.dtype != "i32" or v.edges:
        raise el.error("fold takes a key and an integer literal in [0, 2^31) or an i32 scalar input", n, ctx)
    return el.build(node, ctx, V.fold, key, v)
