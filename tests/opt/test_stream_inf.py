"""Attention masked with a -inf fill, some rows seeing no key at all, streamed
(tgc.opt.stream over blocks of rows, tgc.opt.stream_keys over blocks of keys): each
output is NaN exactly where the program without the pass gives NaN (PyTorch's
softmax of an all -inf row), and equal within rounding elsewhere, gradients included,
in f64 and f32 on the interpreter, the CPU and the lowered interpreter; a -1e9 fill
gives no NaN at all. The streamed program joins its blocks' results back over the rows
by contractions with indicators, which are index arithmetic: the interpreter keeps an
indicator's 0 exact against a NaN of the other operand (tgc.ir.interp), as the
backends do."""
import numpy as np
import pytest

from tgc.frontend import compile_source
from tgc.ir.interp import evaluate
from tgc.options import Options

torch_oracle = pytest.importorskip("torch_oracle", reason="the oracle needs torch")

from test_stream import LAYER, MASKED, inputs, loops, optimized  # noqa: E402
from test_stream_keys import key_loops  # noqa: E402

SCORES = "where([s + 4 <= t], sum[hd](q * k), -1e9)"
# rows t < 4 see no key: the first block's rows, at the start of the first run
FIRST = MASKED.replace(SCORES, "where([s + 4 <= t], sum[hd](q * k), -inf)")
# rows 9..12 see no key: across the third and fourth blocks of rows, inside a run
MIDDLE = MASKED.replace(SCORES, "where([s <= t], where([9 <= t <= 12], -inf, sum[hd](q * k)), -inf)")
# the same rows masked by an infinite fill subtracted (their gradients are NaN too)
SUBTRACTED = MASKED.replace(SCORES, "where([s <= t], sum[hd](q * k), -inf) - inf * [9 <= t <= 12]")
# rows 0..8 see no key: half the blocks of the first run and one row of the third block
HALF = MASKED.replace(SCORES, "where([2*s <= t - 9], sum[hd](q * k), -inf)")
# examples/attention.tg's layer (batch, heads, projections), rows t < 4 seeing no key: every
# dx is NaN (the NaN rows' cotangents reach every row through the projections' gradients)
LAYER_FIRST = LAYER.replace("[s <= t]", "[s + 4 <= t]")
PROGRAMS = {"layer": LAYER_FIRST, "first": FIRST, "middle": MIDDLE, "subtracted": SUBTRACTED, "half": HALF, "fill_1e9": MASKED}
NAN_ROWS = {"first": range(4), "middle": range(9, 13), "subtracted": range(9, 13), "half": range(9), "fill_1e9": (), "layer": range(4)}

ROWS = dict(stream_block=4, stream_min_elements=200, stream_mask_groups=2)
ONE_RUN = dict(ROWS, stream_mask_groups=1)
KEYS = dict(ROWS, stream_step_elements=16, stream_key_block=4)
STREAMS = {"rows": ROWS, "one_run": ONE_RUN, "keys": KEYS}
OFF = dict(stream_block=0)


def same(got: dict, want: dict, tol: float) -> None:
    """NaN at the same entries; the other entries within tol of the largest finite one."""
    for name, w in want.items():
        g, w = np.asarray(got[name], np.float64), np.asarray(w, np.float64)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"{name}: NaN entries")
        ok = ~np.isnan(w)
        scale = float(np.max(np.abs(w[ok]), initial=1e-30))
        np.testing.assert_allclose(g[ok], w[ok], rtol=0, atol=tol * scale, err_msg=name)


@pytest.mark.parametrize("stream", sorted(STREAMS))
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_interpreter_nan_rows_as_unstreamed_and_torch(name, stream):
    src = PROGRAMS[name]
    streamed = optimized(src, "f64", **STREAMS[stream])
    assert loops(streamed) >= 1
    assert stream != "keys" or key_loops(streamed) >= 2   # the online softmax, then the gradients
    x = inputs(src)
    got = evaluate(streamed, x, dtype="f64")
    want = evaluate(optimized(src, "f64", **OFF), x, dtype="f64")
    rows = list(NAN_ROWS[name])
    seen = [t for t in range(32) if t not in rows]
    if name == "layer":
        assert np.isnan(want["y"]).any(axis=(0, 2)).nonzero()[0].tolist() == rows
        assert np.isfinite(got["y"][:, seen]).all()
    else:
        assert np.isnan(want["y"]).any(axis=-1).nonzero()[0].tolist() == rows
        assert np.isfinite(got["y"][seen]).all()
        # the gradients of the rows that see keys are finite (dq of the masked rows: 0, or
        # NaN where the fill is subtracted: inf * 0's derivative, as unstreamed)
        assert np.isfinite(got["dq"][seen]).all()
    same(got, want, 1e-10)
    x32 = inputs(src, "f32")
    same(evaluate(optimized(src, "f32", **STREAMS[stream]), x32, dtype="f32"),
         evaluate(optimized(src, "f32", **OFF), x32, dtype="f32"), 1e-5)
    if name != "subtracted":   # the language folds the literal's inf * 0 to 0, PyTorch gives NaN
        same(got, torch_oracle.evaluate(compile_source(src, "<stream>", Options(dtype="f64")), x), 1e-10)


@pytest.mark.parametrize("backend", ["cpu", "lowered"])
@pytest.mark.parametrize("stream", ["rows", "keys"])
@pytest.mark.parametrize("name", ["first", "middle", "fill_1e9"])
def test_backend_nan_rows_as_unstreamed(name, stream, backend):
    import tgc

    src = PROGRAMS[name]
    for dtype, tol in (("f64", 1e-10), ("f32", 1e-5)):
        x = inputs(src, dtype)
        on = tgc.compile(src, backend, dtype, options=Options(**STREAMS[stream]))
        assert any(getattr(k, "kind", "") == "steps" for k in on.lowered.kernels)
        off = tgc.compile(src, backend, dtype, options=Options(**OFF))
        same(on(**x), off(**x), tol)


def test_an_indicator_zero_is_exact_against_nan(monkeypatch):
    """A reindex (a contraction with an indicator) of a vector with a NaN and an inf is
    NaN and inf at their images only, as index arithmetic gives, in slices of the joint
    product too; a product of two dense operands keeps IEEE's NaN * 0 = NaN."""
    from tgc.ir import interp

    src = "dim t = 8\ndim s = t\ninput x[t]\ninput w[t]\nout y[s] = x[t = 7 - s]\nout d = sum(x * w)\n"
    m = compile_source(src, "<inf>", Options(dtype="f64"))
    assert any(v.op == "indicator" for v in m.values())
    x = np.arange(8.0)
    x[2], x[6] = np.nan, -np.inf
    for most in (interp._JOINT_MOST, 4):
        monkeypatch.setattr(interp, "_JOINT_MOST", most)
        got = evaluate(m, {"x": x, "w": np.zeros(8)}, dtype="f64")
        np.testing.assert_array_equal(got["y"], x[::-1])   # NaN at 5, -inf at 1, the rest exact
        assert np.isnan(got["d"])


@pytest.mark.parametrize("stream", ["rows", "keys"])
def test_a_nan_query_without_a_mask_as_unstreamed(stream):
    """Cross attention (no mask: no key skipped) with one NaN in a query: y and dq NaN in
    that row only, dk and dv NaN in that head, as unstreamed (the queries' blocks are
    split off by contractions with indicators)."""
    from test_stream import CROSS

    x = inputs(CROSS)
    x["q"][1, 13, 0] = np.nan
    got = evaluate(optimized(CROSS, "f64", **STREAMS[stream]), x, dtype="f64")
    want = evaluate(optimized(CROSS, "f64", **OFF), x, dtype="f64")
    assert [a.tolist() for a in np.isnan(want["y"]).any(axis=-1).nonzero()] == [[1], [13]]
    assert np.isnan(want["dk"][1]).all() and not np.isnan(want["dk"][0]).any()
    same(got, want, 1e-10)
