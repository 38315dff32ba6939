"""Ahead-of-time builds: LLVM text, assembly, an object, a `.so` and its C header.

The exported symbols of the generated code (`tgc_init`, `tgc_run`,
`tgc_workspace_bytes`) are renamed to `PREFIX_*`, so several models can live in
one program. A `.so` also gets `PREFIX_init_default()`, which fills the function
table from the libraries it is linked against: numpy's bundled OpenBLAS (ILP64,
`scipy_cblas_[sd]gemm64_`, found at build time and recorded as an rpath) and
libgomp. Code is tuned for the building machine's CPU (like -march=native).

Every artifact is a pure function of the module, the options and the prefix.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

from tgc.ir.module import Module
from tgc.options import Options

EXPORTS = ("init", "run", "workspace_bytes")
EMITS = ("so", "obj", "llvm", "asm", "h")


class BuildError(RuntimeError):
    """The system toolchain (cc) failed to link the library."""


def llvm_text(module: Module, options: Options, prefix: str) -> str:
    """Unoptimized LLVM IR of the whole program, exports named `PREFIX_*`."""
    from tgc.backends.cpu import codegen
    from tgc.passes.plan import lower_module

    text = codegen.generate(lower_module(module, options), options)
    for name in EXPORTS:
        text = re.sub(rf'@"?tgc_{name}"?(?![\w.])', f'@"{prefix}_{name}"', text)
    return text


_STUB = """#include <stdint.h>
extern void scipy_cblas_sgemm64_(void);
extern void scipy_cblas_dgemm64_(void);
extern void GOMP_parallel(void);
extern int omp_get_thread_num(void);
extern int omp_get_num_threads(void);
extern int omp_get_max_threads(void);
extern int scipy_openblas_get_num_threads64_(void);
extern void scipy_openblas_set_num_threads64_(int);
void {p}_init(void* const* table);
int32_t {p}_init_default(void) {{
  void* table[8] = {{(void*)scipy_cblas_sgemm64_, (void*)scipy_cblas_dgemm64_, (void*)GOMP_parallel,
                    (void*)omp_get_thread_num, (void*)omp_get_num_threads,
                    (void*)scipy_openblas_get_num_threads64_, (void*)scipy_openblas_set_num_threads64_,
                    (void*)omp_get_max_threads}};
  {p}_init(table);
  return 0;
}}
"""


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


def link_shared(obj: bytes, prefix: str) -> bytes:
    """Link an object into a shared library with the system `cc`; its bytes."""
    from tgc.backends.cpu.blas import openblas_path

    blas = Path(openblas_path())
    remove_stale_link_dirs()
    with tempfile.TemporaryDirectory(prefix=LINK_PREFIX) as tmp:
        o, stub, so = Path(tmp, "model.o"), Path(tmp, "init_default.c"), Path(tmp, "model.so")
        o.write_bytes(obj)
        stub.write_text(_STUB.format(p=prefix))
        cmd = ["cc", "-shared", "-O2", "-fPIC", "-o", str(so), str(o), str(stub),
               f"-L{blas.parent}", f"-l:{blas.name}", f"-Wl,-rpath,{blas.parent}", "-lgomp",
               "-Wl,--build-id=sha1"]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp,
                           env={**os.environ, "SOURCE_DATE_EPOCH": "0"})
        if p.returncode != 0:
            raise BuildError(f"linking failed: {' '.join(cmd)}\n{p.stderr.strip()}")
        return so.read_bytes()


def build(module: Module, options: Options, emit: str, prefix: str, source: str) -> bytes:
    """The bytes of one artifact kind (see EMITS) for a module after the IR pipeline."""
    from tgc.backends.cpu import llvm_env
    from tgc.backends.cpu.header import make_header

    if emit == "h":
        return make_header(module, prefix, options.dtype, source).encode()
    text = llvm_text(module, options, prefix)
    opt = options.opt_level
    if emit == "llvm":
        return str(llvm_env.optimize(text, opt)).encode()
    if emit == "asm":
        return llvm_env.emit_asm(text, opt).encode()
    obj = llvm_env.emit_objects([text], opt)[0]   # in a child: an LLVM crash is an error, not an abort
    return obj if emit == "obj" else link_shared(obj, prefix)
