"""The lowered-program verifier (tgc/lower/verify.py): every rule it states catches a
program that breaks it (the stages' own output passes it: the manager runs it after
lowering, and the round-trip test after every stage of every example)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tgc import pipeline
from tgc.backends.cpu.group import LoopGroup
from tgc.lower.lowered import Acc, Const, GemmKernel, Ix, Load, LoopKernel, Map, View
from tgc.lower.verify import VerifyError, verify_lowered
from tgc.pipeline import lower_module
from tgc.options import Options

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mlp():
    opts = Options()
    module = pipeline.lower(pipeline.load(str(ROOT / "examples" / "mlp.tg"), opts), opts).module
    return module, opts


def planned(mlp, stop_after="plan"):
    module, opts = mlp
    return lower_module(module, opts, stop_after=stop_after)


def first(low, kind, pred=lambda k: True) -> int:
    return next(i for i, k in enumerate(low.kernels) if isinstance(k, kind) and pred(k))


def fails(low, match: str) -> None:
    with pytest.raises(VerifyError, match=match):
        verify_lowered(low)


def test_every_stage_of_mlp_verifies(mlp):
    for stage in ("fuse", "layout", "group", "plan"):
        verify_lowered(planned(mlp, stage))


def test_reads_only_defined_buffers(mlp):
    low = planned(mlp, "fuse")
    i = first(low, LoopKernel, lambda k: any(isinstance(n, Load) and low.buffers[n.buf].kind == "temp"
                                              for n in [k.body]))
    low.kernels.insert(0, low.kernels.pop(i))
    fails(low, r"k0: reads '%t\d+' before anything writes it")


def test_writes_only_update_targets_among_arguments(mlp):
    low = planned(mlp, "fuse")
    i = first(low, LoopKernel)
    low.kernels[i] = replace(low.kernels[i], out="x", index=tuple((e, Ix.var(e)) for e in low.buffers["x"].edges),
                             loops=low.buffers["x"].edges, sizes={e: low.size(e) for e in low.buffers["x"].edges},
                             body=Const(0.0), reduce="", red=(), epilogue=None)
    fails(low, r"writes argument '%x', which no update targets")


def test_every_output_is_written(mlp):
    low = planned(mlp, "fuse")
    del low.kernels[first(low, LoopKernel, lambda k: k.out == "correct")]
    fails(low, r"output 'correct' \(out 1\) is never written")


def test_loop_variables_are_bound(mlp):
    low = planned(mlp, "fuse")
    i = first(low, LoopKernel, lambda k: len(k.loops) == 2 and not k.reduce)
    k = low.kernels[i]
    low.kernels[i] = replace(k, loops=k.loops[:1], sizes={k.loops[0]: k.sizes[k.loops[0]]})
    fails(low, rf"k{i}: index uses '{k.loops[1]}', which is not a loop here")


def test_sizes_are_consistent(mlp):
    low = planned(mlp, "fuse")
    i = first(low, LoopKernel, lambda k: not k.reduce and not k.bounds)
    k = low.kernels[i]
    v = k.loops[0]
    low.kernels[i] = replace(k, sizes={**k.sizes, v: 7})
    fails(low, rf"k{i}: loop '{v}' runs over 7 but writes edge")


def test_acc_only_in_an_epilogue(mlp):
    low = planned(mlp, "fuse")
    i = first(low, LoopKernel)
    low.kernels[i] = replace(low.kernels[i], body=Map("exp", (Acc(),)))
    fails(low, rf"k{i}: 'acc' outside the epilogue of a reduction")


def test_reduced_loops_are_loops(mlp):
    low = planned(mlp, "fuse")
    i = first(low, LoopKernel, lambda k: bool(k.reduce))
    low.kernels[i] = replace(low.kernels[i], red=low.kernels[i].red + ("nope",))
    fails(low, rf"k{i}: reduces over 'nope', which is not one of its loops")


def test_gemm_operands_agree_on_sizes(mlp):
    low = planned(mlp, "layout")
    i = first(low, GemmKernel)
    g = low.kernels[i]
    k = g.k[0]
    # read operand b through a view whose k edge is another buffer edge of a different size
    other = next(b for v, b in g.b.edges if v != k and low.size(b) != low.size(dict(g.b.edges)[k]))
    swapped = tuple((v, other if v == k else dict(g.b.edges)[k] if b == other else b) for v, b in g.b.edges)
    low.kernels[i] = replace(g, b=View(g.b.buf, swapped))
    fails(low, rf"k{i}: GEMM operands disagree on the size of")


def test_registers_are_written_before_they_are_read(mlp):
    low = planned(mlp, "group")
    i = first(low, LoopGroup, lambda g: bool(g.regs))
    g = low.kernels[i]
    j = next(j for j, m in enumerate(g.members) if m.out in g.regs)
    low.kernels[i] = replace(g, members=tuple(m for jj, m in enumerate(g.members) if jj != j))
    fails(low, rf"k{i}: reads register '%{g.members[j].out}' before a member writes it")


def test_workspace_slots(mlp):
    low = planned(mlp)
    temps = [b for b in low.buffers.values() if b.kind == "temp"]
    temps[0].slot = len(low.slots)
    fails(low, rf"buffer '%{temps[0].name}' is in slot {len(low.slots)}, outside the workspace's")
    low = planned(mlp)
    low.slots[low.buffers[temps[0].name].slot] = (1,)
    fails(low, rf"does not list the size of '%{temps[0].name}'")
    low = planned(mlp)
    for b in low.buffers.values():
        if b.kind == "temp":
            b.slot = 0
    low.slots = [tuple(dict.fromkeys(s for sizes in low.slots for s in sizes))]
    fails(low, r"share slot 0 while both are alive")
    low = planned(mlp)
    next(b for b in low.buffers.values() if b.kind == "temp").slot = None
    fails(low, r"has no workspace slot after plan")


def test_buffers_match_the_module(mlp):
    low = planned(mlp, "fuse")
    low.buffers["x"].index = 1
    fails(low, r"buffers '%\w+' and '%x' are both arg 1|is arg 1, but the module's argument 1 is 'y'")
    low = planned(mlp, "layout")
    low.buffers["y"].order = ("batch",)
    fails(low, r"buffer '%y' order \[batch\] is not an order of its edges")
