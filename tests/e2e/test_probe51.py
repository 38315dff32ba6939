"""Probe of stop 51: an outsider's programs and hostile inputs, from shared/LANGUAGE.md
(sections 11 and 12 above all) and the README only, through the Python API and the CLI.
Each test here failed before its fix (the commit that adds it says which)."""
from __future__ import annotations

import numpy as np
import pytest

import tgc

COMPLEX_STATE = """dim c = 2
input x[c]
param z: c64[c]
state a: f32[c], s: c64[c]
out y = sum(x)
update a = a + x
update s = s + x
update z = z * 2
for p in params {
  state m.p
  update m.p = m.p + z
}
"""


@pytest.mark.parametrize("backend", ["interp", "cpu", "cuda-sim"])
def test_init_state_of_a_c64_state_in_an_f64_program_is_what_the_call_takes(backend):
    """`init_state()` promises each state "of the shape and element type a call takes".
    A `c64` state (declared, or a for block's `state m.p` of a c64 param) keeps its
    width in an f64 program, and the call refuses an updated one of another width; but
    init_state gave it as complex128, so its own zeros were refused ('s' is updated in
    place, so it must be complex64, not complex128)."""
    p = tgc.compile(COMPLEX_STATE, dtype="f64", backend=backend)
    st = p.init_state()
    assert {k: v.dtype for k, v in st.items()} == {"a": np.float32, "s": np.complex64, "m.z": np.complex64}
    z = np.array([1 + 2j, 3j], np.complex64)
    p(x=np.ones(2), z=z, **st)
    np.testing.assert_array_equal(st["s"], [1, 1])
    np.testing.assert_array_equal(st["m.z"], [1 + 2j, 3j])
    np.testing.assert_array_equal(st["a"], [1, 1])


LOW_STATES = """dim batch, c = 3
input x[batch, c]
param v[c]
state m: bf16[c], s: c64[c]
loss = mean(x @ v)
out loss
update m = 0.5 * m + grad(loss, v)
update s = s + 1j * grad(loss, v)
"""


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_data_parallel_init_state_is_what_its_call_takes(dtype):
    """`DataParallel.init_state` promises the states "as `Program.init_state` gives
    them"; it gave a bf16 state as the float type, and a c64 state of an f64 program as
    complex128, and then its own call refused them ("'m' is updated in place, so it
    must be bfloat16, not float64")."""
    pytest.importorskip("ml_dtypes", reason="bf16 arrays are ml_dtypes'")
    from tgc.local_ranks import local_group

    dp = tgc.compile(LOW_STATES, dtype=dtype, data_parallel=local_group(1)[0])
    st = dp.init_state()
    want = tgc.compile(LOW_STATES, dtype=dtype).init_state()
    assert {k: v.dtype for k, v in st.items()} == {k: v.dtype for k, v in want.items()}
    dp(x=np.ones((2, 3)), v=np.ones(3, np.float64 if dtype == "f64" else np.float32), **st)
    np.testing.assert_array_equal(st["m"].astype(np.float32), [1, 1, 1])
    np.testing.assert_array_equal(st["s"], [1j, 1j, 1j])


BF16_TORCH = """dim batch, c = 3
input x[batch, c]
param w: bf16[c], v[c]
out loss = mean(x @ (f32(w) * v))
out h[c] = w * 2
"""


def test_torch_function_takes_and_gives_bf16_tensors():
    """`tgc.torch.function` takes torch CPU tensors; a bf16 one (a `bf16` param) failed
    in `Tensor.numpy()` with PyTorch's own TypeError ('Got unsupported ScalarType
    BFloat16'), though the program itself takes it (through DLPack). Its bf16 output
    comes back as a bf16 tensor, and the bf16 param's gradient as the param's type."""
    torch = pytest.importorskip("torch", reason="tgc.torch is for PyTorch")
    import tgc.torch as tgc_torch

    f = tgc_torch.function(tgc.compile(BF16_TORCH))
    w = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16, requires_grad=True)
    v = torch.tensor([0.5, 1.0, 2.0], requires_grad=True)
    x = torch.ones(2, 3)
    out = f(x=x, w=w, v=v)
    assert out["h"].dtype == torch.bfloat16 and out["h"].tolist() == [2.0, 4.0, 6.0]
    out["loss"].backward()
    assert out["loss"].item() == pytest.approx(0.5 + 2 + 6)
    assert w.grad.dtype == torch.bfloat16 and w.grad.tolist() == [0.5, 1.0, 2.0]
    assert v.grad.tolist() == [1.0, 2.0, 3.0]


def test_run_output_named_safetensors_is_refused_not_written_as_npz(tmp_path):
    """`tgc run -o` writes an .npz archive; `-o out.safetensors` wrote a zip under that
    name, which `--inputs out.safetensors` then refused as 'a damaged safetensors file'.
    The name is refused up front (a usage error, nothing written), as is any name not
    ending in .npz (tests/cli/test_outputs.py)."""
    from click.testing import CliRunner

    from tgc.cli import main

    src = tmp_path / "p.tg"
    src.write_text("dim c = 3\ninput x[c]\nparam w[c]\nout loss = sum(w * x)\nupdate w = w - 0.1 * x\n")
    out = tmp_path / "out.safetensors"
    r = CliRunner().invoke(main, ["run", str(src), "--random-inputs", "-o", str(out)])
    assert r.exit_code == 2, r.output
    assert ".npz" in r.output and not out.exists()
    r = CliRunner().invoke(main, ["run", str(src), "--random-inputs", "-o", str(tmp_path / "out.npz")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["run", str(src), "--random-inputs", "--inputs", str(tmp_path / "out.npz")])
    assert r.exit_code == 0, r.output
