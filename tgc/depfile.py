"""Make-style dependency files, as `gcc -MD -MF FILE -MT TARGET -MP` writes them.

`format_depfile(targets, quoted, deps, phony)` gives `target: dep dep ...` with
make's escaping (spaces, `#`, `$`) of the dependencies and of the `quoted` targets
(-MT targets are written as given, as gcc does), lines continued with a backslash, and with `phony` an
empty rule per dependency so that deleting a header-like import does not break
the build.
"""
from __future__ import annotations

import os


def escape(path: str) -> str:
    out = path.replace("$", "$$").replace("#", "\\#")
    return out.replace(" ", "\\ ")


def format_depfile(targets: list[str], quoted: list[str], deps: list[str], phony: bool = False) -> str:
    """`targets` as written (gcc's -MT), `quoted` escaped for make (the default target,
    the output's path, as gcc's -MQ)."""
    seen: dict[str, None] = {}
    for d in deps:
        seen.setdefault(os.path.normpath(d), None)
    items = list(targets) + [escape(t) for t in quoted]
    lines = [" ".join(items) + ":"]
    for d in seen:
        lines[-1] += " \\"
        lines.append(f"  {escape(d)}")
    text = "\n".join(lines) + "\n"
    if phony:
        text += "".join(f"\n{escape(d)}:\n" for d in list(seen)[1:])
    return text
