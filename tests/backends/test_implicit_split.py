"""Split tap sums of implicit GEMMs (backends/cpu/implicit.py, "Split sums"): a 2-D
convolution's kernel gradient, summed over the images outside the product's calls,
sums its images in `gemm_tiles` parts (one task each, so each thread packs only its
images' dy) into partial rows that a loop kernel adds up after it. Asserted: the rule
(when the plan splits), the text form, and the values against PyTorch, the lowered
interpreter and the unsplit product, on 1 and 2 threads (the same bits on both).
Times are measured by benchmarks/conv2d_probe.py, not asserted here."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tgc import pipeline
from tgc.backends.cpu.implicit import PART_EDGE, ImplicitGemm
from tgc.lower.interp import run_lowered
from tgc.lower.lowered import Load, LoopKernel, print_lowered, walk
from tgc.lower.text import parse_lowered
from tgc.options import Options
from tgc.pipeline import lower_module

ROOT = Path(__file__).resolve().parent.parent.parent
BENCH_SYM = ROOT / "benchmarks" / "workloads" / "conv2d_sym.tg"
SYM_SIZES = {"nb": 16, "cin": 32, "cout": 64, "hh": 32, "ww": 32}     # the benchmark's call
SMALL = {"nb": 5, "cin": 16, "cout": 32, "hh": 32, "ww": 32}          # 5 images: parts of 3 and 2


def _module(sizes, options=Options()):
    module = pipeline.lower(pipeline.load(str(BENCH_SYM), options), options).module
    return module if sizes is None else pipeline.specialized_module(module, sizes, options)


def _with(**cpu) -> Options:
    o = Options()
    return o.with_(cpu=o.cpu.with_(**cpu))


def _split(low) -> list[ImplicitGemm]:
    return [k for k in low.kernels if isinstance(k, ImplicitGemm) and k.partial]


def _loops(low):
    for k in low.kernels:
        yield from getattr(k, "members", (k,))


def test_the_kernel_gradient_sums_its_images_in_parts():
    """At the benchmark's sizes dK's product (taps(nb), 64 x 288 x 1024 per image) is
    split in gemm_tiles = 2 parts into a partial buffer [#part, dK's edges]; a loop
    sums the parts over #part; y's product (batched, no taps) is not split. The text
    shows it and reads back to the same program."""
    low = lower_module(_module(SYM_SIZES), Options())
    split, = _split(low)
    assert split.gemm.taps == ("nb",) and split.parts == Options().cpu.gemm_tiles == 2
    part = low.buffers[split.partial]
    assert part.order[0] == split.part_edge and split.part_edge.startswith(PART_EDGE)
    assert low.size(split.part_edge) == 2 and split.gemm.out not in low.buffers
    text = print_lowered(low)
    assert f"parts 2 into %{split.partial}" in text, text
    sums = [k for k in _loops(low) if isinstance(k, LoopKernel) and k.red == (split.part_edge,)
            and any(isinstance(n, Load) and n.buf == split.partial for n in walk(k.body))]
    assert len(sums) == 1, text
    assert print_lowered(parse_lowered(text)) == text


@pytest.mark.parametrize("sizes, options", [
    (None, Options()),                                        # symbolic sizes: no known partial size
    (dict(SYM_SIZES, nb=3), Options()),                       # 3 images: a part of fewer than two
    (SYM_SIZES, _with(implicit_split_bytes=0)),               # off
    (SYM_SIZES, _with(implicit_split_bytes=100_000)),         # 2 x 73,728 bytes of partial rows: too many
    (SYM_SIZES, _with(gemm_tiles=1)),                         # one tile: nothing packed twice
    (SYM_SIZES, _with(blas_tile_mnk=1 << 25)),                # a product the tiles would leave whole
], ids=["symbolic", "few-taps", "off", "large-partials", "one-tile", "small"])
def test_no_split_where_the_rule_says_no(sizes, options):
    low = lower_module(_module(sizes, options), options)
    assert not _split(low), print_lowered(low)
    assert any(getattr(getattr(k, "gemm", k), "taps", ()) == ("nb",) for k in low.kernels)   # dK's product is there


def _inputs(sizes, seed=0):
    rng = np.random.default_rng(seed)
    nb, cin, cout, h, w = (sizes[k] for k in ("nb", "cin", "cout", "hh", "ww"))
    return {"x": rng.standard_normal((nb, cin, h, w)).astype(np.float32),
            "dy": rng.standard_normal((nb, cout, h, w)).astype(np.float32),
            "K": (rng.standard_normal((cout, cin, 3, 3)) / np.sqrt(cin * 9)).astype(np.float32)}


def test_split_sums_match_torch_the_interpreter_and_the_whole_sum():
    """5 images in parts of 3 and 2: dK against PyTorch (f64), the lowered interpreter
    of the split program and the unsplit program's; 1 and 2 threads give the same bits."""
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle of this test")
    args = _inputs(SMALL)
    tx = torch.tensor(args["x"], dtype=torch.float64, requires_grad=True)
    tK = torch.tensor(args["K"], dtype=torch.float64, requires_grad=True)
    y = torch.nn.functional.conv2d(tx, tK, padding=1)
    dx, dK = torch.autograd.grad(y, (tx, tK), torch.tensor(args["dy"], dtype=torch.float64))
    ref = {"y": y.detach().numpy(), "dx": dx.numpy(), "dK": dK.numpy()}
    module = _module(SMALL)
    got = {}
    for name, options in (("split", Options()), ("whole", _with(implicit_split_bytes=0))):
        low = lower_module(module, options)
        assert bool(_split(low)) == (name == "split")
        if name == "split":
            split, = _split(low)
            assert [split.part_range(i, 5) for i in range(2)] == [(0, 3), (3, 5)]
        interp = run_lowered(low, {k: v.copy() for k, v in args.items()})
        for threads in (1, 2):
            prog = pipeline.compile_module(module, options.with_(cpu=options.cpu.with_(threads=threads)))
            out = prog(**{k: v.copy() for k, v in args.items()})
            got[name, threads] = {k: np.asarray(out[k]).copy() for k in ref}
        for k in ref:
            assert np.array_equal(got[name, 1][k], got[name, 2][k]), (name, k)
            err = np.linalg.norm(got[name, 1][k] - ref[k]) / np.linalg.norm(ref[k])
            assert err < 1e-6, (name, k, err)
            np.testing.assert_allclose(got[name, 1][k], interp[k], rtol=3e-5, atol=3e-5 * np.abs(ref[k]).max(),
                                       err_msg=f"{name} {k}")
    np.testing.assert_allclose(got["split", 1]["dK"], got["whole", 1]["dK"], rtol=1e-5, atol=1e-5)
    for k in ("y", "dx"):   # only dK's product is split
        assert np.array_equal(got["split", 1][k], got["whole", 1][k]), k
