"""Which kernels run on threads (`codegen.thread_plan`, shown by `tgc explain`): a kernel
too small to gain from threads runs serially, by the thresholds in `CpuOptions`; and
a program gives the same bits on any number of threads with its default thresholds."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import tgc
from tgc.backends.cpu.codegen import PARALLEL, SERIAL
from tgc.cli import main as cli_main
from tgc.ir.inputs import random_inputs
from tgc.options import CpuOptions, Options

ROOT = Path(__file__).resolve().parents[2]
GPT_SMALL = ROOT / "benchmarks" / "workloads" / "gpt_small.tg"

ROWS = """dim rows, d
input x[rows, d]
input w[d]
out y = layernorm[d](x, w, 0.0)
out p = softmax[d](x)
"""


def explain(path, dims, *flags):
    args = ["explain", str(path), "--format", "json", *flags] + [f"--dim={k}={v}" for k, v in dims.items()]
    res = CliRunner().invoke(cli_main, args)
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_tiny_kernels_are_planned_serial(tmp_path):
    src = tmp_path / "rows.tg"
    src.write_text(ROWS)
    small = explain(src, {"rows": 4, "d": 8})
    assert small["kernels"] and all(k["threads"] == SERIAL for k in small["kernels"])
    big = explain(src, {"rows": 4096, "d": 1024})
    assert any(k["threads"] == PARALLEL for k in big["kernels"])


def test_a_small_gpt_step_is_mostly_serial_and_large_products_parallel():
    small = explain(GPT_SMALL, {"batch": 1})
    plans = [k["threads"] for k in small["kernels"]]
    assert PARALLEL not in plans   # a region only while the workers still spin from another
    assert small["regions"]["when_warm"] == small["regions"]["per_call"] < small["regions"]["unmerged"]
    from tgc import pipeline
    from tgc.backends.cpu.codegen import thread_plan
    from tgc.frontend import compile_file
    m = compile_file(str(GPT_SMALL), Options())
    low = pipeline.lower_module(pipeline.lower(m, Options()).module, Options(), "cpu")
    alone = [thread_plan(low, k, m.bind_dims({"batch": 1}), Options()) for k in low.kernels]
    assert PARALLEL not in alone and alone.count(SERIAL) > len(alone) // 2   # each kernel alone: mostly serial
    large = explain(GPT_SMALL, {"batch": 64})
    gemms = [k["threads"] for k in large["kernels"] if k["kind"] == "gemm" and k["flops"] >= 1 << 21]
    assert gemms and all(t == PARALLEL for t in gemms)


def test_the_plan_follows_the_options():
    from tgc import pipeline
    from tgc.backends.cpu.codegen import thread_plan
    from tgc.frontend import compile_file

    m = compile_file(str(GPT_SMALL), Options())
    env = m.bind_dims({"batch": 64})
    low = pipeline.lower_module(pipeline.lower(m, Options()).module, Options(), "cpu")
    default = [thread_plan(low, k, env, Options()) for k in low.kernels]
    assert PARALLEL in default
    one = Options(cpu=CpuOptions(threads=1))
    assert all(thread_plan(low, k, env, one) == SERIAL for k in low.kernels)
    never = Options(cpu=CpuOptions(parallel_min_work=1 << 62, parallel_min_work_warm=1 << 62,
                                   gemm_parallel_min_flops=1 << 62, gemm_parallel_min_flops_warm=1 << 62))
    assert all(thread_plan(low, k, env, never) == SERIAL for k in low.kernels)


def test_text_report_has_a_threads_column(tmp_path):
    src = tmp_path / "rows.tg"
    src.write_text(ROWS)
    res = CliRunner().invoke(cli_main, ["explain", str(src), "--dim", "rows=4", "--dim", "d=8"])
    assert res.exit_code == 0, res.output
    assert re.search(r"live during\s+threads\s+what", res.output)
    assert re.search(r"^threads: \d+ kernels serial", res.output, re.M)


def test_fixed_size_kernels_planned_serial_get_no_parallel_body(tmp_path):
    """The plan is what the code does: a program whose sizes are all fixed and small
    has no outlined parallel body at all."""
    prog = tgc.compile(ROWS.replace("dim rows, d", "dim rows = 4, d = 8"), dtype="f32")
    assert ".par" not in prog.llvm_ir


@pytest.mark.parametrize("batch", [8, 64])
def test_default_thresholds_give_the_same_bits_on_any_thread_count(batch):
    m = tgc.compile(str(GPT_SMALL), dtype="f32", options=Options(cpu=CpuOptions(threads=1))).module
    inputs = {k: (0.2 * v if v.dtype.kind == "f" else v)
              for k, v in random_inputs(m, m.bind_dims({"batch": batch}), 3, "f32").items()}
    want = None
    for threads in (1, 2, 0):
        prog = tgc.compile(str(GPT_SMALL), dtype="f32", options=Options(cpu=CpuOptions(threads=threads)))
        for _ in range(2):   # the second call may start warm
            got = {k: np.array(v, copy=True) for k, v in prog(**{k: v.copy() for k, v in inputs.items()}).items()}
            if want is None:
                want = got
            assert got.keys() == want.keys()
            for name in want:
                assert got[name].tobytes() == want[name].tobytes(), (name, threads)
