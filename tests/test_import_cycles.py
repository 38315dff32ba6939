"""No import cycles among tgc's modules, counting the imports inside functions.

A function-level import hides a cycle from Python's loader but not from the design:
the two modules still depend on each other (the stage order of DESIGN.md, "no
earlier stage imports a later one", is what keeps the tree layered). The graph is
read with `ast` from the source: `import a.b` and `from a import b` name module
a.b where it exists, else a (an attribute of a); relative imports resolve against
the importing module's package. Its strongly connected components must be single
modules.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "tgc").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The tgc modules `name` imports anywhere in its text (module level or not)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return {m for m in out if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def test_the_finder_sees_a_cycle_through_a_function_level_import(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from pkg import b\n")
    b = tmp_path / "b.py"
    b.write_text("from pkg.a import f\n")
    known = {"pkg.a", "pkg.b"}
    graph = {"pkg.a": imports("pkg.a", a, known), "pkg.b": imports("pkg.b", b, known)}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]


def test_no_module_of_tgc_is_on_an_import_cycle():
    graph = import_graph()
    assert len(graph) > 100   # the whole tree was read
    found = cycles(graph)
    assert not found, "import cycles (counting imports inside functions):\n" + "\n".join(
        "  " + " <-> ".join(c) + "\n    " + "\n    ".join(f"{m} imports {', '.join(sorted(graph[m] & set(c)))}"
                                                      for m in c) for c in found)


def test_the_pipeline_knows_nothing_of_processes():
    """Data parallelism wraps compiled programs from outside (`tgc.distributed`): the
    pipeline, the pass manager and the budget planner never import it."""
    graph = import_graph()
    reach, todo = set(), ["tgc.pipeline", "tgc.manager", "tgc.budget"]
    while todo:
        m = todo.pop()
        if m not in reach:
            reach.add(m)
            todo.extend(graph[m])
    assert "tgc.distributed" not in reach
