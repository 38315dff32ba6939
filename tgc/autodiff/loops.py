"""Derivatives of loops (`tgc.ir.values.loop`): the derivative of a loop is a loop.

A loop over edge `e` with body `B` (carries C, per-step slices X, invariants P;
results: new carries C' and per-step results Y) runs, for each index in order,
`C <- C'(C, X[e = i], P)` and records `Y(C, X[e = i], P)` at `e = i`.

Reverse mode (`loops_vjp`), for the cotangents of outputs of one loop (one group of
`loop_groups`: loops of the same operands whose bodies are one the prefix of the
longest, B, as a loop and the forward loop that keeps its steps' values are, both
differentiated by an HVP), ONE backward loop seeded with all of them (a custom vjp
clause in B sees their summed cotangent, as in the unrolled program; it need not be
linear):
- the backward step (`_plan`): the reverse sweep (`tgc.autodiff.reverse`) of B for
  the cotangents of the new carries and of the step's stacked results, in one sweep;
  it gives the step's cotangents of C (the next carries), of P (added to running
  sums) and of X (stacked). The values of the step it reads (less what a
  `checkpoint` in B recomputes, `tgc.autodiff.remat.regions`; less parameters and
  leaves) are kept: the backward step reads them as parameters, as it reads the
  incoming carries it still needs. A value the sweep builds anew that a kept value
  already computes is read as that kept value (`_reuse_kept`: attention's softmax P,
  not the scores and logsumexp it would be recomputed from), and a kept value that is
  a cheap elementwise function of one other kept value is computed again from it
  (`tgc.autodiff.remat.recompute_cheap`: gelu's 0.5 + 0.5 tanh(..), from the tanh);
- a forward loop of the same body that also stacks those kept values per step (the
  lowering runs it as the loop it extends: `tgc.lower.steps`);
- a loop over the indices in the other order whose carries are the cotangents of C
  (starting at the carry outputs' cotangents, else 0) and the running sums, whose
  slices are the kept values, X and the stacked outputs' cotangents, and whose body
  is the backward step.
Its outputs are the cotangents of every operand, one loop for all of them.
Keeping everything the backward step reads is the default; `checkpointed(B)` (the
memory planner's other choice, `tgc.budget`) checkpoints B's results, so the
backward step keeps only the incoming carries and recomputes the step from them.

Forward mode (`loop_jvp`): one loop that carries (C, dC), reads (X, dX) and (P, dP)
for the operands with a tangent, and whose body adds to B the tangent program of
each result (`tgc.autodiff.forward`).

The sweeps are passed in by the drivers that meet a loop (`tgc.autodiff.reverse`,
`tgc.autodiff.forward`), which import this module: it imports neither.

Both derivative loops are ordinary loops of primitive ops, so a derivative of a
derivative (an HVP through a `repeat`) applies these rules again.

Exact: each derivative loop runs the chain rule of the step, step by step, in the
order the dependencies go. Terminates: each rule builds one or two loops from a
finite body, one sweep over it per group of outputs (reverse) or per result (forward).
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple, Sequence

from tgc.autodiff.remat import is_checkpoint, recompute_cheap, regions
from tgc.ir import values as V
from tgc.ir.values import LoopBody, Value, rebuild_same, topo_order


def _substitute(values: Sequence[Value], mapping: dict[int, Value]) -> list[Value]:
    """`values` with each value whose id is in `mapping` replaced (a body's parameters
    by a new body's)."""
    memo: dict[int, Value] = {}
    for v in topo_order(list(values)):
        memo[id(v)] = mapping[id(v)] if id(v) in mapping else \
            rebuild_same(v, tuple(memo[id(o)] for o in v.operands))
    return [memo[id(v)] for v in values]


def _zero(dtype: str, edges) -> Value:
    return V.const(0.0, dtype, set(edges))


def _fitted(t: Value | None, like: Value, batch: set[str]) -> Value:
    """`t` (None: 0) with `like`'s edges plus the batch edges, in `like`'s type."""
    edges = tuple(sorted(set(like.edges) | batch))
    if t is None:
        return _zero(like.dtype, edges)
    if t.edges != edges:
        t = V.contract([t], edges)
    return V.convert(t, like.dtype)


def _float(v: Value) -> bool:
    return v.dtype != "i32"


class _Params:
    """The parameters of a body being built, numbered as they are added."""

    def __init__(self):
        self.values: list[Value] = []

    def add(self, dtype: str, edges) -> Value:
        p = V.loopvar(len(self.values), dtype, edges)
        self.values.append(p)
        return p


def _slice_type(o: Value, edge: str) -> list[str]:
    return [e for e in o.edges if e != edge]


# ---- reverse mode ---------------------------------------------------------------------

def loops_vjp(pairs: Sequence[tuple[Value, Value]], reverse_many) -> list[Value | None]:
    """The cotangents of the operands of the loop outputs `pairs` ((output, its
    cotangent), one group of `loop_groups`: the same operands, each body a prefix of
    the longest) from ONE backward loop of the longest body, seeded with every
    output's cotangent (a custom vjp clause in the step sees their sum)."""
    return _backward(tuple(v for v, _ in pairs), tuple(ct for _, ct in pairs), reverse_many)


@lru_cache(maxsize=32)
def _backward(vs: tuple[Value, ...], cts: tuple[Value, ...], reverse_many) -> list[Value | None]:
    """The cotangents of all the operands: the loop is built once (values are hashed
    by identity; the cache holds a few)."""
    return _build_backward(vs, cts, reverse_many)


def loop_groups(loops: Sequence[Value]) -> dict[int, int]:
    """id(v) -> a group number for the loop outputs `loops`: outputs of loops over the
    same operands, edge and order whose bodies are one the prefix of the longest
    (`_extends`: a loop and the forward loop its reverse mode built to keep each
    step's values) share a group, and a sweep builds one backward loop for a group."""
    by_key: dict[tuple, list[Value]] = {}
    for v in loops:
        body, edge, reverse, _ = v.attrs
        by_key.setdefault((edge, reverse) + tuple(map(id, v.operands)), []).append(v)
    groups: dict[int, int] = {}
    names: dict[tuple, int] = {}
    for key, vs in by_key.items():
        bodies = {id(v.attrs[0]): v.attrs[0] for v in vs}
        for v in vs:
            body = best = v.attrs[0]
            for other in bodies.values():
                if len(other.results) > len(best.results) and _extends(other, body):
                    best = other
            groups[id(v)] = names.setdefault(key + (id(best),), len(names))
    return groups


def checkpointed(body: LoopBody) -> LoopBody:
    """`body` with each float result read as `checkpoint(result)`: its reverse loop keeps
    only the carries each step starts from and recomputes the rest of the step (the
    memory planner's choice under a budget, `tgc.budget`)."""
    results = [r if not _float(r) or (r.op == "map" and r.attrs[0] == "checkpoint")
               else V.map_("checkpoint", r, loc=r.loc) for r in body.results]
    return V.loop_body(body.params, results, body.carries, body.slices)


class StepPlan(NamedTuple):
    """What the reverse loop of a loop reads from its forward steps."""
    carries: tuple[int, ...]     # the carries whose incoming value each step keeps
    kept: tuple[Value, ...]      # the step's values each step keeps (in the forward body's terms)
    recomputed: int              # the step's values the backward step computes again
    back: LoopBody               # the backward step


def step_plan(v: Value, reverse_many) -> StepPlan:
    """The plan of the reverse loop of `v`'s loop for a cotangent of `v`'s type (what
    `tgc explain` and the memory planner report)."""
    body, edge, _, out = v.attrs
    ct = V.const(0.0, v.dtype, set(v.edges))
    return _plan(body, edge, ((out, ct.dtype, ct.edges),), frozenset(), reverse_many)


KEPT_NOT = ("loopvar", "const", "size", "indicator")
_STAND = 1 << 30   # numbers of the stand-in parameters while a backward step is built


def _read_back(primal: list[Value], roots: list[Value]) -> list[Value]:
    """The values of `primal` (a step's graph, operands first) that the backward step
    (`roots`) reads, other than parameters and leaves and what a `checkpoint` in the
    step has it recompute (`tgc.autodiff.remat.regions`)."""
    in_primal = {id(p) for p in primal}
    backward = topo_order(roots)
    read = {id(r) for r in roots}
    for w in backward:
        if id(w) not in in_primal:
            read.update(id(o) for o in w.operands)
    region = regions(primal, backward) if any(is_checkpoint(p) for p in primal) else set()
    return [p for p in primal if id(p) in read and id(p) not in region and p.op not in KEPT_NOT]


def _shape(v: Value, ops: Sequence[Value]) -> tuple:
    """What `v` computes from `ops`, up to the order of a sum's terms and a product's
    factors (the order `normalize` sorts them into): equal shapes, equal values."""
    if v.op == "add":
        return ("add", tuple(sorted(zip(map(id, ops), v.attrs[0]))), v.dtype, v.edges)
    if v.op == "contract":
        return ("contract", tuple(sorted(map(id, ops))), v.dtype, v.edges)
    return (v.op, tuple(map(id, ops)), v.attrs, v.dtype, v.edges)


def _reuse_kept(primal: list[Value], roots: list[Value], kept: list[Value]) -> list[Value]:
    """`roots` (the backward step) with each value that computes what a kept value of
    the step computes read as that value. The reverse sweep builds derivatives anew
    (a logsumexp's is `exp(d - lse)`, the softmax its step already computed and the
    backward keeps to multiply `dP` by): hash-consing, and later `normalize`, would
    merge the two in one graph, but the step and its backward are two loop bodies, so
    the copy would read `d` and `lse` as kept values of their own (two more stacked
    buffers, and an exp per element) while `P` is kept already. Only values already
    kept are read, so the backward keeps nothing new (and what only the copy read is
    no longer kept); `recompute` copies (a checkpoint's) read markers, never matched.

    Exact: a matched value is the same op on the same operands (a sum's terms and a
    product's factors in either order, as `normalize` orders them anyway), as the
    program without the loop computes it once. Terminates: one pass over each graph."""
    kept_ids = {id(k) for k in kept}
    in_primal = {id(p) for p in primal}
    table = {_shape(p, p.operands): p for p in primal if p.operands}
    same: dict[int, Value] = {}
    for w in topo_order(roots):
        if id(w) in in_primal or not w.operands:
            continue
        p = table.get(_shape(w, [same.get(id(o), o) for o in w.operands]))
        if p is not None:
            same[id(w)] = p
    if not any(id(p) in kept_ids for p in same.values()):
        return roots

    def fn(w: Value, ops: tuple[Value, ...]) -> Value:
        p = same.get(id(w))
        return p if p is not None and id(p) in kept_ids else rebuild_same(w, ops)

    memo = V.rebuild(roots, fn)
    return [memo[id(r)] for r in roots]


@lru_cache(maxsize=64)
def _plan(body: LoopBody, edge: str, outs: tuple[tuple[int, str, tuple], ...], batch: frozenset,
          reverse_many) -> StepPlan:
    """The backward step of `body` for cotangents of the outputs `outs` (each: the
    output's number, the cotangent's dtype and edges; `batch`: their edges beyond the
    outputs'), and what it keeps. The cotangents of carry outputs start the backward
    carries; each stacked output's is a slice of the backward loop."""
    nc, nx = body.carries, body.slices
    carries, slices = body.params[:nc], body.params[nc:nc + nx]
    invariants = body.params[nc + nx:]
    stacked_outs = [(o, d, e) for o, d, e in outs if o >= nc]
    ct_dtype = outs[0][1]
    float_slices = [j for j, x in enumerate(slices) if _float(x)]
    float_invs = [j for j, b in enumerate(invariants) if _float(b)]

    ps = _Params()   # stand-ins first, numbered for the final body below
    g_carry = [ps.add(c.dtype if _float(c) else ct_dtype, set(c.edges) | batch) for c in carries]   # (ids: a 0)
    g_inv = [ps.add(invariants[j].dtype, set(invariants[j].edges) | batch) for j in float_invs]
    c_in = [ps.add(c.dtype, c.edges) for c in carries]
    x_in = [ps.add(x.dtype, x.edges) for x in slices]
    y_cts = [ps.add(d, [e for e in es if e != edge]) for _, d, es in stacked_outs]
    p_in = [ps.add(b.dtype, b.edges) for b in invariants]

    primal = list(c_in) + list(x_in) + list(p_in)
    results = _substitute(body.results, {id(old): new for old, new in zip(body.params, primal)})
    seeds = [(results[k], g_carry[k]) for k in range(nc) if _float(carries[k])]
    seeds += [(results[o], y) for (o, _, _), y in zip(stacked_outs, y_cts)]
    wrt = [p for p in primal if _float(p)]
    # one sweep for all the seeds: a value two results share gets their summed cotangent
    # before its rule runs (a custom vjp clause need not be linear)
    cts = reverse_many(seeds[0][0], wrt, seeds[0][1], tuple(seeds[1:])) if seeds else {}

    def cotangent(p: Value) -> Value | None:
        """p's cotangent in the step, None for 0 (always for an i32 parameter: ids have none)."""
        return cts.get(id(p))

    new_carry = [_fitted(cotangent(c_in[k]), g_carry[k], set()) for k in range(nc)]
    new_inv = [V.convert(V.add([g, _fitted(cotangent(p_in[j]), g, set())]), g.dtype)
               for g, j in zip(g_inv, float_invs)]
    d_slices = [_fitted(cotangent(x_in[j]), x_in[j], batch) for j in float_slices]
    roots = new_carry + new_inv + d_slices

    # keep what the backward step reads (less what a checkpoint recomputes); read it as parameters
    graph = topo_order(results)
    roots = _reuse_kept(graph, roots, [k for k in _read_back(graph, roots) if edge not in k.edges])
    roots = recompute_cheap(graph, roots, [k for k in _read_back(graph, roots) if edge not in k.edges], results)
    kept = [k for k in _read_back(graph, roots) if edge not in k.edges]
    stand = [V.loopvar(_STAND + j, k.dtype, k.edges) for j, k in enumerate(kept)]
    roots = _substitute(roots, {id(k): s for k, s in zip(kept, stand)})
    used = {id(w) for w in topo_order(roots)}
    kept_carries = [k for k in range(nc) if id(c_in[k]) in used]
    again = {id(w) for w in graph if w.op not in KEPT_NOT}   # the step's values, and the copies `checkpoint` has recomputed
    recomputed = 0
    for w in topo_order(roots):
        if w.op == "map" and w.attrs[0] == "recompute" or id(w) in again:
            again.add(id(w))
        elif w.operands and all(id(o) in again or o.op in KEPT_NOT for o in w.operands) \
                and any(id(o) in again for o in w.operands):
            again.add(id(w))
        else:
            continue
        recomputed += w.op not in KEPT_NOT and not (w.op == "map" and w.attrs[0] == "recompute")

    final = _Params()
    order = (g_carry + g_inv + [c_in[k] for k in kept_carries] + stand + x_in
             + y_cts + p_in)
    mapping = {id(p): final.add(p.dtype, p.edges) for p in order}
    back = V.loop_body(final.values, _substitute(roots, mapping), nc + len(float_invs),
                       len(kept_carries) + len(stand) + nx + len(y_cts))
    forward = _substitute(kept, {id(new): old for new, old in zip(primal, body.params)})
    return StepPlan(tuple(kept_carries), tuple(forward), recomputed, back)


def _build_backward(vs: tuple[Value, ...], cts: tuple[Value, ...], reverse_many) -> list[Value | None]:
    body = max((v.attrs[0] for v in vs), key=lambda b: len(b.results))
    _, edge, reverse, _ = vs[0].attrs
    nc, nx = body.carries, body.slices
    ops = vs[0].operands
    carries, slices, invariants = ops[:nc], ops[nc:nc + nx], ops[nc + nx:]
    batch: frozenset = frozenset()
    summed: dict[int, list[Value]] = {}
    for v, ct in zip(vs, cts):
        batch |= set(ct.edges) - set(v.edges)
        summed.setdefault(v.attrs[3], []).append(ct)
    cts_of = {o: c[0] if len(c) == 1 else V.add(c) for o, c in sorted(summed.items())}
    float_slices = [j for j, x in enumerate(slices) if _float(x)]
    float_invs = [j for j, b in enumerate(invariants) if _float(b)]
    plan = _plan(body, edge, tuple((o, c.dtype, c.edges) for o, c in cts_of.items()), batch, reverse_many)
    ct_dtype = next(iter(cts_of.values())).dtype

    # the forward loop that also stacks what each step keeps (lowering runs it with `v`'s)
    stacked = [body.params[k] for k in plan.carries] + list(plan.kept)
    extra = [r for r in stacked if not any(r is q for q in body.results[nc:])]
    keep = V.loop_body(body.params, body.results + tuple(extra), nc, nx)

    def kept(r: Value) -> Value:
        at = next((m for m in range(nc, len(body.results)) if body.results[m] is r), None)
        at = len(body.results) + extra.index(r) if at is None else at
        return V.loop(keep, edge, ops, at, reverse)

    start = [_zero(c.dtype if _float(c) else ct_dtype, set(c.edges) | batch) for c in carries]
    for o, ct in cts_of.items():
        if o < nc:
            start[o] = _fitted(ct, carries[o], set(batch))
    operands = (start + [_zero(invariants[j].dtype, set(invariants[j].edges) | batch) for j in float_invs]
                + [kept(r) for r in stacked] + list(slices)
                + [V.convert(ct, ct.dtype) for o, ct in cts_of.items() if o >= nc] + list(invariants))
    outs = lambda k: V.loop(plan.back, edge, operands, k, not reverse)   # noqa: E731
    result: list[Value | None] = [outs(k) if _float(carries[k]) else None for k in range(nc)]
    result += [outs(nc + len(float_invs) + float_slices.index(j)) if j in float_slices else None
               for j in range(nx)]
    result += [outs(nc + float_invs.index(j)) if j in float_invs else None for j in range(len(invariants))]
    return result


def _extends(longer: LoopBody, body: LoopBody) -> bool:
    """`longer` is `body` with more stacked results: the same parameters and carries,
    the same first results."""
    return (len(longer.results) > len(body.results) and (longer.carries, longer.slices) == (body.carries, body.slices)
            and len(longer.params) == len(body.params)
            and all(p is q for p, q in zip(longer.params, body.params))
            and all(r is q for r, q in zip(longer.results, body.results)))


def one_forward_loop(module):
    """`module` with each output of a loop that another loop of the same operands extends
    (the forward loop reverse mode builds to keep what each step keeps) read from the
    longer loop: one loop, run once, whose body the later passes rewrite as one (two
    bodies rewritten apart would no longer be one the prefix of the other). The same
    steps on the same operands: the same values."""
    groups: dict[tuple, dict[int, LoopBody]] = {}
    for v in topo_order(module.roots()):
        if v.op == "loop":
            body, edge, reverse, _ = v.attrs
            groups.setdefault((edge, reverse) + tuple(map(id, v.operands)), {})[id(body)] = body
    longest: dict[tuple, LoopBody] = {}
    for key, bodies in groups.items():
        for body in bodies.values():
            best = body
            for other in bodies.values():
                if len(other.results) > len(best.results) and _extends(other, body):
                    best = other
            if best is not body:
                longest[key + (id(body),)] = best
    if not longest:
        return module

    def fn(v: Value, ops: tuple[Value, ...]) -> Value:
        if v.op == "loop":
            body, edge, reverse, out = v.attrs
            best = longest.get((edge, reverse) + tuple(map(id, v.operands)) + (id(body),))
            if best is not None:
                return V.loop(best, edge, ops, out, reverse, loc=v.loc)
        return rebuild_same(v, ops)

    return module.replace_values(V.rebuild(module.roots(), fn))


# ---- forward mode ---------------------------------------------------------------------

def loop_jvp(v: Value, ts: Sequence[Value | None], forward) -> Value | None:
    """The tangent of loop output `v` given its operands' tangents `ts` (None: 0);
    `forward` is the tangent sweep that called it (`tgc.autodiff.forward`), run on the
    body."""
    body, edge, reverse, out = v.attrs
    nc, nx = body.carries, body.slices
    ops = v.operands
    batch: set[str] = set()
    for o, t in zip(ops, ts):
        if t is not None:
            batch |= set(t.edges) - set(o.edges)
    ps = _Params()
    c_in = [ps.add(c.dtype, c.edges) for c in ops[:nc]]
    dc_in = [ps.add(c.dtype, set(c.edges) | batch) for c in ops[:nc]]
    x_in = [ps.add(x.dtype, _slice_type(x, edge)) for x in ops[nc:nc + nx]]
    dx_pos = [j for j in range(nc, nc + nx) if ts[j] is not None]
    dx_in = [ps.add(ops[j].dtype, _slice_type(ts[j], edge)) for j in dx_pos]
    p_in = [ps.add(b.dtype, b.edges) for b in ops[nc + nx:]]
    dp_pos = [j for j in range(nc + nx, len(ops)) if ts[j] is not None]
    dp_in = [ps.add(ops[j].dtype, ts[j].edges) for j in dp_pos]

    primal = c_in + x_in + p_in
    results = _substitute(body.results, {id(old): new for old, new in zip(body.params, primal)})
    moving = list(zip(c_in, dc_in)) + [(x_in[j - nc], d) for j, d in zip(dx_pos, dx_in)] \
        + [(p_in[j - nc - nx], d) for j, d in zip(dp_pos, dp_in)]

    def tangent(r: Value) -> Value | None:
        """r's tangent from every moving parameter in one sweep (a custom jvp clause
        sees their summed tangents, as it would in the unrolled program)."""
        return forward(r, moving[0][0], moving[0][1], tuple(moving[1:])) if moving else None

    carried = [_fitted(tangent(results[k]), dc_in[k], set()) for k in range(nc)]
    ys = list(results[nc:])
    dys = [_fitted(tangent(y), y, batch) for y in ys]
    body_t = V.loop_body(ps.values, list(results[:nc]) + carried + ys + dys, 2 * nc, nx + len(dx_pos))
    operands = (list(ops[:nc]) + [_fitted(ts[k], ops[k], batch) for k in range(nc)] + list(ops[nc:nc + nx])
                + [V.convert(ts[j], ops[j].dtype) for j in dx_pos] + list(ops[nc + nx:])
                + [V.convert(ts[j], ops[j].dtype) for j in dp_pos])
    k = nc + out if out < nc else 2 * nc + len(ys) + (out - nc)
    return V.loop(body_t, edge, operands, k, reverse)
