"""The IR module: dims, edges, arguments, and the outputs and updates of a program.

A module owns the global edge table (every edge name has exactly one dim, and every
dim is also an edge of its own size) and the roots of the value DAG: its outputs
(each with an ABI order: the row-major axis order a caller sees) and its updates
(new values for params and states, written back after the step).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping

from tgc.ir.diag import Loc, did_you_mean
from tgc.ir.sizes import MAX_SIZE, Size, SizeError, UnboundDim, check_count, size_eval, size_eval_checked, size_str
from tgc.ir.values import Value, topo_order



@dataclass(frozen=True)
class Arg:
    name: str
    kind: str  # input | param | state
    dtype: str  # f32 | f64 | i32
    order: tuple[str, ...]  # ABI order of the edges
    loc: Loc | None = None


@dataclass(frozen=True)
class Output:
    name: str
    value: Value
    order: tuple[str, ...]  # ABI order
    loc: Loc | None = None
    low: str | None = None  # bf16/f16: the declared type of an output whose value `emulate_low` holds in floats


@dataclass(frozen=True)
class Update:
    target: str
    value: Value
    loc: Loc | None = None


# a fact's relation -> its name in the textual IR
FACT_RELS = {"=": "eq", "!=": "ne", "<": "lt", "<=": "le", ">": "gt", ">=": "ge"}


@dataclass(frozen=True)
class Fact:
    """`assume lhs rel rhs`: a declared fact about the inputs, holding elementwise over
    the union of both sides' edges. `text` is the relation as written (for messages).
    Facts are not roots: nothing computes them unless asked to check them."""
    rel: str  # = != < <= > >=
    lhs: Value
    rhs: Value
    text: str
    loc: Loc | None = None



def size_error(name: str, n) -> str | None:
    """Why `n` is not a size a caller may give dim `name` (None: it is one)."""
    import numbers

    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 0 < n <= MAX_SIZE:
        return f"dim '{name}' = {n!r}: a size is a positive integer (at most 2^62)"
    return None

@dataclass
class Module:
    dims: dict[str, Size | None] = field(default_factory=dict)  # None: symbolic, bound at call
    edges: dict[str, str] = field(default_factory=dict)  # edge -> dim
    args: dict[str, Arg] = field(default_factory=dict)
    outputs: list[Output] = field(default_factory=list)
    updates: list[Update] = field(default_factory=list)
    facts: list[Fact] = field(default_factory=list)  # `assume` statements

    def size(self, edge: str) -> Size:
        """The edge's size: an int, or an expression of symbolic dims."""
        dim = self.edges[edge]
        s = self.dims[dim]
        return dim if s is None else s

    def symbolic_dims(self) -> list[str]:
        return [d for d, s in self.dims.items() if s is None]

    def roots(self) -> list[Value]:
        return [o.value for o in self.outputs] + [u.value for u in self.updates]

    def update_key(self, target: str) -> str:
        """The name of an update's new value among a call's results: the target's, or
        `target'` when an output has that name (`out W` beside `update W`: the output
        is W before the step, as every right-hand side reads it)."""
        return f"{target}'" if any(o.name == target for o in self.outputs) else target

    def values(self) -> list[Value]:
        """Every live value, operands first, in a deterministic order."""
        return topo_order(self.roots())

    def replace_values(self, memo: Mapping[int, Value]) -> "Module":
        """A copy whose outputs and updates map through `memo` (id(old) -> new)."""
        outs = [replace(o, value=memo.get(id(o.value), o.value)) for o in self.outputs]
        ups = [replace(u, value=memo.get(id(u.value), u.value)) for u in self.updates]
        # the facts stay as declared: they read only arguments, which passes never change,
        # and a rewrite that uses a fact (`sum[v](y) = 1`) must not rewrite the fact itself
        return Module(dict(self.dims), dict(self.edges), dict(self.args), outs, ups, list(self.facts))

    def fact_values(self) -> list[Value]:
        """The values of the facts' sides (and what they read), operands first."""
        return topo_order([v for f in self.facts for v in (f.lhs, f.rhs)])

    def fresh_edge(self, base: str, dim: str) -> str:
        """Register and return a new edge name of size `dim` that no one uses yet."""
        stem = base.split(".")[0]
        n = 1
        while f"{stem}.{n}" in self.edges:
            n += 1
        name = f"{stem}.{n}"
        self.edges[name] = dim
        return name

    def dim_error(self, name: str, n, bind: bool = True) -> str | None:
        """Why a caller may not give dim `name` the size `n` (None: it may): the one
        check of a given dim (`dims=`, `--dim`, `-D`, `tgc.compile(dims=)`). With
        `bind`, only a symbolic dim takes a size (a fixed or derived one only its own)."""
        if name not in self.dims:
            return f"the program has no dim '{name}'" + did_you_mean(name, self.dims)
        if size_error(name, n):
            return size_error(name, n)
        if bind and self.dims[name] is not None and self.dims[name] != n:
            why = "it has a fixed size" if isinstance(self.dims[name], int) else "it is derived from other dims"
            return f"dim '{name}' is {size_str(self.dims[name])}, not a symbolic dim to bind to {n}: {why}"
        return None

    def bind_dims(self, known: Mapping[str, int]) -> dict[str, int]:
        """Sizes of every dim given the symbolic ones in `known`: UnboundDim if one is
        missing, SizeError if a dim expression does not divide or is not positive (the
        optimizer's algebra assumes no edge is empty: a mean's gradient divides by the
        size, a softmax's weights add up to 1)."""
        env = dict(known)
        for dim, s in self.dims.items():
            if s is None and dim not in env:
                raise UnboundDim(f"dim '{dim}' is not bound")
            if s is not None:
                env[dim] = _dim_value(dim, s, env)
            if env[dim] <= 0:
                how = "" if s is None else f" = {size_str(s)}"
                raise SizeError(f"dim '{dim}'{how} is {env[dim]}: sizes must be positive")
            if env[dim] > MAX_SIZE:
                how = "" if s is None else f" = {size_str(s)}"
                raise SizeError(f"dim '{dim}'{how} is {env[dim]}, over the size limit of 2^62")
        for a in self.args.values():   # every argument's and output's elements and bytes
            check_count(f"{a.kind} '{a.name}'", [self.size(e) for e in a.order], env, 8)
        for o in self.outputs:
            check_count(f"output '{o.name}'", [self.size(e) for e in o.order], env, 8)
        return env

    def edge_sizes(self, env: Mapping[str, int]) -> dict[str, int]:
        return {e: env[d] for e, d in self.edges.items()}

    def order_edges(self, edges: Iterable[str]) -> tuple[str, ...]:
        """`edges` in the order their names were first declared in the program."""
        rank = {e: i for i, e in enumerate(self.edges)}
        return tuple(sorted(edges, key=lambda e: (rank.get(e, len(rank)), e)))


def _dim_value(dim: str, s: Size, env: Mapping[str, int]) -> int:
    """The value of dim `dim` = `s`; a SizeError naming the dim if `s` does not divide."""
    try:
        return size_eval_checked(s, env)
    except UnboundDim:
        raise
    except SizeError as e:
        raise SizeError(f"dim '{dim}' = {size_str(s)}: {e}") from None


def index_bound(aff, module: Module, env: Mapping[str, int]) -> int:
    """The largest magnitude the affine index `aff` (an `Affine` over `module`'s edges)
    takes over its edges' ranges at the dims `env`: |const| + sum |coef| (size - 1)."""
    bound = abs(size_eval(aff.const, env))
    for edge, coef in aff.terms:
        bound += abs(size_eval(coef, env)) * (size_eval(module.size(edge), env) - 1)
    return bound


def index_exprs(module: Module) -> list:
    """The affine expressions of `module`'s indicators (reindexing, windows, masks;
    loop steps' included) that a call must bound at its sizes, so that no int64 index
    arithmetic in compiled code wraps: those whose value depends on a symbolic size,
    and those past 2^62 at fixed sizes (the front end refuses them, but IR text can
    hold them). The Python runtime (`Program`) and the C library's entry point
    (`tgc.backends.cpu.sizecheck`) both refuse a call where one passes 2^62."""
    found, seen, todo = {}, set(), list(module.roots())
    while todo:
        for v in topo_order(todo):
            if id(v) in seen:
                continue
            seen.add(id(v))
            if v.op == "indicator":
                for aff in v.attrs[0].exprs:
                    sizes = [c for _, c in aff.terms] + [aff.const] + [
                        module.size(e) for e in aff.edges() if e in module.edges]
                    if all(e in module.edges for e in aff.edges()) and (
                            any(not isinstance(x, int) for x in sizes) or index_bound(aff, module, {}) > MAX_SIZE):
                        found[aff] = None
        todo = [r for v in list(topo_order(todo)) if v.op == "loop" for r in v.attrs[0].results
                if id(r) not in seen]
    return list(found)
