"""f32 numerics of common idioms, as a user writes them, against PyTorch float32.

The fourth file of the f32 suite (with `test_numerics_f32.py`, `test_numerics_f32_idioms.py`
and `test_numerics_f32_probe.py`): statistics of data far from 0 (variances, standard
deviations, batch statistics, layer normalization), cross-entropy with large logits,
log1p/expm1, norms and cosine similarity of large vectors, logsumexp's gradient, softplus
at large inputs, entropy of a softmax. The rule is the suite's (`numerics_util`): inputs
rounded to float32 once; want = the hand-written PyTorch reference in float64; PASS when
tgc's f32 error is at most 10x PyTorch float32's, or at most 1e-6.

`python tests/e2e/test_numerics_f32_common.py [backend ...]` prints the table.
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


# ================================================================ statistics of data far from 0

@case("variance_offset_1e5_grad", """
dim b = 8, n = 1024
input x[b, n], w[b]
mu = mean[n](x)
v = mean[n]((x - mu) ^ 2)
out v[b]
out gx[b, n] = grad(sum(v * w), x)
""", {"x": normal(201, (8, 1024), 1.0, 1e5), "w": normal(202, 8)})
def _(T):
    (x,) = leaves(T.x)
    v = x.var(-1, unbiased=False)
    (gx,) = grads((v * T.w).sum(), (x,))
    return {"v": v, "gx": gx}


@case("std_unbiased_offset_1e4", """
dim b = 4, n = 500
input x[b, n]
mu = mean[n](x)
out s[b] = sqrt(sum[n]((x - mu) * (x - mu)) / (size(n) - 1))
""", {"x": normal(203, (4, 500), 0.5, 1e4)})
def _(T):
    return {"s": T.x.std(-1)}


@case("batch_statistics_offset_1e4", """
dim b = 256, c = 16
input x[b, c]
mu = mean[b](x)
out m[c] = mu
out v[c] = mean[b]((x - mu) * (x - mu))
""", {"x": normal(204, (256, 16), 1.0, 1e4) + 100 * rng(205).standard_normal(16)})
def _(T):
    return {"m": T.x.mean(0), "v": T.x.var(0, unbiased=False)}


@case("variance_symbolic_rows", """
dim b = 4
dim n
input x[b, n]
mu = mean[n](x)
out v[b] = mean[n]((x - mu) * (x - mu))
""", {"x": normal(206, (4, 2000), 1.0, 3e4)})
def _(T):
    return {"v": T.x.var(-1, unbiased=False)}


@case("layernorm_offset_1e5_768", """
dim b = 4, d = 768
input x[b, d], w[d], bias[d], ct[b, d]
y = layernorm[d](x, w, bias)
out y[b, d]
out gx[b, d] = grad(sum(y * ct), x)
out gw = grad(sum(y * ct), w)
""", {"x": normal(207, (4, 768), 1.0, 1e5), "w": normal(208, 768, 0.1, 1.0), "bias": normal(209, 768, 0.1),
      "ct": normal(210, (4, 768))})
def _(T):
    x, w = leaves(T.x, T.w)
    y = F.layer_norm(x, (768,), w, T.bias, eps=1e-5)
    gx, gw = grads((y * T.ct).sum(), (x, w))
    return {"y": y, "gx": gx, "gw": gw}


# ================================================================ softmax family at large logits

_ids = rng(211).integers(0, 32, 8)


@case("cross_entropy_logits_scale_100", """
dim b = 8, c = 32
input x[b, c], y[b, c]
loss = mean[b](cross_entropy[c](x, y))
out loss
out gx[b, c] = grad(loss, x)
""", {"x": normal(212, (8, 32), 100.0), "y": np.eye(32)[_ids]})
def _(T):
    (x,) = leaves(T.x)
    loss = F.cross_entropy(x, T.y.argmax(-1))
    (gx,) = grads(loss, (x,))
    return {"loss": loss, "gx": gx}


@case("logsumexp_grad_scale_1e3", """
dim b = 4, c = 64
input x[b, c], w[b]
l = logsumexp[c](x)
out l[b]
out gx[b, c] = grad(sum(l * w), x)
""", {"x": normal(213, (4, 64), 1e3), "w": normal(214, 4)})
def _(T):
    (x,) = leaves(T.x)
    l = torch.logsumexp(x, -1)
    (gx,) = grads((l * T.w).sum(), (x,))
    return {"l": l, "gx": gx}


@case("entropy_moderate_logits", """
dim b = 4, c = 16
input x[b, c]
h = -sum[c](softmax[c](x) * log_softmax[c](x))
out h[b]
out gx[b, c] = grad(sum(h), x)
""", {"x": normal(215, (4, 16), 4.0)})
def _(T):
    (x,) = leaves(T.x)
    h = -(torch.softmax(x, -1) * F.log_softmax(x, -1)).sum(-1)
    (gx,) = grads(h.sum(), (x,))
    return {"h": h, "gx": gx}


@case("softplus_large_inputs", """
dim n = 16
input x[n]
out y[n] = softplus(x)
out g[n] = grad(sum(softplus(x)), x)
""", {"x": np.array([20.0, 30.0, 50.0, 80.0, 90.0, 100.0, 1e3, 1e4, -20.0, -50.0, -90.0, -100.0, 0.0, 1.0, -1.0,
                     15.0])}, elementwise=True)
def _(T):
    (x,) = leaves(T.x)
    y = F.softplus(x)   # x above the threshold 20 is returned as it is
    (g,) = grads(y.sum(), (x,))
    return {"y": y, "g": g}


# ================================================================ log1p, expm1

@case("log1p_expm1_small", """
dim n = 16
input x[n]
out a[n] = log1p(x)
out e[n] = expm1(x)
out ga[n] = grad(sum(log1p(x)), x)
out ge[n] = grad(sum(expm1(x)), x)
""", {"x": np.concatenate([[1e-10, -1e-10, 1e-7, -1e-7, 1e-4, -1e-4, 0.5, -0.5], normal(216, 8, 1e-3)])},
    elementwise=True)
def _(T):
    (x,) = leaves(T.x)
    a, e = torch.log1p(x), torch.expm1(x)
    ga, ge = grads(a.sum(), (x,))[0], grads(e.sum(), (x,))[0]
    return {"a": a, "e": e, "ga": ga, "ge": ge}


@case("log1p_exp_as_written", """
dim n = 16
input x[n]
out y[n] = log(1 + exp(x))
out g[n] = grad(sum(log(1 + exp(x))), x)
""", {"x": np.concatenate([[-30.0, -20.0, -10.0, 0.0, 10.0, 20.0, 30.0, 60.0], normal(217, 8, 5.0)])},
    elementwise=True)
def _(T):
    (x,) = leaves(T.x)
    y = F.softplus(x, threshold=1e9)
    (g,) = grads(y.sum(), (x,))
    return {"y": y, "g": g}


# ================================================================ norms and cosine similarity

@case("l2_norm_large_values", """
dim b = 4, n = 1000
input x[b, n]
r = sqrt(sum[n](x * x))
out r[b]
out gx[b, n] = grad(sum(r), x)
""", {"x": normal(218, (4, 1000), 1e17)})
def _(T):
    (x,) = leaves(T.x)
    r = torch.linalg.vector_norm(x, dim=-1)
    (gx,) = grads(r.sum(), (x,))
    return {"r": r, "gx": gx}


@case("cosine_similarity_offset_vectors", """
dim b = 4, n = 512
input x[b, n], y[b, n]
c = sum[n](x * y) / (sqrt(sum[n](x * x)) * sqrt(sum[n](y * y)))
out c[b]
out gx[b, n] = grad(sum(c), x)
""", {"x": normal(219, (4, 512), 1.0, 100.0), "y": normal(220, (4, 512), 1.0, 100.0)})
def _(T):
    (x,) = leaves(T.x)
    c = F.cosine_similarity(x, T.y, dim=-1, eps=0.0)
    (gx,) = grads(c.sum(), (x,))
    return {"c": c, "gx": gx}


@case("mean_of_many_offset", """
dim n = 1000000
input x[n]
out m = mean(x)
out v = mean((x - mean(x)) ^ 2)
""", {"x": normal(221, 1000000, 1.0, 1e3)})
def _(T):
    return {"m": T.x.mean(), "v": T.x.var(unbiased=False)}


def _params():
    return [pytest.param(c, id=c.id) for c in CASES]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("c", _params())
def test_f32_not_worse_than_torch(c, backend):
    assert_not_worse_than_torch(c, backend)


if __name__ == "__main__":
    want = sys.argv[1:] or list(BACKENDS)
    for c in CASES:
        for bk in want:
            try:
                rs = compare(c, bk)
            except Exception as e:  # noqa: BLE001
                print(f"{c.id:34s} {bk:8s} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            for r in rs:
                ratio = r.tgc_err / r.torch_err if r.torch_err else float("inf")
                print(f"{c.id:34s} {bk:8s} {r.name:6s} tgc {r.tgc_err:9.3g} torch {r.torch_err:9.3g} "
                      f"ratio {ratio:8.3g} {'ok' if r.passed else 'FAIL'} {r.where}", flush=True)
