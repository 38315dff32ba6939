"""The CPU backend's code-generation settings, nested in `tgc.options.Options` as
`options.cpu` (`Options(cpu=CpuOptions(threads=1))`).

Plain data (no imports of tgc): the neutral options module nests it. Its values are
checked when it is made (`check_fields`): a field of the wrong type is a TypeError, a
negative or NaN number or a string `CHOICES` does not list a ValueError, each naming the field. Every tuned number of
the CPU backend is a field here, not a module-level constant. A field changes
what code is generated (so it is part of the code cache's key), except `compile_jobs`,
which only splits the work of compiling it, and `recycle_min_bytes` and `recycle_kept`,
which the runtime reads. docs/optimization.md ("Tuned numbers") gives the measurement
behind each tuned default.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, fields, replace


def check_fields(options, choices: dict[str, tuple[str, ...]] | None = None) -> None:
    """Refuses a field of the options dataclass `options` (`CpuOptions`, `CudaOptions`)
    whose value is not of its declared type (`int`, `float`, `bool`, `str`; `| None`
    also takes None; an int for a float; numpy's integers and floats as well; a bool
    for no number), with a TypeError,
    or is a negative or NaN number, or a string that `choices` (field name -> the
    values it takes) does not list, with a ValueError; each message names the
    field. Every number of these settings is a count, size, threshold, cost or
    rate, of which 0 is the least (and, where its comment says so, means none,
    never or every core)."""
    for f in fields(options):
        value, types = getattr(options, f.name), [t.strip() for t in str(f.type).split("|")]
        where = f"{type(options).__name__}.{f.name}"
        if value is None and "None" in types:
            continue
        number = isinstance(value, numbers.Integral) and not isinstance(value, bool) or \
            "float" in types and isinstance(value, numbers.Real) and not isinstance(value, bool)
        ok = {"bool": isinstance(value, bool), "str": isinstance(value, str),
              "int": number, "float": number}
        checked = [t for t in types if t in ok]   # other types (tuples, ...) are not checked here
        if checked and not any(ok[t] for t in checked):
            raise TypeError(f"{where} must be {' or '.join(types)}, not {type(value).__name__} {value!r}")
        if number and not value >= 0:
            raise ValueError(f"{where} must be 0 or more, not {value!r}")
        allowed = (choices or {}).get(f.name)
        if allowed and value not in allowed:
            raise ValueError(f"{where} must be one of {', '.join(map(repr, allowed))}, not {value!r}")


# The values each string field of CpuOptions takes (its comment says what each means).
CHOICES = {"blas": ("numpy", "system", "none"), "bf16_gemm": ("auto", "on", "off"), "own_gemm": ("auto", "on", "off")}


@dataclass(frozen=True)
class CpuOptions:
    """How the CPU backend lowers and generates code; `with_(name=value)` copies."""

    threads: int = 0                         # worker threads for large loops; 0: every core, 1: none
    # A kernel too small to gain from threads runs on one thread (`tgc explain` shows which do, column "threads"):
    parallel_min_work: int = 1 << 19         # work (loop iterations x op weight, see codegen.work_terms: the cost model's units, ~0.1 ns each) below which a kernel runs on one thread (~50 us of serial time; tuned by measurement)
    parallel_min_work_warm: int = 1 << 15    # the same while the worker threads still spin from a parallel region (see warm_cycles)
    merge_regions: bool = True               # consecutive loop kernels share one parallel region, with barriers only where a kernel reads across the threads' shares (backends/cpu/regions.py); off: each kernel decides and starts its own
    region_max_barriers: int = 8             # ... a merged region holds at most this many barriers (a longer run of kernels is cut into several): under contention each barrier may wait a time slice (docs/optimization.md, "Tuned numbers")
    barrier_work: int = 1 << 12              # ... and a region's threshold grows by this much work per barrier in it: a barrier of two running threads costs ~0.25 us here, and the threads must save twice that
    warm_cycles: int = 60_000                # a parallel region that ended less than this many time-stamp-counter cycles ago left the workers spinning
    # Contention (backends/cpu/parallel.py): each region's overhead (its time less the calling thread's own share) beyond
    # what a region costs is its lag, milliseconds while other processes hold the cores. While the lag is held, a kernel
    # runs in a region only if its serial time, estimated from its work, is at least twice the lag (two threads save at
    # most half of it); every kernel under that runs serially. The estimate, in time-stamp-counter cycles:
    loop_work_per_cycle: int = 3             # units of work (see parallel_min_work) a loop kernel does per cycle on one thread (an add or mul per element ~0.1 ns, vectorized)
    gemm_flops_per_cycle: int = 16           # flops a GEMM does per cycle on one thread (the small products of a step; large ones do more)
    parallel_steps_min_cycles: int = 1 << 20  # a loop over an edge with independent steps (no carry, every output stacked) whose step takes at least this many cycles by the estimate (gemm_flops_per_cycle, loop_work_per_cycle) shares its steps among the threads, each step's kernels on one thread (codegen.parallel_step_loops; 0: never)
    cold_region_cycles: int = 300_000        # the expected overhead of a region whose workers had gone to sleep (a futex wake-up, ~80 us), not counted as lag
    contention_confirm_regions: int = 2      # the lag follows the least excess of this many consecutive regions (this one among them): one outlying region does not set it; 1: every region's excess does
    contention_memory_cycles: int = 250_000_000  # a measured lag is held this long (~0.1 s), then a region measures it again; 0: no lag (every kernel over its threshold runs in a region)
    contention_memory_lags: int = 50         # ... or up to this many times the lag, if longer: 1 at first, doubled each time the region that measures it again (costing about one lag: 2% of the time at 50) finds it again (parallel._next_hold)
    blas_min_flops: int = 1 << 16            # GEMM cells with fewer flops (all sizes known) become loops (read by the fuse stage)
    blas_tile_mnk: int = 1 << 18             # GEMM tiles (cblas calls) of at most this m*n*k: OpenBLAS runs them on the calling thread
    gemm_loop_max_flops: int = 1 << 15       # GEMM tiles with at most these flops run generated loops instead of cblas
    blas_chain_mnk: int = 1_000_000          # real cblas calls of at most this m*n*k go in K chunks of `sum_chunk` terms, one call each, each chunk summed from zero (0: never cut): numpy's OpenBLAS runs such calls on AVX-512 in its small-matrix kernels (m*n*k <= 100^3), one f32 chain over all of K; a 4 x 4096 x 16 product of positive operands was 2.8e-6 off norm-wise as one call, 11x PyTorch f32's 2.2e-7 (GemmGen.call_blas)
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
    own_gemm_max_b_bytes: int = 1 << 19      # ... whose B' has at most this many bytes (larger ones stream from memory: OpenBLAS packs them faster) ...
    own_gemm_min_rows: int = 192             # ... or tiles of at least this many rows of C' and 128 columns, any depth and B' ...
    own_gemm_tall_max_b_bytes: int = 1 << 22  # ... and a B' of at most this many bytes (gemm_dispatch.uses_own_gemm)
    own_gemm_transposed_a: bool = True       # ... also where A' has its rows contiguous (no taps): the kernel packs it panel by panel (fgemm._pack_a_transposed); False: such products go to cblas
    own_gemm_pack_a_rows: int = 512          # the most rows of a row panel (own_gemm_panel_rows) whose transposed A' the own kernel packs, in a stack buffer of its rows (rounded up to whole row blocks, then to 16) x 400 floats (5/4 of own_gemm_depth; the default panel: 512 rows, 516 in blocks of 6, 528 x 400 floats, 825 KiB); a larger panel reads A' in place
    own_gemm_pack_a_span: int = 1 << 21      # ... and packs A' for a single column block (which reads each packed row once) only where A''s K block spans more than this many bytes (K block x K stride x 4: an L2; in place, each line of it is fetched again for every block of rows it holds, from L3 beyond this)
    own_gemm_copy_a_rows: int = 48            # ... but where such an A' spanning more than that meets one block of B''s columns, sub-panels of this many of its rows (rounded up to whole row blocks) are copied as they are, rows still contiguous, K block by K block into a stack buffer of this many floats (rounded up to 16) a K (no transpose, no 4 KiB-aliased lines: fgemm._copy_a_rows) and read from there, the next sub-panel's lines prefetched meanwhile (attention's dk and dv at long keys: docs/optimization.md); 0: off (packed)
    own_gemm_tall_transposed: bool = False    # a tile whose A' has its rows contiguous, with one block of columns (own_gemm_vecs x 16) and at least own_gemm_min_rows rows, runs the own kernel whatever its depth (attention's dk and dv: 128 query rows a stream step, 64 columns), not cblas (gemm_dispatch.uses_own_gemm, GemmGen.own_tile); off by default: faster alone, level inside the attention step (docs/optimization.md)
    implicit_gemm: bool = True               # a gather copy (im2col) read only by products the own kernel runs is packed by them from its source, never stored (backends/cpu/implicit.py): less memory, and faster (docs/optimization.md)
    implicit_split_bytes: int = 1 << 19       # ... and such a product summing a tap edge (a convolution's kernel gradient over the images) sums it in gemm_tiles parts, one task each, into partial rows added up after it, when those rows take at most this many bytes (each thread packs only its parts' operand: backends/cpu/implicit.py, "Split sums"); 0: never
    group_blocks: int = 32                   # blocks of a loop group's rows with partial sums; 0: no groups (the group stage, backends/cpu/group.py)
    group_shrink_max_bytes: int = 1 << 21    # a kernel that would shorten a loop group's shared outer loops (loops that disagree, or end, where they did not before) starts a new group instead when the group's buffers would then have more than this many bytes per outer index (an L2: more no longer stays in cache between members), unless it sums over the loop where they end (a layernorm backward's partial sums; group._Grouper.outer); a group whose members sum over more than its first outer loop keeps them outer only above half this many bytes per index of the first (group._Run._prefix)
    group_past_gemms: bool = True            # a GEMM between a run of loop kernels and a loop kernel re-reading, over the same rows, a buffer of that run larger than half group_shrink_max_bytes moves up before the run (it reads and writes nothing the run touches), so that the run and the reader form one group (attention's backward step: P's rows read back in cache; backends/cpu/gemm_up.py)
    group_in_place: bool = True              # a loop group's member writes its temporary over a temporary of the same layout that the group reads for the last time, where every member up to it reads that one only at the element it writes (LoopGroup.can_retarget): the store hits the line just read, and the program holds one slot fewer (attention's step: P over the scores, dS over dP; backends/cpu/group_in_place.py)
    group_inline_max_ops: int = 3            # ... an elementwise member of at most this many adds, products and cheap maps is recomputed by each later member that reads it instead of stored (group._cheap; read by the group stage)
    # Tuned numbers of the code generator (docs/optimization.md, "Tuned numbers", gives each one's measurement):
    row_entry_work: int = 128                # work (parallel_min_work's units) of each entry into a kernel's innermost loop: its setup, masked tail and horizontal reduction (codegen.work_terms)
    entry_compile_cost: int = 0              # estimated compile cost (codegen.compile_cost's ms) of the entry points beyond their kernel calls, when the program is split into units for compile_jobs ...
    call_compile_cost: float = 0.5           # ... and of each kernel call in tgc_run ...
    tile_compile_cost: int = 100             # ... and of the GEMM tile helpers (gemm_small), compiled with the entry points in the first unit
    # The estimate of each kernel's compile cost (codegen.compile_cost, ms), fitted to LLVM's measured times on the benchmark workloads' kernels (correlation ~0.8):
    gemm_compile_cost: int = 8               # a GEMM kernel without batch edges (its entry is not optimized, nor an unbatched work function) ...
    batched_gemm_compile_cost: int = 14      # ... one with batch edges ...
    tap_compile_cost: int = 26               # ... and this more per tap
    implicit_compile_cost: int = 40          # an implicit GEMM: its GEMM's, and this more for its own copy of the f32 kernel
    loop_compile_cost: int = 10              # a loop kernel or loop group: this ...
    member_compile_cost: int = 4             # ... and this per member ...
    member_loop_compile_cost: int = 2        # ... and this per loop of each member ...
    blocked_compile_cost: int = 70           # ... and this for a group whose sums go into per-block partials
    gemm_merge_rows: bool = True             # a product run whole on one thread whose tiles cut only its rows (P) and all run the own kernel takes them in one call: the same bits, B' packed once (gemm.GemmGen.rows_merge)
    mask_ones_prefix: int = 64               # a loop kernel reading a band mask (a 1-D buffer indexed `v - w + c`, its innermost loop v and an outer w: a causal stream's step mask) as a `where` condition or a factor counts its leading 1.0s once per call and runs each row's innermost loop in two parts: where the index is in that prefix (whole multiples of this many iterations: no scalar remainder in either part; 0: off) the load is the constant 1.0 (no load, compare or select), the rest as before: the same values there (a reassociated sum in the same function may take other lanes: loops.py, "Band masks"); loops.mask_prefix_plan; off under --fp-strict
    gemm_min_tile: int = 16                  # GEMM tiles are not cut below this many rows or columns of C' (gemm.GemmGen.tiles) ...
    gemm_min_chunk: int = 64                 # ... nor below this many terms of K
    gemm_epilogue: bool = True               # a GEMM's epilogue (the `epilogue` stage: bias, GELU, residual, AdamW folded in) runs on each tile right after its product (backends/cpu/gemm_epilogue.py); False: as loops after the GEMM
    gemm_tap_tiles: int = 4                  # a GEMM with shifts (convolution taps) that cblas runs is cut into this many times gemm_tiles tiles
    gemm_batch_tasks: int = 16               # a GEMM batched at least this many times is one tile per batch index; a batch of fewer indices may share one packed B' in the own kernel (gemm_dispatch.shared_b_batch)
    pair_batch_loops: bool = True            # ... and such a product followed by a loop kernel that reads it one batch index at a time (a convolution's input gradient and its column sum) runs interleaved with it, index by index, on each thread, so that each index's product is read back from cache (regions.pairs); False: one after the other
    gemm_pack_elems: int = 4096              # elements of the stack buffer the small-tile GEMM loops pack B' into (gemm_small: 16 KiB of f32, in L1)
    gemm_loop_cols: int = 2                  # vectors of columns per block of the blocked GEMM loops (gemm_small.loops_kernel)
    bf16_gemm_depth: int = 256               # K per packed block of the bf16 kernel (even; gemm_bf16: a B' block of 128 pairs x 64 columns, 32 KiB)
    bf16_gemm_panel: int = 256               # rows of A' the bf16 kernel packs at a time per K block (256 x 128 pairs, 128 KiB)
    loop_split_min: int = 8                  # an outermost loop shorter than this is shared by threads together with the next ones, while their product is under this (loops.split_loops, loops.blocked_loops)
    unroll_max: int = 4                      # a loop of at most this many known iterations is unrolled ...
    unroll_copies: int = 8                   # ... while the short loops unrolled inside it make at most this many copies of the body (loops.unrolled)
    group_min_block_rows: int = 16           # the shortest block of a blocked loop group's outer loop ...
    group_min_vector_block_rows: int = 64    # ... when that loop is the one LLVM vectorizes (its main vector loop takes 2 x 16 rows) (loops.split_count)
    short_sum: int = 4096                    # an f32 sum of at most this many terms keeps f32 lanes (loops.LoopGen.accumulate); beyond short_sum // 64 rows a memory-mode sum goes through an f64 scratch row
    sum_chunk: int = 256                     # ... summed over chunks of this many iterations of its innermost loop (loops.LoopGen.chunked_sum); also the K block of the small-tile GEMM loops (gemm_small), each block's sum from zero
    wide_scratch: int = 4096                 # the most elements of an f32 memory-mode sum's f64 scratch row on the stack (loops.LoopGen.wide_memory_sum), and of an f32 scatter-add's f64 scratch copy of its output (wide_scatter)
    prefetch_row_bytes: int = 16384          # the most bytes of a loop group's next row prefetched per buffer ...
    prefetch_min_row_bytes: int = 1024       # ... and rows shorter than this not at all (consecutive rows share pages)
    own_gemm_depth: int = 320                # K per packed block of B in tgc's own f32 kernel (fgemm.own_kernel: even blocks of at most 5/4 of it: a width-384 transformer's 384-deep products are one block, C written once) ...
    own_gemm_mask_classes: int = 64          # ... and the most row classes whose lane masks an implicit GEMM's window table holds (fgemm._Lanes)
    own_gemm_window_groups: bool = True      # an implicit GEMM packs its window B''s rows that differ by one element of the source (a convolution's kernel columns) as one group, their lines read and joined once (fgemm._Lanes.fill_group)
    own_gemm_rows: int = 6                   # rows of A (broadcast) x ...
    own_gemm_vecs: int = 4                   # ... vectors of 16 columns of B of the own kernel's register block (24 accumulators); docs/optimization.md
    own_gemm_window_rows: int = 6            # rows of A of the register block (x 4 vectors) of an implicit GEMM's copy of the own kernel, which packs its window (implicit.py; docs/optimization.md)
    own_gemm_edge_vecs: int = 5              # a tile of C' with more columns than one block of the own kernel (own_gemm_vecs x 16) but at most this many vectors of 16 runs a 4 x this register block, its columns in one pass (gemm_dispatch.edge_vecs: nanoGPT's vocabulary of 65); at most own_gemm_vecs: never
    own_gemm_unroll: int = 4                 # K steps per iteration of the own kernel's FMA loop (the same FMAs in the same order; fewer loop instructions beside them)
    own_gemm_c_prefetch: int = 16            # K steps before the end of the own kernel's FMA loop at which a block's lines of C are prefetched into L1 for its store (0: only at the block's start)
    own_gemm_b_in_place: bool = True         # the own kernel reads a B' whose rows are one block of columns apart (columns contiguous, row stride own_gemm_vecs x 16: attention's P v, dS k and its dk, dv at 64 per head) in place rather than packing each K block (fgemm.own_kernel)
    own_gemm_panel_rows: int = 512           # rows of A the own kernel takes through all of B's column blocks at a time (its A panel stays in L2)
    causal_gemm: bool = True                 # a product whose operand is 0, or whose result is dead, where a causal mask rejects (attention's q.k, P v and their gradients) runs the own kernel's `tri` form over the blocks the mask admits (tgc.backends.cpu.causal; fgemm.own_kernel)
    recycle_min_bytes: int = 1 << 20         # a fast-path call whose outputs total at least this many bytes keeps them, to write into again once the caller drops them (kernels.CpuKernels.run_fast) ...
    recycle_kept: int = 2                    # ... from up to this many earlier calls

    def __post_init__(self) -> None:
        check_fields(self, CHOICES)
        if self.threads > 2 ** 31 - 1:   # the OpenMP runtime takes an int
            raise ValueError(f"CpuOptions.threads must be at most 2^31 - 1 (0: every core), not {self.threads}")

    def with_(self, **changes) -> "CpuOptions":
        """A copy with the given fields changed."""
        return replace(self, **changes)

    def step_lanes(self) -> int:
        """How many threads a loop's independent steps are shared among at most
        (codegen.parallel_step_loops): `threads`, or with 0 (every core) the cores this
        process may run on; 1 where such loops run one step after another (one thread,
        `profile`, `parallel_steps_min_cycles` 0)."""
        import os

        if self.threads == 1 or self.profile or self.parallel_steps_min_cycles <= 0:
            return 1
        if self.threads > 0:
            return self.threads
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except (AttributeError, OSError):
            return max(1, os.cpu_count() or 1)
