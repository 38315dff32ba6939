"""Random draws with explicit keys: `rand[e, ...](key)`, `randn[e, ...](key)`, `fold(key, n)`
and the prelude's `dropout` (docs/language.md, "Randomness"; tgc/ir/philox.py).

- Philox 4x32-10 against the published known-answer vectors (Random123's kat_vectors);
- statistics: mean, variance, uniformity (chi-square, Kolmogorov-Smirnov) of 1e5 draws
  with fixed keys, and no correlation across keys, folds and neighbouring counters;
- bit-exact agreement of the IR interpreter, the lowered interpreter (every lowering
  stage) and the CPU backend (1 and 4 threads), in f32 and f64, with draws fused into
  bigger kernels, read through renames, transposed outputs and reductions;
- IR text round trip, hash-consing (one draw per key, folds, kind and edges), facts;
- dropout: its value, p = 0 exactly x, its derivative against finite differences with
  the key fixed, and a training step that compiles and runs;
- misuse reported as file:line:col errors.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.frontend import compile_source
from tgc.ir import values as V
from tgc.ir.diag import CompileError
from tgc.ir.interp import evaluate
from tgc.ir.inputs import random_inputs
from tgc.lower.interp import run_lowered
from tgc.ir.parser import parse_module
from tgc.ir.philox import draw_numpy, philox_block
from tgc.ir.printer import print_module
from tgc.options import Options
from tgc.opt.facts import Facts
from tgc.manager import run_pipeline
from tgc.pipeline import lower_module

N = 100_000
F = 0xFFFFFFFF


# ---------------------------------------------------------------- Philox itself

@pytest.mark.parametrize("counter, key, want", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((F, F, F, F), (F, F), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(counter, key, want):
    assert philox_block(counter, key) == want


def test_uniform_is_the_top_bits_of_the_words():
    """f32: (w0 >> 8) 2^-24; f64: ((w0 >> 5) 2^26 + (w1 >> 6)) 2^-53, at counter (i, 0, 0, 0)."""
    for i in (0, 1, 12345, 2 ** 33 + 7):
        w = philox_block((i & F, i >> 32, 0, 0), (5, 0))
        assert draw_numpy("rand", "f32", 5, (), np.array([i]))[0] == np.float32((w[0] >> 8) * 2.0 ** -24)
        assert draw_numpy("rand", "f64", 5, (), np.array([i]))[0] == ((w[0] >> 5) * 2 ** 26 + (w[1] >> 6)) * 2.0 ** -53


def test_fold_is_a_philox_block_of_the_key():
    k0, k1 = philox_block((3, 0, 1, 0), (9, 0))[:2]
    w = philox_block((4, 0, 0, 0), (k0, k1))
    assert draw_numpy("rand", "f32", 9, (3,), np.array([4]))[0] == np.float32((w[0] >> 8) * 2.0 ** -24)


def test_negative_keys_are_their_32_bit_pattern():
    w = philox_block((0, 0, 0, 0), (2 ** 32 - 3, 0))
    assert draw_numpy("rand", "f32", -3, (), np.array([0]))[0] == np.float32((w[0] >> 8) * 2.0 ** -24)


# ---------------------------------------------------------------- statistics

def _normal_cdf(x):
    return 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def _ks(sample, cdf) -> float:
    s = np.sort(sample.astype(np.float64))
    f = cdf(s)
    n = len(s)
    return max(np.max(np.arange(1, n + 1) / n - f), np.max(f - np.arange(n) / n))


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_uniform_statistics(dtype):
    u = draw_numpy("rand", dtype, 2024, (), np.arange(N)).astype(np.float64)
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / N)
    assert abs(u.var() - 1 / 12) < 5 * math.sqrt(1 / 180 / N)   # var of (u - 1/2)^2 is 1/180
    counts = np.bincount((u * 100).astype(int), minlength=100)
    chi2 = np.sum((counts - N / 100) ** 2 / (N / 100))
    assert chi2 < 148.2                                       # 99 degrees of freedom, p = 0.001
    assert _ks(u, lambda x: x) < 1.95 / math.sqrt(N)          # p = 0.001


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_normal_statistics(dtype):
    z = draw_numpy("randn", dtype, 77, (), np.arange(N)).astype(np.float64)
    assert np.all(np.isfinite(z))
    assert abs(z.mean()) < 5 / math.sqrt(N)
    assert abs(z.var() - 1) < 5 * math.sqrt(2 / N)
    assert abs(np.mean(z ** 3)) < 5 * math.sqrt(15 / N)       # symmetric
    assert abs(np.mean(z ** 4) - 3) < 5 * math.sqrt(96 / N)   # normal tails
    assert _ks(z, _normal_cdf) < 1.95 / math.sqrt(N)


def test_normal_functions_match_libm():
    """The polynomial log and cos of Box-Muller agree with numpy's to float64 accuracy."""
    from tgc.ir.philox import NUMPY, _log, _normal
    x = np.linspace(2.0 ** -53, 1.0, 10001)
    np.testing.assert_allclose(_log(NUMPY, x), np.log(x), rtol=4e-16, atol=1e-300)
    words = [np.arange(4000, dtype=np.uint64) * np.uint64(1_000_003) & np.uint64(F) for _ in range(4)]
    words[2] = (np.arange(4000, dtype=np.uint64) * np.uint64(1_073_741) + np.uint64(12345)) & np.uint64(F)
    z = _normal(NUMPY, "f64", words)
    U = ((words[0] >> np.uint64(5)) << np.uint64(26) | (words[1] >> np.uint64(6))).astype(np.float64)
    T = ((words[2] >> np.uint64(5)) << np.uint64(26) | (words[3] >> np.uint64(6))).astype(np.float64)
    want = np.sqrt(-2 * np.log((U + 1) * 2.0 ** -53)) * np.cos(2 * np.pi * T * 2.0 ** -53)
    np.testing.assert_allclose(z, want, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("a, b", [
    ((1, ()), (2, ())), ((1, ()), (1, (0,))), ((1, (0,)), (1, (1,))), ((1, (0, 1)), (1, (1, 0))),
    ((-1, ()), (2 ** 31 - 1, ())),
])
def test_independent_across_keys_and_folds(a, b):
    x = draw_numpy("randn", "f64", a[0], a[1], np.arange(N))
    y = draw_numpy("randn", "f64", b[0], b[1], np.arange(N))
    assert abs(np.corrcoef(x, y)[0, 1]) < 5 / math.sqrt(N)
    u = draw_numpy("rand", "f32", a[0], a[1], np.arange(N))
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 5 / math.sqrt(N)   # neighbouring counters


# ---------------------------------------------------------------- the backends agree bit for bit

DRAWS = """
dim i = 37, j = 29, k = 6
input key: i32
input x[i, j]
u = rand[i, j](key)
z = randn[j, k](fold(key, 3))
out u
out zt[k, j] = z                                  # transposed output
out w[j, i] = rand[i, j](fold(fold(key, 1), 2))
out m = max[j](where(u >= 0.5, x, -1) + 0 * x)    # a draw fused into a reduction's kernel
out mz[i, k] = max[j](z + x)                      # a draw read at another kernel's loops
input x2[i2: i]                                   # declares edge i2, of i's size
r = rand[i, j](key)[i -> i2]                      # through a rename
out r
out d = dropout[i, j](x, key, 0.5)                # x / (1 - p) = 2 x: exact in every path
"""


def _all_paths(source: str, dtype: str, inputs: dict):
    opts = Options(dtype=dtype)
    m = pipeline.lower(compile_source(source, "<draws>", opts), opts).module
    yield "interp", evaluate(m, {k: np.copy(v) for k, v in inputs.items()}, dtype=dtype)
    for stage in ("fuse", "layout", "group", "plan"):
        low = lower_module(m, opts, stop_after=stage)
        yield f"lowered after {stage}", run_lowered(low, {k: np.copy(v) for k, v in inputs.items()})
    for threads in (1, 4):
        program = tgc.compile(source, dtype=dtype, options=Options(dtype=dtype).with_(
            threads=threads, parallel_min_work=1, parallel_min_work_warm=1))
        yield f"cpu, {threads} threads", program(**{k: np.copy(v) for k, v in inputs.items()})


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("key", [0, 12345, -7])
def test_interpreters_and_cpu_agree_bit_for_bit(dtype, key):
    rng = np.random.default_rng(key & 0xFF)
    fp = dtype.replace("f", "float")
    inputs = {"key": np.int32(key), "x": rng.standard_normal((37, 29)).astype(fp), "x2": np.zeros(37, fp)}
    results = list(_all_paths(DRAWS, dtype, inputs))
    name0, want = results[0]
    assert want["u"].dtype == np.dtype(dtype.replace("f", "float"))
    for name, got in results[1:]:
        for out in want:
            np.testing.assert_array_equal(got[out], want[out], err_msg=f"{out}: {name} vs {name0}")
    u, zt, r = want["u"], want["zt"], want["r"]
    np.testing.assert_array_equal(r.T, u)                     # a rename reads the same draw (r is [j, i2])
    np.testing.assert_array_equal(zt, draw_numpy("randn", dtype, key, (3,), np.arange(29 * 6).reshape(29, 6)).T)
    assert not np.array_equal(want["w"].T, u)                  # another key


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_fp_strict_draws_are_the_interpreters(dtype):
    """--fp-strict runs an f32 program as f64 rounded to f32 (emulate_f32): its draws stay
    f32 draws (`random[... as f32]`, exact in f64), never f64 ones rounded (possibly to 1.0)."""
    src = "dim i = 300, j = 7\ninput key: i32\nout u = rand[i, j](key)\nout z = randn[j, i](fold(key, 9))\n"
    m = compile_source(src, "t.tg", Options(dtype=dtype))
    want = evaluate(m, {"key": 99})
    got = tgc.compile(src, dtype=dtype, options=Options(dtype=dtype, fp_strict=True))(key=np.int32(99))
    for k in want:
        assert got[k].dtype == want[k].dtype
        np.testing.assert_array_equal(got[k], want[k])
    if dtype == "f32":
        from tgc.ir.emulate import emulate_f32
        text = print_module(emulate_f32(m))
        assert "random[rand as f32] %key : f64[i, j]" in text and "round32" not in text
        assert print_module(parse_module(text)) == text


def test_draws_do_not_depend_on_the_edges_around_them():
    """A draw over [i, j] is the same in a program that also has other edges and values."""
    small = compile_source("dim i = 4, j = 3\ninput key: i32\nout u = rand[i, j](key)\n", "<a>")
    big = compile_source("dim a = 9, i = 4, j = 3\ninput key: i32\ninput y[a, i]\n"
                         "out u = rand[i, j](key)\nout s = sum[a](y * rand[i, j](key))\n", "<b>")
    a = evaluate(small, {"key": 5})["u"]
    b = evaluate(big, {"key": 5, "y": np.ones((9, 4), np.float32)})["u"]
    np.testing.assert_array_equal(a, b)
    # edge names matter only through their order: [i, j] and [a, b] (a < b) are one
    # stream; [z, b] sorts b first, and the renamed [i -> z] keeps the draw over (i, j)
    names = compile_source("dim i = 4, j = 3\ninput key: i32\ninput t[a: i, b: j, z: i]\n"
                           "out u[i, j] = rand[i, j](key)\nout v[a, b] = rand[a, b](key)\n"
                           "out w[z, b] = rand[z, b](key)\nout r[z, j] = rand[i, j](key)[i -> z]\n", "<c>")
    got = evaluate(names, {"key": 5, "t": np.zeros((4, 3, 4), np.float32)})
    np.testing.assert_array_equal(got["u"], got["v"])
    np.testing.assert_array_equal(got["u"], got["r"])
    assert not np.array_equal(got["u"], got["w"])
    np.testing.assert_array_equal(got["w"].T.reshape(-1), a.reshape(-1))   # rows of w's [b, z] order


# ---------------------------------------------------------------- the IR

def test_ir_text_round_trip_and_verify_each():
    m = compile_source(DRAWS, "<draws>", Options(dtype="f64"))
    text = print_module(m)
    assert "random[randn: 3] %key : f64[j, k]" in text
    assert "random[rand: 1, 2] %key : f64[i, j]" in text
    assert print_module(parse_module(text)) == text
    run_pipeline(m, Options(dtype="f64", verify_each=True))


def test_one_draw_per_key_kind_and_edges():
    """Hash-consing: the same key, folds, kind and edges are one value (a draw is
    deterministic); another key, fold or kind is another value, never merged."""
    k, k2 = V.arg("k", "i32", ()), V.arg("k2", "i32", ())
    a = V.random("rand", k, (), "f32", ["i"])
    assert V.random("rand", k, (), "f32", ["i"]) is a
    assert V.random("rand", V.fold(k, 1), (), "f32", ["i"]) is V.random("rand", k, (1,), "f32", ["i"])
    others = [V.random("rand", k2, (), "f32", ["i"]), V.random("randn", k, (), "f32", ["i"]),
              V.random("rand", k, (1,), "f32", ["i"]), V.random("rand", k, (2,), "f32", ["i"]),
              V.random("rand", V.fold(V.fold(k, 1), 2), (), "f32", ["i"]),
              V.random("rand", V.fold(V.fold(k, 2), 1), (), "f32", ["i"])]
    assert len({id(v) for v in [a] + others}) == len(others) + 1


def _optimized(src: str):
    opts = Options(dtype="f64")
    return run_pipeline(compile_source(src, "t.tg", opts), opts).module


def test_simplify_cancels_one_draw_and_keeps_two():
    same = _optimized("dim i = 5\ninput key: i32\nout y = rand[i](key) - rand[i](key)\n")
    assert not [v for v in same.values() if v.op == "random"]
    two = _optimized("dim i = 5\ninput key: i32\ninput key2: i32\n"
                     "out y = rand[i](key) - rand[i](key2) + rand[i](fold(key, 1)) - rand[i](fold(key, 2))\n")
    assert len([v for v in two.values() if v.op == "random"]) == 4


def test_facts():
    k = V.arg("k", "i32", ())
    u, z = V.random("rand", k, (), "f64", ["i"]), V.random("randn", k, (), "f64", ["i"])
    facts = Facts()
    assert facts.finite(u) and facts.nonneg(u) and facts.upper(u) == 1.0
    assert facts.finite(z) and not facts.nonneg(z)


# ---------------------------------------------------------------- dropout

DROPOUT = """
dim b = 50, h = 40
input key: i32
input x[b, h]
input p
out y = dropout[b, h](x, key, p)
out g = grad(sum(dropout[b, h](x * x, fold(key, 7), p)), x)
"""


def test_dropout_value():
    m = _optimized(DROPOUT)
    x = np.random.default_rng(0).standard_normal((50, 40))
    for p in (0.0, 0.25, 0.9):
        y = evaluate(m, {"key": 3, "x": x, "p": p}, dtype="f64")["y"]
        keep = draw_numpy("rand", "f64", 3, (), np.arange(2000).reshape(50, 40)) >= p
        np.testing.assert_allclose(y, np.where(keep, x / (1 - p), 0.0), rtol=4e-16)
        if p == 0:
            np.testing.assert_array_equal(y, x)
        assert abs(keep.mean() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / 2000) + 1e-12


def test_dropout_derivative_against_finite_differences():
    m = _optimized(DROPOUT)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((50, 40))
    loss = compile_source(DROPOUT.replace("out y = dropout[b, h](x, key, p)\n", "")
                          .replace("out g = grad(", "out f = ").replace(", x)\n", "\n"), "t.tg",
                          Options(dtype="f64"))
    inputs = {"key": 11, "x": x, "p": 0.4}
    g = evaluate(m, inputs, dtype="f64")["g"]
    h = 1e-6
    for idx in [(0, 0), (3, 7), (49, 39), (20, 1), (11, 30)]:
        e = np.zeros_like(x)
        e[idx] = h
        up = evaluate(loss, {**inputs, "x": x + e}, dtype="f64")["f"]
        down = evaluate(loss, {**inputs, "x": x - e}, dtype="f64")["f"]
        assert abs((up - down) / (2 * h) - g[idx]) < 1e-6 * max(1, abs(g[idx]))
    keep = draw_numpy("rand", "f64", 11, (7,), np.arange(2000).reshape(50, 40)) >= 0.4
    np.testing.assert_allclose(g, np.where(keep, 2 * x / 0.6, 0.0), rtol=1e-14)


TRAIN = """
dim batch, features = 5, hidden = 16, classes = 3
input x[batch, features]
input y[batch, classes]
input key: i32
param W1[features, hidden], b1[hidden]
param W2[hidden, classes], b2[classes]
input lr
h = dropout[batch, hidden](relu(x @ W1 + b1), fold(key, 1), 0.25)
logits = dropout[batch, classes](h @ W2 + b2, fold(key, 2), 0.1)
loss = mean[batch](cross_entropy[classes](logits, y))
out loss
update W1 = W1 - lr * grad(loss, W1)
update W2 = W2 - lr * grad(loss, W2)
update b1 = b1 - lr * grad(loss, b1)
"""


def test_a_training_step_with_dropout_compiles_and_agrees_with_the_interpreter():
    rng = np.random.default_rng(2)
    arrays = dict(x=rng.standard_normal((32, 5)), y=np.eye(3)[rng.integers(0, 3, 32)],
                  W1=0.3 * rng.standard_normal((5, 16)), b1=np.zeros(16), W2=0.3 * rng.standard_normal((16, 3)),
                  b2=np.zeros(3), lr=0.1)
    step = tgc.compile(TRAIN, dtype="f64")
    m = _optimized(TRAIN)
    losses = []
    for it in range(20):
        want = evaluate(m, {**arrays, "key": it}, dtype="f64")
        got = step(**arrays, key=np.int32(it))
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-10)
        np.testing.assert_allclose(arrays["W1"], want["W1"], rtol=1e-9, atol=1e-12)
        losses.append(float(got["loss"]))
    assert all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < np.mean(losses[:5])


ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
WITH_DROPOUT = {   # example -> (replacements that add dropout to it), each must apply once
    "gpt.tg": [("x0 = wte[vocab = ids] + wpe", "input key: i32\nx0 = dropout[batch, t, c](wte[vocab = ids] + wpe, key, 0.1)"),
               ("xf = layernorm[c](x2,", "xf = layernorm[c](dropout[batch, t, c](x2, fold(key, 1), 0.1),")],
    "train_digits.tg": [("logits = pool2 @ W + b", "input key: i32\nlogits = dropout[batch, ch2, h4, w4](pool2, key, 0.25) @ W + b")],
}


@pytest.mark.parametrize("name", sorted(WITH_DROPOUT))
def test_examples_train_with_dropout(name):
    """An example's training step with dropout layers compiles and runs on the CPU, to
    the interpreter's values, and another key drops other units."""
    path = ROOT / "examples" / name
    src = path.read_text()
    for old, new in WITH_DROPOUT[name]:
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    opts = Options(dtype="f64")
    source_module = compile_source(src, str(path), opts)    # imports are relative to the example
    m = run_pipeline(source_module, opts).module
    x = random_inputs(m, m.bind_dims({d: 4 for d in m.symbolic_dims()}), 0, "f64")
    step = tgc.compile(source_module, dtype="f64")
    results = []
    for key in (1, 2):
        want = evaluate(m, {**x, "key": key}, dtype="f64")
        got = step.run({**{k: np.copy(v) for k, v in x.items()}, "key": np.int32(key)})
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-9, atol=1e-12, err_msg=k)
        results.append(want["loss"])
    assert results[0] != results[1]


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("src, line, col, words", [
    ("dim i = 3\ninput key\nout y = rand[i](key)\n", 3, 17, "i32 scalar input"),
    ("dim i = 3\ninput key: i32[i]\nout y = rand[i](key)\n", 3, 17, "i32 scalar input"),
    ("dim i = 3\ninput key: i32\nout y = rand(key) + size(i)\n", 3, 9, "needs the edges"),
    ("dim i = 3\ninput key: i32\nout y = randn[i, i](key)\n", 3, 18, "listed twice"),
    ("dim i = 3\ninput key: i32\nout y = rand[q](key)\n", 3, 14, "unknown edge"),
    ("dim i = 3\ninput key: i32\ninput n: i32[i]\nout y = rand[i](fold(key, n))\n", 4, 27, "i32 scalar input"),
    ("dim i = 3\ninput key: i32\ninput n\nout y = rand[i](fold(key, n))\n", 4, 27, "integer literal"),
    ("dim i = 3\ninput key: i32\ninput n: i32\nout y = rand[i](fold(key, n)) + n\n", 4, 33, "integer"),
    ("dim i = 3\ninput key: i32\nout y = rand[i](fold(key, 0.5))\n", 3, 27, "integer literal"),
    ("dim i = 3\ninput key: i32\nout y = rand[i](key, key)\n", 3, 9, "takes 1 argument"),
    ("dim i = 3\ninput key: i32\nout y = rand[i](key) + key\n", 3, 24, "integer"),
    ("dim i = 3\ninput key: i32\nk = fold(key, 1)\ninput E[i]\nout y = E[i = k]\n", 5, 11, "no index"),
    ("dim i = 3\ninput key: i32\nfn f[e...](x) = x * size(e)\nout y = f[i, i](rand[i](key))\n", 4, 9, "twice"),
    ("dim i = 3\ninput key: i32\nfn f[e](x) = sum[e](x)\nout y = f[i, i](rand[i](key))\n", 4, 9, "takes 1 edge"),
    ("dim i = 3\ninput x[i]\nout y = dropout(x, 0, 0.5)\n", 3, 9, "1 or more edge arguments"),
])
def test_errors(src, line, col, words):
    with pytest.raises(CompileError) as e:
        compile_source(src, "t.tg")
    text = e.value.format({"t.tg": src})
    assert (e.value.loc.line, e.value.loc.col) == (line, col), text
    assert words in text and text.startswith(f"t.tg:{line}:{col}: error:"), text


def test_a_collecting_edge_parameter():
    """`fn f[a, e...]`: e takes the remaining edges, one or several, in edge lists."""
    src = ("dim i = 3, j = 2, k = 4\ninput x[i, j, k]\nfn f[a, e...](x) = sum[e](x) + max[a](x)\n"
           "out y = f[i, j, k](x)\nout z = f[i, j](x)\n")
    m = compile_source(src, "t.tg", Options(dtype="f64"))
    x = np.random.default_rng(3).standard_normal((3, 2, 4))
    got = evaluate(m, {"x": x}, dtype="f64")
    np.testing.assert_allclose(got["y"], x.sum(axis=(1, 2))[:, None, None] + x.max(axis=0)[None], rtol=1e-12)
    np.testing.assert_allclose(got["z"], x.sum(axis=1)[:, None, :] + x.max(axis=0)[None], rtol=1e-12)


def test_an_edge_parameter_with_several_edges_where_one_is_needed():
    src = "dim i = 3, j = 2\ninput x[i, j]\nfn f[e...](x) = x * size(e)\nout y = f[i, j](x)\n"
    with pytest.raises(CompileError) as e:
        compile_source(src, "t.tg")
    assert "stands for several edges" in str(e.value)


FOLD_BY_INPUT = """\
dim i = 37, j = 5
input key: i32
input step: i32
input x[i, j]
out u = rand[i, j](fold(key, step))         # n: an i32 input's value
out w = rand[i, j](fold(key, 4))            # the same draw when step = 4
out z = randn[j, i](fold(fold(key, 3), step))
out d = dropout[i, j](x, fold(key, step), 0.5)
"""


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_fold_by_an_i32_input_on_every_path(dtype):
    """fold(key, n) with n an i32 input is the fold by n's value: step = 4 draws what
    fold(key, 4) draws, other steps other values; the interpreters and the CPU backend
    agree bit for bit (negative n: its 32 bits, as for keys)."""
    x = np.random.default_rng(0).standard_normal((37, 5)).astype(dtype.replace("f", "float"))
    draws = {}
    for step in (4, 0, 1, -5):
        inputs = {"key": np.int32(9), "step": np.int32(step), "x": x}
        results = list(_all_paths(FOLD_BY_INPUT, dtype, inputs))
        name0, want = results[0]
        for name, got in results[1:]:
            for out in want:
                np.testing.assert_array_equal(got[out], want[out], err_msg=f"{out}: {name} vs {name0}")
        if step == 4:
            np.testing.assert_array_equal(want["u"], want["w"])
        draws[step] = want["u"]
    w = philox_block((1, 0, 1, 0), (9, 0))[:2]
    u = philox_block((0, 0, 0, 0), w)[0]
    if dtype == "f32":
        assert draws[1][0, 0] == np.float32((u >> 8) * 2.0 ** -24)   # fold(9, 1), counter 0
    k = philox_block(((-5) & F, 0, 1, 0), (9, 0))[:2]
    if dtype == "f32":
        assert draws[-5][0, 0] == np.float32((philox_block((0, 0, 0, 0), k)[0] >> 8) * 2.0 ** -24)
    assert len({d.tobytes() for d in draws.values()}) == 4


def test_fold_by_an_input_round_trips_through_ir_text_and_tg():
    opts = Options(dtype="f64")
    m = pipeline.lower(compile_source(FOLD_BY_INPUT, "t.tg", opts), opts).module
    text = print_module(m)
    assert "random[randn: 3, $1] %key, %step" in text
    assert print_module(parse_module(text)) == text
    from tgc.frontend.emit_tg import emit_tg
    tg = emit_tg(m)
    assert "fold(fold(key, 3), step)" in tg
    again = compile_source(tg, "again.tg", opts)
    inputs = {"key": np.int32(2), "step": np.int32(7), "x": np.ones((37, 5))}
    a, b = evaluate(m, inputs, dtype="f64"), evaluate(again, inputs, dtype="f64")
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
