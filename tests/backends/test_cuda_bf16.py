"""bf16/f16 on the CUDA backends: 2-byte buffers (the neutral `narrow` stage), kernels
that widen on load and narrow on store (`tgc_ld_bf16`/`tgc_st_bf16`, ... in
tgc_ops.cuh; four at a time as ushort4 in the vector loops; row groups with their rows
in registers or not), and GEMM cells on two bf16 (or two f16) operands as
`cublasGemmStridedBatchedEx` calls with f32 output and compute (`cublas_operands`,
`gemm.ex_types`; numpy on the widened operands under cuda-sim).

Oracles: the same program on cuda-sim without `narrow` and `cublas_operands` (every
buffer in f32: the emulation the backend ran before), bit for bit outside GEMMs; the
IR interpreter to a bf16/f16 ulp; the CPU backend under `--autocast` (products of
the same bf16-rounded operands summed in f32, in another order); float64 products of
the same bf16 values for the GemmEx cells. nvcc compiles the modules for sm_90 where it
is installed.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import tgc
from tgc.backends.base import get_backend
from tgc.backends.cuda import aot, codegen, gemm
from tgc.backends.cuda.runtime import lower
from tgc.backends.cpu.options import CpuOptions
from tgc.frontend import compile_source
from tgc.ir.dtypes import round_to
from tgc.ir.interp import evaluate
from tgc.lower.lowered import GemmKernel, LoopKernel
from tgc.manager import run_pipeline
from tgc.options import Options
from lowp_programs import CHAIN   # shared with the other backend's bf16 tests

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="cuda-sim needs g++ with OpenMP")

ROOT = Path(__file__).parent.parent.parent
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
NVCC = shutil.which("nvcc")


def wide_stages() -> tuple[str, ...]:
    """The CUDA backends' stage list without `narrow` and `cublas_operands`: f32 buffers."""
    return tuple(s for s in get_backend("cuda-sim").lowering() if s not in ("narrow", "cublas_operands"))


def optimized(src: str, opts: Options):
    return run_pipeline(compile_source(src, "t.tg", opts), opts).module


def same_bits(a, b) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


def _counters(prog):
    import ctypes

    fn = prog._kernels._device.lib.tgc_sim_counters
    fn.restype = ctypes.POINTER(ctypes.c_longlong)
    return fn()


def low_values(rng, shape, t):
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-4, 4, shape))
    flat = x.reshape(-1)
    if flat.size >= 8:
        flat[:3] = [0.0, -0.0, 2.0 ** -130 if t == "bf16" else 2.0 ** -20]
    return round_to(x, t)


@pytest.fixture
def ex_calls(monkeypatch):
    """Every cuBLAS call cuda-sim runs (`gemm.run_numpy`), recorded."""
    calls = []
    run = gemm.run_numpy

    def record(call, *args, **kw):
        calls.append(call)
        return run(call, *args, **kw)
    monkeypatch.setattr(gemm, "run_numpy", record)
    return calls


# ---- storage: which buffers are 2-byte, and the generated C ----------------------------



def test_cuda_lowering_stores_bf16_values_in_two_bytes():
    opts = Options()
    low = lower(optimized(CHAIN, opts), opts)
    bufs = low.buffers
    assert bufs["x"].dtype == "bf16" and bufs["s"].dtype == "bf16" and bufs["h"].dtype == "f16"
    assert bufs["y"].dtype == "bf16" and bufs["g"].dtype == "f16"    # declared bf16/f16, written elementwise
    assert bufs["r"].dtype == "f32"                                  # a reduction's output stays f32
    src = codegen.generate(low).source
    assert "tgc_ld_bf16(" in src and "tgc_st_bf16(" in src and "tgc_ld_f16(" in src and "tgc_st_f16(" in src
    assert "const unsigned short* __restrict__" in src


@pytest.mark.parametrize("regs", [8, 1])
def test_chain_on_cuda_sim_matches_the_f32_buffers_bit_for_bit(regs):
    """Row groups with the row in registers (8) and read from memory (1) alike."""
    rng = np.random.default_rng(1)
    inputs = {"x": low_values(rng, (64, 48), "bf16"), "s": low_values(rng, 48, "bf16"),
              "h": low_values(rng, (64, 48), "f16")}
    opts = Options().with_(row_regs=regs)
    narrow = tgc.compile(CHAIN, backend="cuda-sim", options=opts)
    wide = tgc.compile(CHAIN, backend="cuda-sim", options=opts.with_(stages=wide_stages()))
    assert any(type(k).__name__ == "RowGroup" for k in narrow.lowered.kernels)
    c = _counters(narrow)
    c[1] = c[2] = 0
    got, want = narrow(**inputs), wide(**inputs)
    assert (c[1] > 0, c[2] > 0) == ((True, False) if regs == 8 else (False, True))   # rows in registers, or not
    ref = evaluate(optimized(CHAIN, opts), inputs)
    for k in want:
        assert got[k].dtype == want[k].dtype == ref[k].dtype, k
        assert same_bits(got[k], want[k]), k
        ulp = 2.0 ** -7 if got[k].dtype == BF16 else 2.0 ** -10
        np.testing.assert_allclose(np.asarray(got[k], np.float64), np.asarray(ref[k], np.float64),
                                   rtol=2 * ulp, atol=1e-3, err_msg=k)
    assert got["y"].dtype == BF16 and got["g"].dtype == F16


VECTOR = """
dim r, d
input x: bf16[r, d]
input s: bf16[d]
input h: f16[r, d]
input z[r, d]
out y = x * s + x
out g = h * h
out w = f32(x) * z
"""


def test_two_byte_buffers_take_the_vector_loop_where_aligned():
    """bf16/f16 operands and outputs along the contiguous edge: one 8-byte ushort4 load
    or store of four elements (widened, narrowed per element), where the row length is
    a multiple of 4 and the addresses are 8-byte aligned; else the scalar loop. The
    same bits either way, and as with f32 buffers."""
    prog = tgc.compile(VECTOR, backend="cuda-sim", options=Options().with_(row_groups=False))
    wide = tgc.compile(VECTOR, backend="cuda-sim", options=Options().with_(row_groups=False, stages=wide_stages()))
    src = prog.cuda_source
    assert "reinterpret_cast<const ushort4*>" in src and "reinterpret_cast<ushort4*>" in src
    assert "tgc_aligned8(" in src and "const float4 l" in src
    rng = np.random.default_rng(7)
    runs = {}
    for rows, d, offset in ((3, 8, False), (3, 8, True), (3, 7, False)):
        big = low_values(rng, rows * d + 1, "bf16")
        x = (big[1:] if offset else big[:-1].copy()).reshape(rows, d)   # 2 bytes past 8: misaligned
        ins = {"x": x, "s": low_values(rng, d, "bf16"), "h": low_values(rng, (rows, d), "f16"),
               "z": rng.standard_normal((rows, d)).astype(np.float32)}
        c = _counters(prog)
        c[0] = 0
        got = prog(**ins)
        runs[rows, d, offset] = c[0]     # threads that ran a vector loop
        want = wide(**ins)
        for k in want:
            assert got[k].dtype == want[k].dtype and same_bits(got[k], want[k]), (k, rows, d, offset)
    # aligned: the three kernels; x misaligned: only g = h * h; rows of 7: none
    assert runs[3, 8, False] > runs[3, 8, True] > 0 and runs[3, 7, False] == 0, runs


def random_program(rng) -> str:
    leaves = ["x", "y", "z", "u"]
    ops = ["{a} + {b}", "{a} * {b}", "{a} - {b}", "{a} / ({b} * {b} + 1)", "max({a}, {b})",
           "bf16({a})", "f16({a})", "f32({a})", "tanh({a})", "exp(-{a} * {a})", "where({a} > 0, {a}, {b})"]

    def expr(depth):
        if depth == 0 or rng.random() < 0.2:
            return str(rng.choice(leaves))
        return str(rng.choice(ops)).format(a=expr(depth - 1), b=expr(depth - 1))

    lines = ["dim n = 24, m = 40, k = 16",
             "input x: bf16[i: n, j: m]", "input y: f16[i, j]", "input z: f32[i, j]", "input u: bf16[j]",
             "input w: bf16[j, l: k]", "input v: f16[j, l]"]
    for o in range(4):
        lines += [f"t{o} = {expr(3)}", f"out e{o} = t{o}"]
    lines += ["out s = sum[j](f32(t0) * f32(x))", "out p = bf16(t1) @ w", "out q = f16(t2) @ v",
              "out mixed = bf16(t3) * f32(u)"]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("seed", range(4))
def test_random_mixed_programs_on_cuda_sim(seed):
    rng = np.random.default_rng(seed)
    src = random_program(rng)
    inputs = {"x": low_values(rng, (24, 40), "bf16"), "y": low_values(rng, (24, 40), "f16"),
              "z": rng.standard_normal((24, 40)).astype(np.float32), "u": low_values(rng, 40, "bf16"),
              "w": low_values(rng, (40, 16), "bf16"), "v": low_values(rng, (40, 16), "f16")}
    opts = Options()
    narrow = tgc.compile(src, backend="cuda-sim", options=opts)
    wide = tgc.compile(src, backend="cuda-sim", options=opts.with_(stages=wide_stages()))
    assert any(b.dtype in ("bf16", "f16") for b in narrow.lowered.buffers.values() if b.kind != "arg")
    assert not any(b.dtype in ("bf16", "f16") for b in wide.lowered.buffers.values())
    got, want = narrow(**inputs), wide(**inputs)
    ref = evaluate(optimized(src, opts), inputs)
    for k in want:
        assert got[k].dtype == want[k].dtype == ref[k].dtype, k
        g, w, r = (np.asarray(a, np.float64) for a in (got[k], want[k], ref[k]))
        if k in ("p", "q", "mixed"):   # f32 sums in another order
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max(), err_msg=(k, src))
        else:
            assert same_bits(g, w), (k, src)
        ulp = 2.0 ** -7 if got[k].dtype == BF16 else 2.0 ** -10 if got[k].dtype == F16 else 1e-5
        finite = np.abs(r[np.isfinite(r)])
        scale = max(1.0, float(finite.max())) if finite.size else 1.0
        np.testing.assert_allclose(g, r, rtol=2 * ulp, atol=1e-3 * scale, equal_nan=True, err_msg=(k, src))


# ---- GEMM cells: GemmEx on two bf16 (or f16) operands, the rest widened ------------------

PRODUCTS = """
dim m = 40, k = 56, n = 24, h = 3
input a: bf16[i: m, kk: k]
input b: bf16[kk, j: n]
input c: f16[i, kk]
input d: f16[kk, j]
input e[kk, j]
input qa: bf16[hh: h, i, kk]
input qb: bf16[hh, j, kk]
out ab = f32(a) @ f32(b)
out cd = f32(c) @ f32(d)
out ae = f32(a) @ e
out ad = f32(a) @ f32(d)
out batched = sum[kk](f32(qa) * f32(qb))
"""


def test_gemm_ex_cells_and_widened_operands(ex_calls):
    opts = Options()
    low = lower(optimized(PRODUCTS, opts), opts)
    gemms = {k.out: k for k in low.kernels if isinstance(k, GemmKernel)}
    types = {o: (low.buffers[k.a.buf].dtype, low.buffers[k.b.buf].dtype) for o, k in gemms.items()}
    assert sorted(types.values()) == sorted([("bf16", "bf16"), ("f16", "f16"), ("f32", "f32"), ("f32", "f32"),
                                             ("bf16", "bf16")]), types
    notes = [k.note for k in low.kernels if isinstance(k, LoopKernel)]
    assert "bf16 widened for cuBLAS" in notes and "f16 widened for cuBLAS" in notes

    rng = np.random.default_rng(2)
    inputs = {"a": low_values(rng, (40, 56), "bf16"), "b": low_values(rng, (56, 24), "bf16"),
              "c": low_values(rng, (40, 56), "f16"), "d": low_values(rng, (56, 24), "f16"),
              "e": rng.standard_normal((56, 24)).astype(np.float32),
              "qa": low_values(rng, (3, 40, 56), "bf16"), "qb": low_values(rng, (3, 24, 56), "bf16")}
    prog = tgc.compile(PRODUCTS, backend="cuda-sim")
    ex_calls.clear()
    got = prog(**inputs)
    f = {k: np.asarray(v, np.float64) for k, v in inputs.items()}
    pairs = {"ab": (f["a"], f["b"]), "cd": (f["c"], f["d"]), "ae": (f["a"], f["e"]), "ad": (f["a"], f["d"]),
             "batched": (f["qa"], f["qb"].transpose(0, 2, 1))}
    for k, (x, y) in pairs.items():
        assert got[k].dtype == np.float32
        # exact products summed in f32: within about k * 2^-24 of the sum of magnitudes
        bound = 56 * 2.0 ** -24 * (np.abs(x) @ np.abs(y)) + 1e-30
        g = np.moveaxis(got[k], -1, 0) if k == "batched" else got[k]   # [i, j, hh] in ABI order
        assert np.all(np.abs(g - x @ y) <= bound), k
    ex = [c for c in ex_calls if c.atype]
    assert len(ex) == 3 and {c.atype for c in ex} == {"bf16", "f16"}
    for c in ex:
        assert c.atype == c.btype
        assert gemm.ex_types(c) == (gemm.CUDA_R[c.atype], gemm.CUDA_R[c.atype], 0, 68)
    assert gemm.CUDA_R == {"f32": 0, "f64": 1, "f16": 2, "bf16": 14} and gemm.CUBLAS_COMPUTE_32F == 68
    assert all(gemm.ex_types(c) is None for c in ex_calls if not c.atype)
    assert any(c.batch == 3 for c in ex)   # the batched bf16 product: one strided batched GemmEx call


def test_f64_programs_widen_every_low_operand(ex_calls):
    """GemmEx writes f32 only: in an f64 program a bf16 product runs dgemm on widened operands."""
    rng = np.random.default_rng(3)
    src = "dim m = 40, k = 56, n = 24\ninput a: bf16[i: m, kk: k]\ninput b: bf16[kk, j: n]\nout c = f32(a) @ f32(b)\n"
    prog = tgc.compile(src, backend="cuda-sim", dtype="f64")
    a, b = low_values(rng, (40, 56), "bf16"), low_values(rng, (56, 24), "bf16")
    ex_calls.clear()
    got = prog(a=a, b=b)["c"]
    assert ex_calls and not any(c.atype for c in ex_calls)
    np.testing.assert_allclose(got, np.asarray(a, np.float64) @ np.asarray(b, np.float64), rtol=1e-6)


def test_manifest_names_two_byte_buffers_and_gemm_ex():
    opts = Options()
    module = optimized(PRODUCTS, opts)
    low = lower(module, opts)
    cm = codegen.generate(low)
    doc = json.loads(aot.manifest(low, cm, "cu", "sm_90"))
    args = {a["name"]: a["dtype"] for a in doc["args"]}
    assert args["a"] == "bf16" and args["c"] == "f16" and args["e"] == "f32"
    ex = [x["ex"] for x in doc["launches"] if x["kind"] == "gemm" and "ex" in x]
    assert sorted((x["a"], x["b"]) for x in ex) == [("bf16", "bf16"), ("bf16", "bf16"), ("f16", "f16")]
    assert all(x["out"] == "f32" and x["compute"] == "CUBLAS_COMPUTE_32F" for x in ex)


# ---- autocast: the MLP and GPT examples, and the sorting GPT's training --------------------

def _example_inputs(module, batch: int, seed: int) -> dict:
    from tgc.ir.inputs import random_inputs

    dims = {d: batch for d in module.symbolic_dims()}
    return random_inputs(module, module.bind_dims(dims), seed, "f32"), dims


@pytest.mark.parametrize("low", ["bf16", "f16"])
@pytest.mark.parametrize("name", ["mlp.tg", pytest.param("gpt.tg", marks=pytest.mark.slow)])
def test_autocast_examples_on_cuda_sim_match_the_cpu(name, low, ex_calls):
    from tgc import pipeline

    opts = Options(autocast=low, cpu=CpuOptions(bf16_gemm="off"))
    module = pipeline.lower(pipeline.load(str(ROOT / "examples" / name), opts), opts).module
    inputs, dims = _example_inputs(module, 6, 0)
    sim = tgc.compile(ROOT / "examples" / name, backend="cuda-sim", options=opts)
    cpu = tgc.compile(ROOT / "examples" / name, options=opts)
    ex_calls.clear()
    got = sim.run({k: v.copy() for k, v in inputs.items()}, dims)
    assert ex_calls and all(c.atype == low for c in ex_calls)   # every product: GemmEx on 2-byte operands
    assert any(b.dtype == low and b.kind == "temp" for b in sim.lowered.buffers.values())
    want = cpu.run({k: v.copy() for k, v in inputs.items()}, dims)
    ref = evaluate(module, {k: v.copy() for k, v in inputs.items()}, dims=dims)
    for k in want:
        g, w, r = (np.asarray(x, np.float64) for x in (got[k], want[k], ref[k]))
        scale = max(1.0, np.abs(r).max())
        # cuda-sim multiplies the rounded operands as the interpreter does (numpy, f32):
        # element by element, up to f32 sums in another order
        tol = 2.0 ** -6 if low == "bf16" else 2.0 ** -9
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol * scale, err_msg=k)
        # the CPU's sgemm sums in another order, so now and then a value rounds to the other
        # bf16/f16 neighbour before a product (GPT, batch 6: 40 of 2112 logits move); the
        # backward pass spreads such a flip over whole gradients (a layernorm weight's,
        # summed over a few rows, by up to 3% in norm), so the CPU is compared in norm
        assert np.linalg.norm(g - w) <= 4 * tol * max(np.linalg.norm(w), 1e-30), k


def _sort_gpt():
    spec = importlib.util.spec_from_file_location("example_train_sort_gpt", ROOT / "examples" / "train_sort_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_sorting_gpt_trains_alike_on_cuda_sim_and_cpu_under_autocast(ex_calls):
    """Three AdamW steps of the sorting GPT under --autocast bf16: cuda-sim (GemmEx
    cells on bf16 buffers) and the CPU (sgemm on the same rounded operands) agree."""
    m = _sort_gpt()
    opts = Options(autocast="bf16", cpu=CpuOptions(bf16_gemm="off"))
    tg = ROOT / "examples" / "train_sort_gpt.tg"
    sim, cpu = tgc.compile(tg, backend="cuda-sim", options=opts), tgc.compile(tg, options=opts)
    train, _ = m.split(0)
    p_sim, p_cpu = m.init(cpu, 0), m.init(cpu, 0)
    rng = np.random.default_rng(0)
    ex_calls.clear()
    for step in range(3):
        b = m.batch(train[rng.integers(0, len(train), 16)])
        args = {**b, "lr": np.float32(m.learning_rate(step, 600) * 10), "wd": np.float32(m.WEIGHT_DECAY)}
        got, want = sim(**args, **p_sim), cpu(**args, **p_cpu)
        assert float(got["loss"]) == pytest.approx(float(want["loss"]), rel=2e-3), step
    # the forward products run as GemmEx on bf16 buffers; in the backward of the
    # layers' loop (its step), a product fed by a fused reduction reads an f32
    # buffer (`narrow` keeps a reduction's output wide), so sgemm runs it on widened
    # operands: the same values, another cuBLAS call
    flops = lambda calls: sum(2 * c.m * c.n * c.k * c.batch for c in calls)
    ex = [c for c in ex_calls if c.atype == "bf16"]
    assert ex and all(c.btype == "bf16" for c in ex)
    assert flops(ex) >= 0.5 * flops(ex_calls), (flops(ex), flops(ex_calls))
    for k in p_cpu:
        np.testing.assert_allclose(p_sim[k], p_cpu[k], rtol=2e-2, atol=2e-3 * max(1e-2, np.abs(p_cpu[k]).max()),
                                   err_msg=k)


# ---- nvcc: the modules with 2-byte buffers compile for sm_90 -------------------------------

@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc (the CUDA toolkit) is not installed")
def test_two_byte_modules_compile_for_sm90_without_warnings(tmp_path):
    from tgc import pipeline

    sources = []
    for i, (src, opts) in enumerate([(CHAIN, Options()), (PRODUCTS, Options()), (VECTOR, Options()),
                                     (ROOT / "examples/gpt.tg", Options(autocast="bf16")),
                                     (ROOT / "examples/mlp.tg", Options(autocast="f16"))]):
        module = (pipeline.lower(pipeline.load(str(src), opts), opts).module if isinstance(src, Path)
                  else optimized(src, opts))
        low = lower(module, opts)
        assert any(b.dtype in ("bf16", "f16") for b in low.buffers.values())
        sources.append(codegen.generate(low, prefix=f"p{i}_").source)
    cu = tmp_path / "lowp.cu"
    cu.write_text("\n".join(sources))
    done = subprocess.run([NVCC, "-cubin", "-arch=sm_90", "--Werror", "all-warnings", "-o",
                           str(tmp_path / "lowp.cubin"), str(cu)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr[-3000:]


def _libnvrtc():
    """NVRTC (CuPy's compiler): the `nvidia-cuda-nvrtc` wheel's library on sys.path, or the system's."""
    import ctypes
    import ctypes.util
    import sys

    for entry in sys.path:
        lib = Path(entry) / "nvidia" / "cu13" / "lib" / "libnvrtc.so.13"
        if lib.is_file():
            return ctypes.CDLL(str(lib))
    found = ctypes.util.find_library("nvrtc")
    return ctypes.CDLL(found) if found else None


@pytest.mark.skipif(_libnvrtc() is None, reason="NVRTC is not installed (pip install nvidia-cuda-nvrtc)")
def test_two_byte_modules_compile_with_nvrtc():
    """The runtime's compiler has no cuda_bf16.h / cuda_fp16.h on its own: the 2-byte
    loads and stores use none, and compile there with an empty log."""
    import ctypes

    from tgc import pipeline

    nvrtc = _libnvrtc()
    for src, opts in [(CHAIN, Options()), (PRODUCTS, Options()), (VECTOR, Options()),
                      (ROOT / "examples/mlp.tg", Options(autocast="f16"))]:
        module = (pipeline.lower(pipeline.load(str(src), opts), opts).module if isinstance(src, Path)
                  else optimized(src, opts))
        source = codegen.generate(lower(module, opts)).source
        prog = ctypes.c_void_p()
        assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"module.cu", 0, None, None) == 0
        flags = [b"--std=c++17", b"-arch=sm_90"]
        rc = nvrtc.nvrtcCompileProgram(prog, len(flags), (ctypes.c_char_p * len(flags))(*flags))
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
        assert rc == 0 and not log.value.strip(), log.value.decode()[:2000]


@pytest.mark.parametrize("backend", ["cpu", "cuda-sim"])
def test_fp_strict_keeps_declared_bf16_outputs_and_the_bits(backend):
    """--fp-strict runs the f32 program as its f64 emulation and returns its float
    outputs as f32 (`r`, a sum of the conversion `f32(b)`); outputs of bf16/f16 values keep their type (stored in 2 bytes, or
    held in floats), with the CPU's bits on cuda-sim."""
    rng = np.random.default_rng(8)
    ins = {"x": low_values(rng, (64, 48), "bf16"), "s": low_values(rng, 48, "bf16"), "h": low_values(rng, (64, 48), "f16")}
    strict = Options(fp_strict=True)
    got = tgc.compile(CHAIN, backend=backend, options=strict)(**ins)
    assert (got["y"].dtype, got["r"].dtype, got["g"].dtype) == (BF16, np.float32, F16)   # r: a sum of f32(b)
    want = tgc.compile(CHAIN, options=strict)(**ins)
    for k in want:
        assert same_bits(got[k], want[k]), k
