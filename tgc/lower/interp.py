"""A numpy interpreter of the lowered program: the oracle for every backend's kernels.

`run_lowered(low, inputs)` executes a `Lowered` program (after `fuse`, `layout`,
`group` or `plan`) kernel by kernel, with numpy, and returns what a compiled
program's call returns: every output, and every update's new value under the key
`Module.update_key` gives it. It shares nothing with a backend but the lowered
program itself, the elementwise functions' numpy definitions (`tgc.ir.ops.FNS`) and
the dispatch by node class that evaluates an expression (`tgc.lower.lowered.ExprVisitor`: a method
per node, `expr_load`, `expr_add`, ..., as in each code generator), so a backend's
kernels can be compared with it kernel for kernel, and a lowering stage can be
checked by running the program before and after it.

Semantics, as `tgc.lower.lowered` states them:
- a `LoopKernel` is evaluated over its whole loop nest at once (index grids):
  `Mask` narrows where its operand is evaluated, a reduced loop's `bounds` narrow
  where its terms count, `reduce` is sum, max or min (NaN propagates), `maxshift`
  (NaNs skipped) or `logsumexp`, and the epilogue sees the reduced value as `Acc`;
  a scatter kernel fills its output with 0 (its `reduce` empty: a scatter-add), -inf
  (`max`) or inf (`min`) and combines every term into its gathered index;
- a kind of kernel that a backend's own stage adds runs through its own
  `interpret(interp)` hook, which calls back `loop`, `eval_size`, `arrays`, `order`
  and `fp` here (the CPU's `LoopGroup`: `tgc.backends.cpu.group`), so the oracle
  runs CPU-grouped programs without knowing the CPU backend;
- a `GemmKernel` is one contraction of its two views (shifted reads out of range
  are 0, as each call clips its range), summed over `k` and its taps; an operand
  marked `rounded` is rounded to bf16 as it is read; its epilogue's outputs are
  then computed one after another, each over the whole product with `Acc` read from
  `out` (`tgc.lower.lowered.epilogue_loops`): the same values as output by output at
  each element, since an epilogue reads its outputs only at the element's own index;
- a `Check` stops the call with `EvalError` before any kernel runs;
- an alias (`Buffer.alias`) is a view of its buffer's array, in its own shape.

Each operation (a sum's term and total, a product, a function, a reduction) is
computed in float64 from its operands and rounded once to the program's float type
(a softmax weight `exp(d - lse)` takes the sum unrounded: `tgc.lower.lowered.wide_exp`),
as the IR interpreter does: so an expression computed in two kernels has the same
bits in both (a max's gradient compares the max with its recomputed argument), and
results agree with a backend's to the type's precision, not bit for bit. Temporaries live in their workspace slots (`plan`), which start filled
with NaN bytes: a kernel that reads a temporary before anything wrote it, or a slot
shared by two buffers alive at once, shows up as wrong values. A load out of range
where no `Mask` guards it raises `LoweredError`: no correct program does that.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from tgc.ir.complex_io import RI, complex_outputs, pairs_inputs
from tgc.ir.interp import (NP_DTYPES, SCATTER_COMBINE, SCATTER_INIT, EvalError, bind_dims,
                           check_inputs)
from tgc.lower.lowered import (Acc, Add, Const, ExprVisitor, FloorDiv, GemmKernel, IdLoad, Ix, Load, LoopKernel, Lowered,
                            Map, Mask, Mul, Rand, SizeOf, StepLoop, epilogue_loops, logsumexp_outputs, wide_exp,
                            wide_sum, wide_term_factors)
from tgc.ir.ops import NUMPY as MAP_FNS
from tgc.ir.philox import draw_numpy
from tgc.ir.sizes import size_eval

_CMP = {"=": np.equal, "!=": np.not_equal, "<": np.less, "<=": np.less_equal, ">": np.greater,
        ">=": np.greater_equal}


PRODUCT = "#product"   # a GEMM's product while its epilogue overwrites `out` (no buffer is named so)


class LoweredError(RuntimeError):
    """The lowered program did what no correct program does (an unguarded load out of range)."""


def run_lowered(low: Lowered, inputs: Mapping[str, np.ndarray],
                dims: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """Run `low` on `inputs` (one array per argument, in ABI order); the outputs and the
    updates' new values, keyed as a compiled program's call keys them."""
    m = low.module
    inputs = pairs_inputs(m, inputs, low.dtype, EvalError)   # complex arrays as float pairs (a view)
    env = bind_dims(m, {k: v for k, v in inputs.items() if k in m.args}, dims)
    args = check_inputs(m, inputs, env, low.dtype)
    return complex_outputs(m, run_bound(low, args, env))


def run_bound(low: Lowered, args: Mapping[str, np.ndarray], env: Mapping[str, int]) -> dict[str, np.ndarray]:
    """Run `low` on arguments its caller has bound and checked (`run_lowered`'s, or the
    neutral runtime's through the `lowered` backend: one array per argument, in its
    declared edge order, a complex one as float pairs) with `env` every dim's size;
    the outputs and the updates' new values, keyed as `run_lowered` keys them (complex
    ones as float pairs). A failed `Check` raises EvalError before any kernel runs."""
    return _Machine(low, dict(env), dict(args)).run()


class _Machine(ExprVisitor):
    """The interpreter's state (the buffers' arrays) and its evaluation of kernels; an
    expression's nodes are evaluated by its `expr_*` and `atom_*` methods (`ExprVisitor`)
    over index grids: `vals` (loop variable -> index array), `active` (where the
    value counts) and `acc` (the reduced value, in an epilogue)."""
    def __init__(self, low: Lowered, env: dict[str, int], args: dict[str, np.ndarray]):
        self.low, self.env = low, env
        self.fp = NP_DTYPES[low.dtype]
        self.lse = logsumexp_outputs(low)
        self.arrays: dict[str, np.ndarray] = {}
        slots = [np.full(max([self.eval_size(s) for s in sizes] + [1]), 0xFF, np.uint8) for sizes in low.slots]
        for name, buf in low.buffers.items():
            order = buf.order if buf.order is not None else buf.edges
            shape = tuple(self.size(e) for e in order)
            dtype = NP_DTYPES[buf.dtype]
            if buf.kind == "arg":
                have = low.module.args[name].order
                self.arrays[name] = np.array(np.transpose(args[name], [have.index(e) for e in order]), dtype,
                                             order="C")   # a bf16 argument in a float buffer: widened
            elif buf.slot is not None:
                count = int(np.prod(shape, dtype=np.int64))
                self.arrays[name] = np.frombuffer(slots[buf.slot], dtype, count).reshape(shape)
            else:
                self.arrays[name] = np.full(shape, np.nan, dtype) if dtype != np.int32 else np.zeros(shape, dtype)
        self.order = {name: (buf.order if buf.order is not None else buf.edges) for name, buf in low.buffers.items()}
        self.bind_aliases()

    def bind_aliases(self) -> None:
        """Each alias (`Buffer.alias`) as a view of its buffer's array, in its own shape:
        the same bytes, or their first ones (a prefix view; the buffer's array is
        C-contiguous in its order)."""
        for name, buf in self.low.buffers.items():
            if buf.alias is not None:
                base = self.arrays[buf.alias]
                shape = tuple(self.size(e) for e in self.order[name])
                view = base.reshape(-1)[:int(np.prod(shape, dtype=np.int64))].reshape(shape)
                assert np.shares_memory(view, base), "an alias is a view of its buffer"
                self.arrays[name] = view

    # ---------------------------------------------------------------- sizes

    def eval_size(self, s) -> int:
        return size_eval(s, self.env)

    def size(self, edge: str) -> int:
        return self.eval_size(self.low.size(edge))

    # ---------------------------------------------------------------- the program

    def run(self) -> dict[str, np.ndarray]:
        for c in self.low.checks:
            ids, n = self.arrays[c.buf], self.eval_size(c.size)
            bad = (ids < 0) | (ids >= n)
            if bad.any():
                raise EvalError(f"gather id {int(ids[bad].flat[0])} in '{c.buf}' is out of range [0, {n})")
        self.run_kernels()
        m, result = self.low.module, {}
        outs = {b.index: b for b in self.low.buffers.values() if b.kind == "out"}
        for i, o in enumerate(m.outputs):
            buf = outs[i]
            result[o.name] = self._in_order(buf.name, o.order)
        for u in m.updates:
            result[m.update_key(u.target)] = self._in_order(u.target, m.args[u.target].order)
        return {k: v.astype(self.fp) if v.dtype.kind == "V" or v.dtype.itemsize == 2 else v   # bf16/f16 buffers
                for k, v in result.items()}

    def run_kernels(self) -> None:
        with np.errstate(all="ignore"):   # IEEE arithmetic: inf and NaN are values
            for k in self.low.kernels:
                if isinstance(k, GemmKernel):
                    self.gemm(k)
                elif isinstance(k, LoopKernel):
                    self.loop(k, {})
                elif isinstance(k, StepLoop):
                    self.steps(k)
                else:   # a backend's own kind of kernel says how it runs (the CPU's LoopGroup)
                    k.interpret(self)

    def steps(self, k: StepLoop) -> None:
        """The loop: its step, a program of its own, on the bound buffers (a stacked
        one's slice at the step's index), then the carries' new values copied back."""
        n = self.eval_size(k.trip)
        step = k.step
        outs = {b.index: b.name for b in step.buffers.values() if b.kind == "out"}
        for i in (range(n - 1, -1, -1) if k.reverse else range(n)):
            args = {name: self.block(b, n, i, step, name) if b.split else self.arrays[b.buf][i, ...] if b.stacked
                    else self.arrays[b.buf] for name, b in zip(step.module.args, k.args)}
            inner = _Machine(step, self.env, args)
            for c in range(k.carries):   # a carry updated in place: its output is the carry's buffer
                if k.outs[c].buf == k.args[c].buf:
                    inner.arrays[outs[c]] = self.arrays[k.args[c].buf]
            inner.bind_aliases()
            inner.run_kernels()
            for j, b in enumerate(k.outs):
                dst = self.arrays[b.buf]
                if b.split:   # one index of an edge after edges of size 1: a view of the contiguous buffer
                    dst = self.block(b, n, i, step, outs[j])
                    assert np.shares_memory(dst, self.arrays[b.buf]), "a split output's block is a view"
                    dst[...] = inner.arrays[outs[j]]
                    continue
                (dst[i, ...] if b.stacked else dst)[...] = inner.arrays[outs[j]]   # [i, ...]: a view, 0-d too
            for c in range(k.carries):
                if k.outs[c].buf != k.args[c].buf:
                    self.arrays[k.args[c].buf][...] = self.arrays[k.outs[c].buf]

    def block(self, b, n: int, i: int, step, name: str) -> np.ndarray:
        """Step i's block of the buffer's edge `b.split` (`Bind.split`: the edges before it
        of size 1): its slice i of n, in the step's argument's shape."""
        sb = step.buffers[name]
        shape = tuple(self.eval_size(step.size(e)) for e in (sb.order or sb.edges))
        return self.arrays[b.buf].reshape(n, -1)[i].reshape(shape)

    def _in_order(self, name: str, order) -> np.ndarray:
        a, have = self.arrays[name], self.order[name]
        return np.array(np.transpose(a, [have.index(e) for e in order]), order="C", copy=True)

    # ---------------------------------------------------------------- loop kernels

    def grid(self, names: list[str], sizes: list[int]) -> dict[str, np.ndarray]:
        """Index arrays of a loop nest, one axis per loop (broadcast against each other).
        numpy broadcasts at most 32 axes: a deeper nest is an EvalError, not numpy's."""
        n = len(names)
        if n > 32:
            raise EvalError(f"the lowered backend (a numpy reference) runs loop nests of at most 32 loops; "
                            f"a kernel here has {n}: the interp and cpu backends run it")
        return {v: np.arange(s, dtype=np.int64).reshape([s if j == i else 1 for j in range(n)])
                for i, (v, s) in enumerate(zip(names, sizes))}

    def loop(self, k: LoopKernel, fixed: dict[str, int]) -> None:
        loops = [v for v in k.loops if v not in fixed]
        sizes = [self.eval_size(k.sizes[v]) for v in loops]
        vals: dict = {**fixed, **self.grid(loops, sizes)}
        shape = tuple(sizes)
        active = np.ones(shape, bool)
        for v, (lows, highs) in k.bounds.items():
            if v in fixed:
                continue
            i = vals[v]
            for ix in lows:
                active = active & (i >= self.ix(ix, vals))
            for ix in highs:
                active = active & (i < self.ix(ix, vals))
        if k.scatter:
            self.scatter(k, vals, active, shape)
            return
        if not k.reduce:
            self.store(k, vals, np.broadcast_to(self.expr(k.body, vals, active), shape))
            return
        axes = tuple(i for i, v in enumerate(loops) if v in k.red)
        x = np.broadcast_to(self.expr(k.body, vals, active), shape).astype(np.float64)
        value = self.round(self.reduce(k.reduce, x, active, axes))
        if k.epilogue is not None:
            value = self.expr(k.epilogue, vals, np.ones(value.shape, bool), value)
        if set(k.red) & set(fixed):   # a partial sum: adds into its block's row
            value = self.round(value + self.load(k.out, k.index, vals, np.ones(value.shape, bool)))
        self.store(k, vals, value)

    @staticmethod
    def reduce(kind: str, x: np.ndarray, active: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        if kind == "sum":
            return np.sum(np.where(active, x, 0.0), axis=axes, keepdims=True)
        if kind in ("max", "min"):
            fill = -np.inf if kind == "max" else np.inf
            return (np.max if kind == "max" else np.min)(np.where(active, x, fill), axis=axes, keepdims=True)
        m = np.fmax.reduce(np.where(active, x, -np.inf), axis=axes, keepdims=True)   # NaNs skipped
        if kind == "maxshift":
            return m
        if kind == "logsumexp":
            m = np.where(np.isfinite(m), m, 0.0)
            return np.log(np.sum(np.where(active, np.exp(x - m), 0.0), axis=axes, keepdims=True)) + m
        raise LoweredError(f"unknown reduction '{kind}'")

    def store(self, k: LoopKernel, vals: dict, value: np.ndarray) -> None:
        out = self.arrays[k.out]
        idx = self.index(k.out, k.index, vals)
        if not idx:   # a scalar
            out[()] = np.asarray(value).reshape(())
            return
        full = np.broadcast_arrays(value, *idx)
        self.check_range(k.out, full[1:], np.ones(full[0].shape, bool))
        out[tuple(full[1:])] = full[0].astype(out.dtype)

    def scatter(self, k: LoopKernel, vals: dict, active: np.ndarray, shape) -> None:
        """Sums accumulate in float64 and round once; max/min are exact in any type."""
        out = self.arrays[k.out]
        kind = k.reduce or "sum"
        value = np.broadcast_to(self.expr(k.body, vals, active), shape)
        idx = [np.broadcast_to(i, shape) for i in self.index(k.out, k.index, vals)]
        act = np.broadcast_to(active, shape)
        self.check_range(k.out, idx, act)
        acc = np.full(out.shape, SCATTER_INIT[kind], np.float64)
        SCATTER_COMBINE[kind].at(acc, tuple(i[act] for i in idx), value[act])
        out[...] = acc.astype(out.dtype)

    # ---------------------------------------------------------------- GEMMs

    def gemm(self, k: GemmKernel) -> None:
        shifts = {(role, e): ix for role, e, ix in k.shifts}
        names = list(dict.fromkeys(k.batch + k.m + k.n + k.k + k.taps + ((RI,) if k.cplx else ())))
        letters = {v: chr(ord("a") + i) for i, v in enumerate(names)}

        def operand(role: str, view) -> tuple[np.ndarray, str]:
            used = [v for v, _ in view.edges]
            for (r, e), ix in shifts.items():
                if r == role:
                    used += [v for v in sorted(ix.vars()) if v not in used]
            used = [v for v in names if v in used]
            vals = self.grid(used, [self.size(v) for v in used])
            index = tuple((b, Ix.var(v).plus(shifts[(role, v)]) if (role, v) in shifts else Ix.var(v))
                          for v, b in view.edges)
            x = self.load(view.buf, tuple(sorted(index)), vals, True, outside_zero=True)
            x = np.broadcast_to(x, [self.size(v) for v in used])
            return x, "".join(letters[v] for v in used)

        a, sa = operand("a", k.a)
        b, sb = operand("b", k.b)
        a, b = (MAP_FNS["round_bf16"](x) if r else x for x, r in zip((a, b), k.rounded))   # to bf16, as read
        out_order = self.order[k.out]
        if k.cplx is not None:   # float pairs (re.im last in `used`) as complex numbers
            a, b = (x[..., 0] + 1j * x[..., 1] for x in (a.astype(np.float64), b.astype(np.float64)))
            a, b = (np.conj(x) if c else x for x, c in zip((a, b), k.cplx))
            out = [e for e in out_order if e != RI]
            z = k.alpha * np.einsum(f"{sa[:-1]},{sb[:-1]}->{''.join(letters[e] for e in out)}", a, b)
            result = np.moveaxis(np.stack([z.real, z.imag]), 0, list(out_order).index(RI))
            self.arrays[k.out][...] = result.astype(self.arrays[k.out].dtype)
            return
        back = {b: p for p, b in k.prefix}   # `out`'s edge -> the product's edge along it
        result = np.einsum(f"{sa},{sb}->{''.join(letters[back.get(e, e)] for e in out_order)}",
                           a.astype(np.float64), b.astype(np.float64))
        if k.acc:   # `out += a @ b`: the old value and the product summed in float64, rounded once
            # (into the leading block of each `prefix` edge of `out`)
            block = tuple(slice(0, self.size(back[e])) if e in back else slice(None) for e in out_order)
            target = self.arrays[k.out][block]
            target[...] = (result + target.astype(np.float64)).astype(target.dtype)
            return
        self.arrays[k.out][...] = result.astype(self.arrays[k.out].dtype)
        if any(o.buf == k.out for o in k.epilogue):   # `out` is an output: the product kept apart
            self.arrays[PRODUCT] = np.copy(self.arrays[k.out])
            self.order[PRODUCT] = self.order[k.out]
        for loop in epilogue_loops(self.low, k, PRODUCT if PRODUCT in self.arrays else None):
            self.loop(loop, {})   # in order, each over the whole product
        self.arrays.pop(PRODUCT, None)

    # ---------------------------------------------------------------- expressions

    def expr_load(self, e: Load, vals: dict, active, acc=None):
        return self.load(e.buf, e.index, vals, active)

    def expr_const(self, e: Const, vals: dict, active, acc=None):
        return self.round(e.value)

    def expr_size_of(self, e: SizeOf, vals: dict, active, acc=None):
        return self.round(self.eval_size(e.size))

    def expr_acc(self, e: Acc, vals: dict, active, acc=None):
        return acc

    def expr_rand(self, e: Rand, vals: dict, active, acc=None):
        """Integer arithmetic, then float64 rounded once (tgc.ir.philox)."""
        key = np.asarray(self.ix(e.key, vals), np.int64)
        counter = np.asarray(self.ix(e.counter, vals), np.int64)
        dtype = e.draw or ("f32" if self.fp == np.float32 else "f64")
        folds = tuple(n if isinstance(n, int) else np.int64(np.asarray(self.ix(n, vals)).reshape(-1)[0])
                      for n in e.folds)
        return self.round(draw_numpy(e.kind, dtype, int(key.reshape(-1)[0]), folds, counter))

    def expr_mask(self, e: Mask, vals: dict, active, acc=None):
        ok = True
        for c in e.conds:
            ok = ok & _CMP[c.op](self.ix(c.ix, vals), 0)
        return np.where(ok, self.expr(e.arg, vals, active & ok, acc), self.fp(0))

    def expr_add(self, e: Add, vals: dict, active, acc=None):
        if wide_sum(e, "f32" if self.fp == np.float32 else "f64"):
            return self.round(self.sum64(e, vals, active, acc, low=self.low))
        # c0 a0 + c1 a1 + ..., each scaled term and partial sum rounded
        args = [np.asarray(self.expr(a, vals, active, acc), np.float64) for a in e.args]
        total = None
        for c, a in zip(e.coefs, args):
            term = a if c == 1 else self.round(c * a)
            total = term if total is None else self.round(np.asarray(total, np.float64) + term)
        return total

    def expr_mul(self, e: Mul, vals: dict, active, acc=None):
        args = [np.asarray(self.expr(a, vals, active, acc), np.float64) for a in e.args]
        out = args[0]
        for a in args[1:]:
            out = np.asarray(self.round(out * a), np.float64)
        return self.round(out)

    def sum64(self, e: Add, vals: dict, active, acc=None, low=None) -> np.ndarray:
        """The sum `e` in float64, not rounded: a product term's factors widened where
        `lowered.wide_term_factors(low, term)` says, else the product rounded in the program's type."""
        total = np.float64(0)
        for c, a in zip(e.coefs, e.args):
            factors = a.args if wide_term_factors(low, a) else (a,)
            term = np.float64(1)
            for f in factors:
                term = term * np.asarray(self.expr(f, vals, active, acc), np.float64)
            total = total + (term if c == 1 else c * term)
        return np.asarray(total)

    def expr_map(self, e: Map, vals: dict, active, acc=None):
        if wide_exp(e, "f32" if self.fp == np.float32 else "f64", self.lse):   # exp(d - lse): the sum unrounded
            return self.round(MAP_FNS["exp"](self.sum64(e.args[0], vals, active, acc)))
        args = [np.asarray(self.expr(a, vals, active, acc), np.float64) for a in e.args]
        return self.round(MAP_FNS[e.fn](*args))

    def load(self, buf: str, index, vals: dict, active, outside_zero: bool = False):
        idx = self.index(buf, index, vals)
        arr = self.arrays[buf]
        full = np.broadcast_arrays(*idx) if idx else []
        ok = np.ones(full[0].shape if full else (), bool)
        for i, n in zip(full, arr.shape):
            ok = ok & (i >= 0) & (i < n)
        if not outside_zero and np.any(~ok & active):
            raise LoweredError(f"a load of %{buf} out of range where no mask guards it")
        clipped = tuple(np.clip(i, 0, max(n - 1, 0)) for i, n in zip(full, arr.shape))
        x = arr[clipped] if arr.size else np.zeros(ok.shape, arr.dtype)
        if arr.dtype != self.fp and arr.dtype.kind != "i":   # a bf16/f16 buffer: widened (exact)
            x = np.asarray(x).astype(self.fp)
            arr = x
        return np.where(ok, x, arr.dtype.type(0)) if outside_zero or not ok.all() else x

    def round(self, x) -> np.ndarray:
        """`x` rounded to the program's float type."""
        return np.asarray(x).astype(self.fp)

    def index(self, buf: str, index, vals: dict) -> list:
        at = dict(index)
        return [np.asarray(self.ix(at[e], vals), np.int64) for e in self.order[buf]]

    def check_range(self, buf: str, idx, active) -> None:
        for i, n in zip(idx, self.arrays[buf].shape):
            if np.any(((i < 0) | (i >= n)) & active):
                raise LoweredError(f"a store to %{buf} out of range")

    def ix(self, ix: Ix, vals: dict):
        total = self.eval_size(ix.const)
        for atom, coef in ix.terms:
            total = total + self.eval_size(coef) * self.atom(atom, vals)
        return total

    def atom_var(self, a: str, vals: dict):
        return vals[a]

    def atom_floor_div(self, a: FloorDiv, vals: dict):
        return np.floor_divide(self.ix(a.num, vals), self.eval_size(a.den))

    def atom_id_load(self, a: IdLoad, vals: dict):
        idx = self.index(a.buf, a.index, vals)
        arr = self.arrays[a.buf]
        full = np.broadcast_arrays(*idx) if idx else []
        clipped = tuple(np.clip(i, 0, max(n - 1, 0)) for i, n in zip(full, arr.shape))
        return arr[clipped].astype(np.int64)
