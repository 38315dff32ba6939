"""The last block of rows of an implicit GEMM's copy (backends/cpu/fgemm.py,
`window_row_blocks`): where M leaves at most `own_gemm_window_rows` - 2 rows after its
whole blocks, they run in a block of that many rows, not in a whole block with rows
past M computed again (conv2d_sym's output product: 64 rows, 10 x 6 + 4). Asserted:
y and dK (the products whose window is their B, cout rows) and dx against PyTorch
(f64) and the lowered interpreter for remainders 4, 1, 5 and 0 of 6, the same bits on 1 and 2 threads, and the same
bits as blocks of 4 rows (each element's FMAs in the same order in a block of any
height). Times: benchmarks/conv2d_probe.py kernels, not asserted here."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tgc import pipeline
from tgc.backends.cpu.implicit import ImplicitGemm
from tgc.lower.interp import run_lowered
from tgc.options import Options
from tgc.pipeline import lower_module

ROOT = Path(__file__).resolve().parent.parent.parent
BENCH_SYM = ROOT / "benchmarks" / "workloads" / "conv2d_sym.tg"


def _with(**cpu) -> Options:
    o = Options()
    return o.with_(cpu=o.cpu.with_(**cpu))


@pytest.mark.parametrize("cout", [4, 25, 29, 30])   # rows past the whole blocks of 6: 4, 1, 5, 0
def test_output_rows_past_whole_blocks(cout):
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle of this test")
    sizes = {"nb": 5, "cin": 16, "cout": cout, "hh": 32, "ww": 32}
    rng = np.random.default_rng(cout)
    args = {"x": rng.standard_normal((5, 16, 32, 32)).astype(np.float32),
            "dy": rng.standard_normal((5, cout, 32, 32)).astype(np.float32),
            "K": (rng.standard_normal((cout, 16, 3, 3)) / np.sqrt(16 * 9)).astype(np.float32)}
    tx = torch.tensor(args["x"], dtype=torch.float64, requires_grad=True)
    tK = torch.tensor(args["K"], dtype=torch.float64, requires_grad=True)
    y = torch.nn.functional.conv2d(tx, tK, padding=1)
    dx, dK = torch.autograd.grad(y, (tx, tK), torch.tensor(args["dy"], dtype=torch.float64))
    ref = {"y": y.detach().numpy(), "dx": dx.numpy(), "dK": dK.numpy()}
    options = Options()
    module = pipeline.lower(pipeline.load(str(BENCH_SYM), options), options).module
    module = pipeline.specialized_module(module, sizes, options)
    low = lower_module(module, options)
    windows = [k for k in low.kernels if isinstance(k, ImplicitGemm) and k.role() == "b"]
    assert [k.gemm.m for k in windows] == [("cout",)] * 2, "y's and dK's products: implicit, cout rows"
    interp = run_lowered(low, {k: v.copy() for k, v in args.items()})
    got = {}
    for name, opts in (("t1", _with(threads=1)), ("t2", _with(threads=2)),
                       ("rows4", _with(threads=1, own_gemm_window_rows=4))):
        out = pipeline.compile_module(module, opts)(**{k: v.copy() for k, v in args.items()})
        got[name] = {k: np.asarray(out[k]).copy() for k in ref}
    for k in ref:
        err = np.linalg.norm(got["t1"][k] - ref[k]) / np.linalg.norm(ref[k])
        assert err < 1e-6, (k, err)
        np.testing.assert_allclose(got["t1"][k], interp[k], rtol=3e-5, atol=3e-5 * np.abs(ref[k]).max(), err_msg=k)
        assert np.array_equal(got["t1"][k], got["t2"][k]), k
        assert np.array_equal(got["t1"][k], got["rows4"][k]), k
