"""carry_sums: a loop's f32 running sum is accumulated compensated, in two f32 carries.

The rule (docs/language.md, "Running sums are compensated"): a carry of type f32 whose
step is an accumulation `h' = h + d`, where the increment `d` reads no carry of the
loop (only the step's slices of the stacked operands, the loop-invariant operands and
constants), is a prefix sum of the loop's inputs: a cumulative sum
`scan[t](add, h0, xs)`, and in reverse mode the sum of a per-step cotangent slice into
a carry's (the gradient of such a scan's xs and init, a reverse cumulative sum). Such a
carry is summed as tgc sums an edge, more exactly than one f32 rounding per step (what
PyTorch's torch.cumsum does: it sums f32 in double on the CPU). The carry `h` is held
as an unevaluated pair `(h, c)` of f32 values, `c` a second carry that starts at 0 and
holds what `h`'s roundings lost. Each step adds `d` to `h` with its rounding error
found exactly (Knuth's two-sum, six f32 operations), adds that error into `c`, then
moves `c` into `h` (`h'` is `s + c1` rounded once, `c'` what that rounding left out):

    s  = h + d
    b  = s - h
    e  = (h - (s - b)) + (d - b)     # s + e = h + d exactly
    c1 = c + e
    h' = s + c1                      # the carry's value: the step's result
    c' = c1 - (h' - s)

`h'` is where the step's result was (the carry's new value, what a `scan` stacks, what
the loop's last step gives, and what the next step's other values read as `h`), now
within about an f32 rounding of the exact running sum: the error of n steps no longer
grows like n (2.4e-6 relative for 10^4 uniform terms) but stays about one rounding
(4.8e-8, as torch.cumsum). The increment `d` is computed as before the pass (several
terms besides `h` are one sum, rounded once, then added).

Which carries, and why only those: an increment that reads a carry makes the loop a
recurrence, not a sum of its inputs. A carry fed back into its own increment (a
residual stream `x + f(x)` over layers, its gradient `ct + J^T ct`) and a sum whose
terms come from another carry (reverse mode's `dW + h^T g` for a weight every step
shares, `g` from the state's cotangent) are what PyTorch computes in a Python loop
and in autograd, one f32 rounding a step, as tgc does without the pass; the contract
(at most 10x PyTorch's error) holds there, and the extra carries would cost (a tanh
RNN of width 32 over 1000 steps, forward and backward, took 1.33x the time with its
dU and dW compensated). So a transformer's activations over its
layers keep their one buffer and their memory traffic. Only f32: an f64 carry is as
exact as torch's double accumulation, and a bf16/f16 carry is a storage type (its
rounding is what the program asked for).

Exact in real arithmetic (`h' + c'` = `h + c + d`, and `c` starts at 0). In floating
point it needs each of the six additions rounded to f32 as written: the pass runs
after every canonical rewrite (normalize would merge the sums), every addition it
builds has two terms (an f32 sum of three or more is computed wider:
`lowered.wide_sum`), and no backend reassociates an f32 addition, contracts one into
an FMA without a product, or keeps one wider than f32 (tests/opt/test_carry_sums.py:
every backend gives the reference interpreter's bits). It never runs under
--fp-strict (not in the strict pipeline): the carry then rounds each step as written.

Cost: a second carry of the carry's size (read and written once a step) and ten
additions an element a step, only where the rule applies.

Terminates: one bottom-up rebuild; each loop body is rebuilt once (its own loops
first, as programs of their own). A second run leaves the result: the carry's new
step `s + c1` and the compensation's `c1 - (h' - s)` both read the carry `c`.
"""
from __future__ import annotations

from dataclasses import dataclass

from tgc.ir import values as V
from tgc.ir.module import Module
from tgc.ir.passes import Pass
from tgc.ir.values import Value, topo_order
from tgc.options import Options
from tgc.opt.rewrite import map_bodies


def _reads_a_carry(v: Value, carries: set[int]) -> bool:
    """Whether `v` reads one of the body's carry parameters (ids in `carries`)."""
    return any(id(u) in carries for u in topo_order([v]))


def increment(body: V.LoopBody, k: int) -> Value | None:
    """The increment `d` of carry `k` where its step is `h + d` and `d` reads no carry
    (the rule in the module's docstring), else None."""
    p, r = body.params[k], body.results[k]
    if p.dtype != "f32" or r.op != "add" or r.dtype != "f32":
        return None
    coefs = r.attrs[0]
    at = [i for i, o in enumerate(r.operands) if o is p]
    if len(at) != 1 or coefs[at[0]] != 1.0 or len(r.operands) < 2:
        return None
    rest = [(o, c) for i, (o, c) in enumerate(zip(r.operands, coefs)) if i != at[0]]
    carries = {id(q) for q in body.params[:body.carries]}
    if any(o.dtype != "f32" or _reads_a_carry(o, carries) for o, _ in rest):
        return None
    if len(rest) == 1 and rest[0][1] == 1.0:
        return rest[0][0]
    return V.add([o for o, _ in rest], [c for _, c in rest], r.loc)


def _compensated(h: Value, c: Value, d: Value, loc) -> tuple[Value, Value]:
    """The new carry and compensation of `(h, c)` after adding `d` (the docstring's six
    lines), every addition a two-operand f32 add, as written."""
    def plus(a, b):
        return V.add([a, b], [1.0, 1.0], loc)

    def minus(a, b):
        return V.add([a, b], [1.0, -1.0], loc)

    s = plus(h, d)
    b = minus(s, h)
    e = plus(minus(h, minus(s, b)), minus(d, b))
    c1 = plus(c, e)
    h1 = plus(s, c1)
    return h1, minus(c1, minus(h1, s))


def compensate(body: V.LoopBody) -> tuple[V.LoopBody, list[int]] | None:
    """`body` with a compensation carry after its carries for each accumulation (the
    new carries in the order of those they compensate), and the indices of the carries
    compensated; None when none is."""
    found = [(k, d) for k in range(body.carries) if (d := increment(body, k)) is not None]
    if not found:
        return None
    n = len(found)
    C = body.carries
    # parameters: the carries, the compensations, then the slices and invariants shifted by n
    shifted = {id(p): V.loopvar(k + n if k >= C else k, p.dtype, p.edges, p.loc)
               for k, p in enumerate(body.params)}
    memo = V.rebuild(list(body.results) + [d for _, d in found],
                     lambda v, ops: shifted[id(v)] if v.op == "loopvar" else V.rebuild_same(v, ops))
    new_value, extra = {}, []   # id(the carry's old new value) -> the compensated one
    for j, (k, d) in enumerate(found):
        h = shifted[id(body.params[k])]
        c = V.loopvar(C + j, h.dtype, h.edges)
        h1, c1 = _compensated(h, c, memo[id(d)], body.results[k].loc)
        new_value[id(memo[id(body.results[k])])] = h1
        extra.append(c1)
    # every other result reads the carry's new value as compensated: where the body
    # stacks it (a scan's result) and any value of the step computed from it
    others = [memo[id(r)] for r in body.results]
    again = V.rebuild(others, lambda v, ops: new_value[id(v)] if id(v) in new_value else V.rebuild_same(v, ops))
    results = [again[id(r)] for r in others]
    params = [shifted[id(p)] for p in body.params[:C]] + \
             [V.loopvar(C + j, body.params[k].dtype, body.params[k].edges) for j, (k, _) in enumerate(found)] + \
             [shifted[id(p)] for p in body.params[C:]]
    new = V.loop_body(params, results[:C] + extra + results[C:], C + n, body.slices)
    return new, [k for k, _ in found]


def _run(module: Module) -> Module:
    module = map_bodies(module, _run)
    done: dict[V.LoopBody, tuple | None] = {}
    for v in module.values():
        if v.op == "loop" and v.attrs[0] not in done:
            done[v.attrs[0]] = compensate(v.attrs[0])
    if not any(done.values()):
        return module

    def fn(v: Value, ops: tuple[Value, ...]) -> Value:
        if v.op == "loop" and done.get(v.attrs[0]):
            body, edge, reverse, out = v.attrs
            new, ks = done[body]
            C = body.carries
            zeros = [V.const(0.0, body.params[k].dtype, body.params[k].edges) for k in ks]
            return V.loop(new, edge, ops[:C] + tuple(zeros) + ops[C:], out + len(ks) if out >= C else out,
                          reverse, v.loc)
        return V.rebuild_same(v, ops)

    return module.replace_values(V.rebuild(module.roots(), fn))


@dataclass(frozen=True)
class CarrySums(Pass):
    """A loop's f32 running sum (`h + d`, `d` reading no carry) carried with its rounding error."""

    name = "carry_sums"

    def run(self, module: Module, options: Options) -> Module:
        return _run(module)
