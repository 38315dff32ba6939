"""benchmarks/breakdown.py: its per-kernel accounting adds up to the call it counts.

A tiny GPT step (2 layers of width 32, t 16: loops over the layers with their step
kernels, GEMMs, AdamW), the symbolic conv2d at batch 2 and a small causal attention are built as the script
builds them (every size fixed, `CpuOptions(profile=True)`), and counted: the kernels'
ticks, with each loop's own, sum exactly to the counted total; the counted total is
within a tolerance of the call's wall time (the rest is the Python call, microseconds
here); the products' FLOPs are the GEMM kernels' (2 m n k each, no epilogue); the
kernels' bytes (a loop's step kernels once per step) are `tgc explain`'s total. The torch
half (torch.profiler's breakdown, and oneDNN's primitives for the conv2d) runs where
torch is installed.
"""
from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = {"layer": 2, "head": 2, "hd": 16, "t": 16, "vocab": 17}


@pytest.fixture(scope="module")
def breakdown():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        yield importlib.import_module("breakdown")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def counted(bd, w, slack_s: float, calls: int = 5, tries: int = 8):
    """The program and its accounting in the fastest of `calls` calls. On a loaded
    machine (CI runs two workers on two cores) every call of a try may wait for a core
    outside the kernels' counters; the wall-time check is then tried again, up to
    `tries` times: the property is that a call nobody preempts is all counted."""
    hz = bd.tsc_hz(0.05)
    program = bd.build(w.module, w.dims, w.options, True, 1)
    arrays = w.arrays(program)
    for _ in range(tries):
        acc = bd.account(program, arrays, calls, hz)
        if acc.wall - acc.counted / acc.hz <= slack_s + 0.2 * acc.wall:
            break
    return program, acc


def check_sums(acc, slack_s: float) -> None:
    ticks = sum(r.ticks for r in acc.rows) + acc.loops
    assert ticks == pytest.approx(acc.counted, rel=1e-12), "rows plus loop overhead are not the counted total"
    assert acc.loops >= 0 and all(r.ticks >= 0 for r in acc.rows)
    counted_s = acc.counted / acc.hz
    # the counters run inside the call: never more than its wall time (1% for the clocks' rates)
    assert counted_s <= acc.wall * 1.01
    # and all but the call's own overhead (argument checks, Python): at most `slack_s`
    assert acc.wall - counted_s <= slack_s + 0.2 * acc.wall, (acc.wall, counted_s)


def test_tiny_gpt_accounting(breakdown):
    from tgc.lower.lowered import GemmKernel, StepLoop

    w = breakdown.NanoGPT(batch=2, sizes=TINY)
    program, acc = counted(breakdown, w, 2e-3)
    assert any(isinstance(k, StepLoop) for k in program.lowered.kernels), "the layers are no loop: no loop accounting"
    assert acc.loops > 0
    check_sums(acc, 2e-3)

    def gemms(low, times=1):
        for k in low.kernels:
            if isinstance(k, StepLoop):
                yield from gemms(k.step, times * k.trip)
            elif isinstance(getattr(k, "gemm", k), GemmKernel):
                g = getattr(k, "gemm", k)
                size = lambda es: math.prod(low.size(e) for e in es)   # noqa: E731
                yield times * 2 * size(g.batch) * size(g.taps) * size(g.m) * size(g.n) * size(g.k)

    assert acc.product_flops() == sum(gemms(program.lowered)) > 0
    assert all(r.shape for r in acc.rows if r.product)
    assert all(r.nbytes > 0 for r in acc.rows if not r.product)
    # a step kernel moves its bytes once per step: the rows add up to `tgc explain`'s total
    from tgc.explain import _fixed_dims, kernel_bytes

    low = program.lowered
    env = _fixed_dims(low)
    assert sum(r.moved for r in acc.rows) == sum(kernel_bytes(low, k, env) for k in low.kernels)
    assert any(r.times > 1 and r.moved == r.times * r.nbytes for r in acc.rows if not r.product)


def test_conv2d_sym_accounting(breakdown):
    w = breakdown.Conv2dSym(batch=2)
    program, acc = counted(breakdown, w, 1e-3)
    check_sums(acc, 1e-3)
    assert acc.product_flops() == w.model_flops()   # y, dx and dK: one product each
    # each product reaches the one output it computes; every kernel reaches some output
    assert sorted(r.outputs for r in acc.rows if r.product) == [("dK",), ("dx",), ("y",)]
    assert all(r.outputs for r in acc.rows)
    dx = [r for r in acc.rows if r.outputs == ("dx",)]
    assert any(not r.product and r.flops for r in dx), "dx's column sum after its product is not counted with dx"


def test_attention_accounting_and_kernel_minima(breakdown):
    """The attention workload (2 heads x batch 2, t 64: one program, no stream) counts as
    the others; with `minima`, each kernel's least ticks over the calls: none above the
    fastest call's, and the rows with the loops' own still sum to the counted total."""
    w = breakdown.Attention(t=64, heads=2, batch=2)
    program, acc = counted(breakdown, w, 2e-3)
    check_sums(acc, 2e-3)
    assert acc.product_flops() > 0 and all(r.shape for r in acc.rows if r.product)
    least = breakdown.account(program, w.arrays(program), 5, acc.hz, minima=True)
    ticks = sum(r.ticks for r in least.rows) + least.loops
    assert ticks == pytest.approx(least.counted, rel=1e-12) and least.loops >= 0
    assert least.counted / least.hz <= least.wall * 1.01


def test_torch_breakdown(breakdown):
    torch = pytest.importorskip("torch", reason="the torch half profiles PyTorch eager")
    w = breakdown.Conv2dSym(batch=2)
    torch.set_num_threads(1)
    step = w.torch_step(w.arrays(None), None)
    prof = breakdown.torch_profile(step, 2)
    assert prof["products"] > 0, "no convolution op was classed as a product"
    assert set(prof["phases"]) == {"forward", "backward"}
    ops = prof["products"] + prof["attention"] + prof["other"]
    assert ops <= prof["wall"] * 1.05


def test_onednn_primitives(breakdown):
    torch = pytest.importorskip("torch", reason="the oneDNN half profiles PyTorch eager")
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    w = breakdown.Conv2dSym(batch=2)
    torch.set_num_threads(1)
    prims = breakdown.onednn_profile(w.torch_step(w.arrays(None), None), 2)
    assert prims is not None, "oneDNN's verbose mode printed no primitive"
    for _, prim in w.parts:   # the three convolutions, once each, each timed
        assert prims[prim][1] == 1 and prims[prim][0] > 0, (prim, prims)


def test_torch_breakdown_gpt(breakdown):
    torch = pytest.importorskip("torch", reason="the torch half profiles PyTorch eager")
    w = breakdown.NanoGPT(batch=2, sizes=TINY)
    program = breakdown.build(w.module, w.dims, w.options, False, 1)
    torch.set_num_threads(1)
    prof = breakdown.torch_profile(w.torch_step(w.arrays(program), program), 2)
    assert set(prof["phases"]) == {"forward", "backward", "clip", "adamw"}
    assert prof["products"] > 0 and prof["product_flops"] > 0 and prof["attention"] > 0
    assert prof["products"] + prof["attention"] + prof["other"] <= prof["wall"] * 1.05


def test_thread_split_on_a_tiny_gpt(breakdown, capsys):
    """benchmarks/thread_split.py on the tiny GPT step: a `thread_profile` row per
    counter for every call of both programs; on one thread the busy time is the
    kernel's time and no other thread works; the totals it prints add up its rows."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        split = importlib.import_module("thread_split")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    w = breakdown.NanoGPT(batch=2, sizes=TINY)
    rows, seen = split.measure(w, 2, 3)
    assert set(seen) == {1, 2} and all(len(calls) == 3 for calls in seen.values())
    assert all(len(call) == len(rows) for calls in seen.values() for call in calls)
    for call in seen[1]:
        assert all(all0 == own and rest == 0 and region == 0 for all0, own, rest, region in call)
    t = split.report(rows, seen, 2, 5)
    kernels = [i for i, r in enumerate(rows) if not r.loop]
    assert t["one"] == pytest.approx(sum(min(c[i][0] for c in seen[1]) for i in kernels) / 1e6)
    assert t["busiest"] >= max(t["own"], t["rest"]) > 0
    assert "all kernels: 1t" in capsys.readouterr().out


@pytest.mark.slow
def test_conv2d_probe_kernel_minima():
    """benchmarks/conv2d_probe.py `kernels`: one least thread time per kernel of the
    specialized conv2d_sym program and one per call, for each option variant (the
    variants' calls alternated); a variant names CpuOptions fields, and an unknown
    field is a clear exit, not a traceback."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        probe = importlib.import_module("conv2d_probe")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    dims = {"nb": 2, "cin": 4, "cout": 8, "hh": 8, "ww": 8}
    out, names = probe.kernel_minima(["base:", "t1:gemm_tiles=1"], 2, dims=dims)
    assert list(out) == ["base", "t1"]
    assert any(line.startswith(("gemm", "implicit")) for line in names), names
    for per_kernel, call in out.values():
        assert len(per_kernel) == len(names)
        assert all(t >= 0 for t in per_kernel) and sum(per_kernel) > 0
        assert 0 < call < math.inf
    with pytest.raises(SystemExit, match="no field 'gemm_tile'"):
        probe.kernel_minima(["bad:gemm_tile=1"], 1, dims=dims)


def _probe():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module("conv2d_probe")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_conv2d_probe_paired_shares():
    """`paired` reads perf's report: each tgc function's share of the samples in tgc's
    functions (a symbol's lines summed; other code and header lines left out)."""
    report = """# Samples: 13K of event 'cpu-clock:pppH'
#
    30.00%  [.] tgc.k0.own
    20.00%  [.] tgc.gemm.own.f32.b6.v4.taps
     5.00%  [.] _PyEval_EvalFrameDefault
    10.00%  [.] tgc.k3
    40.00%  [.] tgc.k0.own
"""
    shares = _probe().paired_shares(report)
    assert list(shares) == ["tgc.k0.own", "tgc.gemm.own.f32.b6.v4.taps", "tgc.k3"]
    assert shares["tgc.k0.own"] == pytest.approx(0.7) and shares["tgc.k3"] == pytest.approx(0.1)
    assert _probe().paired_shares("# nothing\n") == {}


def test_conv2d_probe_paired_unknown_field(monkeypatch):
    """`paired` with a variant naming no CpuOptions field exits with that message before
    it records anything (it was the recorded child's traceback)."""
    probe = _probe()
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/perf")
    args = probe.argparse.Namespace(variant="bad:gemm_tile=1", threads=1, seconds=0.1)
    with pytest.raises(SystemExit, match="no field 'gemm_tile'"):
        probe.paired(args)


@pytest.mark.slow
def test_conv2d_probe_perf_map(tmp_path):
    """`paired`'s perf map names each JIT function of a compiled program once, at its
    address, in ascending order (perf's `START SIZE NAME`, hex): the kernels, the
    implicit GEMM's own kernel copy and the own GEMM kernel included."""
    import tgc
    from tgc.options import CpuOptions, Options

    prog = tgc.compile(str(ROOT / "benchmarks" / "workloads" / "conv2d_sym.tg"),
                       options=Options(cpu=CpuOptions(threads=1)))
    path = tmp_path / "perf.map"
    count = _probe().perf_map(prog, str(path))
    rows = [line.split() for line in path.read_text().splitlines()]
    assert count == len(rows) > 0
    names = [r[2] for r in rows]
    assert len(set(names)) == len(names)
    assert any(n.startswith("tgc.k") for n in names), names
    starts = [int(r[0], 16) for r in rows]
    assert starts == sorted(starts) and all(int(r[1], 16) > 0 for r in rows)
    assert starts[0] == prog._kernels._jit.address(names[0])


def test_torch_steps_at_least_one(breakdown, capsys):
    """`--torch-steps 0` is a clear usage error before anything is timed (it was a
    TypeError after the tgc half had run: the torch half kept the fastest of no steps)."""
    with pytest.raises(SystemExit) as exc:
        breakdown.main(["--workload", "nanogpt", "--torch-steps", "0"])
    assert exc.value.code == 2
    assert "--torch-steps must be at least 1 (got 0)" in capsys.readouterr().err


def test_product_ab_on_a_tiny_gpt(breakdown, capsys):
    """benchmarks/product_ab.py on the tiny GPT step: one least CPU time per kernel for
    each variant (the defaults and a changed CpuOptions field), the totals it prints
    adding up its rows; a variant's bad field or value is a clear exit."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        ab = importlib.import_module("product_ab")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert ab.parse_variant("base:") == ("base", {})
    assert ab.parse_variant("x:gemm_merge_rows=off,own_gemm_panel_rows=256") == (
        "x", {"gemm_merge_rows": False, "own_gemm_panel_rows": 256})
    for bad, msg in (("x:gemm_tile=1", "no field 'gemm_tile'"), ("x:gemm_tiles=two", "not a value of gemm_tiles"),
                     ("x:gemm_merge_rows=maybe", "not a value"), (":gemm_tiles=1", "no name"),
                     ("x:gemm_tiles", "not field=value")):
        with pytest.raises(SystemExit, match=msg):
            ab.parse_variant(bad)
    w = breakdown.NanoGPT(batch=2, sizes=TINY)
    variants = dict(ab.parse_variant(v) for v in ("base:", "unmerged:gemm_merge_rows=off"))
    rows, best = ab.measure(w, variants, 1, 2)
    assert list(best) == ["base", "unmerged"] and all(len(v) == len(rows) for v in best.values())
    assert all(0 <= t < math.inf for v in best.values() for t in v)
    totals = ab.report(rows, best, 1, 214.0)
    kernels = [i for i, r in enumerate(rows) if not r.loop]
    products = [i for i in kernels if rows[i].product]
    assert products
    for name, (prod_ms, all_ms) in totals.items():
        assert prod_ms == pytest.approx(sum(best[name][i] for i in products) / 1e6)
        assert all_ms == pytest.approx(sum(best[name][i] for i in kernels) / 1e6)
        assert 0 < prod_ms <= all_ms
    out = capsys.readouterr().out
    assert "products: base" in out and "unmerged" in out
