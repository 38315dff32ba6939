"""Make-style dependency files, as `gcc -MD -MF FILE -MT TARGET -MP` writes them.

`format_depfile(targets, deps, phony)` gives `target: dep dep ...` with make's
escaping (spaces, `#`, `$`), lines continued with a backslash, and with `phony` an
empty rule per dependency so that deleting a header-like import does not break
the build.
"""
from __future__ import annotations

import os


def escape(path: str) -> str:
    out = path.replace("$", "$$").replace("#", "\\#")
    return out.replace(" ", "\\ ")


def format_depfile(targets: list[str], deps: list[str], phony: bool = False) -> str:
    seen: dict[str, None] = {}
    for d in deps:
        seen.setdefault(os.path.normpath(d), None)
    items = [escape(t) for t in targets]
    lines = [" ".join(items) + ":"]
    for d in seen:
        lines[-1] += " \\"
        lines.append(f"  {escape(d)}")
    text = "\n".join(lines) + "\n"
    if phony:
        text += "".join(f"\n{escape(d)}:\n" for d in list(seen)[1:])
    return text
