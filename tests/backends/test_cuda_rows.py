"""The CUDA backends' row groups (`tgc/backends/cuda/rows.py` and codegen's row-group
kernels): a softmax, log_softmax, logsumexp or layernorm row, forward and backward,
runs as one kernel, a warp or a block per row, with the row in registers where it
fits. Each program runs on cuda-sim against the reference interpreter at row
lengths 1, 31, 33, 300 and 1000 (rows longer than the emulator's block of 64
threads and than its registers hold), through both variants (a warp per row, a
block per row) and both paths (registers, memory); NaN and infinite entries
propagate as the interpreter's do; and the groups make fewer kernels."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc.backends.cuda import codegen
from tgc.backends.cuda.rows import RowGroup
from tgc.backends.cuda.runtime import lower
from tgc.ir.inputs import random_inputs
from tgc.ir.interp import evaluate
from tgc.lower.interp import run_lowered
from tgc.lower.lowered import print_lowered
from tgc.lower.text import parse_lowered
from tgc.options import Options

from marks import sized_by_themselves
from layer_programs import LAYERNORM

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="cuda-sim needs g++ with OpenMP")

SOFTMAX = """
dim rows, d
input x[rows, d]
input dy[rows, d]
y = softmax[d](x)
out y
out dx = grad(sum(y * dy), x)
"""

LOG_SOFTMAX = """
dim rows, d
input x[rows, d]
input dy[rows, d]
y = log_softmax[d](x)
out y
out l = logsumexp[d](x)
out dx = grad(sum(y * dy), x)
"""


# a row of a 3-d tensor (two outer loops) with a causal mask: rows of -inf entries
CAUSAL = """
dim b, t
dim s = t
input x[b, t, s]
out y[b, t, s] = softmax[s](where([s <= t], x, -inf))
"""

TOL = {"f64": (1e-11, 1e-12), "f32": (3e-5, 3e-6)}
LENGTHS = (1, 31, 33, 300, 1000)


def build(source: str, dtype: str, **opts):
    return tgc.compile(source, backend="cuda-sim", dtype=dtype, options=Options().with_(**opts))


def compare(prog, dims: dict, dtype: str, seed: int = 0, poke=None) -> None:
    m = prog.module
    x = random_inputs(m, m.bind_dims(dims), seed, dtype)
    if poke:
        poke(x)
    want = evaluate(m, {k: np.copy(v) for k, v in x.items()}, dtype=dtype)
    got = prog(**{k: np.copy(v) for k, v in x.items()})
    rtol, atol = TOL[dtype]
    for name, w in want.items():
        finite = w[np.isfinite(w)]
        scale = max(1.0, float(np.max(np.abs(finite)))) if finite.size else 1.0
        np.testing.assert_allclose(got[name], w, rtol=rtol, atol=atol * scale, err_msg=f"{name} at {dims}")


def row_groups(prog) -> list[RowGroup]:
    return [k for k in prog.lowered.kernels if isinstance(k, RowGroup)]


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("source", [SOFTMAX, LOG_SOFTMAX, LAYERNORM], ids=["softmax", "log_softmax", "layernorm"])
def test_row_groups_match_the_interpreter(source, dtype):
    prog = build(source, dtype)
    assert len(row_groups(prog)) == 1
    for d in LENGTHS:
        for rows in (1, 5):
            compare(prog, {"rows": rows, "d": d}, dtype, seed=d + rows)


@pytest.mark.parametrize("warp_rows", [0, 10 ** 6], ids=["block", "warp"])
@pytest.mark.parametrize("row_regs", [1, 8])
def test_both_variants_and_both_paths(warp_rows, row_regs):
    """warp_rows 0: every row a block's; 10**6: every row a warp's (rows of 1000 then
    read memory again); row_regs 1: only rows up to the threads' count in registers."""
    prog = build(LAYERNORM, "f32", warp_rows=warp_rows, row_regs=row_regs)
    for d in (1, 33, 100, 1000):
        compare(prog, {"rows": 3, "d": d}, "f32", seed=d)
    prog = build(SOFTMAX, "f64", warp_rows=warp_rows, row_regs=row_regs)
    for d in (31, 200):
        compare(prog, {"rows": 9, "d": d}, "f64", seed=d)


def test_nan_and_infinities_propagate_as_in_the_interpreter():
    def poke(x):
        x["x"][0, 3] = np.nan            # a NaN row: all NaN
        x["x"][1, :] = -np.inf           # a row of -inf: NaN (0/0), as numpy's
        x["x"][2, 5] = np.inf            # +inf: NaN where inf - inf
        x["x"][3, 7] = 1e30              # large but finite: stable
    for dtype in ("f32", "f64"):
        for source in (SOFTMAX, LOG_SOFTMAX):
            prog = build(source, dtype)
            for d in (40, 600):
                compare(prog, {"rows": 6, "d": d}, dtype, seed=d, poke=poke)


def test_masked_rows_over_two_outer_loops():
    prog = build(CAUSAL, "f32")
    (g,) = row_groups(prog)
    assert g.outer == ("b", "t")
    for t in (1, 7, 40):
        compare(prog, {"b": 2, "t": t}, "f32", seed=t)


def test_a_row_group_is_one_kernel_with_its_statistics_in_registers():
    on, off = build(SOFTMAX, "f32"), build(SOFTMAX, "f32", row_groups=False)
    kinds = [x.kind for x in on.cuda_module.launches]
    assert kinds == ["rows"]                                   # max, logsumexp, exp, sum, dx: one kernel
    assert len([x for x in off.cuda_module.launches if x.kind != "gemm"]) == 5
    (g,) = row_groups(on)
    assert len(g.members) == 5 and len(g.regs) == 3            # max, logsumexp, sum(y * dy) per row: registers
    assert not [b for b in on.lowered.buffers.values() if b.kind == "temp"]
    ln_on, ln_off = build(LAYERNORM, "f32", row_columns=True), build(LAYERNORM, "f32", row_groups=False)
    n_on = len(ln_on.cuda_module.launches)
    n_off = len(ln_off.cuda_module.launches)
    assert n_on == 2 and n_off == 9     # the row group (dw and db summed in it), then their slots' partials added
    # the row is read once: the register path loads x and dy at the row's start, and
    # stores only what another kernel reads (y, dx)
    src = ln_on.cuda_source
    assert "tgc_row_reduce" in src and "__shfl_xor_sync" in src
    assert len(re.findall(r"c_\d+\[k\] = p\d+\[", src)) == 4          # x, dy, w, b: loaded once per row
    # y and dx are stored; nothing else is (the centred x dw reads is in registers)
    (body,) = [p for p in src.split("static __device__") if "_body(" in p and "TGC_SIM_COUNT(1)" in p]
    cached = body.split("TGC_SIM_COUNT(1)")[1].split("TGC_SIM_COUNT(2)")[0]
    assert len(re.findall(r"reinterpret_cast<float4\*>\(&p\d+\[", cached)) == 2         # float4 stores
    assert len(re.findall(r"\bp\d+\[[^\]]*\] = [oc]_\d+\[k\];", cached)) == 2       # (or one at a time)
    assert not re.findall(r"\bp\d+\[[^\]]*\] = val;", cached)
    # the path through memory steps a 32-bit index over the row where its length allows
    memory = body.split("TGC_SIM_COUNT(2)")[1]
    narrow, wide = memory.count("for (int q = (int)lane; q < (int)c; q += (int)tpr)"), memory.count("for (long long q")
    assert narrow == wide > 0 and "int rq = q;" in memory


def test_lowered_text_and_the_lowered_interpreter():
    """The stage's output reads back from its text and verifies; the lowered
    interpreter runs it (the oracle sees the group as one kernel with registers)."""
    for source in (SOFTMAX, LAYERNORM, CAUSAL):
        options = Options()
        module = tgc.compile(source, backend="cpu").module
        low = lower(module, options)
        text = print_lowered(low)
        assert "rowgroup for" in text
        assert print_lowered(parse_lowered(text)) == text
        dims = {"rows": 4, "d": 9} if "rows" in module.dims else {"b": 2, "t": 5}
        module64 = tgc.compile(source, backend="cpu", dtype="f64").module   # f64 values (an f32 module's
        x = random_inputs(module64, module64.bind_dims(dims), 3, "f64")     # are f32 at any width)
        want = evaluate(module64, x, dtype="f64")
        low64 = lower(module64, options.with_(dtype="f64"))
        got = run_lowered(low64, x)
        for k, w in want.items():
            np.testing.assert_allclose(got[k], w, rtol=1e-12, atol=1e-12)
    options = Options().with_(row_groups=False)
    assert "rowgroup" not in print_lowered(lower(tgc.compile(SOFTMAX, backend="cpu").module, options))


def test_manifest_names_both_variants():
    import json

    from tgc.backends.cuda import aot

    module = tgc.compile(SOFTMAX, backend="cpu").module
    _, doc = aot.build(lower(module, Options()), Options(), "cu")
    (x,) = json.loads(doc)["launches"]
    assert x["kind"] == "rows" and x["kernel"] == "k0" and x["warp_kernel"] == "k0_warp"
    assert x["items"] == "(rows)" and x["row_length"] == "(d)" and set(x["writes"]) == {"y", "dx"}
    assert codegen.generate(lower(module, Options())).kernel_names() == ["k0", "k0_warp"]


ROOT = Path(__file__).resolve().parents[2]
ALL = sorted(str(p.relative_to(ROOT)) for p in
             list(sized_by_themselves((ROOT / "examples").glob("*.tg"))) + list((ROOT / "benchmarks" / "workloads").glob("*.tg")))


@pytest.mark.parametrize("path", ALL)
def test_every_program_reads_back_and_runs_in_the_lowered_interpreter_after_rowgroup(path):
    """After the stage (and after plan), every example and workload prints as text that
    reads back to the same program, and the lowered interpreter runs it as the IR
    interpreter runs the module (f64, small dims)."""
    import dataclasses

    from tgc import pipeline
    from tgc.ir.printer import print_module

    options = Options(dtype="f64")
    module = pipeline.lower(pipeline.load(str(ROOT / path), options), options).module
    for stop in ("rowgroup", "plan"):
        low = pipeline.lower_module(module, options, backend="cuda-sim", stop_after=stop)
        text = print_lowered(low)
        back = parse_lowered(text, path)
        diff = [f.name for f in dataclasses.fields(low) if f.name != "module" and getattr(low, f.name) != getattr(back, f.name)]
        assert diff == [] and print_module(back.module) == print_module(low.module), stop
        assert print_lowered(back) == text
    dims = {d: 3 for d in module.symbolic_dims()}
    inputs = random_inputs(module, module.bind_dims(dims), 0, "f64")
    want = evaluate(module, {k: np.copy(v) for k, v in inputs.items()}, dtype="f64", dims=dims)
    got = run_lowered(low, {k: np.copy(v) for k, v in inputs.items()}, dims)
    for k, w in want.items():
        np.testing.assert_allclose(got[k], w, rtol=1e-9, atol=1e-9 * max(1.0, float(np.nanmax(np.abs(w)))), err_msg=k)


def test_rows_in_registers_load_float4_where_sizes_and_addresses_allow():
    """A row of an f32 layernorm held in registers is read one float4 per group of 4
    neighbours when its length is a multiple of 4 and its inputs are 16-byte aligned
    (the emulator's counter 5), else element by element into the same registers: the
    same bits either way. Its outputs (y, dx) are stored one float4 per group of 4
    under the same condition on the length and the output's address (counter 8)."""
    import ctypes

    prog = build(LAYERNORM, "f32")
    fn = prog._kernels._device.lib.tgc_sim_counters
    fn.restype = ctypes.POINTER(ctypes.c_longlong)
    count = fn()
    assert "reinterpret_cast<const float4*>" in prog.cuda_source.split("_body(")[1]
    for d, want_vec in ((40, True), (33, False), (4, True)):
        count[5] = count[8] = 0
        compare(prog, {"rows": 5, "d": d}, "f32", seed=d)
        assert (count[5] > 0) == want_vec and (count[8] > 0) == want_vec, d   # float4 loads, float4 stores
    rng = np.random.default_rng(1)
    big = rng.standard_normal(5 * 40 + 1).astype(np.float32)
    x = dict(x=big[:-1].copy().reshape(5, 40), dy=rng.standard_normal((5, 40)).astype(np.float32),
             w=rng.standard_normal(40).astype(np.float32), b=rng.standard_normal(40).astype(np.float32))
    count[5] = 0
    aligned = prog(**{k: np.copy(v) for k, v in x.items()})
    assert count[5] > 0
    shifted = big[1:].reshape(5, 40)     # 4 bytes into its memory: element by element
    shifted[...] = x["x"]
    count[5] = 0
    other = prog(**dict(x, x=shifted))
    assert count[5] == 0
    for k in aligned:
        assert aligned[k].tobytes() == other[k].tobytes(), k


def test_the_block_of_a_row_follows_its_length(monkeypatch):
    """A block-per-row launch takes `CudaOptions.row_block(length)` threads: 64 for a
    row of 300, 128 for 1024, 256 from 1025 on; under cuda-sim at most its 64, so a
    `row_block_max` of 32 (one warp per block) shows the launch follows it."""
    from tgc.backends.cuda import runtime
    from tgc.backends.cuda.options import CudaOptions

    rule = CudaOptions()
    assert [rule.row_block(n) for n in (257, 512, 513, 1024, 1025, 4096)] == [64, 64, 128, 128, 256, 256]
    assert CudaOptions(row_regs=4).row_block(1024) == 256 and CudaOptions(row_block_max=100).row_block(4096) == 64
    seen = []
    launcher = runtime._SimDevice.launcher

    def spy(self, name, total, row, dims, err, names, threads=0):
        seen.append((name, threads))
        return launcher(self, name, total, row, dims, err, names, threads)

    monkeypatch.setattr(runtime._SimDevice, "launcher", spy)
    for block_max, want in ((32, 32), (256, 256)):
        prog = build(LAYERNORM, "f32", cuda=CudaOptions(warp_rows=0, row_block_max=block_max))
        seen.clear()
        compare(prog, {"rows": 9, "d": 1500}, "f32", seed=block_max)
        assert ("k0", want) in seen, seen
