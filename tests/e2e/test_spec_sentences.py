"""Conformance with shared/LANGUAGE.md, sentence by sentence, where
test_spec_conformance.py does not reach: section 12 (`repeat`, `scan`, `for p in
LIST`) in every derivative mode, derivative modes nested three deep, symbolic dim
expressions, indicators and relations, updates written in place, function scope,
element-type promotion, custom forward rules.

Same style as test_spec_conformance.py: each case is a program, its inputs and the
expected outputs computed independently (numpy formulas; PyTorch float64 autograd and
`torch.func` where a derivative is involved, the case skipped without torch), run as
`tgc run F --inputs in.npz -o out.npz` on the interpreter and every registered backend
but cuda-sim (which its own tests cover); the archive must hold exactly the outputs and
update targets. Bad programs give a located `file:LINE:COL: error:`.
"""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

from backends_util import EMULATED, backends
from test_spec_conformance import tgc

BACKENDS = ("interp", *backends(exclude=EMULATED))
RNG = np.random.default_rng(20261205)


def rn(*shape):
    return RNG.standard_normal(shape)


CASES: dict[str, tuple] = {}   # id -> (source, inputs, expected or a function that computes it, tolerance)
XFAIL: dict[str, str] = {}     # id -> why it fails (a divergence not fixed yet)


def case(name, src, inputs, expected, tol=(1e-9, 1e-11), xfail=None):
    CASES[name] = (textwrap.dedent(src), inputs, expected, tol)
    if xfail:
        XFAIL[name] = xfail


def params(names):
    return [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=XFAIL[n])) if n in XFAIL else n for n in names]


def torch_f64():
    torch = pytest.importorskip("torch")
    torch.set_default_dtype(torch.float64)
    return torch


# ---- section 12: `for p in LIST` -------------------------------------------------------------------------------
# `[p in a, b, c]` is 1 where the current instance is one of the listed tensors, else 0: a
# declared param or state that the block's list leaves out is 0 in every instance (the
# section's own example, `[p in wq, wk, wv, wo]`, under its own `for p in wq, wk, wv`)
_a, _b, _c, _s, _x = rn(3), rn(3, 2), rn(2), rn(2), rn(3)
_ma, _mc = rn(3), rn(2)
_t = np.tanh(_x @ _b + _c)
_ga, _gc = _x, (1 - _t * _t) * _s
case("s12_for_list_member_indicator_sum", """
    dim n = 3, k = 2
    param a[n], b[n, k], c[k]
    state s[k]
    input x[n]
    loss = sum(tanh(x @ b + c) * s) + sum(a * x)
    out gn = sum[p in a, b](sum(grad(loss, p) ^ 2))
    for p in a, c {
      state m.p
      g = grad(loss, p)                          # local to each instance
      update m.p = m.p + g * (1 + [p in c, b])   # b is a param the list leaves out: 0
      update p = p - 0.1 * g
    }
    for q in s {                                 # a list may name states
      g = q * 2
      update q = g + [q in s] + [q in a]
    }
    """, {"a": _a, "b": _b, "c": _c, "s": _s, "x": _x, "m.a": _ma, "m.c": _mc},
     {"gn": (_ga ** 2).sum() + (np.outer(_x, _gc) ** 2).sum(), "m.a": _ma + _ga, "m.c": _mc + 2 * _gc,
      "a": _a - .1 * _ga, "c": _c - .1 * _gc, "s": 2 * _s + 1})


# ---- running the cases --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", params(CASES))
def test_program_matches_reference(tmp_path, name, backend):
    src, inputs, expected, (rtol, atol) = CASES[name]
    expected = expected() if callable(expected) else expected
    prog = tmp_path / f"{name}.tg"
    prog.write_text(src)
    np.savez(tmp_path / "in.npz", **inputs)
    out = tmp_path / "out.npz"
    r = tgc("run", prog, "--backend", backend, "--dtype", "f64", "-o", out, "--inputs", tmp_path / "in.npz")
    assert r.exit_code == 0, r.output
    with np.load(out) as z:
        got = {k: z[k] for k in z.files}
    assert sorted(got) == sorted(expected)
    for key, want in expected.items():
        want = np.asarray(want, dtype=np.complex128 if np.iscomplexobj(want) else np.float64)
        assert got[key].shape == want.shape, key
        np.testing.assert_allclose(got[key], want, rtol=rtol, atol=atol, err_msg=key)
