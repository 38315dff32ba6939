"""The CUDA backends' `inline_elementwise` stage (`tgc/backends/cuda/inline.py`): an
elementwise temporary whose readers already read its inputs is computed again in each
reader instead of being stored: gelu's forward and backward are two kernels, not three.
Checked on cuda-sim and in the lowered interpreter against the reference interpreter,
and where the stage must not apply (a reader that would read a new array)."""
from __future__ import annotations

import shutil
from dataclasses import replace

import numpy as np

import tgc
from tgc.backends.cuda.inline import InlineElementwise
from tgc.backends.cuda.options import CudaOptions
from tgc.ir.inputs import random_inputs
from tgc.ir.interp import evaluate
from tgc.lower.interp import run_lowered
from tgc.lower.lowered import Load, LoopKernel, Mul, walk
from tgc.options import Options

GELU = """
dim rows, d
input x[rows, d]
input dy[rows, d]
y = gelu(x)
out y
out dx = grad(sum(y * dy), x)
"""


def build(source: str, backend: str = "cuda-sim", **cuda):
    return tgc.compile(source, backend=backend, dtype="f32", options=Options().with_(cuda=CudaOptions(**cuda)))


def check(prog, dims: dict) -> None:
    m = prog.module
    x = random_inputs(m, m.bind_dims(dims), 3, "f32")
    want = evaluate(m, {k: np.copy(v) for k, v in x.items()}, dtype="f64")
    lowered = run_lowered(prog.lowered, {k: np.copy(v) for k, v in x.items()}, m.bind_dims(dims))
    for name, w in want.items():
        np.testing.assert_allclose(lowered[name], w, rtol=1e-5, atol=1e-6, err_msg=name)
    if shutil.which("g++"):
        got = prog(**x)
        for name, w in want.items():
            np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-6, err_msg=name)


def test_gelu_is_two_kernels_that_compute_tanh_where_they_read_it():
    on, off = build(GELU), build(GELU, inline_elementwise=False)
    assert len(off.lowered.kernels) == 3 and len(on.lowered.kernels) == 2
    assert all(isinstance(k, LoopKernel) for k in on.lowered.kernels)
    assert {b.kind for b in on.lowered.buffers.values()} == {"arg", "out"}    # no temporary left
    for dims in ({"rows": 3, "d": 5}, {"rows": 1, "d": 1}):
        check(on, dims)


def test_a_temporary_whose_reader_lacks_its_inputs_stays():
    """gelu's lowered program with the `dx` kernel reading `dy` and the tanh only: it
    would read `x` anew, so the tanh stays a buffer there (and so in every reader)."""
    low = build(GELU, inline_elementwise=False).lowered
    t = next(n for n, b in low.buffers.items() if b.kind == "temp")
    last = low.kernels[-1]
    dy = next(e for e in walk(last.body) if isinstance(e, Load) and e.buf == "dy")
    tl = next(e for e in walk(last.body) if isinstance(e, Load) and e.buf == t)
    low.kernels[-1] = replace(last, body=Mul((dy, tl)))
    options = Options().with_(cuda=CudaOptions())
    assert len(InlineElementwise().run(low, options).kernels) == 3
    low.kernels[-1] = last
    assert len(InlineElementwise().run(low, options).kernels) == 2
