"""stream_keys: a stream step's softmax over blocks of the keys, with a running max and
running sums (online softmax; tgc.opt.stream_keys). Forward chains (attention, cross
attention, a bias, a softmax-weighted pooling over a non-attention edge, masked rows)
and with their gradients (a second loop over the keys) against the program without the
pass and PyTorch, in f64 and f32, on the interpreter and the CPU (attention on cuda-sim
too). The golden IR is
tests/opt/stream_keys.tgir (forward) and tests/opt/stream_keys_grad.tgir."""
import numpy as np
import pytest

from tgc.frontend import compile_source
from tgc.ir.interp import evaluate
from tgc.ir.values import topo_order
from tgc.options import Options

torch_oracle = pytest.importorskip("torch_oracle", reason="the oracle needs torch")

from test_stream import (ATTENTION, BIAS, CROSS, LAYER, MASKED, POOLING, SUBTRACTIVE, WINDOW, close,  # noqa: E402
                         inputs, large_logits_and_torch, optimized)

# streams over t in blocks of 4 rows, whose [.., 4, s] matrices are over the budget of 16:
# each step runs over blocks of 4 keys
KEYS = dict(stream_block=4, stream_min_elements=200, stream_mask_groups=2, stream_step_elements=16,
            stream_key_block=4)
ROWS = dict(KEYS, stream_key_block=0)   # the same streams over t, steps whole
OFF = dict(stream_block=0)


def forward(src: str) -> str:
    """`src` without its gradients (and the inputs only they read)."""
    keep = [ln for ln in src.splitlines() if "grad(" not in ln and "loss" not in ln and "dy" not in ln]
    return "\n".join(keep) + "\n"


FORWARD = {"attention": forward(ATTENTION), "cross": forward(CROSS), "bias": forward(BIAS),
           "pooling": forward(POOLING), "masked": forward(MASKED)}
# attention with a -inf fill: masked keys' weights exp(-inf) = 0
FORWARD["inf_fill"] = FORWARD["attention"].replace("-1e9)", "-inf)")


def key_loops(module) -> int:
    """How many loops over blocks of the keys (`s`, the pooling's `n`) run inside the
    program's loops' steps (each body counted once)."""
    inner, stack = set(), [v for v in module.values() if v.op == "loop"]
    while stack:
        v = stack.pop()
        for w in topo_order(list(v.attrs[0].results)):
            if w.op == "loop" and id(w.attrs[0]) not in inner:
                stack.append(w)
                if w.attrs[1].split(".")[0] in ("s", "n"):
                    inner.add(id(w.attrs[0]))
    return len(inner)


@pytest.mark.parametrize("name", sorted(FORWARD))
def test_interpreter_f64_matches_unstreamed_and_torch(name):
    src = FORWARD[name]
    streamed = optimized(src, "f64", **KEYS)
    assert key_loops(streamed) >= 1 and key_loops(optimized(src, "f64", **ROWS)) == 0
    x = inputs(src)
    got = evaluate(streamed, x, dtype="f64")
    close(got, evaluate(optimized(src, "f64", **OFF), x, dtype="f64"), 1e-12)
    close(got, torch_oracle.evaluate(compile_source(src, "<keys>", Options(dtype="f64")), x), 1e-12)


@pytest.mark.parametrize("name", sorted(FORWARD))
def test_cpu_f32_and_f64_match_torch(name):
    import tgc

    src = FORWARD[name]
    want = torch_oracle.evaluate(compile_source(src, "<keys>", Options(dtype="f64")), inputs(src))
    for dtype, tol in (("f64", 1e-12), ("f32", 2e-6)):
        prog = tgc.compile(src, "cpu", dtype, options=Options(**KEYS))
        close(prog(**inputs(src, dtype)), want, tol)


def test_fully_masked_rows_as_unstreamed():
    """Rows t < 4 see no key (every score the fill -1e9): uniform weights, the mean of v,
    as the program without the pass, on the interpreter and in f32 on the CPU."""
    import tgc

    src = FORWARD["masked"]
    x = inputs(src)
    got = evaluate(optimized(src, "f64", **KEYS), x, dtype="f64")
    np.testing.assert_allclose(got["y"][:4], np.broadcast_to(x["v"].mean(axis=0), (4, 2)), rtol=1e-12)
    close(got, evaluate(optimized(src, "f64", **OFF), x, dtype="f64"), 1e-12)
    x32 = inputs(src, "f32")
    on = tgc.compile(src, "cpu", "f32", options=Options(**KEYS))(**x32)
    off = tgc.compile(src, "cpu", "f32", options=Options(**OFF))(**x32)
    close(on, {k: np.asarray(v, np.float64) for k, v in off.items()}, 1e-6)


# with gradients: the first loop the online softmax (m, lse, y), the second dq, dk, dv
# over the blocks with the weights recomputed from m and lse
# (cross attention and the pooling: no mask, their backward's softmax stabilized again
# over its own shift, whose max is 0; the layer: a -inf fill, projections around)
GRADS = {"attention": ATTENTION, "bias": BIAS, "masked": MASKED, "window": WINDOW, "subtractive": SUBTRACTIVE,
         "cross": CROSS, "pooling": POOLING, "layer": LAYER}


@pytest.mark.parametrize("name", sorted(GRADS))
def test_gradients_interpreter_f64_match_unstreamed_and_torch(name):
    src = GRADS[name]
    streamed = optimized(src, "f64", **KEYS)
    assert key_loops(streamed) >= 2   # two loops over the keys per step
    x = inputs(src)
    got = evaluate(streamed, x, dtype="f64")
    close(got, evaluate(optimized(src, "f64", **OFF), x, dtype="f64"), 1e-12)
    close(got, torch_oracle.evaluate(compile_source(src, "<keys>", Options(dtype="f64")), x), 1e-12)


@pytest.mark.parametrize("name", sorted(GRADS))
def test_gradients_cpu_f32_and_f64_match_torch(name):
    import tgc

    src = GRADS[name]
    want = torch_oracle.evaluate(compile_source(src, "<keys>", Options(dtype="f64")), inputs(src))
    for dtype, tol in (("f64", 1e-12), ("f32", 2e-5)):
        close(tgc.compile(src, "cpu", dtype, options=Options(**KEYS))(**inputs(src, dtype)), want, tol)


def test_fp_strict_keeps_the_steps_whole_and_the_default_streams_long_keys_only():
    """`--fp-strict` makes no key loops; the defaults make none (key blocks off); a key
    block of 256 (the docs' measured value) makes none where the keys are shorter than
    two blocks (every GPT of the benchmark table, t = 256)."""
    src = FORWARD["attention"]
    assert key_loops(optimized(src, "f64", fp_strict=True, **KEYS)) == 0
    assert Options().stream_key_block == 0
    assert key_loops(optimized(src, "f64", **dict(KEYS, stream_key_block=256))) == 0


def _step_values(module) -> list:
    """The values of the program's loops' steps, nested loops' steps included."""
    out, seen, stack = [], set(), [v for v in module.values() if v.op == "loop"]
    while stack:
        v = stack.pop()
        if id(v.attrs[0]) in seen:
            continue
        seen.add(id(v.attrs[0]))
        for w in topo_order(list(v.attrs[0].results)):
            out.append(w)
            if w.op == "loop":
                stack.append(w)
    return out


def test_a_layers_products_over_the_keys_own_edge_run_in_the_key_loops():
    """In a layer (keys and values projected from x over `t`, renamed to `s`), the scores
    `q . k` and the backward's `dO . v` are products over `t` read at the run's keys
    through a rename or a reindex: with the key loops they are made over the keys and
    computed block by block (tgc.opt.stream_keys `_products_at_keys`), so that no step
    holds a `[.., t, B]` matrix beside its key loops; y and every gradient equal the
    program without the pass (f64, interpreter)."""
    module = optimized(LAYER, "f64", **KEYS)
    assert key_loops(module) >= 2
    whole = [v for v in _step_values(module) if v.op != "indicator" and "t" in v.edges
             and any(e.startswith("t.") for e in v.edges)]
    assert not whole, [(v.op, v.edges) for v in whole]
    x = inputs(LAYER)
    close(evaluate(module, x, dtype="f64"), evaluate(optimized(LAYER, "f64", **OFF), x, dtype="f64"), 1e-12)


@pytest.mark.parametrize("rows", [{}, {"stream_key_rows": 4}, {"stream_key_rows": 8}])
def test_f32_at_logits_up_to_1e4_is_within_10x_torch_f32(rows):
    """q and k scaled so that the scores reach about 1e4 (nearly one-hot weights, the
    running max moving by thousands between blocks): tgc f32 with the key loops (CPU),
    y and every gradient, within 10x PyTorch f32's normwise error of the f64 truth,
    with the stream's rows and with `stream_key_rows` (whose steps' `dy . v` and
    `rowsum(P * dP)` the CPU computes in other kernels: the row sum taken as
    `rowsum(dy * y)` rounded an ulp away from the one-hot key's `dP`, dq and dk 1e5 to
    1e6 times PyTorch's error)."""
    import tgc
    from numerics_util import normwise_err, ok

    src = ATTENTION
    x, want, theirs = large_logits_and_torch()
    assert key_loops(optimized(src, "f32", **KEYS, **rows)) >= 2
    prog = tgc.compile(src, "cpu", "f32", options=Options(**KEYS, **rows))
    got = prog(**{n: a.astype(np.float32) for n, a in x.items()})
    for n in want:
        mine, torch_err = normwise_err(got[n], want[n]), normwise_err(theirs[n], want[n])
        assert ok(mine, torch_err), (n, mine, torch_err)


ONE_HOT = ATTENTION.replace("dim head = 2, t = 32, hd = 2", "dim head = 1, t = 4096, hd = 64")


@pytest.mark.slow
@pytest.mark.parametrize("key_block", [256, 0])
def test_one_hot_rows_at_the_defaults_give_torchs_gradients(key_block):
    """Attention at t = 4096 (one head of 64) under the default options, with key blocks
    of 256 (the steps run over key blocks) and without, with q = k = 30 * N(0, 1): each row's own key scores |k_t|^2 / 8,
    about 7e3 (up to 1e4), thousands above every other, so every row's weights are
    one-hot in f32 and f64 and the exact dq and dk are 0 (dS = P * (dP - D) with D =
    1 * dP of the row's key), as PyTorch f32's are. tgc f32 on the CPU within 10x
    PyTorch f32's normwise error: dq and dk exactly 0 (D and dP the same number)."""
    import tgc
    import torch
    from numerics_util import normwise_err, ok

    assert (key_loops(optimized(ONE_HOT, "f32", stream_key_block=key_block)) >= 2) == (key_block > 0)
    rng = np.random.default_rng(0)
    x = {n: rng.standard_normal((1, 4096, 64)) for n in ("k", "v", "dy")}
    x["k"] *= 30
    x["q"] = x["k"].copy()

    def reference(dtype):
        a = {n: torch.tensor(b, dtype=dtype, requires_grad=n in "qkv") for n, b in x.items()}
        scores = torch.einsum("htd,hsd->hts", a["q"], a["k"]) / 8
        causal = torch.ones(4096, 4096, dtype=torch.bool).tril()
        y = torch.einsum("hts,hsd->htd", torch.softmax(torch.where(causal, scores, -1e9), -1), a["v"])
        grads = torch.autograd.grad((y * a["dy"]).sum(), (a["q"], a["k"], a["v"]))
        return {n: b.detach().to(torch.float64).numpy() for n, b in zip(("y", "dq", "dk", "dv"), (y, *grads))}

    want, theirs = reference(torch.float64), reference(torch.float32)
    assert np.abs(want["dq"]).max() == 0 and np.abs(want["dv"]).max() > 0
    got = tgc.compile(ONE_HOT, "cpu", "f32", options=Options(stream_key_block=key_block))(
        **{n: a.astype(np.float32) for n, a in x.items()})
    for n in want:
        mine, torch_err = normwise_err(got[n], want[n]), normwise_err(theirs[n], want[n])
        assert ok(mine, torch_err), (n, mine, torch_err)


def test_the_steps_hold_key_blocks():
    """`tgc explain`: with the key loop the peak of live temporaries is under the peak with
    the steps' [head, B, s] matrices, and it grows linearly with t (O(t * d)): a step
    holds [head, B, Bs] tiles, not [head, B, s] rows (the peak's rest: the inputs'
    blocked copies and the stacked results)."""
    from tgc.explain import explain
    from tgc.pipeline import lower_module

    def peak_at(t, key_block):
        src = FORWARD["cross"].replace("t = 16, s = 32, hd = 2", f"t = {t}, s = {t}, hd = 16")
        opts = dict(stream_block=32, stream_min_elements=1 << 14, stream_step_elements=1 << 10,
                    stream_key_block=key_block, stream_key_rows=32)
        module = optimized(src, "f32", **opts)
        assert key_loops(module) == (1 if key_block else 0)
        return explain(lower_module(module, Options(**opts)), {})["peak"]["bytes"]

    small, large = peak_at(512, 32), peak_at(1024, 32)
    assert 1.5 * small <= large <= 2.5 * small, (small, large)
    rows = peak_at(1024, 0)   # the steps' [head, 32, 1024] matrices
    assert large < rows, (large, rows)


def test_explain_names_the_key_loops_after_the_keys():
    """`tgc explain` says what a stream step's loops over the keys stream: the keys `s`
    (the loop's first stacked operand is the mask's window over `r`)."""
    from tgc.explain import explain, format_explain
    from tgc.pipeline import lower_module

    module = optimized(FORWARD["masked"], "f32", **KEYS)
    text = format_explain(explain(lower_module(module, Options(**KEYS)), {}), "keys")
    assert "streams s in blocks of s." in text and "streams r" not in text, text


def test_a_stream_whose_steps_run_over_key_blocks_takes_stream_key_rows():
    """A stream whose steps stay over the budget and run over key blocks takes blocks of
    `stream_key_rows` rows (8 here, where the stream's own block is 4); with the key
    loops off it keeps its block. Both compute the unstreamed program's y."""
    src = FORWARD["attention"]
    rows = optimized(src, "f64", **KEYS, stream_key_rows=8)
    assert rows.dims["t.1"] == 8 and key_loops(rows) >= 1
    assert optimized(src, "f64", **ROWS, stream_key_rows=8).dims["t.1"] == 4
    x = inputs(src)
    close(evaluate(rows, x, dtype="f64"), evaluate(optimized(src, "f64", **OFF), x, dtype="f64"), 1e-12)


@pytest.mark.parametrize("dtype,tol", [("f64", 1e-12), ("f32", 2e-5)])
@pytest.mark.parametrize("name", ["attention", "layer"])
def test_cuda_sim_matches_torch(name, dtype, tol):
    """The key loops inside the stream's steps on the CUDA module's emulator (host launch
    loops), attention and the layer (its products over the keys' own edge in the key
    loops: what CUDA compiles for `benchmarks/attention.py`'s layer at t = 8192, whose
    chain the flash kernels do not take) with their gradients."""
    import tgc

    src = {"attention": ATTENTION, "layer": LAYER}[name]
    want = torch_oracle.evaluate(compile_source(src, "<keys>", Options(dtype="f64")), inputs(src))
    got = tgc.compile(src, "cuda-sim", dtype, options=Options(**KEYS))(**inputs(src, dtype))
    close(got, want, tol)


def split_binds(low) -> list:
    """The `Bind.split` arguments of every loop of a lowered program, nested ones too."""
    from tgc.lower.lowered import StepLoop

    out, stack = [], [low]
    while stack:
        lw = stack.pop()
        for k in lw.kernels:
            if isinstance(k, StepLoop):
                out += [b for b in k.args if b.split]
                stack.append(k.step)
    return out


@pytest.mark.parametrize("backend", ["lowered", "cpu"])
def test_blocks_read_in_place_match_unstreamed(backend):
    """With key blocks under rows of 8 (stream_key_rows), the stream loops over the heads
    first, so each step's keys, values and dk, dv carries are one head's: the key loops
    read their blocks in place (Bind.split: no copy) and the loop over the heads reads q,
    k, v, dy and writes y and the gradients where the program stores them; y and every gradient equal the program without the pass (f64) on
    the lowered interpreter and the CPU."""
    import tgc
    from tgc import pipeline
    from tgc.lower.lowered import StepLoop
    from tgc.pipeline import lower_module

    opts = Options(dtype="f64", **dict(KEYS, stream_key_rows=8))
    module = optimized(ATTENTION, "f64", **dict(KEYS, stream_key_rows=8))
    assert key_loops(module) >= 1
    low = lower_module(pipeline.lower(compile_source(ATTENTION, "<keys>", opts), opts).module, opts)
    splits = {b.split for b in split_binds(low)}
    assert any(s.split(".")[0] == "s" for s in splits), splits
    heads = [k for k in low.kernels if isinstance(k, StepLoop)]   # the loop over the heads itself
    assert heads and {low.buffers[b.buf].kind for k in heads for b in k.args + k.outs} == {"arg", "out"}
    # the lowered text writes such a block '%k[s]' and reads it back (and verified)
    from tgc.lower.lowered import print_lowered
    from tgc.lower.text import parse_lowered
    text = print_lowered(low)
    assert print_lowered(parse_lowered(text)) == text and "%p6[s" in text
    x = inputs(ATTENTION)
    want = evaluate(optimized(ATTENTION, "f64", **OFF), x, dtype="f64")
    close(tgc.compile(ATTENTION, backend, "f64", options=opts)(**x), want, 1e-12)


def test_the_attention_layer_at_t_8192_peaks_within_64_mib_under_the_defaults():
    """`benchmarks/attention.py`'s layer at t = 8192 (examples/attention.tg with one head
    of 64, the batch symbolic, bound to 1) under the default options and with key blocks
    of 256 (its steps run over key blocks): `tgc explain`'s peak of live temporaries is within the issue's 64
    MiB (its scores and `dO . v` over the keys' own edge were held whole, `[B, t]`,
    beside the key loops: 82 MiB), and so is the peak at t = 4096 (O(t * d), not O(t^2):
    the two heads there hold as much as the one head at 8192)."""
    import importlib
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        bench = importlib.import_module("attention")
    finally:
        sys.path.remove(str(root / "benchmarks"))
    for t in (4096, 8192):
        for opts in (Options(), Options(stream_key_block=256)):
            peak, _ = bench.tgc_peak(bench.layer_source(t), {"batch": bench.ROWS[t][1]}, opts)
            assert peak <= 64 * 2**20, (t, opts.stream_key_block, peak / 2**20)


def test_second_loop_marks_the_lse_it_reads_for_wide_exp():
    """The backward's second key loop reads the first loop's lse = log(l) as an invariant:
    its step's argument bound to it is marked `logsumexp` (`Buffer.lse`, in the lowered
    text too), so that its weights exp(X - m - lse) are softmax weights to
    `lowered.wide_exp` (the sum unrounded in f32; the numbers:
    attention_far_tail_weight_key_blocks in tests/e2e/test_numerics_f32.py). No
    argument of the first loop's step is marked (it computes lse), nor of the stream's
    over the rows (its lse is computed inside the step)."""
    from tgc.lower.lowered import Add, Load, Map, logsumexp_outputs, print_lowered, step_loops, walk
    from tgc.lower.text import parse_lowered
    from tgc.pipeline import lower_module

    src = CROSS.replace("head = 2, ", "").replace("head, ", "")
    low = lower_module(optimized(src, "f32", **KEYS), Options(**KEYS))
    steps = [k.step for _, k in step_loops(low)]
    assert len(steps) == 3   # the rows', and the two key loops inside its step
    marked = [{n for n, b in s.buffers.items() if b.lse} for s in steps]
    assert [bool(m) for m in marked] == [False, False, True], marked
    second = steps[2]
    lse = logsumexp_outputs(second)
    assert lse == marked[2]
    # every exp of a sum in the second loop reads one of them: all are softmax weights
    kernels = [m for k in second.kernels for m in (getattr(k, "members", None) or (k,))]
    exps = [e for k in kernels if hasattr(k, "body") for e in walk(k.body) if isinstance(e, Map) and e.fn == "exp"]
    assert exps and all(isinstance(e.args[0], Add) and any(isinstance(a, Load) and a.buf in lse for a in e.args[0].args)
                        for e in exps), [str(e) for e in exps]
    text = print_lowered(low)
    assert text.count(" logsumexp\n") == len(lse)
    assert print_lowered(parse_lowered(text)) == text
