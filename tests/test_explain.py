"""`tgc explain`: kernels with FLOPs and bytes, workspace, live memory and its peak."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from tgc import pipeline
from tgc.cli import main
from tgc.explain import explain
from tgc.frontend import compile_source
from tgc.lower.lowered import GemmKernel, StepLoop
from tgc.options import Options
from tgc.pipeline import lower_module

ROOT = Path(__file__).resolve().parent.parent


def lowered(src: str):
    opts = Options()
    return lower_module(pipeline.lower(compile_source(src, "<t>", opts), opts).module, opts)


def run(*args):
    return CliRunner().invoke(main, ["explain", *map(str, args)])


def test_a_gemm_is_2mnk_flops_and_its_three_matrices_in_bytes():
    low = lowered("dim m = 64, k = 32, n = 48\ninput a[m, k], b[k, n]\nout y = a @ b\n")
    (g,) = [k for k in low.kernels if isinstance(k, GemmKernel)]
    report = explain(low, {})
    (row,) = [k for k in report["kernels"] if k["kind"] == "gemm"]
    assert row["flops"] == 2 * 64 * 32 * 48
    assert row["bytes"] == 4 * (64 * 32 + 32 * 48 + 64 * 48)


def test_a_loop_counts_each_operation_at_every_point():
    low = lowered("dim n = 100\ninput x[n], y[n]\nout z = exp(x) * y + 3\n")
    report = explain(low, {})
    assert [k["flops"] for k in report["kernels"]] == [100 * 3]   # exp, *, +


def test_the_peak_is_the_largest_live_total_and_fits_the_workspace():
    report = explain(lowered((ROOT / "benchmarks" / "workloads" / "gpt.tg").read_text().replace("dim batch\n", "dim batch = 8\n")), {})
    peak = report["peak"]
    assert peak["bytes"] == max(report["live_bytes"]) > 0
    assert sum(b["bytes"] for b in peak["buffers"]) == peak["bytes"]
    assert all(b["from"] <= peak["kernel"] <= b["to"] for b in peak["buffers"])
    assert report["workspace"]["bytes"] >= peak["bytes"]   # slots hold every live temporary at once
    assert report["recompute"] == [] and "no recomputation" in report["recompute_note"]


def test_cli_text_json_and_an_svg_timeline(tmp_path):
    svg = tmp_path / "mem.svg"
    r = run(ROOT / "examples" / "mlp.tg", "--dim", "batch=178", "--timeline", svg)
    assert r.exit_code == 0, r.output
    assert "batch = 178" in r.output and "peak:" in r.output and "workspace:" in r.output
    r = run(ROOT / "examples" / "mlp.tg", "--dim", "batch=178", "--format", "json")
    data = json.loads(r.output)
    assert data["dims"] == {"batch": 178}
    assert len(data["kernels"]) == len(data["live_bytes"]) > 0
    text = svg.read_text()
    assert text.startswith("<svg") and text.count("<rect") == len(data["kernels"])


def test_a_png_timeline_needs_matplotlib(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib draws the PNG timeline")
    png = tmp_path / "mem.png"
    r = run(ROOT / "examples" / "mlp.tg", "--timeline", png)
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_are_usage_errors(tmp_path):
    assert run(ROOT / "examples" / "mlp.tg", "--timeline", tmp_path / "x.gif").exit_code == 2
    r = run(ROOT / "examples" / "mlp.tg", "--dim", "nope=3")
    assert r.exit_code == 2 and "no dim 'nope'" in r.output
    r = run(ROOT / "examples" / "mlp.tg", "--dim", "hidden=3")
    assert r.exit_code == 2 and "fixed size" in r.output
    # a size within 2^62 whose arrays are not: the -D value's fault, not an internal error
    r = run(ROOT / "examples" / "mlp.tg", "--dim", f"batch={2 ** 61}")
    assert r.exit_code == 2 and "input 'x' would take more than 2^62 bytes" in r.output, r.output


DEEP = """\
dim layer{size}, b = 2, c = 3, c2 = 3
input x[b, c]
param w[layer, c, c2]
fn block(h, w) = tanh(sum[c](h * w))[c2 -> c] * 0.9 + h * 0.1
y = repeat[layer](block, x, w)
out loss = sum(y * y)
{grad}"""


def test_a_differentiated_loop_says_what_each_step_keeps(tmp_path):
    path = tmp_path / "deep.tg"
    path.write_text(DEEP.format(size=" = 3", grad="out gw = grad(loss, w)\n"))
    r = run(path)
    assert r.exit_code == 0, r.output
    # the CPU unrolls the loop: the steps' values are the forward pass's own
    assert "loop over 'layer' (3 steps): unrolled for this backend" in r.output
    # as a loop: the carry f32[b, c] and tanh's f32[b, c2] per step, 3 steps x 2 x 3 x 4 B each
    assert "keep each step's incoming carry (f32[b, c]) and 1 values each step computes (144 B in all)" in r.output
    loops = json.loads(run(path, "--format", "json").output)["loops"]
    assert [(lp["edge"], lp["steps"], lp["unrolled"], lp["keep"], [k["bytes"] for k in lp["kept"]])
            for lp in loops] == [("layer", 3, True, "values", [72, 72])]
    path.write_text(DEEP.format(size=" = 3", grad=""))                # no derivative: nothing kept
    r = run(path)
    assert r.exit_code == 0 and "loop over" not in r.output


def test_a_loop_run_as_a_loop_keeps_what_its_backward_step_reads_or_only_its_carries():
    from tgc.budget import _with_checkpoints
    from tgc.explain import format_explain, loop_steps

    options = Options(dtype="f64", passes=("normalize",))
    primal = pipeline.lower(compile_source(DEEP.format(size="", grad="out gw = grad(loss, w)\n"), "<t>", options),
                            options).module
    env = primal.bind_dims({"layer": 5})
    loops = loop_steps(primal, env, unrolled=False)   # by default: the carry and tanh's value, per step
    assert len(loops) == 1 and loops[0]["steps"] == 5 and loops[0]["keep"] == "values"
    assert [(k["what"], k["bytes"]) for k in loops[0]["kept"]] == [("carry", 5 * 2 * 3 * 8), ("tanh", 5 * 2 * 3 * 8)]
    assert loops[0]["bytes"] == 480 and loops[0]["recomputed_values"] == 0
    report = explain(lowered("dim n = 2\ninput x[n]\nout y = x * 2\n"), {}) | {"loops": loops}
    assert ("loop over 'layer' (5 steps): the backward pass keeps each step's incoming carry (f64[b, c]) and "
            "1 values each step computes (480 B in all) and recomputes 0 of the step's values") \
        in format_explain(report, "deep.tg")
    # the memory planner's other choice: the step's results checkpointed, only the carry kept
    loop = next(v for v in primal.values() if v.op == "loop")
    loops = loop_steps(_with_checkpoints(primal, [loop]), env, unrolled=False)
    assert loops[0]["keep"] == "carries" and [k["bytes"] for k in loops[0]["kept"]] == [240]
    assert loops[0]["recomputed_values"] > 0
    report = explain(lowered("dim n = 2\ninput x[n]\nout y = x * 2\n"), {}) | {"loops": loops}
    assert ("loop over 'layer' (5 steps): the backward pass keeps each step's incoming carry (f64[b, c], "
            "240 B in all) and recomputes the step's other") in format_explain(report, "deep.tg")


def test_a_loop_kernel_has_a_thread_plan_and_its_steps_temporaries_count_in_the_peak(tmp_path):
    # a wide step: its temporaries (the [b, c2] product and its tanh) outweigh the carries
    # (the GEMM epilogue off: on, it stores the product into the step's tanh, its output)
    src = DEEP.replace("b = 2, c = 3, c2 = 3", "b = 64, c = 256, c2 = 256").format(
        size="", grad="out gw = grad(loss, w)\n")
    opts = Options().with_(gemm_epilogue=False)
    low = lower_module(pipeline.lower(compile_source(src, "<t>", opts), opts).module, opts)
    steps = [i for i, k in enumerate(low.kernels) if isinstance(k, StepLoop)]
    assert steps, "the symbolic-size loop runs as a loop"
    report = explain(low, low.module.bind_dims({"layer": 4}), Options())
    for i in steps:
        row = report["kernels"][i]
        assert row["threads"] == "per step kernel"
        assert row["step_peak"] > 0 and report["live_bytes"][i] >= row["step_peak"]
    path = tmp_path / "deep.tg"
    path.write_text(src)
    r = run(path, "-D", "layer=4")
    assert r.exit_code == 0, r.output
    assert re.search(r"^ +k\d+ +steps .* steps reverse over layer", r.output, re.M | re.S), r.output


CAUSAL = """dim b, h, t, e
dim s = t
input q[b, h, t, e], k[b, h, s, e], v[b, h, s, e]
y = sum[s](softmax[s](where([s <= t], dot[e](q, k) / sqrt(size(e)), -1e9)) * v)
out y[b, h, t, e]
"""


def test_it_says_which_program_a_first_call_runs(tmp_path):
    # the generic program keeps the [t, s] matrices of a causal attention over a
    # symbolic t whole (16 MB at t = 2048), its specialization streams them: a first
    # call past --specialize-at-bytes runs the specialization
    f = tmp_path / "causal.tg"
    f.write_text(CAUSAL)
    sizes = ["-D", "b=1", "-D", "h=1", "-D", "e=16"]

    def first(t, *more):
        result = run(f, *sizes, "-D", f"t={t}", "--format", "json", *more)
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["first_call"]

    past = first(2048, "--specialize-at-bytes", "1MiB")
    assert past["runs"] == "specialized" and past["generic_peak"] >= 2 * past["specialized_peak"], past
    assert past["specialize_at_bytes"] == 1 << 20
    assert first(2048)["runs"] == "generic" and first(2048)["specialized_peak"] is None   # under 256 MiB
    assert first(64, "--specialize-at-bytes", "1MiB")["runs"] == "generic"
    text = run(f, *sizes, "-D", "t=2048", "--specialize-at-bytes", "1MiB").output
    assert "a first call with these sizes runs the specialization" in text.splitlines()[2], text
    # the work rule: at t = 2048 a [t, s] matrix (4M elements) is one that stream blocks
    # once t is known, so the generic work is reckoned; the specialization's skips the
    # masked keys: 224M fewer, under the default 2^36 but over 2^27
    default = first(2048)
    assert default["generic_work"] is not None and default["specialize_first_work"] == 1 << 36, default
    assert default["runs"] == "generic" and default["reason"] is None and default["specialized_work"] is None
    saves = first(2048, "--specialize-first-work", str(1 << 27))
    assert saves["runs"] == "specialized" and saves["reason"] == "work", saves
    assert saves["generic_work"] - saves["specialized_work"] >= 1 << 27, saves
    text = run(f, *sizes, "-D", "t=2048", "--specialize-first-work", str(1 << 27)).output
    assert "runs the specialization, built before it: it saves that call's compile" in text.splitlines()[2], text
    assert first(64, "--specialize-first-work", "0")["generic_work"] is None   # nothing stream would block


def test_a_loop_moves_its_step_kernels_bytes_once_per_step():
    """Bytes moved per call: a loop over an edge counts each of its step's kernels once
    per step (`kernel_bytes`), so the total is what the call's kernels read and write."""
    from tgc.explain import kernel_bytes

    low = lowered(DEEP.replace("b = 2, c = 3, c2 = 3", "b = 64, c = 256, c2 = 256").format(
        size="", grad="out gw = grad(loss, w)\n"))
    env = low.module.bind_dims({"layer": 4})
    report = explain(low, env)
    steps = [(i, k) for i, k in enumerate(low.kernels) if isinstance(k, StepLoop)]
    assert steps
    for i, k in steps:
        one = sum(kernel_bytes(k.step, s, env) for s in k.step.kernels)
        assert one > 0 and report["kernels"][i]["bytes"] == 4 * one
    assert report["bytes"] == sum(row["bytes"] for row in report["kernels"])


def test_the_loops_of_streamed_attention_share_their_steps_slots():
    """Causal attention with gradients at t = 2048 streams in 8 loops over query blocks,
    one after another: their steps' temporaries share one run of slots, so the
    workspace stays near the peak of live temporaries (each loop its own run: 4x it
    at t = 16384), and the step still computes attention and its gradients."""
    import numpy as np
    import tgc
    src = """dim batch = 1, head = 1, t = 2048, hd = 16
dim s = t
input q[batch, head, t, hd], k[batch, head, s, hd], v[batch, head, s, hd], dy[batch, head, t, hd]
p = softmax[s](where([s <= t], sum[hd](q * k) / sqrt(size(hd)), -inf))
y = sum[s](p * v)
out y[batch, head, t, hd]
loss = sum(y * dy)
out dq[batch, head, t, hd] = grad(loss, q)
out dv[batch, head, s, hd] = grad(loss, v)
"""
    low = lowered(src)
    loops = [k for k in low.kernels if isinstance(k, StepLoop)]
    assert len(loops) >= 2 and len({k.slot_base for k in loops}) == 1
    assert all(k.slot_base + len(k.step.slots) <= len(low.slots) for k in loops)
    report = explain(low, {})
    assert report["peak"]["bytes"] <= report["workspace"]["bytes"] <= 1.25 * report["peak"]["bytes"]
    rng = np.random.default_rng(0)
    a = {n: rng.standard_normal((1, 1, 2048, 16)).astype(np.float32) for n in ("q", "k", "v", "dy")}
    got = tgc.compile(src)(**a)
    q, k, v, dy = (a[n][0, 0].astype(np.float64) for n in ("q", "k", "v", "dy"))
    sc = np.where(np.tril(np.ones((2048, 2048), bool)), q @ k.T / 4, -np.inf)
    p = np.exp(sc - sc.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    dp = dy @ v.T
    want = {"y": p @ v, "dq": p * (dp - (dp * p).sum(1, keepdims=True)) @ k / 4, "dv": p.T @ dy}
    for n, w in want.items():
        assert np.abs(got[n][0, 0] - w).max() <= 1e-5 * np.abs(w).max(), n
