"""Running an outlined loop body on all cores through libgomp.

Generated code outlines a parallel loop into ``void body(ptr data)``; inside, the
body asks ``thread_range`` for its share [lo, hi) of the iteration space and runs
it. The caller emits ``parallel_for``: when the trip count reaches a threshold it
calls ``GOMP_parallel(body, data, 0, 0)`` (0 threads = libgomp's default, one per
core), otherwise it calls ``body(data)`` directly, where
``omp_get_num_threads() == 1`` makes the share the whole range. All libgomp
entries are reached through the runtime function table (``fntable.py``), so the
generated code links nothing.

Why a threshold: a parallel region costs 1-3 us when the workers are still spinning
from the previous region, ~80 us when they sleep (futex wake-up on this VM), and up to
milliseconds when another process holds a core; small loops stay serial.

Waiting: libgomp reads ``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` once, when it is
loaded. If this process has not loaded libgomp yet, ``gomp_addresses`` sets them
(where the environment does not already) before loading it. The default, a bounded
spin of 10,000 iterations and no policy, measured best on a 2-core machine (median
us, f32 exp over n elements, serial -> parallel):
    idle                 n=1e4        n=1e5         n=1e7
    passive              3.2 -> 87    30 -> 106     6755 -> 3746
    GOMP_SPINCOUNT=1e4   3.5 -> 2.7   32 -> 17      6548 -> 3027
    libgomp default      3.4 -> 2.7   32 -> 17      6529 -> 2814
    other core busy
    passive              3.5 -> 8.2   32 -> 37      6085 -> 6912
    GOMP_SPINCOUNT=1e4   3.5 -> 3.0   32 -> 17      6596 -> 6219
    libgomp default      3.5 -> 2.7   30 -> 16      5914 -> 7148
(libgomp's default spins 300,000 iterations, which PLATFORM.md saw cost 8 ms per
region under contention; ``OMP_WAIT_POLICY=active`` cost 0.5 ms here.)
"""

import ctypes
import functools
import os

import llvmlite.ir as ir

from tgc.backends.cpu import fntable

LIBGOMP = 'libgomp.so.1'
# table field -> libgomp symbol
SYMBOLS = {'gomp_parallel': 'GOMP_parallel', 'omp_get_thread_num': 'omp_get_thread_num',
           'omp_get_num_threads': 'omp_get_num_threads', 'omp_get_max_threads': 'omp_get_max_threads'}


def _gomp_loaded() -> bool:
    try:
        with open('/proc/self/maps') as f:
            return any('libgomp' in line for line in f)
    except OSError:
        return False


@functools.cache
def _library(spin_count: int | None, wait_policy: str | None) -> ctypes.CDLL:
    """libgomp, loaded with our wait settings where the environment has none. The
    environment is restored at once: another OpenMP runtime loaded later (torch bundles
    its own libgomp) must not read our settings (a short spin made torch's small ops
    ~15x slower, waking its sleeping threads for every op)."""
    if _gomp_loaded():
        return ctypes.CDLL(LIBGOMP)
    wanted = {'GOMP_SPINCOUNT': None if spin_count is None else str(spin_count), 'OMP_WAIT_POLICY': wait_policy}
    added = [k for k, v in wanted.items() if v is not None and k not in os.environ]
    for k in added:
        os.environ[k] = wanted[k]
    try:
        return ctypes.CDLL(LIBGOMP)
    finally:
        for k in added:
            del os.environ[k]


def gomp_addresses(spin_count: int | None = 10_000,
                   wait_policy: str | None = None) -> dict[str, int]:
    """Table fields -> addresses of GOMP_parallel, omp_get_thread_num/num_threads.
    The wait settings apply only if libgomp is not loaded yet (see above)."""
    lib = _library(spin_count, wait_policy)
    return {field: ctypes.cast(getattr(lib, sym), ctypes.c_void_p).value
            for field, sym in SYMBOLS.items()}


def body_type() -> ir.FunctionType:
    """The outlined body: ``void (ptr data)``."""
    return ir.FunctionType(ir.VoidType(), [ir.PointerType()])


def thread_range(builder: ir.IRBuilder, n):
    """Inside a body: (lo, hi), this thread's contiguous share of [0, n) (i64)."""
    i64 = ir.IntType(64)
    tid = builder.sext(fntable.call(builder, 'omp_get_thread_num', []), i64)
    nth = builder.sext(fntable.call(builder, 'omp_get_num_threads', []), i64)
    chunk = builder.sdiv(builder.add(n, builder.sub(nth, i64(1))), nth)
    lo = builder.mul(tid, chunk)
    lo = builder.select(builder.icmp_signed('<', lo, n), lo, n)
    hi = builder.add(lo, chunk)
    hi = builder.select(builder.icmp_signed('<', hi, n), hi, n)
    return lo, hi


def parallel_for(builder: ir.IRBuilder, body: ir.Function, data, n, threshold: int,
                 num_threads: int = 0) -> None:
    """Run ``body(data)`` on all cores when ``n >= threshold``, else inline-serially."""
    i32, i64 = ir.IntType(32), ir.IntType(64)
    big = builder.icmp_signed('>=', n, i64(threshold))
    with builder.if_else(big) as (then, otherwise):
        with then:
            fntable.call(builder, 'gomp_parallel', [body, data, i32(num_threads), i32(0)])
        with otherwise:
            builder.call(body, [data])
