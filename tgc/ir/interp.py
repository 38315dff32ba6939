"""The reference interpreter: evaluates a module with numpy, at any pipeline stage.

It is the correctness oracle for every pass and backend, so it is written for
clarity, not speed: each value is a numpy array whose axes follow the value's
sorted edge names; indicators are built densely (a contraction keeps their 0 exact
against a NaN or an inf of its other operands: index arithmetic); gathers check their ids. Each op
computes in float64 and rounds its result once to the value's float type, so an f32
value is the float64 one, rounded (sums of any length included); a softmax's weight
`exp(d - lse)` (an f32 exp of a sum with a logsumexp term) reads the sum before it is
rounded (`tgc.lower.lowered.wide_exp`).

`evaluate(module, inputs)` binds symbolic dims from the input shapes (given in
each argument's ABI order) and returns one array per output and per update
(named as its target), each in its ABI order.
"""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from tgc.ir.complex_io import complex_outputs, pairs_inputs
from tgc.ir.input_checks import EvalError, check_element_type, check_ids_fit, check_names, check_shape
from tgc.ir.module import Arg, Module
from tgc.ir.philox import draw_numpy
from tgc.ir.sizes import MAX_SIZE, SizeError, UnboundDim, size_eval
from tgc.ir.dtypes import LOW_FLOATS, SCALAR_TYPES, is_low_array, round_to
from tgc.ir.ops import NUMPY
from tgc.ir.values import Value, holds_logsumexp, primal_order

NP_DTYPES = SCALAR_TYPES   # {type name: numpy scalar type}; bf16: ml_dtypes.bfloat16


def bind_dims(module: Module, inputs: Mapping[str, np.ndarray],
              given: Mapping[str, int] | None = None, given_as: str = "--dim",
              check_given: bool = False) -> dict[str, int]:
    """Sizes of every dim: `given`, then symbolic dims read off the input shapes
    (anything with a shape; every argument's), then the derived ones. The one binder
    of the interpreters and the runtime; `given_as` names where `given` came from in
    messages ("--dim", "dims="). With `check_given` (a caller's own dims=), each given
    dim is checked (`Module.dim_error`); the interpreters' callers pass dims they
    made (the pass checker's, say), which a pass may have made unused."""
    env: dict[str, int] = dict(given or {})
    for d, n in env.items() if check_given else ():
        why = module.dim_error(d, n)
        if why:
            raise EvalError(f"{given_as}: {why}")
    where: dict[str, str] = {d: given_as for d in env}
    for arg in module.args.values():
        shape = np.shape(inputs[arg.name])
        if len(shape) != len(arg.order):
            raise EvalError(f"input '{arg.name}' has {len(shape)} axes, expected {len(arg.order)} "
                            f"([{', '.join(arg.order)}])")
        for axis, edge in enumerate(arg.order):
            dim, n = module.edges[edge], int(shape[axis])
            if module.dims[dim] is not None:
                continue
            if dim in env and env[dim] != n:
                raise EvalError(f"input '{arg.name}': edge '{edge}' has size {n}, "
                                f"but dim '{dim}' is {env[dim]} (from {where[dim]})")
            env.setdefault(dim, n)
            where.setdefault(dim, f"input '{arg.name}'")
    try:
        return module.bind_dims(env)
    except UnboundDim as e:
        how = given_as
        if given_as == "dims=":   # a keyword call, program(x=...), takes no dims=: say where it goes
            how = "dims= (program.run(arrays, dims={...}), or fixed when compiling: tgc.compile(..., dims={...}))"
        raise EvalError(f"{e}: no input has it; pass its size with {how}") from None
    except SizeError as e:
        raise EvalError(str(e)) from None


def check_inputs(module: Module, inputs: Mapping[str, np.ndarray], env: Mapping[str, int],
                 float_dtype: str | None = None) -> dict[str, np.ndarray]:
    """Validated copies of the inputs: names, ranks, sizes and dtypes checked
    (`tgc.ir.input_checks`, as a compiled program checks them)."""
    check_names(tuple(module.args), inputs)
    out = {}
    for arg in module.args.values():
        out[arg.name] = _check_one(module, arg, np.asarray(inputs[arg.name]), env, float_dtype)
    return out


def _check_one(module: Module, arg: Arg, a: np.ndarray, env, float_dtype) -> np.ndarray:
    check_shape(arg.name, a.shape, tuple(env[module.edges[e]] for e in arg.order), arg.order)
    check_element_type(arg.name, a.dtype, arg.dtype, numbers=True)
    if arg.dtype == "i32":
        check_ids_fit(arg.name, a)
        return a.astype(np.int32)
    if arg.dtype in LOW_FLOATS:   # bf16/f16 stay themselves; --dtype overrides f32/f64 only
        return round_to(a, arg.dtype)
    return a.astype(NP_DTYPES[float_dtype or arg.dtype])


class _Eval:
    def __init__(self, module: Module, env: dict[str, int], args: dict[str, np.ndarray],
                 float_dtype: str | None):
        self.m, self.env, self.args = module, env, args
        self.sizes = module.edge_sizes(env)
        self.float_dtype = float_dtype
        self.params: list[np.ndarray] = []   # a loop body's parameters, while it runs
        self.lse_params: frozenset[int] = frozenset()   # ... those bound to a log-sum-exp (holds_lse)
        self.param_src: dict[int, tuple[str, tuple[str, ...]]] = {}   # ... those that are an input's slices:
        #   its name and the fixed indices ("l=1") of the enclosing steps, for an out-of-range id's message
        self.loops: dict[tuple, list[np.ndarray]] = {}   # a loop's outputs, computed once for all

    def source(self, v: Value) -> tuple[str, tuple[str, ...]] | None:
        """The input `v` reads, with the indices fixed by enclosing loop steps, or None."""
        if v.op == "arg":
            return v.attrs[0], ()
        if v.op == "loopvar":
            return self.param_src.get(v.attrs[0])
        return None

    def np_dtype(self, v: Value):
        return NP_DTYPES[self.float_dtype if self.float_dtype and v.dtype in ("f32", "f64") else v.dtype]

    def expand(self, a: np.ndarray, v: Value, edges: tuple[str, ...]) -> np.ndarray:
        """`a` (axes = v.edges) with size-1 axes inserted so its axes are `edges`."""
        shape = [self.sizes[e] if e in v.edges else 1 for e in edges]
        return a.reshape(shape)

    def run(self, roots: list[Value]) -> dict[int, np.ndarray]:
        vals: dict[int, np.ndarray] = {}
        for v in primal_order(roots):  # a custom value's derivative rules are not evaluated
            self.check_size(v)
            ops = [_wide(vals[id(o)]) for o in (v.operands[:1] if v.op == "custom" else v.operands)]
            if self.exp_of_sum(v):   # exp(d - lse): the sum as computed, before its rounding
                o = v.operands[0]
                ops = [_add(self, o, [_wide(vals[id(x)]) for x in o.operands])]
            try:
                out = np.asarray(OPS[v.op](self, v, ops))
                vals[id(v)] = (round_to(out, v.dtype) if v.dtype in LOW_FLOATS
                               else out.astype(self.np_dtype(v), copy=False))
            except MemoryError:
                raise EvalError(f"not enough memory for a value over [{', '.join(v.edges)}] "
                                f"({self.elements(v)} elements)") from None
        return vals

    def exp_of_sum(self, v: Value) -> bool:
        """Whether `v` is an f32 softmax weight exp(d - lse): an exp of a sum with a
        logsumexp term, which reads the sum in float64, unrounded (the lowered
        programs' rule, `tgc.lower.lowered.wide_exp`: to f32's precision, not |d - lse| ulps)."""
        if v.op != "map" or v.attrs[0] != "exp" or v.operands[0].op != "add":
            return False
        if not any(self.holds_lse(x) for x in v.operands[0].operands):
            return False
        return all(x.dtype not in LOW_FLOATS and self.np_dtype(x) == np.float32 for x in (v, v.operands[0]))

    def holds_lse(self, x: Value) -> bool:
        """Whether `x` is a log-sum-exp (`holds_logsumexp`), a parameter of the loop body
        running bound to one from outside included (`lse_params`)."""
        return holds_logsumexp(x, lambda v: v.op == "loopvar" and v.attrs[0] in self.lse_params)

    def elements(self, v: Value) -> int:
        n = 1
        for e in v.edges:
            n *= self.sizes[e]
        return n

    def check_size(self, v: Value) -> None:
        """A value whose bytes (in float64, as computed) exceed 2^62, or that has more
        edges than a numpy array has axes (MAX_AXES), is an error, not numpy's 'array is
        too big' or 'maximum supported dimension' (an internal error)."""
        if len(v.edges) > MAX_AXES:
            raise EvalError(f"a value over {len(v.edges)} edges: the interpreter (numpy) holds at most "
                            f"{MAX_AXES} edges per value; the cpu backend runs it")
        if self.elements(v) * 8 > MAX_SIZE:
            raise EvalError(f"a value over [{', '.join(v.edges)}] has {self.elements(v)} elements: "
                            f"more than 2^62 bytes")


MAX_AXES = 64   # numpy's most axes per array (NPY_MAXDIMS in numpy 2)


def _wide(a: np.ndarray) -> np.ndarray:
    """f32 operands in float64: every op computes in float64 and its result is rounded
    once to the value's type, so a sum of any length, or exp near 1, is as accurate as
    f32 can hold (numpy's own f32 sums and functions are not always correctly rounded)."""
    return a.astype(np.float64) if a.dtype == np.float32 or is_low_array(a) else a


def _arg(ev: _Eval, v: Value, ops):
    a = ev.m.args[v.attrs[0]]
    arr = ev.args[a.name]
    return np.transpose(arr, [a.order.index(e) for e in v.edges])


def _const(ev: _Eval, v: Value, ops):
    if v.dtype in LOW_FLOATS:
        return round_to(np.full([ev.sizes[e] for e in v.edges], v.attrs[0]), v.dtype)
    return np.full([ev.sizes[e] for e in v.edges], v.attrs[0], dtype=ev.np_dtype(v))


def _size(ev: _Eval, v: Value, ops):
    return np.asarray(float(size_eval(ev.m.size(v.attrs[0]), ev.env)))


def _add(ev: _Eval, v: Value, ops):
    total = np.zeros([ev.sizes[e] for e in v.edges], dtype=np.float64 if v.dtype in LOW_FLOATS else ev.np_dtype(v))
    for c, o, a in zip(v.attrs[0], v.operands, ops):
        total = total + c * ev.expand(a, o, v.edges)
    return total


def _contract(ev: _Eval, v: Value, ops):
    present = [e for e in v.edges if any(e in o.edges for o in v.operands)]
    if _index_products(v, ops):
        out = _strong_zero_contract(ev, v, ops, present)
    else:
        out = _einsum(ev, v, ops, present)
    shape = [ev.sizes[e] if e in present else 1 for e in v.edges]
    return np.broadcast_to(out.reshape(shape), [ev.sizes[e] for e in v.edges])


def _einsum(ev: _Eval, v: Value, ops, present: list[str]):
    """The contraction by numpy's einsum, over `present` (in that order). einsum names
    at most len(_LETTERS) edges: past that, the edges of size 1 (index 0 only) leave the
    subscripts, their axes squeezed, and come back as axes of length 1. einsum takes at
    most 63 operands: past _EINSUM_MOST, the first ones are contracted into one operand
    first (over the edges no later operand and not the result has), again until few
    enough remain (a product of many factors: the gradient of a long chain of tanh)."""
    names = list(dict.fromkeys([*present, *(e for o in v.operands for e in o.edges)]))
    keep = names if len(names) <= len(_LETTERS) else [e for e in names if ev.sizes[e] != 1]
    if len(keep) > len(_LETTERS):
        raise EvalError(f"a contraction over {len(keep)} edges longer than 1 (the interpreter's einsum "
                        f"names at most {len(_LETTERS)})")
    letters = {e: _LETTERS[i] for i, e in enumerate(keep)}
    if len(keep) < len(names):
        ops = [np.squeeze(a, axis=tuple(i for i, e in enumerate(o.edges) if e not in letters))
               for o, a in zip(v.operands, ops)]
    subs = ["".join(letters[e] for e in o.edges if e in letters) for o in v.operands]
    result = "".join(letters[e] for e in present if e in letters)
    ops = list(ops)
    while len(ops) > _EINSUM_MOST:   # fold the first operands into one, keeping the edges still needed
        head, rest = subs[:_EINSUM_MOST], subs[_EINSUM_MOST:]
        needed = set(result).union(*rest)
        sub = "".join(dict.fromkeys(c for s in head for c in s if c in needed))
        ops = [np.einsum(f"{','.join(head)}->{sub}", *ops[:_EINSUM_MOST], optimize=True), *ops[_EINSUM_MOST:]]
        subs = [sub, *rest]
    out = np.einsum(f"{','.join(subs)}->{result}", *ops, optimize=len(ops) > 2)
    return out.reshape([ev.sizes[e] for e in present])


_EINSUM_MOST = 32   # operands of one einsum call (numpy takes at most 63)


def _index_products(v: Value, ops) -> bool:
    """Whether a contraction reads an indicator and a non-finite entry of another operand:
    an indicator is index arithmetic (LANGUAGE.md section 6: `x[t = s + k]` is `x @ [t =
    s + k]`, 0 where the relation fails), so its 0 is an exact 0 that a NaN or an inf of
    the other operands does not turn into NaN (the backends read only the indexed
    entries; numpy's dense product would give NaN * 0 = NaN and spread it over the sum:
    a stream's blocks joined back over their edge would all be NaN where one is)."""
    kinds = [o.op == "indicator" for o in v.operands]
    if not any(kinds) or all(kinds):
        return False
    with np.errstate(all="ignore"):
        return not all(np.isfinite(a).all() for a, k in zip(ops, kinds) if not k)


_JOINT_MOST = 1 << 24   # the most elements of a strong-zero contraction's joint product at once


def _strong_zero_contract(ev: _Eval, v: Value, ops, present: list[str]):
    """The contraction over `present` with each term that an indicator zeroes exactly 0:
    the operands' joint product over all their edges (IEEE for the other operands), kept
    where every indicator holds, summed over the contracted edges; in slices along the
    first kept edge longer than 1 while the joint is over _JOINT_MOST elements."""
    edges = list(dict.fromkeys([*present, *(e for o in v.operands for e in o.edges)]))
    joint = int(np.prod([ev.sizes[e] for e in edges], dtype=np.int64))
    long = [e for e in present if ev.sizes[e] > 1]
    if joint > _JOINT_MOST and long:
        e, parts = long[0], []
        for i in range(ev.sizes[e]):
            sl = [a[tuple(slice(i, i + 1) if x == e else slice(None) for x in o.edges)] if e in o.edges else a
                  for o, a in zip(v.operands, ops)]
            parts.append(_strong_zero_contract(_Sliced(ev, e), v, sl, present))
        return np.concatenate(parts, axis=present.index(e))

    def spread(o: Value, a):   # a over all edges: its axes moved to their places, 1 elsewhere
        a = np.transpose(np.asarray(a), [o.edges.index(e) for e in edges if e in o.edges])
        return a.reshape([a.shape[[x for x in edges if x in o.edges].index(e)] if e in o.edges else 1
                          for e in edges])

    dense, held = np.float64(1.0), True
    with np.errstate(all="ignore"):
        for o, a in zip(v.operands, ops):
            if o.op == "indicator":
                held = held & (spread(o, a) != 0)
            dense = dense * spread(o, a)
        terms = np.where(held, dense, 0)   # over every edge: each is some operand's
        return terms.sum(axis=tuple(range(len(present), len(edges))))


class _Sliced:
    """An evaluator's sizes with one edge of size 1 (a slice of a strong-zero contraction)."""

    def __init__(self, ev, edge: str):
        self.sizes = {**ev.sizes, edge: 1}


_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


# each elementwise function's float semantics (tgc.ir.ops.FNS), shared with tgc.lower.interp
MAP_FNS: dict[str, Callable] = NUMPY


def _logsumexp(x, axis):
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)  # all -inf stays -inf; an inf stays inf
    return np.log(np.sum(np.exp(x - m), axis=axis)) + np.squeeze(m, axis=axis)


def _map(ev: _Eval, v: Value, ops):
    args = [ev.expand(a, o, v.edges) for o, a in zip(v.operands, ops)]
    with np.errstate(all="ignore"):
        out = MAP_FNS[v.attrs[0]](*args)
    return np.broadcast_to(out, [ev.sizes[e] for e in v.edges])


def _reduce(ev: _Eval, v: Value, ops):
    kind, edges = v.attrs
    x = v.operands[0]
    axes = tuple(x.edges.index(e) for e in edges)
    with np.errstate(all="ignore"):
        return {"max": np.max, "min": np.min, "logsumexp": _logsumexp}[kind](ops[0], axis=axes)


def _indicator(ev: _Eval, v: Value, ops):
    rel = v.attrs[0]
    n = len(v.edges)
    index = {e: np.arange(ev.sizes[e]).reshape([-1 if i == j else 1 for j in range(n)])
             for i, e in enumerate(v.edges)}
    held = rel.holds(index, ev.env)
    return np.broadcast_to(np.asarray(held, dtype=ev.np_dtype(v)), [ev.sizes[e] for e in v.edges])


def _check_ids(ev: _Eval, v: Value, ids: Value, a: np.ndarray) -> None:
    edge = v.attrs[0]
    n = ev.sizes[edge]
    bad = (a < 0) | (a >= n)
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        where = ", ".join(f"{e}={i}" for e, i in zip(ids.edges, pos))
        src = ev.source(ids)
        if src is not None:
            where = ", ".join(src[1] + ((where,) if where else ()))
        src = f"'{src[0]}'" if src is not None else "the index tensor"
        raise EvalError(f"{v.op} index out of range: {src}[{where}] = {int(a[pos])}, "
                        f"but edge '{edge}' has size {n}")


def _gather(ev: _Eval, v: Value, ops):
    table, ids = v.operands
    edge = v.attrs[0]
    _check_ids(ev, v, ids, ops[1])
    index = []
    for e in table.edges:
        if e == edge:
            index.append(ev.expand(ops[1], ids, v.edges))
        else:
            index.append(np.arange(ev.sizes[e]).reshape([-1 if x == e else 1 for x in v.edges]))
    return ops[0][tuple(index)]


def _scatter(ev: _Eval, v: Value, ops):
    ct, ids = v.operands
    edge = v.attrs[0]
    _check_ids(ev, v, ids, ops[1])
    full = tuple(sorted(set(ct.edges) | set(ids.edges)))
    shape = [ev.sizes[e] for e in full]
    values = np.broadcast_to(ev.expand(ops[0], ct, full), shape)
    index = tuple(np.broadcast_to(ev.expand(ops[1], ids, full), shape) if e == edge else
                  np.arange(ev.sizes[e]).reshape([-1 if x == e else 1 for x in full])
                  for e in v.edges)
    kind = v.attrs[1]
    out = np.full([ev.sizes[e] for e in v.edges], SCATTER_INIT[kind], dtype=values.dtype)
    SCATTER_COMBINE[kind].at(out, index, values)   # maximum/minimum propagate NaN, as max does
    return out


SCATTER_INIT = {"sum": 0.0, "max": -np.inf, "min": np.inf}
SCATTER_COMBINE = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def _random(ev: _Eval, v: Value, ops):
    """Philox draws (tgc.ir.philox) at the row-major linear index over the sorted edges."""
    shape = [ev.sizes[e] for e in v.edges]
    dtype = v.attrs[2] or ("f64" if ev.np_dtype(v) == np.float64 else "f32")   # bf16/f16: drawn in f32, rounded
    counters = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.int64).reshape(shape)
    folds = tuple(np.int64(np.asarray(ops[int(n[1:])]).reshape(())) if isinstance(n, str) else n for n in v.attrs[1])
    return draw_numpy(v.attrs[0], dtype, int(np.asarray(ops[0]).reshape(())), folds, counters)


def _rename(ev: _Eval, v: Value, ops):
    mapping = dict(v.attrs[0])
    renamed = [mapping.get(e, e) for e in v.operands[0].edges]
    return np.transpose(ops[0], [renamed.index(e) for e in v.edges])


def _not_differentiated(ev: _Eval, v: Value, ops):
    raise EvalError(f"'{v.op}' is not differentiated yet: run the adjoint and tangent passes first")


def _loop(ev: _Eval, v: Value, ops):
    """Output `out` of the loop: the body run once per index of the edge, in order
    (downwards when `reverse`), each run on its own evaluator over the step's params."""
    body, edge, reverse, out = v.attrs
    key = (body, edge, reverse) + tuple(map(id, v.operands))
    if key not in ev.loops:
        ev.loops[key] = _run_loop(ev, v, ops)
    return ev.loops[key][out]


def _run_loop(ev: _Eval, v: Value, ops) -> list[np.ndarray]:
    body, edge, reverse, _ = v.attrs
    n = ev.sizes[edge]
    axes = [o.edges.index(edge) if edge in o.edges else -1 for o in v.operands]
    carry = list(ops[:body.carries])
    stacked: list[list[np.ndarray]] = [[] for _ in range(body.stacked)]
    lse = frozenset(k for k, o in enumerate(v.operands) if body.role(k) == "invariant" and ev.holds_lse(o))
    for i in (range(n - 1, -1, -1) if reverse else range(n)):
        step = _Eval(ev.m, ev.env, ev.args, ev.float_dtype)
        step.lse_params = lse
        step.param_src = {k: (src[0], src[1] + ((f"{edge}={i}",) if body.role(k) == "slice" else ()))
                          for k, o in enumerate(v.operands) if k >= body.carries
                          for src in [ev.source(o)] if src is not None}
        step.params = carry + [np.take(a, i, axis=axes[k]) if body.role(k) == "slice" else a
                               for k, a in enumerate(ops) if k >= body.carries]
        vals = step.run(list(body.results))
        results = [_wide(vals[id(r)]) for r in body.results]
        carry = results[:body.carries]
        for j, y in enumerate(results[body.carries:]):
            stacked[j].append(y)
    outs = list(carry)
    for j, ys in enumerate(stacked):
        r = body.results[body.carries + j]
        if reverse:
            ys = ys[::-1]
        outs.append(np.stack(ys, axis=tuple(sorted(r.edges + (edge,))).index(edge)))
    return outs


def _slot(ev: _Eval, v: Value, ops):
    raise EvalError(f"the placeholder '{v.attrs[0]}' of a custom derivative rule has no value")


OPS: dict[str, Callable] = {
    "arg": _arg, "const": _const, "size": _size, "add": _add, "contract": _contract,
    "map": _map, "reduce": _reduce, "indicator": _indicator, "gather": _gather, "scatter": _scatter,
    "random": _random, "rename": _rename, "stop": lambda ev, v, ops: ops[0],
    "grad": _not_differentiated, "jvp": _not_differentiated, "vjp": _not_differentiated,
    "custom": lambda ev, v, ops: ops[0], "slot": _slot,  # a custom call's value is its body's
    "loopvar": lambda ev, v, ops: ev.params[v.attrs[0]], "loop": _loop,
}


def evaluate(module: Module, inputs: Mapping[str, np.ndarray], *, dtype: str | None = None,
             dims: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """Run the module; `dtype` ('f32'/'f64') overrides the float type of every value."""
    check_names(tuple(module.args), inputs)
    inputs = pairs_inputs(module, inputs, dtype, EvalError)   # complex arrays as float pairs (a view)
    env = bind_dims(module, {k: v for k, v in inputs.items() if k in module.args}, dims)
    args = check_inputs(module, inputs, env, dtype)
    ev = _Eval(module, env, args, dtype)
    with np.errstate(all="ignore"):   # IEEE arithmetic, as compiled code: inf and NaN are values
        vals = ev.run(module.roots())
    result: dict[str, np.ndarray] = {}
    for o in module.outputs:
        result[o.name] = _in_order(vals[id(o.value)], o.value.edges, o.order)
    for u in module.updates:
        order = module.args[u.target].order
        result[module.update_key(u.target)] = _in_order(vals[id(u.value)], u.value.edges, order)
    return complex_outputs(module, result)


def _in_order(a: np.ndarray, edges: tuple[str, ...], order: tuple[str, ...]) -> np.ndarray:
    """A fresh C-contiguous copy of `a` with its axes in `order` (0-d stays 0-d)."""
    return np.array(np.transpose(a, [edges.index(e) for e in order]), order="C", copy=True)
