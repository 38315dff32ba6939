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
GRADS = ("input dy[head, t, hd]\nloss = sum(y * dy)\nout dq[head, t, hd] = grad(loss, q)\n"
         "out dk[head, s, hd] = grad(loss, k)\nout dv[head, s, hd] = grad(loss, v)\n")
PROGRAMS = {
    # causal self-attention (t = s), masked by a -1e9 fill
    "causal": f"p = softmax[s](where([s <= t], {SCORES}, -1e9))\n",
    # cross-attention, no mask, t != s (its derived backward takes a second row max and logsumexp)
    "cross": f"p = softmax[s]({SCORES})\n",
    # an additive bias over the keys, causal, and its gradient (a sum over the rows)
    "bias": f"input bias[head, s]\np = softmax[s](where([s <= t], {SCORES} + bias, -1e9))\n",
    # row 0 sees no key: the uniform average of v
    "masked_row": f"p = softmax[s](where([s < t], {SCORES}, -1e9))\n",
    # a subtracted mask
    "subtracted": f"p = softmax[s]({SCORES} - 1e9 * [s > t])\n",
}
DIMS = {"cross": dict(t=24, s=40)}


def source(name: str, d: int, grads: bool = True) -> str:
    dims = DIMS.get(name, dict(t=40, s=40))
    text = HEAD.format(d=d, **dims) + PROGRAMS[name] + "y = sum[s](p * v)\nout y[head, t, hd]\n"
    if grads:
        text += GRADS + ("out dbias[head, s] = grad(loss, bias)\n" if name == "bias" else "")
    if dims["t"] == dims["s"]:
        text = text.replace(f", s = {dims['s']}", "").replace("input q", "dim s = t\ninput q", 1)
    return text


def reference(src: str, x: dict) -> dict:
    """The interpreter's values (f64) of the optimized module (gradients derived)."""
    options = Options(dtype="f64", stream_block=0)
    return evaluate(pipeline.lower(compile_source(src, "<flash>", options), options).module, x)


def inputs(src: str) -> dict:
    m = compile_source(src, "<flash>", Options(dtype="f64"))
    return random_inputs(m, m.bind_dims({}), 0, "f64")


def torch_attention(name: str, x: dict, dtype, outs) -> dict:
    """y and the gradients of sum(y * dy) by PyTorch's autograd."""
    torch = pytest.importorskip("torch", reason="the oracle needs torch")
    ts = {n: torch.tensor(a, dtype=dtype, requires_grad=n != "dy") for n, a in x.items()}
    q, k, v = ts["q"], ts["k"], ts["v"]
    t, s = q.shape[1], k.shape[1]
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if name == "bias":
        scores = scores + ts["bias"][:, None, :]
    tt, ss = torch.arange(t)[:, None], torch.arange(s)[None, :]
    if name == "subtracted":
        scores = scores - 1e9 * (ss > tt).to(dtype)
    admitted = {"causal": ss <= tt, "bias": ss <= tt, "masked_row": ss < tt}.get(name)
    if admitted is not None:
        scores = torch.where(admitted, scores, torch.tensor(-1e9, dtype=dtype))
    y = torch.softmax(scores, -1) @ v
    out = {"y": y.detach().numpy()}
    wrt = [n for n in outs if n != "y"]
    if wrt:
        grads = torch.autograd.grad((y * ts["dy"]).sum(), [ts[n[1:]] for n in wrt])
        out.update({n: g.numpy() for n, g in zip(wrt, grads)})
    return out


def build(src: str, dtype: str, **options):
    return tgc.compile(src, backend="cuda-sim", dtype=dtype, options=Options(**options))


def kinds(prog) -> list[str]:
    return [getattr(k, "kind", type(k).__name__) for k in prog.lowered.kernels]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_flash_matches_the_interpreter_and_torch(name, d):
    """y (and dq, dk, dv, dbias) on cuda-sim in f64 and f32 against the interpreter,
    and against PyTorch: f64 to rounding, f32 within 10x PyTorch f32's error."""
    if d == 128 and name not in ("causal", "cross"):
        pytest.skip("d = 128: the causal and cross programs (cuda-sim is slow)")
    pytest.importorskip("torch", reason="the oracle needs torch")
    import torch
    src = source(name, d)
    x = inputs(src)
    want = reference(src, x)
    ref = torch_attention(name, x, torch.float64, want)
    ref32 = torch_attention(name, {n: a.astype(np.float32) for n, a in x.items()}, torch.float32, want)
    for dtype, tol in (("f64", 1e-12), ("f32", 1e-5)):
        prog = build(src, dtype)
        assert kinds(prog)[:2] == (["flash", "flashback"] if "dq" in want else ["flash"]), kinds(prog)
        got = prog(**{n: a.astype(np.float32 if dtype == "f32" else np.float64) for n, a in x.items()})
        for n, w in want.items():
            g = np.asarray(got[n], np.float64)
            scale = float(np.max(np.abs(w)))
            np.testing.assert_allclose(g, w, rtol=0, atol=tol * scale, err_msg=f"{name} {dtype} {n}")
            np.testing.assert_allclose(w, ref[n], rtol=0, atol=1e-12 * scale, err_msg=f"{name} torch {n}")
            if dtype == "f32":
                err32 = float(np.max(np.abs(ref32[n] - ref[n])))
                assert float(np.max(np.abs(g - ref[n]))) <= max(10 * err32, 1e-6 * scale), n


def test_a_fully_masked_row_is_the_average_of_v():
    src = source("masked_row", 64)
    x = inputs(src)
    y = build(src, "f64")(**x)["y"]
    assert np.max(np.abs(x["v"].mean(axis=1))) > 0.1   # (not the 0 a skipped row would give)
    np.testing.assert_allclose(y[:, 0, :], x["v"].mean(axis=1), rtol=0, atol=1e-12)


def test_the_fused_kernels_are_what_runs():
    """Forward and backward: one flash launch, then one for the rows (dq and the row
    sums) and one for the keys (dk, dv), then the scales of dq and dk; no cuBLAS call
    and no [t, s] buffer."""
    prog = build(source("causal", 64), "f32")
    launches = prog._kernels._cm.launches
    names = [x.name for x in launches]
    assert names[:3] == ["k0_flash", "k1_flash_rows", "k1_flash_keys"], names
    assert "gemm" not in {x.kind for x in launches} and len(launches) == 5
    assert not any({"s", "t"} <= set(b.edges) for b in prog.lowered.buffers.values())
    fwd = build(source("causal", 64, grads=False), "f32")
    assert [x.kind for x in fwd._kernels._cm.launches] == ["flash"]


def test_what_is_not_fused():
    """--fp-strict and CudaOptions(flash=False) keep the unfused kernels, with the same
    values; so does a chain whose weights are an output (a `[t, s]` buffer the caller
    reads)."""
    src = source("causal", 64)
    assert "flash" not in kinds(build(src, "f64", fp_strict=True))
    off = tgc.compile(src, backend="cuda-sim", dtype="f64", options=Options().with_(cuda=CudaOptions(flash=False)))
    assert "flash" not in kinds(off)
    x = inputs(src)
    got, want = off(**x), build(src, "f64")(**x)
    for n in want:
        np.testing.assert_allclose(got[n], want[n], rtol=0, atol=1e-12 * float(np.max(np.abs(want[n]))))
    probs = source("causal", 64, grads=False) + "out probs[head, t, s] = p\n"
    prog = build(probs, "f64")
    assert "flash" not in kinds(prog)
    x = inputs(probs)
    want, got = reference(probs, x), prog(**x)
    for n in ("y", "probs"):
        np.testing.assert_allclose(got[n], want[n], rtol=0, atol=1e-12 * float(np.max(np.abs(want[n]))))


@pytest.mark.skipif(NVCC is None, reason="nvcc (the CUDA toolkit) is not installed")
def test_the_flash_kernel_compiles_without_spills(tmp_path):
    """`ptxas -v` for sm_90 (warnings are errors): the fused kernels (forward, backward
    rows and keys) at d = 64 and 128, f32 and f64, causal, with a bias, unmasked and with
    a subtracted mask, have no spill stores or loads and no stack frame; so have those
    the default options generate for the cuda backend at t = 4096 (two heads, causal and
    unmasked: lengths where the CPU streams), modules m6 to m9."""
    report = []
    for dtype in ("f32", "f64"):
        parts = []
        for j, (name, d) in enumerate([("causal", 64), ("causal", 128), ("bias", 64), ("bias", 128),
                                       ("cross", 64), ("subtracted", 128)]):
            low = build(source(name, d), dtype).lowered
            parts.append(codegen.generate(low, prefix=f"m{j}_").source)
        for j, (name, d) in enumerate([("causal", 64), ("causal", 128), ("cross", 64), ("cross", 128)], start=6):
            low = lowered(long_source(name, 4096, d, heads=2), "cuda", dtype)[1]
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
    assert {f"m{j}_k{i}" for j in (0, 1, 2, 3, 5, 6, 7, 8, 9) for i in ("0_flash", "1_flash_rows", "1_flash_keys")} \
        <= names, sorted(names)
    assert "m4_k0_flash" in names
    bad = [(k, frame, st, ld) for k, frame, st, ld in kernels if (frame, st, ld) != ("0", "0", "0")]
    assert not bad, bad


def test_an_attention_layer_fuses_and_matches_the_interpreter():
    """examples/attention.tg (projections in and out, heads split by a reindex, the
    scores' GEMM naming the keys t.1) with two heads of 64 and a -1e9 fill, with its
    gradients: the forward and backward chains fuse, and every output matches the
    interpreter (f64: 1e-11; f32: the unfused program's own error, 1e-4)."""
    src = layer(24, 128, 2)
    x = inputs(src)
    want = reference(src, x)
    for dtype, tol in (("f64", 1e-11), ("f32", 1e-4)):
        prog = build(src, dtype)
        assert {"flash", "flashback"} <= set(kinds(prog)), kinds(prog)
        got = prog(**{n: a.astype(np.float32 if dtype == "f32" else np.float64) for n, a in x.items()})
        for n, w in want.items():
            np.testing.assert_allclose(np.asarray(got[n], np.float64), w, rtol=0, atol=tol * float(np.max(np.abs(w))),
                                       err_msg=f"{dtype} {n}")


POOLING = """
dim b = 16, n = 40, d = 64, c = 64
input u[b, d]
input z[n, d]
input m[n, c]
input dy[b, c]
w = softmax[n](2 * sum[d](u * z))
pooled = sum[n](w * m)
out pooled[b, c]
loss = sum(pooled * dy)
out du[b, d] = grad(loss, u)
out dz[n, d] = grad(loss, z)
out dm[n, c] = grad(loss, m)
"""


def test_a_softmax_weighted_pooling_fuses():
    """A memory read by softmax weights over its slots n, one row per item b (no
    attention names, no batch edge, no mask): forward and backward fuse, and match the
    interpreter in f64 and f32."""
    x = inputs(POOLING)
    want = reference(POOLING, x)
    for dtype, tol in (("f64", 1e-12), ("f32", 1e-5)):
        prog = build(POOLING, dtype)
        assert kinds(prog)[:2] == ["flash", "flashback"], kinds(prog)
        got = prog(**{n: a.astype(np.float32 if dtype == "f32" else np.float64) for n, a in x.items()})
        for n, w in want.items():
            np.testing.assert_allclose(np.asarray(got[n], np.float64), w, rtol=0, atol=tol * float(np.max(np.abs(w))),
                                       err_msg=f"{dtype} {n}")


def long_source(name: str, t: int, d: int = 64, heads: int = 1, grads: bool = True) -> str:
    """`source(name, d)` with `t` rows (and keys) and `heads` heads."""
    src = source(name, d, grads).replace("dim head = 2", f"dim head = {heads}")
    if "t = 24, s = 40" in src:
        return src.replace("t = 24, s = 40", f"t = {t // 2}, s = {t}")
    return src.replace("t = 40", f"t = {t}")


def lowered(src: str, backend: str, dtype: str = "f32", options: Options | None = None):
    """The optimized module and the lowered program `tgc.compile(src, backend=backend)`
    builds (the backend's pipeline options, its lowering), without compiling kernels."""
    options = (options or Options()).with_(dtype=dtype)
    m = pipeline.lower(compile_source(src, "<flash>", options), options, backend=backend).module
    return m, pipeline.lower_module(m, options, backend)


def has_loop(m) -> bool:
    return any(v.op == "loop" for v in m.values())


def largest_temporary(low) -> int:
    return max((int(low.nbytes(b)) for b in low.buffers.values() if b.kind == "temp"), default=0)


@pytest.mark.parametrize("t", [2048, 4096, 8192])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_default_options_fuse_where_the_cpu_streams(name, t):
    """Under the default options, a length where the CPU streams the chain over query
    blocks (two heads of 64; a loop in its program: causal from 4M elements, unmasked
    from 16M, so cross-attention over 2048 keys stays whole there too) compiles
    for CUDA to the fused kernels, forward and backward, with no loop and no buffer
    larger than a `[t, hd]` one (`Backend.pipeline_options`: the stream pass leaves the
    chain the flash stage fuses whole)."""
    src = long_source(name, t, heads=2)
    if name != "cross" or t > 2048:   # cross: 1024 rows over 2048 keys are under the thresholds
        assert has_loop(lowered(src, "cpu")[0]), name
    for backend in ("cuda", "cuda-sim"):
        m, low = lowered(src, backend)
        assert kinds_of(low)[:2] == ["flash", "flashback"] and not has_loop(m), kinds_of(low)
        assert largest_temporary(low) <= 2 * t * 64 * 4, largest_temporary(low)


def kinds_of(low) -> list[str]:
    return [getattr(k, "kind", type(k).__name__) for k in low.kernels]


def test_a_chain_the_flash_stage_does_not_take_still_streams():
    """The flash kernels take contracted and value edges up to 256: at d = 512 the CUDA
    compile streams the chain as the CPU does (a loop over query blocks, no `[t, s]`
    buffer); so it does with `CudaOptions(flash=False)`; under --fp-strict neither
    streams nor fuses (the matrices are kept, as the contract says)."""
    t = 4096
    for src, options in ((long_source("causal", t, d=512), None),
                         (long_source("causal", t), Options().with_(flash=False))):
        m, low = lowered(src, "cuda-sim", options=options)
        assert has_loop(m) and "flash" not in kinds_of(low)
        assert not any({"s", "t"} <= set(b.edges) for b in low.buffers.values() if b.kind == "temp")
    m, low = lowered(long_source("causal", t), "cuda-sim", options=Options(fp_strict=True))
    assert not has_loop(m) and "flash" not in kinds_of(low)


def layer(t: int, c: int, heads: int) -> str:
    """examples/attention.tg with `t` positions, width `c` in `heads` heads, batch 2, a
    -1e9 fill, with its gradients."""
    from pathlib import Path

    text = (Path(tgc.__file__).resolve().parents[1] / "examples" / "attention.tg").read_text()
    return (text.replace("dim t = 11", f"dim t = {t}").replace("dim c = 48, head = 3", f"dim c = {c}, head = {heads}")
            .replace("scores, -inf)", "scores, -1e9)").replace("\nout probs", "\n# out probs")
            .replace("dim batch\n", "dim batch = 2\n"))


def test_a_kept_chain_the_backend_does_not_fuse_streams():
    """The attention layer with two heads of 64 at t = 2048 fuses under the default
    options (no loop, flash and flashback). With one head the flash stage does not take
    the layer's form, though the stream pass keeps the chain for it: the lowering's
    workspace then exceeds the streamed program's, and `pipeline.lower` gives the
    program of the given options, streamed as on the CPU (no `[t, s]` buffer)."""
    m, low = lowered(layer(2048, 128, 2), "cuda")
    assert {"flash", "flashback"} <= set(kinds_of(low)) and not has_loop(m)
    m, low = lowered(layer(2048, 64, 1), "cuda")
    assert "flash" not in kinds_of(low) and has_loop(m)
    assert largest_temporary(low) < 2 * 2048 * 2048 * 4 // 8, largest_temporary(low)


def test_explain_for_cuda_shows_the_flash_kernels_and_a_t_by_d_peak(tmp_path):
    """`tgc explain --backend cuda` of causal attention with its gradients at t = 8192
    (one head of 64, the default options): the flash and flashback kernels, and a peak
    of O(t * d) (the gradients' [t, hd] temporaries: 4.3 MB, where the CPU's streamed
    program holds 30-40 MB and the whole [t, s] matrices 268 MB each)."""
    from click.testing import CliRunner

    from tgc.cli import main

    f = tmp_path / "attention.tg"
    f.write_text(long_source("causal", 8192))
    r = CliRunner().invoke(main, ["explain", str(f), "--backend", "cuda", "--format", "json"])
    assert r.exit_code == 0, r.output
    import json

    report = json.loads(r.output)
    assert [k["kind"] for k in report["kernels"]][:2] == ["flash", "flashback"], report["kernels"]
    assert report["peak"]["bytes"] <= 3 * 8192 * 64 * 4, report["peak"]
    r = CliRunner().invoke(main, ["explain", str(f), "--backend", "cuda"])
    assert r.exit_code == 0 and "flashback for" in r.output and "peak: 4.29 MB" in r.output, r.output[-2000:]


@pytest.mark.slow
def test_default_options_run_the_fused_kernels_at_a_streaming_length():
    """Causal attention at t = 2048, one head of 64, with gradients, at the default
    options, where the CPU streams: cuda-sim runs the fused kernels and matches the
    interpreter (f64) and PyTorch (f64; f32 within 10x PyTorch f32's error). (About 80 s
    on 2 shared cores.)"""
    torch = pytest.importorskip("torch", reason="the oracle needs torch")
    name = "causal"
    src = long_source(name, 2048)
    assert has_loop(lowered(src, "cpu")[0])
    x = inputs(src)
    want = reference(src, x)
    ref = torch_attention(name, x, torch.float64, want)
    ref32 = torch_attention(name, {n: a.astype(np.float32) for n, a in x.items()}, torch.float32, want)
    for dtype, tol in (("f64", 1e-11), ("f32", 1e-5)):
        prog = tgc.compile(src, backend="cuda-sim", dtype=dtype)
        assert kinds(prog)[:2] == ["flash", "flashback"], kinds(prog)
        got = prog(**{n: a.astype(np.float32 if dtype == "f32" else np.float64) for n, a in x.items()})
        for n, w in want.items():
            g = np.asarray(got[n], np.float64)
            scale = float(np.max(np.abs(w)))
            np.testing.assert_allclose(g, w, rtol=0, atol=tol * scale, err_msg=f"{name} {dtype} {n}")
            np.testing.assert_allclose(w, ref[n], rtol=0, atol=1e-11 * scale, err_msg=f"{name} torch {n}")
            if dtype == "f32":
                err32 = float(np.max(np.abs(ref32[n] - ref[n])))
                assert float(np.max(np.abs(g - ref[n]))) <= max(10 * err32, 1e-6 * scale), n


def test_the_lowered_text_reads_back():
    """`tgc dump-ir --after flash` prints the groups (`flash for head < 2  reg %S[..],
    %P[..]`, `flashback for ...` with S and P again as its first members) and the text
    reads back (verified) to the same program."""
    from tgc.lower.lowered import print_lowered
    from tgc.lower.text import parse_lowered

    for name in ("causal", "cross"):
        text = print_lowered(build(source(name, 64), "f64").lowered)
        heads = [line for line in text.splitlines() if line.startswith(("k0:", "k1:"))]
        assert heads[0].startswith("k0: flash for head < 2  reg %") and "flashback for head < 2  reg %" in heads[1], heads
        assert print_lowered(parse_lowered(text)) == text


@pytest.mark.parametrize("scale", [300.0, 3000.0])
def test_f32_at_large_logits_is_within_the_contract(scale):
    """Logits up to about 1e3 and 1e4 (q scaled): y, dq, dk, dv in f32 on cuda-sim
    within 10x PyTorch f32's error against PyTorch f64 (the dot products and output
    sums are taken in double and rounded once)."""
    torch = pytest.importorskip("torch", reason="the oracle needs torch")
    for name in ("causal", "cross"):
        src = source(name, 64)
        x = inputs(src)
        x["q"] = x["q"] * scale
        outs = ["y", "dq", "dk", "dv"]
        ref = torch_attention(name, x, torch.float64, outs)
        ref32 = torch_attention(name, {n: a.astype(np.float32) for n, a in x.items()}, torch.float32, outs)
        got = build(src, "f32")(**{n: a.astype(np.float32) for n, a in x.items()})
        for n in outs:
            err32 = float(np.max(np.abs(ref32[n] - ref[n])))
            err = float(np.max(np.abs(np.asarray(got[n], np.float64) - ref[n])))
            assert err <= 10 * err32 + 1e-7 * float(np.max(np.abs(ref[n]))), (name, n, err, err32)
