"""The loops of a module as `repeat` and `scan` (for `tgc.frontend.emit_tg`).

An IR loop (`tgc.ir.values.loop`) may carry several values, read loop-invariant
values, stack per-step results other than its carry, and run its indices downwards:
a derivative's loops do all of these (`tgc.autodiff.loops`: the forward loop that
keeps each step's values, the reverse loop of `grad`/`vjp`, the loop of `jvp` that
carries a tangent beside each value). The language's loops carry one value and stack
only it (LANGUAGE.md section 12). This module writes every loop with those two forms
and nothing but the language's own edge operations:

- **What is written.** Only the outputs the printed program reads: the stacked
  results it reads, the carries whose last value it reads, and every carry that those
  read in a step (closed over the steps); a loop's operands count as read only where
  that form reads them (`used_outputs`), so what only a left-out result needed is left
  out too. A stacked result that is a carry's new value (a `scan` of the source) is
  read from that carry.
- **Several values, one carry.** When more than one value must travel from step to
  step (several carries, or stacked results beside them), they are flattened into
  one edge `pack`, each value at its own offset with its edges row-major:
  `x @ [pack = c*b + c + 6]` writes `x[b, c]` into its segment and
  `h[pack = c*b + c + 6]` reads it back (LANGUAGE.md section 6: merging edges into
  one and reindexing). The step function reads the carries from its packed argument
  and returns the new carries and the step's results packed together; `scan`
  stacks that per step, `repeat` gives the last. A stacked result alone (no carry
  needed) is the carry itself, started at zero.
- **Loop-invariant values** are passed stacked, `p * [e = e]` (every step reads
  the same `p`): a function body reads only its parameters.
- **Downwards.** The stacked operands are flipped, `x[e = size(e) - 1 - e]`, the
  loop runs upwards over them, and its stacked result is flipped back.

Exact: the packing writes each value into its own segment and adds zeros to the
others (x + 0 = x, up to the sign of a zero), reads are index arithmetic, a flip is a
permutation and `p * 1 = p`; each step computes what the IR's step computes, on the
same values, in the same order of steps. An evaluator that builds the indicators
densely multiplies an infinite or NaN value by the 0s of the other segments, as it
does for any reindex. The packed edge has the program's float type: a narrower
float value is converted into it and back, which is exact (`f32(f64(x)) = x`); a
value that it cannot hold exactly (an `i32` one) is a CompileError that names the
loop. Terminates: one pass over each loop's body per set of outputs printed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tgc.ir.affine import Affine
from tgc.ir.diag import CompileError
from tgc.ir.sizes import Size, size_collect, size_op, size_str
from tgc.ir.values import LoopBody, Value, topo_order


def loop_key(v: Value) -> tuple:
    """What makes two loop outputs outputs of one loop: body, edge, order, operands."""
    body, edge, reverse, _ = v.attrs
    return (body, edge, reverse) + tuple(map(id, v.operands))


def used_outputs(roots: list[Value]) -> dict[tuple, set[int]]:
    """For each loop under `roots` (in a loop's step too), the outputs that the printed
    program reads: a loop's operands are read only as far as its printed form reads
    them (`needs`), so a value that only a left-out result of another loop needed is
    not printed either. Each scope is visited users first; a form read from more
    outputs reads more operands, so marking operands as each output is met ends with
    the operands of the loop's whole form."""
    used: dict[tuple, set[int]] = {}
    bodies: dict[tuple, LoopBody] = {}
    pending, seen = [list(roots)], set()
    while pending:
        scope = pending.pop()
        live = {id(r) for r in scope}
        keys = []
        for v in reversed(topo_order(scope)):
            if id(v) not in live:
                continue
            if v.op != "loop":
                live.update(id(o) for o in v.operands)
                continue
            key = loop_key(v)
            if key not in used:
                keys.append(key)
            used.setdefault(key, set()).add(v.attrs[3])
            bodies[key] = v.attrs[0]
            need = needs(v.attrs[0], used[key])
            live.update(id(v.operands[k]) for k in need.carries + need.reads)
        for key in keys:   # the steps, from the values each loop's form computes
            need = needs(bodies[key], used[key])
            roots_in = tuple(need.computed)
            if (key[0], roots_in) not in seen:
                seen.add((key[0], roots_in))
                pending.append(list(roots_in))
    return used


@dataclass(frozen=True)
class Needs:
    """What a loop's printed form computes in each step, for the outputs read."""
    carries: tuple[int, ...]   # the carries it passes on (read, or read by a step of one that is)
    stacked: tuple[int, ...]   # the stacked results it keeps beside them (body result nc + j)
    alias: dict                # a stacked result that is a carry's new value: result index -> carry index
    reads: tuple[int, ...]     # the slices and invariants the step reads (body parameter indices)
    computed: tuple[Value, ...]  # the carries' new values, then the stacked results


def needs(body: LoopBody, outs: set[int]) -> Needs:
    """What a loop of `body` whose outputs `outs` are read computes per step."""
    nc = body.carries
    results = sorted(o - nc for o in outs if o >= nc)
    alias = {}
    for j in results:
        k = next((k for k in range(nc) if body.results[k] is body.results[nc + j]), None)
        if k is not None:
            alias[j] = k
    stacked = [j for j in results if j not in alias]
    carries = {o for o in outs if o < nc} | set(alias.values())
    carries |= {k for k in _params_read(body, [body.results[nc + j] for j in stacked]) if k < nc}
    while True:   # the carries the kept carries' steps read, until none is added
        more = {k for k in _params_read(body, [body.results[k] for k in carries]) if k < nc} - carries
        if not more:
            break
        carries |= more
    computed = tuple([body.results[k] for k in sorted(carries)] + [body.results[nc + j] for j in stacked])
    reads = tuple(sorted(k for k in _params_read(body, list(computed)) if k >= nc))
    return Needs(tuple(sorted(carries)), tuple(stacked), alias, reads, computed)


def _params_read(body: LoopBody, values: list[Value]) -> set[int]:
    """The indices of the body's parameters that computing `values` reads."""
    where = {id(p): k for k, p in enumerate(body.params)}
    return {where[id(w)] for w in topo_order(values) if id(w) in where}


@dataclass(frozen=True)
class Slot:
    """A value the carry of the printed loop holds: carry `index`, or stacked result
    `index` (of the body's stacked results), at `offset` of the packed edge."""
    kind: str              # "carry" or "result"
    index: int
    value: Value           # the body's value that gives its type (the carry's parameter, or the result)
    offset: Size


@dataclass(frozen=True)
class LoopForm:
    """How one loop is written: what its carry holds and which parameters its step reads."""
    slots: tuple[Slot, ...]
    alias: dict              # a stacked result that is a carry's new value: result index -> carry index
    reads: tuple[int, ...]   # the slices and invariants the step reads (body parameter indices)
    size: Size               # the size of the packed edge

    @property
    def packed(self) -> bool:
        return len(self.slots) > 1

    def slot(self, kind: str, index: int) -> Slot:
        return next(s for s in self.slots if s.kind == kind and s.index == index)


def loop_form(body: LoopBody, outs: set[int], size_of) -> LoopForm:
    """The form of a loop of `body` whose outputs `outs` are read; `size_of(edge)` is an
    edge's size."""
    need = needs(body, outs)
    nc = body.carries
    slots, offset = [], 0
    for kind, index, value in ([("carry", k, body.params[k]) for k in need.carries]
                               + [("result", j, body.results[nc + j]) for j in need.stacked]):
        slots.append(Slot(kind, index, value, offset))
        offset = size_collect(size_op("+", offset, _count(value, size_of)))
    return LoopForm(tuple(slots), need.alias, need.reads, offset)


def _count(v: Value, size_of) -> Size:
    n: Size = 1
    for e in v.edges:
        n = size_op("*", n, size_of(e))
    return n


def segment(slot: Slot, size_of) -> Affine:
    """The index of `slot`'s value's elements on the packed edge: its offset plus its
    edges row-major (in the order of the value's edges)."""
    terms, stride = [], 1
    for e in reversed(slot.value.edges):
        terms.append((e, stride))
        stride = size_collect(size_op("*", stride, size_of(e)))
    return Affine.make(terms, slot.offset)


class LoopPrinter:
    """Writes loop outputs for a `tgc.frontend.emit_tg` writer `w` (its names, lines,
    fresh names, edge names and index expressions)."""

    def __init__(self, w, roots: list[Value], float_type: str):
        self.w = w
        self.used = used_outputs(roots)
        self.float_type = float_type
        self.steps: dict[tuple, tuple[str, str | None]] = {}   # (body, form) -> (step function, packed edge)
        self.args: dict[tuple, tuple[list, str]] = {}   # (scope, text) -> (the scope's lines, name)

    def bound(self, text: str) -> str:
        """A name bound to `text` in the writer's scope, bound once per scope (the operands
        that the loops over one edge share: a flipped slice, a broadcast invariant)."""
        key = (id(self.w.lines), text)
        if key not in self.args:
            self.args[key] = (self.w.lines, self.w.bind(text))
        return self.args[key][1]

    def size_of(self, edge: str) -> Size:
        return self.w.m.size(edge)

    def write(self, v: Value) -> None:
        """Bind the names of every read output of `v`'s loop (in the writer's scope)."""
        w = self.w
        body, edge, reverse, _ = v.attrs
        outs = self.used.get(loop_key(v)) or {v.attrs[3]}
        form = loop_form(body, outs, self.size_of)
        if form.packed or form.slots[0].kind == "result":
            other = sorted({s.value.dtype for s in form.slots} - {self.float_type, *_WIDENS[self.float_type]})
            if other:
                raise CompileError(
                    f"a loop over '{edge}' whose step passes on {len(form.slots)} values, one of type "
                    f"{' and '.join(other)}, has no .tg form: repeat and scan carry one tensor, and the values "
                    f"are packed into one of the program's type ({self.float_type}), which must hold each "
                    "exactly", v.loc)
        step, pack = self.step_fn(body, form)
        e = w.e(edge)
        ops = v.operands
        nc = body.carries
        if form.packed:
            parts = [self.pack(w.ref(ops[s.index]), s, pack) for s in form.slots
                     if s.kind == "carry" and not _zero(ops[s.index])]   # the other segments start at 0
            init = " + ".join(parts) if parts else f"0 * [{pack} = {pack}]"
        elif form.slots[0].kind == "carry":
            init = w.ref(ops[form.slots[0].index])
        else:
            value = form.slots[0].value
            init = " * ".join(["0"] + [f"[{w.e(d)} = {w.e(d)}]" for d in value.edges])
            init = init if value.dtype == self.float_type else f"{value.dtype}({init})"
        args = [init]
        for k in form.reads:
            text = w.ref(ops[k])
            if k >= nc + body.slices:
                text = f"{text} * [{e} = {e}]"
            elif reverse:
                if ops[k].dtype == "i32":
                    raise CompileError(f"a loop over '{edge}' that runs backwards (a derivative's) reads i32 ids "
                                       "per step, and has no .tg form: a scan runs forwards, and the ids cannot "
                                       f"be flipped along '{edge}' (a reindex takes float tensors)", v.loc)
                text = f"{text}[{e} = size({e}) - 1 - {e}]"
            args.append(text)
        args = [a if _plain(a) else self.bound(a) for a in args]
        call = f"({step}, {', '.join(args)})"
        last = w.bind(f"repeat[{e}]{call}") if any(o < nc for o in outs) else None
        every = w.bind(f"scan[{e}]{call}") if any(o >= nc for o in outs) else None
        if every and reverse:
            every = w.bind(f"{every}[{e} = size({e}) - 1 - {e}]")
        for o in sorted(outs):
            if o < nc:
                slot, whole = form.slot("carry", o), last
            elif o - nc in form.alias:
                slot, whole = form.slot("carry", form.alias[o - nc]), every
            else:
                slot, whole = form.slot("result", o - nc), every
            w.names[id(_output(v, o))] = w.bind(self.unpack(whole, slot, pack)) if form.packed else whole

    def pack(self, text: str, slot: Slot, pack: str) -> str:
        """`text`, the value of `slot`, written into its segment of the packed edge."""
        if slot.value.dtype != self.float_type:
            text = f"{self.float_type}({text})"
        return f"{text} @ [{pack} = {self.w.affine(segment(slot, self.size_of))}]"

    def unpack(self, text: str, slot: Slot, pack: str) -> str:
        """The value of `slot` read from `text`, a packed value (stacked or not)."""
        read = f"{text}[{pack} = {self.w.affine(segment(slot, self.size_of))}]"
        return read if slot.value.dtype == self.float_type else f"{slot.value.dtype}({read})"

    def step_fn(self, body: LoopBody, form: LoopForm) -> tuple[str, str | None]:
        """The step function (written once per body and form) and the packed edge's name."""
        key = (body, form.slots, form.reads)
        if key in self.steps:
            return self.steps[key]
        w = self.w
        pack = None
        if form.packed:
            pack = w.fresh("pack")
            w.top.insert(w._dims_end(), f"dim {pack} = {size_str(form.size)}")
            w.head += 1
        name = w.fresh("step")
        carry = w.fresh("h")
        params = [w.fresh(f"p{k}") for k in form.reads]
        outer = (w.names, w.lines)
        w.names = {id(body.params[k]): p for k, p in zip(form.reads, params)}
        w.lines = []
        read = _params_read(body, [body.results[s.index] if s.kind == "carry" else s.value for s in form.slots])
        for s in form.slots:
            if s.kind == "carry" and s.index in read:
                w.names[id(body.params[s.index])] = w.bind(self.unpack(carry, s, pack)) if form.packed else carry
        nc = body.carries
        values = [body.results[s.index] if s.kind == "carry" else body.results[nc + s.index] for s in form.slots]
        result = (" + ".join(self.pack(w.ref(r), s, pack) for r, s in zip(values, form.slots))
                  if form.packed else w.ref(values[0]))
        lines = w.lines
        w.names, w.lines = outer
        w.fn_lines += [f"fn {name}({', '.join([carry] + params)}) {{", *(f"  {line}" for line in lines),
                       f"  return {result}", "}"]
        self.steps[key] = (name, pack)
        return name, pack


_WIDENS = {"f64": ("f32", "bf16", "f16"), "f32": ("bf16", "f16")}   # the types each holds exactly


def _zero(v: Value) -> bool:
    return v.op == "const" and v.attrs[0] == 0 and math.copysign(1.0, v.attrs[0]) > 0


def _plain(text: str) -> bool:
    return text.replace("_", "a").replace("'", "a").isalnum()


def _output(v: Value, out: int) -> Value:
    from tgc.ir.values import loop_output

    return v if v.attrs[3] == out else loop_output(v, out)
