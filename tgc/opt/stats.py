"""Statistics of a module: op count, FLOPs, bytes of intermediates, largest intermediate.

The cost model (shared with `factor`), with every symbolic dim at a representative
size (`Options.rep_size`, 64 by default: a typical batch or sequence length):

- a contraction costs, per operand pair, the product of the sizes of all the edges
  the pair involves, at the best pairwise order (`tgc.opt.paths`: what `factor`
  makes of it; the order written, for one already pairwise); a pair with an
  indicator is index arithmetic: it costs the size of its dense side or of its
  result, whichever is larger, and a pair of indicators costs nothing; a
  one-operand contraction (a sum or a broadcast) costs the larger of its operand
  and its result;
- an elementwise op costs its size (an add of n operands n - 1 per element);
  a reduction, its operand's size; a gather, its result's; a scatter, its cotangent's;
- arguments, constants, sizes, indicators (and products of indicators only),
  renames and stops cost nothing and occupy no memory (inputs, lazily filled
  constants, index arithmetic, views).

Bytes: the sizes of all other values (every intermediate and result a program
computes), at 4 bytes per f32 and 8 per f64. Terminates: one visit per value.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from tgc.ir.module import Module
from tgc.ir.sizes import size_estimate
from tgc.ir.values import Value
from tgc.opt.paths import contraction_cost, prod

FREE = ("arg", "const", "size", "indicator", "rename", "stop", "custom", "slot")
BYTES = {"f32": 4, "f64": 8, "i32": 4, "bf16": 2, "f16": 2}


@dataclass(frozen=True)
class ModuleStats:
    ops: int
    flops: int
    bytes: int
    largest: int  # bytes of the largest intermediate


class RepSizes(dict):
    """Every edge's size, symbolic dims taken as `rep`; edges added later are looked up too."""

    def __init__(self, m: Module, rep: int):
        super().__init__()
        self.m = m
        self.env = {d: rep for d in m.symbolic_dims()}
        for d, s in m.dims.items():
            if s is not None:
                self.env[d] = size_estimate(s, self.env)

    def __missing__(self, edge: str) -> int:
        self[edge] = self.env[self.m.edges[edge]]
        return self[edge]


def rep_sizes(m: Module, rep: int) -> RepSizes:
    return RepSizes(m, rep)


def is_index(v: Value) -> bool:
    """An indicator, or a product or renaming of indicators only: index arithmetic."""
    if v.op == "indicator":
        return True
    return v.op in ("contract", "rename") and all(is_index(o) for o in v.operands)


def value_flops(v: Value, sizes: Mapping[str, int]) -> int:
    if v.op in FREE or is_index(v):
        return 0
    if v.op == "contract":
        if len(v.operands) == 1:
            return max(prod(v.operands[0].edges, sizes), prod(v.edges, sizes))
        leaves = [(frozenset(o.edges), is_index(o)) for o in v.operands]
        return contraction_cost(leaves, set(v.edges), sizes)
    if v.op == "add":
        return max(1, len(v.operands) - 1) * prod(v.edges, sizes)
    if v.op == "reduce":
        return prod(v.operands[0].edges, sizes)
    if v.op == "scatter":
        return prod(v.operands[0].edges, sizes)
    return prod(v.edges, sizes)


def module_stats(m: Module, rep: int = 64) -> ModuleStats:
    sizes = rep_sizes(m, rep)
    values = [v for v in m.values() if v.op != "arg"]
    flops = sum(value_flops(v, sizes) for v in values)
    mem = [prod(v.edges, sizes) * BYTES[v.dtype] for v in values if v.op not in FREE and not is_index(v)]
    return ModuleStats(len(values), flops, sum(mem), max(mem, default=0))


def format_table(rows: Sequence[tuple[str, ModuleStats]], count: str = "ops") -> str:
    """One line per (stage, stats), for `tgc dump-ir --stats`; `count` heads the first
    column (the ops of a module, the kernels of a lowered program)."""
    lines = [f"  {count:>7} {'FLOPs':>14} {'bytes':>14} {'largest':>12}  after"]
    for name, s in rows:
        lines.append(f"  {s.ops:7d} {s.flops:14,d} {s.bytes:14,d} {s.largest:12,d}  {name}")
    return "\n".join(lines) + "\n"
