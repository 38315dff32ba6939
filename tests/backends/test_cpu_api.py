"""The Python API (`tgc.compile`, `Program`) and `tgc run --backend cpu`."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


import tgc
from tgc.ir.interp import EvalError, evaluate
from tgc.ir.diag import CompileError
from tgc.ir.parser import parse_module

from layer_programs import DEEP

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

MLP = """\
dim batch
dim features = 8, hidden = 16
input x[batch, features]
param W[features, hidden]
input lr
y = tanh(x @ W)
loss = sum(y * y)
out loss
out y
update W = W - lr * grad(loss, W)
"""


def test_compile_source_runs_forward_backward_and_update():
    prog = tgc.compile(MLP, dtype="f64")
    assert [(s.name, s.edges, s.dtype, s.updated) for s in prog.inputs] == [
        ("x", ("batch", "features"), "f64", False), ("W", ("features", "hidden"), "f64", True),
        ("lr", (), "f64", False)]
    assert [(s.name, s.edges) for s in prog.outputs] == [("loss", ()), ("y", ("batch", "hidden"))]
    rng = np.random.default_rng(0)
    for batch in (3, 40):  # one build, two batch sizes
        x, W = rng.standard_normal((batch, 8)), rng.standard_normal((8, 16))
        W0 = W.copy()
        got = prog(x=x, W=W, lr=0.01)
        y = np.tanh(x @ W0)
        np.testing.assert_allclose(got["y"], y, rtol=1e-12)
        np.testing.assert_allclose(got["loss"], np.sum(y * y), rtol=1e-12)
        grad = x.T @ (2 * y * (1 - y * y))
        np.testing.assert_allclose(W, W0 - 0.01 * grad, rtol=1e-10)
        assert got["W"] is W


def test_compile_file_ir_text_and_module(tmp_path: Path):
    path = tmp_path / "mlp.tg"
    path.write_text(MLP)
    a = tgc.compile(str(path), dtype="f32")
    b = tgc.compile(path, dtype="f32")
    module = parse_module("""
dim n
input x : f32[n]
%0 = map[exp] %x : f32[n]
out y = %0 : [n]
""")
    c = tgc.compile(module)
    assert a.outputs == b.outputs
    np.testing.assert_allclose(c(x=np.zeros(3, np.float32))["y"], np.ones(3))
    from tgc.ir.printer import print_module

    d = tgc.compile(print_module(module))
    assert d.outputs == c.outputs


def test_dims_fixed_at_build_time():
    prog = tgc.compile(MLP, dims={"batch": 4})
    assert prog.inputs[0].shape == (4, 8)
    with pytest.raises(EvalError, match="shape"):
        prog(x=np.zeros((5, 8), np.float32), W=np.zeros((8, 16), np.float32), lr=0.1)
    with pytest.raises(ValueError, match="no dim"):
        tgc.compile(MLP, dims={"nope": 4})


def test_the_options_dtype_and_dims_hold_unless_the_arguments_say_otherwise():
    """`compile(src, options=Options(dtype="f64", dims=...))` builds an f64 program with
    those dims (the `dtype` and `dims` arguments default to the options'); an explicit
    argument overrides them."""
    from tgc import Options

    opts = Options(dtype="f64", dims=(("batch", 4),))
    prog = tgc.compile(MLP, options=opts)
    assert prog.inputs[0].shape == (4, 8) and prog.inputs[0].dtype == "f64"
    out = prog(x=np.ones((4, 8)), W=np.ones((8, 16)), lr=0.1)
    assert out["y"].dtype == np.float64
    prog = tgc.compile(MLP, dtype="f32", dims={"batch": 3}, options=opts)
    assert prog.inputs[0].shape == (3, 8) and prog.inputs[0].dtype == "f32"


def test_ids_dtypes():
    prog = tgc.compile("""
dim b
dim v = 5
input ids : i32[b]
input E : f32[v]
%0 = gather[v] %E, %ids : f32[b]
out y = %0 : [b]
""")
    E = np.arange(5, dtype=np.float32)
    np.testing.assert_array_equal(prog(ids=np.array([4, 0], np.int64), E=E)["y"], [4, 0])
    with pytest.raises(EvalError, match="ids"):
        prog(ids=np.array([1.0]), E=E)
    with pytest.raises(EvalError, match="int32"):
        prog(ids=np.array([2**40]), E=E)


def test_readonly_update_target_refused_before_any_write():
    prog = tgc.compile("""
dim n = 3
param a : f32[n]
%0 = map[exp] %a : f32[n]
update a = %0
out y = %0 : [n]
""")
    a = np.zeros(3, np.float32)
    a.flags.writeable = False
    with pytest.raises(EvalError, match="read-only"):
        prog(a=a)
    with pytest.raises(EvalError, match="numpy array"):
        prog(a=[0.0, 0.0, 0.0])


def test_input_aliasing_an_update_target_reads_old_values():
    prog = tgc.compile("""
dim n = 4
param a : f64[n]
input b : f64[n]
%0 = add[1.0, 1.0] %a, %b : f64[n]
%1 = add[1.0, 1.0] %0, %b : f64[n]
update a = %0
out y = %1 : [n]
""", dtype="f64")
    a = np.ones(4)
    got = prog(a=a, b=a)  # b is the same array as a, which is updated
    np.testing.assert_array_equal(a, 2 * np.ones(4))
    np.testing.assert_array_equal(got["y"], 3 * np.ones(4))


def test_cli_run_backend_cpu_matches_interp(tmp_path: Path):
    path = tmp_path / "mlp.tg"
    path.write_text(MLP)
    outs = {}
    for backend in ("interp", "cpu"):
        out = tmp_path / f"{backend}.npz"
        subprocess.run([sys.executable, "-m", "tgc.cli", "run", str(path), "--random-inputs", "--dim", "batch=6",
                        "--dtype", "f64", "--backend", backend, "-o", str(out)], check=True,
                       cwd=Path(__file__).resolve().parents[2])
        with np.load(out) as f:
            outs[backend] = {k: f[k] for k in f.files}
    assert outs["cpu"].keys() == outs["interp"].keys()
    for k in outs["cpu"]:
        np.testing.assert_allclose(outs["cpu"][k], outs["interp"][k], rtol=1e-10)


def test_run_compiled_takes_dims_from_options():
    from tgc.options import Options
    from tgc.pipeline import run_compiled

    m = parse_module("""
dim n
input s : f64[]
%0 = size[n] : f64[]
%1 = add[1.0, 1.0] %0, %s : f64[]
%2 = contract %1 : f64[n]
out y = %2 : [n]
""")
    x = {"s": np.float64(0.5)}
    got = run_compiled(m, x, Options(dtype="f64", dims=(("n", 3),)))
    np.testing.assert_array_equal(got["y"], evaluate(m, x, dims={"n": 3})["y"])


# ---------------------------------------------------------------- the call's fast path
# (inputs already of the exact dtype and C-contiguous skip conversion; shapes are bound
# once per combination; every check still runs before anything is written)

UPD = """
dim n
param a : f64[n]
input b : f64[n]
%0 = add[1.0, 1.0] %a, %b : f64[n]
%1 = add[1.0, 1.0] %0, %b : f64[n]
update a = %0
out y = %1 : [n]
"""


def test_fast_path_partial_overlap_with_update_target_reads_old_values():
    prog = tgc.compile(UPD, dtype="f64")
    buf = np.arange(6, dtype=np.float64)
    a, b = buf[0:4], buf[2:6]          # overlapping views, both contiguous and f64
    old_b = b.copy()
    got = prog(a=a, b=b)
    np.testing.assert_array_equal(got["y"], np.arange(4) + 2 * old_b)
    assert got["a"] is a
    # disjoint views of one buffer: no copy needed, same results as fresh arrays
    buf = np.arange(8, dtype=np.float64)
    a, b = buf[0:4], buf[4:8]
    got = prog(a=a, b=b)
    np.testing.assert_array_equal(got["y"], np.arange(4) + 2 * np.arange(4, 8))
    np.testing.assert_array_equal(buf[0:4], np.arange(4) + np.arange(4, 8))


def test_fast_path_shapes_checked_for_every_combination():
    prog = tgc.compile(UPD, dtype="f64")
    for n in (3, 5, 3):
        prog(a=np.zeros(n), b=np.ones(n))
    a = np.zeros(3)
    with pytest.raises(EvalError, match="size"):
        prog(a=a, b=np.ones(4))
    with pytest.raises(EvalError, match="axes"):
        prog(a=a, b=np.ones((3, 1)))
    np.testing.assert_array_equal(a, np.zeros(3))       # nothing written
    for n in range(1, 80):                                # more shapes than the plans kept
        got = prog(a=np.zeros(n), b=np.ones(n))
        np.testing.assert_array_equal(got["y"], 2 * np.ones(n))


def test_fast_path_outputs_fresh_and_conversions_agree():
    prog = tgc.compile(UPD, dtype="f64")
    y1 = prog(a=np.zeros(4), b=np.ones(4))["y"]
    y2 = prog(a=np.zeros(4), b=np.full(4, 2.0))["y"]
    assert y1 is not y2 and not np.shares_memory(y1, y2)
    np.testing.assert_array_equal(y1, 2 * np.ones(4))
    # cast (f32 -> f64) and strided inputs take the checked path: same results
    a1, a = np.zeros(4), np.zeros(4)
    b = np.ones(8)[::2]
    np.testing.assert_array_equal(prog(a=a1, b=b)["y"], prog(a=a, b=np.ones(4))["y"])
    np.testing.assert_array_equal(prog(a=a1, b=np.ones(4, np.float32))["y"], prog(a=a, b=np.ones(4))["y"])
    np.testing.assert_array_equal(a1, a)


def test_fast_path_ids_out_of_range_write_nothing():
    prog = tgc.compile("""
dim b
dim v = 5
input ids : i32[b]
param E : f32[v]
%0 = gather[v] %E, %ids : f32[b]
%1 = add[1.0, 1.0] %E, %E : f32[v]
update E = %1
out y = %0 : [b]
""")
    E = np.arange(5, dtype=np.float32)
    with pytest.raises(EvalError, match="out of range"):
        prog(ids=np.array([1, 5], np.int32), E=E)
    np.testing.assert_array_equal(E, np.arange(5))
    got = prog(ids=np.array([4, 0], np.int32), E=E)
    np.testing.assert_array_equal(got["y"], [4, 0])
    np.testing.assert_array_equal(E, 2 * np.arange(5))


def test_objects_entry_and_pointer_entry_agree():
    from tgc.backends.cpu import kernels as P

    prog = tgc.compile(UPD, dtype="f64")
    if P._LAYOUT is None:
        pytest.skip("this numpy's array layout is not the one the native argument checks know")
    assert prog._kernels._run_objects is not None
    assert "tgc_run_objects" not in tgc.compile(UPD, dtype="f64").llvm_ir   # AOT/IR text: tgc_run only
    rng = np.random.default_rng(1)
    results = []
    for entry in (prog._kernels._run_objects, None):
        prog._kernels._run_objects, prog._fast = entry, entry is not None
        a, b = rng.standard_normal(6), rng.standard_normal(6)
        a0 = a.copy()
        y = prog(a=a, b=b)["y"]
        results.append((y, a, a0, b))
    for y, a, a0, b in results:
        np.testing.assert_array_equal(a, a0 + b)
        np.testing.assert_array_equal(y, (a0 + b) + b)


def test_the_native_checks_take_the_fast_path_and_refuse_what_they_must():
    """After one checked call per shape, calls go straight to native code; anything
    it refuses (view, other dtype, read-only target, other shape, aliasing) takes the
    checked path, which converts, copies or explains, before anything is written."""
    from tgc.backends.cpu import kernels as P

    if P._LAYOUT is None:
        pytest.skip("this numpy's array layout is not the one the native argument checks know")
    prog = tgc.compile(UPD, dtype="f64")
    checked = []
    inner = prog._run_checked
    prog._run_checked = lambda *a, **k: checked.append(1) or inner(*a, **k)
    a, b = np.arange(6.0), np.ones(6)
    prog(a=a, b=b)
    prog(a=a, b=b)
    assert len(checked) == 1
    np.testing.assert_array_equal(a, np.arange(6.0) + 2)
    # a strided view, a float32 array: converted by the checked path, same numbers
    wide = np.ones(12)
    y = prog(a=a, b=wide[::2])["y"]
    assert len(checked) == 2
    np.testing.assert_array_equal(y, np.arange(6.0) + 4)
    y = prog(a=a, b=np.ones(6, np.float32))["y"]
    np.testing.assert_array_equal(y, np.arange(6.0) + 5)
    # the update target read-only: refused with a message, nothing written
    ro = np.arange(6.0)
    ro.flags.writeable = False
    with pytest.raises(EvalError, match="read-only"):
        prog(a=ro, b=b)
    # b is a's own memory: read with the old values
    a = np.arange(6.0)
    y = prog(a=a, b=a)["y"]
    np.testing.assert_array_equal(a, 2 * np.arange(6.0))
    np.testing.assert_array_equal(y, 3 * np.arange(6.0))
    # another length: a new plan, then the fast path again
    n = len(checked)
    prog(a=np.zeros(3), b=np.ones(3))
    prog(a=np.zeros(3), b=np.ones(3))
    assert len(checked) == n + 1


def test_the_objects_entry_does_not_grow_with_the_number_of_arguments():
    """Its checks loop over a table: unrolled per argument, a 40-parameter GPT step
    took LLVM 40 s to optimize."""
    import re

    from tgc.backends.cpu import codegen

    def entry_lines(n: int) -> int:
        params = "\n".join(f"param p{i} : f32[n]" for i in range(n))
        updates = "\n".join(f"%u{i} = add[1.0, 1.0] %p{i}, %x : f32[n]\nupdate p{i} = %u{i}" for i in range(n))
        prog = tgc.compile(f"dim n\ninput x : f32[n]\n{params}\n{updates}\n")
        text = codegen.generate(prog.lowered, prog.options, objects_entry=True)
        body = re.search(r'define i32 @"?tgc_run_objects"?.*?\n}', text, re.S).group(0)
        return body.count("\n")

    assert entry_lines(30) == entry_lines(3)


def test_a_python_scalar_or_list_for_an_array_takes_the_checked_path():
    """The native checks read an argument's array fields only once its type is ndarray."""
    prog = tgc.compile(UPD, dtype="f64")
    a = np.zeros(3)
    prog(a=a, b=np.ones(3))  # a plan for n = 3
    y = prog(a=a, b=[1.0, 2.0, 3.0])["y"]
    np.testing.assert_array_equal(y, [3.0, 5.0, 7.0])  # a was 1 after the first call
    with pytest.raises(EvalError):
        prog(a=a, b=2.5)


BIG = "dim n\ninput x[n]\nout y[n] = x * 2\nout z[n] = x + 1\n"


def test_large_outputs_are_recycled_only_once_dropped():
    prog = tgc.compile(BIG)
    n = 1 << 18                                         # 1 MiB per output
    xs = [np.full(n, float(i), np.float32) for i in range(4)]
    held = [prog(x=xs[0]), prog(x=xs[1])]
    view = prog(x=xs[2])["y"][5:9]                      # a view keeps its result's array
    for i in range(6):
        prog(x=xs[3])
    for i, r in enumerate(held):
        np.testing.assert_array_equal(r["y"], 2.0 * i)
        np.testing.assert_array_equal(r["z"], i + 1.0)
    np.testing.assert_array_equal(view, 4.0)
    first, second = prog(x=xs[0]), prog(x=xs[1])     # the two results the program keeps
    address = first["y"].ctypes.data
    del first
    again = prog(x=xs[2])                               # the dropped one's memory is used again
    assert again["y"].ctypes.data == address
    np.testing.assert_array_equal(again["y"], 4.0)
    np.testing.assert_array_equal(again["z"], 3.0)
    np.testing.assert_array_equal(second["y"], 2.0)


def test_small_outputs_are_new_every_call():
    prog = tgc.compile(BIG)
    x = np.ones(16, np.float32)
    a = prog(x=x)["y"]
    b = prog(x=x)["y"]
    assert a is not b and not np.shares_memory(a, b)


def test_profile_counts_cycles_per_kernel():
    from tgc.options import Options

    prog = tgc.compile(MLP, dtype="f64", options=Options().with_(profile=True))
    x, W = np.ones((4, 8)), np.full((8, 16), 0.1)
    for _ in range(3):
        prog(x=x, W=W.copy(), lr=0.1)
    prof = prog.profile(reset=True)
    assert len(prof) == len(prog.lowered.kernels)
    assert [c for c, _, _ in prof] == sorted((c for c, _, _ in prof), reverse=True)
    assert prof[0][0] > 0 and all(text for _, _, text in prof)
    assert all(c == 0 for c, _, _ in prog.profile())          # reset
    with pytest.raises(ValueError, match="profile=True"):
        tgc.compile(MLP, dtype="f64").profile()


def test_profile_counts_the_kernels_of_a_loops_step():
    """A loop's kernel counts its whole loop; `step_profile` has a counter per kernel
    of its step (forward and reverse loop), each summed over the steps."""
    from tgc.backends.cpu.codegen import step_profile_kernels
    from tgc.options import Options

    prog = tgc.compile(DEEP, dtype="f64", options=Options().with_(profile=True))
    x, w = np.ones((4, 8)), np.full((3, 8, 8), 0.1)
    prog(x=x, w=w.copy(), lr=0.1)
    rows = prog.step_profile()
    assert len(rows) == len(step_profile_kernels(prog.lowered)) > 2
    assert any("gemm" in text for _, text in rows)
    assert all(c > 0 for c, _ in rows)
    loops = sum(c for c, _, text in prog.profile() if text.startswith("steps"))
    assert sum(c for c, _ in rows) <= loops
    prog.profile(reset=True)
    assert all(c == 0 for c, _ in prog.step_profile())
    with pytest.raises(ValueError, match="profile=True"):
        tgc.compile(DEEP, dtype="f64").step_profile()


def test_region_calls_count_the_gemm_calls_that_ran_in_a_region():
    """`region_calls` counts, per profile counter, a GEMM's calls that ran in a
    parallel region of their own: every call of a product over the threshold on two
    threads without the contention rule's hold, none on one thread, none for a loop."""
    from tgc.backends.cpu.llvm_env import usable_cores
    from tgc.options import Options

    src = """
dim m, k, n
input x: f32[m, k], w: f32[k, n]
y = relu(x @ w)
out y
"""
    x = np.ones((256, 256), np.float32)
    w = np.full((256, 256), 0.5, np.float32)
    counts = {}
    for threads in (1, 2):
        cpu = Options().cpu.with_(profile=True, threads=threads, contention_memory_cycles=0)
        prog = tgc.compile(src, options=Options().with_(cpu=cpu))
        for _ in range(3):
            np.testing.assert_array_equal(prog(x=x, w=w)["y"], 128.0)
        kinds = ["gemm" if k.text().startswith("gemm") else "loop" for k in prog.lowered.kernels]
        calls = prog.region_calls()
        assert len(calls) == len(kinds) and "gemm" in kinds
        assert all(c == 0 for c, kind in zip(calls, kinds) if kind == "loop")
        counts[threads] = sum(calls)
        prog.profile(reset=True)
        assert prog.region_calls() == [0] * len(kinds)
    assert counts[1] == 0
    if usable_cores() >= 2:
        assert counts[2] == 3
    with pytest.raises(ValueError, match="profile=True"):
        tgc.compile(src).region_calls()


def test_thread_profile_splits_a_kernels_cpu_time_among_the_threads():
    """`thread_profile` gives, per profile counter, in ns of CPU time: thread 0's over
    the kernel, thread 0's and the other threads' busy time, and thread 0's in the
    kernel's regions. On one thread, thread 0 was busy all through and no region ran;
    on two, a product in a region of its own keeps both threads busy, thread 0 for
    less than its time over the kernel (planning the tiles, starting the team), and a
    kernel that ran no region keeps the other threads idle. The product's busy times
    sum to about its CPU time on one thread (no timing is asserted beyond a factor 3:
    another process's load can still slow a thread's share, through the caches)."""
    from tgc.backends.cpu.llvm_env import usable_cores
    from tgc.options import Options

    src = """
dim m, k, n
input x: f32[m, k], w: f32[k, n]
y = relu(x @ w)
out y
"""
    x = np.ones((512, 512), np.float32)
    w = np.full((512, 512), 0.5, np.float32)
    alone = None
    for threads in (1, 2):
        cpu = Options().cpu.with_(profile=True, threads=threads, contention_memory_cycles=0, merge_regions=False)
        prog = tgc.compile(src, options=Options().with_(cpu=cpu))
        prog(x=x, w=w)
        prog.profile(reset=True)
        for _ in range(3):
            np.testing.assert_array_equal(prog(x=x, w=w)["y"], 256.0)
        rows = prog.thread_profile()
        calls = prog.region_calls()
        assert len(rows) == len(prog.lowered.kernels) == len(calls)
        gemm = next(i for i, k in enumerate(prog.lowered.kernels) if k.text().startswith("gemm"))
        for i, (cpu0, own, rest, region) in enumerate(rows):
            assert cpu0 > 0 and 0 <= region <= cpu0 and 0 < own <= cpu0 and rest >= 0
            if threads == 1 or region == 0:
                assert own == cpu0 and rest == 0
        if threads == 1:
            alone = rows[gemm][0]
        elif usable_cores() >= 2:
            cpu0, own, rest, region = rows[gemm]
            assert calls[gemm] == 3 and region > 0 and 0 < own < cpu0 and rest > 0
            assert alone / 3 < own + rest < 3 * alone
        prog.profile(reset=True)
        assert all(r == (0, 0, 0, 0) for r in prog.thread_profile())
    with pytest.raises(ValueError, match="profile=True"):
        tgc.compile(src).thread_profile()


def test_recycled_outputs_are_safe_across_threads():
    """Calls from several threads: no call's outputs are handed to another call."""
    import threading

    prog = tgc.compile(BIG)
    n = 1 << 18
    bad = []

    def work(i):
        x = np.full(n, float(i), np.float32)
        for _ in range(40):
            r = prog(x=x)
            if not (np.all(r["y"] == 2.0 * i) and np.all(r["z"] == i + 1.0)):
                bad.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # switch threads as often as possible
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not bad


@pytest.mark.slow
def test_cli_run_profile_lists_kernels_and_keeps_the_results(tmp_path: Path):
    path = tmp_path / "mlp.tg"
    path.write_text(MLP)
    cmd = [sys.executable, "-m", "tgc.cli", "run", str(path), "--random-inputs", "--dim", "batch=6", "--dtype", "f64"]
    root = Path(__file__).resolve().parents[2]
    plain = subprocess.run(cmd + ["--backend", "cpu"], capture_output=True, text=True, cwd=root)
    done = subprocess.run(cmd + ["--backend", "cpu", "--profile", "3"], capture_output=True, text=True, cwd=root)
    assert done.returncode == 0, done.stderr
    assert done.stdout == plain.stdout            # the printed results are those of the first call
    lines = done.stderr.splitlines()
    assert lines[0].startswith("# 3 calls,")
    shares = [float(line.split("%")[0]) for line in lines[1:]]
    assert shares and abs(sum(shares) - 100) < 0.1 and shares == sorted(shares, reverse=True)
    assert all(re.search(r"k\d+: (gemm|loop|group)", line) for line in lines[1:])
    refused = subprocess.run(cmd + ["--backend", "interp", "--profile", "3"], capture_output=True, text=True, cwd=root)
    assert refused.returncode == 2 and "--profile needs --backend cpu" in refused.stderr



EMPTY_BATCH = """
dim b
dim d = 3
input x[b, d]
out me = mean(x)
out g = grad(mean[b](sum[d](tanh(x))), x)
"""


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_a_dim_bound_to_zero_is_refused_before_anything_runs(dtype, tmp_path: Path):
    """The optimizer's algebra assumes no edge is empty (a mean's gradient has 1/size;
    a probe found 0 * (1/0) = NaN where the unoptimized program gave 0), so a dim bound
    to 0 at call time is a clear error on both backends, and `--dim b=0` a usage error."""
    prog = tgc.compile(EMPTY_BATCH, dtype=dtype)
    x = np.zeros((0, 3), dtype=np.float32 if dtype == "f32" else np.float64)
    for run in (lambda: prog(x=x), lambda: prog(x=x), lambda: evaluate(prog.module, {"x": x}, dtype=dtype)):
        with pytest.raises(EvalError, match="dim 'b' is 0: sizes must be positive"):
            run()
    src = tmp_path / "empty.tg"
    src.write_text(EMPTY_BATCH)
    np.savez(tmp_path / "in.npz", x=x)
    for backend in ("interp", "cpu"):
        r = subprocess.run([sys.executable, "-m", "tgc.cli", "run", str(src), "--inputs", str(tmp_path / "in.npz"),
                            "--backend", backend], capture_output=True, text=True)
        assert r.returncode == 3 and "sizes must be positive" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "tgc.cli", "run", str(src), "--random-inputs", "--dim", "b=0"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "must be positive" in r.stderr, r.stderr


def test_update_targets_sharing_memory_are_refused_before_any_write():
    """Found by a probe: one array (or overlapping views) passed as two update targets
    was accepted and the two in-place writes mixed."""
    prog = tgc.compile("dim n = 4\nparam a[n], b[n]\nout s = sum(a * b)\nupdate a = a + b\nupdate b = a - b\n")
    z = np.arange(4, dtype=np.float32)
    buf = np.arange(6, dtype=np.float32)
    wide = np.arange(8, dtype=np.float32)   # a strided view: copied, each copy written back
    for _ in range(2):   # the checked path, then the fast path's refusal falls back to it
        for a, b in ((z, z), (buf[0:4], buf[2:6]), (wide[::2],) * 2):
            with pytest.raises(EvalError, match="update targets 'a' and 'b' share memory"):
                prog(a=a, b=b)
        assert np.array_equal(z, np.arange(4)) and np.array_equal(buf, np.arange(6))
        assert np.array_equal(wide, np.arange(8))
        prog(a=np.ones(4, np.float32), b=np.ones(4, np.float32))


def test_bad_dims_dtypes_and_values_are_clear_errors():
    for bad in (0, -3, 2.7, "4", True):
        with pytest.raises(ValueError, match="a size is a positive integer"):
            tgc.compile(str(EXAMPLES / "mlp.tg"), dims={"batch": bad})
    with pytest.raises(ValueError, match="'f32' or 'f64'"):
        tgc.compile(str(EXAMPLES / "mlp.tg"), dtype="i32")
    with pytest.raises(TypeError, match="not bytes"):
        tgc.compile(b"dim n = 2\n")
    prog = tgc.compile("dim n = 2\ninput x[n], lr\nout y = x * lr\n")
    with pytest.raises(EvalError, match="input 'x' is not an array of numbers"):
        prog(x=[[1, 2], [3]], lr=1.0)
    with pytest.raises(EvalError, match="input 'lr' is not an array of numbers"):
        prog(x=np.ones(2), lr=10**400)
    with pytest.raises(EvalError, match="no dim 'nope'"):
        prog.run({"x": np.ones(2), "lr": 1.0}, dims={"nope": 3})
    with pytest.raises(EvalError, match="dim 'n' is 2, not a symbolic dim to bind to 3"):
        prog.run({"x": np.ones(2), "lr": 1.0}, dims={"n": 3})
    prog.run({"x": np.ones(2), "lr": 1.0}, dims={"n": 2})   # the same size: nothing to refuse
    derived = tgc.compile("dim d\ndim h = d / 2\ninput x[d]\nout y = sum(x) * size(h)\n")
    with pytest.raises(EvalError, match="dim 'h' is d / 2, not a symbolic dim"):
        derived.run({"x": np.ones(4)}, dims={"h": 2})


def test_compile_arguments_of_the_wrong_kind_are_clear_type_errors():
    """A source, options or dims of the wrong kind is a TypeError that names the
    argument (were: 'expected string or bytes-like object', a dict's AttributeError)."""
    mlp = str(EXAMPLES / "mlp.tg")
    for source in (42, None, [mlp]):
        with pytest.raises(TypeError, match="^source: a path"):
            tgc.compile(source)
    with pytest.raises(TypeError, match="options= takes a tgc.options.Options, not dict"):
        tgc.compile(mlp, options={"dtype": "f64"})
    with pytest.raises(TypeError, match="dims= takes a dict"):
        tgc.compile(mlp, dims=[("batch", 4)])



def test_an_existing_path_is_read_whatever_its_suffix(tmp_path):
    """A string naming an existing file or folder is a path (a directory was parsed as
    program text: 'unexpected token /'); .tg and .tgir name paths even when missing."""
    src = tmp_path / "mlp.txt"
    src.write_text((EXAMPLES / "mlp.tg").read_text())
    assert [s.name for s in tgc.compile(str(src)).inputs] == \
        [s.name for s in tgc.compile(str(EXAMPLES / "mlp.tg")).inputs]
    with pytest.raises(CompileError, match="is a directory, not a source file"):
        tgc.compile(str(tmp_path))


def test_init_state_checks_the_sizes_it_is_given():
    """`init_state(dims=...)` refuses a size as `compile(dims=...)` does (a negative one
    was numpy's 'negative dimensions are not allowed')."""
    prog = tgc.compile("dim n\ninput x[n]\nstate m[n]\nupdate m = m + x\nout y = sum(x)\n")
    assert prog.init_state(dims={"n": 3})["m"].shape == (3,)
    for bad in (0, -1, 2.5, "3", True):
        with pytest.raises(ValueError, match="init_state: dim 'n' = .*: a size is a positive integer"):
            prog.init_state(dims={"n": bad})
    with pytest.raises(TypeError, match="dims= takes a dict"):
        prog.init_state(dims=[("n", 3)])


def test_a_python_number_for_a_scalar_input_takes_the_fast_path():
    """A learning rate passed as a Python float (or int, or numpy scalar, or 0-d array
    of another float type: torch's autograd wrapper passes float64 ones) is made a
    0-d array of the program's float type, so a training loop's calls stay on the
    native fast path; the values are those of a 0-d array."""
    from tgc.backends.cpu import kernels as P

    if P._LAYOUT is None:
        pytest.skip("this numpy's array layout is not the one the native argument checks know")
    src = "dim n = 4\ninput x[n], lr\nparam w[n]\nout y = sum[n](w * x)\nupdate w = w - lr * x\n"
    prog = tgc.compile(src)
    checked = []
    inner = prog._run_checked
    prog._run_checked = lambda *a, **k: checked.append(1) or inner(*a, **k)
    x = np.arange(4, dtype=np.float32)
    w = np.zeros(4, np.float32)
    prog(x=x, lr=np.array(0.5, np.float32), w=w)
    for lr in (0.5, 1, np.float32(0.25), np.float64(0.125), np.array(0.0625), np.array(2.0, np.float16)):
        before = w.copy()
        y = prog(x=x, lr=lr, w=w)["y"]
        assert y == np.float32(np.dot(before, x))
        np.testing.assert_array_equal(w, before - np.float32(lr) * x)
    assert len(checked) == 1
