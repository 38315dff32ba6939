"""Loops over an edge (`repeat`, `scan`): values and every derivative mode against the
hand-unrolled program, finite differences and PyTorch; symbolic trip counts; the text
form; the compiled backends (a loop kept: its step compiled once)."""
import numpy as np
import pytest

import tgc
from tgc.ir.interp import evaluate
from tgc.ir.parser import parse_module
from tgc.ir.printer import print_module
from tgc.options import Options
from tgc.pipeline import lower
from tgc.frontend.elaborate import elaborate_source

from backends_util import backends, compile_on

# a carry with two edges (b, c); the step reads a stacked matrix and a stacked bias
HEAD = """\
dim {layer}, b = 2, c = 3, c2 = 3
input x[b, c], v[layer, c, c2], dx[b, c]
param w[layer, c, c2], g[layer, c]
fn block(h, w, g) {{
  z = tanh(sum[c](h * w) + g[c = c2])
  return z[c2 = c] * 0.9 + h * 0.1
}}
"""

LOOP = """\
y = repeat[layer](block, x, w, g)
hs = scan[layer](block, x, w, g)
"""

OUTS = """\
loss = sum(y * y) + sum(hs * hs * hs)
out loss
out hs
out gw = grad(loss, w)
out gx = grad(loss, x)
out gg = grad(loss, g)
out jw = jvp(loss, w, v)
out jx = jvp(hs, x, dx)
out hv = grad(sum(grad(loss, w) * v), w)
out hx = jvp(grad(loss, x), w, v)
"""


def unrolled(n: int) -> str:
    lines, h = [], "x"
    for i in range(n):
        lines.append(f"h{i} = block({h}, w[layer = {i}], g[layer = {i}])")
        h = f"h{i}"
    lines.append(f"y = {h}")
    lines.append("hs = " + " + ".join(f"h{i} * [layer = {i}]" for i in range(n)))
    return "\n".join(lines) + "\n"


def program(n, loop=True, symbolic=False):
    layer = "layer" if symbolic else f"layer = {n}"
    return HEAD.format(layer=layer) + (LOOP if loop else unrolled(n)) + OUTS


def module(source, **opts):
    options = Options(dtype="f64", **opts)
    return lower(elaborate_source(source, "<test>", options).module, options).module


def inputs(n, seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"x": (2, 3), "dx": (2, 3), "v": (n, 3, 3), "w": (n, 3, 3), "g": (n, 3)}
    return {k: rng.standard_normal(s) * 0.6 for k, s in shapes.items()}


def run(source, ins, **opts):
    return evaluate(module(source, **opts), {k: a.copy() for k, a in ins.items()}, dtype="f64")


@pytest.mark.parametrize("n", [1, 2, 5])
def test_every_derivative_matches_the_unrolled_program(n):
    ins = inputs(n)
    got = run(program(n), ins, passes=("normalize", "adjoint", "tangent"))   # loops kept: the interpreter runs them
    want = run(program(n, loop=False), ins)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-11, atol=1e-12, err_msg=k)


def test_symbolic_trip_count_serves_any_depth():
    m = module(program(3, symbolic=True))
    assert any(v.op == "loop" for v in m.values())   # not unrolled: the size is unknown
    for n in (1, 4):
        ins = inputs(n, seed=n)
        got = evaluate(m, {k: a.copy() for k, a in ins.items()}, dtype="f64")
        want = run(program(n, loop=False), ins)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-11, atol=1e-12, err_msg=k)


def check_central_differences(m, ins: dict, base: dict, pairs, seed: int) -> None:
    """Each (input, gradient output) pair of `base` (module `m` on `ins`, f64) at 4 random
    elements against central differences of the output `loss` (eps 1e-6)."""
    rng = np.random.default_rng(seed)
    for name, grad in pairs:
        for _ in range(4):
            idx = tuple(rng.integers(0, s) for s in ins[name].shape)
            eps = 1e-6
            hi = {k: a.copy() for k, a in ins.items()}
            lo = {k: a.copy() for k, a in ins.items()}
            hi[name][idx] += eps
            lo[name][idx] -= eps
            fd = (evaluate(m, hi, dtype="f64")["loss"] - evaluate(m, lo, dtype="f64")["loss"]) / (2 * eps)
            assert abs(fd - base[grad][idx]) < 1e-6 * max(1.0, abs(fd)), (name, idx)


def test_gradient_matches_finite_differences():
    n = 3
    src = HEAD.format(layer=f"layer = {n}") + LOOP + "out loss = sum(y * y) + sum(hs * hs * hs)\n" \
        "out gw = grad(loss, w)\nout gx = grad(loss, x)\nout gg = grad(loss, g)\n"
    m = module(src, passes=("normalize", "adjoint", "tangent"))
    ins = inputs(n)
    base = evaluate(m, ins, dtype="f64")
    check_central_differences(m, ins, base, (("w", "gw"), ("x", "gx"), ("g", "gg")), seed=1)


def test_gradients_match_pytorch():
    torch = pytest.importorskip("torch")
    n = 4
    ins = inputs(n)
    got = run(program(n), ins, passes=("normalize", "adjoint", "tangent"))
    t = {k: torch.tensor(a, requires_grad=True) for k, a in ins.items()}
    h, hs = t["x"], []
    for i in range(n):
        z = torch.tanh(torch.einsum("bc,cd->bd", h, t["w"][i]) + t["g"][i])
        h = z * 0.9 + h * 0.1
        hs.append(h)
    loss = (h * h).sum() + (torch.stack(hs) ** 3).sum()
    gw, gx, gg = torch.autograd.grad(loss, [t["w"], t["x"], t["g"]], create_graph=True)
    hv, = torch.autograd.grad((gw * t["v"]).sum(), [t["w"]])
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-12)
    for name, want in (("gw", gw), ("gx", gx), ("gg", gg), ("hv", hv)):
        np.testing.assert_allclose(got[name], want.detach().numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


def test_loop_text_reads_back():
    m = module(program(3), passes=("normalize", "adjoint", "tangent"))
    text = print_module(m)
    assert "body b0 carries=1 slices=2 {" in text and ", reverse]" in text   # the reverse loop of grad
    assert print_module(parse_module(text)) == text


@pytest.mark.parametrize("backend", backends())
def test_compiled_backends_run_loops(backend):
    n = 3
    ins = inputs(n)
    want = run(program(n, loop=False), ins)
    p = compile_on(program(n), backend, dtype="f64")
    got = p(**{k: a.copy() for k, a in ins.items()})
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-10, atol=1e-12, err_msg=k)


def test_compiled_symbolic_loop_with_its_size_fixed_on_cuda():
    """`dims=` fixes the loop's size at build time (the symbolic loop itself runs on cuda-sim
    too: tests/e2e/test_cuda_loops.py)."""
    src = program(2, symbolic=True)
    p = tgc.compile(src, backend="cuda-sim", dtype="f64", dims={"layer": 2})
    ins = inputs(2)
    want = run(program(2, loop=False), ins)
    got = p(**{k: a.copy() for k, a in ins.items()})
    np.testing.assert_allclose(np.asarray(got["hv"]), want["hv"], rtol=1e-10, atol=1e-12)


def test_emit_tg_writes_loops_as_loops():
    from tgc.frontend.emit_tg import emit_tg

    src = HEAD.format(layer="layer") + LOOP + "out y\nout hs\n"
    m = elaborate_source(src, "<test>", Options(dtype="f64")).module
    text = emit_tg(m)
    assert "repeat[layer](step, " in text and "scan[layer](step_1, " in text and "fn step(" in text
    again = elaborate_source(text, "<emitted>", Options(dtype="f64")).module
    ins = inputs(3)
    want, got = evaluate(m, ins, dtype="f64"), evaluate(again, ins, dtype="f64")
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-14, err_msg=k)


@pytest.mark.parametrize("passes", [None, ("normalize", "adjoint", "tangent")], ids=["pipeline", "derived"])
def test_emit_tg_writes_derivative_loops_as_loops(passes):
    """Every derivative of the loops over a symbolic depth (grad, vjp, jvp, an HVP: the
    forward loop that keeps step values, the reverse loop, the tangent loop, a tangent of
    a reverse loop) prints as `repeat`/`scan` (tgc.frontend.emit_loops) and reads back to
    the same values, whether the pipeline optimized the steps or not."""
    from tgc.frontend.emit_tg import emit_tg

    src = program(3, symbolic=True).replace("input x[b, c]", "input x[b, c], ct[layer, b, c]") \
        + "out vj = vjp(hs, w, ct)\n"
    m = module(src, **({"passes": passes} if passes else {}))
    assert sum(v.op == "loop" and v.attrs[2] for v in m.values()) > 0   # a reverse loop is printed
    text = emit_tg(m)
    assert "[layer = 0]" not in text and "scan[layer](" in text and "repeat[layer](" in text
    assert "[layer = size(layer) - 1 - layer]" in text   # the reverse loops, over the flipped steps
    again = elaborate_source(text, "<emitted>", Options(dtype="f64")).module
    ins = {**inputs(3), "ct": np.random.default_rng(5).standard_normal((3, 2, 3))}
    want, got = evaluate(m, ins, dtype="f64"), evaluate(again, ins, dtype="f64")
    assert set(want) == {"loss", "hs", "gw", "gx", "gg", "jw", "jx", "hv", "hx", "vj"}
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-10, atol=1e-12, err_msg=k)


NESTED = """\
dim layer = 2, sub = 3, c = 3
input x[c]
param w[layer, sub, c]
fn inner(h, w) = tanh(h * w + 0.1)
fn outer(h, w) = {inner} * 0.5 + h
y = {outer}
loss = sum(y * y)
out loss
out gw = grad(loss, w)
out hv = jvp(grad(loss, x), w, w)
"""


@pytest.mark.parametrize("backend", ["interp", "cpu"])
def test_a_loop_inside_a_step(backend):
    loops = NESTED.format(inner="repeat[sub](inner, h, w)", outer="repeat[layer](outer, x, w)")
    plain = NESTED.format(inner="inner(inner(inner(h, w[sub = 0]), w[sub = 1]), w[sub = 2])",
                          outer="outer(outer(x, w[layer = 0]), w[layer = 1])")
    rng = np.random.default_rng(3)
    ins = {"x": rng.standard_normal(3), "w": rng.standard_normal((2, 3, 3))}
    want = run(plain, ins)
    if backend == "interp":
        got = run(loops, ins, passes=("normalize", "adjoint", "tangent", "simplify"))
    else:
        got = tgc.compile(loops, backend="cpu", dtype="f64")(**{k: a.copy() for k, a in ins.items()})
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-12, atol=1e-14, err_msg=k)


def test_tgc_run_binds_a_loop_dim_before_compiling(tmp_path):
    from click.testing import CliRunner

    from tgc.cli.app import main

    path = tmp_path / "deep.tg"
    path.write_text(program(2, symbolic=True))
    res = CliRunner().invoke(main, ["run", str(path), "--random-inputs", "--dim", "layer=4", "--backend", "cpu"])
    assert res.exit_code == 0, res.output
    assert "gw[layer, c, c2]" in res.output and "shape=(4, 3, 3)" in res.output


# a step that takes i32 slices: gather ids and random keys (LANGUAGE.md section 12: every
# `ak` is stacked on the loop edge, whatever its type)
IDS_HEAD = """\
dim {layer}, n = 4, v = 5
input x0[n]
param E[layer, v, n]
fn step(h, e, i, k) = tanh(h * e[v = i] + dropout[n](h, k, 0.25) + 0.1 * randn[n](fold(k, 3)))
"""
IDS_LOOP = """\
input ids: i32[layer, n]
input keys: i32[layer]
y = repeat[layer](step, x0, E, ids, keys)
hs = scan[layer](step, x0, E, ids, keys)
"""
IDS_OUTS = """\
loss = sum(y * y) + sum(hs * hs * hs)
out loss
out hs
out gE = grad(loss, E)
out gx = grad(loss, x0)
out jx = jvp(y, x0, x0)
"""


def ids_unrolled(n: int) -> str:
    """The same steps written out: step i's ids and key are inputs of their own."""
    decls = "".join(f"input ids{i}: i32[n]\ninput key{i}: i32\n" for i in range(n))
    lines, h = [], "x0"
    for i in range(n):
        lines.append(f"h{i} = step({h}, E[layer = {i}], ids{i}, key{i})")
        h = f"h{i}"
    lines += [f"y = {h}", "hs = " + " + ".join(f"h{i} * [layer = {i}]" for i in range(n))]
    return decls + "\n".join(lines) + "\n"


def ids_program(n, loop=True, symbolic=False):
    return IDS_HEAD.format(layer="layer" if symbolic else f"layer = {n}") + \
        (IDS_LOOP if loop else ids_unrolled(n)) + IDS_OUTS


def ids_inputs(n, seed=0):
    rng = np.random.default_rng(seed)
    ins = {"x0": rng.standard_normal(4) * 0.6, "E": rng.standard_normal((n, 5, 4)) * 0.6,
           "ids": rng.integers(0, 5, (n, 4)).astype(np.int32), "keys": rng.integers(0, 2 ** 31, n).astype(np.int32)}
    return ins


def ids_split(ins):
    """The loop's inputs as the written-out program takes them."""
    out = {k: ins[k] for k in ("x0", "E")}
    for i in range(len(ins["keys"])):
        out[f"ids{i}"], out[f"key{i}"] = ins["ids"][i], ins["keys"][i]
    return out


@pytest.mark.parametrize("backend", ["interp", *backends()])
@pytest.mark.parametrize("symbolic", [False, True], ids=["fixed", "symbolic"])
def test_a_step_takes_i32_ids_and_keys(backend, symbolic):
    """Values and derivatives w.r.t. the float arguments equal the written-out program's, on
    the interpreter and every backend, with the loop's size fixed (a loop that reads i32
    slices is never unrolled) or symbolic."""
    n = 3
    ins = ids_inputs(n)
    want = run(ids_program(n, loop=False), ids_split(ins))
    src = ids_program(n, symbolic=symbolic)
    if backend == "interp":
        got = run(src, ins)
        assert any(v.op == "loop" for v in module(src).values())
    else:
        got = compile_on(src, backend, dtype="f64")(**{k: a.copy() for k, a in ins.items()})
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-10, atol=1e-12, err_msg=k)


def test_i32_step_gradient_matches_finite_differences():
    n = 3
    m = module(ids_program(n))
    ins = ids_inputs(n, seed=1)
    base = evaluate(m, {k: a.copy() for k, a in ins.items()}, dtype="f64")
    check_central_differences(m, ins, base, (("E", "gE"), ("x0", "gx")), seed=2)


def test_an_i32_loop_on_a_backend_without_loops_is_a_located_error():
    from tgc.ir.diag import CompileError
    from tgc.opt.unroll import unroll

    m = elaborate_source(ids_program(2), "ids.tg", Options(dtype="f64")).module
    with pytest.raises(CompileError, match="runs only as a loop") as info:
        unroll(m)
    assert info.value.loc is not None
