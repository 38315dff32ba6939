"""The front end's work grows linearly with the program (issue 19, item 5).

Counted, not timed: the operands the elaborator hands to the IR builders (each
`Value.make` costs time proportional to its operands), and the source files read to
render a batch of diagnostics. A chain `v_i = v_(i-1) * 1.5` used to flatten every
product into one contraction of i operands (n^2 / 2 operand slots for n statements),
and every warning re-read and re-split the whole file. `tgc check` runs the derivative
passes only on a program that takes a derivative, and `normalize` (the first of them)
names a product it has named before as before: a chain of matrix products (eleven or
more links merged into one product, its summed edges `k.1` ... `k.10` ... tied) came
out renamed on every rebuild, 64 rebuilds a statement (tgc check of chain-matmul at
10^5 statements: over 120 s). `benchmarks/frontend.py` times the same shapes at 10^5
statements.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tgc import manager, pipeline
from tgc.cli import main
from tgc.frontend import expressions
from tgc.frontend.elaborate import elaborate_source
from tgc.ir import diag
from tgc.ir import values as V
from tgc.opt import canon
from tgc.options import Options

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import frontend  # noqa: E402  (benchmarks/frontend.py: the generated shapes)


def operand_slots(text: str, monkeypatch) -> int:
    """Operands passed to Value.make while elaborating `text` (the prelude included)."""
    count = [0]
    make = V.Value.make.__func__

    def counting(cls, op, operands, *args, **kwargs):
        count[0] += len(operands) + 1
        return make(cls, op, operands, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(V.Value, "make", classmethod(counting))
        elaborate_source(text, "scaling.tg", Options())
    return count[0]


@pytest.mark.parametrize("shape", sorted(frontend.SHAPES))
def test_elaboration_work_is_linear_in_statements(shape, monkeypatch):
    gen = frontend.SHAPES[shape]
    base = operand_slots(gen(1), monkeypatch)
    small, large = (operand_slots(gen(n), monkeypatch) - base for n in (400, 1600))
    assert large <= 4.2 * small, (shape, small, large)   # 4x the statements: 4x the work, not 16x
    assert large <= 200 * 1600, (shape, large)


def test_long_product_chain_is_bounded_not_flattened():
    n = 3 * expressions.MAX_FLAT_FACTORS
    m = elaborate_source(frontend.chain_mul(n), "chain.tg", Options()).module
    seen, todo, widest = set(), [o.value for o in m.outputs], 0
    while todo:
        v = todo.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if v.op == "contract":
            widest = max(widest, len(v.operands))
        todo.extend(v.operands)
    assert widest == expressions.MAX_FLAT_FACTORS


def test_short_products_are_still_one_contraction():
    text = "input x\ny = x * 2.5 * x * 3.5\nz = y * x\nout z\n"
    z = elaborate_source(text, "p.tg", Options()).module.outputs[0].value
    assert z.op == "contract" and len(z.operands) == 5


def test_warnings_read_the_source_once(tmp_path, monkeypatch):
    path = tmp_path / "many.tg"
    path.write_text(frontend.independent(300))
    reads = []
    real = diag._file_lines
    monkeypatch.setattr(diag, "_file_lines", lambda file, sources: reads.append(file) or real(file, sources))
    result = CliRunner().invoke(main, ["check", str(path)])
    assert result.exit_code == 0
    assert result.output.count("is never used") == 299
    assert "y7 = x * 7.5" in result.output
    assert reads == [str(path)]


# LALR reductions per statement of each shape (the parser's work is mostly reductions):
# the grammar gives an operand few unit reductions. They were 15, 16, 13, 19, 15 and 38.
REDUCTIONS = {"chain-mul": 8, "chain-add": 8, "chain-matmul": 7, "chain-calls": 12, "independent": 8,
              "wide-sum": 18}


@pytest.mark.parametrize("shape", sorted(frontend.SHAPES))
def test_reductions_per_statement(shape, monkeypatch):
    from tgc.frontend import parser

    callbacks = parser._lark().parser.parser.parser.callbacks   # lark's table: rule -> callback
    count = [0]

    def counted(f):
        def g(children):
            count[0] += 1
            return f(children)
        return g

    monkeypatch.setattr(parser._lark().parser.parser.parser, "callbacks",
                        {rule: counted(f) for rule, f in callbacks.items()})
    n = 1000
    parser.parse(frontend.SHAPES[shape](n), "shape.tg")
    assert count[0] <= REDUCTIONS[shape] * n + 50, (shape, count[0] / n)   # + the declarations


def normalize_work(text: str, monkeypatch) -> tuple[int, int]:
    """(operands passed to Value.make, products named) while `normalize` runs on the
    elaborated `text`."""
    m = elaborate_source(text, "scaling.tg", Options()).module
    slots, named = [0], [0]
    make, names = V.Value.make.__func__, canon.working_names

    def counting(cls, op, operands, *args, **kwargs):
        slots[0] += len(operands) + 1
        return make(cls, op, operands, *args, **kwargs)

    def naming(*args):
        named[0] += 1
        return names(*args)

    with monkeypatch.context() as mp:
        mp.setattr(V.Value, "make", classmethod(counting))
        mp.setattr(canon, "working_names", naming)
        manager.run_passes(m, ("normalize",), Options())
    return slots[0], named[0]


@pytest.mark.parametrize("shape", sorted(frontend.SHAPES))
def test_normalize_work_is_linear_in_statements(shape, monkeypatch):
    """A product merged into its user is named about once a statement. The chain of
    matrix products was renamed on each of `rewrite.MAX_STEPS` rebuilds: 32 products
    named and 5,700 operand slots a statement (now 2.3 and 240: each link merges into
    the next up to `rewrite.MERGE_MOST` factors, so a statement rebuilds a product of
    32 factors on average)."""
    gen = frontend.SHAPES[shape]
    (slots, named), (slots4, named4) = (normalize_work(gen(n), monkeypatch) for n in (400, 1600))
    assert slots4 <= 4.2 * slots + 50 and named4 <= 4.2 * named + 5, (shape, slots, slots4, named, named4)
    assert slots4 <= 300 * 1600 and named4 <= 3 * 1600, (shape, slots4, named4)


def test_naming_a_named_product_gives_it_back():
    """Canonical naming is idempotent: the normalized product of a 32-link matrix chain
    (summed edges k.1 ... k.15 and m.1 ... m.15, of which structure alone cannot order
    those far from the ends) built again from its own factors is the same value."""
    m = manager.run_passes(elaborate_source(frontend.chain_matmul(32), "chain.tg", Options()).module,
                           ("normalize",), Options())
    product = m.outputs[0].value
    while product.op != "contract":
        product = product.operands[0]
    assert len(product.operands) == 33 and any(e.endswith(".10") for o in product.operands for e in o.edges)
    assert canon.Canon(m).contract(product.operands, product.edges) is product


def test_check_runs_the_derivative_passes_only_for_derivatives(tmp_path, monkeypatch):
    """A program without grad, jvp or vjp has no derivative rule to miss: `tgc check`
    runs no pass on it (normalize's work grows with the program); one that takes a
    derivative gets `CHECK_PASSES` (tests/cli/test_cli.py: its missing rules)."""
    ran = []
    real = manager.run_passes
    monkeypatch.setattr(manager, "run_passes", lambda m, specs, *a, **k: ran.append(specs) or real(m, specs, *a, **k))
    for shape, gen in sorted(frontend.SHAPES.items()):
        path = tmp_path / f"{shape}.tg"
        path.write_text(gen(50))
        pipeline.check_program(str(path), Options())
    assert ran == []
    path = tmp_path / "grad.tg"
    path.write_text("dim a = 3\ninput x[a]\nout g[a] = grad(sum(tanh(x)), x)\n")
    pipeline.check_program(str(path), Options())
    assert ran == [pipeline.CHECK_PASSES]
