"""The reverse loop of a GELU MLP keeps the pre-activation u and t = tanh(..) of it,
not `0.5 + 0.5 * t`: that cheap function of t is recomputed in the backward step
(`tgc.autodiff.remat.recompute_cheap`) instead of being stacked by the forward loop.
The plan (what the forward loop stacks, what the backward step recomputes, with the
rule and without), values against the unrolled program, and examples/gpt2.tg's
compiled step against the same step built without the rule (f64 and f32: the same
values up to rounding; not bit for bit, as `normalize` sorts the terms of the
derivative's sum by their structure, which the recomputed copy changes)."""
from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc.autodiff import loops, remat

from layer_programs import MLP_OUTS, MLP_PARAMS, assert_loop_is_the_unrolled_program, layer_stack, loop_kept, mlp_head

N = 3


def program(loop: bool = True) -> str:
    return layer_stack(mlp_head(b=2, t=4, c=8, ff=16), MLP_OUTS, N, MLP_PARAMS, loop)


optimized = loop_kept


def inputs(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"x": (2, 4, 8), "wfc": (N, 8, 16), "bfc": (N, 16), "wproj": (N, 16, 8)}
    return {k: rng.standard_normal(s) * 0.5 for k, s in shapes.items()}


def _fresh():
    """Forget the loop derivatives built so far (their caches), so the next are built anew."""
    loops._plan.cache_clear()
    loops._backward.cache_clear()


@pytest.fixture
def without_rule(monkeypatch):
    """The rule off (no expression is cheap enough), the step plans built again."""
    monkeypatch.setattr(remat, "CHEAP_OPS", -1)
    _fresh()
    yield
    _fresh()


def _loops(m):
    forward = [v for v in m.values() if v.op == "loop" and not v.attrs[2]]
    backward = [v for v in m.values() if v.op == "loop" and v.attrs[2]]
    assert forward and backward, "the layer loop was unrolled"
    return forward[0].attrs[0], backward[0].attrs[0]


def _ff_stacked(body):
    return sorted((r.op, r.attrs[0] if r.op == "map" else "") for r in body.results[body.carries:]
                  if "ff" in r.edges and "c" not in r.edges)


def _maps(body):
    from tgc.ir.values import topo_order
    return sorted(v.attrs[0] for v in topo_order(body.results) if v.op == "map")


def test_the_forward_loop_stacks_the_pre_activation_and_tanh_only():
    forward, backward = _loops(optimized(program()))
    assert _ff_stacked(forward) == [("add", ""), ("map", "tanh")]   # h @ wfc + bfc and tanh(..), not 0.5 + 0.5 t
    maps = _maps(backward)
    assert "tanh" not in maps and maps.count("recompute") == 1       # 0.5 + 0.5 t again, from the kept t


def test_without_the_rule_it_stacks_tanh_and_its_affine_function_too(without_rule):
    forward, backward = _loops(optimized(program()))
    assert _ff_stacked(forward) == [("add", ""), ("add", ""), ("map", "tanh")]
    assert "tanh" not in _maps(backward)


def test_gradients_match_the_unrolled_program():
    assert_loop_is_the_unrolled_program(program, inputs())


GPT2 = Path(__file__).resolve().parents[2] / "examples" / "gpt2.tg"
REDUCED = {"layer": 2, "head": 2, "hd": 16, "t": 16, "vocab": 50, "batch": 3}


def _gpt2_step(dtype: str) -> tuple[str, dict[str, np.ndarray]]:
    """One compiled AdamW step of examples/gpt2.tg: its lowered program's text, and its
    loss and every updated array."""
    program = tgc.compile(GPT2, dtype=dtype, dims=REDUCED)
    rng = np.random.default_rng(0)
    args = program.init_state(REDUCED)
    for spec in program.inputs:
        if spec.kind == "param":
            args[spec.name] = (0.3 * rng.standard_normal(spec.shape)).astype(args["step"].dtype)
    tokens = rng.integers(0, REDUCED["vocab"], (REDUCED["batch"], REDUCED["t"] + 1)).astype(np.int32)
    args.update(ids=tokens[:, :-1].copy(), targets=tokens[:, 1:].copy(),
                lr=np.asarray(1e-2, args["step"].dtype), wd=np.asarray(0.1, args["step"].dtype))
    loss = program(**args)["loss"]
    return str(program.lowered), {"loss": np.asarray(loss), **{k: v for k, v in args.items() if k not in ("ids", "targets")}}


@pytest.mark.slow
@pytest.mark.parametrize("dtype, rtol", [("f64", 1e-11), ("f32", 2e-4)])
def test_gpt2_step_is_the_one_without_the_rule(monkeypatch, dtype, rtol):
    monkeypatch.setenv("TGC_CACHE", "off")
    _fresh()
    program, got = _gpt2_step(dtype)
    monkeypatch.setattr(remat, "CHEAP_OPS", -1)
    _fresh()
    without, want = _gpt2_step(dtype)
    _fresh()
    assert program != without, "the two builds are one: the rule was not off"
    assert got.keys() == want.keys()
    for k in want:
        scale = max(np.abs(want[k]).max(), 1e-6)   # bk's gradient is 0 up to rounding (softmax's shift invariance)
        atol = rtol * scale
        if dtype == "f32" and k != "loss" and not k.startswith(("m.", "v.")) and k != "step":
            # ... 9e-10 in f32 (bq's 3e-3), which AdamW's first step turns into up to
            # lr g / (|g| + 1e-8) = 0.08 lr: the builds' bk agree to that noise only.
            # So does any param with a gradient element near its rounding (wk: 3e-4 of
            # its largest value with the layernorm's normalized rows recomputed, within
            # 0.04 lr); the moments m and v, compared at rtol, hold the gradients. bk's
            # gradient is all rounding: its first update is anything up to lr (|m^| <=
            # sqrt(v^)): 0.13 lr apart with the normalized rows recomputed.
            atol = (2.0 if k == "bk" else 0.1) * 1e-2
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=atol, err_msg=k)
