"""rowgroup: the CUDA backends' own lowering stage: a row's reductions and the
elementwise kernels that consume them, over the same rows, become one kernel
(`RowGroup`, a kind of kernel only these backends have: it says itself how neutral
code renames and interprets it).

`Lowered` (after `layout`) -> `Lowered`. `fuse` gives one loop nest per materialized
value, so a softmax is a max, a logsumexp and an exp kernel, and a layernorm's
forward and backward are seven kernels, each reading the row again from memory and
each a launch of its own. Kernels that follow one another and all keep the same
first loops (the `outer` loops: the rows) become one group, which the code generator
(`codegen`) runs as one kernel: one block, or one warp for short rows, per row; each
member in turn over the row's elements, its reductions combined by warp shuffles and
shared memory; a row's statistics (mean, max, sum) in registers.

A kernel joins the group before it when:
- both are loop kernels (not scatters, not the final copies of updates) that write
  their whole output at the identity index, and the longest common prefix of their
  kept loops (same variables, same extents) is not empty;
- every read of a buffer an earlier member wrote is at the same outer index (the
  outer variables themselves): for that row the value is complete once the block
  has passed the barrier after its writer;
- a member that reduces to a value per row (no kept loop besides the outer ones)
  has bounds on its reduced loops that depend on the outer loops only, as the
  threads share those loops out before they start (a member that also keeps inner
  loops reduces serially per element, with any bounds).
A group has at least two members and at least one reduction. A member's output that
is a temporary over exactly the outer edges, read by no kernel outside the group,
becomes a register (`regs`: no buffer). Other temporaries stay buffers (the
generated kernel may keep them in registers and skip the store when the row fits,
but it keeps a path that writes and re-reads them).

Then (`CudaOptions.row_columns`, `join_columns`) a column sum over a group's rows
(`out[c] = sum[outer](...)`: a bias or weight gradient, `column_member`) joins the
nearest group before it that it can join, as its last member, its loops the outer
ones then the group's inner ones: a sum over exactly the group's outer loops and its
first member's inner loops (same extents, no bounds), with an epilogue that reads no
outer loop, that reads what the group wrote only at the outer index (where the row is
complete) and no register of it; the group reads or writes rows the sum reads (so the
sum costs no more reads) and has fewer than `CudaOptions.row_columns_max` column sums
(each keeps `row_regs` doubles a thread in registers); and the sum moves up to the
group: no kernel in between writes a buffer it reads, or reads or writes its output.
The kernel then sums it while the row is in hand (a partial per slot of rows, the
slots' partials added in a fixed order by a second kernel: `rowgen`)
instead of a kernel reading the rows again; a temporary over the outer edges that now
only the group reads becomes a register.

Exact: members run in their order for each row, and a member reads another's
output only at its own row, where it is complete; the interpreter runs the members
one after another over all rows, which computes the same values (a column member's
sum over all rows included: the generated kernel adds its terms in another order, in
double, as the column tiles it replaces do). A column sum moved up reads the same
values (nothing in between writes them) and nothing in between sees its output.
Terminates: one pass over the kernels, each joining or ending one group; then one
pass over the kernels, each column sum joining at most one group.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tgc.ir.passes import Pass
from tgc.ir.sizes import Size, size_str
from tgc.lower.lowered import IdLoad, Ix, Load, LoopKernel, Lowered, walk
from tgc.lower.grouping import Grouper, MemberGroup, read_member_parts
from tgc.lower.text import KernelForm
from tgc.options import Options

ROW_REDUCTIONS = ("sum", "max", "min", "maxshift", "logsumexp")


@dataclass
class RowGroup(MemberGroup):
    """Loop kernels run one after another for each index of the shared outer loops
    `outer` (kept by every member, outermost first): each member runs its remaining
    (inner) loops with the outer ones fixed, and reads what an earlier member wrote
    only at that outer index. A member whose output is in `regs` has no buffer: its
    value per outer index lives in a register and only later members read it."""
    outer: tuple[str, ...]
    sizes: dict[str, Size]
    members: tuple[LoopKernel, ...]
    regs: tuple[str, ...] = ()
    note: str = ""
    blocks = 0                 # (no partial sums: the verifier's groups may have blocks)
    kind = "rowgroup"          # what `tgc explain` calls it

    def can_retarget(self, low: Lowered, target: str, tmp: str) -> bool:
        """Never (plan keeps the copy into an updated buffer): the threads of a block
        share a row's elements, so no order of reads before writes is promised."""
        return False

    def text(self) -> str:
        loops = ", ".join(f"{v} < {size_str(self.sizes[v])}" for v in self.outer)
        regs = ", ".join(f"%{r}[{', '.join(self.outer_edges(r))}]" for r in self.regs)
        regs = f"  reg {regs}" if regs else ""
        body = "".join(f"\n    {m.text()}".replace("\n      for", "\n          for") for m in self.members)
        return f"rowgroup for {loops}{regs}" + (f"    # {self.note}" if self.note else "") + body

    def outer_edges(self, r: str) -> tuple[str, ...]:
        writer = next((m for m in self.members if m.out == r), None)
        return tuple(e for e, _ in writer.index) if writer else ()


def read_rowgroup(reader, t) -> RowGroup:
    """A `rowgroup for ...` kernel of the lowered text (`reader`: `tgc.lower.text`'s walk)."""
    outer, sizes, members, regs, note, _ = read_member_parts(reader, t)
    return RowGroup(outer, sizes, members, regs, note)


# shared outer loops (the rows), then the members
ROWGROUP_FORM = KernelForm("rowgroup", r"""
rowgroup: "rowgroup" "for" outer ("," outer)* regs? note _NL loop+
""", read_rowgroup)


@dataclass(frozen=True)
class RowGroups(Pass[Lowered, Lowered]):
    """Fuse a row's reductions and their consumers into one kernel per group of rows."""

    name = "rowgroup"
    takes = gives = "lowered"

    def run(self, low: Lowered, options: Options) -> Lowered:
        out = low.staged("rowgroup")
        if not options.cuda.row_groups:
            return out
        out.kernels = []
        _Grouper(low, out).run()
        if options.cuda.row_columns:
            join_columns(out, options.cuda.row_columns_max)
        return out


def inner_loops(m: LoopKernel, outer) -> tuple[str, ...]:
    return tuple(m.loops[len(outer):])


def column_member(m: LoopKernel, outer, sizes: dict) -> bool:
    """Whether `m` is a column sum over the rows `outer` (of extents `sizes`): a sum
    over exactly the outer loops (same extents) that keeps others, with no bounds and
    an epilogue that reads no outer loop."""
    if not (outer and isinstance(m, LoopKernel) and m.reduce == "sum" and not m.scatter and not m.bounds
            and set(m.red) == set(outer) and len(m.loops) > len(outer)):
        return False
    if any(m.sizes[v] != sizes[v] for v in outer):
        return False
    if m.epilogue is not None:
        for e in walk(m.epilogue):
            if isinstance(e, Load) and any(ix.vars() & set(outer) for _, ix in e.index):
                return False
    return True


def join_columns(low: Lowered, most: int) -> None:
    """Each column sum of `low.kernels` into the nearest row group before it that it
    can join and move up to, that reads or writes the rows it sums, and that has fewer
    than `most` column sums (the module docstring), in place."""
    ks = low.kernels
    j = 0
    while j < len(ks):
        c = ks[j]
        if isinstance(c, LoopKernel) and c.reduce == "sum" and low.buffers[c.out].kind != "arg":
            for i in range(j - 1, -1, -1):
                k = ks[i]
                if isinstance(k, RowGroup) and _joins(k, c) and _columns(k) < most:
                    del ks[j]
                    ks[i] = _grown(low, k, c, i)
                    j -= 1
                    break
                if k.writes() & c.buffers_read() or c.out in k.writes() or c.out in k.buffers_read():
                    break
        j += 1


def _columns(g: RowGroup) -> int:
    return sum(1 for m in g.members if column_member(m, g.outer, g.sizes))


def _joins(g: RowGroup, c: LoopKernel) -> bool:
    """Whether the column sum `c` can be a member of `g`, after its members, and reads
    rows the group reads or writes."""
    if not column_member(c, g.outer, g.sizes):
        return False
    rows = {ld.buf for ld in _loads(c) if any(ix.vars() & set(g.outer) for _, ix in ld.index)}
    if not rows & (g.buffers_read() | g.writes()):
        return False
    inner0 = inner_loops(g.members[0], g.outer)
    kept = [v for v in c.loops if v not in c.red]
    if set(kept) != set(inner0) or len(kept) != len(inner0) or any(c.sizes[v] != g.members[0].sizes[v] for v in kept):
        return False
    written = {m.out for m in g.members}
    if c.out in written or c.out in g.buffers_read() or _id_bufs(c) & written:
        return False
    if set(g.regs) & c.buffers_read():
        return False
    return all(dict(ld.index).get(v) == Ix.var(v) for ld in _loads(c) if ld.buf in written for v in g.outer)


def _grown(low: Lowered, g: RowGroup, c: LoopKernel, at: int) -> RowGroup:
    """`g` (the `at`th kernel) with the column sum `c` as its last member, its loops
    the outer ones then the group's inner ones (the same loops: its sum is over the
    same points); a member's output that is a temporary over the outer edges, which no
    other kernel reads now, becomes a register."""
    members = g.members + (replace(c, loops=tuple(g.outer) + inner_loops(g.members[0], g.outer)),)
    others = {b for n, k in enumerate(low.kernels) if n != at for b in k.buffers_read()}
    regs = list(g.regs)
    for m in members:
        b = low.buffers.get(m.out)
        if b is not None and b.kind == "temp" and set(b.edges) == set(g.outer) and m.out not in others:
            regs.append(m.out)
            del low.buffers[m.out]
    return RowGroup(g.outer, g.sizes, members, tuple(regs), g.note)


def _loads(k: LoopKernel):
    for root in [k.body] + ([k.epilogue] if k.epilogue is not None else []):
        for n in walk(root):
            if isinstance(n, Load):
                yield n


def _id_bufs(k: LoopKernel) -> set[str]:
    """Buffers read as ids (inside indices, masks, bounds or draws)."""
    out = set()
    ixs = [ix for _, ix in k.index] + [ix for lo, hi in k.bounds.values() for ix in lo + hi]
    for root in [k.body] + ([k.epilogue] if k.epilogue is not None else []):
        for n in walk(root):
            if isinstance(n, Load):
                ixs += [ix for _, ix in n.index]
            elif hasattr(n, "conds"):
                ixs += [c.ix for c in n.conds]
    while ixs:
        ix = ixs.pop()
        for atom, _ in ix.terms:
            if isinstance(atom, IdLoad):
                out.add(atom.buf)
                ixs += [i for _, i in atom.index]
            elif hasattr(atom, "num"):
                ixs.append(atom.num)
    return out


class _Grouper(Grouper):

    def groupable(self, k) -> bool:
        if not (isinstance(k, LoopKernel) and k.loops and not k.scatter
                and all(ix == Ix.var(e) for e, ix in k.index) and self.low.buffers[k.out].kind != "arg"):
            return False
        return not k.reduce or k.reduce in ROW_REDUCTIONS

    def outer(self, members: list[int]) -> tuple[str, ...]:
        """The group's outer loops, or () when these kernels cannot form one."""
        ks = [self.low.kernels[i] for i in members]

        def kept_prefix(k: LoopKernel) -> list[str]:
            out = []
            for v in k.loops:
                if v in k.red:
                    break
                out.append(v)
            return out

        prefix = kept_prefix(ks[0])
        for k in ks[1:]:
            mine = kept_prefix(k)
            n = 0
            while n < min(len(prefix), len(mine)) and prefix[n] == mine[n] and ks[0].sizes[prefix[n]] == k.sizes[mine[n]]:
                n += 1
            prefix = prefix[:n]
        if not prefix:
            return ()
        written: set[str] = set()
        for k in ks:
            inner = set(inner_loops(k, prefix))
            if k.reduce and not (inner - set(k.red)):   # a value per row: threads share the reduced loops
                if any(ix.vars() & set(k.red) for lo, hi in k.bounds.values() for ix in lo + hi):
                    return ()
            if _id_bufs(k) & written:
                return ()
            for ld in _loads(k):
                if ld.buf in written and any(dict(ld.index).get(v) != Ix.var(v) for v in prefix):
                    return ()
            written.add(k.out)
        return tuple(prefix)

    def flush(self, members: list[int]) -> None:
        if not members:
            return
        ks = [self.low.kernels[i] for i in members]
        if len(ks) < 2 or not any(k.reduce for k in ks):
            self.out.kernels += ks
            return
        outer = self.outer(members)
        outside = set(range(len(self.low.kernels))) - set(members)
        bufs = self.out.buffers
        regs = []
        for k in ks:
            b = bufs[k.out]
            if b.kind == "temp" and set(b.edges) == set(outer) and not (self.readers.get(k.out, set()) & outside):
                regs.append(k.out)
        for r in regs:
            del bufs[r]
        notes = [k.note for k in ks if k.note]
        self.out.kernels.append(RowGroup(outer, {v: ks[0].sizes[v] for v in outer}, tuple(ks), tuple(regs),
                                         note="; ".join(dict.fromkeys(notes))[:80]))
