"""simplify: exact algebra on the canonical form (the rules of `tgc.opt.rules`).

Rewrites, besides everything `normalize` does:
- indicators and deltas: a delta summed over one edge is a rename; two reindexes
  compose into one relation by eliminating the edge they share; an indicator that
  always (never) holds is 1 (0); [R] [R] = [R];
- constants and identities: x*1, x+0, x*0 = 0 (LANGUAGE.md section 8), mul0(0, y) = 0,
  where(1, a, b) = a, x^0, x^1, small integer powers as products, a/k as a scaling,
  quotients as products with reciprocals once no derivative is left (`quotients`
  makes them divisions again at the end of the pipeline), x (1/x) = 1 for x > 0;
- the guards derivatives carry, once provably unneeded: mul0(a, b) = a b when b is
  finite, mul00(a, b) = mul0(a, b) when a is, where(c, a, 0) = a when a vanishes
  with c;
- exp(log x), log(exp x), sqrt(x) sqrt(x), x^a x^b, max(x, x), max(0, x) for x >= 0;
- like terms collected, and `stop` dropped once no derivative is left to take;
- dead code (nothing unreachable is visited).

Terminates: canonical rebuilding terminates, and every rule strictly decreases the
measure stated in `tgc.opt.rules` (ops removed, or replaced by lower-ranked ones).
"""
from __future__ import annotations

from dataclasses import dataclass

from tgc.ir.module import Module
from tgc.options import Options
from tgc.ir.passes import Pass
from tgc.opt.rewrite import rewrite
from tgc.opt.rules import SIMPLIFY


@dataclass(frozen=True)
class Simplify(Pass):
    """Exact algebra: indicators/deltas, constants, guards, like terms, dead code."""

    name = "simplify"

    def run(self, module: Module, options: Options) -> Module:
        return rewrite(module, SIMPLIFY, options)
