"""Ahead-of-time builds: LLVM text, assembly, an object, a `.so` and its C header.

The exported symbols of the generated code (`tgc_init`, `tgc_run`,
`tgc_workspace_bytes`) are renamed to `PREFIX_*`, so several models can live in
one program. The generated code links nothing: it reaches BLAS and libgomp through
the function table `PREFIX_init` copies (`fntable.py`). A `.so` also gets two
helpers, compiled from C (`STUB`) with the system `cc`, that fill that table:

- `PREFIX_init_blas(int_bits, sgemm, dgemm, get_threads, set_threads)`: the
  caller's CBLAS, ILP64 (`int_bits` 64: the table's own signature, given as is) or
  LP64 (32: the sizes of a call are passed as `int` by an adapter, and a call whose
  sizes do not fit an `int` is computed by its definition instead), plus libgomp's
  entries; complex products use the complex GEMMs the library links (below);
- `PREFIX_init_blas_complex(int_bits, conj_no_trans, sgemm, dgemm, cgemm, zgemm,
  get_threads, set_threads)`: the same with the caller's cgemm and zgemm too (same
  `int_bits`, the same LP64 adapter and fallback; `conj_no_trans` 1 says they take
  OpenBLAS's CblasConjNoTrans, else such a call is computed by its definition; NULL:
  every complex product by its definition);
- `PREFIX_init_default()`: `PREFIX_init_blas` with the BLAS `options.cpu.blas` linked.

`options.cpu.blas` decides what the `.so` links, and so what it needs to load:

- "none": no BLAS (the GEMMs run generated loops unless the caller passes one);
- "system": the system CBLAS (`-lopenblas`, else `-lcblas`, else `-lblas`: a NEEDED
  entry on a library in the system's search path, no RUNPATH), LP64 as Debian's;
  its cblas_cgemm/cblas_zgemm through the LP64 adapter (CblasConjNoTrans passed on
  only to OpenBLAS, which has it);
- "numpy": numpy's bundled OpenBLAS (ILP64 `scipy_cblas_[sd]gemm64_`, found at build
  time), with a RUNPATH into that Python environment: the library loads only while
  that environment exists. The generated code then assumes a BLAS in the table.

A complex product becomes one cgemm/zgemm call (`lower/complex_gemm.py`) in the
"numpy" and "system" builds; "none" computes it as four real products.

Every `.so` links libgomp (GCC's OpenMP runtime, `libgomp.so.1` in the system's
library path wherever GCC is; its threads are the ones tgc's parallel kernels run
on), libc (`memcpy`, `memset`) and libm (the elementwise functions the CPU calls
there, `tgc.ir.ops.Fn.libm`; a NEEDED entry only where the code calls one, as the
linker's --as-needed keeps it); the link refuses any symbol left undefined
(`-z defs`), so a library that links also loads. Code is tuned for the building
machine's CPU (like -march=native).

Every artifact is a pure function of the module, the options and the prefix.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

from tgc.ir.module import Module
from tgc.lower.lowered import Lowered
from tgc.options import Options

EXPORTS = ("init", "run", "workspace_bytes")
EMITS = ("so", "obj", "llvm", "asm", "h")


class BuildError(RuntimeError):
    """The system toolchain (cc) failed to link the library."""


def llvm_text(low: Lowered, options: Options, prefix: str) -> str:
    """Unoptimized LLVM IR of the whole lowered program, exports named `PREFIX_*`."""
    from tgc.backends.cpu import codegen

    text = codegen.generate(low, options)
    for name in EXPORTS:
        text = re.sub(rf'@"?tgc_{name}"?(?![\w.])', f'@"{prefix}_{name}"', text)
    return text


BLAS_CHOICES = ("none", "system", "numpy")
SYSTEM_LIBRARIES = ("openblas", "cblas", "blas")   # tried in this order by --blas=system

# C, compiled into every .so. {p}: the prefix; {required}: 1 when the generated code
# calls the table's BLAS unconditionally (--blas=numpy). ORDER/TRANS values are CBLAS's.
STUB = r"""#include <complex.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>

/* 1: the generated code calls the table's BLAS for every large product (--blas=numpy);
   0: it runs its own loops when the table has none. */
#define BLAS_REQUIRED {required}

void {p}_init(void* const* table);

extern void GOMP_parallel(void);
extern void GOMP_barrier(void);
extern int omp_get_thread_num(void);
extern int omp_get_num_threads(void);
extern int omp_get_max_threads(void);

typedef void (*lp64_sgemm_t)(int, int, int, int, int, int, float, const float*, int,
                             const float*, int, float, float*, int);
typedef void (*lp64_dgemm_t)(int, int, int, int, int, int, double, const double*, int,
                             const double*, int, double, double*, int);
static lp64_sgemm_t lp64_sgemm;
static lp64_dgemm_t lp64_dgemm;

#ifndef TGC_LP64_MAX
#define TGC_LP64_MAX INT_MAX
#endif

static int lp64_fits(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc) {{
  return m <= TGC_LP64_MAX && n <= TGC_LP64_MAX && k <= TGC_LP64_MAX && lda <= TGC_LP64_MAX &&
         ldb <= TGC_LP64_MAX && ldc <= TGC_LP64_MAX;
}}

/* C = alpha op(A) op(B) + beta C by its definition: a call whose sizes an LP64
   CBLAS cannot take. Column-major is the row-major product of the transposes. */
#define TGC_GEMM_BY_DEFINITION(NAME, T)                                                   \
  static void NAME(int32_t order, int32_t ta, int32_t tb, int64_t m, int64_t n, int64_t k, \
                   T alpha, const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c,  \
                   int64_t ldc) {{                                                          \
    if (order == 102) {{                                                                  \
      NAME(101, tb, ta, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);                     \
      return;                                                                             \
    }}                                                                                    \
    for (int64_t i = 0; i < m; i++)                                                       \
      for (int64_t j = 0; j < n; j++) {{                                                  \
        T s = 0;                                                                          \
        for (int64_t p = 0; p < k; p++)                                                   \
          s += (ta == 111 ? a[i * lda + p] : a[p * lda + i]) *                            \
               (tb == 111 ? b[p * ldb + j] : b[j * ldb + p]);                             \
        c[i * ldc + j] = (beta == 0 ? (T)0 : beta * c[i * ldc + j]) + alpha * s;         \
      }}                                                                                  \
  }}
TGC_GEMM_BY_DEFINITION(sgemm_by_definition, float)
TGC_GEMM_BY_DEFINITION(dgemm_by_definition, double)

/* The table's (ILP64) signature over an LP64 CBLAS. */
#define TGC_LP64_ADAPTER(NAME, T, TARGET, FALLBACK)                                       \
  static void NAME(int32_t order, int32_t ta, int32_t tb, int64_t m, int64_t n, int64_t k, \
                   T alpha, const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c,  \
                   int64_t ldc) {{                                                          \
    if (lp64_fits(m, n, k, lda, ldb, ldc))                                                \
      TARGET(order, ta, tb, (int)m, (int)n, (int)k, alpha, a, (int)lda, b, (int)ldb, beta, \
             c, (int)ldc);                                                                \
    else                                                                                  \
      FALLBACK(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);              \
  }}
TGC_LP64_ADAPTER(sgemm_lp64, float, lp64_sgemm, sgemm_by_definition)
TGC_LP64_ADAPTER(dgemm_lp64, double, lp64_dgemm, dgemm_by_definition)

/* Complex products (cgemm, zgemm): alpha and beta point to a complex number, A, B and C
   hold interleaved parts (C99's float complex), transposes may also be CblasConjTrans
   = 113 and CblasConjNoTrans = 114 (OpenBLAS's extension: the operand conjugated). */
#define TGC_COMPLEX_GEMM_BY_DEFINITION(NAME, T, CONJ)                                     \
  static void NAME(int32_t order, int32_t ta, int32_t tb, int64_t m, int64_t n, int64_t k, \
                   const void* alpha_, const void* a_, int64_t lda, const void* b_,         \
                   int64_t ldb, const void* beta_, void* c_, int64_t ldc) {{                 \
    const T* a = (const T*)a_;                                                            \
    const T* b = (const T*)b_;                                                            \
    T* c = (T*)c_;                                                                        \
    T alpha = *(const T*)alpha_, beta = *(const T*)beta_;                                 \
    if (order == 102) {{                                                                  \
      NAME(101, tb, ta, n, m, k, alpha_, b_, ldb, a_, lda, beta_, c_, ldc);                \
      return;                                                                             \
    }}                                                                                    \
    for (int64_t i = 0; i < m; i++)                                                       \
      for (int64_t j = 0; j < n; j++) {{                                                  \
        T s = 0;                                                                          \
        for (int64_t p = 0; p < k; p++) {{                                                \
          T x = (ta == 111 || ta == 114) ? a[i * lda + p] : a[p * lda + i];               \
          T y = (tb == 111 || tb == 114) ? b[p * ldb + j] : b[j * ldb + p];               \
          if (ta == 113 || ta == 114) x = CONJ(x);                                        \
          if (tb == 113 || tb == 114) y = CONJ(y);                                        \
          s += x * y;                                                                     \
        }}                                                                                \
        c[i * ldc + j] = (beta == 0 ? (T)0 : beta * c[i * ldc + j]) + alpha * s;         \
      }}                                                                                  \
  }}
TGC_COMPLEX_GEMM_BY_DEFINITION(cgemm_by_definition, float complex, conjf)
TGC_COMPLEX_GEMM_BY_DEFINITION(zgemm_by_definition, double complex, conj)

typedef void (*ilp64_complex_gemm_t)(int32_t, int32_t, int32_t, int64_t, int64_t, int64_t, const void*,
                                     const void*, int64_t, const void*, int64_t, const void*, void*, int64_t);
typedef void (*lp64_complex_gemm_t)(int, int, int, int, int, int, const void*, const void*, int,
                                    const void*, int, const void*, void*, int);

/* The caller's cgemm (zgemm) behind the table's ILP64 signature: an LP64 one gets int
   sizes, and a call it cannot take (sizes over an int, or CblasConjNoTrans when the
   caller did not say that its BLAS knows it) is computed by the definition. */
#define TGC_COMPLEX_ADAPTER(NAME, FALLBACK)                                               \
  static ilp64_complex_gemm_t NAME##_ilp64;                                               \
  static lp64_complex_gemm_t NAME##_lp64;                                                 \
  static int NAME##_conj_no_trans;                                                        \
  static void NAME(int32_t order, int32_t ta, int32_t tb, int64_t m, int64_t n, int64_t k, \
                   const void* alpha, const void* a, int64_t lda, const void* b,            \
                   int64_t ldb, const void* beta, void* c, int64_t ldc) {{                   \
    int known = NAME##_conj_no_trans || (ta != 114 && tb != 114);                         \
    if (known && NAME##_ilp64)                                                            \
      NAME##_ilp64(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);          \
    else if (known && NAME##_lp64 && lp64_fits(m, n, k, lda, ldb, ldc))                   \
      NAME##_lp64(order, ta, tb, (int)m, (int)n, (int)k, alpha, a, (int)lda, b, (int)ldb, \
                  beta, c, (int)ldc);                                                     \
    else                                                                                  \
      FALLBACK(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);              \
  }}
TGC_COMPLEX_ADAPTER(cgemm_adapted, cgemm_by_definition)
TGC_COMPLEX_ADAPTER(zgemm_adapted, zgemm_by_definition)

/* The complex GEMMs the library links, for {p}_init_blas and {p}_init_default:
   numpy's (ILP64, with CblasConjNoTrans) with --blas=numpy, the system CBLAS's (LP64)
   with --blas=system, none with --blas=none (whose code makes no complex call). */
{complex}

static int32_t init_table(int32_t int_bits, void* sgemm, void* dgemm, int32_t complex_bits,
                          int32_t conj_no_trans, void* cgemm, void* zgemm, void* get_threads,
                          void* set_threads) {{
  void* table[11] = {{NULL, NULL, (void*)GOMP_parallel, (void*)omp_get_thread_num,
                     (void*)omp_get_num_threads, get_threads, set_threads,
                     (void*)omp_get_max_threads, (void*)cgemm_adapted, (void*)zgemm_adapted,
                     (void*)GOMP_barrier}};
  if (BLAS_REQUIRED && (sgemm == NULL || dgemm == NULL)) return -1;
  if ((int_bits != 32 && int_bits != 64) || (complex_bits != 32 && complex_bits != 64)) return -1;
  if (int_bits == 64) {{
    table[0] = sgemm;
    table[1] = dgemm;
  }} else {{
    lp64_sgemm = (lp64_sgemm_t)sgemm;
    lp64_dgemm = (lp64_dgemm_t)dgemm;
    table[0] = sgemm ? (void*)sgemm_lp64 : NULL;
    table[1] = dgemm ? (void*)dgemm_lp64 : NULL;
  }}
  cgemm_adapted_ilp64 = complex_bits == 64 ? (ilp64_complex_gemm_t)cgemm : NULL;
  zgemm_adapted_ilp64 = complex_bits == 64 ? (ilp64_complex_gemm_t)zgemm : NULL;
  cgemm_adapted_lp64 = complex_bits == 32 ? (lp64_complex_gemm_t)cgemm : NULL;
  zgemm_adapted_lp64 = complex_bits == 32 ? (lp64_complex_gemm_t)zgemm : NULL;
  cgemm_adapted_conj_no_trans = zgemm_adapted_conj_no_trans = conj_no_trans != 0;
  {p}_init(table);
  return 0;
}}

int32_t {p}_init_blas(int32_t int_bits, void* sgemm, void* dgemm, void* get_threads,
                      void* set_threads) {{
  return init_table(int_bits, sgemm, dgemm, LINKED_COMPLEX_BITS, LINKED_CONJ_NO_TRANS, LINKED_CGEMM,
                    LINKED_ZGEMM, get_threads, set_threads);
}}

int32_t {p}_init_blas_complex(int32_t int_bits, int32_t conj_no_trans, void* sgemm, void* dgemm,
                              void* cgemm, void* zgemm, void* get_threads, void* set_threads) {{
  return init_table(int_bits, sgemm, dgemm, int_bits, conj_no_trans, cgemm, zgemm, get_threads,
                    set_threads);
}}

{default}
"""

DEFAULTS = {
    "none": """int32_t {p}_init_default(void) {{ return {p}_init_blas(64, NULL, NULL, NULL, NULL); }}""",
    "system": """extern void cblas_sgemm(void);
extern void cblas_dgemm(void);
extern int openblas_get_num_threads(void) __attribute__((weak));   /* OpenBLAS's only */
extern void openblas_set_num_threads(int) __attribute__((weak));
int32_t {p}_init_default(void) {{
  return {p}_init_blas(32, (void*)cblas_sgemm, (void*)cblas_dgemm, (void*)openblas_get_num_threads,
                       (void*)openblas_set_num_threads);
}}""",
    "numpy": """extern void scipy_cblas_sgemm64_(void);
extern void scipy_cblas_dgemm64_(void);
extern int scipy_openblas_get_num_threads64_(void);
extern void scipy_openblas_set_num_threads64_(int);
int32_t {p}_init_default(void) {{
  return {p}_init_blas(64, (void*)scipy_cblas_sgemm64_, (void*)scipy_cblas_dgemm64_,
                       (void*)scipy_openblas_get_num_threads64_, (void*)scipy_openblas_set_num_threads64_);
}}""",
}


COMPLEX_GEMMS = {
    "none": """#define LINKED_COMPLEX_BITS 64
#define LINKED_CONJ_NO_TRANS 1
#define LINKED_CGEMM NULL
#define LINKED_ZGEMM NULL""",
    # TGC_CONJ_NO_TRANS: 1 when the library linked is OpenBLAS (link_shared says so)
    "system": """#ifndef TGC_CONJ_NO_TRANS
#define TGC_CONJ_NO_TRANS 0
#endif
extern void cblas_cgemm(void);
extern void cblas_zgemm(void);
#define LINKED_COMPLEX_BITS 32
#define LINKED_CONJ_NO_TRANS TGC_CONJ_NO_TRANS
#define LINKED_CGEMM ((void*)cblas_cgemm)
#define LINKED_ZGEMM ((void*)cblas_zgemm)""",
    "numpy": """extern void scipy_cblas_cgemm64_(void);
extern void scipy_cblas_zgemm64_(void);
#define LINKED_COMPLEX_BITS 64
#define LINKED_CONJ_NO_TRANS 1
#define LINKED_CGEMM ((void*)scipy_cblas_cgemm64_)
#define LINKED_ZGEMM ((void*)scipy_cblas_zgemm64_)""",
}


def stub_source(prefix: str, blas: str) -> str:
    """The C source of a `.so`'s `PREFIX_init_blas`, `PREFIX_init_blas_complex` and
    `PREFIX_init_default`."""
    if blas not in BLAS_CHOICES:
        raise ValueError(f"unknown BLAS choice '{blas}' (one of {', '.join(BLAS_CHOICES)})")
    return STUB.format(p=prefix, required=int(blas == "numpy"), default=DEFAULTS[blas].format(p=prefix),
                       complex=COMPLEX_GEMMS[blas])


class NoSystemBlas(BuildError):
    """--blas=system on a machine without a CBLAS to link (no libopenblas-dev)."""


LINK_PREFIX = "tgc-link-"
STALE_SECONDS = 15 * 60   # a link takes seconds: an older folder's process was killed


def remove_stale_link_dirs(now: float | None = None) -> None:
    """Remove the temporary link folders that killed builds left behind: `tgc-link-*`
    folders in the temp directory, owned by this user (not symlinks), untouched for
    STALE_SECONDS."""
    import shutil
    import stat
    import time

    now = time.time() if now is None else now
    base = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(base) if n.startswith(LINK_PREFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and now - st.st_mtime > STALE_SECONDS:
            shutil.rmtree(path, ignore_errors=True)


def link_shared(obj: bytes, prefix: str, blas: str) -> bytes:
    """Link an object into a shared library with the system `cc`, with the init
    helpers and the BLAS `blas` names (see the module docstring); its bytes."""
    remove_stale_link_dirs()
    with tempfile.TemporaryDirectory(prefix=LINK_PREFIX) as tmp:
        o, stub, so = Path(tmp, "model.o"), Path(tmp, "init.c"), Path(tmp, "model.so")
        o.write_bytes(obj)
        stub.write_text(stub_source(prefix, blas))
        base = ["cc", "-shared", "-O2", "-fPIC", "-o", str(so), str(o), str(stub)]
        tail = ["-lgomp", "-lm", "-Wl,-z,defs", "-Wl,--build-id=sha1"]
        env = {**os.environ, "SOURCE_DATE_EPOCH": "0", "LC_ALL": "C"}   # C: the linker's messages are read
        if blas == "system":
            tried = []
            for name in SYSTEM_LIBRARIES:   # OpenBLAS's cgemm/zgemm take CblasConjNoTrans (its extension)
                cmd = base + (["-DTGC_CONJ_NO_TRANS=1"] if name == "openblas" else []) + [f"-l{name}"] + tail
                p = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=env)
                if p.returncode == 0:
                    return so.read_bytes()
                if f"cannot find -l{name}" not in p.stderr and "undefined reference to `cblas_" not in p.stderr:
                    raise BuildError(f"linking failed: {' '.join(cmd)}\n{p.stderr.strip()}")
                tried.append(f"-l{name}")   # absent, or a BLAS without the CBLAS interface
            raise NoSystemBlas(f"no system CBLAS to link (tried {', '.join(tried)}; the last said: "
                               f"{_last_line(p.stderr)}); install one (Debian/Ubuntu: apt-get install "
                               "libopenblas-dev), or build with --blas=none")
        if blas == "numpy":
            from tgc.backends.cpu.blas import openblas_path

            lib = Path(openblas_path())
            base += [f"-L{lib.parent}", f"-l:{lib.name}", f"-Wl,-rpath,{lib.parent}"]
        cmd = base + tail
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=env)
        if p.returncode != 0:
            raise BuildError(f"linking failed: {' '.join(cmd)}\n{p.stderr.strip()}")
        return so.read_bytes()


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(nothing)"


def build(module: Module, low: Lowered | None, options: Options, emit: str, prefix: str, source: str) -> bytes:
    """The bytes of one artifact kind (see EMITS) for a module after the IR pipeline
    and its lowered program (`tgc.pipeline.lower_module(module, options, "cpu")`; for
    the header, it says which bf16/f16 arguments and outputs are 2-byte arrays, and
    may be None: then they are taken as floats)."""
    from tgc.backends.cpu import llvm_env
    from tgc.backends.cpu.header import make_header

    if emit == "h":
        return make_header(module, prefix, options.dtype, source, options.cpu.blas, low).encode()
    text = llvm_text(low, options, prefix)
    opt = options.opt_level
    if emit == "llvm":
        return str(llvm_env.optimize(text, opt)).encode()
    if emit == "asm":
        return llvm_env.emit_asm(text, opt).encode()
    obj = llvm_env.emit_objects([text], opt)[0]   # in a child: an LLVM crash is an error, not an abort
    return obj if emit == "obj" else link_shared(obj, prefix, options.cpu.blas)
