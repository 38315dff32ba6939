"""Hardening: no code from caches, sizes that overflow, special files, hostile
inputs; each case is a clear error (or a refusal), never a crash or a traceback."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tgc

ROOT = Path(__file__).resolve().parents[1]


def tgc_cli(*args, cwd=None, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "tgc.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, **(env or {})}, timeout=timeout)


# ------------------------------------------------------------ the parser reads no cache file

def test_parser_tables_are_current_and_loaded():
    """The shipped tables are for this grammar (else `python -m tgc.frontend.parser`),
    are what the parser uses, and parse like tables built from the grammar."""
    import json

    from lark import Lark

    from tgc.frontend import parser

    grammar = parser._grammar_path().read_text(encoding="utf-8")
    tables = json.loads(parser._TABLES.read_text(encoding="utf-8"))
    assert tables["grammar_sha256"] == parser._grammar_digest(grammar), \
        "run `python -m tgc.frontend.parser` after changing the grammar"
    shipped = parser._lark()
    assert shipped.source_path == "<deserialized>" and not shipped.options.cache
    fresh = Lark(grammar, postlex=parser._POSTLEX, transformer=parser._BUILDER, **parser._OPTIONS)
    for path in sorted((ROOT / "examples").glob("*.tg")):
        text = path.read_text()
        parser._BUILDER.start_parse(str(path))
        a = shipped.parse(text)
        parser._BUILDER.start_parse(str(path))
        assert fresh.parse(text) == a, path


def test_check_reads_and_writes_nothing_in_the_temp_dir(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    planted = tmp / ".lark_cache_planted.tmp"
    planted.write_bytes(b"not a pickle")
    r = tgc_cli("check", ROOT / "examples" / "mlp.tg", env={"TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp.iterdir()) == [planted.name]
