"""Two-dimensional convolutions written with reindex (issue 16, item 7).

Small ones (a digits model's) compile to little code, large ones run as GEMMs with
no transposing copies, and a program whose sizes are fixed in the file takes the
same plan as the symbolic one. Compile and run times are measured by
`benchmarks/conv2d_probe.py`, not asserted here (timed assertions are flaky on a
shared machine); what is asserted is the shape of the plan, the size of the
generated code, and the values against the interpreter and PyTorch.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.frontend import compile_source
from tgc.ir.interp import evaluate
from tgc.ir.inputs import random_inputs
from tgc.backends.cpu.group import LoopGroup
from tgc.backends.cpu.implicit import ImplicitGemm
from tgc.lower.lowered import GemmKernel, Load, LoopKernel, Mask, walk
from tgc.options import Options
from tgc.pipeline import lower_module
from tgc.backends.cpu.loops import unrolled
from tgc.backends.cpu.options import CpuOptions

CPU = CpuOptions()   # the defaults the program is lowered and generated with

ROOT = Path(__file__).resolve().parent.parent.parent
TINY = ROOT / "tests" / "programs" / "good" / "039_conv2d_pool.tg"
BENCH = ROOT / "benchmarks" / "workloads" / "conv2d.tg"
CONV1D = ROOT / "benchmarks" / "workloads" / "conv1d.tg"
BENCH_SYM = ROOT / "benchmarks" / "workloads" / "conv2d_sym.tg"
SYM_SIZES = {"nb": 16, "cin": 32, "cout": 64, "hh": 32, "ww": 32}

# Two convolutions and two pools, as a digits model with a second layer has them.
# The second convolution reads the pooled activations (not an input), and its input
# gradient reads the first pool's gradient: before, fuse gave BLAS the product of its
# two window indicators as a dense 0/1 operand over six edges (kh, kw, q2h, q2w, qh,
# qw), and the program was 80,000 lines of LLVM IR (8 s to compile).
TWO_LAYERS = """
dim batch
dim cin = 1, c1 = 8, c2 = 16, h = 8, w = 8, kh = 3, kw = 3
dim ho = h, wo = w
dim ph = 2, pw = 2, qh = h / 2, qw = w / 2
dim q2h = qh, q2w = qw, rh = qh / 2, rw = qw / 2
dim classes = 10
input  x[batch, cin, h, w]
input  y[batch, classes]
param  K1[c1, cin, kh, kw], b1[c1]
param  K2[c2, c1, kh, kw], b2[c2]
param  W[c2, rh, rw, classes], b[classes]
input  lr
a1 = relu(x[h = ho + kh - 1, w = wo + kw - 1] @ K1 + b1)
z1 = max[ph, pw](a1[ho = 2*qh + ph, wo = 2*qw + pw])
a2 = relu(z1[qh = q2h + kh - 1, qw = q2w + kw - 1] @ K2 + b2)
z2 = max[ph, pw](a2[q2h = 2*rh + ph, q2w = 2*rw + pw])
loss = mean[batch](cross_entropy[classes](z2 @ W + b, y))
out loss
update K1 = K1 - lr * grad(loss, K1)
update b1 = b1 - lr * grad(loss, b1)
update K2 = K2 - lr * grad(loss, K2)
update b2 = b2 - lr * grad(loss, b2)
update W = W - lr * grad(loss, W)
update b = b - lr * grad(loss, b)
"""


# Stride 2: output pixel (ho, wo) reads (2 ho + kh - 1, 2 wo + kw - 1).
STRIDED = """
dim batch
dim cin = 8, cout = 16, h = 16, w = 16, kh = 3, kw = 3
dim ho = 8, wo = 8
input  x[batch, cin, h, w]
input  dy[batch, cout, ho, wo]
param  K[cout, cin, kh, kw]
y = x[h = 2*ho + kh - 1, w = 2*wo + kw - 1] @ K
loss = sum(y * dy)
out y[batch, cout, ho, wo]
out dx = grad(loss, x)
out dK = grad(loss, K)
"""


def _source(which) -> str:
    return which.read_text() if isinstance(which, Path) else which


def _fixed(text: str, batch: int) -> str:
    """The program with its batch fixed in the file (`dim batch = N`)."""
    fixed, n = re.subn(r"^dim batch$", f"dim batch = {batch}", text, flags=re.M)
    assert n == 1
    return fixed


def _lowered(text: str, dtype: str = "f32"):
    options = Options(dtype=dtype)
    module = pipeline.lower(compile_source(text, "<test>", options), options).module
    return lower_module(module, options)


def _gemms(low) -> list[GemmKernel]:
    """The products: GEMM kernels, and those of implicit GEMMs (their window packed from x)."""
    return [k.gemm if isinstance(k, ImplicitGemm) else k for k in low.kernels
            if isinstance(k, (GemmKernel, ImplicitGemm))]


def _members(low):
    for k in low.kernels:
        if isinstance(k, LoopGroup):
            yield from k.members
        elif isinstance(k, LoopKernel):
            yield k


def _dense_indicators(low) -> list[str]:
    """Loop kernels that write a relation as numbers: masked, and loading nothing."""
    out = []
    for k in _members(low):
        nodes = list(walk(k.body)) + (list(walk(k.epilogue)) if k.epilogue is not None else [])
        if any(isinstance(n, Mask) for n in nodes) and not any(isinstance(n, Load) for n in nodes):
            out.append(k.text())
    return out


def _function_lines(llvm_ir: str) -> dict[str, int]:
    lines, name = {}, None
    for line in llvm_ir.splitlines():
        m = re.match(r'define .*@"?([^"( ]+)"?\(', line)
        if m:
            name = m.group(1)
            lines[name] = 0
        elif line.startswith("}"):
            name = None
        elif name is not None:
            lines[name] += 1
    return lines


@pytest.mark.parametrize("which", [TINY, TWO_LAYERS, BENCH], ids=["tiny", "two_layers", "bench"])
def test_no_indicator_is_materialized(which):
    low = _lowered(_source(which))
    assert not _dense_indicators(low)
    for k in low.kernels:   # no GEMM operand is written by a kernel that loads nothing
        if isinstance(k, GemmKernel):
            for view in (k.a, k.b):
                writers = [m for m in _members(low) if m.out == view.buf]
                assert all(any(isinstance(n, Load) for n in walk(m.body)) for m in writers), k.text()


@pytest.mark.parametrize("which, max_lines, max_kernels",
                         [(TINY, 8_000, 12), (TWO_LAYERS, 20_000, 32)], ids=["tiny", "two_layers"])
@pytest.mark.slow
def test_small_convolutions_are_little_code(which, max_lines, max_kernels):
    """Bounds with room on the program's own functions (the tiny program's are ~3,700
    lines, the two layers' ~10,200; before, 80,000 with one kernel of 19,000): what they
    catch is a blow-up, such as nested short loops unrolled into each other or a dense
    relation. The GEMM library's functions (`tgc.gemm.*`) are the same whatever the
    program, one per register block the program's tiles use (the own kernel's FMA loop
    runs `own_gemm_unroll` K steps an iteration, in two loops where C is prefetched late:
    ~4,000 lines at 4); they are bounded each and in all."""
    prog = tgc.compile(_source(which))
    lines = _function_lines(prog.llvm_ir)
    top = sorted(lines.items(), key=lambda kv: -kv[1])[:5]
    library = {f: n for f, n in lines.items() if f.startswith("tgc.gemm.")}
    assert sum(lines.values()) - sum(library.values()) <= max_lines, top
    assert max(n for f, n in lines.items() if f not in library) <= 2_500, top
    assert max(library.values(), default=0) <= 5_000 and sum(library.values()) <= 15_000, library
    assert len(prog.lowered.kernels) <= max_kernels


def _unrolled_copies(k: LoopKernel) -> int:
    copies = 1
    for v in k.loops:
        if unrolled(k, v, CPU):
            copies *= k.sizes[v]
    return copies


def test_nested_short_loops_unroll_within_the_budget():
    """A 2x2 max-pool's gradient over 4 x 4 pooled positions (loops 4, 2, 4, 2 around
    the channels): the innermost short loops unroll, the copies stay within budget."""
    low = _lowered(TINY.read_text())
    pools = [k for k in _members(low) if {"ph", "pw", "qh", "qw"} <= set(k.loops)]
    assert pools
    for k in pools:
        assert 1 < _unrolled_copies(k) <= CPU.unroll_copies, k.text()
    for k in _members(low):
        assert _unrolled_copies(k) <= CPU.unroll_copies, k.text()


def _conv_inputs(path: Path, batch: int, dtype, seed: int = 0) -> dict:
    m = compile_source(path.read_text(), str(path), Options())
    return random_inputs(m, m.bind_dims({d: batch for d in m.symbolic_dims()}), seed, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("blas", ["numpy", "none"])
@pytest.mark.parametrize("which", [TINY, BENCH], ids=["tiny", "bench"])
def test_convolution_matches_the_interpreter(which, blas):
    """f64: the CPU program (shifted GEMMs, im2col, col2im loops) against the
    interpreter's reading of the indicators, to rounding; with BLAS and with tgc's
    own GEMM loops (`tgc build`'s default)."""
    text = which.read_text()
    m = compile_source(text, str(which), Options(dtype="f64"))
    inputs = _conv_inputs(which, 3, "f64")
    want = evaluate(pipeline.lower(m, Options(dtype="f64")).module, {k: v.copy() for k, v in inputs.items()},
                    dtype="f64", dims={"batch": 3})
    for source in (text, _fixed(text, 3)):
        prog = tgc.compile(source, dtype="f64", options=Options().with_(blas=blas))
        got = prog.run({k: v.copy() for k, v in inputs.items()}, None if source != text else {"batch": 3})
        for name, ref in want.items():
            scale = max(1.0, float(np.max(np.abs(ref))))
            np.testing.assert_allclose(got[name], ref, rtol=1e-10, atol=1e-10 * scale, err_msg=name)


def test_small_convolution_and_pool_match_torch():
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle of this test")
    F = torch.nn.functional
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 1, 8, 8))
    K, bias = rng.standard_normal((4, 1, 3, 3)), rng.standard_normal(4)
    dz = rng.standard_normal((5, 4, 4, 4))
    tx, tK = torch.tensor(x, requires_grad=True), torch.tensor(K, requires_grad=True)
    z = F.relu(F.max_pool2d(F.conv2d(tx, tK, torch.tensor(bias), padding=1), 2))
    dx, dK = torch.autograd.grad(z, (tx, tK), torch.tensor(dz))
    got = tgc.compile(str(TINY), dtype="f64")(x=x, K=K, bias=bias, dz=dz)
    for name, ref in (("z", z), ("dx", dx), ("dK", dK)):
        np.testing.assert_allclose(got[name], ref.detach().numpy(), rtol=1e-10, atol=1e-10, err_msg=name)


def test_benchmark_convolution_matches_torch():
    x, dy, K, ref = _torch_convolution(2, (3, 32, 32, 32), 64)
    text = BENCH.read_text()
    for source in (text, _fixed(text, 3)):
        got = tgc.compile(source, dtype="f32")(x=x.astype(np.float32), dy=dy.astype(np.float32),
                                               K=K.astype(np.float32))
        for name in ("y", "dx", "dK"):
            err = np.linalg.norm(got[name] - ref[name]) / np.linalg.norm(ref[name])
            assert err < 1e-5, (name, err)


def test_benchmark_convolution_runs_as_gemms_without_copies():
    """y: the windows (im2col, or packed from x by implicit GEMMs where the own
    kernel runs) and one GEMM per image; dx: one GEMM per image and
    kernel row on dy shifted by rows, whole rows per call (the clipped edge h is the
    outer edge of the group (h, w)), then a sum over the kernel columns; dK: the
    windows again, one call per image adding into dK. Neither dy nor the windows are
    copied into a transposed temporary."""
    low = _lowered(BENCH.read_text())
    gemms = _gemms(low)
    assert len(gemms) == 3
    shifted = [g for g in gemms if g.shifts]
    assert len(shifted) == 1
    (role, edge, _), = shifted[0].shifts
    group = next(g for g in (shifted[0].m, shifted[0].n) if edge in g)
    assert len(group) == 2 and set(shifted[0].taps) == {"kh"}
    assert any(g.taps == ("batch",) and not g.shifts for g in gemms)   # dK
    copies = [k for k in _members(low) if "transposing copy" in k.note]
    assert all("batch" not in low.buffers[k.out].edges for k in copies), [k.text() for k in copies]


@pytest.mark.parametrize("specialized", [False, True], ids=["generic", "specialized"])
def test_symbolic_sizes_shift_the_input_gradient_by_rows(specialized):
    """conv2d_sym.tg (every size symbolic, other edge names than conv2d.tg) makes dx as
    conv2d.tg does: dy shifted by whole image rows, the row taps (kh) summed in the
    product, its columns whole rows (hh, wo). Before, the tie between folding kh or kw
    into the product went by the operands' digests, and these names took the column
    taps: a batch of nb x hh products of 32 columns each (13.3 against 8.2 Mcycles on
    one thread)."""
    options = Options()
    module = pipeline.lower(pipeline.load(str(BENCH_SYM), options), options).module
    if specialized:
        module = pipeline.specialized_module(module, SYM_SIZES, options)
    shifted = [g for g in _gemms(lower_module(module, options)) if g.shifts]
    assert len(shifted) == 1
    (_, edge, _), = shifted[0].shifts
    assert set(shifted[0].taps) == {"kh"} and edge == "hh", shifted[0].text()
    assert ("hh", "wo") == tuple(shifted[0].n[:2]), shifted[0].text()


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_symbolic_benchmark_convolution_matches_torch_and_the_interpreter(dtype):
    """conv2d_sym.tg, generic and specialized to its call's sizes, against PyTorch
    (y, dx, dK) and, in f64, the interpreter."""
    x, dy, K, ref = _torch_convolution(3, (2, 8, 12, 10), 16)
    np_dtype = np.float32 if dtype == "f32" else np.float64
    args = {"x": x.astype(np_dtype), "dy": dy.astype(np_dtype), "K": K.astype(np_dtype)}
    options = Options(dtype=dtype)
    module = pipeline.lower(pipeline.load(str(BENCH_SYM), options), options).module
    sizes = {"nb": 2, "cin": 8, "cout": 16, "hh": 12, "ww": 10}
    if dtype == "f64":
        torch_ref, ref = ref, evaluate(module, {k: v.copy() for k, v in args.items()}, dtype="f64", dims=sizes)
        for name in ("y", "dx", "dK"):   # the interpreter against PyTorch first
            np.testing.assert_allclose(ref[name], torch_ref[name], rtol=1e-10, atol=1e-10)
    generic = pipeline.compile_module(module, options)
    special = pipeline.compile_module(pipeline.specialized_module(module, sizes, options), options)
    for prog in (generic, special):
        got = prog(**{k: v.copy() for k, v in args.items()})
        for name in ("y", "dx", "dK"):
            err = np.linalg.norm(got[name] - ref[name]) / np.linalg.norm(ref[name])
            assert err < (1e-6 if dtype == "f32" else 1e-13), (name, err)


def _torch_convolution(seed: int, x_shape: tuple, cout: int):
    """Random x[nb, cin, h, w], dy and a 3x3 kernel K (scaled by its fan-in), with
    PyTorch's y, dx and dK in f64 (padding 1). Skips without PyTorch."""
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle of this test")
    rng = np.random.default_rng(seed)
    nb, cin, h, w = x_shape
    x, dy = rng.standard_normal(x_shape), rng.standard_normal((nb, cout, h, w))
    K = rng.standard_normal((cout, cin, 3, 3)) / np.sqrt(cin * 9)
    tx, tK = torch.tensor(x, requires_grad=True), torch.tensor(K, requires_grad=True)
    y = torch.nn.functional.conv2d(tx, tK, padding=1)
    dx, dK = torch.autograd.grad(y, (tx, tK), torch.tensor(dy))
    return x, dy, K, {"y": y.detach().numpy(), "dx": dx.numpy(), "dK": dK.numpy()}


def _gemm_shapes(low) -> list[tuple]:
    return [(k.batch, k.m, k.n, k.k, k.taps, tuple((r, e, str(ix)) for r, e, ix in k.shifts))
            for k in _gemms(low)]


@pytest.mark.parametrize("path, batch", [(BENCH, 16), (CONV1D, 32)], ids=["conv2d", "conv1d"])
def test_fixed_sizes_take_the_symbolic_plan(path, batch):
    """A program with its batch (and, for conv1d, its length) fixed in the file makes
    the same GEMMs as the symbolic one. Before, the taps were chosen as the shortest
    edges only among fixed ones: conv1d fixed looped over 1,024 output positions of
    64 x 32 x 5 products, 1.7x slower."""
    text = path.read_text()
    fixed = text.replace("dim batch, len", f"dim batch = {batch}, len = 1024") if path == CONV1D \
        else _fixed(text, batch)
    assert fixed != text
    sym, fix = _lowered(text), _lowered(fixed)
    assert _gemm_shapes(sym) == _gemm_shapes(fix)
    assert len(sym.kernels) >= len(fix.kernels)


def test_strided_input_gradient_sums_over_the_taps():
    """dx of a stride-2 convolution adds, for each input pixel, the products of the
    kernel taps whose output position it is (ho = (h + 1 - kh) / 2 where that
    divides): 3 x 3 iterations per pixel. Before, it looped over all 8 x 8 output
    positions with a mask (a 32 x 32 image and 16 x 16 outputs took 1.3 s, PyTorch
    18 ms)."""
    low = _lowered(STRIDED)
    dx = [k for k in _members(low) if k.out == "dx"]
    assert len(dx) == 1 and set(dx[0].red) == {"kh", "kw"}, dx[0].text()
    assert "floor(" in dx[0].text()


def test_strided_convolution_matches_torch_and_the_interpreter():
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle of this test")
    F = torch.nn.functional
    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal((3, 8, 16, 16)), rng.standard_normal((3, 16, 8, 8))
    K = rng.standard_normal((16, 8, 3, 3))
    tx, tK = torch.tensor(x, requires_grad=True), torch.tensor(K, requires_grad=True)
    y = F.conv2d(tx, tK, stride=2, padding=1)
    dx, dK = torch.autograd.grad(y, (tx, tK), torch.tensor(dy))
    m = compile_source(STRIDED, "<test>", Options(dtype="f64"))
    want = evaluate(pipeline.lower(m, Options(dtype="f64")).module, {"x": x, "dy": dy, "K": K}, dtype="f64",
                    dims={"batch": 3})
    got = tgc.compile(STRIDED, dtype="f64")(x=x, dy=dy, K=K)
    for name, ref in (("y", y), ("dx", dx), ("dK", dK)):
        np.testing.assert_allclose(got[name], ref.detach().numpy(), rtol=1e-10, atol=1e-10, err_msg=name)
        np.testing.assert_allclose(want[name], ref.detach().numpy(), rtol=1e-10, atol=1e-10, err_msg=name)


def test_input_gradient_sum_reads_its_partial_contiguously():
    """dx sums the kernel columns of the input gradient's GEMM partial
    `t[b, c, h, kw, wo]` at `wo = w - kw + 1`. The partial is laid out with `wo`
    innermost (the edge that dx's innermost edge `w` walks), so the sum's innermost
    loop is contiguous in what it reads and what it writes; before, the partial had
    `(cin, kw)` innermost and the sum read it with a stride of 96."""
    low = _lowered(BENCH.read_text())
    dx, = [k for k in _members(low) if k.out == "dx"]
    inner = dx.loops[-1]
    assert inner == "w", dx.text()
    loads = [n for n in walk(dx.body) if isinstance(n, Load)]
    assert loads
    for load in loads:
        order = low.buffers[load.buf].order
        assert dict(load.index)[order[-1]].coef(inner) == 1, (load, order)


def test_kernel_gradient_is_computed_as_a_tall_product():
    """dK[cout, (cin, kh, kw)] in its output order is a 64 x 288 matrix summed over
    16 x 1024 terms; BLAS computes it as 288 x 64 (OpenBLAS runs that shape faster)
    into a temporary with `cout` innermost, and one copy writes dK."""
    low = _lowered(BENCH.read_text())
    gemm, = [k for k in _gemms(low) if k.taps == ("batch",)]
    assert gemm.out != "dK" and low.buffers[gemm.out].order[-1] == "cout"
    writers = [k for k in _members(low) if k.out == "dK"]
    assert len(writers) == 1 and "copy" in writers[0].note


WEIGHT_GRADIENT = """
dim n = {n}
dim i = 16, o = 256
input x[n, i]
input g[n, o]
out w = x @ g
"""


@pytest.mark.parametrize("n, tall", [(8192, True), (64, False)])
def test_wide_result_is_computed_tall_only_over_long_sums(n, tall):
    """`w[i, o] = sum_n x[n, i] g[n, o]` is 16 x 256 in its output order. Summed over
    8192 terms it is computed as 256 x 16 into a temporary and copied (the copy is
    nothing next to the product); over 64 terms (an MLP's weight gradient) BLAS writes
    w itself. The values are numpy's either way."""
    text = WEIGHT_GRADIENT.format(n=n)
    low = _lowered(text)
    gemm, = [k for k in low.kernels if isinstance(k, GemmKernel)]
    assert (gemm.out != "w") == tall
    if tall:
        assert low.buffers[gemm.out].order == ("o", "i")
    rng = np.random.default_rng(4)
    x, g = rng.standard_normal((n, 16)), rng.standard_normal((n, 256))
    got = tgc.compile(text, dtype="f64")(x=x, g=g)["w"]
    np.testing.assert_allclose(got, x.T @ g, rtol=1e-10, atol=1e-10 * n)


@pytest.mark.parametrize("threads", [1, 2])
def test_input_gradient_product_and_column_sum_run_paired(threads):
    """conv2d_sym specialized to a batch of 16 (at least `gemm_batch_tasks`: a task per
    image): dx's product and its column sum over the kernel's columns are a pair
    (`regions.pairs`), run image by image on each thread, so the sum reads each
    image's product from cache; no barrier between them, one before the next kernel
    whose memory (a slot the product's transposed kernel shares) the product read.
    The results have the bits of the two run one after the other, against PyTorch."""
    from tgc.backends.cpu import regions

    sizes = dict(SYM_SIZES, cin=16, cout=32, hh=16, ww=16)
    x, dy, K, ref = _torch_convolution(5, (16, 16, 16, 16), 32)
    args = {"x": x.astype(np.float32), "dy": dy.astype(np.float32), "K": K.astype(np.float32)}
    base = Options()
    module = pipeline.specialized_module(pipeline.lower(pipeline.load(str(BENCH_SYM), base), base).module,
                                         sizes, base)
    got = {}
    for pair in (True, False):
        options = base.with_(cpu=base.cpu.with_(threads=threads, pair_batch_loops=pair))
        prog = pipeline.compile_module(module, options)
        low = prog.lowered
        ks = low.kernels
        at = [i for i in range(1, len(ks)) if regions.pair_key(low, ks[i - 1], ks[i], options.cpu) is not None]
        if pair:
            assert len(at) == 1 and isinstance(ks[at[0] - 1], GemmKernel) and ks[at[0] - 1].shifts, \
                [k.text() for k in ks]
            assert ks[at[0]].out == "dx"
            for r in regions.plan_regions(low, options.cpu.with_(threads=2)):
                if r.start < at[0] < r.stop:
                    assert r.paired[at[0] - r.start] and not r.barrier[at[0] - r.start]
        else:
            assert not at
        got[pair] = {k: np.asarray(v).copy() for k, v in prog(**{k: v.copy() for k, v in args.items()}).items()}
    for name in ("y", "dx", "dK"):
        assert np.array_equal(got[True][name], got[False][name]), name
        err = np.linalg.norm(got[True][name] - ref[name]) / np.linalg.norm(ref[name])
        assert err < 1e-6, (name, err)
