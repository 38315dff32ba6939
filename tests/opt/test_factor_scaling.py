"""`factor` takes work about linear in the length of a chain of steps under a gradient.

Counted, not timed: the products `factor` builds (`Canon.contract` calls while it runs).
The gradient of `v_i = tanh(v_{i-1}) * 0.5 + x` over n steps reaches `factor` as one sum
of n terms whose common factors nest (groups of ~31 steps, `rewrite.MERGE_MOST`).
Un-distribution takes one group out per rewrite of the sum, and the rewritten sum weighs
the groups it keeps again: each weighing rebuilt the group's products (the same values,
hash-consed), so the work grew with n times the number of groups (the whole compile
took 15 s of CPU at n = 800, 12 of them in `factor`). The groups built and weighed are
now memoized (`factor._undistributed`), which changes no result.
"""
from __future__ import annotations

from tgc.opt import factor as F
from tgc.opt.canon import Canon
from tgc.pipeline import load_source, lower


def chain(n: int) -> str:
    lines = ["dim n = 4", "input x[n]", "v0 = x"]
    lines += [f"v{i} = tanh(v{i - 1}) * 0.5 + x" for i in range(1, n)]
    lines += [f"out y = sum(v{n - 1})", f"out g = grad(sum(v{n - 1}), x)"]
    return "\n".join(lines) + "\n"


def factor_products(n: int, monkeypatch) -> int:
    """`Canon.contract` calls during the `factor` pass of the chain of n steps."""
    count, inside = [0], [False]
    real_run, real_contract = F.Factor.run, Canon.contract

    def run(self, module, options):
        inside[0] = True
        try:
            return real_run(self, module, options)
        finally:
            inside[0] = False

    def contract(self, *args, **kwargs):
        count[0] += inside[0]
        return real_contract(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(F.Factor, "run", run)
        m.setattr(Canon, "contract", contract)
        src = load_source(chain(n), "cpu", "f32", lookup=False)
        lower(src.module, src.options, backend="cpu")
    return count[0]


def test_factor_builds_products_linear_in_the_chain(monkeypatch):
    p64, p256 = (factor_products(n, monkeypatch) for n in (64, 256))
    assert p64 > 1000, p64   # the pass does build the Horner form of the gradient
    # 4x the steps: about 4x the products (6,926 -> 28,664; rebuilding each kept group
    # per rewrite: 7,154 -> 35,552, 5.0x, the ratio growing with n)
    assert p256 <= 4.4 * p64, (p64, p256)
