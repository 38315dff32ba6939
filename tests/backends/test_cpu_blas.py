"""numpy's OpenBLAS GEMMs: found, callable through ctypes, and through the runtime
function table from JIT-compiled code and from a linked .so."""

import ctypes
import os
import shutil
import subprocess

import llvmlite.ir as ir
import numpy as np
import pytest

from tgc.backends.cpu import blas, fntable, llvm_env

CT = {np.float32: ctypes.c_float, np.float64: ctypes.c_double}
FIELD = {np.float32: 'sgemm', np.float64: 'dgemm'}


def test_library_is_numpys_and_exports_ilp64_gemm():
    path = blas.openblas_path()
    assert 'openblas' in os.path.basename(path)
    addrs = blas.gemm_addresses()
    gemms = {'sgemm', 'dgemm', 'cgemm', 'zgemm'}
    assert gemms <= set(addrs) <= gemms | {'blas_get_threads', 'blas_set_threads'}
    assert all(addrs.values())
    if shutil.which('nm'):
        out = subprocess.run(['nm', '-D', path], capture_output=True, text=True).stdout
        names = {line.split()[-1] for line in out.splitlines() if line.strip()}
        assert any(s in names for s in blas.SYMBOLS['sgemm'])
        assert any(s in names for s in blas.SYMBOLS['dgemm'])
        assert any(s in names for s in blas.SYMBOLS['cgemm'])
        assert any(s in names for s in blas.SYMBOLS['zgemm'])


def call_gemm(dtype, a, b, c, ta, tb, alpha, beta):
    """C = alpha op(A) op(B) + beta C, row-major, through the raw function pointer."""
    fn = blas.gemm_ctypes(CT[dtype])(blas.gemm_addresses()[FIELD[dtype]])
    m, n = c.shape
    k = a.shape[0] if ta else a.shape[1]
    fn(blas.ORDER_ROW_MAJOR, blas.TRANS if ta else blas.NO_TRANS,
       blas.TRANS if tb else blas.NO_TRANS, m, n, k, alpha,
       a.ctypes.data, a.strides[0] // a.itemsize, b.ctypes.data, b.strides[0] // b.itemsize,
       beta, c.ctypes.data, c.strides[0] // c.itemsize)


@pytest.mark.parametrize('dtype', [np.float32, np.float64], ids=['s', 'd'])
@pytest.mark.parametrize('ta', [False, True], ids=['N', 'T'])
@pytest.mark.parametrize('tb', [False, True], ids=['N', 'T'])
def test_gemm_through_ctypes_pointer(dtype, ta, tb):
    rng = np.random.default_rng(0)
    m, n, k = 37, 29, 53
    # operands are column slices of wider arrays: leading dimensions exceed widths
    a = rng.standard_normal((k, m + 3) if ta else (m, k + 3)).astype(dtype)[:, :-3]
    b = rng.standard_normal((n, k + 5) if tb else (k, n + 5)).astype(dtype)[:, :-5]
    c = rng.standard_normal((m, n + 2)).astype(dtype)[:, :-2]
    want = 1.5 * ((a.T if ta else a) @ (b.T if tb else b)) - 0.5 * c
    call_gemm(dtype, a, b, c, ta, tb, 1.5, -0.5)
    tol = 1e-4 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(c, want, rtol=tol, atol=tol * k)


def matmul_module(dtype) -> ir.Module:
    """``void mm(ptr a, ptr b, ptr c, i64 m, i64 n, i64 k)``: C = A B (row-major),
    calling GEMM through the function table; plus the exported ``tgc_init``."""
    module = ir.Module(name='mm')
    fp = ir.FloatType() if dtype == np.float32 else ir.DoubleType()
    i32, i64, ptr = ir.IntType(32), ir.IntType(64), ir.PointerType()
    fntable.define_init(module)
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [ptr, ptr, ptr, i64, i64, i64]), 'mm')
    a, b, c, m, n, k = fn.args
    bld = ir.IRBuilder(fn.append_basic_block('entry'))
    fntable.call(bld, FIELD[dtype], [
        i32(blas.ORDER_ROW_MAJOR), i32(blas.NO_TRANS), i32(blas.NO_TRANS), m, n, k,
        fp(1.0), a, k, b, n, fp(0.0), c, n])
    bld.ret_void()
    return module


MM = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 3, *[ctypes.c_int64] * 3)
INIT = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def check_mm(mm, dtype):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((64, 48)).astype(dtype)
    b = rng.standard_normal((48, 80)).astype(dtype)
    c = np.zeros((64, 80), dtype)
    mm(a.ctypes.data, b.ctypes.data, c.ctypes.data, 64, 80, 48)
    np.testing.assert_allclose(c, a @ b, rtol=1e-4 if dtype == np.float32 else 1e-12, atol=1e-4)


@pytest.mark.parametrize('dtype', [np.float32, np.float64], ids=['s', 'd'])
def test_gemm_through_table_from_jit(dtype):
    jm = llvm_env.jit(str(matmul_module(dtype)))
    table = fntable.make_table(blas.gemm_addresses())
    INIT(jm.address('tgc_init'))(ctypes.addressof(table))
    del table  # the module keeps its own copy
    check_mm(MM(jm.address('mm')), dtype)


@pytest.mark.skipif(shutil.which('cc') is None, reason='no C compiler to link a .so')
def test_gemm_through_table_from_shared_object(tmp_path):
    obj = tmp_path / 'mm.o'
    obj.write_bytes(llvm_env.emit_object(str(matmul_module(np.float32))))
    so = tmp_path / 'mm.so'
    subprocess.run(['cc', '-shared', '-o', str(so), str(obj)], check=True)
    lib = ctypes.CDLL(str(so))
    table = fntable.make_table(blas.gemm_addresses())
    INIT(ctypes.cast(lib.tgc_init, ctypes.c_void_p).value)(ctypes.addressof(table))
    check_mm(MM(ctypes.cast(lib.mm, ctypes.c_void_p).value), np.float32)


def test_table_layout():
    assert fntable.FIELDS[:2] == ('sgemm', 'dgemm')
    t = fntable.make_table({'dgemm': 1234})
    assert len(t) == len(fntable.FIELDS) and t[0] is None and t[1] == 1234
    assert str(fntable.field_type('sgemm')) == (
        'void (i32, i32, i32, i64, i64, i64, float, ptr, i64, ptr, i64, float, ptr, i64)')


def test_a_program_with_gemms_gives_back_the_callers_openblas_thread_count():
    """tgc_run sets OpenBLAS to one thread while it runs (tgc shares the cores itself);
    the result is right and the caller's setting is back afterwards."""
    import ctypes

    import numpy as np

    import tgc

    lib = blas._library()
    names = [n for n in blas.THREAD_SYMBOLS['blas_get_threads'] if hasattr(lib, n)]
    if not names:
        pytest.skip("this OpenBLAS has no openblas_get_num_threads")
    get = getattr(lib, names[0])
    get.restype = ctypes.c_int
    prog = tgc.compile("dim i = 300, j = 300, k = 300\ninput A[i, k]\ninput B[k, j]\nout C = A @ B\n",
                       dtype="f64")
    before = get()
    A, B = np.random.default_rng(0).standard_normal((2, 300, 300))
    np.testing.assert_allclose(prog(A=A, B=B)["C"], A @ B, rtol=1e-10, atol=1e-10)
    assert get() == before
