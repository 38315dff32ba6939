"""Code generated in units and compiled at once (codegen.generate_units,
llvm_env.emit_objects): the same results as one unit, the same bytes however the
work is shared, and a failing child process only costs time."""
import os
import re
from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.backends.cpu import codegen, llvm_env
from tgc.ir.interp import evaluate
from tgc.ir.inputs import random_inputs
from tgc.options import CpuOptions, Options
from tgc.pipeline import lower_module

ROOT = Path(__file__).resolve().parents[2]
GPT = ROOT / "benchmarks" / "workloads" / "gpt.tg"
MLP = ROOT / "benchmarks" / "workloads" / "mlp.tg"   # two units as well, and quicker to compile


def lowered(path, dtype="f64"):
    opts = Options(dtype=dtype)
    module = pipeline.lower(pipeline.load(str(path), opts), opts).module
    return module, lower_module(module, opts), opts


def test_units_split_kernels_and_share_one_table():
    _, low, opts = lowered(GPT)
    texts = codegen.generate_units(low, opts, objects_entry=True, units=3)
    assert len(texts) == 3
    first, rest = texts[0], texts[1:]
    assert "define i32 @\"tgc_run\"" in first and all("tgc_run" not in t for t in rest)
    assert re.search(r'@"tgc.fntable" = hidden global', first)
    for t in rest:
        assert re.search(r'@"tgc.fntable" = external global', t)
        defined = re.findall(r'define hidden [^@]*@"(tgc\.k\d+)"', t)
        assert defined, "a unit without kernels should not exist"
        for name in defined:  # what another unit defines, the first declares
            assert re.search(rf'declare hidden [^@]*@"{re.escape(name)}"', first)
    # every kernel is defined exactly once over all units
    names = [n for t in texts for n in re.findall(r'define (?:internal |hidden )?[^@]*@"(tgc\.k\d+)"\(', t)]
    assert len(names) == len(set(names)) > 10


def test_a_single_kernel_makes_at_most_two_units():
    path = ROOT / "benchmarks" / "workloads" / "gelu.tg"
    _, low, opts = lowered(path)
    assert len(codegen.generate_units(low, opts, units=8)) <= 2
    assert len(codegen.generate_units(low, opts, units=1)) == 1


@pytest.mark.slow
@pytest.mark.parametrize("jobs", [1, 2, 3])
def test_gpt_in_units_matches_the_interpreter(jobs):
    prog = tgc.compile(GPT, dtype="f64", options=Options().with_(compile_jobs=jobs))
    arrays = {k: 0.2 * v if v.dtype != np.int32 else v
              for k, v in random_inputs(prog.module, {**prog.module.dims, "batch": 2}, seed=jobs, dtype="f64").items()}
    want = evaluate(prog.module, {k: v.copy() for k, v in arrays.items()}, dtype="f64")
    got = prog(**{k: v.copy() for k, v in arrays.items()})
    for name, value in got.items():
        np.testing.assert_allclose(value, want[name], rtol=1e-9, atol=1e-11, err_msg=name)


def test_objects_do_not_depend_on_how_they_were_compiled():
    _, low, opts = lowered(MLP, "f32")
    texts = codegen.generate_units(low, opts, units=2)
    assert len(texts) == 2
    assert llvm_env.emit_objects(texts, 2, jobs=2) == llvm_env.emit_objects(texts, 2, jobs=1)


def test_a_child_that_dies_is_tried_again_without_the_vectorizers(monkeypatch):
    """LLVM's assertions abort the process: a vectorized compile that dies is retried
    unvectorized (as an LLVM assert in the loop vectorizer needs), in a child again."""
    _, low, opts = lowered(MLP, "f32")
    texts = codegen.generate_units(low, opts, units=2)
    parent, emit = os.getpid(), llvm_env.emit_object

    def vectorizer_dies(text, *args, vectorize=True, **kw):
        if os.getpid() != parent and vectorize:
            os.abort()
        return emit(text, *args, vectorize=vectorize, **kw)

    monkeypatch.setattr(llvm_env, "emit_object", vectorizer_dies)
    assert llvm_env.emit_objects(texts, 2, jobs=2) == [emit(t, 2, vectorize=False) for t in texts]


def test_a_child_that_fails_without_crashing_llvm_is_compiled_here_with_the_same_settings(monkeypatch):
    """A child that raised (or was killed from outside) says nothing about LLVM: this
    process compiles the module itself, vectorized as asked, so the code is the one a
    process without fork makes (never the unvectorized fallback)."""
    _, low, opts = lowered(MLP, "f32")
    texts = codegen.generate_units(low, opts, units=2)
    parent, emit = os.getpid(), llvm_env.emit_object
    seen = []

    def child_raises(text, *args, vectorize=True, **kw):
        if os.getpid() != parent:
            raise MemoryError("the child ran out")
        seen.append(vectorize)
        return emit(text, *args, vectorize=vectorize, **kw)

    monkeypatch.setattr(llvm_env, "emit_object", child_raises)
    assert llvm_env.emit_objects(texts, 2, jobs=2) == [emit(t, 2) for t in texts]
    assert seen == [True, True]


def test_a_module_llvm_cannot_compile_at_all_is_an_error_not_an_abort(monkeypatch):
    _, low, opts = lowered(MLP, "f32")
    texts = codegen.generate_units(low, opts, units=2)
    parent, emit = os.getpid(), llvm_env.emit_object

    def always_dies(text, *args, **kw):
        if os.getpid() != parent:
            os.abort()
        return emit(text, *args, **kw)

    monkeypatch.setattr(llvm_env, "emit_object", always_dies)
    with pytest.raises(llvm_env.LLVMCrash, match="with and without vectorization"):
        llvm_env.emit_objects(texts, 2, jobs=2)


def test_the_program_that_made_llvms_loop_vectorizer_assert_compiles():
    """Found by the fuzzer: a logsumexp of a power over a flipped, padded reindex made
    LLVM's loop vectorizer assert ("VPlan cost model and legacy cost model disagreed"),
    which aborted the process; it now compiles (unvectorized) and runs."""
    src = (ROOT / "tests/fuzz/regressions/llvm_loop_vectorize_abort.tg").read_text()
    prog = tgc.compile(src, dtype="f64")
    inputs = {"x11": np.linspace(-1, 1, 3).reshape(1, 3), "W8": np.array([0.5, -0.25, 1.0])}
    want = evaluate(prog.module, {k: v.copy() for k, v in inputs.items()}, dtype="f64")
    np.testing.assert_allclose(prog(**inputs)["o0"], want["o0"], rtol=1e-12)


def test_without_fork_this_process_compiles_every_unit(monkeypatch):
    _, low, opts = lowered(MLP, "f32")
    texts = codegen.generate_units(low, opts, units=2)

    def refuse():
        raise OSError("fork refused")

    monkeypatch.setattr(os, "fork", refuse)
    assert llvm_env.emit_objects(texts, 2, jobs=2) == [llvm_env.emit_object(t, 2) for t in texts]


@pytest.mark.slow
def test_after_a_parallel_region_small_kernels_go_parallel_too():
    """With the warm thresholds at 1 and a window that never closes, every kernel
    after the first parallel region runs on the threads: the results still match."""
    warm = Options(cpu=CpuOptions(parallel_min_work=1, parallel_min_work_warm=1, gemm_parallel_min_flops_warm=1,
                               warm_cycles=1 << 62, contention_memory_cycles=0))
    prog = tgc.compile(GPT, dtype="f64", options=warm)
    text = prog.llvm_ir
    assert "llvm.readcyclecounter" in text and "tgc.region_end" in text
    arrays = {k: 0.2 * v if v.dtype != np.int32 else v
              for k, v in random_inputs(prog.module, {**prog.module.dims, "batch": 3}, seed=5, dtype="f64").items()}
    want = evaluate(prog.module, {k: v.copy() for k, v in arrays.items()}, dtype="f64")
    for _ in range(2):   # the second call starts warm
        got = prog(**{k: v.copy() for k, v in arrays.items()})
        for name, value in got.items():
            np.testing.assert_allclose(value, want[name], rtol=1e-9, atol=1e-11, err_msg=name)


@pytest.mark.slow
def test_one_thread_has_no_warm_test():
    prog = tgc.compile(GPT, dtype="f64", options=Options().with_(threads=1))
    assert "llvm.readcyclecounter" not in prog.llvm_ir


def test_a_unit_given_as_a_function_is_made_by_the_child_that_compiles_it(monkeypatch):
    _, low, opts = lowered(MLP, "f32")
    first, rest = codegen.generate_units_first_last(low, opts, units=2)
    assert len(rest) == 1
    calls = []

    def make():
        calls.append(os.getpid())
        return first()

    objs = llvm_env.emit_objects([make] + rest, 2, jobs=2)
    assert calls == []   # made in the child: the parent spends no time on it
    assert objs == llvm_env.emit_objects(codegen.generate_units(low, opts, units=2), 2, jobs=1)


def test_an_error_here_stops_and_reaps_the_children(monkeypatch):
    _, low, opts = lowered(MLP, "f32")
    texts = codegen.generate_units(low, opts, units=2)
    forked, fork_compile = [], llvm_env._fork_compile

    def recorded(*args):
        child = fork_compile(*args)
        forked.append(child[0])
        return child

    def collect_fails(pid, fd):
        raise RuntimeError("reading a child failed here")

    monkeypatch.setattr(llvm_env, "_fork_compile", recorded)
    monkeypatch.setattr(llvm_env, "_collect", collect_fails)
    with pytest.raises(RuntimeError, match="failed here"):
        llvm_env.emit_objects(texts, 2, jobs=2)
    assert len(forked) == 2
    for pid in forked:
        with pytest.raises(ChildProcessError):   # reaped: not even a zombie is left
            os.waitpid(pid, os.WNOHANG)


def test_a_child_compiles_while_another_thread_holds_the_flags_lock():
    """A thread of the parent holding llvm_env's option lock at the fork (it waits
    for llvmlite's lock, which the forking thread holds) must not hang the child."""
    import threading

    _, low, opts = lowered(MLP, "f32")
    texts = codegen.generate_units(low, opts, units=2)
    held, release = threading.Event(), threading.Event()

    def hold():
        with llvm_env._FLAGS_LOCK:
            held.set()
            release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    got = {}
    try:
        pid, fd, _ = llvm_env._fork_compile(texts[1], 1, 2, True)
        reader = threading.Thread(target=lambda: got.setdefault("obj", llvm_env._collect(pid, fd)))
        reader.start()
        reader.join(120)
        if reader.is_alive():   # hung: stop the child rather than the test run
            os.kill(pid, 9)
            reader.join()
            pytest.fail("the child hung on a lock another thread held at the fork")
    finally:
        release.set()
        t.join()
    assert got["obj"] == (llvm_env.emit_object(texts[1], 2), False)
