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

