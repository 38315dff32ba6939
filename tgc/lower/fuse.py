"""fuse: partition the module's value DAG into kernels (the first lowering stage).

Module -> `Lowered` (tgc.lower.lowered). Every value is either *materialized* (a
buffer: arguments, outputs, update values, reductions, GEMM operands, scatters,
values with several consumers unless they are cheap to recompute (see
`recompute`), expensive values a consumer would recompute over a broadcast, and values
whose inlined expression would nest deeper than `MAX_INLINE_DEPTH`) or *inlined* into the
expression tree of the kernel that consumes it. So a chain of elementwise ops and
reductions reads its inputs once:

- GEMM cells: two-operand contractions whose edges split into batch / M / N / K
  groups, all of M, N, K present and (when sizes are known) at least
  `options.cpu.blas_min_flops` flops; their operands are materialized buffers, seen
  through renames: the first value of an operand's chain of renames that has a buffer
  of its own (an output, a loop step's saved keys `k[t -> s]`) is read there, and only
  where none has one is the value under the renames materialized (else it was stored
  twice, the renamed output a copy of it). An indicator, or a product of indicators only (`index_only`),
  is never an operand: it is index arithmetic, and as a buffer it would be a dense
  0/1 tensor over all its edges (six, for a 2-D convolution's window relation).
- GEMMs on shifted views (`tgc.lower.taps`): a contraction whose two factors are
  read through indicators as `edge + shift(short edges)` (a convolution, its input
  and kernel gradients) becomes a loop over the short edges (taps) of GEMM calls on
  shifted views, each edge's range clipped to the input (no im2col copy); the
  single-use inner contractions it folds in get no kernel of their own.
- Loop kernels: `out[kept] = R_summed(body)` with R in (sum, max, min) or none;
  `body` inlines adds, maps, products, consts, sizes, renames (index relabeling),
  gathers (indexed loads), and indicators (index arithmetic, `tgc.lower.indexing`:
  substitutions and bounds, never dense 0/1 tensors). The indicators of a product's
  inlined factors (a padded window `x[h = ho + kh - 1]`) mask the product as a
  whole, as its own indicators do (`masked_product`): a term one indicator zeroes is
  zero, so this is the contraction's value, and `layout` can then turn the conditions
  into loop bounds. A reduction with a single elementwise consumer of the same edges
  becomes that kernel's `epilogue`.
- Scatters: zero the output, then add each element at its gathered position.
- Loops over an edge (`loop` values, `repeat`/`scan` and their derivatives) become
  `StepLoop`s (`tgc.lower.steps`): the body is lowered as a program of its own, and
  the loop's operands and results are buffers, so fusion stops at the loop.
- Random draws (`random`) are leaves like indicators: a `Rand` computed from the
  loop indices (its counter, the row-major index over its own edges) and the key,
  so a draw fused into any kernel, in any loop order, has the same value.

Outputs are computed into the caller's output buffers; update values into
temporaries copied into their targets at the very end (after every read of the
old values; `plan` writes them in place where that is safe).

Terminates: one visit per value (topological order), one upward walk per reduction.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from tgc.lower.lowered import (Acc, Add, Buffer, Check, Const, GemmKernel, IdLoad, Ix, Load,
                            LoopKernel, Lowered, Map, Mask, Mul, Rand, SizeOf, View, smul)
from tgc.ir.sizes import size_op
from tgc.ir.diag import CompileError
from tgc.ir.module import Module
# the functions worth materializing (cost class heavy), from tgc.ir.ops
from tgc.ir.ops import EXPENSIVE
from tgc.ir.values import Value, topo_order
from tgc.options import Options
from tgc.ir.passes import Pass
from tgc.lower.complex_gemm import ComplexGemms
from tgc.lower.steps import StepLowering
from tgc.lower.taps import TapGemms
from tgc.lower.views import is_identity, peel
from tgc.lower.indexing import edge_size, relation_conds, simplify_conds, solve

ELEMENTWISE = frozenset({"add", "map", "stop"})
# The deepest expression tree a kernel inlines: a longer chain of single-use
# elementwise values (`y1 = y0 * 2 + 1`, `y2 = y1 * 2 + 1`, ... over hundreds of
# bindings) is cut into kernels that meet at a buffer, so that every later stage, which
# walks expression trees recursively, stays far from Python's recursion limit.
MAX_INLINE_DEPTH = 64


class FuseError(ValueError):
    """The module holds something no kernel can compute (e.g. an undifferentiated grad)."""


@dataclass(frozen=True)
class Fuse(Pass[Module, Lowered]):
    """Partition the DAG into kernels: GEMM cells and fused loop nests."""

    name = "fuse"
    gives = "lowered"

    def run(self, module: Module, options: Options) -> Lowered:
        return _Fuser(module, options).lower()




def _kernel_writes(k) -> set[str]:
    return k.writes() if hasattr(k, "writes") else {k.out}


def sink_recomputation(kernels: list) -> None:
    """Move each kernel that recomputes a checkpointed value for the backward pass (note
    "recompute", see `tgc.autodiff.remat`) to just before its first reader, later ones
    first so that a chain of copies moves together: a copy then lives only while the
    backward reads it. A kernel moves past no kernel that writes a buffer it reads or
    reads or writes one it writes, so every kernel still reads what it read before.
    Terminates: one pass, each kernel moved at most once."""
    for i in reversed(range(len(kernels))):
        k = kernels[i]
        if k.note != "recompute":
            continue
        writes, reads = _kernel_writes(k), k.buffers_read()
        j = i + 1
        while j < len(kernels) and not (kernels[j].buffers_read() & writes) \
                and not (_kernel_writes(kernels[j]) & (reads | writes)):
            j += 1
        if j < len(kernels) and j > i + 1:
            kernels.insert(j - 1, kernels.pop(i))


class _Fuser:
    def __init__(self, m: Module, options: Options, lse_args: frozenset[str] = frozenset()):
        self.m, self.opt = m, options
        self.lse_args = lse_args   # a step's arguments bound to a log-sum-exp from outside (`Buffer.lse`)
        self.values = m.values()
        for v in self.values:
            if v.op in ("grad", "jvp", "vjp"):
                raise CompileError(f"'{v.op}' is left in the program, which cannot be lowered: a pass list "
                                   f"(-p) without the adjoint and tangent passes", v.loc)
        self.users: dict[int, set[int]] = {id(v): set() for v in self.values}
        for v in self.values:
            for o in v.operands:
                self.users[id(o)].add(id(v))
        self.by_id = {id(v): v for v in self.values}
        self.root_uses = Counter(id(v) for v in m.roots())
        self.low = Lowered(m, options.dtype, sum_exact_products=options.sum_exact_products)
        self.mat: dict[int, str] = {}      # id(value) -> buffer
        self.gemms: dict[int, tuple] = {}  # id(value) -> (batch, m, n, k)
        self.shifted: dict[int, dict] = {}  # id(value) -> GEMMs on shifted views (`taps.TapGemms.tap_gemm`)
        self.cgemms: dict[int, dict] = {}   # id(value) -> the complex product it is (`complex_gemm.match`)
        self.folded: set[int] = set()      # reductions computed inside a shifted GEMM
        self.absorb: dict[int, Value] = {}  # id(kernel root) -> the reduction it finishes
        self.acc_of: int | None = None
        self._reduction: dict[int, bool] = {}
        self._cost: dict[int, int] = {}
        self._depth: dict[int, int] = {}   # id(value) -> its inlined expression's depth (inline_depth)
        self.steps = StepLowering(self)   # loops over an edge: `StepLoop`s (tgc.lower.steps)
        self.taps = TapGemms(self)         # GEMMs on shifted views (tgc.lower.taps)
        self.complex = ComplexGemms(self)  # complex products (tgc.lower.complex_gemm)

    # ------------------------------------------------------------ classification

    def uses(self, v: Value) -> int:
        return len(self.users[id(v)]) + self.root_uses[id(v)]

    def is_reduction(self, v: Value) -> bool:
        if v.op == "reduce":
            return True
        if v.op != "contract":
            return False
        if id(v) not in self._reduction:
            env = {e: Ix.var(e) for e in v.edges}
            sol = self.solve(v, env, "?")
            self._reduction[id(v)] = bool(sol[1].remaining)
        return self._reduction[id(v)]

    def summed(self, v: Value) -> list[str]:
        edges = {e for o in v.operands for e in o.edges} - set(v.edges)
        return list(self.m.order_edges(edges))

    def parts(self, v: Value) -> tuple[list[Value], list]:
        """A contraction's factors and indicator relations, nested pure products flattened."""
        factors, rels = [], []
        for o in v.operands:
            if id(o) in self.mat:
                factors.append(o)
            elif o.op == "indicator":
                rels.append(o.attrs[0])
            elif o.op == "contract" and all(set(x.edges) <= set(o.edges) for x in o.operands):
                f, r = self.parts(o)
                factors += f
                rels += r
            else:
                factors.append(o)
        return factors, rels

    def solve(self, v: Value, env: dict[str, Ix], prefix: str):
        """Substitute the summed edges that indicators determine. The longest are
        eliminated first (`long_first`): what stays a loop is the short edge, so
        `sum_{kw, wo} [w = wo + kw - 1] g[wo, kw]` loops over 3 taps, not 32 positions.
        Where that leaves loops, a link may also determine an edge it scales (stride
        2: `h = 2*ho + kh - 1` gives `ho = (h + 1 - kh) / 2` where that divides), if
        that leaves shorter loops (`indexing.solve_conds`)."""
        factors, rels = self.parts(v)
        summed = self.summed(v)
        names = {e: prefix + e for e in self.long_first(summed)}
        full = dict(env)
        full.update({e: Ix.var(p) for e, p in names.items()})
        sizes = {p: edge_size(self.m, e) for e, p in names.items()}
        sol = solve(self.m, rels, full, names, sizes)
        if sol.remaining:
            other = solve(self.m, rels, full, names, sizes, divide=True)
            if self.loop_volume(other.remaining, sizes) < self.loop_volume(sol.remaining, sizes):
                sol = other
        left = set(sol.remaining)   # the loops in the edges' order, whatever the elimination's
        sol.remaining = [names[e] for e in summed if names[e] in left]
        for e, p in names.items():
            full[e] = sol.sol.get(p, Ix.var(p))
        return factors, sol, full

    def loop_volume(self, places, sizes) -> int:
        """Iterations of loops over `places` (a symbolic size at `options.rep_size`)."""
        n = 1
        for p in places:
            n *= sizes[p] if isinstance(sizes[p], int) else self.opt.rep_size
        return n

    def long_first(self, edges) -> list[str]:
        """`edges` by decreasing size (a symbolic one counts as longest; ties keep their order)."""
        def key(e):
            n = edge_size(self.m, e)
            return -n if isinstance(n, int) else -(1 << 40)
        return sorted(edges, key=key)

    def gemm_groups(self, v: Value):
        if v.op != "contract" or len(v.operands) != 2 or not self.is_reduction(v):
            return None
        a, b = (peel(o)[0] for o in v.operands)
        if self.index_only(a) or self.index_only(b):
            return None   # an indicator (or a product of them) is index arithmetic, never a dense matrix
        if self.broadcast_edges(a) or self.broadcast_edges(b):
            return None   # an operand stored without the edges it repeats along is no BLAS matrix
        A, B, C = set(v.operands[0].edges), set(v.operands[1].edges), set(v.edges)
        if C - (A | B) or (A - B - C) or (B - A - C):
            return None
        groups = [self.m.order_edges(g) for g in (A & B & C, (A & C) - B, (B & C) - A, (A & B) - C)]
        if not all(groups[1:]):
            return None
        flops = 2
        for e in A | B:
            s = edge_size(self.m, e)
            flops = flops * s if isinstance(s, int) and isinstance(flops, int) else None
        if flops is not None and flops < self.opt.cpu.blas_min_flops:
            return None
        return tuple(groups)

    def index_only(self, v: Value) -> bool:
        """`v` is an indicator or a product of indicators (seen through renames): a
        relation over its edges, which loads inline as index arithmetic and a mask.
        Materializing one would write a dense 0/1 tensor over all of its edges."""
        v = peel(v)[0]
        if v.op == "indicator":
            return True
        return (v.op == "contract" and id(v) not in self.mat
                and all(self.index_only(o) for o in v.operands))

    def cost(self, v: Value) -> int:
        """Work to recompute `v` inline from materialized values (loads cost nothing)."""
        if id(v) not in self._cost:
            self._cost[id(v)] = min(100, self._cost_of(v))
        return self._cost[id(v)]

    def _cost_of(self, v: Value) -> int:
        if id(v) in self.mat or v.op in ("const", "size", "indicator", "arg"):
            return 0
        own = 10 if (v.op == "map" and v.attrs[0] in EXPENSIVE) or v.op == "random" else 1
        if v.op == "rename" or is_identity(v):
            own = 0
        if v.op in ("reduce", "scatter") or (v.op == "contract" and self.is_reduction(v)):
            return 100
        return own + sum(self.cost(o) for o in v.operands)

    def recompute(self, v: Value) -> bool:
        """Inline a value with several users into each: trivially cheap, or one
        vectorized transcendental over what its two users read anyway (softmax's
        exp(x - max) is computed twice rather than written and read back)."""
        cost = self.cost(v)
        return cost <= 2 or (cost <= 11 and self.uses(v) == 2 and not self.broadcast_by_user(v))

    def broadcast_by_user(self, v: Value) -> bool:
        for u in self.users[id(v)]:
            user = self.by_id[u]
            space = set(user.edges).union(*(o.edges for o in user.operands))
            if space - set(v.edges):
                return True
        return False

    # ------------------------------------------------------------ partition

    def broadcast_edges(self, v: Value) -> set[str]:
        """Result edges of a reduction that no operand has: it is the same along them."""
        if v.op != "contract" or not self.is_reduction(v):
            return set()
        return set(v.edges) - {e for o in v.operands for e in o.edges}

    def materialize(self, v: Value) -> None:
        """Give `v` a buffer (a reduction's without its broadcast edges: loads repeat it)."""
        if id(v) not in self.mat:
            name = self.low.fresh("t")
            edges = tuple(e for e in v.edges if e not in self.broadcast_edges(v))
            self.low.buffers[name] = Buffer(name, self.dtype_of(v), edges, "temp")
            self.mat[id(v)] = name
            self._cost.clear()

    def dtype_of(self, v: Value) -> str:
        return "i32" if v.dtype == "i32" else self.opt.dtype

    def partition(self) -> None:
        for v in self.values:
            if id(v) in self.folded:
                continue
            if id(v) in self.shifted:
                self.materialize(v)
                for leaf in self.shifted[id(v)]["leaves"]:
                    self.materialize(leaf)
                continue
            if id(v) in self.cgemms:
                self.complex.materialize(v)
                continue
            if id(v) in self.mat:
                pass
            elif v.op == "scatter" or self.is_reduction(v) or self.root_uses[id(v)]:
                self.materialize(v)
            elif self.uses(v) > 1 and not self.recompute(v):
                self.materialize(v)
            elif self.cost(v) >= 10 and self.broadcast_by_user(v):
                self.materialize(v)
            elif self.inline_depth(v) > MAX_INLINE_DEPTH:
                self.materialize(v)
            groups = self.gemm_groups(v)
            if groups is not None:
                self.gemms[id(v)] = groups
                for o in v.operands:
                    base = peel(o, self.mat)[0]
                    if base.op != "arg":
                        self.materialize(base)
        self.settle()
        for v in self.values:
            if id(v) in self.mat and self.is_reduction(v) and id(v) not in self.gemms | self.shifted.keys() | self.cgemms.keys():
                self.try_absorb(v)

    def inline_depth(self, v: Value) -> int:
        """How deep `v`'s inlined expression tree is: 0 for a buffer or a leaf, else one
        more than its deepest operand. Operands come first in `self.values` and their
        depth only falls later (`settle` materializes more), so one lookup each."""
        if id(v) in self.mat or not v.operands:
            depth = 0
        else:
            depth = 1 + max(self._depth.get(id(o), 0) if id(o) not in self.mat else 0 for o in v.operands)
        self._depth[id(v)] = depth
        return depth

    def settle(self) -> None:
        """Materializing a product can hide an indicator from a contraction that was
        classified as an index transform: such a contraction becomes a reduction
        and is materialized too (monotone, so this ends)."""
        changed = True
        while changed:
            self._reduction.clear()
            changed = False
            for v in self.values:
                if id(v) not in self.mat and id(v) not in self.folded and self.is_reduction(v):
                    self.materialize(v)
                    changed = True

    def try_absorb(self, r: Value) -> None:
        """Make `r` the reduction of the elementwise kernel that consumes it, if any."""
        if self.uses(r) != 1 or self.root_uses[id(r)] or self.broadcast_edges(r):
            return
        u = self.by_id[next(iter(self.users[id(r)]))]
        while True:
            elementwise = u.op in ELEMENTWISE or (
                u.op == "contract" and not self.is_reduction(u) and not self.summed(u))
            if not elementwise or u.edges != r.edges or id(u) in self.absorb:
                return
            if id(u) in self.mat:
                break
            if self.uses(u) != 1:
                return
            u = self.by_id[next(iter(self.users[id(u)]))]
        if u.op == "scatter" or id(u) in self.gemms or id(u) in self.shifted or id(u) in self.cgemms \
                or self.is_reduction(u):
            return
        buf = self.mat.pop(id(r))
        del self.low.buffers[buf]
        self.absorb[id(u)] = r

    # ------------------------------------------------------------ expressions

    def expr(self, v: Value, env: dict[str, Ix]):
        if id(v) == self.acc_of:
            return Acc()
        if id(v) in self.mat:
            buf = self.mat[id(v)]
            return Load(buf, tuple((e, env[e]) for e in self.low.buffers[buf].edges))
        return self.define(v, env)

    def define(self, v: Value, env: dict[str, Ix]):
        """The expression computing `v` itself (its operands inlined or loaded)."""
        op = v.op
        if op == "const":
            return Const(v.attrs[0])
        if op == "size":
            return SizeOf(edge_size(self.m, v.attrs[0]))
        if is_identity(v):
            return self.expr(v.operands[0], env)
        if op == "rename":
            fwd = dict(v.attrs[0])
            x = v.operands[0]
            return self.expr(x, {e: env[fwd.get(e, e)] for e in x.edges})
        if op == "add":
            return Add(v.attrs[0], tuple(self.expr(o, env) for o in v.operands))
        if op == "map":
            if self.weight_sum(v):   # exp(d - lse): the sum inlined, though it has a buffer
                return Map("exp", (self.define(v.operands[0], env),))
            return Map(v.attrs[0], tuple(self.expr(o, env) for o in v.operands))
        if op == "indicator":
            return self.mask(relation_conds(self.m, v.attrs[0], env), Const(1.0))
        if op == "random":
            return self.random(v, env)
        if op == "gather":
            table, ids = v.operands
            tenv = {e: env[e] for e in table.edges if e != v.attrs[0]}
            tenv[v.attrs[0]] = Ix.of(self.idload(ids, env))
            return self.expr(table, tenv)
        if op == "contract":
            factors, sol, full = self.solve(v, env, "?")
            if sol.remaining:
                raise FuseError(f"internal: a reduction was inlined ({v})")
            return self.masked_product(sol.conds, factors, full)
        raise FuseError(f"internal: cannot inline '{op}'")

    def weight_sum(self, v: Value) -> bool:
        """Whether `v` is an f32 softmax weight exp(d - lse) (an exp of a sum with a
        logsumexp operand) whose sum is materialized (a log-softmax output, read
        elsewhere too). The exp then computes the sum again, inline, instead of loading
        it: the backends take such a sum unrounded into the exp (`lowered.wide_exp`),
        which a load of its f32 buffer cannot (with d - lse rounded first, a weight 85
        logits down its row had 85 ulps of error, 25x PyTorch's)."""
        if v.op != "map" or v.attrs[0] != "exp" or self.dtype_of(v) != "f32":
            return False
        o = v.operands[0]
        return (o.op == "add" and id(o) in self.mat and self.dtype_of(o) == "f32"
                and any(x.op == "reduce" and x.attrs[0] == "logsumexp" for x in o.operands))

    def product(self, factors: list[Value], env: dict[str, Ix]):
        exprs = tuple(e for e in (self.expr(f, env) for f in factors) if e != Const(1.0))
        return exprs[0] if len(exprs) == 1 else (Mul(exprs) if exprs else Const(1.0))

    def masked_product(self, conds, factors: list[Value], env: dict[str, Ix]):
        """The product of `factors` under the contraction's own conditions `conds`, with
        the conditions of masked factors (views through indicators, `x[h = ho + kh - 1]`
        inlined) taken out to the top: a term that one factor's indicator zeroes is zero
        in the contraction as a whole (the same reading as the contraction's own
        indicators), and a mask at the top is one `layout` can turn into loop bounds."""
        e = self.product(factors, env)
        conds = list(conds)
        if isinstance(e, Mul) and any(isinstance(a, Mask) for a in e.args):
            args = []
            for a in e.args:
                while isinstance(a, Mask):
                    conds += [c for c in a.conds if c not in conds]
                    a = a.arg
                args.append(a)
            e = Mul(tuple(args))
        return self.mask(conds, e)

    def mask(self, conds, e):
        sizes = {x: edge_size(self.m, x) for c in conds for x in c.ix.vars() if x in self.m.edges}
        kept = simplify_conds(conds, sizes)
        if kept is None:
            return Const(0.0)
        return Mask(tuple(kept), e) if kept else e

    def random(self, v: Value, env: dict[str, Ix]) -> Rand:
        """A draw, computed from the loop indices: its counter is the row-major index
        over the draw's own edges (sorted by name), whatever loops compute it."""
        counter, stride = Ix(), 1
        for e in reversed(v.edges):
            ix = env[e]
            counter = counter.plus(Ix.make([(a, smul(stride, c)) for a, c in ix.terms],
                                           0 if ix.const == 0 else smul(stride, ix.const)))
            stride = size_op("*", stride, edge_size(self.m, e))
        key = Ix.of(IdLoad(v.operands[0].attrs[0], ()))
        folds = tuple(Ix.of(IdLoad(v.operands[int(n[1:])].attrs[0], ())) if isinstance(n, str) else n
                      for n in v.attrs[1])
        return Rand(v.attrs[0], folds, key, counter, v.attrs[2])

    def idload(self, ids: Value, env: dict[str, Ix]) -> IdLoad:
        base, view = peel(ids)
        if base.op != "arg":
            raise FuseError("gather indices must come from an i32 input")
        index = {view[e]: env[e] for e in ids.edges}
        return IdLoad(base.attrs[0], tuple(sorted(index.items())))

    # ------------------------------------------------------------ kernels

    def lower(self) -> Lowered:
        for i, (name, a) in enumerate(self.m.args.items()):
            dtype = "i32" if a.dtype == "i32" else self.opt.dtype
            self.low.buffers[name] = Buffer(name, dtype, tuple(sorted(a.order)), "arg", i, a.order,
                                            lse=name in self.lse_args)
        for v in self.values:
            if v.op == "arg":
                self.mat[id(v)] = v.attrs[0]
        self.steps.prepare()
        copies = self.homes()
        self.taps.find()
        self.complex.find()
        self.partition()
        again = self.recomputed()
        for v in self.values:
            if v.op == "loop":
                self.low.kernels += self.steps.kernels(v)
            elif id(v) in self.mat and v.op != "arg":
                k = self.kernel(v)
                self.low.kernels.append(replace(k, note="recompute") if id(v) in again and not k.note else k)
        sink_recomputation(self.low.kernels)
        self.low.kernels += [self.copy(dst, src) for dst, src in copies]
        self.low.kernels += [self.copy(target, src) for target, src in self._late]
        self.checks()
        return self.low

    def recomputed(self) -> set[int]:
        """ids of the backward's recomputed copies (autodiff/remat.py): values computed only
        from `recompute(b)` markers and constants. `plan` runs their kernels as late as it
        can, so that a copy lives only while the backward uses it."""
        copies: set[int] = set()
        for v in self.values:
            if v.op == "map" and v.attrs[0] == "recompute":
                copies.add(id(v))
            elif v.op not in ("arg", "const", "size", "indicator") and \
                    all(id(o) in copies or o.op in ("const", "size", "indicator") for o in v.operands):
                copies.add(id(v))
        return copies

    def homes(self) -> list[tuple[str, Value | str]]:
        """Buffers of outputs and updates; returns the (dst, source) copies still needed
        (a source is a value, or the name of the buffer holding one)."""
        copies: list[tuple[str, Value | str]] = []
        for i, o in enumerate(self.m.outputs):
            if o.value.dtype == "i32":
                raise FuseError(f"output '{o.name}' is an integer tensor; the CPU backend computes floats")
            held = self.low.buffers.get(self.mat.get(id(o.value), ""))
            if held is not None and held.kind == "out" and held.index == i:   # a loop's result, written there (steps)
                continue
            name = o.name if o.name not in self.low.buffers else self.low.fresh(o.name + ".")
            self.low.buffers[name] = Buffer(name, self.opt.dtype, o.value.edges, "out", i, o.order)
            if o.value.op == "arg" or id(o.value) in self.mat:
                copies.append((name, o.value))
            else:
                self.mat[id(o.value)] = name
        self._late: list[tuple[str, Value | str]] = []
        for u in self.m.updates:
            v = u.value
            if v.op == "arg" or id(v) not in self.mat:
                tmp = self.low.fresh("t")
                self.low.buffers[tmp] = Buffer(tmp, self.opt.dtype, v.edges, "temp",
                                               prefer=self.m.args[u.target].order)
                if v.op == "arg":
                    copies.append((tmp, v))
                else:
                    self.mat[id(v)] = tmp
                self._late.append((u.target, tmp))
            else:
                self._late.append((u.target, self.mat[id(v)]))
        return copies

    def copy(self, dst: str, src: Value | str) -> LoopKernel:
        edges = self.low.buffers[dst].edges
        index = tuple((e, Ix.var(e)) for e in edges)
        body = Load(src, index) if isinstance(src, str) else self.expr(src, dict(index))
        note = f"update {dst}" if self.low.buffers[dst].kind == "arg" else "copy"
        return LoopKernel(dst, index, edges, self.var_sizes(edges), body, note=note)

    def var_sizes(self, edges) -> dict:
        return {e: edge_size(self.m, e) for e in edges}

    def kernel(self, v: Value):
        out = self.mat[id(v)]
        if id(v) in self.shifted:
            return self.taps.kernel(v, out)
        if id(v) in self.cgemms:
            return self.complex.kernel(v, out)
        if id(v) in self.gemms:
            batch, m, n, k = self.gemms[id(v)]
            a, b = (self.view(o) for o in v.operands)
            return GemmKernel(out, a, b, batch, m, n, k)
        ident = {e: Ix.var(e) for e in v.edges}
        index = tuple(ident.items())
        if v.op == "scatter":
            return self.scatter_kernel(v, out)
        if self.is_reduction(v):
            body, red, kind, env = self.reduction(v)
            kept = self.low.buffers[out].edges
            index = tuple((e, ident[e]) for e in kept)
            loops = tuple(kept) + tuple(red)
            return LoopKernel(out, index, loops, self.var_sizes(loops), body, kind, tuple(red))
        r = self.absorb.get(id(v))
        if r is None:
            return LoopKernel(out, index, v.edges, self.var_sizes(v.edges), self.define(v, ident))
        body, red, kind, env = self.reduction(r)
        self.acc_of = id(r)
        epilogue = self.define(v, ident)
        self.acc_of = None
        loops = tuple(v.edges) + tuple(red)
        return LoopKernel(out, index, loops, self.var_sizes(loops), body, kind, tuple(red), epilogue)

    def reduction(self, r: Value):
        """(body, reduced loop variables, kind) of a reduction over identity kept indices."""
        ident = {e: Ix.var(e) for e in r.edges}
        if r.op == "reduce":
            x = r.operands[0]
            env = {e: Ix.var(e) for e in x.edges}
            return self.expr(x, env), list(r.attrs[1]), r.attrs[0], env
        factors, sol, full = self.solve(r, ident, "")
        return self.masked_product(sol.conds, factors, full), sol.remaining, "sum", full

    def scatter_kernel(self, v: Value, out: str) -> LoopKernel:
        ct, ids = v.operands
        edge = v.attrs[0]
        loops = self.m.order_edges(set(ct.edges) | set(ids.edges))
        env = {e: Ix.var(e) for e in loops}
        index = tuple((e, Ix.of(self.idload(ids, env)) if e == edge else env[e]) for e in v.edges)
        kind = v.attrs[1]
        return LoopKernel(out, index, tuple(loops), self.var_sizes(loops), self.expr(ct, env),
                          "" if kind == "sum" else kind, scatter=True,
                          note="scatter" if kind == "sum" else f"segment {kind}")

    def view(self, o: Value) -> View:
        base, mapping = peel(o, self.mat)
        return View(self.mat[id(base)], tuple(sorted(mapping.items())))

    def checks(self) -> None:
        """One `Check` per (i32 argument, size) that a gather or scatter reads ids of,
        in a loop's step too: a step's ids are a slice (or the whole) of the loop's
        operand, so the check is on the argument that operand is a view of, before
        anything runs (a step lowered as a program of its own checks only its own
        parameters, which no backend binds to the caller's arrays)."""
        seen = set()

        def walk(values, outer: dict[int, Value | None], where: str) -> None:
            for v in values:
                if v.op in ("gather", "scatter"):
                    base, _ = peel(v.operands[1])
                    if base.op == "loopvar":
                        base = outer.get(base.attrs[0])
                    if base is None or base.op != "arg":
                        raise CompileError(f"the ids of a {v.op} along '{v.attrs[0]}'{where} are not an "
                                           f"i32 argument's view: they cannot be checked")
                    key = (base.attrs[0], edge_size(self.m, v.attrs[0]))
                    if key not in seen:
                        seen.add(key)
                        self.low.checks.append(Check(key[0], key[1], f"{v.op} along '{v.attrs[0]}'{where}"))
                elif v.op == "loop":
                    body, edge = v.attrs[0], v.attrs[1]
                    inner = {}
                    for k, o in enumerate(v.operands):
                        base, _ = peel(o)
                        if base.op == "loopvar":
                            base = outer.get(base.attrs[0])
                        inner[k] = base
                    walk(topo_order(list(body.results)), inner, f" in a step of the loop over '{edge}'")

        walk(self.values, {}, "")
