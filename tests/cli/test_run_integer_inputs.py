"""`tgc run` keeps integer input files integer: an i32 input (gather ids, a random key, a
loop step's ids and keys) read from .npy, .npz or .safetensors, of any integer width or
byte order, is passed as int32 on every backend; a float or bool file for it, or an id
that does not fit in int32, is a clear error naming the file. (Integer files for a float
input are converted to its float type: tgc/cli/run.py, `_as_float_input`.)"""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from tgc.cli import main

GATHER = """\
dim n = 4, v = 5
input E[v, n]
input ids: i32[n]
input key: i32
out y[n] = E[v = ids] + 0 * rand[n](key)
out r[n] = rand[n](fold(key, 2))
"""

LOOP = """\
dim layer = 3, n = 4, v = 5
input x0[n]
input E[layer, v, n]
input ids: i32[layer, n]
input keys: i32[layer]
fn step(h, e, i, k) = h + e[v = i] + rand[n](k)
out y = repeat[layer](step, x0, E, ids, keys)
"""

IDS = [4, 0, 2, 1]
E = np.arange(20, dtype=np.int64).reshape(5, 4)     # an integer file for a float input


def run(tmp_path, src, *args):
    prog = tmp_path / "p.tg"
    prog.write_text(src)
    out = tmp_path / "out.npz"
    r = CliRunner().invoke(main, ["run", str(prog), *map(str, args), "-o", str(out)])
    return r, (dict(np.load(out)) if r.exit_code == 0 else None)


def rand_of(key, n=4):
    from tgc.ir.philox import draw_numpy

    return draw_numpy("rand", "f32", key, (2,), np.arange(n, dtype=np.int64))


@pytest.mark.parametrize("backend", ["interp", "lowered", "cpu"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, ">i4"])
def test_integer_files_for_i32_inputs_keep_their_values(tmp_path, backend, dtype):
    np.save(tmp_path / "ids.npy", np.array(IDS, dtype))
    np.save(tmp_path / "key.npy", np.array(7, dtype))
    np.save(tmp_path / "E.npy", E)
    r, out = run(tmp_path, GATHER, "--input", f"ids={tmp_path / 'ids.npy'}", "--input",
                 f"key={tmp_path / 'key.npy'}", "--input", f"E={tmp_path / 'E.npy'}", "--backend", backend)
    assert r.exit_code == 0, r.output
    np.testing.assert_array_equal(out["y"], E[IDS, np.arange(4)].astype(np.float32))
    np.testing.assert_allclose(out["r"], rand_of(7), rtol=1e-6)


@pytest.mark.parametrize("backend", ["interp", "cpu"])
def test_archives_keep_i32_inputs_of_a_loop_step(tmp_path, backend):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    arrays = {"x0": rng.standard_normal(4).astype(np.float32), "E": rng.standard_normal((3, 5, 4)).astype(np.float32),
              "ids": rng.integers(0, 5, (3, 4)), "keys": np.array([5, 6, 7], np.int64)}
    np.savez(tmp_path / "in.npz", **arrays)
    save_file(arrays, str(tmp_path / "in.safetensors"))
    want = arrays["x0"].astype(np.float64)
    for i in range(3):
        from tgc.ir.philox import draw_numpy

        want = want + arrays["E"][i][arrays["ids"][i], np.arange(4)] + \
            draw_numpy("rand", "f32", int(arrays["keys"][i]), (), np.arange(4, dtype=np.int64))
    for archive in ("in.npz", "in.safetensors"):
        r, out = run(tmp_path, LOOP, "--inputs", tmp_path / archive, "--backend", backend)
        assert r.exit_code == 0, r.output
        np.testing.assert_allclose(out["y"], want, rtol=1e-5, err_msg=archive)


@pytest.mark.parametrize("bad, message", [
    (np.array([4.0, 0.0, 2.0, 1.0], np.float32), "holds ids (i32): pass integers, not float32"),
    (np.array([True, False, True, False]), "holds ids (i32): pass integers, not bool"),
    (np.array([2 ** 40, 0, 0, 0], np.int64), "do not fit in int32"),
])
def test_non_integer_or_too_wide_files_for_i32_inputs_are_clear_errors(tmp_path, bad, message):
    np.save(tmp_path / "ids.npy", bad)
    r, _ = run(tmp_path, GATHER, "--input", f"ids={tmp_path / 'ids.npy'}", "--random-inputs")
    assert r.exit_code != 0 and message in r.output and "ids.npy" in r.output, r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("dtype", [np.complex128, np.complex64])
def test_a_complex_file_for_a_real_input_is_named_by_its_own_type(tmp_path, dtype):
    """A complex128 file for a real f32 input was first narrowed to complex64, and the
    error then named complex64, a type the file does not hold."""
    np.save(tmp_path / "e.npy", np.ones((5, 4), dtype))
    r, _ = run(tmp_path, GATHER, "--input", f"E={tmp_path / 'e.npy'}", "--random-inputs")
    assert r.exit_code == 3 and f"input 'E' must be a float array (f32), not {np.dtype(dtype).name}" in r.output, \
        r.output
