"""Column sums moved up to the loop kernels that already read their rows (a helper of
the CPU group stage, `tgc.backends.cpu.group`, run on each program before grouping).

What it rewrites. A column sum is a loop kernel that sums over its first loop (a
parameter gradient `dw[c] = sum[batch, t] dy * xhat`, a bias gradient `db[c] =
sum[batch, t] dy`). `fuse` orders kernels by the value graph, so such a sum often
comes long after the rows it reads were last read: in a transformer layer's backward
step the second layernorm's weight and bias gradients read the MLP's input gradient
and the saved normalized rows after the attention's products, in the first
layernorm's group, and the attention output's bias gradient reads the second
layernorm's input gradient there too. Each such read streams the [rows, width] buffer
from memory again. The sum K moves up to just after the last loop kernel L before it
that reads a buffer K reads at its rows (an index of its first loop; or writes one:
K's input's writer), when

- nothing between L and K writes a buffer K reads, nor reads or writes one K writes
  (so K reads what it read before and every other kernel too), and
- L's first loop is K's, of the same extent (the group stage can then run K in L's
  group: its rows are in cache; K becomes one of its partial-sum members), and
- the kernels between L and K touch more than `cache_bytes` of buffers (known sizes;
  `CpuOptions.group_shrink_max_bytes`, an L2), so that K would read its rows from
  memory where it is, and the rows K reads hold more than half of that: a smaller
  re-read is cheap (from a cache further out), and the move changes L's group (a GPT
  of width 48 at 64 x 11 tokens, 135 kB a buffer: its layernorm backward's groups
  lost their rows loops for blocks of the batch, ~6% slower on one thread).

Exact: K computes the same expression from the same values (the legality rule
above); only its position changes. Its group (and so its blocks of partial sums) may
change, which moves the sum within rounding (the group stage's partial sums add
block by block), as any change of the group would. Terminates: one pass in program
order; each kernel moves at most once, only up.
"""
from __future__ import annotations

from tgc.ir.dtypes import itemsize
from tgc.lower.lowered import Load, LoopKernel, Lowered, walk


def _writes(k) -> set[str]:
    return k.writes() if hasattr(k, "writes") else {k.out}


def is_column_sum(k) -> bool:
    """A loop kernel summing over its first loop (and writing its whole output)."""
    return (isinstance(k, LoopKernel) and k.reduce == "sum" and bool(k.loops) and k.loops[0] in k.red
            and not k.scatter and not k.bounds and k.epilogue is None)


def _row_reads(k: LoopKernel) -> set[str]:
    """The buffers `k` loads at an index of its first loop (its rows, not a vector
    every row shares)."""
    first = k.loops[0]
    return {e.buf for e in walk(k.body) if isinstance(e, Load)
            and any(a == first for _, ix in e.index for a, _ in ix.terms)}


def _touched(low: Lowered, used: list, names: set[str] | None = None) -> int | None:
    """The bytes of the distinct buffers in `used` (kernels' (read, written) buffer
    sets), or of `names` (None: a symbolic size)."""
    names = set(names or ())
    for read, written in used:
        names |= set(read) | written
    total = 0
    for name in names:
        b = low.buffers.get(name)
        if b is None:
            continue
        n = itemsize(b.dtype)
        for e in b.edges:
            size = low.size(e)
            if not isinstance(size, int):
                return None
            n *= size
        total += n
    return total


def hoist_column_sums(low: Lowered, cache_bytes: int) -> list:
    """`low`'s kernels with each column sum moved up as the module docstring says."""
    out = list(low.kernels)
    # each kernel's read and written buffers, asked once (a scan back from every column
    # sum asking again made the lowering's questions quadratic in the program's length:
    # tests/lower/test_lowering_scaling.py)
    sets = {id(k): (k.buffers_read(), _writes(k)) for k in out}
    i = 0
    while i < len(out):
        k = out[i]
        if not is_column_sum(k):
            i += 1
            continue
        (reads, writes), rows = sets[id(k)], _row_reads(k)
        first, extent = k.loops[0], k.sizes[k.loops[0]]
        land = None
        for j in range(i - 1, -1, -1):
            p = out[j]
            pr, pw = sets[id(p)]
            shares = isinstance(p, LoopKernel) and p.loops[:1] == (first,) and p.sizes.get(first) == extent
            if pw & reads:   # K's input's writer: K may follow it, no further
                if land is None and shares and pw & rows and not (pw & writes) and not (pr & writes):
                    land = j
                break
            if pr & writes or pw & writes:
                break
            if land is None and shares and pr & rows:
                land = j
        if land is not None and land < i - 1:
            between, own = _touched(low, [sets[id(p)] for p in out[land + 1:i]]), _touched(low, [], rows)
            if (between is None or between > cache_bytes) and (own is None or 2 * own > cache_bytes):
                out.insert(land + 1, out.pop(i))
        i += 1
    return out
