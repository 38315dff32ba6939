"""Declared facts (`assume RELATION`): what the optimizer may read from them, inputs
that satisfy them, and their check at run time.

A fact `assume lhs REL rhs` holds elementwise over the union of both sides' edges.
The compiler trusts it: a rewrite that uses it is exact for inputs where it holds
(as real numbers; in floating point the rewritten program differs from the original
by the rounding of the side it replaced, e.g. of `sum[v](y)` from 1).

- `arg_bounds(module)`: for each argument, the sign and upper bound that its facts
  give (`x > 0`, `y >= 0`, `p <= 1`, and the mirrored `0 < x`): the input to
  `tgc.opt.facts.Facts`.
- `equalities(module)`: the facts `side = constant` (and `constant = side`), whose
  side simplify may replace by the constant (`sum[v](y) = 1`).
- `satisfy(module, inputs, env)`: seeded random inputs moved onto the facts that name
  one argument directly (`x > 0`: |x| + 0.5; `sum[E](y) = c`: y made positive and
  scaled so each sum is c), so that `--verify-each` and `--random-inputs` run on
  inputs where the optimizer's assumptions hold.
- `check_facts(module, inputs, env, dtype)`: evaluates each fact with the IR
  interpreter (its sides read only arguments: one pass over the inputs it names and
  one reduction), and raises `EvalError` naming the first fact that does not hold,
  its source line and an element where it fails. Comparisons are exact; an equality
  allows |lhs - rhs| <= 4·n·eps·max(1, |rhs|), with eps the float type's machine
  epsilon and n the number of input elements summed into one element of the fact
  (the product of the sizes of the edges that its values carry and it does not), the
  bound on the rounding error of a sum of n terms.

Everything here is a finite walk over the facts' values (a DAG), so it terminates.
"""
from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from tgc.ir.interp import EvalError, NP_DTYPES
from tgc.ir.module import Fact, Module
from tgc.ir.values import Value, topo_order

_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "=": "=", "!=": "!="}


def _const(v: Value) -> float | None:
    return float(v.attrs[0]) if v.op == "const" else None


def _oriented(f: Fact) -> tuple[Value, str, float] | None:
    """(side, rel, c) with the constant on the right, or None when neither side is one."""
    c = _const(f.rhs)
    if c is not None and _const(f.lhs) is None:
        return f.lhs, f.rel, c
    c = _const(f.lhs)
    if c is not None and _const(f.rhs) is None:
        return f.rhs, _FLIP[f.rel], c
    return None


def _arg_name(v: Value) -> str | None:
    while v.op == "rename":
        v = v.operands[0]
    return v.attrs[0] if v.op == "arg" else None


def arg_bounds(module: Module) -> dict[str, tuple[str | None, float]]:
    """name -> (sign "pos" | "nonneg" | None, upper bound) that the facts give each argument."""
    out: dict[str, tuple[str | None, float]] = {}
    for f in module.facts:
        o = _oriented(f)
        if o is None or _arg_name(o[0]) is None:
            continue
        side, rel, c = o
        name = _arg_name(side)
        sign, hi = out.get(name, (None, math.inf))
        if rel in (">", ">=", "=") and (c > 0 or (c == 0 and rel == ">")):
            sign = "pos"
        elif rel in (">=", "=") and c == 0 and sign != "pos":
            sign = "nonneg"
        if rel in ("<", "<=", "="):
            hi = min(hi, c)
        out[name] = (sign, hi)
    return out


def equalities(module: Module) -> list[tuple[Value, float]]:
    """(side, c) for every fact `side = c` with c a constant and side not one."""
    out = []
    for f in module.facts:
        o = _oriented(f)
        if o is not None and o[1] == "=":
            out.append((o[0], o[2]))
    return out


def _sum_of_arg(v: Value) -> tuple[str, tuple[str, ...]] | None:
    """(arg, summed edges) when v is a plain sum of one argument over some edges."""
    if v.op == "contract" and len(v.operands) == 1 and _arg_name(v.operands[0]) is not None:
        x = v.operands[0]
        if x.op == "arg":
            return x.attrs[0], tuple(e for e in x.edges if e not in v.edges)
    if v.op == "reduce" and v.attrs[0] == "sum" and v.operands[0].op == "arg":
        return v.operands[0].attrs[0], tuple(v.attrs[1])
    return None


def satisfy(module: Module, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`inputs` (random, in ABI order) changed in place to meet the facts that name one
    argument: signs (`x > 0`, `x >= 0`, `x >= c`), upper bounds (`x <= c`) and sums
    of one argument equal to a positive constant. Other facts are left as they are."""
    facts = [o for o in map(_oriented, module.facts) if o is not None]
    for side, rel, c in facts:   # bounds first: a sum's normalization keeps them
        name = _arg_name(side)
        if name is None or side.op != "arg" or name not in inputs:
            continue
        a = inputs[name]
        if rel in (">", ">="):
            a[...] = np.where(a > c if rel == ">" else a >= c, a, np.abs(a) + c + 0.5)
        elif rel in ("<", "<="):
            a[...] = np.where(a < c if rel == "<" else a <= c, a, c - np.abs(a) - 0.5)
        elif rel == "=":
            a[...] = c
    for side, rel, c in facts:
        summed = _sum_of_arg(side)
        if summed is not None and rel == "=" and c > 0 and summed[0] in inputs:
            name, edges = summed
            order = module.args[name].order
            a = inputs[name]
            p = np.abs(a) + 0.1
            a[...] = p / p.sum(axis=tuple(order.index(e) for e in edges), keepdims=True) * c
    return inputs


def _aligned(vals: Mapping[int, np.ndarray], v: Value, edges: tuple[str, ...]) -> np.ndarray:
    a = np.asarray(vals[id(v)])
    return a.reshape([a.shape[v.edges.index(e)] if e in v.edges else 1 for e in edges])


def check_facts(module: Module, inputs: Mapping[str, np.ndarray], dims: Mapping[str, int] | None = None,
                dtype: str | None = None) -> None:
    """Raise EvalError when a fact of `module` does not hold on `inputs` (see the module
    docstring for the tolerance of an equality)."""
    if not module.facts:
        return
    from tgc.ir.interp import _Eval, bind_dims, check_inputs

    env = bind_dims(module, {k: v for k, v in inputs.items() if k in module.args}, dims)
    args = check_inputs(module, inputs, env, dtype)
    ev = _Eval(module, env, args, dtype)
    sizes = module.edge_sizes(env)
    with np.errstate(all="ignore"):
        vals = ev.run([x for f in module.facts for x in (f.lhs, f.rhs)])
        for f in module.facts:
            edges = tuple(sorted(set(f.lhs.edges) | set(f.rhs.edges)))
            lhs, rhs = _aligned(vals, f.lhs, edges), _aligned(vals, f.rhs, edges)
            ok = _holds(f, lhs, rhs, edges, sizes, dtype or f.lhs.dtype)
            if not np.all(ok):
                _violated(f, ok, np.broadcast_to(lhs, ok.shape), np.broadcast_to(rhs, ok.shape), edges)


def _holds(f: Fact, lhs, rhs, edges, sizes, dtype: str) -> np.ndarray:
    if f.rel == "=":
        inner = {e for v in topo_order([f.lhs, f.rhs]) for e in v.edges} - set(edges)
        n = math.prod(sizes[e] for e in inner) if inner else 1
        eps = float(np.finfo(NP_DTYPES[dtype if dtype != "i32" else "f64"]).eps)
        return np.abs(lhs - rhs) <= 4 * n * eps * np.maximum(1.0, np.abs(rhs))
    test = {"!=": np.not_equal, "<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal}
    return test[f.rel](lhs, rhs)


def _violated(f: Fact, ok: np.ndarray, lhs, rhs, edges) -> None:
    pos = tuple(int(i) for i in np.argwhere(~ok)[0])
    where = ", ".join(f"{e}={i}" for e, i in zip(edges, pos))
    at = f" at [{where}]" if where else ""
    loc = f" ({f.loc})" if f.loc else ""
    raise EvalError(f"assumption '{f.text}'{loc} does not hold{at}: the left side is {float(lhs[pos]):.9g}, "
                    f"the right side {float(rhs[pos]):.9g}")
