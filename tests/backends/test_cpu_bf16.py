"""bf16/f16 storage in the CPU backend's kernels (tgc/lower/narrow.py) and its GEMMs
on bf16 operands (tgc/backends/cpu/gemm_operands.py, gemm_bf16.bf16_kernel).

The invariant of storage: a 2-byte buffer holds only values of its type, so storing
them narrow and widening them on load changes no bit. The oracle is the same program
compiled with the stage list without `narrow` (every buffer in f32, each bf16/f16
value rounded in f32: the emulation the backend ran before), bit for bit; the IR
interpreter to a bf16/f16 ulp (sums in another order); PyTorch's CPU bf16 where it
is installed. The bf16 GEMM (`vdpbf16ps`) runs where the host reports avx512bf16
and is checked against float64 products of the same bf16 values; its code is also
compiled for Sapphire Rapids and the assembly inspected, whatever the host.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

import tgc
from tgc.backends.cpu.gemm_dispatch import bf16_product
from tgc.backends.cpu.llvm_env import has_feature
from tgc.backends.cpu.options import CpuOptions
from tgc.frontend import compile_source
from tgc.ir.dtypes import round_to
from tgc.ir.interp import evaluate
from tgc.lower.interp import run_lowered
from tgc.lower.lowered import GemmKernel, LoopKernel, print_lowered
from tgc.lower.verify import VerifyError, verify_lowered
from tgc.manager import run_pipeline
from tgc.options import Options
from tgc.pipeline import lower_module, lowering
from lowp_programs import CHAIN   # shared with the other backend's bf16 tests

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
HAS_BF16 = has_feature("avx512bf16")


def wide_stages() -> tuple[str, ...]:
    """The CPU's stage list without `narrow`: every buffer in the float type."""
    return tuple(s for s in lowering("cpu") if s != "narrow")


def optimized(src: str, opts: Options):
    return run_pipeline(compile_source(src, "t.tg", opts), opts).module


def same_bits(a, b) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


def low_values(rng, shape, t):
    """Values of type t: normal ones of several scales, some tiny, a few specials."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-4, 4, shape))
    flat = x.reshape(-1)
    if flat.size >= 8:
        flat[:3] = [0.0, -0.0, 2.0 ** -130 if t == "bf16" else 2.0 ** -20]
    return round_to(x, t)


# ---- which buffers are 2-byte ------------------------------------------------------------



def test_bf16_values_computed_elementwise_are_stored_in_two_bytes():
    opts = Options()
    low = lower_module(optimized(CHAIN, opts), opts)
    bufs = low.buffers
    assert bufs["x"].dtype == "bf16" and bufs["s"].dtype == "bf16" and bufs["h"].dtype == "f16"
    outs = {low.module.outputs[b.index].name: b for b in bufs.values() if b.kind == "out"}
    assert outs["y"].dtype == "bf16" and outs["g"].dtype == "f16"   # elementwise, rounded: 2 bytes
    assert outs["r"].dtype == "f32"                                  # a reduction's output stays f32
    for k in low.kernels:   # no reduction, scatter or GEMM writes a 2-byte buffer (verify checks it too)
        for m in getattr(k, "members", (k,)):
            if bufs[m.out].dtype in ("bf16", "f16"):
                assert isinstance(m, LoopKernel) and not m.reduce and not m.scatter
    verify_lowered(low)


def test_two_byte_temporaries_halve_the_workspace():
    src = """
dim n = 256, m = 128
input x: bf16[i: n, j: m]
input w: bf16[j]
a = tanh(x * w)
out r1 = sum[j](f32(a))
out r2 = sum[i](f32(a) * f32(a))
"""
    opts = Options(cpu=CpuOptions(group_blocks=0))   # every value its own buffer
    m = optimized(src, opts)
    narrow = lower_module(m, opts)
    wide = lower_module(m, opts.with_(stages=wide_stages()))
    temps = lambda low: sorted(b.dtype for b in low.buffers.values() if b.kind == "temp")  # noqa: E731
    assert "bf16" in temps(narrow) and "bf16" not in temps(wide)
    total = lambda low: sum(max(s) for s in low.slots)  # noqa: E731
    assert total(narrow) * 2 <= total(wide) + 64 * len(wide.slots)   # bf16 temporaries: half the bytes
    rng = np.random.default_rng(0)
    inputs = {"x": low_values(rng, (256, 128), "bf16"), "w": low_values(rng, 128, "bf16")}
    for k in ("r1", "r2"):
        assert same_bits(run_lowered(narrow, inputs)[k], run_lowered(wide, inputs)[k])


def test_verifier_refuses_a_reduction_into_a_bf16_buffer():
    opts = Options()
    low = lower_module(optimized(CHAIN, opts), opts)
    red = next(m for k in low.kernels for m in getattr(k, "members", (k,))
               if isinstance(m, LoopKernel) and m.reduce)
    low.buffers[red.out].dtype = "bf16"
    with pytest.raises(VerifyError, match="bf16 buffer"):
        verify_lowered(low)


# ---- bit for bit against the f32-held emulation, on random programs --------------------

TYPES = ("bf16", "f16", "f32")


def random_program(rng) -> str:
    """A program over bf16, f16 and f32 inputs: elementwise chains with conversions,
    selections, a reduction, a broadcast and a product, each result an output."""
    leaves = ["x", "y", "z", "u"]
    ops = ["{a} + {b}", "{a} * {b}", "{a} - {b}", "{a} / ({b} * {b} + 1)", "max({a}, {b})",
           "bf16({a})", "f16({a})", "f32({a})", "tanh({a})", "exp(-{a} * {a})", "where({a} > 0, {a}, {b})"]

    def expr(depth):
        if depth == 0 or rng.random() < 0.2:
            return str(rng.choice(leaves))
        op = str(rng.choice(ops))
        return op.format(a=expr(depth - 1), b=expr(depth - 1))

    lines = ["dim n = 24, m = 40, k = 16",
             "input x: bf16[i: n, j: m]", "input y: f16[i, j]", "input z: f32[i, j]", "input u: bf16[j]",
             "input w: bf16[j, l: k]"]
    for o in range(4):
        lines.append(f"t{o} = {expr(3)}")
        lines.append(f"out e{o} = t{o}")
    lines.append("out s = sum[j](f32(t0) * f32(x))")
    lines.append("out p = bf16(t1) @ w")
    return "\n".join(lines) + "\n"


def random_inputs(rng) -> dict:
    return {"x": low_values(rng, (24, 40), "bf16"), "y": low_values(rng, (24, 40), "f16"),
            "z": rng.standard_normal((24, 40)).astype(np.float32), "u": low_values(rng, 40, "bf16"),
            "w": low_values(rng, (40, 16), "bf16")}


@pytest.mark.parametrize("seed", range(8))
def test_random_mixed_programs_store_narrow_with_the_same_bits(seed):
    rng = np.random.default_rng(seed)
    src = random_program(rng)
    inputs = random_inputs(rng)
    opts = Options(cpu=CpuOptions(bf16_gemm="off"))
    narrow = tgc.compile(src, options=opts)
    wide = tgc.compile(src, options=opts.with_(stages=wide_stages()))
    assert any(b.dtype in ("bf16", "f16") for b in narrow.lowered.buffers.values() if b.kind != "arg")
    assert not any(b.dtype in ("bf16", "f16") for b in wide.lowered.buffers.values())
    got, want = narrow(**inputs), wide(**inputs)
    ref = evaluate(optimized(src, opts), inputs)
    for k in want:
        assert got[k].dtype == want[k].dtype == ref[k].dtype, k
        assert same_bits(got[k], want[k]), (k, src)       # storage changes no bit
        a, b = np.asarray(got[k], np.float64), np.asarray(ref[k], np.float64)
        ulp = 2.0 ** -7 if got[k].dtype == BF16 else 2.0 ** -10
        assert np.allclose(a, b, rtol=2 * ulp, atol=1e-3, equal_nan=True), (k, src)
    # the lowered interpreter on the CPU's stages: 2-byte buffers, the same bits
    m = optimized(src, opts)
    low_n = run_lowered(lower_module(m, opts), inputs)
    low_w = run_lowered(lower_module(m, opts.with_(stages=wide_stages())), inputs)
    for k in low_w:
        assert same_bits(low_n[k], low_w[k]), k


# ---- the runtime: 2-byte arrays in and out, without copies --------------------------------

SGD = """
dim n = 256, c = 8
input x: bf16[b: n, i: c]
param W: bf16[i, o: c]
input lr
y = tanh(x @ W)
loss = mean[b](sum[o](f32(y) * f32(y)))
out y
out loss
update W = W - lr * grad(loss, W)
"""


def test_bf16_arrays_are_passed_as_they_are_and_updated_in_place():
    p = tgc.compile(SGD)
    rng = np.random.default_rng(1)
    x, W = low_values(rng, (256, 8), "bf16"), low_values(rng, (8, 8), "bf16") * np.float32(0.3).astype(BF16)
    ref = evaluate(optimized(SGD, Options()), {"x": x, "W": W.copy(), "lr": np.float32(0.1)})
    assert p.lowered.buffers["x"].dtype == "bf16" and p.lowered.buffers["W"].dtype == "bf16"
    assert p.element_dtype(p.inputs[0]) == BF16
    for _ in range(2):   # the second call with these shapes takes the native fast path
        W1 = W.copy()
        out = p(x=x, W=W1, lr=0.1)
        assert out["W"] is W1 and W1.dtype == BF16
        assert out["y"].dtype == BF16
        np.testing.assert_allclose(np.float64(out["loss"]), ref["loss"], rtol=1e-5)
        assert np.allclose(W1.astype(np.float64), ref["W"].astype(np.float64), rtol=2 ** -7, atol=1e-6)
    assert p._fast and p._plans


def test_bf16_layer_matches_torch_cpu_bf16():
    torch = pytest.importorskip("torch", reason="torch's CPU bf16 is the oracle")
    src = """
dim n = 64, d = 96, h = 80
input x: bf16[b: n, i: d]
param W: bf16[i, o: h]
param c: bf16[o]
out y = max(x @ W + c, 0) * 2
"""
    rng = np.random.default_rng(3)
    x, W, c = (low_values(rng, s, "bf16") for s in ((64, 96), (96, 80), (80,)))
    got = tgc.compile(src, options=Options(cpu=CpuOptions(bf16_gemm_min_flops=0, bf16_gemm_min_k=1)))(x=x, W=W, c=c)["y"]
    T = lambda a: torch.from_numpy(a.astype(np.float32)).bfloat16()  # noqa: E731
    want = (torch.relu(T(x) @ T(W) + T(c)) * 2).float().numpy()
    assert got.dtype == BF16
    g = got.astype(np.float64)
    # torch's bf16 matmul sums in f32 and rounds once, as tgc does; another summation
    # order moves a sum across a bf16 rounding boundary at most: one bf16 ulp, rarely
    close = np.isclose(g, want, rtol=2 ** -7, atol=1e-6)
    assert close.all() and np.mean(g == want) > 0.9


# ---- GEMMs on bf16 operands ---------------------------------------------------------------

def gemm_program(a_order="i, k", b_order="k, j", sizes=(37, 70, 51), batch=None):
    m, n, k = sizes
    dims = f"dim m = {m}, n = {n}, kk = {k}" + (f", nb = {batch}" if batch else "")
    edges = {"i": "i: m", "j": "j: n", "k": "k: kk", "b": "b: nb"}
    def decl(order):
        return ", ".join(edges[e.strip()] if e.strip() not in seen and not seen.add(e.strip()) else e.strip()
                         for e in order.split(","))
    seen: set = set()
    a, b = decl(a_order), decl(b_order)
    return f"{dims}\ninput a: bf16[{a}]\ninput w: bf16[{b}]\nout c = f32(a) @ f32(w)\n"


def gemm_inputs(src, rng):
    p = tgc.compile(src, options=Options(cpu=CpuOptions(bf16_gemm="off")))
    return {s.name: low_values(rng, tuple(int(x) for x in s.shape), "bf16") for s in p.inputs}


def f64_product(src, inputs):
    ref = evaluate(optimized(src, Options()), {k: v for k, v in inputs.items()}, dtype="f64")
    return np.asarray(ref["c"], np.float64)


@pytest.mark.parametrize("orders,sizes", [
    (("i, k", "k, j"), (37, 70, 51)),     # K odd, N past one block of 64, M not a multiple of 4
    (("k, i", "j, k"), (16, 130, 600)),    # transposed operands, K over one block of 256
    (("i, k", "k, j"), (300, 200, 256)),   # large enough to be cut into tiles on threads
    (("i, k", "k, j"), (5, 3, 1)),         # K = 1
    (("i, k", "j, k"), (37, 50, 257)),     # B's K contiguous (pairs gathered), K odd past a block
    (("k, i", "k, j"), (300, 70, 45)),     # A's M contiguous: more rows than a packed panel
    (("k, i", "j, k"), (520, 33, 301)),    # both transposed (a weight gradient's x^T dy), 3 panels
])
def test_gemm_conversion_path_and_bf16_path_agree_with_f64(orders, sizes):
    src = gemm_program(*orders, sizes=sizes)
    rng = np.random.default_rng(sum(sizes))
    inputs = gemm_inputs(src, rng)
    want = f64_product(src, inputs)
    scale = np.abs(inputs["a"].astype(np.float64)).max() * np.abs(inputs["w"].astype(np.float64)).max() * sizes[2]
    off = tgc.compile(src, options=Options(cpu=CpuOptions(bf16_gemm="off", blas_min_flops=1)))
    assert not any(isinstance(k, GemmKernel) and off.lowered.buffers[k.a.buf].dtype == "bf16"
                   for k in off.lowered.kernels)
    assert any("widened for BLAS" in getattr(k, "note", "") for k in off.lowered.kernels
               for k in getattr(k, "members", (k,)))
    got_off = off(**inputs)["c"]
    np.testing.assert_allclose(got_off, want, rtol=1e-5, atol=1e-6 * scale)
    if not HAS_BF16:
        pytest.skip("this CPU has no avx512bf16: the vdpbf16ps path is checked by its assembly only")
    on = tgc.compile(src, options=Options(cpu=CpuOptions(bf16_gemm="auto", blas_min_flops=1, bf16_gemm_min_flops=0, bf16_gemm_min_k=1)))
    assert any(isinstance(k, GemmKernel) and on.lowered.buffers[k.a.buf].dtype == "bf16"
               for k in on.lowered.kernels)
    assert "llvm.x86.avx512bf16.dpbf16ps.512" in on.llvm_ir
    got = on(**inputs)["c"]
    # vdpbf16ps: exact products, f32 sums in pairs (another order than sgemm's)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * scale)


def test_bf16_gemm_in_a_batched_product_and_after_elementwise_bf16():
    src = """
dim nb = 3, m = 20, n = 33, kk = 45
input x: bf16[b: nb, i: m, k: kk]
input w: bf16[k, j: n]
h = x * 2 - x
out c = f32(h) @ f32(w)
"""
    rng = np.random.default_rng(7)
    inputs = {"x": low_values(rng, (3, 20, 45), "bf16"), "w": low_values(rng, (45, 33), "bf16")}
    want = np.einsum("bik,kj->bij", (2.0 * inputs["x"].astype(np.float64)) - inputs["x"].astype(np.float64),
                     inputs["w"].astype(np.float64))
    for mode in ("off", "auto"):
        p = tgc.compile(src, options=Options(cpu=CpuOptions(bf16_gemm=mode, bf16_gemm_min_flops=0, bf16_gemm_min_k=1)))
        np.testing.assert_allclose(p(**inputs)["c"], want, rtol=1e-5, atol=1e-4)


def test_bf16_gemm_code_for_sapphire_rapids_has_vdpbf16ps():
    """Compiled for `sapphirerapids` (a target with AVX-512 BF16) whatever this host
    is; the code is not run here unless the host has the feature (see above)."""
    import llvmlite.binding as llvm

    from tgc.backends.cpu import codegen

    src = gemm_program(sizes=(64, 64, 64))
    opts = Options(cpu=CpuOptions(bf16_gemm="on", bf16_gemm_min_flops=0, bf16_gemm_min_k=1))
    low = lower_module(optimized(src, opts), opts)
    assert any(isinstance(k, GemmKernel) and low.buffers[k.a.buf].dtype == "bf16" for k in low.kernels)
    text = codegen.generate(low, opts)
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    mod = llvm.parse_assembly(text)
    mod.verify()
    target = llvm.Target.from_triple(llvm.get_process_triple())
    tm = target.create_target_machine(cpu="sapphirerapids", features="", opt=2)
    asm = tm.emit_assembly(mod)
    assert "vdpbf16ps" in asm
    # and without bf16 GEMMs, none
    off = Options(cpu=CpuOptions(bf16_gemm="off"))
    low_off = lower_module(optimized(src, off), off)
    asm_off = tm.emit_assembly(llvm.parse_assembly(codegen.generate(low_off, off)))
    assert "vdpbf16ps" not in asm_off


def test_autocast_products_use_bf16_operands_and_match_the_conversion_path():
    src = "dim m = 64, k = 96, n = 48\ninput a[m, k]\ninput b[k, n]\nout c[m, n] = a @ b"
    rng = np.random.default_rng(9)
    a, b = rng.standard_normal((64, 96)).astype(np.float32), rng.standard_normal((96, 48)).astype(np.float32)
    want = round_to(a, "bf16").astype(np.float64) @ round_to(b, "bf16").astype(np.float64)
    for mode in ("off", "auto"):
        p = tgc.compile(src, options=Options(autocast="bf16", cpu=CpuOptions(bf16_gemm=mode, bf16_gemm_min_flops=0, bf16_gemm_min_k=1)))
        np.testing.assert_allclose(p(a=a, b=b)["c"], want, rtol=1e-5, atol=1e-4)
        bf16_gemm = any(isinstance(k, GemmKernel) and bf16_product(p.lowered, k) for k in p.lowered.kernels)
        assert bf16_gemm == (mode == "auto" and HAS_BF16)


def test_header_says_bf16_arguments_are_16_bit(tmp_path):
    from tgc.cli import main as cli

    f = tmp_path / "p.tg"
    f.write_text("dim n = 8\ninput x: bf16[i: n]\ninput h: f16[i]\nout y = x * x\nout s = sum[i](f32(x))\n")
    r = CliRunner().invoke(cli, ["build", str(f), "--emit", "h", "-o", str(tmp_path / "p.h")])
    assert r.exit_code == 0, r.output
    text = (tmp_path / "p.h").read_text()
    line = lambda name: next(x for x in text.splitlines() if f"_{name} " in x)  # noqa: E731
    assert "uint16_t" in line("ARG_X") and "bfloat16" in line("ARG_X")
    assert "uint16_t" in line("ARG_H") and "half" in line("ARG_H")
    assert "uint16_t" in line("OUT_Y") and "float" in line("OUT_S")


def test_lowered_text_keeps_two_byte_buffers():
    from tgc.lower.lowered import print_lowered
    from tgc.lower.text import parse_lowered

    opts = Options()
    low = lower_module(optimized(CHAIN, opts), opts)
    text = print_lowered(low)
    assert "buffer %x : bf16[i, j] arg 0" in text and "buffer %h : f16[i, j] arg 2" in text
    back = parse_lowered(text)
    assert {n: b.dtype for n, b in back.buffers.items()} == {n: b.dtype for n, b in low.buffers.items()}
    rng = np.random.default_rng(4)
    inputs = {"x": low_values(rng, (64, 48), "bf16"), "s": low_values(rng, 48, "bf16"),
              "h": low_values(rng, (64, 48), "f16")}
    a, b = run_lowered(low, inputs), run_lowered(back, inputs)
    assert all(same_bits(a[k], b[k]) for k in a)


def test_small_bf16_products_run_sgemm_on_their_f32_values():
    """Under `bf16_gemm_min_flops` (default 2^24) a product runs sgemm: its operands,
    rounded temporaries that only GEMMs read, go back to f32 storage, no copy."""
    src = "dim m = 64, k = 96, n = 48\ninput a[m, k]\ninput b[k, n]\nout c[m, n] = a @ b"
    p = tgc.compile(src, options=Options(autocast="bf16"))
    gemms = [k for k in p.lowered.kernels if isinstance(k, GemmKernel)]
    assert gemms and all(p.lowered.buffers[v.buf].dtype == "f32" for k in gemms for v in (k.a, k.b))
    assert not any(bf16_product(p.lowered, k) for k in gemms)
    assert not any("widened" in getattr(k, "note", "") for k in p.lowered.kernels)
    big = "dim m = 512, k = 256, n = 256\ninput a[m, k]\ninput b[k, n]\nout c[m, n] = a @ b"
    q = tgc.compile(big, options=Options(autocast="bf16"))
    kinds = {bf16_product(q.lowered, k) for k in q.lowered.kernels if isinstance(k, GemmKernel)}
    assert kinds == {HAS_BF16}


# ---- bf16 GEMMs that round their f32 operands as they pack them ---------------------------

AUTOCAST_MLP = """
dim batch = 96, features = 160, hidden = 130, classes = 8
input x[batch, features]
input y[batch, classes]
param W1[features, hidden]
param W2[hidden, classes]
input lr
loss = mean[batch](cross_entropy[classes](tanh(x @ W1) @ W2, y))
out loss
update W1 = W1 - lr * grad(loss, W1)
update W2 = W2 - lr * grad(loss, W2)
"""


def autocast_mlp_inputs(rng):
    return {"x": rng.standard_normal((96, 160)).astype(np.float32),
            "y": np.eye(8, dtype=np.float32)[rng.integers(0, 8, 96)],
            "W1": (rng.standard_normal((160, 130)) * 0.1).astype(np.float32),
            "W2": (rng.standard_normal((130, 8)) * 0.1).astype(np.float32), "lr": np.float32(0.1)}


def rounding_opts(rounds: bool, mode: str = "auto") -> Options:
    return Options(autocast="bf16", cpu=CpuOptions(bf16_gemm=mode, bf16_gemm_min_flops=0, bf16_gemm_min_k=1, blas_min_flops=1,
                                                   bf16_gemm_rounds=rounds))


def test_autocast_gemms_read_the_f32_weights_and_inputs_rounding_as_they_pack():
    """`--autocast bf16`: the weights' and the input's roundings are no loops of their own
    (the bf16 GEMMs read the f32 buffers, `round_bf16(%W1[...])` in the lowered text);
    the step has the bits of the lowering that stores the rounded copies."""
    m = optimized(AUTOCAST_MLP, rounding_opts(True, "on"))
    low = lower_module(m, rounding_opts(True, "on"))
    old = lower_module(m, rounding_opts(False, "on"))
    rounded = {v.buf for k in low.kernels if isinstance(k, GemmKernel)
               for v, r in zip((k.a, k.b), k.rounded) if r}
    assert {"x", "W1", "W2"} <= rounded
    whole = [k for k in low.kernels if isinstance(k, LoopKernel) and "round_bf16(%W1" in k.text()]
    assert not whole and any("round_bf16(%W1" in k.text() for k in old.kernels)
    assert len(low.kernels) < len(old.kernels)
    assert "= round_bf16(%W1[" in print_lowered(low) or "@ round_bf16(%W1[" in print_lowered(low)
    verify_lowered(low)
    # the lowered interpreter: the same bits as the rounded copies (bf16 values, f64 sums)
    inputs = autocast_mlp_inputs(np.random.default_rng(3))
    a = run_lowered(low, {k: np.copy(v) for k, v in inputs.items()})
    b = run_lowered(old, {k: np.copy(v) for k, v in inputs.items()})
    assert all(same_bits(a[k], b[k]) for k in b)
    # and its text reads back
    from tgc.lower.text import parse_lowered

    back = parse_lowered(print_lowered(low))
    assert [k.rounded for k in back.kernels if isinstance(k, GemmKernel)] == \
        [k.rounded for k in low.kernels if isinstance(k, GemmKernel)]
    c = run_lowered(back, {k: np.copy(v) for k, v in inputs.items()})
    assert all(same_bits(a[k], c[k]) for k in a)
    if not HAS_BF16:
        pytest.skip("this CPU has no avx512bf16: the rounding packs are checked on the lowered program only")
    got = tgc.compile(AUTOCAST_MLP, options=rounding_opts(True))(**{k: np.copy(v) for k, v in inputs.items()})
    want = tgc.compile(AUTOCAST_MLP, options=rounding_opts(False))(**{k: np.copy(v) for k, v in inputs.items()})
    for k in want:   # the same bf16 values in the same vdpbf16ps sums: the same bits
        assert same_bits(got[k], want[k]), k


@pytest.mark.parametrize("orders", [("i, k", "k, j"), ("k, i", "j, k"), ("i, k", "j, k"), ("k, i", "k, j")])
def test_bf16_gemm_rounding_f32_operands_gives_the_bits_of_rounded_copies(orders):
    """Every packing path (rows or K of A contiguous; N or K of B contiguous; K odd; edge
    rows and columns) on f32 operands with NaN, inf, ties and values that round up into
    the exponent: the product of the rounded-as-packed operands has the bits of the
    product of rounded copies."""
    sizes = (37, 70, 263)
    src = gemm_program(*orders, sizes=sizes).replace("bf16", "f32").replace("f32(a) @ f32(w)", "a @ w")
    rng = np.random.default_rng(11)
    p0 = tgc.compile(src)
    inputs = {}
    for s_ in p0.inputs:
        x = (rng.standard_normal(tuple(int(v) for v in s_.shape)) * 4).astype(np.float32)
        flat = x.reshape(-1)
        flat[:7] = [1 + 2 ** -8, 1 + 3 * 2 ** -8, 3.4028235e38, -(1 + 2 ** -9 + 2 ** -20), 2 ** -130, -0.0, np.nan]
        inputs[s_.name] = x
    m = optimized(src, rounding_opts(True, "on"))
    low, old = lower_module(m, rounding_opts(True, "on")), lower_module(m, rounding_opts(False, "on"))
    assert any(isinstance(k, GemmKernel) and all(k.rounded) for k in low.kernels)
    if not HAS_BF16:
        pytest.skip("this CPU has no avx512bf16")
    got = tgc.compile(src, options=rounding_opts(True))(**inputs)["c"]
    want = tgc.compile(src, options=rounding_opts(False))(**inputs)["c"]
    assert same_bits(got, want)
    # and the values: f64 sums of the bf16-rounded operands, where those are finite
    ref = np.asarray(f64_product(src.replace("input a: f32", "input a: bf16").replace("input w: f32", "input w: bf16")
                                 .replace("a @ w", "f32(a) @ f32(w)"),
                                 {k: round_to(v, "bf16") for k, v in inputs.items()}))
    fin = np.isfinite(ref)
    assert fin.sum() > 0.5 * ref.size and np.isnan(got[~fin]).sum() + np.isinf(got[~fin]).sum() == (~fin).sum()
    np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-4, atol=1e-3)


def test_verifier_refuses_rounding_a_bf16_operand():
    from dataclasses import replace

    src = gemm_program(sizes=(64, 64, 64))
    opts = Options(cpu=CpuOptions(bf16_gemm="on", bf16_gemm_min_flops=0, bf16_gemm_min_k=1))
    low = lower_module(optimized(src, opts), opts)
    i = next(i for i, k in enumerate(low.kernels) if isinstance(k, GemmKernel))
    low.kernels[i] = replace(low.kernels[i], rounded=(True, False))
    with pytest.raises(VerifyError, match="round_bf16"):
        verify_lowered(low)


def test_bf16_gemms_only_for_products_summed_over_enough_elements():
    """`bf16_gemm_min_k` (64): a product summed over fewer elements runs sgemm, however
    many FLOPs it has (GPT's K = 48 products were slower as bf16 GEMMs)."""
    def kinds(k):
        src = f"dim m = 704, k = {k}, n = 192\ninput a[m, k]\ninput b[k, n]\nout c[m, n] = a @ b"
        opts = Options(autocast="bf16", cpu=CpuOptions(bf16_gemm="on"))
        low = lower_module(optimized(src, opts), opts)
        return {bf16_product(low, g) for g in low.kernels if isinstance(g, GemmKernel)}
    assert kinds(48) == {False} and kinds(192) == {True}


def test_transposed_bf16_operand_is_gathered_by_pairs_in_the_assembly():
    """B with K contiguous (`w[j, k]`): its (k, k+1) pairs are 32-bit words gathered 16
    columns at a time (`vpgatherqd`: 64-bit addresses, 8 lanes per instruction), in code
    compiled for Sapphire Rapids."""
    import llvmlite.binding as llvm

    from tgc.backends.cpu import codegen

    src = gemm_program("i, k", "j, k", sizes=(64, 64, 64))
    opts = Options(cpu=CpuOptions(bf16_gemm="on", bf16_gemm_min_flops=0, bf16_gemm_min_k=1))
    low = lower_module(optimized(src, opts), opts)
    assert any(isinstance(k, GemmKernel) and bf16_product(low, k) for k in low.kernels)
    text = codegen.generate(low, opts)
    assert "llvm.masked.gather.v16i32" in text
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    tm = llvm.Target.from_triple(llvm.get_process_triple()).create_target_machine(cpu="sapphirerapids", opt=2)
    asm = tm.emit_assembly(llvm.parse_assembly(text))
    assert "vpgatherqd" in asm and "vdpbf16ps" in asm


@pytest.mark.parametrize("bf16_gemm", ["off", "auto"])
def test_autocast_gpt_step_matches_the_interpreter(bf16_gemm):
    """examples/gpt.tg under --autocast bf16 (a whole SGD step) on the CPU
    against the interpreter on the same lowered program. On the H200 machine's CPU
    (AVX-512) this step once gave a NaN loss with `bf16_gemm="off"`: the check for
    any machine the suite runs on."""
    from pathlib import Path

    from tgc import pipeline
    from tgc.ir.inputs import random_inputs
    from tgc.options import Options

    path = Path(__file__).parent.parent.parent / "examples/gpt.tg"
    options = Options(autocast="bf16", cpu=CpuOptions(bf16_gemm=bf16_gemm))
    module = pipeline.lower(pipeline.load(str(path), options), options).module
    dims = {d: 16 for d in module.symbolic_dims()}
    inputs = random_inputs(module, module.bind_dims(dims), 0, "f32")
    want = evaluate(module, {k: v.copy() for k, v in inputs.items()}, dtype="f32", dims=dims)
    got = tgc.compile(path, options=options).run({k: v.copy() for k, v in inputs.items()}, dims)
    for k, ref in want.items():
        assert np.all(np.isfinite(got[k])), k
        scale = max(1.0, float(np.max(np.abs(ref))))
        np.testing.assert_allclose(got[k], ref, rtol=2.0 ** -6, atol=2.0 ** -6 * scale, err_msg=k)


@pytest.mark.skipif(not HAS_BF16, reason="this CPU has no avx512bf16: the vdpbf16ps kernel cannot run")
def test_bf16_gemm_sums_each_k_block_from_zero():
    """Each K block's part of an element is summed from zero and then added to C: one
    chain over all of K (the block's accumulators started from C) was 5.6e-6 off
    norm-wise on 8 x 65536 x 16 (PyTorch f32 2.8e-7 on the same values)."""
    m, k, n = 8, 65536, 16
    src = f"""
dim m = {m}, k = {k}, n = {n}
input a: bf16[m, k]
input b: bf16[k, n]
out c[m, n] = f32(a) @ f32(b)
"""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((m, k)).astype(np.float32).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((k, n)).astype(np.float32).astype(ml_dtypes.bfloat16)
    prog = tgc.compile(src, options=Options(cpu=CpuOptions(bf16_gemm="auto")))
    assert "llvm.x86.avx512bf16.dpbf16ps.512" in prog.llvm_ir
    want = a.astype(np.float64) @ b.astype(np.float64)
    got = prog(a=a, b=b)["c"]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-6
