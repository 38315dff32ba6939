"""Golden IR for every example: the front end's output is checked in, and it reads back.

Regenerate after an intended change with `TGC_UPDATE_GOLDEN=1 python3 -m pytest tests/frontend/test_golden_ir.py`
and review the diff.
"""
import os
from pathlib import Path

import pytest

from tgc.frontend import compile_file
from tgc.ir.parser import parse_module
from tgc.ir.printer import print_module

ROOT = Path(__file__).parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.tg"))
GOLDEN = ROOT / "tests/golden/examples"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_ir_matches_golden_and_round_trips(path):
    text = print_module(compile_file(str(path)))
    golden = GOLDEN / f"{path.stem}.tgir"
    if os.environ.get("TGC_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"{path.name}: IR changed; see the module docstring to update"
    assert print_module(parse_module(golden.read_text(), str(golden))) == text


def test_every_example_has_a_golden_file():
    assert sorted(p.stem for p in GOLDEN.glob("*.tgir")) == [p.stem for p in EXAMPLES]
