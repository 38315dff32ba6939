"""Integer indicators `[node = ids]`: gathers, scatter-adds and segment max/min.

Values against numpy references (np.add.at, np.maximum.at) on the IR interpreter, the
lowered interpreter and the CPU backend; derivatives against central differences; the
O(edges x features) claim as "no value and no buffer has both a node edge and an id
edge"; bounds errors; the text IR; f32 accuracy against PyTorch float32.
"""
from __future__ import annotations

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.frontend import compile_source
from tgc.ir.diag import CompileError
from tgc.ir.interp import EvalError, evaluate
from tgc.lower.interp import run_lowered
from tgc.ir.parser import parse_module
from tgc.ir.printer import print_module
from tgc.options import Options
from tgc.pipeline import lower_module
from numerics_util import Case, compare as compare_f32, report
from passes_util import central_difference, optimize

N, M, F = 6, 11, 3
DST = np.array([0, 1, 1, 3, 3, 3, 0, 1, 4, 4, 1], np.int32)   # node 2 and node 5 get nothing
SRC = np.array([5, 2, 0, 1, 1, 4, 3, 2, 0, 5, 2], np.int32)

PROGRAM = f"""
dim n = {N}, m = {M}, f = {F}
input x[n, f]
input msg[m, f]
input s[m]
input dst: i32[m]
input src: i32[m]
out add = msg @ [n = dst]
out add_sum = sum[m](msg * [n = dst])
out degree = sum[m]([n = dst])
out gathered = x @ [n = src]
out same = x[n = src]
out smax = max[m](where([n = dst], msg, -inf))
out smin = min[m](where([n = dst], msg, inf))
out smax_all = max[m, f](where([n = dst], msg, -inf))
mx = max[m](where([n = dst], s, -inf))
w = exp(s - mx[n = dst])
out attn = w / (w @ [n = dst])[n = dst]
"""


def inputs(seed=0):
    r = np.random.default_rng(seed)
    return {"x": r.normal(size=(N, F)), "msg": r.normal(size=(M, F)), "s": r.normal(size=M),
            "dst": DST.copy(), "src": SRC.copy()}


def numpy_reference(a):
    x, msg, s, dst, src = a["x"], a["msg"], a["s"], a["dst"], a["src"]
    add = np.zeros((N, F))
    np.add.at(add, dst, msg)
    degree = np.zeros(N)
    np.add.at(degree, dst, 1.0)
    smax = np.full((N, F), -np.inf)
    np.maximum.at(smax, dst, msg)
    smin = np.full((N, F), np.inf)
    np.minimum.at(smin, dst, msg)
    mx = np.full(N, -np.inf)
    np.maximum.at(mx, dst, s)
    w = np.exp(s - mx[dst])
    z = np.zeros(N)
    np.add.at(z, dst, w)
    return {"add": add, "add_sum": add, "degree": degree, "gathered": x[src], "same": x[src],
            "smax": smax, "smin": smin, "smax_all": smax.max(axis=1), "attn": w / z[dst]}


def backends(source, dtype, a):
    """The outputs of `source` on the three evaluators, by name."""
    opts = Options(dtype=dtype)
    m = pipeline.lower(compile_source(source, "<scatter>", opts), opts).module
    out = {"interp": evaluate(m, {k: v.copy() for k, v in a.items()}, dtype=dtype),
           "lowered": run_lowered(lower_module(m, opts), {k: v.copy() for k, v in a.items()}),
           "cpu": tgc.compile(source, dtype=dtype).run({k: v.copy() for k, v in a.items()})}
    return m, out


@pytest.mark.parametrize("dtype", ["f64", "f32"])
def test_values_on_every_backend(dtype):
    a = inputs()
    want = numpy_reference(a)
    _, got = backends(PROGRAM, dtype, a)
    tol = 1e-12 if dtype == "f64" else 1e-5
    for backend, outs in got.items():
        assert set(outs) == set(want)
        for k, w in want.items():
            np.testing.assert_allclose(outs[k], w, rtol=tol, atol=tol, err_msg=f"{backend}: {k}")
    # empty segments: -inf for max, inf for min, 0 for sums, as the dense forms give
    for outs in got.values():
        assert np.all(outs["smax"][[2, 5]] == -np.inf) and np.all(outs["smin"][[2, 5]] == np.inf)
        assert np.all(outs["add"][[2, 5]] == 0.0)


def test_the_dense_meaning_is_the_same():
    """The unoptimized module (the indicator a dense 0/1 tensor) gives the same values."""
    a = inputs(1)
    dense = compile_source(PROGRAM, "<scatter>", Options(dtype="f64"))
    got = evaluate(dense, {k: v.copy() for k, v in a.items()}, dtype="f64")
    for k, w in numpy_reference(a).items():
        np.testing.assert_allclose(got[k], w, rtol=1e-12, atol=1e-12, err_msg=k)


def test_the_indicator_used_elementwise_is_the_one_hot():
    src = f"dim n = {N}, m = {M}\ninput dst: i32[m]\nout S = [n = dst]\nout T = [dst = n] * 2\n"
    a = {"dst": DST.copy()}
    want = (np.arange(N)[:, None] == DST[None, :]).astype(float)
    for backend, outs in backends(src, "f64", a)[1].items():
        np.testing.assert_array_equal(outs["S"], want, err_msg=backend)
        np.testing.assert_array_equal(outs["T"], 2 * want, err_msg=backend)


def _mixed(v) -> bool:
    return "n" in v.edges and "m" in v.edges


GRADS = PROGRAM + """
input gx[n, f], gm[m, f], gs[m]
out l_add = sum((msg @ [n = dst]) * x)
out l_gather = sum(sin(x @ [n = src]) * msg)
out l_max = sum(max[m](where([n = dst], msg * msg, -inf)) * x)
out l_min = sum(min[m](where([n = dst], msg, inf)) * x)
mx2 = max[m](where([n = dst], s, -inf))
w2 = exp(s - mx2[n = dst])
out l_attn = sum(w2 / (w2 @ [n = dst])[n = dst] * s * s)
out d_add = grad(l_add, msg)
out d_gather_x = grad(l_gather, x)
out d_gather_m = grad(l_gather, msg)
out d_max = grad(l_max, msg)
out d_min = grad(l_min, msg)
out d_attn = grad(l_attn, s)
out t_max = jvp(l_max, msg, gm)
out t_attn = jvp(l_attn, s, gs)
"""

LOSSES = {"d_add": ("l_add", "msg"), "d_gather_x": ("l_gather", "x"), "d_gather_m": ("l_gather", "msg"),
          "d_max": ("l_max", "msg"), "d_min": ("l_min", "msg"), "d_attn": ("l_attn", "s")}


def test_derivatives_against_finite_differences_on_every_backend():
    a = inputs(2)
    a["dst"] = np.array([0, 1, 1, 3, 3, 3, 0, 1, 4, 2, 5], np.int32)   # no empty segment: finite losses
    r = np.random.default_rng(5)
    a.update(gx=r.normal(size=(N, F)), gm=r.normal(size=(M, F)), gs=r.normal(size=M))
    m, got = backends(GRADS, "f64", a)
    assert not [v for v in m.values() if _mixed(v)], "a nodes x edges value in the derivative program"
    for out, (loss, wrt) in LOSSES.items():
        fd = np.zeros_like(a[wrt])
        for idx in np.ndindex(a[wrt].shape):
            d = np.zeros_like(a[wrt])
            d[idx] = 1.0
            fd[idx] = central_difference(m, a, loss, wrt, d, 1e-6)
        for backend, outs in got.items():
            np.testing.assert_allclose(outs[out], fd, rtol=1e-6, atol=1e-7, err_msg=f"{backend}: {out}")
    for t, (loss, wrt, dir_) in {"t_max": ("l_max", "msg", "gm"), "t_attn": ("l_attn", "s", "gs")}.items():
        fd = central_difference(m, a, loss, wrt, a[dir_], 1e-6)
        for backend, outs in got.items():
            np.testing.assert_allclose(outs[t], fd, rtol=1e-6, atol=1e-7, err_msg=f"{backend}: {t}")


def test_segment_max_ties_share_the_gradient_like_max():
    src = f"""dim n = {N}, m = {M}
input msg[m]
input dst: i32[m]
out g = grad(sum(max[m](where([n = dst], msg, -inf))), msg)
"""
    a = {"msg": np.ones(M), "dst": DST.copy()}
    count = np.bincount(DST, minlength=N)
    for backend, outs in backends(src, "f64", a)[1].items():
        np.testing.assert_allclose(outs["g"], 1.0 / count[DST], err_msg=backend)


SOFTMAX = """
dim n, m, f
input s[m]
input h[n, f]
input dst: i32[m]
input src: i32[m]
m_ = max[m](where([n = dst], s, -inf))
w = exp(s - m_[n = dst])
z = w @ [n = dst]
a = w / z[n = dst]
y = (a * (h @ [n = src])) @ [n = dst]
out y
out ds = grad(sum(y * y), s)
out dh = grad(sum(y * y), h)
"""


@pytest.mark.parametrize("strict", [False, True])
def test_segment_softmax_has_no_nodes_by_edges_buffer(strict):
    opts = Options(dtype="f32", fp_strict=strict)
    m = pipeline.lower(compile_source(SOFTMAX, "<softmax>", opts), opts).module
    assert not [v for v in m.values() if _mixed(v)]
    low = lower_module(m, opts)
    assert not [b for b in low.buffers.values() if {"n", "m"} <= set(b.edges)]
    text = "\n".join(k.text() for k in low.kernels)
    assert "max=" in text and "+=" in text    # a segment max and scatter-adds
    a = {"s": np.random.default_rng(0).normal(size=M).astype(np.float32),
         "h": np.random.default_rng(1).normal(size=(N, F)).astype(np.float32),
         "dst": DST.copy(), "src": SRC.copy()}
    want = evaluate(m, {k: v.copy() for k, v in a.items()}, dtype="f64")
    got = run_lowered(low, {k: v.copy() for k, v in a.items()})
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)


def test_verify_each_and_the_text_ir():
    m = optimize(compile_source(PROGRAM, "<scatter>", Options(dtype="f64")))
    text = print_module(m)
    assert "scatter[max: n]" in text and "scatter[min: n]" in text and "gather[n]" in text
    assert print_module(parse_module(text)) == text
    a = inputs(3)
    got = evaluate(parse_module(text), a, dtype="f64")
    for k, w in numpy_reference(a).items():
        np.testing.assert_allclose(got[k], w, rtol=1e-12, atol=1e-12, err_msg=k)


def test_ids_out_of_range_are_refused_naming_the_input():
    bad = inputs()
    bad["dst"][4] = N
    opts = Options(dtype="f64")
    m = pipeline.lower(compile_source(PROGRAM, "<scatter>", opts), opts).module
    with pytest.raises(EvalError, match="'dst'"):
        evaluate(m, bad, dtype="f64")
    with pytest.raises(EvalError, match="'dst'"):
        run_lowered(lower_module(m, opts), bad)
    prog = tgc.compile(PROGRAM, dtype="f64")
    with pytest.raises(EvalError, match="'dst'"):
        prog.run(bad)
    neg = inputs()
    neg["src"][0] = -1
    with pytest.raises(EvalError, match="'src'"):
        prog.run(neg)


def test_the_degree_alone_still_checks_its_ids():
    src = f"dim n = {N}, m = {M}\ninput dst: i32[m]\nout d = sum[m, n]([n = dst])\n"
    prog = tgc.compile(src, dtype="f64")
    assert prog.run({"dst": DST.copy()})["d"] == M
    bad = DST.copy()
    bad[0] = 99
    with pytest.raises(EvalError, match="'dst'"):
        prog.run({"dst": bad})


@pytest.mark.parametrize("body, message", [
    ("[n = x]", "an indicator's data must be an i32 tensor; 'x' is a float tensor"),
    ("[dst = dst] * x", "one side must be an edge"),
    ("[n + 1 = dst]", "relates it to one edge, written alone"),
    ("[m = dst]", "is also an edge of 'dst'"),
])
def test_errors_are_located(body, message):
    src = f"dim n = {N}, m = {M}\ninput x[n]\ninput dst: i32[m]\nout y = {body}\n"
    with pytest.raises(CompileError, match=message) as e:
        compile_source(src, "bad.tg", Options())
    assert e.value.loc is not None and e.value.loc.line == 4


def _torch_case():
    r = np.random.default_rng(7)
    n, m, f = 40, 400, 8
    a = {"x": r.normal(size=(n, f)), "msg": r.normal(size=(m, f)), "s": 3 * r.normal(size=m),
         "dst": r.integers(0, n, m).astype(np.int32), "src": r.integers(0, n, m).astype(np.int32)}
    src = f"""dim n = {n}, m = {m}, f = {f}
input x[n, f], msg[m, f], s[m]
input dst: i32[m]
input src: i32[m]
out add = msg @ [n = dst]
out gathered = tanh(x @ [n = src]) * msg
out smax = max[m](where([n = dst], msg, -inf))
mx = max[m](where([n = dst], s, -inf))
w = exp(s - mx[n = dst])
out attn = w / (w @ [n = dst])[n = dst]
out d_msg = grad(sum(((tanh(x @ [n = src]) * msg) @ [n = dst]) ^ 2), msg)
out d_x = grad(sum(((tanh(x @ [n = src]) * msg) @ [n = dst]) ^ 2), x)
"""

    def ref(T):
        import torch

        dst, srcl = T.dst.long(), T.src.long()
        add = torch.zeros(n, f, dtype=T.msg.dtype).index_add(0, dst, T.msg)
        smax = torch.full((n, f), -torch.inf, dtype=T.msg.dtype).scatter_reduce(
            0, dst[:, None].expand(m, f), T.msg, "amax")
        mx = torch.full((n,), -torch.inf, dtype=T.s.dtype).scatter_reduce(0, dst, T.s, "amax")
        w = torch.exp(T.s - mx[dst])
        attn = w / torch.zeros(n, dtype=w.dtype).index_add(0, dst, w)[dst]
        x, msg = T.x.clone().requires_grad_(True), T.msg.clone().requires_grad_(True)
        y = torch.zeros(n, f, dtype=x.dtype).index_add(0, dst, torch.tanh(x[srcl]) * msg)
        d_x, d_msg = torch.autograd.grad((y ** 2).sum(), (x, msg))
        return {"add": add, "gathered": torch.tanh(T.x[srcl]) * T.msg, "smax": smax, "attn": attn,
                "d_msg": d_msg, "d_x": d_x}

    return Case("scatter_segment", src, a, ref)


@pytest.mark.parametrize("backend", ["interp", "cpu"])
def test_f32_not_worse_than_torch(backend):
    pytest.importorskip("torch", reason="PyTorch is the float32 oracle")
    case = _torch_case()
    results = compare_f32(case, backend)
    assert all(r.passed for r in results), report(case, backend, results)


@pytest.mark.parametrize("backend", ["cpu", "cuda-sim"])
@pytest.mark.parametrize("edges", [100_000, 600])
def test_f32_scatter_add_of_many_terms_per_node_is_rounded_once(edges, backend):
    """An f32 scatter-add into a small output: with many terms per element (100000
    into 8 x 2, here with the edges a symbolic size: the length picks the form at run
    time) it adds in f64 (the CPU: a scratch copy on the stack; CUDA: f64 atomics into
    a scratch of doubles), each element rounded once, as the interpreters do; with few
    (600 into 8 x 2, 75 each) it adds into the f32 output, within f32's rounding of a
    chain that short."""
    from backends_util import compile_on

    src = "dim e, node = 8, f = 2\ninput dst: i32[e]\ninput msg[e, f]\nout agg[node, f] = msg @ [node = dst]\n"
    r = np.random.default_rng(7)
    dst = r.integers(0, 8, edges).astype(np.int32)
    msg = r.uniform(size=(edges, 2)).astype(np.float32)
    got = compile_on(src, backend, dtype="f32")(dst=dst, msg=msg)["agg"]
    want = np.zeros((8, 2))
    np.add.at(want, dst, msg.astype(np.float64))
    if edges > 8 * 2 * 256 and backend == "cpu":   # the f64 sum in the edges' order, as np.add.at's, rounded once
        np.testing.assert_array_equal(got, want.astype(np.float32))
    elif edges > 8 * 2 * 256:   # f64 atomics: an f64 sum in some order, rounded once
        assert np.all(np.abs(got - want) <= 0.5000001 * np.spacing(want.astype(np.float32)))
    assert np.max(np.abs(got - want)) / np.max(want) <= 75 * 2.0 ** -24


def test_gcn_example_against_torch():
    """examples/gcn.tg, forward and backward, against index_add / scatter_reduce (float64)."""
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle of the GCN example")
    from pathlib import Path

    n, e = 50, 300
    r = np.random.default_rng(11)
    a = {"x": r.normal(size=(n, 16)), "src": r.integers(0, n, e).astype(np.int32),
         "dst": r.integers(0, n, e).astype(np.int32), "y": np.eye(4)[r.integers(0, 4, n)],
         "W1": r.normal(size=(16, 32)) / 4, "W2": r.normal(size=(32, 4)) / 4,
         "a_src": r.normal(size=4), "a_dst": r.normal(size=4), "lr": np.asarray(0.1)}
    a["dst"][:3] = [7, 7, 7]     # a node with several in-edges, and (likely) nodes with none

    T = {k: torch.tensor(v) for k, v in a.items()}
    src, dst = T["src"].long(), T["dst"].long()
    params = {k: T[k].clone().requires_grad_(True) for k in ("W1", "W2", "a_src", "a_dst")}
    deg = torch.zeros(n, dtype=torch.float64).index_add(0, dst, torch.ones(e, dtype=torch.float64)) + 1
    xw = T["x"] @ params["W1"]
    h = torch.relu((torch.zeros(n, 32, dtype=torch.float64).index_add(0, dst, xw[src]) + xw) / deg[:, None])
    v = h @ params["W2"]
    s = torch.tanh(v[src] @ params["a_src"] + v[dst] @ params["a_dst"])
    m = torch.full((n,), -torch.inf, dtype=torch.float64).scatter_reduce(0, dst, s, "amax").detach()
    w = torch.exp(s - m[dst])
    att = w / torch.zeros(n, dtype=torch.float64).index_add(0, dst, w)[dst]
    logits = torch.zeros(n, 4, dtype=torch.float64).index_add(0, dst, att[:, None] * v[src]) + v
    loss = -(T["y"] * torch.log_softmax(logits, 1)).sum(1).mean()
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))

    prog = tgc.compile(str(Path(__file__).resolve().parents[2] / "examples" / "gcn.tg"), dtype="f64")
    arrays = {k: np.array(v, copy=True) for k, v in a.items()}
    got = prog(**arrays)
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-12)
    np.testing.assert_allclose(got["logits"], logits.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got["dW1"], grads["W1"].numpy(), rtol=1e-9, atol=1e-12)
    for k, g in grads.items():   # the updates: one SGD step
        np.testing.assert_allclose(arrays[k], a[k] - 0.1 * g.numpy(), rtol=1e-10, atol=1e-12, err_msg=k)


def test_grad_emits_integer_indicators_that_compile_back():
    """`tgc grad --emit tg` spells scatters with `[n = ids]`, and the program computes the same."""
    from tgc.frontend.emit_tg import emit_tg

    src = f"""dim n = {N}, m = {M}, f = {F}
input msg[m, f], x[n, f]
input dst: i32[m]
out l = sum(max[m](where([n = dst], msg, -inf)) * x) + sum(min[m](where([n = dst], msg, inf)) * x)
out d = grad(sum((msg @ [n = dst]) * x) + l, msg)
"""
    opts = Options(dtype="f64")
    m = pipeline.lower(compile_source(src, "<emit>", opts), opts).module
    text = emit_tg(m)
    assert "where([n = dst], msg, -inf)" in text and "where([n = dst], msg, inf)" in text
    assert "* [n = dst]" in text
    again = pipeline.lower(compile_source(text, "<emitted>", opts), opts).module
    a = inputs(4)
    a["dst"] = np.array([0, 1, 1, 3, 3, 3, 0, 1, 4, 2, 5], np.int32)
    a = {k: a[k] for k in ("msg", "x", "dst")}
    want = evaluate(m, dict(a), dtype="f64")
    got = evaluate(again, dict(a), dtype="f64")
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, err_msg=k)


def test_second_derivatives_stay_in_edge_space():
    """A Hessian-vector product through a scatter-add, a gather and a segment max: against
    central differences of the gradient, and with no nodes x edges value."""
    src = f"""dim n = {N}, m = {M}, f = {F}
input msg[m, f], v[m, f], x[n, f]
input dst: i32[m]
input src: i32[m]
l = sum(tanh((msg @ [n = dst]) * x) ^ 2) + sum(max[m](where([n = dst], msg * msg, -inf)) * x) + sum(exp((x @ [n = src]) * msg))
out g = grad(l, msg)
out hv = grad(sum(grad(l, msg) * v), msg)
"""
    r = np.random.default_rng(9)
    a = {"msg": r.normal(size=(M, F)), "v": r.normal(size=(M, F)), "x": r.normal(size=(N, F)),
         "dst": np.array([0, 1, 1, 3, 3, 3, 0, 1, 4, 2, 5], np.int32), "src": SRC.copy()}
    m, got = backends(src, "f64", a)
    assert not [v for v in m.values() if _mixed(v)]
    fd = central_difference(m, a, "g", "msg", a["v"], 1e-6)
    for backend, outs in got.items():
        np.testing.assert_allclose(outs["hv"], fd, rtol=1e-6, atol=1e-6, err_msg=backend)


def test_torch_autograd_oracle_agrees():
    """The elaborated (dense) module under torch.autograd (tests/torch_oracle.py) gives the
    values and derivatives tgc computes with gathers, scatters and segment reductions."""
    pytest.importorskip("torch", reason="PyTorch is the autograd oracle")
    import torch_oracle

    a = inputs(6)
    a["dst"] = np.array([0, 1, 1, 3, 3, 3, 0, 1, 4, 2, 5], np.int32)
    r = np.random.default_rng(8)
    a.update(gx=r.normal(size=(N, F)), gm=r.normal(size=(M, F)), gs=r.normal(size=M))
    dense = compile_source(GRADS, "<oracle>", Options(dtype="f64"))
    want = torch_oracle.evaluate(dense, {k: v.copy() for k, v in a.items()})
    got = tgc.compile(GRADS, dtype="f64").run({k: v.copy() for k, v in a.items()})
    for k, w in want.items():
        np.testing.assert_allclose(got[k], w, rtol=1e-10, atol=1e-12, err_msg=k)
    # and the oracle's own segment reductions, on the text IR
    text = f"""dim v = 4
dim n = 6
input c : f64[n]
input ids : i32[n]
%a = scatter[max: v] %c, %ids : f64[v]
%b = scatter[min: v] %c, %ids : f64[v]
out a = %a : [v]
out b = %b : [v]
"""
    x = {"c": np.array([3.0, -1.0, 2.0, 7.0, 0.5, -4.0]), "ids": np.array([1, 1, 3, 0, 3, 1], np.int32)}
    want = torch_oracle.evaluate(parse_module(text), dict(x))
    got = evaluate(parse_module(text), dict(x), dtype="f64")
    np.testing.assert_array_equal(got["a"], [7.0, 3.0, -np.inf, 2.0])
    np.testing.assert_array_equal(got["b"], [7.0, -4.0, np.inf, 0.5])
    for k in got:
        np.testing.assert_array_equal(want[k], got[k], err_msg=k)


def test_nan_propagates_through_segment_max_and_min():
    src = f"""dim n = {N}, m = {M}
input msg[m]
input dst: i32[m]
out a = max[m](where([n = dst], msg, -inf))
out b = min[m](where([n = dst], msg, inf))
"""
    msg = np.arange(M, dtype=float)
    msg[4] = np.nan                      # in node 3's segment (DST[4] = 3)
    for backend, outs in backends(src, "f64", {"msg": msg, "dst": DST.copy()})[1].items():
        for k in ("a", "b"):
            assert np.isnan(outs[k][3]), (backend, k)
            assert not np.isnan(np.delete(outs[k], 3)).any(), (backend, k)
