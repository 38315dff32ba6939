"""PyTorch contenders: eager (idiomatic builtins + autograd) and torch.compile.

`make(case, arrays, compiled)` returns a zero-argument step that runs one call and
returns a dict of tensors named like the .tg outputs. Each step works on its own
copies of the arrays (training steps update them in place with a foreach SGD).
For torch.compile the forward (or, for the HVP, the whole torch.func transform) is
compiled; AOTAutograd compiles the backward on the first call, which the harness
times separately as compile time.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

if torch.get_num_threads() > 2:
    torch.set_num_threads(2)

K0, K1 = 0.7978845608028654, 0.044715


def _t(a, grad=False):
    t = torch.from_numpy(np.array(a, copy=True))
    return t.requires_grad_(True) if grad else t


def _maybe_compile(fn, compiled):
    return torch.compile(fn, dynamic=False) if compiled else fn


def layernorm(a, compiled):
    x, w, b = _t(a["x"], True), _t(a["w"], True), _t(a["b"], True)
    dy = _t(a["dy"])
    fwd = _maybe_compile(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5), compiled)

    def step():
        y = fwd(x, w, b)
        dx, dw, db = torch.autograd.grad(y, (x, w, b), dy)
        return {"y": y, "dx": dx, "dw": dw, "db": db}
    return step


def gelu(a, compiled):
    x, dy = _t(a["x"], True), _t(a["dy"])
    fwd = _maybe_compile(lambda x: F.gelu(x, approximate="tanh"), compiled)

    def step():
        y = fwd(x)
        (dx,) = torch.autograd.grad(y, (x,), dy)
        return {"y": y, "dx": dx}
    return step


def softmax(a, compiled):
    x, dy = _t(a["x"], True), _t(a["dy"])
    fwd = _maybe_compile(lambda x: torch.softmax(x, -1), compiled)

    def step():
        y = fwd(x)
        (dx,) = torch.autograd.grad(y, (x,), dy)
        return {"y": y, "dx": dx}
    return step


def hvp(a, compiled):
    y, v = _t(a["y"]), _t(a["v"])

    def loss(x):
        return -(y * torch.log_softmax(x, -1)).sum()

    if compiled:
        # AOTAutograd has no double backward: compile the torch.func transform instead.
        def gv(x):
            return (torch.func.grad(loss)(x) * v).sum()
        fn = torch.compile(torch.func.grad(gv), dynamic=False)
        x = _t(a["x"])
        return lambda: {"hv": fn(x)}
    x = _t(a["x"], True)

    def step():
        (g,) = torch.autograd.grad(loss(x), (x,), create_graph=True)
        (hv,) = torch.autograd.grad((g * v).sum(), (x,))
        return {"hv": hv}
    return step


def conv1d(a, compiled):
    x, K, dy = _t(a["x"], True), _t(a["K"], True), _t(a["dy"])
    fwd = _maybe_compile(lambda x, K: F.conv1d(x, K, padding=2), compiled)

    def step():
        y = fwd(x, K)
        dx, dK = torch.autograd.grad(y, (x, K), dy)
        return {"y": y, "dx": dx, "dK": dK}
    return step


def conv2d(a, compiled):
    x, K, dy = _t(a["x"], True), _t(a["K"], True), _t(a["dy"])
    fwd = _maybe_compile(lambda x, K: F.conv2d(x, K, padding=1), compiled)

    def step():
        y = fwd(x, K)
        dx, dK = torch.autograd.grad(y, (x, K), dy)
        return {"y": y, "dx": dx, "dK": dK}
    return step


def gcn(a, compiled):
    """index_add (scatter-add) and indexing (gather), as PyTorch Geometric's mean aggregation does."""
    x, W1, W2 = _t(a["x"], True), _t(a["W1"], True), _t(a["W2"], True)
    src, dst, dy = _t(a["src"]).long(), _t(a["dst"]).long(), _t(a["dy"])
    n = x.shape[0]

    def forward(x, W1, W2):
        deg = torch.zeros(n, dtype=x.dtype).index_add_(0, dst, torch.ones(dst.shape[0], dtype=x.dtype))
        inv = (1 / deg.clamp(min=1))[:, None]
        h = torch.relu(torch.zeros(n, W1.shape[1], dtype=x.dtype).index_add(0, dst, (x @ W1)[src]) * inv)
        return torch.zeros(n, W2.shape[1], dtype=x.dtype).index_add(0, dst, (h @ W2)[src]) * inv
    fwd = _maybe_compile(forward, compiled)

    def step():
        y = fwd(x, W1, W2)
        dx, dW1, dW2 = torch.autograd.grad(y, (x, W1, W2), dy)
        return {"y": y, "dx": dx, "dW1": dW1, "dW2": dW2}
    return step


def _sgd_step(loss_fn, params, names, lr):
    def step():
        loss = loss_fn()
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            torch._foreach_add_(params, grads, alpha=-lr)
        return {"loss": loss.detach(), **dict(zip(names, params))}
    return step


MLP_PARAMS = ("W1", "b1", "W2", "b2", "W3", "b3")


def mlp(a, compiled):
    x, y = _t(a["x"]), _t(a["y"])
    params = [_t(a[n], True) for n in MLP_PARAMS]

    def loss(x, y, W1, b1, W2, b2, W3, b3):
        h = torch.relu(torch.addmm(b1, x, W1))
        h = torch.relu(torch.addmm(b2, h, W2))
        return F.cross_entropy(torch.addmm(b3, h, W3), y)          # probability targets, mean over rows
    fwd = _maybe_compile(loss, compiled)
    return _sgd_step(lambda: fwd(x, y, *params), params, MLP_PARAMS, float(a["lr"]))


def gpt(a, compiled, layers=3, heads=3):
    names, ids, targets, params, fwd = _gpt_model(a, compiled, layers, heads)
    return _sgd_step(lambda: fwd(ids, targets, *params), params, names, float(a["lr"]))


def gpt_adamw(a, compiled, layers=3, heads=3):
    """The GPT with torch.optim.AdamW(foreach=True), its state set to the arrays' moments
    at step t, where the inputs' bias corrections bc1 = 1 / (1 - beta1^t) put it."""
    from ref_numpy import ADAMW
    names, ids, targets, params, fwd = _gpt_model(a, compiled, layers, heads)
    b1, b2 = ADAMW["beta1"], ADAMW["beta2"]
    t = round(float(np.log(1 - 1 / float(a["bc1"])) / np.log(b1)))
    opt = torch.optim.AdamW(params, lr=float(a["lr"]), betas=(b1, b2), eps=ADAMW["eps"],
                            weight_decay=ADAMW["weight_decay"], foreach=True)
    for p, n in zip(params, names):
        opt.state[p] = {"step": torch.tensor(float(t - 1)), "exp_avg": _t(a[f"m_{n}"]),
                        "exp_avg_sq": _t(a[f"v_{n}"])}

    def step():
        opt.zero_grad(set_to_none=True)
        loss = fwd(ids, targets, *params)
        loss.backward()
        opt.step()
        return {"loss": loss.detach(), **dict(zip(names, params))}
    return step


def _gpt_model(a, compiled, layers, heads):
    """(param names, ids, targets, param tensors, loss function) of the GPT."""
    from ref_numpy import gpt_param_names
    names = gpt_param_names(layers)
    ids = torch.from_numpy(a["ids"].astype(np.int64))
    targets = torch.from_numpy(a["targets"].astype(np.int64)).reshape(-1)
    params = [_t(a[n], True) for n in names]

    def loss(ids, targets, *ps):
        P = dict(zip(names, ps))
        B, T = ids.shape
        V, C = P["wte"].shape
        hd = C // heads
        x = F.embedding(ids, P["wte"]) + P["wpe"]
        for i in range(1, layers + 1):
            p = lambda n: P[f"l{i}_{n}"]
            h = F.layer_norm(x, (C,), p("ln1_w"), p("ln1_b"), 1e-5)
            qkv = h @ torch.cat((p("wq"), p("wk"), p("wv")), 1)
            q, k, v = (z.reshape(B, T, heads, hd).transpose(1, 2) for z in qkv.split(C, -1))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + o.transpose(1, 2).reshape(B, T, C) @ p("wo")
            h = F.layer_norm(x, (C,), p("ln2_w"), p("ln2_b"), 1e-5)
            x = x + F.gelu(h @ p("wfc") + p("bfc"), approximate="tanh") @ p("wproj") + p("bproj")
        xf = F.layer_norm(x, (C,), P["lnf_w"], P["lnf_b"], 1e-5)
        return F.cross_entropy((xf @ P["wte"].T).reshape(-1, V), targets)
    return names, ids, targets, params, _maybe_compile(loss, compiled)


MAKERS = {"layernorm": layernorm, "gelu": gelu, "softmax": softmax, "hvp": hvp,
          "conv1d": conv1d, "conv2d": conv2d, "conv2d_sym": conv2d, "gcn": gcn, "mlp": mlp, "gpt": gpt, "gpt_adamw": gpt_adamw,
          "gpt_small": lambda a, compiled: gpt(a, compiled, layers=1, heads=4)}   # workloads/gpt_small.tg


def make(workload, arrays, compiled):
    return MAKERS[workload](arrays, compiled)


def to_numpy(out):
    return {k: (v.detach().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)) for k, v in out.items()}
