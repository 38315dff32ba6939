"""The CPU backend's code-generation settings, nested in `tgc.options.Options` as
`options.cpu` (`Options(cpu=CpuOptions(threads=1))`).

Plain data (no imports): the neutral options module nests it. Every tuned threshold
of the CPU backend is a field here, none is a module-level constant. A field changes
what code is generated (so it is part of the code cache's key), except `compile_jobs`,
which only splits the work of compiling it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class CpuOptions:
    """How the CPU backend lowers and generates code; `with_(name=value)` copies."""

    threads: int = 0                         # worker threads for large loops; 0: every core, 1: none
    # A kernel too small to gain from threads runs on one thread (`tgc explain` shows which do, column "threads"):
    parallel_min_work: int = 1 << 19         # work (loop iterations x op weight, see codegen.work_terms: the cost model's units, ~0.1 ns each) below which a kernel runs on one thread (~50 us of serial time; tuned by measurement)
    parallel_min_work_warm: int = 1 << 15    # the same while the worker threads still spin from a parallel region (see warm_cycles)
    warm_cycles: int = 60_000                # a parallel region that ended less than this many time-stamp-counter cycles ago left the workers spinning
    # Contention (backends/cpu/parallel.py): each region's overhead (its time less the calling thread's own share) beyond
    # what a region costs is its lag, milliseconds while other processes hold the cores. While the lag is held, a kernel
    # runs in a region only if its serial time, estimated from its work, is at least twice the lag (two threads save at
    # most half of it); every kernel under that runs serially. The estimate, in time-stamp-counter cycles:
    loop_work_per_cycle: int = 3             # units of work (see parallel_min_work) a loop kernel does per cycle on one thread (an add or mul per element ~0.1 ns, vectorized)
    gemm_flops_per_cycle: int = 16           # flops a GEMM does per cycle on one thread (the small products of a step; large ones do more)
    cold_region_cycles: int = 300_000        # the expected overhead of a region whose workers had gone to sleep (a futex wake-up, ~80 us), not counted as lag
    contention_memory_cycles: int = 250_000_000  # a measured lag is held this long (~0.1 s), then a region measures it again; 0: no lag (every kernel over its threshold runs in a region)
    contention_memory_lags: int = 50         # ... or this many times the lag, if longer: the region that measures it again costs about one lag (2% of the time)
    blas_min_flops: int = 1 << 16            # GEMM cells with fewer flops (all sizes known) become loops (read by the fuse stage)
    blas_tile_mnk: int = 1 << 18             # GEMM tiles (cblas calls) of at most this m*n*k: OpenBLAS runs them on the calling thread
    gemm_loop_max_flops: int = 1 << 15       # GEMM tiles with at most these flops run generated loops instead of cblas
    gemm_parallel_min_flops: int = 1 << 21   # GEMM cells with fewer flops run on one thread
    gemm_parallel_min_flops_warm: int = 1 << 18  # the same while the worker threads still spin
    gemm_tiles: int = 2                      # tiles (tasks) a GEMM product is cut into, whatever the thread count, so that its bits are the same on any
    blas: str = "numpy"                      # GEMMs' BLAS: "numpy" (numpy's OpenBLAS; tgc build links it with a RUNPATH into its venv), "system" (tgc build links the system CBLAS; the JIT uses numpy's) or "none" (generated loops, unless a library's caller passes a BLAS to NAME_init); backends/cpu/aot.py
    complex_gemm: bool = True                # a complex product becomes one cgemm/zgemm cell on the interleaved pairs (with blas "numpy" or "system"; read by the fuse stage, lower/complex_gemm.py)
    profile: bool = False                    # count time-stamp-counter cycles per kernel (Program.profile())
    compile_jobs: int = 0                    # LLVM compiles the program in this many parts at once (forked processes); 0: one per usable core
    bf16_gemm: str = "auto"                  # products of two bf16 operands: "auto" (vdpbf16ps where the host reports avx512bf16), "on" (always: code for another CPU), "off" (widened to f32, then sgemm); backends/cpu/gemm_operands.py
    bf16_gemm_min_flops: int = 1 << 20       # ... for products of at least these flops (symbolic dims at rep_size); smaller ones run sgemm on f32 (the kernel's packing, per call, costs more than it saves)
    bf16_gemm_min_k: int = 64                # ... and summed over at least this many elements (symbolic dims at rep_size): GPT's 704 x 192 x 48 products (K = 48) took 0.37 Mcycles as bf16 GEMMs, 0.20 with sgemm; its K = 192 and K = 704 ones 0.12-0.18 against 0.21-0.30
    bf16_gemm_rounds: bool = False           # a bf16 GEMM reads an operand that is a whole f32 buffer rounded to bf16 (autocast's weights, inputs, products) from the f32 buffer, rounding as it packs, instead of a rounded 2-byte copy written by a loop of its own (backends/cpu/gemm_operands.py); off: on the MLP benchmark its f32 gathers made the forward GEMM 15.5 Mcycles against 11.0 after a rounding loop of 0.3
    own_gemm: str = "auto"                   # large f32 GEMM tiles whose left operand has K contiguous: "auto" (tgc's own AVX-512 kernel, backends/cpu/fgemm.py, where the host has avx512f), "on", "off" (cblas); gemm_dispatch.uses_own_gemm
    own_gemm_min_depth: int = 256            # ... for tiles summing at least this many terms ...
    own_gemm_min_cols: int = 512             # ... or with at least this many columns of C' (the normalized product) ...
    own_gemm_max_b_bytes: int = 1 << 19      # ... whose B' has at most this many bytes (larger ones stream from memory: OpenBLAS packs them faster)
    implicit_gemm: bool = True               # a gather copy (im2col) read only by products the own kernel runs is packed by them from its source, never stored (backends/cpu/implicit.py): less memory, and faster (conv2d benchmark, 2 threads, with the own kernel's other changes of that stop: 18.5 -> 13.9-14.9 Mcycles of kernels)
    group_blocks: int = 32                   # blocks of a loop group's rows with partial sums; 0: no groups (the group stage, backends/cpu/group.py)

    def with_(self, **changes) -> "CpuOptions":
        """A copy with the given fields changed."""
        return replace(self, **changes)
