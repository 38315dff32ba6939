"""tgc programs inside PyTorch: `tgc.torch.function` (autograd through tgc's own
derivative program) and torch CPU tensors as arguments, updated ones written in place."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc.ir.interp import EvalError

torch = pytest.importorskip("torch", reason="PyTorch is the interop's other side (optional)")
import tgc.torch as tgc_torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def mlp_arrays(p, batch=8, seed=0):
    rng = np.random.default_rng(seed)
    size = {"features": 13, "hidden": 64, "classes": 3, "batch": batch}
    arrs = {s.name: rng.standard_normal([size[e] for e in s.edges]) for s in p.inputs}
    arrs["y"] = np.eye(3)[rng.integers(0, 3, batch)]
    arrs["lr"] = np.array(0.1)
    return arrs


def test_gradients_through_autograd_are_torchs_own():
    p = tgc.compile(str(ROOT / "examples" / "mlp.tg"), dtype="f64")
    arrs = mlp_arrays(p)
    params = ("W1", "b1", "W2", "b2")
    t = {k: torch.tensor(v, requires_grad=k in params) for k, v in arrs.items()}
    out = tgc_torch.function(p)(**t)
    out["loss"].backward()
    ref = {k: torch.tensor(arrs[k], requires_grad=True) for k in params}
    h = torch.relu(t["x"] @ ref["W1"] + ref["b1"])
    loss = -(t["y"] * torch.log_softmax(h @ ref["W2"] + ref["b2"], -1)).sum(-1).mean()
    loss.backward()
    assert abs(out["loss"].item() - loss.item()) < 1e-12
    for k in params:
        torch.testing.assert_close(t[k].grad, ref[k].grad, rtol=1e-10, atol=1e-12)
    assert t["x"].grad is None and not any(t[k].grad is not None for k in ("x", "y", "lr"))


SMALL = """
dim n = 3, m = 4
input x[n], W[n, m]
out y[m] = tanh(x @ W)
out s = sum(softmax[m](x @ W) * W)
"""


def test_gradcheck_with_two_outputs_and_one_unused():
    p = tgc.compile(SMALL, dtype="f64")
    f = tgc_torch.function(p)
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    W = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, W: tuple(f(x=x, W=W).values()), (x, W))
    (gx,) = torch.autograd.grad(f(x=x, W=W)["y"].sum(), (x,))    # the other output's cotangent is zero
    x2 = x.detach().clone().requires_grad_(True)
    (want,) = torch.autograd.grad(torch.tanh(x2 @ W.detach()).sum(), (x2,))
    torch.testing.assert_close(gx, want)


def test_torch_tensors_are_updated_in_place_without_a_copy():
    p = tgc.compile(str(ROOT / "examples" / "mlp.tg"), dtype="f64")
    arrs = mlp_arrays(p, seed=1)
    want = p(**{k: v.copy() for k, v in arrs.items()})
    t = {k: torch.tensor(v) for k, v in arrs.items()}
    got = p(**t)
    for k in ("W2", "b2"):
        torch.testing.assert_close(t[k], torch.from_numpy(want[k]))
        assert np.shares_memory(got[k], t[k].numpy())
    np.testing.assert_allclose(got["loss"], want["loss"])


def test_a_tensor_that_requires_grad_cannot_be_updated_in_place():
    p = tgc.compile(str(ROOT / "examples" / "mlp.tg"), dtype="f64")
    t = {k: torch.tensor(v) for k, v in mlp_arrays(p).items()}
    t["W2"].requires_grad_(True)
    with pytest.raises(EvalError, match="detached"):
        p(**t)


def test_argument_names_are_checked():
    f = tgc_torch.function(tgc.compile(SMALL, dtype="f64"))
    with pytest.raises(TypeError, match="missing argument 'W'"):
        f(x=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="unexpected argument 'z'"):
        f(x=torch.zeros(3), W=torch.zeros(3, 4), z=1)


def test_a_python_float_learning_rate_keeps_both_passes_on_the_fast_path():
    """The README's `f(x=xt, y=yt, lr=0.1, ...)`: the float reaches the backward program
    as a float64 0-d array, which the fast path converts as it does a Python number;
    after one checked call per program, every step is one native call each way."""
    from tgc.backends.cpu import kernels as P

    if P._LAYOUT is None:
        pytest.skip("this numpy's array layout is not the one the native argument checks know")
    f = tgc_torch.function(tgc.compile(str(ROOT / "examples" / "mlp.tg")))
    checked = []
    for program in (f.forward_program, f.vjp_program()):
        inner = program._run_checked
        program._run_checked = lambda *a, _inner=inner, **k: checked.append(1) or _inner(*a, **k)
    arrs = {k: torch.tensor(v, dtype=torch.float32) for k, v in mlp_arrays(f.program).items()}
    params = ("W1", "b1", "W2", "b2")
    for k in params:
        arrs[k].requires_grad_(True)
    arrs["lr"] = 0.1
    grads = []
    for _ in range(3):
        f(**arrs)["loss"].backward()
        grads.append(arrs["W1"].grad.clone())
        for k in params:
            arrs[k].grad = None
    assert len(checked) == 2
    assert all(torch.equal(g, grads[0]) for g in grads)


def test_a_second_derivative_through_the_backward_pass_is_an_error_not_zero():
    """The backward pass is differentiable once. With create_graph=True and a constant
    cotangent (a scalar loss's 1), PyTorch's once_differentiable guard sees no argument
    that requires grad and lets the gradient through as a constant: the second
    derivative of `(g ** 2).sum() + (x ** 2).sum()` came back as 2x, silently without
    the tgc part. It is an error when that derivative is taken."""
    f = tgc_torch.function(tgc.compile("dim n = 3\nparam x[n]\ninput y[n]\nout L = sum(exp(x) * y)\n",
                                       dtype="f64"))
    x = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    g, = torch.autograd.grad(f(x=x, y=y)["L"], x, create_graph=True)
    torch.testing.assert_close(g.detach(), torch.exp(x.detach()) * y)   # the first derivative is right
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad((g ** 2).sum() + (x ** 2).sum(), x)
    g, = torch.autograd.grad(f(x=x, y=y)["L"], x)   # without create_graph: a plain tensor
    assert not g.requires_grad
