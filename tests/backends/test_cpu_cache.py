"""The on-disk code cache: hits and misses, keys, damaged entries, concurrent builds."""
import subprocess
import sys
import time

import numpy as np
import pytest

import tgc
from tgc.runtime import cache

PROGRAM = "dim n\ninput x[n]\nout y[n] = exp(x) * 2\n"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TGC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TGC_CACHE", raising=False)
    return tmp_path


def entries(d):
    return sorted(p.name for p in d.rglob("*.o"))


def test_miss_then_hit(cache_dir):
    assert entries(cache_dir) == []
    a = tgc.compile(PROGRAM)
    first = entries(cache_dir)
    assert len(first) == 1
    b = tgc.compile(PROGRAM)
    assert entries(cache_dir) == first  # a hit adds nothing
    x = np.linspace(-1, 1, 7, dtype=np.float32)
    np.testing.assert_allclose(a(x=x)["y"], b(x=x)["y"])
    np.testing.assert_allclose(b(x=x)["y"], np.exp(x) * 2, rtol=1e-6)


def test_key_depends_on_program_dtype_and_flags(cache_dir):
    tgc.compile(PROGRAM)
    tgc.compile(PROGRAM, dtype="f64")
    tgc.compile(PROGRAM.replace("* 2", "* 3"))
    tgc.compile(PROGRAM, options=tgc.options.Options(opt_level=3))
    assert len(entries(cache_dir)) == 4
    tgc.compile(PROGRAM, options=tgc.options.Options(print_ir_after_all=True, time_passes=True))
    assert len(entries(cache_dir)) == 4  # presentation flags do not change the code


def test_damaged_entry_is_rebuilt(cache_dir):
    tgc.compile(PROGRAM)
    (entry,) = cache_dir.rglob("*.o")
    good = entry.read_bytes()
    entry.write_bytes(good[: len(good) // 2])  # truncated, as by a full disk
    for prog in cache_dir.rglob("*.prog"):     # so that the object entry is looked up
        prog.unlink()
    prog = tgc.compile(PROGRAM)
    np.testing.assert_allclose(prog(x=np.zeros(3, np.float32))["y"], 2 * np.ones(3))
    assert entry.read_bytes() == good


def test_source_level_entry_hit_skips_the_front_end(cache_dir, monkeypatch):
    a = tgc.compile(PROGRAM)
    assert len(list(cache_dir.rglob("*.prog"))) == 1
    import tgc.frontend.elaborate as elaborate

    def boom(*args, **kwargs):
        raise AssertionError("front end ran on a hit")

    monkeypatch.setattr(elaborate, "elaborate_source", boom)
    b = tgc.compile(PROGRAM)
    x = np.linspace(-1, 1, 5, dtype=np.float32)
    np.testing.assert_array_equal(a(x=x)["y"], b(x=x)["y"])
    assert b.inputs == a.inputs and b.outputs == a.outputs
    # printing options bypass it (a hit would print nothing)
    with pytest.raises(AssertionError, match="front end ran"):
        tgc.compile(PROGRAM, options=tgc.options.Options(time_passes=True))


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_damaged_source_level_entry_is_a_miss(cache_dir, damage):
    tgc.compile(PROGRAM, dtype="f64")
    (entry,) = cache_dir.rglob("*.prog")
    data = entry.read_bytes()
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data = data[:-10] + bytes([data[-10] ^ 1]) + data[-9:]
    else:
        data = b"not a cache entry"
    entry.write_bytes(data)
    prog = tgc.compile(PROGRAM, dtype="f64")
    np.testing.assert_allclose(prog(x=np.zeros(3))["y"], 2 * np.ones(3))
    key = entry.name[:-len(".prog")]
    assert cache.lookup_program(key) is not None     # rewritten whole


def test_source_level_entry_checks_imports(cache_dir, tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "lib.tg").write_text("fn f(a) {\n  return a * 2\n}\n")
    (src / "main.tg").write_text('import "lib.tg"\ndim n\ninput x[n]\nout y[n] = f(x)\n')
    x = np.ones(3, np.float32)
    try:
        assert tgc.compile(src / "main.tg")(x=x)["y"].tolist() == [2, 2, 2]
    except Exception as e:  # noqa: BLE001 -- the import syntax is the front end's business
        pytest.skip(f"imports: {e}")
    assert tgc.compile(src / "main.tg")(x=x)["y"].tolist() == [2, 2, 2]
    (src / "lib.tg").write_text("fn f(a) {\n  return a * 3\n}\n")
    assert tgc.compile(src / "main.tg")(x=x)["y"].tolist() == [3, 3, 3]


def test_disabled(cache_dir, monkeypatch):
    monkeypatch.setenv("TGC_CACHE", "off")
    tgc.compile(PROGRAM)
    assert entries(cache_dir) == []


def test_concurrent_builds_agree(cache_dir):
    code = ("import numpy as np, tgc; p = tgc.compile(%r); "
            "print(float(p(x=np.ones(4, np.float32))['y'].sum()))" % PROGRAM)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**__import__("os").environ, "TGC_CACHE_DIR": str(cache_dir)})
             for _ in range(4)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outs)) == 1 and float(outs[0]) == pytest.approx(8 * np.e, rel=1e-6)
    assert len(entries(cache_dir)) == 1
    assert not list(cache_dir.rglob("*.tmp"))


def test_entries_hold_every_object_file(cache_dir):
    objs = (b"first object", b"", b"third")
    cache.store("ab" + "0" * 62, objs)
    assert cache.lookup("ab" + "0" * 62) == objs
    path = next(cache_dir.rglob("*.o"))
    data = path.read_bytes()
    path.write_bytes(data[:-2])                 # truncated: the checksum fails
    assert cache.lookup("ab" + "0" * 62) is None
    assert cache._unpack((100).to_bytes(8, "little") + b"short") is None   # a length past the end
