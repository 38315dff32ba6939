"""Deployable libraries (`tgc build --blas`): what a `.so` links, and that it runs
from C outside any Python environment.

Each test builds examples/mlp.tg, copies the `.so` and its header into a folder of
their own (as a user deploying them would), compiles examples/c/mlp_main.c there,
and runs it with an empty environment (`env -i PATH=/usr/bin:/bin`). The printed
loss, probabilities and updated weights of two steps are checked against
`tgc.compile` of the same program. A batch of 512 makes products large enough for
BLAS; a preloaded shim counts the calls of `cblas_sgemm` to show which BLAS ran.

- --blas=none (the default): NEEDED only libgomp (and libc), no RPATH/RUNPATH, no
  BLAS symbol; the driver links no BLAS; with a mount namespace, it runs with the
  build's Python environment hidden (where --blas=numpy's library fails to load).
- the caller's BLAS through `mlp_init_blas`: the driver built with
  -DMLP_CALLER_BLAS and linked with the system OpenBLAS (LP64) passes it.
- --blas=system: a NEEDED entry on the system CBLAS, no RUNPATH; `mlp_init_default`.
- the LP64 adapter: sizes passed through as int, and a call whose sizes do not fit
  computed by its definition (the stub compiled with a small TGC_LP64_MAX).

The system BLAS is Debian's libopenblas-dev (`.ci/run` installs it as root); without
it those tests skip.
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import tgc
from tgc.backends.cpu import aot, blas
from tgc.cli import main

from system_blas import needs_openblas

ROOT = Path(__file__).parents[2]
MLP = ROOT / "examples/mlp.tg"
DRIVER = ROOT / "examples/c/mlp_main.c"
CLEAN_ENV = {"PATH": "/usr/bin:/bin"}
TOOLS = ("cc", "readelf", "nm", "ldd")

needs_toolchain = pytest.mark.skipif(any(shutil.which(t) is None for t in TOOLS),
                                     reason=f"needs a C toolchain ({', '.join(TOOLS)})")




# ---------------------------------------------------------------- helpers


def build_and_deploy(tmp_path: Path, *flags: str) -> Path:
    """Build libmlp.so + mlp.h with `flags`, copy both to a folder of their own."""
    out = tmp_path / "build"
    out.mkdir()
    r = CliRunner().invoke(main, ["build", str(MLP), "-o", str(out / "libmlp.so"), *flags])
    assert r.exit_code == 0, r.output
    deploy = tmp_path / "deploy"
    deploy.mkdir()
    for name in ("libmlp.so", "mlp.h"):
        shutil.copy2(out / name, deploy / name)
    assert not str(deploy.resolve()).startswith(str(Path(sys.prefix).resolve()))
    return deploy


def compile_driver(deploy: Path, *extra: str, name: str = "mlp_main") -> Path:
    exe = deploy / name
    subprocess.run(["cc", "-O2", "-std=c11", "-Wall", "-Werror", f"-I{deploy}", "-o", str(exe), str(DRIVER),
                    f"-L{deploy}", "-lmlp", "-Wl,-rpath,$ORIGIN", *extra, "-lm"], check=True)
    return exe


def dynamic_section(path: Path) -> tuple[list[str], list[str]]:
    """(NEEDED entries, RPATH and RUNPATH values) of an ELF file."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)
    paths = re.findall(r"\((?:RPATH|RUNPATH)\)\s+Library r(?:un)?path: \[(.+?)\]", out)
    return needed, paths


def undefined_symbols(path: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--undefined-only", str(path)], capture_output=True, text=True,
                         check=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}


def counting_shim(tmp_path: Path) -> Path:
    """A preloadable cblas_sgemm that counts its calls (printed to stderr at exit) and
    forwards them to the next definition (the real CBLAS)."""
    src = tmp_path / "count_sgemm.c"
    src.write_text(r"""#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
typedef void (*sgemm_t)(int, int, int, int, int, int, float, const float*, int, const float*, int,
                        float, float*, int);
static long calls;
static sgemm_t next;
static void report(void) { fprintf(stderr, "cblas_sgemm calls: %ld\n", calls); }
__attribute__((constructor)) static void start(void) { atexit(report); }
void cblas_sgemm(int o, int ta, int tb, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc) {
    if (!next) next = (sgemm_t)dlsym(RTLD_NEXT, "cblas_sgemm");
    calls++;
    next(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
""")
    shim = tmp_path / "count_sgemm.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(shim), str(src), "-ldl"], check=True)
    return shim


def run_clean(exe: Path, batch: int, preload: Path | None = None) -> tuple[str, int]:
    """Run the driver with an environment that names no Python environment; (stdout,
    cblas_sgemm calls counted by the shim, -1 without one)."""
    env = dict(CLEAN_ENV, **({"LD_PRELOAD": str(preload)} if preload else {}))
    p = subprocess.run([str(exe), str(batch)], capture_output=True, text=True, env=env, cwd=exe.parent)
    assert p.returncode == 0, p.stderr
    m = re.search(r"cblas_sgemm calls: (\d+)", p.stderr)
    return p.stdout, int(m.group(1)) if m else -1


def assert_loads_nothing_from_python(exe: Path) -> None:
    out = subprocess.run(["ldd", str(exe)], capture_output=True, text=True, env=CLEAN_ENV, check=True).stdout
    assert "not found" not in out, out
    for marker in (str(Path(sys.prefix).resolve()), "site-packages", "numpy.libs", "scipy_openblas"):
        assert marker not in out, out


def mlp_inputs(batch: int) -> dict:
    """The inputs mlp_main.c builds, in numpy (float32, as C computes them)."""
    def filled(n, scale, freq, phase):
        return (scale * np.sin(freq * np.arange(n, dtype=np.float64) + phase)).astype(np.float32)
    y = np.zeros((batch, 3), np.float32)
    y[np.arange(batch), np.arange(batch) % 3] = 1
    return {"x": filled(batch * 13, 1.0, 0.37, 0.1).reshape(batch, 13), "y": y,
            "W1": filled(13 * 64, 0.3, 0.71, 0.2).reshape(13, 64), "b1": filled(64, 0.05, 0.13, 0.3),
            "W2": filled(64 * 3, 0.3, 0.53, 0.4).reshape(64, 3), "b2": filled(3, 0.05, 1.1, 0.5),
            "lr": np.float32(0.1)}


def check_against_jit(stdout: str, batch: int) -> None:
    """The driver's two printed steps equal tgc.compile's (to f32 and printing)."""
    got = [dict(re.findall(r"(\w+(?:\[0\])?) ([-\d.e+]+)", line)) for line in stdout.splitlines()]
    assert len(got) == 2, stdout
    program = tgc.compile(str(MLP))
    inputs = mlp_inputs(batch)
    for step in got:
        r = program(**inputs)                    # params updated in place, as in C
        want = {"loss": float(r["loss"]), "probs_mean": float(np.mean(r["probs"], dtype=np.float64)),
                "W2[0]": float(inputs["W2"][0, 0]), "b1[0]": float(inputs["b1"][0])}
        for key, value in want.items():
            assert float(step[key]) == pytest.approx(value, rel=1e-5, abs=1e-7), (key, stdout)


# ---------------------------------------------------------------- --blas=none


@needs_toolchain
def test_default_library_needs_no_blas_and_no_python(tmp_path):
    deploy = build_and_deploy(tmp_path)                  # --blas=none is the default
    needed, paths = dynamic_section(deploy / "libmlp.so")
    assert paths == []
    assert set(needed) <= {"libgomp.so.1", "libc.so.6"} and "libgomp.so.1" in needed, needed
    assert not any("gemm" in s or "blas" in s.lower() for s in undefined_symbols(deploy / "libmlp.so"))
    exe = compile_driver(deploy)                         # linked with no BLAS at all
    assert not any("blas" in n for n in dynamic_section(exe)[0])
    assert_loads_nothing_from_python(exe)
    for batch in (8, 512):
        out, _ = run_clean(exe, batch)
        check_against_jit(out, batch)


def _mount_namespaces_work() -> bool:
    if shutil.which("unshare") is None or sys.prefix == sys.base_prefix:
        return False
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    return p.returncode == 0


@needs_toolchain
@pytest.mark.skipif(not _mount_namespaces_work(),
                    reason="hiding the venv needs a venv and mount namespaces (unshare -m, as root)")
def test_library_runs_with_the_python_environment_gone(tmp_path):
    """The venv that built the library hidden under an empty tmpfs: the default
    library still runs; --blas=numpy's (today's former default) no longer loads."""
    runs = {}
    for blas_choice in ("none", "numpy"):
        (tmp_path / blas_choice).mkdir()
        runs[blas_choice] = compile_driver(build_and_deploy(tmp_path / blas_choice, f"--blas={blas_choice}"))
    venv = str(Path(sys.prefix).resolve())
    script = (f"mount -t tmpfs none '{venv}' && test -z \"$(ls -A '{venv}')\" && "
              f"'{runs['none']}' 8 && {{ '{runs['numpy']}' 8; echo numpy-exit=$?; }}")
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                       capture_output=True, text=True, env=CLEAN_ENV)
    assert p.returncode == 0, p.stderr
    check_against_jit(p.stdout.split("numpy-exit")[0], 8)
    assert "numpy-exit=127" in p.stdout and "libscipy_openblas" in p.stderr, p.stdout + p.stderr


# ---------------------------------------------------------------- the caller's BLAS, --blas=system


@needs_toolchain
@needs_openblas
def test_caller_passes_the_system_openblas_through_the_init_table(tmp_path):
    deploy = build_and_deploy(tmp_path)
    exe = compile_driver(deploy, "-DMLP_CALLER_BLAS", "-lopenblas", name="mlp_main_blas")
    assert_loads_nothing_from_python(exe)
    shim = counting_shim(tmp_path)
    out, calls = run_clean(exe, 512, shim)
    check_against_jit(out, 512)
    assert calls > 0                                     # the products went to OpenBLAS
    out, calls = run_clean(compile_driver(deploy), 512, shim)
    assert calls == 0                                    # mlp_init_default: no BLAS, tgc's loops
    check_against_jit(out, 512)


@needs_toolchain
@needs_openblas
def test_blas_system_links_the_system_cblas(tmp_path):
    deploy = build_and_deploy(tmp_path, "--blas=system")
    needed, paths = dynamic_section(deploy / "libmlp.so")
    assert paths == []
    assert "libopenblas.so.0" in needed and set(needed) <= {"libopenblas.so.0", "libgomp.so.1", "libc.so.6"}
    exe = compile_driver(deploy)
    assert_loads_nothing_from_python(exe)
    out, calls = run_clean(exe, 512, counting_shim(tmp_path))
    check_against_jit(out, 512)
    assert calls > 0
    assert "links the system's CBLAS" in (deploy / "mlp.h").read_text()


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs cc")
def test_blas_system_without_a_system_cblas_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(aot, "SYSTEM_LIBRARIES", ("tgc_no_such_blas",))
    out = tmp_path / "libmlp.so"
    r = CliRunner().invoke(main, ["build", str(MLP), "-o", str(out), "--blas=system"])
    assert r.exit_code == 2, r.output
    assert "no system CBLAS" in r.output and "libopenblas-dev" in r.output and "--blas=none" in r.output
    assert "Traceback" not in r.output
    assert list(tmp_path.iterdir()) == []                # nothing written
    r = CliRunner().invoke(main, ["build", str(MLP), "-o", str(out), "--blas=mkl"])
    assert r.exit_code == 2 and "'mkl' is not one of" in r.output


# ---------------------------------------------------------------- --blas=numpy


@needs_toolchain
def test_blas_numpy_links_numpys_openblas_with_a_runpath(tmp_path):
    """Today's library, kept on request: numpy's OpenBLAS through a RUNPATH into this
    environment. Its code needs a BLAS, so _init_blas refuses none."""
    r = CliRunner().invoke(main, ["build", str(MLP), "-o", str(tmp_path / "libmlp.so"), "--blas=numpy"])
    assert r.exit_code == 0, r.output
    needed, paths = dynamic_section(tmp_path / "libmlp.so")
    assert any("scipy_openblas" in n for n in needed)
    assert paths == [str(Path(blas.openblas_path()).parent)]
    lib = ctypes.CDLL(str(tmp_path / "libmlp.so"))
    lib.mlp_init_blas.argtypes = [ctypes.c_int32] + [ctypes.c_void_p] * 4
    assert lib.mlp_init_blas(64, None, None, None, None) == -1
    addr = blas.gemm_addresses()
    assert lib.mlp_init_blas(16, addr["sgemm"], addr["dgemm"], None, None) == -1
    assert lib.mlp_init_blas(64, addr["sgemm"], addr["dgemm"], None, None) == 0
    assert lib.mlp_init_default() == 0
    assert "RUNPATH into the Python environment" in (tmp_path / "mlp.h").read_text()


# ---------------------------------------------------------------- the LP64 adapter


HARNESS = r"""#include <stdint.h>
#include <string.h>
static void* table[8];
void t_init(void* const* t) { memcpy(table, t, sizeof table); }
void* t_slot(int i) { return table[i]; }
long fake_calls;
int fake_args[9];
/* an LP64 sgemm that records its integer arguments and computes nothing */
void fake_sgemm(int o, int ta, int tb, int m, int n, int k, float alpha, const float* a, int lda,
                const float* b, int ldb, float beta, float* c, int ldc) {
    int v[9] = {o, ta, tb, m, n, k, lda, ldb, ldc};
    (void)alpha; (void)a; (void)b; (void)beta; (void)c;
    memcpy(fake_args, v, sizeof v);
    fake_calls++;
}
void fake_dgemm(int o, int ta, int tb, int m, int n, int k, double alpha, const double* a, int lda,
                const double* b, int ldb, double beta, double* c, int ldc) {
    int v[9] = {o, ta, tb, m, n, k, lda, ldb, ldc};
    (void)alpha; (void)a; (void)b; (void)beta; (void)c;
    memcpy(fake_args, v, sizeof v);
    fake_calls++;
}
"""

LP64_MAX = 40


@pytest.fixture(scope="module")
def adapter_library(tmp_path_factory):
    """The --blas=none stub compiled with int sizes capped at LP64_MAX, and fake LP64 GEMMs."""
    if shutil.which("cc") is None:
        pytest.skip("needs cc")
    d = tmp_path_factory.mktemp("adapter")
    (d / "stub.c").write_text(aot.stub_source("t", "none"))
    (d / "harness.c").write_text(HARNESS)
    so = d / "libadapter.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror", f"-DTGC_LP64_MAX={LP64_MAX}",
                    "-o", str(so), str(d / "stub.c"), str(d / "harness.c"), "-lgomp"], check=True)
    lib = ctypes.CDLL(str(so))
    lib.t_init_blas.argtypes = [ctypes.c_int32] + [ctypes.c_void_p] * 4
    lib.t_slot.restype = ctypes.c_void_p
    return lib


@pytest.fixture
def adapter(adapter_library):
    """The capped stub, initialized with the fake GEMMs as LP64 (int_bits 32)."""
    lib = adapter_library
    fake = {n: ctypes.cast(getattr(lib, f"fake_{n}"), ctypes.c_void_p).value for n in ("sgemm", "dgemm")}
    assert lib.t_init_blas(32, fake["sgemm"], fake["dgemm"], None, None) == 0
    return lib


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["s", "d"])
def test_lp64_adapter_passes_sizes_as_int(adapter, dtype):
    slot = adapter.t_slot(0 if dtype == np.float32 else 1)
    ct = ctypes.c_float if dtype == np.float32 else ctypes.c_double
    before = ctypes.c_long.in_dll(adapter, "fake_calls").value
    blas.gemm_ctypes(ct)(slot)(101, 111, 112, 7, 9, 11, 1.0, None, 40, None, 39, 0.0, None, 38)
    assert ctypes.c_long.in_dll(adapter, "fake_calls").value == before + 1
    assert list((ctypes.c_int * 9).in_dll(adapter, "fake_args")) == [101, 111, 112, 7, 9, 11, 40, 39, 38]


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["s", "d"])
@pytest.mark.parametrize("order", [101, 102], ids=["row", "col"])
@pytest.mark.parametrize("ta", [111, 112], ids=["N", "T"])
@pytest.mark.parametrize("tb", [111, 112], ids=["N", "T"])
@pytest.mark.parametrize("beta", [0.0, -0.5])
def test_lp64_adapter_computes_a_call_too_large_for_int(adapter, dtype, order, ta, tb, beta):
    """m = 45 > the cap: the adapter computes C = alpha op(A) op(B) + beta C itself
    (beta 0: C's old values, NaN here, are not read), row- or column-major, with
    leading dimensions over the widths."""
    m, n, k = 45, 13, 17
    rng = np.random.default_rng(0)
    # an operand stored row-major as R is R itself; column-major, the matrix is R.T
    rows = lambda r, c: (r, c) if order == 101 else (c, r)  # noqa: E731
    a_rows = rows(*((k, m) if ta == 112 else (m, k)))
    b_rows = rows(*((n, k) if tb == 112 else (k, n)))
    A = rng.standard_normal((a_rows[0], a_rows[1] + 3)).astype(dtype)
    B = rng.standard_normal((b_rows[0], b_rows[1] + 2)).astype(dtype)
    c_rows = rows(m, n)
    C = np.full((c_rows[0], c_rows[1] + 1), np.nan if beta == 0 else 0.25, dtype)
    mat = lambda x, r: (x[:, :r[1]] if order == 101 else x[:, :r[1]].T).astype(np.float64)  # noqa: E731
    opA, opB = mat(A, a_rows), mat(B, b_rows)
    opA, opB = (opA.T if ta == 112 else opA), (opB.T if tb == 112 else opB)
    want = 1.5 * opA @ opB + (beta * mat(C, c_rows) if beta else 0)
    before = ctypes.c_long.in_dll(adapter, "fake_calls").value
    ct = ctypes.c_float if dtype == np.float32 else ctypes.c_double
    fn = blas.gemm_ctypes(ct)(adapter.t_slot(0 if dtype == np.float32 else 1))
    fn(order, ta, tb, m, n, k, 1.5, A.ctypes.data, A.shape[1], B.ctypes.data, B.shape[1], beta,
       C.ctypes.data, C.shape[1])
    assert ctypes.c_long.in_dll(adapter, "fake_calls").value == before     # not passed on
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(mat(C, c_rows), want, rtol=tol, atol=tol)


def test_init_blas_refuses_another_int_width(adapter):
    assert adapter.t_init_blas(16, None, None, None, None) == -1
    assert adapter.t_init_blas(64, None, None, None, None) == 0          # none: no BLAS is fine
    assert adapter.t_slot(0) is None and adapter.t_slot(2) is not None  # libgomp's entries given
