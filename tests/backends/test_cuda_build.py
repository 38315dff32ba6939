"""`tgc build --target cuda`: the CUDA module (cu, ptx, cubin) and its JSON manifest,
reproducible, with depfiles; wrong combinations are usage errors."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tgc.backends.cuda.codegen import COL_SCRATCH

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "examples" / "mlp.tg"


def tgc(*args, cwd):
    return subprocess.run([sys.executable, "-m", "tgc.cli", "build", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True)


def test_cu_and_manifest_are_reproducible_and_describe_the_launches(tmp_path):
    for name in ("a", "b"):
        done = tgc(MLP, "--target", "cuda", "--emit", "cu", "-o", tmp_path / f"{name}.cu", "-MD", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    assert (tmp_path / "a.cu").read_bytes() == (tmp_path / "b.cu").read_bytes()
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert "mlp.tg" in (tmp_path / "a.d").read_text()
    source, man = (tmp_path / "a.cu").read_text(), json.loads((tmp_path / "a.json").read_text())
    assert man["dims"] == ["batch"] and man["dtype"] == "f32" and man["block"] == 256
    assert [a["name"] for a in man["args"]] == ["x", "y", "W1", "b1", "W2", "b2", "lr"]
    assert [o["name"] for o in man["outputs"]] == ["loss", "correct", "probs"]
    kernels = [x for x in man["launches"] if x["kind"] != "gemm"]
    gemms = [x for x in man["launches"] if x["kind"] == "gemm"]
    assert kernels and gemms
    for x in kernels:
        assert re.search(rf'void __launch_bounds__\(256(, 1)?\) {x["kernel"]}\(', source)   # (, 1): a row group
        # the column partials' scratch is the binding's, described by the launch that writes it
        assert set(x["buffers"]) - {COL_SCRATCH} <= {b["name"] for b in man["buffers"]}
        assert COL_SCRATCH not in x["buffers"] or "column_partials" in x or "column_kernel" in x
    for b in man["buffers"]:
        assert b["kind"] != "temp" or b["slot"] < len(man["workspace"]["slots"])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (the CUDA toolkit) is not installed")
def test_a_strict_f32_build_is_the_emulation_tgc_compile_runs(tmp_path):
    """--fp-strict f32: the CUDA module is built from the target pass's f64 emulation
    (`emulate_f32`, run by the pipeline for every backend), as the CPU's is."""
    done = tgc(MLP, "--target", "cuda", "--emit", "cu", "--fp-strict", "-o", tmp_path / "s.cu", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    man = json.loads((tmp_path / "s.json").read_text())
    assert man["dtype"] == "f64" and {a["dtype"] for a in man["args"]} == {"f64"}
    assert (tmp_path / "s.cu").read_text().count("tgc_round32(") > 1   # used, beside its definition


def test_cubin_is_an_elf_with_every_kernel(tmp_path):
    done = tgc(MLP, "--target", "cuda", "-o", tmp_path / "mlp.cubin", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    cubin = (tmp_path / "mlp.cubin").read_bytes()
    assert cubin[:4] == b"\x7fELF"
    man = json.loads((tmp_path / "mlp.json").read_text())
    assert man["format"] == "cubin" and man["arch"] == "sm_90"
    for x in man["launches"]:
        if x["kind"] != "gemm":
            assert x["kernel"].encode() in cubin


def test_wrong_combinations_are_usage_errors(tmp_path):
    done = tgc(MLP, "--target", "cuda", "--emit", "so", cwd=tmp_path)
    assert done.returncode == 2 and "--emit so is not an output of --target cuda" in done.stderr
    done = tgc(MLP, "--emit", "cubin", cwd=tmp_path)
    assert done.returncode == 2 and "--emit cubin is not an output of --target cpu" in done.stderr
    done = tgc(MLP, "--target", "cuda", "--emit", "cu", "-o", "-", cwd=tmp_path)
    assert done.returncode == 2 and "manifest" in done.stderr
    assert not list(tmp_path.iterdir())


def test_manifest_describes_a_loop_as_a_host_loop_over_its_step(tmp_path):
    """A loop over an edge is one `steps` entry: the step's buffers and launches (its
    kernels in the module once) and the carries' copy kernels."""
    src = tmp_path / "deep.tg"
    src.write_text("dim layer, c = 4\ninput x[c]\nparam w[layer, c]\nfn f(h, w) = tanh(h * w)\n"
                   "y = repeat[layer](f, x, w)\nout y\n")
    done = tgc(src, "--target", "cuda", "--emit", "cu", "-o", tmp_path / "deep.cu", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    source, man = (tmp_path / "deep.cu").read_text(), json.loads((tmp_path / "deep.json").read_text())
    loop = next(x for x in man["launches"] if x["kind"] == "steps")
    assert loop["edge"] == "layer" and loop["trip"] == "layer" and not loop["reverse"] and loop["carries"] == 1
    assert [a["stacked"] for a in loop["args"]] == [False, True]
    names = {b["name"] for b in man["buffers"]}
    assert {a["buffer"] for a in loop["args"] + loop["outs"]} <= names
    for x in loop["step"]["launches"] + loop["carry"]:
        assert re.search(rf'void __launch_bounds__\(256(, 1)?\) {x["kernel"]}\(', source)
    assert set(loop["step"]["launches"][0]["buffers"]) <= {b["name"] for b in loop["step"]["buffers"]}
    assert set(loop["carry"][0]["buffers"]) <= names
