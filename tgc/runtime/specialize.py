"""Programs specialized to the sizes they are called with.

A program whose dims are symbolic serves every shape: its kernels read the sizes at
run time, and the lowering plans them for sizes it does not know (cost models take
`Options.rep_size`; a GEMM kernel's choice between tgc's own and the BLAS, and the
implicit convolution GEMM that depends on it, are left to run time). The same program
with those dims fixed is planned and compiled for the real sizes. So a program keeps,
beside its generic code, a table of specializations, one per shape signature (the
symbolic dims' sizes, read from the arguments' shapes, and `dims=` if given):

- each call looks its signature up (a dict lookup); a specialized one runs the
  program built for it, with its own checks and fast path;
- otherwise the generic program runs, and the call is counted for its signature.
  The signature is specialized once it has been called at least
  `Options.specialize_calls` times (default 2: never a shape seen once) and those
  calls have done at least `Options.specialize_work` FLOPs plus bytes moved (default
  2^31; per call as `tgc explain` counts them at those sizes: `tgc.explain`, reckoned
  once per signature, at its `specialize_calls`-th call). Compiling a specialization
  takes 0.3-2 s on the 2-core machine, and 2^31 units are roughly 0.1-0.5 s of its
  kernels (10-20 GFLOP/s, 4 GB/s): the compile is paid once the generic calls have
  done work of its order (the rent-or-buy rule: a signature that stops being called
  right after wastes at most about as much as it had already cost), and a step of
  microseconds, which fixed sizes barely speed up, pays for one only after
  thousands of calls. The work is counted, not timed, so the choice does not depend
  on the machine's load: the same calls specialize at the same call in every run.
  `specialize_calls=0`: never specialize; `specialize_work=0`: on the
  `specialize_calls`-th call;
- a signature whose generic call would hold large temporaries is specialized on its
  first call, before it runs: at a new signature the generic program's peak of
  temporaries at its sizes is reckoned (`tgc.explain.Liveness`: the planned buffers'
  symbolic sizes evaluated at the dims, found once per program; microseconds), and
  when it is at least `Options.specialize_at_bytes` (default 256 MiB; None: never)
  the specialization is lowered, and compiled and run if its own peak is at most half
  of it (`first_call_specializes`). The generic program keeps what `stream` cannot
  block without known sizes (a causal attention's `[t, s]` matrices over a symbolic
  `t`: 805 MB at t = 8192, 13 GB at 32768, where its specialization holds 52 MB), so
  a first call of such a size would need that memory; the compile (0.3-2 s) is of
  the order of such a call's own time. A first call also runs the specialization
  when it alone pays for the compile: when the specialization does at least
  `Options.specialize_first_work` (2^36; None: never) FLOPs plus bytes fewer than the
  generic call, holding no more. The only pass a specialization runs again is
  `stream`, which changes the work only where it blocks a value of its threshold
  (`stream_min_elements_masked` for a masked cluster), so the generic call's work
  (`tgc.explain`: up to tens of ms) is counted only at sizes where a temporary whose
  size depends on a symbolic dim reaches it (`Liveness.largest_unfixed`: microseconds),
  and the specialization is lowered only when that work reaches the bound. A
  compile (1-10 s measured) is about 7e10 units of saved work: a causal attention
  streamed at t = 2048 saves 6.3e9 a call (0.15 s against a 1.6 s compile), so its
  first call keeps the generic program, as a shape seen once should
  (docs/optimization.md, "Specialized sizes", has the measurements). Otherwise
  (smaller calls, or a specialization that would hold as much and save less) the
  call runs the generic program and counts as above;
- at most `Options.specialize_max` signatures are specialized per program (their
  code and workspace stay loaded); later ones run the generic program, except a first
  call specialized for memory: the least recently run specialization gives way to it
  (dropped from the table, its code and workspace freed once no call runs it; its
  signature is a new one when it comes again). Sizes that change on every call would
  otherwise leave each size past the first `specialize_max` to the generic program's
  peak, the one the rule exists to avoid (a transformer layer at t = 8192: 1.8 GB of
  RSS where its specialization ran in 0.6 GB). Only the memory reason evicts: the calls'
  rule and the work reason keep the bound as it is, so a program never holds more
  than `specialize_max` specializations and never rebuilds for work alone.

A specialization is the module after the IR pipeline with those dims fixed
(`tgc.pipeline.specialized_module`: `fix_dims`, then `stream`, which blocks only edges
of known size), lowered and compiled again: the same operations, planned for fixed
sizes (a long attention streamed over blocks of its queries), so its results differ
from the generic program's only as two plans of one program may (docs/optimization.md,
the numerics contract), and its machine code is kept in the on-disk code cache like any program's
(`tgc.backends.cache`): a later process compiles nothing for a signature it has seen.
A call the specialized program refuses (an argument of another shape or type: an
EvalError, nothing written) is run again by the generic program, whose checks give
the message. A specialization that cannot be built (or does not take the same
arguments) is recorded (`Variant.refused`), and its signature runs generic code.

`Program.variants()` lists the signatures seen, `Program.last_variant` says which
program the calling thread's last call ran (`Variant.at_once`: specialized on its
first call, `first_reason` "memory" or "work", with `peak` and `special_peak` the two
programs' peaks, `work` and `special_work` their work where counted). Thread-safe: the table is read without a
lock; counting and building take one, so one signature is built once.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, replace

from tgc.ir.interp import EvalError
from tgc.ir.sizes import SizeError

SIGNATURES = 256    # signatures counted per program before the unspecialized ones are forgotten


@dataclass
class Variant:
    """One shape signature a program was called with (`Program.variants()`).

    `dims` gives the symbolic dims' sizes; `calls` the calls the generic program ran
    with them; `work` the FLOPs plus bytes of one such call (`tgc explain`'s count;
    None until reckoned); `program` the specialized program once built (None: the
    generic one runs), `compile_seconds` what building it took; `refused` why it will
    not be specialized (None: it may be, or it is). With `Options.specialize_at_bytes`
    set, `peak` is the bytes of temporaries the generic program holds at once at
    these sizes (reckoned at the first call), `special_peak` and `special_work` the
    specialization's peak and work when that peak (or, with
    `Options.specialize_first_work`, `work`, then reckoned at the first call) reached
    its bound, `first_reason` why the first call ran it ("memory" or "work"; None: it
    did not), and `at_once` says it was built then, and ran that first call."""
    dims: dict[str, int]
    calls: int = 0
    work: int | None = None
    program: object = None
    compile_seconds: float | None = None
    refused: str | None = None
    peak: int | None = None
    special_peak: int | None = None
    special_work: int | None = None
    first_reason: str | None = None
    at_once: bool = False
    used: int = 0   # the tick of the last call its specialization ran (or of its build): the LRU order

    @property
    def specialized(self) -> bool:
        return self.program is not None

    def __repr__(self) -> str:
        dims = ", ".join(f"{d}={n}" for d, n in self.dims.items())
        when = f", on its first call: {self.first_reason}" if self.at_once else ""
        state = (f"specialized ({self.compile_seconds:.2f} s to build{when})" if self.program is not None
                 else f"generic (refused: {self.refused})" if self.refused else "generic")
        work = "" if self.work is None else f" of {self.work:.3g} FLOPs + bytes"
        peaks = "" if self.peak is None else f"; temporaries {self.peak:.3g} B generic" + (
            "" if self.special_peak is None else f", {self.special_peak:.3g} B specialized")
        return f"<Variant {dims}: {state}; {self.calls} generic calls{work}{peaks}>"


class Specializations:
    """The specializations of one generic program (see the module docstring).

    `build(dims)` compiles the program with the symbolic dims in `dims` fixed (the
    pipeline's); `locate` gives, for each symbolic dim an argument carries
    (`carried`), the first such argument and axis; the others only `dims=` gives."""

    def __init__(self, program, build, options):
        self.program, self.build = program, build
        self.calls, self.work, self.most = options.specialize_calls, options.specialize_work, options.specialize_max
        self.at_bytes, self.first_work = options.specialize_at_bytes, options.specialize_first_work
        self.streams = self.streams_from(options)
        self.liveness = None   # the generic program's (tgc.explain.Liveness), found at the first signature
        module = program.module
        found = {d: _carrier(program, d) for d in module.symbolic_dims()}
        self.carried = tuple(d for d, c in found.items() if c is not None)
        self.locate = tuple(found[d] for d in self.carried)
        self.table: dict[tuple, Variant] = {}
        self.built = 0
        self.ticks = itertools.count(1)   # next() is atomic under the GIL: the calls stamp `used` without the lock
        self.lock = threading.Lock()
        self.local = threading.local()

    @staticmethod
    def streams_from(options) -> int | None:
        """The fewest elements of a value `stream` blocks (a masked cluster's, when its
        runs may skip keys); None: a specialization runs no pass that changes the work
        (`stream` is `tgc.pipeline.SIZED_PASSES`' one)."""
        from tgc.registry import pipeline as pipeline_passes

        if options.stream_block <= 0 or "stream" not in pipeline_passes(options):
            return None
        if options.stream_mask_groups > 0:
            return min(options.stream_min_elements, options.stream_min_elements_masked)
        return options.stream_min_elements

    @classmethod
    def of(cls, program, build, options) -> "Specializations | None":
        """The table for `program`, or None: no symbolic dims, no builder (a backend
        that does not specialize), specialization off (`specialize_calls=0`), or a
        program that counts cycles per kernel (`CpuOptions(profile=True)`: its
        `profile()` counts every call)."""
        if build is None or options.specialize_calls <= 0 or options.specialize_max <= 0 \
                or options.cpu.profile or not program.module.symbolic_dims():
            return None
        return cls(program, build, options)

    def call(self, arrays: dict, dims: dict | None, run_generic):
        """Run one call: the specialized program of its signature, else
        `run_generic(arrays, dims)`, counted and timed for the signature."""
        try:   # the signature: the carried dims' sizes (then dims=); none when the arguments give none
            key = tuple([arrays[a].shape[i] for a, i in self.locate])
            if dims is not None:
                key += (tuple(sorted(dims.items())),)
            variant = self.table.get(key)
        except (KeyError, AttributeError, IndexError, TypeError):   # the generic checks explain
            key = variant = None
        if variant is None and key is not None and (self.at_bytes is not None or self.first_work is not None):
            variant = self._first_call(key)
        refused = None
        if variant is not None and variant.program is not None:
            self.local.last = variant
            variant.used = next(self.ticks)
            try:
                return variant.program._call_here(arrays, None)
            except EvalError as e:   # refused before anything was written: the generic checks explain
                refused = e
        self.local.last = None
        result = run_generic(arrays, dims)
        if key is None:
            return result
        with self.lock:
            if refused is not None:   # the generic program took what its specialization refused
                variant.program, variant.refused = None, f"it refused a call the generic program ran: {refused}"
            variant = self.table.get(key) or self._add(key)
            variant.calls += 1
            if self._due(variant):
                self._specialize(variant)
        return result

    def _add(self, key: tuple) -> Variant:
        """A new signature's entry (under the lock)."""
        if len(self.table) >= SIGNATURES:
            self.table = {k: v for k, v in self.table.items() if v.program is not None}
        variant = self.table[key] = Variant(self._sizes(key))
        return variant

    def _first_call(self, key: tuple) -> Variant:
        """The entry of a signature not yet seen, specialized at once when the generic
        program would hold `specialize_at_bytes` of temporaries at its sizes and the
        specialization at most half as much, or when the specialization would do
        `specialize_first_work` FLOPs plus bytes fewer (`first_call_specializes`): the
        specialization is lowered only when the generic program's own peak or work
        reaches its bound."""
        with self.lock:
            variant = self.table.get(key)
            if variant is not None:   # another thread's first call added it
                return variant
            variant = self._add(key)
            try:
                env = self.program.module.bind_dims(variant.dims)
            except SizeError:   # sizes the generic checks refuse, with their message
                return variant
            if self.liveness is None:
                from tgc.explain import Liveness

                self.liveness = Liveness(self.program.lowered)
            variant.peak = self.liveness.peak_bytes(env)
            large = self.at_bytes is not None and variant.peak >= self.at_bytes
            long = self.first_work is not None and self.streams is not None \
                and self.liveness.largest_unfixed(env) >= self.streams
            if long:   # `stream` may block a cluster at these sizes; the work saved is at most the generic call's
                variant.work = self._work(variant.dims)
                long = variant.work >= self.first_work
            if (large or long) and (self.built < self.most or large):
                def worth(low) -> bool:
                    from tgc.explain import Liveness

                    variant.special_peak = Liveness(low).peak_bytes(env)
                    variant.special_work = None if variant.work is None else work_of(low, env)
                    variant.first_reason = first_call_specializes(
                        variant.peak, variant.special_peak, self.at_bytes, variant.work, variant.special_work,
                        self.first_work)
                    if self.built >= self.most and variant.first_reason != "memory":
                        variant.first_reason = None   # the table is full: only memory evicts
                    return variant.first_reason is not None

                self._specialize(variant, worth)
                variant.at_once = variant.program is not None
            return variant

    def _sizes(self, key: tuple) -> dict[str, int]:
        """The symbolic dims' sizes of a signature that a generic call bound: those the
        arguments carry, then those given by `dims=`."""
        sizes = {d: int(n) for d, n in zip(self.carried, key)}
        given = dict(key[len(self.carried)]) if len(key) > len(self.carried) else {}
        return {**sizes, **{str(d): int(n) for d, n in given.items() if d not in sizes}}

    def _due(self, variant: Variant) -> bool:
        if variant.program is not None or variant.refused is not None or variant.calls < self.calls \
                or self.built >= self.most:
            return False
        if variant.work is None:
            variant.work = self._work(variant.dims)
        return variant.calls * variant.work >= self.work

    def _work(self, dims: dict[str, int]) -> int:
        """The FLOPs plus bytes of one generic call at these sizes (`tgc explain`'s)."""
        return work_of(self.program.lowered, self.program.module.bind_dims(dims))

    def _specialize(self, variant: Variant, worth=None) -> None:
        """Build `variant`'s program (under the lock), or record why not. With `worth`,
        a test of the specialization's lowered program: when false, nothing is built
        and nothing refused (the signature may still be specialized by the calls' rule)."""
        start = time.perf_counter()
        try:
            program = self.build(dict(variant.dims)) if worth is None else self.build(dict(variant.dims), worth)
            if program is None:
                return
        except Exception as e:  # noqa: BLE001 -- the generic program serves the signature
            variant.refused = f"building it failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            return
        program.out_dtype = self.program.out_dtype   # --fp-strict's f64 emulation takes f32 arrays
        why = _differs(self.program, program)
        if why:
            variant.refused = why
            return
        variant.compile_seconds = time.perf_counter() - start
        if self.built >= self.most:   # a first call for memory past the bound (`_first_call`)
            self._evict(variant)
        variant.program = program
        variant.used = next(self.ticks)
        self.built += 1

    def _evict(self, keep: Variant) -> None:
        """Drop the least recently run specialization but `keep` (under the lock): its
        entry leaves the table, so nothing here refers to its program any more, and its
        code and workspace are freed once a call running it (which holds it) returns and
        no thread's `last_variant` names it (that thread's next call replaces it)."""
        loaded = [(v.used, k) for k, v in self.table.items() if v.program is not None and v is not keep]
        if loaded:
            _, key = min(loaded)
            table = dict(self.table)   # a new dict: calls read the table without the lock
            del table[key]
            self.table = table
            self.built -= 1

    def variants(self) -> list[Variant]:
        with self.lock:
            return [replace(v) for v in self.table.values()]

    def last(self) -> Variant | None:
        return getattr(self.local, "last", None)


def first_call_specializes(peak: int, special_peak: int, at_bytes: int | None, work: int | None = None,
                           special_work: int | None = None, first_work: int | None = None) -> str | None:
    """Why a first call runs the specialization, or None (it runs the generic program):
    "memory" when the generic program would hold at least `at_bytes` of temporaries at
    its sizes (`peak`) and the specialization at most half as much (`special_peak`;
    `Options.specialize_at_bytes`); "work" when one call of the specialization does at
    least `first_work` FLOPs plus bytes fewer than the generic call (`special_work`
    against `work`; `Options.specialize_first_work`), holding no more."""
    if at_bytes is not None and peak >= at_bytes and 2 * special_peak <= peak:
        return "memory"
    if first_work is not None and work is not None and special_work is not None \
            and work - special_work >= first_work and special_peak <= peak:
        return "work"
    return None


def work_of(low, env: dict[str, int]) -> int:
    """The FLOPs plus bytes of one call of the planned program `low` at the dims `env`
    (`tgc explain`'s count)."""
    from tgc.explain import explain

    report = explain(low, env)
    return int(report["flops"]) + int(report["bytes"])


def _carrier(program, dim: str) -> tuple[str, int] | None:
    """(argument name, axis) of the first argument with an edge of `dim`, or None: no
    argument carries it (a call gives it with `dims=`)."""
    m = program.module
    for spec in program.inputs:
        for axis, e in enumerate(spec.edges):
            if m.edges[e] == dim:
                return spec.name, axis
    return None


def _differs(generic, special) -> str | None:
    """Why `special` cannot stand in for `generic` in a call (it takes or gives other
    names, or stores other arguments or outputs in 2 bytes), or None."""
    for what in ("_names", "_store", "_low_outs", "_update_keys", "_complex_args", "_complex_results",
                 "float_dtype"):
        if getattr(generic, what) != getattr(special, what):
            return f"the specialized program's {what.strip('_').replace('_', ' ')} differ"
    if [s.name for s in generic.outputs] != [s.name for s in special.outputs]:
        return "the specialized program's outputs differ"
    return None
