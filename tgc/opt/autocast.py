"""autocast: matrix products on bf16/f16 operands with f32 accumulation (--autocast).

As the field's autocast does, only the products that are matrix multiplications take
the low type: a contraction of two or more tensors in which two operands each keep an
edge the other lacks (an m and an n) and share a summed edge (a k). Its non-constant,
non-indicator operands are converted (`to_bf16`/`to_f16`: rounded to nearest even);
the product itself stays f32 (a contraction on bf16/f16 operands computes and
accumulates in f32, `tgc.ir.values`). Everything else, elementwise products summed
(a loss's `sum(targets * logp)`), reductions, softmax, layernorm, losses, updates,
stays as it was, in the program's float type. With `Options.autocast_min_flops`,
products of fewer FLOPs (as `tgc explain` counts them, symbolic dims at `rep_size`)
keep their operands too: on a CPU, rounding the operands of a small product costs
more than its bf16 GEMM saves (the default, 0, converts every matrix product).

The pass runs last in the pipeline, after the derivatives are formed, so the
backward pass's matrix products (x^T dy, dy W^T) are converted as the forward ones
are, as under PyTorch's autocast, where autograd replays the bf16 products.

Not exact: it rounds operands by design (the relative error of each product term is
at most 2^-8 for bf16, 2^-11 for f16), so --verify-each compares the passes after it
with its result, not with the program before it. Terminates: one visit per value.
"""
from __future__ import annotations

from dataclasses import dataclass

from tgc.ir import values as V
from tgc.ir.module import Module
from tgc.ir.values import Value, rebuild_same, topo_order
from tgc.options import Options
from tgc.ir.passes import Pass
from tgc.opt.rewrite import map_bodies
from tgc.opt.stats import rep_sizes, value_flops

_KEEP_OPS = ("const", "size", "indicator")


def is_matmul(v: Value) -> bool:
    """A contraction with a summed edge shared by two operands that each keep an edge
    the other lacks (a GEMM with m, n, k > 1 edges)."""
    if v.op != "contract":
        return False
    ops = [o for o in v.operands if o.op not in _KEEP_OPS and o.dtype != "i32"]
    kept = set(v.edges)
    for i, a in enumerate(ops):
        for b in ops[i + 1:]:
            ea, eb = set(a.edges), set(b.edges)
            if ((ea & eb) - kept) and ((ea - eb) & kept) and ((eb - ea) & kept):
                return True
    return False


def autocast(module: Module, dtype: str, min_flops: int = 0, rep: int = 64) -> Module:
    """The module with every matrix product of at least `min_flops` FLOPs (symbolic
    dims at `rep`) getting its operands converted to `dtype`, in every loop's step too."""
    module = map_bodies(module, lambda step: autocast(step, dtype, min_flops, rep))
    sizes = rep_sizes(module, rep)
    memo: dict[int, Value] = {}
    for v in topo_order(module.roots()):
        ops = tuple(memo[id(o)] for o in v.operands)
        if is_matmul(v) and (min_flops <= 0 or value_flops(v, sizes) >= min_flops):
            ops = tuple(o if o.op in _KEEP_OPS or o.dtype == "i32" else V.convert(o, dtype, loc=o.loc)
                        for o in ops)
            memo[id(v)] = V.convert(V.contract(ops, v.edges, v.loc), v.dtype)   # stays f32 (or f64)
        else:
            memo[id(v)] = rebuild_same(v, ops)
    return module.replace_values(memo)


@dataclass(frozen=True)
class Autocast(Pass):
    """Mixed precision: matrix products on bf16/f16 operands, accumulated in f32 (--autocast)."""

    name = "autocast"
    rounds = True    # changes values by design: --verify-each checks what follows against its result

    def run(self, module: Module, options: Options) -> Module:
        if not options.autocast:
            return module
        return autocast(module, options.autocast, options.autocast_min_flops, options.rep_size)
