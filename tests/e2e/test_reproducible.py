"""Reproducibility (issue 19, item 10): the CPU backend gives the same bits on any
number of threads and from run to run.

Every example and benchmark workload is compiled at `threads=1`, 2 and 3 with the
parallel thresholds at 1, so every loop kernel and every GEMM that can run in a
region does (on 1 thread none can), and its outputs on seeded random inputs must be
bit-identical across the three builds and across two calls of each. Symbolic dims
are 37: odd, so no share of rows or tiles divides evenly. What makes this hold:
reductions split into a fixed number of blocks (`group_blocks`) added in block
order, and GEMM tiles planned from the product's sizes only (`gemm.tile_limit`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc.frontend import compile_file
from tgc.ir.inputs import random_inputs
from tgc.options import Options

from marks import heavy, sized_by_themselves

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = sized_by_themselves(sorted((ROOT / "examples").glob("*.tg"))) + sorted((ROOT / "benchmarks" / "workloads").glob("*.tg"))
ALWAYS_PARALLEL = dict(parallel_min_work=1, parallel_min_work_warm=1,
                       gemm_parallel_min_flops=1, gemm_parallel_min_flops_warm=1,
                       contention_memory_cycles=0)   # nor does a loaded machine keep them serial


def _outputs(path: Path, threads: int, inputs: dict, dims: dict) -> list[dict]:
    prog = tgc.compile(str(path), dtype="f32", options=Options().with_(threads=threads, **ALWAYS_PARALLEL))
    runs = []
    for _ in range(2):
        out = prog.run({k: v.copy() for k, v in inputs.items()}, dims or None)
        runs.append({k: np.array(v, copy=True) for k, v in out.items()})
    return runs


@pytest.mark.parametrize("path", heavy(PROGRAMS), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_same_bits_on_1_2_and_3_threads(path):
    m = compile_file(str(path), Options())
    dims = {d: 37 for d in m.symbolic_dims()}
    inputs = random_inputs(m, m.bind_dims(dims), 0, "f32")
    want = _outputs(path, 1, inputs, dims)[0]
    assert want
    for threads in (1, 2, 3):
        for run, got in enumerate(_outputs(path, threads, inputs, dims)):
            assert got.keys() == want.keys()
            for name in want:
                differ = want[name].tobytes() != got[name].tobytes()
                assert not differ, (f"{path.name}: '{name}' on {threads} threads (call {run + 1}) differs from "
                                    f"1 thread by up to {np.max(np.abs(want[name] - got[name].astype(np.float64)))}")


def test_gemm_tiles_do_not_follow_the_thread_count():
    """A product big enough to be tiled, with its default thresholds: the same bits."""
    src = ROOT / "examples" / "mlp.tg"
    m = compile_file(str(src), Options())
    dims = {d: 2049 for d in m.symbolic_dims()}
    inputs = random_inputs(m, m.bind_dims(dims), 1, "f32")
    outs = [tgc.compile(str(src), dtype="f32", options=Options().with_(threads=t)).run(
        {k: v.copy() for k, v in inputs.items()}, dims) for t in (1, 2, 3)]
    for name in outs[0]:
        for other in outs[1:]:
            assert np.asarray(outs[0][name]).tobytes() == np.asarray(other[name]).tobytes(), name


SERIAL_ONLY = """
dim batch = 2, cin = 36, cout = 17, len = 3, klen = 6, lout = 3
input  x[t: len, cin, batch]
input  dy[batch, cout, s: lout]
param  K[cout, cin, k: klen]
y    = K @ x[t = s + k - 7]
loss = sum(y * dy)
out y[batch, cout, s]
out dx = grad(loss, x)
out dK = grad(loss, K)
"""


def test_same_bits_where_no_kernel_is_worth_a_region():
    """With the default thresholds this tiny convolution runs on one thread whatever
    `threads` says, yet its 1-thread build made no regions at all: LLVM propagated
    the constant row range of the only (serial) call into the loop kernels, and the
    input gradient's sum, which it may reassociate, took another order there (found
    by a random-convolution probe). Loop kernels are hidden, not internal, so their
    code never depends on the thread count."""
    rng = np.random.default_rng(1)
    arrays = {"x": rng.standard_normal((3, 36, 2), dtype=np.float32),
              "dy": rng.standard_normal((2, 17, 3), dtype=np.float32),
              "K": rng.standard_normal((17, 36, 6), dtype=np.float32)}
    got = [tgc.compile(SERIAL_ONLY, options=Options().with_(threads=t))(**arrays) for t in (1, 2)]
    for name in ("y", "dx", "dK"):
        assert np.array_equal(got[0][name], got[1][name]), name
