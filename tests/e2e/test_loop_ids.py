"""A loop whose stacked argument is i32 ids (`scan[t](cell, h0, ids, E, W)`, each step
gathering rows by its slice of the ids): values, reverse, forward and nested
derivatives against a plain numpy loop with hand-written derivatives... and against
PyTorch's autograd where torch is installed; on the lowered, CPU and cuda-sim backends,
with the trip count symbolic and fixed (short fixed loops that slice ids stay loops:
`unroll` cannot write an i32 slice out). An id out of range at some step is the
gather check's error before anything runs, as for a gather outside a loop."""
import numpy as np
import pytest

import tgc
from tgc.frontend import compile_source
from tgc.ir.inputs import random_inputs
from tgc.options import Options

SOURCE = """\
dim t{T}, b = 3, v = 7, d = 5
input ids: i32[b, t]
param E[t, v, d], W[t, d, v]
param h0[b, d]
fn cell(h, id, E, W) {{
  e = h + E[v = id]
  return tanh(e @ W @ E)
}}
hs = scan[t](cell, h0, ids, E, W)
loss = sum(hs * hs)
out loss
out gE[t, v, d] = grad(loss, E)
out gh = grad(loss, h0)
out jv = jvp(loss, h0, h0)
"""

T, B, V, D = 6, 3, 7, 5


def _args(seed=0):
    rng = np.random.default_rng(seed)
    return dict(ids=rng.integers(0, V, (B, T)).astype(np.int32), E=0.4 * rng.standard_normal((T, V, D)),
                W=0.4 * rng.standard_normal((T, D, V)), h0=rng.standard_normal((B, D)))


def _oracle(a):
    """The loop in numpy, its reverse pass written by hand: loss, dloss/dE, dloss/dh0, and
    jvp(loss, h0, h0) = <dloss/dh0, h0>."""
    h, keep = a["h0"], []
    for i in range(T):
        rows = a["E"][i][a["ids"][:, i]]                    # [b, d]
        e = h + rows
        z = e @ a["W"][i] @ a["E"][i]
        keep.append((e, np.tanh(z)))
        h = np.tanh(z)
    hs = np.stack([y for _, y in keep])
    loss = float(np.sum(hs * hs))
    gE, gh = np.zeros_like(a["E"]), np.zeros_like(a["h0"])
    for i in reversed(range(T)):
        e, y = keep[i]
        gh = gh + 2 * y                                     # loss's own use of step i's carry
        gz = gh * (1 - y * y)
        ew = e @ a["W"][i]                                  # [b, v]
        gE[i] += ew.T @ gz                                  # z = ew @ E
        ge = gz @ a["E"][i].T @ a["W"][i].T
        np.add.at(gE[i], a["ids"][:, i], ge)                # the gather's rows
        gh = ge
    return dict(loss=loss, gE=gE, gh=gh, jv=float(np.sum(gh * a["h0"])))


@pytest.mark.parametrize("backend", ["lowered", "cpu", "cuda-sim"])
@pytest.mark.parametrize("fixed", [False, True])
def test_a_scan_over_ids_agrees_with_a_numpy_loop(backend, fixed):
    a = _args()
    want = _oracle(a)
    p = tgc.compile(SOURCE.format(T=f" = {T}" if fixed else ""), backend=backend, dtype="f64")
    got = p(**{k: np.copy(x) for k, x in a.items()})
    for k, w in want.items():
        np.testing.assert_allclose(np.asarray(got[k]), w, rtol=1e-11, atol=1e-12, err_msg=k)


def test_the_oracle_is_torch_autograd():
    torch = pytest.importorskip("torch", reason="torch checks the hand-written loop derivative")
    a = _args(1)
    want = _oracle(a)
    E, W, h = (torch.tensor(a[k], requires_grad=True) for k in ("E", "W", "h0"))
    ids = torch.tensor(a["ids"], dtype=torch.long)
    y, ys = h, []
    for i in range(T):
        y = torch.tanh((y + E[i][ids[:, i]]) @ W[i] @ E[i])
        ys.append(y)
    loss = (torch.stack(ys) ** 2).sum()
    gE, gh = torch.autograd.grad(loss, [E, h])
    assert want["loss"] == pytest.approx(float(loss.detach()), rel=1e-13)
    np.testing.assert_allclose(want["gE"], gE.numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(want["gh"], gh.numpy(), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("backend", ["lowered", "cpu", "cuda-sim"])
@pytest.mark.parametrize("bad", [V, -1])
def test_an_id_out_of_range_in_a_step_is_an_error_before_anything_runs(backend, bad):
    a = _args()
    a["ids"][1, 4] = bad
    p = tgc.compile(SOURCE.format(T=""), backend=backend, dtype="f64")
    before = {k: np.copy(x) for k, x in a.items()}
    with pytest.raises(tgc.EvalError, match=f"'ids'\\[b=1, t=4\\] = {bad}.*loop over 't'"):
        p(**a)
    for k in before:
        np.testing.assert_array_equal(a[k], before[k])


def test_random_inputs_draw_ids_in_range_of_a_gather_in_a_step():
    m = compile_source(SOURCE.format(T=""), "ids.tg", Options())
    ids = random_inputs(m, {"t": 400, "b": B, "v": V, "d": D})["ids"]
    assert ids.min() == 0 and ids.max() == V - 1


BF16_SOURCE = """\
dim layer, b = 2, d = 8
param W: bf16[layer, d, d2: d]
param x0[b, d]
fn blk(x, w) = x + tanh(x @ w)[d2 -> d]
y = repeat[layer](blk, x0, W)
out loss = sum(y * y)
out g[layer, d, d2] = grad(loss, W)
out jv = jvp(loss, x0, x0)
"""


@pytest.mark.parametrize("backend", ["lowered", "cpu", "cuda-sim"])
def test_a_repeat_over_bf16_params_compiles_and_agrees_with_torch(backend):
    """bf16 params stacked on the loop edge, with their bf16 gradient: the CPU and CUDA
    backends store bf16 arguments in 2-byte buffers, and the step (a program of its own,
    reading floats) got them unwidened, and its gradient's `to_bf16` unemulated: an
    internal error at 'plan', then 'no code for to_bf16'."""
    torch = pytest.importorskip("torch", reason="torch is the oracle")
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bf16 arrays")
    rng = np.random.default_rng(0)
    L = 9
    W = (0.4 * rng.standard_normal((L, 8, 8))).astype(ml_dtypes.bfloat16)
    x0 = rng.standard_normal((2, 8)).astype(np.float32)
    p = tgc.compile(BF16_SOURCE, backend=backend)
    got = p(W=W, x0=x0)
    Wt = torch.tensor(W.astype(np.float64), requires_grad=True)
    xt = torch.tensor(x0.astype(np.float64), requires_grad=True)
    y = xt
    for i in range(L):
        y = y + torch.tanh(y @ Wt[i])
    loss = (y * y).sum()
    g, gx = torch.autograd.grad(loss, [Wt, xt])
    assert float(got["loss"]) == pytest.approx(float(loss.detach()), rel=1e-5)
    assert float(got["jv"]) == pytest.approx(float((gx * xt).sum().detach()), rel=1e-4)
    assert got["g"].dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(got["g"].astype(np.float64), g.numpy(), rtol=2 ** -7, atol=1e-3 * float(g.abs().max()))


@pytest.mark.parametrize("fixed", [False, True])
def test_grad_emit_tg_of_a_scan_over_ids_is_an_error_not_a_program_that_does_not_read_back(tmp_path, fixed):
    """The derivative's loop runs backwards over the ids; `.tg` cannot flip them (a
    reindex takes float tensors): printed as `ids[t = size(t) - 1 - t]`, the program
    did not read back ('an integer (i32) tensor can only be used as gather indices')."""
    from click.testing import CliRunner

    from tgc.cli import main

    src = tmp_path / "ids.tg"
    src.write_text(SOURCE.format(T=f" = {T}" if fixed else ""))
    out = tmp_path / "d.tg"
    r = CliRunner().invoke(main, ["grad", str(src), "--wrt", "E", "--of", "loss", "-o", str(out)])
    assert r.exit_code == 1, r.output
    assert "runs backwards" in r.output and "reads i32 ids" in r.output and "Traceback" not in r.output
    assert not out.exists()


SHARED = """\
dim t{T}, b = 3, d = 4
param W[d, d2: d], U[t, d, d2], h0[b, d], c[d]
input xs[t, b, d]
fn cell(h, w, x, u, cc) = tanh(h @ w + (x @ u))[d2 -> d] * cc
hs = scan[t](cell, h0, W * [t = t], xs, U, [t = t] * c)
loss = sum(hs * hs)
out loss
out gW = grad(loss, W)
out gU[t, d, d2] = grad(loss, U)
out gc = grad(loss, c)
out jW = jvp(loss, W, W)
out hW = grad(jvp(loss, W, W), W)
"""


def test_a_weight_repeated_along_the_loop_edge_is_one_invariant_operand():
    """`W * [t = t]` (W repeated along t: every step's W) is passed to the loop as W, an
    invariant: the loop holds no [t, d, d2] stack of it, and its gradient is a sum carried
    through the reverse steps, not a per-step stack summed after (an RNN of width 256
    over t = 4096 held 2.21 GB of temporaries, now 67 MB)."""
    m = compile_source(SHARED.format(T=""), "shared.tg", Options())
    (loop,) = [v for v in m.values() if v.op == "loop"]
    body = loop.attrs[0]
    assert (body.carries, body.slices, body.invariants) == (1, 2, 2)
    assert [o.op for o in loop.operands[3:]] == ["arg", "arg"] and {o.attrs[0] for o in loop.operands[3:]} == {"W", "c"}


@pytest.mark.parametrize("backend", ["lowered", "cpu", "cuda-sim"])
@pytest.mark.parametrize("fixed", [False, True])
def test_a_shared_weight_agrees_with_torch_in_every_mode(backend, fixed):
    torch = pytest.importorskip("torch", reason="torch is the oracle")
    n = 3 if fixed else 11
    rng = np.random.default_rng(0)
    a = dict(W=0.5 * rng.standard_normal((4, 4)), U=0.5 * rng.standard_normal((n, 4, 4)),
             h0=rng.standard_normal((3, 4)), c=rng.standard_normal(4), xs=rng.standard_normal((n, 3, 4)))
    got = tgc.compile(SHARED.format(T=f" = {n}" if fixed else ""), backend=backend, dtype="f64")(
        **{k: np.copy(x) for k, x in a.items()})
    t = {k: torch.tensor(x, requires_grad=True) for k, x in a.items()}
    h, hs = t["h0"], []
    for i in range(n):
        h = torch.tanh(h @ t["W"] + t["xs"][i] @ t["U"][i]) * t["c"]
        hs.append(h)
    loss = (torch.stack(hs) ** 2).sum()
    gW, gU, gc = torch.autograd.grad(loss, [t["W"], t["U"], t["c"]], create_graph=True)
    jW = (gW * t["W"]).sum()
    (hW,) = torch.autograd.grad(jW, [t["W"]])
    want = dict(loss=loss, gW=gW, gU=gU, gc=gc, jW=jW, hW=hW)
    for k, w in want.items():
        np.testing.assert_allclose(np.asarray(got[k]), w.detach().numpy(), rtol=1e-10, atol=1e-12, err_msg=k)


BF16_CARRY = """\
dim layer, b = 2, d = 8
param W: bf16[layer, d, d2: d]
param x0: bf16[b, d]
fn blk(x, w) = bf16(x + tanh(x @ w)[d2 -> d])
y = repeat[layer](blk, x0, W)
out loss = sum(f32(y) * y)
out g[layer, d, d2] = grad(loss, W)
"""


@pytest.mark.parametrize("backend", ["lowered", "cpu", "cuda-sim"])
@pytest.mark.parametrize("fixed", [False, True])
def test_a_bf16_carry_through_a_differentiated_loop(backend, fixed):
    """A bf16 carry (and bf16 params) in a differentiated loop: emulate_low holds a step's
    parameters in f32 as its operands (a bf16 argument widened exactly); it gave the
    forward loop a bf16 operand for an f32 parameter, an internal IRError. Unrolled
    (fixed depth), the stack of the bf16 steps had the compute type f32 where the
    derivative's loop read bf16 slices: an IRError too."""
    torch = pytest.importorskip("torch", reason="torch is the oracle")
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bf16 arrays")
    rng = np.random.default_rng(0)
    L = 7
    W = (0.4 * rng.standard_normal((L, 8, 8))).astype(ml_dtypes.bfloat16)
    x0 = rng.standard_normal((2, 8)).astype(ml_dtypes.bfloat16)
    src = BF16_CARRY.replace("dim layer,", f"dim layer = {L},") if fixed else BF16_CARRY
    got = tgc.compile(src, backend=backend)(W=W, x0=x0)
    Wt = torch.tensor(W.astype(np.float32), requires_grad=True)
    y = torch.tensor(x0.astype(np.float32))
    for i in range(L):   # each step's value rounded to bf16 (its gradient passes straight through)
        z = y + torch.tanh(y @ Wt[i])
        y = z + (z.detach().to(torch.bfloat16).float() - z.detach())
    loss = (y * y).sum()
    (g,) = torch.autograd.grad(loss, [Wt])
    assert float(got["loss"]) == pytest.approx(float(loss.detach()), rel=2 ** -7)
    np.testing.assert_allclose(got["g"].astype(np.float64), g.numpy(), rtol=0.05, atol=0.02 * float(g.abs().max()))
