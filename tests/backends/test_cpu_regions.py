"""Consecutive loop kernels in one parallel region (`tgc.backends.cpu.regions`): where
the barriers go, the generated code against the interpreter (on any thread count:
run this file with OMP_NUM_THREADS=1 and 2), and the region count `tgc explain` gives."""
from __future__ import annotations

import ctypes
import json

import numpy as np
import pytest
from click.testing import CliRunner

from backends.test_cpu_codegen import assert_matches, compile_ir, inputs_for
from tgc.backends.cpu import regions
from tgc.backends.cpu.codegen import region_count
from tgc.cli import main as cli_main
from tgc.ir.parser import parse_module
from tgc.options import Options

# k0: t = exp(tanh x); k1: p = t + 2 t^T (reads t across the threads' shares: a
# barrier); k2: q = tanh y (touches nothing of k0, k1: none); k3: r = sum over the
# split loop of p (a sum over its outer loop: runs alone, after the region)
CHAIN = """
dim n
edge m : n
input x : {t}[n, m]
input y : {t}[n, m]
%0 = map[tanh] %x : {t}[n, m]
%1 = map[exp] %0 : {t}[n, m]
%2 = rename[m -> n, n -> m] %1 : {t}[m, n]
%3 = add[1.0, 2.0] %1, %2 : {t}[n, m]
%4 = map[tanh] %y : {t}[n, m]
%5 = contract %3 : {t}[m]
out p = %3 : [n, m]
out q = %4 : [n, m]
out r = %5 : [m]
"""

# k0: u = tanh x, also an output; k1: v = exp(u) + y at the same element (thread-local:
# no barrier); k2: w = u * v, at the same element too
LOCAL = """
dim n
dim d = 40
input x : {t}[n, d]
input y : {t}[n, d]
%0 = map[tanh] %x : {t}[n, d]
%1 = map[exp] %0 : {t}[n, d]
%2 = add[1.0, 1.0] %1, %y : {t}[n, d]
%3 = contract %0, %2 : {t}[n, d]
out u = %0 : [n, d]
out v = %2 : [n, d]
out w = %3 : [n, d]
"""

# GEMMs between loops: k1 reads k0's output through a GEMM (barrier), k2's GEMM reads
# k1's result, k3 adds k0's output back
PRODUCTS = """
dim n
dim d = 48
dim e = 40
input x : {t}[n, d]
input w : {t}[d, e]
input v : {t}[e, d]
%0 = map[tanh] %x : {t}[n, d]
%1 = contract %0, %w : {t}[n, e]
%2 = map[tanh] %1 : {t}[n, e]
%3 = contract %2, %v : {t}[n, d]
%4 = add[1.0, 1.0] %3, %0 : {t}[n, d]
out a = %4 : [n, d]
out b = %1 : [n, e]
"""

# always in a region (no size threshold, no lag), no loop groups
FORCED = dict(group_blocks=0, parallel_min_work=1, parallel_min_work_warm=1, contention_memory_cycles=0)


def _threads() -> int:
    try:
        return ctypes.CDLL("libgomp.so.1").omp_get_max_threads()
    except OSError:
        return 1


def test_a_read_across_the_partition_gets_a_barrier_and_an_independent_kernel_none():
    prog = compile_ir(CHAIN.format(t="f64"), "f64", **FORCED)
    low = prog.lowered
    assert len(low.kernels) == 4
    (r,) = regions.plan_regions(low, prog.options.cpu)
    assert (r.start, r.stop) == (0, 3)
    assert r.single == (False, False, False)
    assert r.barrier == (False, True, False)
    assert prog.llvm_ir.count('call void @"tgc.barrier"()') == 1
    assert 'define internal void @"tgc.r0"' in prog.llvm_ir


def test_reads_at_the_written_element_need_no_barrier():
    prog = compile_ir(LOCAL.format(t="f64"), "f64", **FORCED)
    plan = regions.plan_regions(prog.lowered, prog.options.cpu)
    assert len(plan) == 1 and plan[0].stop - plan[0].start == len(prog.lowered.kernels) >= 2
    assert plan[0].barriers == 0
    assert "tgc.barrier" not in prog.llvm_ir


def test_temporaries_sharing_a_slot_conflict():
    """Two temporaries the memory plan put in one slot are one memory: a kernel writing
    one after another read the other needs a barrier, whatever their names."""
    low = compile_ir(CHAIN.format(t="f64"), "f64", **FORCED).lowered
    temps = [n for n, b in low.buffers.items() if b.kind == "temp"]
    assert temps
    cpu = Options().cpu
    reader = regions._Access(low, low.kernels[1], False, cpu, False)
    assert reader.memory(temps[0]) == ("slot", low.buffers[temps[0]].slot)
    assert regions._Access(low, low.kernels[1], False, cpu, True).memory("p") == ("io",)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("program", [CHAIN, LOCAL, PRODUCTS], ids=["across", "local", "products"])
def test_merged_regions_match_the_interpreter(dtype, program):
    prog = compile_ir(program.format(t=dtype), dtype, **FORCED)
    assert regions.plan_regions(prog.lowered, prog.options.cpu)
    for n in (1, 2, 3, 17, 301):
        for seed in range(2):   # fresh values each call: stale ones from the last cannot pass
            assert_matches(prog, inputs_for(prog, {"n": n}, seed=seed, dtype=dtype), dtype)


def test_products_join_the_region_with_barriers_around_them():
    # (a GEMM with an epilogue runs as a kernel of its own: the epilogue off here)
    prog = compile_ir(PRODUCTS.format(t="f64"), "f64", **FORCED, gemm_epilogue=False)
    kinds = [type(k).__name__ for k in prog.lowered.kernels]
    assert kinds.count("GemmKernel") == 2
    (r,) = regions.plan_regions(prog.lowered, prog.options.cpu)
    assert (r.start, r.stop) == (0, len(kinds))
    assert r.barriers == len(kinds) - 1   # each kernel reads the one before it through a GEMM's tasks


@pytest.mark.parametrize("program", [CHAIN, PRODUCTS], ids=["across", "products"])
def test_merged_and_separate_regions_give_the_same_bits(program):
    text = program.format(t="f32")
    progs = [compile_ir(text, "f32", **FORCED, merge_regions=m) for m in (True, False)] + \
        [compile_ir(text, "f32", group_blocks=0, threads=1)]
    x = inputs_for(progs[0], {"n": 123}, dtype="f32")
    want = progs[-1].run({k: v.copy() for k, v in x.items()})
    for prog in progs[:-1]:
        got = prog.run({k: v.copy() for k, v in x.items()})
        for name in want:
            assert got[name].tobytes() == want[name].tobytes(), name


@pytest.mark.skipif(_threads() < 2, reason="needs two OpenMP threads (OMP_NUM_THREADS=1 here)")
def test_without_the_barrier_the_transposed_read_races(monkeypatch):
    """The barrier is needed: the same region without it reads elements the other
    thread has not written yet (stale ones of the previous call)."""
    monkeypatch.setenv("TGC_CACHE", "off")   # the code must be this plan's, not a cached one
    monkeypatch.setattr(regions, "barriers", lambda low, ks, single, cpu, step=False: (False,) * len(ks))
    prog = compile_ir(CHAIN.format(t="f64"), "f64", **FORCED)
    assert "tgc.barrier" not in prog.llvm_ir
    wrong = 0
    for seed in range(8):
        try:
            assert_matches(prog, inputs_for(prog, {"n": 1000}, seed=seed), "f64")
        except AssertionError:
            wrong += 1
    if wrong == 0:   # a race shows only when the threads interleave: never a failure
        pytest.skip("the threads did not interleave in 8 calls here (the race needs them to)")


def test_region_count_of_a_small_program():
    low = compile_ir(CHAIN.format(t="f64"), "f64", group_blocks=0).lowered
    env = {"n": 2048}
    opts = Options(dtype="f64").with_(group_blocks=0)
    assert region_count(low, env, opts) == (1, 0, 1)         # k0..k2 in one region; k3 cannot split
    assert region_count(low, env, opts.with_(merge_regions=False)) == (3, 0, 0)
    assert region_count(low, env, opts.with_(region_max_barriers=0)) == (2, 0, 0)   # cut at the barrier
    assert region_count(low, env, opts.with_(threads=1)) == (0, 0, 0)
    assert region_count(low, {"n": 4}, opts) == (0, 0, 0)     # too small: serial


def test_explain_reports_regions_per_call(tmp_path):
    src = tmp_path / "chain.tgir"
    src.write_text(CHAIN.format(t="f32"))
    parse_module(src.read_text())   # the text is valid IR
    res = CliRunner().invoke(cli_main, ["explain", str(src), "--format", "json", "--dim", "n=2048"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["regions"]["per_call"] <= report["regions"]["unmerged"]
    assert report["regions"]["per_call"] >= 1
    text = CliRunner().invoke(cli_main, ["explain", str(src), "--dim", "n=2048"]).output
    assert "parallel regions per call: at most" in text


def test_kernels_in_one_region_share_its_plan():
    from tgc.backends.cpu.codegen import PARALLEL, thread_plan, thread_plans
    low = compile_ir(CHAIN.format(t="f64"), "f64", group_blocks=0).lowered
    opts = Options(dtype="f64").with_(group_blocks=0, parallel_min_work=1 << 18)
    env = {"n": 100}   # each kernel alone below parallel_min_work, the three together above it
    alone = [thread_plan(low, k, env, opts) for k in low.kernels[:3]]
    assert PARALLEL not in alone
    assert thread_plans(low, env, opts)[:3] == [PARALLEL] * 3
    assert thread_plans(low, env, opts.with_(merge_regions=False))[:3] == alone


def test_regions_inside_a_loops_step_match_the_interpreter():
    """A `repeat` and its derivative: the step's own kernels share regions (`call_steps`)."""
    from e2e.test_loops import inputs as loop_inputs, module, program
    from tgc.ir.interp import evaluate
    from tgc.lower.lowered import StepLoop
    from tgc.pipeline import compile_module

    m = module(program(3), unroll_max_ops=0)
    opts = Options(dtype="f64", unroll_max_ops=0).with_(**FORCED)
    prog = compile_module(m, opts, "cpu")
    steps = [k.step for k in prog.lowered.kernels if isinstance(k, StepLoop)]
    assert steps and any(regions.plan_regions(s, prog.options.cpu, step=True) for s in steps)
    for seed in range(3):
        ins = loop_inputs(3, seed=seed)
        want = evaluate(m, {k: a.copy() for k, a in ins.items()}, dtype="f64")
        got = prog.run({k: a.copy() for k, a in ins.items()})
        for name, w in want.items():
            np.testing.assert_allclose(np.asarray(got[name]), w, rtol=1e-10, atol=1e-12, err_msg=name)
