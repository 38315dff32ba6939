"""Conformance with shared/LANGUAGE.md, through the `tgc` command line.

Each case is a program written from the reference (its examples verbatim where it has
them), inputs, and the expected outputs computed independently with numpy: einsum and
hand-written formulas, central differences in float64 for derivatives. Every case runs
as `tgc run F --inputs in.npz -o out.npz` on the interpreter and every registered
backend (`backends_util`; one that cannot run here skips, cuda-sim has its own tests); the
archive must hold exactly the outputs and update targets, in their ABI order (0-d for
scalars). Bad programs must give a located `file:LINE:COL: error:` with a caret and
exit status 1; bad inputs exit 3.
"""
from __future__ import annotations

import textwrap

import numpy as np
from pathlib import Path

import pytest
from click.testing import CliRunner
from scipy.special import erf, expit, log_softmax, logsumexp, softmax

from tgc.cli import main

from backends_util import EMULATED, backends, require

BACKENDS = ("interp", *backends(exclude=EMULATED))   # the interpreter and every registered backend (cuda-sim: its own tests)

RNG = np.random.default_rng(20240611)


def rn(*shape):
    return RNG.standard_normal(shape)


def fd(f, x, eps=1e-6):
    """The Jacobian of f at x by central differences, shape f(x).shape + x.shape."""
    x = np.asarray(x, dtype=np.float64)
    jac = np.zeros(np.shape(f(x)) + x.shape)
    for idx in np.ndindex(*x.shape):
        step = np.zeros_like(x)
        step[idx] = eps
        jac[(...,) + idx] = (np.asarray(f(x + step)) - np.asarray(f(x - step))) / (2 * eps)
    return jac


def layernorm(x, w, b, eps=1e-5):
    xc = x - x.mean(-1, keepdims=True)
    return xc / np.sqrt((xc * xc).mean(-1, keepdims=True) + eps) * w + b


def relu(x):
    return np.maximum(x, 0)


def padded(x, idx):
    return np.array([x[i] if 0 <= i < len(x) else 0.0 for i in idx])


CASES: dict[str, tuple] = {}  # id -> (source, inputs, expected, tolerance, --dim pairs)


def case(name, src, inputs, expected, tol=(1e-9, 1e-11), dims=()):
    CASES[name] = (textwrap.dedent(src), inputs, expected, tol, dims)


FD = (1e-6, 1e-7)  # for references by finite differences

# ---- section 1: the first program, verbatim ---------------------------------------------
MLP = (Path(__file__).parents[1] / "programs/spec_section1_mlp.tg").read_text()  # LANGUAGE.md section 1
_m = dict(x=rn(5, 13), y=np.eye(3)[[0, 2, 1, 1, 0]], W1=rn(13, 64) * .3, b1=rn(64), W2=rn(64, 3) * .3, b2=rn(3),
          lr=np.array(0.1))


def _mlp_loss(W1=_m["W1"], W2=_m["W2"]):
    logits = relu(_m["x"] @ W1 + _m["b1"]) @ W2 + _m["b2"]
    return np.mean(-(_m["y"] * log_softmax(logits, 1)).sum(1))


case("s1_mlp", MLP, _m, dict(loss=_mlp_loss(), dW1=fd(lambda w: _mlp_loss(W1=w), _m["W1"]),
                             W2=_m["W2"] - 0.1 * fd(lambda w: _mlp_loss(W2=w), _m["W2"])), FD)

# ---- sections 2 and 5: lexical forms and precedence ------------------------------------------
case("s5_precedence", """
    input a
    input b
    out p1 = -a ^ b
    out p2 = a ^ -b
    out p3 = 2 * -a
    out p4 = a - -b
    out p5 = a + b < b + a + 1
    out p6 = 2 ^ 3 ^ 2
    out p7 = 10 - 4 - 3
    out p8 = 12 / 3 / 2
    out p9 = a * -b ^ 2
    out p10 = 1 + 2 * 3 ^ 2 - 4 / 2
    """, dict(a=np.array(1.5), b=np.array(2.0)),
     dict(p1=-1.5 ** 2, p2=1.5 ** -2, p3=-3.0, p4=3.5, p5=1.0, p6=512.0, p7=3.0, p8=2.0, p9=-6.0, p10=17.0))
_x4 = rn(4)
case("s2_numbers", """
    dim n = 4
    input x[n]
    out a = 3 + 0.5 + 1e-5 + 1e5 + 2.5e-3
    out b = exp(-inf) + 0 * x
    out c = max(x, -inf) + min(x, inf)
    out d = (inf > 1e38) + (-inf < -1e38)
    """, dict(x=_x4), dict(a=3 + .5 + 1e-5 + 1e5 + 2.5e-3, b=np.zeros(4), c=2 * _x4, d=2.0))
_x3, _ab = rn(3), rn(3)
case("s2_names_comments_lines", """
    # a comment
    dim t = 3, t' = 3   # trailing comment
    input x[t]
    input a'b[t']
    x' = x * 2
    y = sum[      # a statement continues inside brackets
        t'        # comment inside brackets
      ](a'b[t' -> t'] *
        x'[t -> t'])
    fn f(p,
         q) {     # a block
      # a comment in a block
      r = p * q
      return r + 1
    }
    out y' = f(y, 2,)
    # the last line has no newline""", {"x": _x3, "a'b": _ab}, {"y'": 2 * (2 * _x3 @ _ab) + 1})

# ---- section 3: dims and edges -------------------------------------------------------------------
_xl, _wk, _z = rn(10), rn(3), rn(2, 4, 16)
case("s3_dims", """
    dim batch
    dim d = 64, heads = 4
    dim hd = d / heads
    dim len = 10, k = 3
    dim out_len = len - k + 1
    input x[len]
    input w[k]
    input z[batch, heads, hd]
    out y = x[len = out_len + k] @ w
    out s[hd, batch] = sum[heads](z)
    out n = size(hd) + 100 * size(out_len)
    """, dict(x=_xl, w=_wk, z=_z), dict(y=np.array([_xl[o:o + 3] @ _wk for o in range(8)]), s=_z.sum(1).T, n=816.0))
case("s3_symbolic_out_len", """
    dim len
    dim k = 3
    dim out_len = len - k + 1
    input x[len]
    input w[k]
    out y = x[len = out_len + k] @ w
    """, dict(x=_xl[:9], w=_wk), dict(y=np.array([_xl[o:o + 3] @ _wk for o in range(7)])))
_A, _B = rn(4, 4), rn(4, 4)
case("s3_s6_edge_aliases", """
    dim n = 4
    input A[i: n, j: n]
    input B[i, j]
    input u[k: n]
    out C = A[j -> k] @ A
    out D = A[j -> k] @ B
    out E[k, j] = A[j -> k] @ B
    out v = u * 1
    """, dict(A=_A, B=_B, u=_x4), dict(C=_A.T @ _A, D=(_A.T @ _B).T, E=_A.T @ _B, v=_x4))

_x8 = rn(8)
case("s6_zero_coefficient_keeps_its_edge", """
    dim t = 8, j = 2
    input x[t]
    out y[j] = x[t = 0*j + 3]
    out z[t, j] = [t = 0*j + 3]
    """, dict(x=_x8), dict(y=np.full(2, _x8[3]), z=np.tile((np.arange(8) == 3)[:, None], (1, 2)).astype(float)))

# ---- section 5: expressions -----------------------------------------------------------------------
_X = rn(3, 4)
case("s5_reductions", """
    dim i = 3, j = 4
    input x[i, j]
    out s1 = sum(x)
    out s2 = sum[i](x)
    out m1 = mean(x)
    out m2 = mean[j, i](x)
    out m3 = mean[j](x) - sum[j](x) / size(j)
    out x1 = max(x)
    out x2 = max[i](x)
    out n1 = min(x)
    out n2 = min[j](x)
    out e1 = max(0, x)
    out e2 = min(x, 0.5)
    """, dict(x=_X), dict(s1=_X.sum(), s2=_X.sum(0), m1=_X.mean(), m2=_X.mean(), m3=np.zeros(3), x1=_X.max(),
                          x2=_X.max(0), n1=_X.min(), n2=_X.min(1), e1=relu(_X), e2=np.minimum(_X, .5)))
_v, _w, _M, _q, _k = rn(3), rn(3), rn(3, 4), rn(2, 3, 5), rn(2, 4, 5)
case("s5_broadcast_contraction", """
    dim i = 3, j = 4, b = 2, t = 3, s = 4, e = 5
    input v[i]
    input w[i]
    input M[i, j]
    input q[b, t, e]
    input k[b, s, e]
    out bc = M + v
    out vv = v @ v
    out outer = v @ M[i -> i2]
    out all = M @ M
    out left = v @ w * w
    out att = sum[e](q * k)
    out att2 = dot[e](q, k)
    """.replace("dim i = 3, j = 4", "dim i = 3, j = 4, i2 = 3"),
     dict(v=_v, w=_w, M=_M, q=_q, k=_k),
     dict(bc=_M + _v[:, None], vv=_v @ _v, outer=np.einsum("i,kj->ijk", _v, _M), all=(_M * _M).sum(),
          left=(_v @ _w) * _w, att=np.einsum("bte,bse->bts", _q, _k), att2=np.einsum("bte,bse->bts", _q, _k)))
_xs = np.array([-2.0, -0.5, 0.0, 0.3, 1.7])
case("s5_elementwise", """
    dim n = 5
    input x[n]
    out a = exp(x) + log(abs(x) + 1) + sqrt(abs(x))
    out b = tanh(x) + erf(x) + sin(x) + cos(x)
    out c = abs(x) + sign(x)
    out d = where(x > 0, x, -2 * x) + where(x, 1, 2)
    out e = (x < 0) + (x <= 0) * 2 + (x > 0) * 4 + (x >= 0) * 8 + (x == 0) * 16 + (x != 0) * 32
    out f = stop(x) * 3 + x ^ 2 + 2 ^ x
    """, dict(x=_xs), dict(
        a=np.exp(_xs) + np.log(abs(_xs) + 1) + np.sqrt(abs(_xs)), b=np.tanh(_xs) + erf(_xs) + np.sin(_xs) + np.cos(_xs),
        c=abs(_xs) + np.sign(_xs), d=np.where(_xs > 0, _xs, -2 * _xs) + np.where(_xs != 0, 1., 2.),
        e=(_xs < 0) + (_xs <= 0) * 2. + (_xs > 0) * 4 + (_xs >= 0) * 8 + (_xs == 0) * 16 + (_xs != 0) * 32,
        f=3 * _xs + _xs ** 2 + 2 ** _xs))
case("s4_scalars", """
    dim n = 2
    input lr
    input v[n]
    out a = lr * 2 + 1
    out c = 3
    out e = lr * v
    """, dict(lr=np.array(0.5), v=_v[:2]), dict(a=2.0, c=3.0, e=0.5 * _v[:2]))

# ---- section 6: edge operations -----------------------------------------------------------------------
_x10, _x8 = rn(10), rn(8)
_win = np.array([[_x8[2 * s + k - 1] if 0 <= 2 * s + k - 1 < 8 else 0 for k in range(3)] for s in range(4)])
case("s6_reindex", """
    dim t = 10, s = 10, s5 = 5, p = 12
    input x[t]
    out flip = x[t = 9 - s]
    out flip2 = x @ [t = 9 - s]
    out slice = x[t = s5 + 2]
    out pad = x[t = p - 1]
    out shift = x[t = t + 1]
    out one = x[t = 3]
    """, dict(x=_x10), dict(flip=_x10[::-1], flip2=_x10[::-1], slice=_x10[2:7], pad=padded(_x10, np.arange(12) - 1),
                            shift=padded(_x10, np.arange(10) + 1), one=_x10[3]))
case("s6_stride_padding", """
    dim t = 8, s = 4, k = 3
    input x[t]
    param w[k]
    out win = x[t = 2*s + k - 1]
    out conv = x[t = 2*s + k - 1] @ w
    out gw = grad(sum((x[t = 2*s + k - 1] @ w) ^ 2), w)
    """, dict(x=_x8, w=_wk), dict(win=_win, conv=_win @ _wk, gw=2 * _win.T @ (_win @ _wk)))
_a3, _b4 = rn(3), rn(4)
for _name, _dims in (("s6_concat", "dim t1 = 3, t2 = 4"), ("s6_concat_symbolic", "dim t1, t2")):
    case(_name, f"""
        {_dims}
        dim t = t1 + t2
        input a[t1]
        input b[t2]
        out c = a[t1 = t] + b[t2 = t - size(t1)]
        out g = grad(sum(c * c * c), b)
        """, dict(a=_a3, b=_b4), dict(c=np.concatenate([_a3, _b4]), g=3 * _b4 ** 2))
_xm = rn(2, 5, 48)
case("s9_multihead_split", """
    dim c = 48, head = 3, hd = 16
    dim batch = 2, t = 5
    input x[batch, t, c]
    xh = x[c = hd*head + hd]        # edges batch, t, head, hd
    back = xh @ [c = hd*head + hd]  # and merged again: edges batch, t, c
    out xh
    out back
    out xh2[batch, t, head, hd] = xh
    """, dict(x=_xm), dict(xh=_xm.reshape(2, 5, 3, 16).transpose(2, 3, 0, 1), back=_xm.transpose(2, 0, 1),
                           xh2=_xm.reshape(2, 5, 3, 16)))
case("s6_indicators", """
    dim i = 3, j = 3, k = 3, t = 4, s = 3, w = 2, c = 6, head = 2, hd = 3
    out id = [i = j]
    out copy = [i = j = k]
    out conv = [t = s + w]
    out tri[s, t] = [s <= t]
    out merge = [c = hd*head + hd]
    """, {}, dict(id=np.eye(3), copy=np.einsum("ij,jk->ijk", np.eye(3), np.eye(3)),
                  conv=np.array([[[float(t == s + w) for w in range(2)] for s in range(3)] for t in range(4)]),
                  tri=np.array([[float(s <= t) for t in range(4)] for s in range(3)]),
                  merge=np.array([[[float(c == 3 * h + d) for d in range(3)] for h in range(2)] for c in range(6)])))
_E, _ids = rn(7, 5), np.array([[0, 6, 3], [3, 3, 1]], np.int32)
case("s6_gather", """
    dim vocab = 7, d = 5
    dim batch, seq
    input E[vocab, d]
    input ids: i32[batch, seq]
    out h = E[vocab = ids]
    out h2[batch, seq, d] = E[vocab = ids]
    out g = grad(sum(E[vocab = ids] ^ 2), E)
    """, dict(E=_E, ids=_ids), dict(h=_E[_ids].transpose(2, 0, 1), h2=_E[_ids],
                                    g=2 * np.bincount(_ids.ravel(), minlength=7)[:, None] * _E))

# ---- section 7: functions, prelude, import -------------------------------------------------------------
_xf, _wf, _bf = rn(2, 6), rn(6), rn(6)
case("s7_functions_verbatim", """
    fn relu(x) = max(0, x)          # at the tie x = 0 the gradient goes to the constant: relu'(0) = 0
    fn softmax[e](x) {
      z = exp(x - stop(max[e](x)))
      return z / sum[e](z)
    }
    fn layernorm[e](x, w, b, eps = 1e-5) {
      mu  = mean[e](x)
      xc  = x - mu
      return xc / sqrt(mean[e](xc * xc) + eps) * w + b
    }
    fn twice(x, k = x) = x + k
    dim batch = 2, d = 6
    input x[batch, d]
    input w[d]
    input b[d]
    out r = relu(x)
    out sm = softmax[d](x)
    out l1 = layernorm[d](x, w, b)
    out l2 = layernorm[d](x, w, b, eps = 0.5)
    out l3 = layernorm[d](x, w = w, b = b, eps = 0.5)
    out t = twice(x)
    """, dict(x=_xf, w=_wf, b=_bf), dict(r=relu(_xf), sm=softmax(_xf, 1), l1=layernorm(_xf, _wf, _bf),
                                         l2=layernorm(_xf, _wf, _bf, .5), l3=layernorm(_xf, _wf, _bf, .5), t=2 * _xf))
_ext = np.array([-1000.0, -30.0, -1.0, 0.0, 0.5, 30.0, 1000.0])
case("s7_prelude_activations", """
    dim n = 7
    input x[n]
    out r = relu(x)
    out sg = sigmoid(x)
    out sp = softplus(x)
    out ge = gelu(x[n = m + 2])
    out gee = gelu_erf(x)
    out si = silu(x)
    out dsg = grad(sum(sigmoid(x)), x)
    out dsp = grad(sum(softplus(x)), x)
    """.replace("dim n = 7", "dim n = 7, m = 3"), dict(x=_ext), dict(
        r=relu(_ext), sg=expit(_ext), sp=np.logaddexp(0, _ext),
        ge=0.5 * _ext[2:5] * (1 + np.tanh(np.sqrt(2 / np.pi) * (_ext[2:5] + 0.044715 * _ext[2:5] ** 3))),
        gee=0.5 * _ext * (1 + erf(_ext / np.sqrt(2))), si=_ext * expit(_ext), dsg=expit(_ext) * expit(-_ext),
        dsp=expit(_ext)))
_L = rn(3, 5) * 3
_L[0, 1], _L[1] = 800.0, -900.0
_Y = np.eye(5)[[1, 2, 4]]
case("s7_prelude_softmax_losses_norms", """
    dim b = 3, c = 5
    input x[b, c]
    input y[b, c]
    input w[c]
    out lse = logsumexp[c](x)
    out sm = softmax[c](x)
    out lsm = log_softmax[c](x)
    out ce = cross_entropy[c](x, y)
    out ms = mse(x, y)
    out ln = layernorm[c](y, w, w)
    out rms = rmsnorm[c](y, w)
    """, dict(x=_L, y=_Y, w=_wf[:5]), dict(
        lse=logsumexp(_L, 1), sm=softmax(_L, 1), lsm=log_softmax(_L, 1), ce=-(_Y * log_softmax(_L, 1)).sum(1),
        ms=((_L - _Y) ** 2).mean(), ln=layernorm(_Y, _wf[:5], _wf[:5]),
        rms=_Y / np.sqrt((_Y * _Y).mean(1, keepdims=True) + 1e-5) * _wf[:5]))
_qa, _ka, _va = rn(2, 4, 3), rn(2, 4, 3), rn(2, 4, 3)
_mask = np.tril(np.ones((4, 4))) > 0


def _attention(q, k=_ka, v=_va, masked=False):
    scores = np.einsum("bte,bse->bts", q, k) / np.sqrt(3)
    scores = np.where(_mask, scores, -np.inf) if masked else scores
    return np.einsum("bts,bse->bte", softmax(scores, 2), v)


case("s7_attention_causal", """
    dim b = 2, t = 4, e = 3
    dim s = t
    input q[b, t, e]
    input k[b, t, e]
    input v[b, t, e]
    ks = k[t -> s]
    vs = v[t -> s]
    out a = attention[s, e](q, ks, vs)
    scores = dot[e](q, ks) / sqrt(size(e))
    p = softmax[s](where([s <= t], scores, -inf))
    out am[b, t, e] = sum[s](p * vs)
    out gq = grad(sum(sum[s](p * vs) ^ 2), q)
    """, dict(q=_qa, k=_ka, v=_va), dict(a=_attention(_qa), am=_attention(_qa, masked=True),
                                         gq=fd(lambda q: (_attention(q, masked=True) ** 2).sum(), _qa)), FD)
case("s7_import", """
    import "lib/common.tg"
    input x[batch, d]
    out y = twice(x) + centre[d](x)
    out n = size(hd)
    """, dict(x=_xf[:, :4]), dict(y=3 * _xf[:, :4] - _xf[:, :4].mean(1, keepdims=True), n=2.0))
IMPORTS = {"lib/common.tg": 'import "more.tg"\ndim batch\ndim d = 4\ndim hd = d / 2\nfn twice(x) = x * 2\n',
           "lib/more.tg": "fn centre[e](x) = x - mean[e](x)\n"}

# ---- section 8: derivatives ---------------------------------------------------------------------------
# `out W` beside `update W`: the output is W before the step; the new value is W'
_w0 = rn(2)
case("s9_out_and_update_of_one_name", """
    dim a = 2
    param W[a]
    out W
    update W = W * 3 + 1
    """, dict(W=_w0), {"W": _w0, "W'": _w0 * 3 + 1})
# second derivatives where a factor is exactly 0 (found against torch.func.hessian): the
# guarded product of the chain rule was a `where` on the other factor, which has no
# derivative where that factor is 0 (the Hessian of sum(x * x) came out 0 at x = 0)
_xz, _vz = np.array([0.0, 1.0, -1.0]), np.array([1.0, 2.0, -0.5])
case("s8_second_derivatives_at_exact_zeros", """
    dim n = 3
    input x[n], v[n]
    out h1 = grad(grad(sum(x * x), x) @ v, x)
    out h2 = grad(grad(sum(x * exp(x)), x) @ v, x)
    out h3 = jvp(grad(sum(x * sin(x)), x), x, v)
    """, dict(x=_xz, v=_vz), dict(
        h1=2 * _vz, h2=(2 + _xz) * np.exp(_xz) * _vz, h3=(2 * np.cos(_xz) - _xz * np.sin(_xz)) * _vz))
# log(sigmoid) and sigmoid' far out on the tails: log(sigmoid(a)) = -softplus(-a) and
# sigmoid' = s(a) s(-a), not s (1 - s), which cancelled (a probe against torch.func found
# a relative error of 3e-4 at x = -30 and -inf at x = -360)
_xt = np.array([-30.0, -36.0, -360.0, 5.0, 40.0])
_st, _sm = 1 / (1 + np.exp(-_xt)), 1 / (1 + np.exp(_xt))
case("s8_log_sigmoid_second_derivative_on_the_tails", """
    dim n = 5
    input x[n], v[n]
    out h = grad(grad(sum(log(sigmoid(x))), x) @ v, x)
    """, dict(x=_xt, v=np.ones(5)), dict(h=-_st * _sm), tol=(1e-12, 0.0))
# x^p with p exactly 0 at run time: the term p x^(p-1) is multiplied by an exact 0, so it
# adds nothing even at x = 0 (it was 0 * inf = NaN)
_xp = np.array([0.0, 1.0, 2.0, 0.0])
case("s8_power_with_a_zero_exponent_at_run_time", """
    dim n = 4
    input x[n], p
    out dx = grad(sum(x ^ p), x)
    out t = jvp(sum(x ^ p), x, x)
    """, dict(x=_xp, p=np.array(0.0)), dict(dx=np.zeros(4), t=np.array(0.0)))
# section 11, custom derivatives: the reference's form verbatim; a tuple per parameter;
# a jvp rule; a second derivative differentiates the clause (max(-1, min(1, g)) along v)
_xc, _wc, _vc, _sc = rn(4), 3 * rn(4), rn(4), np.array(1.5)
case("s11_custom_derivatives", """
    dim n = 4
    input x[n], w[n], v[n], s
    fn clip_grad(x) = x with vjp(g) = max(-1, min(1, g))
    fn scale(x, s) = x * s with vjp(g) = (g * s, sum(g * x))
    fn cube(x) = x * x * x with jvp(dx) = 3 * x * x * dx
    out y = clip_grad(x) * w
    out dx = grad(sum(clip_grad(x) * w), x)
    out ds = grad(sum(scale(x, s) * w), s)
    out t = jvp(sum(cube(x)), x, v)
    out h = grad(sum(grad(sum(clip_grad(x) * w), x) * v), w)
    """, dict(x=_xc, w=_wc, v=_vc, s=_sc), dict(
        y=_xc * _wc, dx=np.clip(_wc, -1, 1), ds=np.sum(_xc * _wc), t=np.sum(3 * _xc ** 2 * _vc),
        h=np.where(np.abs(_wc) <= 1, _vc, 0.0)))
_xg, _Wg, _Vg, _mg = rn(2, 4), rn(4, 3) * .5, rn(4, 3), rn(3, 4)


def _tanh_loss(W, x=_xg):
    return np.sum(np.tanh(x @ W) ** 2)


def _tanh_grad(W):
    t = np.tanh(_xg @ W)
    return _xg.T @ (2 * t * (1 - t * t))


case("s8_grad_hvp", """
    dim batch = 2, features = 4, hidden = 3
    input x[batch, features]
    param W[features, hidden]
    state m[hidden, features]
    input V[features, hidden]
    input s
    loss = sum(tanh(x @ W) ^ 2)
    out dW = grad(loss * s, W)
    out ds = grad(loss * s, s)
    out dm = grad(sum(m * m), m)
    out dx = grad(loss, x)
    out hv = grad(grad(loss, W) @ V, W)
    out hv2 = jvp(grad(loss, W), W, V)
    """, dict(x=_xg, W=_Wg, m=_mg, V=_Vg, s=np.array(0.7)), dict(
        dW=0.7 * _tanh_grad(_Wg), ds=_tanh_loss(_Wg), dm=2 * _mg, dx=fd(lambda x: _tanh_loss(_Wg, x), _xg),
        hv=fd(lambda W: np.sum(_tanh_grad(W) * _Vg), _Wg), hv2=fd(lambda W: np.sum(_tanh_grad(W) * _Vg), _Wg)), FD)
_xj, _Aj, _dx, _vj = rn(3), rn(2, 3), rn(3), rn(2)
_J = fd(lambda x: np.tanh(_Aj @ x) * x.sum(), _xj)
case("s8_jacobian_jvp_vjp", """
    dim n = 3, m = 2
    input x[n]
    input A[m, n]
    input dx[n]
    input v[m]
    f = tanh(A @ x) * sum(x)
    out J = grad(f, x)
    out J2[n, m] = grad(f, x)
    out jv = jvp(f, x, dx)
    out vj = vjp(f, x, v)
    """, dict(x=_xj, A=_Aj, dx=_dx, v=_vj), dict(J=_J, J2=_J.T, jv=_J @ _dx, vj=_vj @ _J), FD)
_s = 0.3
case("s8_nested_scalar", """
    input x
    f = sin(x) * x ^ 3
    out d1 = grad(f, x)
    out d2 = grad(grad(f, x), x)
    out d3 = grad(grad(grad(f, x), x), x)
    out d2v = vjp(jvp(f, x, 1), x, 1)
    """, dict(x=np.array(_s)), dict(
        d1=np.cos(_s) * _s ** 3 + 3 * np.sin(_s) * _s ** 2,
        d2=-np.sin(_s) * _s ** 3 + 6 * np.cos(_s) * _s ** 2 + 6 * np.sin(_s) * _s,
        d3=-np.cos(_s) * _s ** 3 - 9 * np.sin(_s) * _s ** 2 + 18 * np.cos(_s) * _s + 6 * np.sin(_s),
        d2v=-np.sin(_s) * _s ** 3 + 6 * np.cos(_s) * _s ** 2 + 6 * np.sin(_s) * _s))
_tx, _ty = np.array([-1.0, 0.0, 2.0, 3.0]), np.array([-1.0, 1.0, 2.0, 0.0])
case("s8_ties_two_argument", """
    dim n = 4
    input x[n]
    input y[n]
    out gx = grad(sum(max(x, y)), x)
    out gy = grad(sum(max(x, y)), y)
    out hx = grad(sum(min(x, y)), x)
    out relu0 = grad(sum(relu(x)), x)
    out abs0 = grad(sum(abs(x) + sign(x) + (x > 0)), x)
    out jy = jvp(max(x, y), y, y * 0 + 1)
    """, dict(x=_tx, y=_ty), dict(gx=(_tx >= _ty) * 1., gy=(_tx < _ty) * 1., hx=(_tx <= _ty) * 1.,
                                  relu0=(_tx > 0) * 1., abs0=np.sign(_tx), jy=(_tx < _ty) * 1.))
_tie = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]])
case("s8_ties_reduction", """
    dim i = 2, j = 3
    input x[i, j]
    input dx[i, j]
    out gm = grad(sum(max[j](x)), x)
    out gn = grad(sum(min[j](x)), x)
    out ga = grad(max(x), x)
    out jm = jvp(max[j](x), x, dx)
    """, dict(x=_tie, dx=np.array([[0.0, 1.0, 5.0], [1.0, 2.0, 6.0]])),
     dict(gm=np.array([[0, .5, .5], [1 / 3] * 3]), gn=np.array([[1, 0, 0], [1 / 3] * 3]),
          ga=np.array([[0, .5, .5], [0, 0, 0]]), jm=np.array([3.0, 3.0])))
_xn = np.array([0.0, -1.0, 4.0])
case("s8_nan_safety", """
    dim n = 3
    input x[n]
    input z[n]
    out g1 = grad(sum(where(x > 0, sqrt(x), 0)), x)
    out g2 = grad(sum(where(x > 0, log(x), 0)), x)
    out g3 = grad(sum(0 * log(x)), x)
    out g4 = grad(sum(z * sqrt(x)), x)
    out g5 = grad(sum(where(x != 0, sin(x) / x, 1)), x)
    out g6 = jvp(where(x > 0, sqrt(x), 0), x, x * 0 + 1)
    out g7 = grad(sum(abs(x) ^ (z + 2)), z)
    """, dict(x=_xn, z=np.array([0.0, 0.0, 1.0])), dict(
        g1=[0, 0, .25], g2=[0, 0, .25], g3=[0, 0, 0], g4=[0, 0, .25], g5=[0, np.sin(1) - np.cos(1), (4 * np.cos(4) - np.sin(4)) / 16],
        g6=[0, 0, .25], g7=[0, 0, 64 * np.log(4)]))

# ---- section 9: outputs, updates, ABI order --------------------------------------------------------------
_xo, _Wo, _yo, _mo = rn(3, 4), rn(4, 2), np.eye(2)[[0, 1, 1]], rn(4, 2)


def _ce(W):
    return -(_yo * log_softmax(_xo @ W, 1)).sum(1).mean()


_go = fd(_ce, _Wo)
case("s9_out_forms_updates", """
    dim batch
    dim features = 4, classes = 2
    input x[batch, features]
    input y[batch, classes]
    param W[features, classes]
    state m[features, classes]
    input lr
    logits = x @ W
    loss = mean[batch](cross_entropy[classes](logits, y))
    out loss                        # an existing binding
    out logits[classes, batch]      # an existing binding, with its ABI order
    out dW = grad(loss, W)          # a new one
    out probs[batch, classes] = softmax[classes](logits)   # explicit ABI order
    update W = W - lr * grad(loss, W)
    update m = 0.9 * m + 0.1 * grad(loss, W)
    """, dict(x=_xo, y=_yo, W=_Wo, m=_mo, lr=np.array(0.3)), dict(
        loss=_ce(_Wo), logits=(_xo @ _Wo).T, dW=_go, probs=softmax(_xo @ _Wo, 1), W=_Wo - .3 * _go, m=.9 * _mo + .1 * _go), FD)
case("s9_updates_read_old_values", """
    dim n = 3
    param a[n]
    param b[n]
    state c[n, k: n]
    state count
    update a = b
    update b = a
    update c = 0
    update count = count + 1
    out a2 = a * 2
    """, dict(a=_a3, b=_x3, c=rn(3, 3), count=np.array(4.0)),
     dict(a=_x3, b=_a3, c=np.zeros((3, 3)), count=5.0, a2=2 * _a3))
_Wh = rn(3, 4)
case("s9_abi_order_rules", """
    dim batch = 2
    dim features = 4, hidden = 3
    input x[features, batch]
    param W[hidden, features]
    loss = sum(tanh(W @ x))
    out y = x * 1
    out x
    out dW = grad(loss, W)
    out dW2 = grad(loss, W) * 1
    out dW3[features, hidden] = grad(loss, W)
    """, dict(x=_xg.T, W=_Wh), dict(y=_xg, x=_xg, dW=(_gh := fd(lambda W: np.tanh(W @ _xg.T).sum(), _Wh)),
                                    dW2=_gh.T, dW3=_gh.T), FD)

# ---- section 11: element types, complex values -------------------------------------------------------------
_zc, _wc, _xc = rn(3) + 1j * rn(3), rn(3) + 1j * rn(3), rn(3)
_Lc = lambda z: np.sum(np.abs(z * _wc) ** 2 + np.angle(z))   # noqa: E731
case("s11_complex_values", """
    dim n = 3
    input z: c128[n]
    input w: c128[n]
    input x[n]
    out a = 2j * z + (1 + 0.5j)
    out b = real(z) - imag(w) + abs(z) + angle(w)
    out c = conj(z) * w + c64(x) + c128(x) * 1j
    out d = x + z                                  # mixed operands: the wider (complex) type
    out g = grad(sum(abs(z * w) ^ 2 + angle(z)), z)
    out v = vjp(z * w, z, w)
    """, dict(z=_zc, w=_wc, x=_xc),
     dict(a=2j * _zc + (1 + 0.5j), b=_zc.real - _wc.imag + abs(_zc) + np.angle(_wc),
          c=np.conj(_zc) * _wc + _xc + 1j * _xc, d=_xc + _zc,
          g=fd(lambda x: _Lc(x + 1j * _zc.imag), _zc.real) + 1j * fd(lambda y: _Lc(_zc.real + 1j * y), _zc.imag),
          v=_wc * np.conj(_wc)), FD)


# ---- running the cases ---------------------------------------------------------------------------------------


def tgc(*args):
    """`tgc ARGS`; with `--backend B`, a backend that cannot run here skips the test."""
    if "--backend" in args:
        require(str(args[args.index("--backend") + 1]))
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def run_case(tmp_path, name, backend, dtype):
    src, inputs, expected, tol, dims = CASES[name]
    prog = tmp_path / f"{name}.tg"
    prog.write_text(src)
    for rel, text in IMPORTS.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    np.savez(tmp_path / "in.npz", **inputs)
    out = tmp_path / "out.npz"
    args = ["run", prog, "--backend", backend, "--dtype", dtype, "-o", out, "--inputs", tmp_path / "in.npz"]
    for d, n in dims:
        args += ["--dim", f"{d}={n}"]
    r = tgc(*args)
    assert r.exit_code == 0, r.output
    with np.load(out) as z:
        got = {k: z[k] for k in z.files}
    assert sorted(got) == sorted(expected)
    return got, expected, tol


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_program_matches_numpy(tmp_path, name, backend):
    got, expected, (rtol, atol) = run_case(tmp_path, name, backend, "f64")
    for key, want in expected.items():
        want = np.asarray(want, dtype=np.complex128 if np.iscomplexobj(want) else np.float64)
        assert got[key].dtype == want.dtype, key
        assert got[key].shape == want.shape, key
        np.testing.assert_allclose(got[key], want, rtol=rtol, atol=atol, err_msg=key)


@pytest.mark.parametrize("backend", BACKENDS)
def test_f32_results_are_f32_updates_included(tmp_path, backend):
    """--dtype f32 with float64 inputs: every result, update targets too, is float32."""
    got, expected, _ = run_case(tmp_path, "s9_out_forms_updates", backend, "f32")
    for key, want in expected.items():
        assert got[key].dtype == np.float32, key
        np.testing.assert_allclose(got[key], want, rtol=3e-4, atol=3e-5, err_msg=key)


# ---- bad programs ----------------------------------------------------------------------------------------------

ERRORS = [  # id, source, line, column, words of the message
    ("unknown_name", "dim n = 3\ninput x[n]\nout y = x + q\n", 3, 13, "unknown name 'q'"),
    ("edge_two_sizes", "dim n = 3, m = 4\ninput x[i: n]\ninput y[i: m]\n", 3, 9, "two sizes"),
    ("rename_onto_existing", "dim n = 3\ninput A[i: n, j: n]\nout B = A[i -> j]\n", 3, 16, "already has"),
    ("grad_of_binding", "dim n = 3\ninput x[n]\ny = x * 2\nout g = grad(sum(y), y)\n", 4, 22, "not an input"),
    ("non_affine_reindex", "dim t = 4, s = 2\ninput x[t]\nout y = x[t = s ^ 2]\n", 3, 15, "affine"),
    ("recursive_fn", "fn f(x) = f(x) + 1\ndim n = 2\ninput x[n]\nout y = f(x)\n", 1, 11, "itself"),
    ("update_input", "dim n = 2\ninput x[n]\nupdate x = x * 2\n", 3, 8, "input"),
    ("dim_not_divide", "dim d = 10, h = 3\ndim hd = d / h\n", 2, 10, "divide"),
    ("dim_divide_by_zero_symbolic", "dim d\ndim hd = d / 0\n", 2, 10, "division by zero"),
    ("number_out_of_range", "dim n = 3\ninput x[n]\nout y = x * 1" + "0" * 400 + "\n", 3, 13, "out of range"),
    ("dim_too_large", "dim n = 99999999999999999999999\n", 1, 9, "too large"),
    ("chained_comparison", "dim n = 3\ninput x[n]\nout y = 0 < x < 1\n", 3, 15, "chain"),
    ("unknown_name_in_uncalled_fn", "fn f(a) = a + zz\n", 1, 15, "unknown name 'zz'"),
    ("unknown_fn_in_uncalled_fn", "fn f(a) = g(a)\n", 1, 11, "unknown function 'g'"),
    ("program_tensor_in_fn", "dim n = 2\ninput x[n]\nfn f(a) = a + x\n", 3, 15, "not visible"),
    ("later_binding_in_fn", "fn f(a) {\n  b = c\n  c = a\n  return b\n}\n", 2, 7, "unknown name 'c'"),
    ("reduce_param_edge_named", "dim n = 3, m = 2\ninput x[n]\nout z = softmax[m](x)\n", 3, 9, "'m' (edge parameter 'e')"),
    # a coefficient is an integer or a dim's size: `i * j` of two edges multiplies indices
    ("product_of_two_edges", "dim n = 3, t = 9\ninput A[i: n, j: n]\ninput x[t]\nout y = x[t = i * j]\n",
     4, 15, "not affine"),
    ("rename_and_reindex_one_edge", "dim t = 4, s = 2, k = 3, u = 4\ninput x[t]\nout z = x[t -> u, t = s + k]\n",
     3, 19, "both renamed and indexed"),
    ("out_takes_the_name_of_a_new_value", "dim a = 2\nparam W[a]\nout W\nout W' = W * 2\nupdate W = W + 1\n",
     4, 5, "takes the name under which the update of 'W' is returned"),
    ("custom_vjp_tuple_arity", "dim n = 3\ninput x[n], s\nfn f(a, b) = a * b with vjp(g) = g * b\nout y = f(x, s)\n",
     3, 34, "gives 1 derivative, it needs a tuple of 2"),
    ("custom_vjp_extra_edge", "dim n = 3\ninput x[n], s\nfn f(a, b) = a * b with vjp(g) = (g * b, g * a)\nout y = f(x, s)\n",
     3, 42, "has edge 'n', which 'b' lacks"),
    ("float_gather_ids", "dim v = 5, n = 3\ninput E[v]\ninput ids: f64[n]\nout y = E[v = ids]\n", 4, 15,
     "'ids' is a float tensor"),
    ("complex_output_needs_cotangent", "dim n = 3\ninput z: c64[n]\nout g = grad(sum(z * z), z)\n", 3, 9,
     "explicit cotangent"),
    ("complex_comparison", "dim n = 3\ninput z: c64[n]\nout y = max[n](z)\n", 3, 9,
     "not defined for complex values"),
]


@pytest.mark.parametrize("name,src,line,col,words", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_program_is_located(tmp_path, name, src, line, col, words):
    assert_located(tmp_path, src, line, col, words)


def assert_located(tmp_path, src, line, col, words):
    """`tgc check` of `src` fails with `file:line:col: error:`, `words` and a caret under the place."""
    prog = tmp_path / "bad.tg"
    prog.write_text(src)
    r = tgc("check", prog)
    assert r.exit_code == 1, r.output
    assert f"{prog}:{line}:{col}: error: " in r.output and words in r.output, r.output
    assert "^" in r.output


def test_import_cycle_names_every_file(tmp_path):
    (tmp_path / "a.tg").write_text('import "b.tg"\n')
    (tmp_path / "b.tg").write_text('import "a.tg"\n')
    (tmp_path / "main.tg").write_text('import "a.tg"\n')
    r = tgc("check", tmp_path / "main.tg")
    assert r.exit_code == 1 and "import cycle: main.tg -> a.tg -> b.tg -> a.tg" in r.output, r.output


@pytest.mark.parametrize("command", [["check"], ["run"], ["dump-ir"], ["grad", "--wrt", "x"]])
def test_directory_is_a_located_error(tmp_path, command):
    r = tgc(command[0], tmp_path, *command[1:])
    assert r.exit_code == 1 and f"{tmp_path}:1:1: error:" in r.output, r.output


# ---- bad inputs and the command line -------------------------------------------------------------------------------

DIMS = "dim d\ndim e = 6 / d\ndim z = d - 5\ninput x[d]\nout s = sum(x) + size(e) + size(z)\n"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d,words", [(4, "6 / d: 6 is not divisible by 4"), (3, "d - 5 is -2: sizes must be positive")])
def test_call_time_dim_errors_exit_3(tmp_path, backend, d, words):
    prog = tmp_path / "dims.tg"
    prog.write_text(DIMS)
    r = tgc("run", prog, "--backend", backend, "--random-inputs", "--dim", f"d={d}")
    assert r.exit_code == 3 and words in r.output, r.output
    np.save(tmp_path / "x.npy", np.ones(d))
    r = tgc("run", prog, "--backend", backend, "--input", f"x={tmp_path / 'x.npy'}")
    assert r.exit_code == 3 and words in r.output, r.output


@pytest.mark.parametrize("backend", BACKENDS)
def test_integer_data_for_float_inputs(tmp_path, backend):
    prog = tmp_path / "p.tg"
    prog.write_text("dim n = 3\ninput x[n]\ninput lr\nout y = x * lr\n")
    np.savez(tmp_path / "in.npz", x=np.array([1, 2, 3]), lr=np.array(2))
    r = tgc("run", prog, "--backend", backend, "--inputs", tmp_path / "in.npz", "-o", tmp_path / "o.npz")
    assert r.exit_code == 0, r.output
    np.testing.assert_array_equal(np.load(tmp_path / "o.npz")["y"], [2.0, 4.0, 6.0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_input_of_wrong_rank_exit_3(tmp_path, backend):
    prog = tmp_path / "p.tg"
    prog.write_text("dim b, n\ninput x[b, n]\ninput y[b]\nout s = sum(x) + sum(y)\n")
    np.savez(tmp_path / "in.npz", x=np.ones(3), y=np.ones(3))
    r = tgc("run", prog, "--backend", backend, "--inputs", tmp_path / "in.npz")
    assert r.exit_code == 3 and "input 'x' has 1 axes, expected 2" in r.output, r.output


def test_cli_file_problems(tmp_path):
    prog = tmp_path / "p.tg"
    prog.write_text("dim n = 3\ninput x[n]\nout y = x\n")
    np.savez(tmp_path / "in.npz", x=np.ones(3))
    r = tgc("run", prog, "--inputs", tmp_path / "in.npz", "-o", tmp_path / "no" / "such" / "o.npz")
    assert r.exit_code == 2 and f"'{tmp_path / 'no' / 'such' / 'o.npz'}'" in r.output, r.output
    r = tgc("run", prog, "--input", f"x={tmp_path / 'in.npz'}")
    assert r.exit_code == 3 and ".npz archive" in r.output, r.output


def test_grad_emit_tg_with_symbolic_sizes(tmp_path):
    """Constant terms of symbolic size are written as .tg accepts them, and compute the same."""
    prog = tmp_path / "p.tg"
    prog.write_text("dim t1, t2\ndim t = t1 + t2\ndim u = t1 * t2\ninput a[t1]\ninput b[t2]\ninput w[u]\n"
                    "c = a[t1 = t] + b[t2 = t - size(t1)]\n"
                    "out l = sum(c * c) + sum(w[u = 2*t2 - size(u) + 3] * b)\n")
    inputs = dict(a=np.arange(2.0), b=np.arange(3.0) + 1, w=np.arange(6.0))
    np.savez(tmp_path / "in.npz", **inputs)
    for mode in ("rev", "fwd"):
        g = tmp_path / f"g_{mode}.tg"
        assert tgc("grad", prog, "--wrt", "b", "--wrt", "w", "--mode", mode, "-o", g).exit_code == 0
        assert tgc("check", g).exit_code == 0, g.read_text()
        r = tgc("run", g, "--inputs", tmp_path / "in.npz", "--dtype", "f64", "-o", tmp_path / "o.npz")
        assert r.exit_code == 0, r.output
        got = np.load(tmp_path / "o.npz")
        # w[u = 2*t2 - 3]: only t2 = 2 reads w[1]; c = concat(a, b)
        np.testing.assert_allclose(got["db"], 2 * inputs["b"] + np.array([0, 0, 1.0]))
        np.testing.assert_allclose(got["dw"], [0, 3.0, 0, 0, 0, 0])
