"""Masked keys a streamed step may skip (a helper of tgc.opt.stream).

What it decides. A loop that `stream` builds over blocks of an edge `t` reads a mask
(an indicator over `t` and one other edge `s`). A mask admits (`where([s <= t], scores,
-1e9)`, a window `[t - w <= s <= t]`: the keys where its relation holds) or rejects
(`scores - 1e9 * [s > t]`, examples/gpt2.tg's form: the keys where its relation does
not hold; for a chain of links, where one of its links fails, a union whose hull is the
join of those links' negations' hulls). For a run of consecutive blocks, the keys `s` outside the hull `[lo, hi)` of
what the masks admit for any of the run's rows are masked, by every mask, for every row
of the run (with several masks the hull joins theirs), or, where each mask masks on its
own (a window written as two fills, `- 1e9 * [s > t] - 1e9 * [s < t - w]`, or as two
nested wheres), by one of the masks at least (the hull is the meet of theirs).
`groups` splits the blocks into
`options.stream_mask_groups` runs and gives each its hull; `stream` then builds one loop
per run whose step is the step with `s` replaced by an edge of the hull's size at offset
`lo` (`resized`): its scores, weights and their cotangents, its reductions over `s` and
the carries that keep `s` (dk, dv) touch only the hull. A run with a row that the masks
admit nowhere (their hulls do not meet) keeps the whole of `s` (that row's weights are
the unstreamed ones over every key). `stream` tries the roles of the masks, all
admitting first, each with the join and (several masks) the meet, and takes the plan
over the fewest keys that `exact` shows exact (the first such); a meet is shown once
per mask, that mask masked and the others' indicators 0 or 1 (Bit, below): a key the
meet skips is masked by one mask at least, whichever it is.

Why it is exact. `exact` checks the step, value by value, with what each value is at
the skipped entries (masked for every row of the run):
- Z, exactly 0: an admitting mask; a product (contract, mul0) with a Z factor (the other
  factors finite); a mul00 (0 where either factor is 0) with a Z factor; a sum of Z
  values; `where(c, a, b)` with c Z and b Z or 0 (with c One: a Z or 0); exp of an L
  value (it underflows to 0);
- One, exactly 1: a rejecting mask; a sum whose terms are Z values, One values and
  constants, adding up to exactly 1 (`1 - [band]`, the band admitting: its complement),
  each term 0 or an integer coefficient below 2^24 times such an integer (then exact in
  f32 and f64); such a sum adding up to exactly 0 is Z;
- Bit, 0 or 1: another mask's indicator, when a meet is checked for one mask;
- L(b), at most b <= -1e8: `where(c, a, fill)` with c Z and fill <= -1e8 (-1e9,
  -inf), or `where(c, fill, b)` with c One, or with c Bit both branches L (b the
  larger; both Z: Z); a sum whose terms are Z values (0), One values
  with coefficient c (c), Bit values with coefficient c (at most max(c, 0)), L values
  with coefficients >= 1, values without `s` (row
  statistics, counted at 1e7 each, the assumption below) and, when a One value has a
  coefficient <= -1e8 (the fill subtracted), values with `s` of no known state (the
  scores it masks, counted at 1e7 each too): b is the sum of those bounds.
Every reduction over `s` must then ignore the skipped entries exactly: a sum
(contraction) needs a Z factor (adding +0 changes nothing); a max or logsumexp needs
an L operand: each row of a run has an admitted key, whose score is above -1e7, so the
max is the same, and exp(b - max) is exactly 0 in f32 and f64 (below -100); a carry
that keeps `s` must be a sum whose step part is Z (the skipped part of dk, dv is 0:
the resized step adds its part at the hull's keys only, the carry staying over all of
`s`, and each run's loop starts from the last one's carries). A step that
reduces over `s` anything else, stacks a value with `s`, reads `size(s)`, renames `s`
or holds an op not listed keeps the whole of `s` (a rename to `s`, the keys computed in
the step, is read at the hull). A subtracted fill of small magnitude (`- 10 * [s > t]`)
gives no L value: the keys keep their weight, and none is skipped.

Assumption (stated, not checked): the admitted scores, the row statistics and the scores
a subtracted fill masks lie within +-1e7, which a fill of -1e9 presupposes (in the
where form a score below it would be masked out too; in the subtractive form a masked
score near 1e9 would keep its weight unstreamed).

Terminates: one pass over the step's values; the groups are a partition of the blocks.
"""
from __future__ import annotations

import numpy as np

from tgc.ir import values as V
from tgc.ir.affine import Affine, Relation
from tgc.ir.values import Value, rebuild_same, topo_order
from tgc.opt.relations import substitute

LOW = -1e8        # an L value is at most this at skipped entries
ORDINARY = 1e7    # the assumed bound on scores and row statistics


def admitted(rel, t: str, s: str, nt: int, ns: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row t: the hull [lo, hi) of the keys s that `rel` admits (lo >= hi: none)."""
    rows = np.arange(nt, dtype=np.int64)
    lo, hi = np.zeros(nt, np.int64), np.full(nt, ns, np.int64)
    for i, op in enumerate(rel.ops):
        d = rel.exprs[i].plus(rel.exprs[i + 1], -1)   # d op 0, d = a*t + b*s + c
        a, b, c = d.coef(t), d.coef(s), d.const
        if not all(isinstance(x, int) for x in (a, b, c)):
            continue   # a symbolic bound: the hull stays the range
        rest = a * rows + c
        if b == 0:
            ok = {"<": rest < 0, "<=": rest <= 0, ">": rest > 0, ">=": rest >= 0, "=": rest == 0,
                  "!=": rest != 0}[op]
            hi = np.where(ok, hi, lo)
            continue
        if op == "!=":
            continue   # all but one key: the hull is the range
        if b < 0:
            rest, b, op = -rest, -b, {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "=": "="}[op]
        # b*s + rest op 0: s op -rest/b
        if op in ("<", "<="):
            bound = np.floor_divide(-rest - (1 if op == "<" else 0), b)   # largest admitted s
            hi = np.minimum(hi, bound + 1)
        elif op in (">", ">="):
            bound = -np.floor_divide(rest - (1 if op == ">" else 0), b)   # smallest admitted s
            lo = np.maximum(lo, bound)
        else:   # "="
            ok = (-rest) % b == 0
            at = np.floor_divide(-rest, b)
            lo, hi = np.where(ok, np.maximum(lo, at), hi), np.where(ok, np.minimum(hi, at + 1), lo)
    return np.clip(lo, 0, ns), np.clip(hi, 0, ns)


MAX_ROWS = 1 << 22   # rows `groups` analyses (a few int64 arrays of them: 32 MiB each at most)


def complement(rel: Relation) -> list[Relation]:
    """Single-link relations whose union holds exactly where `rel` does not: one per link
    of its chain, that link with its op negated (`a <= b <= c` fails where `a > b` or
    `b > c`)."""
    neg = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "=": "!=", "!=": "="}
    return [Relation((rel.exprs[i], rel.exprs[i + 1]), (neg[op],)) for i, op in enumerate(rel.ops)]


def hull(rel, t: str, s: str, nt: int, ns: int, reject: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per row t: the hull [lo, hi) of the keys s that a mask over `rel` admits: where
    `rel` holds, or (`reject`) where it does not, the join of the hulls of its
    complement's links (the hull of their union)."""
    if not reject:
        return admitted(rel, t, s, nt, ns)
    lo, hi = np.full(nt, ns, np.int64), np.zeros(nt, np.int64)
    for link in complement(rel):
        a, b = admitted(link, t, s, nt, ns)
        keep = a < b   # an empty hull joins nothing
        lo, hi = np.where(keep, np.minimum(lo, a), lo), np.where(keep, np.maximum(hi, b), hi)
    return lo, hi


def groups(masks, s: str, nt: int, ns: int, block: int, count: int, meet: bool = False):
    """[(first block, end block, lo, hi)] for `count` runs of the blocks of the streamed
    edge (as even as can be), each run's keys the hull of what the masks ((relation, its
    name of the streamed edge, whether it rejects)) admit for its rows; None when no run
    skips any key. An admitting mask admits where its relation holds, a rejecting one
    where it does not (`hull`). A key outside a row's hull is outside every
    mask's hull (each mask's hull is joined), so that each mask is in its masked state
    there; with `meet`, a row's hull is the meet of the masks' hulls, and a key outside
    it is outside some mask's hull: that mask is in its masked state there (`exact`,
    asked once per mask, shows that one masked mask suffices); a row whose masks' hulls
    do not meet admits no key. More than `MAX_ROWS` rows are not analysed (None: the
    arrays per row would not fit; such a stream runs over every key)."""
    if nt > MAX_ROWS:
        return None
    lo, hi = np.full(nt, ns, np.int64), np.zeros(nt, np.int64)        # the join
    meet_lo, meet_hi = np.zeros(nt, np.int64), np.full(nt, ns, np.int64)
    for rel, t, reject in masks:
        a, b = hull(rel, t, s, nt, ns, reject)
        lo, hi = np.minimum(lo, a), np.maximum(hi, b)
        meet_lo, meet_hi = np.maximum(meet_lo, a), np.minimum(meet_hi, b)
    nb = nt // block
    count = max(1, min(count, nb))
    out = []
    for g in range(count):
        b0, b1 = g * nb // count, (g + 1) * nb // count
        rows = slice(b0 * block, b1 * block)
        if np.any(meet_lo[rows] >= meet_hi[rows]):
            out.append((b0, b1, 0, ns))   # a row admits no key: its weights are uniform over all of s
        elif meet:
            out.append((b0, b1, int(meet_lo[rows].min()), int(meet_hi[rows].max())))
        else:
            out.append((b0, b1, int(lo[rows].min()), int(hi[rows].max())))
    return out if any(h - l < ns for _, _, l, h in out) else None


def known_value(v: Value, state) -> float | None:
    """The value `v` has at every skipped entry when it is one number (a Z or One value,
    a constant), else None."""
    if state in ("Z", "One"):
        return 0.0 if state == "Z" else 1.0
    return float(v.attrs[0]) if v.op == "const" else None


def exact(body: V.LoopBody, s: str, masks: set[int], kinds: list[str], ones: frozenset[int] = frozenset(),
          bits: frozenset[int] = frozenset()) -> bool:
    """Whether the step `body` gives the same results with `s` restricted to a run's hull
    (`masks`: ids of its values that are an admitting mask, 0 at the skipped entries;
    `ones`: those of a rejecting mask, 1 there; `bits`: those of the other masks, 0 or 1
    there; `kinds`: the carries' combination)."""
    state: dict[int, object] = {}   # id -> "Z", "One", "Bit", ("L", bound) or None, for values with s

    def st(v: Value):
        return state.get(id(v)) if s in v.edges else "no-s"

    def picked(x: Value):   # the state of a value where selects x
        if st(x) == "Z" or (x.op == "const" and x.attrs[0] == 0):
            return "Z"
        if x.op == "const" and x.attrs[0] <= LOW:
            return ("L", x.attrs[0])
        return st(x) if isinstance(st(x), tuple) else None

    for v in topo_order(list(body.results)):
        ops = v.operands
        with_s = [o for o in ops if s in o.edges]
        if id(v) in masks:
            state[id(v)] = "Z"
            continue
        if id(v) in ones:
            state[id(v)] = "One"
            continue
        if id(v) in bits:
            state[id(v)] = "Bit"
            continue
        if v.op in ("loopvar", "const", "indicator"):
            continue
        if v.op == "size" and v.attrs[0] == s:
            return False
        if v.op == "rename" and any(a == s for a, _ in v.attrs[0]):
            return False
        if v.op == "contract":
            if with_s and s not in v.edges and not any(st(o) == "Z" for o in with_s):
                return False
            if any(st(o) == "Z" for o in with_s):
                state[id(v)] = "Z"
        elif v.op == "reduce":
            if s in v.attrs[1]:
                o = st(ops[0])
                if v.attrs[0] not in ("max", "logsumexp") or not isinstance(o, tuple):
                    return False
            elif with_s:
                state[id(v)] = None
        elif v.op == "add":
            states, coefs = [st(o) for o in ops], v.attrs[0]
            known = [known_value(o, x) for o, x in zip(ops, states)]
            # integers below 2^24 (and 0 times any finite coefficient) add exactly in f32 and f64
            whole = None not in known and all(k == 0 and np.isfinite(c) or all(float(x).is_integer() and abs(x) < 2 ** 24
                                                                             for x in (c, k))
                                              for c, k in zip(coefs, known))
            total = sum(c * k for c, k in zip(coefs, known)) if with_s and whole else None
            if with_s and all(x == "Z" for x in states):
                state[id(v)] = "Z"
            elif total is not None and total in (0, 1):   # `1 - [band]`: the mask's complement
                state[id(v)] = "Z" if total == 0 else "One"
            elif with_s:
                # a rejecting mask times a fill: the other scores count at ORDINARY each
                filled = any(x == "One" and c <= LOW for x, c in zip(states, coefs))
                bound = 0.0
                for x, c in zip(states, coefs):
                    if x == "Z":
                        continue
                    if x == "One":
                        bound += c
                    elif x == "Bit":
                        bound += max(c, 0.0)   # 0 or c: at most the larger
                    elif isinstance(x, tuple) and c >= 1:
                        bound += c * x[1]
                    elif x == "no-s" or (filled and x is None):
                        bound += abs(c) * ORDINARY
                    else:
                        bound = None
                        break
                if bound is not None and bound <= LOW:
                    state[id(v)] = ("L", bound)
        elif v.op == "map" and v.attrs[0] == "exp":
            if isinstance(st(ops[0]), tuple):
                state[id(v)] = "Z"
        elif v.op == "map" and v.attrs[0] in ("mul0", "mul00"):   # a * b, 0 where a (mul00: a or b) is 0
            if any(st(o) == "Z" for o in with_s):
                state[id(v)] = "Z"
        elif v.op == "map" and v.attrs[0] == "where":
            c, a, b = ops
            if st(c) == "Z":
                state[id(v)] = picked(b)
            elif st(c) == "One":
                state[id(v)] = picked(a)
            elif st(c) == "Bit":   # either branch: a state both have
                x, y = picked(a), picked(b)
                if x == y == "Z":
                    state[id(v)] = "Z"
                elif isinstance(x, tuple) and isinstance(y, tuple):
                    state[id(v)] = ("L", max(x[1], y[1]))
        elif v.op in ("stop", "rename"):
            state[id(v)] = st(ops[0]) if with_s else None
        elif v.op != "map":
            return False
    for j, r in enumerate(body.results):
        if s not in r.edges:
            continue
        if j >= body.carries or kinds[j] != "sum" or r.op != "add" or st(r.operands[1]) != "Z":
            return False
    return True


def resized(body: V.LoopBody, s: str, sg: str, lo: int) -> V.LoopBody | None:
    """`body` with edge `s` replaced by `sg`, index `s = sg + lo`, but for its carries: a
    carry over `s` stays over all of it, each step adding its part at the hull's keys
    (the runs then chain one carry, not one partial each); None for an op it
    cannot carry over (a rename of `s`, `size(s)`). A rename `a -> s` reads its operand at
`a = sg + lo`."""
    def edges(v: Value) -> list[str]:
        return [sg if e == s else e for e in v.edges]

    memo: dict[int, Value] = {id(p): V.loopvar(p.attrs[0], p.dtype, p.edges if k < body.carries else edges(p), p.loc)
                              for k, p in enumerate(body.params)}   # the carries keep all of s
    for v in topo_order(list(body.results)):
        ops = tuple(memo[id(o)] for o in v.operands)
        if id(v) in memo:
            continue
        if v.op == "loopvar":
            memo[id(v)] = V.loopvar(v.attrs[0], v.dtype, edges(v), v.loc)
        elif v.op == "const":
            memo[id(v)] = V.const(v.attrs[0], v.dtype, edges(v), v.loc)
        elif v.op == "indicator":
            memo[id(v)] = V.indicator(substitute(v.attrs[0], s, Affine.make({sg: 1}, lo)), v.dtype, v.loc)
        elif v.op == "contract":
            memo[id(v)] = V.contract(ops, edges(v), v.loc)
        elif v.op == "reduce":
            memo[id(v)] = V.reduce(v.attrs[0], ops[0], [sg if e == s else e for e in v.attrs[1]], v.loc)
        elif v.op == "rename" and any(b == s for _, b in v.attrs[0]):   # a -> s: a read at sg + lo
            a = next(a for a, b in v.attrs[0] if b == s)
            pairs = {x: y for x, y in v.attrs[0] if y != s}
            x = V.rename(ops[0], pairs, v.loc) if pairs else ops[0]
            at = V.indicator(Relation((Affine.make({a: 1}), Affine.make({sg: 1}, lo)), ("=",)), v.dtype)
            memo[id(v)] = V.contract([x, at], edges(v), v.loc)
        elif v.op in ("add", "map", "stop", "rename", "size"):
            if (v.op == "size" and v.attrs[0] == s) or (v.op == "rename" and any(a == s for a, _ in v.attrs[0])):
                return None
            memo[id(v)] = rebuild_same(v, ops)
        else:
            return None
    params = [memo[id(p)] for p in body.params]
    results = []
    for j, r in enumerate(body.results):
        if j < body.carries and s in r.edges:   # p + part over the hull: the part added at its keys
            p, part = r.operands
            at = V.indicator(Relation((Affine.make({s: 1}), Affine.make({sg: 1}, lo)), ("=",)), r.dtype)
            results.append(V.add([memo[id(p)], V.contract([memo[id(part)], at], r.edges)], r.attrs[0], r.loc))
        else:
            results.append(memo[id(r)])
    return V.loop_body(params, results, body.carries, body.slices)
