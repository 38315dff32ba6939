"""CUDA C from the lowered program: one module per program, one `__global__` kernel
per loop kernel, and a launch list the host side runs in order.

`generate(low)` takes a `Lowered` program after `plan` (lowered by the neutral
stages only, as `tgc.backends.cuda.runtime` lowers) and returns a
`CudaModule`: the CUDA C text (the device header `tgc_ops.cuh` inlined, so it is one
self-contained source for nvcc, NVRTC and the cuda-sim emulator) and its `Launch`es.

What each kernel kind becomes (the meaning is `tgc.lower.interp`'s):

- a `LoopKernel` is a grid-stride loop over the points of its kept (not reduced)
  loops, the innermost fastest, so neighbouring threads write neighbouring elements
  of a row-major output. Each thread reduces its point's reduced loops serially
  (sum in double; max/min propagating NaN; maxshift skipping NaN; logsumexp as a
  maxshift pass then a sum of exp(x - m) pass), each reduced loop over
  [max(0, lower bounds...), min(size, upper bounds...)), then applies the epilogue
  and stores. Every operation is in the program's float type, as on the CPU.
- an elementwise loop kernel of an f32 program whose innermost loop is its output's
  contiguous edge also has a float4 loop (`vector_loop`: four neighbours per thread,
  one 16-byte load per operand read along its own contiguous edge, one 16-byte store;
  8-byte `ushort4` ones for bf16/f16 buffers), taken when the run-time sizes and
  addresses allow, else the scalar loop;
- a column sum (`out[c] = sum[rows] ...` read along its contiguous edge: a bias or
  weight gradient) also has a tiled form (`col_loop`): a block per tile of 128
  columns and chunk of rows, lanes over columns (float4 where allowed), warps over
  rows, the chunks' partials added in chunk order by a second kernel: coalesced, and
  the same bits on every run;
- a `RowGroup` (the backends' own `rowgroup` stage, `rows.py`) is one kernel with
  two variants, a block or a warp per row (`rowgroup`): each member in turn over
  the row, reductions by warp shuffles and shared memory, a row's values in
  registers, the row's elements in registers where it fits; its column sums (bias
  and weight gradients that joined it) as a partial row per slot of rows, added in
  slot order by one more kernel (`row_columns`);
- a scatter kernel is two launches: a grid-stride fill of the output (0, or -inf/inf
  for a segment max/min), then one thread per point combining its term with
  `atomicAdd` (the order of the additions is not fixed: sums agree to rounding, not
  bit for bit) or a compare-and-swap max/min (`tgc_atomic_extreme`: exact, NaN kept).
- indices (`Ix`: loop variables, gathered ids, floor divisions, with size
  coefficients), masks, strides and padding are integer arithmetic in `long long`
  on the buffers' row-major layouts; a `Mask` is a conditional, so its operand (and
  its loads) is not evaluated outside it.
- a `Check` is a kernel over the id buffer that writes the check's number into the
  device error word (compare-and-swap from 0, launched in order: the first failing
  check wins); every other kernel of such a module returns at once when the word is
  set, so nothing is written whether the host reads the word after the checks
  (launching each kernel) or once after the whole call (a CUDA graph).
- a `StepLoop` (a loop over an edge: `repeat`, `scan`, their derivative loops) is a
  `Launch` of kind steps: its step's kernels generated once, by a generator of the
  step's own (the same module, names under `<prefix>s<i>_`, nested loops alike), and
  a copy kernel per carry; the host runs the loop (`runtime.CudaKernels`). A step's
  own checks are not run (as in the lowered interpreter and the CPU backend).
- a `GemmKernel` without taps or shifts is a host-side call (`Launch.gemm`: a cuBLAS
  strided batched GEMM on a GPU, numpy on the same strides under cuda-sim; `gemm.py`); one
  with taps or shifts (a convolution) becomes a loop kernel summing over its `k` and
  tap edges with the shifted reads masked to their ranges (`gemm_as_loop`), which is
  the same sum: each call of the CPU's tap loop adds zeros where it clips.

Exactness: the same operations in the same float type as the CPU backend, with the
CUDA math library's transcendentals (a few ulps from the CPU's), reductions in a
different order (sums in double), so results agree to the type's precision, not bit
for bit. Generation walks the finite expression trees once: it terminates.
Kernels another backend's own stage made (the CPU's `LoopGroup`) are refused. A
complex GEMM cell is a host-side call too (`cublas<c|z>gemmStridedBatched`).
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from tgc.backends.base import BackendUnavailable
from tgc.backends.cuda.philox import device_function
from tgc.backends.cuda.options import CudaOptions
from tgc.backends.cuda.rows import RowGroup, column_member, inner_loops
from tgc.lower.lowered import (Acc, Add, Buffer, Cond, Const, FloorDiv, GemmKernel, IdLoad, Ix, Load,
                            LoopKernel, Lowered, Map, Mask, Mul, Rand, SizeOf, StepLoop, View, neg, walk,
                            wide_sum)
from tgc.ir.ops import FNS
from tgc.ir.sizes import Size, SizeOp, size_eval
from tgc.lower.visit import ExprVisitor

HEADER = Path(__file__).with_name("tgc_ops.cuh")
# a buffer's element type in C; bf16 and f16 buffers (`narrow`) hold their 16 bits,
# loaded with tgc_ld_bf16/tgc_ld_f16 and stored with tgc_st_bf16/tgc_st_f16 (tgc_ops.cuh)
C_TYPES = {"f32": "float", "f64": "double", "i32": "int", "bf16": "unsigned short", "f16": "unsigned short"}
LOW = ("bf16", "f16")
# the vector type of four elements and its alignment, per buffer type (vector_loop)
VEC = {"f32": ("float4", 16), "bf16": ("ushort4", 8), "f16": ("ushort4", 8)}
# The CUDA template per elementwise function of tgc.ir.ops.FNS, derived by rule: every
# function that reaches backends (no `lowered_by`) is the device function `tgc_{name}`
# of tgc_ops.cuh applied to its arguments {0}, {1}, ... (each already cast to the
# program's float type). Functions missing here are refused (CudaUnsupported).
TEMPLATES = {f.name: f"tgc_{f.name}({', '.join(f'{{{i}}}' for i in range(f.arity))})"
             for f in FNS.values() if not f.lowered_by}
# the line of tgc_ops.cuh that `header` replaces by the math library's device functions
LIBM_MARK = "// @libm: the functions of tgc/ir/ops.py with a math library spelling (Fn.libm)\n"


def libm_device_functions() -> str:
    """`tgc_{name}` in float and double for every function of tgc.ir.ops.FNS that the C
    math library computes (`Fn.libm`, its double spelling; the float one appends `f`:
    expf, fabsf, powf), in the table's order: the CUDA math library on a GPU, libm
    under cuda-sim."""
    lines = []
    for f in FNS.values():
        if f.libm and not f.lowered_by:
            params = "xyz"[:f.arity]
            for t, suffix in (("float", "f"), ("double", "")):
                decl = ", ".join(f"{t} {p}" for p in params)
                lines.append(f"TGC_DEV {t} tgc_{f.name}({decl}) {{ return {f.libm}{suffix}({', '.join(params)}); }}\n")
    return "".join(lines)


@functools.cache
def header() -> str:
    """The device header every module inlines: tgc_ops.cuh with the math library's
    device functions (`libm_device_functions`) in place of its `LIBM_MARK` line."""
    text = HEADER.read_text()
    if text.count(LIBM_MARK) != 1:
        raise ValueError(f"{HEADER} must hold the line {LIBM_MARK.strip()!r} once")
    return text.replace(LIBM_MARK, libm_device_functions())


# functions of tgc.ir.ops.FNS not built here yet (none)
NOT_YET: dict[str, str] = {}
BLOCK = 256          # threads per block on a GPU
# the blocks per multiprocessor a row group's launch bounds ask for: one, so ptxas may
# give a thread up to 255 registers for the row it holds (`row_regs`); left to itself it
# capped some variants at 128 and spilled (ptxas -v, sm_90: the f64 layernorm's warp
# variant, the GPT's attention and layernorm groups at 80)
ROW_MIN_BLOCKS = 1
# a column sum's tiles and chunks (tgc_ops.cuh's TGC_COL_TILE, TGC_COL_ROWS, TGC_COL_BLOCKS)
COL_TILE, COL_ROWS, COL_BLOCKS = 128, 64, 1024
COL_SCRATCH = "$colpart"   # the binding's scratch of chunk partials (doubles), a column kernel's last buffer


def row_slots(nrows: int, ncols: int, slot_rows: int, slot_elems: int) -> int:
    """The slots of rows a row group's fused column sums deal `nrows` rows to, for
    `ncols` columns (`tgc_row_slots` of tgc_ops.cuh: the same formula;
    `CudaOptions.row_slot_rows`, `row_slot_elems`): a function of the sizes only."""
    by_rows = -(-nrows // max(1, slot_rows))
    by_elems = -(-slot_elems // ncols) if ncols > 0 else by_rows
    return min(by_rows, by_elems)


def col_chunks(nred: int, ncols: int) -> int:
    """The chunks of rows a column sum over `nred` rows into `ncols` columns is split
    into (`tgc_col_chunks` of tgc_ops.cuh: the same formula): at least COL_ROWS rows
    per chunk, about COL_BLOCKS blocks in all; a function of the sizes only."""
    tiles = -(-ncols // COL_TILE)
    return max(1, min(-(-nred // COL_ROWS), -(-COL_BLOCKS // max(tiles, 1))))


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
                for n in (x.name, x.row, x.warp, x.col, x.col_sum) if n]


def generate(low: Lowered, prefix: str = "", cuda: CudaOptions | None = None) -> CudaModule:
    """The CUDA module of `low` (after `plan`, no loop groups); `prefix` starts every
    kernel's name (modules of one float type with distinct prefixes can be
    concatenated into one translation unit: the tests compile many at once);
    `cuda`: the settings the kernels are shaped by (`row_regs`, `row_slot_rows`, ...)."""
    return _Gen(low, prefix, cuda or CudaOptions()).run()


def gemm_as_loop(low: Lowered, k: GemmKernel) -> LoopKernel:
    """`k` as a loop kernel: out[batch, m, n] = sum over k and taps of a * b, each
    operand read at its (shifted) index and masked to its buffer's range."""
    shifts = {(role, e): ix for role, e, ix in k.shifts}
    out_edges = low.buffers[k.out].edges

    def operand(role: str, view: View):
        conds: list[Cond] = []
        index = []
        for v, b in view.edges:
            ix = Ix.var(v)
            if (role, v) in shifts:
                ix = ix.plus(shifts[(role, v)])
                conds += [Cond(ix, ">="), Cond(ix.plus_const(neg(low.size(b))), "<")]
            index.append((b, ix))
        load = Load(view.buf, tuple(sorted(index)))
        return Mask(tuple(conds), load) if conds else load

    loops = tuple(dict.fromkeys(list(out_edges) + list(k.k) + list(k.taps)))
    red = tuple(v for v in loops if v not in out_edges)
    sizes = {v: low.size(v) for v in loops}
    return LoopKernel(out=k.out, index=tuple((e, Ix.var(e)) for e in out_edges), loops=loops, sizes=sizes,
                      body=Mul((operand("a", k.a), operand("b", k.b))), reduce="sum", red=red, note=k.note)


class _Gen(ExprVisitor):
    """The kernels of one lowered program; a loop's step is generated by a `_Gen` of
    its own (`parent`: the enclosing program's), whose kernels join the same module
    (the same text, draws, dims and error word; names under a prefix of their own).
    Expressions become C text through its `expr_*` and `atom_*` methods
    (`ExprVisitor`), given the kernel's `_Ctx`."""

    def __init__(self, low: Lowered, prefix: str, cuda: CudaOptions, parent: "_Gen | None" = None):
        if low.dtype not in ("f32", "f64"):
            raise CudaUnsupported(f"float type '{low.dtype}'")
        self.low, self.prefix = low, prefix
        self.T = C_TYPES[low.dtype]
        self.launches: list[Launch] = []
        self.cuda = cuda
        self.row_regs = max(1, int(cuda.row_regs))
        self.root = parent is None
        if parent is None:
            self.dims = tuple(low.module.symbolic_dims())
            self.parts: list[str] = []
            self.sim: list[str] = []             # the emulator's host entries
            self.draws: dict[tuple, str] = {}   # (kind, dtype, folds) -> its device function (philox.py)
            self.guard = bool(low.checks)       # kernels return at once when a check failed
        else:
            self.dims, self.parts, self.sim, self.draws, self.guard = (parent.dims, parent.parts, parent.sim,
                                                                       parent.draws, parent.guard)
        self.dim_c = {d: f"d{i}" for i, d in enumerate(self.dims)}

    # ------------------------------------------------------------ the module

    def run(self) -> CudaModule:
        low = self.low
        self.emit()
        head = [f"// generated by tgc (cuda backend): {len(self.launches)} launches, {low.dtype}",
                f"typedef {self.T} tgc_t;", header()]
        for (kind, dtype, folds), name in self.draws.items():
            head.append(f"// {kind} in {dtype}, Philox 4x32-10 (tgc/ir/philox.py)\nstatic "
                        + device_function(name, kind, dtype, folds))
        sim = ["#ifdef TGC_CUDA_SIM", "// cuda-sim: one host entry per kernel (tgc/backends/cuda/sim.h)"]
        source = "\n".join(head + self.parts + sim + self.sim + ["#endif"]) + "\n"
        return CudaModule(source, self.launches, self.dims, low.dtype)

    def emit(self) -> None:
        """The kernels and launches of this program (its loops' steps' too), with the
        emulator's entries."""
        low = self.low
        if self.root:   # a step's checks are not run (as the lowered interpreter and the CPU backend)
            for i, c in enumerate(low.checks):
                self.check(i, c)
        for i, k in enumerate(low.kernels):
            if isinstance(k, RowGroup):
                self.rowgroup(i, k)
                continue
            if isinstance(k, StepLoop):
                self.steps(i, k)
                continue
            if not isinstance(k, (LoopKernel, GemmKernel)):   # another backend's own kind (the CPU's groups)
                raise CudaUnsupported(f"{type(k).__name__} kernels (another backend's own lowering stage)")
            if isinstance(k, GemmKernel):
                if k.taps or k.shifts:
                    self.loop(i, gemm_as_loop(low, k))
                else:
                    self.launches.append(Launch("gemm", gemm=k, index=i))
                continue
            self.loop(i, k)
        self.sim_entries(self.launches)

    def sim_entries(self, launches: list[Launch]) -> None:
        """The emulator's host entry of each kernel of `launches` (a loop's carry
        copies: this program's; its step's: the step's `_Gen`)."""
        for x in launches:
            if x.kind == "steps":
                self.sim_entries(x.carry)
                continue
            if x.kind == "gemm":
                continue
            written = set(x.writes) if x.writes else ({x.bufs[0]} if x.kind != "check" else set())
            args = [("(double*)" if b == COL_SCRATCH else f"({self.buf_type(b, write=b in written)}*)") + f"b[{j}]"
                    for j, b in enumerate(x.bufs)]
            args += [f"d[{j}]" for j in range(len(self.dims))] + ["err"]
            tail = [f"d[{j}]" for j in range(len(self.dims))] + ["err"]
            scratch = args[:len(x.bufs)] + [f"(double*)b[{len(x.bufs)}]"] + tail
            plain = "TGC_SIM_LAUNCH" if x.kind == "rows" else "TGC_SIM_LAUNCH_SERIAL"
            for name, launch, call in ((x.name, plain, args), (x.row, "TGC_SIM_LAUNCH", args),
                                       (x.warp, "TGC_SIM_LAUNCH", args), (x.col, "TGC_SIM_LAUNCH", scratch),
                                       (x.col_sum, "TGC_SIM_LAUNCH_SERIAL", scratch)):
                if name:   # the row and column variants need a team per block: barriers and shuffles
                    self.sim.append(f'extern "C" void tgc_launch_{name}(void* const* b, const long long* d, '
                                    f"int* err, unsigned grid, unsigned block) {{\n    "
                                    f"{launch}(grid, block, {name}({', '.join(call)}));\n}}")

    def steps(self, i: int, k: StepLoop) -> None:
        """A loop over an edge: its step's kernels generated once (a `_Gen` of the step,
        names under `<prefix>s<i>_`), run by the host for every index with the stacked
        buffers' slices; then a copy kernel per carry (`outs[c]` into `args[c].buf`,
        in this program's buffers)."""
        inner = _Gen(k.step, f"{self.prefix}s{i}_", self.cuda, parent=self)
        inner.emit()
        here = len(self.launches)
        for c in range(k.carries):
            dst, src = k.args[c].buf, k.outs[c].buf
            edges = self.low.buffers[dst].order or self.low.buffers[dst].edges
            copy = LoopKernel(out=dst, index=tuple((e, Ix.var(e)) for e in edges), loops=tuple(edges),
                              sizes={e: self.low.size(e) for e in edges},
                              body=Load(src, tuple(sorted((e, Ix.var(e)) for e in edges))),
                              note=f"carry {c} of the loop over {k.edge}: %{dst} = %{src}")
            self.loop(i, copy, name=f"{self.prefix}s{i}_carry{c}")
        carry = self.launches[here:]
        del self.launches[here:]
        self.launches.append(Launch("steps", index=i, loop=k, body=inner.launches, carry=carry))

    def store(self, buf: str, ptr: str, offset: str, value: str) -> str:
        """The C statement storing `value` at element `offset` of `buf` (pointer
        `ptr`): a 2-byte buffer's element narrowed (the value is one of its type, so
        exactly)."""
        dtype = self.low.buffers[buf].dtype
        if dtype in LOW:
            value = f"tgc_st_{dtype}((float)({value}))"
        return f"{ptr}[{offset}] = {value};"

    def buf_type(self, name: str, write: bool) -> str:
        t = C_TYPES[self.low.buffers[name].dtype]
        return t if write else f"const {t}"

    def params(self, bufs: list[str], written, scratch: bool = False) -> str:
        """The parameters of a kernel reading `bufs` and writing `written` (a buffer's
        name, a set of them, or None); `scratch`: then the chunk partials of a column
        sum (`col_loop`)."""
        written = {written} if isinstance(written, str) else set(written or ())
        ps = []
        for j, b in enumerate(bufs):
            t = C_TYPES[self.low.buffers[b].dtype]
            ps.append(f"{t}* p{j}" if b in written else f"const {t}* __restrict__ p{j}")
        if scratch:
            ps.append("double* __restrict__ part")
        ps += [f"long long {self.dim_c[d]}" for d in self.dims] + ["int* __restrict__ err"]
        return ", ".join(ps)

    def kernel(self, name: str, params: str, body: list[str], note: str, check: bool = False,
               min_blocks: int = 0) -> None:
        """A `__global__` kernel. In a module with checks, every other kernel first
        reads the error word and returns if a check failed: a call that runs every
        launch without the host looking in between (a CUDA graph) writes nothing
        then (the word is uniform, so a block's barriers are still reached by all).
        `min_blocks`: the blocks per multiprocessor its registers must allow."""
        if self.guard and not check:
            body = ["if (*err) return;   // a check failed: nothing is written"] + body
        text = f"// {note}\n" if note else ""
        bounds = f"{BLOCK}, {min_blocks}" if min_blocks else f"{BLOCK}"
        text += (f'extern "C" __global__ void __launch_bounds__({bounds}) {name}({params}) {{\n'
                 + "\n".join("    " + line for line in body) + "\n}")
        self.parts.append(text)

    # ------------------------------------------------------------ sizes and indices

    def size(self, s: Size) -> str:
        if isinstance(s, int):
            return f"{s}LL"
        if isinstance(s, str):
            return self.dim_c[s]
        assert isinstance(s, SizeOp)
        if s.op == "min":
            a, b = self.size(s.lhs), self.size(s.rhs)
            return f"({a} < {b} ? {a} : {b})"
        return f"({self.size(s.lhs)} {s.op} {self.size(s.rhs)})"

    def layout(self, name: str) -> list[tuple[str, str]]:
        """(edge, stride expression) of a buffer's axes, outermost first (row-major)."""
        b: Buffer = self.low.buffers[name]
        order = b.order if b.order is not None else b.edges
        out, stride = [], "1LL"
        for e in reversed(order):
            out.append((e, stride))
            stride = f"{stride} * {self.size(self.low.size(e))}" if stride != "1LL" else self.size(self.low.size(e))
        return list(reversed(out))

    def offset(self, name: str, index, ctx: "_Ctx") -> str:
        at = dict(index)
        terms = []
        for e, stride in self.layout(name):
            ix = self.ix(at[e], ctx)
            terms.append(ix if stride == "1LL" else f"({ix}) * ({stride})")
        return " + ".join(terms) if terms else "0"

    def ix(self, ix: Ix, ctx: "_Ctx") -> str:
        parts = []
        for atom, coef in ix.terms:
            a = self.atom(atom, ctx)
            parts.append(a if coef == 1 else f"{self.size(coef)} * {a}")
        if ix.const != 0 or not parts:
            parts.append(self.size(ix.const))
        return "(" + " + ".join(parts) + ")"

    def atom_var(self, a: str, ctx: "_Ctx") -> str:
        return ctx.var[a]

    def atom_floor_div(self, a: FloorDiv, ctx: "_Ctx") -> str:
        return f"tgc_floordiv({self.ix(a.num, ctx)}, {self.size(a.den)})"

    def atom_id_load(self, a: IdLoad, ctx: "_Ctx") -> str:
        return f"(long long){ctx.ptr(a.buf)}[{self.offset(a.buf, a.index, ctx)}]"

    def cond(self, c: Cond, ctx: "_Ctx") -> str:
        op = "==" if c.op == "=" else c.op
        return f"{self.ix(c.ix, ctx)} {op} 0"

    # ------------------------------------------------------------ expressions

    def expr_load(self, e: Load, ctx: "_Ctx") -> str:
        T = "tgc_t"
        if e in ctx.vec:           # one component of a float4 (ushort4) load (vector_loop)
            dtype = self.low.buffers[e.buf].dtype
            v = f"{ctx.vec[e]}.{ctx.comp}"
            return f"(({T})tgc_ld_{dtype}({v}))" if dtype in LOW else v
        if e.buf in ctx.vals:      # a row group's value per row (the stage reads it at its own row only)
            return ctx.vals[e.buf]
        if e.buf in ctx.cache and self.identity(e):   # a row group's element kept in registers
            return f"{ctx.cache[e.buf]}[k]"
        ctx.loaded.add(e.buf)
        v = f"{ctx.ptr(e.buf)}[{self.offset(e.buf, e.index, ctx)}]"
        dtype = self.low.buffers[e.buf].dtype
        if dtype in LOW:           # a 2-byte element, widened exactly
            return f"(({T})tgc_ld_{dtype}({v}))"
        return v if dtype == self.low.dtype else f"(({T}){v})"

    def expr_const(self, e: Const, ctx: "_Ctx") -> str:
        return self.const(e.value)

    def expr_size_of(self, e: SizeOf, ctx: "_Ctx") -> str:
        return f"((tgc_t){self.size(e.size)})"

    def expr_acc(self, e: Acc, ctx: "_Ctx") -> str:
        if ctx.acc is None:
            raise CudaUnsupported("acc outside an epilogue")
        return ctx.acc

    def expr_mask(self, e: Mask, ctx: "_Ctx") -> str:
        if not e.conds:
            return self.expr(e.arg, ctx)
        conds = " && ".join(f"({self.cond(c, ctx)})" for c in e.conds)
        return f"(({conds}) ? {self.expr(e.arg, ctx)} : (tgc_t)0)"

    def expr_add(self, e: Add, ctx: "_Ctx") -> str:
        if wide_sum(e, self.low.dtype):
            return self.wide_add(e, ctx)
        terms = []
        for c, a in zip(e.coefs, e.args):
            x = self.expr(a, ctx)
            terms.append(x if c == 1 else f"{self.const(c)} * {x}")
        return "(" + " + ".join(terms) + ")"

    def expr_mul(self, e: Mul, ctx: "_Ctx") -> str:
        return "(" + " * ".join(self.expr(a, ctx) for a in e.args) + ")"

    def expr_rand(self, e: Rand, ctx: "_Ctx") -> str:
        """A Philox draw: a device function per kind, type and folds (philox.py)."""
        dtype = e.draw or self.low.dtype
        spec = (e.kind, dtype, tuple(n if isinstance(n, int) else None for n in e.folds))
        if spec not in self.draws:
            self.draws[spec] = f"{self.prefix}tgc_draw{len(self.draws)}"
        args = [self.ix(e.key, ctx), self.ix(e.counter, ctx)]
        args += [self.ix(n, ctx) for n in e.folds if not isinstance(n, int)]
        return f"((tgc_t){self.draws[spec]}({', '.join(args)}))"

    def expr_map(self, e: Map, ctx: "_Ctx") -> str:
        if e.fn not in TEMPLATES:
            raise CudaUnsupported(f"elementwise function '{e.fn}'")
        return TEMPLATES[e.fn].format(*(f"(tgc_t){self.expr(a, ctx)}" for a in e.args))

    def wide_add(self, e: Add, ctx: "_Ctx") -> str:
        """An f32 sum of several terms in double, rounded once (`lowered.wide_sum`): a
        product's factors widened before they are multiplied, so its value does not
        depend on the order of its terms."""
        terms = []
        for c, a in zip(e.coefs, e.args):
            if isinstance(a, Mul):
                x = "(" + " * ".join(f"(double){self.expr(f, ctx)}" for f in a.args) + ")"
            else:
                x = f"(double){self.expr(a, ctx)}"
            terms.append(x if c == 1 else f"{float(c)!r} * {x}")
        return "((tgc_t)(" + " + ".join(terms) + "))"

    def const(self, v: float) -> str:
        if math.isnan(v):
            return "((tgc_t)TGC_NAN)"
        if math.isinf(v):
            return "((tgc_t)TGC_INF)" if v > 0 else "(-(tgc_t)TGC_INF)"
        return f"((tgc_t){float(v)!r})"

    # ------------------------------------------------------------ kernels

    def check(self, i: int, c) -> None:
        name = f"{self.prefix}check{i}"
        buf = self.low.buffers[c.buf]
        sizes = tuple(self.low.size(e) for e in buf.edges)
        total = " * ".join(self.size(s) for s in sizes) or "1LL"
        body = [f"const long long n = {total};",
                "for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < n; "
                "t += (long long)gridDim.x * blockDim.x) {",
                "    long long id = p0[t];",
                f"    if (id < 0 || id >= {self.size(c.size)}) atomicCAS(err, 0, {i + 1});",
                "}"]
        self.kernel(name, self.params([c.buf], None), body, f"check 0 <= %{c.buf} < ...", check=True)
        self.launches.append(Launch("check", name, (c.buf,), sizes, index=i))

    def loop(self, i: int, k: LoopKernel, name: str = "") -> None:
        """Loop kernel `k` (lowered kernel `i`), named `name` or `<prefix>k<i>`."""
        name = name or f"{self.prefix}k{i}"
        bufs = k.buffers_used()
        ctx = _Ctx({b: f"p{j}" for j, b in enumerate(bufs)})
        kept = [v for v in k.loops if v not in k.red]
        for j, v in enumerate(k.loops):
            ctx.var[v] = f"i{j}"
        note = (k.note or k.text().splitlines()[0]).replace("\n", " ")
        if k.scatter:
            out_sizes = tuple(self.low.size(e) for e in self.low.buffers[k.out].edges)
            n = " * ".join(self.size(s) for s in out_sizes) or "1LL"
            zero = [f"const long long n = {n};",
                    "for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < n; "
                    f"t += (long long)gridDim.x * blockDim.x) p0[t] = {_SCATTER_INIT[k.reduce or 'sum']};"]
            self.kernel(f"{name}_zero", self.params([k.out], k.out), zero, f"zero %{k.out} before the scatter")
            self.launches.append(Launch("zero", f"{name}_zero", (k.out,), out_sizes, index=i))
        sizes = [self.size(k.sizes[v]) for v in kept]
        body = [f"const long long n = {' * '.join(sizes) or '1LL'};",
                "for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < n; "
                "t += (long long)gridDim.x * blockDim.x) {"]
        inner = []
        if kept:
            inner += _split("r", "t", [(ctx.var[v], "", s) for v, s in zip(kept, sizes)])
        at = self.offset(k.out, k.index, ctx)
        store = f"p0[{at}]"
        if k.scatter:
            if k.red:
                raise CudaUnsupported("a scatter kernel with reduced loops")
            combine = {"sum": "atomicAdd", "max": "tgc_atomic_max", "min": "tgc_atomic_min"}[k.reduce or "sum"]
            inner += self.guarded(k, kept, ctx, [f"{combine}(&{store}, {self.expr(k.body, ctx)});"])
        elif not k.reduce:
            inner.append(self.store(k.out, "p0", at, self.expr(k.body, ctx)))
        else:
            inner += self.reduction(k, ctx)
            ctx.acc = "acc"
            value = self.expr(k.epilogue, ctx) if k.epilogue is not None else "acc"
            inner.append(self.store(k.out, "p0", at, value))
        body += ["    " + line for line in inner] + ["}"]
        vec = self.vector_loop(k, ctx, kept, sizes) if not k.reduce and not k.scatter else None
        if vec is not None:   # float4 loads and stores where the run-time sizes and addresses allow
            cond, lines = vec
            body = ([f"if ({cond}) {{"] + ["    " + line for line in lines] + ["} else {"]
                    + ["    " + line for line in body] + ["}"])
        self.kernel(name, self.params(bufs, k.out), body, note)
        row = self.row_loop(name + "_row", k, bufs, kept, note) if _row_ok(k) else ""
        col = self.col_loop(name + "_col", k, bufs, kept, note) if row and self.column_sum(k, kept) else ("", "")
        self.launches.append(Launch("loop", name, tuple(bufs), tuple(k.sizes[v] for v in kept), index=i, row=row,
                                    red=tuple(k.sizes[v] for v in k.red), col=col[0], col_sum=col[1]))

    def vector_loop(self, k: LoopKernel, ctx: "_Ctx", kept: list[str], sizes: list[str]):
        """The elementwise kernel `k` of an f32 program four elements at a time: (the
        run-time condition, the loop), or None. Each thread takes four neighbours along
        the innermost loop, which must be the output's innermost (contiguous) edge; a
        load that reads its buffer's innermost edge at that loop variable (and no other
        edge at it, outside any mask) is one `float4` load (a bf16/f16 buffer's: one
        8-byte `ushort4`, each element then widened), the others are evaluated per
        element; the four results are one `float4` store (`ushort4` of narrowed
        values into a 2-byte buffer). It runs when the innermost size is a multiple of
        4 (so four neighbours stay in one row and every row starts 16, or 8, bytes
        after the last) and every such buffer's address is 16-byte (8-byte) aligned;
        else the scalar loop runs. The same operations on the same elements: the
        results are the scalar loop's."""
        low = self.low
        if low.dtype != "f32" or not kept or low.buffers[k.out].dtype not in VEC:
            return None
        v_in = kept[-1]
        if not self.layout(k.out):
            return None
        out_last = self.layout(k.out)[-1][0]
        at = dict(k.index)
        if at.get(out_last) != Ix.var(v_in) or low.size(out_last) != k.sizes[v_in] \
                or any(v_in in ix.vars() for e, ix in k.index if e != out_last):
            return None
        loads = self.vector_loads(k, v_in)
        ptrs = dict.fromkeys([(ctx.ptr(k.out), k.out)] + [(ctx.ptr(e.buf), e.buf) for e in loads])
        cond = " && ".join([f"{self.size(k.sizes[v_in])} % 4 == 0"]
                           + [f"tgc_aligned{VEC[low.buffers[b].dtype][1]}({p})" for p, b in ptrs])
        base = ctx.var[v_in]
        lines = [f"const long long n4 = ({' * '.join(sizes)}) / 4;",
                 "for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < n4; "
                 "t += (long long)gridDim.x * blockDim.x) {"]
        lines.insert(0, "TGC_SIM_COUNT(0);")
        lines += ["    " + x for x in _split("r", "t * 4", [(ctx.var[v], "", sz) for v, sz in zip(kept, sizes)])]
        names = {}
        for j, e in enumerate(loads):
            names[e] = f"l{j}"
            vt = VEC[low.buffers[e.buf].dtype][0]
            lines.append(f"    const {vt} l{j} = *reinterpret_cast<const {vt}*>("
                         f"&{ctx.ptr(e.buf)}[{self.offset(e.buf, e.index, ctx)}]);")
        out_type = low.buffers[k.out].dtype
        vt = VEC[out_type][0]
        lines.append(f"    {vt} o;")
        for j, comp in enumerate("xyzw"):
            c = _Ctx(ctx.ptrs, {**ctx.var, v_in: f"({base} + {j})"})
            c.vec, c.comp = names, comp
            value = self.expr(k.body, c)
            value = f"tgc_st_{out_type}((float)({value}))" if out_type in LOW else value
            lines.append(f"    o.{comp} = {value};")
        lines.append(f"    *reinterpret_cast<{vt}*>(&p0[{self.offset(k.out, k.index, ctx)}]) = o;")
        lines.append("}")
        return cond, lines

    def along(self, e: Load, v: str, size: Size) -> bool:
        """Whether `e` reads its buffer's innermost (contiguous) edge at loop variable
        `v` (of extent `size`, the edge's) and no other edge at `v`: neighbouring
        values of `v` read neighbouring elements."""
        b = self.low.buffers[e.buf]
        if not b.edges:
            return False
        last = self.layout(e.buf)[-1][0]
        return (dict(e.index).get(last) == Ix.var(v) and self.low.size(last) == size
                and not any(v in i.vars() for ed, i in e.index if ed != last))

    def vector_loads(self, k: LoopKernel, v: str) -> list[Load]:
        """The loads of `k`'s body that read four neighbours along loop `v` as one
        vector (`along` it, of a type with a vector, outside any mask: a masked load
        may lie outside its buffer next to its range)."""
        loads: list[Load] = []

        def visit(e) -> None:
            if isinstance(e, Mask):
                return
            if isinstance(e, Load):
                if self.low.buffers[e.buf].dtype in VEC and self.along(e, v, k.sizes[v]) and e not in loads:
                    loads.append(e)
                return
            for c in getattr(e, "args", ()):
                visit(c)

        visit(k.body)
        return loads

    def column_sum(self, k: LoopKernel, kept: list[str]) -> bool:
        """Whether the reduction `k` is a column sum (a bias or weight gradient,
        `out[c] = sum[rows] ...`) that `col_loop` reads coalesced: a sum, over reduced
        loops without bounds, whose innermost kept loop is its output's contiguous
        edge, read along by at least one load and crossed by none (every load that
        varies with it reads neighbouring elements: the threads of a warp take
        neighbouring columns)."""
        if k.reduce != "sum" or not kept or k.scatter or set(k.bounds) & set(k.red) or not self.layout(k.out):
            return False
        v_in = kept[-1]
        out_last = self.layout(k.out)[-1][0]
        if dict(k.index).get(out_last) != Ix.var(v_in) or self.low.size(out_last) != k.sizes[v_in]:
            return False
        varying = [e for e in _loads_of(k) if any(v_in in ix.vars() for _, ix in e.index)]
        if k.epilogue is not None and any(set(k.red) & ix.vars() for e in walk(k.epilogue)
                                          if isinstance(e, Load) for _, ix in e.index):
            return False
        return bool(varying) and all(self.along(e, v_in, k.sizes[v_in]) for e in varying)

    def col_loop(self, name: str, k: LoopKernel, bufs: list[str], kept: list[str], note: str) -> tuple[str, str]:
        """The column sum `k` (`column_sum`) as two kernels: (`name`, `name`_sum).

        `name`: a block per (tile, chunk): a tile of COL_TILE neighbouring columns (the
        flat index of the kept loops) and a chunk of the reduced points (`col_chunks`
        of them, a function of the sizes only). Warp `w` of the block sums rows
        w, w + warps, ... of its chunk for the tile's columns, in double: a warp's
        32 lanes read 32 neighbouring columns of a row (coalesced), or, in an f32
        program where the innermost size is a multiple of 4 and the buffers read
        along it are 16-byte aligned, 4 neighbours each with one float4 load. The
        warps' partials are added in warp order through shared memory; the block
        writes its chunk's partial per column to the scratch `part` (or, with one
        chunk, the result). Both paths add the same values in the same order.
        `name`_sum: one thread per column adds the chunks' partials in chunk order,
        then the epilogue, and stores. So every addition's order is fixed by the
        sizes and the block size: the same bits on every run."""
        low = self.low
        ctx = _Ctx({b: f"p{j}" for j, b in enumerate(bufs)})
        for j, v in enumerate(k.loops):
            ctx.var[v] = f"i{j}"
        red = [v for v in k.loops if v in k.red]
        sizes = [self.size(k.sizes[v]) for v in kept]
        v_in = kept[-1]
        geometry = [f"const long long ncols = {' * '.join(sizes)}, nred = {' * '.join(self.size(k.sizes[v]) for v in red)};",
                    "const long long tiles = (ncols + TGC_COL_TILE - 1) / TGC_COL_TILE;",
                    "const long long chunks = tgc_col_chunks(nred, tiles);"]

        def split(flat: str, names: dict) -> list[str]:
            return _split("r", flat, [(names[v], "", sz) for v, sz in zip(kept, sizes)])

        def finish(total: str) -> list[str]:
            """The column `c`'s result from its sum `total`: epilogue, store."""
            c = _Ctx(ctx.ptrs, dict(ctx.var))
            c.acc = "acc"
            value = self.expr(k.epilogue, c) if k.epilogue is not None else "acc"
            return (["{"] + ["    " + line for line in split("c", ctx.var)]
                    + [f"    const tgc_t acc = (tgc_t)({total});",
                       "    " + self.store(k.out, "p0", self.offset(k.out, k.index, c), value), "}"])

        rows = (["for (long long q = q0 + warp; q < q1; q += warps) {"]
                + ["    " + s for s in _decompose([(ctx.var[v], "", self.size(k.sizes[v])) for v in red],
                                                  [self.expr(k.body, ctx)])])
        # the scalar path: lane takes columns tile * TILE + lane + 32 * j, j < 4
        scalar = ["const long long c0 = tile * TGC_COL_TILE + lane;"]
        per = {v: f"{ctx.var[v]}_k" for v in kept}
        for v in kept:
            scalar.append(f"long long {per[v]}[4];")
        scalar += ["#pragma unroll", "for (int j = 0; j < 4; ++j) {"]
        scalar += ["    " + x for x in _split("r", "c0 + 32 * j < ncols ? c0 + 32 * j : 0LL",
                                              [(f"{per[v]}[j]", "", sz) for v, sz in zip(kept, sizes)], decl="")]
        scalar.append("}")
        c = _Ctx(ctx.ptrs, {**ctx.var, **{v: f"{per[v]}[j]" for v in kept}})
        x = self.expr(k.body, c)
        scalar += rows + ["    #pragma unroll", "    for (int j = 0; j < 4; ++j)",
                                         f"        if (c0 + 32 * j < ncols) sums[j] += (double){x};", "}"]
        scalar += ["#pragma unroll", "for (int j = 0; j < 4; ++j) part_c[warp][lane + 32 * j] = sums[j];"]
        # the float4 path: lane takes columns tile * TILE + 4 * lane + j
        loads = self.vector_loads(k, v_in) if low.dtype == "f32" else []
        vector: list[str] = []
        cond = ""
        if loads:
            ptrs = dict.fromkeys((ctx.ptr(e.buf), e.buf) for e in loads)
            cond = " && ".join([f"{self.size(k.sizes[v_in])} % 4 == 0"]
                               + [f"tgc_aligned{VEC[low.buffers[b].dtype][1]}({p})" for p, b in ptrs])
            vector = ["const long long c4 = tile * TGC_COL_TILE + 4 * (long long)lane;", "if (c4 < ncols) {"]
            vector += ["    " + s for s in split("c4", ctx.var) + rows]
            names = {}
            for j, e in enumerate(loads):
                names[e] = f"l{j}"
                vt = VEC[low.buffers[e.buf].dtype][0]
                vector.append(f"        const {vt} l{j} = *reinterpret_cast<const {vt}*>("
                              f"&{ctx.ptr(e.buf)}[{self.offset(e.buf, e.index, ctx)}]);")
            for j, comp in enumerate("xyzw"):
                cv = _Ctx(ctx.ptrs, {**ctx.var, v_in: f"({ctx.var[v_in]} + {j})"})
                cv.vec, cv.comp = names, comp
                vector.append(f"        sums[{j}] += (double){self.expr(k.body, cv)};")
            vector += ["    }", "}", "#pragma unroll",
                       "for (int j = 0; j < 4; ++j) part_c[warp][4 * lane + j] = sums[j];"]
        body = [f"__shared__ double part_c[{BLOCK // 32}][TGC_COL_TILE];"] + geometry
        body += ["const long long len = (nred + chunks - 1) / chunks;   // rows per chunk",
                 "const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;",
                 *([f"const bool vec = {cond};"] if vector else []),
                 "for (long long item = blockIdx.x; item < tiles * chunks; item += gridDim.x) {",
                 "    const long long tile = item % tiles, chunk = item / tiles;",
                 "    const long long q0 = chunk * len, q1 = min_ll(q0 + len, nred);",
                 "    double sums[4] = {0.0, 0.0, 0.0, 0.0};"]
        if vector:
            body += ["    if (vec) {", "        TGC_SIM_COUNT(3);"] + ["        " + s for s in vector] + ["    } else {"]
            body += ["        TGC_SIM_COUNT(4);"] + ["        " + s for s in scalar] + ["    }"]
        else:
            body += ["    TGC_SIM_COUNT(4);"] + ["    " + s for s in scalar]
        body += ["    __syncthreads();",
                 "    for (unsigned s = threadIdx.x; s < (unsigned)TGC_COL_TILE; s += blockDim.x) {",
                 "        const long long c = tile * TGC_COL_TILE + s;",
                 "        if (c >= ncols) continue;",
                 "        double total = part_c[0][s];",
                 "        for (unsigned w = 1; w < warps; ++w) total += part_c[w][s];",
                 "        if (chunks > 1) { part[chunk * ncols + c] = total; continue; }"]
        body += ["        " + s for s in finish("total")]
        body += ["    }", "    __syncthreads();   // part_c is written again for the next item", "}"]
        params = self.params(bufs, k.out, scratch=True)
        self.kernel(name, params, body, note + " (column tiles, partials per chunk of rows)")
        total = geometry + ["for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < ncols; "
                            "c += (long long)gridDim.x * blockDim.x) {",
                            "    double total = part[c];",
                            "    for (long long h = 1; h < chunks; ++h) total += part[h * ncols + c];"]
        total += ["    " + s for s in finish("total")] + ["}"]
        self.kernel(name + "_sum", params, total, note + " (the chunks' partials, in order)")
        return name, name + "_sum"

    def row_loop(self, name: str, k: LoopKernel, bufs: list[str], kept: list[str], note: str) -> str:
        """The reduction `k` with one block per output element (a grid-stride loop of
        blocks over them): the block's threads share the reduced iterations, and
        `tgc_block_reduce` combines their partials (shuffles, then shared memory)."""
        ctx = _Ctx({b: f"p{j}" for j, b in enumerate(bufs)})
        for j, v in enumerate(k.loops):
            ctx.var[v] = f"i{j}"
        sizes = [self.size(k.sizes[v]) for v in kept]
        red = [v for v in k.loops if v in k.red]
        inner = []
        if kept:
            inner += _split("r", "t", [(ctx.var[v], "", s) for v, s in zip(kept, sizes)])
        for v in red:
            lo, hi = self.red_range(k, v, ctx)
            i = ctx.var[v]
            inner.append(f"const long long {i}_lo = {lo}, {i}_n = max_ll({hi} - {i}_lo, 0LL);")
        inner.append(f"const long long cnt = {' * '.join(ctx.var[v] + '_n' for v in red)};")

        def over(stmts: list[str]) -> list[str]:
            head = ["for (long long q = threadIdx.x; q < cnt; q += blockDim.x) {"]
            head += ["    " + x for x in _split("rq", "q", [(ctx.var[v], f"{ctx.var[v]}_lo + ", f"{ctx.var[v]}_n")
                                                            for v in red])]
            return head + ["    " + s for s in stmts] + ["}"]

        x = self.expr(k.body, ctx)
        shared = set()
        if k.reduce == "sum":
            inner += ["double sum = 0.0;"] + over([f"sum += (double){x};"])
            inner += ["sum = tgc_block_reduce(sum, tgc_op_sum(), part_d);", "const tgc_t acc = (tgc_t)sum;"]
            shared.add("double part_d[32];")
        elif k.reduce in ("max", "min"):
            better = "!(v <= m)" if k.reduce == "max" else "!(v >= m)"
            init = "-(tgc_t)TGC_INF" if k.reduce == "max" else "(tgc_t)TGC_INF"
            inner += [f"tgc_t m = {init};"] + over([f"const tgc_t v = {x};", f"if (m == m && ({better})) m = v;"])
            inner += [f"const tgc_t acc = tgc_block_reduce(m, tgc_op_{k.reduce}(), part_t);"]
            shared.add("tgc_t part_t[32];")
        else:   # maxshift, logsumexp
            inner += ["tgc_t m = -(tgc_t)TGC_INF;"] + over([f"const tgc_t v = {x};", "if (v > m) m = v;"])
            inner += ["m = tgc_block_reduce(m, tgc_op_maxshift(), part_t);"]
            shared.add("tgc_t part_t[32];")
            if k.reduce == "maxshift":
                inner.append("const tgc_t acc = m;")
            else:
                inner += ["if (!tgc_finite(m)) m = (tgc_t)0;", "double sum = 0.0;"]
                inner += over([f"sum += (double)tgc_exp((tgc_t)({x} - m));"])
                inner += ["sum = tgc_block_reduce(sum, tgc_op_sum(), part_d);",
                          "const tgc_t acc = (tgc_t)(tgc_log((tgc_t)sum) + m);"]
                shared.add("double part_d[32];")
        ctx.acc = "acc"
        value = self.expr(k.epilogue, ctx) if k.epilogue is not None else "acc"
        inner.append("if (threadIdx.x == 0) " + self.store(k.out, "p0", self.offset(k.out, k.index, ctx), value))
        body = [f"__shared__ {d}" for d in sorted(shared)]
        body += [f"const long long n = {' * '.join(sizes) or '1LL'};",
                 "for (long long t = blockIdx.x; t < n; t += gridDim.x) {"]
        body += ["    " + line for line in inner] + ["}"]
        self.kernel(name, self.params(bufs, k.out), body, note + " (one block per output)")
        return name

    # ------------------------------------------------------------ row groups

    def identity(self, e: Load) -> bool:
        """Whether `e` reads its buffer at the loop variables named like its edges."""
        return all(ix == Ix.var(b) for b, ix in e.index)

    def rowgroup(self, i: int, g: RowGroup) -> None:
        """One kernel for the row group `g` (`rows.py`), in two variants: one block per
        row (`kI`) and one warp per row (`kI_warp`), the same body with `tpr` (threads
        per row) blockDim.x or 32. For each row (a grid-stride loop over rows, the
        same number of iterations for every thread, so barriers and shuffles are
        reached by all), each member in turn: an elementwise member over the row's
        elements strided by the threads; a member reducing to a value per row through
        `tgc_row_reduce` (shuffles, then shared memory for a block), the value then in
        a register of every thread (`s_NAME`), written by the row's first thread if
        it has a buffer. A barrier (`tgc_row_sync`) comes before a member that reads
        from memory what an earlier one wrote.

        When every member runs over the same inner loops (with no bounds) and either
        keeps them all or reduces them all (softmax, layernorm), a row of at most
        `row_regs * tpr` elements is held in registers: thread `lane` keeps elements
        lane + k * tpr, k < row_regs (`c_NAME[k]`), inputs read once at the row's
        start, members' outputs stored only if read elsewhere; longer rows take the
        path that reads and writes memory.

        A column member (`rows.column_member`: `db[c] = sum[rows] ...`) is summed
        while the row is in hand: the rows are dealt to slots (`row_slots`, a
        function of the sizes: slot s takes rows s, s + slots, ... in order), a
        row's thread adds its elements' terms to its columns' partials in double
        (registers when the row is held in registers, else the slot's partial row in
        the scratch `part`), and the slot's partial row is written to `part`; a
        second kernel (`kI_cols`, one thread per column) adds the slots' partials in
        slot order, applies the epilogue and stores. The same order of additions on
        both paths, every run and every GPU."""
        low = self.low
        name = f"{self.prefix}k{i}"
        bufs = g.buffers_used()
        writes = sorted(g.writes(), key=bufs.index)
        outer = list(g.outer)
        cols = [m for m in g.members if column_member(m, outer, g.sizes)]
        col_ids = [id(m) for m in cols]
        col_outs = {m.out for m in cols}
        row_writes = [w for w in writes if w not in col_outs]
        allv = list(dict.fromkeys(v for m in g.members for v in m.loops))
        var = {v: f"v{j}" for j, v in enumerate(allv)}
        osizes = [self.size(g.sizes[v]) for v in outer]
        scalars = {m.out for m in g.members if set(dict(m.index)) == set(outer)}
        # C names of the values a thread holds: s_N (a row's value), c_N (its elements)
        cid = {b: n for n, b in enumerate(dict.fromkeys([m.out for m in g.members] + bufs))}
        reads_elsewhere = self._read_outside(i)
        inner0 = inner_loops(g.members[0], outer)
        if any(sorted(v for v in m.loops if v not in m.red) != sorted(inner0)
               or any(m.sizes[v] != g.members[0].sizes[v] for v in inner0) for m in cols):
            raise CudaUnsupported("a row group's column sum over other loops than its first member's")
        uniform = all(id(m) in col_ids or set(inner_loops(m, outer)) == set(inner0)
                      and all(m.sizes[v] == g.members[0].sizes[v] for v in inner0)
                      and not (set(m.bounds) & set(inner0))
                      and (set(m.red) == set(inner0) if m.reduce else not m.red)
                      and (m.reduce or set(dict(m.index)) == set(outer) | set(inner0))
                      for m in g.members) and bool(inner0)
        red_member = next((m for m in g.members if m.reduce and id(m) not in col_ids), g.members[0])
        row_len = tuple(red_member.sizes[v] for v in inner_loops(red_member, outer))
        group = 4 if self.row_regs % 4 == 0 else 1   # a thread's registers hold groups of this many neighbours
        shared: set[str] = set()

        def ctx_new(cache: dict) -> _Ctx:
            ctx = _Ctx({b: f"p{j}" for j, b in enumerate(bufs)}, dict(var))
            ctx.vals = {s: f"s_{cid[s]}" for s in scalars}
            ctx.cache = dict(cache)
            return ctx

        def reduce_stmts(m: LoopKernel, ctx: _Ctx, over) -> list[str]:
            """`acc` of a member reducing to a value per row; `over(stmts)` runs
            `stmts` over this thread's share of the reduced points."""
            x = self.expr(m.body, ctx)
            if m.reduce == "sum":
                shared.add("double part_d[32];")
                return (["double sum = 0.0;"] + over([f"sum += (double){x};"])
                        + ["sum = tgc_row_reduce(sum, tgc_op_sum(), part_d, tpr);", "const tgc_t acc = (tgc_t)sum;"])
            shared.add("tgc_t part_t[32];")
            if m.reduce in ("max", "min"):
                better = "!(v <= m)" if m.reduce == "max" else "!(v >= m)"
                init = "-(tgc_t)TGC_INF" if m.reduce == "max" else "(tgc_t)TGC_INF"
                return ([f"tgc_t m = {init};"] + over([f"const tgc_t v = {x};", f"if (m == m && ({better})) m = v;"])
                        + [f"const tgc_t acc = tgc_row_reduce(m, tgc_op_{m.reduce}(), part_t, tpr);"])
            out = ["tgc_t m = -(tgc_t)TGC_INF;"] + over([f"const tgc_t v = {x};", "if (v > m) m = v;"])
            out += ["m = tgc_row_reduce(m, tgc_op_maxshift(), part_t, tpr);"]
            if m.reduce == "maxshift":
                return out + ["const tgc_t acc = m;"]
            shared.add("double part_d[32];")
            out += ["if (!tgc_finite(m)) m = (tgc_t)0;", "double sum = 0.0;"]
            out += over([f"sum += (double)tgc_exp((tgc_t)({x} - m));"])
            return out + ["sum = tgc_row_reduce(sum, tgc_op_sum(), part_d, tpr);",
                          "const tgc_t acc = (tgc_t)(tgc_log((tgc_t)sum) + m);"]

        def strided(loops: list[str], sizes: dict, stmts: list[str], cached: bool, count: str) -> list[str]:
            """`stmts` over this thread's points of `loops` (the row's elements)."""
            dec = _decompose([(var[v], "", self.size(sizes[v])) for v in loops], stmts)
            if cached:   # register k holds element G * (lane + k / G * tpr) + k % G (less than row_regs * tpr)
                return ([f"#pragma unroll", f"for (int k = 0; k < {self.row_regs}; ++k) {{",
                         f"    const int q = {group} * ((int)lane + k / {group} * (int)tpr) + k % {group};",
                         f"    if (q < {count}) {{"] + ["        " + s for s in dec + stmts] + ["    }", "}"])
            return spread(count, [(var[v], "", self.size(sizes[v])) for v in loops], stmts)

        def spread(count: str, loops: list, stmts: list[str]) -> list[str]:
            """`stmts` over this thread's share of `count` points (q = lane, lane + tpr,
            ...) split into `loops` (`_decompose`): in 32-bit indices when the count
            allows (the row's index and its split, no 64-bit `%`), else in 64-bit."""
            def loop(narrow: bool) -> list[str]:
                head = (f"for (int q = (int)lane; q < (int)c; q += (int)tpr) {{" if narrow
                        else "for (long long q = lane; q < c; q += tpr) {")
                return [head] + ["    " + x for x in _decompose(loops, stmts, narrow) + stmts] + ["}"]
            return (["{", f"    const long long c = {count};", "    if (c <= 2147483647LL - 1024LL) {   // q + tpr stays an int"]
                    + ["        " + x for x in loop(True)] + ["    } else {"]
                    + ["        " + x for x in loop(False)] + ["    }", "}"])

        def preload(pre: list[Load], cache: dict) -> list[str]:
            """The row's elements of the inputs `pre` into registers; in an f32 program
            whose row is one loop, with the registers in groups of 4 neighbours, the
            inputs read along it as one float4 load per group where the row length is
            a multiple of 4 and their addresses are 16-byte aligned."""
            ctx = ctx_new({})
            scalar = strided(list(inner0), g.members[0].sizes,
                             [f"{cache[e.buf]}[k] = {self.expr(e, ctx)};" for e in pre], True, "cnt")
            v = inner0[0]
            wide = [e for e in pre if group == 4 and len(inner0) == 1 and low.dtype == "f32"
                    and low.buffers[e.buf].dtype == "f32" and self.along(e, v, g.members[0].sizes[v])]
            if not wide:
                return scalar
            rest = strided(list(inner0), g.members[0].sizes,
                           [f"{cache[e.buf]}[k] = {self.expr(e, ctx)};" for e in pre if e not in wide], True, "cnt")
            ptrs = dict.fromkeys(ctx.ptr(e.buf) for e in wide)
            addr = [f"&{ctx.ptr(e.buf)}[{self.offset(e.buf, e.index, ctx)}]" for e in wide]
            lines = []
            for j, (e, a) in enumerate(zip(wide, addr)):
                lines.append(f"const float4 l{j} = *reinterpret_cast<const float4*>({a});")
                lines += [f"{cache[e.buf]}[4 * m + {c}] = l{j}.{comp};" for c, comp in enumerate("xyzw")]
            dec = _decompose([(var[v], "", self.size(g.members[0].sizes[v]))], addr)
            vec = (["TGC_SIM_COUNT(5);", "#pragma unroll", f"for (int m = 0; m < {self.row_regs // 4}; ++m) {{",
                    "    const int q = 4 * ((int)lane + m * (int)tpr);", "    if (q < cnt) {"]
                   + ["        " + x for x in dec + lines] + ["    }", "}"] + (rest if len(wide) < len(pre) else []))
            cond = " && ".join([f"{self.size(g.members[0].sizes[v])} % 4 == 0"] + [f"tgc_aligned16({p})" for p in ptrs])
            return ([f"if ({cond}) {{"] + ["    " + x for x in vec] + ["} else {"]
                    + ["    " + x for x in scalar] + ["}"])

        def members(cached: bool) -> list[str]:
            body, unused = members_once(cached, set())
            # a row a reader reads otherwise in the end (a column sum moved into the group)
            # is not held: nvcc -Werror refuses a register array set and never read
            return members_once(cached, unused)[0] if unused else body

        def members_once(cached: bool, exclude: set[str]) -> tuple[list[str], set[str]]:
            cache = {}
            body: list[str] = []
            if cached:
                later = {e.buf for m in g.members for e in _loads_of(m) if self.identity(e)}
                cache = {m.out: f"c_{cid[m.out]}" for m in g.members
                         if not m.reduce and m.out not in scalars and m.out in later and m.out not in exclude}
                pre = []
                for m in g.members:
                    for e in _loads_of(m):
                        b = low.buffers.get(e.buf)
                        if (e.buf in cache or e.buf in exclude or e.buf in scalars or b is None or e.buf in g.writes()
                                or not self.identity(e) or not (set(b.edges) & set(inner0))
                                or not set(b.edges) <= set(outer) | set(inner0)):
                            continue
                        cache[e.buf] = f"c_{cid[e.buf]}"
                        pre.append(e)
                for c in cache.values():
                    body.append(f"tgc_t {c}[{self.row_regs}];")
                if pre:
                    body += preload(pre, cache)
            written_mem: set[str] = set()
            for m in g.members:
                ctx = ctx_new(cache)
                inner = list(inner_loops(m, outer))
                if id(m) in col_ids:   # a column sum: this row's terms added to the slot's partials
                    j = col_ids.index(id(m))
                    x = self.expr(m.body, ctx)
                    if cached:
                        part = strided(list(inner0), m.sizes, [f"cp_{j}[k] += (double){x};"], True, "cnt")
                    else:
                        part = strided(list(inner0), m.sizes,
                                       [f"part[{j}LL * S * ncols + s * ncols + q] += (double){x};"],
                                       False, "(live ? ncols : 0LL)")
                    if ctx.loaded & written_mem:
                        body.append("tgc_row_sync(tpr);")
                    body.append(f"// {(m.note or m.text().splitlines()[0])[:100]} (this row's column partials)")
                    body += ["{"] + ["    " + x for x in part] + ["}"]
                    continue
                kept = [v for v in inner if v not in m.red]
                store_ix = self.offset(m.out, m.index, ctx) if m.out in low.buffers else None
                stored = m.out in low.buffers and (not cached or m.out not in cache or self._needs_store(g, m, i, reads_elsewhere))
                part: list[str] = []
                if m.out in scalars:
                    if m.reduce:
                        red = [v for v in m.loops if v in m.red]
                        pre = []
                        for v in red:
                            lo, hi = self.red_range(m, v, ctx)
                            pre.append(f"const long long {var[v]}_lo = {lo}, {var[v]}_n = max_ll({hi} - {var[v]}_lo, 0LL);")
                        cnt = " * ".join(f"{var[v]}_n" for v in red) or "1LL"

                        def over(stmts, red=red, cnt=cnt):
                            if cached:
                                return strided(list(inner0), m.sizes, stmts, True, "cnt")
                            return spread(f"(live ? {cnt} : 0LL)",
                                          [(var[v], f"{var[v]}_lo + ", f"{var[v]}_n") for v in red], stmts)

                        part += ([] if cached else pre) + reduce_stmts(m, ctx, over)
                        ctx.acc = "acc"
                        value = self.expr(m.epilogue, ctx) if m.epilogue is not None else "acc"
                    else:
                        value = self.expr(m.body, ctx)
                    part.append(f"s_{cid[m.out]} = {value};")
                    if stored:
                        part.append("if (lane == 0 && live) "
                                    + self.store(m.out, f"p{bufs.index(m.out)}", store_ix, f"s_{cid[m.out]}"))
                else:
                    stmts: list[str] = []
                    if m.reduce:
                        stmts += self.reduction(m, ctx)
                        ctx.acc = "acc"
                        value = self.expr(m.epilogue, ctx) if m.epilogue is not None else "acc"
                    else:
                        value = self.expr(m.body, ctx)
                    stmts.append(f"const tgc_t val = {value};")
                    wide = cached and stored and self.wide_store(g, m, inner0, group)
                    held = cache.get(m.out) if cached else None
                    if wide and held is None:   # the row's values, for the float4 stores after
                        held = f"o_{cid[m.out]}"
                        part.append(f"tgc_t {held}[{self.row_regs}];")
                    if held is not None:
                        stmts.append(f"{held}[k] = val;")
                    if stored and not wide:
                        stmts.append(self.store(m.out, f"p{bufs.index(m.out)}", store_ix, "val"))
                    count = "cnt" if cached else f"(live ? {' * '.join(self.size(m.sizes[v]) for v in kept) or '1LL'} : 0LL)"
                    part += strided(list(inner0) if cached else kept, m.sizes, stmts, cached, count)
                    if wide:
                        part += self.row_stores(m, f"p{bufs.index(m.out)}", held, ctx, var[inner0[0]],
                                                self.size(m.sizes[inner0[0]]), group)
                if ctx.loaded & written_mem:
                    body.append("tgc_row_sync(tpr);")
                body.append(f"// {(m.note or m.text().splitlines()[0])[:100]}")
                if m.out in scalars:
                    body.append(f"tgc_t s_{cid[m.out]};")
                body += ["{"] + ["    " + s for s in part] + ["}"]
                if stored and m.out not in scalars:
                    written_mem.add(m.out)
            read = re.compile(r"\b(c_\d+)\[(?!k\] = |4 \* m \+ \d\] = )")   # a read, not a fill
            used = {name for line in body if not line.startswith("tgc_t ") for name in read.findall(line)}
            return body, {buf for buf, c in cache.items() if c not in used}

        head = ["const unsigned lane = threadIdx.x % tpr, per = blockDim.x / tpr;",
                f"const long long n = {' * '.join(osizes) or '1LL'};"]
        if cols:
            head += [f"const long long ncols = {' * '.join(self.size(g.members[0].sizes[v]) for v in inner0)};",
                     f"const long long S = tgc_row_slots(n, ncols, {self.cuda.row_slot_rows}LL, "
                     f"{self.cuda.row_slot_elems}LL);   // slots of rows, a partial row each per column sum",
                     f"const bool fits = {'true' if uniform else 'false'} && ncols <= {self.row_regs}LL * tpr;"
                     "   // the partials in registers",
                     "for (long long sbase = (long long)blockIdx.x * per; sbase < S; sbase += (long long)gridDim.x * per) {",
                     "    const long long s = sbase + threadIdx.x / tpr;",
                     "    const bool slive = s < S;"]
            for j in range(len(cols)):
                if uniform:
                    head += [f"    double cp_{j}[{self.row_regs}];", "    #pragma unroll",
                             f"    for (int k = 0; k < {self.row_regs}; ++k) cp_{j}[k] = 0.0;"]
                head += [f"    if (!fits && slive) for (long long q = lane; q < ncols; q += tpr) "
                         f"part[{j}LL * S * ncols + s * ncols + q] = 0.0;"]
            head += ["    for (long long base = sbase; base < n; base += S) {   // the slot's rows, in order",
                     "    const long long t = base + threadIdx.x / tpr;",
                     "    const bool live = slive && t < n;"]
        else:
            head += ["for (long long base = (long long)blockIdx.x * per; base < n; base += (long long)gridDim.x * per) {",
                     "    const long long t = base + threadIdx.x / tpr;",
                     "    const bool live = t < n;"]
        head += ["    " + x for x in _split("r", "live ? t : base", [(var[v], "", s) for v, s in zip(outer, osizes)])]
        loop_body: list[str] = []
        if uniform:
            cnt = " * ".join(self.size(g.members[0].sizes[v]) for v in inner0)
            loop_body.append(f"const long long cnt = live ? {cnt} : 0LL;")
            loop_body.append(f"if ({cnt} <= {self.row_regs}LL * tpr) {{")
            loop_body += ["    TGC_SIM_COUNT(1);"] + ["    " + s for s in members(True)]
            loop_body.append("} else {")
            loop_body += ["    TGC_SIM_COUNT(2);"] + ["    " + s for s in members(False)]
            loop_body.append("}")
        else:
            loop_body += ["TGC_SIM_COUNT(2);"] + members(False)
        tail = ["}"]
        if cols:   # the slot's partials, from registers, after its last row
            tail = ["}", "if (fits && slive) {", "    TGC_SIM_COUNT(6);"]
            for j in range(len(cols)):
                tail += ["    #pragma unroll", f"    for (int k = 0; k < {self.row_regs}; ++k) {{",
                         f"        const long long q = {group} * ((long long)lane + k / {group} * (long long)tpr) + k % {group};",
                         f"        if (q < ncols) part[{j}LL * S * ncols + s * ncols + q] = cp_{j}[k];", "    }"]
            tail += ["} else if (slive) {", "    TGC_SIM_COUNT(7);", "}", "}"]
            if not uniform:
                tail = ["}", "if (slive) TGC_SIM_COUNT(7);", "}"]
        body = ([f"__shared__ {d}" for d in sorted(shared)] + head + ["    " + s for s in loop_body]
                + ["    " + s for s in tail[:-1]] + tail[-1:])
        params = self.params(bufs, set(row_writes), scratch=bool(cols))
        call = ", ".join([f"p{j}" for j in range(len(bufs))] + (["part"] if cols else [])
                         + [self.dim_c[d] for d in self.dims] + ["err"])
        note = f"row group of {len(g.members)}: " + ", ".join(m.note or m.reduce or "map" for m in g.members)
        self.parts.append(f"// {note}\nstatic __device__ __forceinline__ void {name}_body({params}, const unsigned tpr) {{\n"
                          + "\n".join("    " + line for line in body) + "\n}")
        bounds = ROW_MIN_BLOCKS
        self.kernel(name, params, [f"{name}_body({call}, blockDim.x);"], "one block per row", min_blocks=bounds)
        self.kernel(name + "_warp", params, [f"{name}_body({call}, 32u);"], "one warp per row", min_blocks=bounds)
        scratch = (COL_SCRATCH,) if cols else ()
        inner_sizes = tuple(g.members[0].sizes[v] for v in inner0)
        slots = (tuple(g.sizes[v] for v in outer), inner_sizes, len(cols), self.cuda.row_slot_rows,
                 self.cuda.row_slot_elems) if cols else ()
        self.launches.append(Launch("rows", name, tuple(bufs) + scratch, tuple(g.sizes[v] for v in outer), index=i,
                                    warp=name + "_warp", inner=row_len, writes=tuple(row_writes), slots=slots))
        if cols:
            self.row_columns(name + "_cols", i, g, cols, bufs, list(inner0), var, osizes, slots)

    def row_columns(self, name: str, i: int, g: RowGroup, cols: list[LoopKernel], bufs: list[str],
                    inner0: list[str], var: dict, osizes: list[str], slots: tuple) -> None:
        """The kernel adding a row group's column partials (`rowgroup`): one thread per
        column, the slots' partials in slot order, in double; then each column sum's
        epilogue and store."""
        ctx = _Ctx({b: f"p{j}" for j, b in enumerate(bufs)}, dict(var))
        sizes = [self.size(g.members[0].sizes[v]) for v in inner0]
        body = [f"const long long n = {' * '.join(osizes) or '1LL'}, ncols = {' * '.join(sizes)};",
                f"const long long S = tgc_row_slots(n, ncols, {self.cuda.row_slot_rows}LL, {self.cuda.row_slot_elems}LL);",
                "for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < ncols; "
                "c += (long long)gridDim.x * blockDim.x) {"]
        body += ["    " + x for x in _split("r", "c", [(var[v], "", sz) for v, sz in zip(inner0, sizes)])]
        for j, m in enumerate(cols):
            c = _Ctx(ctx.ptrs, dict(var))
            c.acc = "acc"
            value = self.expr(m.epilogue, c) if m.epilogue is not None else "acc"
            body += ["    {", "        double total = 0.0;",
                     f"        for (long long h = 0; h < S; ++h) total += part[{j}LL * S * ncols + h * ncols + c];",
                     "        const tgc_t acc = (tgc_t)total;",
                     "        " + self.store(m.out, f"p{bufs.index(m.out)}", self.offset(m.out, m.index, c), value),
                     "    }"]
        body.append("}")
        outs = {m.out for m in cols}
        self.kernel(name, self.params(bufs, outs, scratch=True), body,
                    "row group's column sums: the slots' partials, in order")
        self.launches.append(Launch("loop", name, tuple(bufs) + (COL_SCRATCH,),
                                    tuple(g.members[0].sizes[v] for v in inner0), index=i, writes=tuple(sorted(outs)),
                                    slots=slots))

    def wide_store(self, g: RowGroup, m: LoopKernel, inner0, group: int) -> bool:
        """Whether a row group member's output, held in registers, can be stored four
        neighbours at a time (`row_stores`): an f32 program and buffer, a row of one
        loop, registers in groups of 4, the output's contiguous edge along that loop."""
        if group != 4 or len(inner0) != 1 or self.low.dtype != "f32" or self.low.buffers[m.out].dtype != "f32":
            return False
        v = inner0[0]
        return self.along(Load(m.out, m.index), v, m.sizes[v])

    def row_stores(self, m: LoopKernel, ptr: str, held: str, ctx: "_Ctx", v: str, size: str, group: int) -> list[str]:
        """The stores of a row group member's values `held` (register k: element
        4 * (lane + k / 4 * tpr) + k % 4 of the row, loop variable `v` of extent
        `size`): one float4 per group of 4 where the row length is a multiple of 4
        and the output 16-byte aligned (every row then starts aligned), else one
        element at a time. The same values either way."""
        at = self.offset(m.out, m.index, ctx)
        dec = _decompose([(v, "", size)], [at])
        vec = ["TGC_SIM_COUNT(8);", "#pragma unroll", f"for (int g4 = 0; g4 < {self.row_regs // group}; ++g4) {{",
               "    const int q = 4 * ((int)lane + g4 * (int)tpr);", "    if (q < cnt) {"]
        vec += ["        " + x for x in dec]
        vec += ["        float4 o4;"] + [f"        o4.{c} = {held}[4 * g4 + {j}];" for j, c in enumerate("xyzw")]
        vec += [f"        *reinterpret_cast<float4*>(&{ptr}[{at}]) = o4;", "    }", "}"]
        one = ["#pragma unroll", f"for (int k = 0; k < {self.row_regs}; ++k) {{",
               f"    const int q = {group} * ((int)lane + k / {group} * (int)tpr) + k % {group};", "    if (q < cnt) {"]
        one += ["        " + x for x in dec] + [f"        {ptr}[{at}] = {held}[k];", "    }", "}"]
        return ([f"if ({size} % 4 == 0 && tgc_aligned16({ptr})) {{"] + ["    " + x for x in vec] + ["} else {"]
                + ["    " + x for x in one] + ["}"])

    def _read_outside(self, i: int) -> set[str]:
        """The buffers a kernel other than the `i`th reads."""
        return {b for j, k in enumerate(self.low.kernels) if j != i for b in k.buffers_read()}

    def _needs_store(self, g: RowGroup, m: LoopKernel, i: int, outside: set[str]) -> bool:
        """Whether a member's output kept in registers must be written too: it is not
        a temporary, another kernel reads it, or a member reads it elsewhere than at
        the element the thread holds."""
        if self.low.buffers[m.out].kind != "temp" or m.out in outside:
            return True
        return any(e.buf == m.out and not self.identity(e) for k in g.members for e in _loads_of(k))

    def guarded(self, k: LoopKernel, loops, ctx: "_Ctx", stmts: list[str]) -> list[str]:
        """`stmts` where every bounded loop variable among `loops` is within its bounds."""
        conds = []
        for v in loops:
            lows, highs = k.bounds.get(v, ((), ()))
            conds += [f"{ctx.var[v]} >= {self.ix(x, ctx)}" for x in lows]
            conds += [f"{ctx.var[v]} < {self.ix(x, ctx)}" for x in highs]
        if not conds:
            return stmts
        return [f"if ({' && '.join(conds)}) {{"] + ["    " + s for s in stmts] + ["}"]

    def red_range(self, k: LoopKernel, v: str, ctx: "_Ctx") -> tuple[str, str]:
        """(first, end) C expressions of reduced loop `v` of `k`: [max(0, its lower
        bounds...), min(its size, its upper bounds...)). Loops, one-block-per-output
        reductions and row-group members share it."""
        lows, highs = k.bounds.get(v, ((), ()))
        lo = "0LL"
        for x in lows:
            lo = f"max_ll({lo}, {self.ix(x, ctx)})"
        hi = self.size(k.sizes[v])
        for x in highs:
            hi = f"min_ll({hi}, {self.ix(x, ctx)})"
        return lo, hi

    def nest(self, k: LoopKernel, ctx: "_Ctx", stmts: list[str]) -> list[str]:
        """`stmts` inside the reduced loops, each over its bounded range."""
        red = [v for v in k.loops if v in k.red]
        head, tail = [], []
        for depth, v in enumerate(red):
            pad = "    " * depth
            lo, hi = self.red_range(k, v, ctx)
            i = ctx.var[v]
            head.append(f"{pad}for (long long {i} = {lo}, {i}_end = {hi}; {i} < {i}_end; ++{i}) {{")
            tail.insert(0, f"{pad}}}")
        pad = "    " * len(red)
        return head + [pad + s for s in stmts] + tail

    def reduction(self, k: LoopKernel, ctx: "_Ctx") -> list[str]:
        x = self.expr(k.body, ctx)
        if k.reduce == "sum":
            return (["double sum = 0.0;"] + self.nest(k, ctx, [f"sum += (double){x};"])
                    + ["const tgc_t acc = (tgc_t)sum;"])
        if k.reduce in ("max", "min"):
            better = "!(v <= m)" if k.reduce == "max" else "!(v >= m)"   # v NaN, or past m
            init = "-(tgc_t)TGC_INF" if k.reduce == "max" else "(tgc_t)TGC_INF"
            return ([f"tgc_t m = {init};"]
                    + self.nest(k, ctx, [f"const tgc_t v = {x};", f"if (m == m && ({better})) m = v;"])
                    + ["const tgc_t acc = m;"])
        if k.reduce in ("maxshift", "logsumexp"):
            out = ["tgc_t m = -(tgc_t)TGC_INF;"] + self.nest(k, ctx, [f"const tgc_t v = {x};", "if (v > m) m = v;"])
            if k.reduce == "maxshift":
                return out + ["const tgc_t acc = m;"]
            out += ["if (!tgc_finite(m)) m = (tgc_t)0;", "double sum = 0.0;"]
            out += self.nest(k, ctx, [f"sum += (double)tgc_exp((tgc_t)({x} - m));"])
            return out + ["const tgc_t acc = (tgc_t)(tgc_log((tgc_t)sum) + m);"]
        raise CudaUnsupported(f"reduction '{k.reduce}'")


# what a scatter's output starts as: a sum's 0, a segment max's -inf, a segment min's inf
_SCATTER_INIT = {"sum": "(tgc_t)0", "max": "-(tgc_t)TGC_INF", "min": "(tgc_t)TGC_INF"}


def _row_ok(k: LoopKernel) -> bool:
    """Whether the reduction `k` has a one-block-per-output form: its reduced loops'
    bounds depend on the kept loops only (so their ranges are known before the
    block shares them out)."""
    if not k.reduce or k.scatter or not k.red or k.reduce not in ("sum", "max", "min", "maxshift", "logsumexp"):
        return False
    return all(not (ix.vars() & set(k.red)) for lo, hi in k.bounds.values() for ix in lo + hi)


def _decompose(loops: list[tuple[str, str, str]], stmts: list[str], narrow: bool = False) -> list[str]:
    """Statements splitting the flat index `q` into loop variables (name, offset
    prefix, extent), innermost last, declaring only the variables `stmts` use;
    `narrow`: in 32-bit arithmetic (`q` and every extent below 2^31)."""
    import re

    text = "\n".join(stmts)
    used = [bool(re.search(rf"\b{name}\b", text)) for name, _, _ in loops]
    if not any(used):
        return []
    out = ["int rq = q;" if narrow else "long long rq = q;"]
    for j in reversed(range(len(loops))):
        name, lo, n = loops[j]
        n = f"(int)({n})" if narrow else n
        line = f"const long long {name} = {lo}rq{f' % {n}' if j else ''};" if used[j] else ""
        if any(used[:j]):
            line += f" rq /= {n};"
        if line:
            out.append(line.strip())
    return out


def _split(r: str, flat: str, loops: list[tuple[str, str, str]], decl: str = "const long long ") -> list[str]:
    """Statements splitting the flat index `flat` (less than the product of the
    extents) into loop variables (name, offset prefix, extent), outermost first,
    through the variable `r`: the outermost is what remains, with no remainder.
    `decl` declares each name ('' assigns existing ones)."""
    out = [f"long long {r} = {flat};"]
    for j in reversed(range(len(loops))):
        name, lo, n = loops[j]
        out.append(f"{decl}{name} = {lo}{r}{f' % {n}; {r} /= {n};' if j else ';'}")
    return out


def _loads_of(k: LoopKernel):
    """Every `Load` of a loop kernel's body and epilogue."""
    for root in [k.body] + ([k.epilogue] if k.epilogue is not None else []):
        for n in walk(root):
            if isinstance(n, Load):
                yield n


@dataclass
class _Ctx:
    ptrs: dict[str, str]
    var: dict[str, str] = field(default_factory=dict)
    acc: str | None = None
    vals: dict[str, str] = field(default_factory=dict)    # buffer -> the C value holding it at this row (row groups)
    cache: dict[str, str] = field(default_factory=dict)   # buffer -> the register array holding this thread's elements
    loaded: set = field(default_factory=set)              # buffers read from memory (row groups: barriers)
    vec: dict = field(default_factory=dict)               # Load -> the float4 holding it (vector_loop)
    comp: str = ""                                        # the float4 component this expression computes

    def ptr(self, buf: str) -> str:
        return self.ptrs[buf]
