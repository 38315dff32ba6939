"""The gpt_adamw benchmark workload: the .tg file is what its generator writes, and one
step of it (float64, tgc's CPU build) is the numpy reference's AdamW step."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import tgc

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "workloads")]

import make_gpt_adamw  # noqa: E402
import ref_numpy  # noqa: E402


def test_gpt_adamw_tg_is_generated_from_gpt_tg():
    assert (ROOT / "benchmarks" / "workloads" / "gpt_adamw.tg").read_text() == make_gpt_adamw.generate(), \
        "run python benchmarks/workloads/make_gpt_adamw.py"


@pytest.mark.slow
def test_one_gpt_adamw_step_is_the_reference_adamw_step():
    import run

    arrays = {k: np.asarray(v, np.float64) if np.asarray(v).dtype.kind == "f" else v
              for k, v in run._gpt_adamw_inputs(np.random.default_rng(0)).items()}
    arrays = {k: (v[:4] if k in ("ids", "targets") else v) for k, v in arrays.items()}   # batch 4
    prog = tgc.compile(str(ROOT / "benchmarks" / "workloads" / "gpt_adamw.tg"), dtype="f64")
    got = prog(**{k: np.array(v, copy=True) for k, v in arrays.items()})
    ref = {k: np.array(v, copy=True) for k, v in arrays.items()}
    want = ref_numpy.gpt_adamw_step(ref)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-10)
    for n in ref_numpy.gpt_param_names():
        step = (got[n] - arrays[n]) / float(arrays["lr"])
        np.testing.assert_allclose(step, (want[n] - arrays[n]) / float(arrays["lr"]), rtol=1e-6, atol=1e-8, err_msg=n)
        np.testing.assert_allclose(got[f"m_{n}"], ref[f"m_{n}"], rtol=1e-9, atol=1e-14, err_msg=n)
        np.testing.assert_allclose(got[f"v_{n}"], ref[f"v_{n}"], rtol=1e-9, atol=1e-18, err_msg=n)


def test_conv2d_reference_is_the_programs_values():
    import run

    arrays = {k: np.asarray(v, np.float64) for k, v in run._conv2d_inputs(2, 32, 64, 3, 32)(np.random.default_rng(0)).items()}
    got = tgc.compile(str(ROOT / "benchmarks" / "workloads" / "conv2d.tg"), dtype="f64")(**arrays)
    want = ref_numpy.conv2d({k: v.copy() for k, v in arrays.items()})
    for k in ("y", "dx", "dK"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-10, atol=1e-10, err_msg=k)


def test_gcn_reference_is_the_programs_values():
    """The numpy GCN (np.add.at scatters, a hand-written backward) is what gcn.tg computes."""
    import run

    arrays = {k: np.asarray(v, np.float64) if np.asarray(v).dtype.kind == "f" else v
              for k, v in run._gcn_inputs(np.random.default_rng(0)).items()}
    got = tgc.compile(str(ROOT / "benchmarks" / "workloads" / "gcn.tg"), dtype="f64")(
        **{k: np.array(v, copy=True) for k, v in arrays.items()})
    want = ref_numpy.gcn({k: np.array(v, copy=True) for k, v in arrays.items()})
    for k, w in want.items():
        np.testing.assert_allclose(got[k], w, rtol=1e-10, atol=1e-12, err_msg=k)


def test_one_gpt_small_step_is_the_reference_sgd_step():
    """The gpt_small row's workload (1 layer, 4 heads, width 64) and its numpy reference."""
    import run

    arrays = {k: np.asarray(v, np.float64) if np.asarray(v).dtype.kind == "f" else v
              for k, v in run._gpt_small_inputs(np.random.default_rng(0)).items()}
    prog = tgc.compile(str(ROOT / "benchmarks" / "workloads" / "gpt_small.tg"), dtype="f64")
    got = prog(**{k: np.array(v, copy=True) for k, v in arrays.items()})
    want = ref_numpy.gpt_small_step({k: np.array(v, copy=True) for k, v in arrays.items()})
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-10)
    for n in ref_numpy.gpt_param_names(ref_numpy.GPT_SMALL["layers"]):
        np.testing.assert_allclose(got[n], want[n], rtol=1e-9, atol=1e-12, err_msg=n)


def test_load_processes_run_for_the_block_and_stop_after_it():
    import run

    with run.BusyProcesses(2) as busy:
        assert len(busy.procs) == 2 and all(p.is_alive() for p in busy.procs)
    assert not any(p.is_alive() for p in busy.procs)
    with run.BusyProcesses(0) as none:
        assert none.procs == []


def test_region_counter_counts_the_parallel_regions_a_call_starts():
    """run.py --count-regions: a program loaded while the counter is installed counts each
    parallel region it starts (its values unchanged); on one thread it starts none; after
    close() later programs get tgc's own table."""
    import run
    from tgc.options import CpuOptions, Options

    src = "dim n = 2097152\ninput x[n]\nout y = exp(x) * 2"
    x = np.random.default_rng(0).standard_normal(2097152).astype(np.float32)
    counter = run.RegionCounter()
    try:
        two = tgc.compile(src, backend="cpu", options=Options(cpu=CpuOptions(threads=2, contention_memory_cycles=0)))
        one = tgc.compile(src, backend="cpu", options=Options(cpu=CpuOptions(threads=1)))
        start = counter.count
        y = two(x=x)["y"]
        per_call = counter.count - start
        assert per_call >= 1
        two(x=x)
        assert counter.count - start == 2 * per_call
        start = counter.count
        np.testing.assert_array_equal(one(x=x)["y"], y)
        assert counter.count == start
    finally:
        counter.close()
    after = tgc.compile(src + "\nout z = x * 3", backend="cpu",
                        options=Options(cpu=CpuOptions(threads=2, contention_memory_cycles=0)))
    start = counter.count
    after(x=x)
    assert counter.count == start


def test_every_tgc_column_times_its_specialization():
    """run.py settles each tgc contender before timing it, the one-thread column too (it
    timed the generic program, and the specialization's build, where only "tgc" was settled):
    a row's samples run the program specialized to the row's sizes in both columns."""
    import argparse

    import run
    from tgc.options import CpuOptions, Options

    case = next(c for c in run.cases() if c.workload == "gelu" and c.size == "64x256")
    columns = []
    for threads in (None, 1):
        tg = run.Tgc(False, threads)
        key = (case.workload, ())
        # specialize at the second call (the default waits for 2^31 FLOPs plus bytes of calls)
        tg.programs[key] = tgc.compile(str(run.WORK / "gelu.tg"), backend="cpu", dtype="f32", options=Options(
            specialize_work=0, cpu=CpuOptions(threads=threads or 0)))
        tg.compile_s[key] = 0.0
        columns.append(tg)
    makers = [("tgc", columns[0].make), ("tgc 1 thread", columns[1].make)]
    args = argparse.Namespace(repeat=1, sample_ms=0.1, blocked=False, settle_ms=0.0)
    row = run.run_case(case, makers, args, {"triad_GBps": 1.0, "sgemm_GFLOPs": 1.0}, columns[0])
    assert row["status"] == {"tgc": "ok", "tgc 1 thread": "ok"}
    assert row["variants"] == {"tgc": "specialized", "tgc 1 thread": "specialized"}
    for tg in columns:
        prog = tg.programs[(case.workload, ())]
        assert [v.specialized for v in prog.variants()] == [True] and prog.last_variant is not None
