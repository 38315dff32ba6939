"""Causal products on the CPU (tgc/backends/cpu/causal.py, the own kernel's `tri` form in
fgemm.py): which products of a lowered program skip what a causal mask makes dead (the
plans, golden), and that programs compiled with `CpuOptions.causal_gemm` give the bits
they give without it (attention as examples/gpt2.tg and benchmarks/attention.py write
it, forward and gradients), agree with PyTorch in f32, and that masks under which a
row sees no key, small fills or a result read elsewhere plan nothing."""
from __future__ import annotations

import numpy as np
import pytest

import tgc
from tgc.backends.cpu.causal import Analysis
from tgc.backends.cpu.codegen import generate_units
from tgc.backends.cpu.llvm_env import has_feature
from tgc.lower.lowered import GemmKernel, StepLoop
from tgc.options import CpuOptions, Options

pytestmark = pytest.mark.skipif(not has_feature("avx512f"), reason="the own GEMM kernel needs AVX-512 (avx512f)")

HEAD = """dim batch = {batch}, head = {head}, t = {t}, hd = {hd}
dim s = t
input q[batch, t, head, hd]
input k[batch, s, head, hd]
input v[batch, s, head, hd]
input dy[batch, t, head, hd]
"""
TAIL = """y = sum[s](p * v)
out y[batch, t, head, hd]
loss = sum(y * dy)
out dq[batch, t, head, hd] = grad(loss, q)
out dk[batch, s, head, hd] = grad(loss, k)
out dv[batch, s, head, hd] = grad(loss, v)
"""
MASKS = {   # the weights p, as examples/gpt2.tg and benchmarks/attention.py write them
    "fill": "p = softmax[s](dot[hd](q, k) / sqrt(size(hd)) - 1e9 * [s > t])",
    "where": "p = softmax[s](where([s <= t], dot[hd](q, k) / sqrt(size(hd)), -1e9))",
    "inf": "p = softmax[s](where([s <= t], dot[hd](q, k) / sqrt(size(hd)), -inf))",
    "shifted": "p = softmax[s](dot[hd](q, k) / sqrt(size(hd)) - 1e9 * [s > t + 3])",
}


def source(mask: str, batch=1, head=2, t=64, hd=16) -> str:
    return HEAD.format(batch=batch, head=head, t=t, hd=hd) + mask + "\n" + TAIL


def plans(src: str) -> list[str]:
    low = tgc.compile(src, options=Options(cpu=CpuOptions(threads=1))).lowered
    a = Analysis(low)
    out = []

    def walk(lw):
        for k in lw.kernels:
            if isinstance(k, GemmKernel):
                out.append(f"%{k.out}: {a.plans[id(k)]}" if id(k) in a.plans else f"%{k.out}: -")
            if isinstance(k, StepLoop):
                walk(k.step)
    walk(low)
    return out


def test_plans_of_causal_attention():
    """Golden: q.k and dO.v computed where s <= t only (their readers: the masked max and
    exp, the product with the weights), P v, dS k, dS^T q and P^T dO over the keys or
    queries the weights admit (0 beyond); the same for the where form and an infinite fill."""
    want = ["%t8: out where - s + t + 0 >= 0", "%y: zero where - s + t + 0 >= 0",
            "%t12: out where - s + t + 0 >= 0", "%dq: zero where - s + t + 0 >= 0",
            "%dk: zero where - s + t + 0 >= 0", "%dv: zero where - s + t + 0 >= 0"]
    got = plans(source(MASKS["fill"]))
    assert got == want
    assert [g.split(":")[1] for g in plans(source(MASKS["where"]))] == [w.split(":")[1] for w in want]
    assert [g.split(":")[1] for g in plans(source(MASKS["inf"]))] == [w.split(":")[1] for w in want]
    assert [g.split(":")[1] for g in plans(source(MASKS["shifted"]))] == \
        [w.split(":")[1].replace("+ 0", "+ 3") for w in want]


@pytest.mark.parametrize("mask", [
    "p = softmax[s](dot[hd](q, k) / sqrt(size(hd)) - 1e9 * [s + 4 > t])",    # rows t < 4 see no key
    "p = softmax[s](dot[hd](q, k) / sqrt(size(hd)) - 10 * [s > t])",          # a small fill: weights stay
    "p = softmax[s](dot[hd](q, k) / sqrt(size(hd)) - 1e9 * [s > t])\nout sc[batch, head, s, t] = dot[hd](q, k)",
])
def test_no_plan_where_the_mask_does_not_make_it_dead(mask):
    """A row that sees no key has uniform weights (not 0 above the diagonal), a fill of
    10 leaves the masked weights positive, and a product read as an output is needed
    everywhere: nothing there is planned (the last: only the output's own product)."""
    got = plans(source(mask))
    if "out sc" in mask:
        assert [g for g in got if g.endswith("-")] and not any("out where" in g and "%sc" in g for g in got)
    else:
        assert all(g.endswith(": -") for g in got), got


def _run(src, options, arrays):
    p = tgc.compile(src, options=options)
    return p, {k: np.asarray(v) for k, v in p(**{k: v.copy() for k, v in arrays.items()}).items()}


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("sizes", [dict(batch=2, head=2, t=256, hd=64), dict(batch=1, head=3, t=100, hd=32),
                                   dict(batch=1, head=1, t=520, hd=64)])   # (one product: cut into tiles)
def test_causal_products_give_the_same_bits(mask, sizes):
    """Compiled with and without `causal_gemm` (one thread and two), every output has the
    same bits; at t = 256 and 520 (hd 64: the own kernel's tiles; one product of 520,
    cut into tiles at offsets) the generated code runs the kernel's `tri` form (at t =
    100, hd 32 the tiles go to OpenBLAS and compute it all)."""
    src = source(MASKS[mask], **sizes)
    rng = np.random.default_rng(len(mask))
    b, t, h, d = sizes["batch"], sizes["t"], sizes["head"], sizes["hd"]
    arrays = {n: rng.standard_normal((b, t, h, d)).astype(np.float32) for n in ("q", "k", "v", "dy")}
    for threads in (1, 2):
        opts = Options(cpu=CpuOptions(threads=threads))
        on, got = _run(src, opts, arrays)
        _, want = _run(src, opts.with_(causal_gemm=False), arrays)
        for name in want:
            assert got[name].tobytes() == want[name].tobytes(), (name, threads)
            assert np.isfinite(got[name]).all()
    if t >= 256:
        assert ".tri" in "".join(generate_units(on.lowered, opts))


def test_causal_attention_f32_against_torch():
    """f32 with causal products against PyTorch's SDPA (is_causal) with autograd: within
    10x of PyTorch f32's error against a float64 reference, for y and every gradient."""
    torch = pytest.importorskip("torch")
    b, h, t, d = 2, 2, 256, 64
    src = source(MASKS["fill"], batch=b, head=h, t=t, hd=d)
    rng = np.random.default_rng(3)
    arrays = {n: rng.standard_normal((b, t, h, d)).astype(np.float32) for n in ("q", "k", "v", "dy")}
    _, got = _run(src, Options(cpu=CpuOptions(threads=1)), arrays)

    def ref(dtype):
        x = {n: torch.tensor(a.transpose(0, 2, 1, 3), dtype=dtype, requires_grad=n != "dy") for n, a in arrays.items()}
        y = torch.nn.functional.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True)
        gq, gk, gv = torch.autograd.grad((y * x["dy"]).sum(), [x["q"], x["k"], x["v"]])
        return {n: r.detach().numpy().transpose(0, 2, 1, 3).astype(np.float64)
                for n, r in zip(("y", "dq", "dk", "dv"), (y, gq, gk, gv))}
    exact, torch32 = ref(torch.float64), ref(torch.float32)
    for name, w in exact.items():
        err, terr = np.abs(got[name] - w).max(), np.abs(torch32[name] - w).max()
        assert err <= 10 * terr + 1e-7, (name, err, terr)


def test_a_nan_query_stays_within_the_unplanned_nans():
    """A NaN in one query row (outside the assumption): the planned program gives NaN
    only where the unplanned one does, and the same bits at every other element; its
    dk and dv are NaN at the keys whose blocks of 6 rows reach the row (here 0..5, the
    keys it sees, as in PyTorch's SDPA), where the unplanned program's reach every key
    (the row's weights are NaN at every key)."""
    src = source(MASKS["fill"], batch=1, head=2, t=256, hd=64)
    rng = np.random.default_rng(0)
    arrays = {n: rng.standard_normal((1, 256, 2, 64)).astype(np.float32) for n in ("q", "k", "v", "dy")}
    arrays["q"][0, 5, 0, 3] = np.nan
    opts = Options(cpu=CpuOptions(threads=1))
    _, got = _run(src, opts, arrays)
    _, want = _run(src, opts.with_(causal_gemm=False), arrays)
    for name in want:
        bad = np.isnan(want[name])
        assert (np.isnan(got[name]) <= bad).all() and got[name][~bad].tobytes() == want[name][~bad].tobytes(), name
    assert sorted(set(np.argwhere(np.isnan(got["dk"][0, :, 0]))[:, 0])) == list(range(6))
