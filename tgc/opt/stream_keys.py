"""stream_keys: a step's softmax over a long key edge, computed over blocks of the keys
with a running max and running sums (online softmax), and its backward over the same
blocks with the weights recomputed from the row statistics.

What it rewrites. A stream's step (tgc.opt.stream) holds `[.., B, s]` matrices: the
scores of its block of B rows against every key `s`, their weights, their cotangents.
Where the scores have more than `options.stream_step_elements` elements, this pass
computes the step's values over `s` (the cluster: every value with `s` made by adds,
maps, products and reductions over other edges) in loops over blocks of `Bs =
options.stream_key_block` keys (`s = sc + Bs*sb`), so that the step holds
`[.., B, Bs]` blocks. It is not matched to attention: it applies to any module with a
max over `s`, `m = max[s](X)`, whose cluster is read only by reductions over `s` (the
statistics: maxima, `logsumexp[s]`, sums over `s`) and by values that keep `s` (a
gradient's carry over the keys, an output).

The first loop (the online softmax) computes the statistics it can follow through a
running max. Each cluster value is tracked as a block value and the statistics it owes:

- free: computed from its block (the scores, a mask, a bias);
- additive `b + sum_j c_j T_j` (an exponent): `b` reads the running max `m'` in place of
  `m`, and the terms of the other statistics (`logsumexp`, known only after the loop)
  are kept aside;
- scaled `b * exp(sum_j c_j T_j)` (the weights, their products with free values): `b`
  reads `m'`, each `exp` reading `... - m` (so every block exponent is at most 0).

The loop carries `m'` (the max of the blocks so far) and, per statistic, a running sum
of its block sums, multiplied by `exp(c_m (m'_new - m'_old))` (c_m <= 0: the power of
`exp(-m)` the summand carries) before the block's sum is added: the earlier blocks'
sums brought to the new max (its only new carry kind: a sum whose update first scales
the carry, written with the IR's `map[exp]` of the max carries' difference). After
the loop, `m = m'`, `logsumexp[s](X - m + ...) = log(l) + ...`, and a sum is its carry
times `exp` of the owed terms (attention's `y = acc * exp(-lse)`). Attention's backward
row sum `D = rowsum(P * dP)` (`dP = dy . v`) is such a sum: the first loop computes each
block's `dP` for it, and the second computes it again for `dS = P * (dP - D)`. Why not
the reassociation `D = rowsum(dy * y)` (no `dP` product in the first loop): in a row
whose weights round to one-hot (logits spread by thousands) the exact `dS` is tiny and
PyTorch's is 0 (`D = 1 * dP_hot`, the same number); `dy . y` and `dy . v_hot` are the
same sum over `hd` taken by different kernels (an FMA chain, a sum of rounded products,
a GEMM's order), an ulp of `dP` apart, and that ulp becomes `dS`: dq and dk were 1e5 to
1e6 times PyTorch f32's normwise error at logits of 1e4. The cost: a third product over
the block in the first loop (attention at t = 4096, one thread: docs/optimization.md).

The second loop (only when something is left) computes the other statistics (sums and
maxima over `s`, carries) and the cluster's values read outside (stacked over the
blocks, joined back over `s`: the blocks of `dk`, `dv` added to the step's carries),
the first loop's statistics read as invariants: its weights are `exp(X - m - lse)`
recomputed per block, as the unstreamed step computes them. A value without the keys
made from the first loop's statistics and read by the cluster (the logsumexp rule's
cotangent `-D` in its guarded product `mul0(-D, weights)`: normalize does not merge
that product's -1 into a sum as it does a contraction's) is made between the loops
and read by the second as one more invariant. With
`options.stream_key_scores` the first loop also stacks its blocks of `X` (the max's
operand: the masked, scaled scores), and the second reads each block from there
instead of computing it again: no second scores product or mask per block, for
`[.., B, s]` more per step (the scores the unstreamed step holds). Why not the weights
too: a block's weights need the final `m` and `lse`, known only after the first loop;
keeping `exp(X - m')` with each block's running max would save the exp but hold a
second such matrix and rescale it per row, and the scores are what the first loop has. A statistic of the
second loop read by another of its values would need a third loop: the step is left
whole. (The derived backward of an unmasked softmax stabilizes it again, `max[s](X -
m)`: that max is 0, `_shifted_maxima`, and the softmax over `X - m - 0` is one the
first loop follows.) A key operand (`[s, hd]` keys, values, the step's carries over `s`) is
read as stacked blocks (`_split`, an exact reindex; the lowering reads a stored
operand's blocks in place where the edges before `s` have size 1: tgc.lower.steps,
`Bind.split`), the others as loop invariants; a
gather of a small table at an index affine in `s` (a stream's mask `G[r = s - t + c]`)
reads a stacked window of the table per block; a reindex of the keys to another edge
(a masked run's carry padded back to every key) reads the joined values.

Products over the keys' own edge. A layer projects its keys and values over the input
edge `t` and renames them to `s`; the algebra may put that rename (or a stream run's
reindex to its hull of keys) after the product, so that the step holds `q . k` (and the
backward's `dO . v`) as a whole `[.., B, t]` matrix. Before the loops are built such a
product is made over the keys, the reindex moved onto its operand with `t`
(`_products_at_keys`), so that it is a value of the cluster the loops compute block by
block. And a sum of the cluster's values and a carry of the step over the keys that is
not stored key block by key block (a layer's `[c, s]` dk carry, in its order an edge of
size > 1 before `s`) is computed after the loops on the joined blocks: inside them it
would copy the carry's blocks in and the sums' blocks out.

Masked keys. A stream over a mask already runs each step over only the keys the mask
admits for the step's rows (tgc.opt.stream_skip: the keys resized to the run's hull);
the key loops cover that hull (the masked keys inside it are computed, as the
unstreamed step computes them). Fully masked rows: with a finite fill (-1e9) every
key of the row has the fill's score, so `m'` is the fill from the first block on,
every weight is exp(0) = 1 and the result is the mean, as unstreamed; with a -inf
fill the running max stays -inf and is read as 0 (`exp(-inf - 0) = 0`, the carries
stay 0), the row's logsumexp is log(0) = -inf and its sums NaN, as unstreamed
(exp(-inf - -inf)).

Exact? No: it changes the rounding, as every online softmax does. The first loop's
block weights are `exp(X - m')` with the running max in place of the final one, and
the earlier blocks' sums are scaled by `exp(m'_old - m'_new)` (one more rounding per
block and row; each factor <= 1, so nothing overflows); `y = acc * exp(-log l)`
replaces the sum of `v * exp(X - m - lse)`; the sums over `s` are taken blockwise,
then across blocks (reassociations, as tgc.opt.stream's); a product over the keys' own edge made over the keys computes each
element from the same terms (a GEMM may order the sum over `hd` otherwise), and a
carry added after the loops is the same sum. The maxima are exact; the second loop's weights are the
unstreamed step's (kept or recomputed, X is the same value: the same product and
mask). With logits up to 1e4, f32, y and every gradient stay within 10x
PyTorch f32's error (tests/opt/test_stream_keys.py). Under `--fp-strict` the stream
pass, and this one with it, is not in the pipeline.

Terminates: one pass over each loop body (innermost first), each tried once per max
over a key edge; a rewrite makes at most two loops (the first built a second time
with its stacked scores, the first build then unused), which are not looked into again.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from tgc.ir import values as V
from tgc.ir.affine import Affine, Relation
from tgc.ir.module import Module
from tgc.ir.values import Value, rebuild_same
from tgc.options import Options


class _Reject(Exception):
    """The module's values over the key edge are not of the form this pass streams."""


@dataclass
class _Rep:
    kind: str                                  # "free", "add" (an exponent), "scaled"
    inner: Value | None                        # the block value (None: only statistics' terms)
    coefs: dict[int, float] = field(default_factory=dict)   # id(statistic) -> c_j


def _numel(v: Value, sizes: dict) -> int:
    n = 1
    for e in v.edges:
        n *= sizes.get(e, 1) if isinstance(sizes.get(e), int) else 1
    return n


def _stat_kind(v: Value, s: str) -> str | None:
    """How `v` reduces over the key edge `s`: 'max', 'logsumexp', 'sum', or None."""
    if v.op == "reduce" and s in v.attrs[1]:
        return v.attrs[0] if v.attrs[1] == (s,) and v.attrs[0] in ("max", "logsumexp") else "other"
    if v.op == "contract" and s not in v.edges and any(s in o.edges for o in v.operands):
        # a sum over the keys; with an indicator naming them, a reindex of the keys to
        # another edge (a masked stream's run padding its carry back to every key): a reader
        return None if any(o.op == "indicator" and s in o.edges for o in v.operands) else "sum"
    return None


def _fresh(m: Module, base: str, n: int) -> str:
    stem, k = base.split(".")[0], 1
    while f"{stem}.{k}" in m.edges or f"{stem}.{k}" in m.dims:
        k += 1
    name = f"{stem}.{k}"
    m.dims[name] = n
    m.edges[name] = name
    return name


def _split(x: Value, s: str, sc: str, sb: str, b: int) -> Value:
    """x over `s` as [.., sc, sb]: x[s = sc + b*sb] (an exact reindex)."""
    rel = Relation((Affine.make({s: 1}), Affine.make({sc: 1, sb: b})), ("=",))
    return V.reindexed(x, [V.indicator(rel, x.dtype)], [e for e in x.edges if e != s] + [sc, sb])


class _Keys:
    def __init__(self, m: Module, s: str, b: int, mx: Value, order: list[Value], keep: bool = False,
                 orders: tuple[tuple[str, ...], ...] = ()):
        self.m, self.s, self.b, self.mx = m, s, b, mx
        self.orders = orders                          # the program's outputs' orders (tgc.lower.steps' carry order)
        self.order = order
        self.keep = keep                              # the first loop's block scores kept for the second
        self.kept: dict[int, Value] = {}              # id(cluster value) -> its blocks stacked by the first loop
        self.sizes = {e: m.size(e) for e in m.edges}
        self.owed: dict[int, dict[int, float]] = {}   # id(statistic) -> the terms it owes
        self.derived: dict[int, Value] = {}           # id -> a value without the keys made from the first loop's statistics (build)

    def blockwise(self, o: Value) -> bool:
        """Whether a value over the keys `o` may be stored with every edge before the keys
        of size 1 (its key blocks contiguous) in the order a step's carry has
        (tgc.lower.steps `carry_order`: that of the program's outputs over its edges, or
        over them and the edges of loops around the step, else the declaration order)."""
        have = set(o.edges)
        orders = {tuple(e for e in t if e in have) for t in self.orders if have <= set(t)} \
            or {self.m.order_edges(o.edges)}
        return any(all(self.sizes.get(e) == 1 for e in t[:t.index(self.s)]) for t in orders)

    def edges(self, v: Value) -> list[str]:
        return [self.sc if e == self.s else e for e in v.edges]

    def build(self) -> Module:
        s, b = self.s, self.b
        order = self.order
        cluster = [v for v in order if s in v.edges and v.op in ("add", "map", "contract", "reduce", "stop")]
        ids = {id(v) for v in cluster}
        # a sum of the cluster's values and a value over the keys from outside it that is
        # not stored key block by key block (the step's carry of a layer's dk, `[c, s]`:
        # an edge of size > 1 before the keys) is added after the loops, to the joined
        # blocks: the loop would read that value's blocks and write the sums' blocks as
        # copies (a key block of a carry whose earlier edges have size 1 is read and
        # written in place, tgc.lower.steps; `blockwise`)
        readers: dict[int, list[Value]] = {}
        for v in order:
            for o in v.operands:
                readers.setdefault(id(o), []).append(v)
        late = {id(v) for v in cluster if v.op == "add" and not any(id(r) in ids for r in readers.get(id(v), ()))
                and any(id(o) not in ids and s in o.edges and o.op not in ("const", "indicator")
                        and not self.blockwise(o) for o in v.operands)}
        if late:
            cluster = [v for v in cluster if id(v) not in late]
            ids -= late
        stats = [v for v in order if _stat_kind(v, s) is not None]
        sid = {id(v) for v in stats}
        if any(_stat_kind(v, s) == "other" for v in stats):
            raise _Reject
        # the cluster's values read by other values (a gradient's carry over the keys) or
        # by the outputs: stacked results of the second loop
        stacked = {id(o): o for v in order if id(v) not in ids and id(v) not in sid
                   for o in v.operands if id(o) in ids}
        stacked.update({id(o.value): o.value for o in self.m.outputs if id(o.value) in ids})
        # the loops read only what they compute: the cluster, key operands, invariants not
        # computed from statistics (a statistic read by the cluster is owed or an invariant)
        after: set[int] = set(sid)
        for v in order:
            if id(v) not in sid and any(id(o) in after for o in v.operands):
                after.add(id(v))
        # ... or a value without the keys computed from the first loop's statistics (a
        # logsumexp's cotangent -D, read by its guarded product mul0(-D, weights)): made
        # after the first loop, read by the second as an invariant
        derived: dict[int, Value] = {}
        for v in cluster + stats:
            for o in v.operands:
                if id(o) in after and id(o) not in sid and id(o) not in ids:
                    if s in o.edges:
                        raise _Reject
                    derived[id(o)] = o
        for v in reversed(order):   # and the values they are made from
            if id(v) in derived:
                for o in v.operands:
                    if id(o) in after and id(o) not in sid:
                        if id(o) in ids or s in o.edges:
                            raise _Reject
                        derived[id(o)] = o
        self.derived = derived
        self.ids, self.sid = ids, sid
        self.sc = _fresh(self.m, s, b)
        self.sb = _fresh(self.m, s, self.sizes[s] // b)
        self.windows: dict[int, str] = {}
        # the first loop: the statistics the online form computes (a dry run finds them)
        online = self.online(stats, None)
        if id(self.mx) not in online:
            raise _Reject
        memo: dict[int, Value] = {}
        first = [v for v in stats if id(v) in online]
        self.online(first, memo)
        # the second loop: the other statistics and the stacked results, every statistic
        # of the first loop known
        rest = [v for v in stats if id(v) not in memo]
        for v in order:   # the derived invariants, from the first loop's statistics
            if id(v) in derived:
                if any(id(o) in after and id(o) not in memo for o in v.operands):
                    raise _Reject   # made from a statistic of the second loop
                memo[id(v)] = rebuild_same(v, tuple(memo.get(id(o), o) for o in v.operands))
        if rest or stacked:
            if self.keep:   # the scores the first loop computed, stacked over its blocks, read by the second
                self.kept = self.kept_scores(first, memo)
            self.second(rest, list(stacked.values()), memo)
        for v in order:
            if id(v) not in memo and id(v) not in ids:
                memo[id(v)] = rebuild_same(v, tuple(memo[id(o)] for o in v.operands))
        return self.m.replace_values(memo)

    def cone(self, roots: list[Value], through_stats: bool) -> list[Value]:
        """The cluster's values and statistics `roots` read (and the roots), in order;
        through a statistic's operands only when `through_stats`."""
        seen: set[int] = set()
        stack = list(roots)
        while stack:
            v = stack.pop()
            if id(v) in seen:
                continue
            seen.add(id(v))
            if id(v) in self.sid and not through_stats and not any(v is r for r in roots):
                continue
            stack += [o for o in v.operands if id(o) in self.ids or id(o) in self.sid]
        return [v for v in self.order if id(v) in seen]

    def frame(self, values: list[Value], carries: list[Value], known: dict[int, Value],
              kept: dict[int, Value] | None = None):
        """A loop's parameters and operands for computing `values` (cluster values and
        statistics, in order) with `carries` (statistics) as its carries; `known`: the
        statistics computed before the loop, read as invariants. Returns (params,
        operands, inner: id(outside value) -> its parameter, gathers, slices count)."""
        s, b, sc, sb = self.s, self.b, self.sc, self.sb
        params: list[Value] = []
        operands: list[Value] = []
        for v in carries:
            init = float("-inf") if _stat_kind(v, s) == "max" else 0.0
            operands.append(V.const(init, v.dtype, v.edges))
            params.append(V.loopvar(len(params), v.dtype, v.edges))
        inner: dict[int, Value] = {}
        slices: list[Value] = []
        gathers: dict[int, tuple[Value, Value]] = {}
        invariants: list[Value] = []
        computed = {id(v) for v in values}
        kept = kept or {}
        blocks: list[Value] = []   # values read from `kept` (stacked by an earlier loop)
        for v in values:
            if id(v) in self.sid and not any(v is c for c in carries):
                continue   # a statistic this loop does not compute
            if id(v) in kept:
                blocks.append(v)
                continue
            if v.op == "contract" and any(o.op == "indicator" and s in o.edges for o in v.operands):
                gathers[id(v)] = self.gather(v, operands, params)
                continue
            for o in v.operands:
                if id(o) in inner or o.op in ("const", "size") or (id(o) in computed and id(o) not in known):
                    continue
                if id(o) in self.sid:
                    if id(o) in known:
                        invariants.append(o)
                        inner[id(o)] = o
                    continue
                if id(o) in self.ids:
                    raise _Reject   # a cluster value the loop does not compute
                if o.op == "indicator":
                    if s in o.edges:
                        raise _Reject
                    continue
                (slices if s in o.edges else invariants).append(o)
                inner[id(o)] = o
        for o in slices:
            operands.append(_split(o, s, sc, sb, b))
            inner[id(o)] = V.loopvar(len(params), o.dtype, self.edges(o))
            params.append(inner[id(o)])
        for v in blocks:
            operands.append(kept[id(v)])
            inner[id(v)] = V.loopvar(len(params), v.dtype, self.edges(v))
            params.append(inner[id(v)])
        n_slices = len(params) - len(carries)
        for o in invariants:
            operands.append(known.get(id(o), o))
            inner[id(o)] = V.loopvar(len(params), o.dtype, o.edges)
            params.append(inner[id(o)])
        return params, operands, inner, gathers, n_slices

    def online(self, stats: list[Value], memo: dict[int, Value] | None) -> set[int]:
        """The loop over key blocks computing `stats` in the online form: with `memo`, their
        final values put in `memo`; without it (a dry run), the ids of the statistics the
        form computes."""
        s = self.s
        values = self.cone(stats, True)
        stats = [v for v in values if id(v) in self.sid]
        params, operands, inner, gathers, n_slices = self.frame(values, stats, {})
        carry_of = {id(v): k for k, v in enumerate(stats)}
        reps: dict[int, _Rep | None] = {}
        results: list[Value] = list(params[:len(stats)])   # a failed statistic's carry unchanged (dry run)
        mid = id(self.mx)
        self.m_old = params[carry_of[mid]]
        self.m_safe = None
        self.owed = {}
        done: set[int] = set()

        def rep(o: Value) -> _Rep:
            if id(o) in reps:
                if reps[id(o)] is None:
                    raise _Reject
                return reps[id(o)]
            if id(o) in self.derived:
                raise _Reject   # known only after this loop
            if id(o) in self.sid:
                if id(o) not in done:
                    raise _Reject
                if id(o) == mid:
                    return _Rep("add", self.m_safe, {mid: 1.0})
                return _Rep("add", None, {id(o): 1.0})
            if o.op in ("const", "size", "indicator"):
                return _Rep("free", o)
            return _Rep("free", inner[id(o)])

        for v in values:
            try:
                if id(v) in self.ids:
                    reps[id(v)] = self.member(v, rep, gathers)
                else:
                    results[carry_of[id(v)]] = self.update(v, rep, params[carry_of[id(v)]])
                    done.add(id(v))
            except _Reject:
                if memo is not None:
                    raise
                reps[id(v)] = None
        if memo is None:
            return done
        x = self.mx.operands[0]
        keep = self.keep and memo.get("keep") is not None and reps.get(id(x)) is not None \
            and reps[id(x)].kind == "free" and self.s in x.edges
        if keep:   # the block's scores (the max's operand) as a stacked result too
            results.append(reps[id(x)].inner)
        body = V.loop_body(params, results, len(stats), n_slices)
        if keep:
            memo["keep"] = V.loop(body, self.sb, operands, len(stats))
        for v in stats:   # the statistics after the loop, with the terms they owe
            kind, out = _stat_kind(v, s), V.loop(body, self.sb, operands, carry_of[id(v)])
            if kind != "max":
                if kind == "logsumexp":
                    out = V.map_("log", out)
                owed = [(c, memo[j]) for j, c in self.owed[id(v)].items() if j != mid and c != 0]
                if owed:
                    t = V.add([x for _, x in owed], [c for c, _ in owed])
                    out = V.add([out, t]) if kind == "logsumexp" else V.mul([out, V.map_("exp", t)])
            memo[id(v)] = out
        return done

    def kept_scores(self, first: list[Value], memo: dict) -> dict[int, Value]:
        """{id(X): X's blocks stacked over the key blocks} for the max's operand X (the
        block scores), computed by the first loop again with X as a stacked result (its
        statistics' loop is the same loop: one body, one run), so that the second loop
        reads X's block instead of computing it again (a second scores product and mask
        per block). Empty when X is not a block value of the first loop."""
        again: dict = {"keep": True}
        self.online(first, again)
        x = self.mx.operands[0]
        out = again.get("keep")
        if not isinstance(out, Value):
            return {}
        for v in first:   # the loop with the stacked result computes the same statistics
            memo[id(v)] = again[id(v)]
        return {id(x): out}

    def second(self, stats: list[Value], stacked: list[Value], memo: dict[int, Value]) -> None:
        """The loop over key blocks computing `stats` (sums and maxima over the keys, as
        carries) and the cluster's values `stacked` (stacked over the blocks, joined back
        over the keys), every statistic in `memo` (the first loop's) read as an invariant;
        their values put in `memo`."""
        s, sc, sb, b = self.s, self.sc, self.sb, self.b
        values = self.cone(stats + stacked, False)
        mine = {id(v) for v in stats}
        if any(id(o) in mine or (id(o) in self.sid and id(o) not in memo) for v in values for o in v.operands):
            raise _Reject   # a statistic of this loop read in it: that needs a third loop
        params, operands, inner, gathers, n_slices = self.frame(values, stats, memo, self.kept)
        vals: dict[int, Value] = {}

        def read(o: Value) -> Value:
            return vals[id(o)] if id(o) in vals else inner.get(id(o), o)

        results: list[Value] = []
        for v in values:
            if id(v) in self.kept:
                vals[id(v)] = inner[id(v)]
            elif id(v) in gathers:
                p, ind = gathers[id(v)]
                vals[id(v)] = V.contract([p, ind], self.edges(v), v.loc)
            elif id(v) in self.ids:
                ops = tuple(read(o) for o in v.operands)
                if v.op == "contract":
                    vals[id(v)] = V.contract(ops, self.edges(v), v.loc)
                elif v.op == "reduce":
                    vals[id(v)] = V.reduce(v.attrs[0], ops[0], v.attrs[1], v.loc)
                else:
                    vals[id(v)] = rebuild_same(v, ops)
        for k, v in enumerate(stats):
            kind, carry = _stat_kind(v, s), params[k]
            ops = [read(o) for o in v.operands]
            if kind == "sum":
                results.append(V.add([carry, V.contract(ops, v.edges, v.loc)]))
            elif kind == "max":
                results.append(V.map_("max", carry, V.reduce("max", ops[0], [sc], v.loc)))
            else:
                raise _Reject   # a logsumexp reading what the online form does not follow
        results += [vals[id(v)] for v in stacked]
        body = V.loop_body(params, results, len(stats), n_slices)
        for k, v in enumerate(stats):
            memo[id(v)] = V.loop(body, sb, operands, k)
        for j, v in enumerate(stacked):
            out = V.loop(body, sb, operands, len(stats) + j)
            rel = Relation((Affine.make({s: 1}), Affine.make({sc: 1, sb: b})), ("=",))
            memo[id(v)] = V.reindexed(out, [V.indicator(rel, out.dtype)], [e for e in v.edges])

    def gather(self, v: Value, operands: list, params: list) -> tuple[Value, Value]:
        """For `contract(G, [r = a*s + w])` (a table G without `s` read at an index affine in
        `s`): the stacked window of G a block reads, G[sb, r'] = G[r = r' + a*b*sb + lo], its
        parameter, and the block's indicator [r' = a*sc + w - lo]."""
        s, b, sc, sb = self.s, self.b, self.sc, self.sb
        inds = [o for o in v.operands if o.op == "indicator" and s in o.edges]
        rest = [o for o in v.operands if not (o.op == "indicator" and s in o.edges)]
        if len(inds) != 1 or len(rest) != 1 or s in rest[0].edges:
            raise _Reject
        rel: Relation = inds[0].attrs[0]
        g = rest[0]
        if len(rel.ops) != 1 or rel.ops[0] != "=":
            raise _Reject
        d = rel.exprs[0].plus(rel.exprs[1], -1)
        rs = [e for e, c in d.terms if e in g.edges and e not in v.edges and c in (1, -1)]
        if len(rs) != 1 or not isinstance(self.sizes.get(rs[0]), int):
            raise _Reject
        r = rs[0]
        cr = d.coef(r)
        expr = d.scaled(-1) if cr == 1 else d   # r = expr(s, others): d = cr*r + rest
        expr = Affine.make([(e, c) for e, c in expr.terms if e != r], expr.const)
        a = expr.coef(s)
        u = Affine.make([(sc if e == s else e, c) for e, c in expr.terms], expr.const)   # a*sc + w
        lo = hi = u.const
        for e, c in u.terms:
            n = self.sizes.get(e) if e != sc else b
            if not isinstance(n, int) or not isinstance(c, int):
                raise _Reject
            lo, hi = lo + min(0, c * (n - 1)), hi + max(0, c * (n - 1))
        if id(v) not in self.windows:
            self.windows[id(v)] = _fresh(self.m, r, hi - lo + 1)
        rw = self.windows[id(v)]
        at = Relation((Affine.make({r: 1}), Affine.make({rw: 1, sb: a * b}, lo)), ("=",))
        operands.append(V.reindexed(g, [V.indicator(at, g.dtype)], [rw if e == r else e for e in g.edges] + [sb]))
        p = V.loopvar(len(params), g.dtype, [rw if e == r else e for e in g.edges])
        params.append(p)
        idx = Relation((Affine.make({rw: 1}), u.plus(Affine.make({}, lo), -1)), ("=",))
        return p, V.indicator(idx, inds[0].dtype)

    def member(self, v: Value, rep, gathers) -> _Rep:
        """The block value of cluster member `v` and the statistics it owes."""
        s = self.s
        if id(v) in gathers:
            p, ind = gathers[id(v)]
            return _Rep("free", V.contract([p, ind], self.edges(v), v.loc))
        ops = [rep(o) for o in v.operands]
        if v.op == "stop":
            return ops[0]
        if all(r.kind == "free" for r in ops):
            xs = tuple(r.inner for r in ops)
            if v.op == "contract":
                return _Rep("free", V.contract(xs, self.edges(v), v.loc))
            if v.op == "reduce":
                return _Rep("free", V.reduce(v.attrs[0], xs[0], v.attrs[1], v.loc))
            if v.op == "map" and v.attrs[0] == "exp":
                return _Rep("scaled", V.map_("exp", xs[0], loc=v.loc))
            return _Rep("free", rebuild_same(v, xs))
        if v.op == "add":
            w = v.attrs[0] if v.attrs and v.attrs[0] is not None else [1.0] * len(ops)
            kinds = {r.kind for r in ops}
            if "scaled" in kinds:
                if kinds != {"scaled"} or len({tuple(sorted(r.coefs.items())) for r in ops}) != 1:
                    raise _Reject
                return _Rep("scaled", V.add([r.inner for r in ops], list(w), v.loc), dict(ops[0].coefs))
            coefs: dict[int, float] = {}
            parts, ws = [], []
            for r, c in zip(ops, w):
                for j, k in r.coefs.items():
                    coefs[j] = coefs.get(j, 0.0) + c * k
                if r.inner is not None:
                    parts.append(r.inner)
                    ws.append(c)
            if not parts or s not in v.edges:
                raise _Reject
            one = parts[0] if len(parts) == 1 and ws[0] == 1.0 else V.add(parts, ws, v.loc)
            return _Rep("add", one, coefs)
        if v.op == "map" and v.attrs[0] == "exp" and ops[0].kind == "add":
            if ops[0].coefs.get(id(self.mx), 0.0) != -1.0:
                raise _Reject   # exp(X - m ...) only: every block exponent <= 0
            return _Rep("scaled", V.map_("exp", ops[0].inner, loc=v.loc), dict(ops[0].coefs))
        if (v.op == "contract" or (v.op == "map" and v.attrs[0] == "mul0")) \
                and all(r.kind in ("free", "scaled") for r in ops):
            # a product; mul0(a, b) (0 where a is 0) too: a scaled factor's exp(...) is > 0
            inner = [r.inner for r in ops]
            coefs = {}
            for r in ops:
                for j, k in r.coefs.items():
                    coefs[j] = coefs.get(j, 0.0) + k
            if v.op == "map":
                return _Rep("scaled", V.map_("mul0", *inner, loc=v.loc), coefs)
            return _Rep("scaled", V.contract(inner, self.edges(v), v.loc), coefs)
        raise _Reject

    def update(self, v: Value, rep, carry: Value) -> Value:
        """The new value of statistic `v`'s carry in the step."""
        kind = _stat_kind(v, self.s)
        mid = id(self.mx)
        if kind == "max":
            r = rep(v.operands[0])
            if r.kind != "free":
                raise _Reject
            new = V.map_("max", carry, V.reduce("max", r.inner, [self.sc], v.loc))
            self.owed[id(v)] = {}
            if v is not self.mx:
                return new   # another max of the blocks' values: exact, no rescaling
            inf = V.const(float("-inf"), new.dtype)
            self.m_safe = V.map_("where", V.map_("eq", new, inf), V.const(0.0, new.dtype), new)
            self.m_new = new
            return new
        if self.m_safe is None:
            raise _Reject
        if kind == "logsumexp":
            r = rep(v.operands[0])
            if r.kind != "add" or r.coefs.get(mid, 0.0) != -1.0 or r.inner is None:
                raise _Reject
            part = V.contract([V.map_("exp", r.inner)], [e for e in self.edges(v.operands[0]) if e != self.sc])
            coefs = r.coefs
            cm = -1.0
        else:
            ops = [rep(o) for o in v.operands]
            if any(r.kind not in ("free", "scaled") for r in ops):
                raise _Reject
            coefs = {}
            for r in ops:
                for j, k in r.coefs.items():
                    coefs[j] = coefs.get(j, 0.0) + k
            cm = coefs.get(mid, 0.0)
            if cm > 0:
                raise _Reject
            part = V.contract([r.inner for r in ops], v.edges, v.loc)
        self.owed[id(v)] = coefs
        if cm == 0:
            return V.add([carry, part])
        if not set(self.mx.edges) <= set(v.edges):
            raise _Reject   # a sum over another edge of the max too (the heads of a projection): no one rescale
        # the earlier blocks' sum brought from the old running max to the new one
        scale = V.map_("exp", V.add([self.m_old, self.m_safe], [-cm, cm]))
        return V.add([V.mul([carry, scale]), part])


def stream_keys(module: Module, options: Options, orders: tuple[tuple[str, ...], ...] = ()) -> Module:
    """`module` with its values over a long key edge computed in a loop over blocks of it
    (online softmax), where they exceed `options.stream_step_elements`; else `module`.
    `orders`: the program's outputs' orders, where `module` is a loop's step."""
    b = options.stream_key_block
    budget = options.stream_step_elements
    if b <= 0:
        return module
    given, module = module, _shifted_maxima(module)
    sizes = {e: module.size(e) for e in module.edges}
    for s in sorted(_key_edges(module, options, sizes)):
        module = _products_at_keys(module, s, sizes)
    order = module.values()
    for mx in order:
        if mx.op != "reduce" or mx.attrs[0] != "max" or len(mx.attrs[1]) != 1:
            continue
        s = mx.attrs[1][0]
        n = sizes.get(s)
        x = mx.operands[0]
        if not isinstance(n, int) or n % b or n < 2 * b or _numel(x, sizes) <= budget:
            continue
        m = Module(dict(module.dims), dict(module.edges), dict(module.args), list(module.outputs),
                   list(module.updates), list(module.facts))
        try:
            return _Keys(m, s, b, mx, order, options.stream_key_scores, orders).build()
        except _Reject:
            continue
    return given


def _key_edges(module: Module, options: Options, sizes: dict) -> set[str]:
    """The key edges of the maxima `stream_keys` would try (an operand over the step
    budget, the edge two key blocks at least)."""
    b = options.stream_key_block
    out: set[str] = set()
    for mx in module.values():
        if mx.op == "reduce" and mx.attrs[0] == "max" and len(mx.attrs[1]) == 1:
            n = sizes.get(mx.attrs[1][0])
            if isinstance(n, int) and n % b == 0 and n >= 2 * b \
                    and _numel(mx.operands[0], sizes) > options.stream_step_elements:
                out.add(mx.attrs[1][0])
    return out


def _products_at_keys(module: Module, s: str, sizes: dict) -> Module:
    """`module` with each product read at the keys through a reindex, `P[r = a*s + w]`
    or a rename `r -> s`, where `P = c * contract(.., K, ..)` and only K has `r` (a layer's scores `q . k`
    over the keys' own edge `t`, renamed to the run's keys `s` after the product), made
    over the keys instead: `c * contract(.., K[r = a*s + w], ..)`. The product is then
    a value over `s` that the key loops compute block by block (its operand K's block a
    window of K), not a whole `[.., B, t]` matrix beside them. Exact: the reindex only
    selects elements (each product element is the same sum over the same terms; a
    kernel may order that sum differently), and the scale `c` is applied to each
    selected element as before. Only where P and its scales have no other reader and K
    is smaller than P."""
    order = module.values()
    readers: dict[int, int] = {}
    for v in order:
        for o in v.operands:
            readers[id(o)] = readers.get(id(o), 0) + 1
    for o in module.roots():   # an output or update is read outside
        readers[id(o)] = readers.get(id(o), 0) + 2

    def pushed(v: Value, memo: dict) -> Value | None:
        if v.op == "rename" and len(v.attrs[0]) == 1 and v.attrs[0][0][1] == s:
            ind, g, r = None, v.operands[0], v.attrs[0][0][0]   # P renamed: r -> s
        elif v.op == "contract" and len(v.operands) == 2 and [o.op for o in v.operands].count("indicator") == 1:
            ind = next(o for o in v.operands if o.op == "indicator")
            g = v.operands[1] if v.operands[0] is ind else v.operands[0]
            if s not in ind.edges or len(ind.edges) != 2:
                return None
            r = next(e for e in ind.edges if e != s)
        else:
            return None
        if s in g.edges or r not in g.edges or r in v.edges:
            return None
        scales: list[Value] = []
        x = g
        while x.op == "add" and len(x.operands) == 1 and readers.get(id(x), 0) == 1:
            scales.append(x)
            x = x.operands[0]
        if x.op != "contract" or readers.get(id(x), 0) != 1 or r not in x.edges:
            return None
        holders = [k for k, o in enumerate(x.operands) if r in o.edges]
        if len(holders) != 1 or any(s in o.edges for o in x.operands):
            return None
        k = x.operands[holders[0]]
        if k.op == "indicator" or _numel(k, sizes) >= _numel(x, sizes):
            return None
        kk = V.rename(memo[id(k)], {r: s}, v.loc) if ind is None else \
            V.contract([memo[id(k)], ind], [s if e == r else e for e in k.edges], v.loc)
        ops = [kk if j == holders[0] else memo[id(o)] for j, o in enumerate(x.operands)]
        out = V.contract(ops, v.edges, x.loc)
        for a in reversed(scales):
            out = V.add([out], a.attrs[0], a.loc)
        return out

    memo: dict[int, Value] = {}
    changed = False
    for v in order:
        new = pushed(v, memo)
        if new is not None:
            changed = True
            memo[id(v)] = new
        else:
            memo[id(v)] = rebuild_same(v, tuple(memo[id(o)] for o in v.operands))
    return module.replace_values(memo) if changed else module


def key_candidates(module: Module, options: Options) -> bool:
    """Whether `module` has a max over a key edge that `stream_keys` would try (its
    operand over the step budget, the edge two key blocks at least)."""
    b = options.stream_key_block
    if b <= 0:
        return False
    sizes = {e: module.size(e) for e in module.edges}
    for mx in module.values():
        if mx.op == "reduce" and mx.attrs[0] == "max" and len(mx.attrs[1]) == 1:
            n = sizes.get(mx.attrs[1][0])
            if isinstance(n, int) and n % b == 0 and n >= 2 * b \
                    and _numel(mx.operands[0], sizes) > options.stream_step_elements:
                return True
    return False


def _shifted_maxima(module: Module) -> Module:
    """`module` with each `max[s](c*Z - max[s](c*Z))` (a softmax stabilized again over
    its own shift, as a derived backward writes it) replaced by 0: every element is at
    most 0 and the row's max is 0 (exactly where c*Z is rounded before the subtraction;
    within its rounding where the two are fused), and a row whose max is infinite is NaN
    through the shifted values either way. With it the softmax reads no statistic of a
    shifted value, which a loop over key blocks could not compute."""
    order = module.values()
    zero: dict[int, Value] = {}
    for v in order:
        if v.op != "reduce" or v.attrs[0] != "max" or len(v.attrs[1]) != 1 or v.operands[0].op != "add":
            continue
        y = v.operands[0]
        if len(y.operands) != 2 or not y.attrs or y.attrs[0] is None:
            continue
        for (z, a), (m, b) in itertools.permutations(zip(y.operands, y.attrs[0])):
            if b != -1.0 or m.op != "reduce" or m.attrs[:2] != ("max", v.attrs[1]):
                continue
            x = m.operands[0]
            if (x is z and a == 1.0) or (x.op == "add" and len(x.operands) == 1 and x.operands[0] is z
                                         and tuple(x.attrs[0]) == (a,)):
                zero[id(v)] = V.const(0.0, v.dtype, v.edges)
                break
    if not zero:
        return module
    memo: dict[int, Value] = {}
    for v in order:
        memo[id(v)] = zero[id(v)] if id(v) in zero else rebuild_same(v, tuple(memo[id(o)] for o in v.operands))
    return module.replace_values(memo)


def stream_key_bodies(module: Module, options: Options) -> Module:
    """`module` with `stream_keys` applied to every loop body (innermost first), not to
    the top level."""
    from tgc.opt.rewrite import map_bodies

    if options.stream_key_block <= 0:
        return module
    orders = tuple(tuple(o.order) for o in module.outputs)

    def fn(body: Module) -> Module:
        return stream_keys(map_bodies(body, fn), options, orders)
    return map_bodies(module, fn)
