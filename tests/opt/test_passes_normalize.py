"""normalize: canonical form and renaming-aware hash-consing (golden IR + --verify-each)."""
import os
import subprocess
import sys

from passes_util import ROOT, body, ops, optimize, tg, tgir

NORMALIZE = ("normalize",)

FLATTEN = """
dim n = 4
dim m = 3
edge j : n
edge k : n
input x : f64[n]
input A : f64[n, m]
input B : f64[j, m]

%e1 = map[exp] %x : f64[n]
%e2 = map[exp] %x : f64[n]
%s = add[1.0, 1.0] %e1, %e2 : f64[n]
%t = add[1.0, -3.0] %s, %e1 : f64[n]
%c2 = const[2.0] : f64[]
%p = contract %c2, %A : f64[n, m]
%q = contract %p, %x : f64[m]
%r = contract %q, %x : f64[n, m]
%Bk = rename[j -> k] %B : f64[k, m]
%Bn = rename[k -> n] %Bk : f64[n, m]
%z = const[0.0] : f64[]
%u = add[1.0, 1.0] %Bn, %z : f64[n, m]
%w = contract %u : f64[n, m]
out t = %t : [n]
out r = %r : [n, m]
out w = %w : [n, m]
"""

# e + e - 3e = -e; (2 A . x) x is one product with the constant as a coefficient, the
# summed n renamed apart from the kept one; renames composed, + 0 and the identity sum dropped.
FLATTEN_AFTER = """\
%0 = map[exp] %x : f64[n]
%1 = add[-1.0] %0 : f64[n]
%2 = rename[n -> n.1] %x : f64[n.1]
%3 = rename[n -> n.1] %A : f64[m, n.1]
%4 = contract %x, %2, %3 : f64[m, n]
%5 = add[2.0] %4 : f64[m, n]
%6 = rename[j -> n] %B : f64[m, n]
out t = %1 : [n]
out r = %5 : [n, m]
out w = %6 : [n, m]"""


def test_flatten_fold_and_compose():
    assert body(optimize(tgir(FLATTEN), NORMALIZE)) == FLATTEN_AFTER


RENAMED_SUM = """
dim n = 4
dim p = 5
dim q = 3
edge j : p
edge m : p
input A : f64[n, j]
input B : f64[j, q]
input x : f64[q]

%a = contract %A, %B : f64[n, q]
%A2 = rename[j -> m] %A : f64[n, m]
%B2 = rename[j -> m] %B : f64[m, q]
%b = contract %A2, %B2 : f64[n, q]
%xa = contract %a, %x : f64[n]
%xb = contract %x, %b : f64[n]
%d = add[1.0, 1.0] %xa, %xb : f64[n]
out a = %a : [n, q]
out b = %b : [n, q]
out d = %d : [n]
"""

# The same contraction over a summed edge named j or m is one value; so x.a + x.b = 2 x.a.
RENAMED_SUM_AFTER = """\
%0 = contract %A, %B : f64[n, q]
%1 = contract %x, %0 : f64[n]
%2 = add[2.0] %1 : f64[n]
out a = %0 : [n, q]
out b = %0 : [n, q]
out d = %2 : [n]"""


def test_equal_up_to_renaming_of_summed_edges_is_one_value():
    assert body(optimize(tgir(RENAMED_SUM), NORMALIZE)) == RENAMED_SUM_AFTER


CONV_TWICE = """
dim t = 12
dim k = 3
dim s = 10
dim j = 3
dim u = 8
edge s2 : s
edge k2 : k
input x : f64[t]
param K : f64[k]

%i1 = indicator[t = s + k] : f64[k, s, t]
%w1 = contract %x, %i1 : f64[k, s]
%h1 = contract %w1, %K : f64[s]
%i2 = indicator[s = u + j] : f64[j, s, u]
%a = contract %h1, %i2 : f64[j, u]
%i3 = indicator[t = s2 + k2] : f64[k2, s2, t]
%w3 = contract %x, %i3 : f64[k2, s2]
%K2 = rename[k -> k2] %K : f64[k2]
%h3 = contract %w3, %K2 : f64[s2]
%i4 = indicator[s2 = u + j] : f64[j, s2, u]
%b = contract %h3, %i4 : f64[j, u]
%y = add[1.0, 1.0] %a, %b : f64[j, u]
out y = %y : [u, j]
"""

# Two convolution chains whose summed edges differ only by name (s/s2, k/k2, the
# second joining indicators only): one value, counted twice.
CONV_TWICE_AFTER = """\
%0 = indicator[t = k + s] : f64[k, s, t]
%1 = indicator[s = j + u] : f64[j, s, u]
%2 = contract %K, %x, %0, %1 : f64[j, u]
%3 = add[2.0] %2 : f64[j, u]
out y = %3 : [u, j]"""


def test_renaming_aware_through_indicators():
    assert body(optimize(tgir(CONV_TWICE), NORMALIZE)) == CONV_TWICE_AFTER


def test_like_terms_and_sorting_are_independent_of_operand_order():
    a = optimize(tg("dim n = 3\ninput x[n], y[n]\nout z = exp(x) * y + 2 * y * exp(x) - y"), NORMALIZE)
    b = optimize(tg("dim n = 3\ninput x[n], y[n]\nout z = -y + exp(x) * y * 3"), NORMALIZE)
    assert body(a) == body(b)


def test_normalize_is_idempotent():
    m = optimize(tgir(FLATTEN), NORMALIZE)
    assert body(optimize(m, NORMALIZE)) == body(m)


def test_shared_contractions_are_not_merged_into_their_users():
    """Merging a contraction used twice would recompute it in both users."""
    m = optimize(tg("dim n = 5\ninput A[i: n, j: n], B[j, k: n], v[k]\nC = A @ B\nout p = C @ v\nout q = sum(C * C)"),
                 NORMALIZE)
    assert any(o.op == "contract" for v in ops(m, "contract") for o in v.operands)


def test_no_merging_before_differentiation():
    """q = x @ W stays a value of its own: the derivative program shares it."""
    m = optimize(tg("dim n = 4\ninput x[i: n], W[i, j: n], V[j, k: n]\nf = sum((x @ W) @ V)\nout g = grad(f, W)"),
                 ("normalize",))
    inner = [v for v in ops(m, "contract") if any(o.op == "contract" for o in v.operands)]
    assert inner


def test_output_is_byte_identical_across_hash_seeds():
    outs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(ROOT))
        p = subprocess.run([sys.executable, "-m", "tgc.cli", "dump-ir", str(ROOT / "examples" / "gpt.tg")],
                           capture_output=True, text=True, env=env, check=True)
        outs.append(p.stdout)
    assert outs[0] == outs[1]
