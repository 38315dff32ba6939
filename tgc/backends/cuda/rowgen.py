"""CUDA C of a row group (`RowGroup`, the backends' own `rowgroup` stage, `rows.py`):
one kernel in two variants, one block per row (`kI`) and one warp per row
(`kI_warp`), the same body with `tpr` (threads per row) blockDim.x or 32.

For each row (a grid-stride loop over rows, the same number of iterations for every
thread, so barriers and shuffles are reached by all), each member in turn: an
elementwise member over the row's elements strided by the threads; a member reducing
to a value per row through `tgc_row_reduce` (shuffles, then shared memory for a
block), the value then in a register of every thread (`s_NAME`), written by the
row's first thread if it has a buffer. A barrier (`tgc_row_sync`) comes before a
member that reads from memory what an earlier one wrote.

When every member runs over the same inner loops (with no bounds) and either keeps
them all or reduces them all (softmax, layernorm), a row of at most `row_regs * tpr`
elements is held in registers: thread `lane` keeps elements lane + k * tpr,
k < row_regs (`c_NAME[k]`), inputs read once at the row's start, members' outputs
stored only if read elsewhere; longer rows take the path that reads and writes
memory.

A column member (`rows.column_member`: `db[c] = sum[rows] ...`) is summed while the
row is in hand: the rows are dealt to slots (`launches.row_slots`, a function of the
sizes: slot s takes rows s, s + slots, ... in order), a row's thread adds its
elements' terms to its columns' partials in double (registers when the row is held
in registers, else the slot's partial row in the scratch `part`), and the slot's
partial row is written to `part`; a second kernel (`kI_cols`, one thread per column)
adds the slots' partials in slot order, applies the epilogue and stores. The same
order of additions on both paths, every run and every GPU.

The members' expressions, indices and stores are the loop kernels' own (the
generator `gen`, `codegen._Gen`): a member computes what it computes as a loop
kernel, with its reductions in another order (sums in double). Generation walks
each member once per variant: it terminates.
"""
from __future__ import annotations

import re

from tgc.backends.cuda.ctext import Ctx, decompose, loads_of, split_flat
from tgc.backends.cuda.launches import COL_SCRATCH, CudaUnsupported, Launch
from tgc.backends.cuda.rows import RowGroup, column_member, inner_loops
from tgc.lower.lowered import Load, LoopKernel



class RowGroupGen:
    """The kernels and launches of the row group `g`, the `i`th kernel of the program
    `gen` generates (`codegen._Gen`: its module text and launch list, which `emit`
    extends)."""

    def __init__(self, gen, i: int, g: RowGroup):
        self.gen, self.i, self.g = gen, i, g
        self.low = gen.low
        self.row_regs = gen.row_regs
        self.name = f"{gen.prefix}k{i}"
        self.bufs = g.buffers_used()
        writes = sorted(g.writes(), key=self.bufs.index)
        self.outer = outer = list(g.outer)
        self.cols = [m for m in g.members if column_member(m, outer, g.sizes)]
        self.col_ids = [id(m) for m in self.cols]
        col_outs = {m.out for m in self.cols}
        self.row_writes = [w for w in writes if w not in col_outs]
        allv = list(dict.fromkeys(v for m in g.members for v in m.loops))
        self.var = {v: f"v{j}" for j, v in enumerate(allv)}
        self.osizes = [gen.size(g.sizes[v]) for v in outer]
        self.scalars = {m.out for m in g.members if set(dict(m.index)) == set(outer)}
        # C names of the values a thread holds: s_N (a row's value), c_N (its elements)
        self.cid = {b: n for n, b in enumerate(dict.fromkeys([m.out for m in g.members] + self.bufs))}
        self.reads_elsewhere = self.read_outside()
        self.inner0 = inner0 = inner_loops(g.members[0], outer)
        if any(sorted(v for v in m.loops if v not in m.red) != sorted(inner0)
               or any(m.sizes[v] != g.members[0].sizes[v] for v in inner0) for m in self.cols):
            raise CudaUnsupported("a row group's column sum over other loops than its first member's")
        self.uniform = all(id(m) in self.col_ids or set(inner_loops(m, outer)) == set(inner0)
                           and all(m.sizes[v] == g.members[0].sizes[v] for v in inner0)
                           and not (set(m.bounds) & set(inner0))
                           and (set(m.red) == set(inner0) if m.reduce else not m.red)
                           and (m.reduce or set(dict(m.index)) == set(outer) | set(inner0))
                           for m in g.members) and bool(inner0)
        red_member = next((m for m in g.members if m.reduce and id(m) not in self.col_ids), g.members[0])
        self.row_len = tuple(red_member.sizes[v] for v in inner_loops(red_member, outer))
        self.group = 4 if self.row_regs % 4 == 0 else 1   # a thread's registers hold groups of this many neighbours
        self.shared: set[str] = set()

    # ------------------------------------------------------------ the kernel

    def emit(self) -> None:
        """The group's kernel (both variants), its launch, and its column sums' kernel."""
        gen, g, cols, inner0 = self.gen, self.g, self.cols, self.inner0
        row_regs, group, name, bufs = self.row_regs, self.group, self.name, self.bufs
        head = ["const unsigned lane = threadIdx.x % tpr, per = blockDim.x / tpr;",
                f"const long long n = {' * '.join(self.osizes) or '1LL'};"]
        if cols:
            head += [f"const long long ncols = {' * '.join(gen.size(g.members[0].sizes[v]) for v in inner0)};",
                     f"const long long S = tgc_row_slots(n, ncols, {gen.cuda.row_slot_rows}LL, "
                     f"{gen.cuda.row_slot_elems}LL);   // slots of rows, a partial row each per column sum",
                     f"const bool fits = {'true' if self.uniform else 'false'} && ncols <= {row_regs}LL * tpr;"
                     "   // the partials in registers",
                     "for (long long sbase = (long long)blockIdx.x * per; sbase < S; sbase += (long long)gridDim.x * per) {",
                     "    const long long s = sbase + threadIdx.x / tpr;",
                     "    const bool slive = s < S;"]
            for j in range(len(cols)):
                if self.uniform:
                    head += [f"    double cp_{j}[{row_regs}];", "    #pragma unroll",
                             f"    for (int k = 0; k < {row_regs}; ++k) cp_{j}[k] = 0.0;"]
                head += [f"    if (!fits && slive) for (long long q = lane; q < ncols; q += tpr) "
                         f"part[{j}LL * S * ncols + s * ncols + q] = 0.0;"]
            head += ["    for (long long base = sbase; base < n; base += S) {   // the slot's rows, in order",
                     "    const long long t = base + threadIdx.x / tpr;",
                     "    const bool live = slive && t < n;"]
        else:
            head += ["for (long long base = (long long)blockIdx.x * per; base < n; base += (long long)gridDim.x * per) {",
                     "    const long long t = base + threadIdx.x / tpr;",
                     "    const bool live = t < n;"]
        head += ["    " + x for x in split_flat("r", "live ? t : base",
                                           [(self.var[v], "", s) for v, s in zip(self.outer, self.osizes)])]
        loop_body: list[str] = []
        if self.uniform:
            cnt = " * ".join(gen.size(g.members[0].sizes[v]) for v in inner0)
            loop_body.append(f"const long long cnt = live ? {cnt} : 0LL;")
            loop_body.append(f"if ({cnt} <= {row_regs}LL * tpr) {{")
            loop_body += ["    TGC_SIM_COUNT(1);"] + ["    " + s for s in self.members(True)]
            loop_body.append("} else {")
            loop_body += ["    TGC_SIM_COUNT(2);"] + ["    " + s for s in self.members(False)]
            loop_body.append("}")
        else:
            loop_body += ["TGC_SIM_COUNT(2);"] + self.members(False)
        tail = ["}"]
        if cols:   # the slot's partials, from registers, after its last row
            tail = ["}", "if (fits && slive) {", "    TGC_SIM_COUNT(6);"]
            for j in range(len(cols)):
                tail += ["    #pragma unroll", f"    for (int k = 0; k < {row_regs}; ++k) {{",
                         f"        const long long q = {group} * ((long long)lane + k / {group} * (long long)tpr) + k % {group};",
                         f"        if (q < ncols) part[{j}LL * S * ncols + s * ncols + q] = cp_{j}[k];", "    }"]
            tail += ["} else if (slive) {", "    TGC_SIM_COUNT(7);", "}", "}"]
            if not self.uniform:
                tail = ["}", "if (slive) TGC_SIM_COUNT(7);", "}"]
        body = ([f"__shared__ {d}" for d in sorted(self.shared)] + head + ["    " + s for s in loop_body]
                + ["    " + s for s in tail[:-1]] + tail[-1:])
        params = gen.params(bufs, set(self.row_writes), scratch=bool(cols))
        call = ", ".join([f"p{j}" for j in range(len(bufs))] + (["part"] if cols else [])
                         + [gen.dim_c[d] for d in gen.dims] + ["err"])
        note = f"row group of {len(g.members)}: " + ", ".join(m.note or m.reduce or "map" for m in g.members)
        gen.parts.append(f"// {note}\nstatic __device__ __forceinline__ void {name}_body({params}, const unsigned tpr) {{\n"
                         + "\n".join("    " + line for line in body) + "\n}")
        bounds = gen.cuda.row_min_blocks
        gen.kernel(name, params, [f"{name}_body({call}, blockDim.x);"], "one block per row", min_blocks=bounds)
        gen.kernel(name + "_warp", params, [f"{name}_body({call}, 32u);"], "one warp per row", min_blocks=bounds)
        scratch = (COL_SCRATCH,) if cols else ()
        inner_sizes = tuple(g.members[0].sizes[v] for v in inner0)
        slots = (tuple(g.sizes[v] for v in self.outer), inner_sizes, len(cols), gen.cuda.row_slot_rows,
                 gen.cuda.row_slot_elems) if cols else ()
        gen.launches.append(Launch("rows", name, tuple(bufs) + scratch, tuple(g.sizes[v] for v in self.outer),
                                   index=self.i, warp=name + "_warp", inner=self.row_len,
                                   writes=tuple(self.row_writes), slots=slots))
        if cols:
            self.row_columns(name + "_cols", slots)

    def ctx_new(self, cache: dict) -> Ctx:
        ctx = Ctx({b: f"p{j}" for j, b in enumerate(self.bufs)}, dict(self.var))
        ctx.vals = {s: f"s_{self.cid[s]}" for s in self.scalars}
        ctx.cache = dict(cache)
        return ctx

    # ------------------------------------------------------------ a row's points

    def reduce_stmts(self, m: LoopKernel, ctx: Ctx, over) -> list[str]:
        """`acc` of a member reducing to a value per row; `over(stmts)` runs
        `stmts` over this thread's share of the reduced points."""
        x = self.gen.expr(m.body, ctx)
        shared = self.shared
        if m.reduce == "sum":
            shared.add("double part_d[32];")
            return (["double sum = 0.0;"] + over([f"sum += (double){x};"])
                    + ["sum = tgc_row_reduce(sum, tgc_op_sum(), part_d, tpr);", "const tgc_t acc = (tgc_t)sum;"])
        shared.add("tgc_t part_t[32];")
        if m.reduce in ("max", "min"):
            better = "!(v <= m)" if m.reduce == "max" else "!(v >= m)"
            init = "-(tgc_t)TGC_INF" if m.reduce == "max" else "(tgc_t)TGC_INF"
            return ([f"tgc_t m = {init};"] + over([f"const tgc_t v = {x};", f"if (m == m && ({better})) m = v;"])
                    + [f"const tgc_t acc = tgc_row_reduce(m, tgc_op_{m.reduce}(), part_t, tpr);"])
        out = ["tgc_t m = -(tgc_t)TGC_INF;"] + over([f"const tgc_t v = {x};", "if (v > m) m = v;"])
        out += ["m = tgc_row_reduce(m, tgc_op_maxshift(), part_t, tpr);"]
        if m.reduce == "maxshift":
            return out + ["const tgc_t acc = m;"]
        shared.add("double part_d[32];")
        out += ["if (!tgc_finite(m)) m = (tgc_t)0;", "double sum = 0.0;"]
        out += over([f"sum += (double)tgc_exp((tgc_t)({x} - m));"])
        return out + ["sum = tgc_row_reduce(sum, tgc_op_sum(), part_d, tpr);",
                      "const tgc_t acc = (tgc_t)(tgc_log((tgc_t)sum) + m);"]

    def strided(self, loops: list[str], sizes: dict, stmts: list[str], cached: bool, count: str) -> list[str]:
        """`stmts` over this thread's points of `loops` (the row's elements)."""
        var, size, group = self.var, self.gen.size, self.group
        dec = decompose([(var[v], "", size(sizes[v])) for v in loops], stmts)
        if cached:   # register k holds element G * (lane + k / G * tpr) + k % G (less than row_regs * tpr)
            return ([f"#pragma unroll", f"for (int k = 0; k < {self.row_regs}; ++k) {{",
                     f"    const int q = {group} * ((int)lane + k / {group} * (int)tpr) + k % {group};",
                     f"    if (q < {count}) {{"] + ["        " + s for s in dec + stmts] + ["    }", "}"])
        return self.spread(count, [(var[v], "", size(sizes[v])) for v in loops], stmts)

    @staticmethod
    def spread(count: str, loops: list, stmts: list[str]) -> list[str]:
        """`stmts` over this thread's share of `count` points (q = lane, lane + tpr,
        ...) split into `loops` (`decompose`): in 32-bit indices when the count
        allows (the row's index and its split, no 64-bit `%`), else in 64-bit."""
        def loop(narrow: bool) -> list[str]:
            head = (f"for (int q = (int)lane; q < (int)c; q += (int)tpr) {{" if narrow
                    else "for (long long q = lane; q < c; q += tpr) {")
            return [head] + ["    " + x for x in decompose(loops, stmts, narrow) + stmts] + ["}"]
        return (["{", f"    const long long c = {count};", "    if (c <= 2147483647LL - 1024LL) {   // q + tpr stays an int"]
                + ["        " + x for x in loop(True)] + ["    } else {"]
                + ["        " + x for x in loop(False)] + ["    }", "}"])

    def preload(self, pre: list[Load], cache: dict) -> list[str]:
        """The row's elements of the inputs `pre` into registers; in an f32 program
        whose row is one loop, with the registers in groups of 4 neighbours, the
        inputs read along it as one float4 load per group where the row length is
        a multiple of 4 and their addresses are 16-byte aligned."""
        gen, low, g, inner0, group = self.gen, self.low, self.g, self.inner0, self.group
        ctx = self.ctx_new({})
        scalar = self.strided(list(inner0), g.members[0].sizes,
                              [f"{cache[e.buf]}[k] = {gen.expr(e, ctx)};" for e in pre], True, "cnt")
        v = inner0[0]
        wide = [e for e in pre if group == 4 and len(inner0) == 1 and low.dtype == "f32"
                and low.buffers[e.buf].dtype == "f32" and gen.along(e, v, g.members[0].sizes[v])]
        if not wide:
            return scalar
        rest = self.strided(list(inner0), g.members[0].sizes,
                            [f"{cache[e.buf]}[k] = {gen.expr(e, ctx)};" for e in pre if e not in wide], True, "cnt")
        ptrs = dict.fromkeys(ctx.ptr(e.buf) for e in wide)
        addr = [f"&{ctx.ptr(e.buf)}[{gen.offset(e.buf, e.index, ctx)}]" for e in wide]
        lines = []
        for j, (e, a) in enumerate(zip(wide, addr)):
            lines.append(f"const float4 l{j} = *reinterpret_cast<const float4*>({a});")
            lines += [f"{cache[e.buf]}[4 * m + {c}] = l{j}.{comp};" for c, comp in enumerate("xyzw")]
        dec = decompose([(self.var[v], "", gen.size(g.members[0].sizes[v]))], addr)
        vec = (["TGC_SIM_COUNT(5);", "#pragma unroll", f"for (int m = 0; m < {self.row_regs // 4}; ++m) {{",
                "    const int q = 4 * ((int)lane + m * (int)tpr);", "    if (q < cnt) {"]
               + ["        " + x for x in dec + lines] + ["    }", "}"] + (rest if len(wide) < len(pre) else []))
        cond = " && ".join([f"{gen.size(g.members[0].sizes[v])} % 4 == 0"] + [f"tgc_aligned16({p})" for p in ptrs])
        return ([f"if ({cond}) {{"] + ["    " + x for x in vec] + ["} else {"]
                + ["    " + x for x in scalar] + ["}"])

    # ------------------------------------------------------------ the members

    def members(self, cached: bool) -> list[str]:
        body, unused = self.members_once(cached, set())
        # a row a reader reads otherwise in the end (a column sum moved into the group)
        # is not held: nvcc -Werror refuses a register array set and never read
        return self.members_once(cached, unused)[0] if unused else body

    def members_once(self, cached: bool, exclude: set[str]) -> tuple[list[str], set[str]]:
        """The statements of every member for one row: `cached`, the row held in
        registers; `exclude`, buffers not to hold there. Also the held buffers no
        statement reads."""
        gen, low, g = self.gen, self.low, self.g
        outer, inner0, var, cid, scalars = self.outer, self.inner0, self.var, self.cid, self.scalars
        bufs, col_ids = self.bufs, self.col_ids
        cache = {}
        body: list[str] = []
        if cached:
            later = {e.buf for m in g.members for e in loads_of(m) if gen.identity(e)}
            cache = {m.out: f"c_{cid[m.out]}" for m in g.members
                     if not m.reduce and m.out not in scalars and m.out in later and m.out not in exclude}
            pre = []
            for m in g.members:
                for e in loads_of(m):
                    b = low.buffers.get(e.buf)
                    if (e.buf in cache or e.buf in exclude or e.buf in scalars or b is None or e.buf in g.writes()
                            or not gen.identity(e) or not (set(b.edges) & set(inner0))
                            or not set(b.edges) <= set(outer) | set(inner0)):
                        continue
                    cache[e.buf] = f"c_{cid[e.buf]}"
                    pre.append(e)
            for c in cache.values():
                body.append(f"tgc_t {c}[{self.row_regs}];")
            if pre:
                body += self.preload(pre, cache)
        written_mem: set[str] = set()
        for m in g.members:
            ctx = self.ctx_new(cache)
            inner = list(inner_loops(m, outer))
            if id(m) in col_ids:   # a column sum: this row's terms added to the slot's partials
                j = col_ids.index(id(m))
                x = gen.expr(m.body, ctx)
                if cached:
                    part = self.strided(list(inner0), m.sizes, [f"cp_{j}[k] += (double){x};"], True, "cnt")
                else:
                    part = self.strided(list(inner0), m.sizes,
                                        [f"part[{j}LL * S * ncols + s * ncols + q] += (double){x};"],
                                        False, "(live ? ncols : 0LL)")
                if ctx.loaded & written_mem:
                    body.append("tgc_row_sync(tpr);")
                body.append(f"// {(m.note or m.text().splitlines()[0])[:100]} (this row's column partials)")
                body += ["{"] + ["    " + x for x in part] + ["}"]
                continue
            kept = [v for v in inner if v not in m.red]
            store_ix = gen.offset(m.out, m.index, ctx) if m.out in low.buffers else None
            stored = m.out in low.buffers and (not cached or m.out not in cache
                                               or self.needs_store(m, self.reads_elsewhere))
            part: list[str] = []
            if m.out in scalars:
                if m.reduce:
                    red = [v for v in m.loops if v in m.red]
                    pre = []
                    for v in red:
                        lo, hi = gen.red_range(m, v, ctx)
                        pre.append(f"const long long {var[v]}_lo = {lo}, {var[v]}_n = max_ll({hi} - {var[v]}_lo, 0LL);")
                    cnt = " * ".join(f"{var[v]}_n" for v in red) or "1LL"

                    def over(stmts, red=red, cnt=cnt, m=m):
                        if cached:
                            return self.strided(list(inner0), m.sizes, stmts, True, "cnt")
                        return self.spread(f"(live ? {cnt} : 0LL)",
                                           [(var[v], f"{var[v]}_lo + ", f"{var[v]}_n") for v in red], stmts)

                    part += ([] if cached else pre) + self.reduce_stmts(m, ctx, over)
                    ctx.acc = "acc"
                    value = gen.expr(m.epilogue, ctx) if m.epilogue is not None else "acc"
                else:
                    value = gen.expr(m.body, ctx)
                part.append(f"s_{cid[m.out]} = {value};")
                if stored:
                    part.append("if (lane == 0 && live) "
                                + gen.store(m.out, f"p{bufs.index(m.out)}", store_ix, f"s_{cid[m.out]}"))
            else:
                stmts: list[str] = []
                if m.reduce:
                    stmts += gen.reduction(m, ctx)
                    ctx.acc = "acc"
                    value = gen.expr(m.epilogue, ctx) if m.epilogue is not None else "acc"
                else:
                    value = gen.expr(m.body, ctx)
                stmts.append(f"const tgc_t val = {value};")
                wide = cached and stored and self.wide_store(m)
                held = cache.get(m.out) if cached else None
                if wide and held is None:   # the row's values, for the float4 stores after
                    held = f"o_{cid[m.out]}"
                    part.append(f"tgc_t {held}[{self.row_regs}];")
                if held is not None:
                    stmts.append(f"{held}[k] = val;")
                if stored and not wide:
                    stmts.append(gen.store(m.out, f"p{bufs.index(m.out)}", store_ix, "val"))
                count = "cnt" if cached else f"(live ? {' * '.join(gen.size(m.sizes[v]) for v in kept) or '1LL'} : 0LL)"
                part += self.strided(list(inner0) if cached else kept, m.sizes, stmts, cached, count)
                if wide:
                    part += self.row_stores(m, f"p{bufs.index(m.out)}", held, ctx, var[inner0[0]],
                                            gen.size(m.sizes[inner0[0]]))
            if ctx.loaded & written_mem:
                body.append("tgc_row_sync(tpr);")
            body.append(f"// {(m.note or m.text().splitlines()[0])[:100]}")
            if m.out in scalars:
                body.append(f"tgc_t s_{cid[m.out]};")
            body += ["{"] + ["    " + s for s in part] + ["}"]
            if stored and m.out not in scalars:
                written_mem.add(m.out)
        read = re.compile(r"\b(c_\d+)\[(?!k\] = |4 \* m \+ \d\] = )")   # a read, not a fill
        used = {name for line in body if not line.startswith("tgc_t ") for name in read.findall(line)}
        return body, {buf for buf, c in cache.items() if c not in used}

    # ------------------------------------------------------------ column sums and stores

    def row_columns(self, name: str, slots: tuple) -> None:
        """The kernel adding the group's column partials (`emit`): one thread per
        column, the slots' partials in slot order, in double; then each column sum's
        epilogue and store."""
        gen, g, bufs, var, inner0 = self.gen, self.g, self.bufs, self.var, list(self.inner0)
        ctx = Ctx({b: f"p{j}" for j, b in enumerate(bufs)}, dict(var))
        sizes = [gen.size(g.members[0].sizes[v]) for v in inner0]
        body = [f"const long long n = {' * '.join(self.osizes) or '1LL'}, ncols = {' * '.join(sizes)};",
                f"const long long S = tgc_row_slots(n, ncols, {gen.cuda.row_slot_rows}LL, {gen.cuda.row_slot_elems}LL);",
                "for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < ncols; "
                "c += (long long)gridDim.x * blockDim.x) {"]
        body += ["    " + x for x in split_flat("r", "c", [(var[v], "", sz) for v, sz in zip(inner0, sizes)])]
        for j, m in enumerate(self.cols):
            c = Ctx(ctx.ptrs, dict(var))
            c.acc = "acc"
            value = gen.expr(m.epilogue, c) if m.epilogue is not None else "acc"
            body += ["    {", "        double total = 0.0;",
                     f"        for (long long h = 0; h < S; ++h) total += part[{j}LL * S * ncols + h * ncols + c];",
                     "        const tgc_t acc = (tgc_t)total;",
                     "        " + gen.store(m.out, f"p{bufs.index(m.out)}", gen.offset(m.out, m.index, c), value),
                     "    }"]
        body.append("}")
        outs = {m.out for m in self.cols}
        gen.kernel(name, gen.params(bufs, outs, scratch=True), body,
                   "row group's column sums: the slots' partials, in order")
        gen.launches.append(Launch("loop", name, tuple(bufs) + (COL_SCRATCH,),
                                   tuple(g.members[0].sizes[v] for v in inner0), index=self.i,
                                   writes=tuple(sorted(outs)), slots=slots))

    def wide_store(self, m: LoopKernel) -> bool:
        """Whether a member's output, held in registers, can be stored four neighbours
        at a time (`row_stores`): an f32 program and buffer, a row of one loop,
        registers in groups of 4, the output's contiguous edge along that loop."""
        inner0 = self.inner0
        if self.group != 4 or len(inner0) != 1 or self.low.dtype != "f32" or self.low.buffers[m.out].dtype != "f32":
            return False
        v = inner0[0]
        return self.gen.along(Load(m.out, m.index), v, m.sizes[v])

    def row_stores(self, m: LoopKernel, ptr: str, held: str, ctx: Ctx, v: str, size: str) -> list[str]:
        """The stores of a member's values `held` (register k: element
        4 * (lane + k / 4 * tpr) + k % 4 of the row, loop variable `v` of extent
        `size`): one float4 per group of 4 where the row length is a multiple of 4
        and the output 16-byte aligned (every row then starts aligned), else one
        element at a time. The same values either way."""
        group = self.group
        at = self.gen.offset(m.out, m.index, ctx)
        dec = decompose([(v, "", size)], [at])
        vec = ["TGC_SIM_COUNT(8);", "#pragma unroll", f"for (int g4 = 0; g4 < {self.row_regs // group}; ++g4) {{",
               "    const int q = 4 * ((int)lane + g4 * (int)tpr);", "    if (q < cnt) {"]
        vec += ["        " + x for x in dec]
        vec += ["        float4 o4;"] + [f"        o4.{c} = {held}[4 * g4 + {j}];" for j, c in enumerate("xyzw")]
        vec += [f"        *reinterpret_cast<float4*>(&{ptr}[{at}]) = o4;", "    }", "}"]
        one = ["#pragma unroll", f"for (int k = 0; k < {self.row_regs}; ++k) {{",
               f"    const int q = {group} * ((int)lane + k / {group} * (int)tpr) + k % {group};", "    if (q < cnt) {"]
        one += ["        " + x for x in dec] + [f"        {ptr}[{at}] = {held}[k];", "    }", "}"]
        return ([f"if ({size} % 4 == 0 && tgc_aligned16({ptr})) {{"] + ["    " + x for x in vec] + ["} else {"]
                + ["    " + x for x in one] + ["}"])

    def read_outside(self) -> set[str]:
        """The buffers a kernel other than the group reads."""
        return {b for j, k in enumerate(self.low.kernels) if j != self.i for b in k.buffers_read()}

    def needs_store(self, m: LoopKernel, outside: set[str]) -> bool:
        """Whether a member's output kept in registers must be written too: it is not
        a temporary, another kernel reads it, or a member reads it elsewhere than at
        the element the thread holds."""
        if self.low.buffers[m.out].kind != "temp" or m.out in outside:
            return True
        return any(e.buf == m.out and not self.gen.identity(e) for k in self.g.members for e in loads_of(k))
