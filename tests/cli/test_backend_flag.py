"""`--backend` on the commands that lower (dump-ir, opt, explain): each backend's own
lowering stages, from the registry; the CPU's `group` is not the CUDA backends', whose
own is `rowgroup`."""
from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from tgc.cli import main

MLP = str(Path(__file__).resolve().parents[2] / "examples" / "mlp.tg")


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_dump_ir_lowers_with_the_backend_named():
    cpu = run("dump-ir", MLP, "--after", "plan", "--stats")
    cuda = run("dump-ir", MLP, "--after", "plan", "--stats", "--backend", "cuda")
    assert cpu.exit_code == 0 and cuda.exit_code == 0, cpu.output + cuda.output
    stages = lambda r: [line.split()[-1] for line in r.stderr.splitlines()[-4:] if line.split()[0].isdigit()]
    assert stages(cpu)[-2:] == ["group", "plan"] and stages(cuda)[-2:] == ["rowgroup", "plan"]
    assert ": group for" in cpu.stdout and ": group for" not in cuda.stdout and ": rowgroup for" in cuda.stdout
    bad = run("dump-ir", MLP, "--after", "group", "--backend", "cuda")
    assert bad.exit_code == 2 and ("lowering stage 'group' is not in the stages of --backend cuda (fuse, layout, narrow, "
                                   "cublas_operands, inline_elementwise, flash, accumulate, rowgroup, plan); it is a "
                                   "stage of --backend cpu") in " ".join(bad.output.split())
    bad = run("dump-ir", MLP, "--after", "rowgroup")          # the CPU by default: the error names who has it
    assert bad.exit_code == 2 and "it is a stage of --backend cuda, cuda-sim" in " ".join(bad.output.split())


def test_opt_continues_with_the_backend_named():
    fused = run("dump-ir", MLP, "--after", "fuse")
    assert fused.exit_code == 0
    r = CliRunner().invoke(main, ["opt", "-", "--backend", "cuda"], input=fused.stdout)
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("// lowered after plan") and ": group for" not in r.stdout and ": rowgroup for" in r.stdout


def test_explain_reports_the_program_the_backend_compiles():
    cpu = run("explain", MLP, "--format", "json")
    cuda = run("explain", MLP, "--format", "json", "--backend", "cuda")
    assert cpu.exit_code == 0 and cuda.exit_code == 0
    assert '"kind": "group"' in cpu.stdout and '"kind": "group"' not in cuda.stdout
    assert '"kind": "rowgroup"' in cuda.stdout
    assert run("explain", MLP, "--backend", "tpu").exit_code == 2
