"""group: the CPU backend's own lowering stage: run neighbouring loop kernels inside
shared outer loops (`LoopGroup`, a kind of kernel only this backend has: it says
itself how neutral code renames, retargets and interprets it).

`Lowered` (after `layout`) -> `Lowered`. `fuse` gives one loop nest per materialized
value, so a layernorm's backward is nine kernels that each stream the whole
[rows, d] input from memory. Kernels that follow one another and all start with the
same kept loops (`rows`) become one group: for each row every member runs its own
inner loops, so the row is read from memory once and stays in cache for the rest.

Before grouping, each column sum (a sum over its first loop: a parameter or bias
gradient) moves up beside the last loop kernel that reads the rows it reads
(`tgc.backends.cpu.hoist`), where it joins that kernel's group instead of reading
them from memory again after the products in between.

A kernel joins the group before it when:
- both are loop kernels (not scatters, not the final copies of updates) that write
  their whole output at the identity index, and the longest common prefix of their
  loops (same variables, same extents), kept in every member, is not empty;
- every read of a buffer an earlier member wrote is at the same outer index (the
  outer variables themselves), so at that index the value is complete;
- it does not shorten the group's shared loops while the group's buffers would then
  hold more than `options.cpu.group_shrink_max_bytes` per outer index, unless it sums
  over the loop where they end (`_Grouper.shrinks`: AdamW's moments and parameter of
  a layer's matrix share all their loops, one pass over the slice; a layernorm
  backward's partial sums still shorten its rows group).
A member may also sum over the first outer variable (a parameter gradient
`dw[d] = sum[rows] ...`), or over a leading run of them when it keeps a loop after
them (`db[c] = sum[batch, t] ...` inside a layernorm's rows `(batch, t)`): it then adds
into a partial buffer with one row per block of the first outer loop
(`options.cpu.group_blocks` blocks, threads take whole blocks) at every outer index,
zeroed before the group and added up after it, in block order (the CPU adds an f32
sum's rows of a long block in f64, rounded once into the block's row:
`loops.LoopGen.wide_partials`). The outer loops go past the first one summed over
only where the members' buffers at one index of the first hold more than half of
`options.cpu.group_shrink_max_bytes` (known sizes): over a short slab (a GPT of width
48, 19 kB a batch) the members' own long inner loops are faster, and the slab stays in
cache between them (with room to spare: nanoGPT-char's layernorm backward, its
column sums beside it, touches 1.97 MB a batch, and ran at 8 GB/s with the batch
alone outer against 10.5 with its rows outer, a 2 MiB L2); and where every member's loops would all be outer (a bias sum
beside an elementwise product: each member streams once either way) the group keeps
the first loop alone too. Each element of such a sum takes its terms in the
order a member with only the first loop outer took them (the block's rows, then the
other summed loops), so its value does not change; the members beside it then share
all the rows loops, and the row statistics they read become registers instead of
scratch rows, which may move a statistic by an ulp (a vector sum's lanes are added
in another order).

Inside a finished group, a softmax's `logsumexp` read as `exp(B - lse)` becomes max,
`exp(B - max)` stored once, its sum, and a scaling (`exp_once`: one exp per element,
not two); a logsumexp that is also an output, or read otherwise, is then written as
max + log(sum). Then a temporary that only later members read becomes:
- a register (`regs`) when its edges are exactly the outer variables (a row's mean);
- inlined into its readers when it is elementwise and cheap (`x - mean`), so it is
  never written;
- otherwise a scratch row per block of outer indices (`[#block, inner edges]`, the
  group then runs in blocks): rewritten for each outer index, it stays in cache and
  the full tensor is never written to memory.
A sum alone over its leading loops (a bias gradient between two GEMMs, which keeps a
loop after them; a weight gradient's sum of squares right after its GEMM in a layer
loop's step, `tgc/opt/step_sums.py`, which sums every loop) becomes such a group of one
when it has at least
`options.cpu.parallel_min_work` iterations (`_Grouper.lone_partial`): alone, a sum's
own loop is never split over threads. Its elements take their terms in the blocks'
order, then added up by block: not the order of the serial loop (an f32 sum may move
by its rounding), the same on any number of threads.
A group never has more block rows than outer indices for its blocks to divide
(`#block = min(32, batch)`), so neither a scratch row nor a partial sum is ever
larger than its block's share of the tensor.

Terminates: one pass over the kernels; `exp_once` replaces each logsumexp once (its
members are no logsumexp); inlining removes one member per step.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from tgc.ir.sizes import Size, size_op, size_str
from tgc.ir.dtypes import itemsize
from tgc.lower.lowered import (Acc, Add, Buffer, Const, Cond, Ix, Load, LoopKernel, Lowered,
                               Map, Mask, Mul, Rand, walk)
from tgc.lower.epilogue import expand
from tgc.backends.cpu.gemm_dispatch import tile_epilogue as epilogue_supported
from tgc.backends.cpu.gemm_up import gemms_up
from tgc.backends.cpu.group_in_place import has_mask, write_in_place
from tgc.backends.cpu.hoist import hoist_column_sums
from tgc.lower.grouping import Grouper, MemberGroup, read_member_parts
from tgc.lower.text import KernelForm
from tgc.options import Options
from tgc.ir.ops import EXPENSIVE   # never inlined into a reader (cost class heavy)
from tgc.ir.passes import Pass

BLOCK_EDGE = "#block"      # the partial buffers' block edge (not a name of the language)


@dataclass
class LoopGroup(MemberGroup):
    """Loop kernels run one after another inside shared outer loops: for each index
    of `outer` (loop variables every member keeps, outermost first), each member runs
    its remaining loops with the outer ones fixed. A member reads what an earlier one
    wrote only at the same outer index, so the rows a group works on stay in cache
    (and its threads split the outermost loop). A member whose output is in `regs` is
    kept in a register for the outer index (no buffer: it is read only by later
    members, at that index).

    With `blocks` > 0 the first outer loop runs in that many blocks (a loop variable
    named like the block edge, `#block`; threads take whole blocks), and a member
    may sum over the first outer variable: it adds into its block's row of a partial
    buffer (zeroed by a kernel before the group and added up, in block order, by one
    after it), so the result does not depend on how blocks were shared by threads."""
    outer: tuple[str, ...]
    sizes: dict[str, Size]
    members: tuple[LoopKernel, ...]
    regs: tuple[str, ...] = ()
    blocks: int = 0
    note: str = ""
    kind = "group"             # what `tgc explain` calls it (a class attribute)

    def can_retarget(self, low: Lowered, target: str, tmp: str) -> bool:
        """Whether the member writing `tmp` may write `target` instead (plan's
        in-place updates): no member after it reads `target`, and every member up to
        it reads `target` only at the element that member writes (its own index; the
        writer itself as a plain elementwise member): members run in order for each
        iteration of the shared outer loops, whose indices these loads fix, so each
        old element is read before it is overwritten and no iteration reads
        another's (AdamW's moments and parameter, one elementwise group: three
        copies back gone)."""
        writer = next((j for j, m in enumerate(self.members) if m.out == tmp), None)
        if writer is None:
            return False
        at = self.members[writer].index
        for j, m in enumerate(self.members):
            nodes = list(walk(m.body)) + (list(walk(m.epilogue)) if m.epilogue is not None else [])
            loads = [n for n in nodes if isinstance(n, Load) and n.buf == target]
            if not loads:
                continue
            if j > writer or (j == writer and (m.reduce or m.scatter or m.epilogue is not None)):
                return False
            if any(n.index != at for n in loads):
                return False
        return True

    def run_members(self, it, sizes: list[int]) -> None:
        """With blocks, the members one after another for each index of the outer
        loops (`#block` is the block of the first outer index, and a member summing
        over an outer loop adds into its block's row); without, as `MemberGroup`."""
        if not self.blocks:
            super().run_members(it, sizes)
            return
        for point in np.ndindex(*sizes):
            fixed = dict(zip(self.outer, point))
            blocks = min(self.blocks, sizes[0])   # never more than the block rows (group.block_rows)
            fixed[BLOCK_EDGE] = point[0] * blocks // max(sizes[0], 1)
            for m in self.members:
                it.loop(m, fixed)

    def text(self) -> str:
        loops = ", ".join(f"{v} < {size_str(self.sizes[v])}" for v in self.outer)
        if self.blocks:
            loops += f" in {self.blocks} blocks"
        head = f"group for {loops}" + (f"  reg {', '.join(map(self._reg_text, self.regs))}" if self.regs else "")
        body = "".join(f"\n    {m.text()}".replace("\n      for", "\n          for") for m in self.members)
        return head + (f"    # {self.note}" if self.note else "") + body

    def _reg_text(self, r: str) -> str:
        """A register with its edges (it has no buffer line): those of the member that writes it."""
        writer = next((m for m in self.members if m.out == r), None)
        return f"%{r}[{', '.join(e for e, _ in writer.index)}]" if writer else f"%{r}[]"




def read_group(reader, t) -> LoopGroup:
    """A `group for ...` kernel of the lowered text (`reader`: `tgc.lower.text`'s walk)."""
    outer, sizes, members, regs, note, extras = read_member_parts(reader, t, ("group_blocks",))
    blocks = int(extras["group_blocks"].children[0]) if "group_blocks" in extras else 0
    return LoopGroup(outer, sizes, members, regs, blocks, note)


# shared outer loops (`in N blocks`: partial sums over blocks of the first), then the members
GROUP_FORM = KernelForm("group", r"""
group: "group" "for" outer ("," outer)* group_blocks? regs? note _NL loop+
group_blocks: "in" INT "blocks"
""", read_group)


@dataclass(frozen=True)
class Group(Pass[Lowered, Lowered]):
    """Fuse neighbouring loop kernels that share outer loops into groups."""

    name = "group"
    takes = gives = "lowered"
    blocks: int | None = None   # blocks of a group's rows with partial sums (None: options.cpu.group_blocks; 0: no groups)

    def options_error(self, ir) -> str | None:
        """A negative `blocks` (0 is 'no groups'; a count of blocks is never negative)."""
        if self.blocks is not None and self.blocks < 0:
            return f"blocks={self.blocks}: a number of blocks, 0 (no groups) or more"
        return None

    def run(self, low: Lowered, options: Options) -> Lowered:
        if self.blocks is not None:
            options = options.with_(group_blocks=self.blocks)
        # GEMM epilogues (tgc.lower.epilogue) the tiles do not run (gemm_epilogue.supported): loops after the GEMM
        low = expand(low, keep=lambda p, g: epilogue_supported(p, g, options))
        out = low.staged("group")
        if options.cpu.group_blocks < 1:
            return out
        out.kernels = []
        # column sums beside the rows they read
        low = replace(low, kernels=hoist_column_sums(low, options.cpu.group_shrink_max_bytes))
        # a product moved up past the loop kernels before it, which then group with its reader's
        if options.cpu.group_past_gemms:
            low = replace(low, kernels=gemms_up(low, options.cpu.group_shrink_max_bytes))
        _Grouper(low, out, options).run()
        # a group's output over a buffer it reads for the last time
        # (not in a program with a mask that a causal product's `tri` form could follow:
        # backends/cpu/causal.py keeps its facts per buffer, and a buffer holding two
        # values loses them; the masks of a stream's runs are loaded, not such masks).
        # Not under a memory budget: tgc.budget's greedy choice of recomputes is measured
        # without it (with it, a 2-layer attention stack's best reached 1.68 MB, against
        # 1.40 MB without: tests/test_memory_budget.py), and its trials lower without it
        if options.cpu.group_in_place and options.memory_budget is None \
                and not (options.cpu.causal_gemm and not options.fp_strict and has_mask(out)):
            write_in_place(out, lambda k: isinstance(k, LoopGroup))
        return out


def _identity(k: LoopKernel) -> bool:
    return all(ix == Ix.var(e) for e, ix in k.index) and not k.scatter


def _loads(k: LoopKernel) -> tuple[Load, ...]:
    """The loads of `k`'s body and epilogue, in walk order. Kept with the kernel until
    its body or epilogue is replaced (expressions are immutable values; the cache
    holds them, so the identity test is sound): the grouper asks for every member's
    loads each time a kernel is offered to a group."""
    cached = k.__dict__.get("_loads_cache")
    if cached is not None and cached[0] is k.body and cached[1] is k.epilogue:
        return cached[2]
    roots = [k.body] + ([k.epilogue] if k.epilogue is not None else [])
    out = tuple(n for r in roots for n in walk(r) if isinstance(n, Load))
    k.__dict__["_loads_cache"] = (k.body, k.epilogue, out)
    return out


def _reads_buf(k: LoopKernel, name: str) -> bool:
    """Whether `k` loads buffer `name` (a superset test: `_reads` also counts id buffers)."""
    return name in k._reads()


def _outer_of(k: LoopKernel, partial_ok: bool) -> list[str]:
    """The loops of `k` that can be outer loops of a group, outermost first: kept
    ones, or, for a sum, the reduced loops it starts with: the first always, the
    ones after it while a kept loop follows them (a bias gradient
    `db[c] = sum[batch, t] dy` runs inside its layernorm's rows `(batch, t)`; a full
    sum `sum[layer, c, ff]` keeps only its first loop outer)."""
    out = []
    for i, v in enumerate(k.loops):
        if v in k.red:
            leading = partial_ok and k.reduce == "sum" and all(u in k.red for u in k.loops[:i])
            if not leading or v in k.bounds or (i > 0 and all(u in k.red for u in k.loops[i:])):
                break
        out.append(v)
    return out


def _sums_lead(k: LoopKernel, prefix) -> bool:
    """Whether the outer loops `k` sums over are a leading run of `prefix` (none, or
    the first ones): it then adds into its block's row of a partial buffer at every
    index of the others (`_Grouper.partial`)."""
    summed = [v in k.red for v in prefix]
    return summed == sorted(summed, reverse=True)


class _Run:
    """What `_Grouper._prefix_of` asks of each member of a run of consecutive kernels
    from `start`, kept per member, so that the group's outer loops for the run's first
    m kernels (`prefix(m)`) take time independent of m. With P0 the first kernel's
    possible outer loops (`_outer_of`), each member contributes (`summary`): how many
    of P0 its own outer loops share (same variables, same extents as the first's); how
    many of P0 it may keep while it sums over a leading run of them (`_sums_lead`
    holds for P0[:p] exactly for p up to the first summed loop after a kept one); the
    first position after the first where it sums over a loop of P0; its loop count;
    and, for each of its loads of a buffer an earlier member wrote, whether that writer
    sums over P0's first loop (a partial) and how many of P0 the load indexes by the
    loop variables themselves. These fold by min, min, min, max, or, min (`agg[j]`:
    the first j + 1 members); `prefix(m)` then applies `_prefix_of`'s rules to the
    folded numbers. The bytes per outer index (`bytes`) are kept per outer length
    and extended member by member (each buffer counts with its last access, as
    `bytes_per_outer` counts it)."""

    def __init__(self, grouper: "_Grouper", start: int):
        self.g, self.start = grouper, start
        first = grouper.low.kernels[start]
        self.p0 = tuple(_outer_of(first, True))
        self.sizes0 = first.sizes
        self.agg: list[tuple] = []
        self.written: dict[str, LoopKernel] = {}
        self.touched: dict[int, list] = {}    # outer length -> [members counted, {buffer: bytes}, total, symbolic]
        self.results: dict[int, tuple[str, ...]] = {}

    def summary(self, k: LoopKernel) -> tuple:
        p0 = self.p0
        mine = _outer_of(k, True)
        n = 0
        while n < min(len(p0), len(mine)) and p0[n] == mine[n] and self.sizes0[p0[n]] == k.sizes[mine[n]]:
            n += 1
        flags = [v in k.red for v in p0]
        lead = next((i for i in range(1, len(flags)) if flags[i] and not flags[i - 1]), len(flags))
        # (len(p0): no such position; every outer length the run can have is at most that)
        red = next((j for j in range(1, len(p0)) if p0[j] in k.red), len(p0))
        partial, match = False, len(p0)
        for ld in _loads(k):
            w = self.written.get(ld.buf)
            if w is not None:
                partial = partial or (bool(p0) and p0[0] in w.red)
                at, m = dict(ld.index), 0
                while m < len(p0) and at.get(p0[m]) == Ix.var(p0[m]):
                    m += 1
                match = min(match, m)
        return n, lead, red, len(k.loops), partial, match

    def fold(self, m: int) -> tuple:
        """The summaries of the run's first m members, folded."""
        kernels = self.g.low.kernels
        while len(self.agg) < m:
            k = kernels[self.start + len(self.agg)]
            s = self.summary(k)
            if self.agg:
                a = self.agg[-1]
                s = (min(a[0], s[0]), min(a[1], s[1]), min(a[2], s[2]), max(a[3], s[3]), a[4] or s[4],
                     min(a[5], s[5]))
            self.agg.append(s)
            self.written[k.out] = k
        return self.agg[m - 1]

    def prefix(self, m: int) -> tuple[str, ...]:
        got = self.results.get(m)
        if got is None:
            got = self.results[m] = self._prefix(m)
        return got

    def _prefix(self, m: int) -> tuple[str, ...]:
        common, lead, red, loops, partial, match = self.fold(m)
        n = min(len(self.p0), common, lead)
        if n == 0:
            return ()
        short = min(n, red)
        if short < n:   # the slab of one index of the first loop stays in cache only with room to spare: half an L2
            touched = self.bytes(m, short)
            if touched is None or touched <= self.g.opt.cpu.group_shrink_max_bytes // 2 or loops <= n:
                n = short
        if partial or match < n:
            return ()
        return self.p0[:n]

    def bytes(self, m: int, outer: int) -> int | None:
        """`bytes_per_outer` of the run's first m members over the outer loops P0[:outer]."""
        state = self.touched.get(outer)
        if state is None or state[0] > m:
            state = self.touched[outer] = [0, {}, 0, False]
        low = self.g.low
        at = [Ix.var(v) for v in self.p0[:outer]]
        while state[0] < m:
            k = low.kernels[self.start + state[0]]
            state[0] += 1
            if state[3]:
                continue
            for name, index in [(k.out, k.index)] + [(ld.buf, ld.index) for ld in _loads(k)]:
                size = itemsize(low.buffers[name].dtype)
                for edge, ix in index:
                    if not any(ix == x for x in at):
                        n = low.size(edge)
                        if not isinstance(n, int):
                            state[3] = True
                            break
                        size *= n
                if state[3]:
                    break
                state[2] += size - state[1].get(name, 0)
                state[1][name] = size
        return None if state[3] else state[2]


class _Grouper(Grouper):
    def __init__(self, low: Lowered, out: Lowered, options: Options):
        super().__init__(low, out)
        self.opt = options
        self._run: _Run | None = None   # the run of consecutive kernels `prefix` was last asked about

    def groupable(self, k) -> bool:
        return (isinstance(k, LoopKernel) and _identity(k) and k.loops != ()
                and self.low.buffers[k.out].kind != "arg")

    # ------------------------------------------------------------ membership

    def outer(self, members: list[int]) -> tuple[str, ...]:
        """The group's outer loops, or () when these kernels cannot form one (nor when
        the last one shortens the outer loops of those before it too far: `shrinks`)."""
        prefix = self.prefix(members)
        if not prefix:
            return ()
        if len(members) > 1 and self.shrinks(members, prefix):
            return ()
        return prefix

    def shrinks(self, members: list[int], prefix: tuple[str, ...]) -> bool:
        """Whether the last of `members` shortens the outer loops the others share to
        `prefix` while the members then touch more than
        `options.cpu.group_shrink_max_bytes` of buffers per outer index (a symbolic
        size: the group is kept as it was), and not because it sums over the loop after `prefix` (a layernorm
        backward's partial sums: those groups shrink to the rows on purpose). Each
        member runs all its inner loops before the next starts, so with a short
        prefix a large slice (AdamW's moments and parameter: a layer's 384x384 matrix
        each) leaves the cache between members: the kernel starts a new group, whose
        members keep sharing all their loops (one pass over the slice)."""
        before = self.prefix(members[:-1])
        if len(prefix) >= len(before):
            return False
        k = self.low.kernels[members[-1]]
        n = len(prefix)
        if n < len(k.loops) and k.loops[n] in k.red:
            return False
        run = self._run
        if run is not None and run.start == members[0] and run.p0[:len(prefix)] == tuple(prefix) \
                and members[-1] - members[0] + 1 == len(members):
            touched = run.bytes(len(members), len(prefix))
        else:
            touched = self.bytes_per_outer([self.low.kernels[i] for i in members], prefix)
        return touched is not None and touched > self.opt.cpu.group_shrink_max_bytes

    def bytes_per_outer(self, ks: list[LoopKernel], prefix) -> int | None:
        """The bytes of the buffers `ks` touch at one index of the outer loops
        `prefix` (at most; None for a symbolic size)."""
        touched: dict[str, int] = {}      # each buffer's bytes at one outer index (at most)
        for m in ks:
            for name, index in [(m.out, m.index)] + [(ld.buf, ld.index) for ld in _loads(m)]:
                # the buffer's bytes over its axes that no outer loop indexes (an
                # axis the loop reads only in part, a stream run's window of the keys,
                # counts whole: an upper bound)
                size = itemsize(self.low.buffers[name].dtype)
                for edge, ix in index:
                    if not any(ix == Ix.var(v) for v in prefix):
                        n = self.low.size(edge)
                        if not isinstance(n, int):
                            return None
                        size *= n
                touched[name] = size
        return sum(touched.values())

    def prefix(self, members: list[int]) -> tuple[str, ...]:
        """The outer loops `members` share, or () when they cannot form a group.

        `_prefix_of` says what they are, from all the members at once. The grouper
        offers each kernel to the group before it (`Grouper.run`: members + [i], a run
        of consecutive kernels), so this asks the run's `_Run`, which keeps what each
        member contributes (`_Run.summary`, folded in as the run grows) and gives the
        same loops in time independent of the group's length: a 48-layer MLP at small
        sizes is one group of hundreds of loop kernels, and asking every member again
        for each one offered took time quadratic in the depth (1.8 of 2.6 s of a 24-layer
        MLP's lowering, 47 of 50 s at 64 layers)."""
        if not members:
            return ()
        if members[-1] - members[0] + 1 != len(members):   # (members are increasing: a run of consecutive kernels)
            return self._prefix_of(members)
        run = self._run
        if run is None or run.start != members[0]:
            run = self._run = _Run(self, members[0])
        return run.prefix(len(members))

    def _prefix_of(self, members: list[int]) -> tuple[str, ...]:
        """The outer loops `members` share, or () when they cannot form a group (from
        all the members: what `prefix` gives)."""
        ks = [self.low.kernels[i] for i in members]
        prefix = _outer_of(ks[0], True)
        for k in ks[1:]:
            mine = _outer_of(k, True)
            n = 0
            while n < min(len(prefix), len(mine)) and prefix[n] == mine[n] \
                    and ks[0].sizes[prefix[n]] == k.sizes[mine[n]]:
                n += 1
            prefix = prefix[:n]
        # a member sums over a leading run of the outer loops (a partial, by a sum), or none
        while prefix and not all(_sums_lead(k, prefix) for k in ks):
            prefix = prefix[:-1]
        if not prefix:
            return ()
        # summing over more than the first outer loop pays where the members' buffers
        # at one index of the first would not stay in cache between members
        short = 1
        while short < len(prefix) and not any(prefix[short] in k.red for k in ks):
            short += 1
        if short < len(prefix):
            touched = self.bytes_per_outer(ks, prefix[:short])
            if touched is None or touched <= self.opt.cpu.group_shrink_max_bytes or \
                    all(len(k.loops) <= len(prefix) for k in ks):   # (no member with loops of its own: as before)
                prefix = prefix[:short]
        written: dict[str, LoopKernel] = {}
        for k in ks:
            for ld in _loads(k):
                w = written.get(ld.buf)
                if w is not None and (self.partial(w, prefix) or
                                      any(dict(ld.index).get(v) != Ix.var(v) for v in prefix)):
                    return ()
            written[k.out] = k
        return tuple(prefix)

    def lone_partial(self, k: LoopKernel) -> tuple[str, ...]:
        """The outer loops of a group of one for a kernel alone: a sum over its
        leading loops (a bias gradient `db[c] = sum[batch, t] g`, or a sum of every loop:
        `sum[c, ff] dw^2`) with at least `cpu.parallel_min_work` iterations (known sizes) adds into
        a partial row per block of its first loop, so threads share it (a sum's own
        loop is never split: alone it runs on one thread). Else (): the kernel as it is."""
        if k.reduce != "sum" or not k.loops or k.loops[0] not in k.red:
            return ()
        n = 1
        for v in k.loops:
            if not isinstance(k.sizes[v], int):
                return ()
            n *= k.sizes[v]
        if n < self.opt.cpu.parallel_min_work:
            return ()
        return tuple(v for v in _outer_of(k, True) if v in k.red)

    @staticmethod
    def partial(k: LoopKernel, outer) -> bool:
        return outer[0] in k.red

    # ------------------------------------------------------------ finishing a group

    def flush(self, members: list[int]) -> None:
        if not members:
            return
        ks = [self.low.kernels[i] for i in members]
        outer = self.outer(members) if len(ks) > 1 else self.lone_partial(ks[0])
        if not outer:
            self.out.kernels.append(ks[0])
            return
        outside = set(range(len(self.low.kernels))) - set(members)
        bufs = self.out.buffers
        for k in list(ks):
            if k.reduce == "logsumexp":
                ks = self.exp_once(k, ks, keep=bufs[k.out].kind != "temp"
                                   or bool(self.readers.get(k.out, set()) & outside), outside=outside)
        local = [k.out for k in ks if not self.partial(k, outer) and bufs[k.out].kind == "temp"
                 and not (self.readers.get(k.out, set()) & outside)]
        regs: list[str] = []
        for name in local:
            k = next(m for m in ks if m.out == name)
            if set(bufs[name].edges) == set(outer):
                regs.append(name)
            elif not k.reduce and _cheap(k.body, self.opt.cpu.group_inline_max_ops) and k is not ks[-1]:
                ks = [m for m in ks if m is not k]
                ks = [_inline(m, k) if _reads_buf(m, name) else m for m in ks]
                del self.out.buffers[name]
        for name in regs:
            del self.out.buffers[name]
        rows = self.block_rows(outer, ks)
        scratch = [name for name in local if name not in regs and name in self.out.buffers]
        for name in scratch:
            ks = self.make_scratch(name, outer, ks, rows)
        before, after = [], []
        if any(self.partial(k, outer) for k in ks):
            ks = [self.make_partial(k, outer, before, after, rows) if self.partial(k, outer) else k
                  for k in ks]
        sizes = {v: ks[0].sizes[v] for v in outer}
        self.out.kernels += _together(before)
        if len(ks) == 1 and not after:
            self.out.kernels.append(ks[0])
        else:
            blocked = bool(after or scratch)
            self.out.kernels.append(LoopGroup(outer, sizes, tuple(ks), tuple(regs),
                                              blocks=_at_most(self.opt.cpu.group_blocks, rows) if blocked else 0))
        self.out.kernels += _together(after)

    def exp_once(self, lse: LoopKernel, ks: list[LoopKernel], keep: bool, outside: set[int]) -> list[LoopKernel]:
        """A softmax computes exp twice per element: in `lse = logsumexp[d](B)` and in
        `exp(B - lse)` where it is read. When members read `lse` in such an exp, the
        members become `m = max[d] B` (0 where not finite, as in the logsumexp
        itself), `e = exp(B - m)` (stored once: a scratch row), `s = sum[d] e`, and
        each such exp `e * (1/s)`: one exp per element. When `lse` is also read
        otherwise, or outside the group, or is an output (`keep`), it is still
        written, as `m + log(s)`, after the sum."""
        hits = []

        def match(e) -> bool:
            if not (isinstance(e, Map) and e.fn == "exp" and isinstance(e.args[0], Add)):
                return False
            add = e.args[0]
            if len(add.args) != 2 or sorted(add.coefs) != [-1.0, 1.0]:
                return False
            i = add.coefs.index(-1.0)
            other = add.args[1 - i]
            return add.args[i] == Load(lse.out, lse.index) and other == lse.body

        for m in ks:
            if m is not lse and not _reads_buf(m, lse.out):   # no load of it: no such exp
                continue
            exps = 0 if m is lse else sum(1 for n in _walk_kernel(m) if match(n))
            loads = 0 if m is lse else sum(1 for n in _walk_kernel(m) if isinstance(n, Load) and n.buf == lse.out)
            keep = keep or loads != exps
            if not exps:
                continue
            if set(m.loops[:len(lse.loops)]) != set(lse.loops) or m.reduce:   # any order inside
                return ks
            hits.append(m)
        if not hits or lse.epilogue is not None:
            return ks
        low, dst = self.out, self.out.buffers[hits[0].out]
        full = tuple(sorted(((e, Ix.var(e)) for e in dst.edges), key=lambda t: t[0]))
        if tuple(sorted(dst.edges)) != tuple(sorted(set(dict(lse.index)) | set(lse.red))):
            return ks
        names = {}
        for stem, edges, order in (("m", lse.index, None), ("e", full, dst.order), ("s", lse.index, None)):
            names[stem] = low.fresh(stem)
            edge_names = tuple(e for e, _ in edges)
            low.buffers[names[stem]] = Buffer(names[stem], low.dtype, tuple(sorted(edge_names)), "temp",
                                              order=order or low.buffers[lse.out].order)
        m_load, s_load, e_load = (Load(names[x], lse.index if x != "e" else full) for x in "mse")
        sizes = {**lse.sizes, **{e: hits[0].sizes[e] for e, _ in full}}
        finite = Map("where", (Map("lt", (Map("abs", (Acc(),)), Const(float("inf")))), Acc(), Const(0.0)))
        shift = _shifted_by_its_max(lse, ks)
        if shift is not None:  # its max is 0 (or the row is NaN): exp(B) needs no shift
            del low.buffers[names["m"]]
            new = [LoopKernel(names["e"], full, lse.loops, sizes, Map("exp", (lse.body,)), note="softmax: exp once")]
            if keep:
                m_load = Const(0.0)
        else:
            new = [replace(lse, out=names["m"], reduce="maxshift", epilogue=finite, note="softmax: max"),
                   LoopKernel(names["e"], full, lse.loops, sizes,
                              Map("exp", (Add((1.0, -1.0), (lse.body, m_load)),)), note="softmax: exp once")]
        new.append(replace(lse, out=names["s"], reduce="sum", body=e_load, note="softmax: sum"))
        if keep:
            kept = tuple(v for v in lse.loops if v not in lse.red)
            new.append(LoopKernel(lse.out, lse.index, kept, {v: lse.sizes[v] for v in kept},
                                  Add((1.0, 1.0), (Map("log", (s_load,)), m_load)), note="logsumexp"))
        else:
            del low.buffers[lse.out]
        scaled = Mul((e_load, Map("div", (Const(1.0), s_load))))
        out = []
        for k in ks:
            if k is lse:
                out += new
            elif k in hits:
                out.append(_map_kernel(k, lambda e: scaled if match(e) else None))
            else:
                out.append(k)
        if shift is not None and self.only_shifts(shift.out, new[0], out, outside):
            out = [replace(k, reduce="maxshift") if k is shift else k for k in out]
        return out

    def only_shifts(self, m: str, exps: LoopKernel, ks: list[LoopKernel], outside: set[int]) -> bool:
        """Whether max M, a temp read nowhere outside the group, is read only by `exps`,
        e = exp(B - M): then it may skip NaNs (maxshift, llvm.maxnum, which LLVM
        vectorizes better than the NaN-propagating llvm.maximum), with the same
        outputs. A NaN in a row of B makes its e NaN there, so s = sum e is NaN, and e
        reaches everything only through s (as e * (1/s), or log s); an infinite row
        has the same M either way, and exp(B - M) is 1 at both signed zeros."""
        if self.out.buffers[m].kind != "temp" or self.readers.get(m, set()) & outside:
            return False
        return all(k is exps or not _reads_buf(k, m) or not any(isinstance(n, Load) and n.buf == m
                                                                 for n in _walk_kernel(k)) for k in ks)

    def block_rows(self, outer, ks: list[LoopKernel]) -> Size:
        """How many block rows a scratch or partial buffer of a group over `outer` has:
        `options.cpu.group_blocks`, but never more than the outer indices the blocks
        divide (the first outer loop's extent when a member sums over it, else all
        outer loops'; `min(32, batch)` when that is symbolic), so that a block's scratch
        row or partial sum is never larger than its share of the tensor it stands for
        (32 rows for one (batch, head) of attention would hold 32 copies of its [s, t]
        scores). The threads never use more blocks than this
        (`loops.split_count`: at most one per index of the rows they divide)."""
        rows = outer[:1] if any(self.partial(k, outer) for k in ks) else outer
        n: Size = 1
        for v in rows:
            n = size_op("*", n, ks[0].sizes[v])
        cap = self.opt.cpu.group_blocks
        return max(1, min(cap, n)) if isinstance(n, int) else size_op("min", cap, n)

    def block_edge(self, rows: Size) -> str:
        """The edge of `rows` block rows (declared in the lowered program): `#block`
        for the first count a group needs, `#block.N` for each other. The group's
        block variable is `#block` either way."""
        taken = {e: n for e, n in self.out.edges.items() if e == BLOCK_EDGE or e.startswith(BLOCK_EDGE + ".")}
        edge = next((e for e, n in taken.items() if n == rows), None) \
            or (f"{BLOCK_EDGE}.{len(taken)}" if taken else BLOCK_EDGE)
        self.out.edges[edge] = rows
        return edge

    def make_scratch(self, name: str, outer, ks: list[LoopKernel], rows: Size) -> list[LoopKernel]:
        """Members writing and reading `name` (one outer index at a time) through a
        scratch row per block instead: [#block, inner edges] (a block is one thread's,
        in order, so the row is rewritten for each outer index and stays in cache)."""
        low = self.out
        edge = self.block_edge(rows)
        old = low.buffers.pop(name)
        new = low.fresh("r")
        order = (edge,) + tuple(e for e in old.order if e not in outer)
        low.buffers[new] = Buffer(new, old.dtype, tuple(sorted(order)), "temp", order=order)

        def index(ix):
            kept = tuple((e, i) for e, i in ix if e not in outer)
            return tuple(sorted(((edge, Ix.var(BLOCK_EDGE)),) + kept, key=lambda t: t[0]))

        def visit(e):
            return Load(new, index(e.index)) if isinstance(e, Load) and e.buf == name else None

        out = []
        for k in ks:
            if _reads_buf(k, name):
                k = _map_kernel(k, visit)
            if k.out == name:
                k = replace(k, out=new, index=index(k.index), note="scratch row")
            out.append(k)
        return out

    def make_partial(self, k: LoopKernel, outer, before: list, after: list, rows: Size) -> LoopKernel:
        """`k` adding into its block's row of a partial buffer; the zeroing kernel
        goes to `before`, the kernel adding the rows into `k.out` to `after`."""
        low = self.out
        edge = self.block_edge(rows)
        dst = low.buffers[k.out]
        name = low.fresh("p")
        order = (edge,) + dst.order
        low.buffers[name] = Buffer(name, dst.dtype, tuple(sorted(order)), "temp", order=order)
        kept = tuple(e for e, _ in k.index)
        full = ((edge, Ix.var(BLOCK_EDGE)),) + k.index
        loops = (BLOCK_EDGE,) + tuple(v for v in dst.order)
        sizes = {**{e: k.sizes[e] for e in kept}, BLOCK_EDGE: rows}
        index = tuple(sorted(full, key=lambda t: t[0]))
        before.append(LoopKernel(name, index, loops, sizes, Const(0.0), note="zero partial sums"))
        after.append(LoopKernel(k.out, k.index, loops[1:] + loops[:1], sizes, Load(name, index), "sum", (BLOCK_EDGE,),
                                k.epilogue, note="add partial sums"))
        return replace(k, out=name, index=index, epilogue=None, note="partial sums")


def _at_most(blocks: int, rows: Size) -> int:
    """A group's block count: `blocks`, or `rows` when that is a smaller known count."""
    return min(blocks, rows) if isinstance(rows, int) else blocks


def _shifted_by_its_max(lse: LoopKernel, ks: list[LoopKernel]) -> LoopKernel | None:
    """The member writing M when `lse` is logsumexp[E](B - M) with M = max[E](B): B - M
    has the maximum 0 (the prelude's shifted softmax), or is NaN where M is not finite."""
    e = lse.body
    if not (isinstance(e, Add) and sorted(e.coefs) == [-1.0, 1.0]):
        return None
    b, m = e.args if e.coefs == (1.0, -1.0) else e.args[::-1]
    if not isinstance(m, Load):
        return None
    return next((k for k in ks if k.out == m.buf and k.reduce in ("max", "maxshift") and k.body == b
                 and k.epilogue is None and set(k.loops) == set(lse.loops) and set(k.red) == set(lse.red)
                 and m.index == k.index), None)


def _together(ks: list[LoopKernel]) -> list:
    """Kernels over the same kept loops (the zeroing, or the adding up, of several
    partial sums) as one group: one function instead of one each."""
    if len(ks) < 2:
        return ks
    kept = [tuple(v for v in k.loops if v not in k.red) for k in ks]
    if len(set(kept)) != 1 or not kept[0] or any(k.loops[:len(kept[0])] != kept[0] for k in ks) \
            or len({tuple(k.sizes[v] for v in kept[0]) for k in ks}) != 1:
        return ks
    return [LoopGroup(kept[0], {v: ks[0].sizes[v] for v in kept[0]}, tuple(ks))]


def _walk_kernel(k: LoopKernel):
    yield from walk(k.body)
    if k.epilogue is not None:
        yield from walk(k.epilogue)


def _cheap(e, most: int) -> bool:
    """Few cheap operations, at most `most` (recomputed by each reader instead of stored)."""
    nodes = list(walk(e))
    ops = [n for n in nodes if isinstance(n, (Add, Mul, Map))]
    return (len(ops) <= most and not any(isinstance(n, Map) and n.fn in EXPENSIVE for n in ops)
            and not any(isinstance(n, (Mask, Rand)) for n in nodes))


def _inline(reader: LoopKernel, producer: LoopKernel) -> LoopKernel:
    """`reader` with its loads of `producer.out` replaced by the producer's
    expression at the loaded index."""
    def visit(e):
        if isinstance(e, Load) and e.buf == producer.out:
            at = dict(e.index)
            return _subst(producer.body, {v: at[v] for v, _ in producer.index})
        return None

    return _map_kernel(reader, visit)


def _map_expr(e, visit):
    """`e` with each node for which `visit` returns an expression replaced by it (the
    others rebuilt around their rewritten operands)."""
    new = visit(e)
    if new is not None:
        return new
    if isinstance(e, (Add, Mul, Map)):
        return replace(e, args=tuple(_map_expr(a, visit) for a in e.args))
    if isinstance(e, Mask):
        return Mask(e.conds, _map_expr(e.arg, visit))
    return e


def _map_kernel(k: LoopKernel, visit) -> LoopKernel:
    """`k` with `_map_expr` applied to its body and epilogue."""
    return replace(k, body=_map_expr(k.body, visit),
                   epilogue=None if k.epilogue is None else _map_expr(k.epilogue, visit))


def _subst(e, mapping: dict[str, Ix]):
    """`e` with loop variables replaced by indices."""
    if isinstance(e, Load):
        return Load(e.buf, tuple((edge, ix.subst(mapping)) for edge, ix in e.index))
    if isinstance(e, Mask):
        return Mask(tuple(Cond(c.ix.subst(mapping), c.op) for c in e.conds), _subst(e.arg, mapping))
    if isinstance(e, (Add, Mul, Map)):
        return replace(e, args=tuple(_subst(a, mapping) for a in e.args))
    if isinstance(e, Rand):
        return replace(e, key=e.key.subst(mapping), counter=e.counter.subst(mapping),
                       folds=tuple(n.subst(mapping) if isinstance(n, Ix) else n for n in e.folds))
    return e


