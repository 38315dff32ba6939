"""Data-parallel training steps: one `.tg` step, its batch split over N processes.

    from mpi4py import MPI
    step = tgc.compile("model.tg", data_parallel=MPI.COMM_WORLD)    # shard="batch"
    mine = step.shard_inputs({"x": x, "y": y})      # this rank's rows of a global batch
    result = step(**mine, **params, lr=0.1)         # params updated in place, equal on every rank

What it does (docs/distributed.md has the contract and the measurements):

- `split_step` (tgc/gradient_split.py) cuts the module, before the pass pipeline, at the gradient boundary:
  the *boundary* values are the derivatives (`grad`, `vjp`, `jvp`) that the updates
  read and that depend on the sharded data. Phase 1 (`Split.grads`) is the program
  without its updates, with every boundary value as an extra output; phase 2
  (`Split.apply`) is the updates alone, each boundary value replaced by an input of
  the same type. Both are ordinary modules, compiled by the ordinary pipeline. The cut
  is exact: phase 2 computes, from the same boundary values, what the updates computed
  (a value is never changed, only where it is materialized: the gradient becomes an
  array of the program's float type, which the fused program may have computed in
  another order or precision on its way into the update).
  It refuses (CompileError) an update that reads sharded data outside a derivative, or
  a boundary value that keeps the sharded edge: those cannot be averaged.
- `DataParallel` runs phase 1 on this rank's rows, packs the boundary values and the
  outputs without the sharded edge (the loss, metrics) into flat buffers (buckets),
  reduces them over the ranks, and runs phase 2 on the result on every rank. The
  reduction is a mean weighted by rows (the full-batch gradient of a mean loss; see
  docs/distributed.md), or a sum for outputs named in `sums`.
- Engines (tgc/collectives.py): an mpi4py communicator (CPU and cuda-sim, numpy buffers) or a CuPy NCCL
  communicator (`cupy.cuda.nccl.NcclCommunicator`; cuda, cuda-sim). `local_group(n)`
  (tgc/local_ranks.py) makes n in-process communicators of either kind (threads), for tests and debugging.

Overlap: the buckets are filled in the order in which phase 1's kernels finish their
values (`Program.ready_after`: the last layers' gradients first). With more than one
bucket and more than one rank on a host engine (MPI, or NCCL on cuda-sim), phase 1's
native call stops after the kernel that finishes a bucket (`Program.run`'s `notify`, a
ctypes callback) just long enough to copy the bucket's values into it and hand it to the
step's communication thread, which reduces the buckets in order, with the same
collective as the single-call path, while the kernels go on. So the sums are the same
calls on the same buffers: the results equal the single-call path's bit for bit
(tested), only the time differs. Otherwise (`overlap=False`, one bucket, one rank, a
GPU's NCCL, an MPI without MPI_THREAD_SERIALIZED) phase 1 is one call and the buckets
are reduced after it.

Every collective is called in the same order on every rank (the agreement, then the
first call's broadcast, then the buckets in their fixed order), by one thread at a time.
Before the first, each rank checks its call as the phases' programs would
(`Program.check`: names, dtypes, shapes, sizes, ids), and the ranks exchange one record
each (`_Record`, one allgather): whether the call is fine or why not, the rows, a
fingerprint of the compiled step, the sizes of the dims that are not split. A call that
is wrong on any rank, or steps that differ, raise on every rank before any data is sent
or any param written (the failing rank's own error; EvalError naming it elsewhere), so
the next call runs on every rank. The communication thread ends when its phase 1 does:
an exception on either side is raised by the step after both are done.

A rank that dies or hangs: each MPI collective is nonblocking, polled until it completes
or `Options.collective_timeout` seconds pass; then DataParallelError, and the step runs
no more (a collective cannot be called off). NCCL's are not bounded (not built).
"""
from __future__ import annotations

import queue
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np

from tgc.collectives import NCCL_TYPES, DataParallelError, MPIEngine, NCCLEngine, engine_for
from tgc.gradient_split import Split, sharded_dims, split_step
from tgc.ir.input_checks import check_writable
from tgc.ir.module import Module
from tgc.local_ranks import LocalComm, LocalNcclComm, local_group, run_ranks
from tgc.options import Options

__all__ = ["BUCKET_BYTES", "DataParallel", "DataParallelError", "LocalComm", "LocalNcclComm", "Split", "compile",
           "data_parallel_step", "engine_for", "local_group", "run_ranks", "sharded_dims", "split_step"]

BUCKET_BYTES = 1 << 22      # default bucket size: 4 MiB of gradients per allreduce


def _build_program(module: Module, options: Options, backend: str, key: str | None = None, reads=None):
    """One phase's program. With `key` (the source's first-level cache key and the
    phase), it is looked up in and stored to tgc's program cache where the backend
    keeps one (the CPU), as `tgc.compile` does for a whole program: a hit skips the
    pass pipeline. Not specialized to the sizes it is called with
    (tgc.runtime.specialize): each rank's time rule could switch at another step,
    and a product planned otherwise may round otherwise, so the replicas would drift."""
    from tgc import pipeline

    return pipeline.compile_cached(module, options.with_(specialize_calls=0), backend, key, reads)


def _phase_key(key: str | None, phase: str, shard: str) -> str | None:
    if key is None:
        return None
    import hashlib

    return hashlib.sha256(f"{key}\0data-parallel\0{phase}\0{shard}".encode()).hexdigest()


class DataParallel:
    """A training step whose batch is split over the ranks of a communicator.

    Made by `tgc.compile(source, data_parallel=comm)` (or `compile` here). Each rank
    calls it with its own rows of every input that has the split edge (`shard_inputs`
    cuts them from a global batch) and the same other arguments; the params and states
    are updated in place, to the same values on every rank. The first call broadcasts
    every param and state it is given from rank 0 (`broadcast` does it again).

    The result holds each output: averaged over the ranks (weighted by rows) when it
    has no split edge (a loss), or summed when it is named in `sums`; this rank's own
    rows when it has the split edge. Then each update's new value, as a plain call's.
    `run(..., updates=False)` is the forward-only call, on this rank alone.

    With `overlap` (default) and more than one bucket, each bucket is reduced while
    phase 1 goes on (see the module docstring); the results are the same bits.
    After a call: `last_times` (seconds of phase 1, of the reduction that phase 1 did
    not hide, of phase 2), `last_overlapped`, `last_early_buckets` (buckets reduced
    before phase 1 ended), `buckets`."""

    def __init__(self, module: Module, comm, options: Options, backend: str = "cpu", shard: str = "batch",
                 deterministic: bool = False, bucket_bytes: int = BUCKET_BYTES, sums=(), overlap: bool = True,
                 cache_key: str | None = None, reads=None):
        self.module, self.options, self.backend, self.shard = module, options, backend, shard
        self.split = split_step(module, shard)
        timeout = options.collective_timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ValueError(f"Options.collective_timeout: seconds (> 0) or None, not {timeout!r}")
        self.engine = engine_for(comm, backend, timeout)
        self.rank, self.size = self.engine.rank, self.engine.size
        self.deterministic = bool(deterministic)
        if bucket_bytes < 1:
            raise ValueError("bucket_bytes: at least 1")
        self.bucket_bytes = int(bucket_bytes)
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap= takes True or False, not {type(overlap).__name__}")
        self.overlap = overlap
        outs = {o.name for o in module.outputs}
        unknown = [s for s in sums if s not in outs]
        if unknown:
            raise ValueError(f"sums: the program has no output '{unknown[0]}'")
        self.sums = frozenset(sums)
        self._key, self._reads = cache_key, reads
        self.grads = _build_program(self.split.grads, options, backend, _phase_key(cache_key, "grads", shard), reads)
        self.apply = _build_program(self.split.apply, options, backend, _phase_key(cache_key, "apply", shard), reads)
        self._forward = None
        self._lock = threading.Lock()
        dims = sharded_dims(module, shard)
        sharded = {o.name for o in module.outputs if any(module.edges[e] in dims for e in o.order)}
        self.local_outputs = [o.name for o in module.outputs if o.name in sharded]
        # what crosses the ranks, in a fixed order: the boundary values, then the outputs to reduce
        self.reduced = list(self.split.boundary) + [o.name for o in module.outputs if o.name not in sharded]
        self._sharded_args = {n: a for n, a in module.args.items() if any(module.edges[e] in dims for e in a.order)}
        self._split_dims = dims
        # the arguments a call must give, and the params and states its first call broadcasts
        self._needed = set(self.grads._names) | (set(self.apply._names) - set(self.split.boundary))
        self._params = [n for n in sorted(self._needed) if module.args[n].kind in ("param", "state")]
        self._synced = False
        self._signature = None
        # seconds of the last call: phase 1 (gradients), the reduction (waits included), phase 2 (updates)
        self.last_times: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self._buckets: list[_Bucket] | None = None   # made on the first call, for its shapes
        self._ready = self.grads.ready_after()      # {phase 1 output: the kernel that finishes it}
        self._fingerprint = self._program_fingerprint()
        self._standins: dict = {}   # phase 1's sizes -> stand-ins for the boundary values in phase 2's check
        # the arguments a call gives, and the signatures of calls checked: (rows, dims, their sizes, targets)
        self._call_specs = [s for s in self.inputs if s.name in self._needed]
        self._calls: dict = {}
        self._broken: str | None = None   # why no further step can run (collectives out of step)
        self._worker: threading.Thread | None = None   # reduces the buckets while phase 1 runs
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # whether the last call overlapped its reduction with phase 1, and how many of its
        # buckets were reduced before phase 1 ended
        self.last_overlapped = False
        self.last_early_buckets = 0

    # ------------------------------------------------------------ description

    @property
    def inputs(self):
        """The arguments a call takes (the full program's; `TensorSpec`)."""
        return self._whole().inputs

    @property
    def outputs(self):
        """The program's outputs (`TensorSpec`)."""
        return self._whole().outputs

    @property
    def updates(self) -> list[str]:
        """The params and states a call updates in place (on every rank)."""
        return [u.target for u in self.module.updates]

    @property
    def float_dtype(self) -> str:
        """The float type callers pass and get (f32 or f64)."""
        return self.grads.float_dtype

    def init_state(self, dims: dict | None = None) -> dict:
        """Every state of the step, zero-filled, as `Program.init_state` gives them (the
        same on every rank)."""
        from tgc.ir.complex_io import complex_args
        from tgc.runtime.program import zero_states

        # each state's declared type (bf16, f16, the f32 parts of a c64 state of an f64
        # program), from the phase that takes it: phase 2 updates every state
        declared = {}
        for s in self.inputs:
            if s.kind == "state":
                phase = self.apply if s.name in self.apply.low_types or s.name not in self.grads.low_types else self.grads
                declared[s.name] = phase.declared_dtype(s)
        return zero_states(self.inputs, self.float_dtype, complex_args(self.module), declared, dims)

    def _whole(self) -> "_Signature":
        if self._signature is None:
            self._signature = _Signature(self.module, self.grads.float_dtype)
        return self._signature

    def __repr__(self) -> str:
        return (f"<tgc.distributed.DataParallel rank {self.rank} of {self.size} ({self.engine.kind}), "
                f"split over '{self.shard}': {len(self.split.boundary)} gradients>")

    # ------------------------------------------------------------ helpers for callers

    def shard_rows(self, n: int) -> slice:
        """This rank's rows of a global batch of `n` (contiguous, sizes differing by at most 1)."""
        lo = self.rank * n // self.size
        hi = (self.rank + 1) * n // self.size
        return slice(lo, hi)

    def shard_inputs(self, arrays: dict) -> dict:
        """`arrays` with every input that has the split edge cut to this rank's rows
        (along that edge's axis); the others as given."""
        out = dict(arrays)
        for name, a in self._sharded_args.items():
            if name not in out:
                continue
            x = out[name]
            axis = next(i for i, e in enumerate(a.order) if self.module.edges[e] == self.shard)
            n = np.shape(x)[axis]
            idx = [slice(None)] * np.ndim(x)
            idx[axis] = self.shard_rows(n)
            out[name] = x[tuple(idx)]
        return out

    def broadcast(self, arrays: dict) -> None:
        """Every param and state in `arrays` set, in place, to rank 0's values. Every
        rank must call it with the same names and shapes: the ranks check that they do
        (one small collective) before anything is sent; EvalError on every rank if not."""
        self._refuse_if_broken()
        names = [n for n in sorted(arrays) if n in self.module.args and self.module.args[n].kind in ("param", "state")]
        error = None
        try:
            _check_writable(arrays, names)
            what = ", ".join(f"{n}{tuple(np.shape(arrays[n]))}" for n in names)
        except Exception as e:  # noqa: BLE001 -- told to every rank, then raised
            error, what = e, ""
        self._agree(0, what, error, "broadcast different params or shapes")
        self._broadcast(arrays, names)

    def _broadcast(self, arrays: dict, names: list[str]) -> None:
        """`names` (params and states, shapes agreed) sent from rank 0, each through an
        array of the program's float type (the same bytes on every rank, whatever
        dtype each rank passed), written back where it is not the caller's own."""
        xp = self.engine.xp
        dt = np.float32 if self.float_dtype == "f32" else np.float64
        for name in names:
            x = arrays[name]
            buf = xp.ascontiguousarray(x, dtype=np.int32 if self.module.args[name].dtype == "i32" else dt)
            self.engine.broadcast(buf.reshape(-1))
            if buf is not x:
                x[...] = buf

    # ------------------------------------------------------------ the call

    def without_updates(self):
        """The forward-only program (no updates, no gradients), run on this rank alone."""
        with self._lock:
            if self._forward is None:
                self._forward = _build_program(self.split.forward, self.options, self.backend,
                                               _phase_key(self._key, "forward", self.shard), self._reads)
            return self._forward

    def __call__(self, /, **arrays) -> dict:
        """`step(x=..., W=..., lr=0.1)` is `step.run({...})`; `updates=False` makes the
        forward-only call on this rank alone."""
        updates = True
        if "updates" in arrays and "updates" not in self.module.args:
            updates = arrays.pop("updates")
        return self.run(arrays, updates=updates)

    def run(self, arrays: dict, dims: dict | None = None, updates: bool = True) -> dict:
        """One data-parallel step (see the class docstring); every rank must call it.

        Each rank checks its call (`_check_call`) before any communication, then the
        ranks exchange one small record each (`_agree`): whether the call is fine,
        the rows, the program's fingerprint and the dims. A call that is wrong on any
        rank raises on every rank (EvalError, naming the rank and why) before any
        data is sent or any param written, so the next call runs on every rank."""
        if not isinstance(updates, bool):
            raise TypeError(f"updates= takes True or False, not {type(updates).__name__}")
        if not updates:
            fwd = self.without_updates()
            return fwd.run({n: arrays[n] for n in fwd._names if n in arrays}, dims)
        self._refuse_if_broken()
        tc = time.perf_counter()
        error = rows = None
        try:
            rows, dims_text = self._check_call(arrays, dims)
        except Exception as e:  # noqa: BLE001 -- told to every rank, then raised
            error, dims_text = e, ""
        sizes, sync = self._agree(rows or 0, dims_text, error)
        try:
            return self._step(arrays, dims, sizes, sync, tc)
        except BaseException as e:
            # a rank that fails after the agreement leaves the others in a collective it
            # will not join (they time out): no step can run again on this communicator
            if self.engine.out_of_step is None:
                self._broken = f"data parallel: rank {self.rank} failed during a step ({type(e).__name__}: {e})"
            raise

    def _step(self, arrays: dict, dims: dict | None, sizes: list[int], sync: bool, tc: float) -> dict:
        """The step, once every rank has agreed to run it: the first call's broadcast,
        phase 1, the reduction, phase 2."""
        if sync:
            self._broadcast(arrays, self._params)
            self._synced = True
        g = self.grads
        total, equal = float(sum(sizes)), all(n == sizes[0] for n in sizes)
        rows = sizes[self.rank]
        t0 = time.perf_counter()
        scale = None if equal else rows / total
        args1 = {n: arrays[n] for n in g._names if n in arrays}
        self.last_overlapped = self._overlaps()
        self.last_early_buckets = 0
        if self.last_overlapped:
            first, t1 = self._overlapped(args1, dims, scale, equal)
        else:
            first = g.run(args1, dims)
            t1 = time.perf_counter()
            self._reduce_after(first, scale, equal, set())
        reduced = self._views(first)
        t2 = max(time.perf_counter(), t1)
        a = self.apply
        second = a.run({n: reduced[n] if n in reduced else arrays[n] for n in a._names}, self._dims2(dims))
        self.last_times = (t1 - t0, (t0 - tc) + (t2 - t1), time.perf_counter() - t2)
        # reduced outputs are views of the buckets, which the next call overwrites: copies
        result = {o.name: reduced[o.name].copy() if o.name in reduced else first[o.name] for o in self.module.outputs}
        for u in self.module.updates:
            result[self.module.update_key(u.target)] = second[u.target]
        return result

    def _dims2(self, dims: dict | None) -> dict | None:
        """`dims` without the split ones (phase 2 has none of them)."""
        return {d: n for d, n in dims.items() if d in self.split.apply.dims} if dims else None

    def _refuse_if_broken(self) -> None:
        why = self._broken or self.engine.out_of_step
        if why is not None:
            raise DataParallelError(why + "; the ranks' collectives are out of step: this step cannot run again, "
                                    "end the job (comm.Abort())")

    # ------------------------------------------------------------ checking and agreeing

    def _check_call(self, arrays: dict, dims: dict | None) -> tuple[int, str]:
        """This rank's call checked as both phases' programs check theirs, without
        running anything (`Program.check`; phase 2 with stand-ins of the boundary
        values' shapes): (this rank's rows, the sizes of the dims that are not split, as
        text: every rank must bind the same). EvalError or TypeError says what is wrong."""
        from tgc.ir.input_checks import check_known, check_names
        from tgc.ir.sizes import size_eval
        from tgc.runtime.program import call_key

        if not isinstance(arrays, dict):
            raise TypeError(f"a data-parallel step takes a dict of arrays, not {type(arrays).__name__}")
        # a call with the signature of one checked before (the same names, shapes, dtypes,
        # layouts and update targets): only what depends on the values is checked again
        key = (call_key(self._call_specs, arrays, dims) if len(arrays) == len(self._call_specs)
               and not self.options.check_assumptions else None)
        hit = self._calls.get(key) if key is not None else None
        if hit is not None and all(r() is not None for r in hit[4]):
            rows, text, env1, env2, _ = hit
            self.grads.check_ids(arrays, env1)
            self.apply.check_ids(arrays, env2)
            if not self._synced:
                _check_writable(arrays, self._params)
            return rows, text
        check_known(list(self.module.args), arrays)
        check_names(list(self.module.args), arrays, required=self._needed)
        if dims is not None and not isinstance(dims, dict):
            raise TypeError(f"dims= takes a dict of sizes, not {type(dims).__name__}")
        if not self._synced:
            _check_writable(arrays, self._params)
        env1 = self.grads.check({n: arrays[n] for n in self.grads._names}, dims)
        key1 = tuple(env1.items())
        standins = self._standins.get(key1)
        if standins is None:   # once per sizes: arrays of the boundary values' shapes
            specs = {s.name: s for s in self.grads.outputs}
            dt = np.float32 if self.float_dtype == "f32" else np.float64
            standins = {n: np.empty(tuple(size_eval(x, env1) for x in specs[n].shape), dt) for n in self.split.boundary}
            if len(self._standins) >= 64:
                self._standins.clear()
            self._standins[key1] = standins
        env2 = self.apply.check({n: standins[n] if n in standins else arrays[n] for n in self.apply._names},
                                self._dims2(dims))
        rows = int(env1[self.shard] if self.shard in env1 else self._rows(arrays, dims))
        fixed = {**{d: n for d, n in env1.items() if d not in self._split_dims}, **env2}
        text = ", ".join(f"{d}={n}" for d, n in sorted(fixed.items()))
        if key is not None:
            if len(self._calls) >= 64:
                self._calls.clear()
            self._calls[key] = (rows, text, env1, env2, [weakref.ref(arrays[n]) for n in self.updates])
        return rows, text

    def _program_fingerprint(self) -> bytes:
        """What every rank's step must share for their collectives to match: both
        phases' modules, the float type, the split dim, the reduced values in their
        bucket order, the bucket size, the sums, `deterministic`, the number of ranks
        and the params the first call broadcasts. (The optimizations and the backend
        may differ: they change no buffer.)"""
        import hashlib

        from tgc.ir.printer import print_module

        end = len(self.grads.lowered.kernels) - 1
        order = sorted(self.reduced, key=lambda n: (self._ready.get(n, end), self.reduced.index(n)))
        h = hashlib.sha256()
        for part in (print_module(self.split.grads), print_module(self.split.apply), self.float_dtype, self.shard,
                     repr(order), str(self.bucket_bytes), repr(sorted(self.sums)), str(self.deterministic),
                     str(self.size), repr(self._params)):
            h.update(part.encode("utf-8", "surrogatepass"))
            h.update(b"\0")
        return h.digest()[:16]

    def _agree(self, rows: int, what: str, error: BaseException | None,
               differ: str = "bind different sizes to the dims that are not split") -> tuple[list[int], bool]:
        """One allgather of every rank's record (`_Record`): whether its call is fine
        (else why not), its rows, whether it must still broadcast the params, the
        program's fingerprint and `what` (the dims' sizes). Raises on every rank,
        before any other collective, when a rank's call is wrong (its own error there,
        EvalError naming it elsewhere), when the programs differ (DataParallelError)
        or when the ranks' `what` differ (EvalError: the ranks `differ`). Else (each rank's rows, whether
        to broadcast the params now: when any rank has not yet)."""
        from tgc.ir.interp import EvalError

        why = "" if error is None else (str(error) if isinstance(error, EvalError) else
                                        f"{type(error).__name__}: {error}")
        mine = _Record(error is None, rows, not self._synced, self._fingerprint, what if error is None else why)
        got = self.engine.allgather(self.engine.xp.asarray(mine.pack())) if self.size > 1 else mine.pack()[None]
        records = [_Record.unpack(bytes(np.asarray(g.get() if hasattr(g, "get") else g))) for g in got]
        failed = [r for r, rec in enumerate(records) if not rec.ok]
        if failed:
            if error is not None:
                raise error
            r = failed[0]
            more = f" (and {', '.join(f'rank {q}' for q in failed[1:])})" if failed[1:] else ""
            raise EvalError(f"data parallel: rank {r}{more} cannot run this step: {records[r].text}; "
                            f"no rank ran it, no param was written")
        for r, rec in enumerate(records):
            if rec.fingerprint != records[0].fingerprint:
                raise DataParallelError(
                    f"data parallel: rank {r} compiled another step than rank 0 (its program, float type, split "
                    f"dim, bucket_bytes, sums, deterministic or number of ranks differ): every rank must compile "
                    f"the same; no rank ran this step")
        for r, rec in enumerate(records):
            if rec.text != records[0].text:
                raise EvalError(f"data parallel: the ranks {differ}: rank 0 {records[0].text or 'none'}, "
                                f"rank {r} {rec.text or 'none'}; no rank sent or wrote anything")
        return [rec.rows for rec in records], any(rec.sync for rec in records)

    def _rows(self, arrays: dict, dims: dict | None) -> int:
        if dims and self.shard in dims:
            return int(dims[self.shard])
        for name, a in self._sharded_args.items():
            if name in arrays:
                axis = next((i for i, e in enumerate(a.order) if self.module.edges[e] == self.shard), None)
                if axis is not None:
                    return int(np.shape(arrays[name])[axis])
        from tgc.ir.interp import EvalError

        raise EvalError(f"no input gives the size of dim '{self.shard}': pass dims={{'{self.shard}': n}}")

    # ------------------------------------------------------------ the reduction
    #
    # Both paths reduce the same buckets with the same calls, in the same order: pack
    # (`_pack`: a copy, scaled by rows / total for unequal shards), the collective and
    # the division by the size (`_finish`). Only when `_pack` runs differs.

    def _overlaps(self) -> bool:
        """Whether this call reduces while phase 1 runs: asked for, buckets planned
        (the first call plans them), more than one, more than one rank, an engine
        whose collectives the host runs (not a GPU's stream) and that another thread
        may call, kernels that notify."""
        host = isinstance(self.engine, MPIEngine) or getattr(self.engine, "xp", None) is np
        return (self.overlap and self.size > 1 and self._buckets is not None and len(self._buckets) > 1
                and host and self.engine.other_threads and self.grads._kernels.notifies)

    def _pack(self, bucket: "_Bucket", first: dict, scale: float | None) -> None:
        pos = 0
        for n in bucket.names:
            x = first[n]
            view = bucket.buf[pos:pos + x.size]
            if scale is not None and n not in self.sums:
                view[...] = x.reshape(-1) * scale
            else:
                view[...] = x.reshape(-1)
            pos += x.size

    def _finish(self, bucket: "_Bucket", equal: bool) -> None:
        """The bucket summed over the ranks, then divided by their number (equal shards)."""
        buf = bucket.buf
        if self.size > 1:
            (self.engine.allreduce_fixed if self.deterministic else self.engine.allreduce)(buf)
            if equal:
                pos = 0
                for n, size in zip(bucket.names, bucket.sizes):
                    if n not in self.sums:
                        buf[pos:pos + size] /= self.size
                    pos += size

    def _reduce_after(self, first: dict, scale: float | None, equal: bool, done: set) -> None:
        """Every bucket not in `done`, in order, from phase 1's finished outputs."""
        if self._buckets is None or any(first[n].shape != shape for n, shape, _ in self._layout):
            self._plan_buckets(first)
            done = set()
        for i, bucket in enumerate(self._buckets):
            if i not in done:
                self._pack(bucket, first, scale)
                self._finish(bucket, equal)

    def _views(self, first: dict) -> dict:
        """The reduced values, as views of the buckets (shaped as phase 1's outputs)."""
        out = {}
        for bucket in self._buckets:
            pos = 0
            for n, size in zip(bucket.names, bucket.sizes):
                out[n] = bucket.buf[pos:pos + size].reshape(first[n].shape)
                pos += size
        return out

    def _overlapped(self, args1: dict, dims, scale: float | None, equal: bool) -> tuple[dict, float]:
        """Phase 1 on this thread, told (`notify`) after each kernel that fills a
        bucket: it packs the bucket and hands it to the step's communication thread,
        which reduces the buckets in order while the kernels go on. (phase 1's
        outputs, when phase 1 ended)."""
        buckets = self._buckets
        at: dict[int, list[int]] = {}
        for i, bucket in enumerate(buckets):
            at.setdefault(bucket.ready, []).append(i)
        layout = {n: shape for n, shape, _ in self._layout}
        handed: queue.SimpleQueue = queue.SimpleQueue()     # bucket indices, in order; then None
        finished: queue.SimpleQueue = queue.SimpleQueue()   # what the communication thread did
        fits: list[bool] = []

        def ready(kernel: int, outs: dict) -> None:   # the native call waits meanwhile
            if not fits:   # the first time: do these shapes fit the buckets? (else: after phase 1)
                fits.append(all(outs[n].shape == shape for n, shape in layout.items()))
            if fits[0]:
                for i in at[kernel]:
                    self._pack(buckets[i], outs, scale)
                    handed.put(i)

        ends: list[float] = []

        def reduce_handed() -> None:   # on the communication thread
            done: set[int] = set()
            try:
                while (i := handed.get()) is not None:
                    self._finish(buckets[i], equal)
                    ends.append(time.perf_counter())
                    done.add(i)
                finished.put(("done", done))
            except BaseException as e:  # noqa: BLE001 -- raised on the step's thread
                finished.put(("error", e))
        self._start_worker()
        self._jobs.put(reduce_handed)
        try:
            first = self.grads.run(args1, dims, notify=(list(at), ready))
            t1 = time.perf_counter()
        finally:
            handed.put(None)
            how, what = finished.get()
        if how == "error":
            raise what
        self.last_early_buckets = sum(1 for t in ends if t < t1)
        self._reduce_after(first, scale, equal, what)   # none left, unless the shapes changed
        return first, t1

    def _start_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            jobs = self._jobs
            self._worker = threading.Thread(target=_work, args=(jobs,), daemon=True, name="tgc-allreduce")
            self._worker.start()
            weakref.finalize(self, jobs.put, None)   # the thread ends with the step

    def _plan_buckets(self, first: dict) -> None:
        """Flat buffers of at most `bucket_bytes` each (a larger value alone), per dtype,
        the reduced values in the order phase 1 finishes them (`ready_after`; ties in
        `reduced`'s order): the last layers' gradients first."""
        xp = self.engine.xp if isinstance(self.engine, NCCLEngine) else np
        end = len(self.grads.lowered.kernels) - 1
        order = sorted(self.reduced, key=lambda n: (self._ready.get(n, end), self.reduced.index(n)))
        self._layout = [(n, first[n].shape, first[n].dtype) for n in order]
        buckets, cur, cur_bytes, cur_dt = [], [], 0, None
        for n, shape, dt in self._layout:
            if dt.kind != "f" or dt not in NCCL_TYPES:
                raise TypeError(f"data parallel reduces f32/f64 values; '{n}' is {dt}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            if cur and (dt != cur_dt or cur_bytes + nbytes > self.bucket_bytes):
                buckets.append((cur, cur_dt))
                cur, cur_bytes = [], 0
            cur.append(n)
            cur_bytes += nbytes
            cur_dt = dt
        if cur:
            buckets.append((cur, cur_dt))
        sizes = {n: int(np.prod(shape, dtype=np.int64)) for n, shape, _ in self._layout}
        self._buckets = [_Bucket(names, [sizes[n] for n in names], xp.empty(sum(sizes[n] for n in names), dt),
                                 max(self._ready.get(n, end) for n in names)) for names, dt in buckets]

    @property
    def buckets(self) -> list[tuple[list[str], int, int]]:
        """The buckets (after the first call), in the order they are reduced: (the
        values in it, its bytes, the phase 1 kernel after which it is full)."""
        return [(list(b.names), int(b.buf.nbytes), b.ready) for b in (self._buckets or [])]

    @property
    def gradient_bytes(self) -> int:
        """Bytes reduced per step (after the first call)."""
        return sum(int(b.buf.nbytes) for b in (self._buckets or []))


def _check_writable(arrays: dict, names) -> None:
    """Each of `names` is an array this rank may write (a broadcast sets it in place):
    a GPU array, or a numpy array that passes the check of every array tgc writes
    into (`input_checks.check_writable`: EvalError for a read-only array or one whose
    elements share memory); anything else is a TypeError. Checked before the ranks agree, as a write
    that fails half-way through the broadcasts would leave them out of step."""
    for name in names:
        x = arrays[name]
        if isinstance(x, np.ndarray):
            check_writable(name, x, "is set to rank 0's value in place (a broadcast)")
        elif not hasattr(x, "__cuda_array_interface__"):
            raise TypeError(f"'{name}' must be a writable array: the broadcast sets it to rank 0's value in place, "
                            f"not {type(x).__name__}")


RECORD_BYTES = 256   # one rank's record in the agreement before each step


@dataclass
class _Record:
    """What a rank tells the others before each step (`DataParallel._agree`), packed
    into RECORD_BYTES bytes: 1 + 1 + 8 + 16 bytes, the text's length (2), then the
    text in UTF-8 (the dims' sizes, or why the call is wrong), cut to fit."""
    ok: bool
    rows: int
    sync: bool
    fingerprint: bytes
    text: str

    def pack(self) -> np.ndarray:
        import struct

        head = struct.pack("<??q16s", self.ok, self.sync, self.rows, self.fingerprint)
        room = RECORD_BYTES - len(head) - 2
        text = self.text.encode("utf-8", "replace")
        if len(text) > room:
            text = text[:room - 3].decode("utf-8", "ignore").encode() + b"..."
        body = head + struct.pack("<H", len(text)) + text
        return np.frombuffer(body.ljust(RECORD_BYTES, b"\0"), np.uint8).copy()

    @staticmethod
    def unpack(data: bytes) -> "_Record":
        import struct

        ok, sync, rows, fp = struct.unpack_from("<??q16s", data)
        n, = struct.unpack_from("<H", data, 26)
        return _Record(ok, rows, sync, fp, data[28:28 + n].decode("utf-8", "replace"))


@dataclass
class _Bucket:
    """One flat buffer of reduced values."""
    names: list[str]
    sizes: list[int]       # elements of each value
    buf: object            # the flat buffer (numpy, or CuPy's on a GPU)
    ready: int             # phase 1's kernel after which every value in it is final


def _work(jobs: queue.SimpleQueue) -> None:
    """A DataParallel's communication thread: runs each job it is given; None ends it."""
    while True:
        job = jobs.get()
        if job is None:
            return
        job()
        del job   # a finished job's closure must not keep its step alive (the step ends the thread)


class _Signature:
    """The argument and output specs of the whole program (without compiling it)."""

    def __init__(self, module: Module, dtype: str):
        from tgc.runtime.program import TensorSpec

        targets = {u.target for u in module.updates}
        self.inputs = [TensorSpec(a.name, a.kind, a.order, tuple(module.size(e) for e in a.order),
                                  "i32" if a.dtype == "i32" else dtype, a.name in targets)
                       for a in module.args.values()]
        self.outputs = [TensorSpec(o.name, "output", o.order, tuple(module.size(e) for e in o.order), dtype)
                        for o in module.outputs]


def compile(source, comm, backend: str = "cpu", dtype: str | None = None, dims=None, options=None,
            shard: str = "batch", deterministic: bool = False, bucket_bytes: int = BUCKET_BYTES, sums=(),
            overlap: bool = True):
    """`tgc.compile(source, ..., data_parallel=comm)`: a `DataParallel` step."""
    return data_parallel_step(source, comm, backend, dtype, dims, options, shard=shard, deterministic=deterministic,
                              bucket_bytes=bucket_bytes, sums=sums, overlap=overlap)


def data_parallel_step(source, comm, backend: str = "cpu", dtype: str | None = None, dims=None, options=None,
                       **keywords) -> "DataParallel":
    """The `DataParallel` step of anything `tgc.compile` takes (the arguments as its;
    `keywords` are DataParallel's): the source loaded with its dims fixed by the
    pipeline (`tgc.pipeline.load_source`), split here at the gradient boundary, and
    each phase compiled by the pipeline (`_build_program`)."""
    from tgc import pipeline

    src = pipeline.load_source(source, backend, dtype, dims, options, lookup=False)
    return DataParallel(src.module, comm, src.options, backend, **keywords, cache_key=src.key, reads=src.reads)
