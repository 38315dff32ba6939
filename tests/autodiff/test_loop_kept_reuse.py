"""The reverse loop of an attention layer keeps the softmax P, not the scores and their
logsumexp it would need to compute P again (`tgc.autodiff.loops._reuse_kept`): the
backward's `exp(d - lse)` (the logsumexp's derivative) is read as the kept P. Values
against the unrolled program (no loop: one graph, where hash-consing shares P anyway),
the compiled CPU program against the interpreter in f32 and f64, and PyTorch."""
import numpy as np
import pytest

import tgc
from tgc.ir.interp import evaluate

from layer_programs import assert_loop_is_the_unrolled_program, layer_stack, loop_kept

HEAD = """\
dim layer = {n}, b = 2, t = 16, s = t, hd = 4, head = 2, c = 8
input x[b, t, c]
param wq[layer, c, c2: c], wk[layer, c, c2], wv[layer, c, c2]
fn block(h, wq, wk, wv) {{
  q = (h @ wq)[c2 = hd*head + hd]
  k = (h @ wk)[c2 = hd*head + hd, t -> s]
  v = (h @ wv)[c2 = hd*head + hd, t -> s]
  p = softmax[s](dot[hd](q, k) / sqrt(size(hd)) - 1e9 * [s > t])
  return h + sum[s](p * v) @ [c2 = hd*head + hd][c2 -> c]
}}
"""
OUTS = """\
loss = sum(y * y)
out loss
out gq = grad(loss, wq)
out gk = grad(loss, wk)
out gv = grad(loss, wv)
out gx = grad(loss, x)
"""
N = 3


def program(loop: bool = True) -> str:
    return layer_stack(HEAD, OUTS, N, ('wq', 'wk', 'wv'), loop)


optimized = loop_kept


def inputs(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"x": (2, 16, 8), "wq": (N, 8, 8), "wk": (N, 8, 8), "wv": (N, 8, 8)}
    return {k: rng.standard_normal(s) * 0.5 for k, s in shapes.items()}


def test_the_forward_loop_stacks_p_and_neither_scores_nor_logsumexp():
    m = optimized(program())
    forward = [v for v in m.values() if v.op == "loop" and not v.attrs[2]]
    assert forward, "the layer loop was unrolled"
    body = forward[0].attrs[0]
    stacked = body.results[body.carries:]
    square = [r for r in stacked if {"s", "t"} <= set(r.edges)]
    # P itself, and nothing else over [s, t] (the shifted scores were the other)
    assert [(r.op, r.attrs[0]) for r in square] == [("map", "exp")]
    assert not [r for r in stacked if r.op == "reduce"]   # no logsumexp row kept


def test_gradients_match_the_unrolled_program():
    assert_loop_is_the_unrolled_program(program, inputs())


@pytest.mark.parametrize("dtype,rtol", [("f64", 1e-10), ("f32", 2e-4)])
def test_the_cpu_program_matches_the_interpreter(dtype, rtol):
    ins = inputs(1)
    want = evaluate(optimized(program()), {k: a.copy() for k, a in ins.items()}, dtype="f64")
    p = tgc.compile(program(), dtype=dtype)
    got = p(**{k: a.astype(dtype.replace("f", "float")) for k, a in ins.items()})
    for k in want:
        scale = np.abs(want[k]).max()
        np.testing.assert_allclose(np.asarray(got[k], np.float64), want[k], rtol=rtol, atol=rtol * scale,
                                   err_msg=k)


def test_gradients_match_pytorch():
    torch = pytest.importorskip("torch")
    ins = inputs(2)
    got = evaluate(optimized(program()), {k: a.copy() for k, a in ins.items()}, dtype="f64")
    t = {k: torch.tensor(a, requires_grad=True) for k, a in ins.items()}
    h = t["x"]
    mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), 1)
    for i in range(N):
        q, k, v = ((h @ t[w][i]).reshape(2, 16, 2, 4).transpose(1, 2) for w in ("wq", "wk", "wv"))
        scores = (q @ k.transpose(-1, -2) / 2.0).masked_fill(mask, -1e9)
        h = h + (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(2, 16, 8)
    loss = (h * h).sum()
    grads = torch.autograd.grad(loss, [t["wq"], t["wk"], t["wv"], t["x"]])
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-12)
    for name, want in zip(("gq", "gk", "gv", "gx"), grads):
        np.testing.assert_allclose(got[name], want.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)
