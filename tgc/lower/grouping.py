"""The scan a backend's fusing stage runs over a lowered program's kernels (the CPU's
`group`, CUDA's `rowgroup`): each maximal run of consecutive kernels that the stage
may fuse goes to `flush`, every other kernel is kept as it is, in order.

A stage subclasses `Grouper` with `groupable(kernel)` (may it join a group at all),
`outer(members)` (the loops the members share, or () when they cannot form one) and
`flush(members)` (append the group, or the members alone, to `out`). Terminates: one
pass over the kernels; `readers` (buffer -> the kernels that read it) is what a
stage's `flush` asks to decide which members' buffers another kernel still needs."""
from __future__ import annotations

from tgc.lower.lowered import Lowered


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
            if members and self.groupable(k) and self.outer(members + [i]):
                members.append(i)
                continue
            self.flush(members)
            members = [i] if self.groupable(k) else []
            if not members:
                self.out.kernels.append(k)
        self.flush(members)
