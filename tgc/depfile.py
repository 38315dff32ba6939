"""Make-style dependency files, as `gcc -MD -MF FILE -MT TARGET -MP` writes them.

`format_depfile(targets, quoted, deps, phony)` gives `target: dep dep ...` with
make's escaping (spaces, `#`, `$`) of the dependencies and of the `quoted` targets
(-MT targets are written as given, as gcc does), lines continued with a backslash, and with `phony` an
empty rule per dependency so that deleting a header-like import does not break
the build.

`compiler_dependencies(tg)` names what a build depends on beyond the program's own
files: the prelude (`tgc/frontend/prelude.tg`, read for every `.tg` program) and a
stamp of the compiler's version, tgc's `__init__.py`. That file defines
`tgc.__version__`, so a new version changes its content, and a regular install (pip
writes the package's files anew, for an upgrade or a reinstall alike) gives it the
install's time: a library built before an upgrade is older than the stamp, and make
builds it again. In an editable install, a checkout's new version touches the stamp
with its version number; editing tgc's other sources there does not (`make -B` then).
"""
from __future__ import annotations

import os

import tgc


def compiler_dependencies(tg: bool) -> list[str]:
    """The prelude (when the program is `.tg` source) and the version stamp, as
    absolute paths (see the module's documentation)."""
    package = os.path.dirname(os.path.abspath(tgc.__file__))
    deps = [os.path.join(package, "frontend", "prelude.tg")] if tg else []
    return deps + [os.path.join(package, "__init__.py")]


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
