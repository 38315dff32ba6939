"""The layout of a stream's blocks of rows (tgc.lower.steps, `block_decl_order`).

A stream (tgc.opt.stream) splits the rows t of a cluster into blocks t.2 (a fresh edge,
declared after every edge of the program). The step's operands copied in and its stacked
results were laid out in the declaration order of their edges, so `[batch, c, t.2]` kept
the fresh t.2 innermost, where the program stores the whole `[batch, c, t]` as
`[batch, t, c]` (t is declared before c). In GPT-2 small's layer (examples/gpt2.tg,
t = 1024, where the stream engages by default) every saved activation was transposed
by the join after the stream (`[batch, ff, t.2]` blocks into `[batch, t, ff]`) and the
layernorm backward read a gradient the join left as `[batch, c, t]` across its rows:
59 and 15 ms of a layer's ~470 on one thread. A block edge now ranks as the edge it
splits (the first declared of them: x's rows t and q's t.1 -> t), so both agree.

Checked: the lowered text of examples/gpt2.tg streamed at a small size (every stacked
result and every copied-in block over c or ff holds c or ff innermost, as the program's
own buffers over t do), and the values: the streamed step on the CPU against the
interpreter's, and against the unstreamed step."""
import re
from pathlib import Path

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.lower.lowered import print_lowered
from tgc.options import Options

GPT2 = Path(__file__).resolve().parents[2] / "examples" / "gpt2.tg"
SIZES = {"layer": 2, "head": 2, "hd": 4, "t": 64, "vocab": 16}
# the stream on at this size: blocks of 16 of the 64 rows (the scores: 8192 elements)
ON = dict(stream_block=16, stream_min_elements_masked=1 << 12)
OFF = dict(stream_block=0)


def _lowered(options: dict) -> str:
    src = pipeline.load_source(str(GPT2), dims=SIZES, lookup=False)
    options = src.options.with_(**options)
    m = pipeline.lower(src.module, options).module
    fixed = pipeline.specialized_module(m, {"batch": 1}, options)
    return print_lowered(pipeline.lower_module(fixed, options), module=False)


def _stacked(text: str) -> list[tuple[str, list[str], list[str]]]:
    """(name, edges, order) of every stream step's stacked result (`%y..`) and copied-in
    block (`%s..`) over the width c or the MLP's ff and a block edge of the rows."""
    found = []
    for name, edges, order in re.findall(r"buffer %([ys]\d+) : f32\[([^\]]*)\] temp order \[([^\]]*)\]", text):
        edges, order = edges.split(", "), order.split(", ")
        if any(e in ("c", "ff") for e in edges) and any(re.fullmatch(r"t\.\d+", e) for e in edges):
            found.append((name, edges, order))
    return found


def test_stream_blocks_keep_the_programs_row_layout():
    text = _lowered(ON)
    assert "streams t in blocks" in text
    found = _stacked(text)
    assert len(found) >= 10, found   # the layer's saved activations, x's rows, the backward's gradients
    for name, edges, order in found:
        # the width (c or ff) innermost, as in the program's [batch, t, c] buffers
        assert order[-1] in ("c", "ff"), (name, edges, order)
    # the program's own buffers over [batch, c, t] (the joins' results) keep t before c
    whole = re.findall(r"buffer %(\w+) : f32\[batch, (c|ff), t\] \w+(?: \d+)? order \[([^\]]*)\]", text)
    assert whole and all(order.split(", ")[-1] in ("c", "ff") for _, _, order in whole), whole


def _arrays(program, seed: int = 0) -> dict:
    import sys

    sys.path.insert(0, str(GPT2.parents[1] / "benchmarks"))
    import nanogpt

    return nanogpt.initial(program, 1, seed=seed, sizes=SIZES)


@pytest.mark.slow
def test_streamed_gpt2_step_equals_interp_and_unstreamed():
    on = tgc.compile(str(GPT2), dims=SIZES, options=Options(**ON))
    off = tgc.compile(str(GPT2), dims=SIZES, options=Options(**OFF))
    ref = tgc.compile(str(GPT2), "interp", dims=SIZES, options=Options(**ON))
    base = _arrays(on)
    runs = {}
    for name, prog in (("on", on), ("off", off), ("interp", ref)):
        x = {k: v.copy() for k, v in base.items()}
        out = prog(**x)
        runs[name] = (float(out["loss"]), x)
    loss, x = runs["on"]
    for other in ("off", "interp"):
        want, y = runs[other]
        assert abs(loss - want) <= 1e-5 * abs(want), (other, loss, want)
        for p in ("wte", "wq", "wfc", "wproj", "ln1_w", "bo"):
            # one AdamW step of lr 1e-3: the params agree to f32 rounding of the update
            np.testing.assert_allclose(x[p], y[p], rtol=0, atol=2e-5, err_msg=f"{p} vs {other}")
