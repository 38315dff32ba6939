"""Values of the tensor IR: a hash-consed DAG of named-edge operations.

A `Value` is immutable and interned: building the same op on the same operands
with the same attributes and type returns the very same object, so structural
equality is identity and common subexpressions are shared for free.

Every value has a `TensorType`: a dtype and a set of named edges (kept sorted, so
there is no axis order). The primitive ops and their attributes:

    arg       (name,)            an input, param or state of the module
    const     (value,)           a float filled over the type's edges (usually none)
    size      (edge,)            the size of an edge, as a float scalar
    add       (coefs,)           sum of coef_i * operand_i, broadcast by edge name
    contract  ()                 product of all operands, summed over every edge not
                                 in the result type; result edges no operand has are
                                 broadcast (repeated)
    map       (fn,)              an elementwise leaf function (tgc.ir.ops.FNS), broadcast
    reduce    (kind, edges)      max, min or logsumexp (log sum exp, computed stably)
                                 over `edges`
    indicator (relation,)        1.0 where the affine relation holds, else 0.0
    gather    (edge,)            table[edge = ids[...]]: operands (table, ids:i32);
                                 edges shared by table and ids are matched
    scatter   (edge, kind)       the transpose of gather: operands (ct, ids:i32); combines
                                 ct into position ids[...] along `edge`; the result
                                 has (ct.edges - ids.edges) + edge, plus the edges of
                                 ids its type keeps, which are matched as in gather.
                                 kind `sum` adds (0 where no id points: a scatter-add);
                                 `max`/`min` take the extreme (-inf/inf where no id
                                 points, NaN if any term is NaN: a segment reduction)
    random    (kind, folds, draw) a counter-based draw over the type's edges (tgc.ir.philox):
                                 kind 'rand' (uniform in [0, 1)) or 'randn' (standard
                                 normal); operands: the key, an i32 scalar argument,
                                 then the i32 scalar arguments of folds by an input;
                                 folds: the `fold(key, n)` applied, in order: an
                                 integer n, or '$i' for the value of operand i;
                                 draw: '' (drawn in the computation's float type) or
                                 'f32' (f32 draws held in f64: --fp-strict's emulation)
    fold      (n,)               a key derived from a key (an i32 scalar argument or a
                                 fold) and n (-1: by the value of operand 1, an i32
                                 scalar argument): only the front end builds it, and `random`
                                 takes its chain apart into its folds at once
    rename    (pairs,)           edge renaming ((src, dst), ...)
    stop      ()                 identity with a zero derivative
    grad      ()                 d f / d x          operands (f, x: arg)
    jvp       ()                 forward mode       operands (f, x: arg, dx)
    vjp       ()                 reverse mode       operands (f, x: arg, v)
    slot      (name,)            a placeholder in a custom derivative rule: the
                                 cotangent or a tangent the rule is applied to
    custom    (fn, n, ct, tans)  a function call with its own derivative rules:
                                 operands (y, a_1..a_n, [d_1..d_n], [t]); its value
                                 is y (the body's value); d_i (over the slot named
                                 `ct`, y's edges) is the cotangent of a_i, and t (over
                                 the slots named `tans`, one per a_i) is y's tangent.
                                 `ct` is '' without a vjp rule, `tans` () without a
                                 jvp rule. Only adjoint/tangent read the rules; once
                                 no grad/jvp/vjp is left the op is its value y.
    loopvar   (k,)               the k-th parameter of a loop body (`LoopBody`): only
                                 a body's values read it
    loop      (body, edge, reverse, out)
                                 output `out` of a loop over `edge` (`LoopBody` says
                                 what the operands are: carries' initial values,
                                 stacked per-step inputs, loop-invariant inputs); the
                                 loop's outputs are its carries' last values, then its
                                 stacked per-step results (with `edge`); `reverse`
                                 runs the indices downwards. Each output is its own
                                 value; the loops of one body and operands are one loop
"""
from __future__ import annotations

import itertools
import weakref
from _weakref import _remove_dead_weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from tgc.ir.affine import Relation
from tgc.ir.diag import Loc
from tgc.ir.dtypes import CONVERSIONS, FLOATS, LOW_FLOATS, ROUNDINGS, TYPES, promote
# each elementwise function's operand count, and those whose result keeps a bf16/f16
# operand's type (a selection, a comparison's 0/1, a sign: `Fn.exact`), see _float_dtype
from tgc.ir.ops import EXACT_FNS, MAP_ARITY  # noqa: F401 (re-exported)

FLOAT_DTYPES = FLOATS          # bf16, f16, f32, f64 (tgc.ir.dtypes)
DTYPES = FLOAT_DTYPES + ("i32",)

REDUCE_KINDS = ("max", "min", "logsumexp")
SCATTER_KINDS = ("sum", "max", "min")
RANDOM_KINDS = ("rand", "randn")
DERIVATIVE_OPS = ("grad", "jvp", "vjp")
LOOP_OPS = ("loop", "loopvar")


class IRError(ValueError):
    """An ill-typed IR construction (wrong edges, dtypes, arity)."""


_TYPES: dict = {}   # (dtype, edges) -> TensorType: types are shared, at most _MAX_TYPES kept
_MAX_TYPES = 4096


@dataclass(frozen=True)
class TensorType:
    dtype: str
    edges: tuple[str, ...]  # sorted, unique

    @staticmethod
    def of(dtype: str, edges: Iterable[str]) -> "TensorType":
        key = (dtype, tuple(sorted(edges if isinstance(edges, (set, frozenset)) else set(edges))))
        found = _TYPES.get(key)
        if found is None:
            if len(_TYPES) >= _MAX_TYPES:
                _TYPES.clear()
            found = _TYPES[key] = TensorType(*key)
        return found

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(self.edges)}]"


class _Entry(weakref.ref):
    """The hash-consing table's weak reference to a value, with the value's key."""

    __slots__ = ("key",)


class Value:
    """One node of the DAG. Build with the functions below, never directly.

    `_table` maps (op, operand ids, attrs, dtype, edges) to a weak reference to the
    value, as a `WeakValueDictionary` would, in C: a value no longer used elsewhere is
    freed and its entry removed (only if it still refers to the dead value, as
    `WeakValueDictionary` does). The operands a live value holds keep their ids.
    `serial` numbers the values in the order they are made: a value's operands are
    older than it, so a value newer than `v` is none of `v`'s operands, however deep.
    `weak` says whether the value is a number in the sense of promotion (see `_WEAK_LEAVES`),
    decided as it is made from its operands' flags: no walk of the graph."""

    __slots__ = ("op", "operands", "attrs", "type", "loc", "serial", "weak", "__weakref__")
    _table: "dict[tuple, _Entry]" = {}
    _serials = itertools.count()

    op: str
    operands: tuple["Value", ...]
    attrs: tuple
    type: TensorType
    loc: Loc | None
    serial: int
    weak: bool

    @classmethod
    def make(cls, op: str, operands: Sequence["Value"], attrs: tuple, type: TensorType,
             loc: Loc | None = None) -> "Value":
        key = (op, tuple(map(id, operands)), attrs, type.dtype, type.edges)
        table = cls._table
        entry = table.get(key)
        if entry is not None:
            found = entry()
            if found is not None:
                return found
        v = object.__new__(cls)
        v.op, v.operands, v.attrs, v.type, v.loc = op, tuple(operands), attrs, type, loc
        v.serial = next(cls._serials)
        v.weak = op in _WEAK_LEAVES or (not type.edges and op in _WEAK_OPS and bool(operands)
                                        and (op != "map" or attrs[0] not in _STRONG_FNS)
                                        and all(o.weak for o in operands))
        entry = _Entry(v, _forget)
        entry.key = key
        table[key] = entry
        return v

    @property
    def edges(self) -> tuple[str, ...]:
        return self.type.edges

    @property
    def dtype(self) -> str:
        return self.type.dtype

    def __repr__(self) -> str:
        return f"<{self.op}{list(self.attrs) if self.attrs else ''} : {self.type}>"


# Weak values (a number in the sense of promotion, as a Python number is in numpy and
# PyTorch): a constant, a size, and an edgeless elementwise op, sum or product whose
# operands are all weak (`sqrt(size(hd))`, `1 / size(n)`, `2 ^ 0.5`, `0.5 * 3`). A
# conversion or rounding names its type and is strong, as are arguments, indicators,
# draws, reductions, copies and every edged expression (`1 - [s <= t]`: a mask is a
# tensor, as in PyTorch). A value's flag is a function of its op, attrs, edges and
# operands (its hash-consing key), so one value has one flag.
_WEAK_LEAVES = frozenset({"const", "size"})
_WEAK_OPS = frozenset({"add", "contract", "map"})
_STRONG_FNS = frozenset(CONVERSIONS) | frozenset(ROUNDINGS) | {"round32"}


def _forget(entry: _Entry) -> None:
    """A value was freed: its entry goes, unless the key has been made anew since."""
    _remove_dead_weakref(Value._table, entry.key)


def _union(values: Iterable[Value]) -> set[str]:
    out: set[str] = set()
    for v in values:
        out.update(v.type.edges)
    return out


def _float_dtype(values: Sequence[Value], exact: bool = False) -> str:
    """The type of an op on `values`: their promoted type (tgc.ir.dtypes.promote);
    for a bf16/f16 one, its compute type (f32) unless the op is `exact` (its result
    is one of its operands' values or 0/1). The front end rounds a bf16/f16
    expression's result explicitly (`to_bf16`, tgc.ir.lowp.explicit_rounding), so
    the optimizer never adds a rounding: the values it creates are f32."""
    t = _promoted(values)
    return t if exact or t not in LOW_FLOATS else TYPES[t].compute


def promoted(values: Sequence[Value]) -> str:
    """The promoted float type of `values` (weak values, `Value.weak`, take part only when
    every one is weak; see `_promoted`)."""
    return _promoted(values)


def _promoted(values: Sequence[Value]) -> str:
    if values:   # the common case first: one float type
        first = values[0].type.dtype
        if first != "i32":
            for v in values:
                if v.type.dtype != first:
                    break
            else:
                return first
    dtypes = {v.dtype for v in values}
    if "i32" in dtypes:
        raise IRError("integer (i32) tensors can only be used as gather or scatter indices")
    # mixed types promote (tgc.ir.dtypes.promote); weak values (constants, sizes and
    # edgeless expressions of them: `Value.weak`) are like a Python number in numpy: they
    # take part only when every operand is one
    strong = {v.dtype for v in values if not v.weak} or dtypes
    out = strong.pop()
    for d in strong:
        out = promote(out, d)
    return out


def arg(name: str, dtype: str, edges: Iterable[str], loc: Loc | None = None) -> Value:
    if dtype not in DTYPES:
        raise IRError(f"unknown dtype '{dtype}'")
    return Value.make("arg", (), (name,), TensorType.of(dtype, edges), loc)


def const(value: float, dtype: str, edges: Iterable[str] = (), loc: Loc | None = None) -> Value:
    if dtype not in FLOAT_DTYPES:
        raise IRError(f"constants are float, not '{dtype}'")
    return Value.make("const", (), (float(value),), TensorType.of(dtype, edges), loc)


def size(edge: str, dtype: str, loc: Loc | None = None) -> Value:
    return Value.make("size", (), (edge,), TensorType.of(dtype, ()), loc)


def add(operands: Sequence[Value], coefs: Sequence[float] | None = None, loc: Loc | None = None) -> Value:
    if not operands:
        raise IRError("add needs at least one operand")
    coefs = tuple(map(float, coefs)) if coefs is not None else (1.0,) * len(operands)
    if len(coefs) != len(operands):
        raise IRError("add needs one coefficient per operand")
    dtype = _float_dtype(operands)
    return Value.make("add", operands, (coefs,), TensorType.of(dtype, _union(operands)), loc)


def contract(operands: Sequence[Value], keep: Iterable[str], loc: Loc | None = None) -> Value:
    if not operands:
        raise IRError("contract needs at least one operand")
    dtype = _float_dtype(operands)
    return Value.make("contract", operands, (), TensorType.of(dtype, keep), loc)


def mul(operands: Sequence[Value], loc: Loc | None = None) -> Value:
    """Elementwise product with broadcasting: a contraction that keeps every edge."""
    return contract(operands, _union(operands), loc)


def map_(fn: str, *operands: Value, loc: Loc | None = None) -> Value:
    if fn not in MAP_ARITY:
        raise IRError(f"unknown elementwise function '{fn}'")
    if len(operands) != MAP_ARITY[fn]:
        raise IRError(f"'{fn}' takes {MAP_ARITY[fn]} argument(s), got {len(operands)}")
    dtype = CONVERSIONS.get(fn) or _float_dtype(operands, fn in EXACT_FNS)
    if fn in CONVERSIONS and operands[0].dtype == "i32":
        raise IRError("integer (i32) tensors can only be used as gather indices")
    return Value.make("map", operands, (fn,), TensorType.of(dtype, _union(operands)), loc)


def convert(x: Value, dtype: str, loc: Loc | None = None) -> Value:
    """`x` as type `dtype` (itself when it has it already)."""
    return x if x.dtype == dtype else map_(f"to_{dtype}", x, loc=loc)


def reindexed(x: Value, indicators: Sequence[Value], keep: Iterable[str], loc: Loc | None = None) -> Value:
    """`x` contracted with `indicators` that pick at most one element of `x` for each
    element of the result (an exact reindex: a block split or join, a window), of `x`'s
    type: a bf16/f16 `x`'s contraction has the compute type (f32), and is converted
    back, exactly (it holds `x`'s values and zeros), as the front end rounds a reindex
    `x[t = s + k]` of a bf16 `x`. A loop whose operand or result is so split keeps the
    types of the values it replaces."""
    out = contract([x, *indicators], keep, loc)
    return convert(out, x.dtype, loc) if x.dtype in LOW_FLOATS else out


def reduce(kind: str, x: Value, edges: Iterable[str], loc: Loc | None = None) -> Value:
    if kind not in REDUCE_KINDS:
        raise IRError(f"unknown reduction '{kind}'")
    edges = tuple(sorted(set(edges)))
    missing = [e for e in edges if e not in x.edges]
    if missing:
        raise IRError(f"cannot reduce over edge '{missing[0]}': the tensor has edges [{', '.join(x.edges)}]")
    dtype = _float_dtype([x], kind in ("max", "min"))
    rest = [e for e in x.edges if e not in edges]
    return Value.make("reduce", (x,), (kind, edges), TensorType.of(dtype, rest), loc)


def indicator(rel: Relation, dtype: str, loc: Loc | None = None) -> Value:
    return Value.make("indicator", (), (rel,), TensorType.of(dtype, rel.edges()), loc)


def gather(table: Value, ids: Value, edge: str, loc: Loc | None = None) -> Value:
    if ids.op == "fold":
        raise IRError("a key made by fold is no index: it is used only by rand and randn")
    if ids.dtype != "i32":
        raise IRError(f"gather indices must be i32, not {ids.dtype}")
    if edge not in table.edges:
        raise IRError(f"cannot gather along edge '{edge}': the tensor has edges [{', '.join(table.edges)}]")
    dtype = _float_dtype([table], True)
    rest = [e for e in table.edges if e != edge]
    return Value.make("gather", (table, ids), (edge,), TensorType.of(dtype, rest + list(ids.edges)), loc)


def scatter(ct: Value, ids: Value, edge: str, keep: Iterable[str] = (), loc: Loc | None = None,
            kind: str = "sum") -> Value:
    """result[edge = j, rest, keep] = sum (or max, min: `kind`) over the other ids edges of
    ct where ids[...] == j."""
    if kind not in SCATTER_KINDS:
        raise IRError(f"unknown scatter kind '{kind}'")
    if ids.dtype != "i32":
        raise IRError(f"scatter indices must be i32, not {ids.dtype}")
    if edge in ct.edges or edge in ids.edges:
        raise IRError(f"cannot scatter along edge '{edge}': an operand already has it")
    keep = set(keep)
    if not keep <= set(ids.edges):
        raise IRError(f"scatter can keep only edges of the indices, not '{sorted(keep - set(ids.edges))[0]}'")
    dtype = _float_dtype([ct])
    rest = [e for e in ct.edges if e not in ids.edges]
    return Value.make("scatter", (ct, ids), (edge, kind), TensorType.of(dtype, rest + sorted(keep) + [edge]), loc)


def _is_i32_scalar_arg(v: Value) -> bool:
    """An i32 scalar argument: the program's, or a loop step's (a `loopvar`, which the
    lowering makes an argument of the step's own module)."""
    return v.op in ("arg", "loopvar") and v.dtype == "i32" and not v.edges


def random(kind: str, key: Value, folds: Sequence[int | Value], dtype: str, edges: Iterable[str],
           loc: Loc | None = None, draw: str = "") -> Value:
    """A draw of `kind` over `edges` from `key` (an i32 scalar argument) folded with `folds`,
    each an integer or an i32 scalar argument (`fold(key, n)` by an input's value: an
    operand after the key, named '$i' in the folds attribute, i its operand index).
    Deterministic: the same key, folds, kind and edges are one value (hash-consed)."""
    if kind not in RANDOM_KINDS:
        raise IRError(f"unknown random kind '{kind}'")
    chain: list[int | Value] = []
    while key.op == "fold":
        chain.append(key.operands[1] if len(key.operands) > 1 else key.attrs[0])
        key = key.operands[0]
    all_folds = tuple(reversed(chain)) + tuple(folds)
    if not _is_i32_scalar_arg(key):
        raise IRError("a random key must be an i32 scalar input")
    if dtype not in FLOAT_DTYPES:
        raise IRError(f"random values are float, not '{dtype}'")
    operands, attr = [key], []
    for n in all_folds:
        if isinstance(n, Value):
            if not _is_i32_scalar_arg(n):
                raise IRError("fold takes an integer literal or an i32 scalar input")
            operands.append(n)
            attr.append(f"${len(operands) - 1}")
        elif not 0 <= int(n) < 2 ** 31:
            raise IRError("fold takes an integer in [0, 2^31)")
        else:
            attr.append(int(n))
    if draw not in ("", "f32"):
        raise IRError(f"random draws are f32 or of the value's type, not '{draw}'")
    return Value.make("random", tuple(operands), (kind, tuple(attr), draw), TensorType.of(dtype, edges), loc)


def random_folds(v: Value) -> tuple[int | Value, ...]:
    """The folds of the draw `v`: integers, and the i32 scalar arguments of folds by an
    input's value (its '$i' attributes resolved to its operands)."""
    return tuple(v.operands[int(n[1:])] if isinstance(n, str) else n for n in v.attrs[1])


def fold(key: Value, n: int | Value, loc: Loc | None = None) -> Value:
    """The key `fold(key, n)`, `n` an integer in [0, 2^31) or an i32 scalar argument:
    consumed by `random`, which folds it into its attributes (and operands)."""
    if key.op not in ("arg", "loopvar", "fold") or key.dtype != "i32" or key.edges:
        raise IRError("fold takes an i32 scalar key")
    if isinstance(n, Value):
        if not _is_i32_scalar_arg(n):
            raise IRError("fold takes an integer literal or an i32 scalar input")
        return Value.make("fold", (key, n), (-1,), key.type, loc)
    if not 0 <= int(n) < 2 ** 31:
        raise IRError("fold takes an integer in [0, 2^31)")
    return Value.make("fold", (key,), (int(n),), key.type, loc)


def rename(x: Value, mapping: Mapping[str, str], loc: Loc | None = None) -> Value:
    pairs = tuple(sorted((s, d) for s, d in mapping.items() if s != d))
    if not pairs:
        return x
    for s, _ in pairs:
        if s not in x.edges:
            raise IRError(f"cannot rename edge '{s}': the tensor has edges [{', '.join(x.edges)}]")
    new = [dict(pairs).get(e, e) for e in x.edges]
    if len(set(new)) != len(new):
        dup = next(e for e in new if new.count(e) > 1)
        raise IRError(f"renaming gives the tensor edge '{dup}' twice")
    return Value.make("rename", (x,), (pairs,), TensorType.of(x.dtype, new), loc)


def stop(x: Value, loc: Loc | None = None) -> Value:
    return Value.make("stop", (x,), (), x.type, loc)


def _check_wrt(x: Value) -> None:
    if x.op != "arg":
        raise IRError("derivatives are taken with respect to an input, param or state")
    if x.dtype == "i32":
        raise IRError("cannot differentiate with respect to an integer (i32) input")


def grad(f: Value, x: Value, loc: Loc | None = None) -> Value:
    _check_wrt(x)
    shared = sorted(set(f.edges) & set(x.edges))
    if shared:
        raise IRError(f"grad of a non-scalar needs disjoint edges; both sides have '{shared[0]}' (rename first)")
    # a gradient has its variable's type
    return Value.make("grad", (f, x), (), TensorType.of(x.dtype, f.edges + x.edges), loc)


def jvp(f: Value, x: Value, dx: Value, loc: Loc | None = None) -> Value:
    _check_wrt(x)
    missing = sorted(set(x.edges) - set(dx.edges))
    if missing:
        raise IRError(f"the tangent must have the edges of '{x.attrs[0]}'; it lacks '{missing[0]}'")
    extra = set(dx.edges) - set(x.edges)
    if extra & set(f.edges):
        raise IRError(f"the tangent's extra edge '{sorted(extra & set(f.edges))[0]}' is also an edge of the function")
    return Value.make("jvp", (f, x, dx), (), TensorType.of(f.dtype, set(f.edges) | extra), loc)


def vjp(f: Value, x: Value, v: Value, loc: Loc | None = None) -> Value:
    _check_wrt(x)
    missing = sorted(set(f.edges) - set(v.edges))
    if missing:
        raise IRError(f"the cotangent must have the function's edges; it lacks '{missing[0]}'")
    extra = set(v.edges) - set(f.edges)
    if extra & set(x.edges):
        raise IRError(f"the cotangent's extra edge '{sorted(extra & set(x.edges))[0]}' is also an edge of '{x.attrs[0]}'")
    return Value.make("vjp", (f, x, v), (), TensorType.of(x.dtype, set(x.edges) | extra), loc)


def slot(name: str, dtype: str, edges: Iterable[str], loc: Loc | None = None) -> Value:
    """The placeholder `name` of a custom rule (a cotangent or a tangent)."""
    if dtype not in FLOAT_DTYPES:
        raise IRError(f"a rule's placeholder is float, not '{dtype}'")
    return Value.make("slot", (), (name,), TensorType.of(dtype, edges), loc)


def custom(y: Value, args: Sequence[Value], vjps: Sequence[Value] | None, jvp: Value | None,
           fn: str, ct: str = "", tans: Sequence[str] = (), loc: Loc | None = None) -> Value:
    """`y` (the value of a call of `fn` on `args`) with the call's own derivative rules:
    `vjps[i]` the cotangent of args[i] in terms of the slot `ct` (y's edges), `jvp` the
    tangent of y in terms of the slots `tans` (args[i]'s edges each). A rule may have
    fewer edges than its target (it is broadcast), never an edge the target lacks."""
    n = len(args)
    if n < 1:
        raise IRError("a custom derivative needs at least one argument")
    if (vjps is None) != (not ct) or (jvp is None) != (not tans):
        raise IRError("a custom rule and its placeholders come together")
    if vjps is None and jvp is None:
        raise IRError("a custom derivative needs a vjp or a jvp rule")
    operands = [y, *args]
    if vjps is not None:
        if len(vjps) != n:
            raise IRError(f"the vjp rule gives {len(vjps)} derivatives for {n} arguments")
        for i, (d, a) in enumerate(zip(vjps, args)):
            extra = sorted(set(d.edges) - set(a.edges))
            if extra:
                raise IRError(f"the vjp rule's derivative {i + 1} has edge '{extra[0]}', its argument does not")
        operands += vjps
    if jvp is not None:
        if len(tans) != n:
            raise IRError(f"the jvp rule has {len(tans)} tangents for {n} arguments")
        extra = sorted(set(jvp.edges) - set(y.edges))
        if extra:
            raise IRError(f"the jvp rule has edge '{extra[0]}', the value does not")
        operands.append(jvp)
    return Value.make("custom", operands, (fn, n, ct, tuple(tans)), y.type, loc)


def custom_parts(v: Value) -> tuple[Value, tuple[Value, ...], tuple[Value, ...] | None, Value | None]:
    """(y, args, vjps or None, jvp or None) of a `custom` value."""
    fn, n, ct, tans = v.attrs
    y, args, rest = v.operands[0], v.operands[1:1 + n], v.operands[1 + n:]
    vjps = rest[:n] if ct else None
    jvp = rest[-1] if tans else None
    return y, args, vjps, jvp


@dataclass(frozen=True)
class LoopBody:
    """One step of a loop: a closed graph over its parameters (`loopvar` values).

    `params` are the step's inputs, in order: `carries` carried values (the value
    before the step), `slices` per-step slices of stacked operands (without the loop
    edge), then loop-invariant values. `results` are the carries' new values, in the
    same order, then the per-step results the loop stacks along its edge. A body
    reads nothing but its parameters; it is hash-consed like the values it holds
    (equal bodies are equal), so two loops of one body and operands are one loop."""

    params: tuple[Value, ...]
    results: tuple[Value, ...]
    carries: int
    slices: int

    @property
    def invariants(self) -> int:
        return len(self.params) - self.carries - self.slices

    @property
    def stacked(self) -> int:
        """How many per-step results the loop stacks."""
        return len(self.results) - self.carries

    def role(self, k: int) -> str:
        """What parameter (and operand) `k` is: 'carry', 'slice' or 'invariant'."""
        return "carry" if k < self.carries else "slice" if k < self.carries + self.slices else "invariant"


def loopvar(k: int, dtype: str, edges: Iterable[str], loc: Loc | None = None) -> Value:
    """Parameter `k` of a loop body."""
    if dtype not in DTYPES:
        raise IRError(f"unknown dtype '{dtype}'")
    return Value.make("loopvar", (), (int(k),), TensorType.of(dtype, edges), loc)


def loop_body(params: Sequence[Value], results: Sequence[Value], carries: int, slices: int) -> LoopBody:
    """A checked `LoopBody`: parameters numbered in order, carries typed alike."""
    for k, p in enumerate(params):
        if p.op != "loopvar" or p.attrs[0] != k:
            raise IRError(f"parameter {k} of a loop body is not loopvar[{k}]")
    if not 0 <= carries <= len(results) or carries + slices > len(params):
        raise IRError("a loop body has more carries or slices than parameters and results")
    for k in range(carries):
        if results[k].type != params[k].type:
            raise IRError(f"the loop's carry {k} changes type in a step: {params[k].type} becomes "
                          f"{results[k].type}")
    return LoopBody(tuple(params), tuple(results), carries, slices)


def loop(body: LoopBody, edge: str, operands: Sequence[Value], out: int = 0, reverse: bool = False,
         loc: Loc | None = None) -> Value:
    """Output `out` of the loop of `body` over `edge` on `operands` (see LoopBody)."""
    if len(operands) != len(body.params):
        raise IRError(f"the loop's body takes {len(body.params)} operands, got {len(operands)}")
    for k, (o, p) in enumerate(zip(operands, body.params)):
        role = body.role(k)
        if role == "slice" and edge not in o.edges:
            raise IRError(f"the loop's stacked operand {k - body.carries + 1} lacks the loop edge '{edge}' "
                          f"(its edges: [{', '.join(o.edges)}])")
        want = [e for e in o.edges if e != edge] if role == "slice" else list(o.edges)
        if role != "slice" and edge in o.edges:
            raise IRError(f"the loop's {role} operand {k} has the loop edge '{edge}'")
        if o.dtype != p.dtype or tuple(want) != p.edges:
            raise IRError(f"the loop's operand {k} ({role}) has type {o.type}, its body parameter {p.type}")
    for r in body.results:
        if edge in r.edges:
            raise IRError(f"a loop body's result has the loop edge '{edge}'")
    if not 0 <= out < len(body.results):
        raise IRError(f"the loop has {len(body.results)} outputs, not an output {out}")
    r = body.results[out]
    edges = r.edges if out < body.carries else r.edges + (edge,)
    return Value.make("loop", operands, (body, edge, bool(reverse), int(out)), TensorType.of(r.dtype, edges), loc)


def loop_output(v: Value, out: int) -> Value:
    """Output `out` of the loop that `v` (a loop value) is an output of."""
    body, edge, reverse, _ = v.attrs
    return loop(body, edge, v.operands, out, reverse, v.loc)


def holds_logsumexp(v: Value, lse: Callable[[Value], bool] = lambda v: False) -> bool:
    """Whether `v` is a log-sum-exp, whose softmax weights `exp(d - lse)` take their sum
    unrounded in f32 (`tgc.lower.lowered.wide_exp`): a `reduce[logsumexp]`, or the log
    of a loop's carry (the online softmax's `log(l)`, l the running sum of exp(X - m)
    that the first key loop carries: `tgc.opt.stream_keys`), or what `lse` says of it
    (a loop body's parameter, or a step's argument, bound to one from outside)."""
    if v.op == "reduce":
        return v.attrs[0] == "logsumexp"
    if v.op == "map" and v.attrs[0] == "log" and len(v.operands) == 1:
        o = v.operands[0]
        return o.op == "loop" and o.attrs[3] < o.attrs[0].carries
    return lse(v)


def primal_order(roots: Iterable[Value]) -> list[Value]:
    """`topo_order`, but a `custom` value's rules are not visited: what computing the
    roots' values needs (a custom value is its first operand's value)."""
    order: list[Value] = []
    seen: set[int] = set()
    for root in roots:
        stack: list[tuple[Value, int]] = [(root, 0)]
        while stack:
            v, i = stack.pop()
            if i == 0 and id(v) in seen:
                continue
            ops = v.operands[:1] if v.op == "custom" else v.operands
            if i < len(ops):
                stack.append((v, i + 1))
                child = ops[i]
                if id(child) not in seen:
                    stack.append((child, 0))
            else:
                seen.add(id(v))
                order.append(v)
    return order


def strip_custom(roots: Sequence[Value]) -> dict[int, Value]:
    """id(old) -> replacement for every value `roots` need, each `custom` replaced by its
    value (its first operand): the rules go, the values are unchanged (exact)."""
    memo: dict[int, Value] = {}
    for v in primal_order(roots):
        memo[id(v)] = memo[id(v.operands[0])] if v.op == "custom" else \
            rebuild_same(v, tuple(memo[id(o)] for o in v.operands))
    return memo


def reaches(roots: Iterable[Value], pred: Callable[[Value], bool]) -> bool:
    """Whether `pred` holds for a value reachable from `roots`, the results of a loop's
    body and what they reach included. In no particular order (a walk without one
    costs half of `topo_order`'s)."""
    stack = list(roots)
    seen = {id(v) for v in stack}
    push, add = stack.append, seen.add
    while stack:
        v = stack.pop()
        if pred(v):
            return True
        more = v.operands + v.attrs[0].results if v.op == "loop" else v.operands
        for o in more:
            if id(o) not in seen:
                add(id(o))
                push(o)
    return False


def topo_order(roots: Iterable[Value], stop: Iterable[int] = ()) -> list[Value]:
    """Every value reachable from `roots`, operands before users, deterministic; the
    values whose ids are in `stop`, and what lies beneath them only, are left out."""
    order: list[Value] = []
    seen: set[int] = set(stop)
    for root in roots:
        stack: list[tuple[Value, int]] = [(root, 0)]
        while stack:
            v, i = stack.pop()
            if i == 0 and id(v) in seen:
                continue
            if i < len(v.operands):
                stack.append((v, i + 1))
                child = v.operands[i]
                if id(child) not in seen:
                    stack.append((child, 0))
            else:
                seen.add(id(v))
                order.append(v)
    return order


def rebuild(roots: Sequence[Value], fn: Callable[[Value, tuple[Value, ...]], Value]) -> dict[int, Value]:
    """Rewrite bottom-up: `fn(old, new_operands)` gives each value's replacement.

    Returns a map from `id(old)` to its replacement for every value reachable.
    """
    memo: dict[int, Value] = {}
    for v in topo_order(roots):
        memo[id(v)] = fn(v, tuple(memo[id(o)] for o in v.operands))
    return memo


def rebuild_through_loops(values: Sequence[Value], fn: Callable[[Value, tuple[Value, ...]], Value],
                          memo: dict[int, Value], bodies: dict | None = None,
                          operand: Callable[[Value], Value] | None = None) -> None:
    """Fill `memo[id(v)]` for each of `values` (operands first) with `fn(v, its new
    operands)`; a loop's body is rebuilt the same way first (its `loopvar` parameters
    through `fn` too, once per body), so that a per-value transform (a type emulation)
    reaches every step; `operand`, where given, maps each new operand of a loop (to
    the type its rebuilt parameter has). A loop whose rebuilt body no longer fits its
    operands or its carries (`IRError`) keeps its old body."""
    bodies = {} if bodies is None else bodies
    for v in values:
        ops = tuple(memo[id(o)] for o in v.operands)
        if v.op != "loop":
            memo[id(v)] = fn(v, ops)
            continue
        if operand is not None:
            ops = tuple(operand(o) for o in ops)
        body = v.attrs[0]
        if body not in bodies:
            inner: dict[int, Value] = {}
            rebuild_through_loops(topo_order(list(body.params) + list(body.results)), fn, inner, bodies, operand)
            try:
                bodies[body] = loop_body([inner[id(p)] for p in body.params], [inner[id(r)] for r in body.results],
                                         body.carries, body.slices)
            except IRError:
                bodies[body] = body
        try:
            memo[id(v)] = loop(bodies[body], v.attrs[1], ops, v.attrs[3], v.attrs[2], v.loc)
        except IRError:
            memo[id(v)] = loop(body, v.attrs[1], ops, v.attrs[3], v.attrs[2], v.loc)


def rebuild_same(v: Value, operands: tuple[Value, ...]) -> Value:
    """`v` with new operands, its op and attributes unchanged (types re-derived)."""
    if operands == v.operands:
        return v
    return BUILDERS[v.op](v, operands)


BUILDERS: dict[str, Callable[[Value, tuple[Value, ...]], Value]] = {
    "add": lambda v, ops: add(ops, v.attrs[0], v.loc),
    "contract": lambda v, ops: contract(ops, v.edges, v.loc),
    "map": lambda v, ops: map_(v.attrs[0], *ops, loc=v.loc),
    "reduce": lambda v, ops: reduce(v.attrs[0], ops[0], v.attrs[1], v.loc),
    "gather": lambda v, ops: gather(ops[0], ops[1], v.attrs[0], v.loc),
    "scatter": lambda v, ops: scatter(ops[0], ops[1], v.attrs[0], set(v.edges) & set(ops[1].edges), v.loc,
                                      v.attrs[1]),
    "rename": lambda v, ops: rename(ops[0], dict(v.attrs[0]), v.loc),
    "random": lambda v, ops: random(v.attrs[0], ops[0], tuple(ops[int(n[1:])] if isinstance(n, str) else n
                                                             for n in v.attrs[1]), v.dtype, v.edges, v.loc, v.attrs[2]),
    "stop": lambda v, ops: stop(ops[0], v.loc),
    "grad": lambda v, ops: grad(ops[0], ops[1], v.loc),
    "jvp": lambda v, ops: jvp(*ops, loc=v.loc),
    "vjp": lambda v, ops: vjp(*ops, loc=v.loc),
    "custom": lambda v, ops: _rebuild_custom(v, ops),
    "loop": lambda v, ops: loop(v.attrs[0], v.attrs[1], ops, v.attrs[3], v.attrs[2], v.loc),
}


def _rebuild_custom(v: Value, ops: tuple[Value, ...]) -> Value:
    fn, n, ct, tans = v.attrs
    rest = ops[1 + n:]
    return custom(ops[0], ops[1:1 + n], rest[:n] if ct else None, rest[-1] if tans else None,
                  fn, ct, tans, v.loc)


def is_shift(v: Value) -> bool:
    """v = x - max_E(x) (or min, or either under `stop`): the shifted logits of a softmax.

    A shift stays one term of its users' sums: (x - m) - lse is computed as written,
    with x - m exact where it matters; flattened, the sum could take x - lse first,
    whose terms are as large as the logits (the floating-point contract in docs/optimization.md)."""
    if v.op != "add" or len(v.operands) != 2 or sorted(v.attrs[0]) != [-1.0, 1.0]:
        return False
    x, m = v.operands if v.attrs[0][1] == -1.0 else v.operands[::-1]
    if m.op == "stop":
        m = m.operands[0]
    return m.op == "reduce" and m.attrs[0] in ("max", "min") and m.operands[0] is x
