"""normalize: canonical form and hash-consing (CSE), renaming-aware.

Rewrites: each live value is rebuilt bottom-up from its (already canonical) operands
through the canonical builders of `tgc.opt.canon`:

- adds flattened (coefficients merged), like terms collected, constants folded,
  `x + 0` and zero-coefficient terms dropped;
- product contractions merged into one n-ary contraction (summed edges renamed
  apart), constant factors folded into a coefficient, `contract(x)` over x's own
  edges dropped. Merging (of sums and of products) is for values with one user
  only, and waits until no grad/jvp/vjp is left: a shared value merged into its
  users would be recomputed in each, and one merged before differentiation would
  hide an intermediate the derivative program shares (e.g. q = x @ Wq, needed by
  the scores and by the gradient of Wk);
- renames composed, dropped when the identity, absorbed by constants and
  indicators, and pulled out of elementwise ops and reductions; every contraction
  computes under its operands' native edge names, so values equal up to a
  consistent renaming of summed edges are one value;
- commutative operands sorted by a structural key (no `id()`, no hash seed);
- static `size(e)` folded to a constant.

The builders of `tgc.ir.values` intern what they build, so structurally equal values
become one value; values no output or update reaches are dropped, and so are the
generated edges (`stem.k`) nothing uses any more.

Terminates: one visit per value of the finite DAG; each builder only ever removes
nesting (adds in adds, contractions in contractions, renames under ops), which
bounds the rebuilding it does for one value.
"""
from __future__ import annotations

from dataclasses import dataclass

from tgc.ir.module import Module
from tgc.options import Options
from tgc.ir.passes import Pass
from tgc.opt.rewrite import rewrite


@dataclass(frozen=True)
class Normalize(Pass):
    """Canonical form: flatten, fold, sort, rename-aware hash-consing (CSE)."""

    name = "normalize"

    def run(self, module: Module, options: Options) -> Module:
        return rewrite(module, {}, options)
