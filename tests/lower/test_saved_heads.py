"""Attention's heads in a layer loop (examples/gpt2.tg): the forward step stores the
keys, queries and values it keeps for the backward as its projections' rows,
`[batch, t, head, hd]` (`StepLowering.split_order`), its batched products read them
there (`fuse`: a GEMM operand whose rename has a buffer of its own reads that buffer,
no copy under the other name), and the backward loop binds those buffers as they are
stored (`StepLowering.stored_order`). Golden text of the forward step's attention
kernels, and the compiled step against the IR interpreter in f64 and f32."""
from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.frontend import compile_file
from tgc.ir.interp import evaluate
from tgc.lower.lowered import GemmKernel, LoopKernel, StepLoop
from tgc.options import Options
from lowered_util import gpt2_start

GPT2 = Path(__file__).resolve().parents[2] / "examples" / "gpt2.tg"
DIMS = {"layer": 2, "head": 2, "hd": 4, "t": 5, "vocab": 7}
BATCH = 2


def options(dtype: str) -> Options:
    o = Options(dtype=dtype)
    return o.with_(cpu=o.cpu.with_(blas_min_flops=0))   # every product a GEMM at this size


def lowered():
    src = pipeline.load_source(str(GPT2), dims={**DIMS, "batch": BATCH}, lookup=False, options=options("f64"))
    compiled, o = pipeline.target(pipeline.lower(src.module, src.options).module, src.options)
    return pipeline.lower_module(compiled, o, stop_after="layout")


# the forward step's attention: the biases are added straight into the step's stored
# values (r4), keys (r5) and queries (r6), in their projections' order, and the batched
# scores product reads them there (k8; k14, p @ v, reads r4)
GOLDEN = """\
k4: gemm %t33 = %r3[batch, c, t] @ %p6[c, c2]  batch() m(batch, t) n(c2) k(c)
k5: loop %r6[batch, hd, head, t] = add[1.0, 1.0](%t33[batch, hd + 4*head, t], %p10[hd + 4*head])
      for batch < 2, t < 5, head < 2, hd < 4
k6: gemm %t34 = %r3[batch, c, t] @ %p5[c, c2]  batch() m(batch, t) n(c2) k(c)
k7: loop %r5[batch, hd, head, t.1] = add[1.0, 1.0](%p9[hd + 4*head], %t34[batch, hd + 4*head, t.1])
      for batch < 2, t.1 < 5, head < 2, hd < 4
k8: gemm %t35 = %r6[batch, hd, head, t] @ %r5[batch, hd, head, t.1]  batch(batch, head) m(t) n(t.1) k(hd)
k12: gemm %t38 = %r3[batch, c, t] @ %p7[c, c2]  batch() m(batch, t) n(c2) k(c)
k13: loop %r4[batch, hd, head, s] = add[1.0, 1.0](%t38[batch, hd + 4*head, s], %p11[hd + 4*head])
      for batch < 2, s < 5, head < 2, hd < 4"""


def test_saved_heads_are_stored_as_projection_rows_and_read_in_place():
    low = lowered()
    loops = [k for k in low.kernels if isinstance(k, StepLoop)]
    fwd, bwd = loops[0], loops[-1]
    assert not fwd.reverse and bwd.reverse
    step = fwd.step
    orders = {n: step.buffers[n].order for n in ("r4", "r5", "r6")}
    assert orders == {"r4": ("batch", "s", "head", "hd"), "r5": ("batch", "t.1", "head", "hd"),
                      "r6": ("batch", "t", "head", "hd")}
    assert "\n".join(f"k{i}: " + step.kernels[i].text() for i in (4, 5, 6, 7, 8, 12, 13)) == GOLDEN
    pv = step.kernels[14]   # p @ v reads the stored values under their own names
    assert isinstance(pv, GemmKernel) and pv.b.buf == "r4" and all(v == b for v, b in pv.b.edges)
    # no loop kernel of the step reads a stored head buffer (a copy under another name)
    for k in step.kernels:
        if isinstance(k, LoopKernel):
            assert not ({"r4", "r5", "r6"} & set(k.buffers_read())), k.text()
    # the program stores them with the layer outermost, the step's order inside, and the
    # backward loop binds those buffers, in that order: no copy kernel between the loops
    saved = [b.buf for b in fwd.outs[4:7]]
    for name, order in zip(saved, orders.values()):
        assert low.buffers[name].order == ("layer",) + order
    assert set(saved) <= {b.buf for b in bwd.args}
    between = low.kernels[low.kernels.index(fwd) + 1:low.kernels.index(bwd)]
    assert not any(set(saved) & set(k.buffers_read()) for k in between)
    for i, b in enumerate(bwd.args):
        if b.buf in saved:
            assert bwd.step.buffers[f"p{i}"].order == low.buffers[b.buf].order[1:]


def start(program, seed: int = 3) -> dict[str, np.ndarray]:
    return gpt2_start(program, DIMS, BATCH, seed)


@pytest.mark.parametrize("dtype,tol", [("f64", 1e-9), ("f32", 2e-4)])
def test_the_step_with_saved_heads_is_the_interpreters(dtype, tol):
    """The compiled step (its batched products reading the heads with a row stride of
    head * hd) against the IR interpreter in f64 on the same inputs: the loss and every
    updated param and moment."""
    dims = {**DIMS, "batch": BATCH}
    program = tgc.compile(GPT2, dtype=dtype, dims=dims, options=options(dtype))
    args = start(program)
    ref = Options(dtype="f64", passes=("normalize", "adjoint", "tangent"))   # the interpreter runs the loop
    m = pipeline.lower(compile_file(str(GPT2), ref), ref).module
    want = evaluate(m, {k: np.asarray(v, np.float64) if v.dtype.kind == "f" else v for k, v in args.items()},
                    dtype="f64", dims=dims)
    got = program(**args)   # updates `args` in place
    assert abs(float(got["loss"]) - float(want["loss"])) <= tol * abs(float(want["loss"]))
    for u in m.updates:
        if dtype == "f32" and u.target == "bk":
            # bk's gradient is zero up to rounding (it shifts each query's scores over s by one
            # amount, which the softmax ignores); AdamW's g / sqrt(v) turns that rounding into
            # an update of about lr, whatever the precision: the f64 run checks it
            continue
        w = np.asarray(want[u.target], np.float64)
        np.testing.assert_allclose(np.asarray(args[u.target], np.float64), w, rtol=tol,
                                   atol=tol * max(1e-3, float(np.abs(w).max())), err_msg=u.target)
