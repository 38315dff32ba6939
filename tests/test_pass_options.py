"""Pass lists with options (`-p 'group{blocks=8}'`), and the lowering stages run by
the one pass manager: level checks, dumps, timing and --verify-each through lowering,
and `tgc opt` on lowered text."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tgc import pipeline
from tgc.backends.base import pass_registry
from tgc.cli import main
from tgc.ir.sizes import size_str
from tgc.lower.text import parse_lowered
from tgc.manager import PassListError, make_pass, parse_pass_list, run_lowering, split_levels
from tgc.pipeline import lower_module
from tgc.options import Options

CPU = pipeline.lowering("cpu")   # the CPU's lowering stages
ALL = pass_registry()   # every pass, every backend's stages included

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "examples" / "mlp.tg")
LAYERNORM = str(ROOT / "benchmarks" / "workloads" / "layernorm.tg")


def test_pass_lists_with_options():
    assert parse_pass_list("normalize, group{blocks = 8},plan{rep_size=16}", ALL) == \
        ("normalize", "group{blocks=8}", "plan{rep_size=16}")
    assert make_pass("group{blocks=8}", ALL).blocks == 8
    assert make_pass("group{blocks=none}", ALL).blocks is None
    assert make_pass("layout").rep_size is None
    assert split_levels(("normalize", "fuse", "layout")) == (("normalize",), ("fuse", "layout"))
    assert split_levels(("normalize",)) == (("normalize",), None)


@pytest.mark.parametrize("text, message", [
    ("nope", r"unknown pass 'nope' \(known: normalize, .*fuse, layout, .*plan\)"),
    ("group{bogus=1}", r"pass 'group' has no option 'bogus' \(its options: blocks\)"),
    ("simplify{x=1}", r"pass 'simplify' has no option 'x' \(its options: none\)"),
    ("group{blocks=many}", r"pass 'group': option 'blocks' takes int or none, not 'many'"),
    ("group{blocks}", r"pass 'group': cannot read option 'blocks' \(write field=value\)"),
    ("group{blocks=1", r"unclosed '\{'"),
])
def test_pass_list_errors_list_what_exists(text, message):
    with pytest.raises(PassListError, match=message):
        parse_pass_list(text, ALL)


def test_the_registry_is_built_once_whatever_was_loaded_before():
    """Every backend's stages are in `pass_registry()` in a fresh process that loaded no
    backend, in the same order as here (loading the backends in another order changes
    nothing), and the table is one object; the neutral table has none of them and
    cannot be changed."""
    from tgc.registry import PASSES

    code = ("from tgc.backends.base import pass_registry; from tgc.manager import parse_pass_list; "
            "print(','.join(pass_registry())); print(parse_pass_list('group{blocks=8}', pass_registry()))")
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=ROOT).stdout.split("\n")
    assert fresh[0] == ",".join(ALL) and fresh[1] == "('group{blocks=8}',)"
    # one object while no backend folder is added (a test that adds one calls refresh(),
    # which builds the table anew: compare with this module's copy by content)
    assert pass_registry() is pass_registry() and dict(pass_registry()) == dict(ALL)
    assert list(ALL).index("group") < list(ALL).index("plan")
    assert "group" not in PASSES and "rowgroup" not in PASSES
    with pytest.raises(TypeError):
        PASSES["group"] = ALL["group"]   # type: ignore[index]
    with pytest.raises(PassListError, match="unknown pass 'group'"):
        parse_pass_list("group")   # the neutral table (the default) names no backend's stage


def test_a_module_pass_after_a_lowering_stage_is_an_error():
    with pytest.raises(PassListError, match="pass 'simplify' works on the IR: it cannot follow the lowering stage 'fuse'"):
        split_levels(parse_pass_list("fuse,simplify", ALL), ALL)


def test_each_pass_reads_what_the_one_before_gives():
    opts = Options()
    module = pipeline.lower(pipeline.load(MLP, opts), opts).module
    with pytest.raises(PassListError, match="pass 'layout' needs a lowered program: run 'fuse' before it"):
        run_lowering(module, opts.with_(stages=("layout",)))
    low = lower_module(module, opts, stop_after="fuse")
    with pytest.raises(PassListError, match="pass 'fuse' needs the IR module"):
        run_lowering(low, opts.with_(stages=("fuse",)))


def test_group_blocks_as_a_pass_option():
    opts = Options()
    module = pipeline.lower(pipeline.load(LAYERNORM, opts), opts).module
    low = lower_module(module, opts.with_(stages=("fuse", "layout", "group{blocks=4}", "plan")))
    # block rows: the option's count, never more than the rows they divide (symbolic here)
    assert size_str(low.edges["#block"]) == "min(4, rows)"
    assert size_str(lower_module(module, opts).edges["#block"]) == "min(32, rows)"   # Options.group_blocks
    none = lower_module(module, opts.with_(stages=("fuse", "layout", "group{blocks=0}", "plan")))
    assert "#block" not in none.edges


def test_lowering_stages_time_print_and_verify_through_the_manager():
    opts = Options(time_passes=True, verify_each=True, print_ir_before=frozenset({"group"}),
                   print_ir_after=frozenset({"fuse", "plan"}))
    module = pipeline.lower(pipeline.load(MLP, opts), Options()).module
    seen = []
    result = run_lowering(module, opts, lambda banner, text: seen.append((banner, text.splitlines()[0])), CPU,
                          known=ALL)
    assert [s.name for s in result.stats] == ["emulate_low", "without_rules", "fuse", "layout", "narrow",
                                              "gemm_operands", "implicit", "accumulate", "unsplit", "epilogue", "alias", "pieces", "group",
                                              "plan"]
    assert all(s.ops_after > 0 for s in result.stats)   # kernels after each stage
    assert seen == [("IR after fuse", "// lowered after fuse (f32)"), ("IR before group", "// lowered after pieces (f32)"),
                    ("IR after plan", "// lowered after plan (f32)")]


# ---------------------------------------------------------------- the command line

def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)


def test_cli_pass_option_errors_are_usage_errors():
    r = run("dump-ir", MLP, "-p", "group{bogus=1}")
    assert r.exit_code == 2
    assert "pass 'group' has no option 'bogus' (its options: blocks)" in r.output


@pytest.mark.parametrize("passes, message", [
    ("adjoint,tangent,fuse,layout,group{blocks=-1}", "pass 'group': blocks=-1: a number of blocks, 0 (no groups) or more"),
    ("adjoint,tangent,fuse,layout{rep_size=-3}", "pass 'layout': rep_size=-3: a dim's size, 1 or more"),
    ("adjoint,tangent,fuse,layout{rep_size=0}", "pass 'layout': rep_size=0: a dim's size, 1 or more"),
    ("stream{block=-1}", "pass 'stream': block=-1: a size or count, 0 or more"),
    ("stream{key_block=-5}", "pass 'stream': key_block=-5: a size or count, 0 or more"),
])
def test_cli_meaningless_sizes_are_pass_list_errors(passes, message):
    """A negative count or size (or a dim's size below 1) is a usage error, before any pass runs."""
    r = run("dump-ir", MLP, "-p", passes)
    assert r.exit_code == 2 and message in r.output, r.output


@pytest.mark.parametrize("passes", ["adjoint,tangent,fuse,layout,group{blocks=0}", "stream{block=0}", "stream{groups=0}",
                                    "adjoint,tangent,fuse,layout{rep_size=1}"])
def test_cli_zero_means_never_where_documented(passes):
    """0 is 'no groups' / 'never stream' (`Options`' comments), so it runs."""
    r = run("dump-ir", MLP, "-p", passes)
    assert r.exit_code == 0, r.output


def test_cli_passes_lists_options():
    r = run("passes")
    assert r.exit_code == 0
    assert re.search(r"^group +Fuse neighbouring", r.output, re.M) and "{blocks=int | none}" in r.output
    assert "lowering for cpu (dump-ir --backend cpu --after STAGE): fuse,layout,narrow,gemm_operands,implicit,accumulate,unsplit,epilogue,alias,pieces,group,plan" in r.output
    assert "lowering for cuda-sim (dump-ir --backend cuda-sim --after STAGE): fuse,layout,narrow,cublas_operands,inline_elementwise,flash,accumulate,rowgroup,plan" in r.output


def test_cli_dump_ir_with_lowering_stages_in_p():
    ir = ",".join(("normalize", "stabilize", "adjoint", "tangent", "simplify", "stabilize", "factor"))
    r = run("dump-ir", LAYERNORM, "-p", ir + ",fuse,layout,group{blocks=2},plan", "--time-passes")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("// lowered after plan (f32)\nedge #block = min(2, rows)\n")
    assert "  group{blocks=2}\n" not in r.stderr and "  group\n" in r.stderr and "  plan\n" in r.stderr


def test_cli_opt_reads_runs_and_reprints_lowered_text(tmp_path):
    fused = run("dump-ir", MLP, "--after", "fuse").stdout
    path = tmp_path / "mlp.tgl"
    path.write_text(fused)
    same = run("opt", str(path), "-p", "", "--verify-each")
    assert same.exit_code == 0 and same.stdout == fused
    rest = run("opt", str(path), "--verify-each")   # the default stages after fuse
    assert rest.exit_code == 0, rest.output
    assert rest.stdout == run("dump-ir", MLP, "--after", "plan").stdout
    piped = run("opt", "-", "-p", "layout", "--print-ir-after", "layout", input=fused)
    assert piped.stdout.startswith("// lowered after layout (f32)")
    assert "// ----- IR after layout -----" in piped.stderr
    bad = run("opt", str(path), "-p", "simplify")
    assert bad.exit_code == 2 and "pass 'simplify' works on the IR; this is a lowered program" in bad.output


def test_cli_opt_on_ir_may_end_with_lowering_stages(tmp_path):
    ir = tmp_path / "mlp.tgir"
    ir.write_text(run("dump-ir", MLP).stdout)
    r = run("opt", str(ir), "-p", "fuse,layout")
    assert r.exit_code == 0, r.output
    low = parse_lowered(r.stdout)
    assert low.stage == "layout"


def test_cli_verify_each_finds_a_lowered_program_that_computes_something_else(tmp_path):
    fused = run("dump-ir", MLP, "--after", "fuse").stdout
    broken = fused.replace("max(0.0, ", "max(1.0, ", 1)   # relu -> max(1, x): still a valid program
    assert broken != fused
    path = tmp_path / "broken.tgl"
    path.write_text(broken)
    assert run("opt", str(path), "-p", "").exit_code == 0
    r = run("opt", str(path), "-p", "", "--verify-each")
    assert r.exit_code == 1
    assert "error: the lowered program changed the value of" in r.output


def test_a_backend_gets_a_planned_program_or_a_clear_error():
    opts = Options()
    module = pipeline.lower(pipeline.load(MLP, opts), opts).module
    with pytest.raises(PassListError, match="the lowering stages end with 'layout': a backend compiles a planned"):
        lower_module(module, opts.with_(stages=("fuse", "layout")))
    assert lower_module(module, opts.with_(stages=("fuse", "layout", "plan"))).stage == "plan"   # no groups


def test_cli_a_pass_list_that_cannot_run_is_a_usage_error():
    r = run("dump-ir", MLP, "-p", "normalize,layout")
    assert r.exit_code == 2
    assert "error: pass 'layout' needs a lowered program: run 'fuse' before it" in r.output
