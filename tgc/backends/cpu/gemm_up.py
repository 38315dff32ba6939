"""A product moved up past the loop kernels before it, so that they and the loop kernel
after it group (a helper of the CPU group stage, `tgc.backends.cpu.group`, run on each
program before grouping; `CpuOptions.group_past_gemms`).

What it rewrites. `group` fuses runs of consecutive loop kernels; a GEMM between two
loop kernels that share their rows loop ends the run. `fuse` orders kernels by the value
graph, which often puts an independent product between a kernel and its reader. In the
backward of a streamed attention's step:

    gemm  S  = q k^T                       the scores
    loops P  = softmax(S)                  (max, logsumexp, exp: one group over the rows)
    gemm  dP = dy v^T                      reads neither S nor P
    loops D  = sum_s P dP;  dS = P (dP - D)  (one group over the rows)

each row of P is written by the first group and read back by the second one after the
product: at t = 8192 a step's P, [256 rows, up to 8192 keys] in f32, is 8 MB, more than
the L2, so the second group reads it from memory. With `dP` first, both runs are one
group over the rows: each row of P is read back by `D`'s and `dS`'s members while it is
in cache (one [rows, keys] matrix less read from memory a step).

The rule: a GEMM G moves to just before the run of loop kernels R right before it when
- the kernel right after G is a loop kernel L whose first loop is the first loop of R's
  last kernel (same extent), and L reads at an index of that loop a buffer R writes
  (the row it would read again), of more than half `cache_bytes` (an L2,
  `CpuOptions.group_shrink_max_bytes`: a smaller re-read comes from a cache anyway), and
- G reads nothing R writes and writes nothing R reads or writes (so every kernel reads
  what it read before).

Exact: no kernel's expression or inputs change, only the order of independent kernels
(and the groups that order lets `group` form: each member computes what it did). The
cost: G's product lives from its new place, across R (one more workspace slot of its
size while R runs: the attention step's `dP` beside `S`). Terminates: one pass in
program order; each GEMM moves at most once, only up.
"""
from __future__ import annotations

from tgc.backends.cpu.hoist import _touched, _writes
from tgc.lower.lowered import GemmKernel, LoopKernel, Lowered


def _shared_rows(k: LoopKernel, after: LoopKernel) -> bool:
    """Whether `k` starts with the loops `after` keeps before its first summed one
    (same extents; at least one): the outer loops a group of the two would share."""
    rows = []
    for v in after.loops:
        if v in after.red:
            break
        rows.append(v)
    return bool(rows) and k.loops[:len(rows)] == tuple(rows) and all(k.sizes.get(v) == after.sizes[v] for v in rows)


def gemms_up(low: Lowered, cache_bytes: int) -> list:
    """`low`'s kernels with each GEMM moved up as the module docstring says."""
    out = list(low.kernels)
    i = 1
    while i < len(out) - 1:
        g, after = out[i], out[i + 1]
        if not (isinstance(g, GemmKernel) and isinstance(after, LoopKernel) and after.loops):
            i += 1
            continue
        start = i
        while start > 0 and isinstance(out[start - 1], LoopKernel):
            start -= 1
        run = out[start:i]
        if not run or not _shared_rows(run[-1], after):
            i += 1
            continue
        written = set().union(*(_writes(k) for k in run))
        read = set().union(*(k.buffers_read() for k in run))
        reread = after.buffers_read() & written
        gw = _writes(g)
        if not reread or g.buffers_read() & written or gw & (written | read):
            i += 1
            continue
        size = _touched(low, [], reread)
        if size is not None and 2 * size <= cache_bytes:
            i += 1
            continue
        out.insert(start, out.pop(i))
        i += 1
    return out
