"""Column sums fused into the CUDA backends' row groups (`rows.column_member`, rowgen's
`RowGroupGen`): a layer's backward (`db = sum[rows](dy)`, `dw =
sum[rows](dy * xhat)`) is summed while the row group has the row in hand, a partial row
per slot of rows (`CudaOptions.row_slot_rows`, `row_slot_elems`), the slots' partials
added in slot order by one more kernel, instead of column-tile kernels reading the rows
again.

On cuda-sim against the interpreter (f32 and f64) at row lengths below and above what
the emulated block holds in registers (both paths: partials in registers, partials in
memory), through both variants (a warp, a block per row), with one slot and with many;
the same bits on every run; f32 within the numerics contract (10x PyTorch f32's error);
the kernel count with and without the fusion."""
from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest

import tgc
from tgc.backends.cuda import codegen, launches
from tgc.backends.cuda.options import CudaOptions
from tgc.backends.cuda.rows import RowGroup, column_member
from tgc.ir.inputs import random_inputs
from tgc.ir.interp import evaluate
from tgc.options import Options

from numerics_util import normwise_err, ok
from layer_programs import LAYERNORM

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="cuda-sim needs g++ with OpenMP")

# a column mean (an epilogue after the sum) next to a row softmax
SOFTMAX_MEAN = """
dim rows, d
input x[rows, d]
out y[rows, d] = softmax[d](x)
out m[d] = mean[rows](y * x)
"""
TOL = {"f64": (1e-12, 1e-13), "f32": (3e-5, 3e-6)}


def build(source: str, dtype: str, **cuda):
    cuda.setdefault("row_columns", True)   # (off by default: this file tests the variant)
    return tgc.compile(source, backend="cuda-sim", dtype=dtype, options=Options().with_(cuda=CudaOptions(**cuda)))


def counters(prog):
    fn = prog._kernels._device.lib.tgc_sim_counters
    fn.restype = ctypes.POINTER(ctypes.c_longlong)
    return fn()


def run(prog, dims: dict, dtype: str, seed: int = 0) -> tuple[dict, int, int]:
    """(outputs, slots whose partials were in registers, slots whose partials were in
    memory): checked against the interpreter."""
    m = prog.module
    x = random_inputs(m, m.bind_dims(dims), seed, dtype)
    want = evaluate(m, {k: np.copy(v) for k, v in x.items()}, dtype=dtype)
    c = counters(prog)
    c[6] = c[7] = 0
    got = prog(**{k: np.copy(v) for k, v in x.items()})
    rtol, atol = TOL[dtype]
    for name, w in want.items():
        scale = max(1.0, float(np.max(np.abs(w)))) if w.size else 1.0
        np.testing.assert_allclose(got[name], w, rtol=rtol, atol=atol * scale, err_msg=f"{name} at {dims}")
    return got, c[6], c[7]


def test_column_sums_move_up_to_the_group_that_reads_their_rows():
    """In the GPT's training step the bias and layernorm gradients come after every GEMM
    of the backward pass; each joins the nearest earlier row group that reads or writes
    the rows it sums (at most `row_columns_max` per group), moved past kernels that
    neither write what it reads nor touch its output; its loops become the group's."""
    from pathlib import Path

    from tgc import pipeline
    from tgc.backends.cuda.runtime import lower

    path = Path(__file__).resolve().parents[2] / "examples" / "gpt.tg"
    o = Options(dtype="f32")
    module = pipeline.lower(pipeline.load(str(path), o), o).module
    on, off = lower(module, o.with_(cuda=CudaOptions(row_columns=True))), lower(module, o)
    joined = {}
    for n, k in enumerate(on.kernels):
        if isinstance(k, RowGroup):
            cols = [m for m in k.members if column_member(m, k.outer, k.sizes)]
            assert len(cols) <= CudaOptions().row_columns_max
            for m in cols:
                assert m.loops[:len(k.outer)] == k.outer
                # the loads whose index runs over the group's rows (by loop variable: a buffer's edge
                # may have another name, e.g. a product summed into another's buffer, `accumulate`)
                reads_rows = {ld.buf for ld in walk_loads(m)
                              if {v for _, ix in ld.index for v, _ in ix.terms} >= set(k.outer)}
                assert reads_rows & (k.buffers_read() | k.writes()), m.out
                joined[m.out] = k.members[0].out
    assert len(joined) >= 10, joined
    # each moved past kernels that write nothing it reads and do not touch its output
    where = {(k.members[0] if isinstance(k, RowGroup) else k).out: n for n, k in enumerate(off.kernels)
             if isinstance(k, RowGroup) or hasattr(k, "out")}
    for out, first in joined.items():
        group, was = where[first], where[out]
        col = off.kernels[was]
        assert group < was
        for k in off.kernels[group + 1:was]:
            assert not (k.writes() & col.buffers_read()) and out not in k.writes() | k.buffers_read()
    assert len(codegen.generate(on).launches) < len(codegen.generate(off).launches)


def walk_loads(m):
    from tgc.lower.lowered import Load, walk

    for root in [m.body] + ([m.epilogue] if m.epilogue is not None else []):
        yield from (e for e in walk(root) if isinstance(e, Load))


def test_the_backward_is_one_row_group_and_its_partials():
    on, off = build(LAYERNORM, "f32"), build(LAYERNORM, "f32", row_columns=False)
    assert [(x.kind, x.name) for x in on.cuda_module.launches] == [("rows", "k0"), ("loop", "k0_cols")]
    assert [(x.kind, bool(x.col)) for x in off.cuda_module.launches] == [("rows", False), ("loop", True),
                                                                         ("loop", True)]
    (g,) = [k for k in on.lowered.kernels if isinstance(k, RowGroup)]
    cols = [m.out for m in g.members if column_member(m, g.outer, g.sizes)]
    assert cols == ["dw", "db"]
    # the centred x and the inverse deviation are no longer read outside: a register, no store
    assert len(g.regs) == 4
    assert on.cuda_module.launches[0].scratch({"rows": 4096, "d": 1024}) == 2 * 512 * 1024


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_layernorm_backward_matches_the_interpreter(dtype):
    """Row lengths 1, 33, 300 (the emulated block of 64 threads holds 512 per row in
    registers) and 1000 (memory), rows 1 to 130: one slot, or many of 8 rows."""
    prog = build(LAYERNORM, dtype)
    for rows, d in ((1, 1), (3, 33), (65, 33), (130, 300), (17, 1000)):
        _, regs, mem = run(prog, {"rows": rows, "d": d}, dtype, seed=rows + d)
        # each thread of a slot's row counts: a warp's 32 (rows up to 256), or the block's 64
        threads = launches.row_slots(rows, d, 8, 1 << 21) * (32 if d <= 256 else 64)
        assert (regs, mem) == ((threads, 0) if d <= 512 else (0, threads)), (rows, d, regs, mem)


@pytest.mark.parametrize("warp_rows,row_regs,slot_rows,slot_elems",
                         [(0, 8, 1, 1 << 21), (4096, 8, 8, 1 << 21), (0, 4, 3, 100), (4096, 2, 1, 1)])
def test_both_variants_paths_and_slot_settings(warp_rows, row_regs, slot_rows, slot_elems):
    prog = build(LAYERNORM, "f32", warp_rows=warp_rows, row_regs=row_regs, row_slot_rows=slot_rows,
                 row_slot_elems=slot_elems)
    for rows, d in ((70, 20), (9, 129)):
        run(prog, {"rows": rows, "d": d}, "f32", seed=rows)


def test_a_column_mean_and_a_softmax():
    prog = build(SOFTMAX_MEAN, "f32")
    assert [x.kind for x in prog.cuda_module.launches] == ["rows", "loop"]
    for rows, d in ((1, 5), (40, 64), (100, 700)):
        run(prog, {"rows": rows, "d": d}, "f32", seed=d)


def test_the_same_bits_on_every_run():
    prog = build(LAYERNORM, "f32")
    first, _, _ = run(prog, {"rows": 200, "d": 96}, "f32", seed=5)
    again, _, _ = run(prog, {"rows": 200, "d": 96}, "f32", seed=5)
    for k in ("dw", "db"):
        assert first[k].tobytes() == again[k].tobytes()


def test_f32_within_ten_times_torch_f32():
    """dw and db in f32 on cuda-sim, against the f64 result: within the numerics
    contract (10x PyTorch f32's own error, or 1e-6)."""
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle of the numerics contract")
    rng = np.random.default_rng(11)
    rows, d = 300, 96
    x = (rng.standard_normal((rows, d)) * 3 + 1).astype(np.float32)
    dy = rng.standard_normal((rows, d)).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    b = rng.standard_normal(d).astype(np.float32)

    def reference(dt):
        t = {k: torch.tensor(v, dtype=dt, requires_grad=k in ("x", "w", "b")) for k, v in
             dict(x=x, dy=dy, w=w, b=b).items()}
        y = torch.nn.functional.layer_norm(t["x"], (d,), t["w"], t["b"], eps=1e-5)
        (y * t["dy"]).sum().backward()
        return {"dx": t["x"].grad.double().numpy(), "dw": t["w"].grad.double().numpy(),
                "db": t["b"].grad.double().numpy()}

    want, torch32 = reference(torch.float64), reference(torch.float32)
    got = build(LAYERNORM, "f32")(x=x, dy=dy, w=w, b=b)
    for k in want:
        mine, theirs = normwise_err(got[k], want[k]), normwise_err(torch32[k], want[k])
        assert ok(mine, theirs), (k, mine, theirs)


def test_the_manifest_describes_the_partials_and_the_block():
    import json

    from tgc.backends.cuda import aot
    from tgc.backends.cuda.runtime import lower

    module = tgc.compile(LAYERNORM, backend="cpu").module
    opts = Options().with_(cuda=CudaOptions(row_columns=True))
    _, doc = aot.build(lower(module, opts), opts, "cu")
    rows, cols = json.loads(doc)["launches"]
    assert rows["kind"] == "rows" and cols["kind"] == "loop" and cols["kernel"] == "k0_cols"
    assert rows["buffers"][-1] == cols["buffers"][-1] == codegen.COL_SCRATCH
    assert rows["column_partials"] == cols["column_partials"]
    assert rows["column_partials"]["columns"] == "(d)" and rows["column_partials"]["rows"] == "(rows)"
    assert "2 * slots * columns" in rows["column_partials"]["scratch"]
    assert "t * 8 >= row_length" in rows["kernel_block"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (the CUDA toolkit) is not installed")
def test_the_gpt_step_compiles_without_spills(tmp_path):
    """`ptxas -v` for sm_90 on the GPT workload's f32 module (its layernorm backward
    groups hold up to `row_columns_max` column sums' partials in registers): no kernel
    spills or keeps a stack frame (about a minute of nvcc)."""
    import re
    import subprocess
    from pathlib import Path

    from tgc import pipeline
    from tgc.backends.cuda.runtime import lower

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "workloads" / "gpt.tg"
    o = Options(dtype="f32")
    low = lower(pipeline.lower(pipeline.load(str(path), o), o).module, o.with_(cuda=CudaOptions(row_columns=True)))
    assert any(isinstance(k, RowGroup) and sum(column_member(m, k.outer, k.sizes) for m in k.members) >= 3
               for k in low.kernels)
    cu = tmp_path / "gpt.cu"
    cu.write_text(codegen.generate(low).source)
    r = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-Xptxas", "-v", str(cu), "-o", str(tmp_path / "k.cubin")],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    kernels = re.findall(r"Function properties for (\w+)\n\s+(\d+) bytes stack frame, (\d+) bytes spill stores, "
                         r"(\d+) bytes spill loads", r.stderr)
    assert len(kernels) > 100 and any(k.endswith("_cols") for k, *_ in kernels)
    bad = [(k, frame, st, ld) for k, frame, st, ld in kernels if (frame, st, ld) != ("0", "0", "0")]
    assert not bad, bad
