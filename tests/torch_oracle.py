"""A second, independent evaluator of IR modules: PyTorch float64 tensors, torch.autograd.

Test-only (torch is never a runtime dependency of tgc). It evaluates the *elaborated*
module, before the adjoint and tangent passes, so its `grad`, `jvp` and `vjp` values
come from torch's own autograd and not from tgc's derivative rules: an oracle for them.

The structure mirrors `tgc.ir.interp`: each value is a tensor whose axes follow the
value's sorted edge names. Every float argument is a leaf with `requires_grad=True`
(in its ABI order; the `arg` op is a differentiable permutation of it), and every
derivative is taken with `create_graph=True`, so derivatives nest.

- `grad(f, x)`: for scalar `f`, `autograd.grad(f, x)`; otherwise the Jacobian, built row
  by row (one vjp per element of `f`), with the edges of both.
- `vjp(f, x, v)`: `autograd.grad(f, x, grad_outputs=v)`; edges of `v` beyond `f`'s are a
  batch: one vjp per index of them, stacked.
- `jvp(f, x, dx)`: the double-vjp trick (`u` a dummy cotangent; `g = vjp(f, x, u)` is
  linear in `u`, and `jvp = vjp(g, u, dx)`); extra edges of `dx` batch as for vjp.
- `custom` (a call with its own `with vjp(g)` rule): a `torch.autograd.Function` whose
  value is the body's and whose backward evaluates the rule with `g` bound, in torch
  ops on the forward tensors, so a second derivative differentiates the rule as tgc
  does. A jvp through one is refused: the double-vjp trick needs a rule linear in `g`.

Conventions of LANGUAGE.md section 8 that torch's own kernels do not share are written
out explicitly: two-argument `max`/`min` select with `where(a >= b, a, b)` so a tie sends
the gradient to the first argument (`torch.maximum` would split it); `max[e]`/`min[e]`
use `amax`/`amin`, which share a tie evenly, as the language asks.

`evaluate(module, inputs)` takes and returns numpy arrays exactly like
`tgc.ir.interp.evaluate`: outputs and updates, each in its ABI order.
"""
from __future__ import annotations

import itertools
from typing import Callable, Mapping

import numpy as np
import torch

from tgc.ir.interp import EvalError, bind_dims, check_inputs
from tgc.ir.module import Module
from tgc.ir.sizes import size_eval
from tgc.ir.values import Value, custom_parts, primal_order, topo_order

F64 = torch.float64


class _Eval:
    def __init__(self, module: Module, env: dict[str, int], args: dict[str, np.ndarray]):
        self.m, self.env = module, env
        self.sizes = module.edge_sizes(env)
        # one leaf per argument, in its ABI order; floats require grad
        self.leaves: dict[str, torch.Tensor] = {}
        for a in module.args.values():
            arr = args[a.name]
            if a.dtype == "i32":
                self.leaves[a.name] = torch.from_numpy(np.asarray(arr, dtype=np.int64))
            else:
                self.leaves[a.name] = torch.tensor(np.asarray(arr, dtype=np.float64), dtype=F64,
                                                   requires_grad=True)

    def shape(self, edges) -> list[int]:
        return [self.sizes[e] for e in edges]

    def expand(self, a: torch.Tensor, v: Value, edges: tuple[str, ...]) -> torch.Tensor:
        """`a` (axes = v.edges) with size-1 axes inserted so its axes are `edges`."""
        return a.reshape([self.sizes[e] if e in v.edges else 1 for e in edges])

    def run(self, roots: list[Value], vals: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
        """The values of `roots` (those in `vals` are known); a custom call's rules are
        evaluated only by its backward pass."""
        vals = {} if vals is None else vals
        for v in primal_order(roots):
            if id(v) in vals:
                continue
            if v.op == "custom":
                self.run(custom_parts(v)[1], vals)  # its arguments, which its body may not read
            ops = [vals[id(o)] for o in (v.operands[:1 + v.attrs[1]] if v.op == "custom" else v.operands)]
            if v.op == "custom":
                ops.append(vals)
            out = OPS[v.op](self, v, ops)
            if v.dtype != "i32" and out.dtype != F64:
                out = out.to(F64)
            want = self.shape(v.edges)
            if list(out.shape) != want:
                raise AssertionError(f"oracle bug: {v!r} has shape {list(out.shape)}, expected {want}")
            vals[id(v)] = out
        return vals


def _arg(ev: _Eval, v: Value, ops):
    a = ev.m.args[v.attrs[0]]
    return ev.leaves[a.name].permute([a.order.index(e) for e in v.edges])


def _const(ev: _Eval, v: Value, ops):
    return torch.full(ev.shape(v.edges), v.attrs[0], dtype=F64)


def _size(ev: _Eval, v: Value, ops):
    return torch.tensor(float(size_eval(ev.m.size(v.attrs[0]), ev.env)), dtype=F64)


def _add(ev: _Eval, v: Value, ops):
    total = torch.zeros(ev.shape(v.edges), dtype=F64)
    for c, o, a in zip(v.attrs[0], v.operands, ops):
        total = total + c * ev.expand(a, o, v.edges)
    return total


_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _contract(ev: _Eval, v: Value, ops):
    letters: dict[str, str] = {}

    def sub(edges):
        return "".join(letters.setdefault(e, _LETTERS[len(letters)]) for e in edges)

    inputs = ",".join(sub(o.edges) for o in v.operands)
    present = [e for e in v.edges if any(e in o.edges for o in v.operands)]
    out = torch.einsum(f"{inputs}->{sub(present)}", *ops)
    shape = [ev.sizes[e] if e in present else 1 for e in v.edges]
    return out.reshape(shape).expand(ev.shape(v.edges))


def _max2(a, b):
    return torch.where(a >= b, a, b)  # a tie sends the gradient to the first argument


def _min2(a, b):
    return torch.where(a <= b, a, b)


def _mul0(a, b):
    return torch.where(a == 0, torch.zeros((), dtype=F64), a * b)


def _mul00(a, b):
    return torch.where((a == 0) | (b == 0), torch.zeros((), dtype=F64), a * b)


def _cmp(fn):
    return lambda a, b: fn(a, b).to(F64)  # a 0/1 float: no derivative flows through it


MAP_FNS: dict[str, Callable] = {
    "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "tanh": torch.tanh, "erf": torch.erf,
    "sin": torch.sin, "cos": torch.cos, "abs": torch.abs, "sign": torch.sign,
    "log1p": torch.log1p, "expm1": torch.expm1, "atan": torch.atan, "asinh": torch.asinh,
    "div": torch.div, "pow": torch.pow, "max": _max2, "min": _min2,
    "lt": _cmp(torch.lt), "le": _cmp(torch.le), "gt": _cmp(torch.gt), "ge": _cmp(torch.ge),
    "eq": _cmp(torch.eq), "ne": _cmp(torch.ne),
    "mul0": _mul0,
    "mul00": _mul00,
    "where": lambda c, a, b: torch.where(c != 0, a, b),
    "checkpoint": lambda x: x,   # the value; recomputing it in the backward pass is no concern here
    # conversions (docs/dtypes.md): the value rounded to the type, and its cotangent too
    "to_bf16": lambda x: _rounded(x, torch.bfloat16), "to_f16": lambda x: _rounded(x, torch.float16),
    "to_f32": lambda x: _rounded(x, torch.float32), "to_f64": lambda x: x,
}


def _rounded(x: torch.Tensor, t: torch.dtype) -> torch.Tensor:
    """`x` rounded to the type `t` (to nearest even) and kept in float64. Its derivative
    rounds the cotangent to `t` as well, as tgc's does (the cotangent of a value has the
    value's type, docs/dtypes.md), so a gradient that cancels to rounding noise (the sum of
    a layernorm) has the same noise."""
    return _Round.apply(x, t)


class _Round(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, t):
        ctx.t = t
        return x.to(t).to(F64)

    @staticmethod
    def backward(ctx, g):
        return _Round.apply(g, ctx.t), None


def _map(ev: _Eval, v: Value, ops):
    args = [ev.expand(a, o, v.edges) for o, a in zip(v.operands, ops)]
    return MAP_FNS[v.attrs[0]](*args).expand(ev.shape(v.edges))


def _reduce(ev: _Eval, v: Value, ops):
    kind, edges = v.attrs
    axes = tuple(v.operands[0].edges.index(e) for e in edges)
    if not axes:
        return ops[0]
    # amax/amin: the gradient of a tie is shared evenly among the extreme positions
    return (torch.amax if kind == "max" else torch.amin)(ops[0], dim=axes)


def _indicator(ev: _Eval, v: Value, ops):
    rel = v.attrs[0]
    n = len(v.edges)
    index = {e: np.arange(ev.sizes[e]).reshape([-1 if i == j else 1 for j in range(n)])
             for i, e in enumerate(v.edges)}
    held = np.broadcast_to(np.asarray(rel.holds(index, ev.env), dtype=np.float64), ev.shape(v.edges))
    return torch.tensor(np.array(held), dtype=F64)


def _check_ids(ev: _Eval, v: Value, ids: torch.Tensor) -> None:
    n = ev.sizes[v.attrs[0]]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise EvalError(f"{v.op} index out of range along '{v.attrs[0]}' (size {n})")


def _arange(ev: _Eval, e: str, edges) -> torch.Tensor:
    return torch.arange(ev.sizes[e]).reshape([-1 if x == e else 1 for x in edges])


def _gather(ev: _Eval, v: Value, ops):
    table, ids = v.operands
    edge = v.attrs[0]
    _check_ids(ev, v, ops[1])
    index = tuple(ev.expand(ops[1], ids, v.edges) if e == edge else _arange(ev, e, v.edges)
                  for e in table.edges)
    return ops[0][index]


def _scatter(ev: _Eval, v: Value, ops):
    ct, ids = v.operands
    edge = v.attrs[0]
    _check_ids(ev, v, ops[1])
    full = tuple(sorted(set(ct.edges) | set(ids.edges)))
    shape = ev.shape(full)
    values = ev.expand(ops[0], ct, full).expand(shape)
    index = tuple(ev.expand(ops[1], ids, full).expand(shape) if e == edge else
                  _arange(ev, e, full).expand(shape) for e in v.edges)
    if v.attrs[1] == "sum":
        out = torch.zeros(ev.shape(v.edges), dtype=F64)
        return out.index_put(index, values, accumulate=True)
    # a segment max/min: scatter_reduce over the flattened output, -inf/inf where empty
    shape = ev.shape(v.edges)
    flat = torch.zeros((), dtype=torch.int64)
    for i, n in zip(index, shape):
        flat = flat * n + i
    fill = float("-inf") if v.attrs[1] == "max" else float("inf")
    out = torch.full((int(torch.tensor(shape).prod()),), fill, dtype=F64)
    out = out.scatter_reduce(0, flat.reshape(-1), values.reshape(-1), "amax" if v.attrs[1] == "max" else "amin")
    return out.reshape(shape)


def _random(ev: _Eval, v: Value, ops):
    """`rand`/`randn`: Philox draws by the reference of tgc.ir.philox (checked against the
    published known-answer vectors in tests/e2e/test_random.py) at the row-major index
    over the sorted edges, in float64; constants to autograd (random values have zero
    derivative)."""
    from tgc.ir.philox import draw_numpy

    shape = [ev.sizes[e] for e in v.edges]
    counters = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.int64).reshape(shape)
    folds = tuple(np.int64(int(ops[int(n[1:])].reshape(()))) if isinstance(n, str) else n for n in v.attrs[1])
    drawn = draw_numpy(v.attrs[0], v.attrs[2] or "f64", int(ops[0].reshape(())), folds, counters)
    return torch.tensor(np.asarray(drawn, dtype=np.float64), dtype=F64)


def _rename(ev: _Eval, v: Value, ops):
    mapping = dict(v.attrs[0])
    renamed = [mapping.get(e, e) for e in v.operands[0].edges]
    return ops[0].permute([renamed.index(e) for e in v.edges])


# ---- derivatives, by torch.autograd ------------------------------------------------------

def _wrt(ev: _Eval, x: Value) -> tuple[torch.Tensor, list[int]]:
    """The leaf of arg `x` (ABI order) and the permutation from ABI to sorted edges."""
    a = ev.m.args[x.attrs[0]]
    return ev.leaves[a.name], [a.order.index(e) for e in x.edges]


def _vjp1(f: torch.Tensor, leaf: torch.Tensor, ct: torch.Tensor) -> torch.Tensor:
    """ct^T df/dleaf, in the leaf's shape; exactly zero where f does not depend on the leaf."""
    if f.requires_grad:
        (g,) = torch.autograd.grad(f, leaf, grad_outputs=ct, create_graph=True, retain_graph=True,
                                   allow_unused=True)
        if g is not None:
            return g
    return torch.zeros_like(leaf)


def _batched(ev: _Eval, t: torch.Tensor, t_edges: tuple[str, ...], batch: list[str],
             core: Callable[[torch.Tensor], torch.Tensor], core_edges: tuple[str, ...],
             out_edges: tuple[str, ...]) -> torch.Tensor:
    """Apply `core` to every slice of `t` along the `batch` edges and stack the results.

    `t` has axes `t_edges`; each slice handed to `core` has the other edges, sorted. `core`
    returns a tensor with axes `core_edges`; the stack has axes `out_edges`.
    """
    rest = [e for e in t_edges if e not in batch]
    t = t.permute([t_edges.index(e) for e in batch + rest])
    sizes = [ev.sizes[e] for e in batch]
    results = [core(t[idx] if batch else t) for idx in itertools.product(*map(range, sizes))]
    stacked = torch.stack(results).reshape(sizes + ev.shape(core_edges)) if batch else results[0]
    have = batch + list(core_edges)
    return stacked.permute([have.index(e) for e in out_edges])


def _grad(ev: _Eval, v: Value, ops):
    fv, xv = v.operands
    f, (leaf, perm) = ops[0], _wrt(ev, xv)
    if not fv.edges:
        return _vjp1(f, leaf, torch.ones((), dtype=F64)).permute(perm)
    # the Jacobian, one row per element of f: axes f.edges + x.edges
    rows = []
    for i in range(f.numel()):
        onehot = torch.zeros(f.numel(), dtype=F64)
        onehot[i] = 1.0
        rows.append(_vjp1(f, leaf, onehot.reshape(f.shape)).permute(perm))
    jac = torch.stack(rows).reshape(list(f.shape) + ev.shape(xv.edges))
    have = list(fv.edges) + list(xv.edges)
    return jac.permute([have.index(e) for e in v.edges])


def _vjp(ev: _Eval, v: Value, ops):
    fv, xv, cv = v.operands
    f, (leaf, perm) = ops[0], _wrt(ev, xv)
    extra = [e for e in cv.edges if e not in fv.edges]
    return _batched(ev, ops[2], cv.edges, extra,
                    lambda ct: _vjp1(f, leaf, ct).permute(perm), xv.edges, v.edges)


def _jvp(ev: _Eval, v: Value, ops):
    fv, xv, tv = v.operands
    f, (leaf, perm) = ops[0], _wrt(ev, xv)
    extra = [e for e in tv.edges if e not in xv.edges]
    abi = [perm.index(i) for i in range(len(perm))]  # sorted edges -> ABI order

    if any(w.op == "custom" for w in topo_order([fv])):
        raise NotImplementedError("the torch oracle's jvp (a double vjp) needs rules linear in the "
                                  "cotangent, which a custom vjp rule need not be")

    def core(dx: torch.Tensor) -> torch.Tensor:
        # double vjp: g(u) = u^T df/dx is linear in u, and d(g . dx)/du = (df/dx) dx
        u = torch.zeros_like(f, requires_grad=True)
        g = _vjp1(f, leaf, u)
        if not g.requires_grad:
            return torch.zeros_like(f)
        (t,) = torch.autograd.grad(g, u, grad_outputs=dx.permute(abi), create_graph=True,
                                   retain_graph=True, allow_unused=True)
        return torch.zeros_like(f) if t is None else t

    return _batched(ev, ops[2], tv.edges, extra, core, fv.edges, v.edges)


class _CustomVjp(torch.autograd.Function):
    """Value: the body's. Backward: the call's vjp rule, evaluated with its cotangent slot
    bound to `g`, from the forward tensors (graph-connected, so it differentiates again)."""

    @staticmethod
    def forward(ctx, ev, v, vals, y, *args):
        ctx.ev, ctx.v, ctx.vals = ev, v, vals
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        ev, v, vals = ctx.ev, ctx.v, ctx.vals
        _, args, vjps, _ = custom_parts(v)
        grads = []
        for a, rule in zip(args, vjps):
            local = dict(vals)
            for w in topo_order([rule], stop=local):
                if w.op == "slot" and w.attrs[0] == v.attrs[2]:
                    local[id(w)] = g
            d = ev.run([rule], local)[id(rule)]
            grads.append(None if a.dtype == "i32" else ev.expand(d, rule, a.edges).expand(ev.shape(a.edges)))
        return (None, None, None, None, *grads)


def _custom(ev: _Eval, v: Value, ops):
    if not v.attrs[2]:
        raise NotImplementedError(f"the torch oracle differentiates '{v.attrs[0]}' only by its vjp rule")
    vals = ops[-1]
    return _CustomVjp.apply(ev, v, vals, *ops[:-1])


def _loop(ev: _Eval, v: Value, ops):
    """Output `out` of the loop: the body run per index on torch tensors (so autograd
    differentiates through the steps), all outputs computed once per set of operand
    tensors: a loop inside another loop's body has the same operand Values at every outer
    step but new tensors, so the key names the tensors (kept alive with the entry, so
    their ids are not reused)."""
    body, edge, reverse, out = v.attrs
    cache = ev.__dict__.setdefault("loops", {})
    key = (body, edge, reverse) + tuple(map(id, ops))
    if key not in cache:
        n, nc = ev.sizes[edge], body.carries
        axes = [o.edges.index(edge) if edge in o.edges else -1 for o in v.operands]
        carry, stacked = list(ops[:nc]), [[] for _ in range(body.stacked)]
        for i in (range(n - 1, -1, -1) if reverse else range(n)):
            params = carry + [o.select(axes[k], i) if body.role(k) == "slice" else o
                              for k, o in enumerate(ops) if k >= nc]
            vals = ev.run(list(body.results), {id(p): t for p, t in zip(body.params, params)})
            results = [vals[id(r)] for r in body.results]
            carry = results[:nc]
            for j, y in enumerate(results[nc:]):
                stacked[j].append(y)
        outs = list(carry)
        for j, ys in enumerate(stacked):
            r = body.results[nc + j]
            outs.append(torch.stack(ys[::-1] if reverse else ys, dim=sorted(r.edges + (edge,)).index(edge)))
        cache[key] = (ops, outs)
    return cache[key][1][out]


def _slot(ev: _Eval, v: Value, ops):
    raise AssertionError(f"oracle bug: the placeholder '{v.attrs[0]}' is evaluated outside its rule")


OPS: dict[str, Callable] = {
    "custom": _custom, "slot": _slot,
    "arg": _arg, "const": _const, "size": _size, "add": _add, "contract": _contract,
    "map": _map, "reduce": _reduce, "indicator": _indicator, "gather": _gather, "scatter": _scatter,
    "rename": _rename, "stop": lambda ev, v, ops: ops[0].detach(), "random": _random,
    "grad": _grad, "jvp": _jvp, "vjp": _vjp, "loop": _loop,
}


def evaluate(module: Module, inputs: Mapping[str, np.ndarray], *,
             dims: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """Run the module in float64 torch; outputs and updates in ABI order, as numpy arrays."""
    missing = [n for n in module.args if n not in inputs]
    if missing:
        raise EvalError(f"missing input '{missing[0]}' (the program takes: {', '.join(module.args)})")
    env = bind_dims(module, {k: v for k, v in inputs.items() if k in module.args}, dims)
    args = check_inputs(module, inputs, env, "f64")
    ev = _Eval(module, env, args)
    vals = ev.run(module.roots())
    result: dict[str, np.ndarray] = {}
    for o in module.outputs:
        result[o.name] = _in_order(vals[id(o.value)], o.value.edges, o.order)
    for u in module.updates:
        result[u.target] = _in_order(vals[id(u.value)], u.value.edges, module.args[u.target].order)
    return result


def _in_order(t: torch.Tensor, edges: tuple[str, ...], order: tuple[str, ...]) -> np.ndarray:
    a = t.detach().permute([edges.index(e) for e in order]).contiguous().numpy()
    return np.array(a, dtype=np.float64 if t.dtype == F64 else a.dtype, order="C", copy=True)


def rel_error(got, want, floor: float) -> float:
    """Norm-wise relative error, |got - want| / max(|want|, floor) (Frobenius norms);
    non-finite entries must agree exactly (the same inf, or both NaN), and a shape
    that differs is an error of inf."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return float("inf")
    fin_g, fin_w = np.isfinite(got), np.isfinite(want)
    if not np.array_equal(fin_g, fin_w):
        return float("inf")
    bad = ~fin_w
    if bad.any() and not np.array_equal(got[bad], want[bad], equal_nan=True):
        return float("inf")
    d = np.linalg.norm((got - want)[fin_w])
    return float(d / max(np.linalg.norm(want[fin_w]), floor))
