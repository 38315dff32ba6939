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


# cross-attention (s != t) with a padding mask, the loss a function of the output
PADDED = """dim batch = 1, head = 2, t = 4096, s = 2048, hd = 64
input q[batch, head, t, hd], k[batch, head, s, hd], v[batch, head, s, hd], pad[batch, s]
p = softmax[s](dot[hd](q, k) / sqrt(size(hd)) - 1e9 * pad)
o = sum[s](p * v)
loss = sum(o * o)
out loss
out gq[batch, head, t, hd] = grad(loss, q)
out gk[batch, head, s, hd] = grad(loss, k)
out gv[batch, head, s, hd] = grad(loss, v)
"""


def test_padded_cross_attention_backward_builds_no_outer_sum():
    """`factor` took `o` and `p` out of attention's backward, `p * sum[hd](o * v) - p *
    sum[hd](o * o)` -> `p * sum[hd](o * (v - o))`: 1.5% fewer FLOPs by its model, but
    `v - o` is a `[batch, hd, head, s, t]` sum (hd times the scores), an elementwise
    loop where there were GEMMs, which `stream` cannot block either: 553 MB at t = 4096,
    s = 2048, 4 heads x batch 2 against 76 MB. Now no value is larger than the scores,
    the sum is `p * (dP - sum(p dP))` (p alone taken out), and the peak is a few blocks."""
    options = Options(dtype="f32")
    module = pipeline.load_program("padded.tg", options, text=PADDED).module
    scores = 1 * 2 * 4096 * 2048
    upto = ("normalize", "stabilize", "adjoint", "tangent", "unroll", "simplify", "stabilize", "factor")
    factored = pipeline.lower(module, options.with_(passes=upto)).module   # before `stream` moves values into loops
    largest = max(int(np.prod([module.dims[factored.edges.get(e, e)] for e in v.edges]))
                  for v in factored.values() if v.op in ("add", "contract", "map"))
    assert largest <= scores, largest
    lowered = pipeline.lower(module, options)
    peak = explain(pipeline.lower_module(lowered.module, options, "cpu"), {}, options)["peak"]["bytes"]
    assert peak < 4 * scores, peak   # less than one [batch, head, s, t] f32 matrix


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_padded_cross_attention_gradients_against_torch(dtype):
    """The same program's loss and gradients against torch in f64; in f32 within 10x
    torch f32's error (the numerics contract), fully padded keys included."""
    torch = pytest.importorskip("torch")
    small = PADDED.replace("t = 4096, s = 2048, hd = 64", "t = 96, s = 40, hd = 32")
    prog = tgc.compile(small, dtype=dtype)
    rng = np.random.default_rng(0)
    arrs = dict(q=rng.standard_normal((1, 2, 96, 32)), k=rng.standard_normal((1, 2, 40, 32)),
                v=rng.standard_normal((1, 2, 40, 32)), pad=(np.arange(40) >= 30)[None].astype(float))
    npdt = np.float32 if dtype == "f32" else np.float64
    got = prog(**{n: a.astype(npdt) for n, a in arrs.items()})

    def ref(tdt):
        t = {n: torch.tensor(a, dtype=tdt, requires_grad=n != "pad") for n, a in arrs.items()}
        p = torch.softmax(t["q"] @ t["k"].transpose(-1, -2) / 32 ** 0.5 - 1e9 * t["pad"][:, None, None, :], -1)
        o = p @ t["v"]
        loss = (o * o).sum()
        loss.backward()
        return {"loss": loss.detach().numpy(), **{"g" + n: t[n].grad.numpy() for n in "qkv"}}

    r64, r32 = ref(torch.float64), ref(torch.float32)
    for name in ("loss", "gq", "gk", "gv"):
        scale = np.abs(r64[name]).max()
        err = np.abs(got[name] - r64[name]).max() / scale
        if dtype == "f64":
            assert err < 1e-12, (name, err)
        else:
            assert err <= 10 * max(np.abs(r32[name] - r64[name]).max() / scale, 1e-7), (name, err)


DEEP = """dim batch, layer, c
input x[batch, c]
param w[layer, c, c2: c], b[layer, c2]
fn blk(h, w, b) { return h + tanh(h @ w + b)[c2 -> c] }
y = repeat[layer](blk, x, w, b)
loss = mean(y * y)
out loss
out gw[layer, c, c2] = grad(loss, w)
out gx[batch, c] = grad(loss, x)
"""


@pytest.mark.slow
def test_deep_residual_stack_one_program_any_depth_against_torch():
    """One compiled program (the depth symbolic) runs 2 and 48 residual layers; the
    gradients at 48 layers are within 10x torch f32's error of torch f64 (measured:
    tgc 2.5e-6, torch f32 3.1e-6 of the largest gradient)."""
    torch = pytest.importorskip("torch")
    prog = tgc.compile(DEEP, dtype="f32")
    rng = np.random.default_rng(0)
    for depth in (2, 48):
        x = rng.standard_normal((8, 64))
        w = 0.1 * rng.standard_normal((depth, 64, 64))
        b = 0.1 * rng.standard_normal((depth, 64))
        got = prog(x=x.astype(np.float32), w=w.astype(np.float32), b=b.astype(np.float32))

        def ref(tdt):
            X, W, B = (torch.tensor(a, dtype=tdt, requires_grad=True) for a in (x, w, b))
            h = X
            for i in range(depth):
                h = h + torch.tanh(h @ W[i] + B[i])
            (h * h).mean().backward()
            return W.grad.numpy(), X.grad.numpy()

        (w64, x64), (w32, x32) = ref(torch.float64), ref(torch.float32)
        for g, r64, r32 in ((got["gw"], w64, w32), (got["gx"], x64, x32)):
            scale = np.abs(r64).max()
            assert np.abs(g - r64).max() / scale <= 10 * max(np.abs(r32 - r64).max() / scale, 1e-7)


RNN = """dim batch, t, c, d
input xs[t, batch, d], y[batch, c]
param wh[c, c2: c], wx[d, c2], bh[c2], h0[c]
fn cell(h, x, wh, wx, bh) { return tanh(h @ wh + x @ wx + bh)[c2 -> c] }
h00 = h0 + 0 * sum[d](xs[t = 0])
hl = repeat[t](cell, h00, xs, wh * [t = t], wx * [t = t], bh * [t = t])
loss = mean((hl - y) ^ 2)
out loss
out gwh[c, c2] = grad(loss, wh)
out gh0[c] = grad(loss, h0)
"""


@pytest.mark.slow
def test_rnn_over_1000_steps_against_torch():
    """A recurrent cell with shared weights (passed as `W * [t = t]`, docs/language.md)
    over 1000 steps: the gradients through every step within 10x torch f32's error of
    torch f64 (measured: 2.0e-6 against torch f32's 1.8e-6)."""
    torch = pytest.importorskip("torch")
    T, B = 1000, 4
    prog = tgc.compile(RNN, dtype="f32", dims=dict(c=32, d=16))
    rng = np.random.default_rng(0)
    xs, y = rng.standard_normal((T, B, 16)), 0.5 * rng.standard_normal((B, 32))
    wh, wx = 0.3 * rng.standard_normal((32, 32)), 0.3 * rng.standard_normal((16, 32))
    bh, h0 = 0.1 * rng.standard_normal(32), 0.1 * rng.standard_normal(32)
    f32 = np.float32
    got = prog(xs=xs.astype(f32), y=y.astype(f32), wh=wh.astype(f32), wx=wx.astype(f32),
               bh=bh.astype(f32), h0=h0.astype(f32))

    def ref(tdt):
        Wh, Wx, Bh, H0 = (torch.tensor(a, dtype=tdt, requires_grad=True) for a in (wh, wx, bh, h0))
        X = torch.tensor(xs, dtype=tdt)
        h = H0.expand(B, 32)
        for i in range(T):
            h = torch.tanh(h @ Wh + X[i] @ Wx + Bh)
        ((h - torch.tensor(y, dtype=tdt)) ** 2).mean().backward()
        return Wh.grad.numpy(), H0.grad.numpy()

    r64, r32 = ref(torch.float64), ref(torch.float32)
    for g, a, b in zip((got["gwh"], got["gh0"]), r64, r32):
        scale = np.abs(a).max()
        assert np.abs(g - a).max() / scale <= 10 * max(np.abs(b - a).max() / scale, 1e-7)
