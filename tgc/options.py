"""The one typed options object that travels through the whole pipeline.

Every stage reads what it needs from `Options`; nothing else configures the
compiler (no module-level knobs). Tests switch a stage off by passing options.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Options:
    """Compiler settings, passed as `tgc.compile(..., options=Options(...))`.

    Frozen: `options.with_(name=value)` makes a changed copy. The fields most callers
    set: `fp_strict` (no algebra, reassociation or FMA), `threads` (worker threads;
    0 every core, 1 none), `compile_jobs` (LLVM compiles in that many parts),
    `opt_level`, `passes` (a pass list instead of the default pipeline; `tgc passes`
    lists them) and `profile` (count cycles per kernel, `Program.profile()`). The
    others tune the CPU backend's choices or print the IR; each field's comment below
    says what it does. `dtype` and `dims` are set by `tgc.compile`'s own arguments."""

    dtype: str = "f32"                       # the program's float type: f32 | f64
    autocast: str | None = None              # mixed precision: None | "bf16" | "f16": matrix products on that type, f32 accumulation (tgc.opt.autocast)
    passes: tuple[str, ...] | None = None    # IR passes, each 'name' or 'name{field=value,...}'; None: the default pipeline
    stages: tuple[str, ...] | None = None    # lowering stages, written the same way; None: the backend's (fuse, layout, group, plan)
    opt_level: int = 2                       # -O0..-O3
    fp_strict: bool = False                  # no algebra, reassociation or FMA: every op as the source orders it (docs/optimization.md)
    dims: tuple[tuple[str, int], ...] = ()   # symbolic dims bound at build time (-D)
    import_dirs: tuple[str, ...] = ()        # folders imports may also come from (-I)
    verify_each: bool = False                # interpret before/after every pass and compare
    verify_seed: int = 0
    print_ir_before: frozenset[str] = field(default_factory=frozenset)
    print_ir_after: frozenset[str] = field(default_factory=frozenset)
    print_ir_after_all: bool = False
    time_passes: bool = False
    locs: bool = False                       # print loc(...) in IR dumps
    stats: bool = False                      # measure ops, FLOPs, bytes after every pass (tgc.opt.stats)
    check_assumptions: bool = False          # check every `assume` on each call's inputs (EvalError when one fails; tgc.ir.assume)
    rep_size: int = 64                       # size taken for symbolic dims by cost models and statistics
    memory_budget: int | None = None         # workspace bytes: the backward pass recomputes saved values until it fits (tgc.budget); sizes: dims, else rep_size
    # CPU backend (lowering and code generation)
    threads: int = 0                         # worker threads for large loops; 0: every core, 1: none
    parallel_min_work: int = 1 << 19         # work (loop iterations x op weight, see codegen.work_terms) below which a kernel runs on one thread
    parallel_min_work_warm: int = 1 << 15    # the same while the worker threads still spin from a parallel region (see warm_cycles)
    warm_cycles: int = 60_000                # a parallel region that ended less than this many time-stamp-counter cycles ago left the workers spinning
    blas_min_flops: int = 1 << 16            # GEMM cells with fewer flops (all sizes known) become loops
    blas_tile_mnk: int = 1 << 18             # GEMM tiles (cblas calls) of at most this m*n*k: OpenBLAS runs them on the calling thread
    gemm_loop_max_flops: int = 1 << 15       # GEMM tiles with at most these flops run generated loops instead of cblas
    gemm_parallel_min_flops: int = 1 << 21   # GEMM cells with fewer flops run on one thread
    gemm_parallel_min_flops_warm: int = 1 << 18  # the same while the worker threads still spin
    gemm_tiles: int = 2                      # tiles (tasks) a GEMM product is cut into, whatever the thread count, so that its bits are the same on any
    blas: str = "numpy"                      # GEMMs' BLAS: "numpy" (numpy's OpenBLAS; tgc build links it with a RUNPATH into its venv), "system" (tgc build links the system CBLAS; the JIT uses numpy's) or "none" (generated loops, unless a library's caller passes a BLAS to NAME_init); backends/cpu/aot.py
    complex_gemm: bool = True                # a complex product becomes one cgemm/zgemm cell on the interleaved pairs (with blas "numpy"; lower/complex_gemm.py)
    profile: bool = False                    # count time-stamp-counter cycles per kernel (Program.profile())
    compile_jobs: int = 0                    # LLVM compiles the program in this many parts at once (forked processes); 0: one per usable core
    group_blocks: int = 32                   # blocks of a loop group's rows with partial sums; 0: no groups
    # CUDA backends (cuda, cuda-sim; docs/cuda.md)
    cuda_row_min: int = 128                  # a reduction over at least this many elements per output runs one block per output (else one thread)

    def with_(self, **changes) -> "Options":
        """A copy with the given fields changed."""
        return replace(self, **changes)
