"""pieces: a kernel that adds up pieces masked to disjoint ranges of one loop variable
is written as one kernel per piece, each over its own range.

`Lowered` (after `alias`) -> `Lowered`, before `group`. A masked stream
(`tgc.opt.stream`, `stream_skip`) runs as several loops, one per run of its row blocks,
and the rows each run computes are put back together as the sum of the runs' stacked
results, each placed at its rows (`_exact_sum` of disjoint pieces). Lowered, that is one
kernel over every row whose body adds one masked load per run:

    loop %r0[hd, t] = add[1.0, ...](mask[t - 256 < 0](%y13[hd, t - 256*floor((t) / 256), ..]),
                                     mask[t - 256 >= 0, t - 512 < 0](%y22[..]), ...)
          for t < 8192, hd < 64

Every element tests every run's mask (a branch each: a guarded load), adds the zeros of
the others (in f64: an f32 sum of three terms or more is widened, `lowered.wide_sum`),
and floor-divides its indices: causal attention at t = 8192 in 32 runs spent 52 ms of
1.76 s in its two such kernels (4 heads x batch 2, one thread; 4.6 ms as a plain copy).
This stage writes it as one kernel per piece over the piece's range, `t = t' + 256`,
`t' < 256`:

    loop %r0[hd, t.40 + 256] = add(%y22[hd, t.40, 0], 0.0)
          for t.40 < 256, hd < 64

its floor divisions folded where the range fixes them (`floor(t' / 256)` is 0 for
`t' < 256`): a vectorized copy.

Rewritten: a plain loop kernel (no reduction, scatter, epilogue or bounds) whose body
adds, with coefficients 1, at least two masked terms, every mask a conjunction of
bounds on one loop variable `v` (the same for all: `v + c op 0`, `c` an integer), `v`
indexing one edge of the output by itself, and the ranges the masks admit disjoint and
covering `v`'s whole loop (an integer size): each element of the output is then written
by exactly one piece kernel.

Exact: at each element the masked sum adds one term's value to zeros (exactly 0 in
every term it does not admit); `x + 0.0` is that value with a -0 turned into +0, which
is what each piece computes (`add(x, 0.0)`, in the program's float type): the same bits
(a NaN stays a NaN). The floors folded are constants over the piece's range. Under
--fp-strict nothing changes (no stream builds such sums there; the stage leaves the
program as it was).

The pieces write one buffer between them; `tgc.lower.verify` accepts a loop shorter than
the output edge it writes where several loop kernels write that buffer (the pieces).

Terminates: one pass over each program's kernels (and each loop's step); each kernel is
rewritten at most once, into kernels with no masked sum.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tgc.ir.passes import Pass
from tgc.ir.sizes import size_op
from tgc.lower.lowered import (Add, Const, ExprVisitor, FloorDiv, IdLoad, Ix, Load, LoopKernel, Lowered, Mask,
                               StepLoop)
from tgc.options import Options


@dataclass(frozen=True)
class Pieces(Pass[Lowered, Lowered]):
    """Write a sum of pieces masked to disjoint ranges as one kernel per piece."""

    name = "pieces"
    takes = gives = "lowered"

    def run(self, low: Lowered, options: Options) -> Lowered:
        out = low.staged("pieces")
        if not options.fp_strict:
            _pieces(out)
        return out


def _pieces(low: Lowered) -> None:
    kernels = []
    for k in low.kernels:
        if isinstance(k, StepLoop):
            step = k.step.staged("pieces")
            _pieces(step)
            k = replace(k, step=step)
        new = split(low, k) if isinstance(k, LoopKernel) else None
        kernels.extend(new or [k])
    low.kernels = kernels


def ranges(k: LoopKernel) -> tuple[str, list[tuple[int, int, object]]] | None:
    """(v, [(lo, hi, term)]) sorted by lo: the masked sum `k` computes, as the range of
    loop variable `v` each term's mask admits and the masked expression; None where `k`
    is no such sum (module docstring), its ranges overlap or leave part of `v` out."""
    if k.reduce or k.red or k.scatter or k.epilogue is not None or k.bounds:
        return None
    e = k.body
    if not isinstance(e, Add) or len(e.args) < 2 or any(c != 1 for c in e.coefs):
        return None
    var, out = None, []
    for term in e.args:
        if not isinstance(term, Mask) or not term.conds:
            return None
        lo, hi = None, None
        for c in term.conds:
            ix = c.ix
            if len(ix.terms) != 1 or not isinstance(ix.terms[0][0], str) or not isinstance(ix.const, int):
                return None
            v, coef = ix.terms[0]
            if coef not in (1, -1) or (var is not None and v != var):
                return None
            var = v
            op, const = c.op, ix.const
            if coef == -1:   # -v + c op 0: v op' c
                op = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}.get(op)
                if op is None:
                    return None
                const = -const
            # v + const op 0
            if op == ">=":
                lo = max(lo if lo is not None else -const, -const)
            elif op == ">":
                lo = max(lo if lo is not None else 1 - const, 1 - const)
            elif op == "<":
                hi = min(hi if hi is not None else -const, -const)
            elif op == "<=":
                hi = min(hi if hi is not None else 1 - const, 1 - const)
            else:
                return None
        out.append((lo, hi, term.arg))
    n = k.sizes.get(var)
    if var is None or var in k.red or not isinstance(n, int):
        return None
    if [e for e, ix in k.index if var in ix.vars()] != [e for e, ix in k.index if ix.as_var() == var] or \
            len([1 for _, ix in k.index if ix.as_var() == var]) != 1:
        return None   # v indexes one edge of the output by itself, and no other
    pieces = sorted(((max(0, lo if lo is not None else 0), min(n, hi if hi is not None else n), arg)
                     for lo, hi, arg in out), key=lambda p: p[0])
    at = 0
    for lo, hi, _ in pieces:
        if lo != at or hi <= lo:
            return None   # a gap, an overlap or an empty piece
        at = hi
    return (var, pieces) if at == n else None


def split(low: Lowered, k: LoopKernel) -> list[LoopKernel] | None:
    """One kernel per piece of `k` (`ranges`), or None."""
    found = ranges(k)
    if found is None:
        return None
    v, pieces = found
    taken = set(k.loops) | set(low.module.dims) | set(low.edges)
    out = []
    for lo, hi, arg in pieces:
        w = _fresh(v, taken)
        taken.add(w)
        sizes = {w: hi - lo, **{u: s for u, s in k.sizes.items() if u != v}}
        shift = _Shift({v: Ix.var(w).plus_const(lo)}, sizes)
        index = tuple((e, shift.ix(ix)) for e, ix in k.index)
        body = Add((1.0, 1.0), (shift.expr(arg), Const(0.0)))
        out.append(LoopKernel(k.out, index, tuple(w if u == v else u for u in k.loops), sizes, body,
                              note=k.note or f"piece {lo}..{hi}"))
    return out


def _fresh(v: str, taken: set[str]) -> str:
    n = 1
    while f"{v}.{n}" in taken:
        n += 1
    return f"{v}.{n}"


class _Shift(ExprVisitor):
    """An expression with loop variables substituted (`mapping`), each floor division
    whose value the loop ranges (`sizes`) fix replaced by that constant."""

    def __init__(self, mapping: dict[str, Ix], sizes: dict) -> None:
        self.mapping, self.sizes = mapping, sizes

    def ix(self, ix: Ix) -> Ix:
        return fold_floors(ix.subst(self.mapping), self.sizes)

    def _index(self, index):
        return tuple((e, self.ix(i)) for e, i in index)

    def expr_load(self, e: Load) -> Load:
        return Load(e.buf, self._index(e.index))

    def expr_mask(self, e: Mask) -> Mask:
        return Mask(tuple(replace(c, ix=self.ix(c.ix)) for c in e.conds), self.expr(e.arg))

    def expr_add(self, e):
        return replace(e, args=tuple(self.expr(a) for a in e.args))

    expr_mul = expr_map = expr_add

    def expr_rand(self, e):
        return replace(e, key=self.ix(e.key), counter=self.ix(e.counter),
                       folds=tuple(self.ix(n) if isinstance(n, Ix) else n for n in e.folds))

    def expr_const(self, e):
        return e

    expr_size_of = expr_acc = atom_var = atom_id_load = atom_floor_div = expr_const


assert not _Shift.missing(), _Shift.missing()


def fold_floors(ix: Ix, sizes: dict) -> Ix:
    """`ix` with each `floor((w + c) / d)` (w a loop variable of integer size n, c and d
    integers, d > 0) that is one constant for 0 <= w < n replaced by it; index loads'
    indices folded too."""
    terms, const = [], ix.const
    for a, coef in ix.terms:
        if isinstance(a, FloorDiv):
            num = fold_floors(a.num, sizes)
            value = _constant_floor(num, a.den, sizes)
            if value is not None and isinstance(coef, int):
                const = size_op("+", const, coef * value)
                continue
            a = FloorDiv(num, a.den)
        elif isinstance(a, IdLoad):
            a = IdLoad(a.buf, tuple((e, fold_floors(i, sizes)) for e, i in a.index))
        terms.append((a, coef))
    return Ix.make(terms, const)


def _constant_floor(num: Ix, den, sizes: dict) -> int | None:
    if not isinstance(den, int) or den <= 0 or not isinstance(num.const, int):
        return None
    if not num.terms:
        return num.const // den
    if len(num.terms) != 1:
        return None
    w, coef = num.terms[0]
    n = sizes.get(w) if isinstance(w, str) else None
    if coef != 1 or not isinstance(n, int) or n < 1:
        return None
    first, last = num.const // den, (num.const + n - 1) // den
    return first if first == last else None
