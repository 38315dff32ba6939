"""Small layer programs that several backend suites run (the CPU group stage, the CUDA
row groups and column sums, loops over layers): one definition each."""

# a layernorm with the gradients of sum(y * dy): row sums (dx) and column sums (dw, db)
LAYERNORM = """
dim rows, d
input x[rows, d]
input dy[rows, d]
param w[d], b[d]
y = layernorm[d](x, w, b)
loss = sum(y * dy)
out y
out dx = grad(loss, x)
out dw = grad(loss, w)
out db = grad(loss, b)
"""

# residual tanh layers stacked on a `layer` edge, applied with `repeat`, one SGD step
DEEP = """\
dim batch, layer
dim c = 8, c2 = 8
input x[batch, c]
param w[layer, c, c2]
input lr
fn block(h, w) = tanh(h @ w)[c2 = c] * 0.5 + h
y = repeat[layer](block, x, w)
loss = sum(y * y)
out loss
out y
update w = w - lr * grad(loss, w)
"""


MLP_PARAMS = ("wfc", "bfc", "wproj")
MLP_OUTS = """\
loss = sum(y * y)
out loss
out gfc = grad(loss, wfc)
out gb = grad(loss, bfc)
out gproj = grad(loss, wproj)
out gx = grad(loss, x)
"""


def mlp_head(b: int, t: int, c: int, ff: int) -> str:
    """The head of a stack of GELU MLP blocks for `layer_stack` (`{n}` layers of
    `h + gelu(h @ wfc + bfc) @ wproj` over [b, t, c], ff hidden); `MLP_OUTS` its loss
    and gradients, `MLP_PARAMS` its stacked params."""
    return (f"dim layer = {{n}}, b = {b}, t = {t}, c = {c}, ff = {ff}\n"
            "input x[b, t, c]\n"
            "param wfc[layer, c, ff], bfc[layer, ff], wproj[layer, ff, c]\n"
            "fn block(h, wfc, bfc, wproj) = h + gelu(h @ wfc + bfc) @ wproj\n")


def layer_stack(head: str, outs: str, n: int, params: tuple[str, ...], loop: bool = True) -> str:
    """`head` (with `{n}` for the layer count), then `y` as `repeat[layer](block, x,
    *params)` or, with `loop=False`, as the n calls of `block` on the layers' slices
    written out (no loop: one graph), then `outs`."""
    if loop:
        body = f"y = repeat[layer](block, x, {', '.join(params)})\n"
    else:
        lines, h = [], "x"
        for i in range(n):
            lines.append(f"h{i} = block({h}, {', '.join(f'{p}[layer = {i}]' for p in params)})")
            h = f"h{i}"
        body = "\n".join(lines) + f"\ny = {h}\n"
    return head.format(n=n) + body + outs


def loop_kept(source: str, dtype: str = "f64"):
    """The optimized module of `source`, its loops kept as loops (`unroll_max_ops=0`)."""
    from tgc.frontend.elaborate import elaborate_source
    from tgc.options import Options
    from tgc.pipeline import lower

    options = Options(dtype=dtype, unroll_max_ops=0)
    return lower(elaborate_source(source, "<test>", options).module, options).module


def assert_loop_is_the_unrolled_program(program, inputs: dict) -> None:
    """`program(loop)` (a layer_stack) evaluated in f64 with its loop and written out
    give the same outputs."""
    import numpy as np
    from tgc.ir.interp import evaluate

    got = evaluate(loop_kept(program()), {k: a.copy() for k, a in inputs.items()}, dtype="f64")
    want = evaluate(loop_kept(program(loop=False)), {k: a.copy() for k, a in inputs.items()}, dtype="f64")
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-11, atol=1e-12, err_msg=k)


def causal_attention(head: int, t: int, hd: int) -> str:
    """Causal self-attention of `head` heads of width `hd` over `t` tokens, with the
    gradients of sum(y * dy): the program the streaming suites (tests/opt/test_stream.py,
    tests/lower/test_pieces.py, the CPU group and mask tests) run at their own sizes."""
    return f"""
dim head = {head}, t = {t}, hd = {hd}
dim s = t
input q[head, t, hd]
input k[head, s, hd]
input v[head, s, hd]
input dy[head, t, hd]
p = softmax[s](where([s <= t], sum[hd](q * k) / sqrt(size(hd)), -1e9))
y = sum[s](p * v)
out y[head, t, hd]
loss = sum(y * dy)
out dq[head, t, hd] = grad(loss, q)
out dk[head, s, hd] = grad(loss, k)
out dv[head, s, hd] = grad(loss, v)
"""
