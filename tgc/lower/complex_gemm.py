"""Complex products as one BLAS cgemm/zgemm cell (part of `fuse`, the first lowering stage).

The front end writes a complex product `a @ b` as real arithmetic on float pairs
(`tgc/frontend/complexes.py`): the parts are taken out by contractions with the
indicators [re.im = k], multiplied by four real contractions, and put back together
(`where([re.im = 0], re, im)`, or `[re.im = 0] * re + [re.im = 1] * im` as the
adjoint writes it). Lowered as such it is four real GEMMs plus strided copies of the
parts. This module finds, in the optimized IR, every value that *is* a complex
product of two complex values (`match`), and `ComplexGemms`, the fuser's part for
them, lowers each as one GEMM cell on the interleaved buffers (`GemmKernel.cplx`),
computed by cgemm/zgemm.

Why here, and not a complex op kept from the front end down: below the front end
nothing knows about complex values (differentiation, every optimizer pass, both
interpreters and the CUDA backend work on the real form unchanged); the gradient of
a complex product comes out of the adjoint as other real products of parts, in
another spelling. Recognizing the bilinear form at the start of lowering catches
the forward products and the adjoint's alike, and only lowering changes.

The recognition is exact. A value Z over edges E + [re.im] is matched when it is
assembled from a real part R and an imaginary part I (over E), each a linear
combination of real contractions c(P, Q), all with the same edges, where every P is
part p of one complex value X and every Q part q of one complex value Y, read through
the same renames (a part may carry a real sign vector over re.im: `conj`). Then
Z[r] = sum_{p,q} C[p, q, r] (X_p . Y_q) for a table C of 8 coefficients, and Z is
alpha op(X) . op(Y), op a conjugation or not, exactly when C is alpha times the
product's table with the rows of a conjugated operand's imaginary part negated:
C[0,0,0] = 1, C[1,1,0] = -1, C[0,1,1] = C[1,0,1] = 1. cgemm computes the same sums
(the textbook four-product form) up to the order of the additions. Anything else
(other coefficients, mixed operands, another edge structure) is left as it was.

Terminates: one visit per value; each match walks a bounded tree of adds above
contractions (every value visited once per match).
"""
from __future__ import annotations

import numpy as np

from tgc.ir.complex_io import RI
from tgc.ir.values import Value
from tgc.lower.lowered import GemmKernel, View

# the complex product's table C[p, q, r] (part p of X times part q of Y into part r)
PRODUCT = np.zeros((2, 2, 2))
PRODUCT[0, 0, 0], PRODUCT[1, 1, 0], PRODUCT[0, 1, 1], PRODUCT[1, 0, 1] = 1, -1, 1, 1


def unit(v: Value) -> int | None:
    """k when `v` is the indicator [re.im = k]."""
    if v.op != "indicator" or v.edges != (RI,) or v.attrs[0].edges() != (RI,):
        return None
    held = np.asarray(v.attrs[0].holds({RI: np.arange(2)}, {RI: 2}), bool)
    if held.shape != (2,) or held.sum() != 1:
        return None
    return int(held.argmax())


def vector(v: Value) -> np.ndarray | None:
    """A real value over [re.im] alone built of its indicators and adds (conj's sign
    (1, -1)), as its two numbers; None for anything else."""
    if v.edges != (RI,):
        return None
    k = unit(v)
    if k is not None:
        out = np.zeros(2)
        out[k] = 1.0
        return out
    if v.op == "add":
        parts = [vector(o) for o in v.operands]
        if any(p is None for p in parts):
            return None
        return sum(c * p for c, p in zip(v.attrs[0], parts))
    return None


def peel(v: Value) -> tuple[Value, dict[str, str]]:
    """Strip renames and `stop`s: (base, view edge -> base edge)."""
    mapping = {e: e for e in v.edges}
    while v.op in ("rename", "stop"):
        if v.op == "rename":
            back = {d: s for s, d in v.attrs[0]}
            mapping = {view: back.get(e, e) for view, e in mapping.items()}
        v = v.operands[0]
    return v, mapping


def scaled(x: Value) -> tuple[Value, np.ndarray]:
    """x as (complex base, per-part sign): `conj(y)` = y * (1, -1) gives (y, (1, -1))."""
    sign = np.ones(2)
    while (x.op == "contract" and len(x.operands) == 2) or (
            x.op == "map" and x.attrs[0] in ("mul", "mul0")):
        a, b = x.operands
        s = vector(b)
        if s is None:
            a, s = b, vector(a)
        if s is None or set(a.edges) != set(x.edges):
            break
        sign, x = sign * s, a
    return x, sign


def selected(w: Value) -> tuple[Value, int] | None:
    """(X, k) when `w` keeps part k of the complex X and zeroes the other:
    `where([re.im = 0], X, 0)`, `where([re.im = 0], 0, X)`, `[re.im = k] * X`."""
    if w.op == "map" and w.attrs[0] == "where" and unit(w.operands[0]) == 0:
        _, x, y = w.operands
        if _is_zero(y) and RI in x.edges:
            return x, 0
        if _is_zero(x) and RI in y.edges:
            return y, 1
    # a product with the indicator selects when it is a contraction (index arithmetic)
    # or mul0 / mul00 (exactly 0 where the indicator is); a plain `mul` would make an
    # inf in the other part NaN, which cgemm would not
    if (w.op == "map" and w.attrs[0] in ("mul0", "mul00")) or (w.op == "contract" and len(w.operands) == 2):
        a, b = w.operands
        if set(w.edges) != set(a.edges) | set(b.edges):
            return None
        order = ((a, b),) if w.op == "map" and w.attrs[0] == "mul0" else ((a, b), (b, a))
        for u, x in order:
            k = unit(u)
            if k is not None:
                return x, k
    return None


def _is_zero(v: Value) -> bool:
    return v.op == "const" and v.attrs[0] == 0.0


def part(p: Value):
    """(base of X, view edge -> base edge, k, sign) when `p` is part k of a complex
    value X (seen through renames); None otherwise."""
    p, outer = peel(p)
    if p.op != "contract" or RI in p.edges:
        return None
    if len(p.operands) == 2:
        x, u = p.operands
        k = unit(u)
        if k is None:
            u, x = x, u
            k = unit(u)
        if k is None or set(x.edges) != set(p.edges) | {RI}:
            return None
    elif len(p.operands) == 1:
        sel = selected(p.operands[0])
        if sel is None or set(sel[0].edges) != set(p.edges) | {RI}:
            return None
        x, k = sel
    else:
        return None
    x, sign = scaled(x)
    base, inner = peel(x)
    if inner.get(RI) != RI:
        return None
    return base, {e: inner[outer[e]] for e in outer}, k, sign[k]


def assembly(v: Value, coef: float, out: list) -> bool:
    """Collect (k, coefficient, real value) with v = sum coef [re.im = k] value."""
    if v.op == "map" and v.attrs[0] == "where" and unit(v.operands[0]) == 0:
        _, re, im = v.operands
        if RI in re.edges or RI in im.edges:
            return False
        out += [(0, coef, re), (1, coef, im)]
        return True
    if v.op == "add":
        return all(assembly(o, coef * c, out) for c, o in zip(v.attrs[0], v.operands))
    sel = selected(v)
    if sel is not None:
        x, k = sel
        if RI in x.edges:
            return False
        out.append((k, coef, x))
        return True
    return False


def terms(v: Value, coef: float, out: list) -> None:
    """Flatten adds: v = sum coef * term."""
    if v.op == "add":
        for c, o in zip(v.attrs[0], v.operands):
            terms(o, coef * c, out)
    else:
        out.append((coef, v))


def match(v: Value, groups_of):
    """The complex product `v` is, or None: a dict with the two operands (base values
    and view edge -> base edge maps, re.im included), the GEMM groups (batch, m, n, k)
    from `groups_of(contraction)`, the conjugation of each operand and the real scale."""
    if RI not in v.edges or v.edges[-1:] == () or v.op not in ("map", "add"):
        return None
    pieces: list = []
    if not assembly(v, 1.0, pieces):
        return None
    table = np.zeros((2, 2, 2))
    key = None
    for r, c, x in pieces:
        flat: list = []
        terms(x, c, flat)
        for coef, t in flat:
            if t.op != "contract" or len(t.operands) != 2:
                return None
            pa, pb = part(t.operands[0]), part(t.operands[1])
            if pa is None or pb is None:
                return None
            this = (id(pa[0]), tuple(sorted(pa[1].items())), id(pb[0]), tuple(sorted(pb[1].items())))
            if key is None:
                key, first = this, (pa, pb, t)
            elif this != key:
                swapped = (this[2], this[3], this[0], this[1])
                if swapped != key:
                    return None
                pa, pb = pb, pa
            if set(t.edges) != set(first[2].edges):
                return None
            table[pa[2], pb[2], r] += coef * pa[3] * pb[3]
    if key is None or set(v.edges) != set(first[2].edges) | {RI}:
        return None
    alpha = table[0, 0, 0]
    if alpha == 0:
        return None
    for ca in (False, True):
        for cb in (False, True):
            want = PRODUCT.copy()
            if ca:
                want[1] *= -1
            if cb:
                want[:, 1] *= -1
            if np.array_equal(table, alpha * want):
                groups = groups_of(first[2])
                if groups is None:
                    return None
                (xa, ma, _, _), (xb, mb, _, _), _ = first
                return {"a": (xa, {**ma, RI: RI}), "b": (xb, {**mb, RI: RI}), "groups": groups,
                        "conj": (ca, cb), "alpha": float(alpha), "terms": first[2]}
    return None


class ComplexGemms:
    """The complex products of a module being fused: found before the partition
    (`find`: the fuser's `cgemms`, and the values they leave unread in `folded`), their
    operands given buffers (`materialize`), then their kernels (`kernel`)."""

    def __init__(self, fuser):   # the `tgc.lower.fuse` fuser lowering the module
        self.f = fuser

    def find(self) -> None:
        """Values that are a complex product (`match`) become one complex
        GEMM cell on their operands' interleaved pairs (cgemm/zgemm: numpy's OpenBLAS,
        or the system CBLAS's through `tgc build`'s LP64 adapter; `blas` "numpy" or
        "system", not "none"). The real products and parts they were built of are
        then computed only where something else still reads them: the values no longer
        reachable from the program's roots are dropped (`folded`), and the use counts
        are taken again without them."""
        f = self.f
        if not f.opt.cpu.complex_gemm or f.opt.cpu.blas == "none" or f.opt.dtype not in ("f32", "f64"):
            return
        for v in f.values:
            if id(v) in f.folded or id(v) in f.shifted:
                continue
            spec = match(v, f.gemm_groups)
            if spec is not None:
                f.cgemms[id(v)] = spec
        if not f.cgemms:
            return
        live: set[int] = set()
        stack = list(f.m.roots())
        while stack:
            v = stack.pop()
            if id(v) in live:
                continue
            live.add(id(v))
            spec = f.cgemms.get(id(v))
            stack += [spec["a"][0], spec["b"][0]] if spec else list(v.operands)
        for v in f.values:
            if id(v) not in live:
                f.folded.add(id(v))
                f.cgemms.pop(id(v), None)
        f.users = {id(v): set() for v in f.values}
        for v in f.values:
            if id(v) in live:
                spec = f.cgemms.get(id(v))
                for o in ([spec["a"][0], spec["b"][0]] if spec else v.operands):
                    f.users[id(o)].add(id(v))
        f._reduction.clear()
        f._cost.clear()

    def materialize(self, v: Value) -> None:
        """Give the complex product `v` and its operands (other than arguments) buffers."""
        f = self.f
        f.materialize(v)
        for base, _ in (f.cgemms[id(v)]["a"], f.cgemms[id(v)]["b"]):
            if base.op != "arg":
                f.materialize(base)

    def kernel(self, v: Value, out: str) -> GemmKernel:
        """The complex GEMM cell computing `v` into the buffer `out`."""
        f = self.f
        spec = f.cgemms[id(v)]
        a, b = (View(f.mat[id(base)], tuple(sorted(mapping.items()))) for base, mapping in (spec["a"], spec["b"]))
        return GemmKernel(out, a, b, *spec["groups"], cplx=spec["conj"], alpha=spec["alpha"],
                          note="complex product")
