"""f32 numerics of long reductions, long contractions, loops over many steps, index ops,
norms, log-domain idioms and their second derivatives, against PyTorch float32.

The third file of the f32 suite (with `test_numerics_f32.py`, adversarial inputs, and
`test_numerics_f32_idioms.py`, everyday programs): what those leave out.

- reductions over long edges: sums, means and logsumexp over 10^6 .. 10^7 elements, and
  sums along a leading edge of 10^6 rows (PyTorch's CPU sum is a cascade of f32 partial
  sums: its error grows like log n, a plain running f32 sum's like n);
- products whose contraction is 10^5 long, and a vocabulary of 50257 (GPT-2's);
- norms: l2 norm, normalize, cosine similarity, at ordinary and tiny scales;
- log-domain idioms at extreme inputs (log-sigmoid, softplus, binary cross entropy with
  logits, entropy and KL of softmaxes) with first and second derivatives, and forward
  over reverse;
- `max[e]` with ties (the gradient shared evenly, PyTorch's amax) and two-argument `max`
  with ties (to the first argument);
- gathers with repeated ids (the backward is a scatter-add of many rows into few);
- loops: a cumulative sum and a tanh RNN over 1000 steps, a residual repeat over 100
  layers, values and gradients; a scan's cumulative sum over 10^4 steps, and over 4000
  with its gradient, against torch.cumsum (a scan's f32 running sum is compensated:
  tgc/opt/carry_sums.py);
- a transformer MLP at width 768.

The rule is the suite's (`numerics_util`): inputs rounded to float32 once; want = the
hand-written PyTorch reference in float64; PASS when tgc's f32 error is at most 10x
PyTorch float32's, or at most 1e-6. A loop's reference is the same loop written in
PyTorch (what a user would write).

`python tests/e2e/test_numerics_f32_probe.py [backend ...]` prints the table.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is a test oracle only: install torch==2.13.0 to run these")
import torch.nn.functional as F  # noqa: E402

TESTS = str(Path(__file__).resolve().parents[1])
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
from numerics_util import (BACKENDS, Case, assert_not_worse_than_torch, case_registry, compare,  # noqa: E402
                           grads, leaves, normal, rng)

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

CASES: list[Case] = []
case = case_registry(CASES)


# ================================================================ long reductions

N7 = 10_000_000
N6 = 1_000_000


@case("sum_mean_1e7_uniform", f"""
dim n = {N7}
input x[n]
out s = sum(x)
out m = mean(x)
""", {"x": rng(101).uniform(size=N7)})
def _(T):
    return {"s": T.x.sum(), "m": T.x.mean()}


@case("sum_1e7_squares", f"""
dim n = {N7}
input x[n]
out s = sum(x * x)
out r = sqrt(sum(x * x))
""", {"x": normal(102, N7)})
def _(T):
    return {"s": (T.x * T.x).sum(), "r": torch.sqrt((T.x * T.x).sum())}


@case("logsumexp_1e6", f"""
dim n = {N6}
input x[n]
l = logsumexp[n](x)
out l
out gx[n] = grad(l, x)
""", {"x": normal(103, N6, 2.0)})
def _(T):
    (x,) = leaves(T.x)
    l = torch.logsumexp(x, 0)
    (gx,) = grads(l, (x,))
    return {"l": l, "gx": gx}


@case("sum_leading_edge_1e6_rows", f"""
dim n = {N6}, c = 4
input x[n, c]
out s[c] = sum[n](x)
out m[c] = mean[n](x)
""", {"x": rng(104).uniform(size=(N6, 4)) + np.array([0.0, 1.0, 10.0, 100.0])})
def _(T):
    return {"s": T.x.sum(0), "m": T.x.mean(0)}


@case("mean_rows_of_1e5", """
dim b = 16, n = 100000
input x[b, n]
out m[b] = mean[n](x)
out s[b] = sum[n](x * x)
""", {"x": rng(105).uniform(size=(16, 100000)) + 1.0})
def _(T):
    return {"m": T.x.mean(1), "s": (T.x * T.x).sum(1)}


@case("sum_log_1e6", f"""
dim n = {N6}
input x[n]
out s = sum(log(x))
out g[n] = grad(sum(log(x)) ^ 2, x)
""", {"x": rng(106).uniform(0.5, 2.0, size=N6)})
def _(T):
    (x,) = leaves(T.x)
    s = torch.log(x).sum()
    (g,) = grads(s ** 2, (x,))
    return {"s": s, "g": g}


@case("logsumexp_leading_edge_1e6", f"""
dim n = {N6}, c = 4
input x[n, c], w[c]
l = logsumexp[n](x)
out l[c]
out gx[n, c] = grad(sum(l * w), x)
""", {"x": normal(153, (N6, 4), 3.0), "w": normal(154, 4)})
def _(T):
    (x,) = leaves(T.x)
    l = torch.logsumexp(x, 0)
    (gx,) = grads((l * T.w).sum(), (x,))
    return {"l": l, "gx": gx}


@case("token_loss_mean_64x256_vocab_65", """
dim b = 64, t = 256, v = 65
input x[b, t, v], y[b, t, v]
loss = mean[b, t](cross_entropy[v](x, y))
out loss
out gx[b, t, v] = grad(loss, x)
""", {"x": normal(155, (64, 256, 65), 2.0), "y": np.eye(65)[rng(156).integers(0, 65, (64, 256))]})
def _(T):
    (x,) = leaves(T.x)
    loss = F.cross_entropy(x.reshape(-1, 65), T.y.reshape(-1, 65).argmax(-1))
    (gx,) = grads(loss, (x,))
    return {"loss": loss, "gx": gx}


# ================================================================ long contractions

@case("matmul_k_1e5", """
dim b = 4, k = 100000, o = 8
input x[b, k], ct[b, o]
param W[k, o]
y = x @ W
out y[b, o]
out dW[k, o] = grad(sum(y * ct), W)
""", {"x": rng(107).uniform(size=(4, 100000)), "ct": normal(108, (4, 8)),
      "W": rng(109).uniform(size=(100000, 8))})
def _(T):
    (W,) = leaves(T.W)
    y = T.x @ W
    (dW,) = grads((y * T.ct).sum(), (W,))
    return {"y": y, "dW": dW}


@case("dot_1e6_positive", f"""
dim n = {N6}
input a[n], b[n]
out d = a @ b
""", {"a": rng(110).uniform(size=N6), "b": rng(111).uniform(size=N6)})
def _(T):
    return {"d": T.a @ T.b}


@case("cross_entropy_vocab_50257", """
dim b = 4, v = 50257
input x[b, v], y[b, v]
loss = mean[b](cross_entropy[v](x, y))
out loss
out gx[b, v] = grad(loss, x)
""", {"x": normal(112, (4, 50257), 4.0), "y": np.eye(50257, dtype=np.float32)[[3, 50000, 17, 2048]]})
def _(T):
    (x,) = leaves(T.x)
    loss = F.cross_entropy(x, T.y.argmax(-1))
    (gx,) = grads(loss, (x,))
    return {"loss": loss, "gx": gx}


# ================================================================ norms

@case("l2_normalize_768", """
dim b = 32, d = 768
input x[b, d], ct[b, d]
nrm = sqrt(sum[d](x * x))
y = x / max(nrm, 1e-12)
out nrm
out y[b, d]
out gx[b, d] = grad(sum(y * ct), x)
""", {"x": normal(113, (32, 768), 3.0), "ct": normal(114, (32, 768))})
def _(T):
    (x,) = leaves(T.x)
    nrm = torch.linalg.vector_norm(x, dim=-1)
    y = F.normalize(x, dim=-1, eps=1e-12)
    (gx,) = grads((y * T.ct).sum(), (x,))
    return {"nrm": nrm, "y": y, "gx": gx}


@case("cosine_similarity_near_parallel", """
dim b = 16, d = 768
input a[b, d], e[b, d]
bb = a + e
c = sum[d](a * bb) / (sqrt(sum[d](a * a)) * sqrt(sum[d](bb * bb)))
out c
out ga[b, d] = grad(sum(c), a)
""", {"a": normal(115, (16, 768)), "e": normal(116, (16, 768), 1e-3)})
def _(T):
    (a,) = leaves(T.a)
    bb = a + T.e
    c = (a * bb).sum(-1) / (torch.sqrt((a * a).sum(-1)) * torch.sqrt((bb * bb).sum(-1)))
    (ga,) = grads(c.sum(), (a,))
    return {"c": c, "ga": ga}


# ================================================================ log-domain idioms at extremes

_ext = np.concatenate([[-200.0, -90.0, -40.0, -20.0, -1e-4, -1e-8, 0.0, 1e-8, 1e-4, 20.0, 40.0, 90.0, 200.0],
                       normal(117, 51, 8.0)])
_ext_w = normal(118, 64)


@case("logsigmoid_softplus_extremes", """
dim n = 64
input x[n], w[n]
ls = -softplus(-x)
sp = softplus(x)
out ls
out sp
out gls = grad(sum(w * ls), x)
out gsp = grad(sum(w * sp), x)
""", {"x": _ext, "w": _ext_w}, elementwise=True)
def _(T):
    (x,) = leaves(T.x)
    ls = F.logsigmoid(x)
    sp = F.softplus(x, beta=1, threshold=1000.0)
    gls, gsp = grads((T.w * ls).sum(), (x,))[0], grads((T.w * F.softplus(x, threshold=1000.0)).sum(), (x,))[0]
    return {"ls": ls, "sp": sp, "gls": gls, "gsp": gsp}


@case("softplus_second_derivative", """
dim n = 64
input x[n]
out h = grad(sum(grad(sum(softplus(x)), x)), x)
out s = grad(sum(sigmoid(x)), x)
""", {"x": _ext})
def _(T):
    (x,) = leaves(T.x)
    (g,) = grads(F.softplus(x, threshold=1000.0).sum(), (x,), create_graph=True)
    (h,) = grads(g.sum(), (x,))
    (x2,) = leaves(T.x)
    (s,) = grads(torch.sigmoid(x2).sum(), (x2,))
    return {"h": h, "s": s}


@case("bce_with_logits_extremes_d2", """
dim n = 64
input x[n], y[n]
l = sum(softplus(x) - x * y)
out l
out g = grad(l, x)
out h = grad(sum(grad(l, x) * y), x)
""", {"x": _ext, "y": rng(119).uniform(size=64)})
def _(T):
    (x,) = leaves(T.x)
    l = F.binary_cross_entropy_with_logits(x, T.y, reduction="sum")
    (g,) = grads(l, (x,), create_graph=True)
    (h,) = grads((g * T.y).sum(), (x,))
    return {"l": l, "g": g, "h": h}


@case("entropy_kl_softmax_d2", """
dim b = 8, v = 512
input x[b, v], q[b, v], u[b, v]
p = softmax[v](x)
lp = log_softmax[v](x)
lq = log_softmax[v](q)
kl = sum(p * (lp - lq))
out kl
out gx[b, v] = grad(kl, x)
out hvp[b, v] = grad(sum(grad(kl, x) * u), x)
""", {"x": normal(120, (8, 512), 2.0), "q": normal(121, (8, 512), 2.0), "u": normal(122, (8, 512))})
def _(T):
    (x,) = leaves(T.x)
    kl = F.kl_div(F.log_softmax(T.q, -1), F.log_softmax(x, -1), reduction="sum", log_target=True)
    (gx,) = grads(kl, (x,), create_graph=True)
    (hvp,) = grads((gx * T.u).sum(), (x,))
    return {"kl": kl, "gx": gx, "hvp": hvp}


@case("forward_over_reverse_mlp", """
dim b = 32, i = 64, h = 128
input x[b, i], y[b], V[i, h]
param W[i, h], w2[h]
loss = mean((tanh(x @ W) @ w2 - y) ^ 2)
out hv[i, h] = jvp(grad(loss, W), W, V)
out rr[i, h] = grad(sum(grad(loss, W) * V), W)
""", {"x": normal(123, (32, 64)), "y": normal(124, 32), "V": normal(125, (64, 128)),
      "W": normal(126, (64, 128), 0.125), "w2": normal(127, 128, 0.1)})
def _(T):
    def g(W):
        (W,) = leaves(W) if not W.requires_grad else (W,)
        loss = ((torch.tanh(T.x @ W) @ T.w2 - T.y) ** 2).mean()
        return torch.autograd.grad(loss, (W,), create_graph=True)[0]

    hv = torch.func.jvp(lambda W: torch.func.grad(
        lambda W: ((torch.tanh(T.x @ W) @ T.w2 - T.y) ** 2).mean())(W), (T.W,), (T.V,))[1]
    (W,) = leaves(T.W)
    gw = g(W)
    (rr,) = grads((gw * T.V).sum(), (W,))
    return {"hv": hv, "rr": rr}


# ================================================================ ties in max

_ties = np.tile(np.array([1.0, 3.0, 3.0, -2.0, 3.0, 0.5, 0.0, 0.0]), (4, 1)) + np.arange(4)[:, None] * 0.0
_ties[1] = [0.0, 0.0, 0.0, 0.0, -1.0, -1.0, -5.0, 0.0]


@case("max_reduction_ties_grad", """
dim b = 4, n = 8
input x[b, n], w[b]
m = max[n](x)
out m
out gx[b, n] = grad(sum(w * m), x)
""", {"x": _ties, "w": np.array([1.0, -2.0, 0.5, 3.0])})
def _(T):
    (x,) = leaves(T.x)
    m = torch.amax(x, -1)
    (gx,) = grads((T.w * m).sum(), (x,))
    return {"m": m, "gx": gx}


@case("max_two_args_ties_grad", """
dim n = 8
input a[n], b[n]
y = max(a, b) + min(a, b) * 2
out y
out ga = grad(sum(y * y), a)
out gb = grad(sum(y * y), b)
""", {"a": np.array([1.0, 2.0, -3.0, 0.0, 5.0, 5.0, -1.0, 7.0]),
      "b": np.array([1.0, 3.0, -3.0, 0.0, 4.0, 5.0, -2.0, 7.0])})
def _(T):
    a, b = leaves(T.a, T.b)
    ge = a >= b           # a tie goes to the first argument of max and of min
    mx = torch.where(ge, a, b)
    mn = torch.where(a <= b, a, b)
    y = mx + mn * 2
    ga, gb = grads((y * y).sum(), (a, b))
    return {"y": y, "ga": ga, "gb": gb}


# ================================================================ gathers with repeated ids

_ids = rng(128).integers(0, 16, size=(64, 1024)).astype(np.int32)


@case("gather_repeated_ids_grad", """
dim b = 64, t = 1024, vocab = 16, d = 32
input ids: i32[b, t]
input ct[b, t, d]
param E[vocab, d]
x = E[vocab = ids]
out x[b, t, d]
out dE[vocab, d] = grad(sum(x * ct), E)
""", {"ids": _ids, "ct": rng(129).uniform(size=(64, 1024, 32)), "E": normal(130, (16, 32))})
def _(T):
    (E,) = leaves(T.E)
    x = E[T.ids.long()]
    (dE,) = grads((x * T.ct).sum(), (E,))
    return {"x": x, "dE": dE}


@case("scatter_add_1e6_edges_into_8_nodes", f"""
dim e = {N6}, node = 8, f = 2
input dst: i32[e]
input msg[e, f]
agg = msg @ [node = dst]
out agg[node, f]
out gm[e, f] = grad(sum(agg * agg), msg)
""", {"dst": rng(157).integers(0, 8, N6).astype(np.int32), "msg": rng(158).uniform(size=(N6, 2))})
def _(T):
    (msg,) = leaves(T.msg)
    agg = torch.zeros(8, 2, dtype=msg.dtype).index_add(0, T.dst.long(), msg)
    (gm,) = grads((agg * agg).sum(), (msg,))
    return {"agg": agg, "gm": gm}


@case("scatter_add_1e6_vs_one_hot_product", f"""
dim e = {N6}, node = 8, f = 2
input dst: i32[e]
input msg[e, f]
out agg[node, f] = msg @ [node = dst]
""", {"dst": rng(157).integers(0, 8, N6).astype(np.int32), "msg": rng(158).uniform(size=(N6, 2))})
def _(T):
    # the scatter as the contraction LANGUAGE.md says it is: a product with the one-hot indicator
    return {"agg": F.one_hot(T.dst.long(), 8).to(T.msg.dtype).T @ T.msg}


@case("cross_entropy_by_ids_vocab_50257", """
dim b = 4, v = 50257
input x[b, v]
input ids: i32[b]
loss = mean[b](logsumexp[v](x) - x[v = ids])
out loss
out gx[b, v] = grad(loss, x)
""", {"x": normal(159, (4, 50257), 4.0), "ids": np.array([3, 50000, 17, 2048], np.int32)})
def _(T):
    (x,) = leaves(T.x)
    loss = F.cross_entropy(x, T.ids.long())
    (gx,) = grads(loss, (x,))
    return {"loss": loss, "gx": gx}


# ================================================================ loops over many steps

@case("scan_cumsum_1000", """
dim t = 1000, n = 8
input xs[t, n], h0[n]
fn add(h, x) = h + x
cs = scan[t](add, h0, xs)
out cs[t, n]
""", {"xs": rng(131).uniform(size=(1000, 8)), "h0": np.zeros(8)})
def _(T):
    h = torch.zeros(8, dtype=T.xs.dtype)
    outs = []
    for i in range(1000):
        h = h + T.xs[i]
        outs.append(h)
    return {"cs": torch.stack(outs)}


@case("cumsum_scan_10000_vs_torch_cumsum", """
dim t = 10000, n = 4
input xs[t, n], h0[n]
fn add(h, x) = h + x
cs = scan[t](add, h0, xs)
out cs[t, n]
""", {"xs": rng(151).uniform(size=(10000, 4)), "h0": np.zeros(4)})
def _(T):
    return {"cs": torch.cumsum(T.xs, 0)}


# its gradient: reverse mode's loop adds ct[t] into its carry, the cotangent of the step's
# carry (a running sum from the last step down, compensated as the forward one:
# tgc/opt/carry_sums.py); h0's gradient is that carry's last value, a sum of 4000 terms
@case("cumsum_scan_4000_grad_vs_torch_cumsum", """
dim t = 4000, n = 4
input xs[t, n], h0[n], ct[t, n]
fn add(h, x) = h + x
cs = scan[t](add, h0, xs)
out cs[t, n]
out gx[t, n] = grad(sum(cs * ct), xs)
out gh[n] = grad(sum(cs * ct), h0)
""", {"xs": rng(153).uniform(size=(4000, 4)), "h0": rng(154).uniform(size=4), "ct": rng(155).uniform(size=(4000, 4))})
def _(T):
    xs, h0 = leaves(T.xs, T.h0)
    cs = h0 + torch.cumsum(xs, 0)
    gx, gh = grads((cs * T.ct).sum(), (xs, h0))
    return {"cs": cs, "gx": gx, "gh": gh}


@case("cumsum_triangular_4096", """
dim t = 4096, n = 4
input xs[s: t, n]
cs = sum[s](xs * [s <= t])
out cs[t, n]
""", {"xs": rng(152).uniform(size=(4096, 4))})
def _(T):
    return {"cs": torch.cumsum(T.xs, 0)}


@case("rnn_tanh_1000_steps", """
dim t = 1000, b = 4, h = 32, i = 8
input xs[t, b, i], h0[b, h], ct[b, h]
param U[i, h], W[h, g: h]
fn cell(hh, x, U, W) = tanh(x @ U + (hh @ W)[g -> h])
hT = repeat[t](cell, h0, xs, U * [t = t], W * [t = t])
out hT[b, h]
out dU[i, h] = grad(sum(hT * ct), U)
out dW[h, g] = grad(sum(hT * ct), W)
""", {"xs": normal(132, (1000, 4, 8)), "h0": normal(133, (4, 32), 0.5), "ct": normal(134, (4, 32)),
      "U": normal(135, (8, 32), 0.3), "W": normal(136, (32, 32), 0.9 / 32 ** 0.5)})
def _(T):
    U, W = leaves(T.U, T.W)
    h = T.h0
    for s in range(1000):
        h = torch.tanh(T.xs[s] @ U + h @ W)
    dU, dW = grads((h * T.ct).sum(), (U, W))
    return {"hT": h, "dU": dU, "dW": dW}


@case("residual_repeat_100_layers", """
dim layer = 100, b = 8, d = 64
input x0[b, d], ct[b, d]
param Ws[layer, d: d, e: d], g[layer, d]
fn block(x, W, g) = x + 0.1 * tanh(rmsnorm[d](x, g) @ W)[e -> d]
y = repeat[layer](block, x0, Ws, g)
out y[b, d]
out dWs[layer, d, e] = grad(sum(y * ct), Ws)
out dx0[b, d] = grad(sum(y * ct), x0)
""", {"x0": normal(137, (8, 64)), "ct": normal(138, (8, 64)), "Ws": normal(139, (100, 64, 64), 0.125),
      "g": normal(140, (100, 64), 0.1, 1.0)})
def _(T):
    Ws, x0 = leaves(T.Ws, T.x0)
    x = x0
    for s in range(100):
        r = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * T.g[s]
        x = x + 0.1 * torch.tanh(r @ Ws[s])
    dWs, dx0 = grads((x * T.ct).sum(), (Ws, x0))
    return {"y": x, "dWs": dWs, "dx0": dx0}


# ================================================================ a transformer MLP at width 768

@case("mlp_block_768", """
dim b = 64, d = 768, f = 3072
input x[b, d], ct[b, d]
param w[d], bias[d], W1[d, f], b1[f], W2[f, e: d], b2[e]
h = gelu(layernorm[d](x, w, bias) @ W1 + b1)
y = x + (h @ W2 + b2)[e -> d]
out y[b, d]
out dW1[d, f] = grad(sum(y * ct), W1)
out dW2[f, e] = grad(sum(y * ct), W2)
out dx[b, d] = grad(sum(y * ct), x)
out dw = grad(sum(y * ct), w)
""", {"x": normal(141, (64, 768)), "ct": normal(142, (64, 768)), "w": normal(143, 768, 0.1, 1.0),
      "bias": normal(144, 768, 0.1), "W1": normal(145, (768, 3072), 0.02), "b1": normal(146, 3072, 0.02),
      "W2": normal(147, (3072, 768), 0.02), "b2": normal(148, 768, 0.02)})
def _(T):
    x, w, W1, W2 = leaves(T.x, T.w, T.W1, T.W2)
    h = F.gelu(F.layer_norm(x, (768,), w, T.bias, eps=1e-5) @ W1 + T.b1, approximate="tanh")
    y = x + (h @ W2 + T.b2)
    dW1, dW2, dx, dw = grads((y * T.ct).sum(), (W1, W2, x, w))
    return {"y": y, "dW1": dW1, "dW2": dW2, "dx": dx, "dw": dw}


# ================================================================ the tests

def test_distinct_case_ids():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


KNOWN_GAPS: dict[str, str] = {}


def _params():
    return [pytest.param(c, id=c.id, marks=[pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[c.id])]
                         if c.id in KNOWN_GAPS else []) for c in CASES]


# Known gaps of one backend: (case id, backend) -> why (strict xfail there only).
BACKEND_GAPS: dict[tuple[str, str], str] = {}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("c", _params())
def test_f32_probe_not_worse_than_torch(c, backend, request):
    if (c.id, backend) in BACKEND_GAPS:
        request.applymarker(pytest.mark.xfail(strict=True, reason=BACKEND_GAPS[(c.id, backend)]))
    assert_not_worse_than_torch(c, backend)


# Long f32 sums within a couple of ulps of the exact sum. The suite's rule lets an error
# under 1e-6 pass whatever PyTorch's; at 10^7 terms PyTorch's cascade sum is within an ulp
# or so, and a sum over blocks of rows (a scalar loss over [b, v], a sum of squares split
# between threads) must be as good: its partial sums and their total are rounded once each.
_KL_SRC = """
dim b = 8, v = 512
input x[b, v], q[b, v], u[b, v]
p = softmax[v](x)
lp = log_softmax[v](x)
lq = log_softmax[v](q)
kl = sum(p * (lp - lq))
out kl
out gx[b, v] = grad(kl, x)
out hvp[b, v] = grad(sum(grad(kl, x) * u), x)
"""


def _ulps(got, want):
    return abs(float(got) - want) / float(np.spacing(np.float32(abs(want))))


def _run(src, backend, inputs):
    c = Case("ulps", src, inputs, lambda T: {})
    from numerics_util import tgc_outputs
    return tgc_outputs(c, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sum_of_squares_2e6_within_an_ulp(backend):
    n = 2_000_000
    src = f"dim n = {n}\ninput x[n]\nout s = sum(x * x)\nout t = sum(x)\n"
    worst = []
    for seed in range(4):
        x = (rng(300 + seed).standard_normal(n) + 0.3).astype(np.float32)
        got = _run(src, backend, {"x": x})
        x64 = x.astype(np.float64)
        worst.append((_ulps(got["s"], float((x64 * x64).sum())), _ulps(got["t"], float(x64.sum()))))
    assert max(max(w) for w in worst) <= 1.0, worst


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_over_blocks_within_two_ulps(backend):
    errs = []
    for seed in range(4):
        x = (2 * rng(120 + 10 * seed).standard_normal((8, 512))).astype(np.float32)
        q = (2 * rng(121 + 10 * seed).standard_normal((8, 512))).astype(np.float32)
        got = _run(_KL_SRC, backend, {"x": x, "q": q, "u": x})
        X, Q = torch.from_numpy(x).double(), torch.from_numpy(q).double()
        want = float(F.kl_div(F.log_softmax(Q, -1), F.log_softmax(X, -1), reduction="sum", log_target=True))
        errs.append(_ulps(got["kl"], want))
    assert max(errs) <= 2.0, errs


def test_scatter_add_1e6_on_cuda_sim():
    """The CUDA kernels' f32 scatter-add of many terms per element adds f64 atomics into
    a scratch of doubles, each element rounded once (f32 atomics into the output:
    1.1e-5 for 10^6 messages into 8 nodes, 18x PyTorch's one-hot product)."""
    assert_not_worse_than_torch(next(c for c in CASES if c.id == "scatter_add_1e6_vs_one_hot_product"), "cuda-sim")


@pytest.mark.slow
@pytest.mark.parametrize("cid", ["cumsum_scan_10000_vs_torch_cumsum", "cumsum_scan_4000_grad_vs_torch_cumsum"])
def test_cumsum_scan_on_cuda_sim(cid):
    """The compensated running sum of a scan (tgc/opt/carry_sums.py) in the CUDA kernels'
    code: nvcc contracts no addition of it, so the two-sum's roundings are as written."""
    assert_not_worse_than_torch(next(c for c in CASES if c.id == cid), "cuda-sim")


@pytest.mark.parametrize("backend", BACKENDS)
def test_logsumexp_all_minus_inf_row_zero_cotangent(backend):
    """LANGUAGE.md section 8: a zero cotangent contributes exactly zero. A row of all -inf
    has softmax weights exp(-inf - -inf) = NaN; the logsumexp rule's guarded product
    (mul0) gives 0 there where the cotangent is 0 (PyTorch's backward gives NaN). The row
    is filled with -inf by the program (inputs are assumed finite: docs/optimization.md),
    row 0 by a subtracted fill, row 1's middle element by `where`."""
    src = """
dim b = 2, v = 3
input x[b, v]
xm = where([b = 1] * [v = 1], -inf, x - inf * [b = 0])
l = logsumexp[v](xm)
out l
out g[b, v] = grad(sum(where(l > -inf, l, 0)), x)
"""
    x = np.array([[0.5, 2.0, -1.0], [0.0, 3.0, 1.0]], np.float32)
    got = _run(src, backend, {"x": x})
    assert np.isneginf(got["l"][0])
    np.testing.assert_allclose(got["g"][1], [0.26894142, 0.0, 0.73105858], rtol=1e-6)
    np.testing.assert_array_equal(got["g"][0], [0.0, 0.0, 0.0])


if __name__ == "__main__":
    import time
    want = sys.argv[1:] or list(BACKENDS)
    only = None
    if want and want[0].startswith("case="):
        only = set(want[0][5:].split(","))
        want = want[1:] or list(BACKENDS)
    for c in CASES:
        if only and c.id not in only:
            continue
        for bk in want:
            t0 = time.time()
            try:
                rs = compare(c, bk)
            except Exception as e:  # noqa: BLE001
                print(f"{c.id:34s} {bk:8s} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            for r in rs:
                ratio = r.tgc_err / r.torch_err if r.torch_err else float("inf")
                print(f"{c.id:34s} {bk:8s} {r.name:6s} tgc {r.tgc_err:9.3g} torch {r.torch_err:9.3g} "
                      f"ratio {ratio:8.3g} {'ok' if r.passed else 'FAIL'} {r.where} ({time.time() - t0:.1f}s)",
                      flush=True)
