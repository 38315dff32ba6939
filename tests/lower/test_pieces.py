"""`tgc.lower.pieces`: the rows of a masked stream's runs, put back together as one
kernel over every row that adds one masked load per run (each element testing every
run's mask and floor-dividing its indices: 52 ms of causal attention's 1.76 s at t =
8192 4 x 2 in 32 runs, one thread), are written by one kernel per run over its own rows.
Checked: the structure of the lowered program (no masked sum left, one piece per run and
output, each over its run's rows at its offset, its floors folded, the pieces' elements
adding up to the output's); the values against torch in f64 and f32 and, bit for bit,
against the same program without the stage; `ranges` on the sums it must leave alone;
`--fp-strict`; `tgc.lower.verify` on a piece alone."""
import numpy as np
import pytest

import tgc
from tgc.backends.base import pass_registry
from tgc.backends.cpu.backend import CpuBackend
from tgc.frontend import compile_source
from tgc.lower.lowered import Add, Cond, Const, FloorDiv, Ix, Load, LoopKernel, Mask, StepLoop, walk
from tgc.lower.pieces import fold_floors, ranges
from tgc.options import Options
from layer_programs import causal_attention

torch_oracle = pytest.importorskip("torch_oracle", reason="the oracle needs torch")

# tests/opt/test_stream.py's causal attention at t = 64 in blocks of 4, in 4 runs of 16 rows
ATTENTION = causal_attention(head=2, t=64, hd=2)
RUNS = dict(stream_block=4, stream_min_elements=200, stream_mask_groups=2, stream_mask_rows=16)


def inputs(dtype: str) -> dict:
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal((2, 64, 2)).astype(np.float32 if dtype == "f32" else np.float64)
            for n in ("q", "k", "v", "dy")}


def compiled(dtype: str, pieces: bool = True, **opts):
    """The CPU program; without the stage (`pieces` False) by its stages less Pieces
    (the pass registry, built once from the backends' stages, made first)."""
    pass_registry()
    saved = CpuBackend.stages
    if not pieces:
        CpuBackend.stages = tuple(s for s in saved if s.__name__ != "Pieces")
    try:
        return tgc.compile(ATTENTION, "cpu", dtype, options=Options(**RUNS, **opts))
    finally:
        CpuBackend.stages = saved


def loop_kernels(low):
    """Every loop kernel of `low`, its steps' and its groups' members, with its program."""
    for k in low.kernels:
        if isinstance(k, StepLoop):
            yield from loop_kernels(k.step)
        elif isinstance(k, LoopKernel):
            yield low, k
        elif hasattr(k, "members"):
            for m in k.members:
                yield low, m


def masked_sums(low) -> list:
    return [k for _, k in loop_kernels(low) if isinstance(k.body, Add)
            and sum(isinstance(a, Mask) for a in k.body.args) >= 2]


def test_the_runs_rows_are_written_by_one_kernel_each():
    """Without the stage y and dq are each one kernel adding 4 masked loads (the 4 runs);
    with it, 4 kernels each, over 16 rows at offsets 0, 16, 32, 48, no floor division
    left where a run's rows are one index of its steps' stack apart (4 steps of 4 rows:
    `floor(t' / 4)` stays, `t' - 4 floor(t' / 4)` the row in the step), every element of
    the output written once: the pieces' elements add up to the output's."""
    before = compiled("f64", pieces=False).lowered
    sums = masked_sums(before)
    assert len(sums) == 2 and len({k.out for k in sums}) == 2   # y and dq
    assert all(len(k.body.args) == 4 for k in sums)
    low = compiled("f64").lowered
    assert masked_sums(low) == []
    for out in {k.out for k in sums}:
        pieces = [(prog, k) for prog, k in loop_kernels(low) if k.out == out and k.note.startswith("piece")]
        assert len(pieces) == 4, out
        offsets = []
        for prog, k in pieces:
            (edge, ix), = [(e, ix) for e, ix in k.index if ix.vars() & {v for v in k.loops if k.sizes[v] == 16}]
            (w, coef), = ix.terms
            assert coef == 1 and k.sizes[w] == 16 and prog.size(edge) == 64
            offsets.append(ix.const)
            assert isinstance(k.body, Add) and k.body.args[1] == Const(0.0) and isinstance(k.body.args[0], Load)
        assert sorted(offsets) == [0, 16, 32, 48]
        total = sum(int(np.prod([k.sizes[v] for v in k.loops])) for _, k in pieces)
        prog = pieces[0][0]
        assert total == int(np.prod(prog.sizes(prog.buffers[out].edges)))


@pytest.mark.parametrize("dtype,tol", [("f64", 1e-10), ("f32", 2e-5)])
def test_values_match_torch_and_the_masked_sums_bits(dtype, tol):
    x = inputs(dtype)
    want = torch_oracle.evaluate(compile_source(ATTENTION, "<pieces>", Options(dtype="f64")),
                                 {n: a.astype(np.float64) for n, a in x.items()})
    got = compiled(dtype)(**x)
    for name, w in want.items():
        scale = float(np.max(np.abs(w)))
        np.testing.assert_allclose(np.asarray(got[name], np.float64), w, rtol=0, atol=tol * scale, err_msg=name)
    plain = compiled(dtype, pieces=False)(**x)
    for name in want:
        assert np.asarray(got[name]).tobytes() == np.asarray(plain[name]).tobytes(), name


def test_two_threads_give_the_same_bits():
    x = inputs("f32")
    one = compiled("f32")
    o = Options(**RUNS)
    two = tgc.compile(ATTENTION, "cpu", "f32", options=o.with_(cpu=o.cpu.with_(threads=2)))
    a, b = one(**x), two(**x)
    for name in a:
        assert np.asarray(a[name]).tobytes() == np.asarray(b[name]).tobytes(), name


def test_fp_strict_keeps_the_program():
    """--fp-strict builds no stream (so no such sum); the stage is off there anyway."""
    low = compiled("f32", fp_strict=True).lowered
    assert not [k for _, k in loop_kernels(low) if k.note.startswith("piece")]


def _sum(*terms, n=8):
    body = Add(tuple(1.0 for _ in terms), tuple(Mask(tuple(Cond(Ix.make([(v, c)], k), op) for v, c, k, op in conds),
                                                    Load("x", (("t", Ix.var("t")),)))
                                               for conds in terms))
    return LoopKernel("y", (("t", Ix.var("t")),), ("t",), {"t": n}, body)


def test_ranges_of_a_partition():
    # t < 3, 3 <= t < 5 (written -t + 5 > 0), t >= 5
    k = _sum([("t", 1, -3, "<")], [("t", 1, -3, ">="), ("t", -1, 5, ">")], [("t", 1, -5, ">=")])
    v, pieces = ranges(k)
    assert v == "t" and [(lo, hi) for lo, hi, _ in pieces] == [(0, 3), (3, 5), (5, 8)]


@pytest.mark.parametrize("terms", [
    [[("t", 1, -3, "<")], [("t", 1, -4, ">=")]],                         # a gap: t = 3
    [[("t", 1, -4, "<")], [("t", 1, -3, ">=")]],                         # an overlap: t = 3
    [[("t", 1, -3, "<")]],                                               # one term
    [[("t", 2, -3, "<")], [("t", 2, -3, ">=")]],                         # 2t: no range of t
    [[("t", 1, -3, "<")], [("t", 1, -3, "!=")]],                         # != is no range
    [[("t", 1, -3, "<")], [("u", 1, -3, ">=")]],                         # two variables
])
def test_ranges_leave_other_sums_alone(terms):
    k = _sum(*terms)
    if any(v == "u" for conds in terms for v, *_ in conds):
        k = LoopKernel("y", (("t", Ix.var("t")), ("u", Ix.var("u"))), ("t", "u"), {"t": 8, "u": 8}, k.body)
    assert ranges(k) is None


def test_floors_fold_where_the_range_fixes_them():
    t = Ix.var("t")
    assert fold_floors(Ix.of(FloorDiv(t, 16)), {"t": 16}) == Ix()
    assert fold_floors(Ix.of(FloorDiv(t.plus_const(32), 16)), {"t": 16}) == Ix((), 2)
    assert fold_floors(t.plus(Ix.of(FloorDiv(t, 16)).scaled(-16)), {"t": 16}) == t
    kept = Ix.of(FloorDiv(t, 4))
    assert fold_floors(kept, {"t": 16}) == kept        # 0..3 over t < 16
    assert fold_floors(Ix.of(FloorDiv(t.plus_const(1), 16)), {"t": 16}) == Ix.of(FloorDiv(t.plus_const(1), 16))


def test_verify_accepts_pieces_and_not_a_short_loop_alone():
    from tgc.lower.verify import VerifyError, verify_lowered as verify

    low = compiled("f64").lowered
    verify(low)   # the pieces, several writers of one buffer
    import copy

    # one piece alone writes 16 of the 64 rows: an error again
    step = copy.deepcopy(low)
    for prog, k in loop_kernels(step):
        if k.note.startswith("piece"):
            out = k.out
            break
    keep = None
    for i, k in enumerate(prog.kernels):
        if isinstance(k, LoopKernel) and k.out == out and k.note.startswith("piece"):
            if keep is None:
                keep = i
    prog.kernels = [k for i, k in enumerate(prog.kernels)
                    if not (isinstance(k, LoopKernel) and k.out == out and k.note.startswith("piece")) or i == keep]
    with pytest.raises(VerifyError, match="runs over 16 but writes edge"):
        verify(step)


def test_no_piece_reads_a_floor_its_range_fixes():
    """Where a run's rows are one step (16-row blocks), `floor(t' / 16)` is 0 over the
    piece: folded, the piece loads at `t'` itself."""
    low = tgc.compile(ATTENTION, "cpu", "f64", options=Options(**{**RUNS, "stream_block": 16})).lowered
    pieces = [k for _, k in loop_kernels(low) if k.note.startswith("piece")]
    assert pieces
    for k in pieces:
        assert not [a for n in walk(k.body) if isinstance(n, Load) for _, ix in n.index for a, _ in ix.terms
                    if isinstance(a, FloorDiv)], k.text()


CONCAT = """
dim t1 = 5, t2 = 70, t3 = 3, c = 33
dim t = 78
input a[t1, c]
input b[t2, c]
input d[t3, c]
out y[t, c] = a[t1 = t] + b[t2 = t - size(t1)] + d[t3 = t - size(t1) - size(t2)]
"""


@pytest.mark.parametrize("threads", [1, 2])
def test_a_concatenation_is_written_in_pieces(threads):
    """A concatenation is such a sum too: three pieces, at offsets 0, 5 and 75, the
    values numpy's (and a -0 comes out +0, as the masked sum gave it)."""
    o = Options()
    prog = tgc.compile(CONCAT, "cpu", "f32", options=o.with_(cpu=o.cpu.with_(threads=threads)))
    pieces = [k for _, k in loop_kernels(prog.lowered) if k.note.startswith("piece")]
    assert sorted(k.note for k in pieces) == ["piece 0..5", "piece 5..75", "piece 75..78"]
    rng = np.random.default_rng(1)
    x = {"a": rng.standard_normal((5, 33)).astype(np.float32), "b": rng.standard_normal((70, 33)).astype(np.float32),
         "d": rng.standard_normal((3, 33)).astype(np.float32)}
    x["b"][3, 4] = -0.0
    y = np.asarray(prog(**x)["y"])
    want = np.concatenate([x["a"], x["b"], x["d"]]) + np.float32(0.0)
    assert y.tobytes() == want.tobytes()


def test_the_pieces_of_one_output_share_a_region_without_barriers():
    """On 2 threads the pieces write disjoint rows of one output (`regions._span`): no
    barrier between two pieces of y, nor of dq (one before dq's first: y and dq are a
    step's outputs, which may share memory)."""
    from tgc.backends.cpu.regions import plan_regions

    o = Options(**RUNS)
    cpu = o.cpu.with_(threads=2)
    low = tgc.compile(ATTENTION, "cpu", "f64", options=o.with_(cpu=cpu)).lowered
    progs = [prog for prog, k in loop_kernels(low) if k.note.startswith("piece")]
    prog = progs[0]
    assert all(p is prog for p in progs)
    at = [i for i, k in enumerate(prog.kernels) if isinstance(k, LoopKernel) and k.note.startswith("piece")]
    step = prog is not low
    for r in plan_regions(prog, cpu, step):
        for j, bar in enumerate(r.barrier):
            i = r.start + j
            if bar and i in at and i - 1 in at:
                assert prog.kernels[i].out != prog.kernels[i - 1].out, prog.kernels[i].text()
    inside = [i for r in plan_regions(prog, cpu, step) for i in range(r.start, r.start + len(r.barrier))]
    assert set(at) <= set(inside)
