"""Loops over an edge in the lowered program: how `fuse` lowers a `loop` value
(`repeat`, `scan`, their derivative loops) to a `StepLoop` (tgc.lower.lowered).

The loop's body becomes a module of its own, the step: each body parameter an
argument, each result an output, every axis order fixed here. It is lowered like
any program (`fuse` now, the later stages by the pass manager, which runs every
stage on the steps first: `tgc.manager`), so its kernels are compiled once,
whatever the trip count. In the enclosing program the loop gets buffers whose
orders are fixed here too (layout keeps an order it finds set), and fusion stops
at them:

- each carry a buffer `C` the loop reads as the step's argument and writes after
  each step from the step's output `N` (the carry's new value, a buffer of its
  own): a copy kernel fills `C` with the initial value first (unless that value is
  a temporary in `C`'s order that nothing but the loop reads: then it is `C`), and
  `C` holds the loop's result at the end (`tgc.lower.accumulate` may later bind `N` to
  `C` itself); `C`'s order is that of the program's outputs over its edges when they
  all have one (`carry_order`), else the declaration order;
- each stacked operand a buffer with the loop edge outermost (step i reads the
  slice at offset i); an argument of the program stored that way, or another
  loop's result (stored so: the carries a forward loop keeps for the backward one),
  is bound as it is; so is an argument x split into blocks of an edge E
  (`x[E = Ec + B*i]`: a stream's rows of q, a key loop's blocks of k, v and of the
  dk, dv carries) or read one index of E a step (a stream's loop over the heads),
  when every edge before E in x's order has size 1: step i's block is then the slice
  at offset i times its size (`Bind.split`), read in x's order; any other operand is
  copied in first;
- each loop-invariant operand: an argument of the program or another loop's result
  as it is, else a copy (a window of a stored tensor, a masked stream's keys, in
  that tensor's order, so that the copy runs along both);
- each stacked result a buffer with the loop edge outermost, step i writing its
  slice (an output of the program stored with that edge outermost, or after edges of
  size 1 only, `Bind.split` then, and read by nothing else: that output's buffer),
  the rest in the order of the program's outputs over its edges with a block edge Ec
  named E (or with the edge a loop runs one index a step added), where there is one:
  the join of a key loop's dk blocks, or a head loop's results, back into the
  outputs then copies along both buffers (`block_order`); else, as a stream's
  operands copied in, in the declaration order with each block edge Ec ranked as E
  (`block_decl_order`: a block of rows `[batch, c, t.2]` stored as the program
  stores `[batch, c, t]`, so that the copies in and the joins out run along both).

The copies cost one pass over an operand per call (the stacked params: once
per step's slice), against the steps' work on the same values.
"""
from __future__ import annotations

from tgc.ir import values as V
from tgc.ir.dtypes import narrower, rounding
from tgc.ir.module import Arg, Module, Output
from tgc.ir.values import Value, holds_logsumexp, rebuild_same, topo_order
from tgc.lower.indexing import edge_size
from tgc.lower.lowered import Bind, Buffer, StepLoop
from tgc.lower.reader_order import arg_order


def loop_key(v: Value) -> tuple:
    """The loop a `loop` value is an output of: its body, edge, direction and operands."""
    body, edge, reverse, _ = v.attrs
    return (body, edge, reverse) + tuple(map(id, v.operands))


class StepLowering:
    """The loops of a module being fused: their buffers (made before the rest of the
    partition, so that a loop's results are buffers), then their kernels."""

    def __init__(self, fuser):   # the `tgc.lower.fuse` fuser lowering the module
        self.f = fuser
        self.groups: dict[tuple, list[Value]] = {}
        for v in fuser.values:
            if v.op == "loop":
                self.groups.setdefault(loop_key(v), []).append(v)
        self.merge_extended()
        self.group_of = {id(v): key for key, vs in self.groups.items() for v in vs}
        self.plans: dict[tuple, dict] = {}
        self.emitted: set[tuple] = set()

    def merge_extended(self) -> None:
        """A loop whose body another loop of the same operands extends (the same
        parameters and carries, the same first results, more stacked ones: the forward
        loop reverse mode builds to keep a `repeat`'s carries) runs once: the shorter
        loop's outputs are the longer one's."""
        for key, vs in list(self.groups.items()):
            body = vs[0].attrs[0]
            for other, ws in self.groups.items():
                o = ws[0].attrs[0]
                if other is key or other[1:] != key[1:] or o is body or len(o.results) <= len(body.results) \
                        or (o.carries, o.slices) != (body.carries, body.slices) \
                        or len(o.params) != len(body.params) \
                        or any(p is not q for p, q in zip(o.params, body.params)) \
                        or any(r is not q for r, q in zip(o.results, body.results)):
                    continue
                ws.extend(vs)
                del self.groups[key]
                break

    def prepare(self) -> None:
        """Buffers for every loop's results; the loop values are materialized there."""
        for key, vs in self.groups.items():
            self.plans[key] = self.plan(vs[0])
            outs = self.plans[key]["results"]
            for v in vs:
                self.f.mat[id(v)] = outs[v.attrs[3]]

    def order(self, edges) -> tuple[str, ...]:
        return tuple(self.f.m.order_edges(edges))

    def temp(self, stem: str, dtype: str, order: tuple[str, ...]) -> str:
        low = self.f.low
        name = low.fresh(stem)
        low.buffers[name] = Buffer(name, dtype, tuple(sorted(order)), "temp", order=order)
        return name

    def plan(self, v: Value) -> dict:
        body, edge, reverse, _ = v.attrs
        ops = v.operands
        args: list[Bind] = []
        arg_orders: list[tuple[str, ...]] = []
        copies: list[tuple[str, Value]] = []   # (buffer, operand) copied in before the loop
        # the blocks E = Ec + B*edge the loop splits its operands into: a stacked result over
        # Ec is laid out as the program's outputs over E (a key loop's blocks of dk, dv,
        # joined back over the keys and added to the step's carries in their order)
        splits = [sp for k, o in enumerate(ops) if body.role(k) == "slice"
                  for sp in [split_edge(o, edge)] if sp is not None]
        blocks = {ec: e for e, ec in splits}
        # ... and one over the edge E a loop runs one index a step (its operands renamed E to
        # the loop edge: the heads of a stream's loops) as those outputs with E outermost
        blocks.update({"": o.attrs[0][0][0] for k, o in enumerate(ops) if body.role(k) == "slice"
                       and o.op == "rename" and len(o.attrs[0]) == 1 and o.attrs[0][0][1] == edge})
        # for the declaration order, each block edge ranks as the first declared of the edges
        # it splits (a stream's rows t.2 of x over t and of q over its rename t.1: as t)
        rank = {e: i for i, e in enumerate(self.f.m.edges)}
        ranked: dict[str, str] = {}
        for e, ec in splits:
            if ec not in ranked or rank.get(e, len(rank)) < rank.get(ranked[ec], len(rank)):
                ranked[ec] = e
        for k, (o, p) in enumerate(zip(ops, body.params)):
            role = body.role(k)
            dtype = self.f.dtype_of(p)
            inner = self.carry_order(p.edges) if role == "carry" else self.block_decl_order(p.edges, ranked)
            order = ((edge,) + inner) if role == "slice" else inner
            view = self.split_view(o, p, edge) if role == "slice" else None
            if view is not None:   # a block of a stored argument, read in place
                args.append(Bind(view[0], True, view[2]))
                arg_orders.append(view[1])
                continue
            if o.op == "arg" and role != "carry":
                have = self.f.m.args[o.attrs[0]].order
                if role == "invariant" or (have and have[0] == edge):
                    args.append(Bind(o.attrs[0], role == "slice"))
                    arg_orders.append(tuple(have[1:]) if role == "slice" else tuple(have))
                    continue
                if self.outer_ones(have, edge) and self.f.dtype_of(p) == o.dtype:
                    # the loop edge after edges of size 1 (heads after a batch of 1): step i's
                    # slice lies at offset i times its size as well, read in place
                    args.append(Bind(o.attrs[0], True, edge))
                    arg_orders.append(tuple(e for e in have if e != edge))
                    continue
            held = self.f.mat.get(id(o))
            stored = self.stored_order(held, edge, role, inner)
            if role != "carry" and stored is not None:
                args.append(Bind(held, role == "slice"))   # another loop's result, read as it is stored
                arg_orders.append(stored)
                continue
            if role == "carry" and held is not None and self.dies_here(o, v, held, order):
                args.append(Bind(held, False))   # an initial value read by this loop alone: updated in place
                arg_orders.append(inner)
                continue
            if role == "invariant":
                order = inner = self.window_order(o) or inner
            buf = self.temp("c" if role == "carry" else "s" if role == "slice" else "w", dtype, order)
            copies.append((buf, o))
            args.append(Bind(buf, role == "slice"))
            arg_orders.append(inner)
        outs: list[Bind] = []
        results: list[str] = []
        out_orders: list[tuple[str, ...]] = []
        for j, r in enumerate(body.results):
            dtype = self.f.dtype_of(r)
            inner = self.carry_order(r.edges) if j < body.carries else self.block_order(r.edges, blocks, ranked)
            if j >= body.carries and inner in (self.order(r.edges), self.block_decl_order(r.edges, ranked)):
                inner = self.split_order(r) or self.reader_order(v, j, edge, inner)
            if j < body.carries:
                outs.append(Bind(self.temp("n", dtype, inner)))
                results.append(args[j].buf)
            else:
                home = self.output_home(v, j, edge, dtype)
                split = ""
                if home is not None:
                    buf, inner, split = home
                else:
                    buf = self.temp("y", dtype, (edge,) + inner)
                outs.append(Bind(buf, True, split))
                results.append(buf)
            out_orders.append(inner)
        step = self.step_module(body, arg_orders, out_orders)
        return {"args": tuple(args), "outs": tuple(outs), "copies": copies, "results": results,
                "step": step, "edge": edge, "reverse": reverse, "carries": body.carries,
                "note": _note(v, body), "lse": self.lse_args(v)}

    def lse_args(self, v: Value) -> frozenset[str]:
        """The step's arguments bound to a log-sum-exp (`holds_logsumexp`: the first key
        loop's lse, which the second reads as an invariant), marked `Buffer.lse` in the
        step so that its softmax weights exp(X - m - lse) take the sum unrounded
        (`lowered.wide_exp`), as the unstreamed program's do."""
        body, bufs = v.attrs[0], self.f.low.buffers

        def marked(x: Value) -> bool:   # an argument of a step bound to one in turn
            return x.op == "arg" and x.attrs[0] in bufs and bufs[x.attrs[0]].lse
        return frozenset(f"p{k}" for k, o in enumerate(v.operands)
                         if body.role(k) == "invariant" and holds_logsumexp(o, marked))

    def stored_order(self, held: str | None, edge: str, role: str, inner: tuple[str, ...]) -> tuple[str, ...] | None:
        """The step's order of an operand held in buffer `held` (another loop's result),
        read as it is stored: the buffer's order (without the loop edge, outermost
        there, for a slice) when it holds the operand's edges in some order; else None
        (no order yet: a temporary that `layout` orders later; a slice stored with
        another edge outermost). Any order serves: the step is built for the one it
        gets, and a saved value's order is its forward step's (`split_order`)."""
        have = self.f.low.buffers[held].order if held is not None else None
        if not have:
            return None
        if role == "slice":
            if have[0] != edge:
                return None
            have = have[1:]
        return tuple(have) if sorted(have) == sorted(inner) else None

    def split_order(self, r: Value) -> tuple[str, ...] | None:
        """A stacked result's order when it is (a rename of) an index split of a value x
        of the step, `x[E = e1 + |e1|*e2 + ...]` (a projection's `[batch, t, c2]` read as
        heads `[batch, t, head, hd]`): x's declaration order with E replaced by its parts,
        the most significant first, renamed as the result. The step then writes the
        result along x's rows (x's order in memory: a GEMM's rows of E), and a GEMM of
        the step that reads it (attention's keys and values, batched over the heads)
        reads it in place with a longer row stride; in the declaration order
        (`[batch, head, hd, t]`) that kernel wrote it transposed, and a GEMM reading
        it under another name of its edges (`t -> s`) needed a copy of its own. None
        where `r` is no such split (the declaration order stays)."""
        from tgc.lower.indexing import norm_size
        from tgc.lower.views import peel

        base, mapping = peel(r)
        if base.op != "contract" or len(base.operands) != 2:
            return None
        ind = [o for o in base.operands if o.op == "indicator"]
        xs = [o for o in base.operands if o.op != "indicator"]
        if len(ind) != 1 or len(xs) != 1:
            return None
        rel, x = ind[0].attrs[0], xs[0]
        gone, parts = set(x.edges) - set(base.edges), set(base.edges) - set(x.edges)
        if len(gone) != 1 or len(parts) < 2 or set(base.edges) != (set(x.edges) - gone) | parts \
                or rel.ops != ("=",) or len(rel.exprs) != 2:
            return None
        E = gone.pop()
        lhs, rhs = rel.exprs
        if lhs.terms != ((E, 1),) or lhs.const != 0:
            lhs, rhs = rhs, lhs
        if lhs.terms != ((E, 1),) or lhs.const != 0 or rhs.const != 0 or set(rhs.edges()) != parts:
            return None
        m = self.f.m
        coef = {e: norm_size(m, c) for e, c in rhs.terms}
        if not all(isinstance(c, int) for c in coef.values()):
            return None
        ranked = sorted(parts, key=lambda e: coef[e])
        step, want = 1, []
        for e in ranked:   # a mixed radix exactly: each part's place is the product of the sizes below it
            n = edge_size(m, e)
            if coef[e] != step or not isinstance(n, int):
                return None
            step *= n
        if step != edge_size(m, E):
            return None
        for e in self.order(x.edges):
            want += list(reversed(ranked)) if e == E else [e]
        back = {b: v for v, b in mapping.items()}
        return tuple(back[e] for e in want)

    def split_view(self, o: Value, p: Value, edge: str) -> tuple[str, tuple[str, ...], str] | None:
        """(argument, the step's order, E) when the stacked operand `o` is an argument x of
        the program split as `x[E = Ec + B*edge]` (B = |Ec|, exactly |E| = B |edge|) and x
        is stored with every edge before E of size 1: step i's block of E is then the
        slice at offset i times its size, read in place (`Bind.split`) instead of a
        copy of x stacked over the loop edge (a key block of a step's `[s, hd]` keys,
        tgc.opt.stream_keys). The step reads it in x's order, E renamed Ec."""
        sp = split_edge(o, edge)
        x = o.operands[0] if sp is not None else None
        if x is None or x.op != "arg" or self.f.dtype_of(p) != x.dtype:
            return None
        E, Ec = sp
        have = self.f.m.args[x.attrs[0]].order
        rel = o.operands[1].attrs[0]
        b, n, whole = (edge_size(self.f.m, e) for e in (Ec, edge, E))
        if not have or E not in have or E not in x.edges or Ec in x.edges or edge in x.edges \
                or not all(isinstance(z, int) for z in (b, n, whole)) or b * n != whole:
            return None
        lhs, rhs = rel.exprs
        if lhs.const != 0 or tuple(lhs.terms) != ((E, 1),) or rhs.const != 0 \
                or dict(rhs.terms) != {Ec: 1, edge: b}:
            return None
        if any(edge_size(self.f.m, e) != 1 for e in have[:have.index(E)]):
            return None
        order = tuple(Ec if e == E else e for e in have)
        if sorted(o.edges) != sorted(order + (edge,)) or tuple(sorted(order)) != tuple(sorted(p.edges)):
            return None
        return x.attrs[0], order, E

    def block_order(self, edges, blocks: dict[str, str], ranked: dict[str, str]) -> tuple[str, ...]:
        """A stacked result's order: where it has a block edge Ec of E (`blocks`) and not E,
        that of the program's outputs over its edges with Ec named E (`carry_order`), Ec in
        E's place; else the declaration order, a block edge ranked as its first declared E
        (`ranked`, `block_decl_order`)."""
        if "" in blocks and blocks[""] not in edges:
            e = blocks[""]
            order = self.carry_order(list(edges) + [e])
            return tuple(x for x in order if x != e)
        ren = {ec: e for ec, e in blocks.items() if ec in edges and e not in edges}
        if not ren:
            return self.block_decl_order(edges, ranked)
        back = {e: ec for ec, e in ren.items()}
        named = [ren.get(e, e) for e in edges]
        order = self.carry_order(named)
        if order == self.order(named):   # no output over them: as any stacked result
            return self.block_decl_order(edges, ranked)
        return tuple(back.get(e, e) for e in order)

    def block_decl_order(self, edges, blocks: dict[str, str]) -> tuple[str, ...]:
        """The declaration order of `edges` with each block edge Ec of E (`blocks`, where
        E is not among them) ranked as E: a stream's block of rows `[batch, c, t.2]` is
        laid out as the whole `[batch, c, t]` is by default (`[batch, t, c]` where t is
        declared first), not with the fresh edge t.2 innermost because it was declared
        last. The stream's operands copied in and its stacked results joined back after
        it then move along the rows of both buffers, and the kernels after the stream
        read the joined values in the layout the unstreamed program gives them (GPT-2
        small at t = 1024: its layer's saved activations were transposed by the joins,
        [batch, ff, t.2] blocks into [batch, t, ff], and its layernorm backward read a
        gradient stored [batch, c, t] across rows; 59 and 15 ms of a layer's 470)."""
        ren = {ec: e for ec, e in blocks.items() if ec and ec in edges and e not in edges}
        if not ren:
            return self.order(edges)
        back = {e: ec for ec, e in ren.items()}
        return tuple(back.get(e, e) for e in self.order([ren.get(e, e) for e in edges]))

    def output_home(self, v: Value, j: int, edge: str, dtype: str) -> tuple[str, tuple[str, ...], str] | None:
        """(the program's output buffer, the step's order of result j, the split edge)
        when the loop's stacked result j is an output of the program stored with the loop
        edge outermost, or after edges of size 1 only (split: the loop edge, `Bind.split`;
        else ""), (a stream's loop over the heads returns `dq` so) and nothing else reads
        it: the steps then write their slices there, with no copy from a temporary after
        the loop; else None. The output's buffer is made here (`fuse.homes` finds it)."""
        mine = [w for w in self.groups[loop_key(v)] if w.attrs[3] == j]
        if len(mine) != 1 or self.f.users[id(mine[0])] or self.f.root_uses[id(mine[0])] != 1:
            return None
        hit = [(i, o) for i, o in enumerate(self.f.m.outputs) if o.value is mine[0]]
        if len(hit) != 1 or dtype != self.f.opt.dtype:
            return None
        i, o = hit[0]
        if not o.order or not self.outer_ones(o.order, edge) or o.name in self.f.low.buffers:
            return None
        self.f.low.buffers[o.name] = Buffer(o.name, self.f.opt.dtype, mine[0].edges, "out", i, o.order)
        return o.name, tuple(e for e in o.order if e != edge), "" if o.order[0] == edge else edge

    def reader_order(self, v: Value, j: int, edge: str, inner: tuple[str, ...]) -> tuple[str, ...]:
        """Stacked result j's order: that of the arguments its elementwise readers combine
        it with (`tgc.lower.reader_order`: a layer stack's weight gradient as the weight
        and its optimizer states are stored), else `inner`."""
        order = arg_order(self.f, [w for w in self.groups[loop_key(v)] if w.attrs[3] == j], edge)
        return order if order is not None and sorted(order) == sorted(inner) else inner

    def outer_ones(self, order, edge: str) -> bool:
        """Whether `edge` is in `order` with every edge before it of size 1: a buffer so
        stored holds the loop's slices at offsets i times their size, as one stored with
        `edge` outermost."""
        if not order or edge not in order:
            return False
        return all(edge_size(self.f.m, e) == 1 for e in order[:list(order).index(edge)])

    def carry_order(self, edges) -> tuple[str, ...]:
        """A carry's order: that of the program's outputs over exactly its edges when they
        all have one (a gradient summed over the steps, `dk` of a streamed attention, is
        such an output: its final copy then runs along both buffers, and a GEMM adding a
        block of keys into the carry, `tgc.lower.accumulate`, writes one contiguous run of
        whole rows: in the declaration order `[.., hd, s]` its 64 rows lay 8 KiB apart at
        t = 2048, 181.7 / 178.1 against 174.7 / 164.2 ms of one thread's time); else the
        declaration order. Every loop of a chain of carries (a masked stream's runs) picks
        the same one, so that each updates the buffer the one before it left."""
        orders = {tuple(o.order) for o in self.f.m.outputs if sorted(o.order) == sorted(edges)}
        return orders.pop() if len(orders) == 1 else self.order(edges)

    def window_order(self, o: Value) -> tuple[str, ...] | None:
        """The order of a window of a stored tensor (`x` contracted with renaming
        indicators `[e = f + c]`: a masked stream's run reads its keys so), that
        tensor's buffer order with each `e` renamed `f`, so that the copy reads and
        writes along the same axes (the declaration order put the keys' window edge
        after `hd`: a transposing copy, about 6% of the benchmark's attention); else None."""
        if o.op != "contract" or not o.operands:
            return None
        x, inds = o.operands[0], o.operands[1:]
        held = self.f.m.args[x.attrs[0]].order if x.op == "arg" else \
            (self.f.low.buffers[self.f.mat[id(x)]].order if id(x) in self.f.mat else None)
        if not held or any(i.op != "indicator" for i in inds):
            return None
        rename = {}
        for i in inds:
            rel = i.attrs[0]
            if rel.ops != ("=",) or len(rel.exprs) != 2 or any(len(e.terms) != 1 for e in rel.exprs):
                return None
            (a, ka), (b, kb) = rel.exprs[0].terms[0], rel.exprs[1].terms[0]
            if ka != 1 or kb != 1 or (a in x.edges) == (b in x.edges):
                return None
            if a in x.edges:
                rename[a] = b
            else:
                rename[b] = a
        order = tuple(rename.get(e, e) for e in held)
        return order if sorted(order) == sorted(o.edges) else None

    def dies_here(self, o: Value, v: Value, held: str, order: tuple[str, ...]) -> bool:
        """Whether the carry's initial value `o`, held in the temporary `held` in the
        carry's order, is read by nothing but loop `v` (the outputs of its loop, as
        one operand, not an output of the program), and every other value held in that
        buffer only before it (by values `v` depends on): then the loop updates that buffer
        in place, with no copy in (a masked stream's runs hand their `dk`, `dv` carries
        on so)."""
        buf = self.f.low.buffers[held]
        if buf.kind != "temp" or buf.order != order or sum(x is o for x in v.operands) != 1:
            return False
        before = {id(w) for w in self.groups[loop_key(v)]}   # this loop, and what runs before it
        todo = list(v.operands)
        while todo:
            w = todo.pop()
            if id(w) not in before:
                before.add(id(w))
                todo.extend(w.operands)
                if w.op == "loop":   # a loop runs whole: its other outputs are before too
                    todo.extend(self.groups[self.group_of[id(w)]])
        # every value held there (a loop's results, an earlier loop's that it updated in place)
        return all(not self.f.root_uses[id(w)] and self.f.users[id(w)] <= before
                   for w in self.f.values if self.f.mat.get(id(w)) == held)

    def step_module(self, body: V.LoopBody, arg_orders, out_orders) -> Module:
        """The step as a module: parameter k is argument `p<k>`, result j output `r<j>`."""
        m = self.f.m
        args = {}
        memo: dict[int, Value] = {}
        for k, (p, order) in enumerate(zip(body.params, arg_orders)):
            name = f"p{k}"
            # a value of a narrower type (bf16; f32 in an f64 program) is read from floats; one of a
            # wider type (f64 in an f32 program) is declared so, held in the float type as any
            low = p.dtype in narrower(self.f.opt.dtype)
            held = self.f.opt.dtype if low else p.dtype
            args[name] = Arg(name, "input", held, order)
            # (its values are that type's: rounding them again, as `emulate_low` writes a
            # conversion, is exact and leaves no `to_bf16` for a backend to compile)
            memo[id(p)] = V.map_(rounding(p.dtype), V.arg(name, held, p.edges)) if low else V.arg(name, held, p.edges)
        for u in topo_order(list(body.results)):
            if id(u) not in memo:
                memo[id(u)] = rebuild_same(u, tuple(memo[id(o)] for o in u.operands))
        outputs = [Output(f"r{j}", memo[id(r)], order) for j, (r, order) in enumerate(zip(body.results, out_orders))]
        return Module(dict(m.dims), dict(m.edges), args, outputs)

    def kernels(self, v: Value) -> list:
        """The kernels of `v`'s loop (its copies in, the loop), at the first of its
        outputs that the partition reaches."""
        key = self.group_of[id(v)]
        if key in self.emitted:
            return []
        self.emitted.add(key)
        plan = self.plans[key]
        out = [self.f.copy(buf, o) for buf, o in plan["copies"]]
        step = type(self.f)(plan["step"], self.f.opt, plan["lse"]).lower()   # the step lowered as a program of its own
        trip = edge_size(self.f.m, plan["edge"])
        out.append(StepLoop(plan["edge"], trip, plan["reverse"], step, plan["args"], plan["outs"],
                            plan["carries"], note=plan["note"]))
        return out


def split_edge(o: Value, edge: str) -> tuple[str, str] | None:
    """(E, Ec) when `o` is an operand split along a loop over `edge` as `E = Ec + B*edge`
    (a contraction with that indicator: `tgc.opt.stream`'s blocks), else None."""
    if o.op != "contract" or len(o.operands) != 2 or o.operands[1].op != "indicator":
        return None
    rel = o.operands[1].attrs[0]
    if rel.ops != ("=",) or len(rel.exprs[0].terms) != 1 or edge not in rel.exprs[1].edges():
        return None
    inner = [e for e in rel.exprs[1].edges() if e != edge]
    return (rel.exprs[0].terms[0][0], inner[0]) if len(inner) == 1 else None


def _hull(o: Value) -> tuple[str, str, int] | None:
    """(e, f, off) when `o` is an operand read over a fresh edge f at e = f + off (a
    contraction with that indicator: a masked stream's keys, tgc.opt.stream_skip)."""
    if o.op != "contract" or len(o.operands) < 2 or o.operands[-1].op != "indicator":
        return None
    rel = o.operands[-1].attrs[0]
    a, b = rel.exprs if len(rel.exprs) == 2 else (None, None)
    if rel.ops != ("=",) or len(a.terms) != 1 or len(b.terms) != 1 or a.const != 0 or b.terms[0][1] != 1 \
            or a.terms[0][1] != 1 or not isinstance(b.const, int):
        return None
    return a.terms[0][0], b.terms[0][0], b.const


def _note(v: Value, body: V.LoopBody) -> str:
    """What the loop is, for `tgc explain`: a `repeat`, a `scan`, or blocks of an edge."""
    edge = v.attrs[1]
    splits = [s for k, o in enumerate(v.operands) if body.role(k) == "slice" for s in [split_edge(o, edge)] if s]
    # the edge the loop is named after first (a key loop's keys, not its mask's window)
    splits.sort(key=lambda s: s[0].split(".")[0] != edge.split(".")[0])
    for split in splits[:1]:
        if split is not None:
            hulls = sorted({h for j, x in enumerate(v.operands) if body.role(j) == "invariant"
                            for h in [_hull(x)] if h is not None})
            keys = "".join(f"; only the keys {e} = {f} + {off} (a mask skips the rest)" for e, f, off in hulls)
            return (f"streams {split[0]} in blocks of {split[1]}: each step recomputes its block's values "
                    f"from the inputs, reductions over {split[0]} carried{keys}")
    return "repeat" if body.carries and body.stacked == 0 else "scan"

