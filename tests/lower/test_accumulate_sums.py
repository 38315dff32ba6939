"""Summed products (tgc.lower.accumulate, "summed products"): products read only in one
sum with coefficient 1, `add[1, 1, 1](t1, t2, t3)` (the input gradient of the
layernorm that feeds a transformer block's q, k and v projections), become one buffer
the later GEMMs add into (beta = 1, their product's edges named as the first's), and
each sum reads that buffer alone. Golden lines (and GPT-2's backward step, where the
edges differ: `t -> s`), the cases it leaves alone, the text read back, the lowered
interpreter against the IR interpreter, the CPU on each of its GEMM paths, cuda-sim,
and the f32 error against float64 numpy within f32's bound (not the same bits: the
separate form sums the three products in f64 and rounds once, `lowered.wide_sum`;
here each GEMM's add rounds, as PyTorch's accumulated gradients do)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.backends.cpu.options import CpuOptions
from tgc.frontend import compile_source
from tgc.ir.interp import evaluate
from tgc.ir.inputs import random_inputs
from tgc.lower.interp import run_lowered
from tgc.lower.lowered import GemmKernel, StepLoop, print_lowered
from tgc.lower.text import parse_lowered
from tgc.options import Options
from tgc.pipeline import lower_module

CPU_STAGES = ("fuse", "layout", "narrow", "gemm_operands", "implicit", "accumulate", "epilogue", "group", "plan")
ROOT = Path(__file__).resolve().parents[2]

# three products summed, the sum read by a row reduction and two outputs (as a
# layernorm's backward reads its input gradient)
THREE = """
dim n = 96, c = 64, d = 48
input a[n, d], b[n, d], e[n, d], x[n, c], g[c]
param w1[d, c], w2[d, c], w3[d, c]
s = a @ w1 + b @ w2 + e @ w3
m = sum[c](s * g * x)
out y = x * m + s * g
out db = sum[n](s)
"""

# the second product is also an output (read alone)
ALONE = THREE.replace("out db = sum[n](s)", "out db = sum[n](s)\nout z = b @ w2")


def options(dtype: str = "f32", **kw) -> Options:
    return Options(dtype=dtype, stages=CPU_STAGES, cpu=CpuOptions(blas_min_flops=0), **kw)


def lowered(source: str = THREE, dtype: str = "f32", stop_after: str = "accumulate", **kw):
    opts = options(dtype, **kw)
    m = pipeline.lower(compile_source(source, "<test>", opts), opts).module
    return m, lower_module(m, opts, stop_after=stop_after)


def gemms(low) -> list[GemmKernel]:
    return [k for k in low.kernels if isinstance(k, GemmKernel)]


def test_golden_the_later_products_add_into_the_first():
    _, low = lowered()
    lines = [x for x in print_lowered(low, module=False).splitlines() if x.startswith(("k", "      for"))]
    assert lines == [
        "k0: gemm %t10 = %w2[c, d] @ %b[d, n]  batch() m(c) n(n) k(d)",
        "k1: gemm %t10 += %e[d, n] @ %w3[c, d]  batch() m(n) n(c) k(d)",
        "k2: gemm %t10 += %w1[c, d] @ %a[d, n]  batch() m(c) n(n) k(d)",
        "k3: loop %t13[n] = sum[c] mul(%g[c], %x[c, n], %t10[c, n])",
        "      for n < 96, c < 64",
        "k4: loop %y[c, n] = add[1.0, 1.0](mul(%x[c, n], %t13[n]), mul(%g[c], %t10[c, n]))",
        "      for n < 96, c < 64",
        "k5: loop %db[c] = sum[n] %t10[c, n]",
        "      for n < 96, c < 64",
    ]
    assert [b for b, x in low.buffers.items() if x.kind == "temp"] == ["t10", "t13"]


def test_a_product_read_alone_is_left_alone():
    """`b @ w2` is also an output: it keeps its buffer, the other two products fold."""
    _, low = lowered(ALONE)
    z, first, second = gemms(low)
    assert z.out == "z" and not z.acc and (first.acc, second.acc) == (False, True) and first.out == second.out
    assert "add[1.0, 1.0](%z[c, n], %t11[c, n])" in print_lowered(low, module=False)


def test_fp_strict_keeps_the_sum():
    _, low = lowered(fp_strict=True)
    assert not any(g.acc for g in gemms(low))


@pytest.mark.parametrize("stage", ["accumulate", "plan"])
def test_the_text_reads_back(stage):
    _, low = lowered(stop_after=stage)
    text = print_lowered(low)
    assert print_lowered(parse_lowered(text)) == text


@pytest.mark.parametrize("dtype", ["f64", "f32"])
def test_the_interpreter_and_the_cpu_agree_with_the_ir_interpreter(dtype):
    m, low = lowered(dtype=dtype, stop_after="plan")
    assert any(g.acc for g in gemms(low))
    x = random_inputs(m, m.bind_dims({}), 3, dtype)
    want = evaluate(m, {k: np.copy(v) for k, v in x.items()}, dtype=dtype)
    got = run_lowered(low, {k: np.copy(v) for k, v in x.items()})
    tol = 1e-12 if dtype == "f64" else 2e-5
    for own, loop_max in (("on", 0), ("off", 0), ("off", 1 << 30)):
        opts = options(dtype).with_(stages=None)
        opts = opts.with_(cpu=opts.cpu.with_(own_gemm=own, own_gemm_min_depth=1, gemm_loop_max_flops=loop_max))
        cpu = tgc.compile(THREE, options=opts)(**{k: np.copy(v) for k, v in x.items()})
        for name in want:
            scale = np.abs(want[name]).max()
            assert np.abs(got[name] - want[name]).max() <= tol * scale, name
            assert np.abs(np.asarray(cpu[name]) - want[name]).max() <= tol * scale, (own, loop_max, name)


def test_f32_error_is_f32s_against_float64():
    """At the nanoGPT block's sizes (1024 rows, 384 wide), f32: the error against
    float64 numpy is within f32's rounding of sums of 384 products (1e-6 of the largest
    value; seen 3.6e-7, the unfolded program 3.1e-7)."""
    src = THREE.replace("n = 96, c = 64, d = 48", "n = 1024, c = 384, d = 384")
    rng = np.random.default_rng(0)
    shapes = dict(a=(1024, 384), b=(1024, 384), e=(1024, 384), x=(1024, 384), g=(384,),
                  w1=(384, 384), w2=(384, 384), w3=(384, 384))
    x = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    f = {k: v.astype(np.float64) for k, v in x.items()}
    s = f["a"] @ f["w1"] + f["b"] @ f["w2"] + f["e"] @ f["w3"]
    m = (s * f["g"] * f["x"]).sum(1, keepdims=True)
    want = {"y": f["x"] * m + s * f["g"], "db": s.sum(0)}
    prog = tgc.compile(src, options=Options(dtype="f32"))
    assert any(isinstance(k, GemmKernel) and k.acc for k in prog.lowered.kernels)
    got = prog(**x)
    for k, w in want.items():
        assert np.abs(np.asarray(got[k]) - w).max() <= 1e-6 * np.abs(w).max(), k


def test_cuda_sim_runs_the_summed_products():
    from tgc.backends.cuda.runtime import unavailable

    why = unavailable("cuda-sim")
    if why:
        pytest.skip(f"cuda-sim: {why}")
    m, low = lowered(dtype="f64", stop_after="plan")
    x = random_inputs(m, m.bind_dims({}), 7, "f64")
    want = run_lowered(low, {k: np.copy(v) for k, v in x.items()})
    opts = options("f64").with_(stages=None)
    assert any(isinstance(k, GemmKernel) and k.acc for k in lower_module(m, opts, "cuda-sim").kernels)
    got = tgc.compile(THREE, "cuda-sim", options=opts)(**{k: np.copy(v) for k, v in x.items()})
    for name in want:
        assert np.allclose(np.asarray(got[name]), want[name], rtol=1e-12, atol=1e-12), name


@pytest.mark.slow
def test_gpt2_backward_adds_the_three_input_gradients_of_ln1_into_one_buffer():
    """examples/gpt2.tg's backward step: the products through q's, k's and v's weights
    add into one buffer, their product's edges named as its (a view `s -> t` or `t -> s`)."""
    opts = Options(dtype="f32")
    dims = {"layer": 2, "head": 2, "hd": 16, "t": 32, "vocab": 29, "batch": 3}
    prog = tgc.compile(str(ROOT / "examples" / "gpt2.tg"), dims=dims, options=opts)
    (loop,) = [k for k in prog.lowered.kernels if isinstance(k, StepLoop) and k.reverse]
    acc = [k for k in loop.step.kernels if isinstance(k, GemmKernel) and k.acc]
    assert len(acc) == 2 and acc[0].out == acc[1].out
    texts = [k.text() for k in acc]
    assert any("t -> s]" in x or "s -> t]" in x for x in texts), texts
    writers = [k for k in loop.step.kernels if acc[0].out in k.writes()]
    assert len(writers) == 3
