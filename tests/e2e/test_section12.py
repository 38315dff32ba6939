"""The example program of the language's "Repetition" section (docs/language.md, "Loops
over an edge" and "One rule for many params"), its lines as written there and its
`...` filled in: stacked params applied by `repeat`, a `scan`, and AdamW with clipping
in one `for p in params` block. It checks, compiles (the 12-step loop unrolled on the
CPU), agrees with the reference interpreter's loop, and trains."""
import numpy as np
import pytest
from click.testing import CliRunner

import tgc
from tgc import pipeline
from tgc.cli import main
from tgc.frontend import compile_source
from tgc.ir.interp import evaluate
from tgc.options import Options

SOURCE = """\
dim batch, c = 8, c2 = c, t = 4
dim layer = 12
param wq[layer, c, c2], ln1_w[layer, c]            # one tensor per kind, stacked on `layer`
param wk[c, c2], wv[c, c2], wo[c2, c]
input x0[batch, c], xs[t, batch, c], h0[batch, c], target[batch, c]
input lr, wd
fn block(x, ln1_w, wq) {
  x2 = x + tanh(rmsnorm[c](x, ln1_w) @ wq)[c2 -> c]
  return x2
}
fn cell(h, x) = tanh(0.5 * h + x)
y  = repeat[layer](block, x0, ln1_w, wq)           # block applied for layer = 0, 1, ..., 11
hs = scan[t](cell, h0, xs)                         # every step's carry, along t
loss = mean((y @ wv @ wo - target) ^ 2) + mean((hs @ wk) ^ 2)
state step
tt = step + 1
update step = tt
gnorm = sqrt(sum[p in params](sum(grad(loss, p) ^ 2)))     # a sum over a list of tensors
clip  = min(1, 1 / (gnorm + 1e-6))
for p in params {                    # every declared param; or a list: for p in wq, wk, wv
  state m.p, v.p                     # per-param states, named m.wq, v.wq, ...: p's edges
  g  = clip * grad(loss, p)
  mn = 0.9 * m.p + 0.1 * g
  vn = 0.95 * v.p + 0.05 * g * g
  update m.p = mn
  update v.p = vn
  update p = p - lr * ((mn / (1 - 0.9 ^ tt)) / (sqrt(vn / (1 - 0.95 ^ tt)) + 1e-8)
                       + wd * [p in wq, wk, wv, wo] * p)    # 1 for the listed params, else 0
}
out loss
"""


def _arrays(program, seed=0):
    rng = np.random.default_rng(seed)
    arrays = program.init_state()
    for spec in program.inputs:
        if spec.kind == "param":
            arrays[spec.name] = np.ones(spec.shape) if spec.name == "ln1_w" \
                else 0.3 * rng.standard_normal(spec.shape)
    b = 5
    return {**arrays, "x0": rng.standard_normal((b, 8)), "xs": rng.standard_normal((4, b, 8)),
            "h0": rng.standard_normal((b, 8)), "target": rng.standard_normal((b, 8)),
            "lr": np.asarray(0.02), "wd": np.asarray(0.01)}


def test_it_checks(tmp_path):
    path = tmp_path / "section.tg"
    path.write_text(SOURCE)
    r = CliRunner().invoke(main, ["check", "-Werror", str(path)])
    assert r.exit_code == 0, r.output


def test_it_compiles_agrees_with_the_interpreter_and_trains():
    program = tgc.compile(SOURCE, dtype="f64")
    args = _arrays(program)
    options = Options(dtype="f64", passes=("normalize", "adjoint", "tangent"))     # loops kept: the interpreter runs them
    module = pipeline.lower(compile_source(SOURCE, "section.tg", options), options).module
    assert any(v.op == "loop" for v in module.values())
    want = evaluate(module, {k: np.copy(v) for k, v in args.items()}, dtype="f64")
    losses = [float(program(**args)["loss"])]
    assert losses[0] == pytest.approx(float(want["loss"]), rel=1e-12)
    for u in module.updates:
        np.testing.assert_allclose(args[u.target], want[u.target], rtol=1e-10, atol=1e-12, err_msg=u.target)
    losses += [float(program(**args)["loss"]) for _ in range(30)]
    assert float(args["step"]) == 31 and {"m.wq", "v.ln1_w", "m.wo"} <= set(args)
    assert losses[-1] < 0.7 * losses[0], losses
