"""f32 numerics of second derivatives and other idioms the other f32 suites leave out,
against PyTorch float32 (the rule of `numerics_util`: tgc's error at most 10x PyTorch
float32's, or at most 1e-6, both against PyTorch float64).

Second derivatives of activations (silu, sigmoid, softplus, -log sigmoid, erf, atan,
asinh, relu^2), Hessian-vector products through layer norm, RMS norm, attention's
softmax and a GELU MLP, cross-entropy with label smoothing, normalizing vectors from
1e-20 to 1e15, a norm, mean and variance over 10^6 elements, exp and log at float32's
extremes and an AdamW step at step 200 with tiny gradients.

`python tests/e2e/test_numerics_f32_second_order.py [backend ...]` prints every case's
errors without asserting.
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
                           grads, leaves, normal, report, rng)

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

CASES: list[Case] = []
case = case_registry(CASES)

# ================================================================ activations: value, first and second derivative

ACT = np.array([-30, -10, -6, -3, -1, -0.5, 0.1, 0.5, 1, 3, 6, 10, 30.])


def _act_src(expr, n):
    return f"dim n = {n}\ninput x[n]\ny = {expr}\nd1 = grad(sum(y), x)\nout y\nout d1\nout d2 = grad(sum(d1), x)\n"


def _d1_d2(f):
    def ref(T):
        df = torch.func.grad(f)
        d2f = torch.func.grad(df)
        return {"y": f(T.x), "d1": torch.func.vmap(df)(T.x), "d2": torch.func.vmap(d2f)(T.x)}
    return ref


def _act(id, expr, f, x=ACT):
    case(id, _act_src(expr, len(x)), {"x": x}, elementwise=True)(_d1_d2(f))


_act("silu_d2", "silu(x)", F.silu)
_act("sigmoid_d2", "sigmoid(x)", torch.sigmoid)
_act("softplus_d2_small", "softplus(x)", F.softplus, ACT[np.abs(ACT) < 20])   # PyTorch's threshold 20
_act("neg_log_sigmoid_d2", "-log(sigmoid(x))", lambda z: -F.logsigmoid(z))
_act("relu_squared_d2", "relu(x) * relu(x)", lambda z: F.relu(z) ** 2)
_act("erf_d2", "erf(x)", torch.erf)
_act("atan_d2", "atan(x)", torch.atan)
_act("asinh_d2", "asinh(x)", torch.asinh)


# ================================================================ Hessian-vector products

@case("layernorm_hvp", """
dim b = 16, d = 256
input x[b, d], ct[b, d], v[b, d]
param w[d], bb[d]
y = layernorm[d](x, w, bb)
g = grad(sum(y * ct), x)
out hv = grad(sum(g * v), x)
""", {"x": normal(3, (16, 256), 2.0, 3.0), "ct": normal(4, (16, 256)), "v": normal(5, (16, 256)),
      "w": normal(6, 256, 0.1, 1.0), "bb": normal(7, 256, 0.1)})
def _(T):
    x, = leaves(T.x)
    y = F.layer_norm(x, (256,), T.w, T.bb, eps=1e-5)
    g, = grads((y * T.ct).sum(), [x], create_graph=True)
    return {"hv": grads((g * T.v).sum(), [x])[0]}


@case("rmsnorm_hvp", """
dim b = 16, d = 256
input x[b, d], ct[b, d], v[b, d]
param w[d]
y = x / sqrt(mean[d](x * x) + 1e-6) * w
g = grad(sum(y * ct), x)
out g
out hv = grad(sum(g * v), x)
""", {"x": normal(23, (16, 256), 1.0, 5.0), "ct": normal(24, (16, 256)), "v": normal(25, (16, 256)),
      "w": normal(26, 256, 0.1, 1.0)})
def _(T):
    x, = leaves(T.x)
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * T.w
    g, = grads((y * T.ct).sum(), [x], create_graph=True)
    return {"g": g, "hv": grads((g * T.v).sum(), [x])[0]}


@case("attention_softmax_hvp", """
dim t = 32, s = 32, e = 16
input q[t, e], k[s, e], vv[s, e], ct[t, e], dq[t, e]
p = softmax[s](dot[e](q, k) / 4)
o = sum[s](p * vv)
g = grad(sum(o * ct), q)
out hv = grad(sum(g * dq), q)
""", {"q": normal(8, (32, 16), 2.0), "k": normal(9, (32, 16), 2.0), "vv": normal(10, (32, 16)),
      "ct": normal(11, (32, 16)), "dq": normal(12, (32, 16))})
def _(T):
    q, = leaves(T.q)
    o = torch.softmax(q @ T.k.T / 4, -1) @ T.vv
    g, = grads((o * T.ct).sum(), [q], create_graph=True)
    return {"hv": grads((g * T.dq).sum(), [q])[0]}


@case("gelu_mlp_hvp", """
dim b = 16, d = 64, h = 256
input x[b, d], ct[b, d], v[d, h]
param W1[d, h], W2[h, d]
y = gelu(x @ W1) @ W2
g = grad(sum(y * ct), W1)
out hv = grad(sum(g * v), W1)
""", {"x": normal(27, (16, 64)), "ct": normal(28, (16, 64)), "v": normal(29, (64, 256)),
      "W1": normal(30, (64, 256), 0.3), "W2": normal(31, (256, 64), 0.1)})
def _(T):
    W1, = leaves(T.W1)
    y = F.gelu(T.x @ W1, approximate="tanh") @ T.W2
    g, = grads((y * T.ct).sum(), [W1], create_graph=True)
    return {"hv": grads((g * T.v).sum(), [W1])[0]}


# ================================================================ losses, norms, reductions, optimizer

@case("cross_entropy_label_smoothing", """
dim b = 32, v = 1000
input x[b, v], y[b, v]
lp = log_softmax[v](x)
t = 0.9 * y + 0.1 / size(v)
loss = -sum(t * lp) / size(b)
out loss
out g = grad(loss, x)
""", {"x": normal(1, (32, 1000), 8.0), "y": np.eye(1000)[rng(2).integers(0, 1000, 32)]})
def _(T):
    x, = leaves(T.x)
    loss = F.cross_entropy(x, T.y.argmax(1), label_smoothing=0.1)
    return {"loss": loss, "g": grads(loss, [x])[0]}


@case("normalize_rows_1e-20_to_1e15", """
dim b = 6, d = 64
input x[b, d], y[b, d]
nx = x / max(sqrt(sum[d](x * x)), 1e-12)
ny = y / max(sqrt(sum[d](y * y)), 1e-12)
out nx
out cs = sum[d](nx * ny)
out g = grad(sum(cs), x)
""", {"x": normal(13, (6, 64)) * np.array([1e-20, 1e-15, 1e-10, 1e-5, 1, 1e15])[:, None],
      "y": normal(14, (6, 64)) * np.array([1e-18, 1e-12, 1e-8, 1e-3, 1e3, 1e17])[:, None]})
def _(T):
    x, = leaves(T.x)
    nx, ny = F.normalize(x, dim=1), F.normalize(T.y, dim=1)
    cs = (nx * ny).sum(1)
    return {"nx": nx, "cs": cs, "g": grads(cs.sum(), [x])[0]}


@case("norm_mean_var_1e6", """
dim n = 1000000
input x[n]
out nrm = sqrt(sum(x * x))
out m = mean(x)
out v = mean((x - mean(x)) ^ 2)
out g = grad(sqrt(sum(x * x)), x)
""", {"x": normal(15, 1000000, 1.0, 10.0)})
def _(T):
    x, = leaves(T.x)
    nrm = torch.linalg.vector_norm(x)
    return {"nrm": nrm, "m": T.x.mean(), "v": T.x.var(unbiased=False), "g": grads(nrm, [x])[0]}


@case("exp_log_extremes", """
dim n = 10
input x[n], z[n]
out e = exp(x)
out l = log(z)
out ge = grad(sum(exp(x)), x)
out gl = grad(sum(log(z)), z)
""", {"x": np.array([88.0, 88.7, -87.0, -103.0, -104.0, 0.0, 1e-8, -1e-8, 50.0, -50.0]),
      "z": np.array([3e38, 1e-38, 1e-45, 1e-40, 1.0, 1 + 1e-7, 1 - 6e-8, 2.0, 1e30, 1e-30])}, elementwise=True)
def _(T):
    x, z = leaves(T.x, T.z)
    return {"e": torch.exp(T.x), "l": torch.log(T.z), "ge": grads(torch.exp(x).sum(), [x])[0],
            "gl": grads(torch.log(z).sum(), [z])[0]}


@case("adamw_step_200_tiny_grads", """
dim n = 64
input g[n]
param w[n]
state m[n], v[n], step
tt = step + 1
update step = tt
mn = 0.9 * m + 0.1 * g
vn = 0.999 * v + 0.001 * g * g
update m = mn
update v = vn
update w = w - 1e-3 * ((mn / (1 - 0.9 ^ tt)) / (sqrt(vn / (1 - 0.999 ^ tt)) + 1e-8) + 0.01 * w)
""", {"g": normal(16, 64, 1e-3), "w": normal(17, 64), "m": normal(18, 64, 1e-4), "v": np.abs(normal(19, 64, 1e-7)),
      "step": np.array(199.0)})
def _(T):
    tt = T.step + 1
    mn = 0.9 * T.m + 0.1 * T.g
    vn = 0.999 * T.v + 0.001 * T.g * T.g
    w = T.w - 1e-3 * ((mn / (1 - 0.9 ** tt)) / (torch.sqrt(vn / (1 - 0.999 ** tt)) + 1e-8) + 0.01 * T.w)
    return {"step": tt, "m": mn, "v": vn, "w": w}


# ================================================================ the tests

def test_distinct_case_ids():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_f32_second_order_not_worse_than_torch(c, backend):
    assert_not_worse_than_torch(c, backend)


if __name__ == "__main__":
    for c in CASES:
        for b in sys.argv[1:] or ["cpu"]:
            print(report(c, b, compare(c, b)))
