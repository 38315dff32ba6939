"""Programs compile and agree with the interpreter whatever subset of their dims is
fixed at build time (`tgc.compile(dims=)`, `tgc build -D`), alias and derived dims
included; and the lowering ICE on a GEMM operand that a reduction repeats along an edge.
"""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.frontend import compile_file, compile_source
from tgc.ir.interp import evaluate
from tgc.ir.inputs import random_inputs
from tgc.options import Options

from marks import heavy, sized_by_themselves

ROOT = Path(__file__).resolve().parents[2]
SIZE = 3

ALIAS = "dim n\ndim m = n\ninput x[n]\nout y[m] = x[n -> m] * 2\n"
CONV1D_DX = """
dim ci, co, n
dim k = 3
dim o = n
input x[ci, n], w[co, ci, k], g[co, o]
out dx = grad(sum((x[n = o + k - 1] @ w) * g), x)
"""
CONV2D = """
dim b, ci, co, h, w
dim k = 3
dim hh = h, ww = w
input x[b, ci, h, w], f[co, ci, kh: k, kw: k], g[b, co, hh, ww]
y = x[h = hh + kh - 1, w = ww + kw - 1] @ f
out dx = grad(sum(y * g), x)
out df = grad(sum(y * g), f)
"""
# a head merge whose gradient reads dy summed over t and repeated along head
HEAD_MERGE = """
dim b
dim t = 3, s = t, c = 6, head = 3, hd = c / head
input  v[b, s, head, hd]
input  dy[b, t, c]
param  Wo[c2: c, c]
input  p[b, head, t, s]
y   = (sum[s](p * v) @ [c2 = hd*t + hd]) @ Wo
loss = sum(y * dy)
out dv = grad(loss, v)
out dWo = grad(loss, Wo)
"""
SOURCES = {"alias": ALIAS, "conv1d_dx": CONV1D_DX, "conv2d": CONV2D, "head_merge": HEAD_MERGE}
FILES = sized_by_themselves(sorted((ROOT / "examples").glob("*.tg"))) + sorted((ROOT / "tests/fuzz/regressions").glob("*.tg"))


def _module(name: str):
    if name in SOURCES:
        return SOURCES[name], compile_source(SOURCES[name], name, Options(dtype="f64"))
    path = next(p for p in FILES if p.stem == name)
    return str(path), compile_file(str(path), Options(dtype="f64"))


def _subsets(dims: list[str]) -> list[tuple[str, ...]]:
    """Every subset for up to 3 dims; else each one alone and all together."""
    if len(dims) <= 3:
        return [c for r in range(1, len(dims) + 1) for c in itertools.combinations(dims, r)]
    return [(d,) for d in dims] + [tuple(dims)]


CASES = [(name, subset) for name in list(SOURCES) + [p.stem for p in FILES]
         for subset in _subsets(_module(name)[1].symbolic_dims())]


@pytest.mark.parametrize("name,subset", heavy(CASES, key=lambda case: case[0]), ids=[f"{n}-{'+'.join(s)}" for n, s in CASES])
def test_any_subset_of_dims_fixed(name, subset):
    source, m = _module(name)
    sizes = {d: SIZE for d in m.symbolic_dims()}
    inputs = random_inputs(m, m.bind_dims(sizes), 0, "f64")
    want = evaluate(pipeline.lower(m, Options(dtype="f64")).module, inputs, dtype="f64", dims=sizes)
    prog = tgc.compile(source, dtype="f64", dims={d: SIZE for d in subset})
    got = prog.run({k: v.copy() for k, v in inputs.items()}, {d: SIZE for d in sizes if d not in subset} or None)
    for k in want:
        scale = max(float(np.max(np.abs(want[k]), initial=0.0)), 1.0)
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-12 * scale, err_msg=k)


def test_a_derived_dim_may_be_named_with_its_size_and_only_that():
    prog = tgc.compile(ALIAS, dims={"n": 8, "m": 8})
    np.testing.assert_array_equal(prog(x=np.arange(8, dtype=np.float32))["y"], 2 * np.arange(8))
    with pytest.raises(ValueError, match="dim 'm' is 8, not 9"):
        tgc.compile(ALIAS, dims={"n": 8, "m": 9})
    with pytest.raises(ValueError, match="derived from other dims"):
        tgc.compile(ALIAS, dims={"m": 8})


def test_a_gemm_operand_repeated_along_an_edge_is_not_given_to_blas():
    """dy summed over t and repeated along head was a GEMM operand whose buffer lacks
    `head`: layout failed with `tuple.index(x): x not in tuple` (unless b was fixed)."""
    from tgc.lower.lowered import GemmKernel
    from tgc.pipeline import lower_module

    m = pipeline.lower(compile_source(HEAD_MERGE, "<t>", Options()), Options()).module
    low = lower_module(m, Options())
    for k in low.kernels:
        if isinstance(k, GemmKernel):
            for view in (k.a, k.b):
                assert {b for _, b in view.edges} == set(low.buffers[view.buf].edges)
