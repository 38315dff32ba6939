"""Which consecutive loop kernels share one parallel region, and where its barriers go.

A parallel region costs 1-3 us while libgomp's workers still spin, ~80 us when they
sleep, and milliseconds when another process holds a core (`parallel.py`). A step's
loop kernels often come in runs between its GEMMs (an optimizer's updates, a
layernorm's backward): `plan_regions` puts each run into one region, whose body
runs the kernels one after another on every thread, each on its static share of its
own split range (`loops.split_count`, `parallel.thread_range`), with a barrier
(`GOMP_barrier`) before a kernel only where the static partitions do not keep what
it touches thread-local:

- A run holds loop kernels, loop groups and GEMMs. A GEMM in a region runs its
  tasks (tiles of its product, `gemm.GemmGen.emit`) shared by the threads as it does
  in a region of its own: each cblas call runs on its calling thread (tgc holds
  OpenBLAS at one thread while it runs, `codegen.blas_one_thread`), and a product
  small enough to be one task runs on thread 0 while the others go on to the
  next kernel or barrier. Its tasks are not a loop's split range, so nothing it
  touches is thread-local. A loop over an edge (`StepLoop`) ends a run; its step
  plans its own (`codegen.call_steps`).
- A kernel whose outer loop threads cannot share (a sum or a scatter over it, or no
  loop) runs on thread 0 inside the region (`Region.single`); a run never starts or
  ends with one (such kernels there run serially before or after the region).
- A split kernel runs split whatever its size: inside a region its share costs
  nothing more than running it whole on one thread, and a barrier it needs is needed
  by the kernels around it either way.
- Barrier: kernel K needs one when, since the last barrier, an earlier kernel P of
  the region wrote memory K reads or writes, or read memory K writes, and the two do
  not both touch it thread-locally. Thread-local: both split ranges of the same
  extents (so thread t gets the same indices [lo, hi) of both), and every access of
  the buffer in both (each store of a writer, each load) indexes the same buffer
  edges with exactly the split loop variables; then thread t touches only elements
  whose coordinates on those edges lie in its own share. Two kernels on thread 0
  are thread-local to each other. Nor do two accesses of one buffer that lie in
  disjoint ranges of one of its edges (`_span`: each kernel indexes that edge at
  `w + c` alone, `w` a loop of known size): they touch different elements, whichever
  threads run them (the pieces of one output, tgc.lower.pieces: 32 runs of causal
  attention wrote y and dq with a barrier between every two pieces). A buffer read through an id (an `IdLoad`), a
  blocked group's partial rows (its threads take blocks, not indices), or a scatter
  are never thread-local. Memory, not names: workspace temporaries that share a slot
  conflict with each other, and in a loop's step every argument and output may
  share memory with another (several bind one buffer of the enclosing program).

Pairs (`pairs`, `CpuOptions.pair_batch_loops`): a GEMM batched over an edge `e` of at
least `gemm_batch_tasks` indices (its tasks are then `e`'s indices, each a whole product)
followed by a loop kernel whose split loop runs over `e` and which reads the product
only at its own index of `e` (a convolution's input-gradient product and its column
sum over the kernel's columns) run interleaved: each thread takes its share of `e`
(`parallel.thread_range`, as the loop alone would) and, index by index, runs that
index's product (`gemm.GemmGen.emit`'s pair mode) and then the loop at that index, so
the loop reads a product the same thread has just written, from cache (393 kB per
image for conv2d_sym's input gradient, against 6.3 MB for the whole product). The
product is then written thread-locally along `e` (the loop's split), so no barrier
separates the two, and the kernels after them see it so. A pair needs the loop to write
no memory the product reads or writes, and the product to write nothing else the loop
reads. Serially (one thread, or a region run on one thread) the pair runs the same
way, index by index.

A region holds at most `cpu.region_max_barriers` barriers: a longer run is cut at a
barrier into several (the end of a region orders what the barrier would). While
another process holds a core, each barrier can wait a time slice for a worker (the
lag), so the cap bounds what one region costs then: the contention logic
(`parallel.py`) measures the lag of each region and runs serially while it is held.

The decision to run a region in parallel is made for the whole run at run time from
the sum of its split kernels' work (`codegen._ModuleGen.call_region`; a GEMM's flops
count as the loop work of the same serial time, `loop_work_per_cycle` /
`gemm_flops_per_cycle` each), as for one kernel, with the lag's floor (`parallel.threshold_fn`) scaled by the region's
barriers plus one: under contention each barrier can cost a lag. Below it the kernels
run serially, one after another, as without regions.

Exact in floating point: each kernel computes every element as it does on its own
(the same code, the same order within an element); only which thread computes which
element changes, and the barriers order every cross-thread dependence. A pair's
loop reads, at each index, a product already complete on the same thread, and writes
nothing either reads at another index.
"""
from __future__ import annotations

from dataclasses import dataclass

from tgc.backends.cpu.group import LoopGroup
from tgc.backends.cpu.implicit import ImplicitGemm
from tgc.backends.cpu.loops import parallel_ok, split_loops
from tgc.backends.cpu.options import CpuOptions
from tgc.lower.lowered import ExprVisitor, GemmKernel, Ix, Load, LoopKernel, Lowered, walk


@dataclass(frozen=True)
class Region:
    """Kernels `start` .. `start + len(single) - 1` of a program, run in one region."""
    start: int
    single: tuple[bool, ...]     # the kernel runs on thread 0 (its loop cannot be split)
    barrier: tuple[bool, ...]    # a barrier before the kernel (never before the first)
    paired: tuple[bool, ...] = ()   # the kernel (a loop) runs interleaved with the GEMM before it (`pairs`)

    def is_paired(self, j: int) -> bool:
        return j < len(self.paired) and self.paired[j]

    @property
    def stop(self) -> int:
        return self.start + len(self.single)

    @property
    def barriers(self) -> int:
        return sum(self.barrier)


def is_gemm(k) -> bool:
    return isinstance(k, (GemmKernel, ImplicitGemm))


def is_member(k) -> bool:
    """Whether `k` may run in a merged region: a loop kernel, a loop group, a GEMM
    without an epilogue (one with takes its epilogue's buffers in an array of its own:
    `gemm_epilogue.py`, called as a kernel of its own)."""
    return isinstance(k, (LoopKernel, LoopGroup)) or (is_gemm(k) and not getattr(k, "epilogue", ()))


def splits(k, cpu: CpuOptions) -> bool:
    """Whether threads share kernel `k`'s work: a GEMM (its tasks, `gemm.GemmGen.emit`),
    a loop whose outer loop they can share (`loops.split_loops`), or a blocked group
    (threads take blocks)."""
    if is_gemm(k):
        return is_member(k)
    if not is_member(k) or not parallel_ok(k):
        return False
    return bool(split_loops(k, cpu)) or (isinstance(k, LoopGroup) and bool(k.blocks))


def plan_regions(low: Lowered, cpu: CpuOptions, step: bool = False) -> list[Region]:
    """The regions of `low`'s own kernels (not its loops' steps): every run of at least
    two split loop kernels, with the kernels on thread 0 between them (module
    docstring). Kernels outside every region run as before, each deciding alone.
    `step`: `low` is a loop's step (its arguments and outputs may share memory)."""
    out: list[Region] = []
    ks = low.kernels
    i = 0
    while i < len(ks):
        if not splits(ks[i], cpu):
            i += 1
            continue
        j = i
        while j + 1 < len(ks) and is_member(ks[j + 1]):
            j += 1
        while not splits(ks[j], cpu):   # a run ends with a split kernel
            j -= 1
        single = tuple(not splits(k, cpu) for k in ks[i:j + 1])
        if single.count(False) >= 2:
            out += _cut(Region(i, single, barriers(low, ks[i:j + 1], single, cpu, step),
                               pairs(low, ks[i:j + 1], cpu, step)),
                        max(cpu.region_max_barriers, 0))
        i = j + 1
    return out


def _cut(r: Region, most: int) -> list[Region]:
    """`r` cut at barriers into regions of at most `most` barriers each (the end of a
    region orders everything a barrier would), each trimmed of kernels on thread 0 at
    either end, and only those with two split kernels or more."""
    pieces, start, count = [], 0, 0
    for j, bar in enumerate(r.barrier):
        if bar and count == most:
            pieces.append((start, j))
            start, count = j, 0
        elif bar:
            count += 1
    pieces.append((start, len(r.barrier)))
    out = []
    for lo, hi in pieces:
        while lo < hi and r.single[lo]:
            lo += 1
        while hi > lo and r.single[hi - 1]:
            hi -= 1
        if r.single[lo:hi].count(False) >= 2:   # (a pair is never cut: no barrier inside it)
            out.append(Region(r.start + lo, r.single[lo:hi], (False,) + r.barrier[lo + 1:hi],
                              (False,) + tuple(r.paired[lo + 1:hi]) if r.paired else ()))
    return out


def pair_key(low: Lowered, g, k, cpu: CpuOptions, step: bool = False):
    """The thread-local key (`_local_key`'s) under which GEMM `g` and the loop kernel
    `k` after it run as a pair (module docstring), or None when they do not."""
    if not cpu.pair_batch_loops or type(g) is not GemmKernel or g.epilogue or len(g.batch) != 1:
        return None
    if not isinstance(k, LoopKernel) or not parallel_ok(k):
        return None
    e = g.batch[0]
    n = low.size(e)
    if not isinstance(n, int) or n < max(cpu.gemm_batch_tasks, 2):
        return None   # fewer indices: the product's tasks are tiles (or one packed B'), not indices
    key = _local_key(k, g.out, cpu)
    if key != ((n,), (e,)) or len(split_loops(k, cpu)) != 1:
        return None   # the loop's split is not e's indices, or it reads the product elsewhere
    ga, ka = _Access(low, g, False, cpu, step), _Access(low, k, False, cpu, step)
    g_mem = {ga.memory(b) for b in ga.reads | ga.writes}
    if any(ka.memory(b) in g_mem for b in ka.writes):
        return None   # the loop writes what the product reads or writes
    if any(ga.memory(b) in {ka.memory(x) for x in ka.reads} for b in ga.writes if b != g.out):
        return None
    return key


def pairs(low: Lowered, ks, cpu: CpuOptions, step: bool = False) -> tuple[bool, ...]:
    """For each kernel of a run, whether it runs interleaved with the GEMM before it
    (`pair_key`); a GEMM pairs with one loop at most."""
    out = [False] * len(ks)
    for j in range(1, len(ks)):
        if not out[j - 1] and pair_key(low, ks[j - 1], ks[j], cpu, step) is not None:
            out[j] = True
    return tuple(out)


def barriers(low: Lowered, ks, single: tuple[bool, ...], cpu: CpuOptions,
             step: bool = False) -> tuple[bool, ...]:
    """Where a run of kernels needs a barrier (module docstring). A paired GEMM
    (`pairs`) writes its product thread-locally, under its loop's split (`pair_key`)."""
    paired = pairs(low, ks, cpu, step)

    def access(j: int) -> _Access:
        acc = _Access(low, ks[j], single[j], cpu, step)
        if j + 1 < len(paired) and paired[j + 1]:
            acc.local[ks[j].out] = pair_key(low, ks[j], ks[j + 1], cpu, step)
        return acc

    out = [False]
    pending = _Pending()
    pending.add(access(0))
    for j in range(1, len(ks)):
        acc = access(j)
        need = pending.conflicts(acc)
        out.append(need)
        if need:
            pending = _Pending()
        pending.add(acc)
    return tuple(out)


class _Pending:
    """The accesses of the kernels since the last barrier, by memory: for each, the
    (buffer, split-edge mapping) pairs read and those written. `conflicts(acc)` is
    `any(acc.conflicts(p) for p in pending)` without visiting each pending kernel: a
    run of independent kernels (AdamW's updates, one per param) made that quadratic."""

    def __init__(self) -> None:
        self.reads: dict = {}
        self.writes: dict = {}
        self.spans: dict = {}   # memory -> [(buffer, its `_span` in that kernel)] of every pending access

    def add(self, acc: "_Access") -> None:
        for buf in acc.reads | acc.writes:
            self.spans.setdefault(acc.memory(buf), []).append((buf, acc.span[buf]))
            table = self.writes if buf in acc.writes else self.reads
            table.setdefault(acc.memory(buf), set()).add((buf, acc.local[buf]))
            if buf in acc.writes and buf in acc.reads:
                self.reads.setdefault(acc.memory(buf), set()).add((buf, acc.local[buf]))

    def conflicts(self, acc: "_Access") -> bool:
        """Whether `acc` touches a memory a pending kernel touches, one of them writing
        it, other than as the same buffer with the same thread-local split."""
        for buf in acc.reads | acc.writes:
            mem = acc.memory(buf)
            theirs = [self.writes.get(mem, ())] + ([self.reads.get(mem, ())] if buf in acc.writes else [])
            mine = (buf, acc.local[buf])
            for keys in theirs:
                if keys and (acc.local[buf] is None or len(keys) > 1 or mine not in keys) \
                        and not self.apart(mem, buf, acc.span[buf]):
                    return True
        return False

    def apart(self, mem, buf: str, span) -> bool:
        """Whether every pending access of memory `mem` is of buffer `buf` over a range
        of the same edge that `span` does not meet (`_span`): the elements differ,
        whichever threads touch them (the pieces of one output, tgc.lower.pieces)."""
        if not span:
            return False
        return all(b == buf and s and any(e == f and (hi <= lo2 or hi2 <= lo)
                                          for e, lo, hi in span for f, lo2, hi2 in s)
                   for b, s in self.spans.get(mem, ()))


class _Access:
    """What one kernel touches: per memory (`memory`), the buffers it reads and writes,
    and for each buffer the split-edge mapping that makes its accesses thread-local
    (None when they are not)."""

    def __init__(self, low: Lowered, k, single: bool, cpu: CpuOptions, step: bool):
        self.low, self.step = low, step
        self.reads = {b for b in k.buffers_read() if b in low.buffers}
        self.writes = {b for b in k.writes() if b in low.buffers}
        self.local: dict[str, object] = {}
        for buf in self.reads | self.writes:
            self.local[buf] = ("thread 0",) if single else None if is_gemm(k) else _local_key(k, buf, cpu)
        self.span = {buf: _span(k, buf) for buf in self.reads | self.writes}

    def memory(self, buf: str):
        b = self.low.buffers[self.low.storage(buf)]   # an alias is its buffer's bytes
        if b.kind == "temp":
            return ("slot", b.slot)
        if self.step:
            return ("io",)
        return ("name", b.name)

    def conflicts(self, other: "_Access") -> bool:
        for mine in self.reads | self.writes:
            for theirs in other.reads | other.writes:
                if mine not in self.writes and theirs not in other.writes:
                    continue   # two reads
                if self.memory(mine) != other.memory(theirs):
                    continue
                if mine != theirs or self.local[mine] is None or self.local[mine] != other.local[theirs]:
                    return True
        return False


def _local_key(k, buf: str, cpu: CpuOptions):
    """(split extents, the buffer edge each split variable indexes) when every access
    of `buf` in `k` indexes those edges with exactly the split variables; else None."""
    if isinstance(k, LoopGroup) and k.blocks:
        return None
    loops = split_loops(k, cpu)
    if not loops:
        return None
    members = k.members if isinstance(k, LoopGroup) else (k,)
    indexes = []
    for m in members:
        if buf in _id_reads(m):
            return None
        if m.out == buf:
            if m.scatter:
                return None
            indexes.append(dict(m.index))
        roots = [m.body] + ([m.epilogue] if m.epilogue is not None else [])
        indexes += [dict(e.index) for r in roots for e in walk(r) if isinstance(e, Load) and e.buf == buf]
    edges = []
    for v in loops:
        var = Ix.var(v)
        found = [e for e in sorted(indexes[0]) if indexes[0][e] == var] if indexes else []
        if len(found) != 1 or any(ix.get(found[0]) != var for ix in indexes):
            return None
        edges.append(found[0])
    return tuple(k.sizes[v] for v in loops), tuple(edges)


def _span(k, buf: str) -> tuple:
    """((edge, lo, hi), ...): each edge of `buf` that loop kernel `k` indexes only at
    `w + lo`, the same at every access, `w` a loop of integer size hi - lo (no bounds,
    no scatter, no read through an id): all it reads or writes of `buf` lies in that
    range of each such edge; () when none."""
    if not isinstance(k, LoopKernel) or k.scatter or k.bounds or buf in _id_reads(k):
        return ()
    roots = [k.body] + ([k.epilogue] if k.epilogue is not None else [])
    indexes = ([dict(k.index)] if k.out == buf else []) + \
        [dict(e.index) for r in roots for e in walk(r) if isinstance(e, Load) and e.buf == buf]
    out = []
    for e, ix in sorted(indexes[0].items()) if indexes else ():
        if len(ix.terms) != 1 or not isinstance(ix.terms[0][0], str) or ix.terms[0][1] != 1 \
                or not isinstance(ix.const, int):
            continue
        n = k.sizes.get(ix.terms[0][0])
        if isinstance(n, int) and all(i.get(e) == ix for i in indexes):
            out.append((e, ix.const, ix.const + n))
    return tuple(out)


def _id_reads(m: LoopKernel) -> set[str]:
    """The buffers `m` reads through ids (in indices, bounds and conditions)."""
    out: set[str] = set()
    v = _IdReads()
    for root in [m.body] + ([m.epilogue] if m.epilogue is not None else []):
        v.expr(root, out)
    v.ixs((ix for _, ix in m.index), out)
    v.ixs((ix for lo, hi in m.bounds.values() for ix in lo + hi), out)
    return out


class _IdReads(ExprVisitor):
    """Adds to `out` the buffers an expression reads in its indices (`IdLoad`)."""

    def ixs(self, ixs, out: set) -> None:
        for ix in ixs:
            for a, _ in ix.terms:
                self.atom(a, out)

    def expr_load(self, e, out: set) -> None:
        self.ixs((ix for _, ix in e.index), out)

    def expr_mask(self, e, out: set) -> None:
        self.ixs((c.ix for c in e.conds), out)
        self.expr(e.arg, out)

    def expr_rand(self, e, out: set) -> None:
        self.ixs((e.key, e.counter, *(n for n in e.folds if isinstance(n, Ix))), out)

    def expr_add(self, e, out: set) -> None:
        for a in e.args:
            self.expr(a, out)

    expr_mul = expr_map = expr_add

    def expr_const(self, e, out: set) -> None:
        pass

    expr_size_of = expr_acc = atom_var = expr_const

    def atom_id_load(self, a, out: set) -> None:
        out.add(a.buf)
        self.ixs((ix for _, ix in a.index), out)

    def atom_floor_div(self, a, out: set) -> None:
        self.ixs([a.num], out)
