"""The CUDA backends' `flash` stage (tgc.backends.cuda.flash, flashgen): attention's
softmax-contraction chain as one kernel. Each program runs on cuda-sim (the generated
CUDA C on this CPU) against the interpreter (f64) and PyTorch's attention (f64 and f32);
the fused kernel is what runs (one launch, no GEMM); `ptxas -v` for sm_90 reports no
spills at d = 64 and 128; `--fp-strict`, `CudaOptions.flash=False` and a chain whose
weights the gradients read keep the unfused kernels."""
import re
import shutil
import subprocess

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.backends.cuda import codegen
from tgc.backends.cuda.options import CudaOptions
from tgc.frontend import compile_source
from tgc.ir.inputs import random_inputs
from tgc.ir.interp import evaluate
from tgc.options import Options

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="cuda-sim needs g++ with OpenMP")
NVCC = shutil.which("nvcc")

HEAD = "dim head = 2, t = {t}, s = {s}, hd = {d}\ninput q[head, t, hd]\ninput k[head, s, hd]\ninput v[head, s, hd]\n"
SCORES = "sum[hd](q * k) / sqrt(size(hd))"
PROGRAMS = {
    # causal self-attention (t = s), masked by a -1e9 fill
    "causal": (HEAD + f"p = softmax[s](where([s <= t], {SCORES}, -1e9))\nout y[head, t, hd] = sum[s](p * v)\n",
               dict(t=40, s=40)),
    # cross-attention, no mask, t != s
    "cross": (HEAD + f"p = softmax[s]({SCORES})\nout y[head, t, hd] = sum[s](p * v)\n", dict(t=24, s=40)),
    # an additive bias over the keys, causal
    "bias": (HEAD + "input bias[head, s]\n"
             f"p = softmax[s](where([s <= t], {SCORES} + bias, -1e9))\nout y[head, t, hd] = sum[s](p * v)\n",
             dict(t=40, s=40)),
    # row 0 sees no key: the uniform average of v
    "masked_row": (HEAD + f"p = softmax[s](where([s < t], {SCORES}, -1e9))\nout y[head, t, hd] = sum[s](p * v)\n",
                   dict(t=40, s=40)),
    # a subtracted mask
    "subtracted": (HEAD + f"p = softmax[s]({SCORES} - 1e9 * [s > t])\nout y[head, t, hd] = sum[s](p * v)\n",
                   dict(t=40, s=40)),
}


def source(name: str, d: int) -> str:
    text, dims = PROGRAMS[name]
    text = text.format(d=d, **dims)
    if dims["t"] == dims["s"]:
        text = text.replace(f", s = {dims['s']}", "").replace("input q", "dim s = t\ninput q")
    return text


def reference(src: str, x: dict) -> dict:
    """The interpreter's values (f64) of the optimized module (gradients derived)."""
    options = Options(dtype="f64", stream_block=0)
    return evaluate(pipeline.lower(compile_source(src, "<flash>", options), options).module, x)


def inputs(src: str) -> dict:
    m = compile_source(src, "<flash>", Options(dtype="f64"))
    return random_inputs(m, m.bind_dims({}), 0, "f64")


def torch_attention(name: str, x: dict, dtype) -> np.ndarray:
    torch = pytest.importorskip("torch", reason="the oracle needs torch")
    q, k, v = (torch.tensor(x[n], dtype=dtype) for n in ("q", "k", "v"))
    t, s = q.shape[1], k.shape[1]
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if name == "bias":
        scores = scores + torch.tensor(x["bias"], dtype=dtype)[:, None, :]
    tt, ss = torch.arange(t)[:, None], torch.arange(s)[None, :]
    admitted = {"causal": ss <= tt, "bias": ss <= tt, "masked_row": ss < tt, "subtracted": ss <= tt}.get(name)
    if admitted is not None:
        scores = torch.where(admitted, scores, torch.tensor(-1e9, dtype=dtype))
    return (torch.softmax(scores, -1) @ v).numpy()


def build(src: str, dtype: str, **options):
    return tgc.compile(src, backend="cuda-sim", dtype=dtype, options=Options(**options))


def kinds(prog) -> list[str]:
    return [getattr(k, "kind", type(k).__name__) for k in prog.lowered.kernels]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_flash_matches_the_interpreter_and_torch(name, d):
    if d == 128 and name not in ("causal", "cross"):
        pytest.skip("d = 128: the causal and cross programs (cuda-sim is slow)")
    src = source(name, d)
    x = inputs(src)
    want = reference(src, x)["y"]
    for dtype, tol in (("f64", 1e-12), ("f32", 2e-6)):
        prog = build(src, dtype)
        assert kinds(prog) == ["flash"], kinds(prog)
        got = np.asarray(prog(**{n: a.astype(np.float32 if dtype == "f32" else np.float64) for n, a in x.items()})["y"],
                         np.float64)
        scale = float(np.max(np.abs(want)))
        np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale, err_msg=f"{name} {dtype}")
    import torch
    ref = torch_attention(name, x, torch.float64)
    np.testing.assert_allclose(want, ref, rtol=0, atol=1e-12 * scale)
    ref32 = torch_attention(name, {n: a.astype(np.float32) for n, a in x.items()}, torch.float32)
    err32 = float(np.max(np.abs(ref32 - ref)))
    assert float(np.max(np.abs(got - ref))) <= max(10 * err32, 1e-6 * scale)


def test_a_fully_masked_row_is_the_average_of_v():
    src = source("masked_row", 64)
    x = inputs(src)
    y = build(src, "f64")(**x)["y"]
    np.testing.assert_allclose(y[:, 0, :], x["v"].mean(axis=1), rtol=0, atol=1e-12)


def test_the_fused_kernel_is_what_runs():
    """One launch of the flash kernel, no cuBLAS call, no [t, s] buffer."""
    prog = build(source("causal", 64), "f32")
    launches = prog._kernels._cm.launches
    assert [x.kind for x in launches] == ["flash"]
    assert not any(b.edges == ("head", "s", "t") for b in prog.lowered.buffers.values())
    assert "_flash" in prog._kernels._cm.source and "gemm" not in {x.kind for x in launches}


def test_what_is_not_fused():
    """--fp-strict, CudaOptions(flash=False) and the gradients (which read the weights)
    keep the unfused kernels, and still give the interpreter's values."""
    src = source("causal", 64)
    assert "flash" not in kinds(build(src, "f64", fp_strict=True))
    off = tgc.compile(src, backend="cuda-sim", dtype="f64", options=Options().with_(cuda=CudaOptions(flash=False)))
    assert "flash" not in kinds(off)
    x = inputs(src)
    np.testing.assert_allclose(off(**x)["y"], build(src, "f64")(**x)["y"], rtol=0, atol=1e-12)
    grads = src.replace("out y[head, t, hd] = sum[s](p * v)\n",
                        "y = sum[s](p * v)\nout y[head, t, hd]\ninput dy[head, t, hd]\n"
                        "out dq[head, t, hd] = grad(sum(y * dy), q)\n")
    prog = build(grads, "f64")
    assert "flash" not in kinds(prog)
    x = inputs(grads)
    want = reference(grads, x)
    got = prog(**x)
    for n in ("y", "dq"):
        np.testing.assert_allclose(got[n], want[n], rtol=0, atol=1e-12 * float(np.max(np.abs(want[n]))))


@pytest.mark.skipif(NVCC is None, reason="nvcc (the CUDA toolkit) is not installed")
def test_the_flash_kernel_compiles_without_spills(tmp_path):
    """`ptxas -v` for sm_90: the fused kernel at d = 64 and 128, f32 and f64, causal and
    with a bias, has no spill stores or loads and no stack frame."""
    report = []
    for dtype in ("f32", "f64"):
        parts = []
        for j, (name, d) in enumerate([("causal", 64), ("causal", 128), ("bias", 64), ("bias", 128)]):
            low = build(source(name, d), dtype).lowered
            parts.append(codegen.generate(low, prefix=f"m{j}_").source)
        cu = tmp_path / f"{dtype}.cu"
        cu.write_text("\n".join(parts))
        r = subprocess.run([NVCC, "-cubin", "-arch=sm_90", "--Werror", "all-warnings", "-Xptxas", "-v", str(cu),
                            "-o", str(tmp_path / "k.cubin")], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        report.append(r.stderr)
    kernels = re.findall(r"Function properties for (\w+)\n\s+(\d+) bytes stack frame, (\d+) bytes spill stores, "
                         r"(\d+) bytes spill loads", "\n".join(report))
    names = {k for k, *_ in kernels}
    assert {f"m{j}_k0_flash" for j in range(4)} <= names, sorted(names)
    bad = [(k, frame, st, ld) for k, frame, st, ld in kernels if (frame, st, ld) != ("0", "0", "0")]
    assert not bad, bad
