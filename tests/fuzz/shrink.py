"""Greedy shrinking of a failing fuzzed program, by its structure.

`shrink(program, outcome)` tries smaller programs, one edit at a time, and keeps an
edit when the oracle still accepts the program (it elaborates, and every oracle value
is finite) and the backend still disagrees *in the same way*
(`harness.Outcome.signature`: a value mismatch stays a value mismatch; an exception
keeps its class and message gist). The edits, biggest first:

- drop a statement (a binding, an output, an update), a function, a declaration, a dim;
- drop an output's explicit ABI order; drop an item of a multi-item edge operation;
- replace a subexpression by one of its operands, or by a leaf (`1`, `0.5`, or a
  declared tensor or binding with the same edges);
- shrink a literal dim's size and a symbolic dim's run-time size.

It repeats until no edit is kept (or the budget runs out) and returns the smallest
program, which `Program.render` writes as .tg text. A crash (the process killed by a
signal, e.g. an LLVM assertion) is shrunk by running each candidate in a forked child.
"""
from __future__ import annotations

import dataclasses
import re
import time

from fuzz import harness
from fuzz.nodes import Node, Program, num


def _roots(p: Program):
    """(location, node) of every expression root of the program."""
    for i, s in enumerate(p.stmts):
        if s.expr is not None:
            yield ("stmt", i), s.expr
    for i, f in enumerate(p.fns):
        yield ("ret", i), f.ret
        for j, (_, e) in enumerate(f.binds):
            yield ("fbind", i, j), e


def _set_root(p: Program, loc, node: Node) -> Program:
    q = p.copy()
    if loc[0] == "stmt":
        q.stmts[loc[1]] = dataclasses.replace(q.stmts[loc[1]], expr=node)
    elif loc[0] == "ret":
        q.fns[loc[1]] = dataclasses.replace(q.fns[loc[1]], ret=node)
    else:
        f = q.fns[loc[1]]
        binds = list(f.binds)
        binds[loc[2]] = (binds[loc[2]][0], node)
        q.fns[loc[1]] = dataclasses.replace(f, binds=binds)
    return q


def _paths(node: Node, path=()):
    yield path, node
    for i, k in enumerate(node.kids):
        yield from _paths(k, path + (i,))


def _replace(node: Node, path, new: Node) -> Node:
    if not path:
        return new
    kids = list(node.kids)
    kids[path[0]] = _replace(kids[path[0]], path[1:], new)
    return node.with_kids(kids)


def _size(p: Program) -> int:
    """A measure of a program: its expression nodes, statements and declarations."""
    return (sum(sum(1 for _ in r.walk()) for _, r in _roots(p)) + 3 * len(p.stmts) + 2 * len(p.decls)
            + 2 * len(p.fns) + len(p.dims) + sum(int(e) for _, e in p.dims if e and e.isdigit())
            + sum(p.bind.values()))


def _leaves(p: Program, node: Node) -> list[Node]:
    out = [num(1), num(0.5)]
    names = [(d.name, frozenset(d.edges)) for d in p.decls if d.dtype != "i32"]
    names += [(s.name, s.expr.edges) for s in p.stmts if s.kind == "bind" and s.expr is not None]
    for n, e in names:
        if e == node.edges:
            out.append(Node("name", [], (n,), e))
    return out


def candidates(p: Program):
    """Smaller variants of `p`, biggest cuts first (most of them may not elaborate)."""
    for i in reversed(range(len(p.stmts))):
        q = p.copy()
        del q.stmts[i]
        if any(s.kind in ("out", "update") for s in q.stmts):
            yield q
    for i in reversed(range(len(p.fns))):
        q = p.copy()
        del q.fns[i]
        yield q
    for i in reversed(range(len(p.decls))):
        q = p.copy()
        del q.decls[i]
        yield q
    for i in reversed(range(len(p.dims))):
        q = p.copy()
        nm = q.dims[i][0]
        del q.dims[i]
        q.bind.pop(nm, None)
        yield q
    for i, s in enumerate(p.stmts):
        if s.order:
            q = p.copy()
            q.stmts[i] = dataclasses.replace(s, order=None)
            yield q
    for loc, root in _roots(p):
        for path, node in _paths(root):
            for kid in node.kids:
                if kid.op != "raw" or node.op != "bin":
                    yield _set_root(p, loc, _replace(root, path, kid))
            if node.op == "eops" and len(node.attrs[0]) > 1:
                for j in range(len(node.attrs[0])):
                    items = node.attrs[0][:j] + node.attrs[0][j + 1:]
                    yield _set_root(p, loc, _replace(root, path, dataclasses.replace(node, attrs=(items,))))
            if node.op == "call" and len(node.kids) > 1:   # drop an optional argument
                kids, kw = node.kids[:-1], node.attrs[2][:-1]
                shorter = dataclasses.replace(node, kids=list(kids), attrs=(node.attrs[0], node.attrs[1], kw))
                yield _set_root(p, loc, _replace(root, path, shorter))
            if node.op not in ("name", "num"):
                for leaf in _leaves(p, node):
                    yield _set_root(p, loc, _replace(root, path, leaf))
    for i, (nm, e) in enumerate(p.dims):
        if e and e.isdigit() and int(e) > 1:
            for smaller in sorted({1, 2, int(e) - 1}):
                if smaller < int(e):
                    q = p.copy()
                    q.dims[i] = (nm, str(smaller))
                    yield q
    for d, n in p.bind.items():
        for smaller in sorted({1, 2, n - 1}):
            if smaller < n:
                q = p.copy()
                q.bind[d] = smaller
                yield q


def shrink(p: Program, outcome: harness.Outcome, *, max_checks: int = 1500, max_seconds: float = 240.0,
           log=None) -> Program:
    """The smallest program found that shows the same disagreement as `outcome` on its backend."""
    target = outcome.signature()
    backend = outcome.backend
    seen: set[str] = set()
    checks = 0
    start = time.monotonic()

    crash = outcome.detail.startswith("crash:")

    def fails(q: Program) -> bool:
        nonlocal checks
        text = q.render()
        if text in seen:
            return False
        seen.add(text)
        checks += 1
        if crash:   # the same signal, in a child process
            return _child_signal(text, q.bind, backend, q.seed) == outcome.detail.split("signal ")[1].split()[0]
        rep = harness.check(text, q.bind, (backend,), q.seed)
        return rep.valid and rep.outcomes[backend].signature() == target

    current = p
    progress = True
    while progress and checks < max_checks and time.monotonic() - start < max_seconds:
        progress = False
        size = _size(current)
        for q in candidates(current):
            if checks >= max_checks or time.monotonic() - start >= max_seconds:
                break
            if _size(q) >= size:
                continue
            if fails(q):
                current = q
                progress = True
                if log:
                    log(f"shrink: {_size(q)} ({checks} checks)")
                break
    return current


def _child_signal(text: str, bind, backend: str, seed: int) -> str | None:
    """The signal that kills a forked child running the program on `backend` (as text), or None."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=harness.check, args=(text, bind, (backend,), seed))
    child.start()
    child.join(120)
    if child.is_alive():
        child.kill()
        child.join()
        return None
    return str(-child.exitcode) if child.exitcode and child.exitcode < 0 else None


def header(p: Program, outcome: harness.Outcome, what: str = "") -> str:
    """A regression file's text: a comment header (what it caught), then the program."""
    detail = re.sub(r"\s+\n", "\n", outcome.detail.split("\nTraceback")[0]).strip()
    lines = [f"Found by the differential fuzzer (scripts/fuzz), program seed {p.seed}.",
             f"{outcome.backend}: {outcome.kind} against the torch oracle" + (f": {what}" if what else ""),
             *detail.splitlines()[:6],
             f"inputs seed: {p.seed}"]
    q = p.copy()
    q.note = "\n".join(lines)
    return q.render()
