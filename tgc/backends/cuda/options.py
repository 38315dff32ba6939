"""The CUDA backends' settings (cuda, cuda-sim; docs/cuda.md), nested in
`tgc.options.Options` as `options.cuda`. Plain data; its values are checked as
`CpuOptions`' are (`check_fields`: a TypeError or ValueError naming the field), and
`block_threads` must be a multiple of 32 from 32 to 1024, `grid_per_sm`, `row_slot_rows`
and `row_slot_elems` 1 or more. docs/cuda.md
("Tuned numbers") gives what each tuned default trades and its measurement."""
from __future__ import annotations

from dataclasses import dataclass, replace

from tgc.backends.cpu.options import check_fields


@dataclass(frozen=True)
class CudaOptions:
    """How the CUDA backends launch kernels; `with_(name=value)` copies."""

    row_min: int = 128   # a reduction over at least this many elements per output runs one block per output (else one thread)
    row_groups: bool = True   # the `rowgroup` stage: a row's reductions and their consumers as one kernel
    warp_rows: int = 256      # a row group whose rows have at most this many elements runs a warp per row (else a block)
    graphs: bool = True       # on a GPU, a call without id checks is captured once as a CUDA graph and replayed
    row_regs: int = 8         # a row group keeps up to this many of a row's elements per thread in registers
    column_tiles: bool = True  # a column sum of at least row_min rows runs as column tiles (else one block per output)
    inline_elementwise: bool = True   # the `inline_elementwise` stage: an elementwise temporary computed where read
    flash: bool = True        # the `flash` stage: attention's softmax-contraction chain as one kernel (tgc.backends.cuda.flash)
    # The `rowgroup` stage may also take a column sum over the group's rows (a bias or
    # weight gradient: `db[d] = sum[rows](dy)`), accumulated while the row is in hand
    # instead of by column tiles that read the rows again. Off: on an H200 the layernorm's
    # forward and backward took 0.197 ms with dw, db in its row group and 0.058 ms with
    # them as column tiles at 4096x1024 (3.0 and 0.20 ms at 65536x64; docs/cuda.md).
    row_columns: bool = False
    row_columns_max: int = 4   # ... at most this many per row group (each keeps row_regs doubles a thread)
    # A fused column sum's rows are dealt to slots (slot s: rows s, s + slots, ...), one
    # partial row of doubles per slot, the slots' partials added in slot order by a
    # second kernel (the same bits on every run and every GPU). There are
    # min(ceil(rows / row_slot_rows), ceil(row_slot_elems / columns)) slots: at least
    # `row_slot_rows` rows per slot, so the partials (written and read once) are at most
    # 1/row_slot_rows of the rows' size, and at most about `row_slot_elems` partial
    # elements per column sum (16 MiB of doubles), which still leaves 512 slots (each a
    # block) for rows of 4096 elements.
    row_slot_rows: int = 8
    row_slot_elems: int = 1 << 21
    # A block-per-row launch of a row group (rows longer than `warp_rows`) takes
    # `row_block(length)` threads: the fewest power of two from `row_block_min` to
    # `row_block_max` whose threads hold the row in registers (`row_regs` elements
    # each), so a row of 1024 runs 128 threads (8 elements each, more blocks per
    # multiprocessor) and one of 4096 the most, `row_block_max` (at most the launch
    # bounds' `block_threads`).
    row_block_min: int = 64
    row_block_max: int = 256
    block_threads: int = 256  # threads per block of a launch, every kernel's __launch_bounds__ (a multiple of 32, at most 1024)
    # the blocks per multiprocessor a row group's launch bounds ask for: one, so ptxas may
    # give a thread up to 255 registers for the row it holds (`row_regs`)
    row_min_blocks: int = 1
    arch: str = "sm_90"  # the GPU architecture `tgc build --target cuda` compiles for (nvcc -arch)
    grid_per_sm: int = 16     # on a GPU, a launch takes at most this many blocks per multiprocessor (grid-stride loops do the rest)
    bindings_kept: int = 4    # bindings of the dims kept per program (runtime._Binding: workspace, steps, graphs), most recently used first
    graphs_kept: int = 4      # CUDA graphs kept per binding (by the addresses of the arguments and outputs); a binding with more misses than hits after twice this many captures stops capturing
    outputs_kept: int = 4     # output sets kept per binding, to be written again once the caller drops them
    wide_scatter_terms: int = 256   # an f32 scatter-add of more than this many terms per output element adds f64 atomics into a scratch of doubles, each element rounded once (else f32 atomics into the output)

    def __post_init__(self) -> None:
        check_fields(self)
        if not (32 <= self.block_threads <= 1024 and self.block_threads % 32 == 0):
            raise ValueError(f"CudaOptions.block_threads must be a multiple of 32 from 32 to 1024, "
                             f"not {self.block_threads!r}")
        for name in ("grid_per_sm", "row_slot_rows", "row_slot_elems"):   # 0: no blocks, no slots
            if getattr(self, name) < 1:
                raise ValueError(f"CudaOptions.{name} must be 1 or more, not {getattr(self, name)!r}")

    def row_block(self, length: int) -> int:
        """The threads of a block-per-row launch for rows of `length` elements (above):
        a power of two, at least a warp (32), at most `row_block_max` (or 32)."""
        block = 32
        while 2 * block <= self.row_block_max and (block < self.row_block_min or block * self.row_regs < length):
            block *= 2
        return block

    def with_(self, **changes) -> "CudaOptions":
        """A copy with the given fields changed."""
        return replace(self, **changes)
