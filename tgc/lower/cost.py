"""What a lowered program costs: FLOPs per kernel (`kernel_flops`), and a program's
kernels, FLOPs, bytes of temporaries and largest temporary (`lowered_stats`, the
lowering stages' rows of `tgc dump-ir --stats`), every symbolic dim at one
representative size.

FLOPs count one per arithmetic operation of an expression, evaluated at every point
of its loop nest: an n-term sum is n - 1 additions plus one multiplication per
coefficient other than 1, an n-factor product n - 1 multiplications, an elementwise
function one (an `exp` is one FLOP here, as in PyTorch's profiler), a mask one per
condition, a reduction one per term; a GEMM is 2 m n k per batch index and tap.
Terminates: one visit per kernel and expression node.
"""
from __future__ import annotations

from tgc.ir.philox import op_counts
from tgc.ir.sizes import size_eval
from tgc.lower.lowered import Add, GemmKernel, LoopKernel, Lowered, Map, Mask, Mul, Rand, StepLoop, walk
from tgc.opt.stats import BYTES, ModuleStats, rep_sizes


def kernel_flops(k, extent, edge_size) -> int:
    """The FLOPs of kernel `k`: `extent(k, loop variable)` and `edge_size(edge)` give sizes."""
    if isinstance(k, GemmKernel):
        n = 2
        for e in k.batch + k.m + k.n + k.k + k.taps:
            n *= edge_size(e)
        return n
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


def expr_ops(e) -> int:
    n = 0
    for node in walk(e):
        if isinstance(node, Add):
            n += len(node.args) - 1 + sum(1 for c in node.coefs if c != 1)
        elif isinstance(node, Mul):
            n += len(node.args) - 1
        elif isinstance(node, Map):
            n += 1
        elif isinstance(node, Mask):
            n += len(node.conds)
        elif isinstance(node, Rand):   # its float operations (Box-Muller's polynomials, the scaling)
            n += op_counts(node.kind, "f64")[1]
    return n


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
