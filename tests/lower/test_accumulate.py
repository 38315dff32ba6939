"""Accumulating GEMMs (tgc.lower.accumulate): `r = c + a @ b` where `r` and `c` share
memory becomes `gemm %r += a @ b` (beta = 1), a loop's carry then updated in place.
Golden lines of a streamed attention's step, the text read back, the verifier's rules,
the lowered interpreter against the IR interpreter and the CPU backend (f32 and f64),
cuda-sim, and --fp-strict keeping the two kernels."""
from __future__ import annotations

from dataclasses import replace

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
from tgc.lower.verify import VerifyError, verify_lowered
from tgc.options import Options
from tgc.pipeline import lower_module

CPU_STAGES = ("fuse", "layout", "narrow", "gemm_operands", "implicit", "accumulate", "epilogue", "group", "plan")

# Attention over 64 keys, streamed over the queries in 4 blocks of 16: dk and dv are
# the loop's carries, each step adding a GEMM's product into them.
ATTENTION = """
dim t = 64, s = 64, hd = 8
input q[t, hd], k[s, hd], v[s, hd], dy[t, hd]
scores = sum[hd](q * k) / sqrt(size(hd))
y = sum[s](softmax[s](scores) * v)
out y
loss = sum(y * dy)
out dq = grad(loss, q)
out dk = grad(loss, k)
out dv = grad(loss, v)
"""

# Causal: the masked stream runs 4 loops, each over the keys its rows admit (16, 32, 48,
# 64): the first three add their products into the leading block of the carries' keys.
CAUSAL = """
dim t = 64, hd = 8
dim s = t
input q[t, hd], k[s, hd], v[s, hd], dy[t, hd]
scores = sum[hd](q * k) / sqrt(size(hd))
y = sum[s](softmax[s](where([s <= t], scores, -1e9)) * v)
out y
loss = sum(y * dy)
out dq = grad(loss, q)
out dk = grad(loss, k)
out dv = grad(loss, v)
"""


def options(dtype: str = "f32", **kw) -> Options:
    return Options(dtype=dtype, stages=CPU_STAGES, stream_block=16, stream_block_min=8, stream_min_elements=64,
                   stream_min_elements_masked=64, stream_mask_groups=4, cpu=CpuOptions(blas_min_flops=0), **kw)


def lowered(dtype: str = "f32", stop_after: str = "plan", source: str = ATTENTION, **kw):
    opts = options(dtype, **kw)
    m = pipeline.lower(compile_source(source, "<test>", opts), opts).module
    return m, lower_module(m, opts, stop_after=stop_after)


def loops(low) -> list[StepLoop]:
    return [k for k in low.kernels if isinstance(k, StepLoop)]


def the_loop(low) -> StepLoop:
    assert len(loops(low)) == 1
    return loops(low)[0]


def accumulating(low) -> list[GemmKernel]:
    return [k for loop in loops(low) for k in loop.step.kernels if isinstance(k, GemmKernel) and k.acc]


def test_golden_carries_added_into_in_place():
    """Each step adds dk's and dv's products into the carries' buffers: the loop binds
    the step's outputs 0 and 1 to the carries (no copy after a step), and the step has
    no kernel that adds a stored product."""
    _, low = lowered(stop_after="accumulate")
    loop = the_loop(low)
    assert loop.trip == 4
    assert [b.buf for b in loop.outs[:2]] == [b.buf for b in loop.args[:2]] == ["c4", "c5"]
    lines = [x for x in print_lowered(loop.step, module=False).splitlines() if x.startswith("k")]
    assert "k9: gemm %r0 += %p2[hd, t.1] @ %t18[s, t.1]  batch() m(hd) n(s) k(t.1)" in lines
    assert "k10: gemm %r1 += %p3[hd, t.1] @ %t14[s, t.1]  batch() m(hd) n(s) k(t.1)" in lines
    assert not any("add[1.0, 1.0](%p0" in x or "add[1.0, 1.0](%p1" in x for x in lines)
    head = loop.text().splitlines()[0]
    # the row blocks of q and dy are read in place (Bind.split: t outermost), no copy in
    assert "args(%c4, %c5, %q[t], %dy[t], %v, %k) outs(%c4, %c5, %y8[i], %y9[i])" in head


def test_golden_causal_blocks_add_into_the_leading_keys():
    """Each of the causal stream's loops adds dk's and dv's products (over its keys
    s.1 .. s.3, then all of s) into the carries in place: the first three into the
    leading block of `s`."""
    _, low = lowered(stop_after="accumulate", source=CAUSAL)
    assert len(loops(low)) == 4
    for loop in loops(low):
        assert [b.buf for b in loop.outs[:2]] == [b.buf for b in loop.args[:2]] == ["c4", "c5"]
    lines = [x for x in print_lowered(loops(low)[0].step, module=False).splitlines() if x.startswith("k")]
    assert "k7: gemm %r0 += %p2[hd, t.1] @ %t17[s.1, t.1]  batch() m(hd) n(s.1) k(t.1) prefix(s.1 in s)" in lines
    assert "k8: gemm %r1 += %p3[hd, t.1] @ %t14[s.1, t.1]  batch() m(hd) n(s.1) k(t.1) prefix(s.1 in s)" in lines
    assert [len(k.prefix) for k in accumulating(low)] == [1, 1, 1, 1, 1, 1, 0, 0]


def test_the_verifier_refuses_a_prefix_without_accumulation():
    _, low = lowered(stop_after="accumulate", source=CAUSAL)
    step = loops(low)[0].step
    j = next(i for i, k in enumerate(step.kernels) if isinstance(k, GemmKernel) and k.prefix)
    step.kernels[j] = replace(step.kernels[j], acc=False)
    with pytest.raises(VerifyError, match="prefix on a GEMM that does not accumulate"):
        verify_lowered(step, frozenset({"r0", "r1"}))


def test_fp_strict_keeps_the_add():
    _, low = lowered(stop_after="accumulate", fp_strict=True)
    assert not any(isinstance(k, GemmKernel) and k.acc for k in low.kernels)


@pytest.mark.parametrize("source", [ATTENTION, CAUSAL])
@pytest.mark.parametrize("stage", ["accumulate", "plan"])
def test_the_text_reads_back_and_the_verifier_accepts_it(stage, source):
    _, low = lowered(stop_after=stage, source=source)
    text = print_lowered(low)
    again = parse_lowered(text)
    assert print_lowered(again) == text
    verify_lowered(again)


def test_the_verifier_needs_the_carry_in_place():
    """The step reads its output before writing it only where the loop binds that
    output to the carry's buffer; an accumulating GEMM into a buffer nothing wrote is refused."""
    _, low = lowered(stop_after="accumulate")
    loop = the_loop(low)
    with pytest.raises(VerifyError, match="adds into '%r0' before anything writes it"):
        verify_lowered(loop.step)
    verify_lowered(loop.step, frozenset({"r0", "r1"}))


@pytest.mark.parametrize("source", [ATTENTION, CAUSAL])
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_the_interpreter_and_the_cpu_agree_with_the_ir_interpreter(dtype, source):
    m, low = lowered(dtype, source=source)
    assert accumulating(low)
    x = random_inputs(m, m.bind_dims({}), 3, dtype)
    want = evaluate(m, x, dtype=dtype)
    got = run_lowered(low, {k: np.copy(v) for k, v in x.items()})
    prog = tgc.compile(source, options=options(dtype).with_(stages=None))
    cpu = prog(**{k: np.copy(v) for k, v in x.items()})
    tol = 1e-12 if dtype == "f64" else 2e-5
    for name in want:
        scale = np.abs(want[name]).max()
        assert np.abs(got[name] - want[name]).max() <= tol * scale, name
        assert np.abs(np.asarray(cpu[name]) - want[name]).max() <= tol * scale, name


@pytest.mark.parametrize("source", [ATTENTION, CAUSAL])
def test_the_cpu_accumulates_on_each_of_its_gemm_paths(source):
    """The own kernel (fgemm) and cblas for large tiles, the generated loops for small
    ones: each adds into the old value (beta = 1), against the lowered interpreter."""
    m, low = lowered("f32", source=source)
    x = random_inputs(m, m.bind_dims({}), 5, "f32")
    want = run_lowered(low, {k: np.copy(v) for k, v in x.items()})
    for own, loop_max in (("on", 0), ("off", 0), ("off", 1 << 30)):
        opts = options("f32").with_(stages=None)
        opts = opts.with_(cpu=opts.cpu.with_(own_gemm=own, own_gemm_min_depth=1, gemm_loop_max_flops=loop_max))
        got = tgc.compile(source, options=opts)(**{k: np.copy(v) for k, v in x.items()})
        for name in want:
            scale = np.abs(want[name]).max()
            assert np.abs(np.asarray(got[name]) - want[name]).max() <= 2e-5 * scale, (own, loop_max, name)


@pytest.mark.parametrize("source", [ATTENTION, CAUSAL])
def test_cuda_sim_runs_an_accumulating_gemm(source):
    """The CUDA backends' lowering (carries in place, `gemm +=`) on the emulator: the
    strided call with beta = 1 (tgc.backends.cuda.gemm.run_numpy), against the lowered
    interpreter on the CPU's lowering."""
    from tgc.backends.cuda.runtime import unavailable

    why = unavailable("cuda-sim")
    if why:
        pytest.skip(f"cuda-sim: {why}")
    m, low = lowered("f64", source=source)
    x = random_inputs(m, m.bind_dims({}), 7, "f64")
    want = run_lowered(low, {k: np.copy(v) for k, v in x.items()})
    opts = options("f64").with_(stages=None)   # the CUDA backends' own stage list (accumulate after flash)
    assert accumulating(lower_module(m, opts, "cuda-sim"))
    prog = tgc.compile(source, "cuda-sim", options=opts)
    got = prog(**{k: np.copy(v) for k, v in x.items()})
    for name in want:
        assert np.allclose(np.asarray(got[name]), want[name], rtol=1e-12, atol=1e-12), name


def test_the_cpus_carries_in_place_give_the_derivative():
    """dk and dv of the causal program, as the CPU computes them with the carries added
    into in place, against central differences of the loss sum(y * dy) (f64)."""
    m, low = lowered("f64", source=CAUSAL)
    assert accumulating(low)
    x = random_inputs(m, m.bind_dims({}), 11, "f64")
    prog = tgc.compile(CAUSAL, options=options("f64").with_(stages=None))

    def loss(**changed):
        y = np.asarray(prog(**{**x, **changed})["y"])
        return float(np.sum(y * x["dy"]))

    got = prog(**x)
    rng = np.random.default_rng(0)
    eps = 1e-5
    for name, grad in (("k", "dk"), ("v", "dv")):
        for _ in range(2):
            u = rng.standard_normal(x[name].shape)
            fd = (loss(**{name: x[name] + eps * u}) - loss(**{name: x[name] - eps * u})) / (2 * eps)
            assert abs(float(np.sum(np.asarray(got[grad]) * u)) - fd) <= 1e-6 * max(1.0, abs(fd)), name


IN_PLACE = """\
// lowered after layout (f64)
buffer %a : f64[k, m] arg 0 order [m, k]
buffer %b : f64[k, n] arg 1 order [k, n]
buffer %c : f64[m, n] arg 2 order [m, n]
buffer %r : f64[m, n] out 0 order [m, n]
buffer %t4 : f64[m, n] temp order [m, n]

k0: loop %r[m, n] = %c[m, n]
      for m < 8, n < 8
k1: gemm %t4 = %b[k, n] @ %a[k, m]  batch() m(n) n(m) k(k)
k2: loop %r[m, n] = add[1.0, 1.0](%r[m, n], %t4[m, n])
      for m < 8, n < 8

module {
dim m = 8
dim k = 8
dim n = 8
input a : f64[m, k]
input b : f64[k, n]
input c : f64[m, n]

%0 = contract %b, %a : f64[m, n]
%1 = add[1.0, 1.0] %c, %0 : f64[m, n]

out r = %1 : [m, n]
}
"""


def test_an_in_place_sum_becomes_one_gemm_adding_into_it():
    """`r = r + t` after `t = a @ b`: one GEMM adding into `r`; the lowered interpreter
    and the CPU backend (the program planned and compiled) give c + a @ b."""
    from tgc.backends.cpu.kernels import compile_kernels
    from tgc.lower.accumulate import Accumulate
    from tgc.lower.plan import Plan

    low = parse_lowered(IN_PLACE)
    out = Accumulate().run(low, Options(dtype="f64"))
    lines = [x for x in print_lowered(out, module=False).splitlines() if x.startswith("k")]
    assert lines == ["k0: loop %r[m, n] = %c[m, n]", "k1: gemm %r += %b[k, n] @ %a[k, m]  batch() m(n) n(m) k(k)"]
    assert "t4" not in out.buffers
    verify_lowered(out)
    rng = np.random.default_rng(2)
    x = {"a": rng.standard_normal((8, 8)), "b": rng.standard_normal((8, 8)), "c": rng.standard_normal((8, 8))}
    want = x["c"] + x["a"] @ x["b"]
    for prog in (low, out):
        got = run_lowered(prog, {k: np.copy(v) for k, v in x.items()})["r"]
        assert np.allclose(got, want, rtol=1e-14, atol=1e-14)
    opts = Options(dtype="f64")
    planned = Plan().run(out, opts)
    compiled = compile_kernels(planned.module, planned, opts)
    r = np.full((8, 8), np.nan)   # the buffers' orders are the arrays' own ([m, k], [k, n], [m, n])
    assert compiled.run({k: np.ascontiguousarray(v) for k, v in x.items()}, {"r": r}, {}) == 0
    assert np.allclose(r, want, rtol=1e-14, atol=1e-14)
