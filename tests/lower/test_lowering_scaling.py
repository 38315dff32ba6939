"""Lowering a program written out block by block takes work linear in its depth.

Counted, not timed: the questions the lowering stages and the CPU's region planner ask
of kernels (`buffers_read()`, `writes()`: a stage that asks every later kernel, once
per GEMM, what it reads is quadratic in the program's length). `epilogue`,
`accumulate`, `layout` and `plan` did so (48 unrolled GPT blocks with AdamW: 40 s of
lowering out of 90); they now ask `tgc.lower.lowered.Uses`, an index of who reads and
writes each buffer. `benchmarks/loops.py --unrolled-depths 6,12,24,48 --stages` times
the whole compile by stage.

`Uses` itself is checked against the scans it replaces, on random kernel lists edited
at random.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

from tgc.backends.cpu import regions
from tgc.lower import lowered as L
from tgc.pipeline import load_source, lower, lower_module, target

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import loops  # noqa: E402  (benchmarks/loops.py: the unrolled GPT with AdamW)


def kernel_questions(blocks: int, monkeypatch) -> tuple[int, int]:
    """(kernels, calls of buffers_read and writes) of lowering and planning the regions
    of an unrolled GPT of `blocks` blocks (width 16, AdamW under global-norm clipping)."""
    src = load_source(loops.source(blocks, 16, loop=False, adamw=True), "cpu", "f32", lookup=False)
    module, options = target(lower(src.module, src.options, backend="cpu").module, src.options)
    count = [0]
    with monkeypatch.context() as m:
        for cls in (L.LoopKernel, L.GemmKernel):
            for name in ("buffers_read", "writes"):
                real = getattr(cls, name)
                m.setattr(cls, name, lambda self, real=real: count.__setitem__(0, count[0] + 1) or real(self))
        low = lower_module(module, options, "cpu")
        regions.plan_regions(low, options.cpu)
    return len(low.kernels), count[0]


def test_lowering_asks_each_kernel_a_bounded_number_of_questions(monkeypatch):
    (k2, q2), (k8, q8) = (kernel_questions(n, monkeypatch) for n in (2, 8))
    assert k8 > 2.5 * k2, (k2, k8)                 # the program does grow with its depth
    # 4x the blocks: about 3.5x the kernels and the questions (a scan of the later
    # kernels per GEMM gave 13x: 14,178 -> 185,489 calls)
    assert q8 <= 1.25 * q2 * k8 / k2, (q2, q8, k2, k8)
    assert q8 <= 80 * k8, (q8, k8)                  # 59 -> 66 with cpu/hoist's moves; the scans: 840 per kernel


class _K:
    """A stand-in kernel: what it reads and writes."""

    def __init__(self, reads, writes):
        self.r, self.w = set(reads), set(writes)

    def buffers_read(self):
        return set(self.r)

    def writes(self):
        return set(self.w)


def test_uses_answers_as_the_scans_do():
    rng = random.Random(0)
    bufs = [f"b{i}" for i in range(6)]

    def kernel():
        return _K(rng.sample(bufs, rng.randint(0, 3)), rng.sample(bufs, rng.randint(0, 2)))

    for _ in range(200):
        ks = [kernel() for _ in range(rng.randint(0, 12))]
        uses = L.Uses(ks)
        slots = list(ks)
        for _ in range(rng.randint(0, 6)):   # edits: remove or replace a kernel
            if not slots:
                break
            i = rng.randrange(len(slots))
            new = None if rng.random() < 0.5 else kernel()
            slots[i] = new
            uses.set(i, new)
        assert uses.kernels() == [k for k in slots if k is not None]
        for b in bufs:
            for lo in range(-1, len(slots) + 1):
                for hi in [None, *range(lo + 1, len(slots) + 1)]:
                    span = range(lo + 1, len(slots) if hi is None else hi)
                    assert uses.readers(b, lo, hi) == [j for j in span if slots[j] and b in slots[j].buffers_read()]
                    assert uses.writers(b, lo, hi) == [j for j in span if slots[j] and b in slots[j].writes()]
