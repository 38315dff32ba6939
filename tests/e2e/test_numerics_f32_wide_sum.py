"""f32 numerics of the sums `lowered.wide_sum` computes in f64, with product terms
rounded in f32 (`lowered.wide_term_factors`, the default since stop 52) and with their
factors widened (`Options.sum_exact_products`, the old rule), against PyTorch float32.

The nanoGPT step's wide sums: the GELU backward fused into its product's GEMM epilogue
(three product terms), a residual plus layernorm backward (its three-term sum over the
row statistics), and an AdamW update. The suite's rule (`numerics_util`): inputs rounded
to float32 once; want = the PyTorch reference in float64; PASS when tgc's f32 error is at
most 10x PyTorch float32's, or at most 1e-6. The inputs reach the regions where a term
cancels: GELU at |x| up to 6 (0.5 + 0.5 tanh near 0 at negative x), a layernorm of rows
1e3 from 0, AdamW moments of both signs with decay that nearly cancels the update.
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
from numerics_util import BACKENDS, assert_not_worse_than_torch, case_registry, grads, leaves, normal, rng  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

CASES: list = []
case = case_registry(CASES)

_gelu_src = """
dim b = 48, k = 64, n = 96
input x[b, k], W[k, n], bias[n], ct[b, n]
y = gelu(x @ W + bias)
out y[b, n]
out gx[b, k] = grad(sum(y * ct), x)
out gW[k, n] = grad(sum(y * ct), W)
"""


def _gelu_ref(T):
    x, W = leaves(T.x, T.W)
    y = F.gelu(x @ W + T.bias, approximate="tanh")
    gx, gW = grads((y * T.ct).sum(), (x, W))
    return {"y": y, "gx": gx, "gW": gW}


_gelu_in = {"x": normal(401, (48, 64), 0.4), "W": normal(402, (64, 96), 0.4),
            "bias": normal(403, 96), "ct": normal(404, (48, 96))}

_ln_src = """
dim b = 64, c = 96
input x[b, c], w[c], bias[c], ct[b, c]
y = x + layernorm[c](x, w, bias)
out y[b, c]
out gx[b, c] = grad(sum(y * ct), x)
out gw[c] = grad(sum(y * ct), w)
"""


def _ln_ref(T):
    x, w = leaves(T.x, T.w)
    y = x + F.layer_norm(x, (96,), w, T.bias, eps=1e-5)
    gx, gw = grads((y * T.ct).sum(), (x, w))
    return {"y": y, "gx": gx, "gw": gw}


_ln_in = {"x": 1e3 * (1 + rng(411).random((64, 1))) + normal(412, (64, 96)),
          "w": 1 + 0.1 * normal(413, 96), "bias": 0.1 * normal(414, 96), "ct": normal(415, (64, 96))}

_adamw_src = """
dim n = 4096
input p[n], m[n], v[n], g[n], lr, wd, tt
mn = 0.9 * m + 0.1 * g
vn = 0.95 * v + 0.05 * g * g
out mn[n]
out vn[n]
out pn[n] = p - lr * ((mn / (1 - 0.9 ^ tt)) / (sqrt(vn / (1 - 0.95 ^ tt)) + 1e-8) + wd * p)
"""


def _adamw_ref(T):
    mn = 0.9 * T.m + 0.1 * T.g
    vn = 0.95 * T.v + 0.05 * T.g * T.g
    pn = T.p - T.lr * ((mn / (1 - 0.9 ** T.tt)) / (torch.sqrt(vn / (1 - 0.95 ** T.tt)) + 1e-8) + T.wd * T.p)
    return {"mn": mn, "vn": vn, "pn": pn}


_adamw_in = {"p": normal(421, 4096), "m": normal(422, 4096, 0.1), "v": np.abs(normal(423, 4096, 0.01)),
             "g": normal(424, 4096), "lr": np.float64(3e-4), "wd": np.float64(0.1), "tt": np.float64(7.0)}

for _exact, _tag in ((False, ""), (True, "_exact_products")):
    _opts = {"sum_exact_products": True} if _exact else None
    case("gelu_backward_product" + _tag, _gelu_src, _gelu_in, options=_opts)(_gelu_ref)
    case("residual_layernorm_backward_mean1e3" + _tag, _ln_src, _ln_in, options=_opts)(_ln_ref)
    case("adamw_update" + _tag, _adamw_src, _adamw_in, options=_opts)(_adamw_ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("c", [pytest.param(c, id=c.id) for c in CASES])
def test_f32_not_worse_than_torch(c, backend):
    assert_not_worse_than_torch(c, backend)
