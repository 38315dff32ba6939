"""factor: pairwise contractions in the cheapest memory-bounded order, common factors out
(golden IR + --verify-each); the Hessian-vector product target."""
import numpy as np
import pytest

from passes_util import GOLDEN, body, ops, optimize, tg
from tgc.ir.interp import evaluate
from tgc.ir.inputs import random_inputs
from tgc.frontend import compile_file
from tgc.options import Options
from tgc.registry import DEFAULT_PIPELINE
from tgc.opt.stats import module_stats

FACTOR = ("normalize", "factor")

CHAIN = "dim a = 50, b = 40, c = 30, d = 20\ninput A[a, b], B[b, c], C[c, d], v[d]\nout y = A @ B @ C @ v"

# ((A B) C) v as written: 91,000 FLOPs; right to left, matrix-vector products: 3,800.
CHAIN_AFTER = """\
%0 = contract %C, %v : f64[c]
%1 = contract %B, %0 : f64[b]
%2 = contract %A, %1 : f64[a]
out y = %2 : [a]"""


def test_matrix_chain_order():
    m = optimize(tg(CHAIN), FACTOR)
    assert body(m) == CHAIN_AFTER
    assert module_stats(m).flops == 3_800


def test_common_factors_out():
    m = optimize(tg("dim n = 8, i = 30, j = 20\ninput x[n, i], A[i, j], B[i, j], C[i, j]\n"
                    "out y = x @ A + x @ B - 2 * (x @ C)"), FACTOR)
    assert body(m) == ("%0 = add[1.0, -2.0, 1.0] %A, %C, %B : f64[i, j]\n"
                       "%1 = contract %x, %0 : f64[j, n]\n"
                       "out y = %1 : [n, j]")


def test_no_common_factor_when_it_costs_more():
    """x A + x B with A, B of different edges: A + B would be a larger tensor."""
    m = optimize(tg("dim n = 8, i = 30, j = 20, k = 25\ninput x[n, i], A[i, j], B[i, k]\nout y = x @ A + x @ B"),
                 FACTOR)
    assert len(ops(m, "contract")) == 2


def test_indicators_are_index_arithmetic_not_dense():
    """A convolution: the window view first (no FLOPs), then one dense contraction."""
    m = optimize(tg("dim batch\ndim t = 64, k = 4, s = 61, cin = 4, cout = 8\ninput x[batch, cin, t]\n"
                    "param K[cout, cin, k]\nout y[batch, cout, s] = x[t = s + k] @ K"), FACTOR)
    assert body(m) == ("%0 = indicator[t = k + s] : f64[k, s, t]\n"
                       "%1 = contract %x, %0 : f64[batch, cin, k, s]\n"
                       "%2 = contract %K, %1 : f64[batch, cout, s]\n"
                       "out y = %2 : [batch, cout, s]")


def test_memory_bound():
    """No intermediate of a factored example is larger than its largest tensor before factoring."""
    for name in ("attention", "gpt", "conv1d", "mlp"):
        m = compile_file(str(GOLDEN.parent.parent / "examples" / f"{name}.tg"), Options(dtype="f64"))
        before = optimize(m, DEFAULT_PIPELINE[:-1], seeds=(0,))
        after = optimize(before, ("factor",), seeds=(0,))
        assert module_stats(after).largest <= module_stats(before).largest, name


def test_hessian_vector_product_is_the_two_term_form():
    """hv = sum(y) (s v - s (s . v)), s = softmax(x) on the shifted logits: at most 12 ops (it takes 10)."""
    m = optimize(compile_file(str(GOLDEN / "hvp_only.tg"), Options(dtype="f64")))
    assert len(ops(m)) <= 12
    assert body(m) == """\
%0 = reduce[max: c] %x : f64[batch]
%1 = add[1.0, -1.0] %x, %0 : f64[batch, c]
%2 = reduce[logsumexp: c] %1 : f64[batch]
%3 = add[-1.0, 1.0] %2, %1 : f64[batch, c]
%4 = map[exp] %3 : f64[batch, c]
%5 = contract %y : f64[batch]
%6 = contract %v, %4, %5 : f64[batch, c]
%7 = contract %6 : f64[batch]
%8 = contract %4, %7 : f64[batch, c]
%9 = add[1.0, -1.0] %6, %8 : f64[batch, c]
out hv = %9 : [batch, c]"""


def test_hessian_vector_products_agree():
    """Forward over reverse and the closed form are one value; reverse over reverse equal."""
    m = optimize(compile_file(str(GOLDEN.parent.parent / "examples" / "hvp.tg"), Options(dtype="f64")))
    outs = {o.name: o.value for o in m.outputs}
    assert outs["hv_fwd"] is outs["hv_exact"]
    assert len(ops(m)) <= 30
    got = evaluate(m, random_inputs(m, m.bind_dims({"batch": 3}), 0, "f64"), dtype="f64")
    np.testing.assert_allclose(got["hv"], got["hv_exact"], rtol=1e-12, atol=1e-14)


def test_many_factors_sharing_one_edge_are_multiplied_first_then_summed(monkeypatch):
    """Found by a probe: opt_einsum's dp search is exponential in the operands, and
    a product of 12 factors that share one edge took 2 s (each more factor 3.3 times
    longer; a forward derivative through a chain of 25 sins never finished). Factors
    with the same edges are multiplied first, with no search at all, and larger
    searches are greedy."""
    import opt_einsum

    from tgc.opt.paths import MAX_DP, find_path

    def no_dp(*args, optimize=None, **kw):
        assert optimize != "dp" or len(args) - 1 <= MAX_DP, "dp over too many operands"
        return real(*args, optimize=optimize, **kw)
    real = opt_einsum.contract_path
    monkeypatch.setattr(opt_einsum, "contract_path", no_dp)
    same = [(frozenset({"n"}), False)] * 30
    assert find_path(same, set(), {"n": 64}, 64) == [(0, 1)] * 29 + [(0,)]
    assert find_path(same, {"n"}, {"n": 64}, 64) == [(0, 1)] * 29
    mixed = [(frozenset({"a", f"e{i}"}), False) for i in range(MAX_DP + 4)]
    path = find_path(mixed, {"a"}, {"a": 8, **{f"e{i}": 4 for i in range(MAX_DP + 4)}}, 1 << 20)
    assert sum(len(step) - 1 for step in path) == len(mixed) - 1   # greedy: every operand joined once

    n = 25
    src = "dim n = 3\ninput x[n]\nv0 = x\n" + "".join(f"v{i + 1} = sin(v{i})\n" for i in range(n)) \
        + f"out z = jvp(sum(v{n}), x, x)\nout p = sum(" + " * ".join(f"cos(x + {i})" for i in range(16)) + ")\n"
    m = optimize(tg(src), DEFAULT_PIPELINE)
    x = np.array([0.3, -1.2, 0.7])
    got = evaluate(m, {"x": x}, dtype="f64")

    def f(x):
        for _ in range(n):
            x = np.sin(x)
        return x.sum()
    eps = 1e-6
    g = np.array([(f(x + eps * e) - f(x - eps * e)) / (2 * eps) for e in np.eye(3)])
    np.testing.assert_allclose(got["z"], g @ x, rtol=1e-7)
    np.testing.assert_allclose(got["p"], np.prod([np.cos(x + i) for i in range(16)], axis=0).sum(), rtol=1e-12)


# A 2-D convolution's input gradient, dx = sum[cout, kh, kw] K dy[ho = hh - kh + 1,
# wo = ww - kw + 1]: its two pairwise orders cost the same (the row taps or the column
# taps folded into the product with K first).
CONV_DX = """
dim nb, cin, cout, hh, ww
dim kh = 3, kw = 3
dim ho = hh, wo = ww
input  x[nb, cin, hh, ww]
input  dy[nb, cout, ho, wo]
param  K[cout, cin, kh, kw]
out dx = grad(sum((x[hh = ho + kh - 1, ww = wo + kw - 1] @ K) * dy), x)
"""

CONV_DX_AFTER = """\
%0 = indicator[ww = kw + wo - 1] : f64[kw, wo, ww]
%1 = indicator[hh = ho + kh - 1] : f64[hh, ho, kh]
%2 = contract %dy, %1 : f64[cout, hh, kh, nb, wo]
%3 = contract %K, %2 : f64[cin, hh, kw, nb, wo]
%4 = contract %0, %3 : f64[cin, hh, nb, ww]
out dx = %4 : [nb, cin, hh, ww]"""


def test_equal_orders_fold_the_outer_axis_shift_first():
    """Of equally cheap orders, the one that contracts dy first with the indicator of
    the outer image axis (hh: rows): the product's operand is then shifted by whole
    rows. Without the rule, the canonical order (a digest) picked the ww (column) shift
    for these names, and the hh one for conv2d.tg's (h, w)."""
    m = optimize(tg(CONV_DX), DEFAULT_PIPELINE)
    assert body(m) == CONV_DX_AFTER
    for a, b in (("hh", "h2"), ("ww", "w2")), (("hh", "rows"), ("ww", "cols")):   # other names, other digests
        text = CONV_DX.replace(*a).replace(*b)
        shifted = [v for v in optimize(tg(text), DEFAULT_PIPELINE).values()
                   if v.op == "contract" and any(o.op == "arg" and o.attrs[0] == "dy" for o in v.operands)]
        assert len(shifted) == 1
        ind, = [o for o in shifted[0].operands if o.op == "indicator"]
        assert a[1] in ind.edges, str(ind.attrs[0])


def _assert_tanh_chain_keeps_the_chain_rule(n: int) -> None:
    """`y_i = tanh(y_(i-1)) * 0.9 + x`, n steps, and its gradient, compiled for the
    interpreter in f64: the values are the recurrence's and the chain rule's."""
    import numpy as np

    import tgc

    steps = "".join(f"y{i} = tanh(y{i - 1}) * 0.9 + x\n" for i in range(1, n))
    src = f"dim n = 3\nparam x[n]\ny0 = x\n{steps}out y = y{n - 1}\nout g = grad(sum(y{n - 1}), x)\n"
    p = tgc.compile(src, backend="interp", dtype="f64")
    x = np.array([0.3, -0.2, 0.5])
    got = p(x=x)
    y, dy = x.copy(), np.ones(3)
    for _ in range(1, n):
        dy = dy * 0.9 * (1 - np.tanh(y) ** 2) + 1
        y = np.tanh(y) * 0.9 + x
    np.testing.assert_allclose(got["y"], y, rtol=1e-12)
    np.testing.assert_allclose(got["g"], dy, rtol=1e-10)


def test_the_gradient_of_a_14_step_residual_chain_compiles_and_keeps_the_chain_rule():
    """`y_i = tanh(y_{i-1}) * 0.9 + x`, 14 steps, and its gradient: the gradient's sums
    nest one inside the next, and un-distribution settled each inner sum once per
    candidate factor of every sum around it (12 steps took 21 s, 14 steps minutes).
    Memoized per sum and per contraction's cost, 14 steps compile in about a second
    (30 in 1.4 s; the candidates built are counted below, no time is asserted), and
    the values are still the chain rule's."""
    _assert_tanh_chain_keeps_the_chain_rule(14)


def _presummed_by_definition(leaves, keep):
    out = []
    for k, (e, ind) in enumerate(leaves):
        others = set(keep).union(*(x for j, (x, _) in enumerate(leaves) if j != k))
        out.append((e if ind else frozenset(e & others), ind))
    return out


def _hadamard_by_definition(leaves):
    groups = {}
    for i, (e, _) in enumerate(leaves):
        groups.setdefault(e, []).append(i)
    live = [(i, leaves[i]) for i in range(len(leaves))]
    steps = []
    for edges, members in groups.items():
        if len(members) < 2:
            continue
        tags = list(members)
        while len(tags) > 1:
            at = sorted(k for k, (tag, _) in enumerate(live) if tag in tags[:2])
            steps.append(tuple(at))
            for k in reversed(at):
                del live[k]
            live.append((("product", len(steps)), (edges, False)))
            tags = tags[2:] + [live[-1][0]]
    return steps, [leaf for _, leaf in live]


def _path_cost_by_definition(leaves, keep, sizes, path):
    from tgc.opt.paths import pair_cost, prod

    live = [(set(e), ind) for e, ind in leaves]
    total = 0
    for step in path:
        picked = [live[i] for i in step]
        for i in sorted(step, reverse=True):
            del live[i]
        later = set(keep).union(*(e for e, _ in live))
        out = set().union(*(e for e, _ in picked)) & later
        if len(picked) == 1:
            total += max(prod(picked[0][0], sizes), prod(out, sizes))
        else:
            (a, ai), (b, bi) = picked
            total += pair_cost(a, ai, b, bi, out, sizes)
        live.append((out, all(i for _, i in picked)))
    return total


def test_the_linear_path_helpers_give_what_their_definitions_give():
    """`presummed`, `_hadamard_first` and `path_cost` count edge carriers instead of
    taking the union of every other operand per operand or step (a product of n
    elementwise factors cost n^2): the same leaves, steps and costs as the
    definitions (the quadratic forms, here) on random contractions."""
    import random

    from tgc.opt import paths

    rng = random.Random(7)
    names = "abcdefg"
    sizes = {e: rng.randint(2, 9) for e in names}
    for _ in range(400):
        n = rng.randint(1, 14)
        pool = [frozenset(rng.sample(names, rng.randint(0, 3))) for _ in range(rng.randint(1, 4))]
        leaves = [(rng.choice(pool), rng.random() < 0.15) for _ in range(n)]
        keep = set(rng.sample(names, rng.randint(0, 3))) & set().union(*(e for e, _ in leaves))
        assert paths.presummed(leaves, keep) == _presummed_by_definition(leaves, keep)
        dense = [(e, False) for e, _ in leaves]
        assert paths._hadamard_first(dense) == _hadamard_by_definition(dense)
        live, path = list(range(n)), []
        while len(live) > 1:
            i, j = sorted(rng.sample(range(len(live)), 2))
            path.append((i, j))
            del live[j], live[i]
            live.append(None)
        assert paths.path_cost(leaves, keep, sizes, path) == _path_cost_by_definition(leaves, keep, sizes, path)


def test_undistribution_builds_few_candidates_per_sum_on_a_deep_chain(monkeypatch):
    """The gradient of `y_i = tanh(y_(i-1)) * 0.9 + x` reaches `factor` as nested sums
    of products, each sum with about as many candidate factors as steps. Each
    candidate's saving is at most what its group's terms cost; tried from the largest
    such bound down, the ones that cannot beat the best found are not built (the
    result is the same: the largest saving, the first in `sort_key` order of equal
    ones). 40 steps built 1560 candidates for 160 sums; now a few per sum."""
    from tgc.opt import factor

    built, sums = [0], [0]
    real_build, real_settle = factor._undistributed, factor._undistribute

    def counting_build(*args):
        built[0] += 1
        return real_build(*args)

    def counting_settle(*args):
        sums[0] += 1
        return real_settle(*args)

    monkeypatch.setattr(factor, "_undistributed", counting_build)
    monkeypatch.setattr(factor, "_undistribute", counting_settle)
    n = 40
    steps = "".join(f"y{i} = tanh(y{i - 1}) * 0.9 + x\n" for i in range(1, n))
    src = f"dim n = 3\nparam x[n]\ny0 = x\n{steps}out y = y{n - 1}\nout g = grad(sum(y{n - 1}), x)\n"
    import tgc

    tgc.compile(src, backend="interp", dtype="f64")
    assert sums[0] >= n and built[0] <= 6 * sums[0], (built[0], sums[0])


@pytest.mark.slow
def test_the_gradient_of_a_120_step_chain_compiles_and_keeps_the_chain_rule():
    """`y_i = tanh(y_(i-1)) * 0.9 + x`, 120 steps, and its gradient (took over 140 s;
    now about 15 s on the 2-core machine, loaded: cubic in the steps, see
    benchmarks/deep_compile.py's `tanh_chain` row): the values are the chain rule's."""
    _assert_tanh_chain_keeps_the_chain_rule(120)


def test_a_rewrite_nests_deeper_than_the_callers_recursion_limit():
    """A rule may build a nest as deep as the program (`factor` makes a chain's
    gradient sum a nest two values a step deep), and the rewrite recurses into it:
    192 steps passed Python's default 1000 frames. The rewrite allows as many frames as
    the front end; here a caller's limit of 400 frames, and a 60-step chain."""
    import sys

    n = 60
    steps = "".join(f"y{i} = tanh(y{i - 1}) * 0.9 + x\n" for i in range(1, n))
    src = f"dim n = 3\nparam x[n]\ny0 = x\n{steps}out g = grad(sum(y{n - 1}), x)\n"
    from tgc.pipeline import load_source

    module = load_source(src, "interp", "f64", lookup=False).module   # (the front end sets its own limit)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(400)
    try:
        from tgc.pipeline import lower

        lowered = lower(module, Options(dtype="f64"), backend="interp").module
    finally:
        sys.setrecursionlimit(limit)
    assert [o.name for o in lowered.outputs] == ["g"]
