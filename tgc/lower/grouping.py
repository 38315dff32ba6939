"""The scan a backend's fusing stage runs over a lowered program's kernels (the CPU's
`group`, CUDA's `rowgroup`): each maximal run of consecutive kernels that the stage
may fuse goes to `flush`, every other kernel is kept as it is, in order.

A stage subclasses `Grouper` with `groupable(kernel)` (may it join a group at all),
`outer(members)` (the loops the members share, or () when they cannot form one) and
`flush(members)` (append the group, or the members alone, to `out`). Terminates: one
pass over the kernels; a group has at most MAX_MEMBERS members (a stage's `outer` looks
at all the members so far, so an unbounded group is quadratic work: the gradient of a
1000-link chain of elementwise functions, one group of 2000 kernels, took 16 s to group
and one LLVM function of them 25 s more). The bound is 48, the largest group of
examples/gpt2.tg (examples/train_sort_gpt.tg's has 36), because LLVM's loop passes take
time super-linear in the size of one function: a 12-layer GPT-2 of width 16 written out
without `repeat` (benchmarks/deep_compile.py's `gpt2`) made groups of 128 kernels, one of
them 15,000 lines of LLVM IR and 8.9 s of its 30 s (CPU); in groups of 48 the same
program takes 18 s (24 layers: 70 -> 38.5 s; one step of the 12 layers 0.395 -> 0.403 ms,
its values within an ulp: a register between two members becomes a buffer); `readers` (buffer -> the kernels that read it) is what a
stage's `flush` asks to decide which members' buffers another kernel still needs.

`MemberGroup` is what such a stage's kernel kind shares (the CPU's `LoopGroup`,
CUDA's `RowGroup`): member loop kernels inside shared outer loops, some members'
outputs held in registers (`regs`) rather than buffers; `read_member_parts` reads the
parts of its lowered text that every such kind shares."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from tgc.lower.lowered import Lowered, rename_buffers

MAX_MEMBERS = 48   # kernels in one group at most: a bound on compile time, not a tuned number


class MemberGroup:
    """The buffer queries, renaming and interpretation of a kernel made of member loop
    kernels (`members`) inside shared outer loops (`outer`, sized by `sizes`), where a
    member whose output is in `regs` has no buffer. Mixed into a dataclass with those
    fields."""

    def buffers_read(self) -> set[str]:
        return {b for m in self.members for b in m.buffers_read()} - set(self.regs)

    def writes(self) -> set[str]:
        return {m.out for m in self.members} - set(self.regs)

    def buffers_used(self) -> list[str]:
        names = [b for m in self.members for b in m.buffers_used()]
        return [b for b in dict.fromkeys(names) if b not in self.regs]

    def renamed(self, mapping):
        """The group reading and writing the buffers `mapping` names instead."""
        return replace(self, members=tuple(rename_buffers(m, mapping) for m in self.members),
                       regs=tuple(mapping.get(r, r) for r in self.regs))

    def interpret(self, it) -> None:
        """Run the group in the lowered interpreter `it` (`tgc.lower.interp`): a
        register is an array over the outer edges while the group runs, and the
        members run as `run_members` says."""
        sizes = [it.eval_size(self.sizes[v]) for v in self.outer]
        for r in self.regs:
            it.arrays[r], it.order[r] = np.full(sizes, np.nan, it.fp), self.outer
        try:
            self.run_members(it, sizes)
        finally:
            for r in self.regs:
                del it.arrays[r], it.order[r]

    def run_members(self, it, sizes: list[int]) -> None:
        """Each member over all the outer indices at once, one member after another:
        the same values as the kernel's order, as a member reads what another writes
        only at the outer index it is at."""
        for m in self.members:
            it.loop(m, {})


class Grouper:
    def __init__(self, low: Lowered, out: Lowered):
        self.low, self.out = low, out
        self.readers: dict[str, set[int]] = {}
        for i, k in enumerate(low.kernels):
            for b in k.buffers_read():
                self.readers.setdefault(b, set()).add(i)

    def groupable(self, k) -> bool:
        raise NotImplementedError

    def outer(self, members: list[int]) -> tuple[str, ...]:
        raise NotImplementedError

    def flush(self, members: list[int]) -> None:
        raise NotImplementedError

    def run(self) -> None:
        members: list[int] = []
        for i, k in enumerate(self.low.kernels):
            if 0 < len(members) < MAX_MEMBERS and self.groupable(k) and self.outer(members + [i]):
                members.append(i)
                continue
            self.flush(members)
            members = [i] if self.groupable(k) else []
            if not members:
                self.out.kernels.append(k)
        self.flush(members)


def read_member_parts(reader, t, extra: tuple[str, ...] = ()):
    """The parts a `MemberGroup` kernel's lowered text gives (`reader`: `tgc.lower.text`'s
    walk of its children): (outer loops, their sizes, members, registers, note, and the
    children named in `extra` by name, which the kernel kind reads itself)."""
    outer: list[str] = []
    sizes: dict = {}
    regs, note, members, extras = (), "", [], {}
    for c in t.children:
        if c.data == "outer":
            outer.append(str(c.children[0]))
            sizes[str(c.children[0])] = reader.size(c.children[1])
        elif c.data in extra:
            extras[c.data] = c
        elif c.data == "regs":
            for r in c.children:
                name = str(r.children[0])[1:]
                if name in reader.low.buffers or name in reader.regs:
                    raise reader.error(f"register '%{name}' is also a buffer or another register", r.children[0])
                reader.regs[name] = reader.names(r.children[1])
            regs = tuple(reader.regs)
        elif c.data == "note":
            note = reader.note(c)
        else:
            reader.meta_line = c.meta.line
            members.append(reader.loop(c))
    reader.regs = {}
    return tuple(outer), sizes, tuple(members), regs, note, extras
