"""One spelling of dims and one default backend across the commands: every command
that sizes dims takes both `-D NAME=N` and `--dim NAME=N`, and every command that
compiles defaults to the compiled CPU backend (`--backend interp` stays available)."""
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tgc.cli import main

ROOT = Path(__file__).parents[2]
MLP = str(ROOT / "examples/mlp.tg")


def tgc(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("spelling", ["-D", "--dim"])
def test_every_command_that_sizes_dims_takes_both_spellings(spelling, tmp_path):
    r = tgc("run", MLP, "--random-inputs", spelling, "batch=5")
    assert r.exit_code == 0 and "probs[batch, classes] float32 shape=(5, 3)" in r.output, r.output
    r = tgc("info", MLP, "--format", "json", spelling, "batch=7")
    assert r.exit_code == 0, r.output
    assert {d["name"]: d["size"] for d in json.loads(r.output)["dims"]}["batch"] == 7
    r = tgc("explain", MLP, "--format", "json", spelling, "batch=9")
    assert r.exit_code == 0 and json.loads(r.output)["dims"] == {"batch": 9}, r.output
    r = tgc("build", MLP, "--emit", "h", "-o", "-", spelling, "batch=11")
    assert r.exit_code == 0 and "[batch=11, features=13]" in r.output, r.output


def test_dim_errors_name_both_spellings_and_the_closest_dim():
    for command in (["run", MLP, "--random-inputs"], ["explain", MLP], ["info", MLP], ["build", MLP, "--emit", "h"]):
        for spelling in ("-D", "--dim"):
            r = tgc(*command, spelling, "bach=5")
            assert r.exit_code == 2, r.output
            assert "-D/--dim" in r.output and "no dim 'bach'; did you mean 'batch'?" in r.output, r.output
            r = tgc(*command, spelling, "batch=0")
            assert r.exit_code == 2 and "a size must be positive" in r.output, r.output


def test_a_dim_given_twice_with_two_sizes_is_a_usage_error():
    r = tgc("info", MLP, "-D", "batch=2", "--dim", "batch=3")
    assert r.exit_code == 2 and "'batch' is given twice, as 2 and as 3" in r.output, r.output
    r = tgc("info", MLP, "--format", "json", "-D", "batch=4", "-D", "batch=4")
    assert r.exit_code == 0 and {d["name"]: d["size"] for d in json.loads(r.output)["dims"]}["batch"] == 4, r.output



@pytest.mark.parametrize("backend", ["cpu", "interp"])
def test_a_dim_no_input_sizes_is_asked_for_as_a_flag(tmp_path, backend):
    """`repeat[L]` over a symbolic L that no input has: `tgc run` says to give it with
    -D, not with the Python API's `dims=` (program.run(...)), which it told before."""
    import numpy as np

    (tmp_path / "loop.tg").write_text("dim L, n = 3\ninput h0[n]\nfn f(h) = h * 2\nout y = repeat[L](f, h0)\n")
    np.savez(tmp_path / "h0.npz", h0=np.ones(3, np.float32))
    r = tgc("run", tmp_path / "loop.tg", "--inputs", tmp_path / "h0.npz", "--backend", backend)
    assert r.exit_code == 3 and "dim 'L' is not bound" in r.output and "-D L=N" in r.output \
        and "dims=" not in r.output, r.output
    r = tgc("run", tmp_path / "loop.tg", "--inputs", tmp_path / "h0.npz", "--backend", backend, "-D", "L=3")
    assert r.exit_code == 0 and "[8., 8., 8.]" in r.output, r.output


def test_every_backend_option_defaults_to_the_compiled_cpu_backend():
    backends = {name: p.default for name, cmd in main.commands.items() for p in cmd.params if p.name == "backend"}
    assert {"run", "dump-ir", "explain", "opt"} <= set(backends)
    assert set(backends.values()) == {"cpu"}, backends
    run = main.commands["run"]
    assert "interp" in next(p for p in run.params if p.name == "backend").type.choices


def test_an_absurd_profile_count_is_refused_not_run():
    """`--profile 10**12` would run for days: a usage error, before anything compiles."""
    r = tgc("run", MLP, "--random-inputs", "--profile", str(10 ** 12))
    assert r.exit_code == 2 and "--profile" in r.output and "1000000" in r.output, r.output


def test_run_compiles_by_default_and_still_interprets_on_request():
    # --profile counts the compiled kernels' cycles: it needs the CPU backend
    r = tgc("run", MLP, "--random-inputs", "--profile", "2")
    assert r.exit_code == 0 and "us per call" in r.output, r.output
    compiled = tgc("run", MLP, "--random-inputs").output
    interpreted = tgc("run", MLP, "--random-inputs", "--backend", "interp")
    assert interpreted.exit_code == 0 and interpreted.output.splitlines()[0].split(" = ")[0] == \
        compiled.splitlines()[0].split(" = ")[0]


@pytest.mark.parametrize("value", ["batch=²", "batch=4²", "batch=٣", "batch=１２"])
def test_a_size_is_ascii_digits_only(value):
    """`str.isdigit` holds for superscripts (which `int` then refuses: a ValueError came
    out of the flag's check) and for other scripts' digits (which `int` reads): a size
    is written in ASCII digits, anything else is a usage error."""
    r = tgc("info", MLP, "-D", value)
    assert r.exit_code == 2 and f"'{value}' is not NAME=N" in r.output, (r.exit_code, r.output, r.exception)
