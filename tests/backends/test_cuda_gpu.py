"""The cuda backend on a real GPU (CuPy): every example against the interpreter,
device arrays in and out, updates in place on the caller's device arrays, a gather
error through the device error word. Skipped, with the reason, where CuPy or a GPU
is missing (benchmarks/gpu_check.sh runs these where one is)."""
from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.ir.interp import EvalError, evaluate
from tgc.ir.inputs import random_inputs
from tgc.options import CudaOptions, Options


def _why_not() -> str | None:
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install -e '.[cuda]')"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as e:  # noqa: BLE001 -- no driver
        return f"no usable CUDA device: {e}"
    return None


REASON = _why_not()
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))
ROOT = Path(__file__).parent.parent.parent
PROGRAMS = sorted((ROOT / "examples").glob("*.tg")) + sorted((ROOT / "tests/programs/good").glob("*.tg"))


@pytest.mark.parametrize("dtype", ["f64", "f32"])
@pytest.mark.parametrize("path", PROGRAMS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_program_matches_interpreter_on_the_gpu(path, dtype):
    import cupy

    options = Options(dtype=dtype, cuda=CudaOptions(row_min=16))   # the one-block-per-row reductions too
    module = pipeline.lower(pipeline.load(str(path), options), options).module
    dims = {d: 40 for d in module.symbolic_dims()}
    inputs = random_inputs(module, module.bind_dims(dims), 0, dtype)
    want = evaluate(module, {k: v.copy() for k, v in inputs.items()}, dtype="f64", dims=dims)
    prog = tgc.compile(module, dtype=dtype, backend="cuda", options=options)
    dev = {k: cupy.asarray(v) for k, v in inputs.items()}
    got = prog.run(dev, dims)
    for name, ref in want.items():
        assert isinstance(got[name], cupy.ndarray)
        scale = max(1.0, float(np.nanmax(np.abs(ref)))) if ref.size else 1.0
        tol = (1e-9, 1e-9) if dtype == "f64" else (2e-4, 2e-5)
        np.testing.assert_allclose(cupy.asnumpy(got[name]), ref, rtol=tol[0], atol=tol[1] * scale, err_msg=name)
    for u in module.updates:   # written in place into the caller's device array
        assert got[module.update_key(u.target)] is dev[u.target]


def test_gather_error_on_the_gpu():
    import cupy

    src = "dim b\ndim v = 10, e = 6\ninput ids: i32[b]\nparam E[v, e]\nout r = E[v = ids]\n"
    prog = tgc.compile(src, backend="cuda")
    with pytest.raises(EvalError, match=r"'ids'\[b=1\] = 10"):
        prog(ids=cupy.asarray(np.array([1, 10], np.int32)), E=cupy.ones((10, 6), np.float32))
    out = prog(ids=np.array([1, 9], np.int32), E=np.ones((10, 6), np.float32))   # numpy: copied to the device
    assert isinstance(out["r"], cupy.ndarray) and float(out["r"].sum()) == 12.0
