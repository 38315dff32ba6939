"""Probe of stop 52: an outsider's programs and hostile inputs, from shared/LANGUAGE.md
and the README only, through the Python API and the CLI. Each test here failed before
its fix (the commit that adds it says which), unless its docstring says it is a probe
kept because it passed."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tgc

ROOT = Path(__file__).resolve().parents[2]


def _safetensors_file(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A .safetensors file as another tool writes it (no tgc metadata): the 8-byte
    little-endian header length, the JSON header, then the data."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_load_params_reads_a_bf16_safetensors_file_in_a_fresh_process(tmp_path):
    """Model weights are exchanged as bf16 safetensors files (PyTorch writes them so).
    `load_params` of one, for a program whose param is declared bf16, said "a damaged
    safetensors file (data type 'bfloat16' not understood)" in any process that had not
    imported ml_dtypes yet: safetensors' numpy reader looks the dtype up by name, and
    only ml_dtypes registers it."""
    # bf16 bit patterns of 1.0, -2.0, 0.5 (the top halves of their f32 patterns)
    raw = np.array([1.0, -2.0, 0.5], np.float32).view(np.uint32) >> 16
    _safetensors_file(tmp_path / "w.safetensors", {"w": ("BF16", [3], raw.astype("<u2").tobytes())})
    (tmp_path / "m.tg").write_text("dim n = 3\ninput x[n]\nparam w: bf16[n]\nout y = sum(x * f32(w))\n")
    code = ("import sys, tgc\n"
            "p = tgc.compile(sys.argv[1], backend='interp')\n"
            "w = tgc.load_params(sys.argv[2], p)['w']\n"
            "print(w.dtype, [float(v) for v in w])\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.tg"), str(tmp_path / "w.safetensors")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["bfloat16", "[1.0,", "-2.0,", "0.5]"]


def test_save_params_writes_bf16_params_to_safetensors(tmp_path):
    """save_params refused a bf16 param to `.safetensors` ("safetensors' numpy reader
    cannot read back"), but the reader does once ml_dtypes is imported (load_params
    now imports it): the format weights are exchanged in takes bf16, as PyTorch's
    bf16 weights; written, it reads back bit for bit, and its header says BF16."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    p = tgc.compile("dim n = 3, m = 2\ninput x[n]\nparam w: bf16[n, m], b[m]\n"
                    "out y = sum(x @ f32(w) + b)\n", backend="interp")
    w = np.array([[1.5, -2], [0.25, 3], [1e-3, 7]], np.float32).astype(ml_dtypes.bfloat16)
    b = np.array([1, 2], np.float32)
    tgc.save_params(tmp_path / "m.safetensors", p, {"w": w, "b": b})
    raw = (tmp_path / "m.safetensors").read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    assert header["w"]["dtype"] == "BF16" and header["b"]["dtype"] == "F32"
    back = tgc.load_params(tmp_path / "m.safetensors", p)
    assert back["w"].dtype == w.dtype and back["w"].view(np.uint16).tolist() == w.view(np.uint16).tolist()
    np.testing.assert_array_equal(back["b"], b)


CASE_NAMES = """dim n, N
input x[n], X[N]
param w[n], W[N]
out y = sum(x * w)
out Y = sum(X * W)
for p in params {
  state m.p
  update m.p = m.p + grad(y + Y, p)
}
"""


def test_c_header_macros_of_names_that_differ_only_in_case_are_distinct(tmp_path):
    """`w` and `W` are two names (edges, tensors and outputs are case-sensitive), but the
    header upper-cases them into one macro: `#define M_ARG_W 2` then `#define M_ARG_W 3`,
    a redefinition C compilers only warn about, so a C caller silently passed W's array
    as w's. Macros of names that differ only in case keep the name's case instead."""
    r = subprocess.run([sys.executable, "-m", "tgc", "build", "--emit", "h", "-o", str(tmp_path / "case.h"),
                        str(_write(tmp_path / "case.tg", CASE_NAMES))], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr
    header = (tmp_path / "case.h").read_text()
    defines = {}
    for line in header.splitlines():
        if line.startswith("#define CASE_") and line.split()[2].lstrip("-(").rstrip(")").isdigit():
            name, value = line.split()[1:3]
            assert name not in defines, f"{name} defined twice: {defines[name]} and {value}"
            defines[name] = value
    args = {d[len("CASE_ARG_"):]: int(v) for d, v in defines.items() if d.startswith("CASE_ARG_")}
    assert len(args) == 6 and sorted(args.values()) == list(range(6))
    assert args["x"] != args["X"] and args["w"] != args["W"] and args["m_w"] != args["m_W"]
    outs = {d[len("CASE_OUT_"):]: int(v) for d, v in defines.items() if d.startswith("CASE_OUT_")}
    dims = {d[len("CASE_DIM_"):]: int(v) for d, v in defines.items() if d.startswith("CASE_DIM_")}
    assert outs == {"y": 0, "Y": 1} and dims == {"n": 0, "N": 1}
    if subprocess.run(["which", "gcc"], capture_output=True).returncode == 0:
        (tmp_path / "t.c").write_text('#include "case.h"\nint main(void) { return CASE_ARG_w + CASE_ARG_W; }\n')
        c = subprocess.run(["gcc", "-Werror", "-c", "t.c", "-o", "t.o"], cwd=tmp_path, capture_output=True, text=True)
        assert c.returncode == 0, c.stderr


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


DOT_STATE = """dim n = 3
input x[n]
param w[n]
out y = sum(x * w * w)
for p in params {
  state m.p
  update m.p = m.p + grad(y, p)
}
out z = sum(m.w * x * x)
"""


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_tgc_grad_of_a_per_param_state_prints_source_that_tgc_check_accepts(tmp_path, mode):
    """`tgc grad` promises ".tg source that `tgc check` accepts"; with respect to a for
    block's state `m.w` it printed `out dm.w[n] = ...`, which the front end reads as a
    per-param name outside a for block (an error). The derivative is named `dm_w`."""
    src = _write(tmp_path / "dot.tg", DOT_STATE)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "tgc", "grad", str(src), "--of", "z", "--wrt", "m.w", "--mode", mode,
                        "-o", str(tmp_path / "g.tg")], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    c = subprocess.run([sys.executable, "-m", "tgc", "check", "-Werror", str(tmp_path / "g.tg")],
                       capture_output=True, text=True, timeout=300, env=env)
    assert c.returncode == 0, c.stderr + (tmp_path / "g.tg").read_text()
    g = tgc.compile(str(tmp_path / "g.tg"), backend="interp", dtype="f64")
    x = np.array([1.0, -2.0, 3.0])
    np.testing.assert_array_equal(g(x=x)["dm_w"], x * x)


DILATED = """dim t, s, k = 3
input x[t], w[k]
y = x[t = 2*s + 2*k - 1] @ w
out y
out gx = grad(sum(y * y), x)
out gw = grad(sum(y * y), w)
out jy = jvp(y, x, x)
"""


@pytest.mark.parametrize("backend", ["interp", "cpu", "lowered"])
def test_strided_dilated_padded_conv_with_a_symbolic_length_matches_torch(backend):
    """A probe kept because it passed: stride 2, dilation 2, padding 1 written as one
    reindex, the input length symbolic and the output's (`s`, read by no input) given
    at the call; values, both gradients and a jvp against torch's conv1d."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    p = tgc.compile(DILATED, backend=backend, dtype="f64")
    rng = np.random.default_rng(52)
    for T in (5, 8):
        x, w = rng.standard_normal(T), rng.standard_normal(3)
        S = (T + 2 - 4 - 1) // 2 + 1
        X, W = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
        y = F.conv1d(X[None, None], W[None, None], stride=2, padding=1, dilation=2)[0, 0]
        gx, gw = torch.autograd.grad((y * y).sum(), [X, W])
        got = p.run({"x": x, "w": w}, dims={"s": S})
        np.testing.assert_allclose(got["y"], y.detach().numpy(), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(got["gx"], gx.numpy(), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(got["gw"], gw.numpy(), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(got["jy"], y.detach().numpy(), rtol=1e-12, atol=1e-14)   # linear in x


SEGMENTS = """dim e, node, f = 3
input msg[e, f], dst: i32[e]
m = max[e](where([node = dst], msg, -inf))
mn = min[e](where([node = dst], msg, inf))
out m
out mn
out gm = grad(sum(where(m > -inf, m, 0) * where(mn < inf, mn, 0)) + sum(where(mn < inf, mn, 0)), msg)
"""


@pytest.mark.parametrize("backend", ["interp", "cpu", "lowered"])
def test_segment_max_and_min_with_ties_and_empty_segments_match_torch(backend):
    """A probe kept because it passed: segment max and min (LANGUAGE.md section 11), a
    node no edge reaches (-inf / inf, masked out of the loss) and tied messages (a tie
    in a max[e] shares the gradient evenly, as torch's scatter_reduce amax/amin does)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(52)
    msg = rng.standard_normal((7, 3))
    msg[1] = msg[0]
    msg[6, 1] = msg[0, 1]
    dst = np.array([0, 0, 2, 2, 2, 4, 0], np.int32)
    M = torch.tensor(msg, requires_grad=True)
    index = torch.tensor(dst, dtype=torch.long)[:, None].expand(7, 3)
    mx = torch.full((5, 3), -np.inf, dtype=torch.float64).scatter_reduce(0, index, M, "amax")
    mn = torch.full((5, 3), np.inf, dtype=torch.float64).scatter_reduce(0, index, M, "amin")
    loss = (torch.where(mx > -np.inf, mx, 0) * torch.where(mn < np.inf, mn, 0)).sum() + torch.where(mn < np.inf, mn, 0).sum()
    gm, = torch.autograd.grad(loss, M)
    got = tgc.compile(SEGMENTS, backend=backend, dtype="f64").run({"msg": msg, "dst": dst}, dims={"node": 5})
    np.testing.assert_array_equal(got["m"], mx.detach().numpy())
    np.testing.assert_array_equal(got["mn"], mn.detach().numpy())
    np.testing.assert_allclose(got["gm"], gm.numpy(), rtol=1e-12, atol=1e-14)


def test_load_params_names_an_fp8_safetensors_array_not_a_damaged_file(tmp_path):
    """An FP8 tensor (F8_E4M3, as quantized checkpoints hold) is a well-formed file of a
    type tgc does not take: load_params said "a damaged safetensors file (data type
    'float8_e4m3fn' not understood)"; it names the array and its type."""
    _safetensors_file(tmp_path / "w.safetensors", {"w": ("F8_E4M3", [3], bytes([0x38, 0x40, 0xb8]))})
    (tmp_path / "m.tg").write_text("dim n = 3\ninput x[n]\nparam w[n]\nout y = sum(x * w)\n")
    code = ("import sys, tgc\n"
            "p = tgc.compile(sys.argv[1], backend='interp')\n"
            "try:\n"
            "    tgc.load_params(sys.argv[2], p)\n"
            "except tgc.ParamsError as e:\n"
            "    print(e)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.tg"), str(tmp_path / "w.safetensors")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "damaged" not in r.stdout and "'w' is F8_E4M3, a type tgc does not take" in r.stdout, r.stdout
