"""What the command line tells a user who got a name or a file wrong, and what its
reports say they assume: the closest name for a misspelt one, the file an input came
from, `explain`'s columns aligned for every kernel kind, and the sizes `--stats`
counts FLOPs at."""
import copy
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tgc.cli import main

ROOT = Path(__file__).parents[2]
MLP = str(ROOT / "examples/mlp.tg")


def tgc(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("args,words", [
    (["grad", MLP, "--wrt", "W11"], "--wrt W11: not a float input, param or state of the program; did you mean 'W1'?"),
    (["grad", MLP, "--wrt", "W1", "--of", "los"], "did you mean 'loss'?"),
    (["dump-ir", MLP, "-p", "normalize,simplfy"], "unknown pass 'simplfy'"),
    (["dump-ir", MLP, "-p", "simplfy"], "did you mean 'simplify'?"),
    (["dump-ir", MLP, "-p", "group{blcks=2}"], "has no option 'blcks' (its options: blocks); did you mean 'blocks'?"),
    (["dump-ir", MLP, "--after", "adjiont"], "did you mean 'adjoint'?"),
    (["dump-ir", MLP, "--print-ir-after", "adjiont"], "did you mean 'adjoint'?"),
    (["run", MLP, "--random-inputs", "--dim", "bach=3"], "no dim 'bach'; did you mean 'batch'?"),
])
def test_a_misspelt_name_on_the_command_line_suggests_the_closest(args, words):
    r = tgc(*args)
    assert r.exit_code in (1, 2) and words in r.output, r.output
    assert "Traceback" not in r.output


def test_input_errors_name_the_file_they_came_from(tmp_path):
    safetensors = pytest.importorskip("safetensors.numpy")

    npy, npz, st = tmp_path / "w.npy", tmp_path / "in.npz", tmp_path / "in.safetensors"
    np.save(npy, np.ones((4, 13), np.float32))
    np.savez(npz, W11=np.ones((13, 64), np.float32))
    safetensors.save_file({"x": np.ones((4, 12), np.float32)}, str(st))
    r = tgc("run", MLP, "--random-inputs", "--inputs", npz)
    assert r.exit_code == 3 and f"{npz}: unexpected input 'W11'" in r.output and "did you mean 'W1'?" in r.output
    r = tgc("run", MLP, "--random-inputs", "--input", f"W11={npy}")
    assert r.exit_code == 3 and f"{npy}: unexpected input 'W11'" in r.output, r.output
    for backend in ("cpu", "interp"):
        r = tgc("run", MLP, "--random-inputs", "--input", f"W1={npy}", "--backend", backend)
        assert r.exit_code == 3 and f"{npy}: input 'W1' has shape (4, 13)" in r.output, r.output
    r = tgc("run", MLP, "--random-inputs", "--inputs", st)
    assert r.exit_code == 3 and f"{st}: input 'x' has shape (4, 12)" in r.output, r.output


def test_explain_columns_line_up_for_every_kernel_kind():
    from tgc import pipeline
    from tgc.explain import explain, format_explain
    from tgc.options import Options

    module = pipeline.load(str(ROOT / "examples/gpt.tg"), Options())
    env = module.bind_dims({d: 8 for d in module.symbolic_dims()})
    report = explain(pipeline.lower_module(pipeline.lower(module, Options()).module, Options()), env)
    report["dims"] = {d: 8 for d in module.symbolic_dims()}
    # the CPU's implicit GEMMs (a host with AVX-512) and a long program's three-digit kernel numbers
    report = copy.deepcopy(report)
    report["kernels"][1]["kind"] = "implicit"
    report["kernels"][2]["index"] = 123
    lines = format_explain(report, "gpt.tg").splitlines()
    header = lines.index("kernels, in order:") + 1
    rows = lines[header:header + 1 + len(report["kernels"])]
    columns = {re.search(r"FLOPs?\b", line).end() for line in rows}   # the right edge of the FLOPs column
    assert len(columns) == 1, "\n".join(rows)
    kinds = {line.split()[1] for line in rows[1:]}
    assert "implicit" in kinds and len({line.index(line.split()[1]) for line in rows}) == 1, "\n".join(rows)


def test_stats_say_the_sizes_they_count_at(tmp_path):
    r = tgc("dump-ir", MLP, "--stats", "--after", "plan", "-o", "/dev/null")
    assert r.exit_code == 0, r.output
    sizes = [line for line in r.output.splitlines() if line.startswith("sizes: ")]
    assert len(sizes) == 2 and all(line.startswith("sizes: batch = 64 (") for line in sizes), r.output
    fixed = tmp_path / "fixed.tg"
    fixed.write_text("dim n = 3\ninput x[n]\nout y = sum[n](x * x)\n")
    r = tgc("dump-ir", fixed, "--stats", "-o", "/dev/null")
    assert r.exit_code == 0 and "sizes: the program's own (it has no symbolic dims)" in r.output, r.output
