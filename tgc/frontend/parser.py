"""Parse .tg source text into the syntax tree of `tgc.frontend.ast`.

`parse(text, filename)` runs lark's LALR parser over `grammar/tg.lark` and turns
the parse tree into AST nodes without Python recursion, so deeply nested input
cannot overflow the stack; expressions nested deeper than `MAX_DEPTH` are a
located error instead (the elaborator may then recurse freely).
`read_source(path)` reads a file as UTF-8 text. Every problem with the input is
raised as `tgc.ir.diag.CompileError` with a location, never as another exception.
"""
from __future__ import annotations

import copy
import functools
import threading
from dataclasses import dataclass
from pathlib import Path

from lark import Lark, Token, Tree
from lark.parsers.lalr_parser_state import ParserState
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from tgc.frontend import ast
from tgc.ir.diag import CompileError, Loc

MAX_DEPTH = 256  # most AST nodes on any root-to-leaf path; see the module docstring
DTYPES = ("i32", "f32", "f64")


def parse(text: str, filename: str) -> ast.Program:
    """The AST of `text`; `filename` goes into every Loc. Raises CompileError."""
    try:
        tree = _lark().parse(text)
    except UnexpectedInput as e:
        raise _syntax_error(e, filename) from None
    return _Builder(filename).build(tree)


def read_source(path) -> tuple[str, str]:
    """(text, filename) of a .tg file; a located CompileError if it is unreadable,
    a directory, binary (NUL bytes) or not UTF-8."""
    name = str(path)
    try:
        data = Path(path).read_bytes()
    except IsADirectoryError:
        raise CompileError(f"'{name}' is a directory, not a source file", Loc(name, 1, 1)) from None
    except OSError as e:
        raise CompileError(f"cannot read '{name}': {e.strerror or e}", Loc(name, 1, 1)) from None
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    nul = data.find(b"\0")
    if nul >= 0:
        raise CompileError("binary file: NUL byte in source", _byte_loc(data, nul, name))
    try:
        return data.decode("utf-8"), name
    except UnicodeDecodeError as e:
        msg = f"invalid UTF-8 byte 0x{data[e.start]:02x} in source"
        raise CompileError(msg, _byte_loc(data, e.start, name)) from None


def _byte_loc(data: bytes, offset: int, name: str) -> Loc:
    line_start = data.rfind(b"\n", 0, offset) + 1
    col = len(data[line_start:offset].decode("utf-8", errors="replace")) + 1
    return Loc(name, data.count(b"\n", 0, offset) + 1, col, data.count(b"\n", 0, offset) + 1, col + 1)


# ---- the lark parser ------------------------------------------------------------

_OPEN = {"LPAR", "LSQB", "LBRACE"}
_CLOSE = {"RPAR", "RSQB", "RBRACE"}


class _BracketNewlines:
    """Postlexer: drop newlines inside ( ) and [ ], where a statement continues."""

    always_accept = ("_NL",)

    def process(self, stream):
        open_ = []
        for tok in stream:
            kind = tok.type
            if kind in _OPEN:
                open_.append(kind)
            elif kind in _CLOSE:
                if open_:
                    open_.pop()
            elif kind == "_NL" and open_ and open_[-1] != "LBRACE":
                continue
            yield tok


def _grammar_path() -> Path:
    here = Path(__file__).with_name("tg.lark")
    return here if here.exists() else Path(__file__).resolve().parents[2] / "grammar" / "tg.lark"


@functools.lru_cache(maxsize=1)
def _lark() -> Lark:
    return Lark(_grammar_path().read_text(encoding="utf-8"), parser="lalr", lexer="contextual",
                propagate_positions=True, postlex=_BracketNewlines(), maybe_placeholders=False)


# ---- syntax errors ------------------------------------------------------------

_NAMED = {"NAME": "NAME", "NUMBER": "NUMBER", "STRING": "STRING", "_NL": "newline",
          "$END": "end of input", "COMPARE": "comparison", "DECL_KIND": "'input'/'param'/'state'"}
_IGNORED = {"WS", "COMMENT"}


def _syntax_error(e: UnexpectedInput, filename: str) -> CompileError:
    if isinstance(e, UnexpectedCharacters):
        ch = e.char
        msg = "unterminated string" if ch == '"' else f"unexpected character {_char(ch)}"
        return CompileError(msg, Loc(filename, e.line, e.column, e.line, e.column + 1))
    if isinstance(e, UnexpectedToken):
        return _token_error(e, filename)
    if isinstance(e, UnexpectedEOF):  # not raised by LALR; kept for safety
        return CompileError("unexpected end of input", Loc(filename, 1, 1))
    return CompileError(f"syntax error: {e}", Loc(filename, getattr(e, "line", 1) or 1,
                                                   getattr(e, "column", 1) or 1))


def _char(ch: str) -> str:
    return f"'{ch}'" if ch.isprintable() and not ch.isspace() else f"U+{ord(ch):04X}"


def _token_error(e: UnexpectedToken, filename: str) -> CompileError:
    tok = e.token
    loc = _token_loc(tok, filename)
    if tok.type == "COMPARE" and _after_comparison(e):
        return CompileError("comparisons do not chain: `a < b < c` is an error; "
                            "write `(a < b) * (b < c)`", loc)
    expected = _friendly_expected(_accepted(e))
    msg = f"unexpected {_describe(tok)}"
    if expected:
        msg += f"; expected {expected[0]}" if len(expected) == 1 else \
            f"; expected one of: {', '.join(expected)}"
    return CompileError(msg, loc)


def _token_loc(tok: Token, filename: str) -> Loc:
    if tok.type != "$END":
        end_col = tok.end_column if tok.end_line == tok.line else tok.column + 1
        return Loc(filename, tok.line, tok.column, tok.line, end_col)
    if tok.line is None:  # empty token stream
        return Loc(filename, 1, 1, 1, 2)
    if tok.end_line is not None and tok.end_line > tok.line:  # borrowed from a newline
        return Loc(filename, tok.line, tok.column, tok.line, tok.column + 1)
    return Loc(filename, tok.end_line, tok.end_column, tok.end_line, tok.end_column + 1)


def _after_comparison(e: UnexpectedToken) -> bool:
    stack = getattr(e.state, "value_stack", None) or []
    return len(stack) >= 2 and isinstance(stack[-2], Token) and stack[-2].type == "COMPARE"


def _accepted(e: UnexpectedToken) -> set[str]:
    """Terminals that really advance the parser here. LALR tables merge lookaheads,
    so each candidate is tried on a copy of the parser state, as lark's
    InteractiveParser.accepts() does."""
    state = e.state
    if not isinstance(state, ParserState):
        return {t for t in (e.expected or ()) if t.isupper()}
    conf = copy.copy(state.parse_conf)
    conf.callbacks = {}
    ok = set()
    for name in state.parse_conf.states[state.position]:
        if not name.isupper():  # a rule's goto entry, not a terminal
            continue
        trial = ParserState(conf, state.lexer, list(state.state_stack), list(state.value_stack))
        try:
            trial.feed_token(Token(name, ""), is_end=name == "$END")
        except (UnexpectedToken, AssertionError):
            continue
        ok.add(name)
    return ok


def _friendly_expected(names: set[str]) -> list[str]:
    terms = {t.name: t for t in _lark().terminals}
    out = []
    for name in names - _IGNORED:
        if name in _NAMED:
            out.append(_NAMED[name])
        elif name in terms and terms[name].pattern.type == "str":
            out.append(f"'{terms[name].pattern.value}'")
        else:
            out.append(name)
    first = ("NAME", "NUMBER", "STRING")
    last = ("newline", "end of input")
    return sorted(out, key=lambda s: (s in last, s not in first, s))


def _describe(tok: Token) -> str:
    kind, text = tok.type, str(tok)
    if kind == "$END":
        return "end of input"
    if kind == "_NL":
        return "end of line"
    if kind == "NAME":
        return f"name '{text}'"
    if kind == "NUMBER":
        return f"number '{text}'"
    if kind == "STRING":
        return f"string {text}"
    return f"keyword '{text}'" if text.isalpha() else f"token '{text}'"


# ---- lark tree -> AST -------------------------------------------------------------


@dataclass(frozen=True)
class _Part:
    """An intermediate piece of a node (an edge list, argument list, ...)."""

    kind: str
    value: object
    loc: Loc | None = None


class _Builder:
    """Builds AST nodes bottom-up with an explicit stack (no recursion)."""

    def __init__(self, filename: str):
        self.file = filename

    def build(self, root: Tree) -> ast.Program:
        values: list = []   # built children, in order
        depths: list = []   # nesting depth of each entry of `values`
        todo = [(root, False)]
        while todo:
            node, ready = todo.pop()
            if not isinstance(node, Tree):
                values.append(node)
                depths.append(0)
            elif ready:
                n = len(node.children)
                kids, values[len(values) - n:] = values[len(values) - n:], []
                built = self._make(node, kids)
                depth = max(depths[len(depths) - n:], default=0) + isinstance(built, ast.Node)
                del depths[len(depths) - n:]
                if depth > MAX_DEPTH:
                    raise CompileError(f"expression nested too deeply (over {MAX_DEPTH} "
                                       "levels); split it into several bindings", self._loc(node))
                values.append(built)
                depths.append(depth)
            else:
                todo.append((node, True))
                todo.extend((child, False) for child in reversed(node.children))
        return values[0]

    def _make(self, tree: Tree, kids: list):
        return getattr(self, "_" + tree.data)(kids, self._loc(tree))

    def _loc(self, item) -> Loc:
        if isinstance(item, Token):
            return Loc(self.file, item.line, item.column, item.end_line, item.end_column)
        m = item.meta
        if getattr(m, "empty", True):
            return Loc(self.file, 1, 1)
        return Loc(self.file, m.line, m.column, m.end_line, m.end_column)

    # -- statements --

    def _start(self, kids, loc):
        items = []
        for k in kids:
            items.extend(k) if isinstance(k, list) else items.append(k)
        return ast.Program(tuple(items), loc=loc)

    def _dim_decl(self, kids, loc):
        return list(kids)

    def _dim_item(self, kids, loc):
        expr = kids[2] if len(kids) == 3 else None
        if expr is not None:
            _check_dim_expr(expr)
        return ast.DimDecl(str(kids[0]), expr, loc=loc)

    def _tensor_decl(self, kids, loc):
        kind = str(kids[0])
        return [ast.TensorDecl(kind, *p.value, loc=p.loc) for p in kids[1:]]

    def _decl_item(self, kids, loc):
        name, dtype, edges = str(kids[0]), None, ()
        for k in kids[1:]:
            if isinstance(k, Token):
                dtype = str(k)
                if dtype not in DTYPES:
                    raise CompileError(f"unknown dtype '{dtype}'; expected one of: "
                                       + ", ".join(DTYPES), self._loc(k))
            else:
                edges = k.value
        return _Part("decl", (name, dtype, edges), loc)

    def _edge_specs(self, kids, loc):
        return _Part("specs", tuple(kids), loc)

    def _edge_spec(self, kids, loc):
        return ast.EdgeSpec(str(kids[0]), str(kids[1]) if len(kids) > 1 else None, loc=loc)

    def _fn_def(self, kids, loc):
        parts = {k.kind: k for k in kids if isinstance(k, _Part)}
        body, result = parts["block"].value if "block" in parts else ((), kids[-1])
        edges = parts["edges"].value if "edges" in parts else ()
        params = parts["params"].value if "params" in parts else ()
        _check_unique([e.id for e in edges], [e.loc for e in edges], "edge parameter")
        return ast.FnDef(str(kids[0]), edges, params, body, result, loc=loc)

    def _params(self, kids, loc):
        _check_unique([p.name for p in kids], [p.loc for p in kids], "parameter")
        seen_default = False
        for p in kids:
            if p.default is None and seen_default:
                raise CompileError(f"parameter '{p.name}' without a default follows "
                                   "one with a default", p.loc)
            seen_default = seen_default or p.default is not None
        return _Part("params", tuple(kids), loc)

    def _param(self, kids, loc):
        return ast.Param(str(kids[0]), kids[2] if len(kids) == 3 else None, loc=loc)

    def _fn_block(self, kids, loc):
        return _Part("block", (tuple(kids[:-1]), kids[-1]), loc)

    def _import_(self, kids, loc):
        return ast.Import(str(kids[0])[1:-1], loc=loc)

    def _bind(self, kids, loc):
        return ast.Bind(str(kids[0]), kids[2], loc=loc)

    def _out(self, kids, loc):
        order = next((k.value for k in kids if isinstance(k, _Part)), None)
        has_expr = len(kids) > 2 and isinstance(kids[-2], Token) and kids[-2].type == "EQ"
        expr = kids[-1] if has_expr else None
        return ast.Out(str(kids[0]), order, expr, loc=loc)

    def _update(self, kids, loc):
        return ast.Update(str(kids[0]), kids[2], loc=loc)

    def _edge_list(self, kids, loc):
        return _Part("edges", tuple(self._name(k) for k in kids), loc)

    # -- expressions --

    def _compare(self, kids, loc):
        return ast.Compare(str(kids[1]), kids[0], kids[2], loc=loc)

    def _binop(self, kids, loc):
        return ast.BinOp(str(kids[1]), kids[0], kids[2], loc=loc)

    def _neg(self, kids, loc):
        return ast.Neg(kids[1], loc=loc)

    def _name(self, kids, loc=None):  # a `name` tree's children, or one NAME token
        tok = kids if isinstance(kids, Token) else kids[0]
        return ast.Name(str(tok), loc=self._loc(tok))

    def _number(self, kids, loc):
        return ast.Num(_number_value(kids[0], loc), loc=loc)

    def _edge_ops(self, kids, loc):
        x = self._name(kids[0]) if isinstance(kids[0], Token) else kids[0]
        items = kids[1].value
        for item in items:
            if isinstance(item, _Part):
                raise CompileError(f"edge operation '{item.value}' needs '->' (rename) or "
                                   "'=' (reindex or gather); a bare edge list belongs to "
                                   "a call such as sum[e](x)", item.loc)
        return ast.EdgeOps(x, items, loc=loc)

    def _call(self, kids, loc):
        parts = {k.kind: k for k in kids[1:]}
        edges = None
        if "items" in parts:
            edges = tuple(self._call_edge(item) for item in parts["items"].value)
        args = parts["args"].value if "args" in parts else ()
        positional = tuple(a for a in args if not isinstance(a, ast.Kwarg))
        kwargs = tuple(a for a in args if isinstance(a, ast.Kwarg))
        _check_arg_order(args)
        return ast.Call(str(kids[0]), edges, positional, kwargs, loc=loc)

    def _call_edge(self, item) -> ast.Name:
        if not isinstance(item, _Part):
            raise CompileError("the edge list of a call holds only edge names "
                               "(rename or reindex the argument instead)", item.loc)
        return ast.Name(item.value, loc=item.loc)

    def _indicator(self, kids, loc):
        terms = tuple(ast.to_affine(k) for k in kids[0::2])
        ops = tuple("=" if str(op) == "==" else str(op) for op in kids[1::2])
        return ast.Indicator(terms, ops, loc=loc)

    def _items(self, kids, loc):
        return _Part("items", tuple(kids), loc)

    def _plain_edge(self, kids, loc):
        return _Part("plain", str(kids[0]), loc)

    def _rename(self, kids, loc):
        return ast.Rename(str(kids[0]), str(kids[2]), loc=loc)

    def _reindex(self, kids, loc):
        return ast.Reindex(str(kids[0]), kids[2], loc=loc)

    def _args(self, kids, loc):
        return _Part("args", tuple(kids), loc)

    def _kwarg(self, kids, loc):
        return ast.Kwarg(str(kids[0]), kids[2], loc=loc)


def _number_value(tok: Token, loc: Loc) -> int | float:
    text = str(tok)
    try:
        value = int(text) if text.isdigit() else float(text)
    except ValueError:  # more digits than Python converts
        raise CompileError("number literal too long", loc) from None
    if value == float("inf") and text != "inf":
        raise CompileError("number literal out of range", loc)
    return value


def _check_dim_expr(expr) -> None:
    """Dim sizes are integer expressions: no fractional literals."""
    if isinstance(expr, ast.Num) and not isinstance(expr.value, int):
        raise CompileError("a dim size must be an integer", expr.loc)
    if isinstance(expr, ast.BinOp):
        _check_dim_expr(expr.lhs)
        _check_dim_expr(expr.rhs)


def _check_unique(names: list[str], locs: list[Loc], what: str) -> None:
    seen = set()
    for name, loc in zip(names, locs):
        if name in seen:
            raise CompileError(f"duplicate {what} '{name}'", loc)
        seen.add(name)


def _check_arg_order(args: tuple) -> None:
    seen_kw: set[str] = set()
    for a in args:
        if isinstance(a, ast.Kwarg):
            if a.name in seen_kw:
                raise CompileError(f"keyword argument '{a.name}' given twice", a.loc)
            seen_kw.add(a.name)
        elif seen_kw:
            raise CompileError("positional argument after keyword argument", a.loc)
