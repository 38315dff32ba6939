"""The `group` lowering stage: neighbouring loop kernels in shared outer loops.

Each program runs on the cpu backend against the reference interpreter, serially and
split over two threads (`parallel_min_work=1` makes every group parallel), at row
counts around the block count, so partial sums, registers and inlined producers are
all checked numerically; the structure is checked on the lowered form.
"""
from __future__ import annotations

import numpy as np
import pytest

import tgc
from tgc.ir.interp import evaluate
from tgc.ir.inputs import random_inputs
from tgc.backends.cpu.group import LoopGroup
from tgc.lower.lowered import LoopKernel
from tgc.options import Options

from layer_programs import LAYERNORM


# a bias gradient summed over rows next to elementwise work: outer loops (rows, d)
TANH_BIAS = """
dim rows, d
input x[rows, d]
input dy[rows, d]
y = tanh(x)
out y
out g = grad(sum(y * dy), x)
out s = sum[rows](dy * y)
"""

# a sum over rows read back by every row: the reader must wait for the whole sum
SUM_THEN_SCALE = """
dim rows, d
input x[rows, d]
s = sum[rows](exp(x))
out z = x * s
"""

# a Hessian-vector product: a per-row tensor with an exp in it is kept in a scratch row
HVP = """
dim rows, d
input x[rows, d]
input y[rows, d]
input v[rows, d]
loss = sum(cross_entropy[d](x, y))
g = grad(loss, x)
out hv[rows, d] = grad(g @ v, x)
"""

SOFTMAX = """
dim rows, d
input x[rows, d]
input dy[rows, d]
y = softmax[d](x)
out y
out dx = grad(sum(y * dy), x)
"""

TOL = {"f64": (1e-10, 1e-12), "f32": (2e-4, 2e-5)}


def build(source: str, dtype: str, **opts):
    return tgc.compile(source, backend="cpu", dtype=dtype, options=Options().with_(**opts))


def run_and_compare(prog, rows: int, d: int, dtype: str, seed: int = 0) -> dict:
    m = prog.module
    x = random_inputs(m, m.bind_dims({"rows": rows, "d": d}), seed, dtype)
    want = evaluate(m, {k: np.copy(v) for k, v in x.items()}, dtype=dtype)
    got = prog(**{k: np.copy(v) for k, v in x.items()})
    rtol, atol = TOL[dtype]
    for name, w in want.items():
        scale = max(1.0, float(np.max(np.abs(w)))) if w.size else 1.0
        np.testing.assert_allclose(got[name], w, rtol=rtol, atol=atol * scale, err_msg=name)
    return got


def groups(prog) -> list[LoopGroup]:
    return [k for k in prog.lowered.kernels if isinstance(k, LoopGroup)]


@pytest.mark.parametrize("dtype", ["f64", "f32"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("source", [LAYERNORM, TANH_BIAS, SUM_THEN_SCALE, HVP, SOFTMAX],
                         ids=["layernorm", "tanh_bias", "sum", "hvp", "softmax"])
def test_groups_match_the_interpreter(source, threads, dtype):
    prog = build(source, dtype, threads=threads, parallel_min_work=1)
    for rows in (1, 2, 31, 32, 33, 100):
        run_and_compare(prog, rows, 24, dtype, seed=rows)


def test_layernorm_is_one_group_with_row_statistics_in_registers():
    prog = build(LAYERNORM, "f32")
    (g,) = [g for g in groups(prog) if g.blocks]   # (the others zero and add up the partial sums)
    assert g.outer == ("rows",) and g.blocks == 32 and len(g.regs) == 4
    # x - mean is recomputed where read, never stored
    assert not [b for b in prog.lowered.buffers.values() if b.kind == "temp" and b.edges == ("d", "rows")]
    partial = [m for m in g.members if m.note == "partial sums"]
    assert len(partial) == 2


def test_tanh_and_its_bias_gradient_share_one_pass():
    prog = build(TANH_BIAS, "f32")
    (g,) = groups(prog)
    assert g.outer == ("rows", "d") and g.blocks
    assert [m.note for m in g.members].count("partial sums") == 1


def test_a_reader_of_a_sum_over_rows_waits_for_it():
    """z reads the whole sum: it is a kernel of its own (in no group with the sum),
    after the kernel that finishes the sum."""
    prog = build(SUM_THEN_SCALE, "f64")
    kernels = prog.lowered.kernels
    (zi,) = [i for i, k in enumerate(kernels) if isinstance(k, LoopKernel) and k.out == "z"]
    from tgc.lower.lowered import Load, walk

    summed = next(n.buf for n in walk(kernels[zi].body) if isinstance(n, Load) and n.buf != "x")  # z = x * s
    (si,) = [i for i, k in enumerate(kernels) if isinstance(k, LoopKernel) and k.out == summed]
    assert si < zi and not any(isinstance(k, LoopGroup) for k in kernels)


def test_partial_sums_do_not_depend_on_the_thread_count():
    x = random_inputs(build(LAYERNORM, "f32").module, {"rows": 333, "d": 40}, 1, "f32")
    one = build(LAYERNORM, "f32", threads=1)(**{k: np.copy(v) for k, v in x.items()})
    two = build(LAYERNORM, "f32", threads=2, parallel_min_work=1)(**{k: np.copy(v) for k, v in x.items()})
    for name in one:
        assert np.array_equal(one[name], two[name]), name


def test_group_blocks_zero_turns_grouping_off():
    prog = build(LAYERNORM, "f64", group_blocks=0)
    assert not groups(prog)
    run_and_compare(prog, 5, 8, "f64")


def test_an_expensive_row_tensor_lives_in_a_scratch_row_per_block():
    prog = build(HVP, "f32")
    (g,) = groups(prog)
    assert g.blocks and any(m.note == "scratch row" for m in g.members)
    temps = [b for b in prog.lowered.buffers.values() if b.kind == "temp"]
    assert [b.order for b in temps] == [("#block", "d")]


# three heads first: threads share (head, b) as one range, not 3 heads over 2 threads
HEADS = """
dim b, d
dim head = 3
input x[head, b, d]
out y[head, b, d] = x * sum[d](x)
out z[head, b, d] = exp(x) * 2
"""


@pytest.mark.parametrize("threads", [1, 2])
def test_a_short_first_loop_is_split_with_the_next(threads):
    from tgc.backends.cpu.loops import split_loops

    prog = build(HEADS, "f64", threads=threads, parallel_min_work=1)
    assert {split_loops(k, prog.options.cpu) for k in prog.lowered.kernels} == {("head", "b")}
    for rows in (1, 5, 33):
        m = prog.module
        x = random_inputs(m, m.bind_dims({"b": rows, "d": 7}), rows, "f64")
        want = evaluate(m, dict(x), dtype="f64")
        got = prog(**x)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-13)


ONE_HEAD = """
dim batch = 1, head = 1, t = 40, d = 16
input x[batch, head, t, d]
out y[batch, head, t, d] = x * sum[d](x)
out z[batch, head, t, d] = exp(x) * 2
"""


def test_short_first_loops_are_split_with_the_next_until_the_range_is_long():
    """One head of one sequence (a stream's key-block step, `[batch, head, ..]` at sizes
    1 and 1): the split range takes `t` too, so that both threads share the rows
    (the range of batch and head alone was 1: thread 0 ran the kernel). The loop
    groups' members and the plain loops alike; the same bits on 1 and 2 threads."""
    from tgc.backends.cpu.loops import split_loops

    progs = {n: build(ONE_HEAD, "f32", threads=n, parallel_min_work=1, parallel_min_work_warm=1) for n in (1, 2)}
    cpu = progs[2].options.cpu
    splits = {split_loops(k, cpu) for k in progs[2].lowered.kernels}
    assert splits == {("batch", "head", "t")}, splits
    m = progs[2].module
    x = random_inputs(m, m.bind_dims({}), 3, "f32")
    want = evaluate(m, dict(x), dtype="f32")
    one, two = progs[1](**x), progs[2](**x)
    for name in want:
        np.testing.assert_allclose(two[name], want[name], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(two[name], one[name])


def test_a_bounded_sum_is_not_split_and_keeps_its_bounds():
    """`sum[q] scores[q + 1, q]` runs q over [0, 4): read past that, it would add what
    lies after the array (here 1e6)."""
    from tgc.backends.cpu.loops import split_loops

    prog = tgc.compile("dim p = 5, q = p\ninput scores[p, q]\nout s = [q = p + 1] @ scores[q -> p, p -> q]\n",
                       dtype="f64")
    assert [split_loops(k, prog.options.cpu) for k in prog.lowered.kernels] == [()]
    memory = np.full(100, 1e6)
    scores = memory[:25].reshape(5, 5)
    scores[:] = np.arange(25.0).reshape(5, 5)
    assert prog(scores=scores)["s"] == sum(scores[q + 1, q] for q in range(4))


def test_a_softmax_takes_one_exp_per_element():
    """logsumexp then exp(x - lse) become max, e = exp(x - max) in a scratch row, its
    sum, and e * (1/sum): no logsumexp is left and exactly one exp is."""
    from tgc.lower.lowered import Map, walk

    prog = build(SOFTMAX, "f32")
    (g,) = groups(prog)
    assert not [m for m in g.members if m.reduce == "logsumexp"]
    exps = [n for m in g.members for n in walk(m.body) if isinstance(n, Map) and n.fn == "exp"]
    assert len(exps) == 1


@pytest.mark.parametrize("dtype", ["f64", "f32"])
def test_a_causal_softmax_with_masked_rows_matches_the_interpreter(dtype):
    prog = build("dim b\ndim t = 7\ndim s = t\ninput x[b, t, s]\n"
                 "out y[b, t, s] = softmax[s](where([s <= t], x, -inf))\n", dtype)
    m = prog.module
    x = random_inputs(m, m.bind_dims({"b": 5}), 3, dtype)
    want = evaluate(m, dict(x), dtype=dtype)["y"]
    got = prog(**x)["y"]
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    assert np.all(got[:, 0, 1:] == 0) and np.allclose(got[:, 0, 0], 1)


# rows of 3 classes: every inner loop is unrolled, so LLVM vectorizes over the rows
CROSS_ENTROPY = """
dim rows
dim c = 3
input x[rows, c]
input y[rows, c]
out loss = sum(cross_entropy[c](x, y))
out g = grad(sum(cross_entropy[c](x, y)), x)
"""


def test_a_group_over_short_rows_is_vectorized_over_them_and_its_blocks_match():
    from tgc.backends.cpu.loops import rows_vectorized

    prog = build(CROSS_ENTROPY, "f64", threads=2, parallel_min_work=1)
    cpu = prog.options.cpu
    blocked = [g for g in groups(prog) if g.blocks]
    assert blocked and all(rows_vectorized(g, cpu) for g in blocked)
    assert not any(rows_vectorized(g, cpu) for g in groups(build(LAYERNORM, "f64")))
    m = prog.module
    block = cpu.group_min_vector_block_rows
    for rows in (1, block - 1, block, 3 * block + 5):
        x = random_inputs(m, m.bind_dims({"rows": rows}), rows, "f64")
        want = evaluate(m, {k: np.copy(v) for k, v in x.items()}, dtype="f64")
        got = prog(**x)
        for name, w in want.items():
            np.testing.assert_allclose(got[name], w, rtol=1e-12, atol=1e-12, err_msg=name)


HEAD_SOFTMAX = "dim b\ndim head = 3, t = 7\ndim s = t\ninput x[head, b, t, s]\n" \
               "out y[head, b, t, s] = softmax[s](where([s <= t], x, -inf))\n"


@pytest.mark.parametrize("threads", [1, 2])
def test_blocks_of_a_short_first_loop_take_the_next_loop_too(threads):
    from tgc.backends.cpu.loops import blocked_loops

    prog = build(HEAD_SOFTMAX, "f64", threads=threads, parallel_min_work=1)
    blocked = [g for g in groups(prog) if g.blocks]
    assert blocked and all(blocked_loops(g, prog.options.cpu) == ("head", "b") for g in blocked)
    m = prog.module
    for rows in (1, 2, 11, 40):
        x = random_inputs(m, m.bind_dims({"b": rows}), rows, "f64")
        want = evaluate(m, dict(x), dtype="f64")["y"]
        np.testing.assert_allclose(prog(**x)["y"], want, rtol=1e-12, atol=1e-13)


BATCH_HEAD_SOFTMAX = "dim b = 2, head = 4, t = 24\ndim s = t\ninput x[b, head, t, s]\n" \
                     "out y[b, head, t, s] = softmax[s](where([s <= t], x, -inf))\n"


@pytest.mark.parametrize("threads", [1, 2])
def test_blocks_of_short_first_loops_take_the_loops_while_their_product_is_short(threads):
    # 2 x 4 rows of batches and heads make fewer than two blocks of group_min_block_rows:
    # the blocks divide the rows t too (a streamed attention step's softmax ran on one thread)
    from tgc.backends.cpu.loops import blocked_loops

    prog = build(BATCH_HEAD_SOFTMAX, "f64", threads=threads, parallel_min_work=1)
    blocked = [g for g in groups(prog) if g.blocks]
    assert blocked and all(blocked_loops(g, prog.options.cpu) == ("b", "head", "t") for g in blocked)
    m = prog.module
    x = random_inputs(m, m.bind_dims({}), 1, "f64")
    want = evaluate(m, dict(x), dtype="f64")["y"]
    np.testing.assert_allclose(prog(**x)["y"], want, rtol=1e-12, atol=1e-13)


def test_blocks_stay_on_the_first_loop_when_it_is_summed_over():
    from tgc.backends.cpu.loops import blocked_loops

    prog = build("dim b\ndim head = 3, d = 5\ninput x[head, b, d]\nout s[b, d] = sum[head](tanh(x))\n"
                 "out y[head, b, d] = tanh(x) * 2\n", "f64", threads=2, parallel_min_work=1)
    partial = [g for g in groups(prog) if g.blocks and any("head" in m.red for m in g.members)]
    assert partial and all(blocked_loops(g, prog.options.cpu) == ("head",) for g in partial)
    m = prog.module
    x = random_inputs(m, m.bind_dims({"b": 9}), 1, "f64")
    want = evaluate(m, dict(x), dtype="f64")
    got = prog(**x)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-13)


SOFTMAX_AND_LSE = """
dim rows, d
input x[rows, d]
out p = softmax[d](x)
out l = logsumexp[d](x)
"""


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_the_shift_of_softmax_and_logsumexp_keeps_nan_and_minus_inf_rows_as_the_interpreter(dtype):
    """The max a softmax or logsumexp subtracts ('maxshift': one compare and select a
    step, NaNs skipped) gives the interpreter's values: rows with a NaN, a -inf, all
    -inf, and signed zeros."""
    prog = build(SOFTMAX_AND_LSE, dtype)
    assert [k for g in groups(prog) for k in g.members if k.reduce in ("max", "maxshift")]
    m = prog.module
    x = random_inputs(m, m.bind_dims({"rows": 6, "d": 37}), 0, dtype)
    xs = x["x"]
    xs[1, 5], xs[2, 0], xs[3, 36] = np.nan, np.nan, -np.inf
    xs[4, :] = -np.inf
    xs[5, :3] = [-0.0, 0.0, -0.0]
    with np.errstate(invalid="ignore"):   # the interpreter's own NaN arithmetic
        want = evaluate(m, {k: np.copy(v) for k, v in x.items()}, dtype=dtype)
    got = prog(**x)
    for name in ("p", "l"):
        np.testing.assert_array_equal(np.isnan(got[name]), np.isnan(want[name]), err_msg=name)
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


# the logsumexp is an output, or read otherwise too, besides exp(x - lse)
LSE_KEPT = {
    "output": "dim rows, d\ninput x[rows, d]\nout m = logsumexp[d](x)\nout y[rows, d] = exp(x - m)\n",
    "read_otherwise": "dim rows, d\ninput x[rows, d]\nm = log(sum[d](exp(tanh(x))))\n"
                      "out y[rows, d] = exp(tanh(x) - m) * m\n",
    "read_after": "dim rows, d\ninput x[rows, d]\nm = logsumexp[d](x)\nout y = exp(x - m)\n"
                  "out z = sum[d](x) * m\n",
}


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("case", sorted(LSE_KEPT))
def test_a_logsumexp_read_besides_its_softmax_is_still_written_with_one_exp_per_element(case, dtype):
    """Found by a conformance probe: an output `logsumexp` next to `exp(x - lse)` was
    never written (its buffer was dropped for the softmax form). Now it is written as
    max + log(sum), from the one exp per element, with the logsumexp's own values on
    rows with +inf, NaN, -inf and all -inf."""
    from tgc.lower.lowered import Map, walk

    prog = build(LSE_KEPT[case], dtype, threads=2, parallel_min_work=1)
    exps = [n for g in groups(prog) for m in g.members for n in walk(m.body)
            if isinstance(n, Map) and n.fn == "exp"]
    assert len(exps) == 1
    m = prog.module
    x = random_inputs(m, m.bind_dims({"rows": 40, "d": 19}), 2, dtype)
    xs = x["x"]
    xs[1, 5], xs[2, 0], xs[3, 18] = np.inf, np.nan, -np.inf
    xs[4, :] = -np.inf
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        want = evaluate(m, {k: np.copy(v) for k, v in x.items()}, dtype=dtype)
    got = prog(**x)
    rtol, atol = TOL[dtype]
    for name, w in want.items():
        np.testing.assert_array_equal(np.isnan(got[name]), np.isnan(w), err_msg=name)
        np.testing.assert_allclose(got[name], w, rtol=rtol, atol=atol, err_msg=name)


def test_the_rows_loop_of_a_group_vectorized_over_rows_asks_for_masked_last_rows():
    """That loop carries `llvm.loop.vectorize.predicate.enable` (no scalar remainder
    loop with every exp and log of the rows inlined once more: the MLP's cross-entropy
    group took 74 -> 30 ms to compile); a group over long rows does not."""
    from tgc.backends.cpu import codegen
    from tgc.pipeline import lower_module

    def text(source):
        prog = build(source, "f64")
        return codegen.generate(lower_module(prog.module, Options(dtype="f64")), Options(dtype="f64"))

    assert "llvm.loop.vectorize.predicate.enable" in text(CROSS_ENTROPY)
    assert "llvm.loop.vectorize.predicate.enable" not in text(LAYERNORM)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("source, shift", [(HVP, "maxshift"), (SOFTMAX, "maxshift"), (LSE_KEPT["read_otherwise"], "maxshift"),
                                           ("dim rows, d\ninput x[rows, d], y[rows, d]\n"
                                            "out l = sum(cross_entropy[d](x, y))\n", "max")],
                         ids=["hvp", "softmax", "own_max", "log_softmax"])
def test_a_max_read_only_as_the_shift_of_one_exp_skips_nans_with_the_same_values(source, shift, dtype):
    """A max that only `exp(x - max)` reads, whose exps reach every output through
    their sum, may skip NaNs (maxshift, llvm.maxnum): a NaN in a row makes the sum and
    so the row NaN either way. Read otherwise (log_softmax's x - max), it stays a max.
    (A logsumexp of no max takes the group's own shift, a maxshift.) Values on rows with NaN, +-inf, all -inf and signed zeros are the interpreter's."""
    prog = build(source, dtype, threads=2, parallel_min_work=1)
    kinds = {k.reduce for g in groups(prog) for k in g.members} & {"max", "maxshift"}
    assert kinds == {shift}
    m = prog.module
    x = random_inputs(m, m.bind_dims({"rows": 40, "d": 19}), 3, dtype)
    xs = x["x"]
    xs[1, 5], xs[2, 0], xs[3, 18], xs[6, 2] = np.inf, np.nan, -np.inf, np.nan
    xs[4, :] = -np.inf
    xs[5, :3] = [-0.0, 0.0, -0.0]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        want = evaluate(m, {k: np.copy(v) for k, v in x.items()}, dtype=dtype)
    got = prog(**x)
    rtol, atol = TOL[dtype]
    for name, w in want.items():
        np.testing.assert_array_equal(np.isnan(got[name]), np.isnan(w), err_msg=name)
        finite = np.abs(w[np.isfinite(w)])
        scale = max(1.0, float(finite.max())) if finite.size else 1.0
        np.testing.assert_allclose(got[name], w, rtol=rtol, atol=atol * scale, err_msg=name)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_a_group_over_long_rows_asks_for_the_next_row_of_what_it_streams(dtype):
    """A one-loop group prefetches the next row of each buffer it reads at its row
    (a layernorm's x and dy; `LoopGen.prefetch_next`), for rows of at least 1 KiB:
    the values (rows of 1024 and 300, the last row prefetching past the end) still
    match the interpreter on 1 and 2 threads."""
    from tgc.backends.cpu import codegen
    from tgc.pipeline import lower_module

    opts = Options(dtype=dtype)
    text = codegen.generate(lower_module(build(LAYERNORM, dtype).module, opts), opts)
    group_fn = [f for f in text.split("\ndefine ") if "llvm.prefetch" in f]
    assert len(group_fn) == 1 and group_fn[0].count("call void @\"llvm.prefetch.p0\"") == 2   # x and dy
    for threads in (1, 2):
        prog = build(LAYERNORM, dtype, threads=threads, parallel_min_work=1)
        for rows, d in ((37, 1024), (5, 300)):
            run_and_compare(prog, rows, d, dtype, seed=rows)


def _one_head_attention(t: int, batch: str = "batch") -> str:
    """examples/attention.tg with one head of 64 over `t` positions (and its gradients),
    masked with a finite -1e9."""
    from pathlib import Path

    src = (Path(__file__).resolve().parents[2] / "examples" / "attention.tg").read_text()
    return (src.replace("dim t = 11", f"dim t = {t}").replace("dim c = 48, head = 3", "dim c = 64, head = 1")
            .replace("dim batch\n", f"dim {batch}\n").replace("\nout probs", "\n# out probs")
            .replace("scores, -inf)", "scores, -1e9)"))


@pytest.mark.parametrize("batch", ["batch", "batch = 1"], ids=["symbolic", "known"])
def test_a_block_row_is_never_larger_than_its_share_of_the_tensor(batch, tmp_path):
    # one (batch, head) of attention: its [s, t] softmax was a scratch row per block,
    # [#block, s, t] (32 times the scores: a 36 MB peak at t = 512, 9 GB at 8192);
    # now at most as many block rows as rows, so the peak is a few [s, t] tensors
    import json

    from click.testing import CliRunner
    from tgc.cli import main

    t = 512
    src = tmp_path / "attention.tg"
    src.write_text(_one_head_attention(t, batch))
    r = CliRunner().invoke(main, ["explain", str(src), "--dim", "batch=1", "--format", "json"])
    assert r.exit_code == 0, r.output
    peak = json.loads(r.stdout)["peak"]
    matrix = 4 * t * t   # bytes of one [s, t] tensor
    assert all(b["bytes"] <= matrix for b in peak["buffers"]), peak
    assert peak["bytes"] <= 4 * matrix


@pytest.mark.parametrize("batch", [1, 2, 3, 40])
def test_attention_with_fewer_rows_than_blocks_matches_the_interpreter(batch):
    prog = build(_one_head_attention(8).replace("dim c = 64, head = 1", "dim c = 8, head = 1"), "f64",
                 threads=2, parallel_min_work=1)
    m = prog.module
    x = random_inputs(m, m.bind_dims({"batch": batch}), batch, "f64")
    want = evaluate(m, {k: np.copy(v) for k, v in x.items()}, dtype="f64")
    got = prog(**x)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-11, atol=1e-12, err_msg=name)


def _relative_error(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


def test_an_f32_sum_sharing_a_long_loop_is_added_up_in_f64():
    """Two sums over one loop of 10^6 form a blocked group with a partial sum per block;
    each block (31250 terms of ~1e12 here) is summed in f64 and rounded once: summed in
    f32, a vector lane carried ~1000 nearly equal terms, and the sum of squares was
    1.9e-5 off (PyTorch's f32 sum 1.6e-7)."""
    prog = build("dim n = 1000000\ninput x[n]\nout s = sum(x)\nout s2 = sum(x * x)\n", "f32")
    assert [g for g in groups(prog) if g.blocks]
    x = (1e6 + np.random.default_rng(0).standard_normal(10 ** 6)).astype(np.float32)
    got = prog(x=x)
    x64 = x.astype(np.float64)
    assert _relative_error(got["s2"], np.sum(x64 * x64)) < 1e-6
    assert _relative_error(got["s"], np.sum(x64)) < 1e-6


@pytest.mark.parametrize("rows", [3000, 40000])
def test_the_partial_rows_of_parameter_gradients_are_summed_in_f64(rows):
    """A layernorm's dw and db (width known) sum over the rows into a partial row per
    block of rows ([#block, d]); each block's rows are added in f64, rounded once (in
    f32 each element took one rounding per row: 40000 rows of dy = 0.1 gave db 1e-5
    off)."""
    prog = build(LAYERNORM.replace("dim rows, d", "dim rows, d = 16"), "f32")
    r = np.random.default_rng(1)
    inputs = {"x": r.standard_normal((rows, 16)), "dy": np.full((rows, 16), 0.1),
              "w": 1 + 0.1 * r.standard_normal(16), "b": r.standard_normal(16)}
    inputs = {k: v.astype(np.float32) for k, v in inputs.items()}
    got = prog(**{k: np.copy(v) for k, v in inputs.items()})
    want = evaluate(prog.module, {k: v.astype(np.float64) for k, v in inputs.items()}, dtype="f64")
    assert _relative_error(got["db"], want["db"]) < 1e-6
    assert _relative_error(got["dw"], want["dw"]) < 1e-6
    two = build(LAYERNORM.replace("dim rows, d", "dim rows, d = 16"), "f32", threads=2, parallel_min_work=1)
    for name, value in two(**{k: np.copy(v) for k, v in inputs.items()}).items():
        assert np.array_equal(value, got[name]), name    # the same bits on any number of threads


@pytest.mark.parametrize("dims", ["dim rows = 256, d = 8192", "dim rows, d"], ids=["known", "symbolic"])
def test_an_f32_full_sum_over_short_blocks_of_long_rows_is_added_up_in_f64(dims):
    """Full sums of a 256 x 8192 matrix in one blocked group (a gradient and the sum of
    its squares, as a global gradient norm reads it): 32 blocks of 8 rows, so each
    block adds 65536 terms into its partial sum. Those go through an f64 scratch
    although the block has few rows: added into the f32 partial, the sum of squares
    of the gradient was 27 ulps off and the dot product 12 (now under 2). The same
    bits on two threads."""
    src = f"{dims}\ninput x[rows, d], w[rows, d]\nloss = sum(tanh(w * x))\n" \
          "out g[rows, d] = grad(loss, w)\nout s2 = sum(grad(loss, w) ^ 2)\nout s4 = sum(x * x)\nout s5 = sum(x * w)\n"
    prog = build(src, "f32")
    assert [g for g in groups(prog) if g.blocks]
    r = np.random.default_rng(0)
    x = (3 + r.standard_normal((256, 8192))).astype(np.float32)
    w = r.standard_normal((256, 8192)).astype(np.float32)
    got = prog(x=x, w=w)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    g64 = np.asarray(got["g"], np.float64)
    for name, want in (("s2", np.sum(g64 * g64)), ("s4", np.sum(x64 * x64)), ("s5", np.sum(x64 * w64))):
        assert abs(float(got[name]) - want) <= 4 * np.spacing(np.float32(abs(want))), name
    two = build(src, "f32", threads=2, parallel_min_work=1)(x=x, w=w)
    for name in ("s2", "s4", "s5"):
        assert np.array_equal(two[name], got[name]), name


# AdamW-like updates of a matrix, of one stored the other way round, and of a bias:
# all share only `layer`, the matrices' own loops are longer
UPDATES = """
dim layer, a, b
input g[layer, a, b]
input m[layer, a, b]
input w[layer, a, b]
input h[layer, b, a]
input n[layer, b, a]
input u[layer, b, a]
input hb[layer, b]
input nb[layer, b]
input ub[layer, b]
out m2 = 0.9 * m + 0.1 * g
out w2 = w - 0.01 * m2 * w
out n2[layer, b, a] = 0.9 * n + 0.1 * h
out u2[layer, b, a] = u - 0.01 * n2 * u
out nb2 = 0.9 * nb + 0.1 * hb
out ub2 = ub - 0.01 * nb2 * ub
"""


def _updates(dtype: str, layer: int = 2, a: int = 384, b: int = 384, **opts):
    src = UPDATES.replace("dim layer, a, b", f"dim layer = {layer}\ndim a = {a}\ndim b = {b}")
    return build(src, dtype, **opts)


def test_a_kernel_shortening_large_shared_loops_starts_a_new_group():
    """A layer's slices (5 x 590 KB in f32) leave the cache between members sharing only
    `layer`: the transposed matrix starts a new group, and each group's members share
    all their loops (one pass over the slice); the bias joins the transposed matrix's
    group, whose rows stay small."""
    prog = _updates("f32")
    got = [(g.outer, [m.out for m in g.members]) for g in groups(prog)]
    assert got == [(("layer", "a", "b"), ["m2", "w2"]),
                   (("layer", "b"), ["n2", "u2", "nb2", "ub2"])]


def test_a_large_threshold_keeps_one_group_over_the_shorter_loops():
    """(As do symbolic sizes: the work per outer index is then unknown.)"""
    assert [g.outer for g in groups(build(UPDATES, "f32"))] == [("layer",)]
    prog = _updates("f32", group_shrink_max_bytes=1 << 40)
    (g,) = groups(prog)
    assert g.outer == ("layer",) and len(g.members) == 6


@pytest.mark.parametrize("dtype", ["f64", "f32"])
@pytest.mark.parametrize("limit", [0, 1 << 40])
def test_updates_split_or_not_match_the_interpreter(dtype, limit):
    """Split (every shortening refused) or not, the groups compute what the interpreter does."""
    prog = _updates(dtype, 3, 5, 7, group_shrink_max_bytes=limit, threads=2, parallel_min_work=1)
    assert len(groups(prog)) == (1 if limit else 3)   # 0: the bias too starts a group
    m = prog.module
    x = random_inputs(m, m.bind_dims({}), 3, dtype)
    want = evaluate(m, {k: np.copy(v) for k, v in x.items()}, dtype=dtype)
    got = prog(**{k: np.copy(v) for k, v in x.items()})
    rtol, atol = TOL[dtype]
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, rtol=rtol, atol=atol, err_msg=name)


def test_the_layernorm_group_keeps_its_rows_loop_under_any_threshold():
    """A member summing over the loop where the shared loops end (a partial sum) may
    shorten them: the layernorm backward stays one group over the rows."""
    prog = build(LAYERNORM, "f32", group_shrink_max_bytes=0)
    (g,) = [g for g in groups(prog) if g.blocks]
    assert g.outer == ("rows",) and len(g.regs) == 4


# a layernorm over the last of three edges: its parameter gradients sum over two rows loops
LAYERNORM_3D = """
dim batch, t, c
input x[batch, t, c]
input dy[batch, t, c]
param w[c], b[c]
y = layernorm[c](x, w, b)
loss = sum(y * dy)
out dx = grad(loss, x)
out dw = grad(loss, w)
out db = grad(loss, b)
"""


def test_golden_a_layernorm_backward_over_two_rows_loops_is_one_pass_over_its_rows():
    """dw and db sum over (batch, t), both outer loops: they add into their block's
    partial row at every (batch, t), so the group keeps both loops, its row statistics
    are registers, and each row of x and dy is read from memory once (with only
    `batch` outer, every member ran its own pass over a batch's [t, c] slab: nine
    buffers of a nanoGPT-char step's layer, 3.5 MB, left the L2 between members).
    That is when a batch's slab holds more than `group_shrink_max_bytes`: 0 here."""
    prog = build(LAYERNORM_3D.replace("dim batch, t, c", "dim batch, t = 8, c = 16"), "f32", group_shrink_max_bytes=0)
    (g,) = [g for g in groups(prog) if g.blocks]
    lines = [line.strip() for line in g.text().splitlines()]
    assert lines[0] == "group for batch < batch, t < 8 in 32 blocks  reg %t7[batch, t], %t9[batch, t], " \
        "%t10[batch, t], %t11[batch, t]"
    assert [line.split(" = ")[0] for line in lines[1::2]] == \
        ["loop %t7[batch, t]", "loop %t9[batch, t]", "loop %t10[batch, t]", "loop %t11[batch, t]",
         "loop %dx[batch, c, t]", "loop %p7[#block, c]", "loop %p8[#block, c]"]
    assert lines[-2:] == ["loop %p8[#block, c] = sum[batch, t] %dy[batch, c, t]",
                          "for batch < batch, t < 8, c < 16    # partial sums"]
    assert [m.red for m in g.members if m.note == "partial sums"] == [("batch", "t"), ("batch", "t")]
    assert not [b for b in prog.lowered.buffers.values() if b.kind == "temp" and "#block" in b.edges
                and "t" in b.edges]   # no scratch row per block of the row statistics


@pytest.mark.parametrize("dtype", ["f64", "f32"])
@pytest.mark.parametrize("threads", [1, 2])
def test_partial_sums_over_two_rows_loops_match_the_interpreter(threads, dtype):
    for batch, t, c in ((1, 1, 3), (2, 5, 24), (3, 33, 7), (40, 3, 9)):
        source = LAYERNORM_3D.replace("dim batch, t, c", f"dim batch = {batch}, t = {t}, c = {c}")
        prog = build(source, dtype, threads=threads, parallel_min_work=1, group_shrink_max_bytes=0)
        (g,) = [g for g in groups(prog) if g.blocks]
        assert g.outer[:2] == ("batch", "t")
        m = prog.module
        x = random_inputs(m, m.bind_dims({}), batch, dtype)
        want = evaluate(m, {k: np.copy(v) for k, v in x.items()}, dtype=dtype)
        got = prog(**{k: np.copy(v) for k, v in x.items()})
        rtol, atol = TOL[dtype]
        for name, w in want.items():
            scale = max(1.0, float(np.max(np.abs(w))))
            np.testing.assert_allclose(got[name], w, rtol=rtol, atol=atol * scale, err_msg=f"{name} {batch, t, c}")


def test_partial_sums_over_two_rows_loops_do_not_depend_on_the_thread_count():
    source = LAYERNORM_3D.replace("dim batch, t, c", "dim batch = 7, t = 45, c = 40")
    m = build(source, "f32").module
    x = random_inputs(m, m.bind_dims({}), 2, "f32")
    one = build(source, "f32", threads=1, group_shrink_max_bytes=0)
    two = build(source, "f32", threads=2, parallel_min_work=1, group_shrink_max_bytes=0)
    assert [g.outer for g in groups(one) if g.blocks] == [("batch", "t")]
    one, two = (p(**{k: np.copy(v) for k, v in x.items()}) for p in (one, two))
    for name in one:
        assert np.array_equal(one[name], two[name]), name


@pytest.mark.parametrize("shrink, outer", [(None, ("batch", "t")), (1 << 22, ("batch",)), (0, ("batch", "t"))])
def test_blocks_over_a_short_summed_batch_count_the_rows_inside_each_index(shrink, outer):
    """nanoGPT-char's layernorm backward (batch 4, t 256, width 384): its parameter
    gradients sum over the batch, so the blocks divide the batch alone (4 blocks), and
    each batch index runs 256 rows of 384: one index is a block
    (`loops.rows_per_index`). With a block of `group_min_block_rows` (16) indices the
    4 were one block, and one thread ran the whole group while the other waited. The
    two threads now share it (each busy, `Program.thread_profile`); the result matches
    the interpreter and has the same bits on one thread and two. Whether the group
    keeps `t` outer (`group_shrink_max_bytes`) or not, the blocks are the same. (By
    default it does: a batch's slab, 1.97 MB, is over half the 2 MiB default; with
    `batch` alone outer the group ran at 8 GB/s, with `t` too at 10.5.)"""
    from tgc.backends.cpu.llvm_env import usable_cores
    from tgc.backends.cpu.loops import blocked_loops, rows_per_index

    source = LAYERNORM_3D.replace("dim batch, t, c", "dim batch = 4, t = 256, c = 384")
    more = {} if shrink is None else {"group_shrink_max_bytes": shrink}
    one = build(source, "f32", threads=1, **more)
    two = build(source, "f32", threads=2, profile=True, contention_memory_cycles=0, merge_regions=False, **more)
    cpu = two.options.cpu
    (i, g), = [(i, k) for i, k in enumerate(two.lowered.kernels) if isinstance(k, LoopGroup) and k.blocks]
    assert g.outer == outer and g.blocks == 4 and blocked_loops(g, cpu) == ("batch",)
    assert rows_per_index(g, cpu) == 256 >= cpu.group_min_block_rows
    m = two.module
    x = random_inputs(m, m.bind_dims({}), 3, "f32")
    want = evaluate(m, {k: np.copy(v) for k, v in x.items()}, dtype="f32")
    got = [p(**{k: np.copy(v) for k, v in x.items()}) for p in (one, two)]
    for name, w in want.items():
        np.testing.assert_allclose(got[0][name], w, rtol=1e-4, atol=1e-4 * max(1.0, float(np.max(np.abs(w)))))
        assert np.array_equal(got[0][name], got[1][name]), name
    if usable_cores() >= 2:
        cpu0, own, rest, region = two.thread_profile()[i]   # CPU time: robust to other processes
        assert region > 0 and min(own, rest) > max(own, rest) / 4   # one block: the worker was busy 0.3% of it


@pytest.mark.parametrize("sizes, outer", [("batch = 64, t = 11, c = 48", ("batch",)),
                                          ("batch = 4, t = 256, c = 768", ("batch", "t")),
                                          ("batch, t = 256, c = 768", ("batch", "t")),
                                          ("batch = 4, t, c = 768", ("batch",))])
def test_partial_sums_keep_two_rows_loops_only_where_a_slab_leaves_the_cache(sizes, outer):
    """Over a short slab per batch (a GPT of width 48: 19 kB) the members' own inner
    loops over (t, c) are long and the slab stays in cache: the group keeps `batch`
    alone. Over one of more than `group_shrink_max_bytes` (4 x 256 x 768: 3.1 MB of x,
    dy, dx) it keeps (batch, t), whatever the batch. A symbolic size inside the slab keeps
    `batch` alone."""
    prog = build(LAYERNORM_3D.replace("dim batch, t, c", "dim " + sizes), "f32")
    (g,) = [g for g in groups(prog) if g.blocks]
    assert g.outer == outer


def test_a_full_sum_keeps_only_its_first_loop_outer():
    """A sum with no kept loop (a gradient's sum of squares for clipping) sums over the
    first outer loop only: its other loops stay its own (one vectorized inner loop)."""
    prog = build("dim layer, a, b\ninput g[layer, a, b]\nout s = sum(g * g)\nout s3 = sum(g * g * g)\n", "f32")
    (g,) = [g for g in groups(prog) if g.blocks]
    assert g.outer == ("layer",)


LONE_SUM = "dim batch = 5, t = 7, c = 9\ninput g[batch, t, c]\nout db[c] = sum[batch, t](g * g)\n"


def test_a_lone_sum_over_its_leading_loops_splits_into_blocks_when_it_is_large():
    """Alone, a sum's own loop is never split over threads; as a group of one with a
    partial row per block of its first loop it is, once it has
    `cpu.parallel_min_work` iterations (known sizes)."""
    small = build(LONE_SUM, "f32")
    assert not groups(small)
    prog = build(LONE_SUM, "f32", parallel_min_work=1, threads=2)
    (g,) = [g for g in groups(prog) if g.blocks]
    assert g.outer == ("batch", "t") and [(m.note, m.red) for m in g.members] == [("partial sums", ("batch", "t"))]
    assert not groups(build(LONE_SUM.replace("dim batch = 5", "dim batch"), "f32", parallel_min_work=1))   # symbolic
    m = prog.module
    x = random_inputs(m, m.bind_dims({}), 4, "f32")
    want = evaluate(m, dict(x), dtype="f64")["db"]
    for p in (prog, build(LONE_SUM, "f32", parallel_min_work=1, threads=1), small):
        np.testing.assert_allclose(p(**x)["db"], want, rtol=1e-6)
    assert np.array_equal(prog(**x)["db"], build(LONE_SUM, "f32", parallel_min_work=1, threads=1)(**x)["db"])


LONE_FULL_SUM = "dim a = 37, b = 9\ninput g[a, b]\nout s = sum(g * g)\n"


def test_a_lone_full_sum_splits_into_blocks_when_it_is_large():
    """A sum of every loop alone (a weight gradient's sum of squares right after its
    product, in a layer loop's step: tgc/opt/step_sums.py) adds into a partial per
    block of its first loop once it has `cpu.parallel_min_work` iterations, so threads
    share it; the same bits on 1 and 2 threads, the interpreter's value to rounding."""
    assert not groups(build(LONE_FULL_SUM, "f32"))
    prog = build(LONE_FULL_SUM, "f32", parallel_min_work=1, threads=2)
    (g,) = [g for g in groups(prog) if g.blocks]
    assert g.outer == ("a",) and [(m.note, m.red) for m in g.members] == [("partial sums", ("a", "b"))]
    m = prog.module
    x = random_inputs(m, m.bind_dims({}), 5, "f32")
    want = evaluate(m, dict(x), dtype="f64")["s"]
    got = prog(**x)["s"]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.array_equal(got, build(LONE_FULL_SUM, "f32", parallel_min_work=1, threads=1)(**x)["s"])


def test_members_with_no_loops_of_their_own_keep_the_first_loop_alone():
    """A bias sum over (batch, t) beside an elementwise product over (batch, t, ff):
    with both rows loops outer every member's loops would all be outer; each streams
    its buffers once either way, so the group keeps `batch` alone (as before)."""
    prog = build("dim batch = 4, t = 256, ff = 1536\ninput g[batch, t, ff], a[batch, t, ff], b[batch, t, ff]\n"
                 "out db[ff] = sum[batch, t](g)\nout y[batch, t, ff] = a * b\n", "f32")
    (g,) = [g for g in groups(prog) if g.blocks]
    assert g.outer == ("batch",)


def _deep_shapes():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import deep_compile  # benchmarks/deep_compile.py: programs written out layer by layer

    return deep_compile


def _group_stage(source: str, monkeypatch, check: bool = False) -> int:
    """Lower `source` (f32, cpu) through the group stage; return the expression nodes
    the stage walked. With `check`, every outer-loop answer of the incremental `_Run`
    is compared with `_prefix_of` (all the members at once) and every byte count with
    `bytes_per_outer`."""
    from tgc.backends.cpu import group as G
    from tgc.pipeline import load_source, lower, lower_module, target

    src = load_source(source, "cpu", "f32", lookup=False)
    module, options = target(lower(src.module, src.options, backend="cpu").module, src.options)
    nodes = [0]
    real_walk, real_prefix, real_bytes = G.walk, G._Grouper.prefix, G._Run.bytes

    def walk(e):
        for n in real_walk(e):
            nodes[0] += 1
            yield n

    def prefix(self, members):
        got = real_prefix(self, members)
        assert tuple(got) == tuple(self._prefix_of(members)), members
        return got

    def bytes_(self, m, outer):
        got = real_bytes(self, m, outer)
        ks = [self.g.low.kernels[self.start + j] for j in range(m)]
        assert got == self.g.bytes_per_outer(ks, self.p0[:outer])
        return got

    with monkeypatch.context() as m:
        m.setattr(G, "walk", walk)
        if check:
            m.setattr(G._Grouper, "prefix", prefix)
            m.setattr(G._Run, "bytes", bytes_)
        lower_module(module, options, "cpu")
    return nodes[0]


@pytest.mark.parametrize("shape, depth", [("mlp", 6), ("gpt2", 2), ("residual", 4), ("elementwise", 3)])
def test_the_incremental_outer_loops_are_those_of_all_the_members(shape, depth, monkeypatch):
    """`_Grouper.prefix` answers from the run's folded member summaries (`_Run`): the
    same loops, and the same bytes per outer index, as asking every member again."""
    _group_stage(_deep_shapes().SHAPES[shape](depth), monkeypatch, check=True)


def test_grouping_a_deep_mlp_walks_each_member_a_bounded_number_of_times(monkeypatch):
    """A 48-layer MLP at small sizes is one group of hundreds of loop kernels: asking
    every member again for each kernel offered walked their expressions
    O(kernels^2) times (47 of 50 s of a 64-layer MLP's lowering). 4x the layers is
    now about 4x the nodes walked, not 16x."""
    shapes = _deep_shapes()
    small, large = (_group_stage(shapes.mlp(n), monkeypatch) for n in (8, 32))
    assert large <= 4.6 * small, (small, large)


def test_a_deep_written_out_gpt_makes_no_group_larger_than_the_examples_largest():
    """LLVM's loop passes take time super-linear in the size of one function: a
    12-layer GPT-2 of width 16 written out without `repeat`
    (benchmarks/deep_compile.py's `gpt2`) grouped up to 128 loop kernels into one
    function, and LLVM spent 30 s (CPU) on its two modules, 8.9 s on one group of 15,000
    lines; at 24 layers 70 s. Groups of at most 48 kernels (`grouping.MAX_MEMBERS`,
    the largest group of examples/gpt2.tg, which keeps its lowering) make the same
    code in 18 s and 38 s. Counted here on the lowered program (no LLVM)."""
    from tgc.backends.cpu.group import LoopGroup
    from tgc.pipeline import load_source, lower, lower_module, target

    src = load_source(_deep_shapes().gpt2(12), "cpu", "f32", lookup=False)
    module, options = target(lower(src.module, src.options, backend="cpu").module, src.options)
    low = lower_module(module, options, "cpu")
    sizes = [len(k.members) for k in low.kernels if isinstance(k, LoopGroup)]
    # (48 grouped kernels, then `exp_once` writes a softmax's logsumexp as more members; was 135)
    assert sizes and max(sizes) <= 56, max(sizes)
