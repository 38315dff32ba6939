"""In-process ranks for tests and debugging: `local_group(n)` makes n communicators
between threads of this process, mpi4py-like (`LocalComm`) or NCCL-like on host
pointers (`LocalNcclComm`, the NCCL path on cuda-sim), and `run_ranks(n, fn)` runs
fn(comm) in one thread per rank. Their sums add the ranks in rank order.
"""
from __future__ import annotations

import threading

import numpy as np

from tgc.collectives import NCCL_SUM, NCCL_TYPES


class _Rendezvous:
    """n threads meeting at each collective. Each rank numbers its collectives in the
    order it calls them; the k-th collective is complete once every rank has posted
    its buffer for it, and is forgotten once every rank has read them all. `abort`
    (a rank that failed, in `run_ranks`) makes every wait raise BrokenBarrierError."""

    def __init__(self, n: int):
        self.n = n
        self.cond = threading.Condition()
        self.rounds: dict[int, list] = {}   # k -> [the buffers by rank, how many posted, how many read]
        self.broken = False

    def post(self, k: int, rank: int, value) -> None:
        with self.cond:
            r = self.rounds.setdefault(k, [[None] * self.n, 0, 0])
            r[0][rank] = value
            r[1] += 1
            self.cond.notify_all()

    def complete(self, k: int) -> bool:
        with self.cond:
            if self.broken:
                raise threading.BrokenBarrierError
            return self.rounds[k][1] == self.n

    def wait(self, k: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.broken or self.rounds[k][1] == self.n)

    def take(self, k: int) -> list:
        """Every rank's buffer of the complete collective k, in rank order."""
        with self.cond:
            r = self.rounds[k]
            r[2] += 1
            if r[2] == self.n:
                del self.rounds[k]
            return list(r[0])

    def abort(self) -> None:
        with self.cond:
            self.broken = True
            self.cond.notify_all()


class _LocalRequest:
    """A nonblocking collective of a `LocalComm` (mpi4py's Request: Test, Wait)."""

    def __init__(self, rv: _Rendezvous, k: int, finish):
        self._rv, self._k, self._finish, self._done = rv, k, finish, False

    def Test(self) -> bool:
        if not self._done and self._rv.complete(self._k):
            self._finish(self._rv.take(self._k))
            self._done = True
        return self._done

    def Wait(self) -> None:
        self._rv.wait(self._k)
        if not self.Test():
            raise threading.BrokenBarrierError


class _LocalRank:
    """One rank's end of a `_Rendezvous`: its collectives numbered in call order."""

    def __init__(self, rv: _Rendezvous, rank: int):
        self._rv, self._rank, self._calls = rv, rank, 0

    def _start(self, value, finish) -> _LocalRequest:
        k = self._calls
        self._calls += 1
        self._rv.post(k, self._rank, value)
        return _LocalRequest(self._rv, k, finish)

    def _exchange(self, value) -> list:
        got: list = []
        self._start(value, got.extend).Wait()
        return got


class LocalComm(_LocalRank):
    """An mpi4py-like communicator between threads of this process (`local_group`),
    with mpi4py's blocking and nonblocking collectives. Allreduce sums in rank order,
    so its results equal `allreduce_fixed`'s bit for bit."""

    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return self._rv.n

    def Iallreduce(self, send, recv) -> _LocalRequest:
        def finish(got):
            recv[...] = got[0]
            for g in got[1:]:
                np.add(recv, g, out=recv)
        return self._start(np.array(send, copy=True), finish)

    def Iallgather(self, send, recv) -> _LocalRequest:
        def finish(got):
            for r, g in enumerate(got):
                recv[r] = g
        return self._start(np.array(send, copy=True), finish)

    def Ibcast(self, buf, root: int = 0) -> _LocalRequest:
        def finish(got):
            buf[...] = got[root]
        return self._start(np.array(buf, copy=True), finish)

    def Allreduce(self, send, recv) -> None:
        self.Iallreduce(send, recv).Wait()

    def Allgather(self, send, recv) -> None:
        self.Iallgather(send, recv).Wait()

    def Bcast(self, buf, root: int = 0) -> None:
        self.Ibcast(buf, root).Wait()


_NCCL_NP = {v: k for k, v in NCCL_TYPES.items()}


class LocalNcclComm(_LocalRank):
    """A NCCL-like communicator (cupy.cuda.nccl.NcclCommunicator's methods) between
    threads of this process, on host pointers: the NCCL path on cuda-sim."""

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._rv.n

    @staticmethod
    def _view(ptr: int, count: int, datatype: int) -> np.ndarray:
        dt = _NCCL_NP[datatype]
        import ctypes

        return np.frombuffer((ctypes.c_char * (count * dt.itemsize)).from_address(ptr), dt)

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int) -> None:
        if op != NCCL_SUM:
            raise ValueError("LocalNcclComm: only ncclSum")
        got = self._exchange(self._view(sendbuf, count, datatype).copy())
        out = self._view(recvbuf, count, datatype)
        out[...] = got[0]
        for g in got[1:]:
            out += g

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:
        got = self._exchange(self._view(sendbuf, count, datatype).copy())
        self._view(recvbuf, count * self._rv.n, datatype)[...] = np.concatenate(got)

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        view = self._view(buff, count, datatype)
        got = self._exchange(view.copy())
        view[...] = got[root]


def local_group(n: int, kind: str = "mpi") -> list:
    """n communicators between threads of this process, one per rank: mpi4py-like
    (`kind="mpi"`) or NCCL-like (`"nccl"`, host pointers: for cuda-sim). Each rank's
    calls must run in a thread of its own (`run_ranks`)."""
    if n < 1:
        raise ValueError("local_group: n >= 1")
    rv = _Rendezvous(n)
    cls = {"mpi": LocalComm, "nccl": LocalNcclComm}[kind]
    return [cls(rv, r) for r in range(n)]


def run_ranks(n: int, fn, kind: str = "mpi", timeout: float = 600.0) -> list:
    """fn(comm) in n threads, one per rank of a `local_group`; their results in rank
    order. The first exception raised by any rank is raised again here."""
    comms = local_group(n, kind)
    results: list = [None] * n
    errors: list = []

    def body(r):
        try:
            results[r] = fn(comms[r])
        except BaseException as e:  # noqa: BLE001 -- reported to the caller
            errors.append(e)
            comms[r]._rv.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        raise first
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"run_ranks: a rank did not finish in {timeout} s")
    return results
