"""The featured fuzzer in CI: `tests/fuzz/features.py` (imports, dtypes, complex values,
`assume`, forward rules and nested modes, memory budgets added to the plain programs).

- `test_featured_programs_elaborate`: every feature's program of seeds 0..GEN-1
  elaborates (with its imported files), deterministically, and leaves the plain
  generator's program of the seed as it was (the features draw from streams of their own).
- `test_kept`: the seeds in KEPT, which once disagreed.
- `test_slice`: seeds 0..QUICK-1 of each feature on the float64 interpreter (after the
  default pipeline), the CPU build and the CPU's lowered program, against the feature's
  oracle (`Featured.check`); seeds up to SLICE, and the `tgc build` library, under
  --run-slow.

`scripts/fuzz --feature F` runs thousands of seeds of one feature on demand.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is the fuzzer's oracle: install torch to run these")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))

from fuzz import harness  # noqa: E402
from fuzz.features import FEATURES, featured  # noqa: E402
from fuzz.gen import generate  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::tgc.budget.MemoryBudgetWarning")   # a budget not met

QUICK = 2          # seeds per feature in the quick run
SLICE = 12         # seeds per feature under --run-slow
GEN = 30
# seeds that once disagreed, on the default backends and the `tgc build` library: dtypes 301 (an
# output's type changed by the optimizer: tests/e2e/test_fuzzed_features.py), dtypes 503 (a bf16
# scalar output of the library, a double in its header: the harness read 2 bytes)
KEPT = [("dtypes", 301), ("dtypes", 503)]


@pytest.fixture(autouse=True, scope="module")
def _no_disk_cache():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TGC_CACHE", "off")
        yield


@pytest.mark.parametrize("feature", FEATURES)
def test_featured_programs_elaborate(feature, tmp_path):
    from tgc.frontend import compile_source
    from tgc.options import Options

    bad = []
    for seed in range(GEN):
        plain = generate(seed).render()
        fp = featured(seed, feature)
        assert featured(seed, feature).source() == fp.source(), f"seed {seed}: not deterministic"
        assert generate(seed).render() == plain, f"seed {seed}: the feature changed the plain program"
        d = tmp_path / f"s{seed}"
        d.mkdir()
        for nm, body in fp.files.items():
            (d / nm).write_text(body)
        try:
            compile_source(fp.text, str(d / "prog.tg"), Options(dtype="f64"))
        except Exception as e:  # noqa: BLE001 -- collected, reported together
            bad.append(f"seed {seed}: {e}\n{fp.source()}")
    assert not bad, f"{len(bad)} {feature} programs do not elaborate; the first:\n{bad[0]}"


def _params():
    out = []
    for feature in FEATURES:
        for seed in range(SLICE):
            marks = () if seed < QUICK else (pytest.mark.slow,)
            out.append(pytest.param(feature, seed, marks=marks, id=f"{feature}-{seed}"))
    return out


@pytest.mark.parametrize("feature,seed", _params())
def test_slice(feature, seed, request):
    fp = featured(seed, feature)
    backends = harness.DEFAULT_BACKENDS
    if request.config.getoption("--run-slow"):
        backends = (*backends, "so-f64")
    rep = fp.check(backends)
    assert rep.valid, f"{feature} seed {seed}: the oracle cannot run it: {rep.invalid_reason}\n{fp.source()}"
    fails = rep.failures()
    lines = [f"--- {o.backend}: {o.kind}\n" + "\n".join(o.detail.splitlines()[:12]) for o in fails]
    assert not fails, f"{feature} seed {seed}: the backends disagree with the oracle\n" + "\n".join(lines) + \
        "\n--- the program:\n" + fp.source()


@pytest.mark.parametrize("feature,seed", KEPT, ids=[f"{f}-{s}" for f, s in KEPT])
def test_kept(feature, seed):
    fp = featured(seed, feature)
    rep = fp.check((*harness.DEFAULT_BACKENDS, "so-f64"))
    assert rep.valid, rep.invalid_reason
    fails = rep.failures()
    assert not fails, "\n".join(f"--- {o.backend}: {o.kind}\n{o.detail[:800]}" for o in fails) + "\n" + fp.source()
