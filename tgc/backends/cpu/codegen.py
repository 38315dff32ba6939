"""LLVM IR for a planned program (`Lowered` after `plan`): one native call runs it all.

Native ABI (C linkage; the same for the JIT and a linked .so):

    void    tgc_init(void* const* table)
        once, before anything else: the function table (`fntable.FIELDS`: cblas
        sgemm/dgemm, GOMP_parallel, omp_get_thread_num, omp_get_num_threads,
        OpenBLAS's thread count get/set; a program with GEMMs runs OpenBLAS on one
        thread during tgc_run: see `blas_one_thread`).
    int64_t tgc_workspace_bytes(const int64_t* dims)
        scratch bytes a run needs for these dims (a multiple of 64).
    int32_t tgc_run(const int64_t* dims, void* const* args, void* const* outs, void* workspace)
        dims:  the symbolic dims, in declaration order (`Module.symbolic_dims()`);
        args:  one pointer per argument, in declaration order, each row-major in its
               ABI axis order (floats of the program's type; ids int32; bf16/f16
               arguments 2-byte elements: bf16 bits, IEEE half); updates are
               written into them after every read of their old values;
        outs:  one pointer per output, row-major in its ABI order (floats, or 2-byte
               elements where `narrow` gave the output a bf16/f16 buffer);
        workspace: tgc_workspace_bytes(dims) bytes, 64-byte aligned.
        Returns 0, or k > 0 when the k-th id check failed (an id out of range): then
        nothing has been written, since every check runs before the first kernel;
        -3 or -4 for sizes over 2^62 or NULL pointers (`sizecheck`, which also makes
        tgc_workspace_bytes return -1 for such dims).
    int32_t tgc_run_objects(const int64_t* frame, PyObject* list)
        only with `generate(..., objects_entry=True)` (the Python runtime's JIT code,
        never an AOT build): tgc_run with each argument, then each output, given as
        a numpy array object in a Python list, so that Python neither checks nor
        reads pointers. `frame`: [dims, address of the workspace address, layout,
        expect]; `layout`: byte offsets of [ob_type, data, nd, dimensions, descr,
        flags] in PyArrayObject and of the item array in a list; `expect`: the
        argument count, then per argument [type, descr, flag mask, rank, bytes, size
        of each axis]. Returns -1
        (nothing run) when an argument is not that (another type, dtype, shape, or
        without a flag, e.g. C-contiguous), -2 when an updated argument's bytes
        overlap another argument's; else as tgc_run.
    void    tgc_set_notify(void (*fn)(int32_t), const uint8_t* marks)
        only with `objects_entry=True` too: while `marks` is set (not NULL), tgc_run
        calls fn(i) right after kernel i returns whenever marks[i] != 0 (one byte per
        kernel); NULL clears it. The runtime sets it for one call (`CpuKernels.run`'s
        `notify`: a data-parallel step starts each bucket's allreduce there).
    const char tgc_fingerprint[64]
        only with a `fingerprint` (the JIT's code): the code cache's key of the
        program the code was compiled for, as 64 hex digits; the runtime reads it
        (data, no code runs) and refuses code whose fingerprint is not the program's
        (`kernels.from_object`).

Kernels are internal functions (`loops.py`, `gemm.py`), or hidden ones when the
program is generated in several units (`generate_units`). A loop over an edge
(`StepLoop`) is an LLVM loop in `tgc_run` around the calls of its step's kernels,
which are compiled once like any other (`leaf_kernels`): the stacked buffers'
pointers advance by the step's offset, each carry's new value is copied into the
carry after the step, and the step's temporaries are in its own workspace slots. A kernel whose outermost
loop runs over a kept edge is also outlined for libgomp and run on every core when
its work (iterations x op weight, known only at run time) reaches
`options.cpu.parallel_min_work`. Consecutive kernels share one region where
`regions.plan_regions` says (`call_region`, `region_body`).
"""
from __future__ import annotations

import functools

from dataclasses import replace

import llvmlite.ir as ir

from tgc.backends.cpu import fntable, parallel, regions, sizecheck
from tgc.backends.cpu.causal import Analysis
from tgc.backends.cpu.gemm import GemmGen
from tgc.backends.cpu.gemm_bf16 import bf16_kernel
from tgc.backends.cpu.gemm_dispatch import tile_epilogue as epilogue_supported
from tgc.backends.cpu.gemm_epilogue import epilogue_buffers
from tgc.backends.cpu.gemm_dispatch import (EDGE_ROWS, bf16_kinds, bf16_product, edge_vecs, packs_b, taps_in_one_call,
                                            uses_own_gemm)
from tgc.backends.cpu.gemm_small import loops_kernel, small_kernel
from tgc.backends.cpu.fgemm import own_kernel
from tgc.backends.cpu.irutil import I32, I64, PTR, Frame, define, fp_type, for_range, optimize_not
from tgc.backends.cpu.loops import LoopGen, emit_parallel_body, kernel_buffers, parallel_ok, split_count
from tgc.backends.cpu.group import LoopGroup
from tgc.backends.cpu.implicit import ImplicitGemm
from tgc.backends.cpu.options import CpuOptions
from tgc.lower.lowered import GemmKernel, Lowered, LoopKernel, Map, Rand, StepLoop, rename_buffers, walk
from tgc.ir.dtypes import itemsize
from tgc.ir.ops import COSTS, FNS
from tgc.ir.sizes import size_eval
from tgc.options import Options

ALIGN = 64
PROFILE_COLUMNS = 6   # `CpuOptions.profile`'s counters per kernel (`_ModuleGen.count_cycles`)
WRITEABLE = 0x400    # NPY_ARRAY_WRITEABLE: in an argument's flag mask, it is updated
# Op weights for the parallel threshold, relative to an add/mul (~0.1 ns an element
# vectorized here): each elementwise function's cost class (tgc.ir.ops.COSTS): the
# polynomial functions (vecmath) and pow cost ~8; sqrt and div are single vector
# instructions (vsqrtps, vdivps), 1. (At weight 8 for div and sqrt, layernorm 64x256
# entered two parallel regions per call: 2-6 us each when idle, up to milliseconds
# while another process holds a core.) Each entry into a kernel's innermost loop weighs
# `CpuOptions.row_entry_work` more (`work_terms`).


def generate(low: Lowered, options: Options, objects_entry: bool = False) -> str:
    """The LLVM IR text of the whole program (with `tgc_run_objects` if asked)."""
    return generate_units(low, options, objects_entry, units=1)[0]


def generate_units(low: Lowered, options: Options, objects_entry: bool = False,
                   units: int = 1) -> list[str]:
    """The program as at most `units` LLVM modules that LLVM can compile at once
    (`llvm_env.emit_objects`) and that link into one program.

    The first holds the entry points and the function table; the distinct kernels
    are dealt out by estimated compile cost (`compile_cost`), the costliest first,
    each to the least loaded module, so the parts take about as long. A kernel
    outside the first module is defined there with hidden visibility and declared in
    the first; GEMM tile helpers live in the first. Units that would be empty are
    left out; `units=1` is the single module of `generate`."""
    first, rest = generate_units_first_last(low, options, objects_entry, units)
    return [first()] + [text() for text in rest]


def generate_units_first_last(low: Lowered, options: Options, objects_entry: bool = False,
                              units: int = 1, fingerprint: str | None = None):
    """`generate_units` as functions, one per unit, that each make its text: (the
    first's, the others'). Each makes only its own unit's kernels (the first declares
    the others'), so the processes of `llvm_env.emit_objects` share the Python work
    of generating and printing IR as well as LLVM's (the MLP: 36 ms of kernels were
    generated before the fork). With `fingerprint`, the first unit defines
    `tgc_fingerprint` (see the module docstring)."""
    if low.stage != "plan":
        raise ValueError(f"code generation needs the planned program, not the one after '{low.stage}'")
    gen = _ModuleGen(low, options, objects_entry, units)
    if fingerprint is not None:
        define_fingerprint(gen.mod, fingerprint)
    gen.emit_table()
    return gen.first_text, [functools.partial(gen.unit_text, u) for u in range(1, len(gen.mods))]


FINGERPRINT = "tgc_fingerprint"
FINGERPRINT_BYTES = 64


def define_fingerprint(mod: ir.Module, fingerprint: str) -> None:
    """`const char tgc_fingerprint[64]`: the program's cache key (64 hex digits)."""
    data = fingerprint.encode("ascii")
    if len(data) != FINGERPRINT_BYTES:
        raise ValueError(f"a fingerprint is {FINGERPRINT_BYTES} characters, not {len(data)}")
    typ = ir.ArrayType(ir.IntType(8), FINGERPRINT_BYTES)
    g = ir.GlobalVariable(mod, typ, FINGERPRINT)
    g.global_constant = True
    g.initializer = ir.Constant(typ, bytearray(data))


def compile_cost(k, cpu: CpuOptions) -> int:
    """A rough estimate of LLVM's time on a kernel, in ms (the `*_compile_cost` fields
    of `cpu`, fitted to measured times of the benchmark workloads' kernels): a GEMM is
    three functions of fixed size, more with taps; a loop kernel costs more per
    member and loop, and much more when its sums go into per-block partials (rows of
    known length, unrolled and vectorized in several copies)."""
    if isinstance(k, GemmKernel):   # the entry is not optimized, nor an unbatched work function
        return ((cpu.batched_gemm_compile_cost if k.batch else cpu.gemm_compile_cost)
                + cpu.tap_compile_cost * len(k.taps))
    if isinstance(k, ImplicitGemm):   # the GEMM and its own copy of the f32 kernel
        return compile_cost(k.gemm, cpu) + cpu.implicit_compile_cost
    members = k.members if isinstance(k, LoopGroup) else (k,)
    blocked = isinstance(k, LoopGroup) and k.blocks > 1
    return (cpu.loop_compile_cost + cpu.member_compile_cost * len(members)
            + cpu.member_loop_compile_cost * sum(len(m.loops) for m in members) + cpu.blocked_compile_cost * blocked)


class _ModuleGen:
    def __init__(self, low: Lowered, options: Options, objects_entry: bool = False, units: int = 1):
        self.low, self.opt, self.objects_entry = low, options, objects_entry
        self.fp = fp_type(low.dtype)
        self.flat = list(leaf_kernels(low))   # (program, kernel): the steps' kernels too, each compiled once
        self.program_of = {id(k): p for p, k in self.flat}   # a kernel's program (the whole one, or a step)
        for p, k in self.flat:   # `group` writes out as loops those gemm_epilogue.py does not run
            if isinstance(k, GemmKernel) and k.epilogue and not epilogue_supported(p, k, options):
                raise ValueError("a GEMM epilogue the CPU cannot run in its tiles, after the group stage "
                                 "(run 'epilogue' before 'group', which writes it out as loops)")
        # the causal plans of the products (tgc.backends.cpu.causal), part of a kernel's key
        self.tri = Analysis(low).plans if options.cpu.causal_gemm and not options.fp_strict else {}
        self.keys = [kernel_key(p, k) + (tuple(sorted((e, str(n)) for e, n in p.edges.items())), self.tri.get(id(k)))
                     for p, k in self.flat]   # (a step's own edges, e.g. its groups' blocks, may differ)
        units = self.assign_units(max(1, units))
        self.mods = [ir.Module(name="tgc" if u == 0 else f"tgc.{u}") for u in range(units)]
        self.mod = self.mods[0]
        self.done: dict = {}
        self.regions_defined = 0   # the region functions tgc.r0, tgc.r1, ... in self.mod
        self.step_counters = step_profile_kernels(low)   # counted after the program's own kernels
        self.serial = False        # emitting a step that runs on one thread of a parallel loop (`call_steps_parallel`)
        self.steps_defined = 0     # the parallel loop bodies tgc.s0, tgc.s1, ... in self.mod
        self.lanes = options.cpu.step_lanes()
        self.parallel_loops = {id(k): sb for k, sb in parallel_step_loops(low, options.cpu)}   # loop -> its step's first slot

    def assign_units(self, units: int) -> int:
        """`self.unit`: kernel key -> module index; returns how many modules are used."""
        self.unit: dict = {}
        costs: dict = {}
        cpu = self.opt.cpu
        for key, (_, k) in zip(self.keys, self.flat):
            costs.setdefault(key, compile_cost(k, cpu))
        gemms = any(isinstance(k, GemmKernel) for _, k in self.flat)
        load = ([cpu.entry_compile_cost + cpu.call_compile_cost * len(self.flat) + cpu.tile_compile_cost * gemms]
                + [0] * (units - 1))
        for key, cost in sorted(costs.items(), key=lambda kv: -kv[1]):  # stable: ties keep first-use order
            u = load.index(min(load))
            self.unit[key] = u
            load[u] += cost
        return max(self.unit.values(), default=0) + 1

    def emit_table(self) -> None:
        """The function table: defined in the first unit, declared in the others."""
        fntable.define_init(self.mod, "tgc_init")
        if self.opt.cpu.profile:   # its CPU clock (`parallel.CLOCK_SETTER`)
            parallel.thread_ns_fn(self.mod)
        if len(self.mods) > 1:
            self.mod.globals[fntable.GLOBAL].linkage = "hidden"   # the other units read it
            for m in self.mods[1:]:
                fntable.declare_table(m)

    def first_text(self) -> str:
        """The first unit: the GEMM tile helpers every unit calls, its kernels (the
        others' declared), the entry points."""
        for packed in sorted({packs_b(p, k) for p, k in self.flat if isinstance(k, GemmKernel)
                              and k.cplx is None and not bf16_product(p, k)}):
            small_kernel(self.mod, self.fp, packed, self.opt.cpu)
            if self.opt.cpu.blas != "numpy":   # large tiles without BLAS (see gemm.py)
                loops_kernel(self.mod, self.fp, packed, self.opt.cpu)
        for rounds in sorted(set().union(*(bf16_kinds(p, k) for p, k in self.flat
                                           if isinstance(k, GemmKernel)))):
            bf16_kernel(self.mod, self.opt.cpu, rounds=rounds)   # bf16 products (gemm_operands chose them)
        if any(isinstance(k, GemmKernel) and uses_own_gemm(p, k, self.opt) for p, k in self.flat):
            own_kernel(self.mod, self.opt.cpu)    # tgc's own f32 kernel for large tiles (fgemm.py)
        for vecs in sorted({edge_vecs(p, k, self.opt) for p, k in self.flat if isinstance(k, GemmKernel)} - {0}):
            own_kernel(self.mod, self.opt.cpu, EDGE_ROWS, vecs)   # its edge block (gemm_dispatch.edge_vecs)
        if self.tri and any(isinstance(k, GemmKernel) and id(k) in self.tri and uses_own_gemm(p, k, self.opt)
                            for p, k in self.flat):
            own_kernel(self.mod, self.opt.cpu, tri=True)   # its causal form (tgc.backends.cpu.causal)
        if any(isinstance(k, GemmKernel) and taps_in_one_call(p, k, self.opt) for p, k in self.flat):
            own_kernel(self.mod, self.opt.cpu, taps=True)       # its form for all taps in one call (gemm_dispatch.taps_in_one_call)
        if self.opt.cpu.threads != 1:   # GEMMs in every unit run their regions through it
            parallel.region_fn(self.mod, self.mod, self.opt.cpu)
        if len(self.mods) > 1:   # the other units call them
            for fn in self.mod.functions:
                if fn.name.startswith(("tgc.gemm.small.", "tgc.gemm.loops.", "tgc.gemm.bf16", "tgc.gemm.own.")) and not fn.is_declaration \
                        or fn.name == parallel.REGION:
                    fn.linkage = "hidden"
        kernels = [self.kernel_fns(i, p, k) for i, (p, k) in enumerate(self.flat)]
        return str(self.emit_entry(kernels))

    def unit_text(self, u: int) -> str:
        """Unit u > 0: its kernels, defined with hidden visibility."""
        done = set()
        for i, (p, k) in enumerate(self.flat):
            key = self.keys[i]
            if self.unit[key] == u and key not in done:
                done.add(key)
                for fn in self.define_kernel(i, p, k):
                    if fn is not None:
                        fn.linkage = "hidden"
        return str(self.mods[u])

    def emit_entry(self, kernels: list) -> ir.Module:
        """The entry points, in the first unit."""
        checks = [self.check_fn(i, c) for i, c in enumerate(self.low.checks)]
        self.workspace_fn()
        run = self.run_fn(checks, kernels)
        sizecheck.entry_points(self.mod, self.low)
        if self.objects_entry:
            self.objects_fn(run)
        return self.mod

    # ------------------------------------------------------------ pieces

    def check_fn(self, i: int, c) -> ir.Function:
        """i32 check(dims, ids): 1 if any id lies outside [0, size)."""
        fn = define(self.mod, f"tgc.check{i}", I32, [PTR, PTR])
        f = Frame(fn, self.low.module, fn.args[0], self.low.edges)
        b = f.b
        n = f.count(self.low.buffers[c.buf].edges)
        hi = f.size(c.size)
        bad = f.alloca(ir.IntType(8), "bad")
        f.entry.store(ir.IntType(8)(0), bad)
        with for_range(b, I64(0), n, "j") as j:
            v = b.sext(b.load(b.gep(fn.args[1], [j], source_etype=I32), typ=I32), I64)
            out = b.or_(b.icmp_signed("<", v, I64(0)), b.icmp_signed(">=", v, hi))
            b.store(b.or_(b.load(bad), b.zext(out, ir.IntType(8))), bad)
        b.ret(b.zext(b.load(bad), I32))
        f.finish()
        return fn

    def kernel_fns(self, i: int, p: Lowered, k):
        """The kernel's function (and parallel body) as the first unit sees them:
        defined there, or declared when another unit defines them. Structurally
        equal kernels — the same computation on other buffers, e.g. in another
        layer — share one."""
        key = self.keys[i]
        if key not in self.done:
            self.done[key] = self.define_kernel(i, p, k) if self.unit[key] == 0 else self.declare_kernel(i, k)
        return self.done[key]

    def define_kernel(self, i: int, p: Lowered, k):
        """(function, parallel body or None), defined in the kernel's unit; `p` is the
        program the kernel belongs to (the whole one, or a loop's step)."""
        mod = self.mods[self.unit[self.keys[i]]]
        name = f"tgc.k{i}"
        if isinstance(k, GemmKernel):
            return GemmGen(mod, p, k, name, self.fp, self.opt, home=self.mod, tri=self.tri.get(id(k))).emit(), None
        if isinstance(k, ImplicitGemm):
            return GemmGen(mod, p, k.gemm, name, self.fp, self.opt, home=self.mod, implicit=k).emit(), None
        fn = LoopGen(mod, p, k, name, self.fp, self.opt).emit()
        par = emit_parallel_body(mod, p, k, fn, name + ".par", self.opt) if self.has_par(k) else None
        return fn, par

    def declare_kernel(self, i: int, k):
        """(function, parallel body or None) declared in the first unit, with the
        signatures `GemmGen`, `LoopGen` and `emit_parallel_body` define them with."""
        def declare(name, ret, args):
            fn = ir.Function(self.mod, ir.FunctionType(ret, args), name)
            fn.linkage = "hidden"
            return fn
        name = f"tgc.k{i}"
        if isinstance(k, (GemmKernel, ImplicitGemm)):
            epi = isinstance(k, GemmKernel) and bool(k.epilogue)   # its epilogue's pointers (gemm_epilogue.py)
            return declare(name, I32, [PTR] * 4 + [I64] + ([PTR] if epi else [])), None
        fn = declare(name, ir.VoidType(), [PTR] * (1 + len(kernel_buffers(k))) + [I64, I64])
        return fn, (declare(name + ".par", ir.VoidType(), [PTR]) if self.has_par(k) else None)

    def has_par(self, k) -> bool:
        return self.opt.cpu.threads != 1 and parallel_ok(k) and not self.always_serial(k)

    def always_serial(self, k) -> bool:
        """Whether the kernel's work is known here (no symbolic dim) and below the
        threshold: then it gets no parallel body and no run-time test (less code for
        LLVM to compile: small fixed-size kernels, e.g. an MLP's weight updates)."""
        env = {d: s for d, s in self.low.module.dims.items() if isinstance(s, int)}
        try:
            total = kernel_work(k, env, self.opt.cpu)
        except Exception:  # noqa: BLE001 -- a symbolic size: decided at run time
            return False
        return total < min(self.opt.cpu.parallel_min_work, self.opt.cpu.parallel_min_work_warm)

    def slot_sizes(self, f: Frame) -> list:
        out = []
        for sizes in self.low.slots:
            best = None
            for s in sizes:
                v = f.size(s)
                best = v if best is None else f.entry.select(f.entry.icmp_signed(">", v, best), v, best)
            rounded = f.entry.and_(f.entry.add(best, I64(ALIGN - 1)), I64(-ALIGN))
            out.append(rounded)
        return out

    def workspace_fn(self) -> None:
        fn = define(self.mod, sizecheck.INNER_WORKSPACE, I64, [PTR])   # exported checked: sizecheck
        optimize_not(fn)
        f = Frame(fn, self.low.module, fn.args[0], self.low.edges)
        f.b.ret(f.b.add(self.slots_total(f), self.lane_bytes(f)))
        f.finish()

    def lane_bytes(self, f: Frame):
        """i64: the workspace past the slots that a parallel loop's lanes 1, 2, ...
        take, each a copy of the slots from its step's first one on (`call_steps_parallel`)."""
        if not self.parallel_loops:
            return I64(0)
        offsets, total = self.slot_offsets(f), self.slots_total(f)
        span = I64(0)
        for sb in self.parallel_loops.values():
            one = f.b.sub(total, offsets[sb])
            span = f.b.select(f.b.icmp_signed(">", one, span), one, span)
        return f.b.mul(span, I64(self.lanes - 1))

    def slots_total(self, f: Frame):
        total = I64(0)
        for s in self.slot_sizes(f):
            total = f.entry.add(total, s)
        return total

    # ------------------------------------------------------------ the entry point

    def run_fn(self, checks, kernels) -> None:
        fn = define(self.mod, sizecheck.INNER_RUN, I32, [PTR] * 4)   # exported checked: sizecheck
        optimize_not(fn)   # calls, mostly (see `helper`): the MLP's first unit compiles in 112 ms, 130 optimized
        dims, args, outs, ws = fn.args
        f = Frame(fn, self.low.module, dims, self.low.edges)
        b = f.b
        for i, (check, c) in enumerate(zip(checks, self.low.checks)):
            bad = b.call(check, [dims, self.arg_ptr(b, args, self.low.buffers[c.buf].index)])
            with b.if_then(b.icmp_signed("!=", bad, I32(0)), likely=False):
                b.ret(I32(i + 1))
        offsets = self.slot_offsets(f)
        ptrs = self.buffer_ptrs(f, args, outs, ws, offsets)
        restore = self.blas_one_thread(f) if any(isinstance(k, GemmKernel) for _, k in self.flat) else None
        fns = iter(kernels)
        starts = {r.start: r for r in self.regions(self.low, step=False)}
        i = 0
        while i < len(self.low.kernels):
            if i in starts:   # several kernels in one region (no profile: see `regions`)
                r = starts[i]
                self.call_region(f, self.low, r, fns, ptrs)
                for j in range(r.start, r.stop) if self.objects_entry else ():
                    b.call(self.notify_fn(), [I32(j)])
                i = r.stop
                continue
            k = self.low.kernels[i]
            if self.serial_pair(i):   # one thread: the GEMM and its loop index by index (no counters)
                nxt = self.low.kernels[i + 1]
                (gfn, _), (lfn, _) = next(fns), next(fns)
                self.call_pair(f, gfn, [f.dims_ptr] + [ptrs[n] for n in gemm_buffers(k)],
                               lfn, [f.dims_ptr] + [ptrs[n] for n in kernel_buffers(nxt)],
                               I64(0), split_count(f, nxt, self.opt.cpu))
                if self.objects_entry:
                    b.call(self.notify_fn(), [I32(i)])
                    b.call(self.notify_fn(), [I32(i + 1)])
                i += 2
                continue
            start = self.profile_start(b) if self.opt.cpu.profile else None
            ran = self.call_kernel(f, k, fns, ptrs, ws, offsets, 0)
            if start is not None:
                self.count_cycles(b, i, start, ran)
            if self.objects_entry:
                b.call(self.notify_fn(), [I32(i)])
            i += 1
        if restore is not None:
            restore()
        b.ret(I32(0))
        f.finish()
        return fn

    def serial_pair(self, i: int) -> bool:
        """Whether the program's kernels i and i + 1 run as a pair (`regions.pairs`) on
        one thread: only with `threads=1` (else regions run them) and without the
        profile (its counters are per kernel)."""
        cpu = self.opt.cpu
        ks = self.low.kernels
        return (cpu.threads == 1 and not cpu.profile and i + 1 < len(ks)
                and regions.pair_key(self.low, ks[i], ks[i + 1], cpu) is not None)

    def call_kernel(self, f: Frame, k, fns, ptrs: dict, ws, offsets: list, base: int):
        """Run kernel `k` on the buffers `ptrs` (by name); `fns` yields the functions of
        the leaf kernels in `leaf_kernels` order; a loop's step uses slots from `base`.
        Returns a GEMM's i32 (1: it ran in a region of its own), else None."""
        b = f.b
        if isinstance(k, StepLoop):
            self.call_steps(f, k, fns, ptrs, ws, offsets, base)
            return None
        kfn, par = next(fns)
        dims = f.dims_ptr
        if isinstance(k, (GemmKernel, ImplicitGemm)):
            extra = []
            if isinstance(k, GemmKernel) and k.epilogue:   # its epilogue's buffers, in an array
                epi = epilogue_buffers(self.program_of[id(k)], k)
                arr = f.alloca(ir.ArrayType(PTR, len(epi)), "epi")
                for j, n in enumerate(epi):
                    b.store(ptrs[n], b.gep(arr, [I32(0), I32(j)]))
                extra = [arr]
            return b.call(kfn, [dims] + [ptrs[n] for n in gemm_buffers(k)] + [self.gemm_min_flops(b)] + extra)
        self.call_loop(f, k, kfn, par, [dims] + [ptrs[n] for n in kernel_buffers(k)])
        return None

    def gemm_min_flops(self, b: ir.IRBuilder):
        """i64: the least flops of a GEMM that starts a region of its own now (none in a
        parallel loop's step)."""
        cpu = self.opt.cpu
        if self.serial:
            return I64(2 ** 62)
        return self.threshold(b, cpu.gemm_parallel_min_flops_warm, cpu.gemm_parallel_min_flops,
                              cpu.gemm_flops_per_cycle)

    def call_steps(self, f: Frame, k: StepLoop, fns, ptrs: dict, ws, offsets: list, base: int) -> None:
        """A loop over an edge: one LLVM loop whose body calls the step's kernels (each
        compiled once) with the stacked buffers' pointers advanced by the step's
        offset, then copies the carries' new values into the carries."""
        step_fns = [next(fns) for _ in leaf_kernels(k.step)]
        if not self.serial and id(k) in self.parallel_loops:
            self.call_steps_parallel(f, k, step_fns, ptrs, ws, offsets, base)
            return
        self.emit_steps(f, k, step_fns, ptrs, ws, offsets, base, I64(0), f.size(k.trip))

    def emit_steps(self, f: Frame, k: StepLoop, step_fns: list, ptrs: dict, ws, offsets: list, base: int,
                   lo, hi) -> None:
        """Steps lo .. hi - 1 of loop `k` (all of them, in order or reversed, when lo = 0
        and hi = its trip)."""
        b, step = f.b, k.step
        trip = f.size(k.trip)
        base = base + k.slot_base
        binds = list(zip(step.module.args, k.args)) + \
            [(b_.name, bind) for j, bind in enumerate(k.outs)
             for b_ in step.buffers.values() if b_.kind == "out" and b_.index == j]
        with for_range(b, lo, hi, f"step.{k.edge}", unroll=False) as i:
            at = b.sub(b.sub(trip, I64(1)), i) if k.reverse else i
            inner = {}
            for name, bind in binds:
                ptr = ptrs[bind.buf]
                if bind.stacked:
                    sb = step.buffers[name]
                    stride = f.entry.mul(f.count(sb.edges), I64(itemsize(sb.dtype)))
                    ptr = b.gep(ptr, [b.mul(at, stride)], source_etype=ir.IntType(8))
                inner[name] = ptr
            for name, sb in step.buffers.items():
                if sb.kind == "temp" and sb.alias is None:
                    inner[name] = b.gep(ws, [offsets[base + sb.slot]], source_etype=ir.IntType(8))
            for name, sb in step.buffers.items():
                if sb.alias is not None:   # the bytes of the buffer it views (tgc.lower.alias)
                    inner[name] = inner[sb.alias]
            sub = iter(step_fns)
            starts = {r.start: r for r in self.regions(step, step=True)} if not self.serial else {}
            skip = 0
            for i, sk in enumerate(step.kernels):
                if i < skip:
                    continue
                if i in starts:
                    self.call_region(f, step, starts[i], sub, inner)
                    skip = starts[i].stop
                    continue
                start = self.profile_start(b) if self.opt.cpu.profile and not isinstance(sk, StepLoop) else None
                ran = self.call_kernel(f, sk, sub, inner, ws, offsets, base)
                if start is not None:
                    j = next(j for j, c in enumerate(self.step_counters) if c is sk)
                    self.count_cycles(b, len(self.low.kernels) + j, start, ran)
            for c in range(k.carries):
                if k.outs[c].buf == k.args[c].buf:   # updated in place (tgc.lower.accumulate)
                    continue
                buf = self.carry_buffer(step, c)
                nbytes = b.mul(f.count(buf.edges), I64(itemsize(buf.dtype)))
                b.call(self.memcpy(), [ptrs[k.args[c].buf], ptrs[k.outs[c].buf], nbytes, ir.IntType(1)(0)])

    def call_steps_parallel(self, f: Frame, k: StepLoop, step_fns: list, ptrs: dict, ws, offsets: list,
                            base: int) -> None:
        """Loop `k`, whose steps are independent (`parallel_step_loops`), with its steps
        shared among the threads: `tgc.sN(data)` runs on every thread of a region
        (`parallel.region_fn`); lane j < min(threads, `self.lanes`) takes the next step
        not yet taken (a shared counter, atomically) until none is left, each kernel of a
        step on this thread alone (`self.serial`: loops whole, GEMMs with no region of
        their own, no merged regions), its step's slots (those from the step's first on)
        at lane j's copy past the workspace's slots (`lane_bytes`). A lane whose core
        another process holds takes no step until it runs, and the others take the steps
        it would have run (a fixed share waited for it: the slowest lane's time).
        Each step computes what the loop computes one step at a time, in the same order
        within the step, whichever lane runs it: the results have the same bits (a
        GEMM's tiles do not depend on the thread count, `gemm.GemmGen.tile_limit`).
        Without libgomp in the runtime's table the loop runs here, one step after another."""
        b = f.b
        names = list(dict.fromkeys(bind.buf for bind in k.args + k.outs))
        offs = f.alloca(ir.ArrayType(I64, max(1, len(offsets) + 2)), "steps.offsets")
        for i, o in enumerate(offsets + [self.slots_total(f)]):
            f.entry.store(o, f.entry.gep(offs, [I32(0), I32(i)]))
        b.store(I64(0), b.gep(offs, [I32(0), I32(len(offsets) + 1)]))   # the next step to take
        data = f.alloca(ir.ArrayType(PTR, 3 + len(names)), "steps.data")
        for i, a in enumerate([f.dims_ptr, ws, offs] + [ptrs[n] for n in names]):
            b.store(a, b.gep(data, [I32(0), I32(i)]))
        have = fntable.is_set(b, "gomp_parallel")
        with b.if_else(have) as (then, otherwise):
            with then:
                b.call(parallel.region_fn(self.mod, self.mod, self.opt.cpu), [self.steps_body(k, step_fns, names,
                                                                                            len(offsets), base), data])
            with otherwise:
                self.emit_steps(f, k, step_fns, ptrs, ws, offsets, base, I64(0), f.size(k.trip))

    def steps_body(self, k: StepLoop, step_fns: list, names: list, nslots: int, base: int) -> ir.Function:
        """`void tgc.sN(ptr data)`, data = [dims, workspace, slot offsets (and the slots'
        total and the shared counter of steps taken after them), the loop's buffers...]:
        this thread's lane of loop `k`."""
        n, self.steps_defined = self.steps_defined, self.steps_defined + 1
        fn = define(self.mod, f"tgc.s{n}", ir.VoidType(), [PTR])
        g = Frame(fn, self.low.module, None, self.low.edges)
        e = g.entry
        load = lambda i: e.load(e.gep(fn.args[0], [I64(i)], source_etype=PTR), typ=PTR)   # noqa: E731
        g.dims_ptr, ws, offs = load(0), load(1), load(2)
        ptrs = {name: load(3 + i) for i, name in enumerate(names)}
        at = [e.load(e.gep(offs, [I64(i)], source_etype=I64), typ=I64) for i in range(nslots + 1)]
        offsets, total = at[:nslots], at[nslots]
        b = g.b
        tid = b.sext(fntable.call(b, "omp_get_thread_num", []), I64)
        nth = b.sext(fntable.call(b, "omp_get_num_threads", []), I64)
        lanes = b.select(b.icmp_signed("<", nth, I64(self.lanes)), nth, I64(self.lanes))
        counter = e.gep(offs, [I64(nslots + 1)], source_etype=I64)
        with b.if_then(b.icmp_signed("<", tid, lanes)):
            trip = g.size(k.trip)
            first = offsets[base + k.slot_base]
            span = b.sub(total, first)
            shift = b.sub(b.add(total, b.mul(b.sub(tid, I64(1)), span)), first)
            own = b.gep(ws, [b.select(b.icmp_signed("==", tid, I64(0)), I64(0), shift)], source_etype=ir.IntType(8))
            fn_ = b.block.function
            take, run, done = (fn_.append_basic_block(f"lane.{x}") for x in ("take", "run", "done"))
            b.branch(take)
            b.position_at_end(take)
            i = b.atomic_rmw("add", counter, I64(1), "monotonic")
            b.cbranch(b.icmp_signed("<", i, trip), run, done)
            b.position_at_end(run)
            self.serial = True
            try:
                self.emit_steps(g, k, step_fns, ptrs, own, offsets, base, i, b.add(i, I64(1)))
            finally:
                self.serial = False
            b.branch(take)
            b.position_at_end(done)
        b.ret_void()
        g.finish()
        return fn

    @staticmethod
    def carry_buffer(step: Lowered, c: int):
        """The step's argument buffer of carry `c`."""
        return step.buffers[list(step.module.args)[c]]

    def memcpy(self) -> ir.Function:
        name = "llvm.memcpy.p0.p0.i64"
        fn = self.mod.globals.get(name)
        if fn is None:
            fn = ir.Function(self.mod, ir.FunctionType(ir.VoidType(), [PTR, PTR, I64, ir.IntType(1)]), name)
        return fn

    def notify_fn(self) -> ir.Function:
        """`tgc.notify(i)`, called after kernel i (the JIT's code only: `objects_entry`):
        when `tgc_set_notify(fn, marks)` has set a marks table and `marks[i]` is not 0,
        it calls `fn(i)`. The runtime sets both for one call (`CpuKernels.run`'s
        `notify`) and clears them after; unset, it is two loads and a branch."""
        fn = self.mod.globals.get("tgc.notify")
        if fn is not None:
            return fn
        slots = []
        for name in ("tgc.notify.fn", "tgc.notify.marks"):
            g = ir.GlobalVariable(self.mod, PTR, name)
            g.linkage = "internal"
            g.initializer = ir.Constant(PTR, None)
            slots.append(g)
        setter = define(self.mod, "tgc_set_notify", ir.VoidType(), [PTR, PTR], internal=False)
        b = ir.IRBuilder(setter.append_basic_block("entry"))
        b.store(setter.args[0], slots[0])
        b.store(setter.args[1], slots[1])
        b.ret_void()
        fn = define(self.mod, "tgc.notify", ir.VoidType(), [I32])
        fn.attributes.add("noinline")
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        marks = b.load(slots[1], typ=PTR)
        with b.if_then(b.icmp_unsigned("!=", marks, ir.Constant(PTR, None)), likely=False):
            mark = b.load(b.gep(marks, [b.sext(fn.args[0], I64)], source_etype=ir.IntType(8)), typ=ir.IntType(8))
            with b.if_then(b.icmp_unsigned("!=", mark, ir.IntType(8)(0))):
                target = b.load(slots[0], typ=ir.FunctionType(ir.VoidType(), [I32]).as_pointer())
                b.call(target, [fn.args[0]])
        b.ret_void()
        return fn

    @staticmethod
    def blas_one_thread(f: Frame):
        """Set OpenBLAS to one thread for this call; returns what emits the restore.

        tgc shares the cores itself (its tiled GEMMs and loops on libgomp); a GEMM
        below `gemm_parallel_min_flops` is one cblas call, which OpenBLAS would
        otherwise thread on its own pool, whose spinning then takes the cores from
        tgc's threads (an MLP step: 70 us, 82 with OpenBLAS threading). Process-wide, but only during the
        call, and restored only by the call that changed it, so overlapping calls
        from several threads end with the caller's setting."""
        b = f.b
        have = b.and_(fntable.is_set(b, "blas_get_threads"), fntable.is_set(b, "blas_set_threads"))
        before = f.alloca(I32, "blas.threads")
        b.store(I32(1), before)
        with b.if_then(have):
            n = fntable.call(b, "blas_get_threads", [])
            b.store(n, before)
            with b.if_then(b.icmp_signed(">", n, I32(1))):
                fntable.call(b, "blas_set_threads", [I32(1)])
        saved = b.load(before)

        def restore() -> None:
            with b.if_then(b.icmp_signed(">", saved, I32(1))):
                fntable.call(b, "blas_set_threads", [saved])
        return restore

    def objects_fn(self, run: ir.Function) -> None:
        """tgc_run_objects: loops over the `expect` table, whose first entry is the
        argument count. The count is read at run time so that LLVM cannot unroll the
        loops: code of one size whatever the number of arguments (unrolled checks of 40
        arguments cost LLVM minutes, and even 2 cost it ~40 ms)."""
        m = self.low.module
        n_args, n_outs = len(m.args), len(m.outputs)
        fn = define(self.mod, "tgc_run_objects", I32, [PTR] * 2, internal=False)
        optimize_not(fn)
        frame, items = fn.args
        f = Frame(fn, m, None)
        b, e = f.b, f.entry

        def at(base, i, typ=I64):
            return b.load(b.gep(base, [i if isinstance(i, ir.Value) else I64(i)], source_etype=typ), typ=typ)

        def field(obj, which, typ):  # which: index into `layout`
            return b.load(b.gep(obj, [at(layout, which)], source_etype=ir.IntType(8)), typ=typ)

        dims, layout, expect = at(frame, 0, PTR), at(frame, 2, PTR), at(frame, 3, PTR)
        ws = b.load(at(frame, 1, PTR), typ=PTR)
        objs = b.load(b.gep(items, [at(layout, 6)], source_etype=ir.IntType(8)), typ=PTR)
        n = max(n_args + n_outs, 1)
        ptrs = f.alloca(ir.ArrayType(PTR, n), "ptrs")
        lo, size, upd = (f.alloca(ir.ArrayType(I64, n), name) for name in ("lo", "size", "upd"))
        pos, ok = f.alloca(I64, "pos"), f.alloca(ir.IntType(1), "ok")
        e.store(I64(1), pos)
        e.store(ir.Constant(ir.IntType(1), 1), ok)
        count = at(expect, 0)

        def slot(array, i):
            return b.gep(array, [I32(0), i])

        with for_range(b, I64(0), count, "arg") as i:
            obj, p = at(objs, i, PTR), b.load(pos)
            mask, rank = at(expect, b.add(p, I64(2))), at(expect, b.add(p, I64(3)))
            b.store(b.add(b.add(p, I64(5)), rank), pos)
            array = b.icmp_unsigned("==", b.ptrtoint(field(obj, 0, PTR), I64), at(expect, p))
            b.store(b.and_(b.load(ok), array), ok)
            with b.if_then(array):  # only an ndarray's fields are read (another object may be smaller)
                same = b.icmp_unsigned("==", b.ptrtoint(field(obj, 4, PTR), I64), at(expect, b.add(p, I64(1))))
                flags = b.zext(field(obj, 5, I32), I64)
                same = b.and_(same, b.icmp_unsigned("==", b.and_(flags, mask), mask))
                same = b.and_(same, b.icmp_unsigned("==", b.sext(field(obj, 2, I32), I64), rank))
                b.store(b.and_(b.load(ok), same), ok)
                with b.if_then(same):  # the same rank: compare the sizes
                    shape = field(obj, 3, PTR)
                    with for_range(b, I64(0), rank, "axis") as a:
                        eq = b.icmp_unsigned("==", at(shape, a), at(expect, b.add(b.add(p, I64(5)), a)))
                        b.store(b.and_(b.load(ok), eq), ok)
                data = field(obj, 1, PTR)
                b.store(data, slot(ptrs, i))
                b.store(b.ptrtoint(data, I64), slot(lo, i))
                b.store(at(expect, b.add(p, I64(4))), slot(size, i))
                b.store(b.and_(mask, I64(WRITEABLE)), slot(upd, i))
        with b.if_then(b.not_(b.load(ok)), likely=False):
            b.ret(I32(-1))
        with for_range(b, I64(0), count, "u") as i:
            lo_i, n_i = b.load(slot(lo, i)), b.load(slot(size, i))
            written = b.and_(b.icmp_unsigned("!=", b.load(slot(upd, i)), I64(0)), b.icmp_unsigned("!=", n_i, I64(0)))
            with b.if_then(written):
                with for_range(b, I64(0), count, "o") as j:
                    lo_j, n_j = b.load(slot(lo, j)), b.load(slot(size, j))
                    hit = b.and_(b.icmp_unsigned("<", lo_j, b.add(lo_i, n_i)), b.icmp_unsigned("<", lo_i, b.add(lo_j, n_j)))
                    hit = b.and_(hit, b.and_(b.icmp_unsigned("!=", i, j), b.icmp_unsigned("!=", n_j, I64(0))))
                    with b.if_then(hit, likely=False):
                        b.ret(I32(-2))
        for j in range(n_outs):
            b.store(field(at(objs, n_args + j, PTR), 1, PTR), slot(ptrs, I32(n_args + j)))
        b.ret(b.call(run, [dims, slot(ptrs, I32(0)), slot(ptrs, I32(n_args)), ws]))
        f.finish()

    def arg_ptr(self, b: ir.IRBuilder, array, index: int):
        return b.load(b.gep(array, [I64(index)], source_etype=PTR), typ=PTR)

    def slot_offsets(self, f: Frame) -> list:
        offsets, at = [], I64(0)
        for s in self.slot_sizes(f):
            offsets.append(at)
            at = f.entry.add(at, s)
        return offsets

    def buffer_ptrs(self, f: Frame, args, outs, ws, offsets) -> dict:
        b = f.b
        ptrs = {}
        for name, buf in self.low.buffers.items():
            if buf.kind == "arg":
                ptrs[name] = self.arg_ptr(b, args, buf.index)
            elif buf.kind == "out":
                ptrs[name] = self.arg_ptr(b, outs, buf.index)
            elif buf.alias is None:
                ptrs[name] = b.gep(ws, [offsets[buf.slot]], source_etype=ir.IntType(8))
        for name, buf in self.low.buffers.items():
            if buf.alias is not None:   # the bytes of the buffer it views (tgc.lower.alias)
                ptrs[name] = ptrs[buf.alias]
        return ptrs

    # ------------------------------------------------------------ warm workers
    #
    # A parallel region costs 1-3 us while libgomp's workers still spin from the last
    # one, ~80 us when they have gone to sleep. So the threshold for going parallel is
    # lower right after a region: `tgc.region` notes the time-stamp counter at the end
    # of each region, and a kernel that starts less than `options.cpu.warm_cycles`
    # later uses the `_warm` threshold. (GPT's step: many small kernels between large
    # ones, 4.2 ms, 4.8 with one threshold; an MLP step, whose kernels are all small, never starts a
    # region and stays serial.) While other processes hold the cores, the measured lag
    # of a region raises both (`parallel.py`: contention).

    def now(self, b: ir.IRBuilder):
        return parallel.now(b)

    def count_cycles(self, b: ir.IRBuilder, i: int, start, ran=None) -> None:
        """Add the cycles since `start` to kernel i's counter (`options.cpu.profile`:
        `tgc_profile()` returns the counters, one i64 per kernel, then one per kernel
        counting a GEMM's calls that ran in a region of their own: `ran`, its i32,
        is 1 for such a call; under contention a GEMM over its serial threshold may
        still run on one thread, `parallel.py`), then four per kernel, in ns of CPU
        time: thread 0's over the kernel, then thread 0's and the other threads' in its
        regions' bodies, and thread 0's in its regions (`parallel.busy_counters`, taken
        and zeroed here; `Program.thread_profile`). `start`: `profile_start`'s."""
        start, cpu0 = start
        n = max(len(self.low.kernels) + len(self.step_counters), 1)
        table = self.mod.globals.get("tgc.profile")
        if table is None:
            table = ir.GlobalVariable(self.mod, ir.ArrayType(I64, PROFILE_COLUMNS * n), "tgc.profile")
            table.linkage = "internal"
            table.initializer = ir.Constant(table.value_type, None)
            getter = define(self.mod, "tgc_profile", PTR, [], internal=False)
            ir.IRBuilder(getter.append_basic_block("entry")).ret(table)
        slot = b.gep(table, [I32(0), I32(i)], inbounds=True)
        b.store(b.add(b.load(slot, typ=I64), b.sub(self.now(b), start)), slot)
        if ran is not None:
            slot = b.gep(table, [I32(0), I32(n + i)], inbounds=True)
            b.store(b.add(b.load(slot, typ=I64), b.zext(b.icmp_signed("!=", ran, I32(0)), I64)), slot)
        spent = b.sub(b.call(parallel.thread_ns_fn(self.mod), []), cpu0)
        taken = [b.load_atomic(g, "monotonic", 8, typ=I64) for g in parallel.busy_counters(self.mod)]
        for j, v in enumerate([spent] + taken):   # every region of the kernel has ended
            slot = b.gep(table, [I32(0), I32(2 * n + 4 * i + j)], inbounds=True)
            b.store(b.add(b.load(slot, typ=I64), v), slot)
        for g in parallel.busy_counters(self.mod):
            b.store_atomic(I64(0), g, "monotonic", 8)

    def profile_start(self, b: ir.IRBuilder):
        """(time-stamp counter, thread 0's CPU time in ns) before a counted kernel: the
        clock first, so that the cycles counted leave out reading it (`count_cycles`
        reads the counter before the clock at the end)."""
        cpu0 = b.call(parallel.thread_ns_fn(self.mod), [])
        return self.now(b), cpu0

    # tgc_run calls small helpers (defined once, never inlined: `parallel.threshold_fn`,
    # `parallel.region_fn`, `tgc.parallel_now`) around every kernel rather than holding
    # their code once per kernel: GPT's first unit, with tgc_run, compiles in 0.92 s, 1.06
    # with their code in every kernel's call (its tgc_run: 3001 lines of IR against 4569).

    def parallel_now(self) -> ir.Function:
        """`i1 tgc.parallel_now(work, limit)`: whether a kernel of this much work runs
        in a region (the runtime gave libgomp and work reaches limit)."""
        fn = self.mod.globals.get("tgc.parallel_now")
        if fn is not None:
            return fn
        fn = define(self.mod, "tgc.parallel_now", ir.IntType(1), [I64, I64])
        fn.attributes.add("noinline")
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        have = b.icmp_unsigned("!=", fntable_slot(b, "gomp_parallel"), ir.Constant(PTR, None))
        b.ret(b.and_(b.icmp_signed(">=", fn.args[0], fn.args[1]), have))
        return fn

    def threshold(self, b: ir.IRBuilder, warm: int, cold: int, per_cycle: int):
        """i64: the least work (GEMM: flops) that runs in a region now: `warm` when a
        region ended less than `warm_cycles` ago, else `cold`, and at least twice the
        measured lag at `per_cycle` units a cycle (`parallel.threshold_fn`)."""
        cpu = self.opt.cpu
        if self.opt.cpu.threads == 1 or (warm >= cold and cpu.contention_memory_cycles <= 0):
            return I64(cold)
        return b.call(parallel.threshold_fn(self.mod, cpu), [I64(warm), I64(cold), I64(max(per_cycle, 0))])

    def call_loop(self, f: Frame, k, kfn, par, call_args) -> None:
        b = f.b
        n = split_count(f, k, self.opt.cpu)
        if par is None or self.serial:
            b.call(kfn, call_args + [I64(0), n])
            return
        data = f.alloca(ir.ArrayType(PTR, len(call_args)), "data")
        for i, a in enumerate(call_args):
            b.store(a, b.gep(data, [I32(0), I32(i)]))
        work = I64(0)
        for weight, sizes in work_terms(k, self.opt.cpu):
            term = I64(weight)
            for s in sizes:
                term = b.mul(term, f.size(s))
            work = b.add(work, term)
        cpu = self.opt.cpu
        limit = self.threshold(b, cpu.parallel_min_work_warm, cpu.parallel_min_work, cpu.loop_work_per_cycle)
        big = b.call(self.parallel_now(), [work, limit])
        with b.if_else(big) as (then, otherwise):
            with then:
                b.call(parallel.region_fn(self.mod, self.mod, cpu), [par, data])
            with otherwise:
                b.call(kfn, call_args + [I64(0), n])


    # ------------------------------------------------------------ merged regions

    def regions(self, p: Lowered, step: bool) -> list:
        """The runs of `p`'s kernels that share one region (`regions.plan_regions`);
        none with one thread, with `merge_regions` off, or with `profile` (its counters
        are per kernel)."""
        cpu = self.opt.cpu
        if cpu.threads == 1 or not cpu.merge_regions or cpu.profile:
            return []
        return regions.plan_regions(p, cpu, step)

    def call_region(self, f: Frame, p: Lowered, r, fns, ptrs: dict) -> None:
        """Run kernels `r.start` .. `r.stop` of `p` in one region when their split
        kernels' work together (`region_work_terms`), less `barrier_work` per barrier,
        reaches the threshold (the lag's floor scaled by the barriers plus one: each
        barrier may wait a lag), else one after another on this thread, as without a
        region (a GEMM then deciding alone)."""
        b, cpu = f.b, self.opt.cpu
        ks = p.kernels[r.start:r.stop]
        kfns = [next(fns)[0] for _ in ks]
        bufs = list(dict.fromkeys(n for k in ks for n in region_buffers(k)))
        data = f.alloca(ir.ArrayType(PTR, 1 + len(bufs)), "region.data")
        for i, a in enumerate([f.dims_ptr] + [ptrs[n] for n in bufs]):
            b.store(a, b.gep(data, [I32(0), I32(i)]))
        work = I64(0)
        for k, one in zip(ks, r.single):
            for weight_, sizes, div, batch in region_work_terms(p, k, cpu) if not one else ():
                term, count = I64(weight_), I64(1)
                for s in sizes:
                    term, count = b.mul(term, f.size(s)), b.mul(count, f.size(s))
                term = term if div == 1 else b.sdiv(term, I64(div))
                if batch is not None:   # a GEMM of one task (one thread) is no split work
                    times = I64(1)
                    for s in batch:
                        times = b.mul(times, f.size(s))
                    tiled = b.or_(b.icmp_signed(">=", b.mul(count, I64(2)), I64(cpu.gemm_parallel_min_flops)),
                                  b.icmp_signed(">=", times, I64(cpu.gemm_batch_tasks)))
                    term = b.select(tiled, term, I64(0))
                work = b.add(work, term)
        limit = self.threshold(b, cpu.parallel_min_work_warm, cpu.parallel_min_work,
                               cpu.loop_work_per_cycle * (1 + r.barriers))
        big = b.call(self.parallel_now(), [b.sub(work, I64(cpu.barrier_work * r.barriers)), limit])
        if r.barriers:
            big = b.and_(big, fntable.is_set(b, "gomp_barrier"))
        with b.if_else(big) as (then, otherwise):
            with then:
                body = self.region_body(p, r, ks, kfns, bufs)
                b.call(parallel.region_fn(self.mod, self.mod, cpu), [body, data])
            with otherwise:
                for j, (k, kfn) in enumerate(zip(ks, kfns)):
                    args = [f.dims_ptr] + [ptrs[n] for n in region_buffers(k)]
                    if r.is_paired(j + 1):   # run with the loop after it
                        continue
                    if r.is_paired(j):
                        g = ks[j - 1]
                        gargs = [f.dims_ptr] + [ptrs[n] for n in region_buffers(g)]
                        self.call_pair(f, kfns[j - 1], gargs, kfn, args, I64(0), split_count(f, k, cpu))
                    elif regions.is_gemm(k):   # decides for itself (its own region, or one thread)
                        b.call(kfn, args + [self.gemm_min_flops(b)])
                    else:
                        b.call(kfn, args + [I64(0), split_count(f, k, cpu)])

    @staticmethod
    def call_pair(f: Frame, gfn, gargs: list, lfn, largs: list, lo, hi) -> None:
        """A GEMM and the loop paired with it (`regions.pairs`) over indices [lo, hi)
        of the loop's split: at each index, the product's tasks of that batch index
        (`gemm.GemmGen.emit`'s pair mode: -2 - index), then the loop at that index."""
        b = f.b
        with for_range(b, lo, hi, "pair", unroll=False) as i:
            b.call(gfn, gargs + [b.sub(I64(-2), i)])
            b.call(lfn, largs + [i, b.add(i, I64(1))])

    def region_body(self, p: Lowered, r, ks, kfns, bufs: list) -> ir.Function:
        """`void tgc.rN(ptr data)`, data = [dims, buffers...]: on each thread, each
        kernel of the region on its share of its split range (`parallel.thread_range`),
        or whole on thread 0 (`r.single`), with `tgc.barrier` where `r.barrier` says."""
        cpu = self.opt.cpu
        n, self.regions_defined = self.regions_defined, self.regions_defined + 1
        fn = define(self.mod, f"tgc.r{n}", ir.VoidType(), [PTR])
        optimize_not(fn)   # loads and calls
        f = Frame(fn, p.module, None, p.edges)
        e = f.entry
        loaded = [e.load(e.gep(fn.args[0], [I64(i)], source_etype=PTR), typ=PTR) for i in range(1 + len(bufs))]
        f.dims_ptr = loaded[0]
        ptrs = dict(zip(bufs, loaded[1:]))
        b = f.b
        for j, (k, kfn) in enumerate(zip(ks, kfns)):
            if r.barrier[j]:
                b.call(parallel.barrier_fn(self.mod, self.mod), [])
            args = [f.dims_ptr] + [ptrs[name] for name in region_buffers(k)]
            if r.is_paired(j + 1):   # runs with the loop after it
                continue
            if r.is_paired(j):   # this thread's share of the loop's split, the product's index by index
                g = ks[j - 1]
                lo, hi = parallel.thread_range(b, split_count(f, k, cpu))
                self.call_pair(f, kfns[j - 1], [f.dims_ptr] + [ptrs[name] for name in region_buffers(g)],
                               kfn, args, lo, hi)
                continue
            if regions.is_gemm(k):   # each thread its share of the tasks (`gemm.GemmGen.emit`)
                b.call(kfn, args + [I64(-1)])
                continue
            n = split_count(f, k, cpu)
            if r.single[j]:
                first = b.icmp_signed("==", fntable.call(b, "omp_get_thread_num", []), I32(0))
                with b.if_then(first):
                    b.call(kfn, args + [I64(0), n])
            else:
                lo, hi = parallel.thread_range(b, n)
                b.call(kfn, args + [lo, hi])
        b.ret_void()
        f.finish()
        return fn


def weight(k: LoopKernel) -> int:
    """Work per iteration of the kernel's loops, in units of an add (tgc.ir.ops.COSTS)."""
    roots = [k.body] + ([k.epilogue] if k.epilogue is not None else [])
    maps = [e.fn for r in roots for e in walk(r) if isinstance(e, Map)]
    if k.reduce == "logsumexp":  # an exp per element, and a second pass
        maps.append("exp")
    draws = [e for r in roots for e in walk(r) if isinstance(e, Rand)]   # Philox's ~100 integer ops, vectorized
    return (1 + sum(COSTS[FNS[fn].cost] for fn in maps)
            + sum(8 if e.kind == "rand" else 24 for e in draws))


def work_terms(k, cpu: CpuOptions) -> list[tuple[int, list]]:
    """(weight, loop extents) terms of the work of `k` (a group: of its members): each
    iteration weighs `weight`, and each entry into the innermost loop `cpu.row_entry_work` more
    (its setup, masked tail and horizontal reduction: softmax rows of 11 elements
    cost ~10x what their element count says)."""
    out = []
    for m in (k.members if isinstance(k, LoopGroup) else (k,)):
        sizes = [m.sizes[v] for v in m.loops]
        out.append((weight(m), sizes))
        if len(sizes) > 1:
            out.append((cpu.row_entry_work, sizes[:-1]))
    return out


def kernel_work(k, env: dict, cpu: CpuOptions) -> int:
    """The work of loop kernel (or group) `k` at the dims `env` (`work_terms`)."""
    total = 0
    for weight, sizes in work_terms(k, cpu):
        for s in sizes:
            weight *= size_eval(s, env)
        total += weight
    return total


SERIAL, PARALLEL, PARALLEL_WARM = "serial", "parallel", "parallel when warm"
STEPS = "per step kernel"   # a loop over an edge: each kernel of its step decides
STEPS_PARALLEL = "steps on the threads"   # ... or its steps shared among the threads, each on one


def thread_plan(low: Lowered, k, env: dict, options: Options) -> str:
    """How kernel `k` is run at the dims `env` (every dim bound), as the generated code
    decides it: SERIAL (one thread: too small to gain from threads even right after
    another region, a loop that cannot be split, or `threads=1`), PARALLEL (in a region
    on every thread) or PARALLEL_WARM (in a region only right after another one, while
    the workers still spin: `warm_cycles`). On a loaded machine a kernel of either
    parallel kind may still run serially (the lag, `parallel.py`). `tgc explain`
    shows it per kernel; a loop over an edge (`StepLoop`) is STEPS: each kernel of its
    step decides for itself; or STEPS_PARALLEL, its steps shared among the threads
    (`parallel_step_loops`)."""
    cpu = options.cpu
    if cpu.threads == 1:
        return SERIAL
    if isinstance(k, StepLoop):
        return STEPS_PARALLEL if any(p is k for p, _ in parallel_step_loops(low, cpu)) else STEPS
    if isinstance(k, (GemmKernel, ImplicitGemm)):
        g = k.gemm if isinstance(k, ImplicitGemm) else k
        amount = 2
        for e in g.batch + g.m + g.n + g.k + g.taps:
            amount *= size_eval(low.size(e), env)
        warm, cold = cpu.gemm_parallel_min_flops_warm, cpu.gemm_parallel_min_flops
    elif parallel_ok(k):
        amount = kernel_work(k, env, cpu)
        warm, cold = cpu.parallel_min_work_warm, cpu.parallel_min_work
    else:
        return SERIAL
    if amount >= cold:
        return PARALLEL
    return PARALLEL_WARM if amount >= warm else SERIAL


def gemm_buffers(k) -> list[str]:
    """A GEMM kernel's buffers in its function's order: a, b, out (an implicit GEMM's
    window: its source; a split sum's out: its partial buffer)."""
    if isinstance(k, ImplicitGemm):   # its window's source; a split sum writes its partial rows
        g = k.gemm
        return [k.source if n == k.window else n for n in (g.a.buf, g.b.buf)] + [k.target]
    return [k.a.buf, k.b.buf, k.out]


def region_buffers(k) -> list[str]:
    """The buffers kernel `k`'s function takes, in its order."""
    return gemm_buffers(k) if regions.is_gemm(k) else kernel_buffers(k)


def region_work_terms(low: Lowered, k, cpu: CpuOptions) -> list[tuple]:
    """The work a kernel in a merged region adds to what threads share, as (weight,
    extents, divisor, batch): weight x extents / divisor; a loop's are `work_terms`.
    A GEMM's flops count as loop work of the same serial time (`loop_work_per_cycle`
    / `gemm_flops_per_cycle` each), and only when it is cut into several tasks
    (`gemm.GemmGen.tile_limit`: at least `gemm_parallel_min_flops`, or its `batch`
    extents at least `gemm_batch_tasks` indices); one task runs on one thread."""
    if not regions.is_gemm(k):
        return [(w, sizes, 1, None) for w, sizes in work_terms(k, cpu)]
    g = k.gemm if isinstance(k, ImplicitGemm) else k
    sizes = [low.size(e) for e in g.batch + g.m + g.n + g.k + g.taps]
    return [(2 * max(cpu.loop_work_per_cycle, 1), sizes, max(cpu.gemm_flops_per_cycle, 1),
             [low.size(e) for e in g.batch])]


def thread_plans(low: Lowered, env: dict, options: Options) -> list[str]:
    """`thread_plan` of each of `low`'s kernels, as the generated code decides it with
    merged regions (`regions.plan_regions`): a region's kernels all take the plan of
    the region, whose work is its split kernels' together (a kernel on thread 0 in it
    takes the region's plan too: it runs inside it)."""
    plans = [thread_plan(low, k, env, options) for k in low.kernels]
    cpu = options.cpu
    if cpu.threads == 1 or not cpu.merge_regions or cpu.profile:
        return plans
    for r in regions.plan_regions(low, cpu):
        amount = 0
        for k, one in zip(low.kernels[r.start:r.stop], r.single):
            for weight_, sizes, div, batch in region_work_terms(low, k, cpu) if not one else ():
                count = 1
                for s in sizes:
                    count *= size_eval(s, env)
                times = 1
                for s in batch or ():
                    times *= size_eval(s, env)
                if batch is None or 2 * count >= cpu.gemm_parallel_min_flops or times >= cpu.gemm_batch_tasks:
                    amount += weight_ * count // div
        amount -= cpu.barrier_work * r.barriers
        plan = PARALLEL if amount >= cpu.parallel_min_work else \
            PARALLEL_WARM if amount >= cpu.parallel_min_work_warm else SERIAL
        for j in range(r.start, r.stop):
            plans[j] = plan
    return plans


def region_count(low: Lowered, env: dict, options: Options) -> tuple[int, int, int]:
    """(regions, of which those that run only right after another region, barriers in
    them) that one call of `low` starts at the dims `env` on a quiet machine, by
    `thread_plans`: one per parallel kernel or merged region, a loop's step's as many
    times as the loop runs. An upper bound: a PARALLEL_WARM one runs serially when
    the workers have gone to sleep, and any runs serially while the lag is held
    (`parallel.py`)."""
    plans = thread_plans(low, env, options)
    cpu = options.cpu
    merged = cpu.threads != 1 and cpu.merge_regions and not cpu.profile
    found = {r.start: r for r in regions.plan_regions(low, cpu)} if merged else {}
    count = warm = bars = 0
    i = 0
    while i < len(low.kernels):
        k = low.kernels[i]
        if isinstance(k, StepLoop) and any(p is k for p, _ in parallel_step_loops(low, cpu)):
            count += 1   # one region, its steps' kernels on their threads
        elif isinstance(k, StepLoop):
            trip = size_eval(k.trip, env)
            c, w, n = region_count(k.step, {**{d: s for d, s in k.step.module.dims.items() if isinstance(s, int)},
                                            **env}, options)
            count, warm, bars = count + trip * c, warm + trip * w, bars + trip * n
        else:
            par = plans[i] in (PARALLEL, PARALLEL_WARM)
            count += par
            warm += plans[i] == PARALLEL_WARM
            bars += found[i].barriers if par and i in found else 0
        i = found[i].stop if i in found else i + 1
    return count, warm, bars


def step_profile_kernels(low: Lowered) -> list:
    """The kernels of every loop's step (recursively; not the loops themselves), in
    the order `leaf_kernels` meets them: with `CpuOptions(profile=True)` each has a
    cycle counter after the program's own kernels' counters."""
    out = []
    for k in low.kernels:
        if isinstance(k, StepLoop):
            out += [sk for sk in k.step.kernels if not isinstance(sk, StepLoop)]
            out += step_profile_kernels(k.step)
    return out


def leaf_kernels(low: Lowered):
    """(program, kernel) for every kernel that is compiled: the program's, and in a
    loop, its step's (recursively), in the order the program runs them first."""
    for k in low.kernels:
        if isinstance(k, StepLoop):
            yield from leaf_kernels(k.step)
        else:
            yield low, k


def step_cycles(low: Lowered, env: dict, cpu: CpuOptions) -> int:
    """The estimated cycles of one run of `low` on one thread at the dims `env`: its
    GEMMs' flops at `gemm_flops_per_cycle`, its loops' work at `loop_work_per_cycle`,
    a loop over an edge its step's times its trip. Raises on a size `env` lacks."""
    total = 0
    for k in low.kernels:
        if isinstance(k, StepLoop):
            inner = {**{d: s for d, s in k.step.module.dims.items() if isinstance(s, int)}, **env}
            total += size_eval(k.trip, env) * step_cycles(k.step, inner, cpu)
            continue
        g = getattr(k, "gemm", k)   # an implicit GEMM's product
        if isinstance(g, GemmKernel):
            flops = 2
            for e in (*g.m, *g.n, *g.k, *g.batch, *g.taps):
                flops *= size_eval(low.size(e), env)
            total += flops // max(1, cpu.gemm_flops_per_cycle)
        else:
            total += kernel_work(k, env, cpu) // max(1, cpu.loop_work_per_cycle)
    return total


def parallel_step_loops(low: Lowered, cpu: CpuOptions, base: int = 0, env: dict | None = None) -> list:
    """(loop, its step's first slot) for each loop over an edge whose steps run on the
    threads together (`_ModuleGen.call_steps_parallel`), outermost first (the loops in
    its step then run on its lanes one after another): a loop that carries nothing,
    whose outputs are all stacked (each step writes its own slice; the other arguments
    are read only), with a trip known here that the lanes share evenly (a multiple of
    them, or at least 4 times as many), and a step of at least
    `cpu.parallel_steps_min_cycles` (`step_cycles`); off with one thread, under
    `profile` (its counters are per kernel) or with `parallel_steps_min_cycles` 0.
    Such a loop replaces the step's kernels' own regions, which at attention's small
    per-head products leave the second core partly idle."""
    lanes = cpu.step_lanes()
    if lanes < 2:
        return []
    env = {d: s for d, s in low.module.dims.items() if isinstance(s, int)} if env is None else env
    out = []
    for k in low.kernels:
        if not isinstance(k, StepLoop):
            continue
        sb = base + k.slot_base
        inner = {**{d: s for d, s in k.step.module.dims.items() if isinstance(s, int)}, **env}
        try:
            trip = size_eval(k.trip, env)
            cycles = step_cycles(k.step, inner, cpu)
        except Exception:  # noqa: BLE001 -- a symbolic size: the steps run one after another
            trip = cycles = 0
        if (k.carries == 0 and all(bind.stacked for bind in k.outs) and trip >= lanes
                and (trip % lanes == 0 or trip >= 4 * lanes) and cycles >= cpu.parallel_steps_min_cycles):
            out.append((k, sb))
        else:
            out += parallel_step_loops(k.step, cpu, sb, inner)
    return out


def kernel_key(low: Lowered, k) -> tuple:
    """What a kernel's code depends on: its text with buffers numbered by first
    use, and each buffer's axis order and dtype."""
    bufs = k.buffers_used()
    k = replace(rename_buffers(k, {b: f"b{i}" for i, b in enumerate(bufs)}), note="")
    return k.text(), tuple((low.buffers[b].order, low.buffers[b].dtype) for b in bufs)


def fntable_slot(b: ir.IRBuilder, name: str):
    """The raw pointer in table entry `name` (null when the runtime gave none)."""
    g = b.module.globals[fntable.GLOBAL]
    slot = b.gep(g, [I32(0), I32(fntable.FIELDS.index(name))], inbounds=True)
    return b.load(slot, typ=PTR)
