"""reader_order: a loop's stacked result laid out as the argument it is combined with.

A loop over an edge (`tgc.lower.steps`) stores each stacked result in a buffer of
its own, the loop edge outermost and the rest in the declaration order of its
edges. The reverse loop of a layer stack returns each stacked param's gradient
this way, and the optimizer then reads the gradient elementwise beside the param
and its states (AdamW's `m.p`, `v.p`, `p`), which keep the param's declared order.
Where the two orders differ the update reads one of them transposed: nanoGPT's
`wo[layer, c2, c]` and `wproj[layer, ff, c]` got gradients stored `[layer, c, c2]`
and `[layer, c, ff]`, and their AdamW kernels ran at a third of the others'
bytes per second (14 and 57 MB at 4.0 and 2.6 GB/s against 8 GB/s).

`arg_order(fuser, values, edge)` returns the order (without the loop edge) of the
program arguments stored with `edge` outermost over exactly the result's edges
that the values reading the result over those same edges combine it with (the
walk follows readers whose edges are the result's, at most `DEPTH` readers
deep: `clip * g`, then `0.9 m + 0.1 clip g`), when they all agree on one order;
else None, and the declaration order stays.

Exact: it chooses where the result's elements lie in memory, not what is computed;
every kernel and GEMM reads and writes the same values (a GEMM writing its result
the other way round computes C^T = B^T A^T, the same sums in the same order of K).
Terminates: a walk of at most `DEPTH` levels of a finite DAG, each value once.
"""
from __future__ import annotations

from typing import Sequence

DEPTH = 4   # readers deep: a gradient's clip, the moment update, and two more maps


def arg_order(fuser, values: Sequence, edge: str) -> tuple[str, ...] | None:
    """The order of the loop result `values` (the loop values of one result: a loop
    merged with the one it extends has several) as the arguments its elementwise
    readers combine it with are stored, the loop edge `edge` outermost and left out;
    None where there is none or they disagree (see the module docstring)."""
    if not values:
        return None
    want = sorted(values[0].edges)
    orders: set[tuple[str, ...]] = set()
    seen: set[int] = set()
    frontier = list(values)
    for _ in range(DEPTH):
        nxt = []
        for x in frontier:
            for u in fuser.users.get(id(x), ()):
                if u in seen:
                    continue
                seen.add(u)
                uv = fuser.by_id[u]
                if sorted(uv.edges) != want:
                    continue
                for o in uv.operands:
                    if o.op != "arg" or sorted(o.edges) != want:
                        continue
                    have = fuser.m.args[o.attrs[0]].order
                    if have and have[0] == edge:
                        orders.add(tuple(have[1:]))
                nxt.append(uv)
        frontier = nxt
    return orders.pop() if len(orders) == 1 else None
