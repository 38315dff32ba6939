"""GEMM epilogues (tgc.lower.epilogue): the kernels that read a product elementwise
become outputs computed as it is stored. Golden text, the text read back, the lowered
interpreter against the IR interpreter (f32 and f64), the CPU backend against the
lowered interpreter, and where the fold must not apply (an AdamW step under global
norm clipping)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import tgc
from tgc import pipeline
from tgc.frontend import compile_source
from tgc.ir.diag import CompileError
from tgc.ir.inputs import random_inputs
from tgc.lower.interp import run_lowered
from tgc.lower.lowered import GemmKernel, LoopKernel, epilogue_loops, print_lowered
from tgc.lower.text import parse_lowered
from tgc.options import Options
from tgc.pipeline import lower_module

from lowered_util import assert_lowered_gives_the_ir_interpreters_values

CPU_STAGES = ("fuse", "layout", "narrow", "gemm_operands", "implicit", "epilogue", "group", "plan")

FFN = """
dim batch = 64, c = 96, ff = 192
input x[batch, c]
param w[c, ff], b[ff]
out y = gelu(x @ w + b)
"""

# Two outputs of one product: the product goes into the first, the second still reads it.
TWO = """
dim batch = 64, c = 96, ff = 192
input x[batch, c]
param w[c, ff], b[ff]
out y = relu(x @ w + b)
out z = exp(-(x @ w) * (x @ w))
"""

# A weight's gradient and its AdamW update (no clipping): the update reads the
# gradient's product elementwise, so it runs as the product is stored.
ADAMW = """
dim batch = 32, c = 48, d = 40
input x[batch, c], dy[batch, d]
param w[c, d]
state m[c, d], v[c, d]
input lr
loss = sum(dy * (x @ w))
out loss
g = grad(loss, w)
mn = 0.9 * m + 0.1 * g
vn = 0.999 * abs(v) + 0.001 * g * g
update m = mn
update v = vn
update w = w - lr * (mn / (sqrt(vn) + 1e-8) + 0.01 * w)
"""

# The same under global-norm clipping: `clip` needs every gradient's norm first.
CLIPPED = ADAMW.replace("g = grad(loss, w)", "gnorm = sqrt(sum(grad(loss, w) ^ 2))\n"
                        "clip = min(1, 1 / (gnorm + 1e-6))\ng = clip * grad(loss, w)")


def lowered(source: str, dtype: str = "f32", stop_after: str = "plan", stages=CPU_STAGES):
    opts = Options(dtype=dtype, stages=stages)
    m = pipeline.lower(compile_source(source, "<test>", opts), opts).module
    return m, lower_module(m, opts, stop_after=stop_after)


def kernel_lines(low) -> list[str]:
    text = print_lowered(low, module=False)
    return [line for line in text.splitlines() if line.startswith(("k", "      then"))]


def test_golden_bias_gelu_epilogue():
    """The product goes straight into the output (laid out as the product), which the
    epilogue then overwrites: no buffer holds the product."""
    _, low = lowered(FFN, stop_after="epilogue")
    assert "t4" not in low.buffers
    assert kernel_lines(low) == [
        "k0: gemm %y = %x[batch, c] @ %w[c, ff]  batch() m(batch) n(ff) k(c)",
        "      then %y[batch, ff] = mul(add[1.0, 1.0](%b[ff], acc), add[0.5, 1.0](tanh(add[0.7978845608028654]"
        "(add[1.0, 0.044715](add[1.0, 1.0](%b[ff], acc), mul(add[1.0, 1.0](%b[ff], acc), add[1.0, 1.0](%b[ff], acc), "
        "add[1.0, 1.0](%b[ff], acc))))), 0.5))",
    ]


def test_golden_adamw_in_the_gradient_store():
    _, low = lowered(ADAMW, stop_after="epilogue")
    gemms = [k for k in low.kernels if isinstance(k, GemmKernel) and k.epilogue]
    assert len(gemms) == 1
    g = gemms[0]
    text = g.text().splitlines()
    assert text[0] == "gemm %t11 = %dy[batch, d] @ %x[batch, c]  batch() m(d) n(c) k(batch)"
    # the moments, then the update reading the new moments: three outputs, no loop reads the gradient
    assert [line.split(" = ")[0].strip() for line in text[1:]] == \
        ["then %t7[c, d]", "then %t8[c, d]", "then %t9[c, d]"]
    assert "acc" in text[1] and "acc" in text[2]
    assert not any(g.out in k.buffers_read() for k in low.kernels if k is not g)


def test_the_product_goes_into_an_output_and_lives_on_as_acc():
    _, low = lowered(TWO, stop_after="epilogue")
    (g,) = [k for k in low.kernels if isinstance(k, GemmKernel)]
    assert [o.buf for o in g.epilogue] == ["y", "z"] and g.out == "y"
    assert "acc" in kernel_lines(low)[2]   # z reads the product, not y's new value


def test_the_text_reads_back_and_the_verifier_accepts_it():
    for source in (FFN, TWO, ADAMW):
        _, low = lowered(source, stop_after="epilogue")
        text = print_lowered(low)
        assert print_lowered(parse_lowered(text)) == text


def test_the_reader_refuses_an_epilogue_output_away_from_the_products_index():
    _, low = lowered(FFN, stop_after="epilogue")
    text = print_lowered(low).replace("then %y[batch, ff]", "then %y[batch, 0]")
    with pytest.raises(CompileError, match="product's own index"):
        parse_lowered(text)


def test_the_verifier_refuses_a_load_of_the_product():
    _, low = lowered(FFN, stop_after="epilogue")
    text = print_lowered(low).replace("(%b[ff], acc)", "(%b[ff], %y[batch, ff])", 1)
    with pytest.raises(CompileError, match="loads the product"):
        parse_lowered(text)


@pytest.mark.parametrize("dtype", ["f64", "f32"])
@pytest.mark.parametrize("source", [FFN, TWO, ADAMW, CLIPPED], ids=["bias_gelu", "two", "adamw", "clipped"])
def test_the_interpreter_runs_epilogues_to_the_ir_interpreters_values(source, dtype):
    m, low = lowered(source, dtype, stop_after="epilogue")
    assert_lowered_gives_the_ir_interpreters_values(m, low, dtype)


@pytest.mark.parametrize("tiles", [True, False], ids=["in_tiles", "as_loops"])
@pytest.mark.parametrize("dtype", ["f64", "f32"])
@pytest.mark.parametrize("source", [FFN, TWO, ADAMW], ids=["bias_gelu", "two", "adamw"])
def test_the_cpu_backend_agrees_with_the_lowered_interpreter(source, dtype, tiles):
    """On each tile right after its product (gemm_epilogue.py), or written out by `group`
    as loops after the GEMM (`CpuOptions.gemm_epilogue` off), on 1 and 2 threads."""
    opts = Options(dtype=dtype, stages=CPU_STAGES)
    opts = opts.with_(cpu=opts.cpu.with_(gemm_epilogue=tiles))
    m = pipeline.lower(compile_source(source, "<test>", opts), opts).module
    low = lower_module(m, opts)
    assert any(isinstance(k, GemmKernel) and k.epilogue for k in low.kernels) == tiles
    x = random_inputs(m, m.bind_dims({}), 1, dtype)
    want = run_lowered(lowered(source, dtype, stop_after="epilogue")[1], {k: np.copy(v) for k, v in x.items()})
    tol = 1e-10 if dtype == "f64" else 3e-5
    for threads in (1, 2):
        prog = tgc.compile(source, options=opts.with_(cpu=opts.cpu.with_(threads=threads, gemm_parallel_min_flops=0)))
        got = prog(**{k: np.copy(v) for k, v in x.items()})
        for k, w in want.items():
            scale = max(1.0, float(np.max(np.abs(w))))
            np.testing.assert_allclose(np.asarray(got[k]), w, rtol=tol, atol=tol * scale, err_msg=f"{k} {threads}")


def test_clipping_keeps_the_update_out_of_the_gradient_store():
    """Under global-norm clipping the update reads `clip`, computed after the sum of the
    gradient's squares: no output of the gradient's GEMM is the update."""
    _, low = lowered(CLIPPED, stop_after="epilogue")
    for k in low.kernels:
        if isinstance(k, GemmKernel):
            assert not k.epilogue, k.text()


def test_epilogue_loops_are_the_kernels_folded():
    _, before = lowered(FFN, stop_after="layout")
    _, after = lowered(FFN, stop_after="epilogue")
    g = after.kernels[0]
    (loop,) = epilogue_loops(after, g, "t4")   # `acc` read from the product's old buffer
    assert isinstance(loop, LoopKernel) and loop.out == "y" and loop.body == before.kernels[1].body


def test_the_cuda_lowering_writes_epilogues_out():
    """cuda-sim's lowering with the stage: its cublas_operands stage turns epilogues back
    into loops (the CUDA code generator never sees one)."""
    stages = ("fuse", "layout", "epilogue", "narrow", "cublas_operands", "inline_elementwise", "rowgroup", "plan")
    opts = Options(stages=stages)
    m = pipeline.lower(compile_source(FFN, "<test>", opts), opts).module
    low = lower_module(m, opts, backend="cuda-sim")
    assert not any(isinstance(k, GemmKernel) and k.epilogue for k in low.kernels)


def test_a_gemm_with_an_epilogue_runs_as_a_kernel_of_its_own():
    """A merged parallel region (backends/cpu/regions.py) takes no epilogue GEMM: its
    function takes the epilogue's buffers in an array of its own."""
    from tgc.backends.cpu import regions

    _, low = lowered(FFN)
    (g,) = [k for k in low.kernels if isinstance(k, GemmKernel)]
    assert g.epilogue and not regions.is_member(g) and not regions.splits(g, Options().cpu)
    assert regions.is_member(replace(g, epilogue=()))
