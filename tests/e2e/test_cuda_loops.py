"""Loops on the CUDA backends (issue 31 item 3): cuda-sim against the IR interpreter for
the loop programs of test_loops, and the generated CUDA source's size against the trip
count. The CUDA backends still unroll every loop (`unroll{all=true}` heads their stage
list), so the kernel-count test is an expected failure until a StepLoop runs as a host
launch loop there."""
import numpy as np
import pytest

from tgc.ir.interp import evaluate
from tgc.options import Options
from tgc.pipeline import compile_module

from test_loops import inputs, module, program


def close(got, want, rtol, atol):
    assert set(want) <= set(got)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=rtol, atol=atol, err_msg=k)


@pytest.mark.parametrize("dtype,rtol,atol", [("f64", 1e-9, 1e-11), ("f32", 1e-4, 1e-5)])
@pytest.mark.parametrize("n", [1, 3])
def test_cuda_sim_runs_loops_and_their_derivatives(n, dtype, rtol, atol):
    m = module(program(n), unroll_max_ops=0)
    ins = inputs(n)
    want = evaluate(m, {k: a.copy() for k, a in ins.items()}, dtype="f64")
    prog = compile_module(m, Options(dtype=dtype, unroll_max_ops=0), "cuda-sim")
    close(prog.run({k: a.copy() for k, a in ins.items()}), want, rtol, atol)


@pytest.mark.xfail(strict=True, reason="cuda unrolls every loop: no StepLoop launch loop yet (issue 31 item 3)")
def test_cuda_kernel_count_does_not_grow_with_the_trip_count():
    def kernels(n):
        m = module(program(n), unroll_max_ops=0)
        prog = compile_module(m, Options(dtype="f64", unroll_max_ops=0), "cuda-sim")
        return prog.cuda_source.count("__global__")
    assert kernels(2) == kernels(16)
