"""The `alias` stage (`tgc.lower.alias`): a copy that only splits or merges edges, whose
source and destination have the same bytes in their orders, becomes a view (an alias
buffer) and the copy goes; `layout` orders a GEMM result that only such a copy reads as
the split of the copy's destination (attention's heads merged into the width:
`[batch, t, head, hd]` for `[batch, t, c]`). Golden text, the refusals, the text form and
the verifier, and numbers: the compiled program with and without the stage (bitwise) and
against the IR interpreter, the generic (symbolic) program through the lowered
interpreter, and a GPT layer loop's steps (examples/gpt2.tg) in f64 and f32."""
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.backends.base import get_backend
from tgc.ir.inputs import random_inputs
from tgc.ir.interp import evaluate
from tgc.lower.alias import Aliases
from tgc.lower.interp import run_lowered
from tgc.lower.lowered import Const, GemmKernel, Ix, LoopKernel, StepLoop, print_lowered
from tgc.lower.text import parse_lowered
from tgc.lower.verify import VerifyError, verify_lowered
from tgc.options import Options
from lowered_util import gpt2_start

HERE = Path(__file__).resolve().parent
MERGE = HERE / "alias_merge.tg"   # y = sum[s](p * v) @ [c = hd*head + hd] @ wo, and wo's gradient
GPT2 = HERE.parents[1] / "examples" / "gpt2.tg"
DIMS = {"head": 3, "hd": 4, "t": 5, "n": 6}


def stages(alias: bool = True) -> tuple[str, ...]:
    return tuple(s for s in get_backend("cpu").lowering() if alias or s != "alias")


def lowered(path, dims, stop_after: str, dtype: str = "f64", opts: Options | None = None):
    opts = opts or Options(dtype=dtype)
    src = pipeline.load_source(str(path), dims=dims, lookup=False, options=opts)
    compiled, o = pipeline.target(pipeline.lower(src.module, src.options).module, src.options)
    return pipeline.lower_module(compiled, o, stop_after=stop_after), o


GOLDEN = """\
buffer %t5 : f64[batch, hd, head, t] temp order [batch, t, head, hd]
buffer %t6 : f64[batch, c, t] temp order [batch, t, c] alias %t5
k0: gemm %t5 = %v[batch, hd, head, s] @ %p[batch, head, s, t]  batch(batch, head) m(hd) n(t) k(s)
k1: gemm %y = %wo[c, n] @ %t6[batch, c, t]  batch() m(n) n(batch, t) k(c)
k2: gemm %g = %t6[batch, c, t] @ %y[batch, n, t]  batch() m(c) n(n) k(batch, t)
      then %g[c, n] = add[2.0](acc)"""


def test_the_merged_heads_are_a_view_of_the_product():
    """The batched product stores its heads in the width's layout (`[batch, t, head,
    hd]`), and both GEMMs that read the width read those bytes: no copy kernel."""
    low, _ = lowered(MERGE, DIMS, "alias")
    text = [b.text() for b in low.buffers.values() if b.kind == "temp"] + \
        [f"k{i}: " + k.text() for i, k in enumerate(low.kernels)]
    assert "\n".join(text) == GOLDEN
    before, _ = lowered(MERGE, DIMS, "epilogue")   # the copy the stage removes
    (copy,) = [k for k in before.kernels if isinstance(k, LoopKernel)]
    assert copy.out == "t6" and "floor" in copy.text()


def test_a_copy_is_kept_where_the_bytes_or_the_writes_do_not_allow_a_view():
    """Refusals: the source in another order (a transpose: the offsets differ), and a
    source written again after the copy (the view would see the new values)."""
    low, opts = lowered(MERGE, DIMS, "epilogue")
    assert Aliases().run(low, opts).buffers["t6"].alias == "t5"
    moved = low.staged("epilogue")
    moved.buffers["t5"].order = ("batch", "head", "t", "hd")
    out = Aliases().run(moved, opts)
    assert not any(b.alias for b in out.buffers.values()) and len(out.kernels) == len(low.kernels)
    again = low.staged("epilogue")
    t5 = again.buffers["t5"]
    zero = LoopKernel("t5", tuple((e, Ix.var(e)) for e in t5.edges), t5.order,
                      {e: again.size(e) for e in t5.edges}, Const(0.0))
    again.kernels = again.kernels + [zero]
    out = Aliases().run(again, opts)
    assert not any(b.alias for b in out.buffers.values()) and len(out.kernels) == len(again.kernels)


def test_an_alias_reads_back_from_text_and_the_verifier_checks_it():
    low, _ = lowered(MERGE, DIMS, "plan")
    text = print_lowered(low)
    assert "alias %t5 slot" in text
    back = parse_lowered(text)
    assert print_lowered(back) == text
    bad = replace(low, buffers={**low.buffers, "t6": replace(low.buffers["t6"], alias="wo")})
    with pytest.raises(VerifyError, match="alias '%t6'"):
        verify_lowered(bad)
    stale = replace(low, buffers={**low.buffers, "t6": replace(low.buffers["t6"], slot=None)})
    with pytest.raises(VerifyError, match="alias '%t6' is in slot None"):
        verify_lowered(stale)


@pytest.mark.parametrize("dtype", ["f64", "f32"])
def test_the_view_computes_the_copys_bits(dtype):
    """The compiled program with the alias stage and without it (the copy): the same
    bits; and the IR interpreter's values."""
    x = None
    got = []
    for alias in (True, False):
        prog = tgc.compile(MERGE, dtype=dtype, dims=DIMS, options=Options(dtype=dtype, stages=stages(alias)))
        if x is None:
            x = random_inputs(prog.module, {**prog.module.dims, "batch": 3}, 1, dtype)
        got.append(prog(**x))
        assert any(b.alias for b in prog.lowered.buffers.values()) == alias
    for name in ("y", "g"):
        assert np.array_equal(got[0][name], got[1][name]), name
    want = evaluate(pipeline.lower(pipeline.load_source(str(MERGE), dims=DIMS, lookup=False,
                                                         options=Options(dtype="f64")).module,
                                   Options(dtype="f64")).module,
                    {k: np.asarray(v, np.float64) for k, v in x.items()}, dtype="f64")
    tol = 1e-12 if dtype == "f64" else 1e-5
    for name in ("y", "g"):
        np.testing.assert_allclose(got[0][name], want[name], rtol=tol, atol=tol * np.abs(want[name]).max())


def test_a_symbolic_programs_masked_copy_is_a_view_too():
    """With every size symbolic the split's copy carries masks that hold over its whole
    range (`c >= 0`, `c - hd * head < 0`) and unsimplified zero offsets: still a view;
    the planned program through the lowered interpreter gives the IR interpreter's values."""
    low, _ = lowered(MERGE, {}, "plan")
    assert [b.name for b in low.buffers.values() if b.alias] == ["t6"]
    assert not [k for k in low.kernels if isinstance(k, LoopKernel) and "floor" in k.text()]
    m = low.module
    x = random_inputs(m, m.bind_dims({"batch": 2, "head": 3, "hd": 4, "t": 5, "n": 6}), 2, "f64")
    got = run_lowered(low, x)
    want = evaluate(m, dict(x), dtype="f64")
    for name in ("y", "g"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12)


GPT_DIMS = {"layer": 2, "head": 2, "hd": 4, "t": 5, "vocab": 7, "batch": 2}


def gpt_options(dtype: str, alias: bool = True) -> Options:
    o = Options(dtype=dtype, stages=stages(alias))
    return o.with_(cpu=o.cpu.with_(blas_min_flops=0))   # every product a GEMM at this size


def test_a_gpt_layers_head_merges_are_views():
    """examples/gpt2.tg's layer loop: the forward step's attention output `p @ v` is
    stored in the width layout of the output it keeps for the backward (an alias of
    that output), and the backward step's three head gradients and its split of `wo`
    into heads are views too: no copy between heads and the width is left. The
    forward step's query, key and value projections, their biases added in the GEMM's
    store (`tgc.lower.unsplit`), are views of the heads the step keeps."""
    low, _ = lowered(GPT2, GPT_DIMS, "alias", opts=gpt_options("f64"))
    fwd, bwd = [k for k in low.kernels if isinstance(k, StepLoop)]
    views = {loop.reverse: [b.text() for b in loop.step.buffers.values() if b.alias] for loop in (fwd, bwd)}
    assert views == {
        False: ["buffer %t39 : f64[batch, hd, head, t] temp order [batch, t, head, hd] alias %r8",
                "buffer %u44 : f64[batch, c2, t] temp order [batch, t, c2] alias %r6",
                "buffer %u45 : f64[batch, c2, t] temp order [batch, t, c2] alias %r5",
                "buffer %u46 : f64[batch, c2, t] temp order [batch, t, c2] alias %r4"],
        True: ["buffer %t70 : f64[c, hd, head] temp order [head, hd, c] alias %p21",
               "buffer %t76 : f64[batch, c2, t] temp order [batch, t, c2] alias %t74",
               "buffer %t79 : f64[batch, c2, s] temp order [batch, s, c2] alias %t77",
               "buffer %t82 : f64[batch, c2, s] temp order [batch, s, c2] alias %t80"]}
    assert fwd.step.buffers["r8"].kind == "out"
    for loop in (fwd, bwd):
        assert not [k for k in loop.step.kernels if isinstance(k, LoopKernel) and "floor" in k.text()]
    pv = [k for k in fwd.step.kernels if isinstance(k, GemmKernel) and k.out == "t39"]
    assert len(pv) == 1 and pv[0].batch == ("batch", "head")


def gpt_start(program, seed: int = 3) -> dict[str, np.ndarray]:
    return gpt2_start(program, {k: v for k, v in GPT_DIMS.items() if k != "batch"}, GPT_DIMS["batch"], seed)


@pytest.mark.parametrize("dtype", ["f64", "f32"])
def test_a_gpt_step_with_views_has_the_copies_bits(dtype):
    """Two AdamW steps of examples/gpt2.tg with the alias stage and without it: the loss
    and every updated param and moment have the same bits (tests/lower/test_saved_heads.py
    checks the same step against the IR interpreter)."""
    results = []
    for alias in (True, False):
        prog = tgc.compile(GPT2, dtype=dtype, dims=GPT_DIMS, options=gpt_options(dtype, alias))
        args = gpt_start(prog)
        losses = [float(prog(**args)["loss"]) for _ in range(2)]   # updates `args` in place
        results.append((losses, args))
    (l1, a1), (l2, a2) = results
    assert l1 == l2
    for k in a1:
        assert np.array_equal(a1[k], a2[k]), k


MERGED_OUT = """
dim batch, head, hd, t
dim c = head * hd, s = t
input  p[batch, head, t, s], v[batch, head, s, hd]
m = sum[s](p * v) @ [c = hd*head + hd]
out m
out z = tanh(m) * m
"""


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_sizes_and_a_merged_output_keep_the_copys_bits(seed):
    """The merge into an output of the program (the product stored in the output's
    bytes: the product's buffer is the alias) and the merge read by two GEMMs, at random
    sizes (edges of 1 included), with the alias stage and without it: the same bits, and
    the IR interpreter's values."""
    rng = np.random.default_rng(seed)
    dims = {"head": int(rng.integers(1, 5)), "hd": int(rng.integers(1, 6)), "t": int(rng.integers(1, 7))}
    cases = [(MERGED_OUT, dims, ("m", "z")), (MERGE, {**dims, "n": int(rng.integers(1, 6))}, ("y", "g"))]
    for source, d, names in cases:
        got, x = [], None
        for alias in (True, False):
            prog = tgc.compile(source, dtype="f64", dims=d, options=Options(dtype="f64", stages=stages(alias)))
            if x is None:
                x = random_inputs(prog.module, {**prog.module.dims, "batch": int(rng.integers(1, 4))}, seed, "f64")
            got.append(prog(**x))
        want = evaluate(prog.module, dict(x), dtype="f64")
        for name in names:
            assert np.array_equal(got[0][name], got[1][name]), (source, d, name)
            np.testing.assert_allclose(got[0][name], want[name], rtol=1e-11, atol=1e-12)


def test_a_merged_output_is_written_by_the_product():
    low, _ = lowered(MERGED_OUT, {"head": 3, "hd": 4, "t": 5}, "alias")
    (view,) = [b for b in low.buffers.values() if b.alias]
    assert low.buffers[view.alias].kind == "out" and view.alias == "m"
    assert [k.out for k in low.kernels if isinstance(k, GemmKernel)] == [view.name]


CAUSAL = """
dim t = 64, hd = 4
dim s = t
input q[t, hd]
input k[s, hd]
input v[s, hd]
input dy[t, hd]
p = softmax[s](where([s <= t], sum[hd](q * k) / sqrt(size(hd)), -1e9))
y = sum[s](p * v)
out y[t, hd]
loss = sum(y * dy)
out dq[t, hd] = grad(loss, q)
out dk[s, hd] = grad(loss, k)
out dv[s, hd] = grad(loss, v)
"""


def causal_options(dtype: str, alias: bool = True) -> Options:
    o = Options(dtype=dtype, stages=stages(alias), stream_block=16, stream_min_elements_masked=64,
                stream_mask_groups=4)
    return o.with_(cpu=o.cpu.with_(threads=1, blas_min_flops=0))


def test_a_causal_runs_keys_are_a_prefix_view_of_the_keys():
    """A causal stream's runs (`stream_skip`) read the keys and values before the run's
    last row: a copy of `k[s, hd]`'s first rows into `[s.1, hd]`, the same offsets, fewer
    bytes. It becomes a view of `k`'s first bytes (no copy per run); a copy into a
    buffer larger than its source, or the reverse direction (the source a temporary
    viewing an output of fewer bytes), stays a copy."""
    from tgc.frontend import compile_source
    opts = causal_options("f64")
    module = compile_source(CAUSAL, "<causal>", opts)
    compiled, o = pipeline.target(pipeline.lower(module, opts).module, opts)
    low = pipeline.lower_module(compiled, o, stop_after="alias")
    views = []

    def walk(p):
        for k in p.kernels:
            if isinstance(k, StepLoop):
                walk(k.step)
        for name, b in p.buffers.items():
            if b.alias is not None and p.nbytes(b) < p.nbytes(p.buffers[b.alias]):
                views.append((name, b.alias, p.nbytes(b), p.nbytes(p.buffers[b.alias])))
    walk(low)
    # the first three runs' keys and values (16, 32, 48 of 64 keys; the last run reads all 64:
    # the same size, a view already) and the first run's stacked queries and dy
    assert sorted(n for _, _, n, _ in views) == sorted([16 * 4 * 8] * 2 + [32 * 4 * 8] * 2 + [48 * 4 * 8] * 2
                                                        + [16 * 4 * 8] * 2), views
    verify_lowered(pipeline.lower_module(compiled, o))


@pytest.mark.parametrize("dtype", ["f64", "f32"])
def test_prefix_views_compute_the_copys_bits(dtype):
    """The causal stream with and without the alias stage: the same bits; and the IR
    interpreter's values (the unstreamed program, f64); the planned program through the
    lowered interpreter (its prefix views are the arrays' first elements) too."""
    from tgc.frontend import compile_source
    got = []
    x = None
    for alias in (True, False):
        prog = tgc.compile(CAUSAL, "cpu", dtype, options=causal_options(dtype, alias))
        if x is None:
            x = random_inputs(prog.module, prog.module.dims, 3, dtype)
        got.append(prog(**x))
    for name in ("y", "dq", "dk", "dv"):
        assert np.array_equal(got[0][name], got[1][name]), name
    plain = compile_source(CAUSAL, "<causal>", Options(dtype="f64"))
    want = evaluate(pipeline.lower(plain, Options(dtype="f64")).module,
                    {n: np.asarray(v, np.float64) for n, v in x.items()}, dtype="f64")
    opts = causal_options("f64")
    compiled, o = pipeline.target(pipeline.lower(compile_source(CAUSAL, "<causal>", opts), opts).module, opts)
    low = pipeline.lower_module(compiled, o)
    back = run_lowered(low, {n: np.asarray(v, np.float64) for n, v in x.items()})
    tol = 1e-12 if dtype == "f64" else 1e-5
    for name in ("y", "dq", "dk", "dv"):
        scale = np.abs(want[name]).max()
        np.testing.assert_allclose(got[0][name], want[name], rtol=tol, atol=tol * scale)
        np.testing.assert_allclose(back[name], want[name], rtol=1e-12, atol=1e-12 * scale)
