"""The cost of a lowered program (`tgc.lower.cost`): FLOPs per kernel as counted by
hand, and the lowering stages' rows of `tgc dump-ir --stats`."""
from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from tgc import pipeline
from tgc.cli import main
from tgc.frontend import compile_source
from tgc.lower.cost import lowered_stats
from tgc.manager import lower_module
from tgc.options import Options

ROOT = Path(__file__).resolve().parents[2]


def _lowered(src: str, opts: Options):
    """After the neutral stages (fuse, layout): no backend's cache blocking yet."""
    module = pipeline.lower(compile_source(src, "t.tg", opts), opts).module
    return lower_module(module, opts, stop_after="layout")


def test_flops_and_temporaries_counted_by_hand():
    # one fused loop: exp, one multiplication by 3, one addition per element; then a
    # GEMM (2 * 50 * 70 * 40) reading it, so it is a temporary of 50 x 70 f64 values
    low = _lowered("dim i = 50, j = 70, k = 40\ninput x[i, j], w[j, k]\nout y = (3 * exp(x) + x) @ w",
                   Options(dtype="f64"))
    assert [type(k).__name__ for k in low.kernels] == ["LoopKernel", "GemmKernel"]
    stats = lowered_stats(low, rep=64)
    assert stats.ops == 2
    assert stats.flops == 50 * 70 * 3 + 2 * 50 * 70 * 40
    assert stats.bytes == stats.largest == 8 * 50 * 70


def test_a_symbolic_dim_counts_at_the_representative_size():
    low = _lowered("dim n\ninput x[n]\nout y = exp(x) * x", Options())
    assert lowered_stats(low, rep=10).flops == 2 * 10 and lowered_stats(low, rep=100).flops == 2 * 100


def test_dump_ir_stats_covers_the_lowering_stages():
    r = CliRunner().invoke(main, ["dump-ir", str(ROOT / "examples" / "mlp.tg"), "--after", "plan",
                                                  "--stats"])
    assert r.exit_code == 0, r.output
    lines = r.stderr.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[0] == "kernels")
    rows = [line.split() for line in lines[head + 1:]]
    assert [row[-1] for row in rows] == ["fuse", "layout", "narrow", "gemm_operands", "implicit", "accumulate", "unsplit", "epilogue", "alias", "pieces", "group",
                                        "plan"]
    assert all(int(row[0]) > 0 and int(row[1].replace(",", "")) > 0 for row in rows)
