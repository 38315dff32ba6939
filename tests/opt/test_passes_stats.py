"""Statistics (ops, FLOPs, bytes) and the measured targets: derived backward passes within
1.3x of hand-written ones, a training step within 3x of its forward pass."""
import pytest
from click.testing import CliRunner

from passes_util import GOLDEN, ROOT, optimize, tg, tgir
from tgc.cli import main
from tgc.frontend import compile_file
from tgc.ir.values import DERIVATIVE_OPS, topo_order
from tgc.options import Options
from tgc.manager import run_pipeline
from tgc.opt.stats import module_stats


def test_cost_model():
    m = tgir("""
dim b
dim i = 3
dim j = 5
dim k = 4
dim t = 6
dim s = 4
input x : f32[b, i]
input W : f32[i, j]
input v : f32[t]
%y = contract %x, %W : f32[b, j]
%e = map[exp] %y : f32[b, j]
%a = add[1.0, 1.0, 1.0] %e, %y, %y : f32[b, j]
%r = indicator[t = s + k] : f32[k, s, t]
%w = contract %v, %r : f32[k, s]
out a = %a : [b, j]
out w = %w : [k, s]
""")
    s = module_stats(m, rep=64)
    # matmul 64*3*5; exp 64*5; add of 3 operands 2*64*5; the window view max(6, 4*4) elements
    assert s.flops == 64 * 3 * 5 + 64 * 5 + 2 * 64 * 5 + 16
    assert s.bytes == 4 * (3 * 64 * 5 + 16) and s.largest == 4 * 64 * 5
    assert s.ops == 5


def test_pass_manager_collects_stats_per_pass():
    r = run_pipeline(tg("dim n = 3\ninput x[n]\nout y = (exp(x) * 1 + 0 * x) * 2 * 3"),
                     Options(passes=("normalize",), stats=True))
    assert r.initial.ops > 3 and r.stats[0].cost.ops == 2  # exp, and one scaling by 6


def test_cli_prints_a_table_per_pass():
    r = CliRunner().invoke(main, ["dump-ir", str(ROOT / "examples" / "mlp.tg"), "--stats"])
    assert r.exit_code == 0, r.output
    for name in ("input", "normalize", "adjoint", "simplify", "stabilize", "factor", "FLOPs", "bytes"):
        assert name in r.output


@pytest.mark.parametrize("name", ["layernorm", "softmax", "gelu"])
def test_derived_backward_within_1_3x_of_hand_written(name):
    derived = optimize(compile_file(str(GOLDEN / f"{name}_grad.tg"), Options(dtype="f64")))
    hand = optimize(compile_file(str(GOLDEN / f"{name}_hand.tg"), Options(dtype="f64")))
    assert module_stats(derived).flops <= 1.3 * module_stats(hand).flops


def _forward_only(m):
    f = m.replace_values({})
    f.updates = []
    f.outputs = [o for o in f.outputs if not any(v.op in DERIVATIVE_OPS for v in topo_order([o.value]))]
    return f


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_training_step_within_3x_of_forward(name):
    m = compile_file(str(ROOT / "examples" / f"{name}.tg"), Options())
    step = module_stats(run_pipeline(m, Options()).module).flops
    forward = module_stats(run_pipeline(_forward_only(m), Options()).module).flops
    assert step <= 3 * forward, (step, forward)
