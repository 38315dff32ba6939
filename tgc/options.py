"""The one typed options object that travels through the whole pipeline.

Every stage reads what it needs from `Options`; nothing else configures the
compiler (no module-level knobs). A backend's own settings are a dataclass in its
folder (`tgc.backends.cpu.options.CpuOptions`, `tgc.backends.cuda.options.CudaOptions`),
nested here as one field each; those modules import nothing. Tests switch a stage off by passing options.
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace

from tgc.backends.cpu.options import CpuOptions, check_fields
from tgc.backends.cuda.options import CudaOptions

# The values each string field of Options takes.
CHOICES = {"dtype": ("f32", "f64"), "autocast": ("bf16", "f16")}


@dataclass(frozen=True)
class Options:
    """Compiler settings, passed as `tgc.compile(..., options=Options(...))`.

    Frozen: `options.with_(name=value)` makes a changed copy. The fields most callers
    set: `fp_strict` (no algebra, reassociation or FMA), `opt_level` and `passes` (a
    pass list instead of the default pipeline; `tgc passes` lists them). Each
    backend's code-generation settings sit in an object of its own: `cpu`, a
    `CpuOptions` (`threads`, `compile_jobs`, `profile`, the BLAS and parallel
    thresholds; `Options(cpu=CpuOptions(threads=1))`), and `cuda`, a `CudaOptions`.
    Each field's comment says what it does; `CpuOptions` and `CudaOptions` refuse a
    value of the wrong type (TypeError) or a negative number (ValueError), naming the
    field (`CpuOptions.threads must be 0 or more, not -1`), and so does `Options` itself
    (`opt_level` 0-3, `rep_size` 1 or more; `passes`, `stages` and `import_dirs` a tuple
    or list of strings, `dims` pairs (name, size) or a dict, each kept as a tuple).
    `dtype` and `dims` are set by `tgc.compile`'s own arguments."""

    dtype: str = "f32"                       # the program's float type: f32 | f64
    autocast: str | None = None              # mixed precision: None | "bf16" | "f16": matrix products on that type, f32 accumulation (tgc.opt.autocast)
    autocast_min_flops: int = 0              # ... only products of at least these FLOPs (as tgc explain counts them; symbolic dims at rep_size); smaller ones keep their operands
    passes: tuple[str, ...] | None = None    # IR passes, each 'name' or 'name{field=value,...}'; None: the default pipeline
    stages: tuple[str, ...] | None = None    # lowering stages, written the same way; None: the backend's (fuse, layout, its own: the CPU's group, plan)
    opt_level: int = 2                       # -O0..-O3
    fp_strict: bool = False                  # no algebra, reassociation or FMA: every op as the source orders it (docs/optimization.md)
    sum_exact_products: bool = False         # an f32 sum of 3+ terms (lowered.wide_sum): True also widens each product term's factors to f64 (exact products; the old rule), False rounds each product in f32 as PyTorch does
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
    unroll_max_ops: int = 64                 # a loop of known trip count n is unrolled when n times its step's op count is at most this; else it stays a loop, compiled once (tgc.opt.unroll)
    stream_block: int = 256                  # a cluster of large values over a long edge runs in a loop over blocks of this many indices (0: never; tgc.opt.stream) ...
    stream_block_min: int = 64               # ... or of its half, quarter, ... down to this many, the largest that divides the edge (none dividing: the largest with two blocks, and a tail step over the rows left over) ...
    stream_min_elements: int = 1 << 24       # ... when one of its values has at least this many elements (64 MiB in f32: smaller matrices stay whole, faster on the CPU)
    stream_min_elements_masked: int = 1 << 22   # ... or this many when its mask lets the loops skip keys (stream_mask_groups: half the work for causal attention pays for the loop sooner)
    stream_step_elements: int = 1 << 18     # a stream's step whose matrices (its block's rows by the keys, by the cluster's other edges) have more elements than this (1 MiB in f32) halves its block once where that brings them within it, else runs one index of the cluster's short edges (batch, heads) at a time, in loops around the stream, whether or not a step then fits (the peak independent of the batch and heads; tgc.opt.stream; 0: never)
    stream_fused_edge: int = 0               # a softmax-then-contract cluster (a logsumexp over the keys, scores over one contracted edge, weights contracted with values over the keys) whose contracted and value edges are at most this is left whole, for a target that runs it as fused kernels with no [t, s] buffer (0: none); the CUDA backends' resolution of the options sets it to what their flash stage takes (Backend.pipeline_options); other clusters stream (tgc.opt.stream)
    stream_mask_groups: int = 8              # a masked stream's blocks run as this many loops, each over only the keys its rows' mask admits (causal: about (n+1)/2n of the work; 0: one loop over every key; tgc.opt.stream_skip)
    stream_mask_rows: int = 256              # ... and at least one such loop per this many rows of the streamed edge (causal attention at t = 8192: 32 loops, 0.52 of the work, against 8's 0.56; each loop's step is compiled for its own keys; 0: stream_mask_groups alone, as under stream_key_block; tgc.opt.stream_skip)
    stream_mask_runs: int = 32               # ... but at most this many loops (each compiles its own step: causal attention at t = 8192 4x2 compiled in 9.3 s with 8 loops, 28 s with 32 and 73 s with 64 at load 6-9; t = 16384 would take 64)
    stream_key_block: int = 0                # a stream's step whose scores over the keys still exceed stream_step_elements (after its block is halved and the loops over batch and heads) computes its softmax in loops over blocks of this many keys: the online softmax (running max, rescaled sums), then, for a backward, the gradients with the weights recomputed (tgc.opt.stream_keys; 0: never, the default: on the CPU such a step runs 7 products where the rows' step runs 6 (D in the first loop, for one-hot rows) and its weights' exp twice, and its products' ~1.3-1.5x speed on L2 tiles does not pay for that at t = 4096 and only evens it at 8192 (docs/optimization.md "Tuned numbers"; benchmarks/attention_kernels.py); 512 the tuned block; keys shorter than two blocks never)
    stream_key_rows: int = 512               # ... and such a stream's block of rows (where it divides the edge twice; else stream_block's): a step's tiles are these rows by a key block
    stream_key_scores: bool = True           # ... and the first key loop keeps its blocks' scores for the backward's loop ([B, s] per step): no second scores product or mask per block (tgc.opt.stream_keys)
    rep_size: int = 64                       # size taken for symbolic dims by cost models and statistics
    # Tuned numbers of the layout stage (tgc.lower.layout; docs/optimization.md, "Tuned numbers"):
    layout_tap_min_k: int = 256              # where an operand's order splits a GEMM's K group, its outer K edges become taps (loops of accumulating calls) only when at least this much of K is left to each call; else the operands are copied (_taps_for_split_k)
    layout_short_sum: int = 8                # loop kernels reading a GEMM's result that sum at most this many terms (kernel taps) count as elementwise readers when its order is chosen; a longer sum votes for its summed group (_suit_readers, _summed_group)
    layout_tie_rows: int = 64                # ... when that summed group is as large as the other, it goes innermost only with at least this many elements (rows of several vectors; shorter rows are summed down the columns: _summed_group)
    layout_tall: int = 4                     # a GEMM result whose fixed order makes BLAS write a matrix at least this many times wider than tall ...
    layout_tall_min_k: int = 4096            # ... each element summing at least this many terms, is computed the other way round into a temporary and copied (_tall_result)
    collective_timeout: float | None = 600.0   # data parallel: seconds a rank waits in one collective for the others before DataParallelError (a rank died or hangs); None: forever (tgc.distributed)
    specialize_calls: int = 2                # symbolic dims: a shape signature gets a program with its sizes fixed once called this often (0: never) ...
    specialize_work: int = 1 << 31           # ... and once those calls did this many FLOPs plus bytes (tgc explain's count; tgc.runtime.specialize; docs/optimization.md)
    specialize_max: int = 8                  # ... for at most this many signatures per program (later ones run the generic program; a first call specialized for memory replaces the least recently run one)
    specialize_at_bytes: int | None = 1 << 28   # a signature whose generic call would hold at least these bytes of temporaries (tgc explain's peak) is specialized on its first call, when the specialization holds at most half (None: never)
    specialize_first_work: int | None = 1 << 36   # ... or whose specialization would do at least this many FLOPs plus bytes fewer in that call than the generic program (tgc explain's count: the compile paid by the one call; None: never)
    memory_budget: int | None = None         # workspace bytes: the backward pass recomputes saved values until it fits (tgc.budget); sizes: dims, else rep_size
    cpu: CpuOptions = field(default_factory=CpuOptions)     # the CPU backend's code generation (tgc.backends.cpu.options)
    cuda: CudaOptions = field(default_factory=CudaOptions)  # the CUDA backends' (tgc.backends.cuda.options)

    def __post_init__(self) -> None:
        check_fields(self, CHOICES)
        if not self.opt_level <= 3:
            raise ValueError(f"Options.opt_level must be 0, 1, 2 or 3, not {self.opt_level!r}")
        if self.rep_size == 0:
            raise ValueError("Options.rep_size must be 1 or more (the size cost models take for a symbolic dim), not 0")
        for name in ("passes", "stages", "import_dirs"):
            value = getattr(self, name)
            if value is None and name != "import_dirs":
                continue
            if not isinstance(value, (tuple, list)) or not all(isinstance(v, str) for v in value):
                what = type(value).__name__ if not isinstance(value, (tuple, list)) else \
                    f"{type(value).__name__} holding {type(next(v for v in value if not isinstance(v, str))).__name__}"
                raise TypeError(f"Options.{name} must be a tuple of strings"
                                f"{' or None' if name != 'import_dirs' else ''}, not {what} {value!r}"
                                + (f" ({name}=({value!r},) for one)" if isinstance(value, str) else ""))
            object.__setattr__(self, name, tuple(value))
        dims = self.dims
        pairs = tuple(dims.items()) if isinstance(dims, Mapping) else dims
        if not isinstance(pairs, (tuple, list)) or \
                not all(isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
            raise TypeError(f"Options.dims must be (name, size) pairs or a dict {{name: size}}, not {dims!r}")
        for name, size in pairs:
            if not isinstance(size, numbers.Integral) or isinstance(size, bool) or size < 1:
                raise ValueError(f"Options.dims: the size of '{name}': a size is a positive integer, "
                                 f"not {type(size).__name__} {size!r}")
        object.__setattr__(self, "dims", tuple((name, int(size)) for name, size in pairs))

    def with_(self, **changes) -> "Options":
        """A copy with the given fields changed. A name that is not a field of `Options`
        but of `CpuOptions` or `CudaOptions` changes that field of `cpu` or `cuda`:
        `options.with_(threads=1)` is `options.with_(cpu=options.cpu.with_(threads=1))`."""
        own = {f.name for f in fields(self)}
        nested: dict[str, dict] = {}
        for name in [n for n in changes if n not in own]:
            for part in ("cpu", "cuda"):
                if name in {f.name for f in fields(getattr(self, part))}:
                    nested.setdefault(part, {})[name] = changes.pop(name)
                    break
            else:
                raise TypeError(f"Options has no field '{name}' (nor have CpuOptions and CudaOptions)")
        for part, values in nested.items():
            changes[part] = replace(changes.get(part, getattr(self, part)), **values)
        return replace(self, **changes)


__all__ = ["Options", "CpuOptions", "CudaOptions"]
