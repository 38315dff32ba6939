"""stream: softmax-then-contract clusters run as loops over blocks of an edge, forward and
backward (tgc.opt.stream). Each program is checked with its gradients against the same
program without the pass (the interpreter, f64: 1e-10) and against PyTorch's autograd
(tests/torch_oracle.py) in f64 and f32, on the interpreter and the CPU; the peak of
`tgc explain` grows linearly with the length. The golden IR is tests/opt/stream.tgir."""
import numpy as np
import pytest

from tgc import pipeline
from tgc.frontend import compile_source
from tgc.ir.inputs import random_inputs
from tgc.ir.interp import evaluate
from tgc.options import Options
from layer_programs import causal_attention

torch_oracle = pytest.importorskip("torch_oracle", reason="the oracle needs torch")

ON = dict(stream_block=4, stream_min_elements=200, stream_mask_groups=2)
OFF = dict(stream_block=0)

ATTENTION = causal_attention(head=2, t=32, hd=2)

CROSS = """
dim head = 2, t = 16, s = 32, hd = 2
input q[head, t, hd]
input k[head, s, hd]
input v[head, s, hd]
input dy[head, t, hd]
p = softmax[s](sum[hd](q * k) / sqrt(size(hd)))
y = sum[s](p * v)
out y[head, t, hd]
loss = sum(y * dy)
out dq[head, t, hd] = grad(loss, q)
out dk[head, s, hd] = grad(loss, k)
out dv[head, s, hd] = grad(loss, v)
"""

BIAS = """
dim head = 2, t = 32, hd = 2
dim s = t
input q[head, t, hd]
input k[head, s, hd]
input v[head, s, hd]
input bias[head, s]
input dy[head, t, hd]
p = softmax[s](where([s <= t], sum[hd](q * k) / sqrt(size(hd)) + bias, -1e9))
y = sum[s](p * v)
out y[head, t, hd]
loss = sum(y * dy)
out dq[head, t, hd] = grad(loss, q)
out dk[head, s, hd] = grad(loss, k)
out dv[head, s, hd] = grad(loss, v)
out dbias[head, s] = grad(loss, bias)
"""

# a memory read by softmax weights over its slots n, one row per item b (no attention names)
POOLING = """
dim b = 16, n = 24, d = 2, c = 2
input u[b, d]
input z[n, d]
input m[n, c]
input dy[b, c]
w = softmax[n](2 * sum[d](u * z))
pooled = sum[n](w * m)
out pooled[b, c]
loss = sum(pooled * dy)
out du[b, d] = grad(loss, u)
out dz[n, d] = grad(loss, z)
out dm[n, c] = grad(loss, m)
"""

# rows t < 4 see no key at all
MASKED = """
dim t = 32, hd = 2
dim s = t
input q[t, hd]
input k[s, hd]
input v[s, hd]
input dy[t, hd]
p = softmax[s](where([s + 4 <= t], sum[hd](q * k), -1e9))
y = sum[s](p * v)
out y[t, hd]
loss = sum(y * dy)
out dq[t, hd] = grad(loss, q)
out dk[s, hd] = grad(loss, k)
"""

# examples/attention.tg's layer: projections in and out, keys renamed from the positions
LAYER = """
dim batch = 2, t = 32, c = 4, head = 2, hd = c / head
dim s = t
input x[batch, t, c]
input dy[batch, t, c]
param Wq[c, c2: c], Wk[c, c2], Wv[c, c2]
param Wo[c2, c]
qh = (x @ Wq)[c2 = hd*head + hd]
kh = (x @ Wk)[c2 = hd*head + hd, t -> s]
vh = (x @ Wv)[c2 = hd*head + hd, t -> s]
p = softmax[s](where([s <= t], sum[hd](qh * kh) / sqrt(size(hd)), -inf))
y = (sum[s](p * vh) @ [c2 = hd*head + hd]) @ Wo
out y[batch, t, c]
loss = sum(y * dy)
out dx = grad(loss, x)
out dWq = grad(loss, Wq)
out dWk = grad(loss, Wk)
out dWv = grad(loss, Wv)
out dWo = grad(loss, Wo)
"""

# examples/gpt2.tg's mask: a fill subtracted where the relation holds
SUBTRACTIVE = ATTENTION.replace("where([s <= t], sum[hd](q * k) / sqrt(size(hd)), -1e9)",
                                "sum[hd](q * k) / sqrt(size(hd)) - 1e9 * [s > t]")

# a sliding window: a chain of two links that both name t
WINDOW = MASKED.replace("[s + 4 <= t]", "[t - 8 <= s <= t]")

# the window's keys rejected by their complement: a fill subtracted where `1 - [band]` is 1
BAND_REJECTING = WINDOW.replace("where([t - 8 <= s <= t], sum[hd](q * k), -1e9)",
                                "sum[hd](q * k) - 1e9 * (1 - [t - 8 <= s <= t])")
# a chain that rejects: the future masked for the rows t >= 4 (rows t < 4 see every key,
# so that a run of rows skips keys only from 4 runs on: test_rejecting_multi_link_masks_skip_keys)
CHAIN_REJECTING = SUBTRACTIVE.replace("- 1e9 * [s > t]", "- 1e9 * [4 <= t < s]")
# the window's complement as the condition of a where: the fill where it is 1
FLIPPED = WINDOW.replace("where([t - 8 <= s <= t], sum[hd](q * k), -1e9)",
                         "where(1 - [t - 8 <= s <= t], -1e9, sum[hd](q * k))")

# a window as two subtracted fills, and as two nested wheres: a key is masked where either
# mask masks it (test_two_masks_that_each_mask_skip_both_sides_of_a_window)
TWO_FILLS = ATTENTION.replace("where([s <= t], sum[hd](q * k) / sqrt(size(hd)), -1e9)",
                              "sum[hd](q * k) / sqrt(size(hd)) - 1e9 * [s > t] - 1e9 * [s < t - 8]")
NESTED_WHERE = ATTENTION.replace("where([s <= t], sum[hd](q * k) / sqrt(size(hd)), -1e9)",
                                 "where([s <= t], where([t - 8 <= s], sum[hd](q * k) / sqrt(size(hd)), -1e9), -1e9)")

# lengths no block divides (31 is prime; 17 queries against 32 keys): the blocks that fit,
# then a step over the rows left over (test_lengths_no_block_divides_stream_with_a_tail)
ODD = ATTENTION.replace("t = 32", "t = 31")
ODD_CROSS = CROSS.replace("t = 16", "t = 17")
ODD_BIAS = BIAS.replace("t = 32", "t = 31")

PROGRAMS = {"odd": ODD, "odd_cross": ODD_CROSS, "odd_bias": ODD_BIAS, "layer": LAYER, "two_fills": TWO_FILLS, "nested_where": NESTED_WHERE, "window": WINDOW, "attention": ATTENTION, "cross": CROSS, "bias": BIAS, "pooling": POOLING, "masked": MASKED,
            "subtractive": SUBTRACTIVE, "band_rejecting": BAND_REJECTING, "flipped": FLIPPED}
# a masked program's blocks run as stream_mask_groups (2 in ON) loops, each over the keys its rows admit
LOOPS = {name: 1 if name in ("cross", "pooling") else 2 for name in PROGRAMS} | {"odd": 3, "odd_bias": 3, "odd_cross": 2}


def optimized(src: str, dtype: str, **opts):
    options = Options(dtype=dtype, **opts)
    return pipeline.lower(compile_source(src, "<stream>", options), options).module


def loops(module) -> int:
    """How many loops (each loop value is one of a loop's outputs)."""
    from tgc.lower.steps import loop_key

    return len({loop_key(v) for v in module.values() if v.op == "loop"})


def inputs(src: str, dtype: str = "f64") -> dict:
    m = compile_source(src, "<stream>", Options(dtype="f64"))
    return {k: v.astype(np.float32 if dtype == "f32" else np.float64)
            for k, v in random_inputs(m, m.bind_dims({}), 0, "f64").items()}


def close(got: dict, want: dict, tol: float) -> None:
    for name, w in want.items():
        scale = float(np.max(np.abs(w), initial=1e-30))
        np.testing.assert_allclose(np.asarray(got[name], np.float64), w, rtol=0, atol=tol * scale, err_msg=name)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_interpreter_f64_matches_unstreamed_and_torch(name):
    src = PROGRAMS[name]
    streamed, plain = optimized(src, "f64", **ON), optimized(src, "f64", **OFF)
    assert loops(streamed) == LOOPS[name] and loops(plain) == 0
    x = inputs(src)
    got, want = evaluate(streamed, x, dtype="f64"), evaluate(plain, x, dtype="f64")
    close(got, want, 1e-10)
    close(got, torch_oracle.evaluate(compile_source(src, "<stream>", Options(dtype="f64")), x), 1e-10)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_cpu_f32_and_f64_match_torch(name):
    import tgc

    src = PROGRAMS[name]
    want = torch_oracle.evaluate(compile_source(src, "<stream>", Options(dtype="f64")), inputs(src))
    for dtype, tol in (("f64", 1e-10), ("f32", 2e-5)):
        prog = tgc.compile(src, "cpu", dtype, options=Options(**ON))
        assert any(getattr(k, "kind", "") == "steps" for k in prog.lowered.kernels)
        close(prog(**inputs(src, dtype)), want, tol)


@pytest.mark.parametrize("form", ["where", "subtractive", "band_rejecting"])
def test_fully_masked_rows_as_unstreamed(form):
    """Rows whose keys are all masked give what the program without the pass gives (the
    -1e9 scores' uniform weights; with the fill subtracted, the weights of the scores
    less 1e9, which the run keeping every key computes as unstreamed), in f32 on the CPU
    too."""
    import tgc

    fill = {"where": "where([s + 4 <= t], sum[hd](q * k), -1e9)", "subtractive": "sum[hd](q * k) - 1e9 * [s + 4 > t]",
            "band_rejecting": "sum[hd](q * k) - 1e9 * (1 - [t - 12 <= s <= t - 4])"}[form]
    src = MASKED.replace("where([s + 4 <= t], sum[hd](q * k), -1e9)", fill)
    assert form == "where" or src != MASKED
    streamed = optimized(src, "f64", **ON)
    assert loops(streamed) == 2
    x = inputs(src)
    got = evaluate(streamed, x, dtype="f64")
    want = evaluate(optimized(src, "f64", **OFF), x, dtype="f64")
    if form == "where":
        np.testing.assert_allclose(got["y"][:4], np.broadcast_to(x["v"].mean(axis=0), (4, 2)), rtol=1e-12)
    close(got, want, 1e-12)
    x32 = inputs(src, "f32")
    on = tgc.compile(src, "cpu", "f32", options=Options(**ON))(**x32)
    off = tgc.compile(src, "cpu", "f32", options=Options(**OFF))(**x32)
    close(on, {k: np.asarray(v, np.float64) for k, v in off.items()}, 1e-5)


def test_fp_strict_keeps_the_matrices():
    strict = optimized(ATTENTION, "f64", fp_strict=True, **ON)
    assert loops(strict) == 0


@pytest.mark.parametrize("name", ["attention", "cross", "bias", "pooling", "masked"])
def test_a_chain_a_target_fuses_stays_whole(name):
    """With `stream_fused_edge` (what the CUDA backends' options set) a softmax-then-
    contract cluster whose contracted and value edges are at most that size stays whole
    (the target fuses it); with a smaller one it streams, as without the option."""
    src = PROGRAMS[name]
    assert loops(optimized(src, "f64", **ON)) > 0
    assert loops(optimized(src, "f64", stream_fused_edge=256, **ON)) == 0
    assert loops(optimized(src, "f64", stream_fused_edge=1, **ON)) > 0


def test_a_kept_chain_without_its_shape_streams():
    """A cluster that is not a softmax-then-contract chain (the weights squared before the
    values' contraction: no `exp` contracted with one outside operand) streams under
    `stream_fused_edge` too."""
    src = ATTENTION.replace("y = sum[s](p * v)", "y = sum[s](p * p * v)")
    assert loops(optimized(src, "f64", **ON)) > 0
    assert loops(optimized(src, "f64", stream_fused_edge=256, **ON)) > 0


def test_the_block_halves_to_divide_the_edge():
    """t = 32 has no two blocks of 32: the block is halved to 16 while it stays at least
    stream_block_min, and the streamed program computes what the plain one does."""
    base = dict(stream_block=32, stream_min_elements=200)
    streamed = optimized(ATTENTION, "f64", stream_block_min=8, **base)
    assert loops(streamed) == 2 and streamed.dims["t.1"] == 16 and streamed.dims["t.2"] == 2   # a loop per block
    assert loops(optimized(ATTENTION, "f64", stream_block_min=32, **base)) == 0
    x = inputs(ATTENTION)
    close(evaluate(streamed, x, dtype="f64"), evaluate(optimized(ATTENTION, "f64", **OFF), x, dtype="f64"), 1e-10)


def test_lengths_no_block_divides_stream_with_a_tail():
    """An edge that no block from stream_block down to stream_block_min divides (a prime
    length) streams in the blocks that fit and one step over the rows left over: the
    tail's loop runs over the last |t| mod B rows, and the results are the unstreamed
    program's."""
    x = inputs(ODD)
    want = evaluate(optimized(ODD, "f64", **OFF), x, dtype="f64")
    one = optimized(ODD, "f64", **(ON | dict(stream_mask_groups=0)))   # one loop over every key
    assert loops(one) == 2
    assert [one.dims[f"t.{k}"] for k in range(1, 5)] == [4, 7, 3, 1]   # 7 blocks of 4, a tail of 3 rows
    close(evaluate(one, x, dtype="f64"), want, 1e-12)
    close(evaluate(optimized(ODD, "f64", **ON), x, dtype="f64"), want, 1e-12)   # the runs, then the tail


def test_small_programs_stay():
    """Under the threshold (the default's 16M elements) nothing is streamed."""
    assert loops(optimized(ATTENTION, "f64")) == 0


def peak(t: int) -> int:
    from tgc.explain import explain
    from tgc.pipeline import lower_module

    src = ATTENTION.replace("t = 32, hd = 2", f"t = {t}, hd = 16")
    options = Options(stream_block=32, stream_min_elements=1 << 14, stream_mask_groups=4)
    module = optimized(src, "f32", stream_block=32, stream_min_elements=1 << 14, stream_mask_groups=4)
    assert loops(module) == 4
    return explain(lower_module(module, options), {})["peak"]["bytes"]


def test_peak_grows_linearly_with_length():
    """Doubling t (and s) doubles the peak of live temporaries: O(t * d), no [t, s] matrix."""
    small, large = peak(256), peak(512)
    assert 1.5 * small <= large <= 2.5 * small, (small, large)
    assert large < 2 * 512 * 512 * 4   # less than one [head, t, s] f32 matrix


@pytest.mark.slow
@pytest.mark.parametrize("t", [8191, 10000])
def test_default_peak_of_a_length_no_block_divides(t):
    """Causal attention (1 head of 64, with its gradients) at a length that 256, 128 and
    64 do not divide streams under the default options as 8192 does: `tgc explain`'s
    peak stays O(t * d), within issue 32's 64 MiB, not the [t, s] matrices' 768 MiB."""
    from tgc.explain import explain
    from tgc.pipeline import lower_module

    src = ATTENTION.replace("head = 2, t = 32, hd = 2", f"head = 1, t = {t}, hd = 64")
    options = Options(dtype="f32")
    module = optimized(src, "f32")
    assert loops(module) > 0
    assert explain(lower_module(module, options), {})["peak"]["bytes"] <= 64 << 20


def test_default_peak_at_8192_is_independent_of_batch_and_heads():
    """Issue 32's long row with its largest batch and heads: causal attention at t = 8192
    with its gradients, 4 heads of 64 x batch 2, under the default options. One head's
    step is already over `stream_step_elements`; the stream still loops over the batch and
    the heads, so that on one thread `tgc explain`'s peak is the 1-head program's (32.6
    MiB), within the issue's 64 MiB, not 8 heads' [256, s] matrices at once (273 MB). On
    two threads the loop's steps run one a core, each with its own copy of the step's
    slots: there the lanes share the block (128 rows each, `stream.partition`), so what
    the two threads hold, and what the code allocates, stays within the 64 MiB (with 256
    rows a lane: explain's peak 65 MiB with both lanes counted, 72 MiB allocated, where
    explain said 33 MiB)."""
    from tgc.backends.cpu.options import CpuOptions
    from tgc.explain import explain
    from tgc.pipeline import lower_module

    def report(batch, head, threads):
        src = BATCHED.replace("batch = 2, head = 2, t = 32, hd = 2", f"batch = {batch}, head = {head}, t = 8192, hd = 64")
        options = Options(dtype="f32", cpu=CpuOptions(threads=threads))
        return explain(lower_module(optimized(src, "f32", cpu=CpuOptions(threads=threads)), options), {}, options)

    one, many = report(1, 1, 1), report(2, 4, 1)
    assert many["peak"]["bytes"] <= 64 << 20, many["peak"]
    assert many["peak"]["bytes"] <= one["peak"]["bytes"] * 1.01, (one["peak"], many["peak"])
    assert many["workspace"]["lanes_bytes"] == 0
    two = report(2, 4, 2)
    (k,) = two["kernels"]
    assert k["lanes"] == 2 and two["peak"]["bytes"] == 2 * k["step_peak"]
    assert two["peak"]["bytes"] <= two["workspace"]["allocated_bytes"] <= 64 << 20, two["workspace"]


@pytest.mark.parametrize("name", ["attention", "odd"])
@pytest.mark.parametrize("dtype,tol", [("f64", 1e-10), ("f32", 2e-5)])
def test_cuda_sim_matches_torch(name, dtype, tol):
    """The streamed attention on the CUDA module's emulator (its loop a host launch loop;
    the flash stage off: with it the CUDA backends keep the chain whole and fuse it); at
    a prime length, with the tail's loop of one step too."""
    import tgc

    src = PROGRAMS[name]
    want = torch_oracle.evaluate(compile_source(src, "<stream>", Options(dtype="f64")), inputs(src))
    prog = tgc.compile(src, "cuda-sim", dtype, options=Options(**ON).with_(flash=False))
    assert any(v.op == "loop" for v in prog.module.values())
    close(prog(**inputs(src, dtype)), want, tol)


def large_logits_and_torch():
    """ATTENTION's inputs with q and k scaled so that the scores reach about 1e4, and
    PyTorch's y, dq, dk, dv on them in f64 (the truth) and f32 (the contract's peer)."""
    import torch

    x = inputs(ATTENTION)
    x["q"], x["k"] = 80 * x["q"], 80 * x["k"]

    def reference(dtype):
        t = {n: torch.tensor(a, dtype=dtype, requires_grad=n in "qkv") for n, a in x.items()}
        scores = torch.einsum("htd,hsd->hts", t["q"], t["k"]) / 2 ** 0.5
        causal = torch.ones(32, 32, dtype=torch.bool).tril()
        y = torch.einsum("hts,hsd->htd", torch.softmax(torch.where(causal, scores, -1e9), -1), t["v"])
        grads = torch.autograd.grad((y * t["dy"]).sum(), (t["q"], t["k"], t["v"]))
        return {n: a.detach().to(torch.float64).numpy() for n, a in zip(("y", "dq", "dk", "dv"), (y, *grads))}

    assert np.abs(np.einsum("htd,hsd->hts", x["q"], x["k"])).max() / 2 ** 0.5 > 5e3
    return x, reference(torch.float64), reference(torch.float32)


def test_f32_at_logits_up_to_1e4_is_within_10x_torch_f32():
    """The numerics contract on the streamed form: q and k scaled so that the scores
    reach about 1e4 (the softmax then nearly one-hot, exp's argument large); tgc f32
    (streamed, CPU) within 10x PyTorch f32's error of the f64 truth, for y and every
    gradient (normwise, as tests/numerics_util.py measures)."""
    import tgc
    from numerics_util import normwise_err, ok

    x, want, theirs = large_logits_and_torch()
    prog = tgc.compile(ATTENTION, "cpu", "f32", options=Options(**ON))
    assert any(getattr(k, "kind", "") == "steps" for k in prog.lowered.kernels)
    got = prog(**{n: a.astype(np.float32) for n, a in x.items()})
    for n in want:
        mine, torch_err = normwise_err(got[n], want[n]), normwise_err(theirs[n], want[n])
        assert ok(mine, torch_err), (n, mine, torch_err)


def test_explain_shows_the_blocks_and_counts_the_steps_temporaries(tmp_path):
    """`tgc explain` on the benchmark's attention at t = 2048 (the default threshold met):
    a loop over the heads (a step's [head, B, s] matrices over stream_step_elements), in a
    parallel region, whose step holds the 8 loops of steps (stream_mask_groups); the
    note and the save/recompute line say they stream t in blocks; the peak (with the
    steps' own temporaries) is under a [t, s] matrix."""
    from click.testing import CliRunner

    from tgc.cli import main

    path = tmp_path / "attention.tg"
    path.write_text(ATTENTION.replace("head = 2, t = 32, hd = 2", "head = 4, t = 2048, hd = 16"))
    r = CliRunner().invoke(main, ["explain", str(path), "--format", "json"])
    assert r.exit_code == 0, r.output
    import json

    report = json.loads(r.output)
    steps = [k for k in report["kernels"] if k["kind"] == "steps"]
    assert len(steps) == 1 and steps[0]["text"].startswith("steps over head < 4")
    assert all(k["threads"] in ("per step kernel", "steps on the threads") for k in steps)
    assert report["recompute_note"].startswith("recompute by blocks: in k") and \
        "8 loops: streams t in blocks of t.1" in report["recompute_note"]
    # under one [head, t, s] f32 matrix (unstreamed: three); the step holds [head, 256, s] blocks
    assert report["peak"]["bytes"] < 4 * 2048 * 2048 * 4


# attention inside a loop over layers (a `repeat` body)
LAYERS = """
dim layer
dim t = 64, hd = 4
dim s = t
input x[t, hd]
param wk[layer, hd, hd2: hd]
fn block(h, wk) {
  k = (h @ wk)[hd2 -> hd, t -> s]
  p = softmax[s](where([s <= t], sum[hd](h * k), -1e9))
  return sum[s](p * h[t -> s]) * 0.5 + h
}
y = repeat[layer](block, x, wk)
"""


def nested_loops(module) -> int:
    from tgc.ir.values import topo_order

    return sum(1 for v in module.values() if v.op == "loop"
               for w in topo_order(list(v.attrs[0].results)) if w.op == "loop")


def step_loops(module) -> tuple[int, int]:
    """How many loops the steps of the forward loops hold, and those of the reverse loops
    (a gradient's): each loop counted once, not once per output."""
    from tgc.ir.values import topo_order
    from tgc.lower.steps import loop_key

    outer = {}
    for v in module.values():
        if v.op == "loop":
            inner = {loop_key(w) for w in topo_order(list(v.attrs[0].results)) if w.op == "loop"}
            outer.setdefault(loop_key(v), (v.attrs[2], len(inner)))
    return (sum(n for rev, n in outer.values() if not rev), sum(n for rev, n in outer.values() if rev))


def stacked_elements(module) -> int:
    """The most elements of one step's value that a loop stacks (what a forward loop keeps
    per step for its reverse loop)."""
    env = module.bind_dims({"layer": 3})
    most = 0
    for v in module.values():
        if v.op == "loop" and v.attrs[3] >= v.attrs[0].carries:
            n = 1
            for e in v.attrs[0].results[v.attrs[3]].edges:
                n *= env[module.edges[e]] if module.edges[e] in env else module.size(e)
            most = max(most, n)
    return most


TOL = {"f64": 1e-12, "f32": 2e-5}


CASES = [(g, m, d) for g in ("forward", "gradients") for m in ("where", "subtractive") for d in ("f64", "f32")
         if (g, m, d) != ("gradients", "subtractive", "f32")] \
    + [("gradients-under-a-budget", m, "f64") for m in ("where", "subtractive")]


@pytest.mark.parametrize("grads,mask,dtype", CASES)
def test_a_loop_body_streams(grads, mask, dtype):
    """A cluster inside a loop's step streams as a loop in the step. With gradients, the
    reverse loop computes the step's [t, s] values again (tgc.opt.stream_loops) instead of
    reading them stacked from the forward loop, so that the forward and the reverse steps
    both stream. The mask in either form (examples/gpt2.tg's block subtracts it) lets each
    run skip keys. Forward and gradients match the program without the pass, f64 and f32."""
    import tgc

    layers = LAYERS if mask == "where" else LAYERS.replace("where([s <= t], sum[hd](h * k), -1e9)",
                                                           "sum[hd](h * k) - 1e9 * [s > t]")
    assert mask == "where" or layers != LAYERS
    src = layers + ("out y\n" if grads == "forward" else
                    "out loss = sum(y * y)\nout dx = grad(loss, x)\nout dw = grad(loss, wk)\n")
    # a budget met by keeping only the carries
    extra = dict(memory_budget=400_000) if grads == "gradients-under-a-budget" else {}
    extra["stream_mask_groups"] = 2
    on, off = optimized(src, dtype, stream_block=16, stream_min_elements=1000, **extra), optimized(src, dtype, **OFF)
    # 2 runs of blocks each; the reverse step streams too, by default and under the budget (whose
    # step, recomputed whole from the carries, reads the layer's input both whole and by blocks)
    assert step_loops(on) == ((2, 0) if grads == "forward" else (2, 2))
    assert nested_loops(off) == 0
    if grads == "gradients":   # the forward loop keeps no [t, s] matrix per step (64 x 64)
        assert stacked_elements(on) < 64 * 64 <= stacked_elements(off)
    env = off.bind_dims({"layer": 3})
    x = random_inputs(off, env, 0, "f64")
    cast = (lambda a: a.astype(np.float32)) if dtype == "f32" else (lambda a: a)
    want = evaluate(off, {k: cast(v.copy()) for k, v in x.items()}, dtype=dtype, dims={"layer": 3})
    close(evaluate(on, {k: cast(v.copy()) for k, v in x.items()}, dtype=dtype, dims={"layer": 3}), want, TOL[dtype])
    prog = tgc.compile(src, "cpu", dtype, options=Options(dtype=dtype, stream_block=16, stream_min_elements=1000,
                                                          **extra))
    close(prog(**{k: cast(v.copy()) for k, v in x.items()}), want, TOL[dtype])


def test_a_scan_body_streams_forward_and_reverse():
    """A `scan` stacks each step's carry; its reverse loop computes the step's [t, s] values
    again and streams them as a `repeat`'s does (the interpreter, f64, against the program
    without the pass)."""
    src = LAYERS.replace("y = repeat[layer](block, x, wk)", "y = scan[layer](block, x, wk)") \
        + "out loss = sum(y * y)\nout dx = grad(loss, x)\nout dw = grad(loss, wk)\n"
    assert src != LAYERS
    on = optimized(src, "f64", stream_block=16, stream_min_elements=1000, stream_mask_groups=2)
    off = optimized(src, "f64", **OFF)
    assert step_loops(on) == (2, 2) and stacked_elements(on) < 64 * 64 <= stacked_elements(off)
    x = random_inputs(off, off.bind_dims({"layer": 3}), 0, "f64")
    want = evaluate(off, {k: v.copy() for k, v in x.items()}, dtype="f64", dims={"layer": 3})
    close(evaluate(on, {k: v.copy() for k, v in x.items()}, dtype="f64", dims={"layer": 3}), want, 1e-12)


def step_flops(src: str, groups: int) -> int:
    """The FLOPs `tgc explain` counts in the loops of steps (every step of every loop)."""
    from tgc.explain import explain
    from tgc.pipeline import lower_module

    opts = dict(stream_block=32, stream_min_elements=1 << 14, stream_mask_groups=groups)
    module = optimized(src, "f32", **opts)
    masked = "where" in src or "1e9 * " in src
    assert loops(module) == (max(groups, 1) if masked else 1)
    kernels = explain(lower_module(module, Options(**opts)), {})["kernels"]
    return sum(k["flops"] for k in kernels if k["kind"] == "steps")


def test_masked_keys_are_skipped_in_the_work():
    """The steps' FLOPs (tgc explain) with 8 runs of blocks against one loop over every
    key: causal attention over 8 blocks does (1 + ... + 8) / 64 = 0.5625 of it; a window
    of 9 keys, 8 blocks of 32 rows, each over its 40 (the first 32) keys of 256."""
    causal = ATTENTION.replace("t = 32, hd = 2", "t = 256, hd = 16")
    ratio = step_flops(causal, 8) / step_flops(causal, 0)
    assert 0.55 < ratio < 0.58, ratio
    window = WINDOW.replace("t = 32, hd = 2", "t = 256, hd = 16")
    ratio = step_flops(window, 8) / step_flops(window, 0)
    assert 0.1 < ratio < 0.2, ratio


def test_long_edges_run_in_more_loops():
    """`stream_mask_rows`: a masked stream runs at least one loop per that many rows of
    its edge (at most `stream_mask_runs`), whatever `stream_mask_groups` says (t = 256 in 8 blocks of 32: 2 loops do
    (1 + 2) / 4 = 0.75 of every key's work, 4 loops of 64 rows 0.625, 8 loops 0.5625);
    0 leaves `stream_mask_groups` alone; the 4-loop program computes torch's values."""
    from tgc.explain import explain
    from tgc.pipeline import lower_module

    causal = ATTENTION.replace("t = 32, hd = 2", "t = 256, hd = 16")

    def work(**kw):
        opts = dict(stream_block=32, stream_min_elements=1 << 14, **kw)
        module = optimized(causal, "f32", **opts)
        kernels = explain(lower_module(module, Options(**opts)), {})["kernels"]
        return loops(module), sum(k["flops"] for k in kernels if k["kind"] == "steps")

    every = work(stream_mask_groups=0)[1]
    two = work(stream_mask_groups=2, stream_mask_rows=0)
    four = work(stream_mask_groups=2, stream_mask_rows=64)
    eight = work(stream_mask_groups=2, stream_mask_rows=16)   # at most one loop a block
    assert (two[0], four[0], eight[0]) == (2, 4, 8)
    assert 0.74 < two[1] / every < 0.76 and 0.61 < four[1] / every < 0.64 and 0.55 < eight[1] / every < 0.58
    assert work(stream_mask_groups=2)[0] == 2   # the default 256 rows: t = 256 is one such run
    # `stream_mask_runs` caps the loops (each compiles its own step), never below the groups
    assert work(stream_mask_groups=2, stream_mask_rows=16, stream_mask_runs=4)[0] == 4
    assert work(stream_mask_groups=2, stream_mask_rows=16, stream_mask_runs=1)[0] == 2
    import tgc
    src = ATTENTION.replace("t = 32", "t = 64")
    prog = tgc.compile(src, "cpu", "f64", options=Options(**{**ON, "stream_mask_rows": 16}))
    assert loops(prog.module) == 4
    want = torch_oracle.evaluate(compile_source(src, "<stream>", Options(dtype="f64")), inputs(src))
    close(prog(**inputs(src)), want, 1e-10)


def test_the_runs_copy_their_key_windows_in_the_keys_order_and_hand_the_carries_on():
    """A masked stream's runs (4 here) read windows of k and v: copied in k's and v's
    own order (`[head, s.N, hd]`, so the copy runs along both), and the dk, dv carries
    pass from run to run in one buffer each (no copy in); the result matches torch."""
    import tgc
    from tgc.lower.lowered import StepLoop

    src = ATTENTION
    prog = tgc.compile(src, "cpu", "f64", options=Options(**{**ON, "stream_mask_groups": 4}))
    low = prog.lowered
    runs = [k for k in low.kernels if isinstance(k, StepLoop)]
    assert len(runs) == 4
    windows = [b for k in runs for b in (x.buf for x in k.args) if b.startswith("w")]
    assert len(windows) == 6   # k and v for every run but the last, which reads them whole
    for w in windows:
        order = low.buffers[w].order
        assert order[0] == "head" and order[1].startswith("s.") and order[2] == "hd", order
    assert len({tuple(x.buf for x in k.args[:k.carries]) for k in runs}) == 1
    want = torch_oracle.evaluate(compile_source(src, "<stream>", Options(dtype="f64")), inputs(src))
    close(prog(**inputs(src)), want, 1e-10)


def test_a_run_with_a_fully_masked_row_keeps_every_key():
    """MASKED's rows t < 4 see no key: the run of its first two blocks keeps all of s
    (its weights uniform over every key, as unstreamed); the other runs see only their hull."""
    module = optimized(MASKED, "f64", **{**ON, "stream_mask_groups": 4})
    bodies = {}
    for v in module.values():
        if v.op == "loop":
            bodies[id(v.attrs[0])] = v.attrs[0]
    keys = sorted(next(e for p in b.params[b.carries + b.slices:] for e in p.edges if e.split(".")[0] == "s")
                  for b in bodies.values())   # the keys (an invariant) each loop's step reads
    assert len(keys) == 4 and keys.count("s") == 1, keys
    sizes = sorted(module.dims[k] for k in keys if k != "s")
    assert sizes == [12, 20, 28], sizes   # blocks of 4 rows, keys s <= t - 4: up to 11, 19, 27


def test_a_step_not_shown_exact_keeps_every_key():
    """A bias over the keys added after the mask: the skipped scores are then -1e9 plus
    any bias, which the check cannot bound, so the loop runs over every key (one loop),
    and the result is the unstreamed one."""
    src = MASKED.replace("input dy[t, hd]", "input dy[t, hd]\ninput bias[s]").replace(
        "where([s + 4 <= t], sum[hd](q * k), -1e9)", "where([s + 4 <= t], sum[hd](q * k), -1e9) + bias")
    streamed = optimized(src, "f64", **ON)
    assert loops(streamed) == 1
    x = inputs(src)
    close(evaluate(streamed, x, dtype="f64"), evaluate(optimized(src, "f64", **OFF), x, dtype="f64"), 1e-10)


def test_a_masked_cluster_streams_from_the_smaller_threshold():
    """stream_min_elements_masked applies where the mask lets loops skip keys: causal
    attention streams under it, cross-attention (no mask) does not."""
    opts = dict(stream_block=4, stream_min_elements=1 << 20, stream_min_elements_masked=200, stream_mask_groups=2)
    assert loops(optimized(ATTENTION, "f64", **opts)) == 2
    assert loops(optimized(CROSS, "f64", **opts)) == 0
    # a mask whose skip the check cannot show exact (a bias over the keys after it): no loop
    late_bias = MASKED.replace("input dy[t, hd]", "input dy[t, hd]\ninput bias[s]").replace(
        "where([s + 4 <= t], sum[hd](q * k), -1e9)", "where([s + 4 <= t], sum[hd](q * k), -1e9) + bias")
    assert loops(optimized(late_bias, "f64", **opts)) == 0


def test_the_subtractive_causal_mask_skips_keys_as_where_does():
    """examples/gpt2.tg masks with `- 1e9 * [s > t]`: the same weights as
    `where([s <= t], scores, -1e9)`, and the steps skip the same keys (the mask rejects:
    it is 1 at the skipped keys, whose scores are then at most -1e9 + 1e7)."""
    causal = SUBTRACTIVE.replace("t = 32, hd = 2", "t = 256, hd = 16")
    ratio = step_flops(causal, 8) / step_flops(causal, 0)
    assert 0.55 < ratio < 0.58, ratio
    # the fill where the rejecting mask holds
    rejecting = ATTENTION.replace("t = 32, hd = 2", "t = 256, hd = 16").replace(
        "where([s <= t], sum[hd](q * k) / sqrt(size(hd)), -1e9)", "where([s > t], -1e9, sum[hd](q * k) / sqrt(size(hd)))")
    ratio = step_flops(rejecting, 8) / step_flops(rejecting, 0)
    assert 0.55 < ratio < 0.58, ratio


def test_a_subtractive_mask_with_a_small_coefficient_keeps_every_key():
    """`- 10 * [s > t]` leaves the masked keys' weights exp(-10) of an admitted one's, not
    0: the loop runs over every key, and the result is the unstreamed one."""
    src = SUBTRACTIVE.replace("- 1e9 * [s > t]", "- 10 * [s > t]")
    streamed = optimized(src, "f64", **ON)
    assert loops(streamed) == 1
    x = inputs(src)
    close(evaluate(streamed, x, dtype="f64"), evaluate(optimized(src, "f64", **OFF), x, dtype="f64"), 1e-10)


def test_two_masks_skip_only_keys_both_mask():
    """Softmax over the causal keys, then a window of them summed: a key before the
    window is masked by the window's mask only, and the causal softmax needs it. A run
    skips only the keys every mask masks (the join of their hulls: here none), and the
    result is the unstreamed one."""
    src = MASKED.replace("p = softmax[s](where([s + 4 <= t], sum[hd](q * k), -1e9))\ny = sum[s](p * v)",
                         "p = softmax[s](where([s <= t], sum[hd](q * k), -1e9))\n"
                         "y = sum[s](where([t - 8 <= s], p, 0) * v)")
    assert src != MASKED
    streamed = optimized(src, "f64", **ON)
    assert loops(streamed) == 1
    x = inputs(src)
    close(evaluate(streamed, x, dtype="f64"), evaluate(optimized(src, "f64", **OFF), x, dtype="f64"), 1e-10)


def test_two_masks_that_each_mask_skip_both_sides_of_a_window():
    """A window written as two masks, each masking on its own: `- 1e9 * [s > t] - 1e9 *
    [s < t - 8]` (two subtracted fills) or two nested wheres. A key is masked where one
    of them masks it, so a run skips the keys outside the meet of their hulls (each
    mask shown by stream_skip.exact to suffice with the other 0 or 1): the window's
    work (about 0.16 of every key's over 8 runs), where the join of the hulls (keys
    that both mask) skipped none of the two fills' keys before the window."""
    big = "t = 32, hd = 2"
    window = WINDOW.replace(big, "t = 256, hd = 16")
    window = step_flops(window, 8) / step_flops(window, 0)
    for src in (TWO_FILLS, NESTED_WHERE):
        ratio = step_flops(src.replace(big, "t = 256, hd = 16"), 8) / step_flops(src.replace(big, "t = 256, hd = 16"), 0)
        assert 0.1 < ratio < 0.2 and abs(ratio - window) < 0.02, (ratio, window)
    # a small second fill leaves the keys before the window a weight: only the future,
    # which the first fill masks, is skipped, in the runs after the first (its rows
    # t <= 8 have no key before the window, which the join's roles read as a row that
    # sees no key, kept whole): (8 + 2 + 3 + ... + 8) / 64
    weak = TWO_FILLS.replace("- 1e9 * [s < t - 8]", "- 10 * [s < t - 8]")
    ratio = step_flops(weak.replace(big, "t = 256, hd = 16"), 8) / step_flops(weak.replace(big, "t = 256, hd = 16"), 0)
    assert abs(ratio - 43 / 64) < 0.02, ratio
    x = inputs(weak)
    close(evaluate(optimized(weak, "f64", **ON), x, dtype="f64"), evaluate(optimized(weak, "f64", **OFF), x, dtype="f64"),
          1e-10)


# the benchmark's shape, small: causal attention over a batch and heads
BATCHED = ATTENTION.replace("dim head = 2, t = 32, hd = 2", "dim batch = 2, head = 2, t = 32, hd = 2").replace(
    "[head, ", "[batch, head, ")


def nested(module) -> list[int]:
    """How many loops each level holds: the top level's, then those of the first loop's
    step, and so on."""
    from tgc.ir.values import topo_order
    from tgc.lower.steps import loop_key

    out, values = [], module.values()
    while True:
        found = [v for v in values if v.op == "loop"]
        if not found:
            return out
        out.append(len({loop_key(v) for v in found}))
        values = topo_order(list(found[0].attrs[0].results))


def test_steps_over_the_cache_budget_loop_over_batch_and_heads():
    """BATCHED's steps would hold [batch, head, 4, s] = 512 elements per matrix: over
    stream_step_elements = 64, the cluster runs as a loop over the batch, whose step
    loops over the heads, whose step streams t in 2 runs, with the block halved to 2
    (2 * 32 keys fits, 4 * 32 does not). At a budget that even a head's halved block
    exceeds, the loops over the batch and the heads still run, their step streaming
    blocks of 4 (a step holds one sequence's head's matrices, whatever the batch and
    heads); where such steps would run over key blocks under the stream's own rows
    (`stream_key_rows` does not divide t), nothing changes (2 runs at the top); with 0,
    never. All on one thread: on two, the loop's steps run on both at once and share the
    block where a step is over the budget (2 rows each, not 4). The values and gradients
    are the unstreamed program's and torch's, on the interpreter (f64) and the CPU (f64,
    f32)."""
    import tgc
    from tgc.backends.cpu.options import CpuOptions

    cache = {**ON, "stream_block_min": 2, "stream_step_elements": 64, "cpu": CpuOptions(threads=1)}
    over = {**cache, "stream_step_elements": 32}
    streamed = optimized(BATCHED, "f64", **cache)
    assert nested(streamed) == [1, 1, 2] and streamed.dims["t.1"] == 2, (nested(streamed), streamed.dims)
    looped = optimized(BATCHED, "f64", **over)
    assert nested(looped) == [1, 1, 2] and looped.dims["t.1"] == 4, (nested(looped), looped.dims)
    shared = optimized(BATCHED, "f64", **{**over, "cpu": CpuOptions(threads=2, parallel_steps_min_cycles=1)})
    assert nested(shared) == [1, 1, 2] and shared.dims["t.1"] == 2, (nested(shared), shared.dims)
    assert nested(optimized(BATCHED, "f64", **over, stream_key_block=4))[0] == 2   # 2 runs at the top (key loops in them)
    flat_opts = {**cache, "stream_step_elements": 0}
    flat = optimized(BATCHED, "f64", **flat_opts)
    assert nested(flat) == [2] and flat.dims["t.1"] == 4
    x = inputs(BATCHED)
    want = torch_oracle.evaluate(compile_source(BATCHED, "<stream>", Options(dtype="f64")), x)
    unstreamed = evaluate(optimized(BATCHED, "f64", **OFF), x, dtype="f64")
    for module in (streamed, looped):
        got = evaluate(module, x, dtype="f64")
        close(got, unstreamed, 1e-10)
        close(got, want, 1e-10)
    for opts in (cache, over):
        for dtype, tol in (("f64", 1e-10), ("f32", 2e-5)):
            prog = tgc.compile(BATCHED, "cpu", dtype, options=Options(**opts))
            assert any(getattr(k, "kind", "") == "steps" for k in prog.lowered.kernels)
            close(prog(**inputs(BATCHED, dtype)), want, tol)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_head_loops_over_the_budget_compute_the_flat_streams_bits(dtype):
    """At heads of 64 (t = 1024, 2 heads x batch 2), steps over the budget even one head
    a step loop over the batch and heads; each head's step is the flat stream's step
    for that head, laid out alike (the block edge declared after t in the loop's body
    as at the top: tgc.opt.rewrite.map_bodies), so the CPU computes the same bits as the
    flat stream (budget 0: no loops), within 2e-5 of torch in f32. On one thread: on two
    the loop's steps share the block (128 rows each)."""
    import tgc
    from tgc.backends.cpu.options import CpuOptions

    src = BATCHED.replace("t = 32, hd = 2", "t = 1024, hd = 64")
    x = inputs(src, dtype)
    got = {}
    for name, budget, shape in (("looped", 1 << 16, [1, 1, 4]), ("flat", 0, [4])):
        options = Options(dtype=dtype, stream_step_elements=budget, cpu=CpuOptions(threads=1))
        assert nested(pipeline.lower(compile_source(src, "<stream>", options), options).module) == shape
        got[name] = tgc.compile(src, "cpu", dtype, options=options)(**x)
    for out, value in got["looped"].items():
        assert np.array_equal(value, got["flat"][out]), out
    if dtype == "f32":
        close(got["looped"], torch_oracle.evaluate(compile_source(src, "<stream>", Options(dtype="f64")),
                                                   inputs(src)), 2e-5)


def test_a_budget_loop_keeps_the_peak_linear():
    """With the steps looped over the batch and heads, the peak of live temporaries still
    doubles with t (O(t * d), no [t, s] matrix), within 1.5 times the flat stream's (the
    loops' stacked results: 1.2 times here)."""
    from tgc.explain import explain
    from tgc.pipeline import lower_module

    def peak_at(t, budget):
        src = BATCHED.replace("t = 32, hd = 2", f"t = {t}, hd = 16")
        opts = dict(stream_block=32, stream_min_elements=1 << 14, stream_mask_groups=4, stream_step_elements=budget)
        module = optimized(src, "f32", **opts)
        assert nested(module) == ([1, 1, 4] if budget else [4]), nested(module)
        return explain(lower_module(module, Options(**opts)), {})["peak"]["bytes"]

    small, large = peak_at(256, 32 * 256), peak_at(512, 32 * 512)
    assert 1.5 * small <= large <= 2.5 * small, (small, large)
    assert large <= 1.5 * peak_at(512, 0), large
    assert large < 4 * 512 * 512 * 4 / 2   # less than half of one [batch, head, t, s] f32 matrix


def test_rejecting_multi_link_masks_skip_keys():
    """A mask over a chain of links may reject as a single link does: `- 1e9 * (1 -
    [band])` and `where(1 - [band], -1e9, scores)` (the band admits; `1 - [band]` is 1
    at every key it masks) skip what the window skips; `- 1e9 * [4 <= t < s]` (the
    chain rejects: its keys are a union, `t < 4` or `s <= t`) skips the future of every
    run but the first, whose rows t < 4 see every key: (8 + 2 + 3 + ... + 8) / 64 of
    the work, where its single-link `[s > t]` does 36 / 64. The chain's values and
    gradients, in 4 runs of which 3 skip, are the unstreamed program's and torch's, on
    the interpreter (f64) and the CPU (f64, f32)."""
    import tgc

    big = "t = 256, hd = 16"
    window = WINDOW.replace("t = 32, hd = 2", big)
    window = step_flops(window, 8) / step_flops(window, 0)
    for src in (BAND_REJECTING, FLIPPED):
        src = src.replace("t = 32, hd = 2", big)
        ratio = step_flops(src, 8) / step_flops(src, 0)
        assert 0.1 < ratio < 0.2 and abs(ratio - window) < 0.02, (ratio, window)
    chain = CHAIN_REJECTING.replace("t = 32, hd = 2", big)
    ratio = step_flops(chain, 8) / step_flops(chain, 0)
    assert abs(ratio - 43 / 64) < 0.02, ratio
    four = {**ON, "stream_mask_groups": 4}
    streamed, plain = optimized(CHAIN_REJECTING, "f64", **four), optimized(CHAIN_REJECTING, "f64", **OFF)
    assert loops(streamed) == 4 and loops(optimized(CHAIN_REJECTING, "f64", **ON)) == 1   # 2 runs: none skips
    x = inputs(CHAIN_REJECTING)
    want = torch_oracle.evaluate(compile_source(CHAIN_REJECTING, "<stream>", Options(dtype="f64")), x)
    got = evaluate(streamed, x, dtype="f64")
    close(got, evaluate(plain, x, dtype="f64"), 1e-10)
    close(got, want, 1e-10)
    for dtype, tol in (("f64", 1e-10), ("f32", 2e-5)):
        prog = tgc.compile(CHAIN_REJECTING, "cpu", dtype, options=Options(**four))
        assert any(getattr(k, "kind", "") == "steps" for k in prog.lowered.kernels)
        close(prog(**inputs(CHAIN_REJECTING, dtype)), want, tol)


@pytest.mark.parametrize("fill", ["- 10 * (1 - [t - 8 <= s <= t])", "- 10 * [4 <= t < s]"])
def test_a_rejecting_multi_link_mask_with_a_small_fill_keeps_every_key(fill):
    """A fill of 10 leaves the masked keys a weight: the loop runs over every key, and
    the result is the unstreamed one."""
    src = ATTENTION.replace("where([s <= t], sum[hd](q * k) / sqrt(size(hd)), -1e9)", f"sum[hd](q * k) {fill}")
    assert src != ATTENTION
    streamed = optimized(src, "f64", **ON)
    assert loops(streamed) == 1
    x = inputs(src)
    close(evaluate(streamed, x, dtype="f64"), evaluate(optimized(src, "f64", **OFF), x, dtype="f64"), 1e-10)


def test_a_masked_stream_over_2_to_62_rows_compiles(tmp_path):
    """The mask analysis sized arrays by the query rows: at t = 2^62 (a fuzzed
    examples/attention.tg, `dim t = 4611686018427387904` and `min[hd]` for `sum[hd]`)
    `tgc dump-ir` was an internal error (numpy: 'array is too big'). So many rows are
    not analysed: the stream's one loop runs over every key."""
    from pathlib import Path

    from click.testing import CliRunner

    from tgc.cli import main

    src = (Path(__file__).resolve().parents[2] / "examples" / "attention.tg").read_text()
    src = src.replace("dim t = 11 ", "dim t = 4611686018427387904 ").replace("sum[hd](qh * kh)", "min[hd](qh * kh)")
    (tmp_path / "big.tg").write_text(src)
    r = CliRunner().invoke(main, ["dump-ir", str(tmp_path / "big.tg")])
    assert r.exit_code in (0, 1) and "internal compiler error" not in r.output, r.output

