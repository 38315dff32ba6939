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
region under contention; ``OMP_WAIT_POLICY=active`` cost 0.5 ms here.) A process that
loaded libgomp before tgc (``import torch`` first: its wheel ships ``libgomp.so.1``)
keeps that library's settings; ``GOMP_SPINCOUNT=10000`` in the environment then gives
the same bounded spin.

Contention: a region waits for every thread of its team, and a worker whose core
another process holds starts only when the scheduler gives it a time slice, milliseconds
later. So every region is timed (`region_fn`): its overhead is its time less the
calling thread's own share of the work, and what exceeds the cost expected of a
region (`CpuOptions.cold_region_cycles` when the workers had gone to sleep) is the
region's *excess*. The lag follows the least excess of the last
`contention_confirm_regions` (2) regions (`_confirmed`): it is set only when
consecutive regions confirm it, so one outlying region on a quiet machine (a worker
preempted once) sets none (held many times itself, such a lag would keep every kernel
under twice it on one thread for that long). Until
`CpuOptions.contention_memory_cycles` have passed (or `HOLD` times the lag, if
longer), a kernel runs in a region only if its serial time is at least
twice the lag: threads save at most half of it on two cores (`threshold_fn`; serial
time from the kernel's work at `loop_work_per_cycle`, or a GEMM's flops at
`gemm_flops_per_cycle`). On a loaded machine the lag is milliseconds and a step runs
serially but for the process's first two regions and, once the hold has run out,
one region now and then that measures the lag again (the excesses are kept across
the hold, so the region before it confirms the new one). `HOLD` starts at 1 and
doubles each time that region finds the cores still taken, up to
`contention_memory_lags` (50: those regions then cost ~2% of the time); a region that
finds them free clears the lag and sets it back to 1 (`_next_hold`). So the serial
tail after an outburst of load is about as long as the outburst or the memory's 0.1 s,
not 50 lags (a 300 ms outburst that blocked a worker's core: 0.1 s against more than
2.9 s; benchmarks/outburst.py).
"""

import ctypes
import functools
import os

import llvmlite.ir as ir

from tgc.backends.cpu import fntable
from tgc.backends.cpu.irutil import I32, I64, PTR, define, export, optimize_not

LIBGOMP = 'libgomp.so.1'
# table field -> libgomp symbol
SYMBOLS = {'gomp_parallel': 'GOMP_parallel', 'omp_get_thread_num': 'omp_get_thread_num',
           'omp_get_num_threads': 'omp_get_num_threads', 'omp_get_max_threads': 'omp_get_max_threads',
           'gomp_barrier': 'GOMP_barrier'}


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


# ------------------------------------------------------------ regions, timed
#
# The state lives in the program's first unit (`home`): the time-stamp counter at the
# end of the last region (`REGION_END`, for the warm threshold), the lag and when it
# was measured, and the excesses of the last regions (`EXCESS`). Racing calls only
# blur a heuristic. A counter that reads 0 (a target without one) is never warm and
# measures no lag.

REGION_END, LAG, LAG_AT = "tgc.region_end", "tgc.region_lag", "tgc.region_lag_at"
HOLD = "tgc.region_lag_hold"   # how many times itself the lag is held (`_next_hold`)
EXCESS = "tgc.region_excess"   # + ".i": the excess of the i-th last region (i = 1 .. contention_confirm_regions - 1)
WAITED = "tgc.region_waited"   # cycles the calling thread has waited at barriers (`barrier_fn`)
BUSY = "tgc.region_busy"       # + ".0", ".1", ".region": with `CpuOptions.profile`, the CPU time (ns) thread 0
#                                and the other threads spent in regions' bodies, and thread 0's in the regions
#                                from start to end (`busy_counters`)
CLOCK, CLOCK_SETTER, THREAD_NS = "tgc.thread_clock", "tgc_profile_clock", "tgc.thread_ns"
CLOCK_THREAD_CPUTIME_ID = 3    # Linux's
REGION, REGION_RUN, THRESHOLD, BARRIER = "tgc.region", "tgc.region.run", "tgc.threshold", "tgc.barrier"


def _state(home: ir.Module, name: str) -> ir.GlobalVariable:
    g = home.globals.get(name)
    if g is None:
        g = ir.GlobalVariable(home, I64, name)
        g.linkage = "internal"
        g.initializer = I64(0)
    return g


def now(b: ir.IRBuilder):
    """i64: the time-stamp counter."""
    fn = b.module.globals.get("llvm.readcyclecounter") or ir.Function(
        b.module, ir.FunctionType(I64, []), "llvm.readcyclecounter")
    return b.call(fn, [])


def _smax(b: ir.IRBuilder, x, y):
    return b.select(b.icmp_signed(">", x, y), x, y)


def _lags_held(b: ir.IRBuilder, home: ir.Module):
    """i64: how many times itself the lag is held now (`HOLD`; at least 1)."""
    return _smax(b, b.load_atomic(_state(home, HOLD), "monotonic", 8, typ=I64), I64(1))


def _held_lag(b: ir.IRBuilder, home: ir.Module, cpu, t):
    """(i1 held, i64 lag) at time `t`: a lag is held `contention_memory_cycles`, or
    `HOLD` times itself if longer (1, doubling up to `contention_memory_lags` while the
    regions that measure it again confirm it: `_next_hold`)."""
    at = b.load_atomic(_state(home, LAG_AT), "monotonic", 8, typ=I64)
    lag = b.load_atomic(_state(home, LAG), "monotonic", 8, typ=I64)
    times = _lags_held(b, home) if cpu.contention_memory_lags > 0 else I64(0)
    hold = _smax(b, I64(cpu.contention_memory_cycles), b.mul(lag, times))
    return b.icmp_unsigned("<", b.sub(t, at), hold), lag


def _next_hold(b: ir.IRBuilder, home: ir.Module, cpu, held, new):
    """Store the next `HOLD` after a region that set the lag `new`; `held`: whether the
    lag was still held when the region began. A region that begins after the hold ran
    out measures the lag again: if the lag is one that `contention_memory_lags` times
    itself would hold beyond `contention_memory_cycles` (the cores are still taken), it
    is held twice as many times itself as before, up to `contention_memory_lags`;
    otherwise once (the memory's floor holds it). So a lag that outlasts its holds is
    measured again after 1, 2, 4 ... lags, and then every `contention_memory_lags`
    (those regions cost ~2% of the time), while the serial tail that a short outburst
    of load leaves is about as long as the outburst, not 50 lags after it."""
    if cpu.contention_memory_lags <= 0:   # only the memory's floor holds a lag
        return
    most = cpu.contention_memory_lags
    m = _lags_held(b, home)
    grown = b.mul(m, I64(2))
    grown = b.select(b.icmp_signed(">", grown, I64(most)), I64(most), grown)
    lasting = b.icmp_unsigned(">=", b.mul(new, I64(most)), I64(cpu.contention_memory_cycles))
    m = b.select(held, m, b.select(lasting, grown, I64(1)))
    b.store_atomic(m, _state(home, HOLD), "monotonic", 8)


def _confirmed(b: ir.IRBuilder, home: ir.Module, cpu, excess):
    """i64: the least excess of the last `contention_confirm_regions` regions, this
    one's (`excess`) among them: the lag follows it, so one outlying region (a worker
    preempted once) does not set it. The earlier regions'
    excesses live in `EXCESS.1` (the last) .. `EXCESS.(n-1)` and move on by one here:
    n - 1 loads and stores."""
    slots = [_state(home, f"{EXCESS}.{i}") for i in range(1, max(cpu.contention_confirm_regions, 1))]
    earlier = [b.load_atomic(slot, "monotonic", 8, typ=I64) for slot in slots]
    for slot, v in zip(slots, [excess] + earlier[:-1]):
        b.store_atomic(v, slot, "monotonic", 8)
    seen = excess
    for v in earlier:
        seen = b.select(b.icmp_unsigned("<", v, seen), v, seen)
    return seen


def region_fn(mod: ir.Module, home: ir.Module, cpu) -> ir.Function:
    """`void tgc.region(ptr body, ptr data)`: run `body(data)` on every thread of a
    libgomp team, then note when it ended and update the lag (module docstring).
    Defined once in `home` (the first unit) and, when `mod` is another unit,
    declared there (hidden: the first unit defines it whenever the program has
    several units and threads, `codegen`)."""
    if REGION in mod.globals:
        return mod.globals[REGION]
    if home is not mod:
        return export(region_fn(home, home, cpu), mod)
    state_t = ir.LiteralStructType([PTR, PTR, I64])   # body, data, the calling thread's cycles in body
    run = define(home, REGION_RUN + (".plain" if cpu.profile else ""), ir.VoidType(), [PTR])
    optimize_not(run)   # a few loads and one call per thread
    b = ir.IRBuilder(run.append_basic_block("entry"))
    st = run.args[0]
    body = b.load(b.gep(st, [I32(0), I32(0)], source_etype=state_t), typ=body_type().as_pointer())
    data = b.load(b.gep(st, [I32(0), I32(1)], source_etype=state_t), typ=PTR)
    first = b.icmp_signed("==", fntable.call(b, "omp_get_thread_num", []), I32(0))
    waited = _state(home, WAITED)
    with b.if_else(first) as (then, otherwise):
        with then:   # its own share: the time in body, less its waits at barriers
            w0 = b.load_atomic(waited, "monotonic", 8, typ=I64)
            t0 = now(b)
            b.call(body, [data])
            spent = b.sub(now(b), t0)
            spent = b.sub(spent, b.sub(b.load_atomic(waited, "monotonic", 8, typ=I64), w0))
            b.store(spent, b.gep(st, [I32(0), I32(2)], source_etype=state_t))
        with otherwise:
            b.call(body, [data])
    b.ret_void()
    if cpu.profile:   # each thread's CPU time in it
        run = _timed_run(home, run)

    fn = define(home, REGION, ir.VoidType(), [PTR, PTR])
    fn.attributes.add("noinline")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    st = b.alloca(state_t)
    for i, v in enumerate((fn.args[0], fn.args[1], I64(0))):
        b.store(v, b.gep(st, [I32(0), I32(i)]))
    end = _state(home, REGION_END)
    t0 = now(b)
    last = b.load_atomic(end, "monotonic", 8, typ=I64)
    c0 = b.call(thread_ns_fn(home), []) if cpu.profile else None
    fntable.call(b, "gomp_parallel", [run, st, I32(max(cpu.threads, 0)), I32(0)])
    if cpu.profile:
        b.atomic_rmw("add", _state(home, BUSY + ".region"), b.sub(b.call(thread_ns_fn(home), []), c0), "monotonic")
    t1 = now(b)
    b.store_atomic(t1, end, "monotonic", 8)
    if cpu.contention_memory_cycles > 0:
        own = b.load(b.gep(st, [I32(0), I32(2)]))
        overhead = b.sub(b.sub(t1, t0), own)
        slept = b.or_(b.icmp_unsigned(">=", b.sub(t0, last), I64(cpu.warm_cycles)), b.icmp_unsigned("==", last, I64(0)))
        expected = b.select(slept, I64(cpu.cold_region_cycles), I64(0))
        excess = _smax(b, b.sub(overhead, expected), I64(0))
        seen = _confirmed(b, home, cpu, excess)
        lag, at = _state(home, LAG), _state(home, LAG_AT)
        held, old = _held_lag(b, home, cpu, t0)
        old = b.select(held, old, I64(0))
        # up at once, down by an eighth of the difference: quick regions among slow ones
        # do not clear it (a lag no region renews is forgotten after its hold instead)
        new = _smax(b, seen, b.sub(old, b.ashr(b.sub(old, seen), I64(3))))
        _next_hold(b, home, cpu, held, new)
        b.store_atomic(new, lag, "monotonic", 8)
        b.store_atomic(t1, at, "monotonic", 8)
    b.ret_void()
    return fn


def busy_counters(home: ir.Module) -> list[ir.GlobalVariable]:
    """With `CpuOptions.profile`: the CPU time (ns, `thread_ns_fn`) thread 0 spent in
    regions' bodies, the other threads' (summed: on two threads, the worker's), and
    thread 0's from each region's start to its end (its body, the team's start, and its
    wait for the others at the end), each summed since the counters were last taken
    (`codegen`'s per-kernel counters take and zero them after each kernel). A kernel
    that ran no region leaves them at 0. CPU time, not the time-stamp counter: on a
    shared machine a thread's time slices taken by other processes do not count, so
    a kernel's busy times measure the threads' shares of its work under load too."""
    return [_state(home, BUSY + s) for s in (".0", ".1", ".region")]


def _timed_run(home: ir.Module, inner: ir.Function) -> ir.Function:
    """`tgc.region.run` of a profiled program: `inner` (the plain one) between two
    readings of the calling thread's CPU clock, the difference added to thread 0's
    counter or the others' (`busy_counters`)."""
    run = define(home, REGION_RUN, ir.VoidType(), [PTR])
    optimize_not(run)
    b = ir.IRBuilder(run.append_basic_block("entry"))
    c0 = b.call(thread_ns_fn(home), [])
    b.call(inner, [run.args[0]])
    spent = b.sub(b.call(thread_ns_fn(home), []), c0)
    first = b.icmp_signed("==", fntable.call(b, "omp_get_thread_num", []), I32(0))
    slot = b.select(first, _state(home, BUSY + ".0"), _state(home, BUSY + ".1"))
    b.atomic_rmw("add", slot, spent, "monotonic")
    b.ret_void()
    return run


def thread_ns_fn(home: ir.Module) -> ir.Function:
    """`i64 tgc.thread_ns()`: the calling thread's CPU time in ns
    (`clock_gettime(CLOCK_THREAD_CPUTIME_ID)`, through the pointer the runtime gives a
    profiled program after loading it: `clock_setter`), 0 without one."""
    fn = home.globals.get(THREAD_NS)
    if fn is not None:
        return fn
    clock = ir.GlobalVariable(home, PTR, CLOCK)
    clock.linkage = "internal"
    clock.initializer = ir.Constant(PTR, None)
    fn = define(home, THREAD_NS, I64, [])
    fn.attributes.add("noinline")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    ts = b.alloca(ir.ArrayType(I64, 2))
    b.store(ir.Constant(ir.ArrayType(I64, 2), [0, 0]), ts)
    f = b.load(clock, typ=ir.FunctionType(I32, [I32, PTR]).as_pointer())
    with b.if_then(b.icmp_unsigned("!=", b.ptrtoint(f, I64), I64(0))):
        b.call(f, [I32(CLOCK_THREAD_CPUTIME_ID), ts])
    sec = b.load(b.gep(ts, [I32(0), I32(0)]), typ=I64)
    nsec = b.load(b.gep(ts, [I32(0), I32(1)]), typ=I64)
    b.ret(b.add(b.mul(sec, I64(1_000_000_000)), nsec))
    setter = define(home, CLOCK_SETTER, ir.VoidType(), [PTR], internal=False)
    b = ir.IRBuilder(setter.append_basic_block("entry"))
    b.store(setter.args[0], clock)
    b.ret_void()
    return fn


def clock_address() -> int:
    """clock_gettime's address (the C library's), for `CLOCK_SETTER`."""
    libc = ctypes.CDLL(None)
    return ctypes.cast(libc.clock_gettime, ctypes.c_void_p).value


def barrier_fn(mod: ir.Module, home: ir.Module) -> ir.Function:
    """`void tgc.barrier()`: libgomp's barrier of the current team (`GOMP_barrier`,
    through the table), for a region that runs several kernels (`regions.py`). Thread
    0 adds the cycles it waited to `WAITED`, so that `tgc.region` counts them as the
    region's overhead (a lag when another process holds a worker's core), not as its
    own share of the work. Defined once in `home`, declared in another unit."""
    if BARRIER in mod.globals:
        return mod.globals[BARRIER]
    if home is not mod:
        return export(barrier_fn(home, home), mod)
    fn = define(home, BARRIER, ir.VoidType(), [])
    fn.attributes.add("noinline")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    first = b.icmp_signed("==", fntable.call(b, "omp_get_thread_num", []), I32(0))
    waited = _state(home, WAITED)
    with b.if_else(first) as (then, otherwise):
        with then:
            t0 = now(b)
            fntable.call(b, "gomp_barrier", [])
            b.store_atomic(b.add(b.load_atomic(waited, "monotonic", 8, typ=I64), b.sub(now(b), t0)),
                           waited, "monotonic", 8)
        with otherwise:
            fntable.call(b, "gomp_barrier", [])
    b.ret_void()
    return fn


def threshold_fn(home: ir.Module, cpu) -> ir.Function:
    """`i64 tgc.threshold(i64 warm, i64 cold, i64 per_cycle)`: the least work (or GEMM
    flops) of a kernel that runs in a region now: `warm` if a region ended less than
    `cpu.warm_cycles` ago, else `cold`; and at least twice the lag in the kernel's
    unit (`per_cycle` units of work a cycle) while the lag is held."""
    fn = home.globals.get(THRESHOLD)
    if fn is not None:
        return fn
    fn = define(home, THRESHOLD, I64, [I64, I64, I64])
    fn.attributes.add("noinline")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    warm, cold, per_cycle = fn.args
    t = now(b)
    last = b.load_atomic(_state(home, REGION_END), "monotonic", 8, typ=I64)
    recent = b.icmp_unsigned("<", b.sub(t, last), I64(cpu.warm_cycles))
    recent = b.and_(recent, b.icmp_unsigned("!=", last, I64(0)))
    least = b.select(recent, warm, cold)
    if cpu.contention_memory_cycles > 0:
        held, lag = _held_lag(b, home, cpu, t)
        floor = b.select(held, b.mul(b.mul(lag, I64(2)), per_cycle), I64(0))
        least = _smax(b, least, floor)
    b.ret(least)
    return fn
