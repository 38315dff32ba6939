"""forward_only and drop_unread_args: a program cut down to what a caller asks for.

- `forward_only`: the program without its updates, and without the arguments only
  they read: the evaluation program (`Program.without_updates`, `tgc run
  --no-update`, a data-parallel step's forward phase). Values that only the updates
  needed are no longer reachable from any root, so the pipeline and the lowering
  never see them.
- `drop_unread_args`: the program without the arguments no output or update reads
  (`tgc grad`'s result, a data-parallel step's phases). With `keep_dims`, an unread
  argument stays when it alone carries a symbolic dim the program uses (a call binds
  that dim from its shape); a fact on a dropped argument goes with it.

Both change the program's signature, not a value: every output (and, for
drop_unread_args, every update) is the same value of the same arguments. Terminates:
one walk over the values, the attributes and the dims (each dim's size expression
visited once).
"""
from __future__ import annotations

from dataclasses import dataclass

from tgc.ir.module import Module
from tgc.ir.passes import Pass
from tgc.ir.values import topo_order
from tgc.options import Options


@dataclass(frozen=True)
class ForwardOnly(Pass[Module, Module]):
    """The program without its updates and the arguments only they read."""

    name = "forward_only"

    def run(self, module: Module, options: Options) -> Module:
        return forward_only(module)


@dataclass(frozen=True)
class DropUnreadArgs(Pass[Module, Module]):
    """The program without the arguments that no output or update reads."""

    name = "drop_unread_args"
    keep_dims: bool = True   # keep an unread argument that alone carries a used symbolic dim

    def run(self, module: Module, options: Options) -> Module:
        return drop_unread_args(module, self.keep_dims)


def read_args(module: Module) -> set[str]:
    """The arguments some output or update reads."""
    return {v.attrs[0] for v in module.values() if v.op == "arg"}


def used_dims(module: Module) -> set[str]:
    """The dims the outputs and updates depend on: those of every edge their values,
    attributes (reductions, reindexing, sizes) and ABI orders mention, and the dims
    those are derived from. Over-approximates: any name in an attribute counts."""
    import dataclasses

    found: set[str] = set()

    def walk(x) -> None:
        if isinstance(x, str):
            if x in module.edges:
                found.add(module.edges[x])
            elif x in module.dims:
                found.add(x)
        elif isinstance(x, (tuple, list, frozenset, set)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for k, y in x.items():
                walk(k)
                walk(y)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))

    for v in module.values():
        walk(v.edges)
        walk(v.attrs)
    walk([o.order for o in module.outputs])
    walk([module.args[u.target].order for u in module.updates])
    todo = list(found)
    while todo:
        s = module.dims.get(todo.pop())
        if s is not None and not isinstance(s, int):
            before = set(found)
            walk(s)
            todo += list(found - before)
    return found


def drop_unread_args(module: Module, keep_dims: bool = True) -> Module:
    """A copy of `module` without the arguments that nothing reads.

    With `keep_dims`, an unread argument stays when it is the only one to carry a
    symbolic dim that the program uses (a call binds that dim from its shape)."""
    read = read_args(module)
    needed = used_dims(module) if keep_dims else set()
    carried = {module.edges[e] for n in read for e in module.args[n].order if module.dims[module.edges[e]] is None}
    args = {}
    for name, a in module.args.items():
        dims = {module.edges[e] for e in a.order if module.dims[module.edges[e]] is None}
        if name in read or (dims & needed) - carried:
            args[name] = a
            carried |= dims
    facts = [f for f in module.facts   # a fact on a dropped argument goes with it
             if all(v.attrs[0] in args for v in topo_order([f.lhs, f.rhs]) if v.op == "arg")]
    return Module(dict(module.dims), dict(module.edges), args, list(module.outputs), list(module.updates), facts)


def forward_only(module: Module) -> Module:
    """`module` without its updates and without the arguments only they read: the
    forward (evaluation) program. Values that only the updates needed are no longer
    reachable from any root, so the pipeline and the lowering never see them."""
    pruned = Module(dict(module.dims), dict(module.edges), dict(module.args), list(module.outputs), [],
                    list(module.facts))
    return drop_unread_args(pruned)
