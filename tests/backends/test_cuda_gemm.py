"""GEMM cells as cuBLAS strided batched calls (`tgc.backends.cuda.gemm`): every
orientation of the operands and the output is one call with transpose flags (no
copy), a broadcast operand has batch stride 0, a batch group that does not merge is
looped around the call, and what fits no call is refused (None); `run_numpy`
executes the call's column-major semantics and must give the product."""
import itertools

import numpy as np
import pytest

from tgc.backends.cuda import gemm
from tgc.lower.lowered import GemmKernel, View


def _strides(a: np.ndarray, axes: str) -> dict:
    return {e: s // a.itemsize for e, s in zip(axes, a.strides)}


def _run(k, arrays: dict, axes: dict, sizes: dict):
    ops = {"a": ("A", _strides(arrays["A"], axes["A"])), "b": ("B", _strides(arrays["B"], axes["B"])),
           "out": ("C", _strides(arrays["C"], axes["C"]))}
    planned = gemm.plan_looped(k, ops, sizes)
    if planned is None:
        return None
    call, looped = planned
    roles = (call.a, call.b, "out")
    for point in np.ndindex(*[sizes[e] for e in looped]):
        offs = tuple(sum(i * ops[r][1].get(e, 0) for e, i in zip(looped, point)) for r in roles)
        gemm.run_numpy(call, *(arrays[ops[r][0]] for r in roles), offs)
    return planned


def _view(buf: str, axes: str) -> View:
    return View(buf, tuple((e, e) for e in sorted(axes)))


@pytest.mark.parametrize("la, lb, lc", list(itertools.product(["il", "li"], ["lj", "jl"], ["ij", "ji"])))
def test_every_orientation_is_one_call(la, lb, lc):
    sizes = {"i": 3, "j": 5, "l": 4}
    rng = np.random.default_rng(0)
    A = rng.standard_normal([sizes[e] for e in la])
    B = rng.standard_normal([sizes[e] for e in lb])
    C = np.full([sizes[e] for e in lc], np.nan)
    k = GemmKernel("C", _view("A", la), _view("B", lb), batch=(), m=("i",), n=("j",), k=("l",))
    call, looped = _run(k, {"A": A, "B": B, "C": C}, {"A": la, "B": lb, "C": lc}, sizes)
    assert looped == () and call.batch == 1
    np.testing.assert_allclose(C, np.einsum(f"{la},{lb}->{lc}", A, B), rtol=1e-12)


def test_broadcast_operand_and_looped_batch_edge():
    # attention-like: out[b, h, t, s] = sum_d q[b, t, h, d] k[b, s, h, d], with W shared over b
    sizes = {"b": 2, "h": 3, "t": 4, "s": 5, "d": 6}
    rng = np.random.default_rng(1)
    q, kk = rng.standard_normal((2, 4, 3, 6)), rng.standard_normal((2, 5, 3, 6))
    out = np.full((2, 3, 4, 5), np.nan)
    k = GemmKernel("C", _view("A", "bthd"), _view("B", "bshd"), batch=("b", "h"), m=("t",), n=("s",), k=("d",))
    call, looped = _run(k, {"A": q, "B": kk, "C": out}, {"A": "bthd", "B": "bshd", "C": "bhts"}, sizes)
    assert looped == ("b",) and call.batch == 3          # h is the call's batch; b is looped
    np.testing.assert_allclose(out, np.einsum("bthd,bshd->bhts", q, kk), rtol=1e-12)
    W, x = rng.standard_normal((6, 4)), rng.standard_normal((3, 5, 6))   # W has no batch edge
    y = np.full((3, 5, 4), np.nan)
    sizes = {"h": 3, "s": 5, "d": 6, "t": 4}
    k = GemmKernel("C", _view("A", "hsd"), _view("B", "dt"), batch=("h",), m=("s",), n=("t",), k=("d",))
    call, looped = _run(k, {"A": x, "B": W, "C": y}, {"A": "hsd", "B": "dt", "C": "hst"}, sizes)
    assert looped == () and 0 in (call.stride_a, call.stride_b)
    np.testing.assert_allclose(y, np.einsum("hsd,dt->hst", x, W), rtol=1e-12)


def test_a_group_split_in_memory_fits_no_call():
    # m = (i, i2) but the output holds j between them: no single strided dimension
    sizes = {"i": 2, "i2": 3, "j": 4, "l": 5}
    B = np.ones((5, 4))
    k = GemmKernel("C", View("A", (("i", "i"), ("i2", "m"), ("l", "l"))), _view("B", "lj"), batch=(),
                   m=("i", "i2"), n=("j",), k=("l",))
    ops = {"a": ("A", {"i": 15, "i2": 5, "l": 1}), "b": ("B", _strides(B, "lj")),
           "out": ("C", {"i": 12, "j": 3, "i2": 1})}
    assert gemm.plan_looped(k, ops, sizes) is None
    ops["out"] = ("C", {"i": 12, "i2": 4, "j": 1})       # [i, i2, j]: m merges, one call
    call, looped = gemm.plan_looped(k, ops, sizes)
    assert looped == () and (call.m, call.n, call.k) == (4, 6, 5)
