"""Column sums move up beside the loop kernels that read their rows
(`tgc.backends.cpu.hoist`, run by the CPU group stage): the moves on a small kernel
list (and where a writer or a reader stops one), examples/gpt2.tg's backward step (the
second layernorm's weight and bias gradients join its own backward group, the
attention output's bias gradient the first layernorm's, the MLP output's bias gradient
the second layernorm's: the column sums that stream a buffer from memory again fall
from 8 to 4 a layer, those of products' results), and the compiled step's values with and without the moves."""
from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.backends.cpu import group, hoist
from tgc.backends.cpu.group import LoopGroup
from tgc.lower.lowered import Const, Ix, Load, LoopKernel, StepLoop
from tgc.options import Options

from lowered_util import gpt2_start

GPT2 = Path(__file__).resolve().parents[2] / "examples" / "gpt2.tg"
DIMS = {"layer": 2, "head": 2, "hd": 4, "t": 5, "vocab": 7, "batch": 2}
SIZES = {"r": 8, "c": 4}


def rows(out, *reads, loops=("r", "c")):
    """`out[r, c]` = the sum of `reads` at [r, c] (a row kernel)."""
    body = Const(0.0)
    for b in reads:
        body = Load(b, (("c", Ix.var("c")), ("r", Ix.var("r")))) if body == Const(0.0) else body
    return LoopKernel(out, tuple((e, Ix.var(e)) for e in sorted(loops)), loops, dict(SIZES), body)


def colsum(out, buf):
    """`out[c] = sum[r] buf[r, c]` (a column sum: it sums over its first loop)."""
    return LoopKernel(out, (("c", Ix.var("c")),), ("r", "c"), dict(SIZES),
                      Load(buf, (("c", Ix.var("c")), ("r", Ix.var("r")))), "sum", ("r",))


def other(out, *reads):
    """A kernel over other loops (a product's stand-in): the group stage never joins it."""
    body = Load(reads[0], (("c", Ix.var("c")), ("r", Ix.var("r")))) if reads else Const(1.0)
    return LoopKernel(out, (("c", Ix.var("c")), ("r", Ix.var("r"))), ("c", "r"), dict(SIZES), body)


def names(ks):
    return [k.out for k in ks]


class _Buf:
    def __init__(self, edges):
        self.dtype, self.edges = "f32", edges


class _Low:
    """The part of a `Lowered` the moves read: kernels, buffers (each [r, c], 128 B,
    but the sums' [c] and those named in `big`, 1 kB) and sizes."""

    def __init__(self, ks, big=()):
        self.kernels = ks
        self.buffers = {}
        for k in ks:
            for b in k.buffers_read() | {k.out}:
                self.buffers[b] = _Buf(("c",) if b.startswith("d") else ("c", "r", "w") if b in big else ("c", "r"))

    def size(self, e):
        return {**SIZES, "w": 8}[e]


def hoisted(ks, cache_bytes=0, big=()):
    return names(hoist.hoist_column_sums(_Low(ks, big), cache_bytes))


def test_a_column_sum_moves_up_beside_the_last_row_kernel_reading_its_rows():
    ks = [rows("x", "a"), rows("y", "x"), other("p", "y"), other("q", "p"), colsum("db", "x")]
    assert hoisted(ks) == ["x", "y", "db", "p", "q"]


def test_it_may_follow_its_input_writer():
    ks = [rows("x", "a"), other("p", "x"), colsum("db", "x")]
    assert hoisted(ks) == ["x", "db", "p"]


def test_a_writer_between_stops_it():
    # `x` is written after y reads it (by a kernel the group stage never joins): db
    # sums that x, so it stays after its writer
    ks = [rows("y", "x"), other("x", "q"), colsum("db", "x")]
    assert hoisted(ks) == ["y", "x", "db"]


def test_a_reader_of_its_output_stops_it():
    ks = [rows("y", "x"), other("p", "db"), colsum("db", "x")]
    assert hoisted(ks) == ["y", "p", "db"]


def test_rows_still_in_cache_no_move():
    """Between y and db: p and q, touching y, p and q (3 x 128 B): up to `cache_bytes`
    db's rows (x, 1 kB) are read from cache where db is."""
    ks = [rows("x", "a"), rows("y", "x"), other("p", "y"), other("q", "p"), colsum("db", "x")]
    assert hoisted(ks, cache_bytes=384, big={"x"}) == ["x", "y", "p", "q", "db"]
    assert hoisted(ks, cache_bytes=383, big={"x"}) == ["x", "y", "db", "p", "q"]


def test_small_rows_no_move():
    """db's rows (x, 128 B) up to half of `cache_bytes`: a re-read that costs little."""
    ks = [rows("x", "a"), rows("y", "x"), other("p", "y"), other("q", "p"), colsum("db", "x")]
    assert hoisted(ks, cache_bytes=256) == ["x", "y", "p", "q", "db"]
    assert hoisted(ks, cache_bytes=255) == ["x", "y", "db", "p", "q"]


def test_no_row_kernel_to_join_no_move():
    ks = [other("x", "a"), other("p", "x"), colsum("db", "x")]
    assert hoisted(ks) == ["x", "p", "db"]


def options(dtype: str) -> Options:
    o = Options(dtype=dtype)
    return o.with_(cpu=o.cpu.with_(blas_min_flops=0))   # every product a GEMM at this size


NANOGPT = {"layer": 2, "head": 6, "hd": 64, "t": 256, "vocab": 65, "batch": 4}   # benchmarks/nanogpt.py's, 2 layers


def backward_step():
    """The reverse loop's step of gpt2.tg at nanoGPT-char's sizes, after the group stage
    (at the small DIMS every buffer stays in cache between kernels: nothing moves)."""
    src = pipeline.load_source(str(GPT2), dims=NANOGPT, lookup=False, options=Options(dtype="f32"))
    compiled, o = pipeline.target(pipeline.lower(src.module, src.options).module, src.options)
    low = pipeline.lower_module(compiled, o, stop_after="group")
    return [k for k in low.kernels if isinstance(k, StepLoop)][-1].step


def rereads(step) -> int:
    """The column sums (partial-sum members, or a sum alone) whose group streams a
    [batch, c, t] buffer for them alone: no other member of their group reads or
    writes it."""
    count = 0
    for k in step.kernels:
        members = k.members if isinstance(k, LoopGroup) else (k,) if isinstance(k, LoopKernel) else ()
        for m in members:
            if not (m.note == "partial sums" or hoist.is_column_sum(m)):
                continue
            big = {b for b in m.buffers_read() if len(step.buffers[b].edges) == 3}
            others = set()
            for o in members:
                if o is not m and o.note != "partial sums":
                    others |= o.buffers_read() | {o.out}
            count += bool(big - others)
    return count


def test_gpt2_backward_column_sums_read_rows_beside_their_group():
    # golden: dq, dk, dv's bias sums and the MLP's (bfc): sums of products' results
    assert rereads(backward_step()) == 4


def test_without_the_moves_seven_reread(monkeypatch):
    monkeypatch.setattr(group, "hoist_column_sums", lambda low, cache_bytes: list(low.kernels))
    # and the layernorms' weight and bias gradients read again (ln2's two in ln1's
    # group), the attention output's bias sum (bo) and the MLP output's (bproj)
    assert rereads(backward_step()) == 8


@pytest.mark.parametrize("dtype, rtol", [("f64", 1e-11), ("f32", 2e-4)])
def test_the_step_is_the_one_without_the_moves(dtype, rtol, monkeypatch):
    """Two steps (the second from the first's moments) against the same program
    built without the moves: the same values within rounding (a bias gradient that
    was summed alone is now summed by blocks of rows)."""
    monkeypatch.setenv("TGC_CACHE", "off")
    o = options(dtype)
    o = o.with_(cpu=o.cpu.with_(group_shrink_max_bytes=1024))   # "out of cache" at these sizes: the sums move
    mine = tgc.compile(GPT2, dtype=dtype, dims=DIMS, options=o)
    with monkeypatch.context() as mp:
        mp.setattr(group, "hoist_column_sums", lambda low, cache_bytes: list(low.kernels))
        base = tgc.compile(GPT2, dtype=dtype, dims=DIMS, options=o)
    assert str(mine.lowered) != str(base.lowered)
    a, b = gpt2_start(mine, DIMS, DIMS["batch"], 3), gpt2_start(mine, DIMS, DIMS["batch"], 3)
    for _ in range(2):
        la, lb = mine(**a)["loss"], base(**b)["loss"]
        assert abs(float(la) - float(lb)) <= rtol * abs(float(lb))
    for k in b:
        if k.startswith(("m.", "v.")):   # the gradients and their squares (AdamW's update amplifies noise)
            scale = max(np.abs(b[k]).max(), 1e-30)
            np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=rtol * scale, err_msg=k)
