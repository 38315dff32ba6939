"""Conformance with shared/LANGUAGE.md, sentence by sentence, where
test_spec_conformance.py does not reach: section 12 (`repeat`, `scan`, `for p in
LIST`) in every derivative mode, derivative modes nested three deep, symbolic dim
expressions, indicators and relations, updates written in place, function scope,
element-type promotion, custom forward rules.

Same style as test_spec_conformance.py: each case is a program, its inputs and the
expected outputs computed independently (numpy formulas; PyTorch float64 autograd and
`torch.func` where a derivative is involved, the case skipped without torch), run as
`tgc run F --inputs in.npz -o out.npz` on the interpreter and every registered backend
but cuda-sim (which its own tests cover); the archive must hold exactly the outputs and
update targets. Bad programs give a located `file:LINE:COL: error:`.
"""
from __future__ import annotations

import textwrap

import ml_dtypes
import numpy as np
import pytest

from backends_util import EMULATED, backends
from test_spec_conformance import assert_located, tgc

BACKENDS = ("interp", *backends(exclude=EMULATED))
RNG = np.random.default_rng(20261205)


def rn(*shape):
    return RNG.standard_normal(shape)


CASES: dict[str, tuple] = {}   # id -> (source, inputs, expected or a function that computes it, tolerance)
XFAIL: dict[str, str] = {}     # id -> why it fails (a divergence not fixed yet)


def case(name, src, inputs, expected, tol=(1e-9, 1e-11), xfail=None):
    CASES[name] = (textwrap.dedent(src), inputs, expected, tol)
    if xfail:
        XFAIL[name] = xfail


def params(names):
    return [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=XFAIL[n])) if n in XFAIL else n for n in names]


def torch_f64():
    torch = pytest.importorskip("torch")
    torch.set_default_dtype(torch.float64)
    return torch


# ---- section 12: `for p in LIST` -------------------------------------------------------------------------------
# `[p in a, b, c]` is 1 where the current instance is one of the listed tensors, else 0: a
# declared param or state that the block's list leaves out is 0 in every instance (the
# section's own example, `[p in wq, wk, wv, wo]`, under its own `for p in wq, wk, wv`)
_a, _b, _c, _s, _x = rn(3), rn(3, 2), rn(2), rn(2), rn(3)
_ma, _mc = rn(3), rn(2)
_t = np.tanh(_x @ _b + _c)
_ga, _gc = _x, (1 - _t * _t) * _s
case("s12_for_list_member_indicator_sum", """
    dim n = 3, k = 2
    param a[n], b[n, k], c[k]
    state s[k]
    input x[n]
    loss = sum(tanh(x @ b + c) * s) + sum(a * x)
    out gn = sum[p in a, b](sum(grad(loss, p) ^ 2))
    for p in a, c {
      state m.p
      g = grad(loss, p)                          # local to each instance
      update m.p = m.p + g * (1 + [p in c, b])   # b is a param the list leaves out: 0
      update p = p - 0.1 * g
    }
    for q in s {                                 # a list may name states
      g = q * 2
      update q = g + [q in s] + [q in a]
    }
    """, {"a": _a, "b": _b, "c": _c, "s": _s, "x": _x, "m.a": _ma, "m.c": _mc},
     {"gn": (_ga ** 2).sum() + (np.outer(_x, _gc) ** 2).sum(), "m.a": _ma + _ga, "m.c": _mc + 2 * _gc,
      "a": _a - .1 * _ga, "c": _c - .1 * _gc, "s": 2 * _s + 1})

# bindings inside the block are local to each instance: one may take the name of a
# program binding (as a function's bindings may), which it hides inside the block only
_xb, _ab, _bb = np.array([1.0, 2.0]), np.array([.1, .2]), np.array([.3, .4])
case("s12_for_local_binding_hides_a_program_binding", """
    dim n = 2
    param a[n], b[n]
    input x[n]
    g = sum(x)
    loss = sum(a * x) + sum(b * x * x) + g
    for p in params {
      g = grad(loss, p)
      update p = p - 0.5 * g
    }
    out g
    """, dict(a=_ab, b=_bb, x=_xb), dict(g=3.0, a=_ab - .5 * _xb, b=_bb - .5 * _xb * _xb))

# ---- section 12: `repeat` and `scan` in every derivative mode ------------------------------------------------------
# a symbolic loop edge (bound from the arrays), a stacked argument whose loop edge is not
# first in its ABI order, a carry that is also read as the scan's stacked result; every
# mode and nesting against torch.func on the unrolled loop
_x0, _V0, _tg = rn(2, 3), rn(2, 3), rn(2, 3)
_W, _bl, _VW = rn(5, 3, 3) * .5, rn(3, 5) * .3, rn(5, 3, 3)


def _loops_expected():
    torch = torch_f64()
    from torch.func import grad, jvp, vjp
    T = {k: torch.tensor(v) for k, v in dict(x0=_x0, V0=_V0, tg=_tg, W=_W, b=_bl, VW=_VW).items()}

    def run(x0, W, b):
        h, hs = x0, []
        for i in range(W.shape[0]):
            h = torch.tanh(h @ W[i] + b[:, i]) + 0.5 * h
            hs.append(h)
        return h, torch.stack(hs)

    def loss(x0, W, b):
        y, hs = run(x0, W, b)
        return ((y - T["tg"]) ** 2).sum() + (hs * hs * 0.1).sum()

    x0, W, b, VW = T["x0"], T["W"], T["b"], T["VW"]
    y, hs = run(x0, W, b)
    out = dict(y=y, hs=hs, loss=loss(x0, W, b), gx=grad(loss, 0)(x0, W, b), gW=grad(loss, 1)(x0, W, b),
               gb=grad(loss, 2)(x0, W, b),
               jx=jvp(lambda a: run(a, W, b)[0], (x0,), (T["V0"],))[1],
               jW=jvp(lambda w: run(x0, w, b)[1], (W,), (VW,))[1],
               hvp=grad(lambda w: (grad(loss, 1)(x0, w, b) * VW).sum())(W),
               hvx=jvp(lambda w: grad(loss, 0)(x0, w, b), (W,), (VW,))[1],
               mix=grad(lambda bb: (grad(loss, 0)(x0, W, bb) * T["V0"]).sum())(b),
               vj=vjp(lambda w: run(x0, w, b)[1], W)[1](hs)[0])
    return {k: v.detach().numpy() for k, v in out.items()}


case("s12_repeat_scan_every_mode", """
    dim layer, batch, c = 3
    input x0[batch, c], V0[batch, c], tgt[batch, c]
    param W[layer, c, c2: c], b[c, layer]
    input VW[layer, c, c2]
    fn blk(h, w, bb) = tanh(h @ w + bb[c -> c2])[c2 -> c] + 0.5 * h
    y = repeat[layer](blk, x0, W, b)
    hs = scan[layer](blk, x0, W, b)
    loss = sum((y - tgt) ^ 2) + sum(hs * hs * 0.1)
    out y
    out hs[layer, batch, c]
    out loss
    out gx = grad(loss, x0)
    out gW = grad(loss, W)
    out gb = grad(loss, b)
    out jx = jvp(y, x0, V0)
    out jW = jvp(hs, W, VW)
    out hvp = grad(sum(grad(loss, W) * VW), W)
    out hvx = jvp(grad(loss, x0), W, VW)
    out mix = grad(sum(grad(loss, x0) * V0), b)
    out vj = vjp(hs, W, hs)
    """, dict(x0=_x0, V0=_V0, tgt=_tg, W=_W, b=_bl, VW=_VW), _loops_expected)
# a scan over a stacked argument with its loop edge last, a scalar stacked argument, a
# prelude call with an edge parameter and a checkpoint inside the step
_h0, _xs, _al, _vl = rn(3), rn(3, 4), rn(4), rn(3)


def _scan_expected():
    torch = torch_f64()
    from torch.func import grad

    def run(h0, xs, a):
        h, hs = h0, []
        for i in range(a.shape[0]):
            h = torch.softmax(torch.tanh(h * a[i] + xs[:, i]), 0) + h * .5
            hs.append(h)
        return torch.stack(hs), h

    def loss(h0, xs, a):
        hs, y = run(h0, xs, a)
        return (hs ** 2).sum() + (y * torch.tensor(_vl)).sum()

    h0, xs, a = (torch.tensor(v) for v in (_h0, _xs, _al))
    ga = grad(loss, 2)(h0, xs, a)
    out = dict(hs=run(h0, xs, a)[0], loss=loss(h0, xs, a), g0=grad(loss, 0)(h0, xs, a), gx=grad(loss, 1)(h0, xs, a),
               ga=ga, j=(ga * a).sum(), hv=grad(lambda q: (grad(loss, 2)(h0, xs, q) * q).sum())(a))
    return {k: v.detach().numpy() for k, v in out.items()}


case("s12_scan_scalar_slices_checkpoint_prelude", """
    dim t, c = 3
    input h0[c], xs[c, t], a[t], v[c]
    fn cell(h, x, s) {
      z = checkpoint(tanh(h * s + x))
      return softmax[c](z) + h * 0.5
    }
    hs = scan[t](cell, h0, xs, a)
    loss = sum(hs ^ 2) + sum(repeat[t](cell, h0, xs, a) * v)
    out hs
    out loss
    out g0 = grad(loss, h0)
    out gx = grad(loss, xs)
    out ga = grad(loss, a)
    out j = jvp(loss, a, a)
    out hv = grad(grad(loss, a) @ a, a)
    """, dict(h0=_h0, xs=_xs, a=_al, v=_vl), _scan_expected)
# `f` must return a value with init's edges and sizes; mixed operands promote to the
# wider type: a bf16 init with f32 stacked params is an f32 carry after the first step
# (h = f(h, ...)), so the loop's result is f32 (values exact in bf16 and f32 here)
_Wp = np.arange(6.0).reshape(3, 2)
case("s12_carry_promoted_by_the_step", """
    dim l = 3, c = 2
    input h0: bf16[c]
    input W[l, c]
    fn f(h, w) = h * 0.5 + w
    out y = repeat[l](f, h0, W)
    out hs = scan[l](f, h0, W)
    out g = grad(sum(repeat[l](f, h0, W)), W)
    out gh = grad(sum(repeat[l](f, h0, W)), h0)
    """, dict(h0=np.array([1.0, 2.0]), W=_Wp), dict(
        y=np.array([5.125, 7.0]), hs=np.array([[0.5, 2.0], [2.25, 4.0], [5.125, 7.0]]), g=np.array([[.25] * 2, [.5] * 2, [1.] * 2]),
        gh=np.full(2, 0.125)))
# a loop inside a step (a repeat in a scan's step), a step parameter left to its default,
# and a weight every step shares passed as `W * [l = l]`, in reverse, forward and mixed modes
_h0n, _Wn, _Un, _bn = rn(3), rn(4, 3) * .5, rn(2, 4, 3) * .5, rn(4, 3) * .3
_Wi = rn(3, 3) * .5


def _nested_loops_expected():
    torch = torch_f64()
    from torch.func import grad, jvp
    h0, W, U, b, Wi = (torch.tensor(q) for q in (_h0n, _Wn, _Un, _bn, _Wi))

    def inner(h, w):
        return torch.tanh(h * w + .5)

    def run(h0, W, U):
        ys, h = [], h0
        for i in range(2):
            g = h
            for j in range(4):
                g = inner(g, U[i, j])
            h = g + h
            ys.append(h)
        z = h0
        for j in range(4):
            z = inner(z, W[j])
        y = torch.stack(ys)
        return y, z, (y ** 2).sum() + z.sum()

    def shared(Wi, b):
        h = h0
        for i in range(4):
            h = torch.tanh(h @ Wi + (b[i] * 2 + 1))
        return (h ** 2).sum()

    y, z, loss = run(h0, W, U)
    out = dict(y=y, loss=loss, gU=grad(lambda u: run(h0, W, u)[2])(U), gh=grad(lambda h: run(h, W, U)[2])(h0),
               jw=jvp(lambda w: run(h0, w, U)[1], (W,), (W,))[1], gWi=grad(shared, 0)(Wi, b), gb=grad(shared, 1)(Wi, b),
               hv=jvp(lambda bb: grad(shared, 0)(Wi, bb), (b,), (b,))[1])
    return {k: v.detach().numpy() for k, v in out.items()}


case("s12_loop_in_a_step_defaults_shared_weight", """
    dim t = 2, l = 4, c = 3
    dim c2 = 3
    input h0[c], W[l, c], U[t, l, c], Wi[c, c2], b[l, c]
    fn inner(h, w, eps = 0.5) = tanh(h * w + eps)
    fn outer(h, u) = repeat[l](inner, h, u) + h
    y = scan[t](outer, h0, U)
    z = repeat[l](inner, h0, W)
    loss = sum(y ^ 2) + sum(z)
    out y
    out loss
    out gU = grad(loss, U)
    out gh = grad(loss, h0)
    out jw = jvp(z, W, W)
    fn f(h, w, bb) = tanh(h @ w + bb[c -> c2])[c2 -> c]
    ls = sum(repeat[l](f, h0, Wi * [l = l], b * 2 + 1) ^ 2)
    out gWi = grad(ls, Wi)
    out gb = grad(ls, b)
    out hv = jvp(grad(ls, Wi), b, b)
    """, dict(h0=_h0n, W=_Wn, U=_Un, Wi=_Wi, b=_bn), _nested_loops_expected)

# ---- section 8: derivative modes nested three deep ----------------------------------------------------------------
_xd, _vd, _wd, _Ad, _ud = rn(3), rn(3), rn(3), rn(2, 3), rn(2)


def _nested_expected():
    torch = torch_f64()
    from torch.func import grad, jvp, vjp
    A, u, v, w, x = (torch.tensor(q) for q in (_Ad, _ud, _vd, _wd, _xd))

    def f(x, A=A):
        return torch.tanh(A @ (x * x)) * torch.sin(x).sum()

    out = dict(jj=jvp(lambda y: jvp(f, (y,), (v,))[1], (x,), (w,))[1],
               vjv=vjp(lambda y: jvp(f, (y,), (v,))[1], x)[1](u)[0],
               jvj=jvp(lambda y: vjp(f, y)[1](u)[0], (x,), (v,))[1],
               gvj=grad(lambda y: (vjp(f, y)[1](u)[0] * w).sum())(x),
               ggg=grad(lambda y: grad(lambda z: grad(lambda q: f(q).sum())(z) @ v)(y) @ w)(x),
               jgA=jvp(lambda a: grad(lambda q: (f(q, a) ** 2).sum())(x), (A,), (A,))[1])
    return {k: t.numpy() for k, t in out.items()}


case("s8_modes_nested_three_deep", """
    dim n = 3, m = 2
    input x[n], v[n], w[n], A[m, n], u[m]
    f = tanh(A @ (x * x)) * sum(sin(x))
    out jj = jvp(jvp(f, x, v), x, w)
    out vjv = vjp(jvp(f, x, v), x, u)
    out jvj = jvp(vjp(f, x, u), x, v)
    out gvj = grad(sum(vjp(f, x, u) * w), x)
    out ggg = grad(grad(grad(sum(f), x) @ v, x) @ w, x)
    out jgA = jvp(grad(sum(f * f), x), A, A)
    """, dict(x=_xd, v=_vd, w=_wd, A=_Ad, u=_ud), _nested_expected)
# ---- section 11: complex values against PyTorch (conjugate-Wirtinger gradients, jvp) ------------------------------
_zc, _wc, _Mc, _xc = rn(3) + 1j * rn(3), rn(3) + 1j * rn(3), rn(3, 3) + 1j * rn(3, 3), rn(3)


def _complex_expected():
    torch = torch_f64()
    from torch.func import jvp
    z, w, M, x = (torch.tensor(q, requires_grad=True) for q in (_zc, _wc, _Mc, _xc))
    L = (((torch.exp(z) * w).abs() ** 2).sum() + (torch.log(z) * w.conj()).real.sum() + (torch.sqrt(z) / w).imag.sum()
         + (M @ (z * torch.sin(z) - torch.cos(w))).abs().sum() + torch.angle(z * w).sum() + (z ** 3).real.sum()
         + (x.to(torch.complex128) * z + 2j).abs().sum())
    gz, gw, gM, gx = torch.autograd.grad(L, (z, w, M, x))
    z, w = z.detach(), w.detach()
    out = dict(L=L, gz=gz, gw=gw, gM=gM, gx=gx, ja=jvp(lambda q: q * q, (z,), (w,))[1],
               jb=jvp(lambda q: q.conj() * q, (z,), (w,))[1], jc=jvp(lambda q: torch.exp(q) + q.real, (z,), (w,))[1])
    return {k: v.detach().numpy() for k, v in out.items()}


case("s11_complex_gradients_and_tangents", """
    dim n = 3
    dim m = 3
    input z: c128[n], w: c128[n], M: c128[m, n], x[n]
    L = (sum(abs(exp(z) * w) ^ 2) + sum(real(log(z) * conj(w))) + sum(imag(sqrt(z) / w))
         + sum(abs(M @ (z * sin(z) - cos(w)))) + sum(angle(z * w)) + sum(real(z ^ 3)) + sum(abs(c128(x) * z + 2j)))
    out L
    out gz = grad(L, z)
    out gw = grad(L, w)
    out gM = grad(L, M)
    out gx = grad(L, x)
    out ja = jvp(z * z, z, w)
    out jb = jvp(conj(z) * z, z, w)
    out jc = jvp(exp(z) + real(z), z, w)
    """, dict(z=_zc, w=_wc, M=_Mc, x=_xc), _complex_expected)

# ---- section 5: comparisons, where, max/min with NaN and infinities; powers of negative bases -----------------------
_xq = np.array([np.nan, 1.0, 0.0, -np.inf, np.inf, -0.0, -2.0, -0.5])
_yq = np.array([np.nan, np.nan, 0.0, -np.inf, 1.0, 0.0, -2.0, 3.0])
with np.errstate(invalid="ignore"):
    case("s5_comparisons_nan_powers", """
        dim n = 8
        input x[n], y[n], p
        out ne = x != y
        out eq = x == y
        out lt = x < y
        out le = x <= y
        out gt = x > y
        out ge = x >= y
        out w = where(x, 1, 2)
        out mx = max(x, y)
        out mn = min(x, y)
        out rm = max[n](x)
        out a = y ^ 3
        out b = y ^ p
        out c = (-2) ^ 3 + p * 0
        out g = grad(sum(y ^ p), y)
        """, dict(x=_xq, y=_yq, p=np.array(3.0)), dict(
            ne=(_xq != _yq) * 1., eq=(_xq == _yq) * 1., lt=(_xq < _yq) * 1., le=(_xq <= _yq) * 1., gt=(_xq > _yq) * 1.,
            ge=(_xq >= _yq) * 1., w=np.where(_xq != 0, 1., 2.), mx=np.maximum(_xq, _yq), mn=np.minimum(_xq, _yq), rm=np.nan,
            a=_yq ** 3, b=_yq ** 3, c=-8.0, g=3 * _yq ** 2))

# ---- section 3: symbolic dims in dim expressions -------------------------------------------------------------------
# `/` of a symbolic dim by a literal, a product and a parenthesized sum of symbolic dims,
# `size` of each, a split and merge of a symbolic edge, a mean over a symbolic edge
_xs3, _ys3, _zs3 = rn(6, 2), rn(12), rn(15)
_mh = _xs3.reshape(2, 3, 2).mean(1)
case("s3_symbolic_dim_expressions", """
    dim c, head = 2
    dim hd = c / head
    dim a, b
    dim u = a * b
    dim w = (a + b) * 2 - 1
    input x[t: c, batch: a]
    input y[u], z[w], q[b]
    xh = x[t = hd*head + hd]
    out m = mean[hd](xh)
    out back[batch, t] = xh @ [t = hd*head + hd]
    out ys[a, b] = y[u = b*a + b]
    out n = size(w) + size(u) * 100 + size(hd) * 10000
    out gz = grad(mean(z ^ 2), z)
    out gx = grad(sum(mean[hd](xh) ^ 2), x)
    """, dict(x=_xs3, y=_ys3, z=_zs3, q=np.zeros(6)), dict(
        m=_mh, back=_xs3.T, ys=_ys3.reshape(2, 6), n=15 + 1200 + 30000, gz=2 * _zs3 / 15,
        gx=np.repeat(2 * _mh / 3, 3, axis=0)))

# ---- sections 5 and 6: renames, relations, indicators, scalars, subgradients -----------------------------------------
_A6, _x6, _w6 = rn(3, 3), rn(6), rn(2)
_win6 = np.array([[_x6[s + k] for k in range(2)] for s in range(5)])
_c6 = _win6 @ _w6
_g6 = np.zeros(6)
for _s6 in range(5):
    _g6[_s6:_s6 + 2] += 2 * _c6[_s6] * _w6
_S, _K = np.meshgrid(np.arange(5), np.arange(2), indexing="ij")
_gm6 = np.zeros((3, 3))
_gm6[np.unravel_index(_A6.argmax(), _A6.shape)] = 1
case("s5_s6_renames_relations_indicators", """
    dim n = 3, t = 6, s = 5, k = 2
    input A[i: n, j: n]
    input x[t]
    input w[k]
    input lr
    out sw = A[i -> j, j -> i]
    out sw2[i, j] = A[i -> j, j -> i] + 0 * A
    out lt[s, k] = [s < k]
    out ge[s, k] = [s >= k]
    out gt[s, k] = [s > k]
    out ne[s, k] = [s != k]
    out c1 = x @ [t = s + k] @ w
    out c2 = x[t = s + k] @ w
    out g1 = grad(sum((x @ [t = s + k] @ w) ^ 2), x)
    out g2 = grad(sum((x[t = s + k] @ w) ^ 2), x)
    out gw = grad(sum((x @ [t = s + k] @ w) ^ 2), w)
    out sc = lr @ w
    out st = grad(sum(stop(x) * x), x)
    out gm = grad(max[i, j](A), A)
    out wh = where(x - 1, 1, 0)
    out gsg = grad(sum(sign(x) + (x > 0) + abs(x)), x)
    """, dict(A=_A6, x=_x6, w=_w6, lr=np.array(.5)), dict(
        sw=_A6.T, sw2=_A6.T, lt=(_S < _K) * 1., ge=(_S >= _K) * 1., gt=(_S > _K) * 1., ne=(_S != _K) * 1., c1=_c6,
        c2=_c6, g1=_g6, g2=_g6, gw=2 * _win6.T @ _c6, sc=.5 * _w6, st=_x6, gm=_gm6, wh=(_x6 != 1) * 1.,
        gsg=np.sign(_x6)))
# edge operations in one bracket are applied together: a reindex or gather reads x's own
# edges, so a rename may take the name of an edge the reindex replaces, as `x[i -> j, j -> i]`
# swaps; a rename onto an edge the result keeps is still an error (ERRORS below)
_A7, _E7, _ids7 = rn(3, 3), rn(5, 3), np.array([4, 0], np.int32)
_r7 = np.array([[[_A7[a, s + k] for k in range(2)] for s in range(2)] for a in range(3)])
case("s6_edge_ops_in_one_bracket_apply_together", """
    dim i = 3, j = 3, s = 2, k = 2, vocab = 5, b = 2
    input A[i, j], E[vocab, i], ids: i32[b]
    out r1[j, s, k] = A[i -> j, j = s + k]
    out r2[s, k, j] = A[j = s + k, i -> j]
    out g1[b, j] = E[vocab = ids, i -> j]
    out d = grad(sum(A[i -> j, j = s + k] ^ 2), A)
    """, dict(A=_A7, E=_E7, ids=_ids7), dict(
        r1=_r7, r2=_r7.transpose(1, 2, 0), g1=_E7[_ids7],
        d=2 * _A7 * np.array([1.0, 2.0, 1.0])[None, :]))

# ---- section 7: what a function body sees ----------------------------------------------------------------------------
# the program's dims and edges (size, a reduction, a rename), an edge parameter passed on
# to another function, a local binding that takes a program binding's name
_x7 = rn(2, 3)
_e7 = np.exp(_x7)
_pd, _pb = _e7 / _e7.sum(1, keepdims=True), _e7 / _e7.sum(0, keepdims=True)
case("s7_function_scope", """
    dim b = 2, d = 3
    dim e2 = 3
    input x[b, d]
    y = x * 3
    fn sz(v) = v * size(d)
    fn sd(v) = sum[d](v)
    fn rn(v) = v[d -> e2]
    fn nrm[e](v) = v / sum[e](v)
    fn f2[q](v) = nrm[q](exp(v))
    fn loc(v) {
      y = v * 2
      return y + 1
    }
    out a = sz(x)
    out s = sd(x)
    out r[b, e2] = rn(x)
    out p = f2[d](x) + f2[b](x)
    out l = loc(x) + y
    out g = grad(sum(f2[d](x) * x), x)
    """, dict(x=_x7), dict(a=3 * _x7, s=_x7.sum(1), r=_x7, p=_pd + _pb, l=5 * _x7 + 1,
                           g=_pd + _pd * (_x7 - (_pd * _x7).sum(1, keepdims=True))))

# ---- section 11: a forward rule of several parameters, beside a reverse rule ----------------------------------------
_x11, _y11, _v11, _w11 = rn(3), rn(3), rn(3), rn(3)
case("s11_custom_jvp_of_two_parameters", """
    dim n = 3
    input x[n], y[n], v[n], w[n]
    fn mul(a, b) = a * b with jvp(da, db) = da * b + a * db with vjp(g) = (g * b, g * a)
    out t = jvp(mul(x, y), x, v)
    out t2 = jvp(mul(x, y) * mul(y, x), y, w)
    out gx = grad(sum(mul(x, y) ^ 2), x)
    out h = grad(sum(jvp(mul(x, x), x, v) * w), x)
    """, dict(x=_x11, y=_y11, v=_v11, w=_w11), dict(
        t=_v11 * _y11, t2=2 * _x11 ** 2 * _y11 * _w11, gx=2 * _x11 * _y11 ** 2, h=2 * _v11 * _w11))

# ---- running the cases --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", params(CASES))
def test_program_matches_reference(tmp_path, name, backend):
    src, inputs, expected, (rtol, atol) = CASES[name]
    expected = expected() if callable(expected) else expected
    prog = tmp_path / f"{name}.tg"
    prog.write_text(src)
    np.savez(tmp_path / "in.npz", **inputs)
    out = tmp_path / "out.npz"
    r = tgc("run", prog, "--backend", backend, "--dtype", "f64", "-o", out, "--inputs", tmp_path / "in.npz")
    assert r.exit_code == 0, r.output
    with np.load(out) as z:
        got = {k: z[k] for k in z.files}
    got = {k: v.view(ml_dtypes.bfloat16).astype(np.float64) if v.dtype.kind == "V" else v for k, v in got.items()}   # bf16
    assert sorted(got) == sorted(expected)
    for key, want in expected.items():
        want = np.asarray(want, dtype=np.complex128 if np.iscomplexobj(want) else np.float64)
        assert got[key].shape == want.shape, key
        np.testing.assert_allclose(got[key], want, rtol=rtol, atol=atol, err_msg=key)


PROMOTION = """
dim n = 4
input xb: bf16[n], xh: f16[n], y: f32[n], yd[n], zc: c64[n], zz: c128[n]
out a = xb + y
out b = xb + xh
out c = xb * 0.1
out d = bf16(y)
out e = c64(y) + xb
out f = zc + yd
out g = xh + zc
out h = f16(yd) * 2
out i = zc * zz
out j = real(zc) + xb
out k = abs(zc)
out l = f32(xb) + f64(xh)
"""
# section 11: mixed operands promote to the wider type (bf16 and f16, neither wider, to
# f32; a complex type takes the wider real part), a number written in the program does
# not widen, a conversion gives its type; in an f64 program
PROMOTED = dict(a="float32", b="float32", c="bfloat16", d="bfloat16", e="complex64", f="complex128", g="complex64",
                h="float16", i="complex128", j="float32", k="float32", l="float64")


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_operands_promote_to_the_wider_type(tmp_path, backend):
    prog = tmp_path / "p.tg"
    prog.write_text(PROMOTION)
    x = np.array([1.5, -2.25, 3.0, 0.5])
    np.savez(tmp_path / "in.npz", xb=x, xh=x, y=x, yd=x, zc=x + 1j * x[::-1], zz=x + 2j)
    r = tgc("run", prog, "--backend", backend, "--dtype", "f64", "-o", tmp_path / "o.npz", "--inputs", tmp_path / "in.npz")
    assert r.exit_code == 0, r.output
    with np.load(tmp_path / "o.npz") as z:
        got = {k: "bfloat16" if z[k].dtype.kind == "V" else z[k].dtype.name for k in z.files}
    assert got == PROMOTED

ERRORS = [  # id, source, line, column, words
    # section 10's errors inside section 12's forms: located in the block or at the call
    ("for_unknown_name", "dim n = 2\nparam a[n]\ninput x[n]\nloss = sum(a * x)\nfor p in params {\n"
     "  g = grad(loss, p) * zz\n  update p = p - g\n}\n", 6, 23, "unknown name 'zz'"),
    ("for_grad_of_a_local", "dim n = 2\nparam a[n]\ninput x[n]\nloss = sum(a * x)\nfor p in params {\n"
     "  g = grad(loss, p)\n  h = grad(sum(g), g)\n  update p = p - h\n}\n", 7, 20, "not an input"),
    ("for_update_of_an_input", "dim n = 2\nparam a[n]\ninput x[n]\nfor p in params {\n  update x = x * 2\n}\n",
     5, 10, "input"),
    ("member_outside_a_block", "dim n = 2\nparam a[n]\nout y = [p in a] * a\n", 3, 10, "outside"),
    ("repeat_of_an_unknown_step", "dim l = 2, n = 2\ninput x[n], w[l, n]\nout y = repeat[l](nofn, x, w)\n",
     3, 19, "name of a function"),
    ("repeat_step_changes_the_edges", "dim l = 2, n = 2, m = 3\ninput x[n], w[l, m]\nfn f(h, a) = h * a\n"
     "out y = repeat[l](f, x, w)\n", 4, 9, "but the carry is"),
    ("scan_over_two_edges", "dim l = 2, n = 2\ninput x[n], w[l, n]\nfn f(h, a) = h * a\nout y = scan[l, n](f, x, w)\n",
     4, 9, "one edge"),
    ("member_of_an_input", "dim n = 2\nparam a[n]\ninput u[n]\nfor p in params {\n  update p = p * [p in u]\n}\n",
     5, 24, "nor a param or state"),
    ("rename_onto_a_kept_edge", "dim i = 3, j = 4, s = 3, k = 2\ninput A[i, j]\nout y = A[i -> s, j = s + k]\n",
     3, 23, "which the tensor already has"),
    ("rename_and_reindex_one_edge", "dim i = 3, j = 3, s = 2, k = 2, u = 3\ninput A[i, j]\nout y = A[j -> u, j = s + k]\n",
     3, 19, "both renamed and indexed"),
]


@pytest.mark.parametrize("name,src,line,col,words", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_program_is_located(tmp_path, name, src, line, col, words):
    assert_located(tmp_path, src, line, col, words)
