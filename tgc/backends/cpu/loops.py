"""Loop kernels as LLVM functions: a loop nest around a fused expression tree.

    void tgc.kN(const i64* dims, T* noalias out, T* noalias in..., i64 lo, i64 hi)

runs the outermost loop over [lo, hi) (the caller passes the full range, or one
thread's share when that loop is over a kept edge). Shapes of the nest:

Expressions carry no fast-math flags; `a * b + c`, a sum with one rounded term and
that a product, is one llvm.fma (`fma_term`), never two rounded products in one FMA.

- register mode (every reduced loop inside every kept loop): an accumulator that
  LLVM keeps in registers (vectorized with `reassoc` on the combining fadd — the
  only fast-math flag besides `contract`, which allows FMA; neither under
  --fp-strict; a long f32 sum accumulates in f64, a short one in f32 lanes over
  chunks whose sums are added in f64), then the epilogue,
  then one store; `logsumexp` makes two passes over the reduced loops (the max,
  then the sum of exp(x - max)) and always runs in this mode;
- memory mode (a reduced loop outside a kept one, e.g. summing rows of a row-major
  matrix; where every reduced loop is unrolled, register mode with them innermost
  instead, the same terms in the same order: `unrolled_reduction`):
  initialize `out`, combine into it in the nest, then apply the epilogue; an
  f32 sum whose kept elements inside the reduced loop are few enough (`CpuOptions.wide_scratch`)
  adds into an f64 scratch row on the stack instead, rounded once into `out`;
- scatter: zero `out`, then add each element at its gathered position (an f32
  scatter-add whose output has at most `CpuOptions.wide_scratch` known elements and
  more than `CpuOptions.sum_chunk` terms per element adds into an f64 scratch copy of
  it on the stack instead, each element rounded once into `out`: `LoopGen.scatter`);
  a segment max/min (`reduce` set on a scatter) fills `out` with -inf/inf and combines
  with llvm.maximum/minimum (NaN-propagating, like `max[e]`).

A group (`LoopGroup`) is one function: its outer loops (the first split between
threads, by blocks when it has partial sums), and inside them each member's own
loops in one of the shapes above, with the outer variables fixed; a member in
`regs` leaves its value in a register for the members after it; a partial member
adds into its block's row without initializing it (an f32 sum over a block of more
than `short_rows` rows adds into an f64 scratch row first, `wide_partials`).

Loops of at most `CpuOptions.unroll_max` known iterations are unrolled, from the
innermost out, while the copies of the body stay within `CpuOptions.unroll_copies`
(`unrolled`): the loop around
them is then the innermost one, which LLVM vectorizes. Each copy computes what one
iteration did, in loop order, and which loops unroll depends on the kernel alone
(never on the thread count).

`Mask` becomes a branch around its operand, so loads under a false condition are
never executed; LLVM if-converts it into masked vector loads. A mask around an
operand that loads nothing (a causal mask's 1.0) is a select, which vectorizes.

Band masks (`CpuOptions.mask_ones_prefix`, `mask_prefix_plan`). A causal stream's step
reads its mask as a vector `m[v - w + c]` (v the innermost loop, w an outer one: a
key, a query row), as a `where` condition or a factor, at every element, though in a
long run only the last few hundred keys of each row are masked. Such a kernel counts
the leading elements of `m` that are exactly 1.0 once per call (a scan that stops at
the first other value), and runs each innermost loop in two parts: below the split
(v - w + c inside that prefix, rounded down to whole multiples of `mask_ones_prefix`
iterations, so that neither part ends in a scalar remainder the loop did not have:
64, LLVM's 16 f32 lanes interleaved 4 times) the load is the constant 1.0, which LLVM folds away
(`where(1.0, a, b)` is `a`, `1.0 * x` is `x`), and from the split on, the body as
before. Exact: the constant is the value the load would read, and the elements are
visited in the same order. Only elementwise members and register-mode max, min and
maxshift reductions split (a sum's vector lanes would take another order). The other
members of the function compute what they did, but LLVM may vectorize a reassociated
sum among them (its lanes are LLVM's choice, `reassoc`) otherwise once the function
around it changed: in causal attention's backward step, dS's row sum D took other
lanes (dq and dk within 2.4e-7 of the option off at t = 8192 4 x 2 in f32, 6e-17 in
f64 at t = 64; y and dv the same bits). The scan costs one pass over the prefix per
call, against rows x keys elements of the loops it serves. Terminates: the scan and
both parts are counted loops.
"""
from __future__ import annotations

import llvmlite.ir as ir
import numpy as np

from tgc.backends.cpu.elementwise import FLAGS, emit_map, intrinsic, narrow_to, storage_type, widen
from tgc.backends.cpu.irutil import I64, PTR, Frame, define, for_range, offset, optimize_not
from tgc.lower.lowered import (Acc, Add, Const, ExprVisitor, FloorDiv, IdLoad, Ix, Load, LoopKernel, Lowered, Map,
                            Mask, Mul, Rand, SizeOf, logsumexp_outputs, walk, wide_exp, wide_sum,
                            wide_term_factors)
from tgc.backends.cpu.philox import emit_draw
from tgc.ir.sizes import size_op
from tgc.backends.cpu.llvm_env import has_feature
from tgc.opt.canon import exact_scale
from tgc.backends.cpu.group import BLOCK_EDGE as BLOCK, LoopGroup
from tgc.backends.cpu.options import CpuOptions
from tgc.options import Options

INIT = {"sum": 0.0, "max": float("-inf"), "min": float("inf"), "maxshift": float("-inf")}


def kernel_buffers(k: LoopKernel | LoopGroup) -> list[str]:
    return k.buffers_used()


def parallel_ok(k: LoopKernel | LoopGroup) -> bool:
    if isinstance(k, LoopGroup):
        return True
    return bool(k.loops) and k.loops[0] not in k.red and not k.scatter


def short_rows(cpu: CpuOptions) -> int:
    """The rows beyond which an f32 memory-mode sum goes through an f64 scratch row
    (f32 lanes carry at most this many terms): `cpu.short_sum` // 64."""
    return cpu.short_sum // 64


def split_loops(k: LoopKernel | LoopGroup, cpu: CpuOptions) -> tuple[str, ...]:
    """The loops whose iterations threads share, as one range: the outermost, or the
    outermost ones while their product is short (under `cpu.loop_split_min`: 3 heads
    do not split well over 2 threads; a key-block step's `[batch, head, ..]` kernels
    at one head of one sequence had a range of 1, and thread 0 ran every elementwise
    kernel of the step), each taken loop kept (not summed, no bounds) and not the
    vectorized innermost loop."""
    loops = k.outer if isinstance(k, LoopGroup) else k.loops
    if not loops or (isinstance(k, LoopGroup) and k.blocks):
        return ()
    if isinstance(k, LoopKernel) and (loops[0] in k.red or k.scatter or k.bounds.get(loops[0])):
        return ()   # a sum's loop (with its bounds), a scatter's: never shared
    taken, n = 1, k.sizes[loops[0]]
    while taken < len(loops) and isinstance(n, int) and n < cpu.loop_split_min:
        nxt = loops[taken]
        if isinstance(k, LoopGroup):   # a loop of the group's nest stays inside, or each member's own
            ok = len(loops) > taken + 1 or all(len(m.loops) > len(loops) for m in k.members)
        else:
            ok = len(loops) > taken + 1 and nxt not in k.red and not k.bounds.get(nxt)
        if not ok:
            break
        n, taken = size_op("*", n, k.sizes[nxt]), taken + 1
    return tuple(loops[:taken])

def split_count(f: Frame, k: LoopKernel | LoopGroup, cpu: CpuOptions):
    """The length of the range threads split (i64): the product of the split loops'
    extents, or a blocked group's blocks: `blocks`, fewer when the outer loop is
    short (each block at least `cpu.group_min_block_rows` rows long, an index of the
    blocked range counting as many rows as a member enters its innermost loop for it
    (`rows_per_index`), or `cpu.group_min_vector_block_rows` indices when the
    rows are what LLVM vectorizes, so that its main vector loop runs; partial-sum rows
    past the last are zeros)."""
    if isinstance(k, LoopGroup) and k.blocks:
        b = f.entry
        if rows_vectorized(k, cpu):
            rows = cpu.group_min_vector_block_rows
        else:
            rows = -(-cpu.group_min_block_rows // rows_per_index(k, cpu))
        per = b.sdiv(blocked_extent(f, k, cpu), I64(rows))
        nb = b.select(b.icmp_signed("<", per, I64(k.blocks)), per, I64(k.blocks))
        return b.select(b.icmp_signed("<", nb, I64(1)), I64(1), nb)
    total = 1
    for v in split_loops(k, cpu):
        total = size_op("*", total, k.sizes[v])
    return f.size(total)


def blocked_loops(g: LoopGroup, cpu: CpuOptions) -> tuple[str, ...]:
    """The outer loops a blocked group's blocks divide, as one range: the first, or
    the first ones while their product is short (under `loop_split_min` or two blocks of
    `group_min_block_rows`; 3 heads: at most 3 blocks, so one thread ran a whole
    attention softmax; 2 x 4 batches and heads of a streamed step's `[B, s]` rows: one
    block, one thread) and no member sums over the loops before the last one taken
    (partial sums are per block of the first loop alone)."""
    k, n = 1, g.sizes[g.outer[0]]
    while k < len(g.outer) and isinstance(n, int) and n < max(cpu.loop_split_min, 2 * cpu.group_min_block_rows) \
            and not any(g.outer[k - 1] in m.red for m in g.members):
        n, k = size_op("*", n, g.sizes[g.outer[k]]), k + 1
    return g.outer[:k]


def rows_per_index(g: LoopGroup, cpu: CpuOptions) -> int:
    """How many rows (entries into its innermost loop) the member with most of them
    runs per index of a blocked group's blocked range (`blocked_loops`): the product of
    its loops' known extents between the blocked loops and its innermost loop (a
    symbolic one counts 1). A layernorm's backward over `batch < 4, t < 256`, blocked
    over the batch alone (its members sum over it, so `blocked_loops` stops there),
    runs 256 rows of 384 channels per batch index: 4 blocks of one index each, where 16
    indices a block made one block and one thread ran it all (0.7 ms a layer of
    nanoGPT's backward step with the other thread idle)."""
    blocked = set(blocked_loops(g, cpu))
    most = 1
    for m in g.members:
        rows = 1
        for v in [v for v in m.loops if v not in blocked][:-1]:
            n = m.sizes[v]
            rows *= n if isinstance(n, int) and n > 0 else 1
        most = max(most, rows)
    return most


def blocked_extent(f: Frame, g: LoopGroup, cpu: CpuOptions):
    """i64: the length of the range a blocked group's blocks divide (`blocked_loops`)."""
    total = I64(1)
    for v in blocked_loops(g, cpu):
        total = f.entry.mul(total, f.size(g.sizes[v]))
    return total


def unrolled(k: LoopKernel, v: str, cpu: CpuOptions) -> bool:
    """Whether `LoopGen.nest` unrolls loop `v` of `k`: a few known iterations (at most
    `cpu.unroll_max`), no bounds, and within `cpu.unroll_copies`. Short loops are unrolled from the innermost out
    while the product of their lengths (the copies of the innermost body) stays within
    it. Unrolled without a limit, nested short loops multiplied the code LLVM
    vectorizes: a 2x2 max-pool's gradient over 4 x 4 pooled positions (loops 4, 2, 4,
    2 around 32 channels) was 64 copies, 3,500 lines of LLVM IR; a small convolution's
    4 output channels around its 3 kernel columns 12 copies and 0.6 s of LLVM's time."""
    copies = 1
    for u in reversed(k.loops):
        n = k.sizes[u]
        if not isinstance(n, int) or n > cpu.unroll_max or any(k.bounds.get(u, ((), ()))):
            continue
        copies *= n
        if copies > cpu.unroll_copies:
            return False
        if u == v:
            return True
    return False


def unrolled_reduction(k: LoopKernel, loops: list[str], cpu: CpuOptions) -> bool:
    """Whether a reduction that memory mode would run over `loops` (a reduced loop
    outside a kept one) runs in register mode instead, its reduced loops moved inside
    the kept ones (`LoopGen.member`): every reduced loop is unrolled (`unrolled`: a
    few known iterations, at most `unroll_copies` terms, never more than `short_rows`,
    so not a sum for the f64 scratch row) and the kernel is a sum, max or min. Each
    element then combines the same terms in the same order from the same initial value
    (the unrolled loops' order, no `reassoc`: `LoopGen._accumulate`), so the values are
    memory mode's, bit for bit, and the output is written once instead of initialized
    and then read and written again for every term. A 2-D convolution's input
    gradient sums its product over the 3 kernel columns (`sum[kw]` of a masked, shifted
    read): memory mode zeroed dx and made three passes over each channel's rows (one
    thread, conv2d_sym at 16 x 32 -> 64, 32 x 32, the sum alone: 0.92 -> 0.61-0.68 ms)."""
    red = [v for v in loops if v in k.red]
    if not red or k.scatter or k.reduce not in ("sum", "max", "min"):
        return False
    terms = 1
    for v in red:
        if not unrolled(k, v, cpu):
            return False
        terms *= k.sizes[v]
    return terms <= short_rows(cpu)


def fma_term(e: Add) -> int | None:
    """The term of `e` computed as an FMA with the sum of the others, if any: the only
    rounded term, and a product. A rounded term is a product, a quotient, or scaled by
    a c other than +-2^k; with two of them, ab - cd at a = b (= c = d) would not be 0
    (an unrounded product less a rounded one), as it is term by term and in PyTorch.
    With one, the FMA rounds once where the sum rounded twice. Only where the CPU has
    FMA instructions (elsewhere llvm.fma is a call)."""
    if len(e.args) < 2 or not has_feature("fma"):
        return None
    rounded = [i for i, (c, a) in enumerate(zip(e.coefs, e.args))
               if not exact_scale(c) or isinstance(a, Mul) or (isinstance(a, Map) and a.fn == "div")]
    if len(rounded) == 1 and isinstance(e.args[rounded[0]], Mul) and len(e.args[rounded[0]].args) >= 2:
        return rounded[0]
    return None


class _IndexVars(ExprVisitor):
    """The loop variables an expression's value depends on (through its loads' and
    draws' indices), added to `out`; an accumulator's value depends on every one (None
    in the set)."""

    def ix(self, ix: Ix, out: set) -> None:
        for atom, _ in ix.terms:
            self.atom(atom, out)

    def atom_var(self, a: str, out: set) -> None:
        out.add(a)

    def atom_id_load(self, a: IdLoad, out: set) -> None:
        for _, sub in a.index:
            self.ix(sub, out)

    def atom_floor_div(self, a: FloorDiv, out: set) -> None:
        self.ix(a.num, out)

    def expr_load(self, e: Load, out: set) -> None:
        for _, ix in e.index:
            self.ix(ix, out)

    def expr_rand(self, e: Rand, out: set) -> None:
        self.ix(e.key, out)
        self.ix(e.counter, out)

    def expr_acc(self, e: Acc, out: set) -> None:
        out.add(None)

    def expr_add(self, e, out: set) -> None:
        for a in e.args:
            self.expr(a, out)

    expr_mul = expr_map = expr_add

    def expr_mask(self, e: Mask, out: set) -> None:
        self.expr(e.arg, out)

    def expr_const(self, e, out: set) -> None:
        pass

    expr_size_of = expr_const


_INDEX_VARS = _IndexVars()


def _index_vars(e) -> set:
    """The loop variables an expression's value depends on (`_IndexVars`)."""
    out: set = set()
    _INDEX_VARS.expr(e, out)
    return out


def factor_order(args) -> list[int]:
    """The order in which a product's factors are multiplied: those that depend on
    fewer loop variables first (stable). The product of the factors an inner loop does
    not change is then a prefix that LLVM hoists out of it: a layernorm's gradient
    term xhat * g * r * r / d takes one multiplication per element, not four. Each
    order rounds n - 1 times (the same error bound); the order is a function of the
    expression alone, so an expression recomputed in another kernel or loop nest has
    the same bits there. Not under --fp-strict (the source's order)."""
    keys = [len(_index_vars(a)) + (1000 if None in _index_vars(a) else 0) for a in args]
    return sorted(range(len(args)), key=lambda i: keys[i])


SPLIT_REDUCTIONS = ("", "max", "min", "maxshift")   # a split loop leaves their results as they were


def mask_prefix_plan(low: Lowered, k: LoopKernel, outer, written) -> tuple[str, Ix, str] | None:
    """(buffer, its index, the innermost loop v) where member `k` (its loops in `outer`
    fixed by a group) reads a band mask whose leading 1.0s its innermost loop may skip
    (module docstring, "Band masks"); None otherwise. The mask: a 1-D buffer of the
    program's float type that no member writes (`written`), every load of it in `k`'s
    body at one index `v - w + c` (w another of `k`'s loops, c a constant), read as a
    `where` condition or a factor of a product at least once."""
    if k.scatter or k.reduce not in SPLIT_REDUCTIONS or not k.loops:
        return None
    loops = [v for v in k.loops if v not in outer]
    if not loops:
        return None
    v = loops[-1]
    if k.reduce and v not in k.red:
        return None
    nodes = list(walk(k.body))
    cands = []
    for n in nodes:
        if isinstance(n, Map) and n.fn == "where" and isinstance(n.args[0], Load):
            cands.append(n.args[0])
        elif isinstance(n, Mul):
            cands += [a for a in n.args if isinstance(a, Load)]
    for c in cands:
        buf = low.buffers.get(c.buf)
        if buf is None or c.buf in written or len(c.index) != 1 or len(buf.edges) != 1 or buf.dtype not in ("f32", "f64"):
            continue
        ix = c.index[0][1]
        terms = dict(ix.terms)
        if (len(terms) != 2 or terms.get(v) != 1 or not all(isinstance(a, str) for a in terms)
                or not isinstance(ix.const, int)):
            continue
        w = next(a for a in terms if a != v)
        if terms[w] != -1 or w not in k.loops:
            continue
        if any(isinstance(n, Load) and n.buf == c.buf and n.index != c.index for n in nodes):
            continue
        return c.buf, ix, v
    return None


def rows_vectorized(g: LoopGroup, cpu: CpuOptions) -> bool:
    """Whether a group has one outer loop (its rows) and every loop inside it is
    unrolled, so that the rows loop is the one LLVM vectorizes."""
    return len(g.outer) == 1 and all(unrolled(m, v, cpu) for m in g.members for v in m.loops if v not in g.outer)


class LoopGen(ExprVisitor):
    """One loop kernel, or a group of them inside shared outer loops, as a function.
    Expressions become LLVM values through its `expr_*` and `atom_*` methods
    (`ExprVisitor`), given the loop variables `vars` and the reduced value `acc`."""

    def __init__(self, mod: ir.Module, low: Lowered, k: LoopKernel | LoopGroup, name: str, fp,
                 options: Options):
        self.low, self.top, self.k, self.fp = low, k, k, fp
        # fast-math flags: none in expressions, so that one expression computes the same
        # bits in every kernel and loop that recomputes it (a max's gradient compares the
        # max with its recomputed argument: an FMA in one place and not the other made
        # that test fail, and the gradient 0 or NaN). An FMA is an explicit llvm.fma,
        # chosen from the expression alone (`fma_term`). `reassoc` (vector lanes) and
        # `contract` (the FMA of the last product into the sum) only on the accumulation
        # of a reduction loop LLVM vectorizes itself (`_accumulate`), or a partial sum
        # carried by a block's rows loop. None of these under --fp-strict
        self.strict = options.fp_strict
        self.cpu = options.cpu
        self.sum_flags: tuple = ()
        self.fused_term = None   # the body whose last product may fuse into the accumulation
        self.lse: frozenset[str] | None = None   # logsumexp kernels' buffers (lse_buffers), when asked
        self.bufs = kernel_buffers(k)
        # hidden, not internal: LLVM would otherwise propagate the constant range [0, n)
        # of a program whose only caller is serial (one thread) into the function, and
        # a sum it may reassociate (a reduction's `reassoc`) then took another order
        # than the same function called by threads (the bits of a 1-D convolution's
        # input gradient differed between 1 and 2 threads)
        fn = define(mod, name, ir.VoidType(), [PTR] * (1 + len(self.bufs)) + [I64, I64], internal=False)
        fn.linkage = "hidden"
        for a in fn.args[: 1 + len(self.bufs)]:
            a.add_attribute("noalias")
        fn.attributes.add("noinline")  # optimized once, not again in each caller
        self.fn = fn
        self.f = Frame(fn, low.module, fn.args[0], low.edges)
        self.b = self.f.b
        self.ptr = dict(zip(self.bufs, fn.args[1:]))
        self.lo, self.hi = fn.args[-2], fn.args[-1]
        self.split = () if isinstance(k, LoopGroup) else split_loops(k, self.cpu)
        self.reg_names = set(k.regs) if isinstance(k, LoopGroup) else set()
        self.wide_rows: dict = {}   # a blocked group's partial members summed in f64 (`wide_partials`)
        self.regs: dict[str, ir.Value] = {}
        self.prefix_plans: dict[int, tuple] = {}   # id(member) -> mask_prefix_plan's (buffer, index, loop)
        self.ones: dict[str, ir.Value] = {}        # a band mask -> its count of leading 1.0s (this call's)
        self.ones_plan = None                       # the plan of the member whose loops are being emitted
        self.known_ones: set[str] = set()           # masks whose loads are 1.0 in the loop being emitted

    # ------------------------------------------------------------ nest

    def emit(self) -> ir.Function:
        self.plan_prefixes()
        if isinstance(self.top, LoopGroup):
            self.group(self.top)
        else:
            self.member(self.top, {})
        self.b.ret_void()
        self.f.finish()
        return self.fn

    def plan_prefixes(self) -> None:
        """Each member's `mask_prefix_plan`, and for each mask planned, its leading 1.0s
        counted once at the start of the call (`CpuOptions.mask_ones_prefix`)."""
        if self.strict or self.cpu.mask_ones_prefix <= 0:
            return
        g = self.top
        members = g.members if isinstance(g, LoopGroup) else (g,)
        outer = set(g.outer) if isinstance(g, LoopGroup) else set()
        written = {m.out for m in members}
        for m in members:
            plan = mask_prefix_plan(self.low, m, outer, written)
            if plan is not None and plan[0] in self.ptr:
                self.prefix_plans[id(m)] = plan
                if plan[0] not in self.ones:
                    self.ones[plan[0]] = self.leading_ones(plan[0])

    def leading_ones(self, name: str) -> ir.Value:
        """i64: how many leading elements of the 1-D buffer `name` are exactly 1.0 (a
        loop that stops at the first other value or at the end)."""
        b, buf = self.b, self.low.buffers[name]
        et = storage_type(buf.dtype, self.fp)
        n = self.f.count(buf.edges)
        fn = b.block.function
        head = fn.append_basic_block("ones.head")
        body = fn.append_basic_block("ones.body")
        done = fn.append_basic_block("ones.done")
        pre = b.block
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(I64, name="ones")
        i.add_incoming(I64(0), pre)
        b.cbranch(b.icmp_signed("<", i, n), body, done)
        b.position_at_end(body)
        x = b.load(self.address(name, ((buf.edges[0], Ix.var("ones")),), {"ones": i}, et), typ=et)
        i.add_incoming(b.add(i, I64(1), flags=["nsw"]), body)
        b.cbranch(b.fcmp_ordered("==", x, ir.Constant(et, 1.0)), head, done)
        b.position_at_end(done)
        return i

    def prefix_split(self, v: str, vars: dict, leaf) -> None:
        """Loop `v` (innermost) in two parts: where the planned mask's index is in its
        leading 1.0s, the mask's loads are that constant; then the rest as before."""
        b = self.b
        buf, ix, _ = self.ones_plan
        lo, hi = self.extent(v, vars)
        split = b.sub(self.ones[buf], self.ix(ix, {**vars, v: I64(0)}))   # v < split <=> index < count
        split = b.select(b.icmp_signed("<", split, hi), split, hi)
        split = b.select(b.icmp_signed(">", split, lo), split, lo)
        # whole multiples of `mask_ones_prefix` iterations below the split (the rest run
        # masked): neither part then ends in a scalar remainder where the loop had none
        # (LLVM's vector loop takes 16 f32 lanes, interleaved up to 4 times)
        step = I64(self.cpu.mask_ones_prefix)
        split = b.add(lo, b.mul(b.sdiv(b.sub(split, lo), step), step))
        self.known_ones.add(buf)
        with for_range(b, lo, split, v) as i:
            leaf({**vars, v: i})
        self.known_ones.discard(buf)
        with for_range(b, split, hi, v) as i:
            leaf({**vars, v: i})

    def group(self, g: LoopGroup) -> None:
        """The outer loops (this call's share of the split ones, or of the blocks),
        then each member."""
        b, first = self.b, g.outer[0]

        streams = self.next_row_streams(g)

        def members(vars: dict) -> None:
            for buf in streams:
                self.prefetch_next(buf, vars[first])
            for m in g.members:
                self.member(m, vars)

        if not g.blocks:
            split = split_loops(g, self.cpu)
            self.k = g  # the split loops' sizes
            self.split_nest(split, [], {},
                            lambda vs: self.plain_nest(list(g.outer[len(split):]), g.sizes, vs, members))
            return
        rows = blocked_loops(g, self.cpu)
        n, nb = blocked_extent(self.f, g, self.cpu), split_count(self.f, g, self.cpu)
        wide = self.wide_partials(g)

        def block(blk, start, end, wide_rows: dict) -> None:
            # (the whole scratch row is zeroed and added, whatever bounds the member's loops have)
            self.wide_rows = wide_rows
            for m, row, inner in wide_rows.values():
                self.k = m
                self.plain_nest(inner, m.sizes, {BLOCK: blk},
                                lambda vs: b.store(ir.Constant(ir.DoubleType(), 0.0), row(vs)))
            with for_range(b, start, end, ".".join(rows), fold_tail=rows_vectorized(g, self.cpu)) as i:
                vars = {}
                for v in reversed(rows[1:]):   # i in the mixed radix of the rows' extents
                    nv = self.f.size(g.sizes[v])
                    vars[v], i = b.srem(i, nv), b.sdiv(i, nv)
                vars[first] = i
                self.plain_nest(list(g.outer[len(rows):]), g.sizes, {BLOCK: blk, **vars}, members)
            for m, row, inner in wide_rows.values():   # each element rounded once into the block's row
                self.k = m
                self.plain_nest(inner, m.sizes, {BLOCK: blk}, lambda vs: self.store(vs, b.fadd(
                    self.load_out(vs), b.fptrunc(b.load(row(vs), typ=ir.DoubleType()), self.fp))))
            self.wide_rows = {}

        with for_range(b, self.lo, self.hi, BLOCK) as blk:
            start = b.sdiv(b.mul(blk, n), nb)
            end = b.sdiv(b.mul(b.add(blk, I64(1)), n), nb)
            if not wide:
                block(blk, start, end, {})
            else:   # (LLVM folds the branch for a known number of rows)
                long = self.long_block(b.sub(end, start), rows, wide)
                with b.if_else(long) as (then, otherwise):
                    with then:
                        block(blk, start, end, wide)
                    with otherwise:
                        block(blk, start, end, {})

    def long_block(self, n, rows: tuple[str, ...], wide: dict) -> ir.Value:
        """i1: whether a block of `n` rows (over the loops `rows`) sums its `wide`
        members in f64 scratch: it has more than `short_rows` rows, or a member adds
        more than `short_rows` terms into an element of its partial row (the rows
        times the member's other reduced loops). The sum of squares of a 256 x 8192
        gradient, in 32 blocks of 8 rows, added 65536 terms per block in f32 lanes: 27
        ulps off, where PyTorch's f32 sum is within one. A scalar loss over [b, v]
        (KL of two softmaxes, 8 x 512 in 8 blocks of one row) added its 512 terms per
        block into the f32 partial one by one: 7.5 ulps off (PyTorch 0.5); the f64
        scratch of one element costs a zeroing and a rounding per block."""
        b = self.b
        long = b.icmp_signed(">", n, I64(short_rows(self.cpu)))
        for m, _, _ in wide.values():
            terms = 1
            for v in m.red:
                if v not in rows:
                    terms = size_op("*", terms, m.sizes[v])
            if terms != 1:
                many = b.icmp_signed(">", b.mul(n, self.f.size(terms)), I64(short_rows(self.cpu)))
                long = b.or_(long, many)
        return long

    def wide_partials(self, g: LoopGroup) -> dict:
        """The members of a blocked group that add an f32 sum over its rows into their
        block's row of a partial buffer, when their kept elements (known sizes, at most
        `cpu.wide_scratch`) fit an f64 scratch row on the stack: id(member) -> (the member, the
        address of an element's f64 accumulator given the loop variables, its kept loops).
        Added into the f32 partial row, each element took one rounding per row of its
        block, and a lane of the vectorized rows loop carried rows / 32 / lanes terms
        (a sum of 10^6 squares sharing the loop with another sum: 1.9e-5 relative,
        PyTorch 1.6e-7); in f64 each is rounded once. Used for blocks of more than
        `short_rows` rows or more than `short_rows` terms per element (`long_block`)."""
        if self.strict or self.fp != ir.FloatType():
            return {}
        out = {}
        for m in g.members:
            if m.reduce != "sum" or not set(m.red) & set(g.outer) or m.out in self.reg_names:
                continue
            inner = [v for v in m.loops if v not in m.red]   # outer ones too (a bias gradient's d)
            sizes = [m.sizes[v] for v in inner]
            if not all(isinstance(n, int) for n in sizes) or not 0 < int(np.prod(sizes)) <= self.cpu.wide_scratch:
                continue
            row = self.f.entry.alloca(ir.DoubleType(), size=I64(int(np.prod(sizes))), name="wide.partial")
            out[id(m)] = (m, self.scratch_slot(m, inner, row), inner)
        return out

    def scratch_slot(self, m: LoopKernel, inner: list[str], row):
        """vars -> the address in `row` (row-major over `inner`, m's known sizes)."""
        def slot(vs):
            off = I64(0)
            for v in inner:
                off = self.b.add(self.b.mul(off, I64(m.sizes[v]), flags=["nsw"]), vs[v], flags=["nsw"])
            return self.b.gep(row, [off], inbounds=True, source_etype=ir.DoubleType())
        return slot

    def next_row_streams(self, g: LoopGroup) -> list[str]:
        """The buffers a one-loop group reads row by row from memory: read by some
        member at `[row, ...]` with `row` its outer variable leading the buffer's
        order, and written by none (a layernorm's x and dy)."""
        if len(g.outer) != 1:
            return []
        row = Ix.var(g.outer[0])
        written = {m.out for m in g.members}
        out = []
        for m in g.members:
            for root in [m.body] + ([m.epilogue] if m.epilogue is not None else []):
                for node in walk(root):
                    buf = self.low.buffers.get(node.buf) if isinstance(node, Load) and node.buf in self.ptr else None
                    order = buf.order if buf is not None else ()   # (registers are no buffers)
                    if (order and node.buf not in written and node.buf not in out
                            and dict(node.index).get(order[0]) == row):
                        out.append(node.buf)
        return out

    def prefetch_next(self, buf: str, row) -> None:
        """Ask for the next row of `buf` (its first `cpu.prefetch_row_bytes`; none when a row
        is shorter than `cpu.prefetch_min_row_bytes`) while this one is worked on: a long row
        starts a new page, where the hardware's prefetchers stop, so without this the
        first member that reads a row waits for memory. A layernorm's forward and
        backward over 4096 x 1024 (the group reads x and dy; minimum Mcycles of 60
        calls, both builds alternated in one process): 11.85 -> 9.91 on one thread,
        7.09 -> 6.39 on two; softmax 6.12 -> 5.55 and hvp 4.62 -> 4.21 on two."""
        b = self.b
        order = self.low.buffers[buf].order
        et = storage_type(self.low.buffers[buf].dtype, self.fp)
        width = et.width // 8 if isinstance(et, ir.IntType) else (4 if isinstance(et, ir.FloatType) else 8)
        per_line = 64 // width
        stride = self.f.strides(order)[order[0]]
        count = b.select(b.icmp_signed("<", stride, I64(self.cpu.prefetch_row_bytes // width)), stride,
                         I64(self.cpu.prefetch_row_bytes // width))
        base = b.gep(self.ptr[buf], [b.mul(b.add(row, I64(1)), stride)], source_etype=et)
        fn = self.b.module.globals.get("llvm.prefetch.p0") or ir.Function(
            self.b.module, ir.FunctionType(ir.VoidType(), [PTR, ir.IntType(32), ir.IntType(32), ir.IntType(32)]),
            "llvm.prefetch.p0")
        lines = b.sdiv(b.add(count, I64(per_line - 1)), I64(per_line))
        lines = b.select(b.icmp_signed("<", stride, I64(self.cpu.prefetch_min_row_bytes // width)), I64(0), lines)
        with for_range(b, I64(0), lines, "pf", unroll=False) as i:
            at = b.gep(base, [b.mul(i, I64(per_line))], source_etype=et)
            b.call(fn, [at, ir.IntType(32)(0), ir.IntType(32)(3), ir.IntType(32)(1)])

    def plain_nest(self, loops: list[str], sizes, vars: dict, leaf) -> None:
        if not loops:
            leaf(vars)
            return
        with for_range(self.b, I64(0), self.f.size(sizes[loops[0]]), loops[0]) as i:
            self.plain_nest(loops[1:], sizes, {**vars, loops[0]: i}, leaf)

    def split_nest(self, split, rest: list[str], vars: dict, leaf) -> None:
        """This call's share [lo, hi) of the split loops (several: one range, divided;
        each variable a digit of the index in the mixed radix of their extents)."""
        b = self.b
        if len(split) == 1:
            with for_range(b, self.lo, self.hi, split[0]) as i:
                self.nest(rest, {**vars, split[0]: i}, leaf)
            return
        with for_range(b, self.lo, self.hi, ".".join(split)) as i:
            own = {}
            for v in reversed(split[1:]):
                n = self.f.size(self.k.sizes[v])
                own[v], i = b.srem(i, n), b.sdiv(i, n)
            own[split[0]] = i
            self.nest(rest, {**vars, **own}, leaf)

    def member(self, k: LoopKernel, vars: dict) -> None:
        """Kernel `k`'s loops other than those `vars` fixes (a group's outer loops)."""
        self.k = k
        loops = [v for v in k.loops if v not in vars]
        kept = [v for v in loops if v not in k.red]
        register = not k.scatter and all(loops.index(r) > loops.index(v)
                                         for r in k.red if r in loops for v in kept)
        if k.scatter:
            self.scatter(loops, vars)
        elif not k.reduce:
            self.ones_plan = self.prefix_plans.get(id(k))
            self.nest(loops, vars, lambda vs: self.store(vs, self.expr(k.body, vs)))
            self.ones_plan = None
        elif set(k.red) & set(vars) and id(k) in self.wide_rows:  # a partial sum, in f64 for the block
            row = self.wide_rows[id(k)][1]
            saved = self.sum_flags, self.fused_term
            self.sum_flags, self.fused_term = ("reassoc", "contract"), k.body
            self.nest(loops, vars, lambda vs: self.b.store(self.b.fadd(
                self.b.load(row(vs), typ=ir.DoubleType()), self.b.fpext(self.expr(k.body, vs), ir.DoubleType()),
                flags=self.sum_flags), row(vs)))
            self.sum_flags, self.fused_term = saved
        elif set(k.red) & set(vars):  # a partial sum: add into the block's row
            saved = self.sum_flags, self.fused_term
            if k.reduce == "sum" and not self.strict:
                # the rows loop LLVM vectorizes carries this sum: lanes (reassoc) and
                # FMA (contract). Blocks split the rows independently of the thread
                # count, so the lanes are the same on any number of threads
                self.sum_flags, self.fused_term = ("reassoc", "contract"), k.body
            self.nest(loops, vars, self.reduce_in_memory)
            self.sum_flags, self.fused_term = saved
        elif register or unrolled_reduction(k, loops, self.cpu):
            self.ones_plan = self.prefix_plans.get(id(k)) if register else None
            self.nest(kept, vars, self.reduce_in_register)
            self.ones_plan = None
        elif self.wide_memory_sum(loops) is not None:
            rows = 1
            for v in k.red:
                if v in loops:
                    rows = size_op("*", rows, k.sizes[v])
            if isinstance(rows, int):
                (self.reduce_in_wide_scratch if rows > short_rows(self.cpu) else self.memory_mode)(loops, vars)
            else:   # a symbolic number of rows: both, and the length picks one
                long = self.b.icmp_signed(">", self.f.size(rows), I64(short_rows(self.cpu)))
                with self.b.if_else(long) as (then, otherwise):
                    with then:
                        self.reduce_in_wide_scratch(loops, vars)
                    with otherwise:
                        self.memory_mode(loops, vars)
        else:
            self.memory_mode(loops, vars)

    def memory_mode(self, loops: list[str], vars: dict) -> None:
        """Initialize `out`, combine every term into it, then apply the epilogue."""
        k = self.k
        kept = [v for v in loops if v not in k.red]
        self.nest(kept, vars, lambda vs: self.store(vs, self.const(INIT[k.reduce])))
        self.nest(loops, vars, self.reduce_in_memory)
        if k.epilogue is not None:
            self.nest(kept, vars, lambda vs: self.store(vs, self.expr(k.epilogue, vs, self.load_out(vs))))

    def nest(self, loops: list[str], vars: dict, leaf) -> None:
        if not loops:
            leaf(vars)
            return
        v = loops[0]
        if self.split and v == self.split[0]:
            self.split_nest(self.split, loops[len(self.split):], vars, leaf)
            return
        if unrolled(self.k, v, self.cpu):
            for i in range(self.k.sizes[v]):  # unrolled, so that the loop around it is innermost for LLVM
                self.nest(loops[1:], {**vars, v: I64(i)}, leaf)
            return
        if self.ones_plan is not None and len(loops) == 1 and v == self.ones_plan[2]:
            self.prefix_split(v, vars, leaf)
            return
        with for_range(self.b, *self.extent(v, vars), v) as i:
            self.nest(loops[1:], {**vars, v: i}, leaf)

    def extent(self, v: str, vars: dict) -> tuple:
        """[lo, hi) of loop `v` given the variables outside it (its bounds applied)."""
        lows, highs = self.k.bounds.get(v, ((), ()))
        lo, hi = I64(0), self.f.size(self.k.sizes[v])
        for ix in lows:
            x = self.ix(ix, vars)
            lo = self.b.select(self.b.icmp_signed(">", x, lo), x, lo)
        for ix in highs:
            x = self.ix(ix, vars)
            hi = self.b.select(self.b.icmp_signed("<", x, hi), x, hi)
        return lo, hi

    def accumulate(self, kind: str, vars: dict, term) -> ir.Value:
        """Reduce `term(vars)` over the reduced loops into a register; its value.

        A long f32 sum accumulates in f64 lanes, rounded once at the end: summed in
        f32, each of LLVM's vector lanes carries n / lanes terms, and the error grows
        with n (3e-3 relative for 10^7 values of 0.1); in f64 it stays below f32's
        rounding of the result for any length that fits in memory. A sum of at most
        `cpu.short_sum` terms (a row of a layernorm) keeps f32 lanes (f64 lanes made a 64 x 256
        layernorm 1.8x slower), over chunks of `cpu.sum_chunk` iterations of its innermost
        loop when that is a loop LLVM vectorizes (`chunked_sum`). With a symbolic
        length, both loops are generated and the length picks one. The total of a
        blocked group's partial sums (a sum over the block edge, at most a few dozen
        terms) is summed in f64 whatever its length: each partial is a large share of the
        total, and the f32 lanes' roundings at the total's magnitude (up to 2 ulps for 2e6
        squares over 32 blocks) were most of the sum's error."""
        b = self.b
        red = [v for v in self.k.loops if v in self.k.red and v not in vars]
        if not (kind == "sum" and self.fp == ir.FloatType()):
            return self._accumulate(kind, vars, term, red, self.fp)
        n = 1
        for v in red:
            n = size_op("*", n, self.k.sizes[v])
        chunked = not self.strict and bool(red) and not unrolled(self.k, red[-1], self.cpu)
        if isinstance(n, int):
            if n > self.cpu.short_sum or BLOCK in red:
                return self._accumulate(kind, vars, term, red, ir.DoubleType())
            if chunked and n > self.cpu.sum_chunk:
                return self.chunked_sum(vars, term, red)
            return self._accumulate(kind, vars, term, red, self.fp)
        result = self.f.alloca(self.fp, "sum")
        short = b.icmp_signed("<=", self.f.size(n), I64(self.cpu.short_sum))
        with b.if_else(short) as (then, otherwise):
            with then:
                b.store(self.chunked_sum(vars, term, red) if chunked else
                        self._accumulate(kind, vars, term, red, self.fp), result)
            with otherwise:
                b.store(self._accumulate(kind, vars, term, red, ir.DoubleType()), result)
        return b.load(result)

    def chunked_sum(self, vars: dict, term, red: list[str]) -> ir.Value:
        """A short f32 sum in f32 lanes over chunks of `cpu.sum_chunk` iterations of its
        innermost loop, each chunk's sum added into an f64 accumulator, rounded once at
        the end: a lane then carries at most `cpu.sum_chunk` / lanes terms (8 with AVX2's
        4 x 8 lanes) wherever the sum is long. One chain of f32 lanes over all of a
        4096-term sum carried 128 terms each, and 4096 values of 0.1 summed 7e-7 off
        (PyTorch 4e-8); the chunk's horizontal add costs little next to its 256 terms."""
        b, wide, chunk_len = self.b, ir.DoubleType(), self.cpu.sum_chunk
        total = self.f.alloca(wide, "acc.wide")
        b.store(ir.Constant(wide, 0.0), total)

        v = red[-1]

        def chunk(vs, start, end):
            acc = self.f.alloca(self.fp, "acc")
            b.store(ir.Constant(self.fp, 0.0), acc)
            saved = self.sum_flags, self.fused_term
            self.sum_flags, self.fused_term = ("reassoc", "contract"), self.k.body
            with for_range(b, start, end, v) as i:
                b.store(self.combine(b.load(acc), term({**vs, v: i}), "sum"), acc)
            self.sum_flags, self.fused_term = saved
            b.store(b.fadd(b.load(total), b.fpext(b.load(acc), wide)), total)

        def rows(vs):
            n = self.k.sizes[v]
            if isinstance(n, int) and not any(self.k.bounds.get(v, ((), ()))):
                # known trip counts, which LLVM vectorizes without a remainder loop
                with for_range(b, I64(0), I64(n // chunk_len), f"{v}.chunk", unroll=False) as c:
                    start = b.mul(c, I64(chunk_len), flags=["nsw"])
                    chunk(vs, start, b.add(start, I64(chunk_len), flags=["nsw"]))
                if n % chunk_len:
                    chunk(vs, I64(n - n % chunk_len), I64(n))
                return
            lo, hi = self.extent(v, vs)
            count = b.sdiv(b.add(b.sub(hi, lo), I64(chunk_len - 1)), I64(chunk_len))
            with for_range(b, I64(0), count, f"{v}.chunk", unroll=False) as c:
                start = b.add(lo, b.mul(c, I64(chunk_len), flags=["nsw"]), flags=["nsw"])
                end = b.add(start, I64(chunk_len), flags=["nsw"])
                chunk(vs, start, b.select(b.icmp_signed("<", end, hi), end, hi))

        self.nest(red[:-1], vars, rows)
        return b.fptrunc(b.load(total), self.fp)

    def _accumulate(self, kind: str, vars: dict, term, red: list[str], acc_type) -> ir.Value:
        b = self.b
        acc = self.f.alloca(acc_type, "acc")
        b.store(ir.Constant(acc_type, INIT[kind]), acc)
        if acc_type != self.fp:
            step = lambda vs: b.store(self.combine(b.load(acc), b.fpext(term(vs), acc_type), kind), acc)  # noqa: E731
        else:
            step = lambda vs: b.store(self.combine(b.load(acc), term(vs), kind), acc)  # noqa: E731
        saved = self.sum_flags, self.fused_term
        if kind == "sum" and not self.strict and not all(unrolled(self.k, v, self.cpu) for v in red):
            # a reduction loop LLVM vectorizes: lanes (reassoc) and FMA (contract). An
            # unrolled one is not: the loop around it is, and there LLVM contracts and
            # reassociates the vector body and the scalar remainder differently, whose
            # split moves with the thread count (the same bits on any number of threads)
            self.sum_flags, self.fused_term = ("reassoc", "contract"), self.k.body
        self.nest(red, vars, step)
        self.sum_flags, self.fused_term = saved
        return b.fptrunc(b.load(acc), self.fp) if acc_type != self.fp else b.load(acc)

    def reduce_in_register(self, vars: dict) -> None:
        k = self.k
        if k.reduce == "logsumexp":
            value = self.logsumexp(vars)
        else:
            value = self.accumulate(k.reduce, vars, lambda vs: self.expr(k.body, vs))
        if k.epilogue is not None:
            value = self.expr(k.epilogue, vars, value)
        self.store(vars, value)

    def wide_memory_sum(self, loops: list[str]) -> list[str] | None:
        """For an f32 sum in memory mode (a reduced loop outside a kept one: summing the
        rows of a row-major matrix, a bias gradient's sum over the batch), the kept loops
        inside its first reduced loop, when their elements (known sizes, at most
        `cpu.wide_scratch`) fit an f64 scratch row on the stack; else None. Added into the f32
        output, each element took one rounding per row, and the error grew with the rows
        (1e-5 relative for 1e5 rows, PyTorch's pairwise sum 1e-7). The scratch row is
        used beyond `short_rows` rows (at run time for a symbolic count): up to there the
        f32 output adds as many terms as a lane of a short register-mode sum does."""
        if self.strict or self.k.reduce != "sum" or self.fp != ir.FloatType():
            return None
        first = next(i for i, v in enumerate(loops) if v in self.k.red)
        inner = [v for v in loops[first:] if v not in self.k.red]
        n = 1
        for v in inner:
            if not isinstance(self.k.sizes[v], int):
                return None
            n *= self.k.sizes[v]
        return inner if 0 < n <= self.cpu.wide_scratch else None

    def reduce_in_wide_scratch(self, loops: list[str], vars: dict) -> None:
        """Memory mode with an f64 accumulator: for each index of the kept loops outside
        the first reduced one, a scratch row over the kept loops inside it is zeroed,
        the terms are added into it in f64, and each element is rounded once into `out`
        (then the epilogue). Loop order and memory order are those of memory mode."""
        b, wide = self.b, ir.DoubleType()
        inner = self.wide_memory_sum(loops)
        first = next(i for i, v in enumerate(loops) if v in self.k.red)
        n = 1
        for v in inner:
            n *= self.k.sizes[v]
        row = self.f.entry.alloca(wide, size=I64(n), name="wide.row")

        def slot(vs):
            off = I64(0)
            for v in inner:
                off = b.add(b.mul(off, I64(self.k.sizes[v]), flags=["nsw"]), vs[v], flags=["nsw"])
            return b.gep(row, [off], inbounds=True, source_etype=wide)

        def add(vs):
            p = slot(vs)
            b.store(b.fadd(b.load(p, typ=wide), b.fpext(self.expr(self.k.body, vs), wide)), p)

        def finish(vs):
            value = b.fptrunc(b.load(slot(vs), typ=wide), self.fp)
            self.store(vs, self.expr(self.k.epilogue, vs, value) if self.k.epilogue is not None else value)

        def per_outer(vs):
            self.nest(inner, vs, lambda ws: b.store(ir.Constant(wide, 0.0), slot(ws)))
            self.nest(loops[first:], vs, add)
            self.nest(inner, vs, finish)

        self.nest(loops[:first], vars, per_outer)

    def reduce_in_memory(self, vars: dict) -> None:
        self.store(vars, self.combine(self.load_out(vars), self.expr(self.k.body, vars)))

    def wide_scatter(self, k: LoopKernel, vars: dict) -> int | None:
        """The element count of an f32 scatter-add's output (not a segment max/min), when
        it is a kernel of its own (no outer loops fixed), stored as f32, with known sizes
        and at most `cpu.wide_scratch` elements; else None. Added into the f32 output one
        term at a time, each element takes one rounding per term sent to it, and the error
        grows with the terms: 10^6 messages into 8 nodes were 1.1e-5 off (PyTorch's
        index_add too; its one-hot product 6e-7, tgc's interpreters 3e-8)."""
        if k.reduce or vars or self.strict or self.fp != ir.FloatType() or k.out in self.reg_names:
            return None
        out = self.low.buffers[k.out]
        if storage_type(out.dtype, self.fp) != self.fp:
            return None
        n = 1
        for e in out.edges:
            size = self.low.size(e)
            if not isinstance(size, int):
                return None
            n *= size
        return n if 0 < n <= self.cpu.wide_scratch else None

    def scatter(self, loops: list[str], vars: dict) -> None:
        """A scatter kernel: into the f32 output (`scatter_step`), or into an f64 scratch
        copy of it (`scatter_in_wide_scratch`) where `wide_scatter` allows and its terms
        are more than `cpu.sum_chunk` per output element on average (at run time for
        symbolic loop sizes): up to there an element's f32 chain is no longer than a
        chunk of a short f32 sum (10^6 uniform terms into 8 x 2 elements: 8e-6 off in
        f32, 2.9e-8 in f64; 40000 into 256 x 16, 156 each: 4e-7, PyTorch's one-hot
        product 1.8e-7), and the scratch, twice the output's bytes, cost 1.3x in the
        scatter's time at that size (a GCN layer's 16 features over 64-512 nodes)."""
        k = self.k
        n = self.wide_scatter(k, vars)
        plain = lambda: (self.fill(INIT[k.reduce or "sum"]), self.nest(loops, vars, self.scatter_step))  # noqa: E731
        if n is None:
            plain()
            return
        terms = 1
        for v in loops:
            terms = size_op("*", terms, k.sizes[v])
        if isinstance(terms, int):
            if terms > n * self.cpu.sum_chunk:
                self.scatter_in_wide_scratch(loops, vars, n)
            else:
                plain()
            return
        many = self.b.icmp_signed(">", self.f.size(terms), I64(n * self.cpu.sum_chunk))
        with self.b.if_else(many) as (then, otherwise):
            with then:
                self.scatter_in_wide_scratch(loops, vars, n)
            with otherwise:
                plain()

    def scatter_in_wide_scratch(self, loops: list[str], vars: dict, n: int) -> None:
        """A scatter-add into an f64 scratch copy of the output on the stack (zeroed,
        each term added at its gathered position, in the scatter's order), each element
        then rounded once into `out`. The scratch is laid out as `out` (its strides), so
        the last loop copies it element by element."""
        b, wide, k = self.b, ir.DoubleType(), self.k
        row = self.f.entry.alloca(wide, size=I64(n), name="wide.scatter")
        row.align = 64   # a row of 8 doubles in one cache line, not across two
        with for_range(b, I64(0), I64(n), "z") as i:
            b.store(ir.Constant(wide, 0.0), b.gep(row, [i], inbounds=True, source_etype=wide))
        order = self.low.buffers[k.out].order
        strides, idx = self.f.strides(order), dict(k.index)

        def add(vs):
            off = offset(b, [(self.ix(idx[e], vs), strides[e]) for e in order])
            p = b.gep(row, [off], inbounds=True, source_etype=wide)
            b.store(b.fadd(b.load(p, typ=wide), b.fpext(self.expr(k.body, vs), wide)), p)

        self.nest(loops, vars, add)
        with for_range(b, I64(0), I64(n), "z") as i:
            value = b.fptrunc(b.load(b.gep(row, [i], inbounds=True, source_etype=wide), typ=wide), self.fp)
            b.store(value, b.gep(self.ptr[k.out], [i], inbounds=True, source_etype=self.fp))

    def scatter_step(self, vars: dict) -> None:
        if self.k.reduce:   # a segment max/min
            self.store(vars, self.combine(self.load_out(vars), self.expr(self.k.body, vars)))
            return
        self.store(vars, self.b.fadd(self.load_out(vars), self.expr(self.k.body, vars)))

    def fill(self, value: float) -> None:
        out = self.low.buffers[self.k.out]
        n = self.f.count(out.edges)
        et = storage_type(out.dtype, self.fp)
        with for_range(self.b, I64(0), n, "z") as i:
            self.b.store(narrow_to(self.b, self.const(value), out.dtype, self.fp),
                         self.b.gep(self.ptr[out.name], [i], source_etype=et))

    def logsumexp(self, vars: dict) -> ir.Value:
        """m + log(sum exp(x - m)), m = max x (0 when not finite: all -inf stays -inf)."""
        b, fp = self.b, self.fp
        m = self.accumulate("maxshift", vars, lambda vs: self.expr(self.k.body, vs))
        finite = b.fcmp_ordered("<", b.call(intrinsic(b, "fabs", fp, 1), [m]), self.const(float("inf")))
        m = b.select(finite, m, self.const(0.0))
        s = self.accumulate("sum", vars, lambda vs: emit_map(b, "exp", [b.fsub(self.expr(self.k.body, vs), m)], fp))
        return b.fadd(emit_map(b, "log", [s], fp), m)

    def combine(self, acc, x, kind: str | None = None):
        kind = kind or self.k.reduce
        if kind == "sum":
            return self.b.fadd(acc, x, flags=self.sum_flags)
        if kind == "maxshift":
            # maxnum, not maximum: no NaN or signed-zero care per step. Rows of 11 that
            # LLVM unrolls into a chain: 65 us per 2112 rows, 107 with maximum; rows of 64
            # that it vectorizes: 56 us per 704, 50 with maximum (a compare and select: 63 and 84)
            return self.b.call(intrinsic(self.b, "maxnum", self.fp, 2), [acc, x])
        return self.b.call(intrinsic(self.b, "maximum" if kind == "max" else "minimum", self.fp, 2), [acc, x])

    # ------------------------------------------------------------ memory

    def address(self, buf: str, index, vars: dict, etype):
        b = self.b
        order = self.low.buffers[buf].order
        strides = self.f.strides(order)
        idx = dict(index)
        off = offset(b, [(self.ix(idx[e], vars), strides[e]) for e in order])
        return b.gep(self.ptr[buf], [off], inbounds=True, source_etype=etype)

    def store(self, vars: dict, value) -> None:
        if self.k.out in self.reg_names:
            self.regs[self.k.out] = value
            return
        dtype = self.low.buffers[self.k.out].dtype   # a bf16/f16 buffer: stored narrowed (exact)
        et = storage_type(dtype, self.fp)
        self.b.store(narrow_to(self.b, value, dtype, self.fp), self.address(self.k.out, self.k.index, vars, et))

    def load_buf(self, buf: str, index, vars: dict):
        """An element of `buf` as a value of the program's float type (a bf16/f16
        element widened, exactly)."""
        dtype = self.low.buffers[buf].dtype
        et = storage_type(dtype, self.fp)
        return widen(self.b, self.b.load(self.address(buf, index, vars, et), typ=et), dtype, self.fp)

    def load_out(self, vars: dict):
        return self.load_buf(self.k.out, self.k.index, vars)

    def ix(self, ix: Ix, vars: dict):
        b = self.b
        total = None if ix.const == 0 else self.f.size(ix.const)
        for atom, coef in ix.terms:
            a = self.atom(atom, vars)
            term = a if coef == 1 else b.mul(a, self.f.size(coef), flags=["nsw"])
            total = term if total is None else b.add(total, term, flags=["nsw"])
        return total if total is not None else I64(0)

    def atom_var(self, atom: str, vars: dict):
        return vars[atom]

    def atom_id_load(self, atom: IdLoad, vars: dict):
        b = self.b
        p = self.address(atom.buf, atom.index, vars, ir.IntType(32))
        return b.sext(b.load(p, typ=ir.IntType(32)), I64)

    def atom_floor_div(self, atom: FloorDiv, vars: dict):
        b = self.b
        n, d = self.ix(atom.num, vars), self.f.size(atom.den)
        q, r = b.sdiv(n, d), b.srem(n, d)
        return b.sub(q, b.zext(b.icmp_signed("<", r, I64(0)), I64))

    # ------------------------------------------------------------ expressions

    def const(self, value: float):
        return ir.Constant(self.fp, value)

    def expr_load(self, e: Load, vars: dict, acc=None):
        if e.buf in self.known_ones:   # below a band mask's split: the value it holds there
            return self.const(1.0)
        if e.buf in self.regs:
            return self.regs[e.buf]
        return self.load_buf(e.buf, e.index, vars)

    def expr_const(self, e: Const, vars: dict, acc=None):
        return self.const(e.value)

    def expr_size_of(self, e: SizeOf, vars: dict, acc=None):
        return self.b.sitofp(self.f.size(e.size), self.fp)

    def expr_acc(self, e: Acc, vars: dict, acc=None):
        return acc

    def expr_rand(self, e: Rand, vars: dict, acc=None):
        b = self.b
        fp = ir.FloatType() if e.draw == "f32" else self.fp
        folds = tuple(n if isinstance(n, int) else self.ix(n, vars) for n in e.folds)
        value = emit_draw(b, e.kind, folds, self.ix(e.key, vars), self.ix(e.counter, vars), fp)
        return value if fp == self.fp else b.fpext(value, self.fp)

    def expr_add(self, e: Add, vars: dict, acc=None):
        if not self.strict and self.fp == ir.FloatType() and wide_sum(e, "f32"):
            return self.wide_add(e, vars, acc)
        k = None if self.strict else fma_term(e)
        if k is not None:
            return self.fused_add(e, k, vars, acc)
        return self.add(e.coefs, [self.expr(a, vars, acc) for a in e.args])

    def expr_mul(self, e: Mul, vars: dict, acc=None):
        args = [self.expr(a, vars, acc) for a in e.args]
        if not self.strict:
            args = [args[i] for i in factor_order(e.args)]
        out = args[0]
        for i, a in enumerate(args[1:], 2):   # the last product of a summed body may fuse (FMA)
            out = self.b.fmul(out, a, flags=FLAGS if e is self.fused_term and i == len(args) else ())
        return out

    def expr_map(self, e: Map, vars: dict, acc=None):
        if (not self.strict and self.fp == ir.FloatType() and e.fn == "exp" and isinstance(e.args[0], Add)
                and wide_exp(e, "f32", self.lse_buffers())):
            return self.exp_sum(e.args[0], vars, acc)
        args = [self.expr(a, vars, acc) for a in e.args]
        exponent = e.args[1].value if e.fn == "pow" and isinstance(e.args[1], Const) else None
        return emit_map(self.b, e.fn, args, self.fp, exponent)

    def add(self, coefs, args):
        """sum c_i a_i in order, each product rounded (no FMA: one would subtract a
        rounded product from an unrounded one, and 3a - 3b or ab - cd at a = b (= c = d)
        would not be 0, as PyTorch's is)."""
        b = self.b
        total = None
        for c, a in zip(coefs, args):
            if total is None:
                total = a if c == 1 else b.fmul(self.const(c), a)
            elif c == 1:
                total = b.fadd(total, a)
            elif c == -1:
                total = b.fsub(total, a)
            else:
                total = b.fadd(total, b.fmul(self.const(c), a))
        return total

    def lse_buffers(self) -> frozenset[str]:
        """The buffers the program's logsumexp kernels write (`lowered.logsumexp_outputs`),
        found once per kernel, when an exp of a sum asks."""
        if self.lse is None:
            self.lse = logsumexp_outputs(self.low)
        return self.lse

    def exp_sum(self, e: Add, vars: dict, acc):
        """A softmax weight exp(d - lse) (`lowered.wide_exp`): the sum s in f64, then the
        f32 exp of its rounding hi corrected by the rounding's error lo, exp(hi) (1 + lo),
        as the CUDA kernels' tgc_exp_sum; an infinite or NaN s (lo NaN, or 0) and an
        overflowed exp give exp(hi). Rounded to f32 first, d - lse gave a weight 85 logits
        down its row 85 ulps of error (17x PyTorch's)."""
        b = self.b
        s = self.sum64(e, vars, acc)
        hi = b.fptrunc(s, self.fp)
        lo = b.fptrunc(b.fsub(s, b.fpext(hi, ir.DoubleType())), self.fp)
        ex = emit_map(b, "exp", [hi], self.fp, None)
        fix = b.and_(b.fcmp_ordered("!=", lo, ir.Constant(self.fp, 0.0)),
                     b.fcmp_ordered("<", ex, ir.Constant(self.fp, float("inf"))))
        return b.select(fix, b.fadd(ex, b.fmul(ex, lo)), ex)

    def wide_add(self, e: Add, vars: dict, acc):
        """An f32 sum of several terms in f64, rounded once (`lowered.wide_sum`): each
        term widened (a product's factors before they are multiplied), scaled and added
        in f64, so its value does not depend on the order of its terms."""
        return self.b.fptrunc(self.sum64(e, vars, acc, low=self.low), self.fp)

    def sum64(self, e: Add, vars: dict, acc, low=None):
        """The sum `e` in f64, not rounded (`wide_add`); a product term's factors widened
        before they are multiplied as `lowered.wide_term_factors(low, term)` says, else
        the product is taken in f32 (factor_order, one rounding per multiplication)."""
        b, wide = self.b, ir.DoubleType()
        total = None
        for c, a in zip(e.coefs, e.args):
            if wide_term_factors(low, a):
                factors = [self.expr(x, vars, acc) for x in a.args]
                term = None
                for i in factor_order(a.args):
                    f = b.fpext(factors[i], wide)
                    term = f if term is None else b.fmul(term, f)
            else:
                term = b.fpext(self.expr(a, vars, acc), wide)
            if total is not None and c in (1.0, -1.0):
                total = b.fadd(total, term) if c == 1.0 else b.fsub(total, term)
                continue
            if c != 1.0:
                term = b.fmul(ir.Constant(wide, c), term)
            total = term if total is None else b.fadd(total, term)
        return total

    def fused_add(self, e: Add, k: int, vars: dict, acc):
        """`e` with its term k, c * m1 * ... * mn, as one FMA: fma(c * m1 * ... * m(n-1),
        mn, the other terms summed in order). Chosen from the expression alone
        (`fma_term`), so an expression computed in several kernels has the same bits
        in each; LLVM's own contraction (`contract`) depends on what it inlines."""
        b = self.b
        rest = [(c, a) for i, (c, a) in enumerate(zip(e.coefs, e.args)) if i != k]
        total = self.add([c for c, _ in rest], [self.expr(a, vars, acc) for _, a in rest])
        factors = [self.expr(a, vars, acc) for a in e.args[k].args]
        factors = [factors[i] for i in factor_order(e.args[k].args)]   # (never strict: no FMA there)
        u = factors[0]
        for x in factors[1:-1]:
            u = b.fmul(u, x)
        c = e.coefs[k]
        u = u if c == 1 else b.fneg(u) if c == -1 else b.fmul(self.const(c), u)
        return b.call(intrinsic(b, "fma", self.fp, 3), [u, factors[-1], total])

    def expr_mask(self, e: Mask, vars: dict, acc=None):
        b = self.b
        ok = None
        for c in e.conds:
            op = "==" if c.op == "=" else c.op
            bit = b.icmp_signed(op, self.ix(c.ix, vars), I64(0))
            ok = bit if ok is None else b.and_(ok, bit)
        if not any(isinstance(n, Load) for n in walk(e.arg)):  # nothing to guard: a select
            return b.select(ok, self.expr(e.arg, vars, acc), self.const(0.0))
        pre = b.block
        then = self.fn.append_basic_block("mask.then")
        merge = self.fn.append_basic_block("mask.merge")
        b.cbranch(ok, then, merge)
        b.position_at_end(then)
        value = self.expr(e.arg, vars, acc)
        then_end = b.block
        b.branch(merge)
        b.position_at_end(merge)
        phi = b.phi(self.fp)
        phi.add_incoming(value, then_end)
        phi.add_incoming(self.const(0.0), pre)
        return phi


def emit_parallel_body(mod: ir.Module, low: Lowered, k, kernel: ir.Function, name: str,
                       options: Options) -> ir.Function:
    """`void name(ptr data)`, data = [dims, buffers...]: runs this thread's share of
    the kernel's split range (`split_count`, `parallel.thread_range`)."""
    from tgc.backends.cpu import parallel

    nbuf = len(kernel_buffers(k))
    fn = define(mod, name, ir.VoidType(), [PTR])
    optimize_not(fn)   # a few loads and one call per thread
    f = Frame(fn, low.module, None, low.edges)
    e = f.entry
    ptrs = [e.load(e.gep(fn.args[0], [I64(i)], source_etype=PTR), typ=PTR) for i in range(nbuf + 1)]
    f.dims_ptr = ptrs[0]
    lo, hi = parallel.thread_range(f.b, split_count(f, k, options.cpu))
    f.b.call(kernel, ptrs + [lo, hi])
    f.b.ret_void()
    f.finish()
    return fn
