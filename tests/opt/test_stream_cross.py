"""stream: plain cross-attention (s != t, no mask, every size written) with a scalar loss
summed over the batch and heads (`sum(o * o) / size(t)`, issue 32 item 6). The loss is a
sum over the batch of the stream's values: the loop over the batch and heads that keeps a
step's matrices within `stream_step_elements` splits it (`stream._Streamer.split_sums`),
each step's partial a stacked result, summed after the loop, so the steps stay
independent (no carry) and run on the threads. Checked: the loops and `tgc explain`'s
peak at the issue's sizes, and the values and gradients against the unstreamed program
(interpreter, f64) and torch's autograd (tests/torch_oracle.py) in f64 and f32 on the CPU."""
import numpy as np
import pytest

from tgc import pipeline
from tgc.frontend import compile_source
from tgc.ir.inputs import random_inputs
from tgc.ir.interp import evaluate
from tgc.options import Options

torch_oracle = pytest.importorskip("torch_oracle", reason="the oracle needs torch")

CROSS = """
dim batch = 2, head = 2, t = 32, s = 16, hd = 2
input q[batch, head, t, hd], k[batch, head, s, hd], v[batch, head, s, hd]
p = softmax[s](dot[hd](q, k) / sqrt(size(hd)))
o = sum[s](p * v)
loss = sum(o * o) / size(t)
out loss
out gq[batch, head, t, hd] = grad(loss, q)
out gk[batch, head, s, hd] = grad(loss, k)
out gv[batch, head, s, hd] = grad(loss, v)
"""


def options(budget: int, dtype: str = "f64", threads: int = 1) -> Options:
    from tgc.backends.cpu.options import CpuOptions

    return Options(dtype=dtype, stream_block=4, stream_min_elements=200, stream_mask_groups=2,
                   stream_block_min=2, stream_step_elements=budget, cpu=CpuOptions(threads=threads))


def lowered(src: str, opts: Options):
    return pipeline.lower(compile_source(src, "<cross>", opts), opts).module


def nested(module) -> list[int]:
    """How many loops each level holds: the top level's, then the first loop's step's, ..."""
    from tgc.ir.values import topo_order
    from tgc.lower.steps import loop_key

    out, values = [], module.values()
    while True:
        found = [v for v in values if v.op == "loop"]
        if not found:
            return out
        out.append(len({loop_key(v) for v in found}))
        values = topo_order(list(found[0].attrs[0].results))


def inputs(src: str, dtype: str = "f64") -> dict:
    m = compile_source(src, "<cross>", Options(dtype="f64"))
    return {k: v.astype(np.float32 if dtype == "f32" else np.float64)
            for k, v in random_inputs(m, m.bind_dims({}), 0, "f64").items()}


def close(got: dict, want: dict, tol: float) -> None:
    for name, w in want.items():
        scale = float(np.max(np.abs(w), initial=1e-30))
        np.testing.assert_allclose(np.asarray(got[name], np.float64), w, rtol=0, atol=tol * scale, err_msg=name)


def test_a_summed_loss_loops_over_batch_and_heads():
    """Steps of [batch, head, 4, s] = 256 elements are over a budget of 64: the cluster
    loops over the batch (its step streams t in blocks of 2: 2 * head * s = 64 fits), or,
    at 32, over the batch then the heads; the loss's sum over them follows the loops.
    (Before the split, the loss was a carry over the batch and the loops were refused:
    one flat stream of blocks of 4.) With budget 0, the flat stream. Values and
    gradients: the unstreamed program's and torch's."""
    import tgc

    assert nested(lowered(CROSS, options(64))) == [1, 1]
    assert nested(lowered(CROSS, options(32))) == [1, 1, 1]
    assert nested(lowered(CROSS, options(0))) == [1]
    x = inputs(CROSS)
    want = torch_oracle.evaluate(compile_source(CROSS, "<cross>", Options(dtype="f64")), x)
    unstreamed = evaluate(lowered(CROSS, Options(dtype="f64", stream_block=0)), x, dtype="f64")
    for budget in (64, 32):
        got = evaluate(lowered(CROSS, options(budget)), x, dtype="f64")
        close(got, unstreamed, 1e-10)
        close(got, want, 1e-10)
    for budget in (64, 32):
        for threads in (1, 2):
            for dtype, tol in (("f64", 1e-10), ("f32", 2e-5)):
                prog = tgc.compile(CROSS, "cpu", dtype, options=options(budget, dtype, threads))
                assert any(getattr(k, "kind", "") == "steps" for k in prog.lowered.kernels)
                close(prog(**inputs(CROSS, dtype)), want, tol)


def test_a_padding_mask_over_the_keys_loops_alike():
    """With a padding mask over the keys (`- 1e9 * pad`, pad read over the batch and the
    keys) the loop over the batch splits the loss as without: values and gradients are
    torch's (pad a 0/1 array)."""
    import tgc

    src = CROSS.replace("v[batch, head, s, hd]\n", "v[batch, head, s, hd], pad[batch, s]\n").replace(
        "/ sqrt(size(hd)))", "/ sqrt(size(hd)) - 1e9 * pad)")
    assert nested(lowered(src, options(64))) == [1, 1]
    x = inputs(src)
    x["pad"] = (np.arange(16)[None, :] >= np.array([[12], [5]])).astype(np.float64)
    want = torch_oracle.evaluate(compile_source(src, "<cross>", Options(dtype="f64")), x)
    close(evaluate(lowered(src, options(64)), x, dtype="f64"), want, 1e-10)
    for dtype, tol in (("f64", 1e-10), ("f32", 2e-5)):
        xs = {k: v.astype(np.float32 if dtype == "f32" else np.float64) for k, v in x.items()}
        close(tgc.compile(src, "cpu", dtype, options=options(64, dtype, 2))(**xs), want, tol)


def test_two_sums_over_the_batch_split_alike():
    """A loss of two sums over the batch of the stream's output (`sum(o * o)`, `sum(o)`):
    the loop over the batch splits both, and the values and gradients are torch's."""
    import tgc

    src = CROSS.replace("loss = sum(o * o) / size(t)", "loss = sum(o * o) / size(t) + sum(o)")
    assert nested(lowered(src, options(64))) == [1, 1]
    x = inputs(src)
    want = torch_oracle.evaluate(compile_source(src, "<cross>", Options(dtype="f64")), x)
    close(evaluate(lowered(src, options(64)), x, dtype="f64"), want, 1e-10)
    close(tgc.compile(src, "cpu", "f64", options=options(64))(**x), want, 1e-10)


ISSUE = """
dim batch = 2, head = 4, t = {t}, s = {s}, hd = 64
input q[batch, head, t, hd], k[batch, head, s, hd], v[batch, head, s, hd]
p = softmax[s](dot[hd](q, k) / sqrt(size(hd)))
o = sum[s](p * v)
loss = sum(o * o) / size(t)
out loss
out gq[batch, head, t, hd] = grad(loss, q)
out gk[batch, head, s, hd] = grad(loss, k)
out gv[batch, head, s, hd] = grad(loss, v)
"""


DY = ISSUE.replace("input q[batch, head, t, hd],", "input q[batch, head, t, hd], dy[batch, head, t, hd],").replace(
    "loss = sum(o * o) / size(t)\nout loss\n", "loss = sum(o * dy)\n")


PAD = ISSUE.replace("v[batch, head, s, hd]\n", "v[batch, head, s, hd], pad[batch, s]\n").replace(
    "/ sqrt(size(hd)))", "/ sqrt(size(hd)) - 1e9 * pad)")


@pytest.mark.parametrize("t,s,most,src", [(4096, 2048, 16, ISSUE), (2048, 4096, 48, ISSUE), (4096, 4096, 48, ISSUE),
                                          (4096, 2048, 16, DY), (4096, 2048, 16, PAD)])
def test_explain_peak_of_cross_attention_at_the_issues_sizes(t, s, most, src):
    """Issue 32 item 6: at batch 2 x 4 heads of 64 (t = 4096, s = 2048) the loss's sum
    over the batch made the loop over the batch and heads a carry, refused: one flat
    stream whose step held [2, 4, 256, s] matrices (67.9 MB, 93.1 MB peak) on one thread.
    Now the steps loop over the batch on both threads, each with its own step's slots:
    13.2 MB in all (t = 2048, s = 4096: 160 -> 40 MB; t = s = 4096 with s written as a
    number: 169 -> 41 MB). With `sum(o * dy)` (no carry, `o` no output) the loop's region
    along the batch needs the values before the seed too (the row max), as the stream's own
    does: 101 -> 13.6 MB. With a padding mask over the keys (`- 1e9 * pad`): 76 -> 10.6 MB."""
    from tgc.backends.cpu.options import CpuOptions
    from tgc.explain import explain
    from tgc.pipeline import lower_module

    opts = Options(dtype="f32", cpu=CpuOptions(threads=2))
    assert ("pad" in src) == (src is PAD) and ("dy" in src) == (src is DY)   # the variants' rewrites took
    src = src.format(t=t, s=s)
    report = explain(lower_module(lowered(src, opts), opts), {}, opts)
    steps = [k for k in report["kernels"] if k.get("lanes")]
    assert len(steps) == 1 and steps[0]["lanes"] == 2, report["kernels"]
    assert report["peak"]["bytes"] <= most << 20, report["peak"]
