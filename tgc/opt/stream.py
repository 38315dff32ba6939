"""stream: a large cluster of values over a long edge becomes a loop over blocks of it.

What it rewrites. A program whose largest values span two long edges, such as the
`[.., t, s]` scores, weights and their cotangents of attention with its gradients
(after autodiff and the algebra passes, forward and backward are one DAG), keeps
whole `|t| * |s|` matrices. This pass picks such a value (the seed: at least
`options.stream_min_elements` elements, every size known) and one of its edges `E`
of fixed size N, split as `E = Ec + B*Eb` (B = `options.stream_block`, dividing N,
N >= 2B), and moves into one `loop` over `Eb` the region of values that can be
computed one block of `E` at a time:

- the region grows from the seed through every value that keeps `E` and reads it
  elementwise along `E` (add, map, rename, stop, a contraction or a reduction that
  keeps `E`): down to its users, and up to its operands that are themselves large;
  a value that reads, besides the region, something computed from the region
  outside it (a reduction of the region over `E`) stays out: it needs the whole loop
  first;
- an operand read from outside is a stacked slice when it has `E` (reindexed to
  `[Eb, Ec, ..]` once, an O(its size) copy; a large one is in the region, so slices
  are small), else a loop-invariant (the `[s, hd]` keys and values);
- a reduction over `E` of region values (a contraction summing `E`, a max or min
  over `E`) is a carry: each step adds its block's partial sum (or takes the max);
  the contraction over the other edges of the block is the step's own;
- a region value read outside the region is a stacked result, reindexed back to `E`
  (the `[t, hd]` outputs and per-row statistics);
- an indicator that names `E` (the causal mask `[s <= t]`) becomes, per link of its
  relation that names `E` (`c*E + w op 0`, w affine in the other edges), a small
  stacked indicator `G[Eb, r] = [c*B*Eb + r + min(w') op 0]` over a fresh edge r
  holding the range of `w' = c*Ec + w`, read in the step at `r = w' - min(w')` (an
  exact reindex): the step sees its block's mask without an `|E| * |s|` matrix.

The edge `E` is chosen among the seed's: one whose region leaves no large value
outside as a stacked result (the key edge of attention does: the weights need the
row max first, a reduction over it; the query edge does not: every reduction over
`s` lies inside one step, and dk, dv are sums over `t`, carries), the longest first.
The step then holds `[.., B, s]` blocks: the peak is O(B * |s|) per head instead of
O(|t| * |s|), and the probabilities are computed block by block, forward and backward
alike, from the inputs of the region.

Exact? Every value of a step is the op the program had, on the same elements; only
the sums over `E` (and the max over `E`, which is exact) are taken blockwise and then
added across blocks: a reassociation of those sums (docs/optimization.md's contract
allows it; under `--fp-strict` the pass is not in the pipeline). The reindexing by
indicators selects exact values.

Terminates: each round moves at least the seed (a value of the top-level DAG over the
threshold) into a loop body whose values are smaller than the threshold's share
(B/N of the seed), and the pass never looks inside bodies; the top level has finitely
many large values, and a round that finds no valid edge for a seed marks it and goes on.
"""
from __future__ import annotations

from dataclasses import dataclass

from tgc.ir import values as V
from tgc.ir.affine import Affine, Relation
from tgc.ir.module import Module
from tgc.ir.passes import Pass
from tgc.ir.values import Value, rebuild_same, topo_order
from tgc.options import Options

# ops a value may have to be computed one block of E at a time (when it keeps E)
_ELEMENTWISE = ("add", "map", "contract", "reduce", "rename", "stop")


def _numel(v: Value, sizes: dict) -> int:
    """How many elements `v` has (`sizes`: every edge's, symbolic ones estimated)."""
    n = 1
    for e in v.edges:
        n *= sizes[e]
    return n


def _along(v: Value, edge: str) -> bool:
    """Whether `v` keeps `edge` and reads its operands at the same index along it."""
    if edge not in v.edges or v.op not in _ELEMENTWISE:
        return False
    if v.op == "rename":
        return all(edge not in p for p in v.attrs[0])
    return True


@dataclass
class _Region:
    edge: str
    members: list[Value]          # operands first
    carries: list[Value]          # reductions over `edge` of members: sums and max/min
    stacked: list[Value]          # members read outside the region
    slices: list[Value]           # operands from outside with `edge`
    invariants: list[Value]       # operands from outside without `edge`
    masks: list[Value]            # indicators that name `edge`


def _carry_kind(v: Value, edge: str) -> str | None:
    """How a reduction of region values over `edge` combines across blocks."""
    if v.op == "contract" and edge not in v.edges:
        return "sum"
    if v.op == "reduce" and edge in v.attrs[1] and v.attrs[0] in ("max", "min"):
        return v.attrs[0]
    return None


def _region(order: list[Value], roots: list[Value], seed: Value, edge: str, large) -> _Region | None:
    """The values computed in a loop over blocks of `edge` around `seed`, or None when
    a large value (`large(v)`) would be left outside, as an operand or a stacked result."""
    member: set[int] = set()
    pos = {id(v): i for i, v in enumerate(order)}

    # up: the seed's large operands along `edge`, and theirs
    stack = [seed]
    while stack:
        v = stack.pop()
        if id(v) in member:
            continue
        member.add(id(v))
        for o in v.operands:
            if _along(o, edge) and large(o) and id(o) not in member:
                stack.append(o)
    # down, in order: a value along `edge` that reads the region and nothing computed from it
    tainted: set[int] = set()   # outside the region, computed from it
    for v in order[pos[id(seed)] + 1:]:
        if id(v) in member:
            continue
        reads = any(id(o) in member for o in v.operands)
        dirty = any(id(o) in tainted for o in v.operands)
        if reads and not dirty and _along(v, edge):
            ups = [o for o in v.operands if id(o) not in member and _along(o, edge)
                   and large(o)]
            if all(not any(id(x) in tainted for x in topo_order([u])) for u in ups):
                for u in ups:   # large siblings (dP = dy . v beside P) are computed in the step too
                    for x in topo_order([u]):
                        if _along(x, edge) and large(x):
                            member.add(id(x))
                member.add(id(v))
                continue
        if reads or dirty:
            tainted.add(id(v))
    members = [v for v in order if id(v) in member]
    # a member must not read a value computed from the region (added upward above)
    for v in members:
        for o in v.operands:
            if id(o) in tainted:
                return None
    carries, stacked, outside = [], [], {}
    for v in order:
        if id(v) in member:
            continue
        if any(id(o) in member for o in v.operands):
            kind = _carry_kind(v, edge)
            if kind is not None and not any(id(o) in tainted and id(o) not in member for o in v.operands):
                carries.append(v)
                for o in v.operands:
                    if id(o) not in member:
                        outside[id(o)] = o
            else:
                for o in v.operands:
                    if id(o) in member:
                        stacked.append(o)
    stacked += [v for v in roots if id(v) in member]
    seen: set[int] = set()
    stacked_u = []
    for o in stacked:
        if id(o) not in seen:
            seen.add(id(o))
            stacked_u.append(o)
    for o in stacked_u:
        if large(o):
            return None
    for v in members:
        for o in v.operands:
            if id(o) not in member:
                outside[id(o)] = o
    slices, invariants, masks = [], [], []
    for o in sorted(outside.values(), key=lambda x: pos[id(x)]):
        if o.op in ("const", "size"):
            continue
        if o.op == "indicator":
            if edge in o.edges:
                masks.append(o)
            continue
        (slices if edge in o.edges else invariants).append(o)
    if any(large(x) for x in slices + invariants):
        return None   # a large operand read whole, or copied as blocks: nothing gained
    return _Region(edge, members, carries, stacked_u, slices, invariants, masks)


def _split(x: Value, edge: str, ec: str, eb: str, block: int) -> Value:
    """x over `edge` as [eb, ec]: x[edge = ec + block*eb] (an exact reindex)."""
    rel = Relation((Affine.make({edge: 1}), Affine.make({ec: 1, eb: block})), ("=",))
    keep = [e for e in x.edges if e != edge] + [ec, eb]
    return V.contract([x, V.indicator(rel, x.dtype)], keep)


def _join(y: Value, edge: str, ec: str, eb: str, block: int) -> Value:
    """y over [eb, ec] back over `edge`."""
    rel = Relation((Affine.make({edge: 1}), Affine.make({ec: 1, eb: block})), ("=",))
    keep = [e for e in y.edges if e not in (ec, eb)] + [edge]
    return V.contract([y, V.indicator(rel, y.dtype)], keep)


class _Streamer:
    def __init__(self, module: Module, options: Options):
        self.m = module
        self.block = options.stream_block
        self.big = options.stream_min_elements
        self.sizes = {e: module.size(e) for e in module.edges}   # int, or a symbolic size
        # the sizes the thresholds read: a symbolic dim counts as `rep_size`, as in every cost model
        self.est = {e: n if isinstance(n, int) else options.rep_size for e, n in self.sizes.items()}

    def new_edge(self, base: str, n: int) -> str:
        """A fresh dim of size n and its edge, named after `base`."""
        stem, k = base.split(".")[0], 1
        while f"{stem}.{k}" in self.m.edges or f"{stem}.{k}" in self.m.dims:
            k += 1
        name = f"{stem}.{k}"
        self.m.dims[name] = n
        self.m.edges[name] = name
        self.sizes[name] = n
        self.est[name] = n
        return name

    def seeds(self, order: list[Value], skip: set[int]) -> list[Value]:
        out = [v for v in order if v.op in _ELEMENTWISE and id(v) not in skip
               and _numel(v, self.est) >= self.big]
        return sorted(out, key=lambda v: -_numel(v, self.est))

    def large(self, v: Value, seed: Value) -> bool:
        """Whether `v` is of the seed's scale: over the threshold, and more than 1/8 of the
        seed (a [t, s] bias beside the [t, s] scores is; a [t, hd] query beside them is not
        once s > 8 hd)."""
        n = _numel(v, self.est)
        return n >= self.big and 8 * n > _numel(seed, self.est)

    def edges_of(self, seed: Value) -> list[str]:
        b = self.block
        ok = [e for e in seed.edges if isinstance(self.sizes.get(e), int) and self.sizes[e] >= 2 * b
              and self.sizes[e] % b == 0]
        return sorted(ok, key=lambda e: (-self.sizes[e], e))

    def round(self, skip: set[int]) -> Module | None:
        order = self.m.values()
        roots = self.m.roots()
        for seed in self.seeds(order, skip):
            for edge in self.edges_of(seed):
                r = _region(order, roots, seed, edge, lambda v: self.large(v, seed))
                if r is not None and all(self.maskable(m, edge) for m in r.masks):
                    return self.build(order, r)
            skip.add(id(seed))
        return None

    def maskable(self, ind: Value, edge: str) -> bool:
        """Whether every link of indicator `ind` that names `edge` has integer
        coefficients and ranges (what `mask` needs)."""
        rel: Relation = ind.attrs[0]
        for i in range(len(rel.ops)):
            d = rel.exprs[i].plus(rel.exprs[i + 1], -1)
            if d.coef(edge) == 0:
                continue
            if not isinstance(d.const, int) or any(not isinstance(k, int) or not isinstance(self.sizes.get(e), int)
                                                   for e, k in d.terms):
                return False
        return True

    def mask(self, ind: Value, edge: str, ec: str, eb: str) -> tuple[list[Value], Value]:
        """The stacked pieces of indicator `ind` and its value in the step as a function of
        parameters (returned as a builder over the pieces' parameters)."""
        rel: Relation = ind.attrs[0]
        b = self.block
        pieces, plan = [], []
        for i, op in enumerate(rel.ops):
            d = rel.exprs[i].plus(rel.exprs[i + 1], -1)
            c = d.coef(edge)
            if c == 0:
                link = Relation((rel.exprs[i].renamed({}), rel.exprs[i + 1]), (op,))
                plan.append(("plain", V.indicator(link, ind.dtype)))
                continue
            w_terms = [(e, k) for e, k in d.terms if e != edge] + [(ec, c)]
            lo, hi = d.const, d.const
            for e, k in w_terms:
                n = self.sizes[e]
                lo, hi = lo + min(0, k * (n - 1)), hi + max(0, k * (n - 1))
            r = self.new_edge("r", hi - lo + 1)
            g = Relation((Affine.make({eb: c * b, r: 1}, lo), Affine.make({}, 0)), (op,))
            pieces.append(V.indicator(g, ind.dtype))
            at = Relation((Affine.make({r: 1}), Affine.make(w_terms, d.const - lo)), ("=",))
            plan.append(("piece", (r, V.indicator(at, ind.dtype), sorted(e for e, _ in w_terms))))
        return pieces, plan

    def build(self, order: list[Value], r: _Region) -> Module:
        edge, b = r.edge, self.block
        n = self.sizes[edge]
        ec = self.new_edge(edge, b)
        eb = self.new_edge(edge, n // b)
        ren = {edge: ec}

        def body_type(v: Value) -> tuple[str, list[str]]:
            return v.dtype, [ren.get(e, e) for e in v.edges]

        masks = []
        for ind in r.masks:
            pieces, plan = self.mask(ind, edge, ec, eb)
            masks.append((ind, pieces, plan))
        # operands and parameters: carries, slices (inputs, then mask pieces), invariants
        params: list[Value] = []
        operands: list[Value] = []
        kinds = [_carry_kind(v, edge) for v in r.carries]
        for v, kind in zip(r.carries, kinds):
            init = {"sum": 0.0, "max": float("-inf"), "min": float("inf")}[kind]
            operands.append(V.const(init, v.dtype, v.edges))
            params.append(V.loopvar(len(params), v.dtype, v.edges))
        inner: dict[int, Value] = {}
        for x in r.slices:
            operands.append(_split(x, edge, ec, eb, b))
            dt, es = body_type(x)
            p = V.loopvar(len(params), dt, es)
            params.append(p)
            inner[id(x)] = p
        piece_params = []
        for ind, pieces, plan in masks:
            ps = []
            for g in pieces:
                operands.append(g)
                p = V.loopvar(len(params), g.dtype, [e for e in g.edges if e != eb])
                params.append(p)
                ps.append(p)
            piece_params.append(ps)
        n_slices = len(params) - len(r.carries)
        for x in r.invariants:
            operands.append(x)
            p = V.loopvar(len(params), x.dtype, x.edges)
            params.append(p)
            inner[id(x)] = p
        for (ind, pieces, plan), ps in zip(masks, piece_params):
            parts, it = [], iter(ps)
            for kind, what in plan:
                if kind == "plain":
                    parts.append(what)
                else:
                    _, at, keep = what
                    parts.append(V.contract([next(it), at], keep))
            inner[id(ind)] = parts[0] if len(parts) == 1 else V.mul(parts)

        def read(o: Value) -> Value:   # an operand in the step: a member, a parameter, or nullary
            return inner.get(id(o), o)

        for v in r.members:
            ops = tuple(read(o) for o in v.operands)
            if v.op == "contract":
                inner[id(v)] = V.contract(ops, [ren.get(e, e) for e in v.edges], v.loc)
            else:
                inner[id(v)] = rebuild_same(v, ops)
        results = []
        for v, kind, p in zip(r.carries, kinds, params):
            ops = [read(o) for o in v.operands]
            if kind == "sum":
                part = V.contract(ops, v.edges, v.loc)
                results.append(V.add([p, part]))
            else:
                part = V.reduce(kind, ops[0], [ren.get(e, e) for e in v.attrs[1]], v.loc)
                results.append(V.map_(kind, p, part))
        for v in r.stacked:
            results.append(inner[id(v)])
        body = V.loop_body(params, results, len(r.carries), n_slices)
        memo: dict[int, Value] = {}
        for i, v in enumerate(r.carries):
            memo[id(v)] = V.loop(body, eb, operands, i)
        for j, v in enumerate(r.stacked):
            out = V.loop(body, eb, operands, len(r.carries) + j)
            memo[id(v)] = _join(out, edge, ec, eb, b)
        for v in order:
            if id(v) not in memo:
                memo[id(v)] = rebuild_same(v, tuple(memo[id(o)] for o in v.operands))
        return self.m.replace_values(memo)


def stream(module: Module, options: Options) -> Module:
    """`module` with every large cluster it can stream moved into a loop over blocks."""
    skip: set[int] = set()
    m = Module(dict(module.dims), dict(module.edges), dict(module.args), list(module.outputs),
               list(module.updates), list(module.facts))
    while True:
        st = _Streamer(m, options)
        out = st.round(skip)
        if out is None:
            return m
        m = out


@dataclass(frozen=True)
class Stream(Pass):
    """Large values over a long edge -> a loop over blocks of it (attention's scores and
    weights, forward and backward, block by block; reductions over the edge as carries)."""

    name = "stream"
    block: int | None = None          # the block size (default: options.stream_block)
    min_elements: int | None = None   # a large value's elements (default: options.stream_min_elements)

    def run(self, module: Module, options: Options) -> Module:
        if self.block is not None:
            options = options.with_(stream_block=self.block)
        if self.min_elements is not None:
            options = options.with_(stream_min_elements=self.min_elements)
        if options.fp_strict or options.stream_block <= 0:
            return module
        return stream(module, options)
