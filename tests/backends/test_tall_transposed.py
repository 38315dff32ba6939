"""`CpuOptions.own_gemm_tall_transposed`: a product whose A' has its rows contiguous,
with exactly one block of 64 columns and at least `own_gemm_min_rows` rows, runs the
own kernel whatever its depth (attention's dk = dS^T q and dv = P^T dy in a stream
step of 128 query rows), where otherwise it goes to cblas (its depth under
`own_gemm_min_depth`). Off by default (docs/optimization.md: faster alone, level in
the attention step). With `own_gemm_copy_a_rows` the kernel copies such an A' where
it spans more than `own_gemm_pack_a_span` (tests/backends/test_cpu_own_gemm.py checks
the copy's bits against packing and reading in place).

Checked: which products compile the own kernel with the option on and off, the
values against float64 (numpy, and torch's oracle on a streamed causal attention)
and the option off, and the same bits on 1 and 2 threads."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc.backends.cpu.codegen import leaf_kernels
from tgc.backends.cpu.gemm_dispatch import a_k_contiguous, uses_own_gemm
from tgc.backends.cpu.llvm_env import has_feature
from tgc.frontend import compile_source
from tgc.lower.lowered import GemmKernel
from tgc.options import Options

pytestmark = pytest.mark.skipif(not has_feature("avx512f"), reason="the own GEMM kernel needs AVX-512 (avx512f)")

ROOT = Path(__file__).resolve().parents[2]

PRODUCT = """
dim s = {s}, t = 128, hd = {hd}
input a[t, s]
input q[t, hd]
out c[s, hd] = sum[t](a * q)
"""


def _options(threads=1, **cpu):
    o = Options(dtype="f32")
    return o.with_(cpu=o.cpu.with_(threads=threads, **cpu))


def _transposed_own(prog) -> int:
    """The program's products whose A' has its rows contiguous that may run the own kernel."""
    return sum(1 for lw, k in leaf_kernels(prog.lowered)
               if isinstance(k, GemmKernel) and not a_k_contiguous(lw, k) and uses_own_gemm(lw, k, prog.options))


@pytest.mark.parametrize("s, hd, own", [(8192, 64, True), (4096, 64, True), (512, 64, True), (128, 64, False),
                                        (4096, 48, False), (4096, 96, False)])
def test_dk_shaped_product_runs_the_own_kernel_and_matches_float64(s, hd, own):
    """C'[s, 64] = A'[s, 128] B' with A' = a^T: the own kernel (the copy past 2 MiB of
    span: s = 8192) where on, cblas where off; fewer rows than `own_gemm_min_rows`
    (128) or columns other than one block (48, 96) stay with cblas. Values against
    float64, on and off (the default), and the same bits on 2 threads."""
    src = PRODUCT.format(s=s, hd=hd)
    rng = np.random.default_rng(s + hd)
    x = {"a": rng.standard_normal((128, s), dtype=np.float32), "q": rng.standard_normal((128, hd), dtype=np.float32)}
    want = x["a"].T.astype(np.float64) @ x["q"].astype(np.float64)
    progs = {"on": tgc.compile(src, "cpu", "f32", options=_options(own_gemm_tall_transposed=True)),
             "off": tgc.compile(src, "cpu", "f32", options=_options()),
             "2": tgc.compile(src, "cpu", "f32", options=_options(threads=2, own_gemm_tall_transposed=True))}
    assert _transposed_own(progs["on"]) == (1 if own else 0)
    assert _transposed_own(progs["off"]) == 0
    copies = re.findall(r'call void @"?tgc\.gemm\.own\.f32\.copy_a', progs["on"].llvm_ir)
    assert bool(copies) == own
    got = {n: p(**x)["c"] for n, p in progs.items()}
    for n in ("on", "off"):
        np.testing.assert_allclose(got[n], want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    assert np.array_equal(got["on"], got["2"])


ATTENTION_OPTS = dict(stream_min_elements_masked=1 << 18, stream_mask_runs=4, stream_step_elements=1 << 17)


@pytest.mark.slow
def test_streamed_attention_matches_torch_and_the_option_off():
    """Causal attention at t = 1024 (1 head), streamed in blocks of 128 query rows over
    4 causal runs (256 .. 1024 keys): its dk and dv products run the own kernel with the
    option on (cblas off); y, dq, dk, dv against torch in float64, on and off, and the
    same bits on 2 threads."""
    torch_oracle = pytest.importorskip("torch_oracle", reason="the oracle needs torch")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import attention

    src = attention.SOURCE.format(batch=1, heads=1, t=1024, hd=64)
    rng = np.random.default_rng(7)
    x = {n: rng.standard_normal((1, 1, 1024, 64), dtype=np.float32) for n in ("q", "k", "v", "dy")}
    want = torch_oracle.evaluate(compile_source(src, "<attention>", Options(dtype="f64")),
                                 {n: a.astype(np.float64) for n, a in x.items()})
    base = Options(dtype="f32", **ATTENTION_OPTS)
    progs = {}
    on = dict(own_gemm_tall_transposed=True)
    for name, threads, cpu in (("on", 1, on), ("off", 1, {}), ("2", 2, on)):
        progs[name] = tgc.compile(src, "cpu", "f32", options=base.with_(cpu=base.cpu.with_(threads=threads, **cpu)))
    assert _transposed_own(progs["on"]) > _transposed_own(progs["off"])
    got = {n: p(**x) for n, p in progs.items()}
    for name, w in want.items():
        scale = float(np.max(np.abs(w)))
        for n in ("on", "off"):
            np.testing.assert_allclose(np.asarray(got[n][name], np.float64), w, rtol=0, atol=2e-5 * scale,
                                       err_msg=f"{name} {n}")
        assert np.asarray(got["on"][name]).tobytes() == np.asarray(got["2"][name]).tobytes(), name
