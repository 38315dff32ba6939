"""A reduction over a few unrolled iterations outside a kept loop (memory mode's shape)
runs in register mode with the reduced loops innermost (`loops.unrolled_reduction`):
one store per element, the same terms in the same order, so the values are those of
the sum made term by term into the output, bit for bit, on any number of threads."""
from __future__ import annotations

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.backends.cpu.loops import unrolled, unrolled_reduction
from tgc.backends.cpu.options import CpuOptions
from tgc.lower.lowered import LoopKernel
from tgc.options import Options

from backends.test_conv2d import BENCH_SYM, SYM_SIZES, _torch_convolution

CPU = CpuOptions()

ROWS = """
dim r = 3, n
input x[r, n]
out s = sum[r](x)
out hi = max[r](x)
out lo = min[r](x)
"""


def _loop_kernels(low):
    return [k for k in low.kernels if isinstance(k, LoopKernel)]


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_of_a_row_major_matrix_sum_in_order(threads):
    """s = sum over 3 rows of x[r, n]: the kernels read x row-major, the reduced loop
    outside the kept one, and take the unrolled register form; each element is
    ((0 + x0) + x1) + x2 in f32 (max and min likewise), as memory mode made it."""
    x = np.random.default_rng(0).standard_normal((3, 1000)).astype(np.float32)
    x[:, 7] = [-0.0, -0.0, -0.0]   # the sum from +0 of negative zeros: +0
    x[:, 8] = [np.inf, -np.inf, 1.0]
    prog = tgc.compile(ROWS, backend="cpu", dtype="f32", options=Options(cpu=CpuOptions(threads=threads)))
    taken = [k for k in _loop_kernels(prog.lowered) if "r" in k.red]
    assert taken
    for k in taken:
        assert k.loops.index("r") < k.loops.index("n") and unrolled(k, "r", CPU), k.text()
        assert unrolled_reduction(k, list(k.loops), CPU), k.text()
    got = prog(x=x)
    with np.errstate(invalid="ignore"):   # inf + -inf: NaN, as in the program
        want = (np.float32(0) + x[0] + x[1]) + x[2]
    assert np.array_equal(got["s"], want, equal_nan=True)
    assert np.signbit(got["s"][7]) == np.signbit(want[7])
    assert np.array_equal(got["hi"], np.maximum(np.maximum(x[0], x[1]), x[2]), equal_nan=True)
    assert np.array_equal(got["lo"], np.minimum(np.minimum(x[0], x[1]), x[2]), equal_nan=True)


def test_long_or_symbolic_reductions_keep_memory_mode():
    """Reduced loops of more than unroll_max iterations, or of a symbolic size, are not
    unrolled: those keep memory mode (and, past short_rows, its f64 scratch row)."""
    for text in (ROWS.replace("dim r = 3, n", "dim r = 9, n"), ROWS.replace("dim r = 3, n", "dim r, n")):
        low = tgc.compile(text, backend="cpu", dtype="f32").lowered
        taken = [k for k in _loop_kernels(low) if "r" in k.red]
        assert taken
        for k in taken:
            assert not unrolled_reduction(k, list(k.loops), CPU), k.text()


@pytest.mark.parametrize("threads", [1, 2])
def test_convolution_input_gradient_column_sum_is_unrolled_in_registers(threads):
    """conv2d_sym's dx: the sum of its product over the kernel's 3 columns (a masked,
    shifted read) is the unrolled register form; dx against PyTorch, and the same bits
    on 1 and 2 threads."""
    sizes = dict(SYM_SIZES, cin=16, cout=32, hh=16, ww=16)
    x, dy, K, ref = _torch_convolution(5, (16, 16, 16, 16), 32)
    args = {"x": x.astype(np.float32), "dy": dy.astype(np.float32), "K": K.astype(np.float32)}
    base = Options()
    module = pipeline.specialized_module(pipeline.lower(pipeline.load(str(BENCH_SYM), base), base).module,
                                         sizes, base)
    got = {}
    for t in (1, threads):
        prog = pipeline.compile_module(module, base.with_(cpu=base.cpu.with_(threads=t)))
        sums = [k for k in _loop_kernels(prog.lowered) if k.out == "dx" and "kw" in k.red]
        assert len(sums) == 1 and unrolled_reduction(sums[0], list(sums[0].loops), CPU), \
            [k.text() for k in prog.lowered.kernels]
        got[t] = np.asarray(prog(**{k: v.copy() for k, v in args.items()})["dx"]).copy()
    assert np.array_equal(got[1], got[threads])
    err = np.linalg.norm(got[1] - ref["dx"]) / np.linalg.norm(ref["dx"])
    assert err < 1e-6, err
