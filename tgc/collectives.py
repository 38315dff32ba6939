"""The collectives a data-parallel step needs (allreduce, allgather, broadcast), over a
communicator of the ranks: an mpi4py communicator on numpy arrays (`MPIEngine`;
CPU and cuda-sim) or a CuPy NCCL communicator on device pointers (`NCCLEngine`;
cuda, cuda-sim). `engine_for` picks one by the communicator's methods.

A rank that dies or hangs: each MPI collective is nonblocking, polled until it completes
or `Options.collective_timeout` seconds pass; then DataParallelError, and the step runs
no more (a collective cannot be called off). NCCL's are not bounded (not built).
"""
from __future__ import annotations

import time

import numpy as np


class DataParallelError(RuntimeError):
    """The ranks cannot run steps together: they hold different programs, or a
    collective waited longer than `Options.collective_timeout` for the other ranks
    (one died or hangs), after which their collectives are out of step for good."""


class _Engine:
    """The collectives a step needs, on arrays of the programs' array module (`xp`).
    Each waits at most `timeout` seconds for the other ranks (None: forever) where the
    communicator has nonblocking collectives; then DataParallelError."""
    rank: int
    size: int
    xp = np
    timeout: float | None = None
    out_of_step: str | None = None   # why no collective can be called again (one timed out)
    other_threads = True   # a thread other than MPI_Init's may call them (one at a time)

    def allreduce(self, buf) -> None:
        """Sum `buf` over the ranks, in place (the same bits on every rank)."""
        raise NotImplementedError

    def allreduce_fixed(self, buf) -> None:
        """Sum `buf` over the ranks in rank order, in place: gathered, then added
        rank 0 first on every rank, whatever the library's algorithm."""
        got = self.allgather(buf)
        buf[...] = got[0]
        for r in range(1, self.size):
            buf += got[r]

    def allgather(self, buf):
        """Every rank's `buf`, in rank order: an array of shape (size, *buf.shape)."""
        raise NotImplementedError

    def broadcast(self, buf, root: int = 0) -> None:
        raise NotImplementedError

    def _timed_out(self, what: str) -> DataParallelError:
        """The error of a collective that waited `timeout` seconds: remembered in
        `out_of_step`, as the collective cannot be called off."""
        self.out_of_step = (f"data parallel: rank {self.rank} waited {self.timeout:g} s for the other ranks in "
                            f"{what} (Options.collective_timeout): a rank has died or hangs")
        return DataParallelError(self.out_of_step + ". The ranks' collectives are out of step; this communicator "
                                 "cannot be used for another step: end the job (comm.Abort())")


class MPIEngine(_Engine):
    """An mpi4py communicator (or one with its methods: Get_rank, Get_size, Allreduce,
    Allgather, Bcast, and Iallreduce, Iallgather, Ibcast for the timeout) on numpy
    arrays. With the nonblocking collectives, each is polled (`Request.Test`) until it
    completes or `timeout` passes; without them, each blocks until it completes."""
    kind = "mpi"

    def __init__(self, comm, timeout: float | None = None):
        self.comm, self.timeout = comm, timeout
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.nonblocking = all(hasattr(comm, m) for m in ("Iallreduce", "Iallgather", "Ibcast"))
        if type(comm).__module__.startswith("mpi4py"):   # MPI_THREAD_SERIALIZED at least (mpi4py asks MULTIPLE)
            from mpi4py import MPI

            self.other_threads = MPI.Query_thread() >= MPI.THREAD_SERIALIZED

    def _wait(self, request, what: str, *buffers) -> None:
        """Until `request` completes (each Test lets MPI progress it): polled at once
        for the first millisecond, then with pauses growing to 1 ms (which let other
        threads run); DataParallelError after `timeout` seconds. A request given up
        keeps its `buffers` for good: MPI may still write them."""
        if self.timeout is None:
            request.Wait()
            return
        start = time.monotonic()
        pause = 0.0
        while not request.Test():
            waited = time.monotonic() - start
            if waited > self.timeout:
                self.abandoned = (request, buffers)
                raise self._timed_out(what)
            if waited > 1e-3:
                pause = min(2 * pause or 1e-5, 1e-3)
                time.sleep(pause)

    def allreduce(self, buf) -> None:
        send = buf.copy()
        if self.nonblocking:
            self._wait(self.comm.Iallreduce(send, buf), f"an allreduce of {buf.size} values", send, buf)
        else:
            self.comm.Allreduce(send, buf)

    def allgather(self, buf):
        got = np.empty((self.size,) + buf.shape, buf.dtype)
        if self.nonblocking:
            self._wait(self.comm.Iallgather(buf, got), f"an allgather of {buf.size} values", buf, got)
        else:
            self.comm.Allgather(buf, got)
        return got

    def broadcast(self, buf, root: int = 0) -> None:
        if self.nonblocking:
            self._wait(self.comm.Ibcast(buf, root=root), f"a broadcast of {buf.size} values", buf)
        else:
            self.comm.Bcast(buf, root=root)


# NCCL's ABI constants (nccl.h): what cupy.cuda.nccl names NCCL_FLOAT32 ...
NCCL_TYPES = {np.dtype(np.float32): 7, np.dtype(np.float64): 8, np.dtype(np.int32): 2, np.dtype(np.uint8): 1}
NCCL_SUM = 0


class NCCLEngine(_Engine):
    """A CuPy NCCL communicator (`cupy.cuda.nccl.NcclCommunicator`: rank_id, size,
    allReduce, allGather, bcast on device pointers, queued on the current stream). On
    cuda-sim the arrays are numpy's and the pointers host addresses (a fake
    communicator from `local_group(n, "nccl")`). Its collectives are queued and
    waited for without a deadline: `timeout` does not bound them (ncclCommAbort on a
    deadline is not built)."""
    kind = "nccl"

    def __init__(self, comm, xp, timeout: float | None = None):
        self.comm, self.xp, self.timeout = comm, xp, timeout
        self.rank, self.size = comm.rank_id(), comm.size()

    def _ptr(self, a) -> int:
        return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr

    def _stream(self) -> int:
        if self.xp is np:
            return 0
        return self.xp.cuda.get_current_stream().ptr

    def allreduce(self, buf) -> None:
        self.comm.allReduce(self._ptr(buf), self._ptr(buf), buf.size, NCCL_TYPES[buf.dtype], NCCL_SUM, self._stream())

    def allgather(self, buf):
        got = self.xp.empty((self.size,) + buf.shape, buf.dtype)
        self.comm.allGather(self._ptr(buf), self._ptr(got), buf.size, NCCL_TYPES[buf.dtype], self._stream())
        return got

    def broadcast(self, buf, root: int = 0) -> None:
        self.comm.bcast(self._ptr(buf), buf.size, NCCL_TYPES[buf.dtype], root, self._stream())


def engine_for(comm, backend: str, timeout: float | None = None) -> _Engine:
    """The engine for `comm` on `backend`: mpi4py-like or NCCL-like (by its methods),
    its collectives waiting at most `timeout` seconds for the other ranks."""
    if hasattr(comm, "allReduce") and hasattr(comm, "rank_id"):
        if backend == "cpu":
            raise ValueError("data_parallel: a NCCL communicator needs backend 'cuda' (or 'cuda-sim'); "
                             "on the CPU pass an mpi4py communicator")
        xp = np
        if backend == "cuda":
            import cupy as xp   # noqa: F811 -- the device's arrays
        return NCCLEngine(comm, xp, timeout)
    if hasattr(comm, "Allreduce") and hasattr(comm, "Get_rank"):
        if backend == "cuda":
            raise ValueError("data_parallel: backend 'cuda' reduces with NCCL: pass a "
                             "cupy.cuda.nccl.NcclCommunicator, not an MPI communicator")
        return MPIEngine(comm, timeout)
    raise TypeError(f"data_parallel: {type(comm).__name__} is no communicator: pass an mpi4py communicator "
                    f"(Get_rank, Get_size, Allreduce, Allgather, Bcast) or a CuPy NCCL communicator")
