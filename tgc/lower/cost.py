"""What a lowered program costs: FLOPs per kernel (`kernel_flops`), and a program's
kernels, FLOPs, bytes of temporaries and largest temporary (`lowered_stats`, the
lowering stages' rows of `tgc dump-ir --stats`), every symbolic dim at one
representative size.

FLOPs count one per arithmetic operation of an expression, evaluated at every point
of its loop nest: an n-term sum is n - 1 additions plus one multiplication per
coefficient other than 1, an n-factor product n - 1 multiplications, an elementwise
function one (an `exp` is one FLOP here, as in PyTorch's profiler), a mask one per
condition, a reduction one per term; a GEMM is 2 m n k per batch index and tap,
plus its epilogue's operations at every element of the product.
Terminates: one visit per kernel and expression node.
"""
from __future__ import annotations

from tgc.ir.philox import op_counts
from tgc.ir.sizes import size_eval
from tgc.lower.lowered import (Add, ExprVisitor, GemmKernel, LoopKernel, Lowered, Map, Mask, Mul, Rand,
                               StepLoop)
from tgc.opt.stats import BYTES, ModuleStats, rep_sizes


def kernel_flops(k, extent, edge_size) -> int:
    """The FLOPs of kernel `k`: `extent(k, loop variable)` and `edge_size(edge)` give sizes."""
    if isinstance(k, GemmKernel):
        n, cells = 2, 1
        for e in k.batch + k.m + k.n + k.k + k.taps:
            n *= edge_size(e)
        for e in k.batch + k.m + k.n:
            cells *= edge_size(e)
        return n + cells * sum(expr_ops(o.expr) for o in k.epilogue)   # its epilogue's, at every element
    if isinstance(k, StepLoop):   # every step's: the step's edges lowering made have sizes of their own
        def size(e: str) -> int:
            own = k.step.edges.get(e)
            return own if isinstance(own, int) else edge_size(e)

        return edge_size(k.edge) * sum(kernel_flops(s, extent, size) for s in k.step.kernels)
    if hasattr(k, "flops"):     # a backend's own kind that counts itself (the CPU's ImplicitGemm)
        return k.flops(extent, edge_size)
    if hasattr(k, "members"):   # a loop group (the CPU backend's): members inside shared outer loops
        outer = 1
        for v in k.outer:
            outer *= extent(k, v)
        return sum(loop_flops(m, extent, skip=set(k.outer)) * outer for m in k.members)
    return loop_flops(k, extent, skip=set())


def loop_flops(k: LoopKernel, extent, skip: set[str]) -> int:
    points = kept = 1
    for v in k.loops:
        if v in skip:
            continue
        points *= extent(k, v)
        if v not in k.red:
            kept *= extent(k, v)
    body = expr_ops(k.body) + (1 if k.reduce else 0) + (2 if k.reduce == "logsumexp" else 0)
    epilogue = expr_ops(k.epilogue) if k.epilogue is not None else 0
    return points * body + kept * epilogue


class _Ops(ExprVisitor):
    """The float operations of an expression tree: a sum's additions and scalings, a
    product's multiplications, a function, a mask's comparisons, a draw's own."""

    def _args(self, e) -> int:
        return sum(self.expr(a) for a in e.args)

    def expr_add(self, e: Add) -> int:
        return len(e.args) - 1 + sum(1 for c in e.coefs if c != 1) + self._args(e)

    def expr_mul(self, e: Mul) -> int:
        return len(e.args) - 1 + self._args(e)

    def expr_map(self, e: Map) -> int:
        return 1 + self._args(e)

    def expr_mask(self, e: Mask) -> int:
        return len(e.conds) + self.expr(e.arg)

    def expr_rand(self, e: Rand) -> int:   # its float operations (Box-Muller's polynomials, the scaling)
        return op_counts(e.kind, "f64")[1]

    def expr_load(self, e) -> int:
        return 0

    expr_const = expr_size_of = expr_acc = atom_var = atom_id_load = atom_floor_div = expr_load


_OPS = _Ops()


def expr_ops(e) -> int:
    return _OPS.expr(e)


def lowered_stats(low: Lowered, rep: int) -> ModuleStats:
    """The program's kernels (as `ops`), FLOPs, bytes of its temporaries and its largest
    temporary, with every symbolic dim at `rep` (as `tgc.opt.stats.module_stats`)."""
    env = rep_sizes(low.module, rep).env

    def edge_size(e: str) -> int:
        return size_eval(low.size(e), env)

    def extent(k, v) -> int:
        return size_eval(k.sizes[v], env)

    temps = []
    for b in low.buffers.values():
        if b.kind == "temp":
            n = BYTES[b.dtype]
            for e in b.edges:
                n *= edge_size(e)
            temps.append(n)
    flops = sum(kernel_flops(k, extent, edge_size) for k in low.kernels)
    return ModuleStats(len(low.kernels), flops, sum(temps), max(temps, default=0))
