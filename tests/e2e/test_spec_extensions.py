"""Conformance with the language reference's extensions (docs/language.md), through the command line.

Each case is written from the reference's wording alone, with independent numpy
expectations; it runs as `tgc run F --inputs in.npz -o out.npz` on the interpreter and
on every registered backend (`backends_util`; cuda-sim has its own tests) in float64,
and each must agree with the expectation. Bad
programs must give a located `file:LINE:COL: error:` and exit 1; bad inputs exit 3."""
from __future__ import annotations

import textwrap

import numpy as np
import pytest
from click.testing import CliRunner

from tgc.cli import main

from backends_util import EMULATED, backends, require

BACKENDS = ("interp", *backends(exclude=EMULATED))


def run(tmp_path, src, inputs, backend, dtype="f64", extra=()):
    f = tmp_path / "p.tg"
    f.write_text(textwrap.dedent(src))
    np.savez(tmp_path / "in.npz", **inputs)
    out = tmp_path / f"out_{backend}.npz"
    require(backend)
    r = CliRunner().invoke(main, ["run", str(f), "--inputs", str(tmp_path / "in.npz"), "-o", str(out),
                                  "--backend", backend, "--dtype", dtype, *extra])
    if r.exit_code != 0:
        return r, None
    with np.load(out) as z:
        return r, {k: z[k] for k in z.files}


def ok(tmp_path, src, inputs, backend, **kw):
    r, out = run(tmp_path, src, inputs, backend, **kw)
    assert r.exit_code == 0, r.output
    return out


def fails(tmp_path, src, inputs=None, backend="interp", code=1, match=None, extra=()):
    r, _ = run(tmp_path, src, inputs or {}, backend, extra=extra)
    assert r.exit_code == code, r.output
    if code == 1:
        assert "p.tg:" in r.output and "error:" in r.output, r.output
    if match:
        assert match in r.output, r.output
    return r.output


rng = np.random.default_rng(11)

# ------------------------------------------------------------------ randomness

RAND = """
dim a = 64, b = 50
input key: i32
out u = rand[a, b](key)
out v = randn[a, b](key)
out w = rand[a, b](fold(key, 1))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_rand_and_randn_draw_from_their_distributions(tmp_path, backend):
    out = ok(tmp_path, RAND, {"key": np.int32(7)}, backend)
    u, v, w = out["u"], out["v"], out["w"]
    assert u.shape == (64, 50) and v.shape == (64, 50)
    assert (u >= 0).all() and (u < 1).all()
    assert abs(u.mean() - 0.5) < 0.02 and abs(u.var() - 1 / 12) < 0.01
    assert abs(v.mean()) < 0.06 and abs(v.std() - 1) < 0.05
    assert not np.array_equal(u, w)           # a folded key is a new key
    assert abs(np.corrcoef(u.ravel(), w.ravel())[0, 1]) < 0.05


def test_random_values_are_the_same_on_every_backend_and_depend_on_the_key(tmp_path):
    i = ok(tmp_path, RAND, {"key": np.int32(3)}, "interp")
    c = ok(tmp_path, RAND, {"key": np.int32(3)}, "cpu")
    np.testing.assert_array_equal(i["u"], c["u"])
    np.testing.assert_allclose(i["v"], c["v"], rtol=1e-12, atol=1e-12)
    other = ok(tmp_path, RAND, {"key": np.int32(4)}, "cpu")
    assert not np.array_equal(other["u"], c["u"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_values_do_not_depend_on_fusion(tmp_path, backend):
    """The same draw alone and inside a bigger fused expression has the same values."""
    src = """
    dim n = 300
    input key: i32
    input x[n]
    out u = rand[n](key)
    out y = exp(x) * rand[n](key) + 1
    """
    x = rng.standard_normal(300)
    out = ok(tmp_path, src, {"key": np.int32(5), "x": x}, backend)
    np.testing.assert_allclose(out["y"], np.exp(x) * out["u"] + 1, rtol=1e-14)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_zeroes_with_probability_p_and_scales_the_rest(tmp_path, backend):
    src = """
    dim n = 4000
    input key: i32
    input x[n]
    out y = dropout[n](x, key, 0.25)
    out d = grad(sum[n](dropout[n](x, key, 0.25) * x), x)
    """
    x = rng.uniform(1, 2, 4000)
    out = ok(tmp_path, src, {"key": np.int32(1), "x": x}, backend)
    y, d = out["y"], out["d"]
    kept = y != 0
    assert abs(kept.mean() - 0.75) < 0.03
    np.testing.assert_allclose(y[kept], x[kept] / 0.75, rtol=1e-12)
    # d/dx of (m x / 0.75) * x = 2 m x / 0.75, the mask a constant
    np.testing.assert_allclose(d, 2 * y, rtol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_values_have_zero_derivative(tmp_path, backend):
    src = """
    dim n = 10
    input key: i32
    input x[n]
    out g = grad(sum[n](x * randn[n](key) + rand[n](key) ^ 2), x)
    out z = randn[n](key)
    """
    out = ok(tmp_path, src, {"key": np.int32(9), "x": rng.standard_normal(10)}, backend)
    np.testing.assert_allclose(out["g"], out["z"], rtol=1e-14)


def test_a_float_key_is_an_error(tmp_path):
    fails(tmp_path, "dim n = 3\ninput k\nout u = rand[n](k)\n")


# ------------------------------------------------- integer indicators, scatter, segments

GRAPH = dict(node=5, e=9, f=3)
SRC_IDS = np.array([0, 1, 2, 3, 4, 0, 1, 2, 3], np.int32)
DST_IDS = np.array([1, 2, 3, 4, 0, 1, 1, 4, 4], np.int32)   # node 0 one edge, 2 none... (3 has one)
HEAD = """
dim node = 5, e = 9, f = 3
input src: i32[e]
input dst: i32[e]
input x[node, f]
input msg[e, f]
"""


def graph_inputs():
    return {"src": SRC_IDS, "dst": DST_IDS, "x": rng.standard_normal((5, 3)), "msg": rng.standard_normal((9, 3))}


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_indicator_on_integer_data_gathers_and_scatters(tmp_path, backend):
    src = HEAD + """
    out ind = [node = dst]
    out g1 = x @ [node = src]
    out g2 = x[node = src]
    out s = msg @ [node = dst]
    out s2 = sum[e](msg * [node = dst])
    """
    inp = graph_inputs()
    out = ok(tmp_path, src, inp, backend)
    ind = np.zeros((5, 9))
    ind[DST_IDS, np.arange(9)] = 1
    assert sorted(out["ind"].shape) == [5, 9]
    dense = out["ind"] if out["ind"].shape == (5, 9) else out["ind"].T
    np.testing.assert_array_equal(dense, ind)
    want_g = inp["x"][SRC_IDS]
    for k in ("g1", "g2"):
        got = out[k] if out[k].shape == (9, 3) else out[k].T
        np.testing.assert_allclose(got, want_g, rtol=1e-14)
    want_s = np.zeros((5, 3))
    np.add.at(want_s, DST_IDS, inp["msg"])
    for k in ("s", "s2"):
        got = out[k] if out[k].shape == (5, 3) else out[k].T
        np.testing.assert_allclose(got, want_s, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("backend", BACKENDS)
def test_segment_max_and_its_gradient(tmp_path, backend):
    src = HEAD + """
    out m = max[e](where([node = dst], msg, -inf))
    out dm = grad(sum[node, f](where(m > -inf, m, 0) * x), msg)
    """
    inp = graph_inputs()
    out = ok(tmp_path, src, inp, backend)
    msg, x = inp["msg"], inp["x"]
    want = np.full((5, 3), -np.inf)
    np.maximum.at(want, DST_IDS, msg)
    got = out["m"] if out["m"].shape == (5, 3) else out["m"].T
    np.testing.assert_array_equal(got, want)
    dm = np.zeros((9, 3))
    for e in range(9):
        for f in range(3):
            if msg[e, f] == want[DST_IDS[e], f]:
                dm[e, f] = x[DST_IDS[e], f]
    got = out["dm"] if out["dm"].shape == (9, 3) else out["dm"].T
    np.testing.assert_allclose(got, dm, rtol=1e-14)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scatter_gradient_is_a_gather(tmp_path, backend):
    src = HEAD + """
    input w[node, f]
    out dmsg = grad(sum[node, f](w * (msg @ [node = dst])), msg)
    out dx = grad(sum[e, f](msg * (x @ [node = src])), x)
    """
    inp = graph_inputs()
    inp["w"] = rng.standard_normal((5, 3))
    out = ok(tmp_path, src, inp, backend)
    got = out["dmsg"] if out["dmsg"].shape == (9, 3) else out["dmsg"].T
    np.testing.assert_allclose(got, inp["w"][DST_IDS], rtol=1e-14)
    want = np.zeros((5, 3))
    np.add.at(want, SRC_IDS, inp["msg"])
    got = out["dx"] if out["dx"].shape == (5, 3) else out["dx"].T
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("backend", BACKENDS)
def test_integer_indicator_ids_are_bounds_checked(tmp_path, backend):
    inp = graph_inputs()
    inp["dst"] = DST_IDS.copy()
    inp["dst"][3] = 5
    out = fails(tmp_path, HEAD + "out s = msg @ [node = dst]\n", inp, backend, code=3)
    assert "scatter index out of range" in out and "'dst'" in out, out


# ------------------------------------------------------------------ checkpoints

@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoint_is_its_value_and_keeps_gradients(tmp_path, backend):
    src = """
    dim n = 6, m = 4
    input x[n], W[n, m]
    out y = sum[m](tanh(checkpoint(tanh(x @ W))) ^ 2)
    out g = grad(y, W)
    """
    x, W = rng.standard_normal(6), rng.standard_normal((6, 4))
    out = ok(tmp_path, src, {"x": x, "W": W}, backend)
    h = np.tanh(x @ W)
    t = np.tanh(h)
    np.testing.assert_allclose(out["y"], (t ** 2).sum(), rtol=1e-13)
    g = np.outer(x, 2 * t * (1 - t ** 2) * (1 - h ** 2))
    # relative to the largest entry: an entry that cancels to 1e-5 of it carries the
    # rounding of its terms (the products' summation order differs between backends)
    np.testing.assert_allclose(out["g"], g, rtol=1e-12, atol=1e-12 * np.abs(g).max())


# ------------------------------------------------------------------ facts

ASSUME = """
dim v = 5
input x[v], y[v]
assume sum[v](y) = 1
assume y >= 0
out loss = -sum[v](y * log_softmax[v](x))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_assume_leaves_values_unchanged(tmp_path, backend):
    x = rng.standard_normal(5)
    y = rng.uniform(0, 1, 5)
    y /= y.sum()
    out = ok(tmp_path, ASSUME, {"x": x, "y": y}, backend)
    lsm = x - x.max() - np.log(np.exp(x - x.max()).sum())
    np.testing.assert_allclose(out["loss"], -(y * lsm).sum(), rtol=1e-13)


def test_assumptions_are_checked_only_when_asked(tmp_path):
    x = rng.standard_normal(5)
    y = np.full(5, 0.5)     # sums to 2.5: the fact is false
    r, _ = run(tmp_path, ASSUME, {"x": x, "y": y}, "cpu")
    assert r.exit_code == 0, r.output
    r, _ = run(tmp_path, ASSUME, {"x": x, "y": y}, "cpu", extra=("--check-assumptions",))
    assert r.exit_code != 0 and "assum" in r.output, r.output


# ------------------------------------------------------------------ custom derivatives

@pytest.mark.parametrize("backend", BACKENDS)
def test_a_function_with_its_own_vjp(tmp_path, backend):
    src = """
    dim n = 4
    input x[n]
    fn clip_grad(x) = x with vjp(g) = max(-1, min(1, g))
    out y = sum[n](clip_grad(x))
    out g = grad(sum[n](5 * clip_grad(x) - 0.5 * clip_grad(x)), x)
    """
    x = rng.standard_normal(4)
    out = ok(tmp_path, src, {"x": x}, backend)
    np.testing.assert_allclose(out["y"], x.sum(), rtol=1e-14)
    # each call's cotangent clipped separately: 5 -> 1, -0.5 -> -0.5
    np.testing.assert_allclose(out["g"], np.full(4, 0.5), rtol=1e-14)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_vjp_clause_with_a_tuple_and_a_jvp_clause(tmp_path, backend):
    src = """
    dim n = 4
    input x[n], y[n], t[n]
    fn f(a, b) = a * b with vjp(g) = (2 * g * b, 3 * g * a)
    fn h(a) = exp(a) with jvp(da) = 7 * da
    out dx = grad(sum[n](f(x, y)), x)
    out dy = grad(sum[n](f(x, y)), y)
    out jt = jvp(h(x), x, t)
    """
    x, y, t = rng.standard_normal(4), rng.standard_normal(4), rng.standard_normal(4)
    out = ok(tmp_path, src, {"x": x, "y": y, "t": t}, backend)
    np.testing.assert_allclose(out["dx"], 2 * y, rtol=1e-14)
    np.testing.assert_allclose(out["dy"], 3 * x, rtol=1e-14)
    np.testing.assert_allclose(out["jt"], 7 * t, rtol=1e-14)


def test_a_missing_derivative_rule_is_an_error_that_names_it(tmp_path):
    src = """
    dim n = 4
    input x[n], t[n]
    fn clip_grad(x) = x with vjp(g) = max(-1, min(1, g))
    out j = jvp(clip_grad(x), x, t)
    """
    out = fails(tmp_path, src, {"x": np.ones(4), "t": np.ones(4)})
    assert "clip_grad" in out and "jvp" in out
