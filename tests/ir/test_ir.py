"""The IR core: sizes, affine relations, hash-consing, text round trip, verifier."""
import pytest

import tgc.ir.values as V
from tgc.ir.affine import parse_relation
from tgc.ir.diag import CompileError
from tgc.ir.parser import parse_module
from tgc.ir.printer import print_module
from tgc.ir.sizes import SizeError, parse_size, size_collect, size_eval, size_str


@pytest.mark.parametrize("text,env,value", [
    ("len - k + 1", {"len": 10, "k": 3}, 8),
    ("(len + 2 - k) / 2 + 1", {"len": 65, "k": 3}, 33),
    ("a - (b - c)", {"a": 5, "b": 3, "c": 1}, 3),
    ("a * (b + c)", {"a": 2, "b": 3, "c": 4}, 14),
    ("12 / 4", {}, 3),
    ("min(32, batch * 2)", {"batch": 3}, 6),
    ("min(32, batch) * d", {"batch": 64, "d": 2}, 64),
    ("min(4, 9)", {}, 4),
])
def test_size_eval_and_round_trip(text, env, value):
    s = parse_size(text)
    assert size_eval(s, env) == value
    assert parse_size(size_str(s)) == s


@pytest.mark.parametrize("text,collected", [
    ("batch * 48 * 11 + 48 + batch * 11 + 2304", "539 * batch + 2352"),
    ("a * b * 2 + 1 + b * a - 3", "3 * a * b - 2"),
    ("(a + 1) * (a - 1)", "a * a - 1"),
    ("c / 2 + c / 2", "c / 2 + c / 2"),          # a quotient is left as it is
    ("min(4, n) + 1", "min(4, n) + 1"),
])
def test_size_collect_keeps_the_value(text, collected):
    s = parse_size(text)
    assert size_str(size_collect(s)) == collected
    for n in (2, 4, 6):
        env = {"batch": n, "a": n, "b": n + 1, "c": 2 * n, "n": n}
        assert size_eval(size_collect(s), env) == size_eval(s, env)


def test_size_errors():
    with pytest.raises(SizeError, match="divisible"):
        parse_size("7 / 2")
    with pytest.raises(SizeError, match="not bound"):
        size_eval(parse_size("n + 1"), {})


@pytest.mark.parametrize("text", [
    "t = k + s", "t = k + 2*s - 1", "c = hd + hd*head", "s <= t", "i = j = k",
    "t = -s + 9", "t2 = t - size(t1)", "t = -n*s", "t = -(n + 1)*s + 3", "i != j",
])
def test_relation_round_trip(text):
    r = parse_relation(text)
    assert str(r) == text
    assert parse_relation(str(r)) == r


def test_relation_holds():
    r = parse_relation("t = 2*s + k - 1")
    assert r.holds({"t": 3, "s": 1, "k": 2}, {})
    assert not r.holds({"t": 3, "s": 1, "k": 1}, {})


def test_hash_consing_shares_equal_values():
    x = V.arg("x", "f32", ["b", "f"])
    w = V.arg("w", "f32", ["f", "h"])
    assert V.contract([x, w], ["h", "b"]) is V.contract([x, w], ["b", "h"])
    assert V.map_("exp", x) is V.map_("exp", x)
    assert V.map_("exp", x) is not V.map_("log", x)


def test_hash_consing_table_holds_values_weakly():
    """A value nothing else holds is freed with its table entry; its type is shared."""
    x = V.arg("x", "f32", ["b", "f"])
    before = len(V.Value._table)
    y = V.map_("exp", V.map_("log", x))
    assert len(V.Value._table) == before + 2
    assert y.type is x.type and y.type == V.TensorType("f32", ("b", "f"))
    del y
    assert len(V.Value._table) == before
    assert V.map_("exp", V.map_("log", x)).operands[0].operands == (x,)


def test_builder_type_errors():
    x = V.arg("x", "f32", ["a", "b"])
    with pytest.raises(V.IRError, match="twice"):
        V.rename(x, {"a": "b"})
    with pytest.raises(V.IRError, match="cannot rename"):
        V.rename(x, {"c": "d"})
    with pytest.raises(V.IRError, match="cannot reduce"):
        V.reduce("max", x, ["c"])
    ids = V.arg("ids", "i32", ["a"])
    with pytest.raises(V.IRError, match="integer"):
        V.add([x, ids])
    with pytest.raises(V.IRError, match="disjoint"):
        V.grad(x, x)


PROGRAM = """\
dim batch
dim f = 3
dim h = 4
dim t = 6
dim s = 4
dim k = 3
edge j : h
input x : f32[batch, f]
param W : f32[f, h]
input ids : i32[batch]
input E : f32[h, f]

%0 = contract %x, %W : f32[batch, h]
%1 = const[1.0] : f32[]
%2 = add[1.0, -0.5] %0, %1 : f32[batch, h]
%3 = map[exp] %2 : f32[batch, h]
%4 = rename[h -> j] %3 : f32[batch, j]
%5 = gather[h] %E, %ids : f32[batch, f]
%6 = indicator[t = k + s] : f32[k, s, t]
%7 = reduce[max: h] %3 : f32[batch]
%8 = size[batch] : f32[]
%9 = map[div] %7, %8 : f32[batch]

out y = %4 : [j, batch]
out g = %5 : [batch, f]
out ind = %6 : [t, s, k]
out m = %9 : [batch]
update W = %W
"""


def test_print_parse_round_trip():
    m = parse_module(PROGRAM)
    assert print_module(m) == PROGRAM
    assert print_module(parse_module(print_module(m))) == PROGRAM


@pytest.mark.parametrize("line,bad,message", [
    (16, "%3 = map[exp] %2 : f32[batch]", "gives type"),
    (13, "%0 = contract %x, %nope : f32[batch, h]", "undefined value"),
    (13, "%0 = frobnicate %x : f32[batch, f]", "unknown op"),
    (13, "%0 = rename[f -> zz] %x : f32[batch, zz]", "unknown edge"),
    (13, "what is this", "cannot parse"),
    (17, "%4 = rename[h -> f] %3 : f32[batch, f]", "changes the size"),
])
def test_parse_errors_name_the_line(line, bad, message):
    lines = PROGRAM.splitlines()
    lines[line - 1] = bad
    with pytest.raises(CompileError) as e:
        parse_module("\n".join(lines) + "\n", "p.tgir")
    assert e.value.loc.line == line
    assert message in e.value.message
    assert str(e.value).startswith(f"p.tgir:{line}:")
