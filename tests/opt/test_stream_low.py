"""stream on bf16/f16 attention (tgc.opt.stream, tgc.opt.stream_keys): the blocks of a
bf16 value are split and joined by reindexes, which computed in f32 and so did not have
the type of the loop parameter they fed; the pass stopped with an internal error ("the
loop's operand 0 (slice) has type f32[hd, t.1, t.2], its body parameter bf16[hd, t.1]")
on the prelude's attention of bf16 q, k, v from t = s = 4096 (16M scores) on. A reindex
now keeps its operand's type (`tgc.ir.values.reindexed`: exact). Oracle: the same program
without the pass, on the interpreter and the CPU; the streamed program has loops."""
import ml_dtypes
import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.frontend import compile_source
from tgc.options import Options

ON = dict(stream_block=4, stream_min_elements=200, stream_mask_groups=2)
OFF = dict(stream_block=0)
LOW = {"bf16": np.dtype(ml_dtypes.bfloat16), "f16": np.dtype(np.float16)}

PROGRAMS = {
    "attention": "out y = attention[s, hd](q, k, v)\n",
    "causal": "out y = sum[s](softmax[s](where([s <= t], dot[hd](q, k) / sqrt(size(hd)), -inf)) * v)\n",
    "grad": ("y = attention[s, hd](q, k, v)\nout y\n"
             "out dq = grad(sum(f32(y) * f32(y)), q)\nout dv = grad(sum(f32(y) * f32(y)), v)\n"),
}


def _loops(src: str) -> int:
    options = Options(**ON)
    m = pipeline.lower(compile_source(src, "<stream>", options), options).module
    return sum(1 for v in m.values() if v.op == "loop")


@pytest.mark.parametrize("backend", ["interp", "cpu"])
@pytest.mark.parametrize("ty", ["bf16", "f16"])
@pytest.mark.parametrize("t", [32, 30])     # 30: a step over the rows left over
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_streamed_low_attention_equals_the_unstreamed(name, t, ty, backend):
    src = f"dim t = {t}, hd = 4\ndim s = t\ninput q: {ty}[t, hd]\ninput k: {ty}[s, hd]\ninput v: {ty}[s, hd]\n" \
          + PROGRAMS[name]
    assert _loops(src) > 0
    rng = np.random.default_rng(t)
    x = {n: rng.standard_normal((t, 4)).astype(LOW[ty]) for n in "qkv"}
    on = tgc.compile(src, backend, options=Options(**ON))(**x)
    off = tgc.compile(src, backend, options=Options(**OFF))(**x)
    assert on["y"].dtype == LOW[ty]
    for k in off:
        assert on[k].dtype == off[k].dtype
        # the blocks' sums run in f32 in another order: a bf16/f16 ulp or two
        np.testing.assert_allclose(on[k].astype(np.float64), off[k].astype(np.float64),
                                   rtol=2 ** -6, atol=2 ** -6, err_msg=k)
