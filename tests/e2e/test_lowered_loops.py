"""Loops in the lowered program (`StepLoop`, tgc.lower.steps): the text form and its
reading back, the verifier, the lowered interpreter and the CPU backend against the IR
interpreter for `repeat`, `scan` and their derivatives, symbolic trip counts, and the
unroll cost model (`Options.unroll_max_ops`)."""
import numpy as np
import pytest

import tgc
from tgc.ir.interp import evaluate
from tgc.lower.interp import run_lowered
from tgc.lower.lowered import StepLoop, print_lowered, step_loops
from tgc.lower.text import parse_lowered
from tgc.options import Options
from tgc.pipeline import compile_module, lower_module

from test_loops import inputs, module, program

LOOPS = Options(dtype="f64", unroll_max_ops=0)   # every loop stays a loop


def lowered(n, symbolic=False, stop_after="plan", **opts):
    m = module(program(n, symbolic=symbolic), unroll_max_ops=0)
    return m, lower_module(m, LOOPS.with_(**opts), "cpu", stop_after=stop_after)


def close(got, want):
    assert set(want) <= set(got)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-10, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_lowered_interpreter_runs_loops_and_their_derivatives(n):
    m, low = lowered(n)
    assert any(isinstance(k, StepLoop) for k in low.kernels)
    ins = inputs(n)
    want = evaluate(m, {k: a.copy() for k, a in ins.items()}, dtype="f64")
    close(run_lowered(low, {k: a.copy() for k, a in ins.items()}), want)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_cpu_runs_loops_and_their_derivatives(n):
    m, _ = lowered(n)
    ins = inputs(n)
    want = evaluate(m, {k: a.copy() for k, a in ins.items()}, dtype="f64")
    prog = compile_module(m, LOOPS, "cpu")
    assert any(isinstance(k, StepLoop) for k in prog.lowered.kernels)
    close(prog.run({k: a.copy() for k, a in ins.items()}), want)


def test_one_program_serves_any_depth():
    """A symbolic trip count: one compiled program, the depth read from the inputs."""
    m, low = lowered(2, symbolic=True)
    prog = compile_module(m, LOOPS, "cpu")
    for n in (1, 3, 6):
        ins = inputs(n, seed=n)
        want = evaluate(m, {k: a.copy() for k, a in ins.items()}, dtype="f64")
        close(prog.run({k: a.copy() for k, a in ins.items()}), want)
        close(run_lowered(low, {k: a.copy() for k, a in ins.items()}), want)


def test_code_does_not_grow_with_the_trip_count():
    def shape(n):
        _, low = lowered(n)
        return [type(k).__name__ for k in low.kernels], sum(len(l.step.kernels) for _, l in step_loops(low))

    assert shape(2) == shape(12)


@pytest.mark.parametrize("stage", ["fuse", "layout", "group", "plan"])
def test_loops_read_back_after_every_stage(stage):
    m, low = lowered(3, stop_after=stage)
    text = print_lowered(low)
    back = parse_lowered(text)
    assert print_lowered(back) == text
    if stage == "plan":
        ins = inputs(3)
        want = evaluate(m, {k: a.copy() for k, a in ins.items()}, dtype="f64")
        close(run_lowered(back, {k: a.copy() for k, a in ins.items()}), want)


SMALL = """\
dim layer = 4, c = 3
input x[c]
param w[layer, c]
fn cell(h, w) = tanh(h * w)
out y = repeat[layer](cell, x, w)
out hs = scan[layer](cell, x, w)
"""

# the scan's stacked result is the output `hs` (stored [layer, c]): the steps write it in place
GOLDEN = """\
// lowered after fuse (f64)
buffer %x : f64[c] arg 0 order [c]
buffer %w : f64[c, layer] arg 1 order [layer, c]
buffer %c2 : f64[c] temp order [c]
buffer %n3 : f64[c] temp order [c]
buffer %hs : f64[c, layer] out 1 order [layer, c]
buffer %y : f64[c] out 0 order [c]

k0: loop %c2[c] = %x[c]
      for c < 3    # copy
k1: steps over layer < 4 carries 1 args(%c2, %w[i]) outs(%n3, %hs[i]) slots from 0 {    # scan
    // lowered after fuse (f64)
    buffer %p0 : f64[c] arg 0 order [c]
    buffer %p1 : f64[c] arg 1 order [c]
    buffer %r0 : f64[c] out 0 order [c]
    buffer %r1 : f64[c] out 1 order [c]

    k0: loop %r0[c] = tanh(mul(%p0[c], %p1[c]))
          for c < 3
    k1: loop %r1[c] = %r0[c]
          for c < 3    # copy

    module {
    dim layer = 4
    dim c = 3
    input p0 : f64[c]
    input p1 : f64[c]

    %0 = contract %p0, %p1 : f64[c]
    %1 = map[tanh] %0 : f64[c]

    out r0 = %1 : [c]
    out r1 = %1 : [c]
    }
  }
k2: loop %y[c] = %c2[c]
      for c < 3    # copy
"""


def test_golden_text_of_a_loop():
    options = LOOPS.with_(dtype="f64")
    m = module(SMALL, unroll_max_ops=0)
    low = lower_module(m, options, "cpu", stop_after="fuse")
    assert print_lowered(low, module=False) == GOLDEN
    ins = {"x": np.array([0.3, -0.5, 0.9]), "w": np.linspace(-1, 1, 12).reshape(4, 3)}
    prog = compile_module(m, options, "cpu")
    close(prog.run(dict(ins)), evaluate(m, dict(ins), dtype="f64"))


def test_verifier_rejects_a_slice_of_an_unstacked_buffer():
    _, low = lowered(2, stop_after="fuse")
    text = print_lowered(low)
    head = next(line for line in text.splitlines() if " steps " in line and "[i]" in line)
    broken = text.replace(head, head.replace("[i]", "", 1), 1)
    with pytest.raises(tgc.CompileError, match=r"bound to '%\w+' \[[^]]*\], not \["):
        parse_lowered(broken, "broken.tgl")


def test_a_short_loop_is_unrolled_and_a_long_one_is_not():
    """The cost model: n steps of s ops are unrolled when n * s <= unroll_max_ops."""
    from tgc.frontend.elaborate import elaborate_source
    from tgc.opt.unroll import step_ops

    raw = elaborate_source(SMALL, "<test>", Options(dtype="f64")).module
    n_ops = max(4 * step_ops(v) for v in raw.values() if v.op == "loop")

    def loops(limit):
        return sum(1 for v in module(SMALL, unroll_max_ops=limit).values() if v.op == "loop")

    assert loops(64) == 0 and loops(n_ops) == 0   # 4 steps of a 2-op cell: unrolled by default
    assert loops(n_ops - 1) > 0 and loops(0) > 0  # kept: the backend runs the loop
    prog = tgc.compile(SMALL, dtype="f64", options=Options(unroll_max_ops=0))
    assert any(isinstance(k, StepLoop) for k in prog.lowered.kernels)
    ins = {"x": np.array([0.3, -0.5, 0.9]), "w": np.linspace(-1, 1, 12).reshape(4, 3)}
    close(prog(**ins), tgc.compile(SMALL, dtype="f64")(**ins))


def test_autocast_loop_agrees_with_the_unrolled_program():
    """bf16 matrix products inside a step: the loop's buffers stay in the float type."""
    ins = {k: a.astype(np.float32) for k, a in inputs(3).items()}
    src = program(3)
    got, want = (tgc.compile(src, dtype="f32", options=Options(autocast="bf16", unroll_max_ops=limit))(**ins)
                 for limit in (0, 10**9))
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=2e-2, atol=2e-2, err_msg=k)


def test_a_loop_inside_a_step_runs_as_nested_loops():
    from test_loops import NESTED, run

    loops = NESTED.format(inner="repeat[sub](inner, h, w)", outer="repeat[layer](outer, x, w)")
    plain = NESTED.format(inner="inner(inner(inner(h, w[sub = 0]), w[sub = 1]), w[sub = 2])",
                          outer="outer(outer(x, w[layer = 0]), w[layer = 1])")
    rng = np.random.default_rng(3)
    ins = {"x": rng.standard_normal(3), "w": rng.standard_normal((2, 3, 3))}
    want = run(plain, ins)
    m = module(loops, unroll_max_ops=0)
    low = lower_module(m, LOOPS, "cpu")
    nested = [l for p, l in step_loops(low) if p is not low]
    assert nested, "a loop inside a step"
    assert print_lowered(parse_lowered(print_lowered(low))) == print_lowered(low)
    close(run_lowered(low, {k: a.copy() for k, a in ins.items()}), want)
    close(compile_module(m, LOOPS, "cpu").run({k: a.copy() for k, a in ins.items()}), want)


@pytest.mark.parametrize("seed", [0, 1, 8, 26, 27])
def test_fuzzed_loops_run_as_loops_on_the_cpu(seed):
    """The fuzzer's programs with repeat/scan (the first seeds that have one), every loop
    kept: the CPU against the IR interpreter (seeds whose loops the optimizer keeps)."""
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parents[1])
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from fuzz.gen import generate
    from tgc.frontend import compile_source
    from tgc.ir.inputs import random_inputs
    from tgc.pipeline import lower

    prog = generate(seed)
    text = prog.render()
    assert "repeat[" in text or "scan[" in text
    m = lower(compile_source(text, "<fuzz>", LOOPS), LOOPS).module
    assert any(v.op == "loop" for v in m.values())
    dims = dict(prog.bind)
    env = m.bind_dims(dims) if dims else {d: s for d, s in m.dims.items() if isinstance(s, int)}
    ins = random_inputs(m, env, seed)
    want = evaluate(m, {k: v.copy() for k, v in ins.items()}, dtype="f64", dims=dims)
    got = compile_module(m, LOOPS, "cpu").run({k: v.copy() for k, v in ins.items()}, dims or None)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-8, atol=1e-10, err_msg=k)


ATTENTION = """\
dim layer = 3, b = 4, t = 5, s = t, c = 32, c2 = c
input x[b, t, c]
param wq[layer, c, c2], wk[layer, c, c2]
fn block(h, wq, wk) {
  p = softmax[s](dot[c2](h @ wq, (h @ wk)[t -> s]))
  return sum[s](p * h[t -> s])
}
y = repeat[layer](block, x, wq, wk)
out loss = sum(y * y)
"""


def test_a_steps_matrix_products_are_pairwise():
    """A kept loop's body has its contractions ordered as the program's are (`factor`):
    the attention scores are products of two factors over one summed edge each (GEMMs
    at sizes BLAS takes), not one 4-factor sum over c, c2 and c.1."""
    from tgc.lower.lowered import LoopKernel

    m = module(ATTENTION, unroll_max_ops=0)
    low = lower_module(m, LOOPS, "cpu", stop_after="fuse")
    steps = [l.step for _, l in step_loops(low)]
    assert steps
    for s in steps:
        assert all(len(k.red) <= 1 for k in s.kernels if isinstance(k, LoopKernel)), \
            [k.text().splitlines()[0] for k in s.kernels]



CARRY_IN = """\
dim layer = 3, c = 4
input x[c]
param w[layer, c]
param v[layer, c]
fn cell(h, w) = tanh(h * w)
h1 = repeat[layer](cell, x, w)
out y = repeat[layer](cell, h1, v){more}
"""


@pytest.mark.parametrize("read_after", [False, True])
def test_a_carry_whose_initial_value_dies_at_the_loop_is_updated_in_place(read_after):
    """The second loop's carry starts from the first loop's result: read by nothing
    else, the buffer holding it is the second loop's carry (no copy in); when it is
    also read after the loop (an output here), the second loop gets a copy."""
    m = module(CARRY_IN.format(more="\nout z = h1 * 3" if read_after else ""), unroll_max_ops=0)
    low = lower_module(m, LOOPS, "cpu")
    first, second = [k for k in low.kernels if isinstance(k, StepLoop)]
    assert (first.args[0].buf == second.args[0].buf) != read_after
    rng = np.random.default_rng(3)
    ins = {"x": rng.standard_normal(4) * 0.5, "w": rng.standard_normal((3, 4)), "v": rng.standard_normal((3, 4))}
    want = evaluate(m, {k: a.copy() for k, a in ins.items()}, dtype="f64")
    close(run_lowered(low, {k: a.copy() for k, a in ins.items()}), want)
    close(compile_module(m, LOOPS, "cpu").run({k: a.copy() for k, a in ins.items()}), want)
