"""Hardening: no code from caches, sizes that overflow, special files, hostile
inputs; each case is a clear error (or a refusal), never a crash or a traceback."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tgc

ROOT = Path(__file__).resolve().parents[2]


def tgc_cli(*args, cwd=None, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "tgc.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, **(env or {})}, timeout=timeout)


# ------------------------------------------------------------ the parser reads no cache file

def test_parser_tables_are_current_and_loaded():
    """The shipped tables are for this grammar (else `python -m tgc.frontend.parser`),
    are what the parser uses, and parse like tables built from the grammar."""
    import json

    from lark import Lark

    from tgc.frontend import parser

    grammar = parser._grammar_path().read_text(encoding="utf-8")
    tables = json.loads(parser._TABLES.read_text(encoding="utf-8"))
    assert tables["grammar_sha256"] == parser._grammar_digest(grammar), \
        "run `python -m tgc.frontend.parser` after changing the grammar"
    shipped = parser._lark()
    assert shipped.source_path == "<deserialized>" and not shipped.options.cache
    fresh = Lark(grammar, postlex=parser._POSTLEX, transformer=parser._BUILDER, **parser._OPTIONS)
    for path in sorted((ROOT / "examples").glob("*.tg")):
        text = path.read_text()
        parser._BUILDER.start_parse(str(path))
        a = shipped.parse(text)
        parser._BUILDER.start_parse(str(path))
        assert fresh.parse(text) == a, path


def test_check_reads_and_writes_nothing_in_the_temp_dir(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    planted = tmp / ".lark_cache_planted.tmp"
    planted.write_bytes(b"not a pickle")
    r = tgc_cli("check", ROOT / "examples" / "mlp.tg", env={"TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp.iterdir()) == [planted.name]


# ------------------------------------------------------------ sizes over 2^62

HUGE = "dim a\ndim m = a*a*a*a\ndim b = m / (a*a*a)\ninput x[b]\nout s = sum(x)\n"


@pytest.mark.parametrize("backend", ["interp", "cpu"])
def test_a_derived_size_over_2_62_is_exit_3(tmp_path, backend):
    src = tmp_path / "huge.tg"
    src.write_text(HUGE)
    np.savez(tmp_path / "x.npz", x=np.ones(2_000_000, np.float32))
    r = tgc_cli("run", src, "--inputs", tmp_path / "x.npz", "--dim", "a=2000000", "--backend", backend)
    assert r.returncode == 3, r.stderr
    assert "2^62" in r.stderr and "Traceback" not in r.stderr
    np.savez(tmp_path / "y.npz", x=np.ones(40_000, np.float32))   # a^4 fits: the right sum
    r = tgc_cli("run", src, "--inputs", tmp_path / "y.npz", "--dim", "a=40000", "--backend", backend)
    assert r.returncode == 0 and "40000" in r.stdout, r.stderr


def test_the_runtime_checks_every_size_at_bind_time():
    prog = tgc.compile(HUGE)
    with pytest.raises(tgc.ir.interp.EvalError, match="2\\^62"):
        prog.run({"x": np.ones(3, np.float32)}, dims={"a": 2_000_000})
    big = tgc.compile("dim n\ninput x[n]\ndim k = n * n * n\nout y = sum(x) * size(k)\n")
    with pytest.raises(tgc.ir.interp.EvalError, match="2\\^62"):
        big(x=np.ones(2_000_000, np.float32))
    assert big(x=np.ones(4, np.float32))["y"] == 4 * 64


@pytest.mark.parametrize("batch", ["4611686018427387904", "4611686018427387903", "99999999999999999999"])
def test_a_huge_dim_on_the_command_line_is_exit_3(batch):
    r = tgc_cli("run", ROOT / "examples" / "mlp.tg", "--random-inputs", "--dim", f"batch={batch}")
    assert r.returncode in (2, 3), r.stderr
    assert "Traceback" not in r.stderr and "internal compiler error" not in r.stderr


@pytest.mark.parametrize("source, line, col, what", [
    ("dim n = 4611686018427387904\ninput x[n]\nout y = x * 2\n", 2, 7, "input 'x'"),
    ("dim n = 2305843009213693952\nparam w: f64[n]\nout y = w * 2\n", 2, 7, "param 'w'"),
    ("dim n = 3037000500\ninput x[n]\ninput y[m: n]\nout z = x * y\n", 4, 5, "output 'z'"),
    ("dim n = 1152921504606846976\ninput x: f32[n]\nout y = x * 2\n", 2, 7, "input 'x'"),   # f64 buffer
])
def test_a_tensor_of_fixed_sizes_over_2_62_bytes_is_a_source_error(tmp_path, source, line, col, what):
    """No call could run such a tensor, so `tgc check` reports it where it is declared
    (before, check passed and every run failed with exit 3)."""
    src = tmp_path / "huge.tg"
    src.write_text(source)
    r = tgc_cli("check", src, "--dtype", "f64")
    assert r.returncode == 1, r.stderr
    assert f"huge.tg:{line}:{col}: error: {what} would take more than 2^62 bytes" in r.stderr
    ok = tmp_path / "ok.tg"   # 2^60 f32 elements: exactly 2^62 bytes, which fits
    ok.write_text("dim n = 1152921504606846976\ninput x[n]\nout y = x * 2\n")
    assert tgc_cli("check", ok).returncode == 0


def _build(tmp_path, source, name):
    import shutil

    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler (cc)")
    src = tmp_path / f"{name}.tg"
    src.write_text(source)
    r = tgc_cli("build", src, "-o", tmp_path / f"lib{name}.so", "--dtype", "f64")
    assert r.returncode == 0, r.stderr
    import ctypes

    lib = ctypes.CDLL(str(tmp_path / f"lib{name}.so"))
    assert getattr(lib, f"{name}_init_default")() == 0
    getattr(lib, f"{name}_workspace_bytes").restype = ctypes.c_int64
    return lib, (tmp_path / f"{name}.h").read_text()


def test_the_lowered_backend_refuses_a_loop_nest_deeper_than_numpy_broadcasts():
    """40 edges (all but one of size 1): the lowered backend's numpy reference broadcasts
    at most 32 axes, so it says so (an EvalError naming the backends that run it), where
    numpy's RuntimeError came out of the call; interp and cpu run it."""
    from tgc.ir.interp import EvalError

    n = 40
    src = "".join(f"dim d{i} = 1\n" for i in range(n)) + "dim k = 3\n"
    src += f"input x[{', '.join(f'd{i}' for i in range(n))}, k]\nout s = sum(x)\nout z = x * 2\n"
    x = np.arange(3.0).reshape((1,) * n + (3,))
    with pytest.raises(EvalError, match="at most 32 loops.*interp and cpu"):
        tgc.compile(src, backend="lowered", dtype="f64")(x=x)
    assert float(tgc.compile(src, backend="cpu", dtype="f64")(x=x)["s"]) == 3.0


@pytest.mark.parametrize("backend", ["interp", "cpu"])
def test_a_tensor_with_more_edges_than_einsum_letters_runs(backend):
    """60 edges (numpy's einsum names at most 52), all but one of size 1: the reference
    interpreter indexed past its letters (an IndexError out of the call)."""
    n = 60
    dims = "".join(f"dim d{i} = 1\n" for i in range(n))
    edges = ", ".join(f"d{i}" for i in range(n))
    src = f"{dims}dim k = 3\ninput x[{edges}, k]\ninput w[k]\nout s = sum(x)\nout c = x @ w\nout z = x * 2\n"
    x = np.arange(3.0).reshape((1,) * n + (3,))
    w = np.array([1.0, 10.0, 100.0])
    got = tgc.compile(src, backend=backend, dtype="f64")(x=x, w=w)
    assert float(got["s"]) == 3.0
    assert np.asarray(got["c"]).shape == (1,) * n and float(np.asarray(got["c"]).ravel()[0]) == 210.0
    np.testing.assert_array_equal(got["z"], 2 * x)


def test_the_c_abi_refuses_bad_dims_and_null_pointers(tmp_path):
    import ctypes

    lib, header = _build(tmp_path, "dim n\ninput x[n]\nt = exp(x) * x\nout y[n] = t / sum(t)\n", "m")
    assert "M_ERR_SIZE (-3)" in header and "M_ERR_NULL (-4)" in header and "NULL" in header
    ws_bytes, run = lib.m_workspace_bytes, lib.m_run
    Dims = ctypes.c_int64 * 1
    x, y = np.linspace(0, 1, 5), np.zeros(5)
    args, outs = (ctypes.c_void_p * 1)(x.ctypes.data), (ctypes.c_void_p * 1)(y.ctypes.data)
    ws = np.zeros(1 << 16, np.uint8)
    w = ctypes.c_void_p(ws.ctypes.data + (-ws.ctypes.data) % 64)
    assert 0 <= ws_bytes(Dims(5)) < 1 << 16
    for bad in (0, -1, 2**62 + 1, 2**63 - 1, 2**61):   # 2^61 f64 elements: 2^64 bytes
        assert ws_bytes(Dims(bad)) == -1, bad
        assert run(Dims(bad), args, outs, w) == -3, bad
    assert ws_bytes(None) == -1
    assert run(None, args, outs, w) == -4
    assert run(Dims(5), None, outs, w) == -4
    assert run(Dims(5), args, None, w) == -4
    assert run(Dims(5), (ctypes.c_void_p * 1)(None), outs, w) == -4
    assert run(Dims(5), args, (ctypes.c_void_p * 1)(None), w) == -4
    assert not y.any()                                     # nothing was written
    assert run(Dims(5), args, outs, w) == 0
    np.testing.assert_allclose(y, np.exp(x) * x / (np.exp(x) * x).sum())


def test_the_c_abi_checks_derived_sizes(tmp_path):
    import ctypes

    lib, _ = _build(tmp_path, HUGE, "h")
    x = np.ones(40_000)
    args, out = (ctypes.c_void_p * 1)(x.ctypes.data), np.zeros(())
    outs = (ctypes.c_void_p * 1)(out.ctypes.data)
    dims = (ctypes.c_int64 * 1)
    assert lib.h_workspace_bytes(dims(2_000_000)) == -1
    assert lib.h_run(dims(2_000_000), args, outs, None) == -3
    assert lib.h_run(dims(40_000), args, outs, None) == 0 and out == 40_000


def test_the_c_abi_checks_index_expressions(tmp_path):
    """`x[t = 2^40 s + 3]` over a symbolic `s`: at n = 2^23 + 2 the index passes 2^63,
    where int64 arithmetic wraps into range. The Python runtime refuses those sizes
    (tests/runtime/test_memory_errors.py); the C library did not, and its call read
    out of bounds (a segfault). It refuses them as any size over 2^62, before reading
    anything (the arrays here are too small for n: a read would show)."""
    import ctypes

    lib, _ = _build(tmp_path, "dim n\ninput x[t: n]\ninput z[s: n]\nout y = x[t = 1099511627776*s + 3] + z\n", "ix")
    dims = ctypes.c_int64 * 1
    x, z, y = np.arange(5, dtype=np.float64), np.ones(5), np.zeros(5)
    args = (ctypes.c_void_p * 2)(x.ctypes.data, z.ctypes.data)
    outs = (ctypes.c_void_p * 1)(y.ctypes.data)
    ws = np.zeros(1 << 12, np.uint8)
    w = ctypes.c_void_p(ws.ctypes.data + (-ws.ctypes.data) % 64)
    for n in (2 ** 23 + 2, 2 ** 40):
        assert lib.ix_workspace_bytes(dims(n)) == -1, n
        assert lib.ix_run(dims(n), args, outs, w) == -3, n
    assert not y.any()
    assert 0 <= lib.ix_workspace_bytes(dims(2 ** 22)) < 1 << 12   # 2^40 (2^22 - 1) + 3 < 2^62
    assert lib.ix_run(dims(5), args, outs, w) == 0
    np.testing.assert_array_equal(y, [4, 1, 1, 1, 1])


def test_a_library_built_from_ir_with_an_index_past_int64_refuses_every_call(tmp_path):
    """IR text is not checked by the front end: `t = 2^62 s` over s < 3 reaches 2^63 at
    fixed sizes. The library's size check refuses every call, as the runtime does."""
    import ctypes

    ir = tgc.compile("dim n = 3\ninput x[t: n]\ninput z[s: n]\nout y = x[t = 2*s] + z\n", backend="interp").ir()
    assert "indicator[t = 2*s]" in ir
    (tmp_path / "fx.tgir").write_text(ir.replace("2*s", "4611686018427387904*s"))
    r = tgc_cli("build", tmp_path / "fx.tgir", "-o", tmp_path / "libfx.so", "--dtype", "f64")
    if r.returncode == 2:   # refused at build time: as good
        assert "2^62" in r.stderr and "Traceback" not in r.stderr
        return
    assert r.returncode == 0, r.stderr
    lib = ctypes.CDLL(str(tmp_path / "libfx.so"))
    assert lib.fx_init_default() == 0
    x, z, y = np.arange(1.0, 4.0), np.zeros(3), np.full(3, -7.0)
    args = (ctypes.c_void_p * 2)(x.ctypes.data, z.ctypes.data)
    outs = (ctypes.c_void_p * 1)(y.ctypes.data)
    ws = np.zeros(1 << 12, np.uint8)
    w = ctypes.c_void_p(ws.ctypes.data + (-ws.ctypes.data) % 64)
    assert lib.fx_workspace_bytes(None) == -1
    assert lib.fx_run(None, args, outs, w) == -3
    assert (y == -7).all()


@pytest.mark.parametrize("dims", [{"a": 2_000_000}, {"a": 2.5}, {"a": "3"}, {"a": 0}, {"a": 2**62 + 1}])
def test_dims_fixed_at_build_time_are_checked(dims):
    with pytest.raises(ValueError, match="2\\^62|positive integer"):
        tgc.compile(HUGE, dims=dims)


def test_build_refuses_a_fixed_dim_whose_derived_size_overflows(tmp_path):
    src = tmp_path / "huge.tg"
    src.write_text(HUGE)
    r = tgc_cli("build", src, "-D", "a=2000000", "-o", tmp_path / "libh.so")
    assert r.returncode == 2 and "2^62" in r.stderr and not (tmp_path / "libh.so").exists()


# ------------------------------------------------------------ -o: devices and FIFOs are written, never replaced

def test_output_to_a_device_or_fifo_writes_into_it(tmp_path):
    import stat
    import threading

    src = ROOT / "examples" / "mlp.tg"
    null = tmp_path / "null"
    try:
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        os.symlink("/dev/null", null)
    for cmd in (["dump-ir", src, "-o", null], ["build", src, "-o", null]):
        r = tgc_cli(*cmd, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert stat.S_ISCHR(os.stat(null).st_mode), cmd
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    r = tgc_cli("dump-ir", src, "-o", fifo)
    reader.join(60)
    assert r.returncode == 0, r.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and got and got[0].startswith(b"dim batch")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "null"]   # no header beside a device


def test_a_full_disk_names_the_file(tmp_path, monkeypatch):
    import errno

    from tgc import fsutil

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fsutil.os, "fsync", full)
    target = tmp_path / "out.txt"
    with pytest.raises(OSError) as e:
        fsutil.write_atomic(target, "text")
    assert e.value.filename == str(target) and e.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------ imports stay inside their folder (or -I)

@pytest.mark.slow
def test_imports_are_relative_and_confined(tmp_path):
    lib = tmp_path / "lib"
    sub = tmp_path / "proj" / "sub"
    lib.mkdir()
    sub.mkdir(parents=True)
    (lib / "f.tg").write_text("fn twice(a) {\n  return a * 2\n}\n")
    (sub / "g.tg").write_text("fn thrice(a) {\n  return a * 3\n}\n")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP SECRET first line\n")
    main = tmp_path / "proj" / "main.tg"
    for imp, ok in [('"sub/g.tg"', True), ('"../lib/f.tg"', False), (f'"{lib / "f.tg"}"', False),
                    (f'"{secret}"', False), ('"../secret.txt"', False), ('"/etc/passwd"', False)]:
        main.write_text(f"import {imp}\ndim n\ninput x[n]\nout y[n] = x\n")
        r = tgc_cli("check", main)
        assert (r.returncode == 0) == ok, (imp, r.stderr)
        assert "SECRET" not in r.stderr and "root:" not in r.stderr, imp
    main.write_text('import "f.tg"\ndim n\ninput x[n]\nout y[n] = twice(x)\n')
    assert tgc_cli("check", main).returncode == 1
    r = tgc_cli("check", "-I", lib, main)          # -I: another folder imports may come from
    assert r.returncode == 0, r.stderr
    main.write_text('import "../lib/f.tg"\ndim n\ninput x[n]\nout y[n] = twice(x)\n')
    assert tgc_cli("check", "-I", lib, main).returncode == 0
    r = tgc_cli("run", "-I", lib, main, "--random-inputs", "--dim", "n=3", "--backend", "cpu")
    assert r.returncode == 0, r.stderr
    link = sub / "escape.tg"                        # a link out of the folder is outside too
    link.symlink_to(lib / "f.tg")
    main.write_text('import "sub/escape.tg"\ndim n\n')
    assert tgc_cli("check", main).returncode == 1


# ------------------------------------------------------------ hostile inputs: exit 3 or 1, a message

@pytest.mark.slow
def test_a_truncated_npz_is_exit_3(tmp_path):
    np.savez(tmp_path / "in.npz", x=np.ones((4, 13), np.float32))
    data = (tmp_path / "in.npz").read_bytes()
    for n in (0, 10, 300, len(data) - 20):
        (tmp_path / "t.npz").write_bytes(data[:n])
        r = tgc_cli("run", ROOT / "examples" / "mlp.tg", "--inputs", tmp_path / "t.npz")
        assert r.returncode == 3 and "cannot read inputs" in r.stderr, (n, r.stderr)
        r = tgc_cli("run", ROOT / "examples" / "mlp.tg", "--random-inputs", "--input", f"x={tmp_path / 't.npz'}")
        assert r.returncode == 3 and "Traceback" not in r.stderr, (n, r.stderr)


@pytest.mark.slow
def test_sources_that_are_devices_fifos_or_huge_are_refused(tmp_path):
    fifo = tmp_path / "p.tg"
    os.mkfifo(fifo)
    for path in ("/dev/zero", fifo):
        for cmd in (["check"], ["dump-ir"], ["run", "--random-inputs"]):
            r = tgc_cli(*cmd, path, timeout=60)
            assert r.returncode == 1 and "not a source file" in r.stderr, (cmd, path, r.stderr)
    with pytest.raises(tgc.ir.diag.CompileError, match="FIFO"):
        tgc.compile(str(fifo))
    from tgc import fsutil

    big = tmp_path / "big.tg"
    big.write_text("# comment\n" * 20)
    with pytest.raises(fsutil.NotASource, match="larger"):
        fsutil.read_source_bytes(big, limit=100)


def test_inputs_and_params_that_are_fifos_or_devices_are_refused(tmp_path):
    """--inputs, --input and load_params refuse a FIFO or a device at once, naming the
    file (each is run in a child with a timeout, so that a wait fails the test)."""
    prog = tmp_path / "p.tg"
    prog.write_text("dim n\ninput x[n]\nparam w[n]\nout y[n] = x * w\n")
    specials = []
    for suffix in (".npz", ".npy", ".safetensors"):
        os.mkfifo(tmp_path / f"fifo{suffix}")
        (tmp_path / f"zero{suffix}").symlink_to("/dev/zero")
        specials += [(tmp_path / f"fifo{suffix}", "FIFO"), (tmp_path / f"zero{suffix}", "device")]
    for path, kind in specials:
        for args in (["--inputs", path], ["--input", f"x={path}", "--random-inputs"]):
            r = tgc_cli("run", prog, "--backend", "interp", *args, timeout=60)
            assert r.returncode == 3 and kind in r.stderr and str(path) in r.stderr, (args, r.stderr)
            assert "Traceback" not in r.stderr
        if path.suffix == ".npy":
            continue
        code = ("import tgc\n"
                "p = tgc.compile(%r)\n"
                "try:\n"
                "    tgc.load_params(%r, p)\n"
                "except tgc.ParamsError as e:\n"
                "    print(e)\n" % (str(prog), str(path)))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and kind in r.stdout and str(path) in r.stdout, (path, r.stdout, r.stderr)


def test_programs_free_their_machine_code():
    import gc
    import weakref

    from tgc.backends.cpu import llvm_env

    gc.collect()
    before = len(llvm_env._LIVE_ENGINES)
    refs = []
    for i in range(20):
        p = tgc.compile(f"dim n\ninput x[n]\nout y[n] = x * {i + 2}\n", options=tgc.Options(cpu=tgc.CpuOptions(compile_jobs=1)))
        assert p(x=np.ones(2, np.float32))["y"].tolist() == [i + 2] * 2
        refs.append(weakref.ref(p))
    del p
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(llvm_env._LIVE_ENGINES) == before


def test_stale_link_folders_are_removed(tmp_path, monkeypatch):
    import tempfile
    import time

    from tgc.backends.cpu import aot

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    old, new = tmp_path / "tgc-link-old", tmp_path / "tgc-link-new"
    for d in (old, new):
        d.mkdir()
        (d / "model.o").write_bytes(b"x")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    other = tmp_path / "unrelated"
    other.mkdir()
    os.utime(other, (0, 0))
    aot.remove_stale_link_dirs()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tgc-link-new", "unrelated"]


# ------------------------------------------------------------ concurrency

def test_threads_share_one_program():
    from concurrent.futures import ThreadPoolExecutor

    prog = tgc.compile(ROOT / "examples" / "layernorm.tg")
    names = [s.name for s in prog.inputs]
    rng = np.random.default_rng(0)

    def inputs(batch):
        return {s.name: rng.standard_normal([batch if isinstance(n, str) else n for n in s.shape]).astype(np.float32)
                if s.shape else np.float32(0.5) for s in prog.inputs}

    cases = [inputs(b) for b in (1, 3, 8, 33, 3, 8) * 2]
    want = [{k: v.copy() for k, v in prog(**{n: c[n].copy() for n in names}).items()} for c in cases]

    def call(i):
        c = cases[i % len(cases)]
        got = prog(**{n: c[n].copy() for n in names})
        return all(np.array_equal(got[k], want[i % len(cases)][k]) for k in got)

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(call, range(400)))


@pytest.mark.slow
def test_processes_share_one_new_cache_dir(tmp_path):
    d = tmp_path / "new" / "cache"                    # made by whichever process comes first
    code = ("import numpy as np, tgc, sys; k = int(sys.argv[1]); "
            "p = tgc.compile('dim n\\ninput x[n]\\nout y[n] = exp(x) * %d\\n' % (k % 3 + 2)); "
            "print(float(p(x=np.ones(4, np.float32))['y'].sum()))")
    env = {**os.environ, "TGC_CACHE_DIR": str(d)}
    env.pop("TGC_CACHE", None)
    for _ in range(2):                                # cold, then warm
        procs = [subprocess.Popen([sys.executable, "-c", code, str(k)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env) for k in range(9)]
        outs = [p.communicate(timeout=180) for p in procs]
        assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
        for k, (out, err) in enumerate(outs):
            assert float(out) == pytest.approx(4 * np.e * (k % 3 + 2), rel=1e-6)
            assert "warning" not in err
    assert len(list(d.rglob("*.prog"))) >= 3 and not list(d.rglob("*.tmp"))   # 3, unless tgc changed meanwhile
    assert (d.stat().st_mode & 0o777) == 0o700
