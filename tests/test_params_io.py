"""Saving and loading a program's params and states (`tgc.save_params`, `tgc.load_params`),
and feeding one `tgc run`'s outputs to the next (`--inputs` skips outputs' keys)."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import tgc
from tgc.cli import main
from tgc.params import NPZ_MEMBER, ParamsError, read_file

ROOT = Path(__file__).parent.parent
MLP = ROOT / "examples/mlp.tg"
SRC = ("dim n\ndim h = 4, k = 3\ninput x[n, h]\nparam W[h, k], b[k]\nstate m[h, k]\ninput lr\n"
       "loss = mean(sum[k]((x @ W + b) ^ 2))\nout loss\n"
       "update m = 0.5 * m + grad(loss, W)\nupdate W = W - lr * m\nupdate b = b - lr * grad(loss, b)\n")


@pytest.fixture(scope="module")
def prog():
    return tgc.compile(SRC)


def params(dtype=np.float32) -> dict:
    rng = np.random.default_rng(1)
    return {"W": rng.standard_normal((4, 3)).astype(dtype), "b": rng.standard_normal(3).astype(dtype),
            "m": np.zeros((4, 3), dtype)}


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_round_trip_after_training_steps(prog, tmp_path, suffix):
    p = params()
    x = np.random.default_rng(2).standard_normal((5, 4)).astype(np.float32)
    for _ in range(3):
        prog(x=x, lr=0.1, **p)
    path = tmp_path / f"model{suffix}"
    tgc.save_params(path, prog, {**p, "x": x, "lr": 0.1})        # other names are ignored
    loaded = tgc.load_params(path, prog)
    assert sorted(loaded) == ["W", "b", "m"]
    for k in p:
        np.testing.assert_array_equal(loaded[k], p[k])
        assert loaded[k].dtype == np.float32 and loaded[k].flags.writeable and loaded[k].flags.c_contiguous
    # the loaded arrays continue training exactly as the originals do
    want = prog(x=x, lr=0.1, **p)["loss"]
    assert prog(x=x, lr=0.1, **loaded)["loss"] == want
    arrays, meta = read_file(path)
    assert meta["dtype"] == "f32" and meta["tensors"]["W"] == {"kind": "param", "edges": ["h", "k"]}
    assert meta["tensors"]["m"]["kind"] == "state"


def test_the_formats_are_the_standard_ones(prog, tmp_path):
    p = params()
    tgc.save_params(tmp_path / "a.safetensors", prog, p)
    import safetensors.numpy
    from safetensors import safe_open

    plain = safetensors.numpy.load_file(str(tmp_path / "a.safetensors"))
    assert sorted(plain) == ["W", "b", "m"] and np.array_equal(plain["W"], p["W"])
    with safe_open(str(tmp_path / "a.safetensors"), framework="numpy") as f:
        assert json.loads(f.metadata()["tgc"])["tensors"]["b"]["edges"] == ["k"]
    tgc.save_params(tmp_path / "a.npz", prog, p)
    with np.load(tmp_path / "a.npz", allow_pickle=False) as z:
        assert sorted(z.files) == sorted(["W", "b", "m", NPZ_MEMBER])


def test_edges_in_another_order_are_transposed(prog, tmp_path):
    import safetensors.numpy

    p = params()
    meta = {"version": 1, "dtype": "f32", "tensors": {"W": {"kind": "param", "edges": ["k", "h"]},
                                                      "b": {"kind": "param", "edges": ["k"]},
                                                      "m": {"kind": "state", "edges": ["h", "k"]}}}
    path = tmp_path / "t.safetensors"
    safetensors.numpy.save_file({"W": np.ascontiguousarray(p["W"].T), "b": p["b"], "m": p["m"]}, str(path),
                                metadata={"tgc": json.dumps(meta)})
    loaded = tgc.load_params(path, prog)
    np.testing.assert_array_equal(loaded["W"], p["W"])
    assert loaded["W"].flags.c_contiguous


def save_raw(path: Path, arrays: dict, tensors: dict | None = None) -> None:
    import safetensors.numpy

    meta = None if tensors is None else {"tgc": json.dumps({"version": 1, "dtype": "f32", "tensors": tensors})}
    safetensors.numpy.save_file(arrays, str(path), metadata=meta)


def test_mismatches_are_refused(prog, tmp_path):
    p = params()
    edges = {"W": {"kind": "param", "edges": ["h", "k"]}, "b": {"kind": "param", "edges": ["k"]},
             "m": {"kind": "state", "edges": ["h", "k"]}}
    path = tmp_path / "bad.safetensors"
    cases = [
        ({"W": p["W"], "b": p["b"]}, edges, "no array for 'm'"),
        ({**p, "extra": p["b"]}, edges, "'extra' is not a param or state"),
        ({**p, "W": p["W"][:3]}, edges, "'W': edge 'h' has size 3, the program's is 4"),
        ({**p, "b": p["b"].astype(np.float64)}, edges, "'b' is f64, the program's float type is f32"),
        (p, {**edges, "W": {"kind": "param", "edges": ["h", "q"]}}, "'W' has edges [h, q]"),
        (p, {**edges, "m": {"kind": "param", "edges": ["h", "k"]}}, "saved as a param"),
        ({**p, "b": np.arange(3, dtype=np.int32)}, edges, "not a float array"),
        ({**p, "W": p["W"].T.copy()}, None, "edge 'h' has size 3"),         # no description: ABI order
    ]
    for arrays, tensors, message in cases:
        save_raw(path, arrays, tensors)
        with pytest.raises(ParamsError, match=message.replace("[", r"\[").replace("]", r"\]")):
            tgc.load_params(path, prog)
    save_raw(path, {**p, "b": p["b"].astype(np.float64)}, edges)
    assert tgc.load_params(path, prog, cast=True)["b"].dtype == np.float32
    save_raw(path, p, None)                                                   # another tool's file
    assert sorted(tgc.load_params(path, prog)) == ["W", "b", "m"]
    for name, data, message in [("x.txt", b"", "must end in .safetensors or .npz"),
                                ("d.safetensors", b"not a file", "cannot read"),
                                ("d.npz", b"not a zip", "cannot read")]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ParamsError, match=message):
            tgc.load_params(tmp_path / name, prog)
    with pytest.raises(ParamsError, match="no array for 'm'"):
        tgc.save_params(tmp_path / "s.npz", prog, {"W": p["W"], "b": p["b"]})


GOOD_TENSORS = {"W": {"kind": "param", "edges": ["h", "k"]}, "b": {"kind": "param", "edges": ["k"]},
                "m": {"kind": "state", "edges": ["h", "k"]}}
MALFORMED_DESCRIPTIONS = [
    ("[1, 2]", "a JSON array, not an object"),
    ("null", "a JSON null, not an object"),
    ("3.5", "a JSON number, not an object"),
    ('"text"', "a JSON string, not an object"),
    ("{", "not JSON"),
    ("[" * 100000, "not JSON"),
    ({"dtype": "f32", "tensors": GOOD_TENSORS}, 'no "version"'),
    ({"version": 1, "tensors": GOOD_TENSORS}, 'no "dtype"'),
    ({"version": 1, "dtype": "f32"}, 'no "tensors"'),
    ({"version": "1", "dtype": "f32", "tensors": GOOD_TENSORS}, '"version" is a JSON string'),
    ({"version": True, "dtype": "f32", "tensors": GOOD_TENSORS}, '"version" is a JSON boolean'),
    ({"version": 2, "dtype": "f32", "tensors": GOOD_TENSORS}, "format version 2, this tgc reads version 1"),
    ({"version": 1, "dtype": None, "tensors": GOOD_TENSORS}, '"dtype" is a JSON null'),
    ({"version": 1, "dtype": "f32", "tensors": []}, '"tensors" is a JSON array'),
    ({"version": 1, "dtype": "f32", "tensors": None}, '"tensors" is a JSON null'),
    ({**GOOD_TENSORS, "W": ["h", "k"]}, "the entry for 'W' is a JSON array, not an object"),
    ({**GOOD_TENSORS, "W": "h,k"}, "the entry for 'W' is a JSON string"),
    ({**GOOD_TENSORS, "W": None}, "the entry for 'W' is a JSON null"),
    ({**GOOD_TENSORS, "W": 7}, "the entry for 'W' is a JSON number"),
    ({**GOOD_TENSORS, "W": {"kind": "param"}}, "the entry for 'W' needs \"edges\""),
    ({**GOOD_TENSORS, "W": {"kind": "param", "edges": "hk"}}, "the entry for 'W' needs \"edges\""),
    ({**GOOD_TENSORS, "W": {"kind": "param", "edges": ["h", 3]}}, "the entry for 'W' needs \"edges\""),
    ({**GOOD_TENSORS, "W": {"kind": "param", "edges": [["h"], "k"]}}, "the entry for 'W' needs \"edges\""),
    ({**GOOD_TENSORS, "W": {"kind": "param", "edges": [None, "k"]}}, "the entry for 'W' needs \"edges\""),
    ({**GOOD_TENSORS, "W": {"kind": "param", "edges": {"h": 0}}}, "the entry for 'W' needs \"edges\""),
    ({**GOOD_TENSORS, "W": {"kind": "param", "edges": ["h", "h"]}}, "lists edge 'h' twice"),
    ({**GOOD_TENSORS, "W": {"edges": ["h", "k"]}}, "the entry for 'W' needs \"kind\""),
    ({**GOOD_TENSORS, "W": {"kind": ["param"], "edges": ["h", "k"]}}, "the entry for 'W' needs \"kind\""),
    ({**GOOD_TENSORS, "W": {"kind": "input", "edges": ["h", "k"]}}, "the entry for 'W' needs \"kind\""),
    ({**GOOD_TENSORS, "W": {"kind": "param", "edges": ["h"]}}, "'W' has edges [h]"),
    ({**GOOD_TENSORS, "W": {"kind": "param", "edges": ["h", "k", "h2"]}}, "'W' has edges [h, k, h2]"),
    ({**GOOD_TENSORS, "W": {"kind": "param", "edges": []}}, "'W' has edges []"),
]


@pytest.mark.parametrize("description, message", MALFORMED_DESCRIPTIONS)
@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_a_malformed_description_is_a_params_error(prog, tmp_path, suffix, description, message):
    if isinstance(description, dict) and "tensors" not in description and "version" not in description:
        description = {"version": 1, "dtype": "f32", "tensors": description}   # a tensors table alone
    text = description if isinstance(description, str) else json.dumps(description)
    path = tmp_path / f"p{suffix}"
    if suffix == ".safetensors":
        import safetensors.numpy

        safetensors.numpy.save_file(params(), str(path), metadata={"tgc": text})
    else:
        np.savez(path, **params(), **{NPZ_MEMBER: np.array(text)})
    with pytest.raises(ParamsError, match=re.escape(message)):
        tgc.load_params(path, prog)


def test_symbolic_dims_must_agree_within_a_file(tmp_path):
    prog = tgc.compile("dim n\ninput x[n]\nparam a[n]\nparam c[n]\nout s = sum(a * c * x)\n")
    save_raw(tmp_path / "s.safetensors", {"a": np.ones(3, np.float32), "c": np.ones(4, np.float32)})
    with pytest.raises(ParamsError, match="dim 'n' is 3"):
        tgc.load_params(tmp_path / "s.safetensors", prog)
    save_raw(tmp_path / "s.safetensors", {"a": np.ones(4, np.float32), "c": np.ones(4, np.float32)})
    assert tgc.load_params(tmp_path / "s.safetensors", prog)["a"].shape == (4,)


def test_f64_programs(tmp_path):
    prog = tgc.compile(SRC, dtype="f64")
    p = params(np.float64)
    tgc.save_params(tmp_path / "p.safetensors", prog, p)
    assert tgc.load_params(tmp_path / "p.safetensors", prog)["W"].dtype == np.float64
    f32 = tgc.compile(SRC)
    with pytest.raises(ParamsError, match="is f64"):
        tgc.load_params(tmp_path / "p.safetensors", f32)


# ------------------------------------------------------------ the command line


def run(*args):
    return CliRunner().invoke(main, ["run", *map(str, args)])


def test_one_runs_outputs_feed_the_next(tmp_path):
    rng = np.random.default_rng(0)
    data = tmp_path / "data.npz"
    np.savez(data, x=rng.standard_normal((8, 13)).astype(np.float32),
             y=np.eye(3, dtype=np.float32)[rng.integers(0, 3, 8)], lr=np.float32(0.1))
    first, second = tmp_path / "step1.npz", tmp_path / "step2.npz"
    r = run(MLP, "--inputs", data, "--random-inputs", "--backend", "cpu", "-o", first)
    assert r.exit_code == 0, r.output
    x = np.load(data)["x"]
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", np.load(data)["y"])
    np.save(tmp_path / "lr.npy", np.float32(0.1))
    r = run(MLP, "--inputs", first, "--input", f"x={tmp_path / 'x.npy'}", "--input", f"y={tmp_path / 'y.npy'}",
            "--input", f"lr={tmp_path / 'lr.npy'}", "--backend", "cpu", "-o", second)
    assert r.exit_code == 0, r.output
    for key in ("loss", "correct", "probs"):
        assert f"note: --inputs {first}: ignoring '{key}' (an output of the program, not an input)" in r.output
    with np.load(first) as a, np.load(second) as b:
        assert b["loss"] < a["loss"]          # the second step starts from the first's parameters
    # an evaluation step needs no learning rate
    r = run(MLP, "--inputs", second, "--input", f"x={tmp_path / 'x.npy'}", "--input", f"y={tmp_path / 'y.npy'}",
            "--no-update")
    assert r.exit_code == 0, r.output
    assert r.output.count("note:") == 3
    r = run(MLP, "--inputs", data, "--random-inputs", "--no-update", "--backend", "cpu")
    assert r.exit_code == 0, r.output
    assert f"note: --inputs {data}: ignoring 'lr' (only the updates read it (--no-update))" in r.output


def test_an_updated_output_feeds_the_next_step_by_its_new_value(tmp_path):
    src = tmp_path / "p.tg"
    src.write_text("dim n = 2\nparam w[n]\nout w\nout s = sum(w)\nupdate w = w + 1\n")
    one, two = tmp_path / "1.npz", tmp_path / "2.npz"
    np.savez(tmp_path / "0.npz", w=np.zeros(2, np.float32))
    assert run(src, "--inputs", tmp_path / "0.npz", "-o", one).exit_code == 0
    with np.load(one) as a:
        assert sorted(a.files) == ["s", "w", "w'"] and list(a["w'"]) == [1, 1]
    r = run(src, "--inputs", one, "-o", two)
    assert r.exit_code == 0, r.output
    assert "ignoring 'w' (an output; its new value w' is the input)" in r.output
    with np.load(two) as b:
        assert list(b["w"]) == [1, 1] and list(b["w'"]) == [2, 2]


def test_inputs_from_safetensors(tmp_path):
    prog = tgc.compile(SRC)
    tgc.save_params(tmp_path / "p.safetensors", prog, params())
    r = run(SRC_FILE(tmp_path), "--inputs", tmp_path / "p.safetensors", "--random-inputs", "--backend", "cpu")
    assert r.exit_code == 0, r.output
    assert "loss[]" in r.output
    (tmp_path / "bad.safetensors").write_bytes(b"junk")
    r = run(SRC_FILE(tmp_path), "--inputs", tmp_path / "bad.safetensors", "--random-inputs")
    assert r.exit_code == 3 and "cannot read" in r.output


def SRC_FILE(tmp_path: Path) -> Path:
    path = tmp_path / "model.tg"
    path.write_text(SRC)
    return path


def test_unknown_keys_are_still_refused(tmp_path):
    buf = io.BytesIO()
    np.savez(buf, nope=np.zeros(1))
    (tmp_path / "n.npz").write_bytes(buf.getvalue())
    r = run(MLP, "--inputs", tmp_path / "n.npz", "--random-inputs")
    assert r.exit_code == 3 and "unexpected input 'nope'" in r.output


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_saving_into_a_missing_folder_is_a_params_error(prog, tmp_path, suffix):
    """A folder that does not exist is a `ParamsError` naming it (save_params creates
    no folders), and nothing is written anywhere."""
    path = tmp_path / "no" / "such" / ("w" + suffix)
    with pytest.raises(ParamsError, match=r"cannot write '.*w\.(safetensors|npz)': no folder '.*such'"):
        tgc.save_params(path, prog, params())
    assert not (tmp_path / "no").exists() and list(tmp_path.iterdir()) == []


def test_a_failed_save_leaves_the_old_file_whole(prog, tmp_path, monkeypatch):
    """The write is atomic: a failure while writing (here, the rename) keeps the file
    that was there, and leaves no temporary file beside it."""
    import os as _os

    path = tmp_path / "w.safetensors"
    tgc.save_params(path, prog, params())
    before = path.read_bytes()

    def fail(src, dst):
        raise OSError(28, "No space left on device", str(dst))

    monkeypatch.setattr(_os, "replace", fail)
    new = {n: a + 1 for n, a in params().items()}
    with pytest.raises(ParamsError, match=r"cannot write '.*w\.safetensors': No space left on device"):
        tgc.save_params(path, prog, new)
    monkeypatch.undo()
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]


def test_a_program_that_is_not_one_is_a_type_error(prog, tmp_path):
    """`load_params(path, "mlp")` was an AttributeError ('str' object has no attribute
    'inputs'); save_params likewise."""
    tgc.save_params(tmp_path / "p.npz", prog, params())
    with pytest.raises(TypeError, match=r"load_params: program must be a compiled tgc\.Program .*not str"):
        tgc.load_params(tmp_path / "p.npz", "mlp")
    with pytest.raises(TypeError, match=r"save_params: program must be a compiled tgc\.Program .*not dict"):
        tgc.save_params(tmp_path / "q.npz", {}, {})
    with pytest.raises(TypeError, match=r"save_params: arrays must be a mapping .*not list"):
        tgc.save_params(tmp_path / "q.npz", prog, [1, 2])
