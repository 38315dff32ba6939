"""The lowered program's verifier: what every stage must leave true.

`verify_lowered(low)` raises `VerifyError` (with the index of the kernel at fault, or
None) when the program breaks one of these rules; the pass manager runs it after every
lowering stage, and `parse_lowered` after reading text:

- buffers: each declared once (a dict), with a known type, sorted known edges, an
  `order` that permutes them, and the module's ABI: every argument the kernels use
  is an `arg` buffer with the argument's position, type and edges, every output an
  `out` buffer, and no two buffers share an ABI position;
- edges: every edge a buffer, loop or GEMM names is the module's or one that
  lowering made (`Lowered.edges`);
- kernels read only defined buffers: arguments, buffers an earlier kernel wrote (a
  group's member: also an earlier member's, and its registers), and a scatter's own
  output; every output is written; only the targets of updates (params and states)
  among the arguments are written;
- loops are bound: every variable an index, mask, bound or draw uses is a loop of
  its kernel (or an outer loop of its group, or `#block` in a blocked group), each
  loop has a size, the reduced loops are loops, an index names exactly its buffer's
  edges, `Acc` appears only in an epilogue of a reduction, a register is written by
  one member and read only by later ones;
- sizes are consistent: where an output index is a loop variable, the loop runs over
  the whole edge (equal sizes); a GEMM's out buffer has the edges of its batch, m and n
  groups and its operands' views agree on the sizes of the edges they share; a group's
  outer loops are the first loops of every member, with the same sizes;
- aliases (`Buffer.alias`): a temporary viewing a buffer that is no alias, of its type
  and byte size, in that buffer's slot; writing either defines both;
- the workspace: after `plan` every temporary has a slot (an alias its buffer's), each slot index lies inside
  the slot table and lists the buffer's byte size, and two temporaries alive at once
  (from first to last use) never share a slot; id checks are on i32 buffers;
- 2-byte buffers (bf16, f16: `tgc.lower.narrow`): an argument's is the argument's
  declared type, and none is written by a reduction, a scatter or a GEMM (their
  partial values would be rounded).

Sizes are expressions of the symbolic dims (`tgc.ir.sizes`); two that are not the same
expression (`h * 5` and `h * e` with `e = 5`) are compared by their values at two
bindings of the symbolic dims (and count as equal when the dims cannot be bound), so
the check flags only sizes that differ. A group is any kernel with `members`,
`outer` loops and `regs` (a backend's own kind: the CPU's `LoopGroup`, which this
module does not import). A kind with a `verify(verifier, defined)` method checks itself
through this verifier's `loop` and `gemm` (the CPU's `ImplicitGemm`). An expression's
nodes are checked by a method per node class (`tgc.lower.lowered.ExprVisitor`), each node before
its operands. It changes nothing. Terminates: one walk over the kernels and their
expression trees.
"""
from __future__ import annotations

import collections

from tgc.ir.interp import MAP_FNS
from tgc.ir.sizes import SizeError, size_eval
from tgc.lower.lowered import (Acc, Add, Const, ExprVisitor, FloorDiv, GemmKernel, IdLoad, Ix, Load, LoopKernel, Lowered,
                               Map, Mask, Mul, Rand, SizeOf, StepLoop, walk)

BLOCK_EDGE = "#block"
REDUCTIONS = ("", "sum", "max", "min", "logsumexp", "maxshift")
DTYPES = ("f32", "f64", "i32", "bf16", "f16")
NARROW = ("bf16", "f16")   # 2-byte elements: written only as whole values (tgc.lower.narrow)



def _is_group(k) -> bool:
    """A loop group (a backend's own kind of kernel: members in shared outer loops)."""
    return hasattr(k, "members") and hasattr(k, "outer")


class VerifyError(ValueError):
    """A broken lowered program; `kernel` is the index of the kernel at fault (or None)."""

    def __init__(self, message: str, kernel: int | None = None):
        super().__init__(message if kernel is None else f"k{kernel}: {message}")
        self.kernel = kernel


def verify_lowered(low: Lowered, held: frozenset[str] = frozenset()) -> None:
    """Raise `VerifyError` where `low` breaks a rule. `held`: outputs that hold a value
    when the program starts (a loop's step whose carry is updated in place: its
    output is bound to the carry's buffer, `tgc.lower.accumulate`)."""
    _Verifier(low, held).run()


class _Readable:
    """The buffers a kernel may read: those of `base`, and of `extra`, but not
    `without`; a view, not a copy (a copy of every defined buffer per kernel made the
    verifier quadratic in the program's length). `|` adds a set."""

    __slots__ = ("base", "extra", "without")

    def __init__(self, base, extra=(), without=()):
        self.base, self.extra, self.without = base, extra, without

    def __contains__(self, name) -> bool:
        return name not in self.without and (name in self.extra or name in self.base)

    def __or__(self, more) -> "_Readable":
        return _Readable(self, more)


class _Verifier(ExprVisitor):
    def __init__(self, low: Lowered, held: frozenset[str] = frozenset()):
        self.low = low
        self.held = held
        self.k: int | None = None
        self.targets = {u.target for u in low.module.updates}   # (once: asked per argument written)

    def fail(self, message: str) -> VerifyError:
        return VerifyError(message, self.k)

    def same_size(self, a, b) -> bool:
        if a == b:
            return True
        if not hasattr(self, "_envs"):
            sym = self.low.module.symbolic_dims()
            self._envs = []
            for base in (7, 12):
                try:
                    self._envs.append(self.low.module.bind_dims({d: base + 2 * i for i, d in enumerate(sym)}))
                except (SizeError, ValueError):
                    pass
        try:
            return all(size_eval(a, env) == size_eval(b, env) for env in self._envs)
        except (SizeError, KeyError):
            return True

    def known_edge(self, e: str) -> bool:
        return e in self.low.edges or e in self.low.module.edges

    # ---------------------------------------------------------------- the program

    def run(self) -> None:
        low = self.low
        if low.dtype not in ("f32", "f64"):
            raise self.fail(f"the program's float type is f32 or f64, not '{low.dtype}'")
        self.buffers()
        defined = self.aliased({n for n, b in low.buffers.items() if b.kind == "arg"} | set(self.held))
        written: set[str] = set()
        for self.k, k in enumerate(low.kernels):
            if _is_group(k):
                self.group(k, defined)
                writes = k.writes()
            elif hasattr(k, "verify"):   # a backend's own kind that checks itself (the CPU's ImplicitGemm)
                k.verify(self, defined)
                writes = k.writes()
            elif isinstance(k, GemmKernel):
                self.gemm(k, defined)
                writes = k.writes()
            elif isinstance(k, StepLoop):
                self.steps(k, defined)
                writes = k.writes()
            else:
                self.loop(k, defined, {}, set())
                writes = {k.out}
            for w in writes:
                self.writable(w)
            writes = self.aliased(set(writes))   # writing an alias writes its buffer's bytes
            defined |= writes
            written |= writes
        self.k = None
        for c in low.checks:
            if c.buf not in low.buffers or low.buffers[c.buf].dtype != "i32":
                raise self.fail(f"id check on '%{c.buf}', which is not an i32 buffer")
        outs = {b.index: n for n, b in low.buffers.items() if b.kind == "out"}
        for i, o in enumerate(low.module.outputs):
            if outs.get(i) not in written:
                raise self.fail(f"output '{o.name}' (out {i}) is never written")
        self.slots()

    def buffers(self) -> None:
        low, m = self.low, self.low.module
        seen: dict[tuple[str, int], str] = {}
        for name, b in low.buffers.items():
            if name != b.name:
                raise self.fail(f"buffer '%{name}' is named '{b.name}'")
            if b.dtype not in DTYPES:
                raise self.fail(f"buffer '%{name}' has unknown type '{b.dtype}'")
            if list(b.edges) != sorted(b.edges) or len(set(b.edges)) != len(b.edges):
                raise self.fail(f"buffer '%{name}' lists its edges unsorted or twice: [{', '.join(b.edges)}]")
            for e in b.edges:
                if not self.known_edge(e):
                    raise self.fail(f"buffer '%{name}' has unknown edge '{e}'")
            for what, order in (("order", b.order), ("prefer", b.prefer)):
                if order is not None and sorted(order) != list(b.edges):
                    raise self.fail(f"buffer '%{name}' {what} [{', '.join(order)}] is not an order of its edges "
                                    f"[{', '.join(b.edges)}]")
            if b.kind not in ("arg", "out", "temp"):
                raise self.fail(f"buffer '%{name}' has unknown kind '{b.kind}'")
            if b.alias is not None:
                self.alias(name, b)
            if b.kind == "temp":
                continue
            key = (b.kind, b.index)
            if key in seen:
                raise self.fail(f"buffers '%{seen[key]}' and '%{name}' are both {b.kind} {b.index}")
            seen[key] = name
            if b.kind == "arg":
                a = m.args.get(name)
                if a is None or list(m.args).index(name) != b.index:
                    raise self.fail(f"buffer '%{name}' is arg {b.index}, but the module's argument {b.index} is "
                                    f"'{list(m.args)[b.index] if 0 <= b.index < len(m.args) else 'missing'}'")
                expect = (a.dtype,) if a.dtype == "i32" else (a.dtype, low.dtype) if a.dtype in NARROW \
                    else (low.dtype,)
                if tuple(sorted(a.order)) != b.edges or b.dtype not in expect:
                    raise self.fail(f"buffer '%{name}' does not have the type of argument '{name}'")
            else:
                if not 0 <= b.index < len(m.outputs):
                    raise self.fail(f"buffer '%{name}' is out {b.index}; the module has {len(m.outputs)} outputs")
                o = m.outputs[b.index]
                if tuple(sorted(o.order)) != b.edges:
                    raise self.fail(f"buffer '%{name}' (out {b.index}) does not have the edges of output '{o.name}'")
            if low.stage != "fuse" and b.order is None:
                raise self.fail(f"buffer '%{name}' has no order after {low.stage}")

    def steps(self, k: StepLoop, defined: set[str]) -> None:
        """A loop: its step is a valid program, and each of its arguments and outputs is
        bound to a buffer of the same type and order (with the loop edge outermost where
        stacked); the carries are read whole and written whole."""
        low, step = self.low, k.step
        if not self.known_edge(k.edge):
            raise self.fail(f"loop over unknown edge '{k.edge}'")
        if not self.same_size(k.trip, low.size(k.edge)):
            raise self.fail(f"loop over '{k.edge}' runs {k.trip} steps, not the edge's size")
        held = frozenset(n for n, b in step.buffers.items() if b.kind == "out" and b.index < k.carries
                         and k.outs[b.index].buf == k.args[b.index].buf and not k.outs[b.index].stacked)
        try:
            verify_lowered(step, held)
        except VerifyError as e:
            raise self.fail(f"in the loop's step: {e}") from None
        if step.stage != low.stage:
            raise self.fail(f"the loop's step is lowered after '{step.stage}', the program after '{low.stage}'")
        args = list(step.module.args.values())
        outs = step.module.outputs
        if len(k.args) != len(args) or len(k.outs) != len(outs):
            raise self.fail(f"the loop binds {len(k.args)} arguments and {len(k.outs)} outputs; its step has "
                            f"{len(args)} and {len(outs)}")
        if not 0 <= k.carries <= min(len(args), len(outs)):
            raise self.fail(f"the loop has {k.carries} carries, more than its step's arguments or outputs")
        for what, binds, orders in (("argument", k.args, [a.order for a in args]),
                                    ("output", k.outs, [o.order for o in outs])):
            for j, (b, order) in enumerate(zip(binds, orders)):
                if b.buf not in low.buffers:
                    raise self.fail(f"the loop's {what} {j} is bound to unknown buffer '%{b.buf}'")
                buf = low.buffers[b.buf]
                want = ((k.edge,) if b.stacked else ()) + tuple(order)
                if b.split:
                    want = self.split_order(k, b, buf, tuple(order), what, j)
                if buf.edges != tuple(sorted(want)):
                    raise self.fail(f"the loop's {what} {j} is bound to '%{b.buf}' [{', '.join(buf.edges)}], "
                                    f"not [{', '.join(sorted(want))}]")
                held = step.buffers.get(list(step.module.args)[j] if what == "argument" else "", None)
                if what == "output":
                    held = next((x for x in step.buffers.values() if x.kind == "out" and x.index == j), None)
                if held is not None and held.dtype != buf.dtype:
                    raise self.fail(f"the loop's {what} {j} is {held.dtype}, bound to '%{b.buf}' of type {buf.dtype}")
                if buf.order is not None and low.stage != "fuse" and buf.order != want:
                    raise self.fail(f"the loop's {what} {j} is bound to '%{b.buf}' in order "
                                    f"[{', '.join(buf.order)}], not [{', '.join(want)}]")
                if what == "argument" and b.buf not in defined:
                    raise self.fail(f"reads '%{b.buf}' before anything writes it")
                if j < k.carries and b.stacked:
                    raise self.fail(f"the loop's carry {j} is bound to a stacked slice")
        if low.stage == "plan" and k.slot_base + len(step.slots) > len(low.slots):
            raise self.fail(f"the loop's step slots from {k.slot_base} lie outside the workspace")

    def split_order(self, k: StepLoop, b, buf, order: tuple[str, ...], what: str, j: int) -> tuple[str, ...]:
        """The order of a buffer whose edge `b.split` a loop's step reads a block of
        (`Bind.split`): the step's order with its block edge (the one edge the buffer
        lacks) named `b.split`, every edge before it of size 1, the edge's size the
        block's times the trip; or, one index of `b.split` a step (an argument or an
        output: a loop over the heads after a batch of 1), the buffer's order."""
        own = [e for e in order if e not in buf.edges]
        if not b.stacked or (what != "argument" and own) or len(own) > 1 or b.split not in buf.edges \
                or b.split in order \
                or (not own and buf.order is not None and b.split not in buf.order):
            raise self.fail(f"the loop's {what} {j} reads a block of '{b.split}' of '%{b.buf}' "
                            f"[{', '.join(buf.edges)}] as [{', '.join(order)}]")
        low = self.low
        if own:   # a block of E over the step's own edge
            want = tuple(b.split if e == own[0] else e for e in order)
            block = low.size(own[0])
        else:     # one index of E a step: the step's order is the buffer's without E
            want = tuple(buf.order) if buf.order is not None else tuple(sorted(order + (b.split,)))
            if tuple(e for e in want if e != b.split) != order:
                raise self.fail(f"the loop's {what} {j} reads '%{b.buf}' at one index of '{b.split}' "
                                f"in another order than the buffer's")
            block = 1
        whole = low.size(b.split)
        # one index a step over the loop edge itself: its size is the trip, symbolic too
        sliced = block == 1 and b.split == k.edge and self.same_size(whole, k.trip)
        if buf.order is not None and (any(not self.same_size(low.size(e), 1) for e in want[:want.index(b.split)])
                                      or not sliced and (not isinstance(whole, int) or not isinstance(block, int)
                                                         or not isinstance(k.trip, int) or whole != block * k.trip)):
            raise self.fail(f"the loop's {what} {j} reads blocks of '{b.split}' of '%{b.buf}' that are "
                            f"not its slices at the step's index")
        return want

    def alias(self, name: str, b) -> None:
        low = self.low
        base = low.buffers.get(b.alias)
        if b.kind != "temp" or base is None or base.alias is not None or base is b:
            raise self.fail(f"buffer '%{name}' is an alias of '%{b.alias}': an alias is a temporary "
                            f"viewing a buffer that is no alias")
        size, whole = low.nbytes(b), low.nbytes(base)
        fewer = isinstance(size, int) and isinstance(whole, int) and size < whole   # a prefix view
        if base.dtype != b.dtype or not (fewer or self.same_size(whole, size)):
            raise self.fail(f"alias '%{name}' does not have the type and byte size of '%{b.alias}' "
                            f"(or fewer bytes, both sizes known)")

    def aliased(self, names: set[str]) -> set[str]:
        """`names` with the buffers that share their bytes (aliases and what they view)."""
        low = self.low
        if not hasattr(self, "_views"):   # buffer -> its aliases, once (asked per kernel)
            self._views: dict[str, list[str]] = {}
            for n, b in low.buffers.items():
                if b.alias is not None:
                    self._views.setdefault(b.alias, []).append(n)
        bases = {low.storage(n) for n in names if n in low.buffers}
        return set(names) | bases | {n for base in bases for n in self._views.get(base, ())}

    def writable(self, name: str) -> None:
        b = self.low.buffers[name]
        if b.kind == "arg" and name not in self.targets:
            raise self.fail(f"writes argument '%{name}', which no update targets")

    def slots(self) -> None:
        low = self.low
        live: dict[str, tuple[int, int]] = {}
        for i, k in enumerate(low.kernels):
            for name in k.buffers_used():
                if name in low.buffers:
                    name = low.storage(name)   # an alias is alive with the buffer it views
                if name in low.buffers and low.buffers[name].kind == "temp":
                    first, _ = live.get(name, (i, i))
                    live[name] = (first, i)
        by_slot: dict[int, list[str]] = {}
        for name, b in low.buffers.items():
            if b.alias is not None:   # the bytes of the buffer it views: its slot, or none
                base = low.buffers[b.alias]
                if b.slot != base.slot:
                    raise self.fail(f"alias '%{name}' is in slot {b.slot}, the buffer it views in {base.slot}")
                if b.slot is not None and low.nbytes(b) not in low.slots[b.slot]:
                    raise self.fail(f"slot {b.slot} does not list the size of '%{name}' ({low.nbytes(b)} bytes)")
                continue
            if b.slot is None:
                if low.stage == "plan" and b.kind == "temp":
                    raise self.fail(f"temporary '%{name}' has no workspace slot after plan")
                continue
            if b.kind != "temp":
                raise self.fail(f"{b.kind} buffer '%{name}' has a workspace slot")
            if not 0 <= b.slot < len(low.slots):
                raise self.fail(f"buffer '%{name}' is in slot {b.slot}, outside the workspace's "
                                f"{len(low.slots)} slots")
            if low.nbytes(b) not in low.slots[b.slot]:
                raise self.fail(f"slot {b.slot} does not list the size of '%{name}' ({low.nbytes(b)} bytes)")
            by_slot.setdefault(b.slot, []).append(name)
        for s, names in by_slot.items():
            spans = sorted((live[n], n) for n in names if n in live)
            for (a, na), (b, nb) in zip(spans, spans[1:]):
                if b[0] <= a[1]:
                    raise self.fail(f"'%{na}' and '%{nb}' share slot {s} while both are alive (k{b[0]})")

    # ---------------------------------------------------------------- kernels

    def group(self, g, defined: set[str]) -> None:
        if g.blocks < 0:
            raise self.fail(f"a group runs in {g.blocks} blocks")
        for v in g.outer:
            if v not in g.sizes:
                raise self.fail(f"group loop '{v}' has no size")
        regs: dict[str, int] = {}
        mine: set[str] = set()   # the members' outputs so far
        for j, m in enumerate(g.members):
            if not isinstance(m, LoopKernel):
                raise self.fail("a group's members are loop kernels")
            if tuple(m.loops[:len(g.outer)]) != tuple(g.outer) and not self.partial(g, m):
                raise self.fail(f"member {j} (%{m.out}) does not start with the group's loops "
                                f"{', '.join(g.outer)}")
            for v in g.outer:
                if v in m.sizes and not self.same_size(m.sizes[v], g.sizes[v]):
                    raise self.fail(f"member {j} (%{m.out}) runs '{v}' over {m.sizes[v]}, the group over "
                                    f"{g.sizes[v]}")
            scope = dict(g.sizes)
            if g.blocks:
                scope[BLOCK_EDGE] = g.blocks
            self.loop(m, _Readable(defined, mine), scope, set(regs))
            if m.out in g.regs:
                if m.out in regs:
                    raise self.fail(f"register '%{m.out}' is written twice")
                regs[m.out] = j
            mine.add(m.out)
        for r in g.regs:
            if r not in regs:
                raise self.fail(f"register '%{r}' is never written")

    @staticmethod
    def partial(g, m: LoopKernel) -> bool:
        """A member summing over the first outer loop (into its block's row) runs it last."""
        return bool(g.blocks) and bool(g.outer) and g.outer[0] in m.red and set(g.outer) <= set(m.loops)

    def loop(self, k: LoopKernel, defined: set[str], outer: dict, regs: set[str]) -> None:
        low = self.low
        if k.out in low.buffers and low.buffers[k.out].dtype in NARROW and (k.reduce or k.scatter):
            raise self.fail(f"a {'scatter' if k.scatter else 'reduction'} writes '%{k.out}', a "
                            f"{low.buffers[k.out].dtype} buffer (its partial values would be rounded)")
        if k.reduce not in REDUCTIONS or (k.scatter and k.reduce not in ("", "max", "min")):
            raise self.fail(f"unknown reduction '{k.reduce}'" + (" for a scatter" if k.scatter else ""))
        for v in k.loops:
            if v not in k.sizes:
                raise self.fail(f"loop '{v}' has no size")
        if len(set(k.loops)) != len(k.loops):
            raise self.fail(f"a loop variable appears twice in {', '.join(k.loops)}")
        for v in k.red:
            if v not in k.loops:
                raise self.fail(f"reduces over '{v}', which is not one of its loops")
        if k.red and not k.reduce and not k.scatter:
            raise self.fail("reduced loops without a reduction")
        if k.epilogue is not None and not k.reduce:
            raise self.fail("an epilogue without a reduction")
        bound = set(k.loops) | set(outer)
        if k.out not in low.buffers and k.out not in regs | set(self.group_regs()):
            raise self.fail(f"writes undeclared buffer '%{k.out}'")
        self.index(k.out, k.index, bound)
        if k.out in low.buffers:
            for e, ix in k.index:
                v = ix.as_var()
                if v is not None and v in k.sizes and not k.scatter and not self.same_size(k.sizes[v], low.size(e)) \
                        and v not in k.bounds and not self.piece(k, v, e):
                    raise self.fail(f"loop '{v}' runs over {k.sizes[v]} but writes edge '{e}' of "
                                    f"%{k.out}, of size {low.size(e)}")
        for v, (lo, hi) in k.bounds.items():
            if v not in k.loops:
                raise self.fail(f"bounds for '{v}', which is not one of its loops")
            for ix in lo + hi:
                self.ix(ix, bound, _Readable(defined, regs))
        can_read = _Readable(defined, regs | ({k.out} if k.scatter or set(k.red) & set(outer) else set()))
        self.expr(k.body, bound, can_read, False)
        if k.epilogue is not None:
            self.expr(k.epilogue, bound, can_read, True)

    def piece(self, k: LoopKernel, v: str, e: str) -> bool:
        """Whether loop `v` of `k`, writing edge `e` of its output, may be shorter than
        the edge: a piece (tgc.lower.pieces), one of several plain loop kernels of this
        program that write the buffer, each over its range (both sizes integers)."""
        n, m = k.sizes[v], self.low.size(e)
        if not (isinstance(n, int) and isinstance(m, int) and n < m) or k.reduce or k.scatter:
            return False
        if not hasattr(self, "_plain_writers"):   # (once: asked per short loop)
            self._plain_writers = collections.Counter(
                w.out for other in self.low.kernels for w in (other.members if _is_group(other) else (other,))
                if isinstance(w, LoopKernel) and not w.reduce and not w.scatter)
        return self._plain_writers[k.out] >= 2

    def group_regs(self) -> list[str]:
        k = self.low.kernels[self.k] if self.k is not None else None
        return list(k.regs) if _is_group(k) else []

    def gemm(self, k: GemmKernel, defined: set[str]) -> None:
        low = self.low
        for v in (k.a, k.b):
            if v.buf not in low.buffers:
                raise self.fail(f"reads undeclared buffer '%{v.buf}'")
            if v.buf not in defined:
                raise self.fail(f"reads '%{v.buf}' before anything writes it")
            if sorted(b for _, b in v.edges) != list(low.buffers[v.buf].edges):
                raise self.fail(f"the view {v} does not name every edge of '%{v.buf}' once")
        for v, r in zip((k.a, k.b), k.rounded):
            if r and (k.cplx is not None or low.buffers[v.buf].dtype != "f32"):
                raise self.fail(f"round_bf16 of '%{v.buf}', which is not a real f32 buffer")
        if k.out not in low.buffers:
            raise self.fail(f"writes undeclared buffer '%{k.out}'")
        if low.buffers[k.out].dtype in NARROW:
            raise self.fail(f"a GEMM writes '%{k.out}', a {low.buffers[k.out].dtype} buffer")
        if k.acc:   # `out += a @ b` (tgc.lower.accumulate)
            if k.taps or k.shifts or k.cplx is not None or any(k.rounded) or k.epilogue:
                raise self.fail("an accumulating GEMM (+=) with taps, shifts, complex pairs, rounding or an epilogue")
            if k.out in (k.a.buf, k.b.buf):
                raise self.fail(f"an accumulating GEMM reads its output '%{k.out}' as an operand")
            if k.out not in defined:
                raise self.fail(f"adds into '%{k.out}' before anything writes it")
        pairs = ("re.im",) if k.cplx is not None else ()   # a complex product's float pairs
        if k.prefix:
            if not k.acc:
                raise self.fail("a GEMM's prefix on a GEMM that does not accumulate (+=)")
            for pe, be in k.prefix:
                if pe not in k.out_edges() or be not in low.buffers[k.out].edges:
                    raise self.fail(f"a GEMM's prefix '{pe} in {be}': no product edge and edge of '%{k.out}'")
                ps, bs = low.size(pe), low.size(be)
                if isinstance(ps, int) and isinstance(bs, int) and ps > bs:
                    raise self.fail(f"a GEMM's prefix '{pe} in {be}' is longer than '{be}' ({ps} > {bs})")
        if sorted([k.out_edge(e) for e in k.batch + k.m + k.n] + list(pairs)) != list(low.buffers[k.out].edges):
            raise self.fail(f"a GEMM into '%{k.out}' over batch, m, n edges {', '.join(k.batch + k.m + k.n)}; "
                            f"the buffer has {', '.join(low.buffers[k.out].edges)}")
        a, b = dict(k.a.edges), dict(k.b.edges)
        shift_vars = {v for _, _, ix in k.shifts for v in ix.vars()}
        groups = set(k.batch + k.m + k.n + k.k + k.taps)
        for e in groups:
            if e not in a and e not in b and e not in shift_vars:
                raise self.fail(f"GEMM edge '{e}' is in neither operand nor a shift")
        for e in (set(a) | set(b)) - set(pairs):   # the views map `re.im` to itself
            if e not in groups:
                raise self.fail(f"operand edge '{e}' is in none of the GEMM's groups")
        shifted = {e for _, e, _ in k.shifts}
        for e in set(a) & set(b):
            if e not in shifted and not self.same_size(low.size(a[e]), low.size(b[e])):
                raise self.fail(f"GEMM operands disagree on the size of '{e}': {low.size(a[e])} and {low.size(b[e])}")
        for role, e, ix in k.shifts:
            if role not in ("a", "b") or e not in (a if role == "a" else b):
                raise self.fail(f"a shift of {role}.{e}, which is no edge of that operand")
            self.ix(ix, set(k.batch) | set(k.taps) | set(a) | set(b), defined)
        if k.epilogue:
            self.gemm_epilogue(k, defined)

    def gemm_epilogue(self, k: GemmKernel, defined: set[str]) -> None:
        """An epilogue (`tgc.lower.epilogue`): outputs over the product's edges, each
        written once, none an operand; `acc` for the product, never a load of `out`
        where it holds the product (`out` may be an output: loaded only by the outputs
        after it, its new value); outputs read (earlier ones' new values, its own old
        one) only at the element's own index."""
        low, edges = self.low, set(k.out_edges())
        if k.cplx is not None or k.taps or k.shifts:
            raise self.fail("an epilogue on a complex GEMM or one with taps or shifts")
        outs = [o.buf for o in k.epilogue]
        if len(set(outs)) != len(outs) or {k.a.buf, k.b.buf} & set(outs):
            raise self.fail("an epilogue's outputs are distinct buffers, none an operand")
        product = outs.index(k.out) if k.out in outs else len(outs)   # `out` holds the product until then
        seen = {k.out}   # with `defined`
        for j, o in enumerate(k.epilogue):
            if o.buf not in low.buffers:
                raise self.fail(f"writes undeclared buffer '%{o.buf}'")
            if set(low.buffers[o.buf].edges) != edges:
                raise self.fail(f"the epilogue's output '%{o.buf}' has edges {', '.join(low.buffers[o.buf].edges)}, "
                                f"not the product's {', '.join(sorted(edges))}")
            own = set(outs[: j + 1])
            for n in walk(o.expr):
                if isinstance(n, Load) and n.buf == k.out and j <= product:
                    raise self.fail(f"an epilogue loads the product '%{k.out}' (it reads acc)")
                if isinstance(n, Load) and n.buf in own and any(ix != Ix.var(e) for e, ix in n.index):
                    raise self.fail(f"an epilogue reads its output '%{n.buf}' away from the element's own index")
            self.expr(o.expr, edges, _Readable(defined, seen, () if j > product else (k.out,)), True)
            seen.add(o.buf)

    # ---------------------------------------------------------------- expressions and indices

    def index(self, buf: str, index, bound: set[str], defined: set[str] | None = None) -> None:
        edges = [e for e, _ in index]
        have = self.low.buffers[buf].edges if buf in self.low.buffers else None
        if have is not None and tuple(edges) != have:
            raise self.fail(f"an index of '%{buf}' over [{', '.join(edges)}]; the buffer's edges are "
                            f"[{', '.join(have)}]")
        for _, ix in index:
            self.ix(ix, bound, defined)

    # expressions and index atoms, each node checked before its operands (`ExprVisitor`):
    # `bound` the loop variables, `defined` the buffers it may read, `acc` whether `Acc` may appear

    def expr_load(self, e: Load, bound: set[str], defined: set[str], acc: bool) -> None:
        if e.buf not in defined:
            if e.buf in self.group_regs():
                raise self.fail(f"reads register '%{e.buf}' before a member writes it")
            if e.buf not in self.low.buffers:
                raise self.fail(f"reads undeclared buffer '%{e.buf}'")
            raise self.fail(f"reads '%{e.buf}' before anything writes it")
        self.index(e.buf, e.index, bound, defined)

    def expr_const(self, e: Const, bound: set[str], defined: set[str], acc: bool) -> None:
        pass

    def expr_size_of(self, e: SizeOf, bound: set[str], defined: set[str], acc: bool) -> None:
        pass

    def expr_acc(self, e: Acc, bound: set[str], defined: set[str], acc: bool) -> None:
        if not acc:
            raise self.fail("'acc' outside the epilogue of a reduction")

    def expr_mask(self, e: Mask, bound: set[str], defined: set[str], acc: bool) -> None:
        for c in e.conds:
            if c.op not in ("=", "!=", "<", "<=", ">", ">="):
                raise self.fail(f"unknown comparison '{c.op}'")
            self.ix(c.ix, bound, defined)
        self.expr(e.arg, bound, defined, acc)

    def expr_add(self, e: Add, bound: set[str], defined: set[str], acc: bool) -> None:
        if len(e.coefs) != len(e.args):
            raise self.fail(f"a sum of {len(e.args)} terms with {len(e.coefs)} coefficients")
        for a in e.args:
            self.expr(a, bound, defined, acc)

    def expr_mul(self, e: Mul, bound: set[str], defined: set[str], acc: bool) -> None:
        for a in e.args:
            self.expr(a, bound, defined, acc)

    def expr_map(self, e: Map, bound: set[str], defined: set[str], acc: bool) -> None:
        if e.fn not in MAP_FNS:
            raise self.fail(f"unknown function '{e.fn}'")
        for a in e.args:
            self.expr(a, bound, defined, acc)

    def expr_rand(self, e: Rand, bound: set[str], defined: set[str], acc: bool) -> None:
        if e.kind not in ("rand", "randn") or e.draw not in ("", "f32"):
            raise self.fail(f"unknown draw '{e.kind}'" + (f" as {e.draw}" if e.draw else ""))
        self.ix(e.key, bound, defined)
        self.ix(e.counter, bound, defined)

    def ix(self, ix: Ix, bound: set[str], defined: set[str] | None) -> None:
        for a, _ in ix.terms:
            self.atom(a, bound, defined)

    def atom_var(self, a: str, bound: set[str], defined: set[str] | None) -> None:
        if a not in bound:
            raise self.fail(f"index uses '{a}', which is not a loop here")

    def atom_id_load(self, a: IdLoad, bound: set[str], defined: set[str] | None) -> None:
        b = self.low.buffers.get(a.buf)
        if b is None or b.dtype != "i32":
            raise self.fail(f"an id load from '%{a.buf}', which is not an i32 buffer")
        if defined is not None and a.buf not in defined:
            raise self.fail(f"reads ids from '%{a.buf}' before anything writes it")
        self.index(a.buf, a.index, bound, defined)

    def atom_floor_div(self, a: FloorDiv, bound: set[str], defined: set[str] | None) -> None:
        self.ix(a.num, bound, defined)
