"""Loops on the CUDA backends (issue 31 item 3): a `StepLoop` is a host loop launching
its step's kernels, generated once. cuda-sim against the IR interpreter for the loop
programs of test_loops (repeat, scan and every derivative mode: reverse loops, an HVP
through a repeat), a symbolic trip count, a loop inside a step; the generated CUDA
source's size against the trip count."""
import numpy as np
import pytest

import tgc
from tgc.backends.cuda import codegen
from tgc.backends.cuda.runtime import lower as cuda_lower
from tgc.ir.interp import evaluate
from tgc.options import Options
from tgc.pipeline import compile_module

from test_loops import HEAD, LOOP, NESTED, inputs, module, program, run, unrolled


def close(got, want, rtol, atol):
    assert set(want) <= set(got)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=rtol, atol=atol, err_msg=k)


@pytest.mark.parametrize("dtype,rtol,atol", [("f64", 1e-9, 1e-11), ("f32", 1e-4, 1e-5)])
@pytest.mark.parametrize("n", [1, 3])
def test_cuda_sim_runs_loops_and_their_derivatives(n, dtype, rtol, atol):
    m = module(program(n), unroll_max_ops=0)
    ins = inputs(n)
    want = evaluate(m, {k: a.copy() for k, a in ins.items()}, dtype="f64")
    prog = compile_module(m, Options(dtype=dtype, unroll_max_ops=0), "cuda-sim")
    loops = [x for x in prog.cuda_module.launches if x.kind == "steps"]
    assert {x.loop.reverse for x in loops} == {False, True}   # forward loops and the gradients' reverse ones
    close(prog.run({k: a.copy() for k, a in ins.items()}), want, rtol, atol)


def test_cuda_kernel_count_does_not_grow_with_the_trip_count():
    """The loop and its derivative loops stay loops: the module's kernels are the
    steps' (generated once), whatever the trip count."""
    def source(n):
        opts = Options(dtype="f64", unroll_max_ops=0)
        low = cuda_lower(module(program(n), unroll_max_ops=0), opts)
        return codegen.generate(low)
    two, sixteen = source(2), source(16)
    assert any(x.kind == "steps" for x in two.launches)
    assert two.source.count("__global__") == sixteen.source.count("__global__")
    assert len(sixteen.source) < 1.01 * len(two.source)   # (the loop edge's size is a literal in some kernels)


def test_symbolic_trip_count_runs_at_any_depth_on_cuda_sim():
    """One compiled program, the loop's size read from the dims at each call."""
    def src(n, loop=True):   # the value and its gradient (a reverse loop) of test_loops' program
        return HEAD.format(layer=f"layer = {n}" if n else "layer") + (LOOP if loop else unrolled(n)) + \
            "loss = sum(y * y) + sum(hs * hs * hs)\nout loss\nout hs\nout gw = grad(loss, w)\nout gx = grad(loss, x)\n"
    p = tgc.compile(src(None), backend="cuda-sim", dtype="f64")
    assert any(x.kind == "steps" for x in p.cuda_module.launches)
    for n in (2, 4):
        ins = inputs(n, seed=n)
        want = run(src(n, loop=False), ins)
        got = p(**{k: a.copy() for k, a in ins.items()})
        close(got, want, 1e-10, 1e-12)


def test_a_loop_inside_a_step_on_cuda_sim():
    """A step that holds a loop (its own host loop, its slots after the step's), forward,
    its gradient (reverse loops in reverse loops) and a forward-over-reverse product."""
    loops = NESTED.format(inner="repeat[sub](inner, h, w)", outer="repeat[layer](outer, x, w)")
    plain = NESTED.format(inner="inner(inner(inner(h, w[sub = 0]), w[sub = 1]), w[sub = 2])",
                          outer="outer(outer(x, w[layer = 0]), w[layer = 1])")
    rng = np.random.default_rng(3)
    ins = {"x": rng.standard_normal(3), "w": rng.standard_normal((2, 3, 3))}
    p = tgc.compile(loops, backend="cuda-sim", options=Options(dtype="f64", unroll_max_ops=0))
    nested = [x for x in p.cuda_module.launches if x.kind == "steps" and any(y.kind == "steps" for y in x.body)]
    assert nested, "a step with a loop inside"
    close(p(**{k: a.copy() for k, a in ins.items()}), run(plain, ins), 1e-12, 1e-14)


@pytest.mark.slow
def test_sorting_gpt_training_step_on_cuda_sim_matches_the_interpreter():
    """examples/train_sort_gpt.tg (its blocks a `repeat`, the gradient a reverse loop),
    one AdamW step on cuda-sim: the loss, logits, new params and optimizer states as the
    IR interpreter computes them."""
    import importlib.util
    from pathlib import Path

    from tgc import pipeline

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("example_train_sort_gpt", root / "examples" / "train_sort_gpt.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    tg, opts = root / "examples" / "train_sort_gpt.tg", Options(dtype="f64")
    sim = tgc.compile(tg, backend="cuda-sim", options=opts)
    assert any(x.kind == "steps" for x in sim.cuda_module.launches)
    params = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in ex.init(sim, 0).items()}
    train, _ = ex.split(0)
    args = {**ex.batch(train[np.random.default_rng(0).integers(0, len(train), 4)]),
            "lr": np.float64(3e-3), "wd": np.float64(0.1)}
    module = pipeline.lower(pipeline.load(str(tg), opts), opts).module
    want = evaluate(module, {**args, **{k: v.copy() for k, v in params.items()}}, dtype="f64")
    got = sim(**args, **params)
    assert set(want) <= set(got)
    for k, w in want.items():
        np.testing.assert_allclose(np.asarray(got[k]), w, rtol=1e-9, atol=1e-12 * max(1.0, np.abs(w).max()), err_msg=k)


SCALARS = """\
dim layer = 4
input x
param w[layer]
fn f(h, w) = tanh(h * w + 0.5)
y = repeat[layer](f, x, w)
hs = scan[layer](f, x, w)
loss = y * y + sum(hs)
out loss
out hs
out gw = grad(loss, w)
out gx = grad(loss, x)
"""


def test_scalar_carries_and_slices_on_cuda_sim():
    """A step whose carry, stacked param and stacked result are scalars (0-d slices)."""
    ins = {"x": np.array(0.3), "w": np.array([0.5, -1.2, 0.8, 1.5])}
    p = tgc.compile(SCALARS, backend="cuda-sim", options=Options(dtype="f64", unroll_max_ops=0))
    assert any(x.kind == "steps" for x in p.cuda_module.launches)
    want = evaluate(module(SCALARS), {k: a.copy() for k, a in ins.items()}, dtype="f64")
    close(p(**{k: a.copy() for k, a in ins.items()}), want, 1e-12, 1e-14)
