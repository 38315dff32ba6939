"""Probe of stop 52 at scale: programs a new user writes from shared/LANGUAGE.md and the
README (every size symbolic, bound by the call), at sizes the project's own tests do
not use: deep `repeat` stacks, long `scan`s, long attention. Each bug test here failed
before its fix (the commit that adds it says which)."""
from __future__ import annotations

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.explain import explain
from tgc.options import Options

# causal attention with its gradients, as a user writes it: every size symbolic, the
# head width `hd` too (the scale is 1 / sqrt(size(hd)))
ATTENTION = """dim batch, head, t, hd
dim s = t
input q[batch, head, t, hd], k[batch, head, s, hd], v[batch, head, s, hd], dy[batch, head, t, hd]
p = softmax[s](where([s <= t], dot[hd](q, k) / sqrt(size(hd)), -1e9))
y = sum[s](p * v)
out y[batch, head, t, hd]
loss = sum(y * dy)
out dq[batch, head, t, hd] = grad(loss, q)
out dk[batch, head, s, hd] = grad(loss, k)
out dv[batch, head, s, hd] = grad(loss, v)
"""


def _specialized_peak(source: str, sizes: dict) -> int:
    """`tgc explain --specialized`'s peak: what calls repeated with `sizes` hold."""
    options = Options(dtype="f32")
    module = pipeline.load_program("attention.tg", options, text=source).module
    generic = pipeline.lower(module, options.with_(dims=tuple(sorted(sizes.items())))).module
    low = pipeline.lower_module(pipeline.specialized_module(generic, sizes, options), options, "cpu")
    return explain(low, module.bind_dims(sizes), options)["peak"]["bytes"]


def test_specialized_attention_over_a_symbolic_head_width_streams():
    """The specialization of a symbolic attention streams its [t, s] matrices whatever
    dims are symbolic. With `hd` symbolic, the generic IR keeps `1 / sqrt(size(hd))` as
    a computed scalar (folded into the causal mask, `mask / sqrt(size(hd))`, by the
    algebra); fixing the dims and running `stream` alone left that `[s, t]` product,
    which `stream` does not read as a mask: the specialization held the whole matrices
    (1.68 GB at t = 4096, 4 heads x batch 2, against 15 MB for the same attention with
    `hd = 64` in the source)."""
    sizes = dict(batch=1, head=2, t=2048, hd=64)
    fixed = ATTENTION.replace("dim batch, head, t, hd", "dim batch = 1, head = 2, t = 2048, hd = 64")
    want = _specialized_peak(fixed, {})
    got = _specialized_peak(ATTENTION, sizes)
    one_matrix = 2048 * 2048 * 4
    assert want < one_matrix
    assert got <= 1.25 * want, (got, want)
