"""Defects found by an outsider's probe of the language (probe11): each test is the
minimal program that gave a wrong result, a crash or a hang, checked on every backend
that runs it against an independent computation."""
import numpy as np
import pytest

import tgc


def _tanh_chain(n: int) -> str:
    return ("dim n = 3\ninput x[n]\nh0 = x\n" + "".join(f"h{i + 1} = tanh(h{i})\n" for i in range(n))
            + f"out y = grad(sum(h{n}), x)\n")


@pytest.mark.parametrize("backend", ["interp", "lowered", "cpu"])
def test_a_product_of_more_factors_than_einsum_takes(backend):
    """The gradient of 40 chained tanh is one product of 80 factors (tanh' = (1 - t)(1 + t)):
    numpy's einsum takes at most 63 operands, so the reference interpreter (`tgc run`'s
    default backend) failed with an internal error `too many operands`."""
    n = 40
    x = np.array([0.5, -1.0, 2.0])
    got = tgc.compile(_tanh_chain(n), backend=backend, dtype="f64")(x=x)["y"]
    h, want = x.copy(), np.ones(3)
    for _ in range(n):
        h = np.tanh(h)
        want = want * (1 - h * h)
    np.testing.assert_allclose(got, want, rtol=1e-13)


def test_a_chain_of_products_stays_linear_in_simplify():
    """simplify merged each single-use product into its user: the gradient of n chained
    tanh became n products of up to 2n factors (a 500-link chain: 31 s to compile, 3000
    links: minutes). Now a product of MERGE_MOST factors or more stays a factor of its user."""
    from tgc.frontend import compile_source
    from tgc.manager import run_pipeline
    from tgc.options import Options

    n = 300
    passes = ("normalize", "stabilize", "adjoint", "tangent", "unroll", "simplify")
    module = run_pipeline(compile_source(_tanh_chain(n), "<chain>", Options(dtype="f64")),
                          Options(dtype="f64", passes=passes)).module
    sizes = [len(v.operands) for v in module.values() if v.op == "contract"]
    assert max(sizes) < 2 * 64       # opt.rewrite.MERGE_MOST: 64
    assert sum(sizes) < 8 * n        # linear: every factor is in few products (was ~n^2)


def test_a_group_has_at_most_max_members_kernels():
    """The CPU's group stage looked at every member so far for each kernel it added: the
    gradient of a 1000-link tanh chain was one group of 2000 kernels (16 s to group, 25 s
    more for LLVM's one function). Values are those of numpy's recurrence."""
    n = 200
    x = np.array([0.5, -1.0, 2.0], np.float32)
    program = tgc.compile(_tanh_chain(n), backend="cpu", dtype="f32")
    groups = [k for k in program.lowered.kernels if type(k).__name__ == "LoopGroup"]
    assert groups and max(len(g.members) for g in groups) <= 48   # lower.grouping.MAX_MEMBERS
    h, want = x.astype(np.float64), np.ones(3)
    for _ in range(n):
        h = np.tanh(h)
        want = want * (1 - h * h)
    np.testing.assert_allclose(program(x=x)["y"], want, rtol=1e-4)


@pytest.mark.parametrize("backend", ["interp", "cpu"])
def test_stop_rename_gather_of_a_low_precision_expression_keep_its_type(backend):
    """stop, rename and gather copy their operand: of an f16 expression (`x * W`, rounded to
    f16) they are f16, as of an f16 argument. They kept the type of the unrounded product
    (f32), so `softmax[n](x * W)` (the prelude's `x - stop(max[n](x))`) was computed and
    returned in f32, while `softmax[n](z)` of an f16 input `z` is f16."""
    src = """
dim b, n = 5
dim m = n
input x: f16[b, n], z: f16[b, n]
param W: f16[n]
input ids: i32[b]
out s = stop(x * W)
out r = (x * W)[n -> m]
out g = (x * W)[b = ids]
out y = softmax[n](x * W)
out yz = softmax[n](z)
"""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5)).astype(np.float16)
    W = rng.standard_normal(5).astype(np.float16)
    xw = (x.astype(np.float32) * W.astype(np.float32)).astype(np.float16)
    program = tgc.compile(src, backend=backend)
    assert {o["name"]: o["dtype"] for o in program.info()["outputs"]} == dict.fromkeys("s r g y yz".split(), "f16")
    got = program(x=x, z=xw, W=W, ids=np.array([2, 0, 1], np.int32))
    for name in ("s", "r"):
        assert got[name].dtype == np.float16
        np.testing.assert_array_equal(got[name], xw)
    np.testing.assert_array_equal(got["g"], xw[[2, 0, 1]])
    assert got["y"].dtype == np.float16
    np.testing.assert_array_equal(got["y"], got["yz"])


@pytest.mark.parametrize("backend", ["interp", "cpu"])
def test_selections_of_bf16_values_are_bf16(backend):
    """A reindex (a contraction with an indicator, which is 0/1: it selects) and a `where`
    whose condition is f32 only select bf16 values, so they are bf16 (docs/dtypes.md:
    ops that only select or copy keep the type). The f32 indicator and the f32 condition
    took part in the promotion, so both were f32, and so was a causal softmax over them."""
    src = """
dim b, n = 6
dim s = n, k = n
input x: bf16[b, n]
input c[b, n]
out y = x[n = s + k]
out w = where(c > 0, x, -x)
out p = softmax[k](where([k <= s], x[n -> k], -inf))
"""
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 6)).astype(bf16)
    c = rng.standard_normal((2, 6)).astype(np.float32)
    program = tgc.compile(src, backend=backend)
    assert {o["name"]: o["dtype"] for o in program.info()["outputs"]} == dict.fromkeys("ywp", "bf16")
    got = program(x=x, c=c)
    xf = x.astype(np.float32)
    want_y = np.zeros((2, 6, 6), np.float32)
    for i in range(6):
        for j in range(6 - i):
            want_y[:, i, j] = xf[:, i + j]
    assert got["y"].dtype == bf16 and got["w"].dtype == bf16 and got["p"].dtype == bf16
    np.testing.assert_array_equal(got["y"].astype(np.float32), want_y)
    np.testing.assert_array_equal(got["w"].astype(np.float32), np.where(c > 0, xf, -xf))
    p = got["p"].astype(np.float32)
    assert np.all(p[:, 0, 1:] == 0) and np.allclose(p.sum(axis=2), 1, atol=0.02)


_BF16_STEP = """
dim b = 2, d = 4, l = 3
dim d2 = d
input x: bf16[b, d]
param W: bf16[l, d, d2]
fn step(h, W) = h + softmax[d](h * (h @ W)[d2 -> d] * 3)
"""


@pytest.mark.parametrize("backend", ["interp", "cpu"])
@pytest.mark.parametrize("unroll", [True, False])
def test_a_bf16_loop_step_rounds_as_the_same_code_written_out(backend, unroll):
    """A step's bf16 operations are rounded to bf16 as the same expressions outside a loop
    are. The front end made the roundings explicit only outside loops: the step's products
    and sums stayed f32 (a loop differed from its written-out steps by bf16 ulps), and a
    step such as `h + softmax(...)` of a bf16 carry was refused ('returns f32, but the
    carry is bf16')."""
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    loop = _BF16_STEP + "y = repeat[l](step, x, W)\nout y\nout g = grad(sum(f32(y) * f32(y)), W)\n"
    written = (_BF16_STEP + "h0 = x\n" + "".join(f"h{i + 1} = step(h{i}, W[l = {i}])\n" for i in range(3))
               + "y = h3\nout y\nout g = grad(sum(f32(y) * f32(y)), W)\n")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4)).astype(bf16)
    W = rng.standard_normal((3, 4, 4)).astype(bf16)
    options = None if unroll else tgc.Options(unroll_max_ops=0)
    got = tgc.compile(loop, backend=backend, options=options)(x=x, W=W)
    want = tgc.compile(written, backend=backend)(x=x, W=W)
    assert got["y"].dtype == bf16
    np.testing.assert_array_equal(got["y"].astype(np.float32), want["y"].astype(np.float32))
    np.testing.assert_allclose(got["g"].astype(np.float32), want["g"].astype(np.float32), rtol=0.02, atol=0.02)
