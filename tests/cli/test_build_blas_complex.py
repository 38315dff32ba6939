"""Complex products in `tgc build` libraries: cgemm/zgemm from the system CBLAS
(`--blas=system`, through the LP64 adapter) and from the caller
(`PREFIX_init_blas_complex`).

- The adapter itself: the `--blas=none` stub compiled with int sizes capped at a small
  TGC_LP64_MAX and fake LP64 complex GEMMs that record their arguments. A call that
  fits is passed on with int sizes; one that does not, and a CblasConjNoTrans call when
  the caller did not say its BLAS takes it, is computed by the definition (checked
  against numpy for every order and transpose, the conjugating ones included).
- A whole library: a complex program (products, a conjugated operand, the gradient of
  `sum(abs(a @ b)^2)`) built with `--blas=system` for f32 (cgemm) and f64 (zgemm), run
  by a C driver outside Python with a preloaded shim that counts cblas_cgemm/zgemm
  calls; its outputs against numpy. The same library initialized with
  `init_blas_complex(32, 0, ...)` (ConjNoTrans not declared) gives the same results.

Needs cc, and the system OpenBLAS for the library tests (Debian: libopenblas-dev).
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tgc.backends.cpu import aot
from tgc.cli import main

from system_blas import needs_openblas

CLEAN_ENV = {"PATH": "/usr/bin:/bin"}


needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="needs cc")

# ---------------------------------------------------------------- the adapter

HARNESS = r"""#include <stdint.h>
#include <string.h>
static void* table[11];
void t_init(void* const* t) { memcpy(table, t, sizeof table); }
void* t_slot(int i) { return table[i]; }
long fake_calls;
int fake_args[9];
static void record(int o, int ta, int tb, int m, int n, int k, int lda, int ldb, int ldc) {
    int v[9] = {o, ta, tb, m, n, k, lda, ldb, ldc};
    memcpy(fake_args, v, sizeof v);
    fake_calls++;
}
/* LP64 complex GEMMs that record their integer arguments and compute nothing */
void fake_cgemm(int o, int ta, int tb, int m, int n, int k, const void* alpha, const void* a, int lda,
                const void* b, int ldb, const void* beta, void* c, int ldc) {
    (void)alpha; (void)a; (void)b; (void)beta; (void)c;
    record(o, ta, tb, m, n, k, lda, ldb, ldc);
}
void fake_zgemm(int o, int ta, int tb, int m, int n, int k, const void* alpha, const void* a, int lda,
                const void* b, int ldb, const void* beta, void* c, int ldc) {
    (void)alpha; (void)a; (void)b; (void)beta; (void)c;
    record(o, ta, tb, m, n, k, lda, ldb, ldc);
}
"""

LP64_MAX = 40
COMPLEX_GEMM = ctypes.CFUNCTYPE(None, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int64,
                                ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


@pytest.fixture(scope="module")
def stub_library(tmp_path_factory):
    if shutil.which("cc") is None:
        pytest.skip("needs cc")
    d = tmp_path_factory.mktemp("complex_adapter")
    (d / "stub.c").write_text(aot.stub_source("t", "none"))
    (d / "harness.c").write_text(HARNESS)
    so = d / "libcadapter.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror", f"-DTGC_LP64_MAX={LP64_MAX}",
                    "-o", str(so), str(d / "stub.c"), str(d / "harness.c"), "-lgomp"], check=True)
    lib = ctypes.CDLL(str(so))
    lib.t_init_blas_complex.argtypes = [ctypes.c_int32, ctypes.c_int32] + [ctypes.c_void_p] * 6
    lib.t_init_blas.argtypes = [ctypes.c_int32] + [ctypes.c_void_p] * 4
    lib.t_slot.restype = ctypes.c_void_p
    return lib


def _init(lib, conj_no_trans: int) -> None:
    fake = {n: ctypes.cast(getattr(lib, f"fake_{n}"), ctypes.c_void_p).value for n in ("cgemm", "zgemm")}
    assert lib.t_init_blas_complex(32, conj_no_trans, None, None, fake["cgemm"], fake["zgemm"], None, None) == 0


def _calls(lib) -> int:
    return ctypes.c_long.in_dll(lib, "fake_calls").value


def _complex(value: complex, dtype) -> np.ndarray:
    return np.array([value], dtype)


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128], ids=["c", "z"])
@pytest.mark.parametrize("ta", [111, 112, 113, 114])
def test_complex_adapter_passes_a_call_that_fits_with_int_sizes(stub_library, dtype, ta):
    lib = stub_library
    _init(lib, 1)
    slot = COMPLEX_GEMM(lib.t_slot(8 if dtype == np.complex64 else 9))
    one = _complex(1, dtype)
    before = _calls(lib)
    slot(101, ta, 113, 7, 9, 11, one.ctypes.data, None, 40, None, 39, one.ctypes.data, None, 38)
    assert _calls(lib) == before + 1
    assert list((ctypes.c_int * 9).in_dll(lib, "fake_args")) == [101, ta, 113, 7, 9, 11, 40, 39, 38]


def _op(x: np.ndarray, t: int) -> np.ndarray:
    x = x.T if t in (112, 113) else x
    return np.conj(x) if t in (113, 114) else x


# (case, transa, transb): every pair of transposes too large for an int; and within the cap,
# each pair with a CblasConjNoTrans operand, given to a BLAS not said to take it
BY_DEFINITION = [("too-large", ta, tb) for ta in (111, 112, 113, 114) for tb in (111, 113, 114)] + [
    ("conj-unknown", ta, tb) for ta in (111, 112, 113, 114) for tb in (111, 113, 114) if 114 in (ta, tb)]


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128], ids=["c", "z"])
@pytest.mark.parametrize("order", [101, 102], ids=["row", "col"])
@pytest.mark.parametrize("case, ta, tb", BY_DEFINITION)
def test_complex_adapter_computes_by_definition(stub_library, dtype, order, case, ta, tb):
    """m = 45 > the cap (or, within the cap, CblasConjNoTrans to a BLAS not said to take
    it): C = alpha op(A) op(B) + beta C computed by the stub, with leading dimensions
    over the widths, row- or column-major; beta 0 does not read C (NaN there)."""
    lib = stub_library
    _init(lib, 0 if case == "conj-unknown" else 1)
    m, n, k = (45, 13, 17) if case == "too-large" else (7, 6, 5)
    rng = np.random.default_rng(ta * 7 + tb)
    rows = lambda r, c: (r, c) if order == 101 else (c, r)  # noqa: E731
    a_rows = rows(*((k, m) if ta in (112, 113) else (m, k)))
    b_rows = rows(*((n, k) if tb in (112, 113) else (k, n)))

    def random(shape):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)

    A, B = random((a_rows[0], a_rows[1] + 3)), random((b_rows[0], b_rows[1] + 2))
    c_rows = rows(m, n)
    for beta in (0, -0.5 + 0.25j):
        C = np.full((c_rows[0], c_rows[1] + 1), np.nan if beta == 0 else 0.25 - 1j, dtype)
        mat = lambda x, r: (x[:, :r[1]] if order == 101 else x[:, :r[1]].T).astype(np.complex128)  # noqa: E731
        alpha = 1.5 - 0.5j
        want = alpha * _op(mat(A, a_rows), ta) @ _op(mat(B, b_rows), tb) + (beta * mat(C, c_rows) if beta else 0)
        before = _calls(lib)
        fn = COMPLEX_GEMM(lib.t_slot(8 if dtype == np.complex64 else 9))
        al, be = _complex(alpha, dtype), _complex(beta, dtype)
        fn(order, ta, tb, m, n, k, al.ctypes.data, A.ctypes.data, A.shape[1], B.ctypes.data, B.shape[1],
           be.ctypes.data, C.ctypes.data, C.shape[1])
        assert _calls(lib) == before          # not passed on
        tol = 1e-5 if dtype == np.complex64 else 1e-12
        np.testing.assert_allclose(mat(C, c_rows), want, rtol=tol, atol=tol)


def test_complex_entries_without_a_blas_compute_by_definition(stub_library):
    """The old entry (`init_blas`, real GEMMs only) on a --blas=none build: the complex
    entries are the definition, never NULL; an int width other than 32 or 64 is refused."""
    lib = stub_library
    assert lib.t_init_blas(64, None, None, None, None) == 0
    assert lib.t_slot(8) is not None and lib.t_slot(9) is not None
    A = np.arange(6, dtype=np.complex128).reshape(2, 3) * (1 - 1j)
    B = np.arange(12, dtype=np.complex128).reshape(3, 4) + 2j
    C = np.zeros((2, 4), np.complex128)
    one, zero = _complex(1, np.complex128), _complex(0, np.complex128)
    COMPLEX_GEMM(lib.t_slot(9))(101, 111, 111, 2, 4, 3, one.ctypes.data, A.ctypes.data, 3, B.ctypes.data, 4,
                                zero.ctypes.data, C.ctypes.data, 4)
    np.testing.assert_allclose(C, A @ B, rtol=1e-14)
    assert lib.t_init_blas_complex(16, 1, None, None, None, None, None, None) == -1


# ---------------------------------------------------------------- a library, --blas=system

PROGRAM = """dim n = 96, k = 80, m = 72   # large enough for GEMMs (small products run fused loops)
input a: {t}[n, k]
input b: {t}[k, m]
out c = a @ b
out d = conj(a) @ b
out g = grad(sum(abs(a @ b) ^ 2), a)
"""

DRIVER = r"""#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "cx.h"
#ifdef CALLER_BLAS
extern void cblas_sgemm(void);
extern void cblas_dgemm(void);
extern void cblas_cgemm(void);
extern void cblas_zgemm(void);
#endif

static void* slurp(const char* path, long bytes) {
    void* p = malloc((size_t)bytes);
    FILE* f = fopen(path, "rb");
    if (!f || fread(p, 1, (size_t)bytes, f) != (size_t)bytes) { fprintf(stderr, "read %s\n", path); exit(2); }
    fclose(f);
    return p;
}

int main(int argc, char** argv) {
    /* argv: bytes of each argument, then of each output */
    if (argc != 1 + CX_NUM_ARGS + CX_NUM_OUTS) { fprintf(stderr, "usage\n"); return 2; }
#ifdef CALLER_BLAS
    if (cx_init_blas_complex(32, 0, (void*)cblas_sgemm, (void*)cblas_dgemm, (void*)cblas_cgemm,
                             (void*)cblas_zgemm, NULL, NULL) != 0) return 3;
#else
    if (cx_init_default() != 0) return 3;
#endif
    void* args[CX_NUM_ARGS];
    void* outs[CX_NUM_OUTS];
    char name[32];
    for (int i = 0; i < CX_NUM_ARGS; i++) {
        snprintf(name, sizeof name, "arg%d.bin", i);
        args[i] = slurp(name, atol(argv[1 + i]));
    }
    for (int j = 0; j < CX_NUM_OUTS; j++) outs[j] = calloc(1, (size_t)atol(argv[1 + CX_NUM_ARGS + j]));
    int64_t dims[1] = {0};
    int64_t bytes = cx_workspace_bytes(dims);
    void* workspace = aligned_alloc(64, (size_t)(bytes > 0 ? bytes : 64));
    int32_t rc = cx_run(dims, args, outs, workspace);
    if (rc != CX_OK) { fprintf(stderr, "cx_run: %d\n", rc); return 4; }
    for (int j = 0; j < CX_NUM_OUTS; j++) {
        snprintf(name, sizeof name, "out%d.bin", j);
        FILE* f = fopen(name, "wb");
        fwrite(outs[j], 1, (size_t)atol(argv[1 + CX_NUM_ARGS + j]), f);
        fclose(f);
    }
    return 0;
}
"""

SHIM = r"""#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
typedef void (*gemm_t)(int, int, int, int, int, int, const void*, const void*, int, const void*, int,
                       const void*, void*, int);
static long calls[2];
static gemm_t next[2];
static void report(void) { fprintf(stderr, "cblas_cgemm calls: %ld\ncblas_zgemm calls: %ld\n", calls[0], calls[1]); }
__attribute__((constructor)) static void start(void) { atexit(report); }
#define FORWARD(NAME, I)                                                                         \
  void NAME(int o, int ta, int tb, int m, int n, int k, const void* al, const void* a, int lda,  \
            const void* b, int ldb, const void* be, void* c, int ldc) {                          \
    if (!next[I]) next[I] = (gemm_t)dlsym(RTLD_NEXT, #NAME);                                     \
    calls[I]++;                                                                                  \
    next[I](o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc);                                 \
  }
FORWARD(cblas_cgemm, 0)
FORWARD(cblas_zgemm, 1)
"""


def _build(tmp: Path, dtype: str) -> Path:
    tmp.mkdir()
    (tmp / "cx.tg").write_text(PROGRAM.format(t="c64" if dtype == "f32" else "c128"))
    r = CliRunner().invoke(main, ["build", str(tmp / "cx.tg"), "-o", str(tmp / "libcx.so"), "--blas=system",
                                  "--dtype", dtype])
    assert r.exit_code == 0, r.output
    return tmp


def _run(tmp: Path, exe: Path, inputs: dict, shim: Path) -> tuple[dict, list[int]]:
    """Run the driver on `inputs` (complex arrays, the program's arguments in order);
    its outputs as complex arrays, and the cgemm/zgemm calls the shim counted."""
    width = np.complex64 if inputs["a"].dtype == np.complex64 else np.complex128
    shapes = {"c": (96, 72), "d": (96, 72), "g": (96, 80)}
    for i, name in enumerate(("a", "b")):
        np.ascontiguousarray(inputs[name]).tofile(tmp / f"arg{i}.bin")
    sizes = [inputs[n].nbytes for n in ("a", "b")] + [int(np.prod(s)) * np.dtype(width).itemsize
                                                      for s in shapes.values()]
    env = dict(CLEAN_ENV, LD_PRELOAD=str(shim))
    p = subprocess.run([str(exe), *map(str, sizes)], capture_output=True, text=True, env=env, cwd=tmp)
    assert p.returncode == 0, p.stderr
    calls = [int(x) for x in re.findall(r"cblas_[cz]gemm calls: (\d+)", p.stderr)]
    outs = {n: np.fromfile(tmp / f"out{j}.bin", width).reshape(s) for j, (n, s) in enumerate(shapes.items())}
    return outs, calls


@needs_openblas
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_blas_system_library_computes_complex_products_with_the_system_cgemm(tmp_path, dtype):
    lib = _build(tmp_path / "build", dtype)
    (tmp_path / "shim.c").write_text(SHIM)
    shim = tmp_path / "shim.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(shim), str(tmp_path / "shim.c"), "-ldl"], check=True)
    (lib / "driver.c").write_text(DRIVER)
    exes = {}
    for variant, flags in (("default", []), ("caller", ["-DCALLER_BLAS", "-lopenblas"])):
        exes[variant] = lib / f"driver_{variant}"
        subprocess.run(["cc", "-O2", "-std=c11", "-Wall", "-Werror", f"-I{lib}", "-o", str(exes[variant]),
                        str(lib / "driver.c"), f"-L{lib}", "-lcx", "-Wl,-rpath,$ORIGIN", *flags], check=True)
    rng = np.random.default_rng(3)
    width = np.complex64 if dtype == "f32" else np.complex128
    cplx = lambda *s: (rng.standard_normal(s) + 1j * rng.standard_normal(s)).astype(width)  # noqa: E731
    inputs = {"a": cplx(96, 80), "b": cplx(80, 72)}
    a, b = (inputs[n].astype(np.complex128) for n in ("a", "b"))
    want = {"c": a @ b, "d": np.conj(a) @ b, "g": 2 * (a @ b) @ np.conj(b).T}
    tol = 2e-5 if dtype == "f32" else 1e-12
    results = {}
    for variant, exe in exes.items():
        outs, calls = _run(lib, exe, inputs, shim)
        for name, ref in want.items():
            scale = np.abs(ref).max()
            np.testing.assert_allclose(outs[name], ref, rtol=tol, atol=tol * scale, err_msg=f"{variant} {name}")
        used = calls[0] if dtype == "f32" else calls[1]
        other = calls[1] if dtype == "f32" else calls[0]
        # default: every complex product is a system call (c, d and g's: ConjNoTrans is OpenBLAS's);
        # caller without ConjNoTrans declared: conj(a) @ b computed by the definition
        assert other == 0 and used == (3 if variant == "default" else 2), (variant, calls)
        results[variant] = outs
    assert "cblas_cgemm/cblas_zgemm" in (lib / "cx.h").read_text()
    assert "cx_init_blas_complex" in (lib / "cx.h").read_text()
