"""The one rule for argument dtypes (docs/dtypes.md, "What a call takes"), on every
backend: an argument that is only read is converted to its declared type (any float
width, a Python number for a scalar); one that an `update` writes in place must already
be of its declared type, and is refused before anything runs; integers and booleans are
not floats. Each message names the argument, the dtype given and the one needed."""
from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

import tgc
from tgc.cli import main
from tgc.ir.interp import EvalError, evaluate
from tgc.options import Options

from backends_util import backends, compile_on, require

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = backends()   # every registered backend (backends_util)
STEP = """dim n = 4
input x[n], lr
param w[n]
state v[n]
out y = sum[n](w * x)
update w = w - lr * x
update v = v + x
"""


def arrays(dtype=np.float32):
    return dict(x=np.arange(4, dtype=dtype), lr=0.5, w=np.ones(4, np.float32), v=np.zeros(4, np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("given", [np.float64, np.float16, ml_dtypes.bfloat16])
def test_an_updated_param_or_state_of_another_float_type_is_refused(backend, given):
    prog = compile_on(STEP, backend)
    for target in ("w", "v"):
        args = arrays()
        args[target] = args[target].astype(given)
        before = {k: np.array(a, copy=True) for k, a in args.items() if k in ("w", "v")}
        want = f"'{target}' is updated in place, so it must be float32, not {np.dtype(given).name}"
        with pytest.raises(EvalError, match=want):
            prog(**args)
        for k, a in before.items():          # nothing was written, not even the other target
            np.testing.assert_array_equal(args[k], a)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("given", [np.float64, np.float16, ml_dtypes.bfloat16])
def test_an_argument_only_read_is_converted_from_any_float_type(backend, given):
    prog = compile_on(STEP, backend)
    want = prog(**arrays())
    args = arrays(given)
    args["lr"] = np.asarray(0.5, given)
    got = prog(**args)
    np.testing.assert_array_equal(got["y"], want["y"])
    np.testing.assert_array_equal(got["w"], want["w"])
    assert got["w"] is args["w"] and got["w"].dtype == np.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_integers_and_booleans_are_not_floats_and_floats_are_not_ids(backend):
    prog = compile_on(STEP, backend)
    for bad in (np.arange(4), np.ones(4, bool)):
        with pytest.raises(EvalError, match=f"input 'x' must be a float array \\(f32\\), not {bad.dtype}"):
            prog(**dict(arrays(), x=bad))
    ids = compile_on("dim n = 3, v = 5\ninput E[v]\ninput k: i32[n]\nout y[n] = E[v = k]\n", backend)
    with pytest.raises(EvalError, match="input 'k' holds ids \\(i32\\): pass integers, not float32"):
        ids(E=np.ones(5, np.float32), k=np.zeros(3, np.float32))
    np.testing.assert_array_equal(ids(E=np.arange(5.0), k=np.array([4, 0, 1]))["y"], [4, 0, 1])   # int64 ids: fit


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_view_of_the_right_type_is_still_updated_through_a_copy(backend):
    prog = compile_on(STEP, backend)
    wide = np.ones(8, np.float32)
    w = wide[::2]                              # float32, not contiguous: the layout alone differs
    prog(**dict(arrays(), w=w))
    np.testing.assert_array_equal(wide[::2], 1 - 0.5 * np.arange(4))
    np.testing.assert_array_equal(wide[1::2], 1)



@pytest.mark.parametrize("backend", BACKENDS)
def test_an_update_target_whose_elements_share_memory_is_refused(backend):
    """A stride-0 view (numpy's as_strided, torch's `expand`) holds one value for many
    elements: an update writing a different value to each kept the last one written
    (w became [-0.5] * 4, not 1 - 0.5 * [0, 1, 2, 3]). It is refused before anything
    runs, as torch refuses an in-place op on an expanded tensor."""
    prog = compile_on(STEP, backend)
    one = np.ones(1, np.float32)
    w = np.lib.stride_tricks.as_strided(one, (4,), (0,))
    assert w.flags.writeable
    with pytest.raises(EvalError, match="'w' is updated in place, but its elements share memory"):
        prog(**dict(arrays(), w=w))
    assert one[0] == 1
    rows = np.lib.stride_tricks.as_strided(np.ones(3, np.float32), (2, 3), (0, 4))   # rows alias one another
    with pytest.raises(EvalError, match="share memory"):
        compile_on("dim a = 2, b = 3\ninput x[a, b]\nparam w[a, b]\nout y = sum(w * x)\nupdate w = w + x\n",
                   backend)(x=np.ones((2, 3), np.float32), w=rows)
    single = np.ones((1, 4), np.float32)[:, :]     # a stride over an axis of size 1 shares nothing
    got = compile_on("dim a = 1, n = 4\ninput x[n]\nparam w[a, n]\nout y = sum(w * x)\nupdate w = w + x\n",
                     backend)(x=np.arange(4, dtype=np.float32), w=np.lib.stride_tricks.as_strided(single, (1, 4), (0, 4)))
    np.testing.assert_array_equal(got["w"], [[1, 2, 3, 4]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_update_target_whose_elements_overlap_is_refused(backend):
    """Elements may share memory without a stride of 0: `as_strided(a, (2, 3), (4, 4))`
    over float32 makes rows [a0 a1 a2] and [a1 a2 a3]. The update's values were copied
    back into it one after the other, each shared element keeping the last (silently
    wrong: w held [[1, 2, 3], [2, 3, 4]] + x with one value per memory cell). Refused
    like a stride-0 view; a strided view whose elements are all distinct, even with
    interleaved strides, is still updated through a copy."""
    prog = compile_on("dim a = 2, b = 3\ninput x[a, b]\nparam w[a, b]\nout y = sum(w * x)\nupdate w = w + x\n",
                      backend)
    base = np.arange(1, 5, dtype=np.float32)
    w = np.lib.stride_tricks.as_strided(base, (2, 3), (4, 4))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    with pytest.raises(EvalError, match="'w' is updated in place, but its elements share memory"):
        prog(x=x, w=w)
    np.testing.assert_array_equal(base, [1, 2, 3, 4])
    cells = np.zeros(8, np.float32)          # offsets 4*(2i + 3j): 0, 12, 8, 20, 16, 28 -> distinct
    interleaved = np.lib.stride_tricks.as_strided(cells, (3, 2), (8, 12))
    prog = compile_on("dim a = 3, b = 2\ninput x[a, b]\nparam w[a, b]\nout y = sum(w * x)\nupdate w = w + x\n",
                      backend)
    prog(x=np.arange(6, dtype=np.float32).reshape(3, 2), w=interleaved)
    np.testing.assert_array_equal(interleaved, np.arange(6).reshape(3, 2))


def test_torch_overlapping_update_targets_are_refused():
    torch = pytest.importorskip("torch")
    rows = torch.arange(6.0).as_strided((2, 3), (1, 1))    # rows [0 1 2] and [1 2 3] share three cells
    prog = tgc.compile("dim a = 2, b = 3\ninput x[a, b]\nparam w[a, b]\nout y = sum(w * x)\nupdate w = w + x\n")
    with pytest.raises(EvalError, match="share memory"):
        prog(x=torch.ones(2, 3), w=rows)


def test_torch_expanded_update_targets_are_refused():
    torch = pytest.importorskip("torch")
    prog = tgc.compile(STEP)
    w = torch.ones(1).expand(4)
    with pytest.raises(EvalError, match="share memory"):
        prog(x=torch.arange(4.0), lr=0.5, w=w, v=torch.zeros(4))


def test_the_declared_type_is_the_one_an_update_needs():
    """An f64 program's params are float64, its f32 declarations float32; bf16/f16
    params are ml_dtypes.bfloat16 / float16; --fp-strict emulates an f32 program in f64
    but its params stay float32 to the caller."""
    wide = tgc.compile(STEP, dtype="f64")
    with pytest.raises(EvalError, match="'w' is updated in place, so it must be float64, not float32"):
        wide(x=np.ones(4), lr=0.5, w=np.ones(4, np.float32), v=np.zeros(4))
    mixed = tgc.compile(STEP.replace("param w[n]", "param w: f32[n]"), dtype="f64")
    w = np.ones(4, np.float32)
    mixed(x=np.arange(4.0), lr=0.5, w=w, v=np.zeros(4))
    np.testing.assert_array_equal(w, 1 - 0.5 * np.arange(4))
    with pytest.raises(EvalError, match="'w' is updated in place, so it must be float32, not float64"):
        mixed(x=np.ones(4), lr=0.5, w=np.ones(4), v=np.zeros(4))
    strict = tgc.compile(STEP, options=Options(fp_strict=True))
    w = np.ones(4, np.float32)
    strict(**dict(arrays(), w=w))
    np.testing.assert_array_equal(w, 1 - 0.5 * np.arange(4))
    with pytest.raises(EvalError, match="'w' is updated in place, so it must be float32, not float64"):
        strict(**dict(arrays(), w=np.ones(4)))
    low = tgc.compile(STEP.replace("param w[n]", "param w: bf16[n]"))
    w = np.ones(4, ml_dtypes.bfloat16)
    low(**dict(arrays(), w=w))
    np.testing.assert_array_equal(w.astype(np.float32), 1 - 0.5 * np.arange(4))
    with pytest.raises(EvalError, match="'w' is updated in place, so it must be bfloat16, not float32"):
        low(**arrays())


def test_a_complex_update_target_of_the_other_width_is_refused():
    prog = tgc.compile("dim n = 4\nparam z: c64[n]\ninput w: c64[n]\nout p = z * w\nupdate z = z * 1j\n")
    w = np.full(4, 2 - 1j, np.complex128)      # only read: converted to complex64
    z = np.array([1 + 2j, 3, 4j, -1], np.complex64)
    prog(z=z, w=w)
    np.testing.assert_array_equal(z, np.array([1 + 2j, 3, 4j, -1], np.complex64) * 1j)
    z128 = z.astype(np.complex128)
    with pytest.raises(EvalError, match="'z' is updated in place, so it must be complex64, not complex128"):
        prog(z=z128, w=w)
    np.testing.assert_array_equal(z128, z)
    with pytest.raises(EvalError, match="'z' is updated in place, so it must be float32, not float64"):
        prog(z=np.zeros((4, 2)), w=w)         # float pairs of the other width


def test_torch_tensors_follow_the_same_rule():
    torch = pytest.importorskip("torch")
    prog = tgc.compile(STEP)
    w = torch.ones(4, dtype=torch.float64)
    with pytest.raises(EvalError, match="'w' is updated in place, so it must be float32, not float64"):
        prog(x=torch.arange(4.0), lr=0.5, w=w, v=torch.zeros(4))
    assert torch.equal(w, torch.ones(4, dtype=torch.float64))
    got = prog(x=torch.arange(4, dtype=torch.float64), lr=0.5, w=torch.ones(4), v=torch.zeros(4))
    np.testing.assert_array_equal(got["w"], 1 - 0.5 * np.arange(4))


@pytest.mark.parametrize("backend", ["interp", *BACKENDS])
def test_tgc_run_converts_file_data_to_the_declared_types_on_every_backend(tmp_path, backend):
    """A file holds no caller's array: `tgc run` converts float64 data, updated params
    included, and integers for a float input, to the declared types; every backend
    then gives the interpreter's values."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "in.npz", x=rng.standard_normal((4, 13)), y=np.eye(3, dtype=np.int64)[[0, 1, 2, 0]],
             W1=rng.standard_normal((13, 64)), b1=np.zeros(64), W2=rng.standard_normal((64, 3)),
             b2=np.zeros(3, np.float16), lr=np.float64(0.01))
    out = tmp_path / "out.npz"
    require(backend)
    r = CliRunner().invoke(main, ["run", str(ROOT / "examples/mlp.tg"), "--inputs", str(tmp_path / "in.npz"),
                                  "--backend", backend, "-o", str(out)])
    assert r.exit_code == 0, r.output
    got = np.load(out)
    ref = evaluate(tgc.compile(str(ROOT / "examples/mlp.tg")).module,
                                 {k: v for k, v in np.load(tmp_path / "in.npz").items()}, dtype="f32")
    for k in ("loss", "W1", "b1", "W2", "b2"):
        assert got[k].dtype == np.float32
        np.testing.assert_allclose(got[k], ref[k], rtol=2e-5, atol=1e-6)


GATHER = """dim n = 4, v = 3
input ids: i32[n]
input table[v]
out y = table[v = ids]
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_interpreter_and_a_compiled_program_refuse_inputs_in_the_same_words(backend):
    """One checker (tgc.ir.input_checks): names, shapes and ids' element type."""
    require(backend)
    prog = tgc.compile(GATHER, backend=backend)
    good = dict(ids=np.array([0, 2, 1, 0], np.int32), table=np.ones(3, np.float32))
    for bad in ({"ids": good["ids"]},                                           # missing
                {**good, "extra": np.ones(2)},                                  # unexpected
                {**good, "table": np.ones(4, np.float32)},                      # shape
                {**good, "ids": good["ids"].astype(np.float32)}):               # ids as floats
        with pytest.raises(EvalError) as ours:
            prog(**bad)
        with pytest.raises(EvalError) as oracle:
            evaluate(prog.module, bad)
        assert str(ours.value) == str(oracle.value)


def test_run_takes_a_mapping():
    """`program.run(None)` was a TypeError from len() inside the call, and `run([...])`
    said the first argument was missing."""
    prog = tgc.compile(STEP)
    for bad in (None, [1, 2, 3], "x"):
        with pytest.raises(TypeError, match=r"run\(\) takes a dict \{name: array\}, not " + type(bad).__name__):
            prog.run(bad)
    assert set(prog.run(dict(arrays()))) >= {"w"}
