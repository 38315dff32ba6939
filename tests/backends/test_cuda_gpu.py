"""The cuda backend on a real GPU (CuPy): every example against the interpreter,
device arrays in and out, updates in place on the caller's device arrays, a gather
error through the device error word. Skipped, with the reason, where CuPy or a GPU
is missing (benchmarks/gpu_check.sh runs these where one is)."""
from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.ir.interp import EvalError, evaluate
from tgc.ir.inputs import random_inputs
from tgc.options import CudaOptions, Options

from marks import sized_by_themselves


def _why_not() -> str | None:
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install -e '.[cuda]')"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as e:  # noqa: BLE001 -- no driver
        return f"no usable CUDA device: {e}"
    return None


REASON = _why_not()
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))
ROOT = Path(__file__).parent.parent.parent
PROGRAMS = sorted(sized_by_themselves((ROOT / "examples").glob("*.tg"))) + sorted((ROOT / "tests/programs/good").glob("*.tg"))


@pytest.mark.parametrize("dtype", ["f64", "f32"])
@pytest.mark.parametrize("path", PROGRAMS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_program_matches_interpreter_on_the_gpu(path, dtype):
    import cupy

    options = Options(dtype=dtype, cuda=CudaOptions(row_min=16))   # the one-block-per-row reductions too
    module = pipeline.lower(pipeline.load(str(path), options), options).module
    dims = {d: 40 for d in module.symbolic_dims()}
    inputs = random_inputs(module, module.bind_dims(dims), 0, dtype)
    want = evaluate(module, {k: v.copy() for k, v in inputs.items()}, dtype="f64", dims=dims)
    prog = tgc.compile(module, dtype=dtype, backend="cuda", options=options)
    dev = {k: cupy.asarray(v) for k, v in inputs.items()}
    got = prog.run(dev, dims)
    for name, ref in want.items():
        assert isinstance(got[name], cupy.ndarray)
        scale = max(1.0, float(np.nanmax(np.abs(ref)))) if ref.size else 1.0
        tol = (1e-9, 1e-9) if dtype == "f64" else (2e-4, 2e-5)
        np.testing.assert_allclose(cupy.asnumpy(got[name]), ref, rtol=tol[0], atol=tol[1] * scale, err_msg=name)
    for u in module.updates:   # written in place into the caller's device array
        assert got[module.update_key(u.target)] is dev[u.target]


def test_gather_error_on_the_gpu():
    import cupy

    src = "dim b\ndim v = 10, e = 6\ninput ids: i32[b]\nparam E[v, e]\nout r = E[v = ids]\n"
    prog = tgc.compile(src, backend="cuda")
    with pytest.raises(EvalError, match=r"'ids'\[b=1\] = 10"):
        prog(ids=cupy.asarray(np.array([1, 10], np.int32)), E=cupy.ones((10, 6), np.float32))
    out = prog(ids=np.array([1, 9], np.int32), E=np.ones((10, 6), np.float32))   # numpy: copied to the device
    assert isinstance(out["r"], cupy.ndarray) and float(out["r"].sum()) == 12.0


def test_cuda_graph_replays_match_launching_each_kernel():
    """The same program with and without CUDA graphs, over several calls (new values
    in the same input arrays each call, the param updated in place by the graph),
    batch sizes changing: a graph per batch size and set of addresses, replayed."""
    import cupy

    src = ROOT / "examples/mlp.tg"
    options = Options(dtype="f32")
    module = pipeline.lower(pipeline.load(str(src), options), options).module
    graph = tgc.compile(module, dtype="f32", backend="cuda")
    plain = tgc.compile(module, dtype="f32", backend="cuda", options=options.with_(graphs=False))
    params = None       # the graph's param arrays: the same device arrays every step
    held: dict = {}     # per batch size, the graph's input arrays, refilled each step
    for step, batch in enumerate((32, 32, 32, 17, 32)):
        dims = {d: batch for d in module.symbolic_dims()}
        inputs = random_inputs(module, module.bind_dims(dims), step, "f32")
        if params is None:
            params = {u.target: cupy.asarray(inputs[u.target]) for u in module.updates}
        a = held.setdefault(batch, {k: cupy.empty(v.shape, v.dtype) for k, v in inputs.items() if k not in params})
        for k, v in a.items():
            v[...] = cupy.asarray(inputs[k])
        b = {k: (params[k].copy() if k in params else cupy.asarray(v)) for k, v in inputs.items()}
        ga, gb = graph.run({**a, **params}, dims), plain.run(b, dims)
        for k in gb:
            np.testing.assert_allclose(cupy.asnumpy(ga[k]), cupy.asnumpy(gb[k]), rtol=1e-5, atol=1e-6, err_msg=k)
        for k in params:    # updated in place by the graph, as without it
            assert ga[module.update_key(k)] is params[k]
            np.testing.assert_allclose(cupy.asnumpy(params[k]), cupy.asnumpy(b[k]), rtol=1e-5, atol=1e-6)
        del ga              # dropped: the next call may write the same outputs again
    counts = graph._kernels.graph_counts
    assert counts["replays"] == 5 and counts["captures"] >= 2   # batch 32 and 17, and new output addresses
    captures = counts["captures"]
    for _ in range(3):    # the same arrays, the outputs dropped: written again, at the same addresses
        graph(**held[32], **params)
    assert counts["replays"] == 8 and counts["captures"] <= captures + 1


@pytest.mark.parametrize("warp_rows", [0, 10 ** 6])
def test_row_groups_and_float4_on_the_gpu(warp_rows):
    """Softmax and layernorm rows (forward and backward) as one kernel, a block or a
    warp per row, rows in registers or re-read; an elementwise loop with float4."""
    import cupy

    rows_src = {"softmax": "dim rows, d\ninput x[rows, d]\ninput dy[rows, d]\ny = softmax[d](x)\nout y\n"
                           "out dx = grad(sum(y * dy), x)\n",
                "layernorm": "dim rows, d\ninput x[rows, d]\ninput dy[rows, d]\nparam w[d], b[d]\n"
                             "y = layernorm[d](x, w, b)\nloss = sum(y * dy)\nout y\nout dx = grad(loss, x)\n"
                             "out dw = grad(loss, w)\nout db = grad(loss, b)\n",
                "float4": "dim rows, d\ninput x[rows, d]\nparam b[d]\nout y = tanh(x + b) * x\n"}
    for name, src in rows_src.items():
        prog = tgc.compile(src, backend="cuda", dtype="f32", options=Options().with_(warp_rows=warp_rows))
        for d in (1, 31, 33, 256, 1000, 4096):
            dims = {"rows": 37, "d": d}
            inputs = random_inputs(prog.module, prog.module.bind_dims(dims), d, "f32")
            want = evaluate(prog.module, {k: v.copy() for k, v in inputs.items()}, dtype="f64")
            got = prog.run({k: cupy.asarray(v) for k, v in inputs.items()}, dims)
            for k, ref in want.items():
                scale = max(1.0, float(np.max(np.abs(ref))))
                np.testing.assert_allclose(cupy.asnumpy(got[k]), ref, rtol=2e-4, atol=2e-5 * scale,
                                           err_msg=f"{name} {k} d={d}")


def test_column_sums_on_the_gpu_are_the_same_bits_every_call():
    """Bias and weight gradients as column tiles (float4 and per-element paths, one
    chunk and many) against the interpreter, and two calls bitwise equal."""
    import cupy

    src = "dim rows, d\ninput dy[rows, d]\ninput x[rows, d]\nout db[d] = sum[rows](dy)\nout dw[d] = sum[rows](dy * x)\n"
    prog = tgc.compile(src, backend="cuda", dtype="f32")
    assert all(x.col for x in prog.cuda_module.launches if x.kind == "loop")
    for rows, d in ((200, 1), (130, 3), (4096, 1024), (1000, 129), (65536, 64)):
        dims = {"rows": rows, "d": d}
        inputs = random_inputs(prog.module, prog.module.bind_dims(dims), rows + d, "f32")
        want = evaluate(prog.module, {k: v.copy() for k, v in inputs.items()}, dtype="f64")
        dev = {k: cupy.asarray(v) for k, v in inputs.items()}
        first = {k: cupy.asnumpy(v) for k, v in prog.run(dev, dims).items()}
        again = {k: cupy.asnumpy(v) for k, v in prog.run(dev, dims).items()}
        for k, ref in want.items():
            scale = max(1.0, float(np.max(np.abs(ref))))
            np.testing.assert_allclose(first[k], ref, rtol=2e-5, atol=2e-6 * scale, err_msg=f"{k} at {dims}")
            assert first[k].tobytes() == again[k].tobytes(), (k, dims)


def test_bf16_gemm_ex_and_two_byte_buffers_on_the_gpu():
    """bf16 and f16 products as cublasGemmStridedBatchedEx (f32 output and compute)
    against float64 products of the same values; declared bf16 elementwise work in
    2-byte buffers (uint16 bits in, uint16 bits out) with cuda-sim's bits."""
    import cupy
    import ml_dtypes

    rng = np.random.default_rng(5)
    for t, dt, view in (("bf16", ml_dtypes.bfloat16, np.uint16), ("f16", np.float16, np.float16)):
        src = f"dim m = 384, k = 1024, n = 200\ninput a: {t}[i: m, kk: k]\ninput b: {t}[kk, j: n]\nout c = f32(a) @ f32(b)\n"
        a, b = rng.standard_normal((384, 1024)).astype(dt), rng.standard_normal((1024, 200)).astype(dt)
        prog = tgc.compile(src, backend="cuda")
        got = cupy.asnumpy(prog(a=cupy.asarray(a.view(view)), b=cupy.asarray(b.view(view)))["c"])
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert got.dtype == np.float32
        assert np.all(np.abs(got - a64 @ b64) <= 1024 * 2.0 ** -22 * (np.abs(a64) @ np.abs(b64))), t
    src = "dim n = 300, m = 97\ninput x: bf16[i: n, j: m]\ninput s: bf16[j]\nout y = exp(x * s) - x\nout r = sum[j](f32(x))\n"
    x, s = rng.standard_normal((300, 97)).astype(ml_dtypes.bfloat16), rng.standard_normal(97).astype(ml_dtypes.bfloat16)
    want = tgc.compile(src, backend="cuda-sim")(x=x, s=s)
    got = tgc.compile(src, backend="cuda")(x=cupy.asarray(x.view(np.uint16)), s=cupy.asarray(s.view(np.uint16)))
    assert got["y"].dtype == np.uint16 and got["r"].dtype == np.float32   # bfloat16 bits; f32(x) summed
    y = cupy.asnumpy(got["y"]).view(ml_dtypes.bfloat16).astype(np.float64)
    r = cupy.asnumpy(got["r"]).astype(np.float64)
    np.testing.assert_allclose(y, np.asarray(want["y"], np.float64), rtol=2.0 ** -7, atol=1e-6)   # exp: a few ulps
    np.testing.assert_allclose(r, np.asarray(want["r"], np.float64), rtol=2.0 ** -7, atol=1e-3)


def test_autocast_gpt_step_on_the_gpu_matches_the_interpreter():
    """examples/gpt.tg under --autocast bf16: GemmEx products on 2-byte operands on the
    GPU, against the interpreter on the same rounded operands (f32)."""
    import cupy

    options = Options(autocast="bf16")
    module = pipeline.lower(pipeline.load(str(ROOT / "examples/gpt.tg"), options), options).module
    dims = {d: 16 for d in module.symbolic_dims()}
    inputs = random_inputs(module, module.bind_dims(dims), 0, "f32")
    want = evaluate(module, {k: v.copy() for k, v in inputs.items()}, dtype="f32", dims=dims)
    prog = tgc.compile(ROOT / "examples/gpt.tg", backend="cuda", options=options)
    got = prog.run({k: cupy.asarray(v) for k, v in inputs.items()}, dims)
    for k, ref in want.items():
        scale = max(1.0, float(np.max(np.abs(ref))))
        np.testing.assert_allclose(cupy.asnumpy(got[k]), ref, rtol=2.0 ** -6, atol=2.0 ** -6 * scale, err_msg=k)


def test_a_loop_as_a_cuda_graph_matches_launching_each_kernel():
    """examples/train_sort_gpt.tg (its layers a `repeat`, a host launch loop over their
    steps) with and without CUDA graphs, three AdamW steps on the same device arrays: the
    whole loop is captured once and replayed, and gives what launching each kernel gives
    (cuBLAS may pick other kernels inside a capture: the first step's outputs agree to
    f32 rounding; AdamW's m / sqrt(v) magnifies a gradient's last bits where it is
    near zero, so the params after a step agree to 1e-3)."""
    import cupy

    path = ROOT / "examples/train_sort_gpt.tg"
    options = Options(dtype="f32")
    module = pipeline.lower(pipeline.load(str(path), options), options).module
    graph = tgc.compile(module, dtype="f32", backend="cuda")
    plain = tgc.compile(module, dtype="f32", backend="cuda", options=options.with_(graphs=False))
    assert any(x.kind == "steps" for x in graph.cuda_module.launches)
    dims = {d: 16 for d in module.symbolic_dims()}
    inputs = random_inputs(module, module.bind_dims(dims), 0, "f32")
    a = {k: cupy.asarray(v) for k, v in inputs.items()}
    b = {k: cupy.asarray(v) for k, v in inputs.items()}
    for step in range(3):
        ga, gb = graph.run(a, dims), plain.run(b, dims)
        for k in gb:
            tol = (1e-4, 1e-5) if step == 0 else (1e-3, 1e-4)
            np.testing.assert_allclose(cupy.asnumpy(ga[k]), cupy.asnumpy(gb[k]), rtol=tol[0], atol=tol[1],
                                       err_msg=f"{k} at step {step}")
        del ga, gb
    counts = graph._kernels.graph_counts
    assert counts["captures"] >= 1 and counts["replays"] == 3, counts


@pytest.mark.parametrize("dtype", ["f64", "f32"])
def test_streamed_attention_on_the_gpu_matches_the_interpreter(dtype):
    """tests/opt/test_stream.py's programs (attention, cross-attention, a bias, pooling, a
    fully masked row, a window, a layer), streamed in blocks of 4 with their gradients:
    the loop over blocks on the GPU against the unstreamed program in the interpreter
    (the flash stage off: with it the CUDA backends keep the chains it fuses whole)."""
    import cupy

    streams = pytest.importorskip("opt.test_stream", reason="the stream tests need torch")
    for name, src in sorted(streams.PROGRAMS.items()):
        options = Options(dtype=dtype, **streams.ON).with_(flash=False)
        prog = tgc.compile(src, backend="cuda", dtype=dtype, options=options)
        assert any(x.kind == "steps" for x in prog.cuda_module.launches), name
        plain = streams.optimized(src, "f64", **streams.OFF)
        x = streams.inputs(src, dtype)
        want = evaluate(plain, {k: np.asarray(v, np.float64) for k, v in x.items()}, dtype="f64")
        got = prog(**{k: cupy.asarray(v) for k, v in x.items()})
        tol = 1e-9 if dtype == "f64" else 2e-5
        for k, ref in want.items():
            scale = max(1.0, float(np.max(np.abs(ref))))
            np.testing.assert_allclose(cupy.asnumpy(got[k]), ref, rtol=0, atol=tol * scale, err_msg=f"{name} {k}")


@pytest.mark.parametrize("dtype", ["f64", "f32"])
def test_flash_attention_on_the_gpu_matches_the_interpreter(dtype):
    """tests/backends/test_cuda_flash.py's programs (causal, cross, a bias, a fully masked
    row, a subtracted mask; d = 64, causal also 128; with their gradients): the fused
    forward and backward kernels on the GPU against the interpreter."""
    import cupy

    flash = pytest.importorskip("backends.test_cuda_flash", reason="the flash tests need torch")
    for name in sorted(flash.PROGRAMS):
        for d in ((64, 128) if name == "causal" else (64,)):   # (NVRTC compiles: part 1 of gpu_check.sh has 120 s)
            src = flash.source(name, d)
            prog = tgc.compile(src, backend="cuda", dtype=dtype)
            assert "flash" in [getattr(k, "kind", "") for k in prog.lowered.kernels], name
            x = flash.inputs(src)
            want = flash.reference(src, x)
            got = prog(**{k: cupy.asarray(v.astype(np.float32 if dtype == "f32" else np.float64)) for k, v in x.items()})
            tol = 1e-10 if dtype == "f64" else 2e-5
            for k, ref in want.items():
                scale = float(np.max(np.abs(ref)))
                np.testing.assert_allclose(cupy.asnumpy(got[k]), ref, rtol=0, atol=tol * scale,
                                           err_msg=f"{name} d={d} {k}")
