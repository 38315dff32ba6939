"""A layer loop's layernorm keeps the centered rows and their standard deviation, not
also the normalized rows `(x - mean) * (1 / std)`: that cheap function of one kept
value of its own edges and of a kept row statistic (broadcast over the rows' width) is
recomputed in the backward step (`tgc.autodiff.remat.recompute_cheap`, a boundary
value over fewer edges) instead of being stacked by the forward loop. The plan (what
the forward loop stacks, with the rule and with main's rule, which took one kept
value of k's own edges only), the gradients against the unrolled program, and the
bytes nanoGPT-char's step moves."""
import pytest

from tgc.autodiff import loops, remat
from tgc.ir.values import topo_order

from layer_programs import assert_loop_is_the_unrolled_program, layer_stack, loop_kept

import numpy as np

N = 3
PARAMS = ("w", "b", "wfc", "wproj")
HEAD = ("dim layer = {n}, r = 4, c = 8, ff = 16\n"
        "input x[r, c]\n"
        "param w[layer, c], b[layer, c], wfc[layer, c, ff], wproj[layer, ff, c]\n"
        "fn block(h, w, b, wfc, wproj) = h + tanh(layernorm[c](h, w, b) @ wfc) @ wproj\n")
OUTS = """\
loss = sum(y * y)
out loss
out gw = grad(loss, w)
out gb = grad(loss, b)
out gfc = grad(loss, wfc)
out gproj = grad(loss, wproj)
out gx = grad(loss, x)
"""


def program(loop: bool = True) -> str:
    return layer_stack(HEAD, OUTS, N, PARAMS, loop)


def _fresh():
    loops._plan.cache_clear()
    loops._backward.cache_clear()


def _stacked(module):
    """(op, edges) of each value the forward loop stacks (its results after the carries)."""
    forward = next(v for v in module.values() if v.op == "loop" and not v.attrs[2]).attrs[0]
    return sorted((r.op, tuple(sorted(r.edges))) for r in forward.results[forward.carries:])


def _one_boundary(k, stored, in_graph):
    """main's rule: every stored value the expression reaches has k's own edges."""
    region = _RULE(k, stored, in_graph)
    if region is None:
        return None
    reached = {id(o) for v in region for o in v.operands if id(o) in stored and o is not k}
    by_id = {id(o): o for v in region for o in v.operands}
    return region if all(by_id[i].edges == k.edges for i in reached) else None


_RULE = remat._cheap_region


@pytest.fixture
def main_rule(monkeypatch):
    monkeypatch.setattr(remat, "_cheap_region", _one_boundary)
    _fresh()
    yield
    _fresh()


def test_the_forward_loop_stacks_the_centered_rows_not_the_normalized_ones():
    _fresh()
    stacked = _stacked(loop_kept(program()))
    rows = [s for s in stacked if s[1] == ("c", "r")]
    # golden: the centered rows x - mean (an add), the layernorm's output (the product's
    # operand) and the block's pre-activation: not the normalized rows (a contract)
    assert rows == [("add", ("c", "r")), ("add", ("c", "r"))], stacked
    assert ("map", ("r",)) in stacked   # the standard deviation, sqrt(..), kept for both


def test_main_rule_stacked_the_normalized_rows_too(main_rule):
    stacked = _stacked(loop_kept(program()))
    rows = [s for s in stacked if s[1] == ("c", "r")]
    assert rows == [("add", ("c", "r")), ("add", ("c", "r")), ("contract", ("c", "r"))], stacked


def inputs(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"x": (4, 8), "w": (N, 8), "b": (N, 8), "wfc": (N, 8, 16), "wproj": (N, 16, 8)}
    return {k: rng.standard_normal(s) * 0.5 + (1.0 if k == "w" else 0.0) for k, s in shapes.items()}


def test_gradients_match_the_unrolled_program():
    _fresh()
    assert_loop_is_the_unrolled_program(program, inputs())
