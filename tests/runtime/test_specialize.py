"""Programs specialized to the sizes they are called with (tgc.runtime.specialize):
one per shape signature, by the rule of `Options.specialize_calls` and
`specialize_work`, with the generic program's results, from the on-disk cache in
a later process, and correct under threads."""
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc.ir.interp import EvalError, evaluate
from tgc.options import Options

CONV2D = Path(__file__).resolve().parents[2] / "benchmarks" / "workloads" / "conv2d_sym.tg"

STEP = """
dim b, d, h
input x[b, d]
param W[d, h]
input lr
y = tanh(x @ W)
loss = sum(y * y)
out loss
update W = W - lr * grad(loss, W)
"""

EAGER = Options(specialize_work=0)           # specialize a signature on its second call
NEVER = Options(specialize_calls=0)          # the generic program only


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TGC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TGC_CACHE", raising=False)
    return tmp_path


def conv_inputs(rng, nb, cin, cout, side):
    return {"x": rng.standard_normal((nb, cin, side, side)).astype(np.float32),
            "dy": rng.standard_normal((nb, cout, side, side)).astype(np.float32),
            "K": (rng.standard_normal((cout, cin, 3, 3)) / np.sqrt(9 * cin)).astype(np.float32)}


def assert_close(got, want):
    assert got.keys() == want.keys()
    for k in want:
        scale = max(float(np.abs(want[k]).max()), 1.0)
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-5 * scale, err_msg=k)


def test_two_shapes_two_specializations_with_the_generic_results(cache_dir):
    rng = np.random.default_rng(0)
    program = tgc.compile(str(CONV2D), options=EAGER)
    generic = tgc.compile(str(CONV2D), options=NEVER)
    module = generic.module
    for sizes in ((2, 3, 4, 5), (3, 2, 5, 7)):
        a = conv_inputs(rng, *sizes)
        want = generic(**a)
        exact = evaluate(module, a, dtype="f64")
        first = program(**a)
        assert program.last_variant is None    # a first call runs the generic program
        second = program(**a)
        assert program.last_variant is None    # so does the second, then its signature is specialized
        third = program(**a)
        assert program.last_variant is not None and program.last_variant.specialized
        assert program.last_variant.dims == dict(zip(("nb", "cin", "cout", "hh", "ww"), sizes[:3] + sizes[3:] * 2))
        for got in (first, second, third):
            assert_close(got, want)
            assert_close(got, {k: v.astype(np.float32) for k, v in exact.items()})
    variants = program.variants()
    assert [v.specialized for v in variants] == [True, True]
    assert [v.calls for v in variants] == [2, 2]
    assert [v.program.module.symbolic_dims() for v in variants] == [[], []]   # every dim fixed
    assert generic.variants() == [] and generic.last_variant is None


def test_a_shape_seen_once_runs_the_generic_program(cache_dir):
    rng = np.random.default_rng(1)
    program = tgc.compile(STEP, options=EAGER)
    for b in (2, 3, 4):
        W = np.full((5, 6), 0.1, np.float32)
        program(x=rng.standard_normal((b, 5)).astype(np.float32), W=W, lr=0.1)
        assert program.last_variant is None
    assert [(v.dims, v.calls, v.specialized) for v in program.variants()] == \
        [({"b": b, "d": 5, "h": 6}, 1, False) for b in (2, 3, 4)]


def test_calls_that_did_less_work_than_the_rule_stay_generic(cache_dir):
    program = tgc.compile(STEP, options=Options(specialize_work=1 << 40))
    x, W = np.ones((2, 3), np.float32), np.zeros((3, 4), np.float32)
    for _ in range(5):
        program(x=x, W=W, lr=0.1)
    [v] = program.variants()
    assert v.calls == 5 and not v.specialized and v.refused is None and program.last_variant is None
    assert v.work > 0   # reckoned at the second call: FLOPs plus bytes of one call


def test_at_most_specialize_max_signatures(cache_dir):
    program = tgc.compile(STEP, options=EAGER.with_(specialize_max=1))
    W = np.zeros((3, 4), np.float32)
    for b in (2, 3):
        for _ in range(3):
            program(x=np.ones((b, 3), np.float32), W=W, lr=0.1)
    assert [v.specialized for v in program.variants()] == [True, False]


def test_updates_and_forward_calls_match_the_generic_program(cache_dir):
    rng = np.random.default_rng(2)
    program, generic = tgc.compile(STEP, options=EAGER), tgc.compile(STEP, options=NEVER)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    W0 = (0.3 * rng.standard_normal((5, 6))).astype(np.float32)
    W, Wg = W0.copy(), W0.copy()
    for _ in range(4):
        got, want = program(x=x, W=W, lr=0.05), generic(x=x, W=Wg, lr=0.05)
        assert got["W"] is W   # the caller's array, updated in place
        np.testing.assert_allclose(W, Wg, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    assert program.last_variant is not None
    for _ in range(3):
        fwd = program.run({"x": x, "W": W}, updates=False)
    np.testing.assert_allclose(fwd["loss"], generic.run({"x": x, "W": W}, updates=False)["loss"], rtol=1e-5)
    assert program.without_updates().last_variant is not None


def test_fp_strict_specializations_take_f32_arrays(cache_dir):
    program = tgc.compile(STEP, options=EAGER.with_(fp_strict=True))
    generic = tgc.compile(STEP, options=NEVER.with_(fp_strict=True))
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    W, Wg = np.full((4, 2), 0.25, np.float32), np.full((4, 2), 0.25, np.float32)
    for _ in range(3):
        got, want = program(x=x, W=W, lr=0.1), generic(x=x, W=Wg, lr=0.1)
    assert program.last_variant is not None and got["loss"].dtype == np.float32
    np.testing.assert_array_equal(W, Wg)
    np.testing.assert_array_equal(got["loss"], want["loss"])


def test_a_call_the_specialization_refuses_gets_the_generic_message(cache_dir):
    rng = np.random.default_rng(3)
    program, generic = tgc.compile(str(CONV2D), options=EAGER), tgc.compile(str(CONV2D), options=NEVER)
    a = conv_inputs(rng, 2, 3, 4, 5)
    for _ in range(3):
        program(**a)
    assert program.last_variant is not None
    bad = dict(a, dy=a["dy"][:, :, :4])       # x binds the signature; dy disagrees
    with pytest.raises(EvalError) as want:
        generic(**bad)
    with pytest.raises(EvalError) as got:
        program(**bad)
    assert str(got.value) == str(want.value)
    program(**a)
    assert program.last_variant is not None and program.variants()[0].refused is None


def test_threads_share_the_specializations(cache_dir):
    rng = np.random.default_rng(4)
    program, generic = tgc.compile(STEP, options=EAGER), tgc.compile(STEP, options=NEVER)
    shapes = [(3, 4), (5, 4), (2, 6)]
    data = {s: (rng.standard_normal(s).astype(np.float32), (0.2 * rng.standard_normal((s[1], 7))).astype(np.float32))
            for s in shapes}
    want = {}
    for s, (x, W) in data.items():
        W1 = W.copy()
        want[s] = (generic(x=x, W=W1, lr=0.01)["loss"], W1)
    errors = []

    def work(i):
        try:
            for n in range(24):
                s = shapes[(i + n) % len(shapes)]
                x, W = data[s]
                W1 = W.copy()
                loss = program(x=x, W=W1, lr=0.01)["loss"]
                if abs(float(loss) - float(want[s][0])) > 1e-5 * abs(float(want[s][0])) or \
                        not np.allclose(W1, want[s][1], rtol=1e-6, atol=1e-7):
                    errors.append((s, float(loss), float(want[s][0])))
        except Exception as e:   # noqa: BLE001 -- reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted((v.dims["b"], v.dims["d"]) for v in program.variants() if v.specialized) == sorted(shapes)


REUSE = textwrap.dedent("""
    import sys, numpy as np, tgc
    from tgc.backends.cpu import kernels
    from tgc.options import Options
    built = []
    compile_objects = kernels._machine_code
    kernels._machine_code = lambda *a: built.append(1) or compile_objects(*a)
    program = tgc.compile(sys.argv[1], options=Options(specialize_work=0))
    x, W = np.ones((3, 4), np.float32), np.full((4, 5), 0.5, np.float32)
    for _ in range(3):
        loss = program(x=x, W=W, lr=0.1)["loss"]
    print(len(built), program.last_variant is not None, repr(float(loss)))
""")


def test_the_specialization_comes_from_the_disk_cache_in_a_new_process(cache_dir, tmp_path):
    source = tmp_path / "step.tg"
    source.write_text(STEP)
    env = {**os.environ, "TGC_CACHE_DIR": str(cache_dir / "cache")}

    def run():
        r = subprocess.run([sys.executable, "-c", REUSE, str(source)], capture_output=True, text=True,
                           timeout=300, env=env)
        assert r.returncode == 0, r.stderr
        return r.stdout.split()

    built, specialized, loss = run()
    assert built == "2" and specialized == "True"   # the generic program and one specialization
    again = run()
    assert again == ["0", "True", loss]             # both from the cache: nothing compiled


CONV_SIZES = ["--dim", "nb=16", "--dim", "cin=32", "--dim", "cout=64", "--dim", "hh=32", "--dim", "ww=32"]


def test_explain_says_which_program_it_explains():
    import json

    from click.testing import CliRunner

    from tgc.cli.app import main

    generic = CliRunner().invoke(main, ["explain", str(CONV2D), *CONV_SIZES])
    special = CliRunner().invoke(main, ["explain", str(CONV2D), *CONV_SIZES, "--specialized"])
    assert generic.exit_code == 0 and special.exit_code == 0, generic.output + special.output
    assert generic.output.splitlines()[1].startswith("program: generic")
    assert special.output.splitlines()[1].startswith("program: specialized to these sizes")
    data = json.loads(CliRunner().invoke(main, ["explain", str(CONV2D), *CONV_SIZES, "--specialized",
                                                "--format", "json"]).output)
    assert data["program"] == "specialized" and data["dims"]["cin"] == 32


def test_the_specialization_plans_for_its_sizes():
    # Where tgc's own GEMM kernel runs (forced here: lowering only, nothing runs), fixed
    # sizes let the convolution's products pack the im2col window from the images
    # (`implicit`) instead of storing it: what the specialization gains on such a host.
    from tgc import pipeline
    from tgc.explain import explain
    from tgc.options import CpuOptions

    options = Options(cpu=CpuOptions(own_gemm="on"))
    module = pipeline.lower(pipeline.load(str(CONV2D), options), options).module
    sizes = {"nb": 16, "cin": 32, "cout": 64, "hh": 32, "ww": 32}
    reports = [explain(pipeline.lower_module(m, options), module.bind_dims(sizes))
               for m in (module, pipeline.fix_dims(module, sizes))]
    kinds = [[k["kind"] for k in r["kernels"]] for r in reports]
    assert "implicit" not in kinds[0] and kinds[1].count("implicit") == 2
    assert reports[1]["workspace"]["bytes"] < reports[0]["workspace"]["bytes"] / 3


def test_a_profiled_program_is_not_specialized(cache_dir):
    from tgc.options import CpuOptions

    program = tgc.compile(STEP, options=EAGER.with_(cpu=CpuOptions(profile=True)))
    x, W = np.ones((2, 3), np.float32), np.zeros((3, 4), np.float32)
    for _ in range(3):
        program(x=x, W=W, lr=0.1)
    assert program.variants() == [] and program.last_variant is None


def test_a_dim_given_by_dims_is_part_of_the_signature(cache_dir):
    from tgc.ir.parser import parse_module

    module = parse_module("""
dim n
input s : f32[]
%0 = size[n] : f32[]
%1 = add[1.0, 1.0] %0, %s : f32[]
%2 = contract %1 : f32[n]
out y = %2 : [n]
""")
    program = tgc.compile(module, options=EAGER)
    for n in (3, 3, 3, 4, 4, 4):
        got = program.run({"s": 0.5}, dims={"n": n})
        np.testing.assert_array_equal(got["y"], evaluate(module, {"s": np.float32(0.5)}, dims={"n": n})["y"])
    assert program.last_variant is not None and program.last_variant.dims == {"n": 4}
    assert [v.dims for v in program.variants() if v.specialized] == [{"n": 3}, {"n": 4}]


def test_the_specialization_lowers_as_the_sizes_fixed_in_the_source():
    # conv2d_sym.tg with conv2d.tg's edge names: specialized to conv2d.tg's sizes, the
    # same kernels as conv2d.tg (its sizes fixed in the file, the batch by dims=)
    import re

    from tgc import pipeline

    options = Options()
    text = re.sub(r"\bnb\b", "batch", CONV2D.read_text())
    text = re.sub(r"\bhh\b", "h", re.sub(r"\bww\b", "w", text))

    def kernels(source, dims):
        module = pipeline.lower(pipeline.load_program("<source>", options, source).module, options).module
        return [k.text() for k in pipeline.lower_module(pipeline.fix_dims(module, dims), options).kernels]

    fixed = CONV2D.with_name("conv2d.tg").read_text()
    assert kernels(text, {"batch": 16, "cin": 32, "cout": 64, "h": 32, "w": 32}) == kernels(fixed, {"batch": 16})


CAUSAL = """
dim b, h, t, e
dim s = t
input q[b, h, t, e], k[b, h, s, e], v[b, h, s, e], dy[b, h, t, e]
y = sum[s](softmax[s](where([s <= t], dot[e](q, k) / sqrt(size(e)), -1e9)) * v)
out y[b, h, t, e]
out dq[b, h, t, e] = grad(sum(y * dy), q)
out dk[b, h, s, e] = grad(sum(y * dy), k)
"""


def test_a_specialization_streams_a_long_attention_that_the_generic_program_keeps_whole(cache_dir):
    # `stream` blocks only an edge of known size: over a symbolic t, a causal attention's
    # [t, s] matrices are whole in the generic program; its specialization to t = 512
    # streams them over blocks of queries (the threshold lowered so that t = 512
    # streams), with the generic program's values
    from tgc.explain import explain

    options = EAGER.with_(stream_min_elements_masked=1 << 16, stream_block=128)
    program = tgc.compile(CAUSAL, options=options)
    rng = np.random.default_rng(0)
    inputs = {n: rng.standard_normal((1, 2, 512, 16)).astype(np.float32) for n in ("q", "k", "v", "dy")}
    generic = program(**inputs)
    for _ in range(2):   # the second call builds the specialization, the third runs it
        special = program(**inputs)
    variant = program.last_variant
    assert variant is not None and variant.specialized
    sizes = {"b": 1, "h": 2, "t": 512, "e": 16}
    peaks = [explain(p.lowered, p.module.bind_dims(sizes))["peak"]["bytes"] for p in (program, variant.program)]
    assert peaks[1] < peaks[0] / 2, peaks
    steps = [sum("steps over t" in k.text() for k in p.lowered.kernels) for p in (program, variant.program)]
    assert steps[0] == 0 and steps[1] > 0, steps
    assert_close(special, generic)


LONG = EAGER.with_(specialize_work=1 << 62, stream_min_elements_masked=1 << 16, stream_block=128,
                   specialize_at_bytes=1 << 20, specialize_first_work=None)   # the calls' rule never; the first-call one at 1 MiB
# the first-call rule by work alone: the specialization's call must do 1M FLOPs plus bytes fewer
SAVES = LONG.with_(specialize_at_bytes=None, specialize_first_work=1 << 20)


def causal_inputs(t):
    rng = np.random.default_rng(t)
    return {n: rng.standard_normal((1, 2, t, 16)).astype(np.float32) for n in ("q", "k", "v", "dy")}


def test_a_first_call_that_would_hold_large_temporaries_runs_the_specialization(cache_dir):
    # The generic program keeps the [t, s] matrices whole: 6.3 MB at t = 512, past the
    # threshold, where the specialization streams them; 98 kB at t = 64, under it
    program = tgc.compile(CAUSAL, options=LONG)
    never = tgc.compile(CAUSAL, options=LONG.with_(specialize_calls=0))
    small = program(**causal_inputs(64))
    assert program.last_variant is None
    [v] = program.variants()
    assert v.peak is not None and v.peak < 1 << 20 and v.special_peak is None and not v.specialized
    large = program(**causal_inputs(512))
    variant = program.last_variant
    assert variant is not None and variant.specialized and variant.at_once and variant.calls == 0
    assert variant.dims["t"] == 512 and variant.peak >= 1 << 20 and 2 * variant.special_peak <= variant.peak
    assert_close(small, never(**causal_inputs(64)))
    assert_close(large, never(**causal_inputs(512)))


def test_a_specialization_that_would_hold_as_much_is_not_built_on_the_first_call(cache_dir):
    # Without streaming the specialization keeps the matrices too: the generic program
    # runs, nothing is compiled and nothing refused (the calls' rule may still build it)
    program = tgc.compile(CAUSAL, options=LONG.with_(stream_block=0))
    program(**causal_inputs(512))
    [v] = program.variants()
    assert program.last_variant is None and not v.specialized and not v.at_once and v.refused is None
    assert v.peak >= 1 << 20 and 2 * v.special_peak > v.peak and v.compile_seconds is None


def test_a_first_call_whose_specialization_saves_its_compile_runs_it(cache_dir):
    # At t = 512 the specialization streams the [t, s] matrices (65k elements each, past
    # the lowered stream threshold) and skips the masked keys: one call does fewer FLOPs
    # plus bytes than the generic program's by more than specialize_first_work, so the
    # first call runs it (the peak rule is off); at t = 64 no temporary reaches stream's
    # threshold, so the generic work is not even reckoned
    program = tgc.compile(CAUSAL, options=SAVES)
    never = tgc.compile(CAUSAL, options=SAVES.with_(specialize_calls=0))
    small = program(**causal_inputs(64))
    [v] = program.variants()
    assert program.last_variant is None and v.work is None and v.special_work is None and not v.specialized
    large = program(**causal_inputs(512))
    variant = program.last_variant
    assert variant is not None and variant.at_once and variant.first_reason == "work" and variant.calls == 0
    assert variant.work - variant.special_work >= 1 << 20 and variant.special_peak <= variant.peak, variant
    assert "on its first call: work" in repr(variant)
    assert_close(small, never(**causal_inputs(64)))
    assert_close(large, never(**causal_inputs(512)))


@pytest.mark.parametrize("why", ["saves less than the bound", "same work", "no stream"])
def test_a_first_call_whose_specialization_saves_less_runs_the_generic_program(cache_dir, why):
    # Saving less than specialize_first_work (the default's 2^36, about the compile's
    # time in saved work), a specialization that does the same work (nothing streams at
    # a higher threshold), or no `stream` in the pipeline at all: the first call runs
    # the generic program, nothing is compiled and nothing refused
    options = {"saves less than the bound": SAVES.with_(specialize_first_work=1 << 36),
               "same work": SAVES.with_(stream_min_elements_masked=1 << 24, stream_min_elements=1 << 24),
               "no stream": SAVES.with_(stream_block=0)}[why]
    program = tgc.compile(CAUSAL, options=options)
    program(**causal_inputs(512))
    [v] = program.variants()
    assert program.last_variant is None and not v.specialized and not v.at_once and v.refused is None
    assert v.compile_seconds is None and v.first_reason is None
    if why == "saves less than the bound":   # reckoned (a temporary stream may block), under the bound
        assert v.work is not None and v.work < 1 << 36 and v.special_work is None
    else:   # no temporary that stream would block: nothing reckoned
        assert v.work is None and v.special_work is None


def test_a_large_first_call_past_specialize_max_replaces_the_least_recently_used(cache_dir):
    # Sizes that change every call: with specialize_max signatures already specialized, a
    # new size whose generic program would hold specialize_at_bytes of temporaries must not
    # fall back to it (a long attention's generic peak grows as t^2: 1.8 GB where the
    # specialization holds 65 MB at t = 8192, measured with a transformer layer). The least
    # recently run specialization gives way (its code and workspace freed), so at most
    # specialize_max stay loaded, and a size seen again is specialized again on its call.
    program = tgc.compile(CAUSAL, options=LONG.with_(specialize_max=2))
    never = tgc.compile(CAUSAL, options=LONG.with_(specialize_calls=0))
    for t in (512, 576, 512, 640, 576):
        got = program(**causal_inputs(t))
        variant = program.last_variant
        assert variant is not None and variant.specialized and variant.dims["t"] == t, (t, program.variants())
        assert_close(got, never(**causal_inputs(t)))
        assert sum(v.specialized for v in program.variants()) <= 2
    # 576 gave way to 640 (512 ran after it), then 512 to 576
    assert sorted(v.dims["t"] for v in program.variants() if v.specialized) == [576, 640]


def test_a_specialization_given_way_frees_its_program(cache_dir):
    import gc
    import weakref

    program = tgc.compile(CAUSAL, options=LONG.with_(specialize_max=1))
    program(**causal_inputs(512))
    first = weakref.ref(program.last_variant.program)
    program(**causal_inputs(576))
    gc.collect()
    assert first() is None
