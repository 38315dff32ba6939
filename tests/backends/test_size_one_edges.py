"""Edges of size 1 on the CPU backend against the reference interpreter, in f64 and f32:
causal attention with one head (`head = 1`, so the head split is a plain copy), a batch
of one, a contracted edge of size 1, reindexing over size-1 edges, convolutions with
kernels of size 1 and images one row high, one input channel. A size-1 edge is a
shape a lowering stage may be tempted to drop; these programs keep every stage honest
about it (the random-program fuzzer, tests/fuzz/gen.py, makes such edges too)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tgc import pipeline
from tgc.frontend import compile_source
from tgc.options import Options

from test_cpu_programs import compare

ROOT = Path(__file__).resolve().parents[2]
ATTENTION = (ROOT / "examples/attention.tg").read_text().replace("dim c = 48, head = 3", "dim c = 16, head = 1")
CONV = ("dim b\ndim h = {h}, w = {w}, kh = {kh}, kw = {kw}, ci = {ci}, co = 3\n"
        "input x[b, ci, h, w], f[co, ci, kh, kw], dy[b, co, h, w]\n"
        "y = sum[ci, kh, kw](x[h = h + kh - 1, w = w + kw - 1] * f)\n"
        "out y\nout df = grad(sum(y * dy), f)\nout dx = grad(sum(y * dy), x)\n")
PROGRAMS = {
    "attention, one head": ATTENTION,
    "attention, one head, a batch of one": ATTENTION.replace("dim batch\n", "dim batch = 1\n"),
    "head split, one head": "dim b\ndim t = 6, o = 3\ndim c = 16, head = 1, hd = c / head\n"
                            "input x[b, t, c2: c], w[hd, o]\nout y[b, t, head, o] = x[c2 = hd*head + hd] @ w\n",
    "contracted edge of size 1": "dim b\ndim k = 1, m = 4, n = 3\ninput x[b, m, k], w[k, n], dy[b, m, n]\n"
                                 "y = x @ w\nout y\nout dw = grad(sum(y * dy), w)\nout dx = grad(sum(y * dy), x)\n",
    "conv1d, kernel of 1": "dim b\ndim l = 7, k = 1, o = l - k + 1, ci = 3, co = 2\n"
                           "input x[b, ci, l], w[co, ci, k], dy[b, co, o]\ny = sum[ci, k](x[l = o + k] * w)\n"
                           "out y\nout dw = grad(sum(y * dy), w)\nout dx = grad(sum(y * dy), x)\n",
    "conv2d, kernel 1x1": CONV.format(h=8, w=8, kh=1, kw=1, ci=4),
    "conv2d, one input channel": CONV.format(h=8, w=8, kh=3, kw=3, ci=1),
    "conv2d, an image one row high": CONV.format(h=1, w=16, kh=3, kw=3, ci=2),
    "reindex over size-1 edges": "dim b\ndim n = 1, m = 2\ninput x[b, n, m]\n"
                                 "out y[b, n, m] = x[n = n + 1] + x[m = 1 - m] + x[n = 0 - n]\n"
                                 "out z = sum[n](x) * mean[m](x)\n",
    "softmax over one": "dim b\ndim n = 1\ninput x[b, n], dy[b, n]\ny = softmax[n](x)\n"
                        "out y\nout dx = grad(sum(y * dy), x)\nout l = logsumexp[n](x)\n",
    # a stacked argument stored with an edge of size 1 before a symbolic loop edge: the
    # step's slices are read in place (fuzzed: the plan verifier refused the symbolic trip)
    "loop over a symbolic edge after one of size 1": "dim b\ndim n = 1\nparam w[n, b]\n"
                                                     "fn step(h, a) = tanh(h + max[n](a))\n"
                                                     "v = repeat[b](step, 0.25, w)\nout v\nout dw = grad(v, w)\n",
}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dtype", ["f64", "f32"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_size_one_edges_match_the_interpreter(name, dtype, batch):
    options = Options(dtype=dtype)
    module = pipeline.lower(compile_source(PROGRAMS[name], "<size1>", options), options).module
    compare(module, dtype, dims={d: batch for d in module.symbolic_dims()})
