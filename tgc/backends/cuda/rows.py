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
A column sum over the group's rows (`out[c] = sum[outer](...)`: a bias or weight
gradient, `column_member`) joins the group too, after its row members, when it runs
over the outer loops then exactly the first member's inner loops (same variables,
same extents, no bounds), its epilogue reads no outer loop, and it reads what a member
wrote only at the outer index: it is a member the kernel accumulates while the row
is in hand (a partial per slot of rows, the slots' partials added in a fixed order by
a second kernel: codegen's `rowgroup`), instead of a kernel reading the rows again.
No later member reads its output (complete only after every row).
A group has at least two members and at least one reduction. A member's output that
is a temporary over exactly the outer edges, read by no kernel outside the group,
becomes a register (`regs`: no buffer). Other temporaries stay buffers (the
generated kernel may keep them in registers and skip the store when the row fits,
but it keeps a path that writes and re-reads them).

Exact: members run in their order for each row, and a member reads another's
output only at its own row, where it is complete; the interpreter runs the members
one after another over all rows, which computes the same values (a column member's
sum over all rows included; the generated kernel adds its terms in another order, in
double, as the column tiles it replaces do). Terminates: one
pass over the kernels, each joining or ending one group.
"""
from __future__ import annotations

from dataclasses import dataclass

from tgc.ir.passes import Pass
from tgc.ir.sizes import Size, size_str
from tgc.lower.lowered import IdLoad, Ix, Load, LoopKernel, Lowered, walk
from tgc.lower.grouping import Grouper, MemberGroup, read_member_parts
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
        _Grouper(low, out, options.cuda.row_columns).run()
        return out


def inner_loops(m: LoopKernel, outer) -> tuple[str, ...]:
    return tuple(m.loops[len(outer):])


def column_member(m: LoopKernel, outer, sizes: dict) -> bool:
    """Whether `m` is a column sum over the rows `outer` (of extents `sizes`): a sum
    whose loops start with the outer ones (same extents), which it reduces and no
    other, with no bounds, and an epilogue that reads no outer loop."""
    n = len(outer)
    if not (n and m.reduce == "sum" and not m.scatter and not m.bounds and tuple(m.loops[:n]) == tuple(outer)
            and set(m.red) == set(outer) and len(m.loops) > n):
        return False
    if any(m.sizes[v] != sizes[v] for v in outer):
        return False
    if m.epilogue is not None:
        for e in walk(m.epilogue):
            if isinstance(e, Load) and any(ix.vars() & set(outer) for _, ix in e.index):
                return False
    return True


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

    def __init__(self, low: Lowered, out: Lowered, columns: bool):
        super().__init__(low, out)
        self.columns = columns

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

        # column sums (no kept prefix: their first loop is reduced) come after the row members
        nrows = next((j for j, k in enumerate(ks) if not kept_prefix(k)), len(ks))
        rows, cols = ks[:nrows], ks[nrows:]
        if not rows or any(kept_prefix(k) for k in cols) or (cols and not self.columns):
            return ()
        prefix = kept_prefix(rows[0])
        for k in rows[1:]:
            mine = kept_prefix(k)
            n = 0
            while n < min(len(prefix), len(mine)) and prefix[n] == mine[n] and ks[0].sizes[prefix[n]] == k.sizes[mine[n]]:
                n += 1
            prefix = prefix[:n]
        if not prefix:
            return ()
        inner0 = inner_loops(rows[0], prefix)
        for k in cols:
            if not column_member(k, prefix, ks[0].sizes) or inner_loops(k, prefix) != inner0 \
                    or any(k.sizes[v] != rows[0].sizes[v] for v in inner0):
                return ()
            if {c.out for c in cols} & k.buffers_read():    # complete only after every row
                return ()
        written: set[str] = set()
        for j, k in enumerate(ks):
            if j >= nrows:
                if _id_bufs(k) & written:
                    return ()
                for ld in _loads(k):
                    if ld.buf in written and any(dict(ld.index).get(v) != Ix.var(v) for v in prefix):
                        return ()
                written.add(k.out)
                continue
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
