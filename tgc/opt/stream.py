"""stream: a large cluster of values over a long edge becomes a loop over blocks of it.

What it rewrites. A program whose largest values span two long edges, such as the
`[.., t, s]` scores, weights and their cotangents of attention with its gradients
(after autodiff and the algebra passes, forward and backward are one DAG), keeps
whole `|t| * |s|` matrices. This pass picks such a value (the seed: at least
`options.stream_min_elements` elements, every size known) and one of its edges `E`
of fixed size N, split as `E = Ec + B*Eb` (B = `options.stream_block`, or its half,
quarter, ... down to `options.stream_block_min`: the largest dividing N with N >= 2B;
where none divides N, the largest with N >= 2B, and the N mod B rows left over are one
more step after the loop, its body resized to them: `tail`), and moves into one `loop` over `Eb` the region of values that can be computed one
block of `E` at a time:

- the region grows from the seed through every value that keeps `E` and reads it
  elementwise along `E` (add, map, rename, stop, a contraction or a reduction that
  keeps `E`): down to its users, and up to its operands that are themselves large;
  a value that reads, besides the region, something computed from the region
  outside it (a reduction of the region over `E`) stays out: it needs the whole loop
  first; so does one that reads from outside an operand a member reads under another
  name of `E`. When that
  region leaves a large value outside, it is grown again with the values before the
  seed too (a row max that reads scores the seed grew up to);
- an operand read from outside is a stacked slice when it has `E` (reindexed to
  `[Eb, Ec, ..]` once, an O(its size) copy; a large one is in the region, so slices
  are small), else a loop-invariant (the `[s, hd]` keys and values); one that members
  read both ways (a layer's input: the queries by blocks, the keys computed from all
  of it, in a step recomputed from its carry) is both;
- a reduction over `E` of region values (a contraction summing `E`, a max or min
  over `E`) is a carry: each step adds its block's partial sum (or takes the max);
  the contraction over the other edges of the block is the step's own;
- a region value read outside the region is a stacked result, reindexed back to `E`
  (the `[t, hd]` outputs and per-row statistics);
- an indicator that names `E` (the causal mask `[s <= t]`) becomes, per link of its
  relation that names `E` (`c*E + w op 0`, w affine in the other edges), a small
  stacked indicator `G[Eb, r] = [c*B*Eb + r + min(w') op 0]` over a fresh edge r
  holding the range of `w' = c*Ec + w`, read in the step at `r = w' - min(w')` (an
  exact reindex; a link is negated first where that makes r grow with the other
  edges (causal: r = s - Ec + B - 1), else with Ec: a step's rows run over the keys
  innermost and read G forward, which LLVM vectorizes, a row max included; read
  backwards, that max ran scalar, 4x slower): the step sees its block's mask without
  an `|E| * |s|` matrix.

- a masked stream skips keys (tgc.opt.stream_skip): when the mask's hull of admitted
  keys `s` for a run of blocks is smaller than `s` (causal: the keys up to the run's
  last row; a window: those within it), the blocks run as `options.stream_mask_groups`
  loops, one per run, each step over the run's hull only (`s` resized to it, the
  invariants read at its offset); the carries over `s` are padded back with zeros and
  added, the stacked results placed at their blocks. Causal attention then does about
  (n + 1) / 2n of the work over n runs. A run with a row that sees no key keeps every
  key, as does a step whose values over `s` the module cannot show to be exactly 0 (or
  exactly too low to count in a max or logsumexp) at the skipped keys. A mask may admit
  (`where([s <= t], scores, -1e9)`) or reject (`scores - 1e9 * [s > t]`: the keys where
  its relation holds are the masked ones; for a chain of links, those where all hold);
  the roles are tried all admitting first, the plan over the fewest keys taken. A band's
  complement `1 - [t - w <= s <= t]` (the band admitting) is 1 at the keys the band
  masks, which the check follows. With several masks a run skips the keys every mask
  masks, or, where each masks on its own (`- 1e9 * [s > t] - 1e9 * [s < t - w]`), the
  keys one of them masks.

- a step's matrices within a cache budget: where a step's `[.., B, s]` matrices (B
  times |s| times the seed's other edges) have more than `options.stream_step_elements`
  elements, the block is halved once where that brings them within it (`cache_block`);
  else the region along a short edge `h` of the seed (batch, heads: a map over it, no
  reduction over `h` but the sums of a loss, no indicator naming it, holding the stream's
  region, with the values before the seed where the stream's region took them) first moves
  into a loop over `h`, one index a step (`map_loop`: over `h` itself where every
  operand and result names it so, else operands renamed to the loop's edge, results
  renamed back), and the step streams as a program of its own under the thresholds
  divided by |h| (`partition`), looping over the next short edge first while still
  over: where one index of every short edge a step fits the budget, and also where it
  does not (t = 8192: one head's [256, s] matrices are 8 MiB each), so that a step's
  matrices are one sequence's head's whatever the batch and heads: the peak is that of
  the one-head program (not where such steps would run over key blocks under the
  stream's own rows, below). The body's new edges keep the place `new_edge` gave them
  (tgc.opt.rewrite.map_bodies), so a head's step is laid out as the flat stream's
  steps are, and computes the same bits. A sum over `h` of the region's values (a
  scalar loss `sum(o * o)` over the batch: a carry, which would chain the steps) is
  split first (`split_sums`): the sum keeping `h` in the step, a stacked result of |h|
  partials per element, then the sum over `h` after the loop (cross-attention with such
  a loss kept its flat stream's [batch, head, 256, s] steps, 93 MB: issue 32 item 6).

- where the steps' matrices are over the budget even so and `options.stream_key_block`
  is set, the block is `options.stream_key_rows` (where it divides the edge twice): the
  steps then run over blocks of the keys (tgc.opt.stream_keys), tiles of rows by keys;
  the loops over the short edges come first even where one index of them does not fit
  the budget: a step of one sequence's head reads its blocks of the keys and writes
  dk, dv in place (tgc.lower.steps, `Bind.split`).

The edge `E` is chosen among the seed's: one whose region leaves no large value
outside as a stacked result (the key edge of attention does: the weights need the
row max first, a reduction over it; the query edge does not: every reduction over
`s` lies inside one step, and dk, dv are sums over `t`, carries), the longest first.
The step then holds `[.., B, s]` blocks: the peak is O(B * |s|) per head instead of
O(|t| * |s|), and the probabilities are computed block by block, forward and backward
alike, from the inputs of the region.

Exact? Every value of a step is the op the program had, on the same elements (a loop
over a short edge reads and writes its slices by renaming: the same values); only
the sums over `E` (and the max over `E`, which is exact) are taken blockwise and then
added across blocks (and across the runs of a masked stream, and a loss's sum over the
batch or heads across a loop's steps): a reassociation of those
sums (docs/optimization.md's contract allows it; under `--fp-strict` the pass is not in
the pipeline). The reindexing by indicators selects exact values. The keys a run skips
are masked for all its rows, and each of its rows sees a key: their weights are
exactly 0 (exp of a score of -1e9 less the row max underflows in f32 and f64; of -inf
is 0), so the sums over them add +0 and the max and logsumexp are unchanged, given
admitted scores within +-1e7, and for a subtracted fill the masked scores too
(stream_skip's docstring states the check and the assumption); fully masked rows keep
every key and give the unstreamed weights.

When. A seed streams from `stream_min_elements`, or from `stream_min_elements_masked`
(smaller) when its masks let some run skip keys: the skipped work pays for the loop.

A target that fuses the chain. With `options.stream_fused_edge` > 0 (the CUDA backends'
options: their flash stage runs a softmax-then-contract chain as fused kernels with no
`[t, s]` buffer), a cluster with that chain's shape (`fused_chain`: contracted and value
edges of at most that size) is left whole: its seeds are skipped, other clusters stream.
Whether the target then fuses it is the backend's to say; `tgc.pipeline.lower` keeps
the streamed program where the kept one's workspace is larger.

Cost: the stacked mask indicator has (N/B) * (|r|) elements, |r| about |s| + B: O(|t| |s| / B),
1 MB at t = s = 8192 in f32 with B = 256, and growing quadratically beyond.

Loops. The steps of the program's loops stream as programs of their own (attention
inside a `repeat` over layers), under the same thresholds, at the sizes the step has.
A reverse loop (a gradient's) first computes again in its step the large values it
would read stacked from its forward loop, where its step then streams
(tgc.opt.stream_loops): both steps then hold blocks, not `[t, s]` matrices.

Keys. Where `options.stream_key_block` is set, a step (of this pass's loops, or any
loop's) whose scores over the keys still exceed `stream_step_elements` computes its
values over the keys in loops over blocks of them, an online softmax then, for a
backward, the gradients (tgc.opt.stream_keys, run after this pass).

Terminates: recompute_residuals is one pass over the loops; then each round moves at
least its seed (a large add, map, contraction, ... of the top level) into a loop body,
which the pass never looks inside, and adds to the top level only values that are no
seeds (a loop, indicators, constants) or small ones (slices and stacked results are
checked small); a seed with no valid edge is skipped. So each round leaves one large
value fewer to try. The runs of a masked stream are a fixed partition of the blocks
(one pass over the step's values per role of the masks decides the skip). A loop over
a short edge moves the seed into its step, which streams once, as a program whose seed
has one edge fewer of size > 1 (so the loops nest at most as deep as the seed has
edges).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from tgc.ir import values as V
from tgc.ir.affine import Affine, Relation
from tgc.ir.dtypes import LOW_FLOATS
from tgc.ir.module import Module
from tgc.ir.passes import Pass
from tgc.ir.values import Value, rebuild_same
from tgc.opt import stream_skip
from tgc.opt.relations import substitute
from tgc.opt.stream_keys import stream_key_bodies
from tgc.opt.stream_loops import recompute_residuals
from tgc.options import Options

# ops a value may have to be computed one block of E at a time (when it keeps E)
_ELEMENTWISE = ("add", "map", "contract", "reduce", "rename", "stop")


_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "=": "=", "!=": "!="}   # a op b <=> -a FLIP[op] -b


def _numel(v: Value, sizes: dict) -> int:
    """How many elements `v` has (`sizes`: every edge's, symbolic ones estimated)."""
    n = 1
    for e in v.edges:
        n *= sizes[e]
    return n


def _along(v: Value, edge: str) -> bool:
    """Whether `v` keeps `edge` and reads its operands at one index along it."""
    return v.op in _ELEMENTWISE and edge in v.edges


def _down(v: Value, edge: str) -> str:
    """The name in `v` of its operands' edge `edge` (a rename may change it)."""
    return dict(v.attrs[0]).get(edge, edge) if v.op == "rename" else edge


def _up(v: Value, edge: str) -> str:
    """The name in `v`'s operands of its edge `edge`."""
    return {b: a for a, b in v.attrs[0]}.get(edge, edge) if v.op == "rename" else edge


@dataclass
class _Region:
    edge: dict[int, str]          # id(value) -> its name of the streamed edge (members, leaves that have it, carries)
    members: list[Value]          # operands first
    carries: list[Value]          # reductions over the edge of members: sums and max/min
    stacked: list[Value]          # members read outside the region
    slices: list[Value]           # operands from outside with the edge
    invariants: list[Value]       # operands from outside without it
    masks: list[Value]            # indicators that name it


def _carry_kind(v: Value, edge: str) -> str | None:
    """How a reduction of region values over `edge` combines across blocks."""
    if v.op == "contract" and edge not in v.edges:
        return "sum"
    if v.op == "reduce" and edge in v.attrs[1] and v.attrs[0] in ("max", "min"):
        return v.attrs[0]
    return None


def _region(order: list[Value], roots: list[Value], seed: Value, edge: str, large,
            closure: bool = False) -> _Region | None:
    """The values computed in a loop over blocks of `edge` around `seed`, or None when
    a large value (`large(v)`) would be left outside, as an operand or a stacked result.
    `closure`: the values before the seed that read the region may join it too."""
    se: dict[int, str] = {}       # members: their name of the edge
    pos = {id(v): i for i, v in enumerate(order)}

    def grow_up(v: Value, e: str) -> None:   # v and its large operands along the edge, and theirs
        stack = [(v, e)]
        while stack:
            v, e = stack.pop()
            if id(v) in se:
                continue
            se[id(v)] = e
            eo = _up(v, e)
            for o in v.operands:
                if id(o) not in se and _along(o, eo) and large(o):
                    stack.append((o, eo))

    users: dict[int, list[Value]] = {}
    for v in order:
        for o in v.operands:
            users.setdefault(id(o), []).append(v)

    def clash(v: Value, eo: str, ups: list[Value]) -> bool:   # v reads from outside what a member reads
        for o in v.operands:                                      # under another name of the edge
            if id(o) in se or any(o is u for u in ups) or o.op in ("const", "size"):
                continue
            name = eo if eo in o.edges else None
            for u in users.get(id(o), ()):
                if id(u) in se:
                    theirs = _up(u, se[id(u)])
                    if (theirs if theirs in o.edges else None) != name:
                        return True
        return False

    grow_up(seed, edge)
    # down, in order: a value along the edge that reads the region and nothing computed from it,
    # and reads nothing from outside that a member reads under another name of the edge (an
    # operand is a slice or an invariant, not both);
    # with `closure`, again from the region's first value until no value joins (a value
    # before the seed that reads what growing up added: the row max of scores a later
    # seed reads them through)
    start = pos[id(seed)] + 1
    while True:
        tainted: set[int] = set()   # outside the region, computed from it
        below: dict[int, bool] = {}   # id -> whether it or a value it is computed from is tainted

        def from_tainted(u: Value) -> bool:
            """Whether `u` or a value beneath it is tainted: asked for the operands of the
            value being visited, whose values beneath all lie before it in `order` and
            were visited already (tainted or not for good in this pass), so the answers
            are kept (one walk per pass; a walk per operand, `topo_order`, was quadratic:
            18 of 55 s compiling attention at t = 8192 in 32 runs)."""
            stack = [u]
            while stack:
                x = stack[-1]
                if id(x) in below:
                    stack.pop()
                    continue
                todo = [o for o in x.operands if id(o) not in below]
                if todo:
                    stack.extend(todo)
                    continue
                below[id(x)] = id(x) in tainted or any(below[id(o)] for o in x.operands)
                stack.pop()
            return below[id(u)]

        size = len(se)
        for v in order[start:]:
            if id(v) in se:
                continue
            reads = [o for o in v.operands if id(o) in se]
            dirty = any(id(o) in tainted for o in v.operands)
            names = {_down(v, se[id(o)]) for o in reads}
            if reads and not dirty and len(names) == 1 and _along(v, next(iter(names))):
                e = names.pop()
                eo = _up(v, e)
                ups = [o for o in v.operands if id(o) not in se and _along(o, eo) and large(o)]
                if not any(from_tainted(u) for u in ups) \
                        and not clash(v, eo, ups):
                    for u in ups:   # large siblings (dP = dy . v beside P) are computed in the step too
                        grow_up(u, eo)
                    grow_up(v, e)
                    continue
            if reads or dirty:
                tainted.add(id(v))
        if not closure or len(se) == size:
            break
        start = min(pos[i] for i in se)
    members = [v for v in order if id(v) in se]
    for v in members:   # a member must not read a value computed from the region
        if any(id(o) in tainted for o in v.operands):
            return None
    carries, stacked, outside = [], [], {}
    leaf: dict[int, set[str | None]] = {}   # the names of the edge each is read with (None: whole)
    reduced: dict[int, str] = {}   # carries: the name of the edge they reduce

    def read(v: Value, e: str) -> bool:   # v's operands from outside, with their name of the edge
        for o in v.operands:
            if id(o) not in se:
                names = leaf.setdefault(id(o), set()) | {e if e in o.edges else None}
                if len(names - {None}) > 1:
                    return False
                leaf[id(o)] = names
                outside[id(o)] = o
        return True

    for v in order:
        if id(v) in se or not any(id(o) in se for o in v.operands):
            continue
        names = {se[id(o)] for o in v.operands if id(o) in se}
        kind = _carry_kind(v, next(iter(names))) if len(names) == 1 and v.op != "rename" else None
        if kind is not None and not any(id(o) in tainted for o in v.operands) and read(v, next(iter(names))):
            carries.append(v)
            reduced[id(v)] = names.pop()
        else:
            stacked += [o for o in v.operands if id(o) in se]
    stacked += [v for v in roots if id(v) in se]
    stacked = list({id(o): o for o in stacked}.values())
    if any(large(o) for o in stacked):
        return None
    for v in members:
        if not read(v, _up(v, se[id(v)])):
            return None
    slices, invariants, masks = [], [], []
    for o in sorted(outside.values(), key=lambda x: pos[id(x)]):
        sliced = next((n for n in leaf[id(o)] if n is not None), None)
        if sliced is not None:
            se[id(o)] = sliced
        if o.op in ("const", "size") or (o.op == "indicator" and sliced is None):
            continue
        if o.op == "indicator":
            if None in leaf[id(o)]:
                return None   # a mask read whole besides
            masks.append(o)
            continue
        if sliced is not None:   # read by blocks (and, by members that do not keep the edge, whole too)
            slices.append(o)
        if None in leaf[id(o)]:
            invariants.append(o)
    if any(large(x) for x in slices + invariants):
        return None   # a large operand read whole, or copied as blocks: nothing gained
    return _Region({**se, **reduced}, members, carries, stacked, slices, invariants, masks)


def _summed(v: Value) -> set[str]:
    """The edges a contraction sums (its operands' edges it does not keep)."""
    return {e for o in v.operands for e in o.edges} - set(v.edges)


def fused_chain(r: _Region, sizes: dict, dtype: str, most: int) -> bool:
    """Whether the cluster `r` is a softmax-then-contract chain as a fusing target (the
    CUDA backends' flash stage, tgc.backends.cuda.flash) runs it whole: a `logsumexp`
    over the keys `s` of the cluster's values; scores, a contraction of two operands
    from outside the cluster over one edge `d` (`sum[d] q * k`, whatever names its rows
    and keys have there: a rename may follow); weights `exp(x - l)` (`l` that logsumexp,
    its coefficient -1, as the softmax makes them) over `s` contracted
    with an operand from outside (indicators beside it: a head split by a reindex) over
    `s` and edges of the weights only (`y = sum[s] P * v`), that operand having one edge
    `e` of its own; `d` and `e` numbers up to `most` (`Options.stream_fused_edge`); every value and operand of
    the cluster of the program's float type `dtype` (no autocast operands). The derived
    backward (dP, dS, the row sums, dq, dk, dv) is in the same cluster, and the same
    stage fuses it."""
    inside = {id(v) for v in r.members}
    if any(v.dtype != dtype for v in r.members + r.slices + r.invariants):
        return False
    lses = {id(v): v.attrs[1][0] for v in r.members
            if v.op == "reduce" and v.attrs[0] == "logsumexp" and len(v.attrs[1]) == 1}
    keys = set(lses.values())

    def normalized(x: Value) -> bool:   # x - l, l a logsumexp of the cluster over the keys
        return x.op == "add" and any(id(o) in lses and c == -1.0 for o, c in zip(x.operands, x.attrs[0]))

    def small(e: str) -> bool:
        n = sizes.get(e)
        return isinstance(n, int) and n <= most

    def loads(v: Value) -> list[Value]:   # a contraction's operands but its indicators
        return [o for o in v.operands if o.op != "indicator"]

    scores = any(v.op == "contract" and len(loads(v)) == 2 and all(id(o) not in inside for o in loads(v))
                 and len(_summed(v)) == 1 and all(small(e) for e in _summed(v)) for v in r.members)
    weights = {id(v): v for v in r.members if v.op == "map" and v.attrs[0] == "exp" and keys & set(v.edges)
               and normalized(v.operands[0])}
    values = False
    for v in r.members + r.carries:
        ps = [o for o in loads(v) if id(o) in weights] if v.op == "contract" else []
        outs = [o for o in loads(v) if id(o) not in inside] if v.op == "contract" else []
        if len(ps) == 1 and len(outs) == 1 and len(loads(v)) == 2 and _summed(v) & keys \
                and _summed(v) <= set(ps[0].edges):
            own = set(outs[0].edges) - set(ps[0].edges)
            values = values or (len(own) == 1 and all(small(e) for e in own))
    return bool(keys) and scores and values


def _split(x: Value, edge: str, ec: str, eb: str, block: int, first: int = 0) -> Value:
    """x over `edge` as [eb, ec]: x[edge = ec + block*(eb + first)] (an exact reindex)."""
    rel = Relation((Affine.make({edge: 1}), Affine.make({ec: 1, eb: block}, block * first)), ("=",))
    keep = [e for e in x.edges if e != edge] + [ec, eb]
    return V.reindexed(x, [V.indicator(rel, x.dtype)], keep)


def _exact_sum(parts: list[Value], dtype: str) -> Value:
    """The sum of `parts` that are nonzero on disjoint elements (a stacked value's pieces,
    each zero outside its blocks), of type `dtype`: exact, so a bf16/f16 value's pieces
    summed in f32 are converted back without changing a value."""
    return V.convert(V.add(parts), dtype) if dtype in LOW_FLOATS else V.add(parts)


def _join(y: Value, edge: str, ec: str, eb: str, block: int) -> Value:
    """y over [eb, ec] back over `edge`."""
    rel = Relation((Affine.make({edge: 1}), Affine.make({ec: 1, eb: block})), ("=",))
    keep = [e for e in y.edges if e not in (ec, eb)] + [edge]
    return V.reindexed(y, [V.indicator(rel, y.dtype)], keep)


class _Streamer:
    def __init__(self, module: Module, options: Options, lanes: int = 1):
        self.m = module
        self.options = options
        self.lanes = lanes   # the threads a loop over a short edge may share its steps among (`partition`)
        self.top = options.stream_block
        self.least = options.stream_block_min
        self.block = self.top             # the block of the edge being tried (`block_for`)
        self.groups = options.stream_mask_groups
        self.whole = options.stream_min_elements   # a seed this large streams; a smaller one ...
        self.big = min(self.whole, options.stream_min_elements_masked) if self.groups > 0 else self.whole
        self.sizes = {e: module.size(e) for e in module.edges}   # int, or a symbolic size
        # the sizes the thresholds read: a symbolic dim counts as 1, its smallest size: one
        # program serves every size, and at a small one the blocks' slices and stacked
        # results cost more memory than the whole matrices they replace (a [batch, t, s]
        # cluster streams when its [t, s] alone is large)
        self.est = {e: n if isinstance(n, int) else 1 for e, n in self.sizes.items()}

    def new_edge(self, base: str, n: int) -> str:
        """A fresh dim of size n and its edge, named after `base` and declared right after
        the edges of that stem (declaration order is layout's tie-break; so placed, the
        step's carry updates took about a third of the cycles they took with the block
        edges declared last, in a profile of the benchmark's attention at t = 2048)."""
        stem, k = base.split(".")[0], 1
        while f"{stem}.{k}" in self.m.edges or f"{stem}.{k}" in self.m.dims:
            k += 1
        name = f"{stem}.{k}"
        self.m.dims[name] = n
        edges = list(self.m.edges.items())
        at = max((i + 1 for i, (e, _) in enumerate(edges) if e.split(".")[0] == stem), default=len(edges))
        edges.insert(at, (name, name))
        self.m.edges.clear()
        self.m.edges.update(edges)
        self.sizes[name] = n
        self.est[name] = n
        return name

    def seeds(self, order: list[Value], skip: set[int]) -> list[Value]:
        out = [v for v in order if v.op in _ELEMENTWISE and id(v) not in skip
               and _numel(v, self.est) >= self.big]
        return sorted(out, key=lambda v: -_numel(v, self.est))

    def large(self, v: Value, seed: Value) -> bool:
        """Whether `v` is of the seed's scale: over the threshold, and more than 1/8 of the
        seed (a [t, s] bias beside the [t, s] scores is; a [t, hd] query beside them is not
        once s > 8 hd)."""
        n = _numel(v, self.est)
        return n >= self.big and 8 * n > _numel(seed, self.est)

    def block_for(self, n: int) -> int | None:
        """The block for an edge of size n: the largest of `stream_block`, its half, its
        quarter, ... down to `stream_block_min` that divides n with two blocks at least;
        where none divides n (a prime length), the largest with two blocks at least, the
        rows left over a tail step of their own (`build`)."""
        b, least = self.top, min(self.least, self.top)
        while b >= least and b >= 1:
            if n % b == 0 and n >= 2 * b:
                return b
            b //= 2
        b = self.top
        while b >= least and b >= 1:
            if n >= 2 * b:
                return b
            b //= 2
        return None

    def edges_of(self, seed: Value) -> list[str]:
        ok = [e for e in seed.edges if isinstance(self.sizes.get(e), int) and self.block_for(self.sizes[e])]
        return sorted(ok, key=lambda e: (-self.sizes[e], e))

    def round(self, skip: set[int]) -> Module | None:
        order = self.m.values()
        roots = self.m.roots()
        for seed in self.seeds(order, skip):
            for edge in self.edges_of(seed):
                self.block = self.block_for(self.sizes[edge])
                r = _region(order, roots, seed, edge, lambda v: self.large(v, seed))
                if r is None:   # the values before the seed that read what the seed grew up to, too
                    r = _region(order, roots, seed, edge, lambda v: self.large(v, seed), closure=True)
                fused = self.options.stream_fused_edge
                if r is not None and fused > 0 and fused_chain(r, self.sizes, self.options.dtype, fused):
                    break   # the target runs this cluster as fused kernels, whole (Options.stream_fused_edge)
                if r is not None and all(self.sizes[e] == self.sizes[edge] for e in r.edge.values()) \
                        and all(self.maskable(m, r.edge[id(m)]) for m in r.masks) \
                        and (_numel(seed, self.est) >= self.whole or self.skips(r, edge)):
                    out = self.partition(order, roots, seed, r, edge)
                    if out is None:
                        n = self.sizes[edge]
                        fits = self.cache_block(_numel(seed, self.est) // n, n)
                        rows = None if fits else self.key_rows(n)
                        block, self.block = self.block, fits or rows or self.block
                        out = self.build(order, r, edge, skip_only=_numel(seed, self.est) < self.whole)
                        if out is not None and rows and not _keys_apply(out, self.options):
                            # a step the key loops do not take keeps the block it had
                            self.block = block
                            out = self.build(order, r, edge, skip_only=_numel(seed, self.est) < self.whole)
                    if out is not None:
                        return out
            skip.add(id(seed))
        return None

    def cache_block(self, per: int, n: int) -> int | None:
        """The block for a stream over an edge of size `n` whose steps' matrices have `per`
        elements per row of the block, within `stream_step_elements`: the block, or its
        half (not below `stream_block_min`) when that brings them within it; None when
        neither does. (Once only: a quarter block's steps cost more than their matrices'
        cache saves, and a half block that does not fit gains nothing: docs/optimization.md,
        "Tuned numbers".)"""
        b, budget = self.block, self.options.stream_step_elements
        if budget <= 0 or b * per <= budget:
            return b
        if b // 2 >= self.least and (n % (b // 2) == 0 or n % b) and b // 2 * per <= budget:
            return b // 2
        return None

    def short_edges(self, seed: Value, r: _Region) -> list[str]:
        """The seed's short edges (batch, heads) of a stream of region `r`: those of known
        size 2 or more that the stream's edges and masks do not name, smallest first."""
        named = set(r.edge.values()) | {e for m in r.masks for e in m.edges}
        return sorted((e for e in seed.edges if e not in named and isinstance(self.sizes.get(e), int)
                       and self.sizes[e] >= 2), key=lambda e: (self.sizes[e], e))

    def key_rows(self, n: int) -> int | None:
        """The block of a stream over an edge of size `n` whose steps' matrices exceed
        `stream_step_elements` even halved and looped over the short edges, when its steps
        then run over blocks of the keys (`stream_key_block`, tgc.opt.stream_keys):
        `stream_key_rows` where it divides n in two blocks at least (a step's tiles are
        its rows by a key block: more rows, fewer steps, each reading the keys once)."""
        b = self.options.stream_key_rows
        if self.options.stream_key_block <= 0 or b <= 0 or n % b or n < 2 * b:
            return None
        return b

    def partition(self, order: list[Value], roots: list[Value], seed: Value, r: _Region, edge: str) -> Module | None:
        """The module with the cluster of `r` (about to stream over `edge`) moved into a loop
        over one of its short edges `h` (batch, heads: by size, then name), one index a
        step, whose step streams the cluster as the top level would have; or None, when the
        steps of the stream over `edge` fit `stream_step_elements` (`cache_block`: the
        block's rows by the seed's other edges), when they would not fit even with one
        index of every short edge a step and would run over key blocks under the stream's
        own rows (`stream_key_block` set, `key_rows` not dividing the edge), or when no
        edge qualifies. Steps that do not fit even one index a step loop all the same, so
        that a step's matrices are one index's of every short edge, not all of them (the
        peak independent of the batch and heads). An edge `h` qualifies when
        the cluster is a map over it: every value of `r` keeps `h` and reads its operands at
        the same index of `h` (the region along `h` holds `r`'s members, has no reduction
        over `h` and no indicator naming it). The step's stream runs under thresholds
        divided by |h|, so that it streams the cluster the top level chose; it may take
        another short edge first, while its steps are still over the budget."""
        n, per = self.sizes[edge], _numel(seed, self.est) // self.sizes[edge]
        if self.cache_block(per, n) is not None:
            return None   # the block or its half fits
        short = self.short_edges(seed, r)
        over = self.cache_block(per // math.prod(self.sizes[e] for e in short), n) is None
        if over and self.key_rows(n) is None and self.options.stream_key_block > 0:
            # the steps would not fit even one index of every short edge at a time, and run
            # over key blocks under rows of the stream's own block: no loops (where they run
            # under stream_key_rows, the loops let them read the keys and write dk, dv in
            # place: their blocks of one sequence's head are contiguous)
            return None
        # else, where the steps do not fit even so, the loops still bound them: a step holds
        # one sequence's head's [B, s] matrices, whatever the batch and heads (attention at
        # t = 8192, 4 heads x batch 2: explain's peak 273 -> 34.2 MB, the 1-head program's),
        # its steps independent (no carries: the CPU shares them among its threads,
        # codegen.parallel_step_loops) and reading q, k, v, dy, writing the outputs in place
        for h in short:
            rp = self.map_region(order, roots, seed, h)
            if rp is None:
                continue
            m, order_h = self.m, order
            if rp.carries:   # sums over h (a scalar loss): each step's partial stacked, summed after
                split = self.split_sums(order, rp, h, seed)
                if split is None:
                    continue
                self.m = split
                order_h = split.values()
                rp = self.map_region(order_h, split.roots(), seed, h)
                if rp is not None:
                    ends = {id(c) for c in rp.carries}
                    rp = _Region(rp.edge, rp.members, [], rp.stacked + [o for c in rp.carries for o in c.operands
                                                                          if id(o) in rp.edge and id(o) not in ends
                                                                          and o not in rp.stacked],
                                 rp.slices, rp.invariants, rp.masks)
            inside = {id(v) for v in rp.members} if rp is not None else set()
            out = None if rp is None or any(id(v) not in inside for v in r.members) \
                else self.map_loop(order_h, rp, h)
            if out is None:
                self.m = m
                continue
            n = self.sizes[h]
            o = self.options
            step = o.with_(stream_min_elements=max(1, o.stream_min_elements // n),
                           stream_min_elements_masked=max(1, o.stream_min_elements_masked // n))
            lanes = self.lanes
            if lanes > 1 and n >= lanes and over:
                # the steps run on `lanes` threads at once (codegen.parallel_step_loops), each
                # holding its own step's [B, s] matrices, over the cache budget even so: the
                # lanes share the block, so that they hold together what one thread's step
                # held (t = 8192, 4 heads x batch 2 on two threads: 65 -> 45 MiB, within the
                # 64 MiB of issue 32), not `lanes` times as much
                step = step.with_(stream_block=max(min(self.least, self.top), self.top // lanes))
                lanes = 1
            from tgc.opt.rewrite import map_bodies
            return map_bodies(out, lambda body: stream(body, step, lanes), only=self.last_body)
        return None

    def map_region(self, order: list[Value], roots: list[Value], seed: Value, h: str) -> _Region | None:
        """The region of `seed` along short edge `h` for a loop over `h` (`partition`): with
        the values before the seed that read it too where it needs them (as the stream's own
        region may: the row max of the scores); None when there is none, or it has masks,
        edges of other sizes, or carries other than sums."""
        rp = _region(order, roots, seed, h, lambda v: self.large(v, seed))
        if rp is None:
            rp = _region(order, roots, seed, h, lambda v: self.large(v, seed), closure=True)
        if rp is None or rp.masks or any(self.sizes[e] != self.sizes[h] for e in rp.edge.values()):
            return None
        if any(_carry_kind(c, h) != "sum" for c in rp.carries):
            return None
        return rp

    def split_sums(self, order: list[Value], rp: _Region, h: str, seed: Value) -> Module | None:
        """The module with each carry of `rp` (a contraction summing `h` among other edges:
        a scalar loss over the batch) split in two: the contraction keeping `h`, then its sum
        over `h`, so that a loop over `h` computes the partial in its steps (a stacked
        result of |h| elements per kept element, no carry: the steps stay independent) and
        the sum over `h` follows the loop. A reassociation of that sum (as the stream's
        own carries are). None when a partial would be of the seed's scale."""
        memo: dict[int, Value] = {}
        ends = {id(c) for c in rp.carries}
        for v in order:
            ops = tuple(memo.get(id(o), o) for o in v.operands)
            if id(v) in ends:
                keep = [e for e in v.edges] + [h]
                part = V.contract(ops, keep, v.loc)
                if self.large(part, seed):
                    return None
                memo[id(v)] = V.contract((part,), v.edges, v.loc)
            else:
                memo[id(v)] = rebuild_same(v, ops)
        return self.m.replace_values(memo)

    def map_loop(self, order: list[Value], r: _Region, h: str) -> Module | None:
        """The module with region `r` (no carries, no masks) computed by a loop over `h`,
        one index a step: the operands with `h` are its slices (renamed to the loop's edge:
        no copy), the others invariants, the step's values those of `r` without `h`, the
        stacked results renamed back to `h`. None when a member reads a constant over `h`
        (it would keep the edge in the step)."""
        if any(o.op in ("const", "size") and _up(v, r.edge[id(v)]) in o.edges for v in r.members for o in v.operands):
            return None
        names = {r.edge[id(x)] for x in r.slices} | {r.edge[id(v)] for v in r.stacked}
        # the loop runs over `h` itself where every slice and result names it so: its operands are then
        # the program's arguments as they are, which the lowering binds with no copy (tgc.lower.steps)
        eb = h if names == {h} else self.new_edge(h, self.sizes[h])
        params: list[Value] = []
        operands: list[Value] = []
        inner: dict[int, Value] = {}
        for x in r.slices:
            e = r.edge[id(x)]
            operands.append(V.rename(x, {e: eb}))
            p = V.loopvar(len(params), x.dtype, [d for d in x.edges if d != e])
            params.append(p)
            inner[id(x)] = p
        n_slices = len(params)
        whole: dict[int, Value] = {}
        for x in r.invariants:
            operands.append(x)
            p = V.loopvar(len(params), x.dtype, x.edges)
            params.append(p)
            whole[id(x)] = p

        def read(o: Value, e: str) -> Value:
            if id(o) in whole and e not in o.edges:
                return whole[id(o)]
            return inner.get(id(o), o)

        for v in r.members:
            e = r.edge[id(v)]
            ops = tuple(read(o, _up(v, e)) for o in v.operands)
            if v.op == "contract":
                inner[id(v)] = V.contract(ops, [d for d in v.edges if d != e], v.loc)
            elif v.op == "rename":
                pairs = {a: c for a, c in v.attrs[0] if c != e}
                inner[id(v)] = V.rename(ops[0], pairs, v.loc) if pairs else ops[0]
            else:
                inner[id(v)] = rebuild_same(v, ops)
        body = V.loop_body(params, [inner[id(v)] for v in r.stacked], 0, n_slices)
        self.last_body = body
        memo: dict[int, Value] = {}
        for j, v in enumerate(r.stacked):
            memo[id(v)] = V.rename(V.loop(body, eb, operands, j), {eb: r.edge[id(v)]})
        for v in order:
            if id(v) not in memo:
                memo[id(v)] = rebuild_same(v, tuple(memo[id(o)] for o in v.operands))
        return self.m.replace_values(memo)

    def maskable(self, ind: Value, edge: str) -> bool:
        """Whether every link of indicator `ind` that names `edge` is an inequality (a
        mask: causal, a window) with integer coefficients and ranges (what `mask`
        needs). An equality naming `edge` is a reindex (a convolution's window `t = s + k
        - 2`, a split): index arithmetic in the program as it is, which a block's stacked
        indicator would turn into a dense product over the other side's edge."""
        rel: Relation = ind.attrs[0]
        for i in range(len(rel.ops)):
            d = rel.exprs[i].plus(rel.exprs[i + 1], -1)
            if d.coef(edge) == 0:
                continue
            if rel.ops[i] == "=":
                return False
            if not isinstance(d.const, int) or any(not isinstance(k, int) or not isinstance(self.sizes.get(e), int)
                                                   for e, k in d.terms):
                return False
        return True

    def mask(self, ind: Value, edge: str, ec: str, eb: str) -> tuple[list[Value], list[tuple]]:
        """Indicator `ind` (naming `edge`) for a loop over blocks `eb` of `ec`: the stacked
        indicators `G[eb, r]` the loop takes (one per link that names `edge`), and per link
        how the step computes it: ("plain", the link's own indicator) or ("piece", (r, the
        reindex [r = w' - min w'], the edges it keeps)), applied to G's slice."""
        rel: Relation = ind.attrs[0]
        b = self.block
        pieces, plan = [], []
        for i, op in enumerate(rel.ops):
            d = rel.exprs[i].plus(rel.exprs[i + 1], -1)
            c = d.coef(edge)
            if c == 0:
                link = Relation((rel.exprs[i], rel.exprs[i + 1]), (op,))
                plan.append(("plain", V.indicator(link, ind.dtype)))
                continue
            others = sum(k for e, k in d.terms if e != edge)
            if others < 0 or (others == 0 and c < 0):
                # oriented so that r grows with the other edges (the keys: a step's rows run
                # over them innermost, and read G forward, which vectorizes their max), else
                # with the block's index
                d, c, op = d.scaled(-1), -c, _FLIP[op]
            w_terms = [(e, k) for e, k in d.terms if e != edge] + [(ec, c)]
            lo, hi = d.const, d.const
            for e, k in w_terms:
                n = self.sizes[e]
                lo, hi = lo + min(0, k * (n - 1)), hi + max(0, k * (n - 1))
            r = self.new_edge("r", hi - lo + 1)
            g = Relation((Affine.make({eb: c * b, r: 1}, lo), Affine.make({}, 0)), (op,))
            pieces.append(V.indicator(g, ind.dtype))
            at = Relation((Affine.make({r: 1}), Affine.make(w_terms, d.const - lo)), ("=",))
            plan.append(("piece", (r, V.indicator(at, ind.dtype), sorted(e for e, _ in w_terms))))
        return pieces, plan

    def key_edge(self, r: _Region) -> str | None:
        """The edge other than the streamed one that every mask of `r` names (the keys)."""
        others = {e for ind in r.masks for e in ind.edges if e != r.edge[id(ind)]}
        if not r.masks or len(others) != 1 or any(len(ind.edges) != 2 for ind in r.masks):
            return None
        s = others.pop()
        return s if isinstance(self.sizes.get(s), int) else None

    def roles(self, r: _Region) -> list[frozenset[int]]:
        """The roles the masks of `r` may play, as the sets of the indices of those that
        reject (1 at the keys they mask: `- 1e9 * [s > t]`), all admitting first; a
        chain rejects where all its links hold (its admitted keys, a union, have the join
        of its links' hulls); the first three masks only."""
        tried = range(min(len(r.masks), 3))
        return [frozenset(i for i, f in zip(tried, flips) if f)
                for flips in itertools.product((False, True), repeat=len(tried))]

    def plan(self, r: _Region, n: int, reject: frozenset[int] = frozenset(), meet: bool = False):
        """stream_skip.groups for the masks of `r` (the streamed edge of size n; those of
        `reject` rejecting; `meet`: a key skipped where one mask masks it), or None."""
        s = self.key_edge(r)
        if s is None or self.groups <= 0:
            return None
        rows = self.options.stream_mask_rows if self.options.stream_key_block <= 0 else 0
        # long edges in more runs (`stream_mask_rows`, at most `stream_mask_runs`: each
        # run compiles its own step); not under key blocks (the attention
        # layer at t = 8192 with keys of 256: explain's peak 62.9 -> 64.5 MiB in 32 runs)
        count = max(self.groups, min(n // rows, self.options.stream_mask_runs)) if rows > 0 else self.groups
        return stream_skip.groups([(ind.attrs[0], r.edge[id(ind)], i in reject) for i, ind in enumerate(r.masks)],
                                  s, n, self.sizes[s], self.block, count, meet)

    def skips(self, r: _Region, edge: str) -> bool:
        """Whether the masks of `r`, in some roles, let some loop skip keys (a seed under
        `stream_min_elements` streams only then)."""
        return any(self.plan(r, self.sizes[edge], reject, meet) is not None
                   for reject in self.roles(r) for meet in (False, True)[:len(r.masks)])

    def runs(self, r: _Region, body: V.LoopBody, kinds: list, masks: list[Value], n: int):
        """(s, [(first block, end block, lo, hi)]): the loops a masked stream runs as, each
        over the keys s in [lo, hi) that its blocks' rows admit (tgc.opt.stream_skip), for
        the roles of the masks (`masks`: their values in the step) that stream_skip.exact
        shows exact, the fewest keys over all runs (the first such: all admitting first);
        with several masks, a key may be skipped where one of them masks it (the meet of
        their hulls) when `exact` shows each mask alone suffices, the others 0 or 1 (a
        window written as two subtracted fills); or None: one loop over every key."""
        s = self.key_edge(r)
        ids = [id(m) for m in masks]
        best = None
        for reject in self.roles(r):
            plan = self.plan(r, n, reject)
            ones = frozenset(m for i, m in enumerate(ids) if i in reject)
            zeros = {m for i, m in enumerate(ids) if i not in reject}
            if plan is not None and stream_skip.exact(body, s, zeros, kinds, ones):
                best = min(best or plan, plan, key=_work)
            if len(masks) > 1:   # a key skipped where one mask masks it: each mask shown to suffice
                plan = self.plan(r, n, reject, meet=True)
                if plan is not None and (best is None or _work(plan) < _work(best)) and all(
                        stream_skip.exact(body, s, set() if i in reject else {m}, kinds,
                                          frozenset({m}) if i in reject else frozenset(),
                                          frozenset(ids[:i] + ids[i + 1:]))
                        for i, m in enumerate(ids)):
                    best = plan
        return None if best is None else (s, best)

    def run_loops(self, r: _Region, body: V.LoopBody, operands: list[Value], runs, eb: str,
                  ec: str) -> dict[int, Value]:
        """The carries and stacked results of the loops of `runs`, one loop per run over its
        blocks and its keys: each loop's carries start from the last loop's (so the sums
        over the blocks are taken in their order), the stacked results are placed at their
        blocks."""
        s, plan = runs
        ns, b = self.sizes[s], self.block
        parts: list[list[Value]] = [[] for _ in body.results]
        carried = list(operands[:len(r.carries)])   # each run's carries start where the last run's ended
        for b0, b1, lo, hi in plan:
            at = {eb: (self.new_edge(eb, b1 - b0), b0)}
            if hi - lo < ns:
                at[s] = (self.new_edge(s, hi - lo), lo)
            step = stream_skip.resized(body, s, at[s][0], lo) if s in at else body
            ops = []
            for k, o in enumerate(operands):
                role = body.role(k)
                if role == "carry":
                    ops.append(carried[k])
                elif k < len(r.carries) + len(r.slices):   # a block of an operand: split at the run's first
                    x = r.slices[k - len(r.carries)]
                    ops.append(_window(_split(x, r.edge[id(x)], ec, at[eb][0], b, b0), {s: at[s]} if s in at else {}))
                elif role == "slice":   # a mask's stacked indicator
                    ops.append(_window(o, at))
                else:
                    ops.append(_window(o, {e: w for e, w in at.items() if e != eb}))
            for j in range(len(body.results)):
                out = V.loop(step, at[eb][0], ops, j)
                if j < len(r.carries):
                    carried[j] = out
                else:
                    v = r.stacked[j - len(r.carries)]
                    e = r.edge[id(v)]
                    rel = Relation((Affine.make({e: 1}), Affine.make({ec: 1, at[eb][0]: b}, b * b0)), ("=",))
                    keep = [x for x in out.edges if x not in (ec, at[eb][0])] + [e]
                    parts[j].append(V.reindexed(out, [V.indicator(rel, out.dtype)], keep))
        memo: dict[int, Value] = {id(v): c for v, c in zip(r.carries, carried)}
        for v, ps in zip(r.stacked, parts[len(r.carries):]):
            memo[id(v)] = ps[0] if len(ps) == 1 else _exact_sum(ps, v.dtype)
        return memo

    def build(self, order: list[Value], r: _Region, edge: str, skip_only: bool = False) -> Module | None:
        """The module with region `r` streamed over `edge`; None (the module as it was)
        when `skip_only` (a seed under `stream_min_elements`) and no loop skips keys."""
        saved = (dict(self.m.dims), dict(self.m.edges), dict(self.sizes), dict(self.est))
        b = self.block
        n = self.sizes[edge]
        ec = self.new_edge(edge, b)
        eb = self.new_edge(edge, n // b)

        def undo() -> None:   # the edges made for it
            for live, old in zip((self.m.dims, self.m.edges, self.sizes, self.est), saved):
                live.clear()
                live.update(old)

        def step_edges(v: Value, e: str | None = None) -> list[str]:   # v's edges in a step
            e = r.edge.get(id(v)) if e is None else e
            return [ec if x == e else x for x in v.edges]

        masks = []
        for ind in r.masks:
            pieces, plan = self.mask(ind, r.edge[id(ind)], ec, eb)
            masks.append((ind, pieces, plan))
        # operands and parameters: carries, slices (inputs, then mask pieces), invariants
        params: list[Value] = []
        operands: list[Value] = []
        kinds = [_carry_kind(v, r.edge[id(v)]) for v in r.carries]
        for v, kind in zip(r.carries, kinds):
            init = {"sum": 0.0, "max": float("-inf"), "min": float("inf")}[kind]
            operands.append(V.const(init, v.dtype, v.edges))
            params.append(V.loopvar(len(params), v.dtype, v.edges))
        inner: dict[int, Value] = {}
        for x in r.slices:
            operands.append(_split(x, r.edge[id(x)], ec, eb, b))
            p = V.loopvar(len(params), x.dtype, step_edges(x))
            params.append(p)
            inner[id(x)] = p
        piece_params = []
        for ind, pieces, plan in masks:
            ps = []
            for g in pieces:
                operands.append(g)
                p = V.loopvar(len(params), g.dtype, [e for e in g.edges if e != eb])
                params.append(p)
                ps.append(p)
            piece_params.append(ps)
        n_slices = len(params) - len(r.carries)
        whole: dict[int, Value] = {}   # the invariants, read whole (some are also read by blocks)
        for x in r.invariants:
            operands.append(x)
            p = V.loopvar(len(params), x.dtype, x.edges)
            params.append(p)
            whole[id(x)] = p
        for (ind, pieces, plan), ps in zip(masks, piece_params):
            parts, it = [], iter(ps)
            for kind, what in plan:
                if kind == "plain":
                    parts.append(what)
                else:
                    _, at, keep = what
                    parts.append(V.contract([next(it), at], keep))
            inner[id(ind)] = parts[0] if len(parts) == 1 else V.mul(parts)

        def read(o: Value, e: str) -> Value:   # an operand in the step (its edge's name e): a member,
            if id(o) in whole and e not in o.edges:   # a parameter, or nullary
                return whole[id(o)]
            return inner.get(id(o), o)

        for v in r.members:
            ops = tuple(read(o, _up(v, r.edge[id(v)])) for o in v.operands)
            if v.op == "contract":
                inner[id(v)] = V.contract(ops, step_edges(v), v.loc)
            elif v.op == "rename":   # the streamed edge is the step's block edge on both sides
                pairs = {a: c for a, c in v.attrs[0] if c != r.edge[id(v)]}
                inner[id(v)] = V.rename(ops[0], pairs, v.loc) if pairs else ops[0]
            else:
                inner[id(v)] = rebuild_same(v, ops)
        results = []
        for v, kind, p in zip(r.carries, kinds, params):
            ops = [read(o, r.edge[id(v)]) for o in v.operands]
            if kind == "sum":
                part = V.contract(ops, v.edges, v.loc)
                results.append(V.add([p, part]))
            else:
                part = V.reduce(kind, ops[0], [ec if x == r.edge[id(v)] else x for x in v.attrs[1]], v.loc)
                results.append(V.map_(kind, p, part))
        for v in r.stacked:
            results.append(inner[id(v)])
        body = V.loop_body(params, results, len(r.carries), n_slices)
        self.last_body = body
        memo: dict[int, Value] = {}
        runs = self.runs(r, body, kinds, [inner[id(ind)] for ind in r.masks], n)
        if runs is None and skip_only:
            undo()
            return None
        if runs is None:
            for i, v in enumerate(r.carries):
                memo[id(v)] = V.loop(body, eb, operands, i)
            for j, v in enumerate(r.stacked):
                out = V.loop(body, eb, operands, len(r.carries) + j)
                memo[id(v)] = _join(out, r.edge[id(v)], ec, eb, b)
        else:
            memo.update(self.run_loops(r, body, operands, runs, eb, ec))
        if n % b and not self.tail(r, body, operands, memo, edge, ec, eb):
            undo()
            return None
        for v in order:
            if id(v) not in memo:
                memo[id(v)] = rebuild_same(v, tuple(memo[id(o)] for o in v.operands))
        return self.m.replace_values(memo)


    def tail(self, r: _Region, body: V.LoopBody, operands: list[Value], memo: dict[int, Value],
             edge: str, ec: str, eb: str) -> bool:
        """The rows of `edge` after its last whole block (|edge| mod B of them) as one more
        step of `body` resized to them, after the blocks' loops: its carries start from
        theirs (the sums over the blocks then the tail, in order), its stacked results
        placed at the tail's rows and added to theirs (disjoint rows). The step is a loop
        of one index, over the tail's rows: the slices read at the last block's offset, a
        mask's stacked indicator at that block's index. False (nothing changed) where the
        step cannot be resized (`stream_skip.resized`: a size of the block's edge)."""
        b, n = self.block, self.sizes[edge]
        nb = n // b
        et = self.new_edge(edge, n - nb * b)
        step = stream_skip.resized(body, ec, et, 0)
        if step is None:
            return False
        ebt = self.new_edge(edge, 1)
        ops = []
        for k, o in enumerate(operands):
            role = body.role(k)
            if role == "carry":
                ops.append(memo[id(r.carries[k])])
            elif k < len(r.carries) + len(r.slices):   # the operand's rows of the tail
                x = r.slices[k - len(r.carries)]
                ops.append(_split(x, r.edge[id(x)], et, ebt, b, nb))
            elif role == "slice":   # a mask's stacked indicator G[eb, r] at eb = nb
                ops.append(V.indicator(substitute(o.attrs[0], eb, Affine.make({ebt: 1}, nb)), o.dtype))
            else:
                ops.append(o)
        for j in range(len(body.results)):
            out = V.loop(step, ebt, ops, j)
            if j < len(r.carries):
                memo[id(r.carries[j])] = out
            else:
                v = r.stacked[j - len(r.carries)]
                e = r.edge[id(v)]
                rel = Relation((Affine.make({e: 1}), Affine.make({et: 1, ebt: b}, b * nb)), ("=",))
                keep = [x for x in out.edges if x not in (et, ebt)] + [e]
                memo[id(v)] = _exact_sum([memo[id(v)], V.reindexed(out, [V.indicator(rel, out.dtype)], keep)], v.dtype)
        return True


def _work(plan: list[tuple[int, int, int, int]]) -> int:
    """The blocks times the keys a masked stream's runs (stream_skip.groups) go over."""
    return sum((b1 - b0) * (hi - lo) for b0, b1, lo, hi in plan)


def _window(x: Value, at: dict[str, tuple[str, int]]) -> Value:
    """x with each edge e of `at` read over a fresh edge f at an offset: x[e = f + off]
    (an exact reindex)."""
    inds = [V.indicator(Relation((Affine.make({e: 1}), Affine.make({f: 1}, off)), ("=",)), x.dtype)
            for e, (f, off) in at.items() if e in x.edges]
    if not inds:
        return x
    return V.reindexed(x, inds, [at[e][0] if e in at else e for e in x.edges])


def stream(module: Module, options: Options, lanes: int | None = None) -> Module:
    """`module` with every large cluster it can stream moved into a loop over blocks.
    `lanes`: the threads a loop over a short edge that this makes may share its steps
    among (default: `options.cpu.step_lanes()`; 1 inside such a loop's step, whose block
    already shares them: `partition`)."""
    skip: set[int] = set()
    m = Module(dict(module.dims), dict(module.edges), dict(module.args), list(module.outputs),
               list(module.updates), list(module.facts))
    lanes = options.cpu.step_lanes() if lanes is None else lanes
    while True:
        st = _Streamer(m, options, lanes)
        out = st.round(skip)
        if out is None:
            return m
        m = out


def _keys_apply(module: Module, options: Options) -> bool:
    """Whether every loop step of `module` whose scores exceed the step budget runs over
    key blocks (tgc.opt.stream_keys takes it, and leaves no value over the budget outside
    its loops): a stream of `stream_key_rows` rows is built for that; one whose steps the
    key loops reject would hold their larger matrices whole."""
    from tgc.opt.rewrite import map_bodies
    from tgc.opt.stream_keys import _numel as numel, key_candidates, stream_keys

    failed: list[bool] = []

    def fn(body: Module) -> Module:
        if key_candidates(body, options):
            new = stream_keys(body, options)
            sizes = {e: new.size(e) for e in new.edges}
            # taken, and no value of the step outside its loops still over the budget (the
            # attention layer's scores over its input edge, which the key loops leave whole)
            if new is body or any(v.op not in ("loop", "indicator", "const")
                                  and numel(v, sizes) > options.stream_step_elements for v in new.values()):
                failed.append(True)
        return body
    map_bodies(module, fn)
    return not failed


@dataclass(frozen=True)
class Stream(Pass):
    """Large values over a long edge -> a loop over blocks of it (attention's scores and
    weights, forward and backward, block by block; reductions over the edge as carries)."""

    name = "stream"
    block: int | None = None          # the block size (default: options.stream_block)
    min_elements: int | None = None   # a large value's elements (default: options.stream_min_elements)
    groups: int | None = None         # loops a masked stream runs as (default: options.stream_mask_groups)
    step_elements: int | None = None  # a step's matrix budget (default: options.stream_step_elements)
    key_block: int | None = None      # a step's key block (default: options.stream_key_block; tgc.opt.stream_keys)

    def options_error(self, ir) -> str | None:
        """A negative size or count (0 is each option's 'never'; none is negative)."""
        for name in ("block", "min_elements", "groups", "step_elements", "key_block"):
            n = getattr(self, name)
            if n is not None and n < 0:
                return f"{name}={n}: a size or count, 0 or more"
        return None

    def run(self, module: Module, options: Options) -> Module:
        if self.block is not None:
            options = options.with_(stream_block=self.block)
        if self.min_elements is not None:
            options = options.with_(stream_min_elements=self.min_elements)
        if self.groups is not None:
            options = options.with_(stream_mask_groups=self.groups)
        if self.step_elements is not None:
            options = options.with_(stream_step_elements=self.step_elements)
        if self.key_block is not None:
            options = options.with_(stream_key_block=self.key_block)
        if options.fp_strict or options.stream_block <= 0:
            return module
        from tgc.opt.rewrite import map_bodies

        # the large values a reverse loop would read stacked from its forward loop computed
        # in its step instead, where that step then streams (tgc.opt.stream_loops); then
        # the program's loops' steps (attention inside a `repeat` over layers: each body as
        # a module, once), then the program itself; the loops this makes are not looked
        # into again
        module = recompute_residuals(module, options, stream)
        module = stream(map_bodies(module, lambda body: stream(body, options)), options)
        # a step whose matrices over the keys are still over the cache budget: its softmax
        # over blocks of the keys (tgc.opt.stream_keys; off unless stream_key_block)
        return stream_key_bodies(module, options)
