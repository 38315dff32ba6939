"""`for p in LIST { ... }` blocks, `[p in ...]` and `sum[p in LIST](x)` (docs/language.md,
"One rule for many params"): the block is a template that the front end expands per
listed tensor, into ordinary states, updates and outputs. Checked here: the expansion
is exactly the program written out by hand (the same IR, the same bits), section 12's
example trains, and the per-param states `m.NAME` are part of the interface everywhere
a caller meets one: `tgc info`, `print(program)`, calls by dict, `tgc run --inputs`,
`save_params`/`load_params`, the C header, `tgc.torch`, `Program.init_state`.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import tgc
from tgc.ir.diag import CompileError

MODEL = """
dim batch, d = 4, h = 8, k = 3
input x[batch, d], y[batch, k]
input lr, wd
param wq[d, h], bq[h], wo[h, k]
loss = mean[batch](cross_entropy[k](relu(x @ wq + bq) @ wo, y))
"""

# LANGUAGE.md section 12's for block, as written there
SECTION_12 = """
state step
tt = step + 1
update step = tt
gnorm = sqrt(sum[p in params](sum(grad(loss, p) ^ 2)))     # a sum over a list of tensors
clip  = min(1, 1 / (gnorm + 1e-6))
for p in params {                    # every declared param; or a list: for p in wq, wk, wv
  state m.p, v.p                     # per-param states, named m.wq, v.wq, ...: p's edges
  g  = clip * grad(loss, p)
  mn = 0.9 * m.p + 0.1 * g
  vn = 0.95 * v.p + 0.05 * g * g
  update m.p = mn
  update v.p = vn
  update p = p - lr * ((mn / (1 - 0.9 ^ tt)) / (sqrt(vn / (1 - 0.95 ^ tt)) + 1e-8)
                       + wd * [p in wq, wo] * p)    # 1 for the listed params, else 0
}
out loss
"""

SHAPES = {"wq": ("d, h", (4, 8)), "bq": ("h", (8,)), "wo": ("h, k", (8, 3))}


def hand_written(prefix: str) -> str:
    """SECTION_12 expanded by hand, its states named `{prefix}NAME` (prefix `m.`: the
    names the block gives them; `m_`: names written out as one would without it)."""
    m, v = f"m{prefix}", f"v{prefix}"
    lines = [MODEL, "state step", "tt = step + 1", "update step = tt",
             "gnorm = sqrt(" + " + ".join(f"sum(grad(loss, {p}) ^ 2)" for p in SHAPES) + ")",
             "clip  = min(1, 1 / (gnorm + 1e-6))"]
    lines += [f"state {m}{p}[{e}], {v}{p}[{e}]" for p, (e, _) in SHAPES.items()]
    for p in SHAPES:
        decay = 1 if p in ("wq", "wo") else 0
        lines += [f"g_{p} = clip * grad(loss, {p})",
                  f"mn_{p} = 0.9 * {m}{p} + 0.1 * g_{p}",
                  f"vn_{p} = 0.95 * {v}{p} + 0.05 * g_{p} * g_{p}",
                  f"update {m}{p} = mn_{p}",
                  f"update {v}{p} = vn_{p}",
                  f"update {p} = {p} - lr * ((mn_{p} / (1 - 0.9 ^ tt)) / (sqrt(vn_{p} / (1 - 0.95 ^ tt)) + 1e-8)"
                  f" + wd * {decay} * {p})"]
    return "\n".join(lines + ["out loss"]) + "\n"


def data(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    y = np.eye(3, dtype=np.float32)[(x[:, 0] > 0).astype(int) + (x[:, 1] > 0)]
    params = {p: (0.5 * rng.standard_normal(shape)).astype(np.float32) for p, (_, shape) in SHAPES.items()}
    return x, y, params


def train(program, steps: int, rename=lambda name: name) -> tuple[list[float], dict]:
    x, y, params = data()
    arrays = {**params, **{rename(k): v for k, v in program.init_state().items()}} if rename else params
    losses = []
    for _ in range(steps):
        losses.append(float(program.run({"x": x, "y": y, "lr": 0.05, "wd": 0.01, **arrays})["loss"]))
    return losses, arrays


def test_section_12_example_checks_compiles_and_trains():
    program = tgc.compile(MODEL + SECTION_12)
    assert [s.name for s in program.inputs if s.kind == "state"] == \
        ["step", "m.wq", "v.wq", "m.bq", "v.bq", "m.wo", "v.wo"]
    losses, arrays = train(program, 40)
    assert float(arrays["step"]) == 40
    assert losses[-1] < 0.5 * losses[0], losses
    assert arrays["m.wq"].shape == (4, 8) and np.abs(arrays["v.bq"]).max() > 0


def test_the_block_is_the_program_written_out():
    block = tgc.compile(MODEL + SECTION_12)
    same_names = tgc.compile(hand_written("."))
    assert block.ir() == same_names.ir()
    got, a = train(block, 5)
    want, b = train(same_names, 5)
    assert got == want
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), name
    # Named otherwise, the states change only the order in which the optimizer writes
    # the factors of a product (it sorts them by name): the same step, rounded otherwise.
    mine, c = train(tgc.compile(hand_written("_")), 5)
    np.testing.assert_allclose(got, mine, rtol=1e-6)
    for name in a:
        np.testing.assert_allclose(a[name], c[name.replace(".", "_")], rtol=1e-5, atol=1e-7, err_msg=name)


def test_lists_members_sums_and_outputs_per_instance():
    src = """
    dim n = 3
    input x[n]
    param a[n], b[n], c
    state s
    loss = sum(x * a * b) * c + s
    for p in b, c {
      out sq.p = sum(p * p) * (1 + 2 * [p in c])
    }
    out n2 = sum[q in a, b, c](sum(q * q))
    """
    program = tgc.compile(src)
    assert [o.name for o in program.outputs] == ["sq.b", "sq.c", "n2"]
    a, b, c = np.array([1., 2., 3.], np.float32), np.array([0., 1., -1.], np.float32), np.float32(2)
    out = program.run({"x": np.ones(3, np.float32), "a": a, "b": b, "c": c, "s": np.float32(0)})
    assert float(out["sq.b"]) == 2 and float(out["sq.c"]) == 12 and float(out["n2"]) == 14 + 2 + 4


def test_the_interface_shows_the_per_param_states(tmp_path):
    path = tmp_path / "adamw.tg"
    path.write_text(MODEL + SECTION_12)
    info = subprocess.run([sys.executable, "-m", "tgc.cli", "info", str(path)], capture_output=True, text=True)
    assert info.returncode == 0, info.stderr
    assert "state  m.wq  [d, h]" in info.stdout and "m.wo    state  m.wo    [h, k]" in info.stdout
    program = tgc.compile(path)
    assert "m.bq" in str(program) and "v.wo[h, k]" in repr(program)

    build = subprocess.run([sys.executable, "-m", "tgc.cli", "build", str(path), "-o", str(tmp_path / "libadamw.so")],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    header = (tmp_path / "adamw.h").read_text()
    assert "#define ADAMW_ARG_M_WQ 8  /* state m.wq: float [d=4, h=8] row-major (updated in place" in header
    assert "ADAMW_ARG_V_WO 13" in header


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_save_and_load_per_param_states(tmp_path, suffix):
    program = tgc.compile(MODEL + SECTION_12)
    _, arrays = train(program, 3)
    tgc.save_params(tmp_path / f"p{suffix}", program, arrays)
    loaded = tgc.load_params(tmp_path / f"p{suffix}", program)
    assert set(loaded) == set(arrays)
    for name, a in arrays.items():
        np.testing.assert_array_equal(loaded[name], a, err_msg=name)


def test_every_way_of_passing_a_dotted_name(tmp_path):
    program = tgc.compile(MODEL + SECTION_12)
    x, y, params = data()
    state = program.init_state()
    given = {"x": x, "y": y, "lr": 0.05, "wd": 0.0, **params, **state}
    copy = {k: np.array(v) for k, v in given.items()}
    by_kwargs = program(**given)                 # ** of a dict: any string is a keyword
    by_dict = program.run(copy)
    assert float(by_kwargs["loss"]) == float(by_dict["loss"])
    assert state["m.wq"].tobytes() == copy["m.wq"].tobytes() and np.abs(state["m.wq"]).max() > 0

    np.savez(tmp_path / "in.npz", **{k: np.asarray(v, np.float32) for k, v in copy.items()})
    r = subprocess.run([sys.executable, "-m", "tgc.cli", "run", "-", "--inputs", str(tmp_path / "in.npz"),
                        "-o", str(tmp_path / "out.npz")], input=MODEL + SECTION_12, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with np.load(tmp_path / "out.npz") as out:
        assert out["m.wq"].shape == (4, 8) and float(out["step"]) == 2


def test_torch_takes_dotted_names():
    torch = pytest.importorskip("torch")
    import tgc.torch

    program = tgc.compile(MODEL + SECTION_12)
    x, y, params = data()
    f = tgc.torch.function(program)
    tensors = {k: torch.tensor(np.asarray(v), requires_grad=k != "x")
               for k, v in {"x": x, "y": y, "lr": np.float32(0.1), "wd": np.float32(0), **params,
                            **program.init_state()}.items()}
    out = f(**tensors)
    out["loss"].backward()
    assert tensors["m.wq"].grad is not None and tensors["wq"].grad.abs().max() > 0


def test_init_state():
    src = """
    dim n, k = 2
    param w[n, k], z: c64[k]
    input x[n]
    loss = sum(x @ w) + real(sum(z * conj(z)))
    for p in params { state m.p
      update m.p = m.p + 1 }
    state count
    update count = count + 1
    out loss
    """
    program = tgc.compile(src)
    with pytest.raises(ValueError, match="dims="):
        program.init_state()
    state = program.init_state(dims={"n": 5})
    assert {k: (v.shape, v.dtype) for k, v in state.items()} == {
        "m.w": ((5, 2), np.float32), "m.z": ((2,), np.complex64), "count": ((), np.float32)}
    assert all(not v.any() and v.flags.writeable for v in state.values())
    program(w=np.ones((5, 2), np.float32), z=np.ones(2, np.complex64), x=np.ones(5, np.float32), **state)
    assert float(state["count"]) == 1 and (state["m.z"] == 1).all()


@pytest.mark.parametrize("backend", ["interp", "lowered", "cpu"])
def test_init_state_of_low_precision_states_is_of_their_declared_type(backend):
    """A bf16 param's per-param state is bf16, and an f16 state f16, on every backend:
    the interpreters' init_state gave float32 arrays, which the call then refused
    ("'m.A' is updated in place, so it must be bfloat16")."""
    import ml_dtypes

    src = ("dim n = 4, m = 3\nparam A: bf16[n, m]\nparam b[m]\nstate h: f16[m]\ninput x[n]\n"
           "loss = sum((x @ A + b) ^ 2)\nupdate h = h + 1\n"
           "for p in params {\n  state m.p\n  update m.p = 0.9 * m.p + grad(loss, p)\n}\nout loss\n")
    program = tgc.compile(src, backend=backend)
    state = program.init_state()
    assert {k: v.dtype for k, v in state.items()} == {
        "h": np.float16, "m.A": ml_dtypes.bfloat16, "m.b": np.float32}
    A = np.ones((4, 3), ml_dtypes.bfloat16)
    program(A=A, b=np.ones(3, np.float32), x=np.ones(4, np.float32), **state)
    assert (state["h"] == 1).all()
    np.testing.assert_array_equal(state["m.A"].astype(np.float32), np.full((4, 3), 2 * 5, np.float32))   # 2 (x @ A + b) x


def test_grad_emit_tg_of_per_param_states_reads_back(tmp_path):
    src = "dim k = 3\nparam w[k]\nfor p in params {\n  state m.p\n  update m.p = m.p + grad(sum(w * w), p)\n}\n" \
          "out o = sum(m.w * w)\n"
    path = tmp_path / "g.tg"
    path.write_text(src)
    r = subprocess.run([sys.executable, "-m", "tgc.cli", "grad", str(path), "--wrt", "m.w", "--emit", "tg"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "out dm_w[k]" in r.stdout   # a per-param state's derivative named so that `tgc check` takes it
    tgc.compile(r.stdout)   # the per-param name reads back outside a for block


def test_an_unused_binding_of_a_block_is_one_warning(tmp_path):
    path = tmp_path / "w.tg"
    path.write_text("dim k = 3\nparam a[k], b[k]\nfor p in params {\n  h = 2 * p\n  update p = p\n}\n")
    r = subprocess.run([sys.executable, "-m", "tgc.cli", "check", str(path)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr.count("warning: 'h' is never used") == 1, r.stderr
    assert "w.tg:4:3:" in r.stderr


def test_for_is_reserved_and_in_is_not():
    with pytest.raises(CompileError, match="unexpected keyword 'for'"):
        tgc.compile("dim n = 2\ninput for[n]\nout y = for\n")
    program = tgc.compile("dim in = 2\ninput x[in]\nparam w[in]\nfor p in params { update p = p + x }\n"
                          "out y = sum[p in w](sum(p * x))\n")
    assert program.outputs[0].name == "y"


def test_init_state_of_a_data_parallel_step():
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install -e '.[mpi]')")
    try:
        from mpi4py import MPI
    except RuntimeError as e:   # installed, but no MPI library to load
        pytest.skip(f"mpi4py does not load its MPI library: {e}")
    step = tgc.compile(MODEL + SECTION_12 + "state unread[d]\n", data_parallel=MPI.COMM_SELF)
    state = step.init_state()
    assert list(state) == ["step", "m.wq", "v.wq", "m.bq", "v.bq", "m.wo", "v.wo", "unread"]
    x, y, params = data()
    step(x=x, y=y, lr=0.05, wd=0.0, **params, **state)
    assert float(state["step"]) == 1 and np.abs(state["v.wo"]).max() > 0
