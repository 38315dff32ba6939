"""What a generated CUDA module is to the host: its source and the `Launch`es a call
runs in order (`CudaModule`), the error for a form the backends do not compile
(`CudaUnsupported`), and the scratch a row group's column sums write (`row_slots`,
`COL_SCRATCH`). Plain data, shared by the kernel generators (`codegen`, `rowgen`),
the runtime and `tgc build`'s manifest (`aot`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tgc.backends.base import BackendUnavailable
from tgc.ir.sizes import Size, size_eval
from tgc.lower.lowered import GemmKernel, StepLoop

COL_SCRATCH = "$colpart"   # the binding's scratch of chunk partials (doubles), a column kernel's last buffer


def row_slots(nrows: int, ncols: int, slot_rows: int, slot_elems: int) -> int:
    """The slots of rows a row group's fused column sums deal `nrows` rows to, for
    `ncols` columns (`tgc_row_slots` of tgc_ops.cuh: the same formula;
    `CudaOptions.row_slot_rows`, `row_slot_elems`): a function of the sizes only."""
    by_rows = -(-nrows // max(1, slot_rows))
    by_elems = -(-slot_elems // ncols) if ncols > 0 else by_rows
    return min(by_rows, by_elems)


class CudaUnsupported(BackendUnavailable):
    """The lowered program has a form the CUDA backend does not compile (yet); the
    message starts "not supported by the cuda backend yet: " (exit 3 from the CLI)."""

    def __init__(self, what: str):
        super().__init__(f"not supported by the cuda backend yet: {what}")


@dataclass
class Launch:
    """One step of a call, in order: a kernel launch (`kind` loop, zero or check) over
    `total` work items (a size expression of the dims), a host-side GEMM, or a loop over
    an edge run by the host (`kind` steps: `loop`, `body`, `carry`)."""
    kind: str                         # loop | zero | check | rows | gemm | steps
    name: str = ""                    # the kernel's name in the module ('' for gemm)
    bufs: tuple[str, ...] = ()        # buffer arguments, in the kernel's parameter order
    total: tuple[Size, ...] = ()      # the work items: the product of these sizes
    gemm: GemmKernel | None = None
    index: int = -1                   # the lowered kernel (or check) it comes from
    row: str = ""                     # a reduction's one-block-per-output variant (kernel name), if any
    red: tuple[Size, ...] = ()        # the reduced loops' sizes (the row variant runs when their product is large)
    warp: str = ""                    # a row group's warp-per-row variant (kind rows; `name` is its block-per-row one)
    inner: tuple[Size, ...] = ()      # a row group's row length (the warp variant runs when it is short)
    writes: tuple[str, ...] = ()      # the buffers it writes, when more than its first (a row group)
    col: str = ""                     # a column sum's tiled variant (`col_loop`): partials per chunk of rows
    col_sum: str = ""                 # ... and the kernel adding its chunks' partials in order (when more than one)
    loop: StepLoop | None = None      # kind steps: the loop over an edge, run by the host
    body: list["Launch"] = field(default_factory=list)    # kind steps: its step's launches (the step's buffers)
    carry: list["Launch"] = field(default_factory=list)   # kind steps: copies of the carries, after each step

    # a row group with column sums: (rows' sizes, columns' sizes, column sums, slot_rows,
    # slot_elems) of its partials in the scratch (`scratch`)
    slots: tuple = ()
    # an f32 scatter-add's zero and add launches: the kernels of its f64 form (the zero
    # kernel filling the scratch; the add kernel adding f64 atomics into it, then
    # `wide_round` rounding each element once into the output), taken when its terms
    # are more than `CudaOptions.wide_scatter_terms` per element of the output (`wide_at`)
    wide: str = ""
    wide_round: str = ""
    terms: tuple[Size, ...] = ()      # ... the scatter's terms: the product of these sizes
    elems: tuple[Size, ...] = ()      # ... the output's elements (the scratch's doubles)

    def wide_at(self, env: dict, per_elem: int) -> bool:
        """Whether this launch of an f32 scatter-add takes its f64 form with these dims:
        more than `per_elem` terms per output element."""
        if not self.wide:
            return False
        terms = math.prod(size_eval(x, env) for x in self.terms)
        return terms > per_elem * math.prod(size_eval(x, env) for x in self.elems)

    def scratch(self, env: dict) -> int:
        """The doubles of scratch (COL_SCRATCH) this launch writes with these dims: a row
        group's column partials, a slot row per column sum (0 if none)."""
        if not self.slots:
            return 0
        rows, cols, count, slot_rows, slot_elems = self.slots
        nrows = math.prod(size_eval(x, env) for x in rows)
        ncols = math.prod(size_eval(x, env) for x in cols)
        return count * ncols * row_slots(nrows, ncols, slot_rows, slot_elems)


def all_launches(launches: list[Launch]):
    """Every launch of the list and of the loops' steps and carry copies in it."""
    for x in launches:
        yield x
        if x.kind == "steps":
            yield from all_launches(x.body)
            yield from all_launches(x.carry)


@dataclass
class CudaModule:
    source: str
    launches: list[Launch] = field(default_factory=list)
    dims: tuple[str, ...] = ()        # the dim parameters every kernel takes, in order
    dtype: str = "f32"

    def kernel_names(self) -> list[str]:
        return [n for x in all_launches(self.launches) if x.kind not in ("gemm", "steps")
                for n in (x.name, x.row, x.warp, x.col, x.col_sum, x.wide, x.wide_round) if n]
