"""step_sums: a sum over a loop's stacked results is summed in the loop's steps
(tgc/opt/step_sums.py). The golden IR is tests/opt/step_sums.tgir. Here: the gradients
stay bit for bit those of the program without the pass (CPU, f32 and f64), the sums
agree to rounding, and examples/gpt2.tg's AdamW step with global-norm clipping (the
clipping active) agrees with PyTorch's `clip_grad_norm_` and `torch.optim.AdamW` in
f64 and f32."""
import sys

import numpy as np
import pytest

import tgc
from passes_util import ROOT, optimize, tg
from tgc.ir.values import topo_order
from tgc.options import Options
from tgc.opt.step_sums import candidate
from tgc.registry import DEFAULT_PIPELINE

WITHOUT = tuple(p for p in DEFAULT_PIPELINE if p != "step_sums")
GPT2 = ROOT / "examples" / "gpt2.tg"
REDUCED = {"layer": 2, "head": 2, "hd": 8, "t": 8, "vocab": 20}

LAYERS = """
dim layer = 3, b = 16, c = 24
input x[b, c]
param w[layer, c, c2: c], u[layer, c2, c], g[layer, c]
fn block(h, w, u, g) { return tanh(tanh(h @ w) @ u) * g }
y = repeat[layer](block, x, w, u, g)
loss = sum(y * y)
out dw = grad(loss, w)
out dg = grad(loss, g)
out norm = sum(grad(loss, w) ^ 2) + sum(grad(loss, g) ^ 2)
"""


def _candidates(m) -> int:
    """Sums over a loop's stacked results left outside the loop (the pass's candidates)."""
    return sum(candidate(v) is not None for v in m.values())


def _bodies(m) -> list:
    return [v.attrs[0] for v in topo_order(m.roots()) if v.op == "loop"]


def test_the_norm_of_stacked_gradients_is_summed_in_the_backward_steps():
    """The layers' loop stacks dW and dg; their sums of squares become partial sums of
    the backward loop's steps (verified on the interpreter by --verify-each)."""
    m = tg(LAYERS)
    off = optimize(m, WITHOUT, seeds=(0,))
    on = optimize(m, DEFAULT_PIPELINE, seeds=(0,))
    assert _candidates(off) == 2 and _candidates(on) == 0
    more = max(len(b.results) for b in _bodies(on)) - max(len(b.results) for b in _bodies(off))
    assert more == 2


@pytest.mark.parametrize("dtype,rtol", [("f64", 1e-13), ("f32", 1e-6)])
def test_gradients_are_the_unfused_programs_bit_for_bit(dtype, rtol):
    on = tgc.compile(LAYERS, dtype=dtype)
    off = tgc.compile(LAYERS, dtype=dtype, options=Options(dtype=dtype, passes=WITHOUT))
    rng = np.random.default_rng(0)
    ft = np.float64 if dtype == "f64" else np.float32
    args = {"x": rng.standard_normal((16, 24)).astype(ft),
            "w": (0.3 * rng.standard_normal((3, 24, 24))).astype(ft),
            "u": (0.3 * rng.standard_normal((3, 24, 24))).astype(ft),
            "g": rng.standard_normal((3, 24)).astype(ft)}
    a, b = on(**{k: v.copy() for k, v in args.items()}), off(**{k: v.copy() for k, v in args.items()})
    np.testing.assert_array_equal(a["dw"], b["dw"])
    np.testing.assert_array_equal(a["dg"], b["dg"])
    want = float(np.sum(np.square(b["dw"], dtype=np.float64)) + np.sum(np.square(b["dg"], dtype=np.float64)))
    assert float(a["norm"]) == pytest.approx(want, rel=rtol)
    assert float(b["norm"]) == pytest.approx(want, rel=rtol)


def test_a_sum_over_the_loop_edge_alone_stays():
    """sum[layer](dW) has partials as large as dW: no read saved, so it stays outside."""
    m = optimize(tg(LAYERS.replace("out norm = sum(grad(loss, w) ^ 2) + sum(grad(loss, g) ^ 2)",
                                   "out s = sum[layer](grad(loss, w))")), DEFAULT_PIPELINE, seeds=(0,))
    loops = [v for v in m.values() if v.op == "contract" and v.operands and v.operands[0].op == "loop"]
    assert loops and all(len(v.operands[0].edges) > 1 for v in loops)


def _torch_reference(arrays, names, sizes):
    pytest.importorskip("torch", reason="the AdamW reference is PyTorch's")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import nanogpt

    step, params = nanogpt.torch_step(arrays, names, False, sizes=sizes)
    loss = step()
    # clip_grad_norm_ scaled the gradients in place: a norm of 1 says it clipped
    norm = float(sum(float((p.grad.double() ** 2).sum()) for p in params.values())) ** 0.5
    return loss, params, norm


@pytest.mark.parametrize("dtype", ["f64", "f32"])
def test_gpt2_step_with_clipping_matches_torch_adamw(dtype):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import nanogpt

    program = tgc.compile(GPT2, dtype=dtype, dims=REDUCED)
    names = [s.name for s in program.inputs if s.kind == "param"]
    ft = np.float64 if dtype == "f64" else np.float32
    arrays = nanogpt.initial(program, 2, sizes=REDUCED)
    arrays = {k: (v.astype(ft) if v.dtype.kind == "f" else v) for k, v in arrays.items()}
    for n in names:   # larger weights: a gradient norm over 1, so the clipping acts
        if n.startswith("w"):
            arrays[n] = (arrays[n] * 10).astype(ft)
    want_loss, params, norm = _torch_reference({k: v.copy() for k, v in arrays.items()}, names, REDUCED)
    assert norm == pytest.approx(1.0, rel=1e-5)
    mine = {k: v.copy() for k, v in arrays.items()}
    got = program(**mine)
    rel = 1e-12 if dtype == "f64" else 1e-5
    assert float(got["loss"]) == pytest.approx(want_loss, rel=rel)
    # the first AdamW step moves a weight by about lr * sign(g); where g is near eps,
    # rounding moves it by up to its own size: f32 to 1e-3 of the largest value
    # (benchmarks/nanogpt.py's bound), f64 to 1e-6 (4.7e-8 seen: a layernorm bias at 0)
    bound = 1e-6 if dtype == "f64" else 1e-3
    for n in names:
        if n == "bk":   # its gradient is zero up to rounding (a key bias shifts every
            continue    # score of a row alike): its update is lr times the sign of rounding
        err = np.abs(mine[n] - _stacked(params, n, lambda p: p.detach())).max()
        assert err <= bound * np.abs(mine[n]).max(), (n, err)
    # the moments of a first step are 0.1 g and 0.05 g^2 of the clipped gradient g
    # (torch's, scaled in place by clip_grad_norm_): they show the clip factor
    mom = 1e-9 if dtype == "f64" else 1e-5
    for n in names:
        if n == "bk":
            continue
        g = _stacked(params, n, lambda p: p.grad)
        for state, want in (("m", 0.1 * g), ("v", 0.05 * g * g)):
            err = np.abs(mine[f"{state}.{n}"] - want).max()
            assert err <= mom * np.abs(want).max(), (state, n, err)


def _stacked(params, n, part):
    """torch's tensor `n` (its layers' tensors stacked) through `part`, as numpy."""
    if n in params:
        return part(params[n]).numpy()
    return np.stack([part(params[f"{n}.{i}"]).numpy() for i in range(REDUCED["layer"])])
