"""GEMM for generated code: numpy's own OpenBLAS, found in this process.

Why numpy's copy: every OpenBLAS in a process keeps its own thread pool, and
alternating two of them halves numpy's matmul speed. numpy >= 2 bundles
``numpy.libs/libscipy_openblas64_-<hash>.so``, an ILP64 build whose CBLAS entry
points carry the ``scipy_`` prefix and ``64_`` suffix:

    void scipy_cblas_sgemm64_(i32 order, i32 transa, i32 transb,
                              i64 m, i64 n, i64 k, float alpha,
                              const float *a, i64 lda, const float *b, i64 ldb,
                              float beta, float *c, i64 ldc)
    (dgemm: the same with double)

Enums are C ``int`` (32 bits), sizes are 64-bit. ``ORDER_ROW_MAJOR`` etc. below.

The library is located from the maps of this process after ``import numpy`` (the
copy numpy actually loaded), falling back to the ``numpy.libs`` folder next to the
numpy package; ctypes then opens that same path, which returns numpy's handle.

Generated code does not link BLAS: it calls these through the runtime function
table (see ``fntable.py``), with ``gemm_type(fp)`` as the LLVM function type.
"""

import ctypes
import functools
import glob
import os

import llvmlite.ir as ir

ORDER_ROW_MAJOR, ORDER_COL_MAJOR = 101, 102
NO_TRANS, TRANS = 111, 112
CONJ_TRANS, CONJ_NO_TRANS = 113, 114   # CblasConjNoTrans is OpenBLAS's extension (numpy's has it)

# ILP64 CBLAS symbol names, most specific first: numpy's scipy-openblas, then a
# plain OpenBLAS built with the 64_ suffix. LP64 builds are not accepted (their
# size arguments are 32-bit, which gemm_type does not describe).
SYMBOLS = {
    'sgemm': ('scipy_cblas_sgemm64_', 'cblas_sgemm64_'),
    'dgemm': ('scipy_cblas_dgemm64_', 'cblas_dgemm64_'),
    # complex (interleaved pairs); alpha and beta are passed by address
    'cgemm': ('scipy_cblas_cgemm64_', 'cblas_cgemm64_'),
    'zgemm': ('scipy_cblas_zgemm64_', 'cblas_zgemm64_'),
}
# OpenBLAS's (process-wide) thread count, which generated code sets to 1 for the
# duration of a call (see codegen.py)
THREAD_SYMBOLS = {
    'blas_get_threads': ('scipy_openblas_get_num_threads64_', 'openblas_get_num_threads64_'),
    'blas_set_threads': ('scipy_openblas_set_num_threads64_', 'openblas_set_num_threads64_'),
}


def _mapped_libraries() -> list[str]:
    try:
        with open('/proc/self/maps') as f:
            paths = {line.split()[-1] for line in f if '/' in line}
    except OSError:
        return []
    return sorted(p for p in paths if 'openblas' in os.path.basename(p).lower())


def _bundled_libraries(numpy_dir: str) -> list[str]:
    libs = os.path.join(os.path.dirname(numpy_dir), 'numpy.libs')
    return sorted(glob.glob(os.path.join(libs, '*openblas*.so*')))


def _exports_gemm(path: str) -> bool:
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return False
    return any(hasattr(lib, name) for name in SYMBOLS['sgemm'])


@functools.cache
def openblas_path() -> str:
    """Path of the OpenBLAS numpy uses (loaded by importing numpy)."""
    import numpy
    numpy_dir = os.path.dirname(numpy.__file__)
    mapped = _mapped_libraries()
    ordered = [p for p in mapped if 'numpy' in p] + [p for p in mapped if 'numpy' not in p]
    for path in ordered + _bundled_libraries(numpy_dir):
        if _exports_gemm(path):
            return path
    raise RuntimeError('no ILP64 OpenBLAS found: numpy does not bundle one here '
                       f'(looked in /proc/self/maps and next to {numpy_dir})')


@functools.cache
def _library() -> ctypes.CDLL:
    return ctypes.CDLL(openblas_path())


def _symbol(lib: ctypes.CDLL, names: tuple[str, ...]):
    for name in names:
        if hasattr(lib, name):
            return getattr(lib, name)
    raise RuntimeError(f'{openblas_path()} exports none of {names}')


def gemm_addresses() -> dict[str, int]:
    """{'sgemm': address, 'dgemm': address, 'cgemm', 'zgemm'} of the ILP64 CBLAS GEMMs, and of the
    thread-count get/set entries where the library has them."""
    lib = _library()
    out = {k: ctypes.cast(_symbol(lib, names), ctypes.c_void_p).value for k, names in SYMBOLS.items()}
    for k, names in THREAD_SYMBOLS.items():
        found = [getattr(lib, n) for n in names if hasattr(lib, n)]
        if found:
            out[k] = ctypes.cast(found[0], ctypes.c_void_p).value
    return out


def gemm_type(fp) -> ir.FunctionType:
    """LLVM type of cblas_?gemm (ILP64) for ``ir.FloatType()``/``ir.DoubleType()``."""
    i32, i64, ptr = ir.IntType(32), ir.IntType(64), ir.PointerType()
    return ir.FunctionType(ir.VoidType(), [i32, i32, i32, i64, i64, i64, fp,
                                           ptr, i64, ptr, i64, fp, ptr, i64])


def complex_gemm_type() -> ir.FunctionType:
    """LLVM type of cblas_cgemm / cblas_zgemm (ILP64): alpha and beta are pointers."""
    i32, i64, ptr = ir.IntType(32), ir.IntType(64), ir.PointerType()
    return ir.FunctionType(ir.VoidType(), [i32, i32, i32, i64, i64, i64, ptr,
                                           ptr, i64, ptr, i64, ptr, ptr, i64])


def gemm_ctypes(fp_ctype) -> type:
    """The ctypes prototype matching ``gemm_type`` (c_float or c_double)."""
    i32, i64, p = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    return ctypes.CFUNCTYPE(None, i32, i32, i32, i64, i64, i64, fp_ctype,
                            p, i64, p, i64, fp_ctype, p, i64)
