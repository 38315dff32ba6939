"""Canonical construction: the smart builders behind `normalize`, `simplify` and `stabilize`.

Given canonical operands, each builder returns the canonical value, so equal things
are one value (the builders of `tgc.ir.values` hash-cons what they build):

- `add`: nested adds flattened (scalings always, sums as `merge` allows), like terms merged,
  constants folded into one, zero terms dropped, operands sorted.
- `contract`: nested product contractions merged into one n-ary contraction (their
  summed edges renamed apart; only those `merge` allows, see `Canon`), scalings
  (`add[k] x`) and constants folded into one
  coefficient (an `add[k]` around the result), the identity contraction dropped,
  operands sorted. Edge names are canonical: every edge is computed under a name
  its operands already carry (their "native" name), so renames move out to the
  result, and a summed edge that must be renamed gets the first free `stem.k`.
  So a contraction written with other internal edge names is the same value.
- `rename`: composed, absorbed by constants and indicators, pulled out of
  elementwise ops (`map`, `add`, `stop`) and reductions: computations happen on
  native names and renamed views share them.
- `map`: constant operands folded, commutative operands sorted, `gt`/`ge` turned
  into `lt`/`le`.

Sorting uses `key`, a digest of a value's structure (op, attributes, type and the
keys of its operands), never `id()` or Python's hash: output is byte-identical run
to run. Every builder strictly reduces the nesting of renames, adds in adds,
contractions in contractions or constants in products, so canonicalizing terminates.
"""
from __future__ import annotations

import hashlib
import itertools
import math
import weakref
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from tgc.ir import values as V
from tgc.ir.module import Module
from tgc.ir.sizes import SizeError, size_eval
from tgc.opt.naming import working_names
from tgc.ir.values import Value, is_shift

_KEYS: "weakref.WeakKeyDictionary[Value, str]" = weakref.WeakKeyDictionary()
_RANK = {"arg": 0, "size": 1, "indicator": 2, "const": 9}
COMMUTATIVE = ("eq", "ne")  # not max/min: a tie sends the gradient to the first argument
FLIPPED = {"gt": "lt", "ge": "le"}


def key(v: Value) -> str:
    """A digest of v's structure, stable across runs (no ids, no hash seeds)."""
    got = _KEYS.get(v)   # (the common case: digested before)
    if got is not None:
        return got
    stack = [v]
    while stack:
        u = stack[-1]
        if u in _KEYS:
            stack.pop()
            continue
        todo = [o for o in u.operands if o not in _KEYS]
        if todo:
            stack.extend(todo)
            continue
        stack.pop()
        text = f"{u.op}|{u.attrs!r}|{u.type}|" + ",".join(_KEYS[o] for o in u.operands)
        _KEYS[u] = hashlib.blake2b(text.encode(), digest_size=10).hexdigest()
    return _KEYS[v]


def sort_key(v: Value) -> tuple:
    """Arguments first, constants last, otherwise by structure."""
    return _RANK.get(v.op, 5), key(v)


def base(v: Value) -> tuple[Value, dict[str, str]]:
    """(x, mapping) for `rename(x, mapping)`, else (v, {})."""
    return (v.operands[0], dict(v.attrs[0])) if v.op == "rename" else (v, {})


def static_size(m: Module, edge: str) -> int | None:
    try:
        return size_eval(m.size(edge), {d: s for d, s in m.dims.items() if isinstance(s, int)})
    except SizeError:
        return None


class Canon:
    """The canonical builders, over one module (its edge table gets fresh edges).

    `merge` says which nested contractions (and sums) may be merged into their user
    (None: none, but scalings): merging a shared one would recompute it in every
    user, and merging before differentiation would hide intermediates that the
    derivative program shares.
    """

    def __init__(self, module: Module, merge: Callable[[Value], bool] | None = lambda v: True,
                 reassociate: bool = True):
        self.m = module
        self.merge = merge
        self.reassociate = reassociate  # False (--fp-strict): scalings stay where the source has them
        # (factors, keep) -> working names: a product met again (a rule or a later pass
        # rebuilding it) is named as before; fresh edges only ever get added to the module,
        # so naming again would give the same names
        self._work: dict[tuple, dict[str, str]] = {}

    # ---- dispatch ----------------------------------------------------------------

    def rebuild(self, v: Value, ops: tuple[Value, ...]) -> Value:
        """The canonical form of `v` with (canonical) operands `ops`."""
        if v.op == "add":
            return self.add(ops, v.attrs[0])
        if v.op == "contract":
            return self.contract(ops, v.edges)
        if v.op == "map":
            return self.map(v.attrs[0], *ops)
        if v.op == "rename":
            return self.rename(ops[0], dict(v.attrs[0]))
        if v.op == "reduce":
            return self.reduce(v.attrs[0], ops[0], v.attrs[1])
        if v.op == "stop":
            return self.stop(ops[0])
        if v.op == "size":
            n = static_size(self.m, v.attrs[0])
            return v if n is None else V.const(float(n), v.dtype)
        return V.rebuild_same(v, ops)

    # ---- broadcast ---------------------------------------------------------------

    def broadcast(self, x: Value, edges: Iterable[str]) -> Value:
        """x repeated over `edges` (a superset of its own)."""
        edges = set(edges)
        if edges <= set(x.edges):
            return x
        if x.op == "const":
            return V.const(x.attrs[0], x.dtype, edges | set(x.edges))
        return V.contract([x], edges | set(x.edges))

    # ---- rename ------------------------------------------------------------------

    def rename(self, x: Value, mapping: Mapping[str, str]) -> Value:
        mapping = {s: d for s, d in mapping.items() if s != d}
        if not mapping:
            return x
        if x.op == "rename":  # rename(rename(x, P), Q) = rename(x, Q . P)
            inner = dict(x.attrs[0])
            composed = {s: mapping.get(d, d) for s, d in inner.items()}
            composed.update({s: d for s, d in mapping.items() if s not in inner.values()})
            return self.rename(x.operands[0], composed)
        if x.op == "const":
            return V.const(x.attrs[0], x.dtype, [mapping.get(e, e) for e in x.edges])
        if x.op == "indicator":
            return V.indicator(x.attrs[0].renamed(mapping), x.dtype)
        if x.op == "contract":  # renamed kept edges: the contraction on its canonical names
            return self.contract([V.rename(x, mapping)], [mapping.get(e, e) for e in x.edges])
        return V.rename(x, mapping)

    def _pull_renames(self, ops: Sequence[Value]) -> tuple[list[Value], dict[str, str]] | None:
        """Operands on their native names and the rename of the result, when they agree.

        Every operand must be a rename (or have none of the renamed edges), the renames
        must agree, and no operand may carry a native name under its own name.
        """
        back: dict[str, str] = {}  # renamed name -> native name
        for o in ops:
            for s, d in base(o)[1].items():
                if back.setdefault(d, s) != s:
                    return None
        if not back:
            return None
        natives = set(back.values())
        if len(natives) != len(back):  # x[i -> j] - x[i -> k]: an outer difference, not one rename of x - x
            return None
        bases = []
        for o in ops:
            b, mp = base(o)
            for e in o.edges:
                if (e in back and mp.get(back[e]) != e) or (e in natives and e not in mp.values() and e not in back):
                    return None
            bases.append(b)
        result = set().union(*(b.edges for b in bases))
        forward = {s: d for d, s in back.items()}
        if len({forward.get(e, e) for e in result}) != len(result):
            return None
        return bases, forward

    # ---- add ---------------------------------------------------------------------

    def add(self, operands: Sequence[Value], coefs: Sequence[float] | None = None) -> Value:
        coefs = list(coefs) if coefs is not None else [1.0] * len(operands)
        dtype = operands[0].dtype
        edges = set().union(*(o.edges for o in operands))
        terms: dict[int, list] = {}  # id -> [value, coef]
        const = 0.0
        for v, c in self._add_terms(operands, coefs):
            v = narrow(v)
            if v.op == "const" and math.isfinite(v.attrs[0]):
                const += c * v.attrs[0]
            else:
                terms.setdefault(id(v), [v, 0.0])[1] += c
        live = sorted(((v, c) for v, c in terms.values() if c != 0.0), key=lambda t: sort_key(t[0]))
        covered = set().union(*(v.edges for v, _ in live)) if live else set()
        if const != 0.0:
            live.append((V.const(const, dtype, edges - covered), 1.0))
            covered = edges
        if not live:
            return V.const(0.0, dtype, edges)
        return self.broadcast(self._add_of(live), edges)

    def _add_terms(self, operands, coefs):
        for o, c in zip(operands, coefs):
            if o.op == "add" and ((len(o.operands) == 1 and self.reassociate) or (
                    exact_scale(c) and not is_shift(o) and self.merge and self.merge(o))):
                yield from ((v, c * k) for v, k in zip(o.operands, o.attrs[0]))  # (a + b) c = a c + b c
            else:
                yield o, c

    def _add_of(self, terms: list[tuple[Value, float]]) -> Value:
        if len(terms) == 1 and terms[0][1] == 1.0:
            return terms[0][0]
        pulled = self._pull_renames([v for v, _ in terms])
        if pulled is not None:
            bases, forward = pulled
            inner = self.add(bases, [c for _, c in terms])
            return self.rename(inner, forward)
        return V.add([v for v, _ in terms], [c for _, c in terms])

    def scale(self, k: float, x: Value) -> Value:
        return self.add([x], [k])

    # ---- contract ----------------------------------------------------------------

    def contract(self, operands: Sequence[Value], keep: Iterable[str]) -> Value:
        keep = set(keep)
        dtype = operands[0].dtype
        coef, factors = self._factors(list(operands), keep)
        coef, factors = self._fold_consts(coef, factors, keep, dtype)
        if coef == 0.0:
            return V.const(0.0, dtype, keep)
        if not factors:
            return V.const(coef, dtype, keep)
        product = self._named(factors, keep)
        return product if coef == 1.0 else self.scale(coef, product)

    def _factors(self, todo: list[Value], keep: set[str]) -> tuple[float, list[Value]]:
        """The coefficient and the factors of the product, nested contractions opened."""
        coef, factors = 1.0, []
        used = set(keep).union(*(o.edges for o in todo))
        at = 0
        while at < len(todo):   # in order, opened contractions' operands appended
            o = todo[at]
            at += 1
            if o.op == "add" and len(o.operands) == 1 and self.reassociate:  # (k x) y = k (x y)
                coef *= o.attrs[0][0]
                o = o.operands[0]
            # (`_open` opens only a contraction or a renamed one: `merge` is asked of those)
            inner = self._open(o) if o.op in ("contract", "rename") and self.merge and self.merge(o) else None
            if inner is None:
                factors.append(o)
                continue
            ops, inner_keep = inner
            todo.extend(self._apart(ops, inner_keep, used, o.dtype))
        return coef, factors

    def _open(self, o: Value) -> tuple[list[Value], set[str]] | None:
        """The operands and kept edges of a contraction `o` (or of a renamed one)."""
        if o.op == "contract":
            return list(o.operands), set(o.edges)
        if o.op != "rename" or o.operands[0].op != "contract":
            return None
        inner, mp = o.operands[0], dict(o.attrs[0])
        summed = set().union(*(x.edges for x in inner.operands)) - set(inner.edges)
        used = summed | set(inner.edges) | set(mp.values())
        apart = {s: self.fresh(s, used) for s in sorted(summed & set(mp.values()))}
        mp.update(apart)
        ops = [self.rename(x, {e: mp[e] for e in x.edges if e in mp}) for x in inner.operands]
        return ops, {mp.get(e, e) for e in inner.edges}

    def _apart(self, ops: list[Value], inner_keep: set[str], used: set[str], dtype: str) -> list[Value]:
        """An inner contraction's operands, its summed edges renamed apart from `used`."""
        summed = sorted(set().union(*(o.edges for o in ops)) - inner_keep)
        fresh = {}
        for s in summed:
            if s in used:
                fresh[s] = self.fresh(s, used)
            used.add(fresh.get(s, s))
        out = [self.rename(o, {e: fresh[e] for e in o.edges if e in fresh}) for o in ops]
        lone = inner_keep - set().union(*(o.edges for o in ops))
        if lone:  # broadcast edges of the inner: a factor 1 over them keeps their count
            out.append(V.const(1.0, dtype, lone))
        return out

    def fresh(self, edge: str, taken: set[str]) -> str:
        """The first of `stem`, `stem.1`, `stem.2`, ... of edge's size not in `taken`."""
        stem, dim = edge.split(".")[0], self.m.edges[edge]
        names = (stem if k == 0 else f"{stem}.{k}" for k in itertools.count())
        name = next(n for n in names if n not in taken and self.m.edges.get(n, dim) == dim)
        self.m.edges[name] = dim
        return name

    def _fold_consts(self, coef, factors, keep, dtype) -> tuple[float, list[Value]]:
        """Constant factors become the coefficient (times the size of edges only they sum)."""
        consts = [f for f in factors if f.op == "const" and math.isfinite(f.attrs[0])]
        rest = [f for f in factors if not (f.op == "const" and math.isfinite(f.attrs[0]))]
        if not consts:
            return coef, rest
        for c in consts:
            coef *= c.attrs[0]
        lone = set().union(*(c.edges for c in consts)) - keep - set().union(*(f.edges for f in rest))
        for e in sorted(lone):
            n = static_size(self.m, e)
            if n is None:
                rest.append(V.size(e, dtype))
            else:
                coef *= n
        return coef, rest

    def _named(self, factors: list[Value], keep: set[str]) -> Value:
        """The product on canonical edge names, renamed to `keep` at the end."""
        memo = (tuple(factors), frozenset(keep))
        work = self._work.get(memo)
        if work is None:
            work = self._work[memo] = working_names(self.m, factors, keep, base, sort_key, self.fresh)
        ops = []
        for f in factors:
            if f.op != "rename" and all(work[e] == e for e in f.edges):   # on its own names: itself
                ops.append(f)
                continue
            b, mp = base(f)
            ops.append(self.rename(b, {e: work[mp.get(e, e)] for e in b.edges}))
        ops.sort(key=sort_key)
        inner_keep = {work.get(e, e) for e in keep}
        back = {work[e]: e for e in keep if e in work}
        if len(ops) == 1 and set(ops[0].edges) == inner_keep:  # one factor: a (composed) rename of it
            b, mp = base(ops[0])
            return V.rename(b, {s: back.get(d, d) for s, d in mp.items()} | {
                s: d for s, d in back.items() if s in b.edges and s not in mp})
        return V.rename(V.contract(ops, inner_keep), back)

    # ---- map, reduce, stop -------------------------------------------------------------

    def map(self, fn: str, *ops: Value) -> Value:
        if fn in FLIPPED:  # a > b = b < a
            return self.map(FLIPPED[fn], ops[1], ops[0])
        if fn in COMMUTATIVE:
            ops = tuple(sorted(ops, key=sort_key))
        if all(o.op == "const" for o in ops):
            return self._fold_map(fn, ops)
        edges = set().union(*(o.edges for o in ops))
        narrowed = tuple(narrow(o) for o in ops)
        if any(n is not o for n, o in zip(narrowed, ops)):  # f(broadcast x) = broadcast f(x)
            return self.broadcast(self.map(fn, *narrowed), edges)
        pulled = self._pull_renames(ops)
        if pulled is not None:
            bases, forward = pulled
            return self.rename(self.map(fn, *bases), forward)
        return V.map_(fn, *ops)

    def _fold_map(self, fn: str, ops: Sequence[Value]) -> Value:
        from tgc.ir.ops import NUMPY as MAP_FNS

        with np.errstate(all="ignore"):
            value = float(MAP_FNS[fn](*(np.float64(o.attrs[0]) for o in ops)))
        return V.const(value, ops[0].dtype, set().union(*(o.edges for o in ops)))

    def reduce(self, kind: str, x: Value, edges: Iterable[str]) -> Value:
        edges = set(edges)
        if not edges:
            return x
        if x.op == "const":
            return self._reduce_const(kind, x, edges)
        if x.op == "rename":  # reduce over renamed edges = rename of the reduction over native ones
            b, mp = base(x)
            inv = {d: s for s, d in mp.items()}
            inner = self.reduce(kind, b, {inv.get(e, e) for e in edges})
            return self.rename(inner, {s: d for s, d in mp.items() if d not in edges})
        return V.reduce(kind, x, edges)

    def _reduce_const(self, kind: str, x: Value, edges: set[str]) -> Value:
        rest = set(x.edges) - edges
        if kind != "logsumexp":  # max/min of a constant is the constant
            return V.const(x.attrs[0], x.dtype, rest)
        return V.reduce(kind, x, edges)

    def stop(self, x: Value) -> Value:
        if x.op in ("stop", "const", "indicator", "size", "random"):  # stop(stop x) = stop x; constants and draws have no derivative
            return x
        if x.op == "rename":
            b, mp = base(x)
            return self.rename(self.stop(b), mp)
        return V.stop(x)


def exact_scale(c: float) -> bool:
    """Scaling by c is exact in floating point: c = +-2^k (barring over/underflow).

    Only such a scale is distributed over a sum: k (a - b) = k a - k b turns the exact
    difference of two close values (Sterbenz) into the difference of two rounded
    products, whose error is relative to k a, not to the result (3 (a - b) at a = b
    came out as 1e-4, not 0)."""
    m, _ = math.frexp(c)
    return m in (0.5, -0.5)


def narrow(v: Value) -> Value:
    """v without the edges it is only broadcast over (an elementwise operand needs none)."""
    if v.op == "const" and v.edges:
        return V.const(v.attrs[0], v.dtype)
    if v.op != "contract":
        return v
    carried = set().union(*(o.edges for o in v.operands))
    if carried >= set(v.edges):
        return v
    keep = set(v.edges) & carried
    if len(v.operands) == 1 and set(v.operands[0].edges) == keep:
        return v.operands[0]
    return V.contract(v.operands, keep)
