"""`CpuOptions.mask_ones_prefix` (backends/cpu/loops.py, "Band masks"): a loop kernel
reading a band mask `m[v - w + c]` (a causal stream step's mask vector) counts the
mask's leading 1.0s once per call and runs each row's innermost loop unmasked below
them. Checked: on a hand-written lowered program, the bits of the option off and of a
reference in numpy for masks with a prefix, a hole, values other than 0 and 1, none
and all ones; which kernels it plans for (the causal step's max, exp and dS members;
not a cross-attention's nor a padding mask's); causal attention against torch in f64
and f32 and against the option off (y and dv the same bits, dq and dk within the
lanes of dS's row sum, which LLVM may vectorize otherwise in the changed function);
fully masked rows; two threads; `--fp-strict` and the option off emit no scan."""
from __future__ import annotations

import numpy as np
import pytest

import tgc
from tgc.backends.cpu.codegen import generate_units
from tgc.backends.cpu.kernels import compile_kernels
from tgc.backends.cpu.loops import mask_prefix_plan
from tgc.frontend import compile_source
from tgc.lower.lowered import StepLoop
from tgc.lower.plan import Plan
from tgc.lower.text import parse_lowered
from tgc.options import Options
from layer_programs import causal_attention

torch_oracle = pytest.importorskip("torch_oracle", reason="the oracle needs torch")

# a band mask read three ways: a where's condition, a maxshift's, a product's factor
BAND = """// lowered after layout (f32)
buffer %x : f32[s, t] arg 0 order [t, s]
buffer %m : f32[r] arg 1 order [r]
buffer %y : f32[s, t] out 0 order [t, s]
buffer %z : f32[t] out 1 order [t]
buffer %w : f32[s, t] out 2 order [t, s]

k0: loop %y[s, t] = where(%m[s - t + 7], %x[s, t], -1000000000.0)
      for t < 8, s < 40
k1: loop %z[t] = maxshift[s] where(%m[s - t + 7], mul(%x[s, t], 0.5), -1000000000.0)
      for t < 8, s < 40
k2: loop %w[s, t] = mul(%m[s - t + 7], %x[s, t], %x[s, t])
      for t < 8, s < 40

module {
dim t = 8
dim s = 40
dim r = 47
input x : f32[t, s]
input m : f32[r]
%0 = reduce[max: s] %x : f32[t]
out y = %x : [t, s]
out z = %0 : [t]
out w = %x : [t, s]
}
"""

MASKS = {
    "prefix": np.r_[np.ones(20), np.zeros(27)],
    "hole": np.r_[np.ones(10), [0, 1, 1], np.ones(10), np.zeros(24)],
    "not_one": np.r_[np.ones(5), [2.0, 0.5], np.ones(40)],
    "none": np.zeros(47),
    "all": np.ones(47),
}


def _band_reference(x: np.ndarray, m: np.ndarray) -> dict:
    t, s = np.meshgrid(np.arange(8), np.arange(40), indexing="ij")
    mm = m[s - t + 7]
    y = np.where(mm != 0, x, np.float32(-1e9))
    return {"y": y, "z": np.where(mm != 0, x * np.float32(0.5), np.float32(-1e9)).max(axis=1), "w": mm * x * x}


@pytest.mark.parametrize("align", [1, 4])
@pytest.mark.parametrize("mask", list(MASKS))
def test_a_band_mask_gives_the_bits_of_the_option_off(mask, align):
    """Each part of a row's split at its own count (1), or at whole multiples of 4
    iterations (the rest masked), against the option off and numpy."""
    low = Plan().run(parse_lowered(BAND), Options())
    assert [mask_prefix_plan(low, k, set(), {k.out}) is not None for k in low.kernels] == [True, True, True]
    x = np.random.default_rng(0).standard_normal((8, 40)).astype(np.float32)
    m = MASKS[mask].astype(np.float32)
    got = {}
    for on in (False, True):
        o = Options().with_(cpu=Options().cpu.with_(mask_ones_prefix=align if on else 0))
        text = "".join(generate_units(low, o, units=1))
        assert ("ones.head" in text) == on
        outs = {"y": np.full((8, 40), np.nan, np.float32), "z": np.full(8, np.nan, np.float32),
                "w": np.full((8, 40), np.nan, np.float32)}
        assert compile_kernels(low.module, low, o).run({"x": x, "m": m}, outs, {}) == 0
        got[on] = outs
    want = _band_reference(x, m)
    for name in want:
        assert got[True][name].tobytes() == got[False][name].tobytes(), name
        np.testing.assert_array_equal(got[True][name], want[name], err_msg=name)


# tests/lower/test_pieces.py's causal attention at t = 64 in blocks of 4, in 4 runs of 16 rows
ATTENTION = causal_attention(head=2, t=64, hd=2)
RUNS = dict(stream_block=4, stream_min_elements=200, stream_mask_groups=2, stream_mask_rows=16)


def _compiled(src: str, dtype: str, on: bool = True, threads: int = 1, **opts):
    o = Options(**RUNS, **opts)
    return tgc.compile(src, "cpu", dtype, options=o.with_(cpu=o.cpu.with_(mask_ones_prefix=64 if on else 0,
                                                                            threads=threads)))


def _inputs(dtype: str, t: int = 64, s: int = 64) -> dict:
    rng = np.random.default_rng(0)
    nt = np.float32 if dtype == "f32" else np.float64
    return {n: rng.standard_normal((2, t if n in ("q", "dy") else s, 2)).astype(nt) for n in ("q", "k", "v", "dy")}


def _plans(low, out: list) -> list:
    """(member's reduce, its body's text) for every loop kernel of `low` (steps and
    groups included) with a band mask plan."""
    for k in low.kernels:
        if isinstance(k, StepLoop):
            _plans(k.step, out)
        elif hasattr(k, "members"):
            written = {m.out for m in k.members}
            out += [(m.reduce, m.text()) for m in k.members if mask_prefix_plan(low, m, set(k.outer), written)]
        elif hasattr(k, "body") and mask_prefix_plan(low, k, set(), {k.out}):
            out.append((k.reduce, k.text()))
    return out


def test_the_causal_steps_mask_is_planned_in_its_three_members():
    """Each of the 4 runs' steps: the scores' row max, the exp (both reading the mask as a
    where's condition) and dS (the mask a factor)."""
    plans = _plans(_compiled(ATTENTION, "f32").lowered, [])
    assert sorted(r for r, _ in plans) == ["", ""] * 4 + ["maxshift"] * 4
    assert sum("exp(" in t for _, t in plans) == 4 and sum("where(" in t for _, t in plans) == 8


@pytest.mark.parametrize("dtype,tol", [("f64", 1e-10), ("f32", 2e-5)])
def test_values_match_torch_and_the_option_off(dtype, tol):
    x = _inputs(dtype)
    want = torch_oracle.evaluate(compile_source(ATTENTION, "<mask_prefix>", Options(dtype="f64")),
                                 {n: a.astype(np.float64) for n, a in x.items()})
    got = _compiled(ATTENTION, dtype)(**x)
    off = _compiled(ATTENTION, dtype, on=False)(**x)
    eps = np.finfo(np.float32 if dtype == "f32" else np.float64).eps
    for name, w in want.items():
        scale = float(np.max(np.abs(w)))
        np.testing.assert_allclose(np.asarray(got[name], np.float64), w, rtol=0, atol=tol * scale, err_msg=name)
        a, b = np.asarray(got[name]), np.asarray(off[name])
        if name in ("y", "dv"):   # read only what the split members and unchanged sums give
            assert a.tobytes() == b.tobytes(), name
        else:                     # through dS's row sum D, whose lanes LLVM may take otherwise
            np.testing.assert_allclose(a, b, rtol=0, atol=8 * eps * scale, err_msg=name)


def test_fully_masked_rows_give_what_the_option_off_gives():
    """Rows t < 5 admit no key: softmax of -1e9 everywhere (uniform weights)."""
    src = ATTENTION.replace("where([s <= t]", "where([s + 5 <= t]")
    x = _inputs("f32")
    prog = _compiled(src, "f32")
    assert _plans(prog.lowered, [])
    got, off = prog(**x), _compiled(src, "f32", on=False)(**x)
    want = torch_oracle.evaluate(compile_source(src, "<mask_prefix>", Options(dtype="f64")),
                                 {n: a.astype(np.float64) for n, a in x.items()})
    for name, w in want.items():
        scale = float(np.max(np.abs(w)))
        np.testing.assert_allclose(np.asarray(got[name], np.float64), w, rtol=0, atol=2e-5 * scale, err_msg=name)
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(off[name]), rtol=0,
                                   atol=8 * np.finfo(np.float32).eps * scale, err_msg=name)
    np.testing.assert_array_equal(np.asarray(got["y"])[:, :5], np.asarray(off["y"])[:, :5])


@pytest.mark.parametrize("form", ["cross", "padding"])
def test_cross_attention_and_a_padding_mask_are_left_alone(form):
    """No band: a cross-attention (48 keys, no mask) and a padding mask `[s < 40]` get no
    plan, and the option changes no bit."""
    if form == "cross":
        src = ATTENTION.replace("dim s = t", "dim s = 48").replace("where([s <= t], ", "(").replace(", -1e9))", "))")
        x = _inputs("f32", s=48)
    else:
        src = ATTENTION.replace("[s <= t]", "[s < 40]")
        x = _inputs("f32")
    prog = _compiled(src, "f32")
    assert _plans(prog.lowered, []) == []
    got, off = prog(**x), _compiled(src, "f32", on=False)(**x)
    for name in got:
        assert np.asarray(got[name]).tobytes() == np.asarray(off[name]).tobytes(), name


def test_two_threads_give_the_bits_of_one():
    x = _inputs("f32")
    a, b = _compiled(ATTENTION, "f32")(**x), _compiled(ATTENTION, "f32", threads=2)(**x)
    for name in a:
        assert np.asarray(a[name]).tobytes() == np.asarray(b[name]).tobytes(), name


def test_fp_strict_emits_no_scan():
    low = Plan().run(parse_lowered(BAND), Options())
    text = "".join(generate_units(low, Options(fp_strict=True), units=1))
    assert "ones.head" not in text and "ones.head" in "".join(generate_units(low, Options(), units=1))
