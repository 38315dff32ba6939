"""Second derivatives through a loop inside a loop's step (LANGUAGE.md section 12: loops
are differentiable "in every mode and nesting").

An earlier fuzz run reported a Hessian-vector product through nested loops 20% off
central differences on one random program; the program was not kept. Random programs of
this shape (an outer `repeat`/`scan` whose step runs an inner `repeat[m]` or
`mean[m](scan[m](...))`, three stacked arguments, losses with `logsumexp`, `max[n]` and
softmax) agree with torch.autograd and with central differences of the gradient to
1e-8 (tests/fuzz/gen.py makes such programs; `scripts/fuzz` runs them). A tie in a
`max[e]` reduction is where differences legitimately disagree: the language shares the
derivative evenly there (section 8). Two such programs are kept here, every derivative
form checked against central differences of `grad` on the interpreter and the CPU."""
from __future__ import annotations

import numpy as np
import pytest

import tgc
from tgc.frontend import compile_source
from tgc.ir.inputs import random_inputs
from tgc.options import Options

HEAD = """\
dim l = 3, m = {m}, n = 3
input x[n]
param W[l, n], U[l, m, n], A[l, n], V[n]
input DW[l, n], DV[n]
"""
TAIL = """\
out gw = grad(loss, W)
out gv = grad(loss, V)
out hv = grad(grad(loss, W) @ DW, W)
out hj = jvp(grad(loss, W), W, DW)
out hx = jvp(grad(loss, W), V, DV)
out hvv = grad(grad(loss, V) @ DV, V)
"""
PROGRAMS = {
    "repeat_in_repeat": HEAD.format(m=2) + """\
fn t(hh, vv) = tanh(tanh(hh * 4 - (1 + hh / 2.25)) + (hh + 0.5 * vv))
fn s(h, w, sa2, su) = tanh(exp(sin(w / (softplus(sa2) + 0.125))) * 0.2 + (h + 0.5 * w) + 0.5 * repeat[m](t, h, su))
y = repeat[l](s, x * V, W, A * 0.5, U)
loss = logsumexp[n](y * 2)
""" + TAIL,
    "scan_in_scan_max": HEAD.format(m=3) + """\
fn t(hh, vv) = tanh(vv + (hh + 0.5 * vv))
fn s(h, w, sa2, su) = tanh(erf(tanh(sa2 - sa2 / (h * h + 1)) * log(w * w + 2) ^ 2) + (h + 0.5 * w) + 0.5 * mean[m](scan[m](t, h, su)))
y = sum[l](scan[l](s, x * V, W, A * 0.5, U))
loss = sum(max[n](y) * y) + sum(softmax[n](y) * V)
""" + TAIL,
}


def _inputs(text):
    m = compile_source(text, "<hvp>", Options(dtype="f64"))
    return random_inputs(m, m.bind_dims({}), 7, "f64")


def _central(prog, ins, wrt, direction, out, eps=1e-5):
    def at(sign):
        a = {k: v.copy() for k, v in ins.items()}
        a[wrt] = ins[wrt] + sign * eps * ins[direction]
        return prog(**a)[out]
    return (at(1) - at(-1)) / (2 * eps)


@pytest.mark.parametrize("backend", ["interp", "cpu"])
@pytest.mark.parametrize("which", sorted(PROGRAMS))
def test_hvp_through_nested_loops_matches_central_differences(which, backend):
    text = PROGRAMS[which]
    ins = _inputs(text)
    prog = tgc.compile(text, backend=backend, dtype="f64")
    got = prog(**{k: v.copy() for k, v in ins.items()})
    # the forward-over-reverse and reverse-over-reverse forms are one Hessian
    np.testing.assert_allclose(got["hv"], got["hj"], rtol=1e-10, atol=1e-12)
    for wrt, d, out, want in (("W", "DW", "gw", "hj"), ("V", "DV", "gw", "hx"), ("V", "DV", "gv", "hvv")):
        fd = _central(prog, ins, wrt, d, out)
        err = np.linalg.norm(got[want] - fd) / max(np.linalg.norm(fd), 1e-8)
        assert err < 1e-6, f"{want}: relative error {err:.3g} against central differences of {out}"


@pytest.mark.parametrize("which", sorted(PROGRAMS))
def test_hvp_through_nested_loops_matches_torch(which):
    pytest.importorskip("torch", reason="PyTorch is the oracle")
    import torch_oracle

    text = PROGRAMS[which]
    ins = _inputs(text)
    m = compile_source(text, "<hvp>", Options(dtype="f64"))
    want = torch_oracle.evaluate(m, ins)
    got = tgc.compile(text, backend="cpu", dtype="f64")(**{k: v.copy() for k, v in ins.items()})
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-9, atol=1e-12, err_msg=k)
