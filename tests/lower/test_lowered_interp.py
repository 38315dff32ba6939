"""The numpy interpreter of the lowered program (`tgc.lower.interp`).

Every example and benchmark workload, lowered to each stage (fuse, layout, group,
plan), runs to the IR interpreter's values; the interpreter flags what no correct
lowered program does (an unguarded load out of range, two live buffers in one
workspace slot) and refuses gather ids out of range like a compiled program.
"""
from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tgc import pipeline
from tgc.frontend import compile_source
from tgc.ir.interp import EvalError, evaluate
from tgc.ir.inputs import random_inputs
from tgc.lower.lowered import Load, LoopKernel
from tgc.lower.interp import LoweredError, run_lowered
from tgc.options import Options
from tgc.pipeline import lower_module

from backends_util import backends, compile_on
from marks import sized_by_themselves

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = sorted(sized_by_themselves((ROOT / "examples").glob("*.tg"))) + sorted((ROOT / "benchmarks" / "workloads").glob("*.tg"))
STAGES = ("fuse", "layout", "group", "plan")


def optimized(source: str, name: str, dtype: str):
    opts = Options(dtype=dtype)
    return pipeline.lower(compile_source(source, name, opts), opts).module, opts


def compare(got: dict, want: dict, dtype: str) -> None:
    assert set(got) == set(want)
    tol = 1e-10 if dtype == "f64" else 2e-5
    for k, w in want.items():
        scale = max(1.0, float(np.max(np.abs(w)))) if w.size else 1.0
        np.testing.assert_allclose(got[k], w, rtol=tol, atol=tol * scale, err_msg=k)


@pytest.mark.parametrize("dtype", ["f64", "f32"])
@pytest.mark.parametrize("path", PROGRAMS, ids=[p.stem for p in PROGRAMS])
def test_every_program_at_every_lowering_stage_runs_to_the_interpreters_values(path, dtype):
    m, opts = optimized(path.read_text(), str(path), dtype)
    x = random_inputs(m, m.bind_dims({d: 3 for d in m.symbolic_dims()}), 0, dtype)
    want = evaluate(m, {k: np.copy(v) for k, v in x.items()}, dtype=dtype)
    if dtype == "f32":   # summation orders differ: each within 10x the interpreter's own error
        wide = {k: v.astype(np.float64) if v.dtype == np.float32 else np.copy(v) for k, v in x.items()}
        truth = evaluate(m, wide, dtype="f64")
        got = run_lowered(lower_module(m, opts), {k: np.copy(v) for k, v in x.items()})
        assert set(got) == set(want)
        for k, w in want.items():
            real = np.isfinite(truth[k])   # where the exact step is a number (random AdamW states make NaNs)
            np.testing.assert_array_equal(np.isfinite(got[k]), real, err_msg=k)
            t = truth[k][real]
            scale = max(1.0, float(np.max(np.abs(t), initial=0.0)))
            own = float(np.max(np.abs(np.asarray(w)[real] - t), initial=0.0))
            err = float(np.max(np.abs(np.asarray(got[k])[real] - t), initial=0.0))
            assert err <= 10 * own + 2e-5 * scale, (k, err, own)
        return
    for stage in STAGES:
        low = lower_module(m, opts, stop_after=stage)
        compare(run_lowered(low, {k: np.copy(v) for k, v in x.items()}), want, dtype)


SOFTMAX_ROWS = """
dim rows, d
input x[rows, d]
input dy[rows, d]
y = softmax[d](x)
out y
out dx = grad(sum(y * dy), x)
out g = sum[rows](y * dy)
"""


@pytest.mark.parametrize("rows", [1, 5, 33, 70])
def test_blocked_groups_with_scratch_rows_and_partial_sums(rows):
    """A group in blocks: a scratch row per block, partial sums per block, added up."""
    m, opts = optimized(SOFTMAX_ROWS, "<softmax>", "f64")
    low = lower_module(m, opts)
    text = "\n".join(k.text() for k in low.kernels)
    assert "partial sums" in text
    x = random_inputs(m, m.bind_dims({"rows": rows, "d": 7}), rows, "f64")
    compare(run_lowered(low, x), evaluate(m, x, dtype="f64"), "f64")


def test_a_load_out_of_range_that_no_mask_guards_is_an_error():
    m, opts = optimized("dim n = 4\ninput x[n]\nout y = exp(x)\n", "<t>", "f64")
    low = lower_module(m, opts)
    (k,) = [k for k in low.kernels if isinstance(k, LoopKernel)]
    shifted = replace(k, body=_shift_loads(k.body, "x", 1))
    low.kernels = [shifted]
    with pytest.raises(LoweredError, match="out of range"):
        run_lowered(low, {"x": np.zeros(4)})


def _shift_loads(e, buf, by):
    if isinstance(e, Load) and e.buf == buf:
        return Load(buf, tuple((edge, ix.plus_const(by)) for edge, ix in e.index))
    if hasattr(e, "args"):
        return replace(e, args=tuple(_shift_loads(a, buf, by) for a in e.args))
    return e


def test_two_live_buffers_in_one_slot_give_wrong_values():
    """Temporaries live in their workspace slots, which start as NaN bytes: a plan that
    put two buffers alive at once in one slot shows up."""
    path = ROOT / "examples" / "mlp.tg"
    m, opts = optimized(path.read_text(), str(path), "f64")
    low = lower_module(m, opts)
    x = random_inputs(m, m.bind_dims({"batch": 6}), 0, "f64")
    want = evaluate(m, x, dtype="f64")
    compare(run_lowered(low, x), want, "f64")
    temps = [b for b in low.buffers.values() if b.kind == "temp"]
    assert len({b.slot for b in temps}) > 1
    for b in temps:
        b.slot = 0
    low.slots = [tuple(s for sizes in low.slots for s in sizes)]
    got = run_lowered(low, x)
    assert any(not np.allclose(got[k], want[k]) for k in want)


def test_gather_ids_out_of_range_stop_the_call():
    src = "dim v = 5, n = 3, c = 2\ninput E[v, c]\ninput ids: i32[n]\nout y = E[v = ids]\n"
    m, opts = optimized(src, "<t>", "f64")
    low = lower_module(m, opts)
    assert low.checks
    with pytest.raises(EvalError, match="out of range"):
        run_lowered(low, {"E": np.ones((5, 2)), "ids": np.array([0, 5, 1], np.int32)})
    got = run_lowered(low, {"E": np.arange(10.0).reshape(5, 2), "ids": np.array([4, 0, 2], np.int32)})
    np.testing.assert_array_equal(got["y"], np.arange(10.0).reshape(5, 2)[[4, 0, 2]])


def test_shifted_gemm_operands_read_zeros_outside():
    """A convolution's GEMM reads its input shifted per tap; out of range is 0."""
    path = ROOT / "benchmarks" / "workloads" / "conv1d.tg"
    m, opts = optimized(path.read_text(), str(path), "f64")
    low = lower_module(m, opts)
    assert any(getattr(k, "shifts", ()) for k in low.kernels)
    x = random_inputs(m, m.bind_dims({"batch": 2, "len": 9}), 1, "f64")
    compare(run_lowered(low, x), evaluate(m, x, dtype="f64"), "f64")


def test_the_interpreter_depends_on_no_backend():
    """It reads the lowered program, the elementwise functions' numpy definitions (tgc.ir.ops), the
    random draws' definition (tgc.ir.philox), the views of complex arrays as float
    pairs at the call's boundary (tgc.ir.complex_io) and the dispatch by node class
    (tgc.lower.lowered.ExprVisitor) only."""
    import tgc.lower.interp as li

    tree = ast.parse(Path(li.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "typing", "numpy", "tgc.ir.interp", "tgc.lower.lowered", "tgc.ir.sizes",
                        "tgc.ir.philox", "tgc.ir.complex_io", "tgc.ir.ops"}, imported


@pytest.mark.parametrize("dtype", ["f64", "f32"])
def test_verify_each_runs_every_lowering_stage_and_names_the_one_that_broke(dtype, monkeypatch):
    from tgc.manager import PassError
    from tgc.lower.plan import Plan

    path = ROOT / "examples" / "mlp.tg"
    m, opts = optimized(path.read_text(), str(path), dtype)
    lower_module(m, opts.with_(verify_each=True))     # every stage keeps the values
    run = Plan.run

    def one_slot(self, low, options):   # a plan that puts every temporary in one slot
        out = run(self, low, options)
        for b in out.buffers.values():
            if b.kind == "temp":
                b.slot = 0
        out.slots = [tuple(s for sizes in out.slots for s in sizes)]
        return out

    monkeypatch.setattr(Plan, "run", one_slot)   # the verifier sees it, even without --verify-each
    with pytest.raises(PassError, match="lowering stage 'plan' made an invalid program: .* share slot 0"):
        lower_module(m, opts)

    def doubled(self, low, options):   # a plan that doubles what the first loop kernel writes
        from dataclasses import replace

        from tgc.lower.lowered import Const, LoopKernel, Mul

        from tgc.lower.lowered import EpilogueOut, GemmKernel

        out = run(self, low, options)
        i = next(i for i, k in enumerate(out.kernels) if isinstance(k, LoopKernel) and not k.reduce
                 and not isinstance(k.body, Const) or isinstance(k, GemmKernel) and k.epilogue)
        k = out.kernels[i]
        if isinstance(k, GemmKernel):   # its epilogue's first output (tgc.lower.epilogue)
            first = EpilogueOut(k.epilogue[0].buf, Mul((k.epilogue[0].expr, Const(2.0))))
            out.kernels[i] = replace(k, epilogue=(first,) + k.epilogue[1:])
        else:
            out.kernels[i] = replace(k, body=Mul((k.body, Const(2.0))))
        return out

    monkeypatch.setattr(Plan, "run", doubled)
    lower_module(m, opts)   # a valid program: only running it shows the change
    with pytest.raises(PassError, match="lowering stage 'plan' changed the value"):
        lower_module(m, opts.with_(verify_each=True))


WIDE_SOURCE = """
dim n = 64
input a[n], b[n], c[n], d[n]
out y = a + (b - c)
out z = a * d + 3 * (b - c) - a
"""


def _wide_inputs():
    rng = np.random.default_rng(0)
    big = (1e4 + np.round(rng.standard_normal(64), 2)).astype(np.float32)
    return {"a": (1e-2 * rng.standard_normal(64)).astype(np.float32),
            "b": (big + np.float32(1e-3) * rng.standard_normal(64).astype(np.float32)).astype(np.float32),
            "c": big, "d": rng.standard_normal(64).astype(np.float32)}


def _wide_want(x):
    a, b, c, d = (x[k].astype(np.float64) for k in "abcd")
    ad = (x["a"] * x["d"]).astype(np.float64)   # a two-factor product term: f32, rounded once (`wide_term_factors`)
    return {"y": (a + (b - c)).astype(np.float32), "z": (ad + 3 * (b - c) - a).astype(np.float32)}


@pytest.mark.parametrize("backend", backends())
def test_an_f32_sum_of_several_terms_is_computed_in_f64_whatever_its_order(backend):
    """`a + (b - c)` is flattened to add[1, 1, -1](a, b, c), in the canonical order of
    its terms, not the source's; summed in f32 as a + b - c, with b and c near 1e4,
    a (near 1e-2) was lost to the rounding of a + b (2e-2 relative). Every executor
    computes an f32 sum of three or more terms in f64 and rounds it once
    (`lowered.wide_sum`), so each gives the correctly rounded result here (every
    registered backend: `lowered` is this interpreter)."""
    from tgc.lower.lowered import Add, walk, wide_sum

    m, opts = optimized(WIDE_SOURCE, "<wide>", "f32")
    low = lower_module(m, opts)
    kernels = [k for g in low.kernels for k in getattr(g, "members", (g,)) if isinstance(k, LoopKernel)]
    adds = [e for k in kernels for e in walk(k.body) if isinstance(e, Add)]
    assert any(wide_sum(e, "f32") for e in adds) and not any(wide_sum(e, "f64") for e in adds)
    x = _wide_inputs()
    got = compile_on(WIDE_SOURCE, backend, dtype="f32")(**{k: v.copy() for k, v in x.items()})
    for k, w in _wide_want(x).items():
        np.testing.assert_array_equal(np.asarray(got[k]), w, err_msg=k)


def test_a_loop_whose_step_gives_one_number_per_index_stores_each():
    """examples/gpt2.tg's backward loop over `layer` gives a number per layer (a [layer]
    output, each step's slice 0-d, its size symbolic): every step writes its own element, and the AdamW
    step with clipping runs to the interpreter's values."""
    src = (ROOT / "examples" / "gpt2.tg").read_text()
    sized = src.replace("dim batch, layer, head, hd, t, vocab ", "dim batch = 2, layer = 2, head = 2, hd = 4, t = 4, vocab = 8 ")
    assert sized != src
    m, opts = optimized(sized, "gpt2.tg", "f64")
    x = random_inputs(m, m.bind_dims({}), 0, "f64")
    want = evaluate(m, {k: np.copy(v) for k, v in x.items()}, dtype="f64")
    import tgc
    got = tgc.compile(src, backend="lowered", dtype="f64").run({k: np.copy(v) for k, v in x.items()},
                                                              dims=dict(head=2, hd=4))   # symbolic: sizes at the call
    compare({k: got[k] for k in want}, want, "f64")
