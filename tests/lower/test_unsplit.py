"""`tgc.lower.unsplit`: the bias added as a projection is split into heads (examples/
gpt2.tg's queries, keys and values) is computed over the product's own edges, so that
`epilogue` folds it into the GEMM's store and `alias` makes the split a view: the
forward layer step has no pass over the projections left. Golden text of the step's
projection kernels after the CPU's stages, the lowered interpreter against the IR
interpreter, the compiled step against the same step without the rewrite (same bits),
and the cases it leaves alone."""
from pathlib import Path

import numpy as np
import pytest

import tgc
import tgc.lower.unsplit as unsplit
from tgc import pipeline
from tgc.lower.lowered import Add, Buffer, GemmKernel, Ix, Load, LoopKernel, Lowered, StepLoop, View
from tgc.options import Options
from lowered_util import gpt2_start

GPT2 = Path(__file__).resolve().parents[2] / "examples" / "gpt2.tg"
DIMS = {"layer": 2, "head": 2, "hd": 4, "t": 5, "vocab": 7, "batch": 2}


def options(dtype: str) -> Options:
    o = Options(dtype=dtype)
    return o.with_(cpu=o.cpu.with_(blas_min_flops=0))   # every product a GEMM at this size


def lowered(stop_after: str):
    src = pipeline.load_source(str(GPT2), dims=DIMS, lookup=False, options=options("f64"))
    compiled, o = pipeline.target(pipeline.lower(src.module, src.options).module, src.options)
    return pipeline.lower_module(compiled, o, stop_after=stop_after)


GOLDEN = """\
k4: gemm %u44 = %r3[batch, c, t] @ %p6[c, c2]  batch() m(batch, t) n(c2) k(c)
      then %u44[batch, c2, t] = add[1.0, 1.0](acc, %p10[c2])
k5: gemm %u45 = %r3[batch, c, t] @ %p5[c, c2]  batch() m(batch, t) n(c2) k(c)
      then %u45[batch, c2, t] = add[1.0, 1.0](%p9[c2], acc)
k10: gemm %u46 = %r3[batch, c, t] @ %p7[c, c2]  batch() m(batch, t) n(c2) k(c)
      then %u46[batch, c2, t] = add[1.0, 1.0](acc, %p11[c2])"""


def test_the_projections_add_their_bias_in_the_store_and_split_in_place():
    low = lowered("alias")
    fwd = [k for k in low.kernels if isinstance(k, StepLoop)][0].step
    assert "\n".join(f"k{i}: " + fwd.kernels[i].text() for i in (4, 5, 10)) == GOLDEN
    assert {fwd.buffers[u].alias for u in ("u44", "u45", "u46")} == {"r4", "r5", "r6"}
    # no loop kernel of the step reads a projection any more
    for k in fwd.kernels:
        if isinstance(k, LoopKernel):
            assert not ({"u44", "u45", "u46", "r4", "r5", "r6"} & k.buffers_read()), k.text()


def test_unsplit_stage_alone_gives_the_kernel_and_its_copy():
    low = lowered("unsplit")
    fwd = [k for k in low.kernels if isinstance(k, StepLoop)][0].step
    u46 = next(k for k in fwd.kernels if k.out == "u46")
    assert u46.text() == ("loop %u46[batch, c2, t] = add[1.0, 1.0](%t38[batch, c2, t], %p11[c2])\n"
                          "      for batch < 2, t < 5, c2 < 8")
    copies = [k for k in fwd.kernels if isinstance(k, LoopKernel) and k.note == "split"]
    assert [(k.out, k.body) for k in copies] == [
        ("r6", Load("u44", (("batch", Ix.var("batch")), ("c2", Ix.make([("hd", 1), ("head", 4)])), ("t", Ix.var("t"))))),
        ("r5", Load("u45", (("batch", Ix.var("batch")), ("c2", Ix.make([("hd", 1), ("head", 4)])), ("t", Ix.var("t.1"))))),
        ("r4", Load("u46", (("batch", Ix.var("batch")), ("c2", Ix.make([("hd", 1), ("head", 4)])), ("t", Ix.var("s")))))]


@pytest.mark.parametrize("dtype", ["f64", "f32"])
def test_the_lowered_program_is_the_ir_interpreters(dtype):
    from lowered_util import assert_lowered_gives_the_ir_interpreters_values

    src = pipeline.load_source(str(GPT2), dims=DIMS, lookup=False, options=options(dtype))
    compiled, o = pipeline.target(pipeline.lower(src.module, src.options).module, src.options)
    low = pipeline.lower_module(compiled, o, stop_after="alias")
    assert_lowered_gives_the_ir_interpreters_values(compiled, low, dtype)


def start(program, seed: int = 3) -> dict[str, np.ndarray]:
    return gpt2_start(program, DIMS, DIMS["batch"], seed)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_the_step_gives_the_same_bits_as_without_the_rewrite(dtype, monkeypatch):
    monkeypatch.setenv("TGC_CACHE", "off")   # two builds of one source: no cached program for the second
    mine = tgc.compile(GPT2, dtype=dtype, dims=DIMS, options=options(dtype))
    with monkeypatch.context() as mp:
        mp.setattr(unsplit, "_rewrite", lambda *a, **k: None)
        plain = tgc.compile(GPT2, dtype=dtype, dims=DIMS, options=options(dtype))

    def kernels(program):
        fwd = [k for k in program.lowered.kernels if isinstance(k, StepLoop)][0]
        return len(fwd.step.kernels)
    assert kernels(mine) == kernels(plain) - 3
    a, b = start(mine), start(mine)
    for _ in range(2):
        assert np.array_equal(mine(**a)["loss"], plain(**b)["loss"])
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# ---------------------------------------------------------------- what it leaves alone


def toy(index_t, index_x, readers: int = 1, sizes=(("hd", 4), ("head", 2))):
    """A program: gemm t[b, c2] = a @ w; y[b, hd, head] = t[index_t] + x[index_x]
    (and, with readers = 2, another kernel reading t)."""
    from tgc.ir.module import Module

    m = Module()
    low = Lowered(m, "f64")
    low.edges = {"b": 3, "c2": 8, "k": 5, "hd": 4, "head": 2}
    low.buffers = {
        "a": Buffer("a", "f64", ("b", "k"), "arg", 0, ("b", "k")),
        "w": Buffer("w", "f64", ("c2", "k"), "arg", 1, ("k", "c2")),
        "x": Buffer("x", "f64", ("c2",), "arg", 2, ("c2",)),
        "t": Buffer("t", "f64", ("b", "c2"), "temp", order=("b", "c2")),
        "y": Buffer("y", "f64", ("b", "hd", "head"), "out", 0, ("b", "head", "hd")),
        "z": Buffer("z", "f64", ("b", "c2"), "out", 1, ("b", "c2")),
    }
    g = GemmKernel("t", View("a", (("b", "b"), ("k", "k"))), View("w", (("c2", "c2"), ("k", "k"))),
                   (), ("b",), ("c2",), ("k",))
    loops = ("b", "head", "hd")
    y = LoopKernel("y", (("b", Ix.var("b")), ("hd", Ix.var("hd")), ("head", Ix.var("head"))), loops,
                   {"b": 3, **dict(sizes)},
                   Add((1.0, 1.0), (Load("t", (("b", Ix.var("b")), ("c2", index_t))), Load("x", (("c2", index_x),)))))
    ks = [g, y]
    if readers == 2:
        ks.append(LoopKernel("z", (("b", Ix.var("b")), ("c2", Ix.var("c2"))), ("b", "c2"), {"b": 3, "c2": 8},
                             Load("t", (("b", Ix.var("b")), ("c2", Ix.var("c2"))))))
    low.kernels = ks
    return low


SPLIT = Ix.make([("hd", 1), ("head", 4)])


def run(low):
    out = low.staged("unsplit")
    unsplit._unsplit(out)
    return out


def test_a_toy_split_is_rewritten():
    out = run(toy(SPLIT, SPLIT))
    assert [k.out for k in out.kernels] == ["t", "u6", "y"]
    assert out.kernels[1].body == Add((1.0, 1.0), (Load("t", (("b", Ix.var("b")), ("c2", Ix.var("c2")))),
                                                  Load("x", (("c2", Ix.var("c2")),))))


@pytest.mark.parametrize("case", ["second reader", "bias on another index", "not a mixed radix", "no split",
                                  "offsets differ"])
def test_what_it_leaves_alone(case):
    low = {"second reader": lambda: toy(SPLIT, SPLIT, readers=2),
           "bias on another index": lambda: toy(SPLIT, Ix.var("hd")),
           "not a mixed radix": lambda: toy(Ix.make([("hd", 1), ("head", 3)]), Ix.make([("hd", 1), ("head", 3)])),
           "no split": lambda: toy(Ix.var("hd"), Ix.var("hd"), sizes=(("hd", 8), ("head", 1))),
           "offsets differ": lambda: toy(Ix.make([("hd", 2), ("head", 1)]), Ix.make([("hd", 2), ("head", 1)]),
                                         sizes=(("hd", 4), ("head", 2)))}[case]()
    before = [k.out for k in low.kernels]
    assert [k.out for k in run(low).kernels] == before
