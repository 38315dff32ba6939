"""The cuda-sim backend (the CUDA module run on this CPU by the emulator) against
the reference interpreter on whole programs: every example, every corpus program,
and every prelude function with its derivatives, f64 and f32 (small dims: the
emulator runs each thread of a kernel one after another)."""
import shutil
from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.ir.interp import evaluate
from tgc.ir.inputs import random_inputs
from tgc.options import CudaOptions, Options

from marks import heavy, sized_by_themselves

ROOT = Path(__file__).parent.parent.parent
PROGRAMS = sized_by_themselves(sorted((ROOT / "examples").glob("*.tg"))) + sorted((ROOT / "tests/programs/good").glob("*.tg"))
F32_RTOL, F32_ATOL = 2e-4, 2e-5  # as the CPU backend's tests (tests/backends/test_cpu_programs.py)

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="cuda-sim needs g++ with OpenMP")


def compare(module, dtype, seed=0, options=None, dims=None):
    dims = {d: (dims or {}).get(d, 5) for d in module.symbolic_dims()}
    inputs = random_inputs(module, module.bind_dims(dims), seed, dtype)
    want = evaluate(module, {k: v.copy() for k, v in inputs.items()}, dtype="f64", dims=dims)
    prog = tgc.compile(module, dtype=dtype, backend="cuda-sim", options=options)
    got = prog.run({k: v.copy() for k, v in inputs.items()}, dims)
    assert set(got) == set(want)
    for name, ref in want.items():
        assert got[name].dtype == (np.float32 if dtype == "f32" else np.float64) or got[name].dtype == ref.dtype
        scale = max(1.0, float(np.nanmax(np.abs(ref)))) if ref.size else 1.0
        if dtype == "f64":
            np.testing.assert_allclose(got[name], ref, rtol=1e-9, atol=1e-9 * scale, err_msg=name)
        else:
            np.testing.assert_allclose(got[name], ref, rtol=F32_RTOL, atol=F32_ATOL * scale, err_msg=name)
    return prog


@pytest.mark.parametrize("dtype", ["f64", "f32"])
@pytest.mark.parametrize("path", heavy(PROGRAMS), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_program_matches_interpreter(path, dtype):
    options = Options(dtype=dtype)
    module = pipeline.lower(pipeline.load(str(path), options), options).module
    prog = compare(module, dtype)
    assert prog.gemm_counts["views"] == 0    # every GEMM cell ran as strided batched calls


ROW_PROGRAMS = ["examples/layernorm.tg", "examples/attention.tg", "tests/programs/good/005_reductions.tg",
                "tests/programs/good/010_conv_stride_pad.tg", "tests/programs/good/019_softmax_family.tg",
                "tests/programs/good/020_norms.tg", "tests/programs/good/032_masked_softmax.tg"]


@pytest.mark.slow
@pytest.mark.parametrize("groups", [False, True], ids=["kernels", "rowgroups"])
@pytest.mark.parametrize("dtype", ["f64", "f32"])
@pytest.mark.parametrize("path", ROW_PROGRAMS)
def test_one_block_per_row_reductions_match_interpreter(path, dtype, groups):
    """With `cuda_row_min=1` every reduction that has the form runs one block per output
    (an OpenMP team under the emulator: shuffles, shared memory, barriers); with row
    groups, a row's reductions and consumers run as one kernel, a block per row where
    the row is longer than `warp_rows` (1 here), else a warp."""
    options = Options(dtype=dtype, cuda=CudaOptions(row_min=1, row_groups=groups, warp_rows=1 if groups else 256))
    module = pipeline.lower(pipeline.load(str(ROOT / path), options), options).module
    prog = compare(module, dtype, options=options)
    kinds = {"row" if x.row else x.kind for x in prog.cuda_module.launches}
    assert ("rows" in kinds) if groups else ("row" in kinds and "rows" not in kinds)
