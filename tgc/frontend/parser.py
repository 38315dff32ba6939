"""Parse .tg source text into the syntax tree of `tgc.frontend.ast`.

`parse(text, filename)` runs lark's LALR parser (basic lexer) over
`grammar/tg.lark` and builds each AST node in lark's reduce callback, so no
intermediate parse tree exists and nothing recurses: deeply nested input cannot
overflow the stack. Expressions nested deeper than `MAX_DEPTH` AST nodes are a
located error instead, so later stages may recurse over the AST freely.
`read_source(path)` reads a file as UTF-8 text. Every problem with the input is
raised as `tgc.ir.diag.CompileError` with a location, never as another exception.

Speed (`tgc check` of 10^5 statements takes seconds: benchmarks/frontend.py): the
time goes into lark's loop over tokens and reductions, so the grammar takes few
reductions per operand, the parser's rules compare by identity and its unit rules
return their child in C (`_tuned`), the lexer loop is lark's without its per-token
calls (`_Lexer`), and the callbacks of expressions build nodes and locations
directly. None of it changes a tree, a location or a message: the tests compare
`parse` with a lark built plainly from the grammar, errors and locations included.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import operator
import threading
from dataclasses import dataclass
from pathlib import Path

import lark
from lark import Lark, Token
from lark.grammar import Rule
from lark.lexer import BasicLexer, LexerState
from lark.parse_tree_builder import ExpandSingleChild
from lark.parsers.lalr_parser_state import ParserState
from lark.utils import TextSlice
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from tgc.frontend import ast
from tgc.frontend.ast import build
from tgc.ir.collector import gc_paused
from tgc.ir.diag import CompileError, Diagnostic, Loc

MAX_DEPTH = 256  # most AST nodes on any root-to-leaf path; see the module docstring
DTYPES = ("i32", "f32", "f64", "bf16", "f16", "c64", "c128")


def parse(text: str, filename: str) -> ast.Program:
    """The AST of `text`; `filename` goes into every Loc. Raises CompileError.

    A line ends at LF, CRLF or a lone CR (classic Mac files): as for `str.splitlines`,
    with which diagnostics show the line, so a comment ends at a lone CR too."""
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    parser = _lark()
    _BUILDER.start_parse(filename)
    try:
        with gc_paused():   # a parse allocates millions of acyclic objects: collecting is waste
            return parser.parse(text)
    except UnexpectedInput as e:
        if text.lstrip("\ufeff").startswith("// lowered"):   # `tgc dump-ir --after fuse` output, any suffix
            raise CompileError("this is a lowered program (a dump of a lowering stage), not .tg source: "
                               "`tgc opt` reads it", Loc(filename, 1, 1)) from None
        raise _syntax_error(e, filename) from None
    except RecursionError:  # not expected: nothing recurses on the input's nesting
        raise CompileError("input nested too deeply", Loc(filename, 1, 1)) from None


def read_source(path) -> tuple[str, str]:
    """(text, filename) of a source file ('-': standard input, named <stdin>): the one
    reader of .tg and .tgir files. A byte order mark is dropped; a located CompileError
    if the file is unreadable, a directory, binary (NUL bytes) or not UTF-8."""
    from tgc.fsutil import NotASource, read_source_bytes

    stdin = str(path) == "-"
    name = "<stdin>" if stdin else str(path)
    try:
        data = read_source_bytes(None if stdin else path)
    except IsADirectoryError:
        raise CompileError(f"'{name}' is a directory, not a source file", Loc(name, 1, 1)) from None
    except NotASource as e:
        raise CompileError(f"cannot read '{name}': {e}", Loc(name, 1, 1)) from None
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
    """The line and column (in characters) of byte `offset`."""
    line = data.count(b"\n", 0, offset) + 1
    line_start = data.rfind(b"\n", 0, offset) + 1
    col = len(data[line_start:offset].decode("utf-8", errors="replace")) + 1
    return Loc(name, line, col, line, col + 1)


# ---- the lark parser ------------------------------------------------------------

_OPEN = {"LPAR", "LSQB", "LBRACE"}
_CLOSE = {"RPAR", "RSQB", "RBRACE"}


class _BracketNewlines:
    """Postlexer: drop newlines inside ( ) and [ ], where a statement continues.
    `open_brackets()` lists the brackets still open, for error messages."""

    always_accept = ("_NL",)

    def __init__(self):
        self.local = threading.local()

    def open_brackets(self) -> list[Token]:
        return getattr(self.local, "open", [])

    def process(self, stream):
        open_ = self.local.open = []
        for tok in stream:
            kind = tok.type
            if kind in _OPEN:
                open_.append(tok)
            elif kind in _CLOSE:
                if open_:
                    open_.pop()
            elif kind == "_NL" and open_ and open_[-1].type != "LBRACE":
                continue
            yield tok


_TOKEN_FIELDS = ("type", "start_pos", "value", "line", "column", "end_line", "end_column", "end_pos")
_new_str = str.__new__


class _Lexer(BasicLexer):
    """lark's basic lexer, its loop made tighter: the same scanner (one regular
    expression of every terminal, in lark's order), the same `Token`s with the same
    positions, the same line counting (a newline counts only in the terminals lark
    counts it in) and the same errors. What it saves is lark's per-token calls through
    `next_token`, `match`, `Scanner.match` and `LineCounter.feed`, the two calls of
    `Token()` (a `str` whose eight fields this sets), and a match and a turn of the
    loop for each run of blanks: the scanner's expression is matched after any run of
    the ignored terminals that hold no newline (which lark would skip one match at a
    time without counting a line), taken possessively. Where that finds no token, one
    step of lark's own loop goes on from the blanks: it skips what it ignores and
    raises where nothing matches. A scanner lark split in several expressions, lexer
    callbacks, input other than a `TextSlice` or a `Token` with other fields are lexed
    by lark's own loop."""

    def lex(self, state: LexerState, parser_state):
        scanner, text = self.scanner, state.text
        if (len(scanner._mres) != 1 or self.callback or not isinstance(text, TextSlice)
                or getattr(Token, "__slots__", None) != _TOKEN_FIELDS):
            yield from super().lex(state, parser_state)
            return
        match = self._after_blanks(scanner._mres[0]).match
        ignored, newline_types = self.ignore_types, self.newline_types
        text, end, ctr = text.text, text.end, state.line_ctr
        nl = ctr.newline_char
        while True:
            pos, line, line_start, last = ctr.char_pos, ctr.line, ctr.line_start_pos, state.last_token
            try:
                while pos < end:
                    m = match(text, pos, end)
                    if m is None:
                        break
                    kind = m.lastgroup
                    value = m.group(kind)
                    pos = m.end()
                    start = pos - len(value)
                    first_line, column = line, start - line_start + 1
                    if kind in newline_types:
                        count = value.count(nl)
                        if count:
                            line += count
                            line_start = start + value.rindex(nl) + 1
                    if kind not in ignored:   # a Token, its fields set as lark's Token() sets them
                        last = _new_str(Token, value)
                        last.type, last.start_pos, last.value, last.line, last.column = kind, start, value, first_line, column
                        last.end_line, last.end_column, last.end_pos = line, pos - line_start + 1, pos
                        yield last
            finally:   # where lark's LineCounter would be
                ctr.char_pos, ctr.line, ctr.line_start_pos = pos, line, line_start
                ctr.column = pos - line_start + 1
                state.last_token = last
            if pos >= end:
                return
            try:   # no token after the blanks here: lark's own step
                token = super().next_token(state, parser_state)
            except EOFError:   # only ignored text was left
                return
            yield token

    def _after_blanks(self, scanner_re):
        """The scanner's expression after a possessive run of the ignored terminals
        that cannot hold a newline (made once per lexer)."""
        made = self.__dict__.get("_after_blanks_re")
        if made is None:
            blanks = [t.pattern.to_regexp() for t in self.terminals
                      if t.name in self.ignore_types and t.name not in self.newline_types]
            pattern = scanner_re.pattern
            if blanks:
                pattern = "(?:" + "|".join(f"(?:{b})" for b in blanks) + f")*+(?:{pattern})"
            made = self._after_blanks_re = self.re.compile(pattern, scanner_re.flags)
        return made


def _grammar_path() -> Path:
    here = Path(__file__).with_name("tg.lark")
    return here if here.exists() else Path(__file__).resolve().parents[2] / "grammar" / "tg.lark"


_TABLES = Path(__file__).with_name("lark_tables.json")   # `python -m tgc.frontend.parser` writes it
_OPTIONS = dict(parser="lalr", lexer="basic", keep_all_tokens=True, maybe_placeholders=False)
_RUNTIME_OPTIONS = ("postlex", "transformer", "_plugins")   # objects of this process, never serialized
_PLUGINS = {"BasicLexer": _Lexer}   # lark's hook for its basic lexer's class


@functools.lru_cache(maxsize=1)
def _lark() -> Lark:
    """The parser: from the tables generated at build time (`lark_tables.json`) when
    they match this grammar and this lark, else built from the grammar in memory.
    Nothing is read from a shared or temporary directory (lark's `cache=True` would
    unpickle a file there that another user can plant)."""
    grammar = _grammar_path().read_text(encoding="utf-8")
    try:
        tables = json.loads(_TABLES.read_text(encoding="utf-8"), object_pairs_hook=_int_keys)
        if tables["grammar_sha256"] == _grammar_digest(grammar) and tables["lark"] == lark.__version__:
            return _tuned(Lark._load_from_dict(tables["data"], tables["memo"], postlex=_POSTLEX,
                                               transformer=_BUILDER, _plugins=_PLUGINS))
    except Exception:  # noqa: BLE001 -- absent, stale or unreadable tables: build them
        pass
    return _tuned(Lark(grammar, postlex=_POSTLEX, transformer=_BUILDER, _plugins=_PLUGINS, **_OPTIONS))


class _Rule(Rule):
    """A grammar rule of tgc's own parser, equal only to itself.

    lark's `Rule` compares and hashes by value in Python code, and its LALR loop
    compares every rule it reduces with the end state and looks it up in the
    callbacks dict: on a program of 10^5 statements, millions of Python calls. The
    rules of the parser `_lark()` builds belong to it alone (lark makes them anew for
    each parser, and each rule once), so identity is their equality."""

    __slots__ = ()
    __eq__ = object.__eq__
    __hash__ = object.__hash__


def _tuned(parser: Lark) -> Lark:
    """`parser`, its reductions made cheaper without changing what they build: each
    rule becomes a `_Rule`, and a rule `?a: b` of one symbol, which lark reduces by
    calling `ExpandSingleChild` (in Python) to return the one child, returns it with
    `operator.itemgetter(0)` (in C). A lark whose parser is laid out otherwise is
    used as it is."""
    try:
        callbacks = parser.parser.parser.parser.callbacks
    except AttributeError:
        return parser
    tuned = {}
    for rule, callback in callbacks.items():
        if type(rule) is Rule:
            rule.__class__ = _Rule
        if isinstance(callback, ExpandSingleChild) and len(rule.expansion) == 1:
            callback = operator.itemgetter(0)
        tuned[rule] = callback
    callbacks.clear()   # rehashed by identity, in the dict the LALR loop holds
    callbacks.update(tuned)
    return parser


def _int_keys(pairs) -> dict:
    """JSON object -> dict, with decimal keys as ints (lark's tables key states,
    tokens and its memo by number; no other key is all digits)."""
    return {int(k) if k.isdigit() else k: v for k, v in pairs}


def _grammar_digest(grammar: str) -> str:
    return hashlib.sha256(grammar.encode("utf-8")).hexdigest()


def tables_json() -> str:
    """The text of `lark_tables.json`: the LALR tables of the grammar (lark's own
    serialization, as data), with the grammar's hash and the lark version they are
    valid for."""
    from lark.lexer import TerminalDef

    grammar = _grammar_path().read_text(encoding="utf-8")
    data, memo = Lark(grammar, postlex=_POSTLEX, **_OPTIONS).memo_serialize([TerminalDef, Rule])
    data["options"] = {k: v for k, v in data["options"].items() if k not in _RUNTIME_OPTIONS}
    return json.dumps({"grammar_sha256": _grammar_digest(grammar), "lark": lark.__version__,
                       "data": data, "memo": memo}, sort_keys=True, separators=(",", ":")) + "\n"


# ---- syntax errors ------------------------------------------------------------

_NAMED = {"NAME": "NAME", "DOTTED": "NAME.NAME", "NUMBER": "NUMBER", "STRING": "STRING", "_NL": "newline",
          "$END": "end of input", "COMPARE": "comparison", "DECL_KIND": "'input'/'param'/'state'",
          "ASSUME": "'assume'"}
_IGNORED = {"WS", "COMMENT"}


def _syntax_error(e: UnexpectedInput, filename: str) -> CompileError:
    if isinstance(e, UnexpectedCharacters):
        ch = e.char
        msg = "unterminated string" if ch == '"' else f"unexpected character {_char(ch)}"
        loc = Loc(filename, e.line, e.column, e.line, e.column + 1)
        return CompileError(msg + _expected_text(e), loc, _unclosed_note(loc, filename))
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
    msg = f"unexpected {_describe(tok)}"
    if tok.type == "COMPARE" and _after_comparison(e):
        msg += ": comparisons do not chain; write `(a < b) * (b < c)` for both"
    return CompileError(msg + _expected_text(e), loc, _unclosed_note(loc, filename))


def _expected_text(e: UnexpectedInput) -> str:
    expected = _friendly_expected(_accepted(e))
    if not expected:
        return ""
    if len(expected) == 1:
        return f"; expected {expected[0]}"
    return f"; expected one of: {', '.join(expected)}"


def _unclosed_note(loc: Loc, filename: str) -> list[Diagnostic]:
    """A note at the innermost open bracket, if the error is on a later line."""
    brackets = _POSTLEX.open_brackets()
    if not brackets or brackets[-1].line >= loc.line:
        return []
    b = brackets[-1]
    return [Diagnostic("note", f"'{b}' opened here is not closed",
                       Loc(filename, b.line, b.column, b.line, b.column + 1))]


def _token_loc(tok: Token, filename: str) -> Loc:
    if tok.type != "$END":
        end_col = tok.end_column if tok.end_line == tok.line else tok.column + 1
        return Loc(filename, tok.line, tok.column, tok.line, end_col)
    if tok.end_line is None:  # no token before the end
        return Loc(filename, tok.line or 1, tok.column or 1)
    if tok.end_line > tok.line:  # position borrowed from a newline token
        return Loc(filename, tok.line, tok.column, tok.line, tok.column + 1)
    return Loc(filename, tok.end_line, tok.end_column, tok.end_line, tok.end_column + 1)


def _after_comparison(e: UnexpectedInput) -> bool:
    stack = getattr(e.state, "value_stack", None) or []
    return len(stack) >= 2 and isinstance(stack[-2], Token) and stack[-2].type == "COMPARE"


def _accepted(e: UnexpectedInput) -> set[str]:
    """Terminals that really advance the parser here. LALR tables merge lookaheads,
    so each candidate is tried on a copy of the parser state, as lark's
    InteractiveParser.accepts() does."""
    state = e.state
    if not isinstance(state, ParserState):
        return {t for t in (getattr(e, "expected", None) or ()) if t.isupper()}
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
    if "NAME" in names:   # `m.wq` (DOTTED) is a name too: one word for both
        names = names - {"DOTTED"}
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


# ---- building the AST -------------------------------------------------------------


@dataclass(frozen=True)
class _Part:
    """An intermediate piece of a node (an edge list, argument list, ...)."""

    kind: str
    value: object
    loc: Loc


# Tokens that carry meaning; the others (keywords, punctuation, newlines) only
# widen the span of the node they belong to.
_KEEP = {"NAME", "DOTTED", "NUMBER", "STRING", "COMPARE", "EQ", "ARROW", "PLUS", "MINUS",
         "STAR", "SLASH", "AT", "CARET", "DECL_KIND", "ELLIPSIS"}


def _is_separator(k) -> bool:
    return type(k) is Token and k.type == "_NL"


_PARENS = {"_dim_atom"}  # handlers that return their child: no new depth

_LOC_FIELDS = ("file", "line", "col", "end_line", "end_col")
_new = object.__new__
_setattr = object.__setattr__


def _plain_loc() -> bool:
    """Whether a `Loc` is a dataclass with exactly these fields, kept in its instance
    `__dict__` and set by nothing but its `__init__`, as `_loc` assumes."""
    return (dataclasses.is_dataclass(Loc) and not hasattr(Loc, "__slots__")
            and not hasattr(Loc, "__post_init__")
            and tuple(f.name for f in dataclasses.fields(Loc)) == _LOC_FIELDS)


if _plain_loc():
    def _loc(file: str, line: int, col: int, end_line: int, end_col: int) -> Loc:
        """`Loc(file, line, col, end_line, end_col)`, its fields set at once (a third of
        the time of the frozen dataclass `__init__`; the parser makes one per node)."""
        loc = _new(Loc)
        _setattr(loc, "__dict__", {"file": file, "line": line, "col": col, "end_line": end_line,
                                   "end_col": end_col})
        return loc
else:   # another Loc: its own constructor
    _loc = Loc

_TOO_DEEP = (f"expression nested too deeply (over {MAX_DEPTH} levels); "
             "split it into several bindings")


class _Builder:
    """lark's callbacks: build each AST node when the LALR parser reduces its rule.

    The rules of expressions, which make up most of any program, have their own
    callbacks (`name`, `number`, `binop`, ...): each knows its rule's children by
    position, so it builds the node and its span directly. For every other rule lark
    calls `builder.<rule>(children)`, and `__getattr__` routes that to the
    `_<rule>(kids, loc)` handler after dropping punctuation from the children and
    computing the node's span. Both check the nesting depth: `local.depth` maps
    `id(value)` to the depth of each value built and not yet consumed, except a leaf
    (a Name or Num, depth 1), which is not recorded: an absent id counts 1. The parser
    is iterative, so nothing here recurses."""

    def __init__(self):
        self.local = threading.local()  # .file and .depth, per parse and thread

    def start_parse(self, filename: str) -> None:
        self.local.file = filename
        self.local.depth = {}  # id(value) -> nesting depth, for values not yet consumed

    def __getattr__(self, rule: str):
        handler = getattr(type(self), "_" + rule, None)
        if handler is None or rule.startswith("_"):
            raise AttributeError(rule)  # lark then builds a Tree, and inlines it
        return lambda children: self._reduce(handler, children)

    def _reduce(self, handler, children):
        local = self.local
        depths, kids, deepest = local.depth, [], 0
        for k in children:
            if type(k) is Token:
                if k.type in _KEEP:
                    kids.append(k)
            else:
                d = depths.pop(id(k), 1)
                if d > deepest:
                    deepest = d
                kids.append(k)
        built = handler(self, kids, self._span(local.file, children))
        if isinstance(built, ast.Node) and handler.__name__ not in _PARENS:
            deepest += 1
            if deepest > MAX_DEPTH:
                raise CompileError(_TOO_DEEP, built.loc)
        depths[id(built)] = deepest
        return built

    @staticmethod
    def _span(file: str, children) -> Loc:
        """From the start of the first child to the end of the last, separators aside."""
        if not children:
            return Loc(file, 1, 1)
        first, last = children[0], children[-1]
        if _is_separator(first) or _is_separator(last):
            children = [k for k in children if not _is_separator(k)]
            if not children:
                return Loc(file, 1, 1)
            first, last = children[0], children[-1]
        if type(first) is Token:
            line, col = first.line, first.column
        else:
            line, col = first.loc.line, first.loc.col
        if type(last) is Token:
            return Loc(file, line, col, last.end_line, last.end_column)
        return Loc(file, line, col, last.loc.end_line, last.loc.end_col)

    def _tok_loc(self, tok: Token) -> Loc:
        return Loc(self.local.file, tok.line, tok.column, tok.end_line, tok.end_column)

    def _from_token(self, tok: Token, loc: Loc) -> Loc:
        """`loc` starting at `tok`: statements are located at their name, not keyword."""
        return Loc(self.local.file, tok.line, tok.column, loc.end_line, loc.end_col)

    # -- expressions: one callback per rule, children by position (hot) --

    def name(self, c):
        """NAME, an operand (also of a dim expression): a leaf."""
        tok = c[0]
        return build(ast.Name, {"id": tok.value, "loc": _loc(self.local.file, tok.line, tok.column,
                                                              tok.end_line, tok.end_column)})

    def number(self, c):
        """NUMBER: a leaf."""
        tok = c[0]
        loc = _loc(self.local.file, tok.line, tok.column, tok.end_line, tok.end_column)
        if tok.value.endswith("j"):   # an imaginary literal, `2j`
            return build(ast.Imag, {"value": float(_number_value(tok.value[:-1], loc)), "loc": loc})
        return build(ast.Num, {"value": _number_value(tok, loc), "loc": loc})

    def binop(self, c):
        """lhs (+ - * / @ ^) rhs."""
        return _binary(self.local, ast.BinOp, c)

    def compare(self, c):
        """lhs (< <= > >= == !=) rhs."""
        return _binary(self.local, ast.Compare, c)

    def name_power(self, c):
        """NAME ^ rhs: the name is the left operand."""
        tok, op, rhs = c
        local = self.local
        depths = local.depth
        file, b = local.file, rhs.loc
        lhs = build(ast.Name, {"id": tok.value, "loc": _loc(file, tok.line, tok.column, tok.end_line,
                                                             tok.end_column)})
        node = build(ast.BinOp, {"op": op.value, "lhs": lhs, "rhs": rhs,
                                 "loc": _loc(file, tok.line, tok.column, b.end_line, b.end_col)})
        return _deeper(depths, node, depths.pop(id(rhs), 1) + 1)

    def neg(self, c):
        """- x."""
        tok, x = c
        local = self.local
        depths = local.depth
        b = x.loc
        node = build(ast.Neg, {"x": x, "loc": _loc(local.file, tok.line, tok.column, b.end_line, b.end_col)})
        return _deeper(depths, node, depths.pop(id(x), 1) + 1)

    def paren(self, c):
        """( expr ): the inner node, its span widened to the parentheses; no new depth."""
        lpar, inner, rpar = c
        depths = self.local.depth
        d = depths.pop(id(inner), 1)
        node = ast.with_loc(inner, _loc(self.local.file, lpar.line, lpar.column, rpar.end_line, rpar.end_column))
        if d > 1:
            depths[id(node)] = d
        return node

    def bind(self, c):
        """NAME = expr, at top level or in a function block."""
        tok, _, x = c
        local = self.local
        depths = local.depth
        b = x.loc
        node = build(ast.Bind, {"name": tok.value, "expr": x,
                                "loc": _loc(local.file, tok.line, tok.column, b.end_line, b.end_col)})
        return _deeper(depths, node, depths.pop(id(x), 1) + 1)

    # -- statements --

    def _start(self, kids, loc):
        items = []
        for k in kids:
            items.extend(k.value) if isinstance(k, _Part) else items.append(k)
        return ast.Program(tuple(items), loc=Loc(self.local.file, 1, 1))

    def _dim_decl(self, kids, loc):
        return _Part("stmts", tuple(kids), loc)

    def _dim_atom(self, kids, loc):  # ( dim_sum ): the inner node, its span widened
        return ast.with_loc(kids[0], loc)

    def _dim_item(self, kids, loc):
        expr = kids[2] if len(kids) == 3 else None
        if expr is not None:
            _check_dim_expr(expr)
        return ast.DimDecl(str(kids[0]), expr, loc=loc)

    def _tensor_decl(self, kids, loc):
        kind = str(kids[0])
        return _Part("stmts", tuple(ast.TensorDecl(kind, *p.value, loc=p.loc) for p in kids[1:]), loc)

    def _decl_item(self, kids, loc):
        name, dtype, edges = str(kids[0]), None, ()
        for k in kids[1:]:
            if isinstance(k, Token):
                dtype = str(k)
                if dtype not in DTYPES:
                    raise CompileError(f"unknown dtype '{dtype}'; expected one of: "
                                       + ", ".join(DTYPES), self._tok_loc(k))
            else:
                edges = k.value
        return _Part("decl", (name, dtype, edges), loc)

    def _edge_specs(self, kids, loc):
        return _Part("specs", tuple(kids), loc)

    def _edge_spec(self, kids, loc):
        if len(kids) == 1:
            return ast.EdgeSpec(str(kids[0]), None, loc=loc)
        return ast.EdgeSpec(str(kids[0]), str(kids[1]), dim_loc=self._tok_loc(kids[1]), loc=loc)

    def _fn_def(self, kids, loc):
        loc = self._from_token(kids[0], loc)
        parts = {k.kind: k for k in kids if isinstance(k, _Part)}
        rules = tuple(k.value for k in kids if isinstance(k, _Part) and k.kind == "rule")
        plain = [k for k in kids if not isinstance(k, (_Part, Token))]
        body, result = parts["block"].value if "block" in parts else ((), plain[-1])
        edges, variadic = parts["fn_edges"].value if "fn_edges" in parts else ((), False)
        params = parts["params"].value if "params" in parts else ()
        _check_unique([e.id for e in edges], [e.loc for e in edges], "edge parameter")
        _check_unique([r.kind for r in rules], [r.loc for r in rules], "derivative rule")
        return ast.FnDef(str(kids[0]), edges, params, body, result, rules=rules, variadic=variadic, loc=loc)

    def _fn_edges(self, kids, loc):
        """[e1, e2, ...] or [e1, e2...]: the edge parameters, and whether the last collects
        every remaining edge argument of a call."""
        variadic = kids[-1].type == "ELLIPSIS"
        names = kids[:-1] if variadic else kids
        return _Part("fn_edges", (tuple(self._name(k) for k in names), variadic), loc)

    def _fn_rule(self, kids, loc):
        kind = str(kids[0])
        if kind not in ("vjp", "jvp"):
            raise CompileError(f"unknown derivative rule '{kind}': a function gives `with vjp(g) = ...` "
                               "or `with jvp(dx, ...) = ...`", self._tok_loc(kids[0]))
        binders = tuple(self._name(k) for k in kids[1:] if type(k) is Token and k.type == "NAME")
        _check_unique([b.id for b in binders], [b.loc for b in binders], f"{kind} variable")
        value = kids[-1]
        tuple_form = isinstance(value, _Part)
        exprs = value.value if tuple_form else (value,)
        return _Part("rule", ast.Rule(kind, binders, exprs, tuple_form, loc=loc), loc)

    def _rule_tuple(self, kids, loc):
        return _Part("tuple", tuple(kids), loc)

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
        return ast.Import(str(kids[0])[1:-1], loc=self._from_token(kids[0], loc))

    def _out(self, kids, loc):
        order = next((k.value for k in kids if isinstance(k, _Part)), None)
        has_expr = len(kids) > 2 and isinstance(kids[-2], Token) and kids[-2].type == "EQ"
        expr = kids[-1] if has_expr else None
        return ast.Out(str(kids[0]), order, expr, loc=self._from_token(kids[0], loc))

    def _update(self, kids, loc):
        return ast.Update(str(kids[0]), kids[2], loc=self._from_token(kids[0], loc))

    def _assume(self, kids, loc):
        """`assume LHS REL RHS`, located at the relation (LHS to RHS), `==` read as `=`."""
        lhs, op, rhs = kids
        rel = "=" if str(op) in ("=", "==") else str(op)
        where = Loc(loc.file, lhs.loc.line, lhs.loc.col, rhs.loc.end_line, rhs.loc.end_col)
        return ast.Assume(rel, lhs, rhs, loc=where)

    def _edge_list(self, kids, loc):
        return _Part("edges", tuple(self._name(k) for k in kids), loc)

    def _for_block(self, kids, loc):
        var, word, names = kids[:3]
        self._expect_in(word)
        body = []
        for k in kids[3:]:
            body.extend(k.value) if isinstance(k, _Part) else body.append(k)
        return ast.For(self._name(var), names.value, tuple(body), loc=self._from_token(var, loc))

    def _tensor_list(self, kids, loc):
        return _Part("names", tuple(self._name(k) for k in kids), loc)

    def _expect_in(self, word: Token) -> None:
        if str(word) != "in":
            raise CompileError(f"expected 'in' after the variable, not '{word}' "
                               "(`for p in LIST`, `[p in LIST]`, `sum[p in LIST](x)`)", self._tok_loc(word))

    # -- expressions --

    def _name(self, tok: Token) -> ast.Name:
        return ast.Name(str(tok), loc=self._tok_loc(tok))

    def _edge_ops(self, kids, loc):
        x = self._name(kids[0]) if isinstance(kids[0], Token) else kids[0]
        items = kids[1].value
        for item in items:
            if isinstance(item, _Part):
                raise CompileError(f"edge operation '{item.value}': expected '->' (rename) or "
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

    def _member(self, kids, loc):
        var, word, names = kids
        self._expect_in(word)
        return ast.Member(self._name(var), names.value, loc=loc)

    def _list_sum(self, kids, loc):
        fn, var, word, names, x = kids
        if str(fn) != "sum":
            raise CompileError(f"'{fn}[{var} in ...]': only sum ranges over a list of tensors, "
                               f"as sum[{var} in LIST](x)", self._tok_loc(fn))
        self._expect_in(word)
        return ast.ListSum(self._name(var), names.value, x, loc=loc)

    def _items(self, kids, loc):
        return _Part("items", tuple(kids), loc)

    def _plain_edge(self, kids, loc):
        return _Part("plain", str(kids[0]), loc)

    def _rename(self, kids, loc):
        return ast.Rename(str(kids[0]), str(kids[2]), dst_loc=self._tok_loc(kids[2]), loc=loc)

    def _reindex(self, kids, loc):
        return ast.Reindex(str(kids[0]), kids[2], loc=loc)

    def _args(self, kids, loc):
        return _Part("args", tuple(kids), loc)

    def _kwarg(self, kids, loc):
        return ast.Kwarg(str(kids[0]), kids[2], loc=loc)


def _binary(local, cls, c):
    """The node `cls` (BinOp or Compare) of lhs op rhs, one deeper than its deeper operand."""
    lhs, op, rhs = c
    depths = local.depth
    d = depths.pop(id(lhs), 1)
    r = depths.pop(id(rhs), 1)
    a, b = lhs.loc, rhs.loc
    node = build(cls, {"op": op.value, "lhs": lhs, "rhs": rhs,
                       "loc": _loc(local.file, a.line, a.col, b.end_line, b.end_col)})
    return _deeper(depths, node, (d if d > r else r) + 1)


def _deeper(depths: dict, node, depth: int):
    """Record `node`'s nesting depth (a located error past MAX_DEPTH); `node`."""
    if depth > MAX_DEPTH:
        raise CompileError(_TOO_DEEP, node.loc)
    depths[id(node)] = depth
    return node


def _number_value(tok: Token, loc: Loc) -> int | float:
    text = str(tok)
    try:
        value = int(text) if text.isdigit() else float(text)
        as_float = float(value)
    except ValueError:  # more digits than Python converts
        raise CompileError("number literal too long", loc) from None
    except OverflowError:  # an integer beyond the float range
        as_float = float("inf")
    if as_float == float("inf") and text != "inf":
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


_POSTLEX = _BracketNewlines()
_BUILDER = _Builder()


if __name__ == "__main__":   # regenerate lark_tables.json after changing the grammar
    _TABLES.write_text(tables_json(), encoding="utf-8")
