"""The lowering stages (fuse, layout, group, plan) read like their dumps: what is fused,
what goes to BLAS, how indicators become index arithmetic, which buffers share
workspace. Numbers are checked in test_cpu_codegen.py; these check the shape.
"""
from __future__ import annotations

import re

import pytest

from tgc.lower.lowered import GemmKernel, LoopKernel, print_lowered
from tgc.ir.parser import parse_module
from tgc.options import Options
from tgc.pipeline import lower_module


def lower(text: str, stop_after: str = "plan", **opts):
    return lower_module(parse_module(text), Options(dtype="f32").with_(**opts), stop_after=stop_after)


def kernel_lines(low) -> list[str]:
    return [line for line in print_lowered(low).splitlines() if re.match(r"k\d+:", line)]


SOFTMAX = """
dim b
dim n = 64
input x : f32[b, n]
%0 = reduce[max: n] %x : f32[b]
%1 = add[1.0, -1.0] %x, %0 : f32[b, n]
%2 = map[exp] %1 : f32[b, n]
%3 = contract %2 : f32[b]
%4 = map[div] %2, %3 : f32[b, n]
out p = %4 : [b, n]
"""


def test_softmax_is_three_passes_over_x():
    lines = kernel_lines(lower(SOFTMAX, group_blocks=0))
    assert len(lines) == 3
    assert "max[n] %x[b, n]" in lines[0]
    assert "sum[n] exp(add[1.0, -1.0](%x[b, n]" in lines[1]
    assert lines[2].startswith("k2: loop %p[b, n] = div(exp(")


def test_softmax_passes_run_per_row_with_max_and_sum_in_registers():
    low = lower(SOFTMAX)
    assert kernel_lines(low) == ["k0: group for b < b  reg %t2[b], %t3[b]"]
    assert not [b for b in low.buffers.values() if b.kind == "temp"]


def test_reduction_epilogue_is_fused():
    low = lower("""
dim b
dim n = 64
input x : f32[b, n]
%0 = contract %x : f32[b]
%1 = size[n] : f32[]
%2 = map[div] %0, %1 : f32[b]
%3 = map[sqrt] %2 : f32[b]
out y = %3 : [b]
""")
    (k,) = low.kernels
    assert k.reduce == "sum" and k.epilogue is not None
    assert "sqrt(div(acc, size(64)))" in print_lowered(low)


def test_dense_matmul_goes_to_blas_with_transpose_flags_not_copies():
    low = lower("""
dim i
dim j = 96
dim k = 80
input A : f32[k, i]
input B : f32[j, k]
%0 = contract %A, %B : f32[i, j]
out C = %0 : [j, i]
""")
    assert [type(k) for k in low.kernels] == [GemmKernel]
    assert not [b for b in low.buffers.values() if b.kind == "temp"]


def test_small_matmul_with_known_sizes_becomes_a_loop():
    low = lower("""
dim i = 4
dim j = 4
dim k = 4
input A : f32[i, k]
input B : f32[k, j]
%0 = contract %A, %B : f32[i, j]
out C = %0 : [i, j]
""")
    (k,) = low.kernels
    assert isinstance(k, LoopKernel) and k.red == ("k",)


def test_reindex_is_substitution_not_a_dense_indicator():
    low = lower("""
dim t = 32
dim s = 15
dim k = 3
input x : f32[t]
%0 = indicator[t = 2*s + k - 1] : f32[k, s, t]
%1 = contract %x, %0 : f32[k, s]
out y = %1 : [s, k]
""")
    text = print_lowered(low)
    assert "%x[k + 2*s - 1]" in text
    assert "mask[k + 2*s - 1 >= 0]" in text  # the upper end always holds
    assert all(set(b.edges) != {"k", "s", "t"} for b in low.buffers.values())


def test_merge_becomes_division_and_split_needs_no_mask():
    text = print_lowered(lower("""
dim c = 12
dim h = 3
dim e = 4
edge c2 : c
input x : f32[c]
input y : f32[h, e]
%0 = indicator[c = 4*h + e] : f32[c, e, h]
%1 = contract %x, %0 : f32[e, h]
%2 = indicator[c2 = 4*h + e] : f32[c2, e, h]
%3 = contract %y, %2 : f32[c2]
out split = %1 : [h, e]
out merged = %3 : [c2]
"""))
    assert "%split[e, h] = %x[e + 4*h]" in text
    assert "%y[c2 - 4*floor((c2) / 4), floor((c2) / 4)]" in text
    assert "mask" not in text


def test_causal_mask_bounds_a_summed_loop():
    text = print_lowered(lower("""
dim s = 64
edge t : s
input q : f32[s]
input k : f32[t]
%0 = indicator[s <= t] : f32[s, t]
%1 = contract %q, %k, %0 : f32[t]
out y = %1 : [t]
"""))
    assert "mask" not in text
    assert "s in [max(0), min(64, t + 1))" in text


def test_update_written_in_place_and_slots_reused():
    low = lower("""
dim n
param W : f32[n]
input g : f32[n]
input lr : f32[]
%0 = map[tanh] %g : f32[n]
%1 = contract %0, %lr : f32[n]
%2 = add[1.0, -1.0] %W, %1 : f32[n]
update W = %2
""")
    (k,) = low.kernels
    assert k.out == "W"
    assert not low.slots


ADAM_MLP = """
dim batch
dim features = 13, hidden = 16, classes = 3
input  x[batch, features]
input  y[batch, classes]
param  W1[features, hidden], W2[hidden, classes]
state  m1[features, hidden], v1[features, hidden]
input  lr, c1, c2
loss = mean[batch](cross_entropy[classes](relu(x @ W1) @ W2, y))
out loss
g = grad(loss, W1)
update m1 = 0.9 * m1 + 0.1 * g
update v1 = 0.999 * v1 + 0.001 * g * g
update W1 = W1 - lr * c1 * (0.9 * m1 + 0.1 * g) / (sqrt(c2 * (0.999 * v1 + 0.001 * g * g)) + 1e-8) - 0.01 * lr * W1
update W2 = W2 - lr * grad(loss, W2)
"""


def test_adam_moments_and_parameter_are_written_in_place_by_their_group():
    """AdamW's moments and parameter update are one elementwise group, whose members
    read the old values at the elements they write: each writes its target directly,
    with no temporary and no copy back; the values are the interpreter's."""
    import numpy as np

    import tgc
    from tgc.ir.interp import evaluate
    from tgc.ir.inputs import random_inputs
    from tgc.backends.cpu.group import LoopGroup

    prog = tgc.compile(ADAM_MLP, dtype="f64")
    # the gradient GEMM's epilogue (tgc.lower.epilogue), or a group when the CPU writes it out
    gemm = next(k for k in prog.lowered.kernels if isinstance(k, GemmKernel) and
                {o.buf for o in k.epilogue} >= {"m1", "v1", "W1"})
    assert [o.buf for o in gemm.epilogue] == ["m1", "v1", "W1"]
    loops = tgc.compile(ADAM_MLP, dtype="f64", options=tgc.Options(dtype="f64").with_(gemm_epilogue=False))
    group = next(k for k in loops.lowered.kernels if isinstance(k, LoopGroup) and
                 {m.out for m in k.members} >= {"m1", "v1", "W1"})
    assert [m.out for m in group.members] == ["m1", "v1", "W1"]
    copies = [k for k in loops.lowered.kernels if isinstance(k, LoopKernel) and k.note.startswith("update")]
    assert {k.out for k in copies} <= {"W2"}
    copies = [k for k in prog.lowered.kernels if isinstance(k, LoopKernel) and k.note.startswith("update")]
    assert {k.out for k in copies} <= {"W2"}
    m = prog.module
    for seed in range(3):
        x = random_inputs(m, m.bind_dims({"batch": 29}), seed, "f64")
        want = evaluate(m, {k: np.copy(v) for k, v in x.items()}, dtype="f64")
        got = prog(**{k: np.copy(v) for k, v in x.items()})
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-10, atol=1e-12, err_msg=k)


def test_liveness_shares_slots():
    low = lower("""
dim b
dim n = 64
input x : f32[b, n]
%0 = map[exp] %x : f32[b, n]
%1 = reduce[max: n] %0 : f32[b]
%2 = add[1.0, -1.0] %0, %1 : f32[b, n]
%3 = map[tanh] %2 : f32[b, n]
%4 = reduce[min: n] %3 : f32[b]
%5 = add[1.0, -1.0] %3, %4 : f32[b, n]
%6 = map[log] %5 : f32[b, n]
%7 = contract %6, %6 : f32[b]
out y = %7 : [b]
""", group_blocks=0)
    temps = [b for b in low.buffers.values() if b.kind == "temp"]
    assert len({b.slot for b in temps}) < len(temps)


def test_gather_is_an_indexed_load_with_a_check():
    low = lower("""
dim b
dim v = 100
dim d = 8
input ids : i32[b]
input E : f32[v, d]
%0 = gather[v] %E, %ids : f32[b, d]
%1 = map[exp] %0 : f32[b, d]
out y = %1 : [b, d]
""")
    text = print_lowered(low)
    assert "exp(%E[d, %ids[b]])" in text
    assert "check 0 <= %ids < 100" in text


def test_stages_print_after_each():
    seen = []
    lower_module(parse_module(SOFTMAX), Options(print_ir_after_all=True),
                 emit=lambda banner, text: seen.append((banner, text)))
    assert [b for b, _ in seen] == ["IR after emulate_low", "IR after without_rules", "IR after fuse",
                                    "IR after layout", "IR after narrow",
                                    "IR after gemm_operands", "IR after implicit", "IR after accumulate", "IR after unsplit",
                                    "IR after epilogue",
                                    "IR after alias", "IR after pieces", "IR after group",
                                    "IR after plan"]
    assert seen[0][1].startswith("dim ")   # emulate_low and without_rules: still the IR module
    stages = dict(seen)
    temps = lambda text: [l for l in text.splitlines() if l.startswith("buffer") and " temp" in l]
    fused = temps(stages["IR after fuse"])
    assert fused and all("order" not in l for l in fused)  # fuse: no layout yet
    assert all("order" in l and "slot" not in l for l in temps(stages["IR after layout"]))
    assert all("slot" in l for l in temps(stages["IR after plan"]))


HEADS_THEN_WEIGHT_GRADIENT = """
dim b
dim head = 3, hd = 4, t = 5, c = 6
dim s = t
input p[b, head, s, t]
input v[b, head, hd, s]
input x[b, t, c]
d = sum[s](p * v)
out w[head, hd, c] = sum[b, t](d * x)
"""


def test_a_gemm_result_is_written_as_the_gemm_reading_it_wants():
    """A product batched over (b, head) feeds one that sums over (b, t) with rows
    (head, hd): the first writes its result in that order (strided rows), so no
    transposing copy sits between them (GPT's attention had 17)."""
    import numpy as np

    import tgc
    from tgc.ir.interp import evaluate
    from tgc.ir.inputs import random_inputs

    prog = tgc.compile(HEADS_THEN_WEIGHT_GRADIENT, dtype="f64")
    gemms = [k for k in prog.lowered.kernels if isinstance(k, GemmKernel)]
    assert len(gemms) == 2
    assert not [k for k in prog.lowered.kernels if "transposing copy" in k.text()]
    m = prog.module
    x = random_inputs(m, {**m.dims, "b": 7}, 0, "f64")
    np.testing.assert_allclose(prog(**x)["w"], evaluate(m, dict(x), dtype="f64")["w"], rtol=1e-12)


HEAD_PROJECTION = """
dim b
dim t = 11, c = 48, head = 3, hd = c / head
input x[b, t, c]
input wq[c, c2: c]
q = x @ wq
out y[b, t, head, hd] = q[c2 = hd*head + hd]
"""


@pytest.mark.parametrize("alias", [True, False])
def test_a_weight_split_into_heads_is_copied_once_for_one_plain_gemm(alias):
    """`wq[c, c2 -> hd + 16*head]` only splits c2 into (head, hd): the projection is one
    GEMM over all heads (n = head, hd), not a loop of GEMMs on views shifted by 16*head.
    Its operand is the weight split into those edges: without the `alias` stage a loop
    kernel copies it once; with it (the CPU's default) the split is a view of the
    weight's bytes (`tgc.lower.alias`), no copy."""
    import numpy as np

    import tgc
    from tgc.backends.base import get_backend
    from tgc.ir.interp import evaluate
    from tgc.ir.inputs import random_inputs

    stages = tuple(s for s in get_backend("cpu").lowering() if alias or s != "alias")
    prog = tgc.compile(HEAD_PROJECTION, dtype="f64", options=Options(dtype="f64", stages=stages))
    (gemm,) = [k for k in prog.lowered.kernels if isinstance(k, GemmKernel)]
    assert not gemm.shifts and not gemm.batch
    assert set(gemm.n) == {"head", "hd"} or set(gemm.m) == {"head", "hd"}
    copies = [k for k in prog.lowered.kernels if isinstance(k, LoopKernel) and "16*head" in k.text()]
    views = [b for b in prog.lowered.buffers.values() if b.alias == "wq"]
    assert (len(copies), len(views)) == ((0, 1) if alias else (1, 0))
    m = prog.module
    x = random_inputs(m, {**m.dims, "b": 5}, 0, "f64")
    np.testing.assert_allclose(prog(**x)["y"], evaluate(m, dict(x), dtype="f64")["y"], rtol=1e-12)


def test_a_true_shift_stays_a_loop_of_gemms_on_shifted_views():
    """A convolution's x[s + k - 2] is not a split (indices run off the ends): it keeps
    the shifted-view GEMMs, with no copy of x."""
    import tgc

    prog = tgc.compile("""
dim b = 8, n = 1024, cin = 64, cout = 64, klen = 5
input x[b, cin, t: n]
input dy[b, cout, s: n]
input K[cout, cin, k: klen]
y = x[t = s + k - 2] @ K
out y[b, cout, s]
""", dtype="f64")
    (gemm,) = [k for k in prog.lowered.kernels if isinstance(k, GemmKernel)]
    assert gemm.shifts


GEMM_THEN_GATE = """
dim b, t = 8, c = 16, f = 96
input x[b, t, c], w[c, f], h[b, t, f], w2[f, c2: c]
u = x @ w
out y[b, t, c2] = (u * h) @ w2
"""


def test_a_gemm_result_read_with_saved_values_follows_their_order():
    """A GELU's backward pass: a product `u` (its M, f, the larger group, so it would
    be written f-major) is multiplied by a value whose order is fixed (`h`, an
    argument, f innermost) into a temporary that the next product reads. That
    temporary has no order yet when `u`'s is chosen, so `u` follows the argument's:
    the elementwise loop then runs along f in all three buffers, with no strided
    read (nanoGPT's `dgelu` loop: 4.95% -> 1.13% of its step)."""
    import numpy as np

    import tgc
    from tgc.ir.interp import evaluate
    from tgc.ir.inputs import random_inputs

    for dtype, rtol in (("f64", 1e-12), ("f32", 1e-5)):
        prog = tgc.compile(GEMM_THEN_GATE, dtype=dtype, dims={"b": 4})
        text = print_lowered(prog.lowered)
        # the elementwise product runs in the GEMM's epilogue (tgc.lower.epilogue), along f in every buffer
        assert "\n      then %t6[b, f, t] = mul(%h[b, f, t], acc)\nk1: gemm %y" in text
        # ... which stores the product straight into %t6, laid out as %h (the product's %t5 is gone)
        assert f"buffer %t6 : {dtype}[b, f, t] temp order [b, t, f]" in text and "%t5" not in text
        m = prog.module
        x = random_inputs(m, {**m.dims, "b": 4}, 0, dtype)
        want = evaluate(m, dict(x), dtype="f64")["y"]
        np.testing.assert_allclose(prog(**x)["y"], want, rtol=rtol, atol=rtol * np.abs(want).max())


BLOCKED = """
dim b = 4
dim h = 8
dim e = 32
dim d = 16
edge c : e
input y : f32[h, b, e, d]
%0 = indicator[c = 32*h + e] : f32[c, e, h]
%1 = contract %y, %0 : f32[b, c, d]
out z = %1 : [b, c, d]
"""


def test_a_read_by_blocks_orders_its_loops_by_the_mean_stride_of_the_division():
    """`z[b, c, d] = y[h = floor(c / 32), b, e = c - 32 floor(c / 32), d]` (a streamed
    loop's stacked blocks joined back): one step of `c` moves a row of `y` and a block
    every 32 steps, so `c` sits inside `b` as in `z`, not outermost as a gather would."""
    low = lower(BLOCKED)
    (k,) = [k for k in low.kernels if isinstance(k, LoopKernel)]
    assert "floor((c) / 32)" in k.text()
    assert k.loops == ("b", "c", "d")
