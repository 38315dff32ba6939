"""Hand-written numpy contenders: forward and the analytic backward of every workload.

Each function takes the workload's arrays (a dict, names as in the .tg file) and
returns the outputs the .tg file returns, under the same names. Training steps
(`mlp_step`, `gpt_step`) update their parameters in place, as the tgc program's
`update`s do, and return the loss plus every updated parameter.

The same code, run on float64 copies of the inputs, is the reference every
contender is checked against. It is written for speed as numpy allows (fused
matrix products, in-place updates, no Python loops over data), not for brevity.
"""
from __future__ import annotations

import numpy as np

K0 = 0.7978845608028654          # sqrt(2 / pi), the gelu tanh form's constant
K1 = 0.044715


# --------------------------------------------------------------- elementwise rows

def _ln_fwd(x, w, b, eps=1e-5):
    """LayerNorm over the last axis; returns y and what the backward needs."""
    mu = x.mean(-1, keepdims=True)
    xc = x - mu
    var = np.einsum("...i,...i->...", xc, xc)[..., None] / x.shape[-1]
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = np.multiply(xc, rstd, out=xc)
    return xhat * w + b, (xhat, rstd)


def _ln_bwd(dy, w, cache):
    """dx, dw, db of LayerNorm (last axis), given the upstream dy."""
    xhat, rstd = cache
    lead = tuple(range(dy.ndim - 1))
    db = dy.sum(lead)
    dw = np.einsum("ij,ij->j", dy, xhat)
    g = dy * w
    n = dy.shape[-1]
    a = g.mean(-1, keepdims=True)
    c = np.einsum("...i,...i->...", g, xhat)[..., None] / n
    g -= a
    g -= xhat * c
    g *= rstd
    return g, dw, db


def layernorm(a):
    y, cache = _ln_fwd(a["x"], a["w"], a["b"])
    dx, dw, db = _ln_bwd(a["dy"], a["w"], cache)
    return {"y": y, "dx": dx, "dw": dw, "db": db}


def _gelu_fwd(x):
    """gelu(x) (tanh form) and what its derivative needs: t = tanh(...) and x^2."""
    x2 = x * x
    t = np.tanh(K0 * x * (1 + K1 * x2))
    y = 0.5 * x * (1 + t)
    return y, t, x2


def _gelu_grad(x, dy, t, x2):
    """dy * gelu'(x), gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) K0 (1 + 3 K1 x^2)."""
    d = (1 - t * t) * (0.5 * K0) * x * (1 + 3 * K1 * x2)
    d += 0.5 * (1 + t)
    d *= dy
    return d


def gelu(a):
    y, t, x2 = _gelu_fwd(a["x"])
    return {"y": y, "dx": _gelu_grad(a["x"], a["dy"], t, x2)}


def _softmax(x):
    e = x - x.max(-1, keepdims=True)
    np.exp(e, out=e)
    e /= e.sum(-1, keepdims=True)
    return e


def softmax(a):
    y = _softmax(a["x"])
    s = np.einsum("ij,ij->i", a["dy"], y)[:, None]
    dx = a["dy"] - s
    dx *= y
    return {"y": y, "dx": dx}


def hvp(a):
    # H v = sum_c(y) * (p v - p sum_c(p v)),  p = softmax(x)
    p = _softmax(a["x"])
    pv = p * a["v"]
    s = pv.sum(-1, keepdims=True)
    p *= s
    pv -= p
    pv *= a["y"].sum(-1, keepdims=True)
    return {"hv": pv}


# --------------------------------------------------------------- conv1d

PAD = 2


def _im2col(x, k):
    """x[B, C, L] padded by PAD -> cols[B, C*k, L] with cols[b, c*k + j, s] = xpad[b, c, s + j]."""
    B, C, L = x.shape
    xp = np.zeros((B, C, L + k - 1), x.dtype)
    xp[:, :, PAD:PAD + L] = x
    win = np.lib.stride_tricks.sliding_window_view(xp, L, axis=2)      # [B, C, k, L] view
    return win.reshape(B, C * k, L)                                    # one copy


def conv1d(a):
    x, K, dy = a["x"], a["K"], a["dy"]
    co, ci, k = K.shape
    cols = _im2col(x, k)                                               # [B, ci*k, L]
    Km = K.reshape(co, ci * k)
    y = np.matmul(Km, cols)                                            # [B, co, L]
    dK = np.matmul(dy, cols.transpose(0, 2, 1)).sum(0).reshape(co, ci, k)
    # dx[b, c, t] = sum_{o, j} dy[b, o, t + PAD - j] K[o, c, j]: a convolution of dy, flipped kernel
    Kf = np.ascontiguousarray(K[:, :, ::-1].transpose(1, 0, 2)).reshape(ci, co * k)
    dx = np.matmul(Kf, _im2col(dy, k))
    return {"y": y, "dx": dx, "dK": dK}


def _im2col2d(x, k):
    """[B, C, H, W] -> [B, C*k*k, H*W]: the k x k windows of x padded by k // 2 (stride 1)."""
    B, C, H, W = x.shape
    p = k // 2
    xp = np.zeros((B, C, H + 2 * p, W + 2 * p), x.dtype)
    xp[:, :, p:p + H, p:p + W] = x
    cols = np.empty((B, C, k, k, H, W), x.dtype)
    for i in range(k):
        for j in range(k):
            cols[:, :, i, j] = xp[:, :, i:i + H, j:j + W]
    return cols.reshape(B, C * k * k, H * W)


def conv2d(a):
    """y = conv2d(x, K) (stride 1, padding 1), dx and dK of sum(y * dy), by im2col GEMMs."""
    x, K, dy = a["x"], a["K"], a["dy"]
    B, ci, H, W = x.shape
    co, _, k, _ = K.shape
    cols = _im2col2d(x, k)                                             # [B, ci*k*k, H*W]
    y = np.matmul(K.reshape(co, ci * k * k), cols).reshape(B, co, H, W)
    dym = dy.reshape(B, co, H * W)
    dK = np.matmul(dym, cols.transpose(0, 2, 1)).sum(0).reshape(co, ci, k, k)
    # dx: dy convolved with the kernel flipped in both spatial axes, channels swapped
    Kf = np.ascontiguousarray(K[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)).reshape(ci, co * k * k)
    dx = np.matmul(Kf, _im2col2d(dy, k)).reshape(B, ci, H, W)
    return {"y": y, "dx": dx, "dK": dK}


# --------------------------------------------------------------- GCN (message passing)

def _segment_sum(values, ids, n):
    """sum of the rows of `values` by destination id: np.add.at, one row per id."""
    out = np.zeros((n,) + values.shape[1:], values.dtype)
    np.add.at(out, ids, values)
    return out


def gcn(a):
    """Two mean-aggregation graph convolutions (workloads/gcn.tg): y, and dx, dW1, dW2 of sum(y * dy)."""
    x, src, dst, dy, W1, W2 = (a[k] for k in ("x", "src", "dst", "dy", "W1", "W2"))
    n = x.shape[0]
    inv = 1 / np.maximum(np.bincount(dst, minlength=n), 1).astype(x.dtype)[:, None]
    a1 = _segment_sum((x @ W1)[src], dst, n) * inv
    h = np.maximum(a1, 0)
    y = _segment_sum((h @ W2)[src], dst, n) * inv
    g = _segment_sum((dy * inv)[dst], src, n)             # d loss / d (h @ W2)
    dW2 = h.T @ g
    da = np.where(a1 > 0, g @ W2.T, 0) * inv
    gx = _segment_sum(da[dst], src, n)                    # d loss / d (x @ W1)
    return {"y": y, "dx": gx @ W1.T, "dW1": x.T @ gx, "dW2": dW2}


# --------------------------------------------------------------- MLP training step

MLP_PARAMS = ("W1", "b1", "W2", "b2", "W3", "b3")


def mlp_step(a):
    x, y, lr = a["x"], a["y"], a["lr"]
    W1, b1, W2, b2, W3, b3 = (a[n] for n in MLP_PARAMS)
    n = x.shape[0]
    z1 = x @ W1 + b1
    h1 = np.maximum(z1, 0)
    z2 = h1 @ W2 + b2
    h2 = np.maximum(z2, 0)
    logits = h2 @ W3 + b3
    m = logits.max(1, keepdims=True)
    sh = logits - m
    lse = np.log(np.exp(sh).sum(1, keepdims=True))
    logp = sh - lse
    ysum = y.sum(1, keepdims=True)
    loss = -np.einsum("ij,ij->", y, logp) / n
    dl = (np.exp(logp) * ysum - y) / n
    dW3 = h2.T @ dl
    db3 = dl.sum(0)
    dz2 = dl @ W3.T
    dz2 *= z2 > 0
    dW2 = h1.T @ dz2
    db2 = dz2.sum(0)
    dz1 = dz2 @ W2.T
    dz1 *= z1 > 0
    dW1 = x.T @ dz1
    db1 = dz1.sum(0)
    for p, g in zip((W1, b1, W2, b2, W3, b3), (dW1, db1, dW2, db2, dW3, db3)):
        p -= lr * g
    return {"loss": np.asarray(loss, x.dtype), **{nm: a[nm] for nm in MLP_PARAMS}}


# --------------------------------------------------------------- GPT training step

GPT_LAYER = ("ln1_w", "ln1_b", "wq", "wk", "wv", "wo", "ln2_w", "ln2_b", "wfc", "bfc", "wproj", "bproj")
GPT_LAYERS = 3
GPT_HEADS = 3


def gpt_param_names(layers=GPT_LAYERS):
    return ["wte", "wpe"] + [f"l{i}_{p}" for i in range(1, layers + 1) for p in GPT_LAYER] + ["lnf_w", "lnf_b"]


def gpt_step(a, layers=GPT_LAYERS, heads=GPT_HEADS):
    """One SGD step of the GPT (benchmarks/workloads/gpt.tg); updates `a` in place."""
    loss, grads = gpt_loss_and_grads(a, layers, heads)
    for nm, gv in grads.items():
        a[nm] -= a["lr"] * gv
    return {"loss": loss, **{nm: a[nm] for nm in gpt_param_names(layers)}}


GPT_SMALL = dict(layers=1, heads=4)   # benchmarks/workloads/gpt_small.tg


def gpt_small_step(a):
    """One SGD step of the 1-layer GPT of width 64 (benchmarks/workloads/gpt_small.tg)."""
    return gpt_step(a, **GPT_SMALL)


ADAMW = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def gpt_adamw_step(a):
    """One AdamW step of the GPT (benchmarks/workloads/gpt_adamw.tg), as torch.optim.AdamW
    takes it: decoupled weight decay, then the moments, then the step with the bias
    corrections bc1 = 1 / (1 - beta1^t), bc2 = 1 / (1 - beta2^t) given as inputs."""
    loss, grads = gpt_loss_and_grads(a)
    b1, b2, eps, wd = ADAMW["beta1"], ADAMW["beta2"], ADAMW["eps"], ADAMW["weight_decay"]
    lr, c1, c2 = a["lr"], a["bc1"], a["bc2"]
    for nm, g in grads.items():
        m = a[f"m_{nm}"] = b1 * a[f"m_{nm}"] + (1 - b1) * g
        v = a[f"v_{nm}"] = b2 * a[f"v_{nm}"] + (1 - b2) * g * g
        a[nm] = a[nm] * (1 - lr * wd) - lr * (m * c1) / (np.sqrt(v * c2) + eps)
    return {"loss": loss, **{nm: a[nm] for nm in gpt_param_names()}}


def gpt_loss_and_grads(a, layers=GPT_LAYERS, heads=GPT_HEADS):
    """(loss, {param: gradient}) of the GPT's next-token cross-entropy."""
    ids, targets = a["ids"], a["targets"]
    wte, wpe = a["wte"], a["wpe"]
    B, T = ids.shape
    V, C = wte.shape
    H = heads
    hd = C // H
    M = B * T
    dt = wte.dtype
    scale = 1.0 / np.sqrt(hd)
    causal = np.triu(np.ones((T, T), bool), 1)                        # True where s > t
    L = [{p: a[f"l{i}_{p}"] for p in GPT_LAYER} for i in range(1, layers + 1)]

    def heads(z):                                                      # [M, C] -> [B, H, T, hd]
        return z.reshape(B, T, H, hd).transpose(0, 2, 1, 3)

    def merge(z):                                                      # [B, H, T, hd] -> [M, C]
        return z.transpose(0, 2, 1, 3).reshape(M, C)

    # forward
    x = (wte[ids] + wpe).reshape(M, C)
    caches = []
    for p in L:
        h, ln1 = _ln_fwd(x, p["ln1_w"], p["ln1_b"])
        wqkv = np.concatenate((p["wq"], p["wk"], p["wv"]), 1)
        qkv = h @ wqkv
        q, k, v = heads(qkv[:, :C]), heads(qkv[:, C:2 * C]), heads(qkv[:, 2 * C:])
        att = np.matmul(q, k.transpose(0, 1, 3, 2))
        att *= scale
        att[..., causal] = -np.inf
        pr = _softmax(att)
        o = merge(np.matmul(pr, v))
        xa = x + o @ p["wo"]
        h2, ln2 = _ln_fwd(xa, p["ln2_w"], p["ln2_b"])
        z = h2 @ p["wfc"] + p["bfc"]
        g, t, z2 = _gelu_fwd(z)
        x_out = xa + g @ p["wproj"] + p["bproj"]
        caches.append((h, ln1, q, k, v, pr, o, xa, h2, ln2, z, g, t, z2))
        x = x_out
    xf, lnf = _ln_fwd(x, a["lnf_w"], a["lnf_b"])
    logits = xf @ wte.T                                                # [M, V]
    sh = logits - logits.max(1, keepdims=True)
    e = np.exp(sh)
    se = e.sum(1, keepdims=True)
    tg = targets.reshape(M)
    rows = np.arange(M)
    loss = (np.log(se[:, 0]) - sh[rows, tg]).mean()

    # backward
    dlog = e / se
    dlog[rows, tg] -= 1
    dlog /= M
    grads = {"wte": dlog.T @ xf}
    dxf = dlog @ wte
    dx, grads["lnf_w"], grads["lnf_b"] = _ln_bwd(dxf, a["lnf_w"], lnf)
    for i in range(layers, 0, -1):
        p = L[i - 1]
        h, ln1, q, k, v, pr, o, xa, h2, ln2, z, g, t, z2 = caches[i - 1]
        G = {}
        G["bproj"] = dx.sum(0)
        G["wproj"] = g.T @ dx
        dz = _gelu_grad(z, dx @ p["wproj"].T, t, z2)
        G["bfc"] = dz.sum(0)
        G["wfc"] = h2.T @ dz
        dh2 = dz @ p["wfc"].T
        dxa, G["ln2_w"], G["ln2_b"] = _ln_bwd(dh2, p["ln2_w"], ln2)
        dxa += dx
        G["wo"] = o.T @ dxa
        do = heads(dxa @ p["wo"].T)
        dpr = np.matmul(do, v.transpose(0, 1, 3, 2))
        dv = np.matmul(pr.transpose(0, 1, 3, 2), do)
        datt = dpr - np.einsum("bhts,bhts->bht", dpr, pr)[..., None]
        datt *= pr
        datt *= scale
        dq = np.matmul(datt, k)
        dk = np.matmul(datt.transpose(0, 1, 3, 2), q)
        dqkv = np.concatenate((merge(dq), merge(dk), merge(dv)), 1)
        dwqkv = h.T @ dqkv
        G["wq"], G["wk"], G["wv"] = dwqkv[:, :C], dwqkv[:, C:2 * C], dwqkv[:, 2 * C:]
        wqkv = np.concatenate((p["wq"], p["wk"], p["wv"]), 1)
        dh = dqkv @ wqkv.T
        dxi, G["ln1_w"], G["ln1_b"] = _ln_bwd(dh, p["ln1_w"], ln1)
        dxi += dxa
        dx = dxi
        grads.update({f"l{i}_{k_}": gv for k_, gv in G.items()})
    dx0 = dx.reshape(B, T, C)
    grads["wpe"] = dx0.sum(0)
    onehot = np.zeros((M, V), dt)
    onehot[rows, ids.reshape(M)] = 1
    grads["wte"] += onehot.T @ dx
    return np.asarray(loss, dt), grads
