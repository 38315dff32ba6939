"""Causal products: which GEMMs of a lowered program may skip what a mask makes dead
(`CpuOptions.causal_gemm`; the own kernel's `tri` form, fgemm.py).

What it decides. For every `GemmKernel` of the program (its steps' too) a `Tri` plan
or none, over the product's edges, `sum(coef[e] * e) + const >= 0` on two of them:
- "zero": an operand is exactly 0 (+0 or -0) wherever the relation fails, the relation
  tying the summed edge to a row or column edge (attention's `P v`, `dS k`, `P^T dO`,
  `dS^T q`: the weights and their cotangent are 0 above the diagonal). The kernel sums
  each block's K range that the relation admits for some element of the block. Exact:
  each element is an FMA chain from +0 in K's order, and a term a * b with a = +-0
  and b finite adds +-0, which leaves the chain's value as it was (+0 + -0 is +0): the
  same bits as summing every term.
- "out": the product's result is read only where the relation holds, or by
  expressions whose value does not depend on it where it fails (`q . k` under
  `- 1e9 * [s > t]` or `where([s <= t], .., -1e9)`, then a max over the keys and an
  exp; `dO . v` times the weights, 0 there). The kernel stores 0 at every element the
  relation rejects and computes only the blocks it admits somewhere. Exact for the
  program's results: the dead elements' readers give the same values with any
  ordinary number there (below), up to the sign of a zero read only by sums.

How a fact is shown. Each loop kernel's expression is evaluated, at the elements a
candidate relation rejects, in the states of tgc/opt/stream_skip.py (`exact`, which
decides the same question for a stream's runs): Z (exactly 0: an admitting mask, a
product or mul0 with a Z factor, a sum of Z terms, exp of an L value), One (a
rejecting mask), L(b) (at most b <= -1e8: a sum with a rejecting mask times a fill <=
-1e8, the other terms ordinary), ordinary (no dependence on both of the relation's
edges: row statistics) and unknown. An elementwise kernel whose value is Z there gives
its buffer the fact (its out index names the relation's edges); a stacked output of a
loop's step gives it to the stacked buffer, and a step's argument slicing a buffer with
a fact has it (the forward's weights, read by the backward's step). A product's result
is dead where a relation fails when every kernel that reads it is a loop kernel (or a
group's member) whose value there is Z whatever the product holds (elementwise, or a sum
over the relation's edges), or L for a max, maxshift or logsumexp over one of them that
finds an admitted element in every row (the sizes known).

Assumption (stated, not checked; the one `stream_skip` makes): admitted scores, row
statistics and masked scores lie within +-1e7, so that a fill of -1e9 stays below -1e8
after the row's max is subtracted and exp of it is exactly 0 in f32 and f64; and the
operands of a product with a Z factor are finite (a NaN or inf times a skipped 0 is
not summed: the result differs from the unskipped program's NaN there).

Terminates: one pass over the kernels in program order (steps recursively); each
candidate relation is checked once per reader.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tgc.lower.lowered import (Add, Const, GemmKernel, Load, LoopKernel, Lowered, Map, Mask, Mul, StepLoop)
from tgc.opt.stream_skip import LOW, ORDINARY   # an L value's bound; the assumed bound on scores and row statistics


@dataclass(frozen=True)
class Lin:
    """`sum(coef * edge) + const >= 0`, coefficients -1 or 1 on exactly two edges."""
    coefs: tuple[tuple[str, int], ...]
    const: int

    @staticmethod
    def make(coefs: dict, const) -> "Lin | None":
        kept = {e: c for e, c in coefs.items() if c != 0}
        if len(kept) != 2 or any(c not in (-1, 1) for c in kept.values()) or not isinstance(const, int):
            return None
        return Lin(tuple(sorted(kept.items())), const)

    def negated(self) -> "Lin":
        """Holds exactly where this one fails: -x - 1 >= 0 <=> x < 0."""
        return Lin(tuple((e, -c) for e, c in self.coefs), -self.const - 1)

    def edges(self) -> tuple[str, ...]:
        return tuple(e for e, _ in self.coefs)

    def __str__(self) -> str:
        terms = " ".join(f"{'-' if c < 0 else '+'} {e}" for e, c in self.coefs).lstrip("+ ")
        return f"{terms} {'-' if self.const < 0 else '+'} {abs(self.const)} >= 0"

    def renamed(self, mapping: dict) -> "Lin | None":
        if any(e not in mapping for e in self.edges()):
            return None
        return Lin.make({mapping[e]: c for e, c in self.coefs}, self.const)


@dataclass(frozen=True)
class Tri:
    """A product's plan: `kind` "zero" (an operand 0 where `rel` fails) or "out" (its
    result needed only where `rel` holds); `rel` over the product's edges."""
    kind: str
    rel: Lin

    def __str__(self) -> str:
        return f"{self.kind} where {self.rel}"


def cond_lin(cond) -> Lin | None:
    """A `Cond` over loop variables as the `Lin` that holds where it does."""
    coefs = {}
    for atom, c in cond.ix.terms:
        if not isinstance(atom, str) or not isinstance(c, int):
            return None
        coefs[atom] = c
    const = cond.ix.const
    if not isinstance(const, int):
        return None
    sign, shift = {">": (1, -1), ">=": (1, 0), "<": (-1, -1), "<=": (-1, 0)}.get(cond.op, (0, 0))
    if sign == 0:
        return None
    return Lin.make({e: sign * c for e, c in coefs.items()}, sign * const + shift)


def var_map(index) -> dict | None:
    """A load's or an out's index as {buffer edge: loop variable} where each buffer
    edge is one loop variable (coefficient 1, no constant); None otherwise."""
    out = {}
    for e, ix in index:
        if ix.const != 0 or len(ix.terms) != 1 or ix.terms[0][1] != 1 or not isinstance(ix.terms[0][0], str):
            return None
        out[e] = ix.terms[0][0]
    return out


class _State:
    """The value of a loop kernel's expression where a relation `rel` (over its loop
    variables) fails (see the module docstring): "Z", "One", ("L", bound), ("K", v), "ord"
    or None."""

    def __init__(self, rel: Lin, facts: dict, env: dict):
        self.rel, self.facts, self.env = rel, facts, env
        self.vars = set(rel.edges())

    def of(self, e):
        if isinstance(e, Const):
            return ("K", e.value)
        if isinstance(e, Load):
            return self.load(e)
        if isinstance(e, Mask):
            if len(e.conds) != 1:
                return None
            lin = cond_lin(e.conds[0])
            if lin == self.rel:
                return "Z"
            if lin is not None and lin == self.rel.negated():
                st = self.of(e.arg)
                return "One" if st == ("K", 1.0) else st
            return None
        if isinstance(e, Add):
            return self.add(e)
        if isinstance(e, Mul):
            states = [self.of(a) for a in e.args]
            if "Z" in states:
                return "Z"
            return "ord" if all(s == "ord" or _known(s) for s in states) else None
        if isinstance(e, Map):
            states = [self.of(a) for a in e.args]
            if e.fn == "exp" and isinstance(states[0], tuple) and states[0][0] == "L":
                return "Z"
            if e.fn in ("mul0", "mul00", "mul") and "Z" in states:
                return "Z"
            if e.fn == "recompute":
                return states[0]
            if e.fn == "where":   # where(c, a, b): a where c is 1, b where it is 0
                c = states[0]
                pick = states[2] if c == "Z" or c == ("K", 0.0) else states[1] if c in ("One", ("K", 1.0)) else None
                if pick == "Z" or pick == ("K", 0.0):
                    return "Z"
                if _known(pick) and pick[1] <= LOW:
                    return ("L", pick[1])
                return pick if isinstance(pick, tuple) and pick[0] == "L" else None
            return "ord" if all(s == "ord" or _known(s) for s in states) else None
        return None

    def load(self, e: Load):
        if e.buf in self.env:
            return self.env[e.buf]
        vm = var_map(e.index)
        used = set()
        for _, ix in e.index:
            used |= {a for a, _ in ix.terms if isinstance(a, str)}
        if vm is not None:
            for fact in self.facts.get(e.buf, ()):
                if fact.renamed(vm) == self.rel:
                    return "Z"
        return None if self.vars <= used else "ord"

    def add(self, e: Add):
        states = [self.of(a) for a in e.args]
        if all(s == "Z" or (_known(s) and s[1] == 0) for s in states):
            return "Z"
        vals = [0.0 if s == "Z" else 1.0 if s == "One" else s[1] if _known(s) else None for s in states]
        if None not in vals and all(float(c).is_integer() and float(v).is_integer() and abs(c) < 2 ** 24
                                    and abs(v) < 2 ** 24 for c, v in zip(e.coefs, vals)):
            total = sum(c * v for c, v in zip(e.coefs, vals))
            if total == 0:
                return "Z"
            if total == 1:
                return "One"
        filled = any(s == "One" and c <= LOW for s, c in zip(states, e.coefs))
        bound = 0.0
        for s, c in zip(states, e.coefs):
            if s == "Z":
                continue
            if s == "One":
                bound += c
            elif _known(s):
                bound += c * s[1]
            elif isinstance(s, tuple) and s[0] == "L" and c >= 1:
                bound += c * s[1]
            elif s == "ord" or (filled and s is None):
                bound += abs(c) * ORDINARY
            else:
                return None
        return ("L", bound) if bound <= LOW else None


def _known(s) -> bool:
    return isinstance(s, tuple) and s[0] == "K"


def _members(k):
    """A loop kernel's loop kernels (itself, or a group's members); None for other kinds."""
    if isinstance(k, LoopKernel):
        return (k,)
    members = getattr(k, "members", None)
    if members is not None and all(isinstance(m, LoopKernel) for m in members):
        return tuple(members)
    return None


def _masks(e, out: set) -> None:
    """The relations (both ways) of every mask in expression `e`."""
    if isinstance(e, Mask):
        if len(e.conds) == 1:
            lin = cond_lin(e.conds[0])
            if lin is not None:
                out.update((lin, lin.negated()))
        _masks(e.arg, out)
    for a in getattr(e, "args", ()):
        _masks(a, out)


def _loads(e, buf: str, out: list) -> None:
    if isinstance(e, Load) and e.buf == buf:
        out.append(e)
    if isinstance(e, Mask):
        _loads(e.arg, buf, out)
    for a in getattr(e, "args", ()):
        _loads(a, buf, out)


def _every_row_admits(rel: Lin, sizes: dict) -> bool:
    """Whether, the sizes of both of `rel`'s edges known, every index of each edge has an
    index of the other that `rel` admits (every row and every column of a causal mask
    sees a key: its max is an admitted score, within the assumption, and exp of a
    rejected score less it is 0; a row that sees none has uniform weights)."""
    (x, cx), (y, cy) = rel.coefs
    nx, ny = sizes.get(x), sizes.get(y)
    if not isinstance(nx, int) or not isinstance(ny, int) or nx < 1 or ny < 1:
        return False
    for (a, ca, na), (cb, nb) in (((x, cx, nx), (cy, ny)), ((y, cy, ny), (cx, nx))):
        best = max(0, cb * (nb - 1))
        if not np.all(ca * np.arange(na) + best + rel.const >= 0):
            return False
    return True


class Analysis:
    """`plans`: id(GemmKernel) -> Tri, for the program `low` and its steps."""

    def __init__(self, low: Lowered):
        self.plans: dict[int, Tri] = {}
        self.program(low, {})

    def program(self, low: Lowered, facts: dict) -> dict:
        """Facts of `low`'s buffers (buffer -> [Lin over its edges], where it is +-0 when
        the relation fails), starting from `facts` (its args'); records the plans of its
        products."""
        facts = {b: list(f) for b, f in facts.items()}
        writers: dict[str, int] = {}
        for k in low.kernels:
            for b in k.writes():
                writers[b] = writers.get(b, 0) + 1
        for k in low.kernels:
            if isinstance(k, StepLoop):
                self.step_loop(low, k, facts, writers)
            elif isinstance(k, GemmKernel):
                self.gemm(low, k, facts)
            else:
                members = _members(k)
                if members is not None:
                    self.loops(low, members, facts, writers)
        return facts

    def step_loop(self, low: Lowered, k: StepLoop, facts: dict, writers: dict) -> None:
        inner = {}
        args = {b.index: name for name, b in k.step.buffers.items() if b.kind == "arg"}
        for i, bind in enumerate(k.args):
            if i >= k.carries and not bind.split and bind.buf in facts and i in args:
                inner[args[i]] = [f for f in facts[bind.buf] if k.edge not in f.edges()]
        out = self.program(k.step, inner)
        outs = {b.index: name for name, b in k.step.buffers.items() if b.kind == "out"}
        for j, bind in enumerate(k.outs):
            if j < k.carries or bind.split or j not in outs or writers.get(bind.buf, 0) != 1:
                continue
            got = out.get(outs[j])
            if got:
                facts[bind.buf] = list(got)

    def loops(self, low: Lowered, members, facts: dict, writers: dict) -> None:
        env_by_rel: dict = {}
        for m in members:
            if m.reduce or m.red or m.epilogue is not None or m.scatter or m.bounds:
                continue
            cands: set = set()
            _masks(m.body, cands)
            vm = var_map(m.index)
            for e in _all_loads(m.body):
                lvm = var_map(e.index)
                if lvm is not None:
                    for f in facts.get(e.buf, ()):
                        r = f.renamed(lvm)
                        if r is not None:
                            cands.add(r)
            for rel in env_by_rel:
                cands.add(rel)
            for rel in sorted(cands, key=lambda r: (r.coefs, r.const)):
                if not set(rel.edges()) <= set(m.loops) or not _every_row_admits(rel, m.sizes):
                    continue
                env = env_by_rel.setdefault(rel, {})
                st = _State(rel, facts, env).of(m.body)
                if st != "Z":
                    continue
                back = {v: e for e, v in (vm or {}).items()}
                fact = rel.renamed(back) if vm is not None else None
                whole = vm is not None and m.out in low.buffers and all(   # it writes every element
                    m.sizes.get(v) == low.size(e) for e, v in vm.items())
                if fact is not None and whole and writers.get(m.out, 0) == 1:
                    facts.setdefault(m.out, []).append(fact)
                else:   # a scratch row of a group: its state, read by later members at the same loop variables
                    env[m.out] = "Z"

    def gemm(self, low: Lowered, k: GemmKernel, facts: dict) -> None:
        if k.taps or k.shifts or k.cplx is not None or any(k.rounded):
            return
        single = {g[0]: name for name, g in (("m", k.m), ("n", k.n), ("k", k.k)) if len(g) == 1}
        for view in (k.a, k.b):
            back = {b: v for v, b in view.edges}
            for f in facts.get(view.buf, ()):
                rel = f.renamed(back)
                if rel is None:
                    continue
                groups = sorted(single.get(e, "") for e in rel.edges())
                if groups in (["k", "m"], ["k", "n"]):
                    self.plans[id(k)] = Tri("zero", rel)
                    return
        out = self.out_plan(low, k, facts)
        if out is not None:
            self.plans[id(k)] = Tri("out", out)

    def out_plan(self, low: Lowered, k: GemmKernel, facts: dict) -> Lin | None:
        """A relation over the product's m and n edges (its only ones) outside which
        every reader of its result ignores it (see the module docstring)."""
        buf = low.buffers.get(k.out)
        if (buf is None or buf.kind != "temp" or buf.alias is not None or k.acc or k.epilogue or k.prefix
                or len(k.m) != 1 or len(k.n) != 1):
            return None
        readers = [r for r in low.kernels if r is not k and k.out in r.buffers_read()]
        if not readers or any(r is k or k.out in getattr(r, "writes", lambda: set())() for r in readers):
            return None
        members = []
        for r in readers:
            ms = _members(r)
            if ms is None:
                return None
            members += [m for m in ms if k.out in m.buffers_read()]
        to_product = {k.out_edge(e): e for e in k.out_edges()}
        cands = []
        for m in members:
            loads: list = []
            _loads(m.body, k.out, loads)
            maps = {tuple(sorted((var_map(ld.index) or {}).items())) for ld in loads}
            if len(maps) != 1 or not next(iter(maps)) or var_map(loads[0].index) is None:
                return None
            rels: set = set()
            _masks(m.body, rels)
            for ld in _all_loads(m.body):
                lvm = var_map(ld.index)
                if lvm is not None:
                    rels.update(r for r in (f.renamed(lvm) for f in facts.get(ld.buf, ())) if r is not None)
            inv = {v: e for e, v in var_map(loads[0].index).items()}
            for rel in rels:
                on_buf = rel.renamed(inv)
                if on_buf is not None and on_buf not in cands:
                    cands.append(on_buf)
        for rel in cands:
            prod = rel.renamed(to_product)
            if prod is None or sorted(prod.edges()) != sorted(k.m + k.n):
                continue
            if all(self.ignores(m, k.out, rel, facts) for m in members):
                return prod
        return None

    def ignores(self, m: LoopKernel, buf: str, rel: Lin, facts: dict) -> bool:
        """Whether member `m`'s value does not depend on `buf` where `rel` (over buf's
        edges) fails."""
        if m.epilogue is not None or m.scatter or m.bounds:
            return False
        loads: list = []
        _loads(m.body, buf, loads)
        here = rel.renamed(var_map(loads[0].index))
        if here is None or not _every_row_admits(here, m.sizes):
            return False
        st = _State(here, facts, {}).of(m.body)
        red = set(m.red) & set(here.edges())
        if not m.reduce:
            return st == "Z"
        if m.reduce == "sum":
            return st == "Z"
        return m.reduce in ("max", "maxshift", "logsumexp") and isinstance(st, tuple) and st[0] == "L" and len(red) == 1


def _all_loads(e):
    if isinstance(e, Load):
        yield e
    if isinstance(e, Mask):
        yield from _all_loads(e.arg)
    for a in getattr(e, "args", ()):
        yield from _all_loads(a)
