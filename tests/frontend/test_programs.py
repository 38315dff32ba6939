"""The program corpus: every bad program is one located diagnostic with exit 1;
every good program and example checks, and runs in the interpreter.

Bad programs start with `# ERROR LINE:COL: words` (the expected position and a
substring of the message); good ones with `# OK`.
"""
import re
from pathlib import Path

import numpy as np
import pytest

from tgc.frontend import compile_file
from tgc.ir.diag import CompileError
from tgc.ir.interp import evaluate
from tgc.ir.inputs import random_inputs
from tgc.options import Options
from tgc.manager import run_pipeline

ROOT = Path(__file__).parents[2]
BAD = sorted((ROOT / "tests/programs/bad").glob("*.tg"))
GOOD = sorted((ROOT / "tests/programs/good").glob("*.tg")) + sorted((ROOT / "examples").glob("*.tg"))
HEADER = re.compile(r"#\s*ERROR\s+(\d+):(\d+):\s*(.+)")


def expectation(path: Path):
    m = HEADER.match(path.read_text(encoding="utf-8", errors="replace").splitlines()[0])
    assert m, f"{path.name}: first line must be '# ERROR LINE:COL: words'"
    return int(m.group(1)), int(m.group(2)), m.group(3).strip().lower()


def test_corpus_is_large_enough():
    assert len(BAD) >= 100
    assert len(GOOD) >= 30


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.name)
def test_bad_program_is_a_located_error(path):
    line, col, words = expectation(path)
    with pytest.raises(CompileError) as info:
        compile_file(str(path))
    err = info.value
    assert err.loc is not None
    rendered = err.format()
    assert (err.loc.line, err.loc.col) == (line, col), rendered
    assert words in err.message.lower(), rendered
    first = rendered.splitlines()[0]
    assert first.startswith(f"{err.loc.file}:{line}:{col}: error: ")
    assert "^" in rendered.splitlines()[2]


def _concrete_run(module, dtype="f64"):
    dims = {d: 3 for d in module.symbolic_dims()}
    env = module.bind_dims(dims)
    inputs = random_inputs(module, env, seed=1, dtype=dtype)
    return evaluate(module, inputs, dtype=dtype, dims=dims)


@pytest.mark.parametrize("path", GOOD, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_good_program_runs(path):
    module = compile_file(str(path), Options(dtype="f64"))
    module = run_pipeline(module, Options(dtype="f64")).module
    out = _concrete_run(module)
    assert set(out) == {o.name for o in module.outputs} | {module.update_key(u.target) for u in module.updates}
    for name, value in out.items():
        assert np.all(np.isfinite(value)), f"{name} is not finite"
