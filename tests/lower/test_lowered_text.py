"""The lowered program as text: print -> parse is the identity after every lowering
stage of every example and benchmark workload, the parsed program runs like the
original, and malformed or broken text is a located error."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from tgc import pipeline
from tgc.backends.base import pass_registry
from tgc.ir.diag import CompileError
from tgc.ir.inputs import random_inputs
from tgc.ir.printer import print_module
from tgc.lower.interp import run_lowered
from tgc.lower.lowered import print_lowered
from tgc.lower.text import KERNEL_FORMS, KernelForm, is_lowered_text, parse_lowered, register_kernel_form
from tgc.manager import run_lowering
from tgc.pipeline import lower_module
from tgc.options import Options

from marks import sized_by_themselves

CPU = pipeline.lowering("cpu")   # the CPU's lowering stages (loads the backend: its kernel forms are read)
ALL = pass_registry()   # every pass by name, the CPU's `group` included

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = sorted(str(p.relative_to(ROOT)) for p in
                  list(sized_by_themselves((ROOT / "examples").glob("*.tg"))) + list((ROOT / "benchmarks" / "workloads").glob("*.tg")))


def same(a, b) -> list[str]:
    """The fields of two lowered programs that differ (the module: as IR text, which
    leaves out source locations)."""
    diff = [f.name for f in dataclasses.fields(a) if f.name != "module" and getattr(a, f.name) != getattr(b, f.name)]
    if print_module(a.module) != print_module(b.module):
        diff.append("module")
    return diff


@pytest.mark.parametrize("path", PROGRAMS)
def test_print_then_parse_is_the_identity_after_every_stage(path):
    opts = Options()
    module = pipeline.lower(pipeline.load(str(ROOT / path), opts), opts).module
    program = module
    for stage in ("fuse", "layout", "group", "plan"):
        program = run_lowering(program, opts.with_(stages=(stage,)), known=ALL).lowered
        text = print_lowered(program)
        back = parse_lowered(text, path)
        assert same(program, back) == [], f"after {stage}"
        assert print_lowered(back) == text


@pytest.mark.parametrize("name", ["mlp.tg", "embedding.tg", "conv1d.tg"])
def test_a_parsed_program_runs_like_the_original(name):
    opts = Options(dtype="f64")
    module = pipeline.lower(pipeline.load(str(ROOT / "examples" / name), opts), opts).module
    low = lower_module(module, opts)
    back = parse_lowered(print_lowered(low))
    dims = {d: 3 for d in module.symbolic_dims()}
    inputs = random_inputs(module, module.bind_dims(dims), 0, "f64")
    want = run_lowered(low, {k: np.copy(v) for k, v in inputs.items()}, dims)
    got = run_lowered(back, {k: np.copy(v) for k, v in inputs.items()}, dims)
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_stages_continue_from_text_as_from_the_module():
    """fuse, then print and parse, then layout/group/plan: the same program as lowering
    in one go (the stages need nothing the text leaves out)."""
    opts = Options()
    module = pipeline.lower(pipeline.load(str(ROOT / "examples" / "gcn.tg"), opts), opts).module
    whole = lower_module(module, opts)
    fused = parse_lowered(print_lowered(lower_module(module, opts, stop_after="fuse")))
    rest = run_lowering(fused, opts, stages=CPU, known=ALL).lowered     # the default stages after 'fuse'
    assert rest.stage == "plan"
    assert same(whole, rest) == []


# ---------------------------------------------------------------- errors

SOFTMAX = """\
dim rows, d
input x[rows, d]
out y[rows, d] = softmax[d](x)
"""


@pytest.fixture(scope="module")
def softmax_text(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("lt") / "softmax.tg"
    path.write_text(SOFTMAX)
    opts = Options()
    module = pipeline.lower(pipeline.load(str(path), opts), opts).module
    return print_lowered(lower_module(module, opts))


def error_of(text: str) -> str:
    with pytest.raises(CompileError) as e:
        parse_lowered(text, "p.tgl")
    return str(e.value)


def line_of(text: str, start: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith(start))


def test_the_text_of_a_small_program(softmax_text):
    assert softmax_text.startswith("// lowered after plan (f32)\n")
    assert is_lowered_text(softmax_text)
    assert "\nmodule {\ndim rows\ndim d\ninput x : f32[rows, d]\n" in softmax_text
    assert softmax_text.endswith("out y = %4 : [rows, d]\n}\n")


def test_a_buffer_declared_twice(softmax_text):
    line = next(x for x in softmax_text.splitlines() if x.startswith("buffer %x"))
    text = softmax_text.replace(line, line + "\n" + line)
    assert error_of(text).startswith(f"p.tgl:{line_of(softmax_text, 'buffer %x') + 1}:8: error: "
                                     "buffer '%x' is declared twice")


def test_an_undeclared_buffer(softmax_text):
    text = softmax_text.replace("%x[d, rows]", "%z[d, rows]", 1)
    assert "error: undeclared buffer '%z'" in error_of(text)


def test_an_index_with_the_wrong_number_of_entries(softmax_text):
    text = softmax_text.replace("%x[d, rows]", "%x[rows]", 1)
    assert "error: %x has 2 edges (d, rows), the index has 1 entries" in error_of(text)


def test_a_syntax_error_is_located(softmax_text):
    text = softmax_text.replace("k0: group for rows < rows", "k0: group for rows <", 1)
    assert re.match(rf"p.tgl:{line_of(softmax_text, 'k0:')}:\d+: error: unexpected ", error_of(text))


def test_a_backends_kind_of_kernel_reads_with_its_form_only(softmax_text, monkeypatch):
    """The CPU's `group` is its backend's grammar, not the neutral one's."""
    assert "k0: group for" in softmax_text
    monkeypatch.delitem(KERNEL_FORMS, "group")
    message = error_of(softmax_text)
    assert f"p.tgl:{line_of(softmax_text, 'k0:')}:5: error: unexpected 'group' in lowered program" in message
    assert "a backend's own kind of kernel reads once its backend is loaded" in message


def test_a_registered_kernel_form_extends_the_reader(tmp_path, monkeypatch):
    """A form from outside `tgc/lower` (grammar and reader) reads its kernels: here a
    `twice` kernel that reads as the loop it wraps."""
    path = tmp_path / "softmax.tg"
    path.write_text(SOFTMAX)
    opts = Options()
    module = pipeline.lower(pipeline.load(str(path), opts), opts).module
    text = print_lowered(lower_module(module, opts, stop_after="layout"))
    wrapped = text.replace("k1: loop", "k1: twice    # the toy form\n    loop", 1)
    assert wrapped != text
    form = KernelForm("twice", 'twice: "twice" twice_note _NL loop\ntwice_note: note',
                      lambda walk, t: walk.loop(t.children[1]))
    with pytest.raises(CompileError, match="unexpected 'twice'"):
        parse_lowered(wrapped)
    monkeypatch.setitem(KERNEL_FORMS, "twice", form)
    assert same(parse_lowered(wrapped), parse_lowered(text)) == []
    with pytest.raises(ValueError, match="two backends define the lowered kernel form 'twice'"):
        register_kernel_form(KernelForm("twice", 'twice: "twice" _NL', lambda walk, t: None))


def test_the_header_and_the_module_are_required(softmax_text):
    assert "needs the line '// lowered after STAGE (f32|f64)'" in error_of(softmax_text.split("\n", 1)[1])
    assert "unknown lowering stage 'fuze'" in error_of(softmax_text.replace("after plan", "after fuze"))
    no_module = softmax_text[:softmax_text.index("module {")]
    assert "needs its module" in error_of(no_module)
    assert "not closed" in error_of(softmax_text.rstrip().rstrip("}"))


def test_an_error_in_the_module_block_is_located_in_the_file(softmax_text):
    text = softmax_text.replace("input x : f32[rows, d]", "input x : f32[rows, e]")
    assert error_of(text).startswith(f"p.tgl:{line_of(softmax_text, 'input x')}:1: error: unknown edge 'e'")


def test_verifier_errors_point_at_the_kernel(softmax_text):
    """The verifier runs after parsing; its errors are located at the kernel's line."""
    k = line_of(softmax_text, "k0:")
    text = softmax_text.replace("for rows < rows", "for rows < rows + 1", 1)
    assert error_of(text).startswith(f"p.tgl:{k}:1: error: k0: member 0 (%")
    text = softmax_text.replace("exp(", "expo(", 1)
    assert "error: k0: unknown function 'expo'" in error_of(text)


def test_a_kernels_reads_follow_its_fields_when_they_are_replaced():
    """`LoopKernel` keeps what it reads until a field it comes from is replaced: a new
    body (or epilogue, or bounds) is read again, never the kept answer."""
    from tgc.frontend import compile_source
    from tgc.lower.lowered import Load, LoopKernel, Mul, walk
    opts = Options()
    src = "dim n = 8\ninput x[n], y[n]\nout z = exp(x) * y\n"
    low = lower_module(pipeline.lower(compile_source(src, "<t>", opts), opts).module, opts)
    (k,) = [k for k in low.kernels if isinstance(k, LoopKernel)]
    assert k.buffers_read() == {"x", "y"}
    (load_y,) = [e for e in walk(k.body) if isinstance(e, Load) and e.buf == "y"]
    k.body = load_y
    assert k.buffers_read() == {"y"} and k.buffers_used() == [k.out, "y"]
    k.body = Mul((load_y, dataclasses.replace(load_y, buf="x")))
    assert k.buffers_read() == {"x", "y"}
