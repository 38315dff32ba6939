"""The differential fuzzer in CI: a seeded slice of random programs, and every saved regression.

- `test_generator_well_typed`: the generator (`tests/fuzz/gen.py`) makes programs that
  elaborate without error, deterministically from their seed: an ill-typed program is
  a bug in the generator, not a finding.
A regression runs in a forked child (`harness.check_isolated`), so a crash of the
compiler (an LLVM assertion aborts the process) fails its test and not the session;
the slice runs in-process (forked children are several times slower there).

- `test_slice`: programs of seeds 0..SLICE-1 (the first QUICK in the quick run), each on the float64 torch oracle and on
  the float64 backends (the interpreter after the default pipeline, the CPU build, and
  the CPU's lowered program run by `tgc.lower.interp`);
  those with no step that float32 rounding could flip (`harness.f32_comparable`) also on
  the float32 ones, to a looser bound.
- `test_regression`: every program in `tests/fuzz/regressions/` (each a shrunk
  disagreement the fuzzer once found, with a header saying what it caught) on every
  registered backend (`harness.registered()`; one that cannot run here is skipped).
- `test_shrinker_*`: the shrinker reduces a program with a planted disagreement to a
  small one that still shows it.

`scripts/fuzz` runs thousands of seeds on demand. PyTorch is the oracle: without it
these tests skip.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is the fuzzer's oracle: install torch to run these")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))

from fuzz import harness, shrink  # noqa: E402
from fuzz.gen import generate  # noqa: E402
from fuzz.nodes import parse_bind_comment, parse_seed_comment  # noqa: E402

SLICE = 300
QUICK = 30         # seeds below QUICK also run in the quick run (without --run-slow); the rest are marked slow
GENERATOR_SEEDS = 200
REGRESSIONS = sorted((ROOT / "tests" / "fuzz" / "regressions").glob("*.tg"))


@pytest.fixture(autouse=True, scope="module")
def _no_disk_cache():
    """Hundreds of one-off programs are not written to the compile cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TGC_CACHE", "off")
        yield


def _failure_message(what: str, text: str, rep: harness.Report) -> str:
    lines = [f"{what}: the backends disagree with the torch oracle"]
    for o in rep.failures():
        lines.append(f"--- {o.backend}: {o.kind}")
        lines += o.detail.rstrip().splitlines()[:12]
    lines += ["--- the program:", text]
    return "\n".join(lines)


def test_generator_well_typed():
    from tgc.frontend import compile_source
    from tgc.options import Options

    bad = []
    for seed in range(GENERATOR_SEEDS):
        text = generate(seed).render()
        assert generate(seed).render() == text, f"seed {seed}: the generator is not deterministic"
        try:
            compile_source(text, f"<seed {seed}>", Options(dtype="f64"))
        except Exception as e:  # noqa: BLE001 -- collected, reported together
            bad.append(f"seed {seed}: {e}\n{text}")
    assert not bad, f"{len(bad)} generated programs do not elaborate; the first:\n{bad[0]}"


def test_generator_independent_of_hash_order():
    """The same seed gives the same program in every process (no set-order dependence)."""
    import subprocess

    code = ("import sys; sys.path.insert(0, sys.argv[1]); from fuzz.gen import generate; "
            "print(''.join(generate(s).render() for s in range(40)))")
    texts = {subprocess.run([sys.executable, "-c", code, str(ROOT / "tests")], capture_output=True, text=True,
                            check=True, env={**os.environ, "PYTHONHASHSEED": h}).stdout
             for h in ("1", "2")}
    assert len(texts) == 1


# what the extensions' stream (tests/fuzz/gen.py, `Gen.ext`) makes, as text in the program
EXTENSIONS = {
    "several stacked arguments": "sa2)",
    "a loop in a loop's step": "[m](t",
    "a gather by an i32 stacked argument": "te[gv = ti]",
    "scatter-add or integer indicator": "= ids",
    "segment max/min": "inf)), ",
    "checkpoint": "checkpoint(",
    "a custom vjp": "with vjp(g)",
    "a for block": "for t in ",
    "per-param state": "state mo.t",
    "a sum over a list of params": "sum[t in ",
    "a name with a prime": "' = ",
    "a dim p * q": "* q\n",
    "random draws": "rand",
    "dropout": "dropout[",
    "fold": "fold(",
}


def test_generator_makes_the_extensions():
    """Each construct of the extensions appears in several of the first programs."""
    texts = [generate(seed).render() for seed in range(GENERATOR_SEEDS)]
    counts = {what: sum(1 for t in texts if needle in t) for what, needle in EXTENSIONS.items()}
    rare = {what: n for what, n in counts.items() if n < 2}
    assert not rare, f"made fewer than twice in {GENERATOR_SEEDS} programs: {rare}"


@pytest.mark.skipif(__import__("shutil").which("cc") is None, reason="tgc build needs a C compiler (cc)")
@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.slow) if i else s
                                  for i, s in enumerate([5, 1, 6, 9, 12])])
def test_shared_library_slice(seed):
    """Generated programs built by `tgc build` and called through ctypes as C would
    (`harness.run_so`: the header's orders, updates in place) agree with the oracle."""
    prog = generate(seed)
    text = prog.render()
    rep = harness.check(text, prog.bind, ("so-f64",), seed)
    assert rep.valid, f"seed {seed}: the oracle cannot run the generated program ({rep.invalid_reason}):\n{text}"
    assert not rep.failures(), _failure_message(f"seed {seed}", text, rep)


@pytest.mark.parametrize("seed", [s if s < QUICK else pytest.param(s, marks=pytest.mark.slow) for s in range(SLICE)])
def test_slice(seed):
    prog = generate(seed)
    text = prog.render()
    backends = harness.DEFAULT_BACKENDS
    if harness.f32_comparable(text):
        backends = backends + ("interp-f32", "cpu-f32", "lowered-f32")
    rep = harness.check(text, prog.bind, backends, seed)
    assert rep.valid, f"seed {seed}: the oracle cannot run the generated program ({rep.invalid_reason}):\n{text}"
    assert not rep.failures(), _failure_message(f"seed {seed}", text, rep)


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.name for p in REGRESSIONS])
def test_regression(path):
    text = path.read_text()
    rep = harness.check_isolated(text, parse_bind_comment(text), harness.registered(), parse_seed_comment(text))
    assert rep.valid, f"{path.name}: the oracle cannot run it ({rep.invalid_reason})"
    assert not rep.failures(), _failure_message(path.name, text, rep)


def test_regressions_found():
    assert REGRESSIONS, "tests/fuzz/regressions/ holds no .tg file"


def test_shrinker_reduces_a_planted_disagreement(monkeypatch):
    """A backend made wrong wherever `tanh` appears: the shrinker keeps a tanh and little else."""
    real = harness.run_backend

    def broken(backend, text, inputs, dims):
        res = real(backend, text, inputs, dims)
        return {k: v * 1.001 + 0.001 for k, v in res.items()} if "tanh(" in text else res

    monkeypatch.setattr(harness, "run_backend", broken)
    for seed in range(100):
        prog = generate(seed)
        rep = harness.check(prog.render(), prog.bind, ("interp-f64",), seed)
        if rep.failures():
            break
    else:
        pytest.fail("no generated program of seeds 0..99 uses tanh")
    small = shrink.shrink(prog, rep.failures()[0])
    text = small.render()
    assert "tanh(" in text
    assert len(text.splitlines()) < len(prog.render().splitlines())
    assert len([line for line in text.splitlines() if not line.startswith("dim ")]) <= 6, text   # dims: as the edges need
    again = harness.check(text, small.bind, ("interp-f64",), small.seed)
    assert again.failures() and again.failures()[0].kind == "mismatch"


def test_shrinker_keeps_the_kind_of_an_error(monkeypatch):
    """An exception shrinks to a program that raises the same exception, not to a mismatch."""
    real = harness.run_backend

    def broken(backend, text, inputs, dims):
        if "exp(" in text:
            raise RuntimeError("planted: exp is not supported")
        return real(backend, text, inputs, dims)

    monkeypatch.setattr(harness, "run_backend", broken)
    for seed in range(100):
        prog = generate(seed)
        rep = harness.check(prog.render(), prog.bind, ("interp-f64",), seed)
        if rep.failures():
            break
    else:
        pytest.fail("no generated program of seeds 0..99 uses exp")
    small = shrink.shrink(prog, rep.failures()[0])
    again = harness.check(small.render(), small.bind, ("interp-f64",), small.seed).failures()
    assert again and again[0].signature() == rep.failures()[0].signature()
    assert "exp(" in small.render()
