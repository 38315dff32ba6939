"""benchmarks/gemm_peak.py's operand costs: `pinned` holds exactly the operand named in
one place (its batch stride and its stride other than 1 set to 0, the others as
stored), and `operand_costs` times every variant of a small batched product."""
from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gemm_peak():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        yield importlib.import_module("gemm_peak")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_pinned_strides(gemm_peak):
    rng = np.random.default_rng(0)
    # A' transposed (its rows contiguous), B' with its columns contiguous: 3 x 8 x 16 x 4
    p = dict(batch=3, P=8, Q=16, R=4, a_k=False, b_n=True)
    A, B, C = gemm_peak.operands(p, rng)
    real = [A.strides[0] // 4, B.strides[0] // 4, C.strides[0] // 4, 1, 8, 16, 1, 16]
    assert gemm_peak.pinned(A, B, C, "none") == real
    assert A.strides[1] // 4 == 1 and A.strides[2] // 4 == 8
    assert gemm_peak.pinned(A, B, C, "A") == [0, real[1], real[2], 1, 0, 16, 1, 16]
    assert gemm_peak.pinned(A, B, C, "B") == [real[0], 0, real[2], 1, 8, 0, 1, 16]
    assert gemm_peak.pinned(A, B, C, "C") == [real[0], real[1], 0, 1, 8, 16, 1, 0]
    assert gemm_peak.pinned(A, B, C, "all") == [0, 0, 0, 1, 0, 0, 1, 0]


def test_operand_costs_times_every_pin(gemm_peak):
    from tgc.backends.cpu.llvm_env import has_feature
    from tgc.options import Options

    if not has_feature("avx512f"):
        pytest.skip("the own kernel needs AVX-512")
    own = gemm_peak.Own(Options().cpu)
    try:
        p = dict(batch=2, P=12, Q=64, R=32, a_k=True, b_n=False)
        best = gemm_peak.operand_costs(p, own, 2, np.random.default_rng(0))
    finally:
        own.jit.close()
    assert list(best) == list(gemm_peak.PINS)
    assert all(0 <= t < math.inf for t in best.values())


def test_huge_pages_operands(gemm_peak):
    """`--pages huge`: each operand a copy on a 2 MiB boundary of one pool, with the
    same values, shape and strides (a transposed operand still transposed), and the
    pool's slices reused for the next product."""
    rng = np.random.default_rng(0)
    p = dict(batch=2, P=8, Q=16, R=4, a_k=False, b_n=False)
    plain = gemm_peak.operands(p, np.random.default_rng(1))
    gemm_peak._PAGES = gemm_peak.HugePages(16 << 20)
    try:
        huge = gemm_peak.operands(p, np.random.default_rng(1))
        for x, y in zip(plain, huge):
            assert y.shape == x.shape and y.strides == x.strides
            np.testing.assert_array_equal(x, y)
        bases = [y.ctypes.data for y in huge]
        again = gemm_peak.operands(p, rng)   # the next product: the same slices
    finally:
        pages, gemm_peak._PAGES = gemm_peak._PAGES, None
    assert all(a % gemm_peak.HUGE == 0 for a in bases)
    assert len(set(bases)) == 3 and [y.ctypes.data for y in again] == bases
    assert all(np.shares_memory(y, pages.pool) for y in huge)
    with pytest.raises(ValueError, match="C-contiguous"):
        pages.like(np.zeros((4, 4), np.float32)[:, :2])
    with pytest.raises(MemoryError):
        gemm_peak.HugePages(1 << 20).like(np.zeros(1 << 20, np.float32))
