"""tgc.backends.cpu.parallel: an outlined body run by libgomp through the table."""

import ctypes
import os

import llvmlite.ir as ir
import numpy as np
import pytest

from tgc.backends.cpu import fntable, llvm_env, parallel

I64 = ir.IntType(64)


def _counted_loop(b: ir.IRBuilder, lo, hi, emit_body):
    """for (i = lo; i < hi; ++i) emit_body(b, i); leaves b after the loop."""
    fn = b.function
    head, body, done = (fn.append_basic_block(s) for s in ('head', 'body', 'done'))
    pre = b.block
    b.branch(head)
    b.position_at_end(head)
    i = b.phi(I64)
    i.add_incoming(lo, pre)
    b.cbranch(b.icmp_signed('<', i, hi), body, done)
    b.position_at_end(body)
    emit_body(b, i)
    i.add_incoming(b.add(i, I64(1)), b.block)
    b.branch(head)
    b.position_at_end(done)


def tid_module(threshold: int) -> ir.Module:
    """``run(ptr data)``, data = {ptr out (i64[n]), i64 n}: out[i] = thread id of i."""
    module = ir.Module(name='par')
    ptr = ir.PointerType()
    fntable.define_init(module)
    body = ir.Function(module, parallel.body_type(), 'body')
    body.linkage = 'internal'
    b = ir.IRBuilder(body.append_basic_block('entry'))
    data = body.args[0]
    out = b.load(data, typ=ptr)
    n = b.load(b.gep(data, [I64(1)], source_etype=I64), typ=I64)
    lo, hi = parallel.thread_range(b, n)
    tid = b.sext(fntable.call(b, 'omp_get_thread_num', []), I64)
    _counted_loop(b, lo, hi, lambda b, i: b.store(tid, b.gep(out, [i], source_etype=I64)))
    b.ret_void()
    run = ir.Function(module, ir.FunctionType(ir.VoidType(), [ptr]), 'run')
    b = ir.IRBuilder(run.append_basic_block('entry'))
    n = b.load(b.gep(run.args[0], [I64(1)], source_etype=I64), typ=I64)
    parallel.parallel_for(b, body, run.args[0], n, threshold)
    b.ret_void()
    return module


RUN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
INIT = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@pytest.fixture(scope='module')
def gomp():
    try:
        return parallel.gomp_addresses()
    except OSError as e:
        pytest.skip(f'libgomp not loadable: {e}')


def compiled(gomp, threshold):
    jm = llvm_env.jit(str(tid_module(threshold)))
    table = fntable.make_table(gomp)  # alive through the call (a temporary is freed before it)
    INIT(jm.address('tgc_init'))(ctypes.addressof(table))
    return jm, RUN(jm.address('run'))


def call(run, n):
    out = np.full(n, -1, dtype=np.int64)
    data = (ctypes.c_int64 * 2)(out.ctypes.data, n)
    run(ctypes.addressof(data))
    return out


def test_below_threshold_runs_serially(gomp):
    _, run = compiled(gomp, threshold=1000)
    np.testing.assert_array_equal(call(run, 999), 0)


def test_above_threshold_splits_contiguously(gomp):
    _, run = compiled(gomp, threshold=1000)
    out = call(run, 100_001)
    assert (out >= 0).all()
    assert (np.diff(out) >= 0).all()  # contiguous shares in thread order
    cores = len(os.sched_getaffinity(0))
    if cores > 1:
        assert len(np.unique(out)) > 1



# ------------------------------------------------------------ timed regions and the lag

def region_module(cpu) -> ir.Module:
    """`run(data)` as `tid_module`'s, but through `parallel.region_fn`; `threshold(warm,
    cold, per_cycle)` through `parallel.threshold_fn`; `set_lag(lag, age)` stores a lag
    measured `age` cycles ago; `set_hold(n)`, that it is held `n` times itself;
    `state(i)` reads region_end (0), lag (1), lag_at (2)."""
    module = tid_module(threshold=1)
    body = module.globals['body']
    region = parallel.region_fn(module, module, cpu)
    thr = parallel.threshold_fn(module, cpu)
    run = ir.Function(module, ir.FunctionType(ir.VoidType(), [ir.PointerType()]), 'run_region')
    b = ir.IRBuilder(run.append_basic_block('entry'))
    b.call(region, [body, run.args[0]])
    b.ret_void()
    names = (parallel.REGION_END, parallel.LAG, parallel.LAG_AT)
    fn = ir.Function(module, ir.FunctionType(I64, [I64] * 3), 'threshold')
    b = ir.IRBuilder(fn.append_basic_block('entry'))
    b.ret(b.call(thr, list(fn.args)))
    if parallel.LAG not in module.globals:   # contention_memory_cycles=0
        return module
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [I64, I64]), 'set_lag')
    b = ir.IRBuilder(fn.append_basic_block('entry'))
    b.store(fn.args[0], module.globals[parallel.LAG])
    b.store(b.sub(parallel.now(b), fn.args[1]), module.globals[parallel.LAG_AT])
    b.ret_void()
    if parallel.HOLD in module.globals:
        fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [I64]), 'set_hold')
        b = ir.IRBuilder(fn.append_basic_block('entry'))
        b.store(fn.args[0], module.globals[parallel.HOLD])
        b.ret_void()
    fn = ir.Function(module, ir.FunctionType(I64, [I64]), 'state')
    b = ir.IRBuilder(fn.append_basic_block('entry'))
    out = I64(0)
    for i, name in enumerate(names):
        v = b.load(module.globals[name], typ=I64)
        out = b.select(b.icmp_signed('==', fn.args[0], I64(i)), v, out)
    b.ret(out)
    return module


def region_compiled(gomp, cpu):
    jm = llvm_env.jit(str(region_module(cpu)))
    table = fntable.make_table(gomp)
    INIT(jm.address('tgc_init'))(ctypes.addressof(table))
    f = ctypes.CFUNCTYPE
    return jm, {'run': RUN(jm.address('run_region')),
                'threshold': f(ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)(jm.address('threshold')),
                'set_lag': f(None, ctypes.c_int64, ctypes.c_int64)(jm.address('set_lag')),
                'set_hold': f(None, ctypes.c_int64)(jm.address('set_hold')),
                'state': f(ctypes.c_int64, ctypes.c_int64)(jm.address('state'))}


def test_a_held_lag_raises_the_threshold_to_twice_the_serial_time_it_costs(gomp):
    """While a lag is held, a kernel runs in a region only if its serial time (its
    work at `per_cycle` units a cycle) is at least twice the lag; a lag older than
    `contention_memory_cycles` is forgotten, and none before the first region."""
    from tgc.backends.cpu.options import CpuOptions
    cpu = CpuOptions(contention_memory_cycles=1 << 40)
    _jm, fns = region_compiled(gomp, cpu)
    assert fns['threshold'](10, 20, 3) == 20               # no region yet: cold, no lag
    fns['set_lag'](1000, 0)
    assert fns['threshold'](10, 20, 3) == 2 * 1000 * 3
    assert fns['threshold'](10, 10 ** 9, 3) == 10 ** 9     # a higher threshold stands
    fns['set_lag'](1000, 1 << 41)                          # measured longer ago than the memory
    assert fns['threshold'](10, 20, 3) == 20


def test_a_region_runs_the_body_on_every_thread_and_notes_its_time(gomp):
    from tgc.backends.cpu.options import CpuOptions
    _jm, fns = region_compiled(gomp, CpuOptions())
    assert fns['state'](0) == 0 and fns['state'](2) == 0
    out = np.full(100_001, -1, dtype=np.int64)
    data = (ctypes.c_int64 * 2)(out.ctypes.data, out.size)
    fns['run'](ctypes.addressof(data))
    assert (out >= 0).all() and (np.diff(out) >= 0).all()
    if len(os.sched_getaffinity(0)) > 1:
        assert len(np.unique(out)) > 1
    assert fns['state'](0) != 0 and fns['state'](2) != 0   # the end noted, the lag measured
    assert fns['state'](1) >= 0


def test_without_contention_memory_no_lag_is_kept():
    from tgc.backends.cpu.options import CpuOptions
    text = str(region_module(CpuOptions(contention_memory_cycles=0)))
    assert parallel.LAG not in text and parallel.REGION_END in text


def test_a_long_lag_is_held_for_a_multiple_of_itself(gomp):
    """A lag of 10^6 cycles is held `HOLD` x 10^6 cycles however short
    `contention_memory_cycles`: once while new, 50 times (`contention_memory_lags`) once
    the regions after its holds confirmed it (the region that measures it again costs
    ~one lag)."""
    from tgc.backends.cpu.options import CpuOptions
    _jm, fns = region_compiled(gomp, CpuOptions(contention_memory_cycles=1000, contention_memory_lags=50))
    fns['set_lag'](10 ** 6, 5 * 10 ** 5)
    assert fns['threshold'](10, 20, 3) == 2 * 10 ** 6 * 3
    fns['set_lag'](10 ** 6, 2 * 10 ** 6)
    assert fns['threshold'](10, 20, 3) == 20
    fns['set_hold'](50)
    fns['set_lag'](10 ** 6, 10 ** 7)
    assert fns['threshold'](10, 20, 3) == 2 * 10 ** 6 * 3
    fns['set_lag'](10 ** 6, 10 ** 9)
    assert fns['threshold'](10, 20, 3) == 20


# ------------------------------------------------------------ the lag, driven by a worker that waits

def waiting_module(cpu) -> ir.Module:
    """`region(delay)`: one region through `parallel.region_fn` whose last thread spins
    `delay` time-stamp-counter cycles (thread 0 returns at once: the region's overhead is
    at least the delay, as when another process holds the worker's core); `threshold(warm,
    cold, per_cycle)`; `lag()`, the lag the regions have set; `excess()`, the last
    region's excess (0 without a slot: `contention_confirm_regions` 1); `hold()`, how
    many times itself the lag is held (0 before the first region); `age(c)` makes
    the lag `c` cycles older, as if that much time had passed without a region."""
    module = ir.Module(name='lag')
    fntable.define_init(module)
    body = ir.Function(module, parallel.body_type(), 'body')
    body.linkage = 'internal'
    b = ir.IRBuilder(body.append_basic_block('entry'))
    delay = b.load(body.args[0], typ=I64)
    tid = b.sext(fntable.call(b, 'omp_get_thread_num', []), I64)
    nth = b.sext(fntable.call(b, 'omp_get_num_threads', []), I64)
    last = b.and_(b.icmp_signed('>', nth, I64(1)), b.icmp_signed('==', tid, b.sub(nth, I64(1))))
    with b.if_then(last):
        start = parallel.now(b)
        spin, done = body.append_basic_block('spin'), body.append_basic_block('spun')
        b.branch(spin)
        b.position_at_end(spin)
        b.cbranch(b.icmp_unsigned('<', b.sub(parallel.now(b), start), delay), spin, done)
        b.position_at_end(done)
    b.ret_void()
    region = ir.Function(module, ir.FunctionType(ir.VoidType(), [I64]), 'region')
    b = ir.IRBuilder(region.append_basic_block('entry'))
    cell = b.alloca(I64)
    b.store(region.args[0], cell)
    b.call(parallel.region_fn(module, module, cpu), [body, cell])
    b.ret_void()
    fn = ir.Function(module, ir.FunctionType(I64, [I64] * 3), 'threshold')
    b = ir.IRBuilder(fn.append_basic_block('entry'))
    b.ret(b.call(parallel.threshold_fn(module, cpu), list(fn.args)))
    for name, state in (('lag', parallel.LAG), ('excess', f'{parallel.EXCESS}.1'), ('hold', parallel.HOLD)):
        fn = ir.Function(module, ir.FunctionType(I64, []), name)
        b = ir.IRBuilder(fn.append_basic_block('entry'))
        b.ret(b.load(module.globals[state], typ=I64) if state in module.globals else I64(0))
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [I64]), 'age')
    b = ir.IRBuilder(fn.append_basic_block('entry'))
    at = module.globals[parallel.LAG_AT]
    b.store(b.sub(b.load(at, typ=I64), fn.args[0]), at)
    b.ret_void()
    return module


# Every region counts as one whose workers had gone to sleep (`warm_cycles` 0): a quick
# region's excess is its overhead less COLD cycles, 0 unless this machine's own load
# delays it by more; a slow one's at least about SLOW - COLD (thread 0 waits for the
# spinning thread). The lag is held throughout (`contention_memory_cycles` 2^40).
COLD, SLOW = 20_000_000, 70_000_000
HIGH = (SLOW - COLD) // 2   # a slow region's excess is above this


class Regions:
    """A compiled `waiting_module`; `run(delay)` runs one region and checks the lag's
    rule against the excesses the regions measured: the lag follows the least excess
    of the last `n` regions, up at once, down an eighth of the way."""

    def __init__(self, gomp, n, memory=1 << 40):
        from tgc.backends.cpu.options import CpuOptions
        cpu = CpuOptions(threads=2, warm_cycles=0, cold_region_cycles=COLD, contention_memory_cycles=memory,
                         contention_confirm_regions=n)
        self.cpu = cpu
        self.jm = llvm_env.jit(str(waiting_module(cpu)))
        table = fntable.make_table(gomp)
        INIT(self.jm.address('tgc_init'))(ctypes.addressof(table))
        f = ctypes.CFUNCTYPE
        self.region = f(None, ctypes.c_int64)(self.jm.address('region'))
        self.threshold = f(ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)(self.jm.address('threshold'))
        self.lag = f(ctypes.c_int64)(self.jm.address('lag'))
        self.excess = f(ctypes.c_int64)(self.jm.address('excess'))
        self.hold = f(ctypes.c_int64)(self.jm.address('hold'))
        self.age = f(None, ctypes.c_int64)(self.jm.address('age'))
        self.n, self.excesses = n, []

    def run(self, delay: int) -> int:
        """Runs a region; returns its excess."""
        old = self.lag()
        self.region(delay)
        e = self.excess()
        self.excesses.append(e)
        seen = min(([0] * self.n + self.excesses)[-self.n:])
        assert self.lag() == max(seen, old - ((old - seen) >> 3))
        return e


def test_one_slow_region_does_not_set_the_lag_but_two_in_a_row_do(gomp):
    """`contention_confirm_regions` = 2: the lag follows the lesser excess of the last
    two regions, so a slow region among quick ones leaves it where it was or at the
    quick region's excess (on a quiet machine 0: later kernels' threshold stays); two
    slow regions in a row set it, and it raises the threshold to twice the lag."""
    r = Regions(gomp, 2)
    r.run(0)
    assert r.lag() == 0                       # the first region: no earlier one confirms it
    for _ in range(3):
        old, quick = r.lag(), r.excesses[-1]
        assert r.run(SLOW) > HIGH
        assert r.lag() <= max(old, quick)     # the slow region's excess is not taken
        r.run(0)
        r.run(0)
    assert r.threshold(10, 20, 1) == max(20, 2 * r.lag())
    r.run(SLOW)
    r.run(SLOW)
    assert r.lag() > HIGH
    assert r.threshold(10, 20, 1) == 2 * r.lag()


def test_with_one_region_confirming_one_slow_region_sets_the_lag(gomp):
    """`contention_confirm_regions` = 1: every region's excess sets the lag, an outlier's
    too, which then keeps every kernel under twice it on one thread."""
    r = Regions(gomp, 1)
    r.region(0)
    r.region(SLOW)
    assert r.lag() > HIGH
    assert r.threshold(10, 20, 1) == 2 * r.lag()


def test_three_regions_confirm_a_lag_only_when_all_three_are_slow(gomp):
    r = Regions(gomp, 3)
    r.run(SLOW)
    r.run(SLOW)
    assert r.lag() == 0
    quick = r.run(0)
    assert r.run(SLOW) > HIGH and r.run(SLOW) > HIGH
    assert r.lag() <= quick
    r.run(SLOW)
    assert r.lag() > HIGH


def test_a_lag_is_held_longer_each_time_it_outlasts_its_hold_and_once_after_it_ends(gomp):
    """A lag is held `contention_memory_cycles`, or `hold()` times itself if longer.
    While the cores stay taken (each region that begins after the hold ran out, slow
    again), the next hold is twice as many lags, up to `contention_memory_lags` (50);
    a region that finds the cores free (quick) clears the lag and the count, so that
    the next outburst's lag is held once, and its serial tail is short. Time passing
    is simulated (`age`): the test does not wait for the holds."""
    memory = 1 << 30                          # a lag of HIGH cycles, 50 times itself, outlasts it
    r = Regions(gomp, 2, memory=memory)
    lags = r.cpu.contention_memory_lags
    assert lags * HIGH >= memory

    def held():                               # the threshold of a 1-work kernel, against the cold one
        return r.threshold(10, 20, 1) > 20

    def hold_cycles():
        return max(memory, r.hold() * r.lag())

    r.region(SLOW)
    r.region(SLOW)                            # two slow regions in a row: the lag is set
    assert r.lag() > HIGH and r.hold() == 1 and held()
    r.age(hold_cycles() + 1)                  # held once: the memory's floor
    assert not held()
    for want in (2, 4, 8, 16, 32, 50, 50):    # each region after the hold: slow again
        r.region(SLOW)
        slow = r.excess()
        assert r.lag() > HIGH and r.hold() == want and held()
        r.age(hold_cycles() - (1 << 26))      # held `want` lags (the floor while shorter);
        assert held()                         # a margin of 2^26 cycles (~20 ms): the real clock
        r.age(1 << 27)                        # runs on too, and a loaded machine can preempt here
        assert not held()
    assert r.hold() * r.lag() > memory        # at 50 lags the hold outlasts the floor
    r.region(0)                               # the cores are free again
    quick = r.excess()
    # the least of this region's and the slow one's (a loaded machine can delay the
    # quick region past the slow one's excess)
    assert r.lag() == min(quick, slow)
    if quick * lags < memory:                 # (unless this machine's own load delayed it)
        assert r.hold() == 1
        assert r.threshold(10, 20, 1) == max(20, 2 * quick)
        r.region(SLOW)                        # a new outburst: its lag is held once
        r.region(SLOW)
        assert r.lag() > HIGH and r.hold() == 1 and held()
        r.age(memory + 1)
        assert not held()
