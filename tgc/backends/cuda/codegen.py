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
  two variants, a block or a warp per row (`rowgen.py`): each member in turn over
  the row, reductions by warp shuffles and shared memory, a row's values in
  registers, the row's elements in registers where it fits; its column sums (bias
  and weight gradients that joined it) as a partial row per slot of rows, added in
  slot order by one more kernel (`RowGroupGen.row_columns`);
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
from pathlib import Path

from tgc.backends.cuda.ctext import Ctx as _Ctx, decompose, loads_of, split_flat
from tgc.backends.cuda.launches import COL_SCRATCH, CudaModule, CudaUnsupported, Launch
from tgc.backends.cuda.philox import device_function
from tgc.backends.cuda.options import CudaOptions
from tgc.backends.cuda.flash import Flash, FlashBack
from tgc.backends.cuda.flashgen import FlashBackGen, FlashGen
from tgc.backends.cuda.rowgen import RowGroupGen
from tgc.backends.cuda.rows import RowGroup
from tgc.lower.lowered import (Acc, Add, Buffer, Cond, Const, ExprVisitor, FloorDiv, GemmKernel, IdLoad, Ix, Load,
                            LoopKernel, Lowered, Map, Mask, Mul, Rand, SizeOf, StepLoop, View, logsumexp_outputs,
                            neg, walk, wide_exp, wide_sum, wide_term_factors)
from tgc.ir.ops import FNS
from tgc.ir.sizes import Size, SizeOp

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
# a column sum's tiles and chunks (tgc_ops.cuh's TGC_COL_TILE, TGC_COL_ROWS, TGC_COL_BLOCKS)
COL_TILE, COL_ROWS, COL_BLOCKS = 128, 64, 1024


def col_chunks(nred: int, ncols: int) -> int:
    """The chunks of rows a column sum over `nred` rows into `ncols` columns is split
    into (`tgc_col_chunks` of tgc_ops.cuh: the same formula): at least COL_ROWS rows
    per chunk, about COL_BLOCKS blocks in all; a function of the sizes only."""
    tiles = -(-ncols // COL_TILE)
    return max(1, min(-(-nred // COL_ROWS), -(-COL_BLOCKS // max(tiles, 1))))


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


class _UnmaskedLoads(ExprVisitor):
    """The loads of an expression outside any mask, in order, added to `out`."""

    def expr_load(self, e: Load, out: list) -> None:
        out.append(e)

    def expr_add(self, e, out: list) -> None:
        for a in e.args:
            self.expr(a, out)

    expr_mul = expr_map = expr_add

    def expr_mask(self, e: Mask, out: list) -> None:
        pass

    expr_const = expr_size_of = expr_acc = expr_rand = atom_var = atom_id_load = atom_floor_div = expr_mask


_UNMASKED_LOADS = _UnmaskedLoads()


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
        self.lse = logsumexp_outputs(low)   # softmax weights exp(d - lse) read these (wide_exp)
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
                RowGroupGen(self, i, k).emit()
                continue
            if isinstance(k, FlashBack):
                FlashBackGen(self, i, k).emit()
                continue
            if isinstance(k, Flash):
                FlashGen(self, i, k).emit()
                continue
            if isinstance(k, StepLoop):
                self.steps(i, k)
                continue
            if not isinstance(k, (LoopKernel, GemmKernel)):   # another backend's own kind (the CPU's groups)
                raise CudaUnsupported(f"{type(k).__name__} kernels (another backend's own lowering stage)")
            if isinstance(k, GemmKernel):
                if k.epilogue:   # written out as loops by cublas_operands (`tgc.lower.epilogue.expand`)
                    raise CudaUnsupported("a GEMM epilogue after the cublas_operands stage (run 'epilogue' before it)")
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
            plain = "TGC_SIM_LAUNCH" if x.kind in ("rows", "flash") else "TGC_SIM_LAUNCH_SERIAL"
            wide = (["(double*)b[0]"] + tail if x.kind == "zero" else scratch,
                    [args[0], "(double*)b[1]"] + tail)   # the f64 form's: the scratch alone, or after the buffers
            for name, launch, call in ((x.name, plain, args), (x.row, "TGC_SIM_LAUNCH", args),
                                       (x.warp, "TGC_SIM_LAUNCH", args), (x.col, "TGC_SIM_LAUNCH", scratch),
                                       (x.col_sum, "TGC_SIM_LAUNCH_SERIAL", scratch),
                                       (x.wide, "TGC_SIM_LAUNCH_SERIAL", wide[0]),
                                       (x.wide_round, "TGC_SIM_LAUNCH_SERIAL", wide[1])):
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
            if dst == src:   # updated in place (tgc.lower.accumulate): no copy
                continue
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
        bounds = f"{self.cuda.block_threads}, {min_blocks}" if min_blocks else f"{self.cuda.block_threads}"
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
        if wide_exp(e, self.low.dtype, self.lse):   # exp(d - lse): the sum in double, not rounded first
            return f"tgc_exp_sum({self.sum64(e.args[0], ctx)})"
        return TEMPLATES[e.fn].format(*(f"(tgc_t){self.expr(a, ctx)}" for a in e.args))

    def wide_add(self, e: Add, ctx: "_Ctx") -> str:
        """An f32 sum of several terms in double, rounded once (`lowered.wide_sum`): a
        product's factors widened before they are multiplied, so its value does not
        depend on the order of its terms."""
        return f"((tgc_t){self.sum64(e, ctx, low=self.low)})"

    def sum64(self, e: Add, ctx: "_Ctx", low=None) -> str:
        """The sum `e` in double, not rounded: a product term's factors widened where
        `lowered.wide_term_factors(low, term)` says, else the product rounded in tgc_t."""
        terms = []
        for c, a in zip(e.coefs, e.args):
            if wide_term_factors(low, a):
                x = "(" + " * ".join(f"(double){self.expr(f, ctx)}" for f in a.args) + ")"
            else:
                x = f"(double){self.expr(a, ctx)}"
            terms.append(x if c == 1 else f"{float(c)!r} * {x}")
        return "(" + " + ".join(terms) + ")"

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
            wide = self.wide_scatter(k)
            if wide:   # its f64 form: the scratch zeroed instead of the output
                self.kernel(f"{name}_zero64", self.scratch_params(["double* __restrict__ p0"]),
                            zero[:1] + [zero[1].replace(f"p0[t] = {_SCATTER_INIT['sum']}", "p0[t] = 0.0")],
                            f"zero the f64 scratch of %{k.out} before the scatter")
            terms = tuple(k.sizes[v] for v in k.loops if v not in k.red)
            self.launches.append(Launch("zero", f"{name}_zero", (k.out,), out_sizes, index=i,
                                        wide=f"{name}_zero64" if wide else "", terms=terms, elems=out_sizes))
        sizes = [self.size(k.sizes[v]) for v in kept]
        body = [f"const long long n = {' * '.join(sizes) or '1LL'};",
                "for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < n; "
                "t += (long long)gridDim.x * blockDim.x) {"]
        inner = []
        if kept:
            inner += split_flat("r", "t", [(ctx.var[v], "", s) for v, s in zip(kept, sizes)])
        at = self.offset(k.out, k.index, ctx)
        store = f"p0[{at}]"
        if k.scatter:
            if k.red:
                raise CudaUnsupported("a scatter kernel with reduced loops")
            combine = {"sum": "atomicAdd", "max": "tgc_atomic_max", "min": "tgc_atomic_min"}[k.reduce or "sum"]
            if self.wide_scatter(k):   # its f64 form: f64 atomics into the scratch, then one rounding each
                wide = inner + self.guarded(k, kept, ctx, [f"atomicAdd(&part[{at}], (double){self.expr(k.body, ctx)});"])
                self.kernel(f"{name}_add64", self.params(bufs, k.out, scratch=True),
                            body + ["    " + line for line in wide] + ["}"], f"{note} (f64 atomics into the scratch)")
                out_n = " * ".join(self.size(self.low.size(e)) for e in self.low.buffers[k.out].edges) or "1LL"
                self.kernel(f"{name}_round64", self.params([k.out], k.out, scratch=True),
                            [f"const long long n = {out_n};",
                             "for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < n; "
                             "t += (long long)gridDim.x * blockDim.x) p0[t] = (float)part[t];"],
                            f"round the f64 scratch of %{k.out} into it, once each")
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
        wide = self.wide_scatter(k) and k.scatter
        self.launches.append(Launch("loop", name, tuple(bufs), tuple(k.sizes[v] for v in kept), index=i, row=row,
                                    red=tuple(k.sizes[v] for v in k.red), col=col[0], col_sum=col[1],
                                    wide=f"{name}_add64" if wide else "", wide_round=f"{name}_round64" if wide else "",
                                    terms=tuple(k.sizes[v] for v in kept) if wide else (),
                                    elems=tuple(self.low.size(e) for e in self.low.buffers[k.out].edges) if wide else ()))

    def wide_scatter(self, k: LoopKernel) -> bool:
        """Whether scatter kernel `k` is an f32 scatter-add with an f64 form (`Launch.wide`):
        one f32 atomic add per term rounds each output element once per term sent to it,
        10^6 messages into 8 nodes 1.1e-5 off (PyTorch's one-hot product 6e-7); adding
        f64 atomics into a scratch of doubles, each element is rounded once (the runtime
        takes this form when the terms are more than `CudaOptions.wide_scatter_terms`
        per element, else the f32 atomics)."""
        return (k.scatter and not k.reduce and not k.red and self.low.dtype == "f32"
                and self.low.buffers[k.out].dtype == "f32")

    def scratch_params(self, first: list[str]) -> str:
        """The parameters `first` then the dims and the error word (a kernel on the scratch alone)."""
        return ", ".join(first + [f"long long {self.dim_c[d]}" for d in self.dims] + ["int* __restrict__ err"])

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
        lines += ["    " + x for x in split_flat("r", "t * 4", [(ctx.var[v], "", sz) for v, sz in zip(kept, sizes)])]
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
        _UNMASKED_LOADS.expr(k.body, loads)
        return [e for e in dict.fromkeys(loads)
                if self.low.buffers[e.buf].dtype in VEC and self.along(e, v, k.sizes[v])]

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
        varying = [e for e in loads_of(k) if any(v_in in ix.vars() for _, ix in e.index)]
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
            return split_flat("r", flat, [(names[v], "", sz) for v, sz in zip(kept, sizes)])

        def finish(total: str) -> list[str]:
            """The column `c`'s result from its sum `total`: epilogue, store."""
            c = _Ctx(ctx.ptrs, dict(ctx.var))
            c.acc = "acc"
            value = self.expr(k.epilogue, c) if k.epilogue is not None else "acc"
            return (["{"] + ["    " + line for line in split("c", ctx.var)]
                    + [f"    const tgc_t acc = (tgc_t)({total});",
                       "    " + self.store(k.out, "p0", self.offset(k.out, k.index, c), value), "}"])

        rows = (["for (long long q = q0 + warp; q < q1; q += warps) {"]
                + ["    " + s for s in decompose([(ctx.var[v], "", self.size(k.sizes[v])) for v in red],
                                                  [self.expr(k.body, ctx)])])
        # the scalar path: lane takes columns tile * TILE + lane + 32 * j, j < 4
        scalar = ["const long long c0 = tile * TGC_COL_TILE + lane;"]
        per = {v: f"{ctx.var[v]}_k" for v in kept}
        for v in kept:
            scalar.append(f"long long {per[v]}[4];")
        scalar += ["#pragma unroll", "for (int j = 0; j < 4; ++j) {"]
        scalar += ["    " + x for x in split_flat("r", "c0 + 32 * j < ncols ? c0 + 32 * j : 0LL",
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
        body = [f"__shared__ double part_c[{self.cuda.block_threads // 32}][TGC_COL_TILE];"] + geometry
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
            inner += split_flat("r", "t", [(ctx.var[v], "", s) for v, s in zip(kept, sizes)])
        for v in red:
            lo, hi = self.red_range(k, v, ctx)
            i = ctx.var[v]
            inner.append(f"const long long {i}_lo = {lo}, {i}_n = max_ll({hi} - {i}_lo, 0LL);")
        inner.append(f"const long long cnt = {' * '.join(ctx.var[v] + '_n' for v in red)};")

        def over(stmts: list[str]) -> list[str]:
            head = ["for (long long q = threadIdx.x; q < cnt; q += blockDim.x) {"]
            head += ["    " + x for x in split_flat("rq", "q", [(ctx.var[v], f"{ctx.var[v]}_lo + ", f"{ctx.var[v]}_n")
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
