"""The backends' options objects refuse values of the wrong type, and negative counts,
sizes and thresholds, with an error that names the field (`CpuOptions(threads=-1)`
used to be accepted and passed to the runtime as it is)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import tgc
from tgc.backends.cpu.options import CpuOptions
from tgc.backends.cuda.options import CudaOptions
from tgc.options import Options

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value", [-1, -8, 2 ** 31])
def test_threads_out_of_range_is_a_value_error(value):
    with pytest.raises(ValueError, match=r"CpuOptions\.threads"):
        CpuOptions(threads=value)
    with pytest.raises(ValueError, match=r"CpuOptions\.threads"):
        Options().with_(threads=value)
    with pytest.raises(ValueError, match=r"CpuOptions\.threads"):
        CpuOptions().with_(threads=value)


@pytest.mark.parametrize("value", ["2", 2.0, True, None])
def test_threads_of_another_type_is_a_type_error(value):
    with pytest.raises(TypeError, match=r"CpuOptions\.threads"):
        CpuOptions(threads=value)


def test_every_field_is_checked_by_its_type():
    with pytest.raises(ValueError, match=r"CpuOptions\.parallel_min_work"):
        CpuOptions(parallel_min_work=-1)
    with pytest.raises(TypeError, match=r"CpuOptions\.merge_regions"):
        CpuOptions(merge_regions=1)
    with pytest.raises(TypeError, match=r"CpuOptions\.blas"):
        CpuOptions(blas=None)
    with pytest.raises(ValueError, match=r"CpuOptions\.call_compile_cost"):
        CpuOptions(call_compile_cost=float("nan"))
    with pytest.raises(ValueError, match=r"CudaOptions\.block_threads"):
        CudaOptions(block_threads=-256)
    with pytest.raises(TypeError, match=r"CudaOptions\.graphs"):
        CudaOptions(graphs="yes")


def test_valid_values_are_kept():
    assert CpuOptions(threads=0).threads == 0 and CpuOptions(threads=3).threads == 3
    assert CpuOptions(call_compile_cost=1).call_compile_cost == 1
    assert Options().with_(threads=2, row_min=64).cpu.threads == 2
    assert CpuOptions() == CpuOptions() and CudaOptions() == CudaOptions()


@pytest.mark.parametrize("field, value", [("blas", "mkl"), ("bf16_gemm", "yes"), ("own_gemm", "never")])
def test_a_string_field_takes_only_its_listed_values(field, value):
    """A misspelt choice is refused, naming the field and what it takes (it was taken
    as one of the others: `blas="mkl"` ran as numpy's)."""
    with pytest.raises(ValueError, match=rf"CpuOptions\.{field} must be one of .*'{value}'"):
        CpuOptions(**{field: value})
    with pytest.raises(ValueError, match=rf"CpuOptions\.{field}"):
        Options().with_(**{field: value})


def test_numpy_numbers_are_numbers():
    """A size computed with numpy (`np.int64`, `np.float32`) is a number like Python's."""
    import numpy as np

    assert CpuOptions(threads=np.int64(2)).threads == 2
    assert CpuOptions(call_compile_cost=np.float32(1.5)).call_compile_cost == 1.5
    with pytest.raises(ValueError, match=r"CpuOptions\.threads"):
        CpuOptions(threads=np.int32(-1))


def test_compile_refuses_negative_threads_before_compiling():
    with pytest.raises(ValueError, match=r"CpuOptions\.threads must be"):
        tgc.compile(ROOT / "examples" / "mlp.tg", options=Options(cpu=CpuOptions(threads=-1)))


def test_the_examples_threads_flag_refuses_what_cpu_options_refuses():
    code = ("import sys; sys.path.insert(0, 'examples'); import train_common as c; "
            "c.parse(c.parser('x', 'doc', 10, 2), ['--threads', sys.argv[1]])")
    for value in ("-1", str(2 ** 31)):
        r = subprocess.run([sys.executable, "-c", code, value], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert r.returncode == 2 and "--threads" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-c", code, "1"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("field, value, error", [
    ("opt_level", 10 ** 30, ValueError),     # an AssertionError deep in the CPU target
    ("opt_level", 4, ValueError),
    ("opt_level", -1, ValueError),           # compiled as -O0
    ("opt_level", "x", TypeError),           # a TypeError comparing 'int' and 'str' in the lowering
    ("stream_block", -1, ValueError),        # taken silently
    ("stream_block", None, TypeError),
    ("rep_size", -1, ValueError),            # costs with a negative size
    ("rep_size", 0, ValueError),             # the size of a symbolic dim: 0 is no size
    ("specialize_max", -1, ValueError),
    ("unroll_max_ops", "x", TypeError),
    ("memory_budget", -5, ValueError),
    ("collective_timeout", float("nan"), ValueError),
    ("fp_strict", "x", TypeError),
    ("check_assumptions", 1, TypeError),
    ("dtype", "f16", ValueError),
    ("autocast", "f8", ValueError),
    ("passes", "simplify", TypeError),       # read one letter at a time: "unknown pass 's'"
    ("passes", 5, TypeError),
    ("stages", "fuse", TypeError),
    ("dims", "batch=2", TypeError),          # a ValueError from dict() deep in the pipeline
    ("dims", (("batch", -2),), ValueError),
    ("import_dirs", "lib", TypeError),
])
def test_options_fields_are_checked_when_made(field, value, error):
    """`Options` checks its own fields as `CpuOptions` does, naming the field: before, a
    wrong value failed deep in a pass with an unrelated TypeError or AssertionError, or
    was taken silently."""
    with pytest.raises(error, match=rf"Options\.{field}"):
        Options(**{field: value})
    with pytest.raises(error, match=rf"Options\.{field}"):
        Options().with_(**{field: value})


def test_options_valid_values_are_kept():
    o = Options(opt_level=3, passes=("simplify", "factor"), stages=None, dims=(("batch", 2),),
                import_dirs=("lib",), memory_budget=None, collective_timeout=None, autocast="bf16")
    assert o.opt_level == 3 and o.passes == ("simplify", "factor") and o.dims == (("batch", 2),)
    assert Options(passes=["simplify"]).passes == ("simplify",)    # a list is taken as a tuple
    assert Options(dims={"batch": 2}).dims == (("batch", 2),)      # and a dict as its pairs
    assert Options(memory_budget=0).memory_budget == 0 and Options(stream_block=0).stream_block == 0
    assert hash(Options(dims={"batch": 2})) == hash(Options(dims=(("batch", 2),)))


@pytest.mark.parametrize("field, value", [
    ("row_slot_elems", 0),    # a fused column sum over no slots: a layernorm's outputs 5e294 off on cuda-sim
    ("row_slot_rows", 0),     # the emulator died (SIGILL) dividing by it
    ("grid_per_sm", 0),       # a launch of no blocks on a GPU
    ("block_threads", 0),     # "a multiple of 32, at most 1024" (the field's comment)
    ("block_threads", 31),
    ("block_threads", 2048),
])
def test_cuda_sizes_of_which_zero_is_no_size_are_refused(field, value):
    with pytest.raises(ValueError, match=rf"CudaOptions\.{field}"):
        CudaOptions(**{field: value})
    with pytest.raises(ValueError, match=rf"CudaOptions\.{field}"):
        Options().with_(**{field: value})
    assert CudaOptions(block_threads=128, row_slot_rows=1, row_slot_elems=1, grid_per_sm=1).block_threads == 128
