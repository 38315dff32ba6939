"""Derivatives of loops (`tgc.ir.values.loop`): the derivative of a loop is a loop.

A loop over edge `e` with body `B` (carries C, per-step slices X, invariants P;
results: new carries C' and per-step results Y) runs, for each index in order,
`C <- C'(C, X[e = i], P)` and records `Y(C, X[e = i], P)` at `e = i`.

Reverse mode (`loop_vjp`), for a cotangent `ct` of one output:
- a forward loop of the same body that also stacks each step's incoming carries
  (the values the backward steps read: carries are kept, the rest of a step is
  recomputed from them);
- a loop over the indices in the other order whose carries are the cotangents of
  C (starting at `ct` for a carry output, else 0) and running sums of the
  cotangents of P, whose slices are the kept carries, X and the stacked `ct` (for a
  stacked output), and whose body is the reverse sweep (`tgc.autodiff.reverse`) of
  B at those values: it gives the step's cotangents of C (the next carries), of P
  (added to the sums) and of X (stacked: the cotangent of the stacked operand).
Its outputs are the cotangents of every operand, one loop for all of them (the
builders hash-cons: the rule called for each operand builds the same loop).

Forward mode (`loop_jvp`): one loop that carries (C, dC), reads (X, dX) and (P, dP)
for the operands with a tangent, and whose body adds to B the tangent program of
each result (`tgc.autodiff.forward`).

The sweeps are passed in by the drivers that meet a loop (`tgc.autodiff.reverse`,
`tgc.autodiff.forward`), which import this module: it imports neither.

Both derivative loops are ordinary loops of primitive ops, so a derivative of a
derivative (an HVP through a `repeat`) applies these rules again.

Exact: each derivative loop runs the chain rule of the step, step by step, in the
order the dependencies go. Terminates: each rule builds one or two loops from a
finite body, one sweep over it per result.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

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

def loop_vjp(v: Value, i: int, ct: Value, reverse_many) -> Value | None:
    """The cotangent of operand `i` of loop output `v` whose cotangent is `ct`;
    `reverse_many` is the reverse sweep that called it (`tgc.autodiff.reverse`), run
    on the body."""
    return _backward(v, ct, reverse_many)[i]


@lru_cache(maxsize=32)
def _backward(v: Value, ct: Value, reverse_many) -> list[Value | None]:
    """The cotangents of all of `v`'s operands: the rule asks once per operand, and
    the loop is built once (values are hashed by identity; the cache holds a few)."""
    return _build_backward(v, ct, reverse_many)


def kept_carries(v: Value) -> list[Value]:
    """The carry each step of `v`'s loop starts from, stacked along its edge: the loop
    of the same body that also yields its incoming carries."""
    body, edge, reverse, _ = v.attrs
    nc = body.carries
    keep = V.loop_body(body.params, body.results + body.params[:nc], nc, body.slices)
    return [V.loop(keep, edge, v.operands, len(body.results) + k, reverse) for k in range(nc)]


def _build_backward(v: Value, ct: Value, reverse_many) -> list[Value | None]:
    body, edge, reverse, out = v.attrs
    nc, nx = body.carries, body.slices
    ops = v.operands
    carries, slices, invariants = ops[:nc], ops[nc:nc + nx], ops[nc + nx:]
    batch = set(ct.edges) - set(v.edges)
    stacked_ct = out >= nc
    float_slices = [j for j, x in enumerate(slices) if _float(x)]
    float_invs = [j for j, b in enumerate(invariants) if _float(b)]

    ps = _Params()
    g_carry = [ps.add(c.dtype, set(c.edges) | batch) for c in carries]
    g_inv = [ps.add(invariants[j].dtype, set(invariants[j].edges) | batch) for j in float_invs]
    c_in = [ps.add(c.dtype, c.edges) for c in carries]
    x_in = [ps.add(x.dtype, _slice_type(x, edge)) for x in slices]
    y_ct = ps.add(ct.dtype, _slice_type(ct, edge)) if stacked_ct else None
    p_in = [ps.add(b.dtype, b.edges) for b in invariants]

    primal = list(c_in) + list(x_in) + list(p_in)
    results = _substitute(body.results, {id(old): new for old, new in zip(body.params, primal)})
    seeds = [(results[k], g_carry[k]) for k in range(nc)]
    if stacked_ct:
        seeds.append((results[out], y_ct))
    wrt = [p for p in primal if _float(p)]
    parts: dict[int, list[Value]] = {id(p): [] for p in wrt}
    for f, seed in seeds:
        cts = reverse_many(f, wrt, seed)
        for p in wrt:
            if cts[id(p)] is not None:
                parts[id(p)].append(cts[id(p)])

    def cotangent(p: Value) -> Value | None:
        return (V.add(parts[id(p)]) if len(parts[id(p)]) > 1 else parts[id(p)][0]) if parts[id(p)] else None

    new_carry = [_fitted(cotangent(c_in[k]), g_carry[k], set()) for k in range(nc)]
    new_inv = [V.convert(V.add([g, _fitted(cotangent(p_in[j]), g, set())]), g.dtype)
               for g, j in zip(g_inv, float_invs)]
    d_slices = [_fitted(cotangent(x_in[j]), x_in[j], batch) for j in float_slices]
    back = V.loop_body(ps.values, new_carry + new_inv + d_slices, nc + len(float_invs),
                       nc + nx + stacked_ct)

    start = [_zero(c.dtype, set(c.edges) | batch) for c in carries]
    if not stacked_ct:
        start[out] = _fitted(ct, carries[out], batch)
    operands = (start + [_zero(invariants[j].dtype, set(invariants[j].edges) | batch) for j in float_invs]
                + kept_carries(v) + list(slices) + ([V.convert(ct, ct.dtype)] if stacked_ct else [])
                + list(invariants))
    outs = lambda k: V.loop(back, edge, operands, k, not reverse)   # noqa: E731
    result: list[Value | None] = [outs(k) for k in range(nc)]
    result += [outs(nc + len(float_invs) + float_slices.index(j)) if j in float_slices else None
               for j in range(nx)]
    result += [outs(nc + float_invs.index(j)) if j in float_invs else None for j in range(len(invariants))]
    return result


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
        parts = [t for t in (forward(r, p, d) for p, d in moving) if t is not None]
        return None if not parts else parts[0] if len(parts) == 1 else V.add(parts)

    carried = [_fitted(tangent(results[k]), dc_in[k], set()) for k in range(nc)]
    ys = list(results[nc:])
    dys = [_fitted(tangent(y), y, batch) for y in ys]
    body_t = V.loop_body(ps.values, list(results[:nc]) + carried + ys + dys, 2 * nc, nx + len(dx_pos))
    operands = (list(ops[:nc]) + [_fitted(ts[k], ops[k], batch) for k in range(nc)] + list(ops[nc:nc + nx])
                + [V.convert(ts[j], ops[j].dtype) for j in dx_pos] + list(ops[nc + nx:])
                + [V.convert(ts[j], ops[j].dtype) for j in dp_pos])
    k = nc + out if out < nc else 2 * nc + len(ys) + (out - nc)
    return V.loop(body_t, edge, operands, k, reverse)
