"""The tuned numbers are options fields (docs/optimization.md, "Tuned numbers"): the CPU
code generator's `CpuOptions` fields each reach the generated LLVM IR through the
options the generator is given, the lowering's (`Options.layout_*`, the CPU's
`group_inline_max_ops`) each reach the lowered program; none is a module-level
constant of the CPU backend or of the lowering, and a program generated with other
values still computes what the interpreter does."""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import re
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.backends.cpu.codegen import generate_units
from tgc.backends.cpu.options import CpuOptions
from tgc.ir.inputs import random_inputs
from tgc.ir.interp import evaluate
from tgc.lower.lowered import print_lowered
from tgc.options import Options

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ROOT / "benchmarks" / "workloads"
OWN = Options().with_(own_gemm="on", bf16_gemm="on")   # the own kernels' code, whatever this host has
BF16 = OWN.with_(autocast="bf16", bf16_gemm_min_flops=0, bf16_gemm_min_k=0)
# attention streamed at a small size, in a loop over the batch whose steps loop over the heads, on 2 threads
STREAMED = OWN.with_(stream_block=4, stream_block_min=2, stream_min_elements=200, stream_mask_groups=2,
                     stream_step_elements=64, cpu=OWN.cpu.with_(threads=2))

# (field, a value other than the default, the program whose code it changes, the options it is lowered with)
REACHES = [
    ("row_entry_work", 256, "layernorm", OWN),
    ("group_min_block_rows", 32, "layernorm", OWN),
    ("short_sum", 8192, "layernorm", OWN),
    ("sum_chunk", 512, "layernorm", OWN),
    ("blas_chain_mnk", 0, "mlp", OWN),
    ("prefetch_row_bytes", 32768, "layernorm", OWN),
    ("prefetch_min_row_bytes", 2048, "layernorm", OWN),
    ("entry_compile_cost", 7, "mlp", OWN),
    ("call_compile_cost", 1.0, "mlp", OWN),
    ("tile_compile_cost", 200, "mlp", OWN),
    ("gemm_min_tile", 32, "mlp", OWN),
    ("gemm_min_chunk", 128, "mlp", OWN),
    ("gemm_batch_tasks", 32, "mlp", OWN),
    ("gemm_pack_elems", 8192, "mlp", OWN),
    ("gemm_loop_cols", 1, "mlp", Options().with_(blas="none")),
    ("group_min_vector_block_rows", 128, "mlp", OWN),
    ("unroll_max", 2, "mlp", OWN),
    ("wide_scratch", 4, "mlp", OWN),
    ("bf16_gemm_depth", 128, "mlp", BF16),
    ("bf16_gemm_panel", 128, "mlp", BF16),
    ("loop_split_min", 2, "conv1d", OWN),
    ("gemm_tap_tiles", 1, "conv1d", Options().with_(own_gemm="off")),
    ("own_gemm_depth", 512, "conv1d", OWN),
    ("own_gemm_rows", 4, "conv1d", OWN),
    ("own_gemm_vecs", 2, "conv1d", OWN),
    ("own_gemm_panel_rows", 384, "conv1d", OWN),
    ("own_gemm_unroll", 1, "conv1d", OWN),
    ("own_gemm_edge_vecs", 6, "gpt", OWN),   # ff = 192: tiles of 96 columns
    ("own_gemm_c_prefetch", 0, "conv1d", OWN),
    ("own_gemm_b_in_place", False, "conv1d", OWN),
    ("gemm_merge_rows", False, "gpt_small", OWN),
    ("own_gemm_pack_a_rows", 64, "conv1d", OWN),
    ("own_gemm_pack_a_span", 0, "conv1d", OWN),
    ("own_gemm_copy_a_rows", 0, "conv1d", OWN),
    ("own_gemm_tall_transposed", True, "gpt_small", OWN),
    ("own_gemm_window_rows", 4, "conv2d", OWN),
    ("unroll_copies", 16, "conv2d", OWN),
    ("own_gemm_mask_classes", 4, "conv2d", OWN),
    ("gemm_compile_cost", 500, "mlp", OWN),
    ("batched_gemm_compile_cost", 500, "conv1d", OWN),
    ("tap_compile_cost", 500, "conv1d", OWN),
    ("implicit_compile_cost", 500, "conv2d", OWN),
    ("loop_compile_cost", 500, "mlp", OWN),
    ("member_compile_cost", 100, "mlp", OWN),
    ("member_loop_compile_cost", 100, "mlp", OWN),
    ("blocked_compile_cost", 500, "mlp", OWN),
    ("region_max_barriers", 1, "gpt_small", OWN),
    ("barrier_work", 1 << 13, "gpt_small", OWN),
    ("contention_confirm_regions", 3, "gpt_small", OWN),
    ("contention_memory_cycles", 1 << 20, "gpt_small", OWN),
    ("contention_memory_lags", 20, "gpt_small", OWN),
    ("parallel_steps_min_cycles", 1, "attention", STREAMED),
    ("causal_gemm", False, "gpt_small", OWN.with_(own_gemm_min_rows=1, own_gemm_min_cols=1, own_gemm_min_depth=1)),
    ("mask_ones_prefix", 16, "attention", STREAMED),
]

# (field, a value other than the default, the program whose lowered program it changes):
# tuned numbers the lowering reads (layout's of `Options`, the CPU group stage's of `CpuOptions`)
LOWERING = [
    ("layout_tap_min_k", 1 << 20, "conv2d"),
    ("layout_short_sum", 0, "conv2d"),
    ("layout_tie_rows", 1, "gpt"),
    ("layout_tall", 1000, "conv2d"),
    ("layout_tall_min_k", 1 << 30, "conv2d"),
    ("group_inline_max_ops", 0, "layernorm"),
    ("gemm_epilogue", False, "gpt_adamw"),
]


@lru_cache(maxsize=None)
def _lowered(name: str, options: Options):
    m = pipeline.load_program(str(WORKLOADS / f"{name}.tg"), options).module
    compiled, opts = pipeline.target(pipeline.lower(m, options).module, options)
    return pipeline.lower_module(compiled, opts, "cpu"), opts


def _ir_hash(name: str, options: Options, **changes) -> str:
    low, opts = _lowered(name, options)   # the fields below are read by code generation only
    text = "".join(generate_units(low, opts.with_(**changes), units=3))
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize("field, value, name, options", REACHES, ids=[r[0] for r in REACHES])
def test_a_tuned_field_reaches_the_generated_code(field, value, name, options):
    assert getattr(CpuOptions(), field) != value
    assert _ir_hash(name, options, **{field: value}) != _ir_hash(name, options)


@lru_cache(maxsize=None)
def _target(name: str):
    options = Options()
    m = pipeline.load_program(str(WORKLOADS / f"{name}.tg"), options).module
    return pipeline.target(pipeline.lower(m, options).module, options)


@pytest.mark.parametrize("field, value, name", LOWERING, ids=[r[0] for r in LOWERING])
def test_a_lowering_field_reaches_the_lowered_program(field, value, name):
    compiled, opts = _target(name)
    assert getattr(opts.cpu if hasattr(opts.cpu, field) else opts, field) != value
    other = opts.with_(**{field: value})
    assert print_lowered(pipeline.lower_module(compiled, other, "cpu")) != \
        print_lowered(pipeline.lower_module(compiled, opts, "cpu"))


def test_every_tuned_field_is_checked():
    """Every field documented under "Tuned numbers" is in `REACHES` (the runtime's
    `recycle_*` and those read by the lowering have tests of their own)."""
    doc = (ROOT / "docs" / "optimization.md").read_text()
    table = doc[doc.index("### Tuned numbers (`CpuOptions`)"):doc.index("## Known gaps")]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    named = {n for row in rows for n in re.findall(r"`(\w+)`", row)}
    assert named <= {f.name for f in dataclasses.fields(CpuOptions)}
    # read by the lowering: in LOWERING, but group_shrink_max_bytes, which changes no workload
    # (their batch is symbolic): tests/backends/test_group.py's updates at fixed sizes check it
    lowering = {"group_inline_max_ops", "group_shrink_max_bytes", "gemm_epilogue"}
    assert named - {"recycle_min_bytes", "recycle_kept"} == {r[0] for r in REACHES} | lowering
    table = doc[doc.index("### Tuned numbers (`Options`)"):doc.index("### Tuned numbers (`CpuOptions`)")]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    named = {n for row in rows for n in re.findall(r"`(\w+)`", row)}
    # the runtime's first-call bounds have tests of their own (tests/runtime/test_specialize.py),
    # as have the stream pass's budget and its loops per rows (tests/opt/test_stream.py) and
    # its key blocks (tests/opt/test_stream_keys.py)
    assert named - {"specialize_at_bytes", "specialize_first_work", "stream_step_elements",
                    "stream_key_block", "stream_key_rows", "stream_key_scores", "stream_mask_rows", "stream_mask_runs",
                    "stream_mask_groups"} == \
        {r[0] for r in LOWERING} - {"group_inline_max_ops", "gemm_epilogue"}
    assert named <= {f.name for f in dataclasses.fields(Options)}


# Module-level numbers of the CPU backend and of the lowering that are not tuning
# choices: fixed by the instruction set, a register block's shape, an ABI or a file
# format; in the lowering, a bound on recursion depth (fuse) and the float semantics
# every backend shares (an f32 sum of at least WIDE_SUM terms is computed in f64).
STRUCTURAL = {
    "cpu/aot.py": {"STALE_SECONDS"}, "cpu/codegen.py": {"ALIGN", "WRITEABLE", "FINGERPRINT_BYTES", "PROFILE_COLUMNS"},
    "cpu/parallel.py": {"CLOCK_THREAD_CPUTIME_ID"},
    "cpu/fgemm.py": {"VL", "MAX_TAPS"}, "cpu/gemm.py": {"UNTILED"}, "cpu/gemm_dispatch.py": {"OWN_COLS", "EDGE_ROWS"},
    "cpu/gemm_bf16.py": {"BF16_ROWS", "BF16_VECS"}, "cpu/gemm_small.py": {"ROWS"}, "cpu/kernels.py": {"ALIGN"},
    "cpu/sizecheck.py": {"ALIGN"},
    "lower/fuse.py": {"MAX_INLINE_DEPTH"}, "lower/grouping.py": {"MAX_MEMBERS"}, "lower/lowered.py": {"WIDE_SUM"},
    "lower/reader_order.py": {"DEPTH"},
}


def test_no_tuned_number_is_a_module_constant():
    found = {}
    paths = sorted((ROOT / "tgc" / "backends" / "cpu").glob("*.py")) + sorted((ROOT / "tgc" / "lower").glob("*.py"))
    for path in paths:
        where = f"{path.parent.name}/{path.name}"
        for node in ast.parse(path.read_text()).body:
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
                node.target if isinstance(node, ast.AnnAssign) else None
            value = node.value if target is not None else None
            if isinstance(target, ast.Name) and target.id.isupper() and isinstance(value, (ast.Constant, ast.BinOp)) \
                    and isinstance(getattr(value, "value", 0), (int, float)) and not isinstance(
                        getattr(value, "value", 0), bool):
                if target.id not in STRUCTURAL.get(where, set()):
                    found.setdefault(where, []).append(target.id)
    assert not found, found


def _matches_interpreter(prog, size: int):
    """Asserts that compiled f64 program `prog`, called on random inputs with every
    symbolic dim at `size`, gives the interpreter's values for every output it has."""
    m = prog.module
    x = random_inputs(m, m.bind_dims({d: size for d in m.symbolic_dims()}), 5, "f64")
    want = evaluate(m, {k: np.copy(v) for k, v in x.items()}, dtype="f64")
    got = prog(**{k: np.copy(v) for k, v in x.items()})
    assert want and set(want) <= set(got)
    for name, w in want.items():
        np.testing.assert_allclose(np.asarray(got[name]), w, rtol=1e-10, atol=1e-12, err_msg=name)


def test_other_values_compute_the_same_program():
    """The MLP step generated with other tuned numbers (smaller tiles, chunks, unrolling)
    gives the interpreter's values."""
    src = (WORKLOADS / "mlp.tg").read_text()
    cpu = CpuOptions(gemm_min_tile=4, gemm_min_chunk=8, gemm_pack_elems=1024, sum_chunk=16, short_sum=64,
                     unroll_max=2, unroll_copies=2, group_min_block_rows=2, group_min_vector_block_rows=4,
                     loop_split_min=2, wide_scratch=4, row_entry_work=1, threads=2, parallel_min_work=1,
                     region_max_barriers=1)
    _matches_interpreter(tgc.compile(src, dtype="f64", options=Options(dtype="f64", cpu=cpu)), 37)


@pytest.mark.parametrize("name, changes", [
    ("conv2d_sym", {"layout_tap_min_k": 1 << 20, "layout_short_sum": 0, "layout_tall": 1000, "layout_tall_min_k": 1 << 30}),
    ("layernorm", {"group_inline_max_ops": 0}),
], ids=["layout", "group"])
def test_other_lowering_values_compute_the_same_program(name, changes):
    """A program lowered with other tuned numbers of the lowering (other GEMM layouts,
    temporaries stored instead of recomputed) gives the interpreter's values."""
    src = (WORKLOADS / f"{name}.tg").read_text()
    _matches_interpreter(tgc.compile(src, dtype="f64", options=Options(dtype="f64").with_(**changes)), 8)
