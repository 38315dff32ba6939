"""Large values a reverse loop reads from its forward loop, recomputed in its step (a
helper of tgc.opt.stream).

What it rewrites. Reverse mode of a `repeat`/`scan` (tgc.autodiff.loops) builds a
forward loop that stacks, per step, the step's values its backward step reads, and a
reverse loop that reads them as slices. For causal attention in the step these are the
`[.., t, s]` scores and weights: kept whole, per step and stacked over the steps, and
neither loop's step can stream them (`stream` leaves a region alone when a large value
is a stacked result or a large operand is read whole). At top level, forward and
backward are one DAG and `stream` recomputes the weights block by block in the
backward; this gives a loop the same: for a reverse loop `L` whose slice `K` is a
stacked result `r` of a forward loop `F` (same edge and length) with at least
`stream_min_elements_masked` elements per step (the smallest seed `stream` takes), L's
step computes `r` again, from what it reads already (F's other stacked results that L
reads as slices: the queries, keys and values) and else from F's own operands (added
to L as slices or invariants, as F read them); an incoming carry of F that L does not
read stacked makes `r` not recomputable. The rewrite is kept only when `stream` then
streams L's step: fewer large values are left at the step's top level than when L
reads `r` (a seed under the thresholds, or one `stream` cannot block, stays kept).
F's stacked results no loop reads any more are then dropped from its step
(`drop_unread_results`), so F keeps no `[t, s]` matrix per step either, and `stream`
blocks its step's attention as at top level.

Exact: the recomputed `r` is the same operations of F's step on the same values (F's
step at that index reads the same slices, invariants and incoming carry as L's step
then has), so L's step reads the value it read before; dropping a result nobody reads
changes no value. What `stream` then does is its own contract (a reassociation of sums
over the streamed edge).

Cost: deciding runs `stream` on the reverse step twice (with and without the values
recomputed), once per group of large slices.

Terminates: one pass over the module's loops, each rewritten at most once (the large
slices from one forward loop together); one more over the bodies to drop unread results.
"""
from __future__ import annotations

from tgc.ir import values as V
from tgc.ir.module import Module, Output
from tgc.ir.values import LoopBody, Value, rebuild_same, topo_order
from tgc.options import Options


def _numel(v: Value, est: dict) -> int:
    n = 1
    for e in v.edges:
        n *= est.get(e, 1)
    return n


def _cut_order(roots: list[Value], cut: set[int]) -> list[Value]:
    """The values `roots` are computed from, operands first, not looking below those of `cut`."""
    order: list[Value] = []
    seen: set[int] = set()
    stack = [(r, False) for r in reversed(roots)]
    while stack:
        v, done = stack.pop()
        if done:
            order.append(v)
            continue
        if id(v) in seen:
            continue
        seen.add(id(v))
        stack.append((v, True))
        if id(v) not in cut:
            stack.extend((o, False) for o in reversed(v.operands) if id(o) not in seen)
    return order


def _large_at_top(body: LoopBody, module: Module, options: Options, est: dict, least: int, stream) -> int:
    """How many values of at least `least` elements `body`, as `stream` leaves it, keeps at
    its top level (outside the loops over blocks it makes)."""
    sub = Module(dict(module.dims), dict(module.edges), {},
                 [Output(f"r{k}", r, r.edges) for k, r in enumerate(body.results)])
    out = stream(sub, options)
    sizes = dict(est)
    for e in out.edges:
        if e not in sizes:
            n = out.size(e)
            sizes[e] = n if isinstance(n, int) else 1
    return sum(1 for v in out.values() if v.op not in ("loopvar", "const", "size", "indicator", "loop")
               and _numel(v, sizes) >= least)


def _family(o: Value) -> tuple:
    """What two outputs of forward loops share when they are outputs of one loop: its edge,
    direction, operands and step parameters (one graph of values)."""
    body, edge, reverse, _ = o.attrs
    return (edge, reverse) + tuple(map(id, o.operands)) + tuple(map(id, body.params))


def _recomputed(L: Value, ks: list[int]) -> tuple[LoopBody, list[Value]] | None:
    """L's body and operands with its slice parameters `ks` (stacked results of one
    forward loop F) computed in the step from F's other stacked results L reads, and else
    from F's operands (the slices `ks` no longer read), or None."""
    body, edge, reverse, out = L.attrs
    ops = list(L.operands)
    nc, nx = body.carries, body.slices
    F = ops[ks[0]]
    fbody, fops = F.attrs[0], F.operands
    fnc, fnx = fbody.carries, fbody.slices
    family = _family(F)
    targets = [ops[k].attrs[0].results[ops[k].attrs[3]] for k in ks]
    # what L's step reads of F's step already: F's other stacked results among L's slices
    avail: dict[int, int] = {}
    for i in range(nc, nc + nx):
        o = ops[i]
        if i not in ks and o.op == "loop" and o.attrs[3] >= o.attrs[0].carries and _family(o) == family:
            avail.setdefault(id(o.attrs[0].results[o.attrs[3]]), i)
    for t in targets:
        avail.pop(id(t), None)
    new_slices: list[tuple[Value, Value]] = []   # (operand, F's parameter for it)
    new_invs: list[tuple[Value, Value]] = []
    need: list[tuple[int, str, int]] = []   # (id in F's step, "old"/"slice"/"inv", index)
    graph = _cut_order(targets, set(avail))
    for w in graph:
        if id(w) in avail:
            need.append((id(w), "old", avail[id(w)]))
        elif w.op == "loopvar":
            p = w.attrs[0]
            if p < fnc:
                return None   # an incoming carry L does not read stacked
            o = fops[p]
            role = "slice" if p < fnc + fnx else "inv"
            lo, hi = (nc, nc + nx) if role == "slice" else (nc + nx, len(ops))
            at = next((i for i in range(lo, hi) if ops[i] is o and i not in ks), None)
            if at is not None:
                need.append((id(w), "old", at))
            else:
                pool = new_slices if role == "slice" else new_invs
                if not any(x is o for x, _ in pool):
                    pool.append((o, w))
                need.append((id(w), role, next(j for j, (x, _) in enumerate(pool) if x is o)))
    # the new parameters: carries, old slices (less `ks`), new slices, old invariants, new invariants
    kinds = ([("old", i) for i in range(nc + nx) if i not in ks] + [("slice", j) for j in range(len(new_slices))]
             + [("old", i) for i in range(nc + nx, len(ops))] + [("inv", j) for j in range(len(new_invs))])
    where = {kind: n for n, kind in enumerate(kinds)}
    operands, params = [], []
    for n, (kind, j) in enumerate(kinds):
        o, like = (ops[j], body.params[j]) if kind == "old" else (new_slices if kind == "slice" else new_invs)[j]
        operands.append(o)
        params.append(V.loopvar(n, like.dtype, like.edges))
    memo: dict[int, Value] = {wid: params[where[(kind, j)]] for wid, kind, j in need}
    for w in graph:
        if id(w) not in memo:
            if w.op == "loopvar":
                return None
            memo[id(w)] = rebuild_same(w, tuple(memo[id(o)] for o in w.operands))
    sub = {id(body.params[i]): params[where[("old", i)]] for i in range(len(ops)) if i not in ks}
    for k, t in zip(ks, targets):
        if memo[id(t)].type != body.params[k].type:
            return None
        sub[id(body.params[k])] = memo[id(t)]
    lmemo: dict[int, Value] = {}
    for w in topo_order(list(body.results)):
        lmemo[id(w)] = sub[id(w)] if id(w) in sub else rebuild_same(w, tuple(lmemo[id(o)] for o in w.operands))
    new = V.loop_body(params, [lmemo[id(r)] for r in body.results], nc, nx - len(ks) + len(new_slices))
    return new, operands


def recompute_residuals(module: Module, options: Options, stream) -> Module:
    """`module` with each large stacked result of a forward loop that a reverse loop reads
    computed in the reverse loop's step instead, where `stream` (`tgc.opt.stream.stream`,
    given by its caller: this module is its helper) then streams that step."""
    est = {}
    for e in module.edges:
        n = module.size(e)
        est[e] = n if isinstance(n, int) else 1
    least = options.stream_min_elements
    if options.stream_mask_groups > 0:
        least = min(least, options.stream_min_elements_masked)
    values = module.values()
    if not any(v.op == "loop" for v in values):
        return module
    done: dict[tuple, tuple[LoopBody, list[Value]] | None] = {}
    memo: dict[int, Value] = {}
    changed = False
    for v in values:
        ops = tuple(memo[id(o)] for o in v.operands)
        if v.op != "loop":
            memo[id(v)] = rebuild_same(v, ops)
            continue
        body, edge, reverse, out = v.attrs
        key = (body, edge, reverse) + tuple(map(id, v.operands))
        if key not in done:
            cur = (body, list(v.operands))
            groups: dict[tuple, list[int]] = {}   # the large slices that are stacked results of one forward loop
            for k in range(body.carries, body.carries + body.slices):
                o = v.operands[k]
                if o.op == "loop" and o.attrs[1] == edge and o.attrs[2] != reverse \
                        and o.attrs[3] >= o.attrs[0].carries \
                        and _numel(o.attrs[0].results[o.attrs[3]], est) >= least:
                    groups.setdefault(_family(o), []).append(k)
            if groups:
                for ks in groups.values():
                    got = _recomputed(V.loop(body, edge, list(v.operands), out, reverse), ks)
                    if got is not None and _large_at_top(got[0], module, options, est, least, stream) \
                            < _large_at_top(body, module, options, est, least, stream):
                        cur = got
                        break   # (one forward loop: a reverse loop's large slices come from one)
            done[key] = cur if cur[0] is not body else None
        got = done[key]
        if got is None:
            memo[id(v)] = rebuild_same(v, ops)
        else:
            changed = True
            nb, nops = got
            memo[id(v)] = V.loop(nb, edge, [memo[id(o)] for o in nops], out, reverse, loc=v.loc)
    if not changed:
        return module
    return drop_unread_results(module.replace_values(memo))


def drop_unread_results(module: Module) -> Module:
    """`module` with each loop body's stacked results that no loop output reads removed."""
    values = module.values()
    read: dict[LoopBody, set[int]] = {}
    for v in values:
        if v.op == "loop":
            read.setdefault(v.attrs[0], set()).add(v.attrs[3])
    bodies: dict[LoopBody, tuple[LoopBody, dict[int, int]]] = {}
    for body, outs in read.items():
        keep = list(range(body.carries)) + sorted(j for j in outs if j >= body.carries)
        if len(keep) < len(body.results):
            bodies[body] = (V.loop_body(body.params, [body.results[j] for j in keep], body.carries, body.slices),
                            {j: i for i, j in enumerate(keep)})
    if not bodies:
        return module
    memo: dict[int, Value] = {}
    for v in values:
        ops = tuple(memo[id(o)] for o in v.operands)
        if v.op == "loop" and v.attrs[0] in bodies:
            nb, at = bodies[v.attrs[0]]
            memo[id(v)] = V.loop(nb, v.attrs[1], ops, at[v.attrs[3]], v.attrs[2], v.loc)
        else:
            memo[id(v)] = rebuild_same(v, ops)
    return module.replace_values(memo)
