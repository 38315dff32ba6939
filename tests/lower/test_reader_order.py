"""A layer loop's stacked weight gradients are stored in their weights' order
(`tgc.lower.reader_order`, `StepLowering.reader_order`): examples/gpt2.tg declares
`wo[layer, c2, c]` and `wproj[layer, ff, c]`, whose gradients the declaration order
stored `[layer, c, c2]` and `[layer, c, ff]`, so that AdamW read them transposed
beside the weight and its moments. Golden orders of every weight gradient the reverse
loop returns, the update kernels reading them along the weight's innermost edge, and
the compiled step: the same bits as with the declaration order, and the IR
interpreter's values."""
from pathlib import Path

import numpy as np
import pytest

import tgc
import tgc.lower.steps as steps
from tgc import pipeline
from tgc.lower.lowered import LoopKernel, StepLoop
from tgc.lower.reader_order import arg_order
from tgc.options import Options
from lowered_util import gpt2_start

GPT2 = Path(__file__).resolve().parents[2] / "examples" / "gpt2.tg"
DIMS = {"layer": 2, "head": 2, "hd": 4, "t": 5, "vocab": 7, "batch": 2}


def options(dtype: str) -> Options:
    o = Options(dtype=dtype)
    return o.with_(cpu=o.cpu.with_(blas_min_flops=0))   # every product a GEMM at this size


def lowered():
    src = pipeline.load_source(str(GPT2), dims=DIMS, lookup=False, options=options("f64"))
    compiled, o = pipeline.target(pipeline.lower(src.module, src.options).module, src.options)
    return pipeline.lower_module(compiled, o, stop_after="layout")


def gradient_orders(low) -> dict[str, tuple[str, ...]]:
    """weight -> the order of the reverse loop's stacked result that its first moment's
    update (the kernel reading `m.<weight>`) reads: the weight's gradient."""
    bwd = [k for k in low.kernels if isinstance(k, StepLoop)][-1]
    outs = {b.buf for b in bwd.outs[bwd.carries:]}
    got = {}
    for k in low.kernels:
        if not isinstance(k, LoopKernel):
            continue
        moments = [b for b in k.buffers_read() if b.startswith("m.")]
        read = set(k.buffers_read()) & outs
        if len(moments) == 1 and len(read) == 1:
            got[moments[0][2:]] = low.buffers[read.pop()].order
    return got


def test_each_weight_gradient_is_stored_as_its_weight():
    low = lowered()
    got = gradient_orders(low)
    # golden: every stacked param of the blocks, its gradient in its own order
    assert {n: got[n] for n in ("wq", "wk", "wv", "wo", "wfc", "wproj", "bq", "bfc", "ln1_w")} == {
        "wq": ("layer", "c", "c2"), "wk": ("layer", "c", "c2"), "wv": ("layer", "c", "c2"),
        "wo": ("layer", "c2", "c"), "wfc": ("layer", "c", "ff"), "wproj": ("layer", "ff", "c"),
        "bq": ("layer", "c2"), "bfc": ("layer", "ff"), "ln1_w": ("layer", "c")}
    for name, order in got.items():
        assert low.buffers[name].order == order, name


def test_without_the_rule_wo_and_wproj_gradients_were_transposed(monkeypatch):
    monkeypatch.setattr(steps, "arg_order", lambda *a, **k: None)
    got = gradient_orders(lowered())
    assert got["wo"] == ("layer", "c", "c2") and got["wproj"] == ("layer", "c", "ff")


def start(program, seed: int = 3) -> dict[str, np.ndarray]:
    return gpt2_start(program, DIMS, DIMS["batch"], seed)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_the_step_gives_the_same_bits_as_with_the_declaration_order(dtype, monkeypatch):
    """Only where the gradients lie changes: two steps (the second from the first's
    moments) update every param and moment to the same bits."""
    monkeypatch.setenv("TGC_CACHE", "off")   # two builds of one source: no cached program for the second
    mine = tgc.compile(GPT2, dtype=dtype, dims=DIMS, options=options(dtype))
    with monkeypatch.context() as mp:
        mp.setattr(steps, "arg_order", lambda *a, **k: None)
        decl = tgc.compile(GPT2, dtype=dtype, dims=DIMS, options=options(dtype))
    def stored(program):   # the reverse loop's stacked results' orders
        low = program.lowered
        bwd = [k for k in low.kernels if isinstance(k, StepLoop)][-1]
        return [low.buffers[b.buf].order for b in bwd.outs]
    assert stored(mine) != stored(decl)
    a, b = start(mine), start(mine)
    for _ in range(2):
        la, lb = mine(**a)["loss"], decl(**b)["loss"]
        assert np.array_equal(la, lb)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_the_step_is_the_interpreters():
    """The compiled f64 step against the IR interpreter: the loss and every update
    (the wo and wproj updates read their gradients in the new order)."""
    from tgc.frontend import compile_file
    from tgc.ir.interp import evaluate

    program = tgc.compile(GPT2, dtype="f64", dims=DIMS, options=options("f64"))
    args = start(program)
    ref = Options(dtype="f64", passes=("normalize", "adjoint", "tangent"))
    m = pipeline.lower(compile_file(str(GPT2), ref), ref).module
    want = evaluate(m, {k: np.asarray(v, np.float64) if v.dtype.kind == "f" else v for k, v in args.items()},
                    dtype="f64", dims=DIMS)
    got = program(**args)
    assert abs(float(got["loss"]) - float(want["loss"])) <= 1e-9 * abs(float(want["loss"]))
    for u in m.updates:
        w = np.asarray(want[u.target], np.float64)
        np.testing.assert_allclose(args[u.target], w, rtol=1e-9, atol=1e-9 * max(1e-3, float(np.abs(w).max())),
                                   err_msg=u.target)


class _V:
    """A value of a toy graph: op, operands, edges, attrs."""

    def __init__(self, op, edges, operands=(), name=None):
        self.op, self.edges, self.operands, self.attrs = op, tuple(edges), tuple(operands), (name,)


class _Arg:
    def __init__(self, order):
        self.order = order


class _Fuser:
    def __init__(self, values, args):
        self.users = {id(v): set() for v in values}
        for v in values:
            for o in v.operands:
                self.users[id(o)].add(id(v))
        self.by_id = {id(v): v for v in values}
        self.m = type("M", (), {"args": args})()


def test_arg_order_needs_one_order_among_the_readers():
    edges = ("layer", "c", "c2")
    g = _V("loop", edges)
    p, q = _V("arg", edges, name="p"), _V("arg", edges, name="q")
    s = _V("reduce", ("layer",), [g])                    # a sum of squares: other edges, not followed
    one = _V("map", edges, [g, p])
    args = {"p": _Arg(("layer", "c2", "c")), "q": _Arg(("layer", "c", "c2"))}
    assert arg_order(_Fuser([g, p, q, s, one], args), [g], "layer") == ("c2", "c")
    two = _V("map", edges, [one, q])                     # a reader further on disagrees
    assert arg_order(_Fuser([g, p, q, s, one, two], args), [g], "layer") is None
    args["q"] = _Arg(("c", "layer", "c2"))               # not stored with the loop edge outermost: ignored
    assert arg_order(_Fuser([g, p, q, s, one, two], args), [g], "layer") == ("c2", "c")
    assert arg_order(_Fuser([g], args), [g], "layer") is None
