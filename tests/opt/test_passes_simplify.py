"""simplify: exact algebra (golden IR + --verify-each), and the structural targets."""
import numpy as np

from passes_util import body, ops, optimize, tg, tgir
from tgc.ir.interp import evaluate
from tgc.registry import DEFAULT_PIPELINE

SIMPLIFY = ("simplify",)

IDENTITIES = """
dim n = 4
edge i : n
edge j : n
input x : f64[i]
input y : f64[i]
input A : f64[i, j]

%one = const[1.0] : f64[]
%zero = const[0.0] : f64[]
%ex = map[exp] %x : f64[i]
%m = map[mul0] %y, %ex : f64[i]
%g = map[where] %ex, %m, %zero : f64[i]
%r = map[div] %one, %x : f64[i]
%m2 = map[mul0] %y, %r : f64[i]
%d = indicator[i = j] : f64[i, j]
%xd = contract %x, %d : f64[j]
%z = contract %A, %zero : f64[i, j]
%w = map[where] %one, %x, %y : f64[i]
%l = map[log] %ex : f64[i]
%two = const[2.0] : f64[]
%p = map[pow] %x, %two : f64[i]
%s = map[sqrt] %ex : f64[i]
%ss = contract %s, %s : f64[i]
out g = %g : [i]
out m2 = %m2 : [i]
out xd = %xd : [j]
out z = %z : [i, j]
out w = %w : [i]
out l = %l : [i]
out p = %p : [i]
out ss = %ss : [i]
"""

# where(e, mul0(y, e), 0) = mul0(y, e) (e = exp x may overflow: the guard stays);
# mul0(y, 1/x) stays (1/x may be inf);
# a summed delta is a rename; A 0 = 0; where(1, x, y) = x; log exp x = x; x^2 = x x;
# sqrt(e) sqrt(e) = e (e = exp x >= 0).
IDENTITIES_AFTER = """\
%0 = map[exp] %x : f64[i]
%1 = map[mul0] %y, %0 : f64[i]
%2 = const[1.0] : f64[]
%3 = map[div] %2, %x : f64[i]
%4 = map[mul0] %y, %3 : f64[i]
%5 = rename[i -> j] %x : f64[j]
%6 = const[0.0] : f64[i, j]
%7 = contract %x, %x : f64[i]
out g = %1 : [i]
out m2 = %4 : [i]
out xd = %5 : [j]
out z = %6 : [i, j]
out w = %x : [i]
out l = %x : [i]
out p = %7 : [i]
out ss = %0 : [i]"""


def test_identities():
    assert body(optimize(tgir(IDENTITIES), SIMPLIFY)) == IDENTITIES_AFTER


def test_two_chained_reindexes_are_one_relation():
    m = optimize(tg("dim t = 10, k = 3, s = 8, j = 3, u = 6\ninput x[t]\nout y[k, u, j] = x[t = s + k][s = u + j]"),
                 ("normalize", "simplify"))
    assert body(m) == ("%0 = indicator[t = j + k + u] : f64[j, k, t, u]\n"
                       "%1 = contract %x, %0 : f64[j, k, u]\n"
                       "out y = %1 : [k, u, j]")


def test_a_reindex_between_dense_contractions_is_not_composed():
    """Composing across K would tie k1 and k2 together: more work, so it stays two relations."""
    m = optimize(tg("dim t = 10, k1 = 3, s1 = 8, k2 = 3, s2 = 6\ninput x[t], K1[k1], K2[k2]\n"
                    "out y = (x[t = s1 + k1] @ K1)[s1 = s2 + k2] @ K2"), ("normalize", "simplify"))
    assert len(ops(m, "indicator")) == 2


def test_indicator_that_always_holds_is_one():
    m = optimize(tg("dim n = 4, p = 4\ninput x[n]\nout y = sum[n](x * [n <= p + 3])"), ("normalize", "simplify"))
    assert not ops(m, "indicator")


def test_stop_stays_until_differentiated():
    src = "dim n = 3\ninput x[n]\nf = sum(exp(x - stop(max[n](x))))\nout f\nout g = grad(f, x)"
    assert ops(optimize(tg(src), ("normalize", "simplify")), "stop")
    assert not ops(optimize(tg(src), ("normalize", "adjoint", "simplify")), "stop")


def test_nan_safe_guards_stay_where_needed():
    """LANGUAGE.md section 8: d/dx sum(where(x > 0, sqrt(x), 0)) is 0 at x = 0 and x = -1."""
    m = optimize(tg("dim n = 3\ninput x[n]\nout g = grad(sum(where(x > 0, sqrt(x), 0)), x)"), DEFAULT_PIPELINE)
    got = evaluate(m, {"x": np.array([0.0, -1.0, 4.0])}, dtype="f64")["g"]
    np.testing.assert_array_equal(got, [0.0, 0.0, 0.25])


def test_derivative_guards_go_when_finite():
    """The guards reverse mode puts around every product disappear from an MLP's gradient."""
    m = optimize(tg("""
dim batch = 4
dim features = 3, hidden = 5
input x[batch, features], y[batch, hidden]
param W[features, hidden], b[hidden]
loss = mse(tanh(x @ W + b), y)
out dW = grad(loss, W)
out db = grad(loss, b)
"""), DEFAULT_PIPELINE)
    assert not ops(m, "map", "mul0") and not ops(m, "map", "where")


def test_dead_branches_go():
    m = optimize(tg("dim n = 3\ninput x[n], y[n]\nout g = grad(sum(x * 0 + y * exp(x)), x)"), DEFAULT_PIPELINE)
    assert body(m).count("map[exp]") == 1 and len(ops(m)) <= 3
