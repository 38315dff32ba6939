"""A GEMM's epilogue (`tgc.lower.epilogue`) on the CPU: computed tile by tile, right
after the tile's product is stored, by the thread that computed it.

    void tgc.kN.epi(const i64* dims, T* bufs..., i64 lo, i64 hi)

runs the epilogue's outputs, in order, at every element of rows [lo, hi) of the
normalized product C'[P, Q] (`gemm.GemmGen`: P is the result's outer group in memory,
Q its contiguous one), all of Q: a loop group (`LoopGroup`) whose outer loops are
P's edges (the range [lo, hi) of their flattened index, as a loop group's split
loops) and then Q's, each output a member reading the product's element from `out`,
so LLVM vectorizes the inner loop over Q. `GemmGen` calls it after each task's tile,
whose columns are then all of Q (an epilogue GEMM's tiles never cut Q): the tile,
just written, is read back from cache, not from memory, and the epilogue runs inside
the GEMM's own parallel region. Where the product goes straight into an output's
buffer (`tgc.lower.epilogue`), its element is loaded into a register first.

`gemm_dispatch.tile_epilogue` says which epilogue GEMMs this path takes: real products without batch
edges (a task is then a tile of rows), not bf16, whose P has at most two edges (a
loop group's split loops); `group` writes out the others as loops after the GEMM
(`tgc.lower.epilogue.expand`). Exact: the same expressions on the same values as
those loops, at each element in the epilogue's order.
"""
from __future__ import annotations

import llvmlite.ir as ir

from tgc.backends.cpu.gemm_dispatch import rows_and_cols
from tgc.backends.cpu.group import LoopGroup
from tgc.backends.cpu.irutil import PTR
from tgc.backends.cpu.loops import LoopGen, kernel_buffers
from tgc.lower.lowered import GemmKernel, Ix, Load, LoopKernel, Lowered, epilogue_loops
from tgc.options import Options


ACC = "#acc"   # the product's element, a register of the group when `out` is also an output


def epilogue_group(low: Lowered, k: GemmKernel) -> LoopGroup:
    """The epilogue as a loop group over P's edges, then Q's (memory order). When
    `out` is one of the outputs, a first member loads the product's element into a
    register (`ACC`) before any output overwrites it."""
    rows, cols = rows_and_cols(low, k)
    outer = tuple(rows) + tuple(cols)
    sizes = {e: low.size(e) for e in outer}
    if not any(o.buf == k.out for o in k.epilogue):
        return LoopGroup(outer, sizes, tuple(epilogue_loops(low, k)), note="epilogue")
    index = tuple((e, Ix.var(e)) for e in sorted(outer))
    first = LoopKernel(ACC, index, outer, sizes, Load(k.out, index), note="the product")
    return LoopGroup(outer, sizes, (first, *epilogue_loops(low, k, ACC)), regs=(ACC,), note="epilogue")


def epilogue_buffers(low: Lowered, k: GemmKernel) -> list[str]:
    """The buffers `tgc.kN.epi` takes, in order (the product's among them)."""
    return kernel_buffers(epilogue_group(low, k))


class _TileEpilogue(LoopGen):
    """The group's outer loops: P's edges over this call's rows [lo, hi), then Q's whole."""

    def __init__(self, mod, low, g: LoopGroup, rows: tuple[str, ...], name, fp, options):
        super().__init__(mod, low, g, name, fp, options)
        self.rows = rows

    def group(self, g: LoopGroup) -> None:
        self.k = g

        def members(vs: dict) -> None:
            for m in g.members:
                self.member(m, vs)

        self.split_nest(self.rows, [], {},
                        lambda vs: self.plain_nest(list(g.outer[len(self.rows):]), g.sizes, vs, members))


def emit_epilogue(mod: ir.Module, low: Lowered, k: GemmKernel, name: str, fp, options: Options) -> ir.Function:
    """`name`: the epilogue of `k` over rows [lo, hi) of C' (see the module docstring)."""
    rows, _ = rows_and_cols(low, k)
    return _TileEpilogue(mod, low, epilogue_group(low, k), rows, name, fp, options).emit()


def load_pointers(b: ir.IRBuilder, array, n: int) -> list:
    """The `n` buffer pointers the caller stored in `array` (an array of pointers)."""
    return [b.load(b.gep(array, [ir.Constant(ir.IntType(64), i)], source_etype=PTR), typ=PTR) for i in range(n)]
