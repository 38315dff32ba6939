"""Canonical edge names inside a contraction (for `tgc.opt.canon`).

A contraction's kept edges are its result's; its summed edges are internal, and
their names must not matter: two contractions that differ only by a consistent
renaming of summed edges must come out as the same value. So every edge gets a
*working name*, the name it is computed under:

- a kept edge: the name a dense operand carries it under natively (so renames
  move out of the contraction, onto its result), else its own name;
- a summed edge: a dense operand's native name, else the first free one of
  `stem`, `stem.1`, `stem.2`, ... with the stem that native's, or (an edge that
  joins indicators only, which absorb renames) the name of the edge's dim.

Summed edges are named in an order that does not depend on their names: by a
signature refined from how they join the operands (Weisfeiler-Lehman colour
refinement over the operands' structural keys and relations), names breaking
only the ties that structure cannot. A tie is broken in the order the names are
handed out (`name_order`: `k.2` before `k.10`), so naming a product named before
gives it back its own names (idempotent): in the string order, a tie of eleven or
more edges of one stem (the links of a chain of matrix products, which a few rounds
cannot tell apart) came out permuted on every rebuild, and `rewrite` rebuilt such a
product MAX_STEPS times. Terminates: a fixed number of rounds.
"""
from __future__ import annotations

import hashlib
from typing import Callable

from tgc.ir.module import Module
from tgc.ir.values import Value

Fresh = Callable[[str, set[str]], str]
ROUNDS = 4


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class _Factor:
    def __init__(self, f: Value, base_of):
        self.f = f
        self.base, self.mp = base_of(f)
        self.inv = {d: s for s, d in self.mp.items()}
        self.dense = f.op != "indicator"
        self._pairs = None

    def native(self, e: str) -> str:
        return self.inv.get(e, e)

    def role(self, e: str, label, key_of) -> str:
        """How `e` joins this factor, every other edge by its label."""
        if not self.dense:
            names = {x: ("@" if x == e else label(x)) for x in self.f.edges}
            return "I" + str(self.f.attrs[0].renamed(names))
        if self._pairs is None:  # the base's edges (sorted) with their outer names, and its key
            self._pairs = sorted((n, self.mp.get(n, n)) for n in self.base.edges), key_of(self.base)
        pairs, key = self._pairs
        body = ",".join(f"{n}={'@' if o == e else label(o)}" for n, o in pairs)
        return f"{key}:{body}"


def name_order(e: str) -> tuple:
    """The order `fresh` hands names out in: `stem`, `stem.1`, ..., `stem.9`, `stem.10`
    (the string order, but a longer suffix of one stem after a shorter one)."""
    stem, _, suffix = e.partition(".")
    return stem, len(suffix), suffix


def working_names(m: Module, factors: list[Value], keep: set[str], base_of, key_of, fresh: Fresh) -> dict[str, str]:
    """outer edge -> the (distinct) name it is computed under."""
    info = [_Factor(f, base_of) for f in factors]
    carriers: dict[str, list[_Factor]] = {}
    for x in info:
        for e in x.f.edges:
            carriers.setdefault(e, []).append(x)
    taken = set(keep) - set(carriers)
    work: dict[str, str] = {}
    summed = [e for e in carriers if e not in keep]
    # the order of one summed edge (or none) needs no signature
    sig = _signatures(m, carriers, keep, summed, key_of) if len(summed) > 1 else {}
    for e in sorted((e for e in carriers if e in keep)) + sorted(summed, key=lambda e: (sig.get(e, ""), name_order(e))):
        natives = [x.native(e) for x in sorted((x for x in carriers[e] if x.dense), key=lambda x: key_of(x.base))]
        own = [e] if e in keep else []
        choice = next((n for n in natives + own if n not in taken), None)
        if choice is None:  # named after a native (invariant), else after the edge's dim
            choice = fresh(natives[0] if natives else (e if e in keep else m.edges[e]), taken)
        work[e] = choice
        taken.add(work[e])
    return work


def _signatures(m: Module, carriers, keep: set[str], summed: list[str], key_of) -> dict[str, str]:
    sig = {e: m.edges[e] for e in summed}

    def label(x: str) -> str:
        return x if x in keep else "#" + sig[x]
    for _ in range(min(ROUNDS, len(summed))):
        sig = {e: _digest(sig[e] + "|" + "|".join(sorted(x.role(e, label, key_of) for x in carriers[e])))
               for e in summed}
    return sig
