"""Every IR op and every elementwise function, defined once.

Two tables, read by every stage that needs to know something about an op:

- `OPS`: the IR's primitive ops (`arg`, `add`, `map`, `reduce`, ...), each with its
  operand count, what its attributes hold, and its text codec: how the printer writes
  its attributes between the brackets of `%3 = op[attrs] ...` and how the parser
  rebuilds the value from them (through the typed builders of `tgc.ir.values`, so the
  text's types are checked). `tgc.ir.printer` and `tgc.ir.parser` hold no op names.
- `FNS`: the elementwise functions of the `map` op (`exp`, `div`, `where`, ...), each
  with its arity, its float semantics as a numpy function of float64 arrays (the
  one definition both interpreters run: `tgc.ir.interp` and `tgc.lower.interp`),
  whether the language calls it by name, whether its result keeps a bf16/f16
  operand's type, its cost class (what fusion, grouping and the CPU's parallel
  threshold charge for it), the facts it enjoys (`tgc.opt.facts`: when it is finite,
  its sign, an upper bound), and the hints a backend reads: whether the CPU backend
  has a vector-math implementation (`tgc.backends.cpu.vecmath`), or which stage
  removes it before any backend sees it.

The backends' elementwise tables are read from here. The CUDA one
(`tgc.backends.cuda.codegen.TEMPLATES`) is derived by rule: every function that reaches
backends calls the device function `tgc_{name}` of `tgc_ops.cuh`; for a function the C
math library computes (`Fn.libm`) that device function, float and double, is written
from this table into the header the modules inline (`tgc.backends.cuda.codegen.header`).
The CPU emits a vector-math function (`Fn.vecmath`) through `tgc.backends.cpu.vecmath`
and the others through `tgc.backends.cpu.elementwise.EMITTERS`, whose entries for a
function with an `intrinsic`, or else a `libm` spelling (a call of the math library),
are derived from it. A test checks that every function here is built by every
backend, removed before backends (`lowered_by`), or listed as not built there yet.

Adding an elementwise function that the C math library computes is one `Fn` entry
here (with its `libm` spelling) and its derivative rule (`tgc.autodiff.rules.RULES`);
a vector-math implementation for the CPU is an entry of `tgc.backends.cpu.vecmath`'s
table as well (`vecmath=True`). A function the math library lacks needs its CPU
emitter (an `EMITTERS` entry) and its `tgc_{name}` device function in `tgc_ops.cuh`.

Nothing here computes anything at import beyond building the tables; the tables are
finite, so every walk over them terminates. This module imports only numpy and
`tgc.ir.dtypes`; its text codecs call the builders of `tgc.ir.values`, which the IR
reader passes to them (values itself reads `FNS` for arities and types, so this
module never imports it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from tgc.ir.dtypes import CONVERSIONS, ROUNDINGS, round_to

# ---------------------------------------------------------------- elementwise functions

# cost classes, in units of an add/mul (a vectorized ~0.1 ns an element on the CPU):
# polynomial transcendentals and pow ~8; sqrt and div one vector instruction each ~1
# (see tgc.backends.cpu.codegen.weight); everything else a select or an add: 0
COSTS = {"cheap": 0, "light": 1, "heavy": 8}

# how an elementwise function's finiteness follows from its operands (tgc.opt.facts):
FINITE = (
    "always",      # finite whatever its operands (a comparison's 0/1, a sign)
    "total",       # finite where its operands are
    "overflow",    # finite where its operand is, and bounded above so that it does not overflow (exp)
    "nonneg_arg",  # finite where its operand is finite and >= 0 (sqrt, log1p)
    "pos_arg",     # finite where its operand is finite and > 0 (log)
    "rule",        # a rule of tgc.opt.facts of its own (div, pow)
    "unknown",     # not known to be finite (a conversion or rounding may overflow)
)
# its sign from its operands' (tgc.opt.facts):
SIGN = (
    "pos",         # > 0 always
    "nonneg",      # >= 0 always
    "keep",        # its operand's sign (an odd, increasing function through 0, or x itself)
    "keep_nonneg", # its operand's sign, and >= 0 where that is unknown (sqrt)
    "select",      # the sign all its selected operands share (max, min, where, guarded products)
    "rule",        # a rule of tgc.opt.facts of its own (div, pow)
    "none",        # unknown
)


@dataclass(frozen=True)
class Fn:
    """One elementwise function of the `map` op."""

    name: str
    arity: int
    numpy: Callable                   # float semantics on float64 arrays (NaN/inf as IEEE values)
    doc: str                          # what it computes, in a line
    surface: bool = False             # the language calls it by name: `name(x)` (docs/language.md)
    infix: str = ""                   # the language's operator for it: `a / b`, `a < b` ('' if none)
    exact: bool = False               # its result is an operand's value or 0/1: it keeps a bf16/f16 type
    cost: str = "cheap"               # a key of COSTS
    identity: bool = False            # its value is its operand's (lowering drops it)
    finite: str = "total"             # a FINITE entry
    sign: str = "none"                # a SIGN entry
    bound: float | None = None        # an upper bound whatever the operand
    increasing: Callable | None = None  # a non-decreasing scalar function: the bound of f(x) is f(bound x)
    vecmath: bool = False             # the CPU backend has it in vector math (tgc.backends.cpu.vecmath)
    intrinsic: str = ""               # the LLVM intrinsic `llvm.<name>` the CPU calls for it ('' if none)
    libm: str = ""                    # the C math library's function that computes it, its double
                                      # spelling (`f` appended for float): CUDA's `tgc_{name}` calls it,
                                      # and so does the CPU where it has no vector math or intrinsic
    lowered_by: str = ""              # the stage that removes it before backends ('' if backends see it)


def _safe_pow(a, b):
    with np.errstate(all="ignore"):
        return np.power(a, b)


def _sigmoid(x):
    e = np.exp(-np.abs(x))  # never overflows
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def _softplus(x):
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


def _erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _same(x):
    return x


_CMP_DOC = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_CMP_NP = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
           "eq": np.equal, "ne": np.not_equal}


def _round_fn(t: str) -> Callable:
    return lambda x: round_to(x, t).astype(np.asarray(x).dtype)


_FNS: list[Fn] = [
    # transcendentals (vector math on the CPU)
    Fn("exp", 1, np.exp, "e^x", surface=True, cost="heavy", finite="overflow", sign="pos",
       increasing=math.exp, vecmath=True, libm="exp"),
    Fn("log", 1, np.log, "natural logarithm (NaN below 0, -inf at 0)", surface=True, cost="heavy",
       finite="pos_arg", increasing=math.log, vecmath=True, libm="log"),
    Fn("sqrt", 1, np.sqrt, "square root", surface=True, cost="light", finite="nonneg_arg",
       sign="keep_nonneg", vecmath=True, libm="sqrt"),
    Fn("tanh", 1, np.tanh, "hyperbolic tangent", surface=True, cost="heavy", sign="keep", bound=1.0,
       vecmath=True, libm="tanh"),
    Fn("sin", 1, np.sin, "sine", surface=True, cost="heavy", bound=1.0, vecmath=True, libm="sin"),
    Fn("cos", 1, np.cos, "cosine", surface=True, cost="heavy", bound=1.0, vecmath=True, libm="cos"),
    Fn("erf", 1, _erf, "error function", surface=True, cost="heavy", sign="keep", bound=1.0, vecmath=True,
       libm="erf"),
    Fn("log1p", 1, np.log1p, "log(1 + x), accurate for small x", surface=True, cost="heavy",
       finite="nonneg_arg", sign="keep", increasing=math.log1p, vecmath=True, libm="log1p"),
    Fn("expm1", 1, np.expm1, "e^x - 1, accurate for small x", surface=True, cost="heavy",
       finite="overflow", sign="keep", increasing=math.expm1, vecmath=True, libm="expm1"),
    # the math library's, on every backend (a scalar call on the CPU)
    Fn("atan", 1, np.arctan, "arc tangent, in [-pi/2, pi/2]", surface=True, cost="heavy", sign="keep",
       increasing=math.atan, libm="atan"),
    Fn("asinh", 1, np.arcsinh, "inverse hyperbolic sine, log(x + sqrt(x^2 + 1))", surface=True, cost="heavy",
       sign="keep", increasing=math.asinh, libm="asinh"),
    # simple functions
    Fn("abs", 1, np.abs, "|x|", surface=True, exact=True, sign="nonneg", intrinsic="fabs", libm="fabs"),
    Fn("sign", 1, np.sign, "-1, 0 or 1 (NaN for NaN)", surface=True, exact=True, finite="always",
       bound=1.0),
    # 1 / (1 + exp(-x)) and log(1 + exp(x)), computed stably through exp(-|x|). Cost class
    # cheap, though each computes an exp (and a log): fusion, grouping and the parallel
    # threshold recompute them where they would an add
    Fn("sigmoid", 1, _sigmoid, "1 / (1 + e^-x), computed stably", sign="pos", bound=1.0),
    Fn("softplus", 1, _softplus, "log(1 + e^x), computed stably", sign="pos"),
    # binary arithmetic (the language's / and ^, and two-argument max/min)
    Fn("div", 2, np.divide, "a / b", infix="/", cost="light", finite="rule", sign="rule"),
    Fn("pow", 2, _safe_pow, "a ^ b (numpy's power on floats)", infix="^", cost="heavy", finite="rule",
       sign="rule", libm="pow"),
    Fn("max", 2, np.maximum, "the larger (NaN if either is)", surface=True, exact=True, sign="select",
       intrinsic="maximum"),
    Fn("min", 2, np.minimum, "the smaller (NaN if either is)", surface=True, exact=True, sign="select",
       intrinsic="minimum"),
    *(Fn(n, 2, _CMP_NP[n], f"1 where a {_CMP_DOC[n]} b, else 0", infix=_CMP_DOC[n], exact=True, finite="always",
         sign="nonneg", bound=1.0) for n in _CMP_DOC),
    Fn("mul0", 2, lambda a, b: np.where(a == 0, 0, a * b),
       "a * b, but exactly 0 where a == 0 (the NaN-safe chain rule)", sign="select"),
    Fn("mul00", 2, lambda a, b: np.where((a == 0) | (b == 0), 0, a * b),
       "a * b, but exactly 0 where a == 0 or b == 0 (a guarded elementwise product)", sign="select"),
    Fn("where", 3, lambda c, a, b: np.where(c != 0, a, b), "a where c != 0 (NaN counts as true), else b",
       surface=True, exact=True, sign="select"),
    # precision emulation and autodiff markers
    Fn("round32", 1, lambda x: np.asarray(x, np.float32).astype(np.float64),
       "x rounded to the nearest f32 (in an f64 program: --fp-strict's f32 emulation)",
       exact=True, sign="keep", increasing=_same),
    Fn("checkpoint", 1, _same, "x, recomputed by the backward pass instead of kept (autodiff/remat.py)",
       exact=True, identity=True, sign="keep", increasing=_same,
       lowered_by="fuse"),
    Fn("recompute", 1, _same, "x, read by a backward recomputation (autodiff/remat.py)",
       exact=True, identity=True, sign="keep", increasing=_same,
       lowered_by="fuse"),
    # conversions: the value itself; the result's type rounds it (tgc.ir.interp)
    *(Fn(fn, 1, _same, f"x converted to {t} (the result's type)", finite="unknown",
         lowered_by="lowp") for fn, t in CONVERSIONS.items()),
    # round_bf16/round_f16: to the nearest bf16/f16 (through f32), held in the operand's type
    *(Fn(fn, 1, _round_fn(t), f"x rounded to the nearest {t}, kept in x's type", exact=True,
         finite="unknown") for fn, t in ROUNDINGS.items()),
]

FNS: dict[str, Fn] = {f.name: f for f in _FNS}
assert len(FNS) == len(_FNS), "an elementwise function is defined twice"
for _f in _FNS:
    assert _f.cost in COSTS and _f.finite in FINITE and _f.sign in SIGN, _f.name

# derived views, for the modules that ask one question of every function
MAP_ARITY: dict[str, int] = {f.name: f.arity for f in _FNS}
EXACT_FNS = frozenset(f.name for f in _FNS if f.exact)
EXPENSIVE = frozenset(f.name for f in _FNS if f.cost == "heavy")
LIGHT = frozenset(f.name for f in _FNS if f.cost == "light")
IDENTITY_FNS = frozenset(f.name for f in _FNS if f.identity)
SURFACE_UNARY = tuple(f.name for f in _FNS if f.surface and f.arity == 1)   # `exp(x)`, ... in .tg
SURFACE_ARITY = {f.name: f.arity for f in _FNS if f.surface}   # every function .tg calls by name
INFIX = {f.name: f.infix for f in _FNS if f.infix}   # div: "/", pow: "^", lt: "<", ...
VECMATH = tuple(f.name for f in _FNS if f.vecmath)
NUMPY: dict[str, Callable] = {f.name: f.numpy for f in _FNS}


def backend_fns(lowered_before: bool = False) -> list[str]:
    """The functions a backend must compile (those no stage removes before it)."""
    return [f.name for f in _FNS if lowered_before or not f.lowered_by]


# ---------------------------------------------------------------- IR ops


def _edges(text: str) -> list[str]:
    return [e.strip() for e in text.split(",") if e.strip()]


@dataclass(frozen=True)
class Op:
    """One primitive op of the IR: its operands, attributes and text codec.

    `text(attrs)` is what the printer writes between the brackets ('' for none: no
    brackets); `parse(V, text, args, type, loc)` rebuilds the value from that text, its
    operands and its written type, through the builders `V` (`tgc.ir.values`; None:
    the text cannot name this op)."""

    name: str
    arity: int | None                 # operand count (None: variable)
    attrs: str                        # what its attributes hold
    text: Callable[[tuple], str]
    parse: Callable | None


def _no_text(a: tuple) -> str:
    return ""


def _scatter_text(a: tuple) -> str:   # a scatter-add is [edge], a segment reduction [kind: edge]
    return a[0] if a[1] == "sum" else f"{a[1]}: {a[0]}"


def _random_text(a: tuple) -> str:
    return a[0] + (f": {', '.join(map(str, a[1]))}" if a[1] else "") + (f" as {a[2]}" if a[2] else "")


def _parse_scatter(V, a, args, typ, loc):
    kind, _, edge = a.rpartition(":")
    return V.scatter(args[0], args[1], edge.strip(), set(typ.edges) & set(args[1].edges), loc,
                        kind.strip() or "sum")


def _parse_reduce(V, a, args, typ, loc):
    kind, _, edges = a.partition(":")
    return V.reduce(kind.strip(), args[0], _edges(edges), loc)


def _parse_rename(V, a, args, typ, loc):
    pairs = [p.split("->") for p in a.split(",")]
    return V.rename(args[0], {s.strip(): d.strip() for s, d in pairs}, loc)


def _parse_custom(V, a, args, typ, loc):
    fn, n, ct, tans = (p.strip() for p in a.split(";"))
    n, tans = int(n), tuple(tans.split())
    want = 1 + n + (n if ct else 0) + (1 if tans else 0)
    if n < 0 or len(args) != want:
        raise V.IRError(f"'custom' with {n} arguments{', a vjp' if ct else ''}{', a jvp' if tans else ''} "
                           f"takes {max(want, 1)} operands, not {len(args)}")
    rest = args[1 + n:]
    return V.custom(args[0], args[1:1 + n], rest[:n] if ct else None, rest[-1] if tans else None,
                       fn, ct, tans, loc)


def _parse_random(V, a, args, typ, loc):
    a, _, draw = a.partition(" as ")
    kind, _, folds = a.partition(":")
    fs = [n.strip() for n in folds.split(",") if n.strip()]   # `$i`: fold by operand i (an i32 input)
    by_input = [int(n[1:]) for n in fs if n.startswith("$") and n[1:].isdigit()]
    if not args or sorted(by_input) != list(range(1, len(args))):
        raise V.IRError(f"'random' takes its key and one operand per '$i' fold ({1 + len(by_input)}), "
                        f"not {len(args)}")
    return V.random(kind.strip(), args[0], [args[int(n[1:])] if n.startswith("$") else int(n) for n in fs],
                    typ.dtype, typ.edges, loc, draw.strip())


def _parse_indicator(V, a, args, typ, loc):
    from tgc.ir.affine import parse_relation

    return V.indicator(parse_relation(a), typ.dtype, loc)


_OPS: list[Op] = [
    Op("arg", 0, "(name,): an input, param or state", _no_text, None),   # written as %name
    Op("const", 0, "(value,): a float filled over the type's edges", lambda a: repr(a[0]),
       lambda V, a, args, typ, loc: V.const(float(a), typ.dtype, typ.edges, loc)),
    Op("size", 0, "(edge,): the edge's size as a float scalar", lambda a: a[0],
       lambda V, a, args, typ, loc: V.size(a.strip(), typ.dtype, loc)),
    Op("add", None, "(coefs,): sum of coef_i * operand_i", lambda a: ", ".join(repr(c) for c in a[0]),
       lambda V, a, args, typ, loc: V.add(args, [float(c) for c in a.split(",")], loc)),
    Op("contract", None, "(): product of the operands summed over the edges not kept", _no_text,
       lambda V, a, args, typ, loc: V.contract(args, typ.edges, loc)),
    Op("map", None, "(fn,): an elementwise function of FNS", lambda a: a[0],
       lambda V, a, args, typ, loc: V.map_(a.strip(), *args, loc=loc)),
    Op("reduce", 1, "(kind, edges): max, min or logsumexp over edges",
       lambda a: f"{a[0]}: {', '.join(a[1])}", _parse_reduce),
    Op("indicator", 0, "(relation,): 1 where the affine relation holds, else 0", lambda a: str(a[0]),
       _parse_indicator),
    Op("gather", 2, "(edge,): table[edge = ids]", lambda a: a[0],
       lambda V, a, args, typ, loc: V.gather(args[0], args[1], a.strip(), loc)),
    Op("scatter", 2, "(edge, kind): gather's transpose (sum) or a segment max/min", _scatter_text,
       _parse_scatter),
    Op("random", None, "(kind, folds, draw): a counter-based draw", _random_text, _parse_random),
    Op("fold", 1, "(n,): a key derived from a key (only the front end builds it; never printed)", _no_text,
       None),
    Op("rename", 1, "(pairs,): edge renaming", lambda a: ", ".join(f"{s} -> {d}" for s, d in a[0]),
       _parse_rename),
    Op("stop", 1, "(): identity with a zero derivative", _no_text,
       lambda V, a, args, typ, loc: V.stop(args[0], loc)),
    *(Op(n, k, "(): a derivative, until autodiff replaces it", _no_text,
         lambda V, a, args, typ, loc, _n=n: getattr(V, _n)(*args, loc=loc))
      for n, k in (("grad", 2), ("jvp", 3), ("vjp", 3))),
    Op("slot", 0, "(name,): a custom derivative rule's placeholder", lambda a: a[0],
       lambda V, a, args, typ, loc: V.slot(a.strip(), typ.dtype, typ.edges, loc)),
    # fn; argument count; cotangent slot ('' without vjp); tangent slots
    Op("custom", None, "(fn, n, ct, tans): a call with its own derivative rules",
       lambda a: f"{a[0]}; {a[1]}; {a[2]}; {' '.join(a[3])}", _parse_custom),
    Op("loopvar", 0, "(k,): parameter k of a loop body", lambda a: str(a[0]),
       lambda V, a, args, typ, loc: V.loopvar(int(a), typ.dtype, typ.edges, loc)),
    # the body is written as a block before its first use (`body b0 ...`), named in the
    # attributes: `loop[b0, edge, out]` or `loop[b0, edge, out, reverse]` (tgc.ir.printer)
    Op("loop", None, "(body, edge, reverse, out): output `out` of a loop over `edge`",
       lambda a: f"{a[1]}, {a[3]}" + (", reverse" if a[2] else ""), None),
]

OPS: dict[str, Op] = {o.name: o for o in _OPS}


def attr_text(op: str, attrs: tuple) -> str:
    """The bracketed attribute text of an op, '' when it has none."""
    text = OPS[op].text(attrs)
    return f"[{text}]" if text else ""


def parse_value(V, op: str, attrs: str | None, args: list, typ, loc):
    """The value `op[attrs] args : typ` of the text form, built through the typed
    builders `V` (the module `tgc.ir.values`, which the reader passes: values reads
    this module's tables at import, so this one never imports it)."""
    o = OPS.get(op)
    if o is None or o.parse is None:
        raise V.IRError(f"unknown op '{op}'")
    if o.arity is not None and len(args) != o.arity:
        raise V.IRError(f"'{op}' takes {o.arity} operand{'s' if o.arity != 1 else ''}, not {len(args)}")
    return o.parse(V, attrs or "", args, typ, loc)
