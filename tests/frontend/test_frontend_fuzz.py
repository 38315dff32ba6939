"""Mutation fuzz of the front end (issue 19, item 9): no input crashes it.

A seeded mutator damages the examples and tests/programs/good (tokens, lines and
characters deleted, duplicated, swapped; random tokens, brackets, numbers, huge numbers
and unicode inserted; the text truncated) and each mutant goes through the front end in
process (`elaborate_source`: parse, scope, elaboration, warnings). The only acceptable
outcomes are success and a `CompileError` whose diagnostics are located
(file:line:col): any other exception is a crash. A sample of the mutants also goes
through `tgc check` (click's CliRunner, the command's own code path), which must exit
0 or 1 and never 4 (internal compiler error) or with a traceback.

Deterministic: the mutants are a function of the seeds. `FUZZ_FRONTEND_MUTANTS=N`
runs more (the default keeps the test near 30 s on one core).
"""
from __future__ import annotations

import os
import random
import re
import shutil
import traceback
from pathlib import Path

import pytest
from click.testing import CliRunner

from tgc.cli import main
from tgc.frontend.elaborate import elaborate_source
from tgc.ir.diag import CompileError
from tgc.options import Options

ROOT = Path(__file__).resolve().parents[2]
CORPUS = sorted([*ROOT.glob("examples/*.tg"), *ROOT.glob("tests/programs/good/*.tg")])
MUTANTS = int(os.environ.get("FUZZ_FRONTEND_MUTANTS", "3000"))
CLI_EVERY = 15   # every 15th mutant also through `tgc check`

TOKEN = re.compile(r"\s+|[A-Za-z_][A-Za-z_0-9']*|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|->|<=|>=|==|!=|.", re.S)
INSERTS = [
    # brackets and punctuation
    "(", ")", "[", "]", "{", "}", ",", ":", ";", "=", "->", "@", "*", "/", "+", "-", "^", "<", ">=", "==",
    "!", "?", "'", '"', "#", "\\", ".", "..", "|", "&", "$", "~", "`",
    # keywords and names of the language
    "dim", "input", "param", "state", "out", "update", "fn", "import", "grad", "jvp", "vjp", "sum", "mean",
    "max", "min", "size", "stop", "where", "gather", "softmax", "relu", "x", "y", "batch", "i32", "f32", "f64",
    # numbers, some huge or degenerate
    "0", "1", "-1", "2.5", "1e400", "-1e400", "1e-400", "nan", "inf", "99999999999999999999999999999",
    "4611686018427387904", "18446744073709551617", "0x10", "1_000", "00", "1.", ".5", "1e", "1e+",
    str(2 ** 63), str(2 ** 62), "3" * 400,
    # unicode and control characters
    "é", "∑", "λ", "\u200b", "\ufeff", "\u202e", "😀", "\t", "\r", "\r\n", "\x0b", "\x0c", "\x00", "\x7f",
    "\ud7ff", "\n", "\n\n", "    ",
]


def _tokens(text: str) -> list[str]:
    return TOKEN.findall(text)


def mutate(text: str, rng: random.Random) -> str:
    """One to three random edits of `text`."""
    for _ in range(rng.choice((1, 1, 2, 3))):
        kind = rng.randrange(12)
        if kind <= 3:   # token edits
            toks = _tokens(text)
            if not toks:
                toks = [""]
            i, j = rng.randrange(len(toks)), rng.randrange(len(toks))
            if kind == 0:
                del toks[i]
            elif kind == 1:
                toks.insert(i, toks[i])
            elif kind == 2:
                toks[i], toks[j] = toks[j], toks[i]
            else:
                toks.insert(i, rng.choice(INSERTS))
            text = "".join(toks)
        elif kind <= 6:   # line edits
            lines = text.split("\n")
            i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
            if kind == 4:
                del lines[i]
            elif kind == 5:
                lines.insert(i, lines[i])
            else:
                lines[i], lines[j] = lines[j], lines[i]
            text = "\n".join(lines)
        elif kind <= 9:   # character edits
            i = rng.randrange(len(text) + 1)
            if kind == 7 and text:
                text = text[:i] + text[i + 1:]
            elif kind == 8:
                text = text[:i] + chr(rng.choice((rng.randrange(32, 127), rng.randrange(0x80, 0x3000)))) + text[i:]
            else:
                text = text[:i] + text[i:i + 1] * rng.randrange(2, 6) + text[i + 1:]
        elif kind == 10:  # a random token sequence at a random place
            i = rng.randrange(len(text) + 1)
            text = text[:i] + " ".join(rng.choice(INSERTS) for _ in range(rng.randrange(1, 6))) + text[i:]
        else:             # truncate
            text = text[:rng.randrange(len(text) + 1)]
    return text


def _mutants():
    sources = [(p, p.read_text(encoding="utf-8")) for p in CORPUS]
    for seed in range(MUTANTS):
        rng = random.Random(seed)
        path, text = sources[seed % len(sources)]
        yield seed, path, mutate(text, rng)


def _located(e: CompileError, name: str) -> str | None:
    """None if every diagnostic of `e` has a file:line:col, else what is wrong."""
    if e.loc is None:
        return f"unlocated error: {e.message}"
    if e.loc.line < 1 or e.loc.col < 1 or not e.loc.file:
        return f"bad location {e.loc}: {e.message}"
    return None


def test_corpus_is_clean():
    assert len(CORPUS) >= 40
    for path in CORPUS:
        elaborate_source(path.read_text(encoding="utf-8"), str(path), Options())


def test_mutants_never_crash_the_front_end():
    crashes, outcomes = [], {"ok": 0, "error": 0}
    for seed, path, text in _mutants():
        try:
            elaborate_source(text, str(path), Options())
            outcomes["ok"] += 1
        except CompileError as e:
            outcomes["error"] += 1
            bad = _located(e, str(path))
            if bad:
                crashes.append((seed, path.name, bad, text))
        except Exception as e:  # noqa: BLE001 - a crash is what this test looks for
            tb = traceback.format_exception(type(e), e, e.__traceback__)[-3:]
            crashes.append((seed, path.name, f"{type(e).__name__}: {e}\n{''.join(tb)}", text))
    report = "\n\n".join(f"seed {s} ({name}): {why}\n--- mutant:\n{text[:2000]}" for s, name, why, text in crashes[:5])
    assert not crashes, f"{len(crashes)} of {MUTANTS} mutants crashed the front end:\n{report}"
    assert outcomes["ok"] > MUTANTS // 20 and outcomes["error"] > MUTANTS // 2, outcomes


def test_mutants_through_tgc_check(tmp_path):
    """`tgc check` on written mutants: exit 0 or 1, a gcc-style diagnostic, no ICE."""
    for sub in ("examples/lib", "tests/programs/good/imports"):   # the corpus's imports, beside the mutants
        shutil.copytree(ROOT / sub, tmp_path / Path(sub).name, dirs_exist_ok=True)
    runner = CliRunner()
    bad = []
    for seed, path, text in _mutants():
        if seed % CLI_EVERY:
            continue
        target = tmp_path / f"m{seed}.tg"
        target.write_bytes(text.encode("utf-8", errors="surrogatepass"))
        result = runner.invoke(main, ["check", str(target)])
        out = result.output
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            bad.append((seed, f"raised {type(result.exception).__name__}: {result.exception}", text))
        elif result.exit_code not in (0, 1) or "Traceback" in out or "internal compiler error" in out:
            bad.append((seed, f"exit {result.exit_code}: {out[-600:]}", text))
        elif result.exit_code == 1 and not re.search(r"^[^\n]+\.tg:\d+:\d+: error: ", out, re.M):
            bad.append((seed, f"no located error: {out[-600:]}", text))
    report = "\n\n".join(f"seed {s}: {why}\n--- mutant:\n{text[:1500]}" for s, why, text in bad[:5])
    assert not bad, f"{len(bad)} mutants failed `tgc check`:\n{report}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mutator_is_deterministic(seed):
    text = CORPUS[seed].read_text(encoding="utf-8")
    assert mutate(text, random.Random(seed)) == mutate(text, random.Random(seed))


# ---- regressions the fuzz found --------------------------------------------------------

@pytest.mark.parametrize("target, why", [
    ("imports" + "3" * 400 + "/lib.tg", "File name too long"),   # ENAMETOOLONG from stat
    ("a\x00b.tg", "embedded null byte"),
    ("loop.tg", "a loop of symbolic links"),                     # pathlib's RuntimeError
])
def test_import_path_the_os_refuses_is_a_located_error(tmp_path, target, why):
    (tmp_path / "loop.tg").symlink_to("loop.tg")
    main_file = tmp_path / "main.tg"
    with pytest.raises(CompileError) as err:
        elaborate_source(f'import "{target}"\ninput x\nout x\n', str(main_file), Options())
    assert err.value.loc is not None and (err.value.loc.line, err.value.loc.col) == (1, 8)
    assert why in err.value.message and len(err.value.message) < 200
