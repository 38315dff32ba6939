"""The cut of a data-parallel training step at its gradient boundary (`split_step`),
made on the module before the pass pipeline: *boundary* values are the derivatives
(`grad`, `vjp`, `jvp`) that the updates read and that depend on the sharded data.
Phase 1 (`Split.grads`) is the program without its updates, with every boundary
value as an extra output; phase 2 (`Split.apply`) is the updates alone, each boundary
value replaced by an input of the same type. Both are ordinary modules, compiled by
the ordinary pipeline; `tgc.distributed.DataParallel` runs them around the reduction.

The cut is exact: phase 2 computes, from the same boundary values, what the updates
computed (a value is never changed, only where it is materialized). It refuses
(CompileError) an update that reads sharded data outside a derivative, or a boundary
value that keeps the sharded edge: those cannot be averaged. Each walk visits every
value of the finite DAG once, so it terminates.
"""
from __future__ import annotations

from dataclasses import dataclass

from tgc.ir import values as V
from tgc.ir.diag import CompileError
from tgc.ir.module import Arg, Module, Output
from tgc.opt.prune import drop_unread_args, forward_only, used_dims


@dataclass
class Split:
    """The two phases of a data-parallel step (see the module docstring)."""
    grads: Module               # outputs + one output per boundary value; no updates
    apply: Module               # the updates; one input per boundary value
    boundary: list[str]         # the boundary values' names: outputs of `grads`, inputs of `apply`
    forward: Module             # the forward-only program (no updates)


def sharded_dims(module: Module, shard: str) -> set[str]:
    """The dim `shard` and every dim whose size expression mentions it (`dim bt = batch * t`)."""
    return {shard} | {d for d, s in module.dims.items()
                      if s is not None and not isinstance(s, int) and shard in _names_in(s)}


def _names_in(s) -> set[str]:
    """Every string inside a size expression (dim names among them)."""
    import dataclasses

    found: set[str] = set()
    stack = [s]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            found.add(x)
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            stack.extend(getattr(x, f.name) for f in dataclasses.fields(x))
    return found


def split_step(module: Module, shard: str = "batch") -> Split:
    """Cut `module` (before the pass pipeline: its derivatives not yet expanded) at the
    gradient boundary over the sharded dim `shard`. CompileError when it cannot.
    Terminates: each walk visits every value of the finite DAG once."""
    if shard not in module.dims:
        have = ", ".join(module.dims) or "none"
        raise CompileError(f"data parallel: the program has no dim '{shard}' to split over the ranks "
                           f"(its dims: {have}); name it with shard=")
    if module.dims[shard] is not None:
        raise CompileError(f"data parallel: dim '{shard}' is fixed; it must be symbolic (`dim {shard}`), "
                           f"so that each rank binds it to the rows it holds")
    if not module.updates:
        raise CompileError("data parallel: the program has no `update`; there is nothing to average")
    dims = sharded_dims(module, shard)

    def sharded(edges) -> bool:
        return any(module.edges[e] in dims for e in edges)

    data = {n for n, a in module.args.items() if sharded(a.order)}
    for n in data:
        if module.args[n].kind != "input":
            raise CompileError(f"data parallel: {module.args[n].kind} '{n}' has the split edge of dim "
                               f"'{shard}'; params and states are the same on every rank", module.args[n].loc)
    # values that depend on the sharded data (the derivative ops' own operands count)
    depends: dict[int, bool] = {}
    for v in V.topo_order(module.roots()):
        depends[id(v)] = (v.op == "arg" and v.attrs[0] in data) or any(depends[id(o)] for o in v.operands)

    # the boundary: the first derivative on each path down from an update that depends on the data
    boundary: dict[int, V.Value] = {}
    seen: set[int] = set()
    stack = [u.value for u in module.updates]
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if v.op in V.DERIVATIVE_OPS and depends[id(v)]:
            boundary[id(v)] = v
            continue
        stack.extend(v.operands)

    taken = set(module.args) | set(module.edges) | set(module.dims) | {o.name for o in module.outputs}
    names: dict[int, str] = {}
    for v in sorted(boundary.values(), key=_boundary_rank(module)):
        if sharded(v.edges):
            raise CompileError(f"data parallel: a derivative the updates read keeps the split edge of dim "
                               f"'{shard}' ({v.type}); only values summed or averaged over it can be reduced",
                               v.loc)
        base = "d_" + (v.operands[1].attrs[0] if v.op in ("grad", "vjp", "jvp") else "value")
        name, n = base, 1
        while name in taken:
            name, n = f"{base}_{n}", n + 1
        taken.add(name)
        names[id(v)] = name

    def order(v: V.Value) -> tuple[str, ...]:
        x = v.operands[1]
        own = [e for e in module.args[x.attrs[0]].order if e in v.edges]
        return tuple(module.order_edges([e for e in v.edges if e not in own])) + tuple(own)

    ordered = [boundary[k] for k in names]
    grads = Module(dict(module.dims), dict(module.edges), dict(module.args),
                   list(module.outputs) + [Output(names[id(v)], v, order(v)) for v in ordered], [],
                   list(module.facts))
    new_args = {names[id(v)]: Arg(names[id(v)], "input", v.dtype, order(v)) for v in ordered}
    memo = V.rebuild([u.value for u in module.updates],
                     lambda v, ops: V.arg(names[id(v)], v.dtype, v.edges) if id(v) in names
                     else V.rebuild_same(v, ops))
    from dataclasses import replace

    updates = [replace(u, value=memo[id(u.value)]) for u in module.updates]
    apply = Module(dict(module.dims), dict(module.edges), {**module.args, **new_args}, [], updates,
                   list(module.facts))
    for v in V.topo_order([u.value for u in updates]):
        if v.op == "arg" and v.attrs[0] in data:
            u = next(u for u in updates if v in V.topo_order([u.value]))
            raise CompileError(f"data parallel: the update of '{u.target}' reads input '{v.attrs[0]}', which is "
                               f"split over the ranks, outside a gradient: it cannot be averaged", u.loc)
    apply = drop_unread_args(apply, keep_dims=False)
    # phase 2 must not see the split dims: they leave its module, so that a call binds no
    # batch size it has no input for (each rank's is its own, not the global one)
    if used_dims(apply) & dims:
        raise CompileError(f"data parallel: an update reads the size of dim '{shard}' (or of a dim derived "
                           f"from it) outside a gradient; on each rank it is that rank's rows, not the batch's")
    apply = Module({d: s for d, s in apply.dims.items() if d not in dims},
                   {e: d for e, d in apply.edges.items() if d not in dims}, apply.args, [], apply.updates,
                   [f for f in apply.facts if not (set(f.lhs.edges) | set(f.rhs.edges)) & {
                       e for e, d in module.edges.items() if d in dims}])
    return Split(drop_unread_args(grads), apply, [names[id(v)] for v in ordered], forward_only(module))


def _boundary_rank(module: Module):
    """Boundary values in the order of their variables' declarations, the last first:
    a backward pass produces the last layers' gradients first (as DDP's buckets)."""
    rank = {n: i for i, n in enumerate(module.args)}

    def key(v: V.Value):
        x = v.operands[1].attrs[0]
        return (-rank.get(x, 0), v.op, str(v.type))
    return key
