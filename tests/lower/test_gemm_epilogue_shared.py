"""GEMM epilogues that take a kernel sharing their loads (tgc.lower.epilogue._sharers):
in a GELU MLP's reverse layer loop, the gradient of the pre-activation is GELU's
derivative of the kept pre-activation `u` and `t = tanh(..)`, computed in the store of
the product `dh = dy @ wproj^T`; the weight gradient of `wproj` reads GELU's output
again, recomputed in the backward step as `(0.5 + 0.5 t) u`: a kernel that reads
neither the product nor an epilogue output, but only `u` and `t`, which the epilogue
already loads at each element. It joins the epilogue: the pass that read `u` and `t`
a second time goes. Golden lowered text of the backward step, the kernels that do not
join (a full-size load the epilogue does not make, a kernel in between that writes
what it reads), and the values: the lowered interpreter against the IR interpreter,
the CPU backend (tiles and loops, 1 and 2 threads) against the lowered interpreter,
and examples/gpt2.tg's step against the same step built without the join (to f32 rounding)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.frontend import compile_source
from tgc.ir.inputs import random_inputs
from tgc.lower import epilogue
from tgc.lower.interp import run_lowered
from tgc.lower.lowered import GemmKernel, LoopKernel, StepLoop
from tgc.options import Options
from tgc.pipeline import lower_module

from layer_programs import MLP_OUTS, MLP_PARAMS, layer_stack, mlp_head
from lowered_util import assert_lowered_gives_the_ir_interpreters_values

CPU_STAGES = ("fuse", "layout", "narrow", "gemm_operands", "implicit", "epilogue", "group", "plan")

MLP = layer_stack(mlp_head(b=4, t=16, c=32, ff=64), MLP_OUTS, 3, MLP_PARAMS)

# `y`'s epilogue loads `u` at each element: `v` (of `u` alone) joins it, `z` (also of `x`) does not
SHARING = """
dim batch = 64, c = 96, ff = 192
input x[batch, ff], u[batch, ff], a[batch, c]
param w[c, ff], b[ff]
out y = (a @ w + b) * u
out z = u * x
out v = exp(u) * 2
"""


def options(dtype: str = "f32", **cpu) -> Options:
    opts = Options(dtype=dtype, stages=CPU_STAGES, unroll_max_ops=0)
    return opts.with_(cpu=opts.cpu.with_(**cpu)) if cpu else opts


def lowered(dtype: str = "f32", stop_after: str = "epilogue", joins: bool = True, monkeypatch=None):
    if not joins:
        monkeypatch.setattr(epilogue, "_sharers", lambda *a: [])
    opts = options(dtype)
    m = pipeline.lower(compile_source(MLP, "<test>", opts), opts).module
    return m, lower_module(m, opts, stop_after=stop_after)


def backward_step(low):
    (loop,) = [k for k in low.kernels if isinstance(k, StepLoop) and k.reverse]
    return loop.step


def gelu_gemm(step) -> GemmKernel:
    (g,) = [k for k in step.kernels if isinstance(k, GemmKernel) and len(k.epilogue) > 0 and
            any("tanh" not in str(o.expr) and "0.7978845608028654" in str(o.expr) for o in k.epilogue)]
    return g


GOLDEN = [
    "gemm %t12 = %p6[c, ff] @ %p0[b, c, t]  batch() m(ff) n(b, t) k(c)",
    "      then %t12[b, ff, t] = add[3.0, 1.0, 0.7978845608028654](mul00(mul00(add[0.035677408136300125](mul0("
    "add[0.5](mul(acc, %p2[b, ff, t])), mul(add[-1.0, 1.0](%p3[b, ff, t], 1.0), add[1.0, 1.0](%p3[b, ff, t], 1.0)))), "
    "%p2[b, ff, t]), %p2[b, ff, t]), mul(acc, add[0.5, 1.0](%p3[b, ff, t], 0.5)), mul0(add[0.5](mul(acc, "
    "%p2[b, ff, t])), mul(add[-1.0, 1.0](%p3[b, ff, t], 1.0), add[1.0, 1.0](%p3[b, ff, t], 1.0))))",
    # the recomputed GELU (0.5 + 0.5 t) u of the kept tanh %p3 and pre-activation %p2
    "      then %t14[b, ff, t] = mul(add[0.5, 1.0](%p3[b, ff, t], 0.5), %p2[b, ff, t])",
]


def test_golden_the_recomputed_gelu_joins_the_derivatives_epilogue():
    _, low = lowered()
    step = backward_step(low)
    g = gelu_gemm(step)
    assert g.text().splitlines() == GOLDEN
    loaded = epilogue._own_loads(g.epilogue[0].expr, set(g.out_edges()))
    assert loaded == {"p2", "p3"} == epilogue._own_loads(g.epilogue[1].expr, set(g.out_edges()))
    # no other kernel of the step reads the kept pre-activation and tanh any more
    for k in step.kernels:
        if k is not g:
            assert not (k.buffers_read() & loaded), k.text()
    # and the weight gradient's product reads the joined output
    assert any(isinstance(k, GemmKernel) and "t14" in (k.a.buf, k.b.buf) for k in step.kernels)


def test_without_the_join_a_loop_reads_them_again(monkeypatch):
    _, low = lowered(joins=False, monkeypatch=monkeypatch)
    step = backward_step(low)
    g = gelu_gemm(step)
    assert len(g.epilogue) == 1
    loaded = epilogue._own_loads(g.epilogue[0].expr, set(g.out_edges()))
    readers = [k for k in step.kernels if isinstance(k, LoopKernel) and k.buffers_read() & loaded]
    assert len(readers) == 1 and readers[0].buffers_read() == loaded


def test_a_full_size_load_the_epilogue_does_not_make_keeps_a_kernel_out():
    """`z = u * x` beside the epilogue `y = (acc + b) * u`: `x` is a full-size read the
    epilogue does not make; `w = u * u` joins."""
    source = SHARING
    opts = Options(dtype="f32", stages=CPU_STAGES)
    m = pipeline.lower(compile_source(source, "<test>", opts), opts).module
    low = lower_module(m, opts, stop_after="epilogue")
    (g,) = [k for k in low.kernels if isinstance(k, GemmKernel)]
    assert [o.buf for o in g.epilogue] == ["y", "v"]
    assert [k.out for k in low.kernels if isinstance(k, LoopKernel)] == ["z"]


def test_a_kernel_in_between_that_writes_what_it_reads_keeps_it_out():
    """`v = exp(u) * 2` after a kernel that writes `u` (after the GEMM): moved into the
    GEMM's store it would read `u`'s old value; it stays where it is, `y` joins."""
    source = SHARING.replace("out z = u * x\n", "")
    opts = Options(dtype="f32", stages=CPU_STAGES)
    m = pipeline.lower(compile_source(source, "<test>", opts), opts).module
    low = lower_module(m, opts, stop_after="layout")
    g, y, v = low.kernels
    assert isinstance(g, GemmKernel) and y.out == "y" and v.out == "v"
    low.kernels = [g, y, replace(v, out="u", body=v.body), v]
    kernels = epilogue.fold(low)
    assert [o.buf for o in kernels[0].epilogue] == ["y"]
    assert [k.out for k in kernels[1:]] == ["u", "v"]


@pytest.mark.parametrize("dtype", ["f64", "f32"])
def test_the_lowered_interpreter_gives_the_ir_interpreters_values(dtype):
    m, low = lowered(dtype)
    assert_lowered_gives_the_ir_interpreters_values(m, low, dtype)


@pytest.mark.parametrize("tiles", [True, False], ids=["in_tiles", "as_loops"])
@pytest.mark.parametrize("dtype", ["f64", "f32"])
def test_the_cpu_backend_agrees_with_the_lowered_interpreter(dtype, tiles):
    m, low = lowered(dtype)
    x = random_inputs(m, m.bind_dims({}), 1, dtype)
    want = run_lowered(low, {k: np.copy(v) for k, v in x.items()})
    tol = 1e-10 if dtype == "f64" else 3e-5
    for threads in (1, 2):
        opts = options(dtype, gemm_epilogue=tiles, threads=threads, gemm_parallel_min_flops=0)
        got = tgc.compile(MLP, options=opts)(**{k: np.copy(v) for k, v in x.items()})
        for k, w in want.items():
            scale = max(1.0, float(np.max(np.abs(w))))
            np.testing.assert_allclose(np.asarray(got[k]), w, rtol=tol, atol=tol * scale, err_msg=f"{k} {threads}")


@pytest.mark.slow
def test_gpt2_step_is_the_step_without_the_join(monkeypatch):
    """examples/gpt2.tg (2 layers, f32, AdamW under clipping) on the CPU: the joined
    output is the same expression of the same values (the same bits), but the bias
    gradient's column sum left alone in its group is grouped differently (its partial
    sums' rounding), and through the clip factor every update moves by f32 rounding:
    each array within 1e-6 of its largest value."""
    monkeypatch.setenv("TGC_CACHE", "off")   # the code cache's key is the module's: it would hand back the first build
    gpt2 = Path(__file__).resolve().parents[2] / "examples" / "gpt2.tg"
    sizes = {"layer": 2, "head": 2, "hd": 16, "t": 32, "vocab": 29, "batch": 3}

    real = epilogue._sharers

    def step(joins: bool):
        if not joins:
            monkeypatch.setattr(epilogue, "_sharers", lambda *a: [])
        prog = tgc.compile(str(gpt2), dims=sizes, dtype="f32", backend="cpu",
                           options=Options(dtype="f32").with_(cpu=Options().cpu.with_(threads=1)))
        low = prog.lowered
        joined = [k for _, lp in [(None, k) for k in low.kernels if isinstance(k, StepLoop)]
                  for k in lp.step.kernels if isinstance(k, GemmKernel) and len(k.epilogue) == 2]
        monkeypatch.setattr(epilogue, "_sharers", real)
        return prog, joined

    a, joined_a = step(True)
    b, joined_b = step(False)
    assert joined_a and not joined_b
    rng = np.random.default_rng(0)
    arrays = {}
    for spec in a.inputs:
        shape = tuple(spec.shape)
        if spec.dtype == "i32":
            arrays[spec.name] = rng.integers(0, sizes["vocab"], shape).astype(np.int32)
        else:
            arrays[spec.name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
    ins = {n: {k: np.copy(v) for k, v in arrays.items()} for n in "ab"}
    got_a, got_b = a(**ins["a"]), b(**ins["b"])
    worst = {}
    for k in arrays:
        if ins["a"][k].dtype.kind == "f":
            worst[k] = float(np.abs(ins["a"][k] - ins["b"][k]).max() / max(np.abs(ins["b"][k]).max(), 1e-30))
    for k in got_a:
        worst[k] = float(np.abs(np.asarray(got_a[k]) - np.asarray(got_b[k])).max())
    for k, err in worst.items():
        if k not in ("bk", "m.bk", "v.bk"):   # bk's gradient is zero up to rounding (a key bias shifts a whole row)
            assert err <= 1e-6, (k, err)   # seen: 7.5e-9 (wproj, through the clip factor)
