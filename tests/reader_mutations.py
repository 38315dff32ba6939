"""Token mutations of `tgc dump-ir` outputs, and the property every reader of them keeps.

The IR reader (`tgc.ir.parser`) and the lowered-program reader (`tgc.lower.text`)
take text a person may have edited. Whatever the text, `tgc opt` on it either accepts
it (the result is a verified module or lowered program, so its printed form reads back)
or stops with a located error (`<stdin>:LINE:COL: error: ...`, exit 1): never an
internal compiler error (exit 4) or a Python traceback.

`mutants(text, seed, count)` makes seeded variants of a text, each with one to three
mutations of a random line: a token deleted, duplicated, swapped with the next, replaced
by a number, a name, an edge, a type or any other token of the text, or inserted; the
line truncated, duplicated or deleted. `check_opt` runs `tgc opt` on one in-process and
says how it ended, failing the test on anything but an acceptance or a located error.
"""
from __future__ import annotations

import random
import re
from typing import Iterator

from click.testing import CliRunner

from tgc.cli import main

TOKEN = re.compile(r"%?[A-Za-z_][\w'.]*|-?\d+(?:\.\d+)?(?:e-?\d+)?|\S")
NUMBERS = ["0", "1", "-1", "2", "3", "-5", "0.5", "1.5", "-0.0", "1e400", "nan", "inf",
           "1000000000000", "99999999999999999999999"]
TYPES = ["f32", "f64", "bf16", "f16", "i32", "bool", "c64"]
NAMES = ["x", "batch", "%t3", "%x", "k0", "sum", "max", "loop", "gemm", "arg", "temp", "out", "rename",
         "contract", "custom", "scatter", "random", "gather", "indicator", "map", "const", "size"]
KINDS = ("delete", "duplicate", "swap", "number", "name", "edge", "type", "any", "insert",
         "truncate", "duplicate-line", "delete-line")

runner = CliRunner()


def dump(path: str, after: str | None) -> str:
    """`tgc dump-ir path [--after after]`: the IR after that pass, or the lowered program."""
    result = runner.invoke(main, ["dump-ir", path, *(["--after", after] if after else [])])
    assert result.exit_code == 0, result.output
    return result.output


def mutants(text: str, seed: int, count: int) -> Iterator[tuple[str, str]]:
    """`count` (what was done, mutated text) pairs, the same for the same seed."""
    r = random.Random(seed)
    tokens = [m.group() for m in TOKEN.finditer(text)]
    edges = sorted({e.strip() for group in re.findall(r"\[([^\]]*)\]", text) for e in group.split(",")
                    if re.fullmatch(r"\s*[A-Za-z_]\w*\s*", e)})
    made = 0
    while made < count:
        lines, done = text.split("\n"), []
        for _ in range(r.choice([1, 1, 1, 2, 3])):
            kind = r.choice(KINDS)
            if _mutate(lines, kind, r, tokens, edges):
                done.append(kind)
        if done:
            made += 1
            yield "+".join(done), "\n".join(lines)


def _mutate(lines: list[str], kind: str, r: random.Random, tokens: list[str], edges: list[str]) -> bool:
    """Apply one mutation of `kind` to a random line of `lines`, in place; False if the
    line has nothing it applies to."""
    i = r.randrange(len(lines))
    line = lines[i]
    if kind == "duplicate-line":
        lines.insert(i, line)
        return True
    if kind == "delete-line":
        del lines[i]
        lines[:] = lines or [""]
        return True
    found = list(TOKEN.finditer(line))
    choose = {
        "number": lambda m: re.fullmatch(r"-?\d.*", m.group()),
        "name": lambda m: re.match(r"%?[A-Za-z_]", m.group()),
        "edge": lambda m: m.group() in edges,
        "type": lambda m: m.group() in TYPES,
    }.get(kind, lambda m: True)
    found = [m for m in found if choose(m)]
    if not found:
        return False
    j = r.randrange(len(found))
    m = found[j]
    a, b = m.span()
    if kind == "delete":
        new = line[:a] + line[b:]
    elif kind == "duplicate":
        new = line[:b] + " " + m.group() + line[b:]
    elif kind == "swap":
        if j + 1 >= len(found):
            return False
        n = found[j + 1]
        new = line[:a] + n.group() + line[b:n.start()] + m.group() + line[n.end():]
    elif kind == "truncate":
        new = line[:a]
    elif kind == "insert":
        new = line[:a] + r.choice(tokens) + " " + line[a:]
    else:
        pool = {"number": NUMBERS, "name": NAMES + [t for t in tokens if re.match(r"%?[A-Za-z_]", t)],
                "edge": edges, "type": TYPES, "any": tokens}[kind]
        new = line[:a] + r.choice(pool) + line[b:]
    lines[i] = new
    return True


LOCATED = re.compile(r"^<stdin>:(\d+):(\d+): error: ", re.M)


def check_opt(text: str, passes: str | None = "", what: str = "") -> str:
    """Run `tgc opt -` on `text` (with `-p passes` unless None: '' only reads, verifies
    and reprints); 'accepted' or 'error'. Fails on an internal error, a traceback, an
    error without a line of the text, or (with -p '') a reprint that does not read back."""
    args = ["opt", "-", *(["-p", passes] if passes is not None else [])]
    result = runner.invoke(main, args, input=text)
    show = f"{what}: `tgc {' '.join(args)}` on\n{text}\n--- gave exit {result.exit_code}:\n{result.output}"
    assert "Traceback" not in result.output, show
    if result.exit_code == 0:
        if passes == "":
            again = runner.invoke(main, ["opt", "-", "-p", ""], input=result.output)
            assert again.exit_code == 0 and again.output == result.output, \
                f"{show}\n--- which does not read back the same:\n{again.output}"
        return "accepted"
    assert result.exit_code == 1, show
    where = LOCATED.search(result.output)
    assert where, f"{show}\n(an error without its location)"
    assert 1 <= int(where.group(1)) <= text.count("\n") + 1, f"{show}\n(the line is not one of the text's)"
    return "error"
