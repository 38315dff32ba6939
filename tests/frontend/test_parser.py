"""Tests of the .tg parser: every syntactic form, precedence, locations, and errors."""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest

from tgc.frontend import ast as A
from tgc.frontend.parser import MAX_DEPTH, parse, read_source
from tgc.ir.diag import CompileError

ROOT = Path(__file__).resolve().parents[2]


def items(src: str) -> tuple:
    return parse(src, "t.tg").items


def expr(src: str):
    (stmt,) = items("x = " + src)
    return stmt.expr


def error(src: str) -> CompileError:
    with pytest.raises(CompileError) as info:
        parse(src, "t.tg")
    return info.value


def N(id_):
    return A.Name(id_)


def B(op, lhs, rhs):
    return A.BinOp(op, lhs, rhs)


def C(fn, *args, edges=None, kwargs=()):
    return A.Call(fn, None if edges is None else tuple(N(e) for e in edges), tuple(args), tuple(kwargs))


def T(coef, size_of=None, edge=None, by_name=False):
    return A.AffineTerm(coef, size_of, edge, by_name)


a, b, c, d = N("a"), N("b"), N("c"), N("d")


# ---- statements ---------------------------------------------------------------

MLP = (Path(__file__).parents[1] / "programs/spec_section1_mlp.tg").read_text()  # LANGUAGE.md section 1


def test_mlp_program():
    prog = parse(MLP, "mlp.tg")
    kinds = [type(s).__name__ for s in prog.items]
    assert kinds == ["DimDecl"] * 4 + ["TensorDecl"] * 7 + ["Bind"] * 3 + ["Out", "Out", "Update"]
    assert prog.items[12] == A.Bind("logits", B("+", B("@", N("h"), N("W2")), N("b2")))
    assert prog.items[13].expr == C("mean", C("cross_entropy", N("logits"), N("y"), edges=["classes"]),
                                    edges=["batch"])
    assert prog.items[15] == A.Out("dW1", None, C("grad", N("loss"), N("W1")))
    assert prog.items[16] == A.Update("W2", B("-", N("W2"), B("*", N("lr"), C("grad", N("loss"), N("W2")))))


def test_dims():
    assert items("dim batch\ndim d = 64, heads = 4\ndim hd = d / heads\ndim out_len = len - k + 1\n") == (
        A.DimDecl("batch", None), A.DimDecl("d", A.Num(64)), A.DimDecl("heads", A.Num(4)),
        A.DimDecl("hd", B("/", N("d"), N("heads"))),
        A.DimDecl("out_len", B("+", B("-", N("len"), N("k")), A.Num(1))))
    assert items("dim c = a * (b + 1) / 2")[0].expr == B("/", B("*", a, B("+", b, A.Num(1))), A.Num(2))
    assert items("dim a, b")[1] == A.DimDecl("b", None)


def test_tensor_declarations():
    src = ("input x[batch, features]\ninput ids: i32[batch, seq]\nparam W[f, h], b[h]\n"
           "state m[f, h]\ninput lr\ninput A[i: n, j: n]\ninput s: f64\n")
    x, ids, w, bias, m, lr, mat, s = items(src)
    assert x == A.TensorDecl("input", "x", None, (A.EdgeSpec("batch", None), A.EdgeSpec("features", None)))
    assert ids == A.TensorDecl("input", "ids", "i32", (A.EdgeSpec("batch", None), A.EdgeSpec("seq", None)))
    assert (w.kind, w.name, bias.kind, bias.name, bias.edges) == ("param", "W", "param", "b", (A.EdgeSpec("h", None),))
    assert m.kind == "state" and lr == A.TensorDecl("input", "lr", None, ())
    assert mat.edges == (A.EdgeSpec("i", "n"), A.EdgeSpec("j", "n"))
    assert s == A.TensorDecl("input", "s", "f64", ())


def test_function_expression_form():
    (f,) = items("fn layer[e1, e2](x, y, eps = 1e-5) = x + eps")
    assert f == A.FnDef("layer", (N("e1"), N("e2")),
                        (A.Param("x", None), A.Param("y", None), A.Param("eps", A.Num(1e-5))),
                        (), B("+", N("x"), N("eps")))
    assert items("fn c() = 3")[0] == A.FnDef("c", (), (), (), A.Num(3))


def test_function_block_form():
    src = """fn layernorm[e](x, w, b, eps = 1e-5) {
  mu  = mean[e](x)

  xc  = x - mu   # centred
  return xc / sqrt(mean[e](xc * xc) + eps) * w + b
}
y = 1
"""
    f, y = items(src)
    assert [s.name for s in f.body] == ["mu", "xc"]
    assert f.body[1] == A.Bind("xc", B("-", N("x"), N("mu")))
    assert isinstance(f.result, A.BinOp) and f.result.op == "+"
    assert y == A.Bind("y", A.Num(1))


def test_function_block_on_one_line():
    assert items("fn f[e](x) { return x }")[0] == A.FnDef("f", (N("e"),), (A.Param("x", None),), (), N("x"))
    (f,) = items("fn g(x) {\n a = x\n\n b = a\n return b }")
    assert f.body == (A.Bind("a", N("x")), A.Bind("b", N("a"))) and f.result == N("b")


def test_import_bind_out_update():
    src = ('import "lib/other.tg"\nz = 1\nout loss\nout y[batch, classes]\nout dW = grad(loss, W)\n'
           "out probs[batch, classes] = softmax[classes](logits)\nupdate m = 0.9 * m\n")
    imp, z, o1, o2, o3, o4, upd = items(src)
    assert imp == A.Import("lib/other.tg") and z == A.Bind("z", A.Num(1))
    assert o1 == A.Out("loss", None, None)
    assert o2 == A.Out("y", (N("batch"), N("classes")), None)
    assert o3 == A.Out("dW", None, C("grad", N("loss"), N("W")))
    assert o4 == A.Out("probs", (N("batch"), N("classes")), C("softmax", N("logits"), edges=["classes"]))
    assert upd == A.Update("m", B("*", A.Num(0.9), N("m")))


def test_empty_and_comment_only_files():
    assert items("") == ()
    assert items("# nothing\n\n   # more\n") == ()
    assert items("\n\nx = 1") == (A.Bind("x", A.Num(1)),)


# ---- expressions ----------------------------------------------------------------

PRECEDENCE = [
    ("a - b - c", B("-", B("-", a, b), c)),
    ("a / b / c", B("/", B("/", a, b), c)),
    ("a ^ b ^ c", B("^", a, B("^", b, c))),
    ("-a ^ b", A.Neg(B("^", a, b))),
    ("a ^ -b", B("^", a, A.Neg(b))),
    ("a ^ -b ^ c", B("^", a, A.Neg(B("^", b, c)))),
    ("a < b + c", A.Compare("<", a, B("+", b, c))),
    ("a + b >= c * d", A.Compare(">=", B("+", a, b), B("*", c, d))),
    ("a @ b * c", B("*", B("@", a, b), c)),
    ("a * b @ c", B("@", B("*", a, b), c)),
    ("a + b * c", B("+", a, B("*", b, c))),
    ("a * b + c", B("+", B("*", a, b), c)),
    ("-a * b", B("*", A.Neg(a), b)),
    ("a * -b", B("*", a, A.Neg(b))),
    ("a - -b", B("-", a, A.Neg(b))),
    ("- - a", A.Neg(A.Neg(a))),
    ("(a + b) * c", B("*", B("+", a, b), c)),
    ("a - (b - c)", B("-", a, B("-", b, c))),
    ("(a ^ b) ^ c", B("^", B("^", a, b), c)),
    ("a == b", A.Compare("==", a, b)),
    ("a != b - 1", A.Compare("!=", a, B("-", b, A.Num(1)))),
    ("(a < b) < c", A.Compare("<", A.Compare("<", a, b), c)),
    ("a <= b", A.Compare("<=", a, b)),
    ("a > b", A.Compare(">", a, b)),
    ("2 * x ^ 2", B("*", A.Num(2), B("^", N("x"), A.Num(2)))),
    ("-x[i -> j]", A.Neg(A.EdgeOps(N("x"), (A.Rename("i", "j"),)))),
    ("f(a)[i -> j] ^ 2", B("^", A.EdgeOps(C("f", a), (A.Rename("i", "j"),)), A.Num(2))),
    ("a @ [i = j]", B("@", a, A.Indicator((A.Affine((T(1, None, "i"),)), A.Affine((T(1, None, "j"),))), ("=",)))),
]


@pytest.mark.parametrize("src, tree", PRECEDENCE, ids=[s for s, _ in PRECEDENCE])
def test_precedence_and_associativity(src, tree):
    assert expr(src) == tree


def test_numbers_and_names():
    assert expr("3") == A.Num(3) and isinstance(expr("3").value, int)
    assert expr("0.5") == A.Num(0.5) and expr("1e-5") == A.Num(1e-5)
    assert isinstance(expr("1E3").value, float) and expr("2.5e+2") == A.Num(250.0)
    assert math.isinf(expr("inf").value)
    assert expr("info") == N("info") and expr("t'") == N("t'") and expr("_x1'") == N("_x1'")
    assert expr("input'") == N("input'") and expr("dims") == N("dims")


@pytest.mark.parametrize("src, col", [("dim n = \u0663", 9), ("x = \u0663", 5), ("x = \uff13", 5),
                                      ("x = \u0b67j", 5), ("dim n = 1\u0663", 10),
                                      ("x = 1.\u0665", 6), ("x = 1e\u0663", 6)])
def test_numbers_are_ascii_digits_only(src, col):
    """A numeric literal is ASCII digits: `dim n = \u0663` (an Arabic-Indic 3) or a
    fullwidth digit is a syntax error where the ASCII literal stops (at the digit, or
    at the `.`/`e` whose fraction/exponent is not ASCII), as `-D n=\u0663` is refused."""
    err = error(src)
    assert (err.loc.line, err.loc.col) == (1, col), (src, str(err))
    assert err.message.startswith("unexpected "), str(err)


def test_calls():
    assert expr("f()") == C("f")
    assert expr("max(0, x)") == C("max", A.Num(0), N("x"))
    assert expr("sum[e, f](x)") == C("sum", N("x"), edges=["e", "f"])
    assert expr("layernorm[e](x, w, b, eps = 1e-5)") == C(
        "layernorm", N("x"), N("w"), N("b"), edges=["e"], kwargs=[A.Kwarg("eps", A.Num(1e-5))])
    assert expr("grad(loss, W)") == C("grad", N("loss"), N("W"))
    assert expr("jvp(f, x, dx)") == C("jvp", N("f"), N("x"), N("dx"))
    assert expr("vjp(f, x, v)") == C("vjp", N("f"), N("x"), N("v"))
    assert expr("size(e)") == C("size", N("e"))
    assert expr("where(c > 0, a, b)") == C("where", A.Compare(">", c, A.Num(0)), a, b)
    assert expr("f(a, b,)") == C("f", a, b)
    assert expr("grad(grad(loss, W) @ V, W)") == C("grad", B("@", C("grad", N("loss"), N("W")), N("V")), N("W"))


def test_edge_operations():
    assert expr("x[i -> j]") == A.EdgeOps(N("x"), (A.Rename("i", "j"),))
    assert expr("x[i -> j, j -> i]") == A.EdgeOps(N("x"), (A.Rename("i", "j"), A.Rename("j", "i")))
    conv = expr("x[t = 2*s + k - 1]")
    assert conv == A.EdgeOps(N("x"), (A.Reindex("t", B("-", B("+", B("*", A.Num(2), N("s")), N("k")), A.Num(1))),))
    assert expr("E[vocab = ids]") == A.EdgeOps(N("E"), (A.Reindex("vocab", N("ids")),))
    assert expr("x[c = hd*head + hd, i -> j][k -> l]") == A.EdgeOps(
        A.EdgeOps(N("x"), (A.Reindex("c", B("+", B("*", N("hd"), N("head")), N("hd"))), A.Rename("i", "j"))),
        (A.Rename("k", "l"),))
    assert expr("(a + b)[i -> j]") == A.EdgeOps(B("+", a, b), (A.Rename("i", "j"),))
    assert expr("A[j -> k] @ A") == B("@", A.EdgeOps(N("A"), (A.Rename("j", "k"),)), N("A"))


def test_concatenation_example():
    e = expr("a[t1 = t] + b[t2 = t - size(t1)]")
    assert e == B("+", A.EdgeOps(a, (A.Reindex("t1", N("t")),)),
                  A.EdgeOps(b, (A.Reindex("t2", B("-", N("t"), C("size", N("t1")))),)))


INDICATORS = [
    ("[i = j]", [[T(1, None, "i")], [T(1, None, "j")]], ["="]),
    ("[i = j = k]", [[T(1, None, "i")], [T(1, None, "j")], [T(1, None, "k")]], ["=", "="]),
    ("[t = s + k]", [[T(1, None, "t")], [T(1, None, "s"), T(1, None, "k")]], ["="]),
    ("[s <= t]", [[T(1, None, "s")], [T(1, None, "t")]], ["<="]),
    ("[c = hd*head + hd]", [[T(1, None, "c")], [T(1, "hd", "head", True), T(1, None, "hd")]], ["="]),
    ("[i != j]", [[T(1, None, "i")], [T(1, None, "j")]], ["!="]),
    ("[i == j]", [[T(1, None, "i")], [T(1, None, "j")]], ["="]),
    ("[s < t < u]", [[T(1, None, "s")], [T(1, None, "t")], [T(1, None, "u")]], ["<", "<"]),
    ("[t = 9 - s]", [[T(1, None, "t")], [T(9), T(-1, None, "s")]], ["="]),
    ("[-s + 2*t - 1 > 0]", [[T(-1, None, "s"), T(2, None, "t"), T(-1)], [T(0)]], [">"]),
    ("[t2 = t - size(t1)]", [[T(1, None, "t2")], [T(1, None, "t"), T(-1, "t1", None)]], ["="]),
    ("[c = 2*hd*head]", [[T(1, None, "c")], [T(2, "hd", "head", True)]], ["="]),
    ("[c = -(s - k)]", [[T(1, None, "c")], [T(-1, None, "s"), T(1, None, "k")]], ["="]),
    ("[c >= -2*s]", [[T(1, None, "c")], [T(-2, None, "s")]], [">="]),
]


@pytest.mark.parametrize("src, terms, ops", INDICATORS, ids=[s for s, _, _ in INDICATORS])
def test_indicators(src, terms, ops):
    assert expr(src) == A.Indicator(tuple(A.Affine(tuple(t)) for t in terms), tuple(ops))


def test_to_affine_of_reindex():
    (item,) = expr("x[t = 2*s + k - 1]").items
    assert A.to_affine(item.rhs) == A.Affine((T(2, None, "s"), T(1, None, "k"), T(-1)))
    (item,) = expr("x[vocab = ids]").items
    assert A.to_affine(item.rhs) == A.Affine((T(1, None, "ids"),))


@pytest.mark.parametrize("rhs, col", [("s*2", 11), ("s / 2", 11), ("s ^ 2", 11), ("0.5*s", 11),
                                      ("hd*dd*s", 11), ("f(s)", 11), ("2*(s + 1)", 13)])
def test_to_affine_errors(rhs, col):
    (item,) = expr(f"x[t = {rhs}]").items
    with pytest.raises(CompileError) as info:
        A.to_affine(item.rhs)
    assert (info.value.loc.line, info.value.loc.col) == (1, col)


# ---- layout: newlines, brackets, comments ------------------------------------------


def test_statements_continue_inside_brackets():
    src = """y = f(a,   # first
      b,

      c)
z = x[i -> j,
      t = s
          + k]
w = [t =
     s + k]
input big[batch,
          features]
out y[a,
      b] = 1
"""
    y, z, w, big, o = items(src)
    assert y == A.Bind("y", C("f", a, b, c))
    assert z.expr == A.EdgeOps(N("x"), (A.Rename("i", "j"), A.Reindex("t", B("+", N("s"), N("k")))))
    assert w.expr.ops == ("=",) and big.edges[1] == A.EdgeSpec("features", None)
    assert o.order == (a, b)


def test_newline_ends_statement_outside_brackets():
    assert error("x = a +\n  b").loc.line == 1


def test_crlf_tabs_and_no_final_newline():
    assert items("x = 1\r\n\ty = 2\r\nz = 3") == (A.Bind("x", A.Num(1)), A.Bind("y", A.Num(2)), A.Bind("z", A.Num(3)))


def test_a_lone_carriage_return_ends_a_line_and_a_comment():
    """Classic Mac line ends: a comment ends at a lone CR, so it does not swallow the
    rest of the file (which was then silently an empty program)."""
    assert items("x = 1  # one\ry = 2\r\rz = 3\r") == (A.Bind("x", A.Num(1)), A.Bind("y", A.Num(2)), A.Bind("z", A.Num(3)))
    assert error("x = 1\ry = )\r").loc.line == 2


# ---- locations ------------------------------------------------------------------


def test_locations():
    src = "dim n = 4\nfn f(x) {\n  return x\n}\ny = (a + b) * size(n)\n"
    dim, fn, y = items(src)
    assert (dim.loc.file, dim.loc.line, dim.loc.col) == ("t.tg", 1, 5)
    assert (fn.loc.line, fn.loc.col, fn.loc.end_line, fn.loc.end_col) == (2, 4, 4, 2)  # from the name
    assert (y.loc.line, y.loc.col, y.loc.end_col) == (5, 1, 22)
    lhs = y.expr.lhs
    assert (lhs.loc.col, lhs.loc.end_col) == (5, 12)  # widened to its parentheses
    assert (lhs.lhs.loc.col, lhs.lhs.loc.end_col) == (6, 7)
    call = y.expr.rhs
    assert (call.loc.col, call.loc.end_col) == (15, 22) and call.args[0].loc.col == 20


def test_statement_locations_start_at_the_name():
    imp, o, u, t = items('import "a.tg"\nout  z[i] = 1\nupdate W = 2\ninput  x[i: n, j]\n')
    assert (imp.loc.line, imp.loc.col, imp.loc.end_col) == (1, 8, 14)
    assert (o.loc.line, o.loc.col, o.loc.end_col) == (2, 6, 14)
    assert (u.loc.line, u.loc.col) == (3, 8)
    assert (t.loc.line, t.loc.col) == (4, 8)
    i, j = t.edges
    assert (i.loc.col, i.loc.end_col, i.dim_loc.col, i.dim_loc.end_col) == (10, 14, 13, 14)
    assert j.dim_loc is None and j.loc.col == 16


def test_rename_locations():
    (r,) = expr("x[i ->  jj]").items
    assert (r.loc.col, r.loc.end_col, r.dst_loc.col, r.dst_loc.end_col) == (7, 15, 13, 15)


def test_location_counts_characters_not_bytes():
    (_, s) = items("z = q # é é\nzz = qq")
    assert (s.expr.loc.line, s.expr.loc.col) == (2, 6)
    e = error('x = "é" + 1')
    assert (e.loc.col, e.loc.end_col) == (5, 8) and "unexpected string" in e.message


def test_ast_holds_no_parser_objects():
    allowed = (A.Node, str, int, float, type(None))
    todo = [parse(MLP + "z = x[t = 2*s - 1] @ [s <= t]\n", "t.tg")]
    while todo:
        node = todo.pop()
        assert isinstance(node, allowed + (tuple,)), type(node)
        if isinstance(node, tuple):
            todo.extend(node)
        elif isinstance(node, A.Node):
            assert node.loc.file == "t.tg" and node.loc.line >= 1
            todo.extend(getattr(node, f) for f in node.__dataclass_fields__ if f != "loc")


# ---- errors ---------------------------------------------------------------------

ERRORS = [
    ("x = )", 1, 5, "unexpected token ')'; expected one of: NAME, NUMBER, '(', '-', '['"),
    ("x = (1 + 2", 1, 11, "unexpected end of input; expected ')'"),
    ("x = 1 +", 1, 8, "unexpected end of input; expected one of: NAME, NUMBER"),
    ("x = 1 +\ny = 2", 1, 8, "unexpected end of line"),
    ("x = $", 1, 5, "unexpected character '$'"),
    ("a = b < c < d", 1, 11, "comparisons do not chain"),
    ("a = b == c != d", 1, 12, "comparisons do not chain"),
    ("x = f(a < b < c)", 1, 13, "comparisons do not chain"),
    ('import "abc', 1, 8, "unterminated string"),
    ("import abc", 1, 8, "unexpected name 'abc'; expected STRING"),
    ("input x: f8[a]", 1, 10, "unknown dtype 'f8'"),
    ("input x[]", 1, 9, "unexpected token ']'; expected NAME"),
    ("y = x[i]", 1, 7, "expected '->' (rename) or '='"),
    ("y = x[i, j -> k]", 1, 7, "expected '->'"),
    ("y = sum[i -> j](x)", 1, 9, "edge list of a call holds only edge names"),
    ("y = f(a = 1, 2)", 1, 14, "positional argument after keyword argument"),
    ("y = f(a = 1, a = 2)", 1, 14, "keyword argument 'a' given twice"),
    ("fn f(x, x) = x", 1, 9, "duplicate parameter 'x'"),
    ("fn f(a = 1, b) = a", 1, 13, "parameter 'b' without a default"),
    ("fn f[e, e](x) = x", 1, 9, "duplicate edge parameter 'e'"),
    ("dim d = 0.5", 1, 9, "a dim size must be an integer"),
    ("dim d = 2 ^ 3", 1, 11, "unexpected token '^'"),
    ("dim d = -1", 1, 9, "unexpected token '-'"),
    ("dim", 1, 4, "unexpected end of input; expected NAME"),
    ("dim a b", 1, 7, "unexpected name 'b'"),
    ("x = 1e999", 1, 5, "number literal out of range"),
    ("x = " + "9" * 5000, 1, 5, "number literal too long"),
    ("out = 3", 1, 5, "unexpected token '='; expected NAME"),
    ("return = 3", 1, 1, "unexpected keyword 'return'"),
    ("input = 3", 1, 7, "unexpected token '='; expected NAME"),
    ("x = [s*2 = t]", 1, 6, "the edge of an index term comes last"),
    ("x = [i = j^2]", 1, 10, "not an affine index expression"),
    ("x = [i = 0.5]", 1, 10, "not an affine index expression"),
    ("x = [i]", 1, 7, "unexpected token ']'"),
    ("x = []", 1, 6, "unexpected token ']'"),
    ("x = 1 2", 1, 7, "unexpected number '2'"),
    ("x = a b", 1, 7, "unexpected name 'b'"),
    ("fn f(x) {\n  return x\n", 2, 11, "unexpected end of input; expected one of: '}', newline"),
    ("fn f(x) {\n  a = x\n}", 3, 1, "unexpected token '}'"),
    ("fn f(x) { return x; y = 1 }", 1, 19, "unexpected character ';'; expected one of:"),
    ("fn f(x) { return x\n y = 1 }", 2, 2, "unexpected name 'y'; expected one of: '}', newline"),
    ("x = 1; y = 2", 1, 6, "unexpected character ';'"),
    ("fn f(x) =\n x", 1, 10, "unexpected end of line"),
    ("fn (x) = x", 1, 4, "unexpected token '('; expected NAME"),
    ("fn f(x) { out y }", 1, 11, "unexpected keyword 'out'"),
    ("x = (1 + 2\ny = 3", 2, 1, "unexpected name 'y'"),
    ("x = f(a, b c)", 1, 12, "unexpected name 'c'"),
    ("x = f(,)", 1, 7, "unexpected token ','"),
    ("x = f[](a)", 1, 7, "unexpected token ']'; expected NAME"),
    ("x = a[i -> ]", 1, 12, "unexpected token ']'; expected NAME"),
    ("x = a[t = ]", 1, 11, "unexpected token ']'"),
    ("x = a[t = s < 3]", 1, 13, "unexpected token '<'"),
    ("update W", 1, 9, "unexpected end of input; expected '='"),
    ("update W[i] = 3", 1, 9, "unexpected token '['; expected '='"),
    ("out y[batch, ] = 3", 1, 14, "unexpected token ']'; expected NAME"),
    ("input x[i: ]", 1, 12, "unexpected token ']'; expected NAME"),
    ("state m[i],", 1, 12, "unexpected end of input; expected NAME"),
    ("x = 1.", 1, 6, "unexpected character '.'"),
    ("x = é", 1, 5, "unexpected character 'é'"),
    ("x = \0", 1, 5, "unexpected character U+0000"),
    ("\tx = )", 1, 6, "unexpected token ')'"),
    ("a = 1\r\nb = )\r\n", 2, 5, "unexpected token ')'"),
    ("x = 1\n\n\n  # c\n\ny = )", 6, 5, "unexpected token ')'"),
    ("x = a +\n", 1, 8, "unexpected end of line"),
    ("x = y @", 1, 8, "unexpected end of input"),
    ("x = 3 = 4", 1, 7, "unexpected token '='"),
    ("x == 3", 1, 3, "unexpected token '=='; expected '='"),
    ("y = x -> m", 1, 7, "unexpected token '->'"),
    ("3 = x", 1, 1, "unexpected number '3'"),
    ("x = {a}", 1, 5, "unexpected token '{'"),
    ("x = (a]", 1, 7, "unexpected token ']'"),
    ("x = a[i -> j", 1, 13, "unexpected end of input; expected one of: ',', ']'"),
]


@pytest.mark.parametrize("src, line, col, message", ERRORS, ids=[s[:30] for s, *_ in ERRORS])
def test_syntax_errors_are_located(src, line, col, message):
    e = error(src)
    assert e.loc is not None and e.loc.file == "t.tg"
    assert (e.loc.line, e.loc.col) == (line, col), str(e)
    assert message in e.message, e.message
    assert "__ANON" not in e.message and "RPAR" not in e.message and "LSQB" not in e.message


def test_error_span_covers_token():
    e = error("x = foo bar")
    assert (e.loc.line, e.loc.col, e.loc.end_line, e.loc.end_col) == (1, 9, 1, 12)


def test_unclosed_bracket_note_and_rendering():
    src = "x = f(1 +\n  2\ny = 3\n"
    e = error(src)
    assert (e.loc.line, e.loc.col) == (3, 1)
    (note,) = e.notes
    assert note.severity == "note" and (note.loc.line, note.loc.col) == (1, 6)
    text = e.format({"t.tg": src})
    assert text.splitlines()[0].startswith("t.tg:3:1: error: unexpected name 'y'")
    assert " ^" in text and "t.tg:1:6: note: '(' opened here is not closed" in text


def test_unclosed_brace_at_end():
    e = error("fn f(x) {\n  a = x\n")
    assert (e.loc.line, e.loc.col) == (2, 8) and e.notes[0].loc.line == 1


# ---- deep and large input ---------------------------------------------------------


def test_5000_deep_parentheses_parse():
    (s,) = items("x = " + "(" * 5000 + "a" + ")" * 5000)
    assert s.expr == a


@pytest.mark.parametrize("src", [
    "x = " + "-(" * 5000 + "a" + ")" * 5000,
    "x = " + "f(" * 5000 + "a" + ")" * 5000,
    "x = " + "(a + " * 5000 + "a" + ")" * 5000,
    "x = " + " + ".join(["a"] * 5000),
    "x = " + "a" + "[i -> j]" * 5000,
    "x = " + "(" * 5000 + "a" + ")" * 4999,
    "x = " + "[" * 5000 + "a",
])
def test_5000_deep_nesting_is_a_located_error(src):
    e = error(src)
    assert e.loc is not None and e.loc.line == 1 and e.loc.col >= 1


def test_nesting_up_to_limit_parses():
    (s,) = items("x = " + " + ".join(["a"] * (MAX_DEPTH - 3)))  # + Bind, Program
    assert isinstance(s.expr, A.BinOp)
    assert "nested too deeply" in error("x = " + " + ".join(["a"] * (MAX_DEPTH + 2))).message


def test_large_file_parses_quickly():
    block = MLP + "z = x[c = hd*head + hd, i -> j] @ [s <= t]\n"
    text = block * (300_000 // len(block))
    start = time.perf_counter()
    prog = parse(text, "big.tg")
    assert len(prog.items) == 18 * (300_000 // len(block))
    assert time.perf_counter() - start < 30


# ---- reading files ----------------------------------------------------------------


def test_read_source(tmp_path):
    p = tmp_path / "ok.tg"
    p.write_bytes(b"\xef\xbb\xbfx = 1  # caf\xc3\xa9\n")
    text, name = read_source(p)
    assert name == str(p) and parse(text, name).items == (A.Bind("x", A.Num(1)),)


@pytest.mark.parametrize("data, line, col, message", [
    (b"x = 1\ny = \xff\n", 2, 5, "invalid UTF-8 byte 0xff"),
    (b"# \xc3\xa9\xfe", 1, 4, "invalid UTF-8 byte 0xfe"),
    (b"x = 1\n\x00\x01\x02", 2, 1, "binary file"),
    (b"\x7fELF\x02\x01\x01\x00\x00", 1, 8, "binary file"),
])
def test_read_source_bad_bytes(tmp_path, data, line, col, message):
    p = tmp_path / "bad.tg"
    p.write_bytes(data)
    with pytest.raises(CompileError) as info:
        read_source(p)
    e = info.value
    assert (e.loc.file, e.loc.line, e.loc.col) == (str(p), line, col) and message in e.message


def test_read_source_directory_and_missing(tmp_path):
    with pytest.raises(CompileError) as info:
        read_source(tmp_path)
    assert "directory" in info.value.message and info.value.loc.line == 1
    with pytest.raises(CompileError) as info:
        read_source(tmp_path / "missing.tg")
    assert "cannot read" in info.value.message and info.value.loc.file.endswith("missing.tg")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads any file")
def test_read_source_unreadable(tmp_path):
    p = tmp_path / "secret.tg"
    p.write_text("x = 1\n")
    p.chmod(0)
    with pytest.raises(CompileError) as info:
        read_source(p)
    assert "cannot read" in info.value.message


# ---- the grammar file and the prelude -----------------------------------------------


def test_grammar_symlink_points_at_repo_grammar():
    link = ROOT / "tgc" / "frontend" / "tg.lark"
    assert link.resolve() == (ROOT / "grammar" / "tg.lark").resolve()


def test_prelude_parses():
    prelude = ROOT / "tgc" / "frontend" / "prelude.tg"
    if not prelude.exists():
        pytest.skip("no prelude yet")
    prog = parse(*read_source(prelude))
    assert all(isinstance(s, A.FnDef) for s in prog.items)


# ---- the fast paths build exactly what lark and the constructors build ----------------


def _dump(x) -> str:
    """Every field of a tree, locations included (== leaves them out)."""
    import dataclasses

    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return f"{type(x).__name__}(" + ", ".join(
            f"{f.name}={_dump(getattr(x, f.name))}" for f in dataclasses.fields(x)) + ")"
    if isinstance(x, tuple):
        return "(" + ", ".join(_dump(y) for y in x) + ")"
    return repr(x)


def _plain_lark_result(text: str, filename: str) -> str:
    """The tree (or the error) lark's own lexer and callbacks give, as `_dump` text."""
    from lark import Lark
    from lark.exceptions import UnexpectedInput

    from tgc.frontend import parser as P

    plain = _plain_lark_result.__dict__.get("parser")
    if plain is None:
        grammar = P._grammar_path().read_text(encoding="utf-8")
        plain = _plain_lark_result.parser = Lark(grammar, postlex=P._POSTLEX, transformer=P._BUILDER, **P._OPTIONS)
    P._BUILDER.start_parse(filename)
    try:
        return _dump(plain.parse(text))
    except UnexpectedInput as e:
        return _dump(P._syntax_error(e, filename).diagnostics())
    except CompileError as e:
        return _dump(e.diagnostics())


def _tgc_result(text: str, filename: str) -> str:
    try:
        return _dump(parse(text, filename))
    except CompileError as e:
        return _dump(e.diagnostics())


def test_parser_matches_plain_lark_with_locations_and_errors():
    """`parse` (tgc's lexer loop, its tuned reductions and fast constructors) gives the
    trees, locations and errors of a lark built from the grammar with lark's own lexer
    and callbacks: on the examples, the test programs and seeded mutants of them."""
    import random

    from test_frontend_fuzz import CORPUS, mutate

    texts = [p.read_text() for p in CORPUS]
    texts += [p.read_text() for p in sorted((ROOT / "tests" / "programs" / "bad").glob("*.tg"))]
    rng = random.Random(19)
    texts += [mutate(rng.choice(texts[:len(CORPUS)]), random.Random(i)) for i in range(400)]
    texts += ["x = " + " + ".join(["a"] * (MAX_DEPTH + k)) for k in (-3, -2, 2)]
    texts += ["x = 1   ", "x = 1 \t\f\r\n  y = x   # c  \n\t\n", "x = 1   $", "x =   \n", "   ", "", "\t",
              "x = (a +\n   b)  ", "x = a   \u00e9", "  # only\n   ", "x = 1\r\n y = 2 \r\n", "x\t=\ta\t*\t2\t",
              "x = a  [ i -> j ]  ", "x = 1 \f", "x = 1\n\n   \n  \n"]   # blanks where lexing turns
    for text in texts:   # `parse` reads a lone CR as a line end, as lark's lexer does LF
        plain = text.replace("\r\n", "\n").replace("\r", "\n")
        assert _tgc_result(text, "t.tg") == _plain_lark_result(plain, "t.tg"), text


def test_fast_constructors_build_what_the_constructors_build():
    import dataclasses

    from tgc.frontend.parser import _loc
    from tgc.ir.diag import Loc

    assert _loc("t.tg", 1, 2, 3, 4) == Loc("t.tg", 1, 2, 3, 4)
    assert vars(_loc("t.tg", 1, 2, 3, 4)) == vars(Loc("t.tg", 1, 2, 3, 4))
    loc = Loc("t.tg", 2, 3, 2, 9)
    for cls in [c for c in vars(A).values() if isinstance(c, type) and issubclass(c, A.Node)]:
        fields = {f.name: f"v_{f.name}" for f in dataclasses.fields(cls)} | {"loc": loc}
        made, built = cls(**fields), A.build(cls, dict(fields))
        assert type(built) is cls and vars(built) == vars(made) and built == made, cls
        assert hash(built) == hash(made) and repr(built) == repr(made)
        moved = A.with_loc(made, Loc("t.tg", 1, 1, 1, 2))
        assert moved == dataclasses.replace(made, loc=Loc("t.tg", 1, 1, 1, 2))
        assert vars(moved) == vars(dataclasses.replace(made, loc=Loc("t.tg", 1, 1, 1, 2)))
        with pytest.raises(dataclasses.FrozenInstanceError):
            built.loc = loc
