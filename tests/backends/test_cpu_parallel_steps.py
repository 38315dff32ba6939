"""A loop over an edge whose steps are independent (no carry, every output stacked: a
stream's loop over the batch or the heads) shares its steps among the threads, each
step's kernels on one thread (`codegen.parallel_step_loops`, `call_steps_parallel`);
and such a loop reads the program's inputs and writes its outputs where they are stored
(tgc.lower.steps: no copies in or out). Checked: which loops qualify, that the code has
the parallel body, that the results have the same bits on one thread and on two, and
that they match the interpreter and PyTorch."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.backends.cpu.codegen import generate_units, parallel_step_loops
from tgc.frontend import compile_source
from tgc.ir.inputs import random_inputs
from tgc.lower.lowered import StepLoop
from tgc.options import Options

torch_oracle = pytest.importorskip("torch_oracle", reason="the oracle needs torch")

# causal attention with its gradients over `batch` sequences of `head` heads: the
# benchmark table's small attention workload, its batch and heads set by the test
WORKLOAD = (Path(__file__).resolve().parents[2] / "benchmarks" / "workloads" / "attention.tg").read_text()
assert "dim batch = 2, head = 2," in WORKLOAD
ATTENTION = WORKLOAD.replace("dim batch = 2, head = 2,", "dim batch = {batch}, head = {head},")

# the stream pass's thresholds at this size: a loop over the batch, whose step loops over the heads
STREAM = dict(stream_block=4, stream_block_min=2, stream_min_elements=200, stream_mask_groups=2,
              stream_step_elements=64)


def options(threads: int = 2, min_cycles: int = 1, **cpu) -> Options:
    o = Options(**STREAM)
    return o.with_(cpu=o.cpu.with_(threads=threads, parallel_steps_min_cycles=min_cycles, **cpu))


def lowered(batch: int, opts: Options, head: int = 2):
    src = pipeline.load_source(ATTENTION.format(batch=batch, head=head), options=opts, lookup=False)
    compiled, o = pipeline.target(pipeline.lower(src.module, src.options).module, src.options)
    return pipeline.lower_module(compiled, o, "cpu"), o


def test_the_outermost_loop_of_independent_steps_runs_on_the_threads():
    low, opts = lowered(2, options())
    assert [type(k) for k in low.kernels] == [StepLoop]   # no copies in or out of the loop over the batch
    loop = low.kernels[0]
    assert loop.edge == "batch" and loop.carries == 0
    assert {b.buf for b in loop.args} == {"q", "k", "v", "dy"} and {b.buf for b in loop.outs} == {"y", "dq", "dk", "dv"}
    found = parallel_step_loops(low, opts.cpu)
    assert [k for k, _ in found] == [loop]   # the heads' loop inside it runs on its lanes
    assert '@"tgc.s0"' in "".join(generate_units(low, opts))


@pytest.mark.parametrize("why", ["one thread", "threshold 0", "profile", "step too small", "uneven trip"])
def test_loops_that_do_not_qualify_run_their_steps_one_after_another(why):
    batch, head, opts = 2, 2, options()
    if why == "one thread":
        opts = options(threads=1)
    elif why == "threshold 0":
        opts = options(min_cycles=0)
    elif why == "profile":
        opts = options(profile=True)
    elif why == "step too small":
        opts = options(min_cycles=1 << 40)
    else:   # 3 steps on 2 lanes, in both loops
        batch = head = 3
    low, o = lowered(batch, opts, head)
    assert any(isinstance(k, StepLoop) and k.carries == 0 for k in low.kernels)
    assert parallel_step_loops(low, o.cpu) == []
    assert '@"tgc.s0"' not in "".join(generate_units(low, o))


def test_a_loop_over_the_heads_after_a_batch_of_1_reads_and_writes_in_place():
    """With a batch of 1 (benchmarks/attention.py's t = 4096 row: 2 heads x batch 1) the
    stream loops over the heads, which come after the batch in q, k, v, dy and the
    outputs: step i's head is still the slice at offset i times its size, so the loop
    binds the arguments and the outputs as they are (`Bind.split` on the loop edge) with
    no copy kernel in or out, and its steps run on the threads."""
    low, opts = lowered(1, options())
    assert [type(k) for k in low.kernels] == [StepLoop]
    loop = low.kernels[0]
    assert loop.edge == "head" and loop.carries == 0
    assert sorted((b.buf, b.split) for b in loop.args) == [(n, "head") for n in ("dy", "k", "q", "v")]
    assert sorted((b.buf, b.split) for b in loop.outs) == [(n, "head") for n in ("dk", "dq", "dv", "y")]
    assert [k for k, _ in parallel_step_loops(low, opts.cpu)] == [loop]
    # read back from its text: the outputs' blocks too
    from tgc.lower.lowered import print_lowered
    from tgc.lower.text import parse_lowered
    again = parse_lowered(print_lowered(low))
    assert [str(b) for b in again.kernels[0].outs] == [str(b) for b in loop.outs] == \
        ["%y[head]", "%dq[head]", "%dk[head]", "%dv[head]"]


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_parallel_steps_give_the_serial_bits_and_the_reference_values(batch):
    """batch 1: the loop over the heads runs on the threads, reading and writing the
    program's buffers in place (after the batch of 1); 2: the loop over the batch; 3:
    the loop over the heads (outermost then: its operands are copied in, its results
    out). The `lowered` interpreter (the reference for the blocks bound in place) too."""
    src = ATTENTION.format(batch=batch, head=2)
    m = compile_source(src, "<steps>", Options(dtype="f64"))
    x = random_inputs(m, m.bind_dims({}), batch, "f64")
    want = torch_oracle.evaluate(m, x)
    for dtype, tol in (("f64", 1e-10), ("f32", 2e-5)):
        a = {n: v.astype(np.float32 if dtype == "f32" else np.float64) for n, v in x.items()}
        serial = tgc.compile(src, "cpu", dtype, options=options(threads=1))(**a)
        ref = tgc.compile(src, "lowered", dtype, options=options(threads=1))(**a)
        for n in want:
            assert np.allclose(ref[n], serial[n], rtol=tol, atol=tol), (dtype, n)
        par = tgc.compile(src, "cpu", dtype, options=options())
        assert parallel_step_loops(par.lowered, options().cpu)
        for _ in range(3):   # each call: the lanes' steps write their own slices
            got = par(**a)
            for n in want:
                assert np.array_equal(got[n], serial[n]), n
                scale = max(1.0, float(np.max(np.abs(want[n]))))
                assert float(np.max(np.abs(got[n] - want[n]))) <= tol * scale, (dtype, n)


def test_explain_shows_the_loop_on_the_threads_and_its_lanes_workspace():
    """The loop over the batch is `steps on the threads`; its second lane's copy of the
    step's slots (all of them: the loop is the whole program) is reported beside the
    workspace, in the text too; one thread has none."""
    from tgc.explain import explain, format_explain

    low, opts = lowered(2, options())
    report = explain(low, {}, opts)
    assert [k["threads"] for k in report["kernels"]] == ["steps on the threads"]
    ws = report["workspace"]
    assert ws["bytes"] <= ws["lanes_bytes"] <= ws["bytes"] + 64 * len(ws["slots"])
    assert "more for the steps of a loop on the threads" in format_explain(report, "attention")
    one, o1 = lowered(2, options(threads=1))
    assert explain(one, {}, o1)["workspace"]["lanes_bytes"] == 0


def _allocated(prog) -> int:
    """The workspace bytes the compiled program's `tgc_workspace_bytes` asks for (no
    symbolic dims here)."""
    import ctypes

    dims = (ctypes.c_int64 * 1)(0)
    return int(prog._kernels._ws_bytes(ctypes.addressof(dims)))


@pytest.mark.parametrize("threads", [1, 2])
def test_explain_peak_and_workspace_are_what_the_threads_allocate(threads):
    """Issue 32: on two threads each lane holds its own copy of the loop's step, so
    `tgc explain`'s peak counts the step's temporaries once per lane (it counted them
    once: half of what two threads hold), and its `allocated_bytes` is exactly what the
    compiled code's `tgc_workspace_bytes` returns (the slots, rounded to 64 bytes, and
    the lanes' copies); on one thread the step counts once and there are no copies."""
    from tgc.explain import explain

    opts = options(threads=threads)
    low, o = lowered(2, opts)
    report = explain(low, {}, o)
    (k,) = report["kernels"]
    lanes = 2 if threads == 2 else 1
    assert k.get("lanes", 1) == lanes
    assert report["peak"]["bytes"] == lanes * k["step_peak"] > 0
    ws = report["workspace"]
    prog = tgc.compile(ATTENTION.format(batch=2, head=2), "cpu", o.dtype, options=opts)
    assert ws["allocated_bytes"] == _allocated(prog)
    assert ws["allocated_bytes"] >= report["peak"]["bytes"]
    assert (ws["lanes_bytes"] > 0) == (threads == 2)


def test_lanes_share_the_block_where_a_step_is_over_the_budget_and_match_the_oracle(monkeypatch):
    """Where one sequence's head's step is over `stream_step_elements` even so (t = 8192
    at the defaults; here a budget of 32 elements), two threads each hold their own
    step: the lanes then share the stream's block (2 rows a step, not 4: `stream.partition`),
    so that together they hold what one thread's step holds. The two-thread program
    (its blocks differ from one thread's: a reassociation of the sums over the rows)
    matches the interpreter and PyTorch in f64 and f32; explain's peak (each thread's
    temporaries counted) is below that of two threads with one thread's block."""
    from tgc.explain import explain
    from tgc.lower.lowered import print_lowered

    tight = dict(stream_step_elements=32)
    one, o1 = lowered(2, options(threads=1).with_(**tight))
    two, o2 = lowered(2, options().with_(**tight))
    rows = lambda low: sorted({int(x) for x in __import__("re").findall(r"t\.\d+ < (\d+)", print_lowered(low))})  # noqa: E731
    assert 4 in rows(one) and 4 not in rows(two) and 2 in rows(two), (rows(one), rows(two))
    assert parallel_step_loops(two, o2.cpu)
    with monkeypatch.context() as mp:   # the stream's blocks as on one thread, the steps on two
        from tgc.backends.cpu.options import CpuOptions
        mp.setattr(CpuOptions, "step_lanes", lambda self: 1)
        whole, ow = lowered(2, options().with_(**tight))
    assert rows(whole) == rows(one) and parallel_step_loops(whole, ow.cpu)
    r2, rw = explain(two, {}, o2), explain(whole, {}, ow)
    assert r2["peak"]["bytes"] < rw["peak"]["bytes"], (r2["peak"]["bytes"], rw["peak"]["bytes"])
    src = ATTENTION.format(batch=2, head=2)
    m = compile_source(src, "<steps>", Options(dtype="f64"))
    x = random_inputs(m, m.bind_dims({}), 2, "f64")
    want = torch_oracle.evaluate(m, x)
    from tgc.ir.interp import evaluate
    interp = evaluate(pipeline.lower(m, Options(dtype="f64", stream_block=0)).module, {k: v.copy() for k, v in x.items()},
                      dtype="f64")   # unstreamed
    for dtype, tol in (("f64", 1e-10), ("f32", 2e-5)):
        a = {n: v.astype(np.float32 if dtype == "f32" else np.float64) for n, v in x.items()}
        got = tgc.compile(src, "cpu", dtype, options=options().with_(**tight))(**a)
        for n in want:
            scale = max(1.0, float(np.max(np.abs(want[n]))))
            assert float(np.max(np.abs(got[n] - want[n]))) <= tol * scale, (dtype, n)
            assert float(np.max(np.abs(got[n] - interp[n]))) <= tol * scale, (dtype, n)
