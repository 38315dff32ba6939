"""The engine of the rewriting passes: canonical rebuild, then a table of rules.

`rewrite(module, table, options)` rebuilds every live value bottom-up through the
canonical builders (`tgc.opt.canon`) and then tries the rules that `table` lists
for the value's op (for a `map`, for its fn; `"*"` for every value). The first rule
that returns a different value replaces it, and the replacement is rewritten in
turn (its new parts first). Dead values are never visited, so they disappear.

A rule is a function `(ctx, v) -> Value | None` with its algebra in a comment; it
may build with `ctx.c` (the canonical builders) and ask `ctx.facts` what a value
provably is. Terminates when each rule strictly decreases a well-founded measure
(each table states its measure); `MAX_STEPS` rewrites per value bound a rule that
would not, so a bad rule costs optimization, never a hang. Once no grad/jvp/vjp is
left, a call with its own derivative rules (`custom`) is first replaced by its value,
so the rules never reach the optimizer's later passes or the backends.

Loop bodies are rewritten too, each once (whatever its trip count), before the values
that use them: a body is rewritten as a module of its own whose outputs are its
results, with the outer module's knowledge of what is left to differentiate (a `stop`
or a custom rule inside a body stays while a derivative outside may read it). A body
whose results would change type is kept as it is (a carry keeps its type).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from tgc.ir import values as V
from tgc.ir.dtypes import LOW_FLOATS
from tgc.ir.module import Module
from tgc.ir.values import DERIVATIVE_OPS, Value, strip_custom
from tgc.options import Options
from tgc.opt.canon import Canon
from tgc.ir.assume import arg_bounds
from tgc.opt.facts import Facts
from tgc.opt.relations import edge_sizes, static_env

MAX_STEPS = 64
MERGE_MOST = 64   # factors of a product that simplify still merges into its user (single_use)


@dataclass
class Ctx:
    module: Module
    options: Options
    c: Canon
    facts: Facts = field(default_factory=Facts)
    derivatives_left: bool = False  # grad/jvp/vjp still in the module: `stop` must stay
    cache: dict = field(default_factory=dict)  # per-run facts a rule table computes once

    def sizes(self) -> dict[str, int]:
        """The static size of every edge that has one."""
        env = static_env(self.module)
        return edge_sizes(self.module, env)

    def env(self) -> dict[str, int]:
        return static_env(self.module)


Rule = Callable[[Ctx, Value], "Value | None"]
Table = Mapping[str, Sequence[Rule]]


def table_key(v: Value) -> str:
    return v.attrs[0] if v.op == "map" else v.op


def _unrenamed(v: Value) -> Value:
    while v.op == "rename":
        v = v.operands[0]
    return v


class _Rewriter:
    def __init__(self, ctx: Ctx, table: Table, users: Counter):
        self.ctx, self.table = ctx, table
        self.memo: dict[int, tuple[Value, Value]] = {}  # id(old) -> (old, new), keeps both alive
        self.busy: set[int] = set()
        self.old_users = users  # id(old value) -> its uses in the input module
        self.users: Counter = Counter()  # id(new value) -> the uses of the old values it replaces

    def single_use(self, v: Value) -> bool:
        """v replaces input values used once in all (or is new): merging it duplicates
        nothing. Uses are counted on the value under any renames (a rename is a view:
        a value shared through two renamings of it is shared). A product of MERGE_MOST
        factors or more is not opened: merging each link of a chain of products into the
        next (the gradient of n chained elementwise functions) built n products of up to
        n factors, quadratic work (a 500-link tanh chain's gradient: 31 s to compile)."""
        u = _unrenamed(v)
        return self.users[id(u)] <= 1 and not (u.op == "contract" and len(u.operands) >= MERGE_MOST)

    def value(self, v: Value) -> Value:
        hit = self.memo.get(id(v))
        if hit is not None:
            return hit[1]
        if id(v) in self.busy:  # a rule rebuilt a value it is rewriting: leave it
            return v
        self.busy.add(id(v))
        w = self.settle(v)
        self.busy.discard(id(v))
        self.memo[id(v)] = (v, w)
        self.memo.setdefault(id(w), (w, w))
        if v.op != "rename":   # a rename's uses are already its operand's (rewrite)
            self.users[id(_unrenamed(w))] += self.old_users[id(v)]
        return w

    def settle(self, w: Value) -> Value:
        """Rebuild canonically and apply rules until neither changes `w`."""
        for _ in range(MAX_STEPS):
            ops = tuple(self.value(o) for o in w.operands)
            new = self.ctx.c.rebuild(w, ops)
            if new is w:
                new = self.rule(w)
                if new is None:
                    return w
            hit = self.memo.get(id(new))
            if hit is not None:
                return hit[1]
            w = new
        return w

    def rule(self, v: Value) -> Value | None:
        for rule in list(self.table.get(table_key(v), ())) + list(self.table.get("*", ())):
            r = rule(self.ctx, v)
            if r is not None and r is not v:
                return r
        return None


def without_rules(module: Module, derivatives_outside: bool = False) -> Module:
    """The module with every custom derivative call replaced by its value, once no
    grad/jvp/vjp is left to read the rules (exact: a call's value is its body's)."""
    values = module.values()
    if (not any(v.op == "custom" for v in values) or derivatives_outside
            or any(v.op in DERIVATIVE_OPS for v in values)):
        return module
    return module.replace_values(strip_custom(module.roots()))


def _rewrite_bodies(module: Module, table: Table, options: Options, derivatives: bool) -> Module:
    """`module` (a copy, whose edge table takes the bodies' new edges) with every loop
    body rewritten once."""
    return map_bodies(module, lambda sub: _rewrite(sub, table, options, derivatives))


def map_bodies(module: Module, fn, only: V.LoopBody | None = None) -> Module:
    """`module` (a copy, whose edge table takes the bodies' new edges) with every loop
    body (or only the body `only`) mapped once by `fn`, a module -> module pass run on a
    module whose outputs are the body's results (a body whose results would change type
    is kept)."""
    values = module.values()
    if not any(v.op == "loop" for v in values):
        return module
    module = module.replace_values({})
    bodies: dict[V.LoopBody, V.LoopBody] = {}
    memo: dict[int, Value] = {}
    for v in values:
        ops = tuple(memo[id(o)] for o in v.operands)
        if v.op == "loop" and (only is None or v.attrs[0] is only):
            body = v.attrs[0]
            if body not in bodies:
                bodies[body] = _map_body(module, body, fn)
            memo[id(v)] = V.loop(bodies[body], v.attrs[1], ops, v.attrs[3], v.attrs[2], v.loc)
        else:
            memo[id(v)] = V.rebuild_same(v, ops)
    return module.replace_values(memo)


def _map_body(module: Module, body: V.LoopBody, fn) -> V.LoopBody:
    from tgc.ir.module import Output

    sub = Module(dict(module.dims), dict(module.edges), {},
                 [Output(f"r{k}", r, r.edges) for k, r in enumerate(body.results)])
    new = fn(sub)
    results = [o.value for o in new.outputs]
    if any(r.type != o.type for r, o in zip(results, body.results)):
        return body
    for d, n in new.dims.items():    # dims a pass declared for the body (stream's block edges)
        module.dims.setdefault(d, n)
    # the body's new edges where the pass declared them, each right after the edge before
    # it in the body's table (stream's block edge after its stem: declaration order is the
    # layout's tie-break); the program's own edges keep their order
    edges = list(module.edges.items())
    names = [e for e, _ in edges]
    prev = None
    for e, d in new.edges.items():
        if e not in module.edges:
            at = names.index(prev) + 1 if prev is not None else 0
            names.insert(at, e)
            edges.insert(at, (e, d))
        prev = e
    module.edges.clear()
    module.edges.update(edges)
    return V.loop_body(body.params, results, body.carries, body.slices)


# Python frames a rewrite may nest: `_Rewriter.value` recurses into the operands of the
# values a rule builds (three frames a level), and a rule may build a nest as deep as the
# program (`factor` takes a chain's gradient sum to a nest two values a step deep: 192
# steps passed Python's default 1000 frames). The front end allows as many.
MAX_FRAMES = 20000


def rewrite(module: Module, table: Table, options: Options) -> Module:
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, MAX_FRAMES))
    try:
        return _rewrite(module, table, options, False)
    finally:
        sys.setrecursionlimit(limit)


def _rewrite(module: Module, table: Table, options: Options, derivatives_outside: bool) -> Module:
    derivatives = derivatives_outside or any(v.op in DERIVATIVE_OPS for v in module.values())
    module = _rewrite_bodies(module.replace_values({}), table, options, derivatives)
    module = without_rules(module, derivatives_outside)
    out = module.replace_values({})  # a copy: canonical renaming registers fresh edges in it
    values = module.values()
    users = Counter(id(o) for v in values for o in v.operands)
    users.update(id(v) for v in module.roots())
    for v in reversed(values):  # a rename is a view: its users use what it renames
        if v.op == "rename":
            users[id(v.operands[0])] += users[id(v)] - 1
    ctx = Ctx(out, options, Canon(out, reassociate=not options.fp_strict), Facts(arg_bounds(out)))
    ctx.derivatives_left = derivatives_outside or any(v.op in DERIVATIVE_OPS for v in values)
    rw = _Rewriter(ctx, table, users)
    ctx.c.merge = None if ctx.derivatives_left or options.fp_strict else rw.single_use
    for v in values:
        rw.value(v)
    mapping = {k: new for k, (_, new) in rw.memo.items()}
    for r in module.roots():   # an output keeps its type (see `_keep_type`)
        mapping[id(r)] = _keep_type(r, mapping[id(r)])
    result = out.replace_values(mapping)
    return prune_edges(result)


def _keep_type(old: Value, new: Value) -> Value:
    """`new`, converted to `old`'s bf16/f16 type where a rule moved the rounding
    inward and left an f32 value (a broadcast of a bf16 value computes in f32), or to
    f32 where it left an f64 value in an f64 program: an output or update keeps the
    type the program gave it. Exact: `new` equals `old`, which holds values of that
    type, so the conversion changes no value."""
    if old.dtype == new.dtype or old.dtype not in LOW_FLOATS + ("f32",):
        return new
    return V.map_(f"to_{old.dtype}", new, loc=old.loc)


def prune_edges(m: Module) -> Module:
    """Drop the generated edges (`stem.k`) that no live value, argument or size uses."""
    used = {e for a in m.args.values() for e in a.order}
    values = m.values() + m.fact_values()
    bodies = {v.attrs[0] for v in values if v.op == "loop"}
    seen = set(bodies)
    while bodies:   # what a loop's body uses is used (and what the loops inside it use)
        inner = V.topo_order([r for b in bodies for r in b.results])
        values += inner
        bodies = {v.attrs[0] for v in inner if v.op == "loop"} - seen
        seen |= bodies
    for v in values:
        used.update(v.edges)
        if v.op == "size":
            used.add(v.attrs[0])
        for o in v.operands:
            used.update(o.edges)
    for e in [e for e in m.edges if "." in e and e not in used and e not in m.dims]:
        del m.edges[e]
    return m
