"""The CPU group stage's `gemms_up` (`CpuOptions.group_past_gemms`: a product moved up
past the loop kernels before it, so that they group with its reader) and
`write_in_place` (`CpuOptions.group_in_place`: a group's output written over a buffer it
reads last), on a streamed causal attention's backward step: the softmax's rows and
the gradient's D = sum_s P dP and dS = P (dP - D) become one group over the rows once a
step's P is larger than half an L2, with P written over the scores and dS over dP.
Checked: the structure of the steps (which steps move, the one group, the buffers
renamed, two [rows, keys] slots fewer); the values against torch in f64 and f32; the
bits against the program with both switches off (each alone too), on 1 and 2 threads."""
import numpy as np
import pytest

import tgc
from tgc.backends.cpu.group import LoopGroup
from tgc.frontend import compile_source
from tgc.lower.lowered import GemmKernel, StepLoop
from tgc.options import Options
from layer_programs import causal_attention

torch_oracle = pytest.importorskip("torch_oracle", reason="the oracle needs torch")

# one head of 8 at t = 4096 under the default options: 16 causal runs of 256 rows whose
# steps' [256, s] matrices grow from 256 KB (s = 256) to 4 MB
ATTENTION = causal_attention(head=1, t=4096, hd=8)


def compiled(dtype: str, threads: int = 1, **cpu):
    o = Options()
    return tgc.compile(ATTENTION, "cpu", dtype, options=o.with_(cpu=o.cpu.with_(threads=threads, **cpu)))


def inputs(dtype: str) -> dict:
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal((1, 4096, 8)).astype(np.float32 if dtype == "f32" else np.float64)
            for n in ("q", "k", "v", "dy")}


def backward_steps(low) -> list:
    """The programs of the steps that hold the backward's dP product (two products of
    [rows, keys] before any `+=` product)."""
    return [k.step for k in low.kernels if isinstance(k, StepLoop)
            and sum(isinstance(g, GemmKernel) and not g.acc for g in k.step.kernels) >= 4]


def keys(step) -> int:
    return max(step.size(e) for e in step.buffers[step.kernels[0].out].edges)


def shape(step) -> list[str]:
    return ["group" if isinstance(k, LoopGroup) else "gemm" if isinstance(k, GemmKernel) else "loop"
            for k in step.kernels[:4]]


def test_the_long_steps_run_softmax_and_ds_in_one_group_over_their_scores_and_dp():
    off = compiled("f32", group_past_gemms=False, group_in_place=False).lowered
    on = compiled("f32").lowered
    before, after = backward_steps(off), backward_steps(on)
    assert len(before) == len(after) == 16
    for a, b in zip(before, after):
        assert shape(a) == ["gemm", "group", "gemm", "group"]
        # P (256 x s f32) over half of group_shrink_max_bytes (2 MiB): s > 1024
        moved = keys(b) > 1024
        assert shape(b) == (["gemm", "gemm", "group", "gemm"] if moved else ["gemm", "group", "gemm", "group"])
        groups = [k for k in b.kernels if isinstance(k, LoopGroup)]
        scores, dp = b.kernels[0].out, b.kernels[1 if moved else 2].out
        # P written over the scores, dS over dP: the members' outputs are the products' buffers
        outs = [m.out for g in groups for m in g.members]
        assert scores in outs and dp in outs
        big = [n for n, buf in b.buffers.items() if buf.kind == "temp" and b.nbytes(buf) == 4 * 256 * keys(b)]
        assert len(big) == 2 and len([n for n, buf in a.buffers.items() if buf.kind == "temp"
                                      and a.nbytes(buf) == 4 * 256 * keys(a)]) == 4
        if moved:
            assert len(groups) == 1 and scores in groups[0].buffers_read() and dp in groups[0].buffers_read()


@pytest.mark.parametrize("dtype,tol", [("f64", 1e-10), ("f32", 2e-5)])
def test_values_match_torch(dtype, tol):
    x = inputs(dtype)
    want = torch_oracle.evaluate(compile_source(ATTENTION, "<gemms_up>", Options(dtype="f64")),
                                 {n: a.astype(np.float64) for n, a in x.items()})
    got = compiled(dtype)(**x)
    for name, w in want.items():
        scale = float(np.max(np.abs(w)))
        np.testing.assert_allclose(np.asarray(got[name], np.float64), w, rtol=0, atol=tol * scale, err_msg=name)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_bits_of_the_switches_off(threads):
    x = inputs("f32")
    plain = compiled("f32", threads, group_past_gemms=False, group_in_place=False)(**x)
    for cpu in (dict(), dict(group_past_gemms=False), dict(group_in_place=False)):
        got = compiled("f32", threads, **cpu)(**x)
        for name in plain:
            assert np.asarray(got[name]).tobytes() == np.asarray(plain[name]).tobytes(), (cpu, name)


def _long_step_before_group():
    """The backward step over 2048 keys, as the group stage receives it."""
    from tgc import pipeline
    o = Options()
    module = compile_source(ATTENTION, "<gemms_up>", o)
    compiled, opts = pipeline.target(pipeline.lower(module, o).module, o)
    low = pipeline.lower_module(compiled, opts, "cpu", stop_after="pieces")
    steps = [k.step for k in low.kernels if isinstance(k, StepLoop)
             and sum(isinstance(g, GemmKernel) and not g.acc for g in k.step.kernels) >= 4]
    return next(s for s in steps if keys(s) == 2048)


def test_gemms_up_moves_only_an_independent_product_past_a_large_run():
    """The rule of `gemms_up` on the step as `group` receives it: dP moves up to just after
    the scores' product; not when it would read what the run writes (P), nor when the
    row re-read would fit half the cache."""
    from dataclasses import replace
    from tgc.backends.cpu.gemm_up import gemms_up
    from tgc.lower.lowered import View

    step = _long_step_before_group()
    kinds = ["gemm" if isinstance(k, GemmKernel) else "loop" for k in step.kernels]
    dp = kinds.index("gemm", 1)
    assert kinds[:dp] == ["gemm"] + ["loop"] * (dp - 1) and kinds[dp + 1] == "loop"
    moved = gemms_up(step, 1 << 21)
    assert moved[1] is step.kernels[dp] and moved[2:dp + 1] == step.kernels[1:dp]
    assert gemms_up(step, 1 << 30) == step.kernels            # 4 MB of P re-read: under half of 1 GB
    p = step.kernels[dp - 1].out                               # the run's last output, P
    g = step.kernels[dp]
    reading = replace(g, a=View(p, g.a.edges))                # (only the name matters to the rule)
    kernels = list(step.kernels)
    kernels[dp] = reading
    assert gemms_up(replace(step, kernels=kernels), 1 << 21) == kernels
