"""Row groups of an implicit GEMM's window (backends/cpu/fgemm.py, `_Lanes.fill_group`):
a convolution's rows (cin, kh, kw) for kw = 0, 1, 2 read one image row moved by one
element each, so their aligned lines are read and joined once and each row's vectors
are the joined ones moved by kw lanes, masked by the row's class. Asserted: of the
program's two window tables (y's, whose window is B', and dK's, whose window is A')
y's groups its 3 kernel columns, and none with `CpuOptions(own_gemm_window_groups=False)`;
y, dx and dK against PyTorch (f64) and the same bits as row by row, on 1 and 2
threads, where K blocks cut a group (cin = 47: 423 rows in blocks of 212), K is one
block of whole groups (cin = 11: 99 rows), and image rows are not a multiple of 16
(40 columns: the groups' runs start at every shift within a line, 1.6 image rows a
block of 64 columns).
Times: benchmarks/conv2d_probe.py kernels, not asserted here."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tgc import pipeline
from tgc.backends.cpu.implicit import ImplicitGemm
from tgc.options import Options
from tgc.pipeline import lower_module

ROOT = Path(__file__).resolve().parent.parent.parent
BENCH_SYM = ROOT / "benchmarks" / "workloads" / "conv2d_sym.tg"


def _with(**cpu) -> Options:
    o = Options()
    return o.with_(cpu=o.cpu.with_(**cpu))


def _module(sizes):
    options = Options()
    module = pipeline.lower(pipeline.load(str(BENCH_SYM), options), options).module
    return pipeline.specialized_module(module, sizes, options)


def test_the_output_window_groups_the_kernel_columns():
    module = _module({"nb": 5, "cin": 16, "cout": 4, "hh": 32, "ww": 32})
    assert sum(isinstance(k, ImplicitGemm) for k in lower_module(module, Options()).kernels) == 2
    # each window kernel's table of union masks (`_Lanes.umasks`), one a kernel
    grouped = pipeline.compile_module(module, _with(threads=1)).llvm_ir
    assert grouped.count('%"lane.union" = alloca') == 1 and grouped.count('%"lane.masks" = alloca') == 2
    plain = pipeline.compile_module(module, _with(threads=1, own_gemm_window_groups=False)).llvm_ir
    assert plain.count('%"lane.union" = alloca') == 0 and plain.count('%"lane.masks" = alloca') == 2


@pytest.mark.parametrize("nb, cin, cout, hh, ww", [(5, 47, 20, 32, 32), (5, 11, 16, 32, 32), (4, 16, 16, 32, 40)])
def test_groups_against_torch_and_row_by_row(nb, cin, cout, hh, ww):
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle of this test")
    sizes = {"nb": nb, "cin": cin, "cout": cout, "hh": hh, "ww": ww}
    rng = np.random.default_rng(cin)
    args = {"x": rng.standard_normal((nb, cin, hh, ww)).astype(np.float32),
            "dy": rng.standard_normal((nb, cout, hh, ww)).astype(np.float32),
            "K": (rng.standard_normal((cout, cin, 3, 3)) / np.sqrt(cin * 9)).astype(np.float32)}
    tx = torch.tensor(args["x"], dtype=torch.float64, requires_grad=True)
    tK = torch.tensor(args["K"], dtype=torch.float64, requires_grad=True)
    y = torch.nn.functional.conv2d(tx, tK, padding=1)
    dx, dK = torch.autograd.grad(y, (tx, tK), torch.tensor(args["dy"], dtype=torch.float64))
    ref = {"y": y.detach().numpy(), "dx": dx.numpy(), "dK": dK.numpy()}
    module = _module(sizes)
    assert sum(isinstance(k, ImplicitGemm) for k in lower_module(module, Options()).kernels) == 2
    got = {}
    for name, opts in (("t1", _with(threads=1)), ("t2", _with(threads=2)),
                       ("rows", _with(threads=1, own_gemm_window_groups=False)),
                       ("rows2", _with(threads=2, own_gemm_window_groups=False))):
        out = pipeline.compile_module(module, opts)(**{k: v.copy() for k, v in args.items()})
        got[name] = {k: np.asarray(out[k]).copy() for k in ref}
    for k in ref:
        err = np.linalg.norm(got["t1"][k] - ref[k]) / np.linalg.norm(ref[k])
        assert err < 1e-6, (k, err)
        assert np.array_equal(got["t1"][k], got["rows"][k]), k
        assert np.array_equal(got["t2"][k], got["rows2"][k]), k
