"""A loop group's output written over a buffer the group reads for the last time (a
helper of the CPU group stage, `tgc.backends.cpu.group`, run on each program after
grouping; `CpuOptions.group_in_place`).

What it rewrites. A group member writing a temporary X that takes the place of a
temporary Y the group reads last: in a streamed attention's step the softmax group
reads the scores S row by row and writes the weights P, and the gradient's group reads
dP and writes dS, each [rows, keys] (8 MB a step at t = 8192). `plan` gives a kernel's
inputs and outputs different slots (a kernel never reads and writes one slot), so each
output row is a fresh line: the CPU reads it from memory before writing it (a store
that misses the cache), and the step holds four such matrices at once. Written over
the row it has just read, the store hits the cache and the step holds two.

The rule: X becomes Y (every kernel from the group on reads and writes Y instead; X's
buffer goes) when
- both are temporaries (no alias, no layout preference, neither a register of the
  group) with the same element type, edges and order;
- the group is the last kernel that uses Y, and no member of it writes Y;
- X is written by exactly one member of the group and by no other kernel of the
  program, and no kernel before the group uses it;
- `LoopGroup.can_retarget(Y, X)` (the test plan's in-place updates ask; here from each
  member's loads gathered once per group, `_retargets`): no member after
  X's writer reads Y, and every member up to it reads Y only at the element it writes.
  Members run in order at each index of the group's outer loops, so every element of Y
  is read before it is overwritten, and no index reads another's.

Left alone: a program holding a mask (`Mask`) while `CpuOptions.causal_gemm` is on
(tgc.backends.cpu.causal keeps its facts, "0 where the mask rejects", per buffer; a
buffer holding two values lost them, and with them a causal product's `tri` form:
tests/backends/test_cpu_causal.py). A stream's runs load their masks from a buffer.

Exact: every member computes the same expression of the same values (each element of Y
is read before its place takes X's value; Y is not read after the group). Only memory
changes: one slot fewer. Terminates: one pass over the kernels; each member's output
is renamed at most once.
"""
from __future__ import annotations

from tgc.lower.lowered import Load, LoopKernel, Lowered, Mask, rename_buffers, walk


def has_mask(low: Lowered) -> bool:
    """Whether a loop kernel of `low` (or a group's member) holds a mask (`Mask`)."""
    for k in low.kernels:
        for m in getattr(k, "members", (k,)):
            if not isinstance(m, LoopKernel):
                continue
            for e in (m.body, m.epilogue):
                if e is not None and any(isinstance(n, Mask) for n in walk(e)):
                    return True
    return False


def _users(kernels: list) -> dict[str, list[int]]:
    users: dict[str, list[int]] = {}
    for i, k in enumerate(kernels):
        for b in k.buffers_used():
            users.setdefault(b, []).append(i)
    return users


def _writers(kernels: list) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, k in enumerate(kernels):
        for b in (k.writes() if hasattr(k, "writes") else {k.out}):
            out.setdefault(b, []).append(i)
    return out


def _plain(low: Lowered, name: str) -> bool:
    b = low.buffers.get(name)
    return b is not None and b.kind == "temp" and b.alias is None and b.prefer is None and b.order is not None


def _member_reads(g, names: set[str]) -> dict[str, list[tuple[int, set]]]:
    """For each of `names`, the members of group `g` that load it: (position, the
    indices they load it at); each member's expressions walked once."""
    out: dict[str, list[tuple[int, set]]] = {}
    for j, m in enumerate(g.members):
        at: dict[str, set] = {}
        for e in (m.body, m.epilogue):
            if e is None:
                continue
            for n in walk(e):
                if isinstance(n, Load) and n.buf in names:
                    at.setdefault(n.buf, set()).add(n.index)
        for b, ix in at.items():
            out.setdefault(b, []).append((j, ix))
    return out


def _retargets(g, reads: dict, w: int, y: str) -> bool:
    """`LoopGroup.can_retarget(y, member w's output)` from the loads `_member_reads`
    gathered: no member after w reads y, and every member up to it (w itself a plain
    elementwise member) reads y only at the index w writes."""
    writer = g.members[w]
    for j, ix in reads.get(y, ()):
        if j > w or (j == w and (writer.reduce or writer.scatter or writer.epilogue is not None)):
            return False
        if ix != {writer.index}:
            return False
    return True


def write_in_place(low: Lowered, is_group) -> None:
    """Rewrite `low.kernels` (and drop the renamed buffers) as the module docstring says;
    `is_group(k)`: whether kernel `k` is a loop group (`LoopGroup`). Each kernel's
    buffers are asked once; a renaming updates the users' and writers' lists of its two
    buffers and renames only the kernels that use the renamed one (asking again after
    each renaming made the stage quadratic: tests/lower/test_lowering_scaling.py)."""
    kernels = list(low.kernels)
    users, writers = _users(kernels), _writers(kernels)
    for i, g in enumerate(kernels):
        if not is_group(g):
            continue
        # the group's candidates Y: temporaries it reads for the last time and does not write
        written = g.writes()
        last = [y for y in sorted(g.buffers_read()) if users.get(y, [])[-1:] == [i] and y not in written
                and y not in g.regs and _plain(low, y)]
        if not last:
            continue
        reads = _member_reads(g, set(last))
        for w, m in enumerate(g.members):
            x = m.out
            if x in g.regs or not _plain(low, x) or writers.get(x) != [i] or users[x][0] != i:
                continue
            if sum(1 for n in g.members if n.out == x) != 1:
                continue
            bx = low.buffers[x]
            for y in last:
                by = low.buffers[y]
                if (by.dtype, by.edges, by.order) != (bx.dtype, bx.edges, bx.order) or not _retargets(g, reads, w, y):
                    continue
                for j in users[x]:
                    kernels[j] = rename_buffers(kernels[j], {x: y})
                users[y] = sorted(set(users[y]) | set(users.pop(x)))
                writers[y] = sorted(set(writers.get(y, [])) | set(writers.pop(x)))
                del low.buffers[x]
                g = kernels[i]
                last.remove(y)
                break
    low.kernels = kernels
