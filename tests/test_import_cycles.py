"""No import cycles among tgc's modules, counting the imports inside functions.

A function-level import hides a cycle from Python's loader but not from the design:
the two modules still depend on each other (DESIGN.md's stage order, "no earlier
stage imports a later one", is what keeps the tree layered). The graph is the one
`tests/test_layout.py` reads with `ast` from the source (every import, at any depth);
its strongly connected components must be single modules.
"""
from __future__ import annotations

from test_layout import GRAPH


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


def test_the_finder_sees_a_cycle_and_the_graph_counts_function_level_imports():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert "tgc.budget" in GRAPH["tgc.pipeline"]   # imported inside `pipeline.lower` only


def test_no_module_of_tgc_is_on_an_import_cycle():
    found = cycles(GRAPH)
    assert not found, "import cycles (counting imports inside functions):\n" + "\n".join(
        "  " + " <-> ".join(c) + "\n    " + "\n    ".join(f"{m} imports {', '.join(sorted(GRAPH[m] & set(c)))}"
                                                      for m in c) for c in found)


def test_the_pipeline_knows_nothing_of_processes():
    """Data parallelism wraps compiled programs from outside (`tgc.distributed` and the
    modules it is made of): the pipeline, the pass manager and the budget planner never
    import them."""
    reach, todo = set(), ["tgc.pipeline", "tgc.manager", "tgc.budget"]
    while todo:
        m = todo.pop()
        if m not in reach:
            reach.add(m)
            todo.extend(GRAPH[m])
    assert not reach & {"tgc.distributed", "tgc.gradient_split", "tgc.collectives", "tgc.local_ranks"}
