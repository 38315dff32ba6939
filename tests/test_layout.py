"""The package's folders follow the pipeline, and the tests' folders follow the package.

Stages, in pipeline order: ir < frontend < opt < autodiff < lower < manager/registry <
backends < runtime < pipeline < cli. A module may import its own stage, an earlier
one, and the leaves (`tgc.options`, `tgc.fsutil`, `tgc.progress`, and each backend's
settings `tgc.backends.NAME.options`, which `tgc.options` nests: they import nothing
of tgc but one another); a top-level module outside the stages (info, explain, params, depfile, torch,
the package itself) may be imported by a stage only if everything it imports,
transitively, is no later than that stage. The imports read here are the source's
(`ast`), so a function-local import counts as much as a module-level one.

`KNOWN` lists the crossings not yet removed, each with its reason; it only permits
(an entry that no longer occurs is harmless), so that removing one needs no change here.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tgc"
TESTS = ROOT / "tests"

STAGES = ["ir", "frontend", "opt", "autodiff", "lower", "manager", "backends", "runtime", "pipeline", "cli"]
RANK = {**{s: i for i, s in enumerate(STAGES)}, "registry": STAGES.index("manager")}
LEAVES = {"options", "fsutil", "progress"}
# each backend's settings: plain dataclasses that `tgc.options` nests (`Options.cpu`, `.cuda`)
LEAF_MODULES = {"tgc.backends.cpu.options", "tgc.backends.cuda.options"}

KNOWN = {
    ("tgc.backends.cuda.aot", "tgc"): "the version stamp `tgc.__version__` in the AOT manifest",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "tgc":
            named = {f"{node.module}.{a.name}" for a in node.names}    # `from tgc.x import y` may name a module
            found.update(named & MODULE_NAMES)
            if named - MODULE_NAMES:                                   # ... or a name defined in tgc.x itself
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "tgc")
    return found


MODULE_NAMES = {module_name(p) for p in PACKAGE.rglob("*.py")}
MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {m: {t for t in imports(p) if t in MODULES} for m, p in MODULES.items()}


def top(module: str) -> str:
    """The first name below `tgc` ('' for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def rank(module: str) -> int | None:
    """The stage of a module in a stage; -1 for a leaf; None for top-level glue."""
    t = top(module)
    return -1 if t in LEAVES or module in LEAF_MODULES else RANK.get(t)


def reach(module: str, seen: set[str] | None = None) -> set[str]:
    seen = set() if seen is None else seen
    for t in GRAPH[module]:
        if t not in seen:
            seen.add(t)
            reach(t, seen)
    return seen


def effective_rank(module: str) -> int:
    """A stage module's rank; for glue, the latest stage it reaches (so a stage may use it only after that)."""
    r = rank(module)
    if r is not None:
        return r
    return max((rank(t) for t in reach(module) if rank(t) is not None), default=-1)


def test_the_stage_list_covers_every_package_folder():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders <= set(STAGES), folders - set(STAGES)
    assert {"ir", "frontend", "opt", "autodiff", "lower", "backends", "runtime", "cli"} <= folders


def test_no_module_imports_a_later_stage():
    late = []
    for m in MODULES:
        r = rank(m)
        if r is None:
            continue
        for t in sorted(GRAPH[m]):
            if effective_rank(t) > r and (m, t) not in KNOWN:
                late.append(f"{m} ({top(m)}) -> {t} ({top(t) or 'tgc'}, stage {effective_rank(t)} > {r})")
    assert not late, "\n".join(late)


def test_leaves_import_nothing_of_tgc():
    for m in MODULES:
        if m in LEAF_MODULES:   # one another only (CudaOptions checks its values with CpuOptions' check_fields)
            assert GRAPH[m] <= LEAF_MODULES - {m}, (m, GRAPH[m])
        elif top(m) in LEAVES:
            assert GRAPH[m] <= LEAF_MODULES, (m, GRAPH[m] - LEAF_MODULES)


def test_the_checker_sees_a_violation():
    """The rule is not vacuous: the IR imports nothing later, yet a made-up crossing is caught."""
    assert effective_rank("tgc.cli.app") == RANK["cli"] and effective_rank("tgc.ir.module") == 0
    assert effective_rank("tgc.depfile") == RANK["pipeline"]     # it imports the package (its version), which reaches the pipeline
    assert effective_rank("tgc.info") == RANK["ir"]             # the interface description needs only the IR
    assert ("tgc.ir.interp", "tgc.lower.plan") not in KNOWN and effective_rank("tgc.lower.plan") > rank("tgc.ir.interp")


@pytest.mark.parametrize("package", sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()))
def test_every_package_says_its_stage_and_what_it_may_import(package):
    doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text())) or ""
    assert re.search(r"^Stage\b", doc, re.M), f"tgc/{package}/__init__.py: no 'Stage:' paragraph"
    assert "import" in doc.split("Stage", 1)[1], f"tgc/{package}/__init__.py: the stage paragraph says nothing of imports"


def test_test_folders_mirror_the_package():
    """Every test folder but the end-to-end suites (e2e) and data folders is a package folder's
    name, and every staged package folder has tests; test basenames are unique (rootdir-based
    imports: pytest imports each test module by its basename)."""
    data = {"programs", "golden", "fuzz", "__pycache__"}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir()} - data
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders - {"e2e"} <= packages, folders - {"e2e"} - packages
    assert packages <= folders, packages - folders
    names = [p.name for p in TESTS.rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    assert not list(TESTS.glob("*/__init__.py")) or [p.parent.name for p in TESTS.glob("*/__init__.py")] == ["fuzz"]
