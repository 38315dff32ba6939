"""The CUDA kernel of a `Flash` group (`tgc.backends.cuda.flash`): attention's
softmax-contraction chain in one kernel, no cuBLAS, no `[t, s]` buffer.

A block per tile of `BQ` query rows (a grid-stride loop over (batch, tile) items):
the tile's rows of `q` are staged in shared memory, then for each tile of `BK` keys
(skipped when a causal `where` mask rejects all of it, `flash`'s docstring) the keys'
rows of `k` and `v` are staged in shared memory; each thread computes scores of the
tile (a dot product over `d` from shared memory, then the program's logit expression
`L` on it, with its loads, masks and scale), one thread per row updates the row's
running max `m`, rescales its running sum and the row's output by `exp(m_old - m)`
and turns the scores into weights `exp(L - m)`; then each thread adds the weights
times `v` into its outputs of the tile (held in shared memory). At the end `y` is the
output over the sum, and the row's max and `log(sum)` are stored (the program's `m`
and `l`). Every loop is strided by the block's threads, so any block size runs it
(the emulator's too). Sums are in the program's float type (f32 or f64).

The tile sizes are the largest of (64, 64), (64, 32), (32, 32), ... whose shared
memory (q, k, v, scores and the outputs of a tile) stays within 48 KiB (static
shared memory), given `d` and `e` (numbers up to 256) and the element size.
"""
from __future__ import annotations

from tgc.backends.cuda.ctext import Ctx
from tgc.backends.cuda.flash import SKIP_FILL, Flash
from tgc.backends.cuda.launches import Launch
from tgc.lower.lowered import Add, Const, Load, Map, Mask, Mul, walk

SHARED_MAX = 48 * 1024 - 512
FLASH_THREADS = 128
TILES = ((64, 64), (64, 32), (32, 32), (32, 16), (16, 16), (16, 8), (8, 8))


def tiles(d: int, e: int, item: int) -> tuple[int, int]:
    """(BQ, BK): the largest tiles whose shared memory fits SHARED_MAX."""
    for bq, bk in TILES:
        if item * (bq * d + bk * d + bk * e + bq * bk + bq * e + 3 * bq) <= SHARED_MAX:
            return bq, bk
    return TILES[-1]


def skip_conds(logit):
    """The conds of a top-level `where(mask[conds](1), x, fill)` with a fill of at most
    SKIP_FILL, or ()."""
    if isinstance(logit, Map) and logit.fn == "where" and len(logit.args) == 3:
        c, _, fill = logit.args
        if (isinstance(c, Mask) and c.arg == Const(1.0) and isinstance(fill, Const) and fill.value <= SKIP_FILL
                and len(c.conds) == 1 and c.conds[0].op in ("<", "<=", ">", ">=")):
            return c.conds
    return ()


class FlashGen:
    """One `Flash` kernel (lowered kernel `i`) of the module `gen` (`codegen._Gen`)."""

    def __init__(self, gen, i: int, g: Flash):
        self.gen, self.i, self.g = gen, i, g
        self.ch = g.chain()
        self.name = f"{gen.prefix}k{i}_flash"

    def emit(self) -> None:
        gen, ch, g = self.gen, self.ch, self.g
        low = gen.low
        bufs = g.buffers_used()
        ptrs = {b: f"p{j}" for j, b in enumerate(bufs)}
        D, E = ch.S.sizes[ch.d], ch.y.sizes[ch.e]
        item = 8 if low.dtype == "f64" else 4
        BQ, BK = tiles(D, E, item)
        bvars = {v: f"b{j}" for j, v in enumerate(ch.batch)}

        def ctx(**extra):
            c = Ctx(dict(ptrs))
            c.var.update(bvars)
            c.var.update(extra)
            return c
        size = gen.size
        nt, ns = size(ch.m.sizes[ch.t]), size(ch.m.sizes[ch.s])
        qload = gen.expr(ch.q, ctx(**{ch.t: "tq", ch.d: "c"}))
        kload = gen.expr(ch.k, ctx(**{ch.s: "sk", ch.d: "c"}))
        vload = gen.expr(ch.v, ctx(**{ch.s: "sk", ch.e: "c"}))
        lc = ctx(**{ch.t: "tq", ch.s: "sk"})
        lc.vals[ch.S.out] = "x"
        logit = gen.expr(ch.logit, lc)
        yat = gen.offset(ch.y.out, ch.y.index, ctx(**{ch.t: "tq", ch.e: "c"}))
        mat = gen.offset(ch.m.out, ch.m.index, ctx(**{ch.t: "tq"}))
        lat = gen.offset(ch.l.out, ch.l.index, ctx(**{ch.t: "tq"}))
        conds = skip_conds(ch.logit)
        if conds and not all(ix_vars(c.ix) <= {ch.t, ch.s} | set(ch.batch) for c in conds):
            conds = ()
        body = [f"__shared__ tgc_t Qs[{BQ * D}], Ks[{BK * D}], Vs[{BK * E}], Ss[{BQ * BK}], Os[{BQ * E}];",
                f"__shared__ tgc_t ms[{BQ}], ls[{BQ}], als[{BQ}];"] + (["__shared__ int every;"] if conds else []) + [
                f"const long long nt = {nt}, ns = {ns};",
                f"const long long ntiles = (nt + {BQ - 1}) / {BQ};",
                f"const long long nitems = ntiles{''.join(f' * {size(ch.m.sizes[v])}' for v in ch.batch)};",
                "const int tid = threadIdx.x, nth = blockDim.x;",
                "for (long long item = blockIdx.x; item < nitems; item += gridDim.x) {"]
        inner = ["long long rr = item;", "const long long qt = rr % ntiles; rr /= ntiles;"]
        for v in reversed(ch.batch):
            inner.append(f"const long long {bvars[v]} = rr % {size(ch.m.sizes[v])}; rr /= {size(ch.m.sizes[v])};")
        inner += [f"const long long q0 = qt * {BQ};",
                  f"for (int i = tid; i < {BQ * D}; i += nth) {{",
                  f"    const long long tq = q0 + i / {D}, c = i % {D};",
                  f"    Qs[i] = tq < nt ? {qload} : (tgc_t)0;",
                  "}",
                  f"for (int i = tid; i < {BQ * E}; i += nth) Os[i] = (tgc_t)0;",
                  f"for (int i = tid; i < {BQ}; i += nth) {{ ms[i] = -(tgc_t)TGC_INF; ls[i] = (tgc_t)0; }}"]
        if conds:
            def at(t, s):
                return " && ".join(f"({gen.cond(c, ctx(**{ch.t: t, ch.s: s}))})" for c in conds)
            inner += ["if (tid == 0) every = 1;", "__syncthreads();",
                      f"for (int i = tid; i < {BQ}; i += nth) {{",
                      "    const long long tq = q0 + i, z = 0, zl = ns - 1;",
                      f"    if (tq < nt && !(({at('tq', 'z')}) || ({at('tq', 'zl')}))) every = 0;",
                      "}"]
        inner += ["__syncthreads();",
                  f"for (long long k0 = 0; k0 < ns; k0 += {BK}) {{"]
        loop = []
        if conds:
            corners = [(t, s) for t in ("ta", "tb") for s in ("sa", "sb")]
            masked = " && ".join(f"!({at(t, s)})" for t, s in corners)
            loop += [f"const long long ta = q0, tb = (q0 + {BQ} < nt ? q0 + {BQ} : nt) - 1;",
                     f"const long long sa = k0, sb = (k0 + {BK} < ns ? k0 + {BK} : ns) - 1;",
                     f"if (every && {masked}) continue;   // every pair of the tiles is masked: weights exactly 0"]
        loop += [f"for (int i = tid; i < {BK * D}; i += nth) {{",
                 f"    const long long sk = k0 + i / {D}, c = i % {D};",
                 f"    Ks[i] = sk < ns ? {kload} : (tgc_t)0;",
                 "}",
                 f"for (int i = tid; i < {BK * E}; i += nth) {{",
                 f"    const long long sk = k0 + i / {E}, c = i % {E};",
                 f"    Vs[i] = sk < ns ? {vload} : (tgc_t)0;",
                 "}",
                 "__syncthreads();",
                 f"for (int i = tid; i < {BQ * BK}; i += nth) {{",
                 f"    const int a = i / {BK}, j = i % {BK};",
                 "    const long long tq = q0 + a, sk = k0 + j;",
                 "    double xd = 0.0;   // in double, rounded once (as the loop kernels' sums)",
                 f"    const tgc_t* qa = Qs + a * {D};",
                 f"    const tgc_t* kj = Ks + j * {D};",
                 "    #pragma unroll 8",
                 f"    for (int c = 0; c < {D}; ++c) xd += (double)qa[c] * (double)kj[c];",
                 "    const tgc_t x = (tgc_t)xd;",
                 f"    Ss[i] = (tq < nt && sk < ns) ? (tgc_t)({logit}) : -(tgc_t)TGC_INF;",
                 "}",
                 "__syncthreads();",
                 f"for (int a = tid; a < {BQ}; a += nth) {{   // the row's running max and sum",
                 "    const tgc_t mo = ms[a];",
                 "    tgc_t mx = mo;",
                 f"    for (int j = 0; j < {BK}; ++j) {{ const tgc_t v = Ss[a * {BK} + j]; "
                 "if (mx == mx && !(v <= mx)) mx = v; }",
                 "    const tgc_t al = mo == -(tgc_t)TGC_INF ? (tgc_t)0 : tgc_exp((tgc_t)(mo - mx));",
                 "    tgc_t sum = (tgc_t)0;",
                 f"    for (int j = 0; j < {BK}; ++j) {{",
                 f"        const tgc_t p = mx == -(tgc_t)TGC_INF ? (tgc_t)0 : tgc_exp((tgc_t)(Ss[a * {BK} + j] - mx));",
                 f"        Ss[a * {BK} + j] = p; sum += p;",
                 "    }",
                 "    ls[a] = ls[a] * al + sum; ms[a] = mx; als[a] = al;",
                 "}",
                 "__syncthreads();",
                 f"for (int i = tid; i < {BQ * E}; i += nth) {{",
                 f"    const int a = i / {E}, c = i % {E};",
                 "    double o = (double)Os[i] * (double)als[a];",
                 f"    const tgc_t* pa = Ss + a * {BK};",
                 "    #pragma unroll 8",
                 f"    for (int j = 0; j < {BK}; ++j) o += (double)pa[j] * (double)Vs[j * {E} + c];",
                 "    Os[i] = (tgc_t)o;",
                 "}",
                 "__syncthreads();"]
        inner += ["    " + x for x in loop] + ["}"]
        inner += [f"for (int i = tid; i < {BQ * E}; i += nth) {{",
                  f"    const long long tq = q0 + i / {E}, c = i % {E};",
                  f"    if (tq < nt) {gen.store(ch.y.out, ptrs[ch.y.out], yat, f'Os[i] / ls[i / {E}]')}",
                  "}",
                  f"for (int a = tid; a < {BQ}; a += nth) {{",
                  "    const long long tq = q0 + a;",
                  "    if (tq < nt) {",
                  f"        {gen.store(ch.m.out, ptrs[ch.m.out], mat, 'ms[a]')}",
                  f"        {gen.store(ch.l.out, ptrs[ch.l.out], lat, 'tgc_log(ls[a])')}",
                  "    }",
                  "}",
                  "__syncthreads();"]
        body += ["    " + x for x in inner] + ["}"]
        note = f"flash attention: {BQ} rows x {BK} keys a tile, d = {D}, e = {E} ({g.note})"
        gen.kernel(self.name, gen.params(bufs, g.writes()), body, note, min_blocks=1)
        total = (*(ch.m.sizes[v] for v in ch.batch), ch.m.sizes[ch.t])
        gen.launches.append(Launch("flash", self.name, tuple(bufs), total, index=self.i,
                                   writes=tuple(sorted(g.writes())), inner=(BQ,)))


def ix_vars(ix) -> set:
    """The atoms of an index, when all are loop variables (else a set that matches nothing)."""
    out = set()
    for a, _ in ix.terms:
        if not isinstance(a, str):
            return {object()}
        out.add(a)
    return out


BACK_TILES = ((64, 64), (64, 32), (32, 64), (32, 32), (32, 16), (16, 32), (16, 16), (16, 8), (8, 16), (8, 8),
              (8, 4), (4, 8), (4, 4), (2, 2), (1, 1))


def zero_where_masked(e, zero: set, conds) -> bool:
    """Whether `e` is exactly 0 wherever the mask `conds` rejects (the weights, which
    are 0 there, in `zero`): a load of a value in `zero`, that mask, a product with
    such a factor, a sum of such terms."""
    if isinstance(e, Load):
        return e.buf in zero
    if isinstance(e, Mask):
        return tuple(e.conds) == tuple(conds) or zero_where_masked(e.arg, zero, conds)
    if isinstance(e, Map) and e.fn == "where" and len(e.args) == 3 and e.args[2] == Const(0.0):
        c = e.args[0]
        return (isinstance(c, Mask) and tuple(c.conds) == tuple(conds)) or zero_where_masked(e.args[1], zero, conds)
    if isinstance(e, Map) and e.fn == "mul0":
        return any(zero_where_masked(a, zero, conds) for a in e.args)
    if isinstance(e, Mul):
        return any(zero_where_masked(a, zero, conds) for a in e.args)
    if isinstance(e, Add):
        return all(zero_where_masked(a, zero, conds) for a in e.args)
    if isinstance(e, Const):
        return e.value == 0.0
    return False


class FlashBackGen:
    """The two kernels of a `FlashBack` group (lowered kernel `i`): `_rows`, a block per
    tile of query rows, and `_keys`, a block per tile of keys (module docstring of
    `tgc.backends.cuda.flash`)."""

    def __init__(self, gen, i: int, g):
        self.gen, self.i, self.g = gen, i, g
        self.ch = g.chain()
        self.item = 8 if gen.low.dtype == "f64" else 4

    # -- the pieces both kernels share

    def setup(self):
        gen, ch = self.gen, self.ch
        self.bufs = self.g.buffers_used()
        self.ptrs = {b: f"p{j}" for j, b in enumerate(self.bufs)}
        self.bvars = {v: f"b{j}" for j, v in enumerate(ch.batch)}
        S = ch.S
        self.d = S.red[0]
        q, k = S.body.args
        self.nt, self.ns = gen.size(S.sizes[ch.t]), gen.size(S.sizes[ch.s])
        # row operands (a row of t: staged per tile of rows) and key operands, deduplicated by their C text
        self.rowops: dict[str, tuple[str, int]] = {}
        self.keyops: dict[str, tuple[str, int]] = {}
        self.sq_ops = {}
        for m, kind in ch.squares:
            if kind in ("S", "dot"):
                a, b = m.body.args
                c = m.red[0]
                self.sq_ops[m.out] = (self.op(a, ch.t, c, m.sizes[c], self.rowops), self.op(b, ch.s, c, m.sizes[c], self.keyops),
                                      m.sizes[c])
        self.rowout_ops = [self.op(op, ch.s, c, m.sizes[c], self.keyops) for m, _, op, c in ch.rowouts]
        self.colout_ops = [self.op(op, ch.t, c, m.sizes[c], self.rowops) for m, _, op, c in ch.colouts]
        # the causal skip: the where mask of the weights' expression
        P = ch.squares[1][0]
        self.conds = ()
        for e in walk(P.body):
            self.conds = skip_conds(e)
            if self.conds:
                break
        if self.conds:
            if not all(ix_vars(c.ix) <= {ch.t, ch.s} | set(ch.batch) for c in self.conds):
                self.conds = ()
        if self.conds:
            zero = {P.out}
            for m, kind in ch.squares[2:]:
                if kind == "expr" and zero_where_masked(m.body, zero, self.conds):
                    zero.add(m.out)
            ok = all(zero_where_masked(r.body, zero, self.conds) for r in (*ch.rowsums, *ch.colsums))
            ok = ok and all(src in zero for _, src, _, _ in (*ch.rowouts, *ch.colouts))
            ok = ok and all(r.reduce == "sum" for r in ch.rowsums)
            if not ok:
                self.conds = ()

    def ctx(self, **extra):
        c = Ctx(dict(self.ptrs))
        c.var.update(self.bvars)
        c.var.update(extra)
        return c

    def op(self, load, edge: str, c: str, n: int, into: dict) -> str:
        """The shared array staging `load` (read at the row or key variable and `c`)."""
        var = "tq" if into is self.rowops else "sk"
        text = self.gen.expr(load, self.ctx(**{edge: var, c: "c"}))
        if text not in into:
            into[text] = (f"{'R' if into is self.rowops else 'K'}{len(into)}", n)
        return into[text][0]

    def stage(self, ops: dict, first: str, tile: int, bound: str, var: str) -> list[str]:
        out = []
        for text, (name, n) in ops.items():
            out += [f"for (int i = tid; i < {tile * n}; i += nth) {{",
                    f"    const long long {var} = {first} + i / {n}, c = i % {n};",
                    f"    {name}[i] = {var} < {bound} ? {text} : (tgc_t)0;",
                    "}"]
        return out

    def squares(self, BQ: int, BK: int, upto, rowsum_vals: dict, terms: list, keep: set) -> list[str]:
        """The element loop over (a, j) of the tile: each `[t, s]` value ready by pass
        `upto` (every one when None: the row statistics it reads are complete), the row or
        key sums' terms (`terms`: (array, kernel, the value where the pair is out of range)),
        the values other loops read stored (`keep`)."""
        gen, ch = self.gen, self.ch
        lines = [f"for (int i = tid; i < {BQ * BK}; i += nth) {{",
                 f"    const int a = i / {BK}, j = i % {BK};",
                 "    const long long tq = q0 + a, sk = k0 + j;",
                 "    const bool ok = tq < nt && sk < ns;"]
        ctx = self.ctx(**{ch.t: "tq", ch.s: "sk"})
        ctx.vals.update(rowsum_vals)
        # only the values the terms and `keep` need (through the values they read)
        sq = {m.out: m for m, _ in ch.squares}
        need, todo = set(), [x.buf for _, r, _ in terms for x in walk(r.body) if isinstance(x, Load)] + list(keep)
        while todo:
            b = todo.pop()
            if b in sq and b not in need:
                need.add(b)
                todo += [x.buf for x in walk(sq[b].body) if isinstance(x, Load)]
        for n, (m, kind) in enumerate(ch.squares):
            if (upto is not None and self.ready(m.out) > upto) or m.out not in need:
                continue
            name = f"sq{n}"
            if kind in ("S", "dot"):
                R, K, c = self.sq_ops[m.out]
                lines += [f"    double {name}d = 0.0;",
                          "    #pragma unroll 8",
                          f"    for (int c = 0; c < {c}; ++c) {name}d += (double){R}[a * {c} + c] * (double){K}[j * {c} + c];",
                          f"    const tgc_t {name} = (tgc_t){name}d;"]
            else:
                lines.append(f"    const tgc_t {name} = ok ? (tgc_t)({gen.expr(m.body, ctx)}) : (tgc_t)0;")
            ctx.vals[m.out] = name
            if m.out in keep:
                lines.append(f"    Q{n}[i] = {name};")
        for arr, r, outside in terms:
            lines.append(f"    {arr}[i] = ok ? (tgc_t)({gen.expr(r.body, ctx)}) : {outside};")
        return lines + ["}"]

    def ready(self, buf: str) -> int:
        """The pass over the keys after which `buf` (a `[t, s]` value or a row statistic)
        can be computed or read: 0 for what needs no row statistic; a statistic after the
        passes of what it reads, one pass (a sum, a max) or two (a logsumexp: its max,
        then its sum of exponentials, as the program's kernel takes them)."""
        ch = self.ch
        if not hasattr(self, "_ready"):
            self._ready = {}
        if buf in self._ready:
            return self._ready[buf]
        rs = {r.out: r for r in ch.rowsums}
        sq = {m.out: m for m, _ in ch.squares}
        k = rs.get(buf) or sq[buf]
        need = max([self.ready(x.buf) for x in walk(k.body) if isinstance(x, Load) and x.buf != buf
                    and (x.buf in rs or x.buf in sq)] + [0])
        v = need + ((2 if k.reduce == "logsumexp" else 1) if buf in rs else 0)
        self._ready[buf] = v
        return v

    def sq_index(self, buf: str) -> int:
        return next(n for n, (m, _) in enumerate(self.ch.squares) if m.out == buf)

    def shared(self, BQ: int, BK: int, rows: bool) -> int:
        """Elements of shared memory a kernel takes (rows: `_rows`; else `_keys`)."""
        ch = self.ch
        n = sum(BQ * w for _, w in self.rowops.values()) + sum(BK * w for _, w in self.keyops.values())
        n += len({src for _, src, _, _ in (ch.rowouts if rows else ch.colouts)}) * BQ * BK
        if rows:
            n += len(ch.rowsums) * BQ * (BK + 6) + sum(BQ * m.sizes[c] for m, _, _, c in ch.rowouts)
        else:
            n += len(ch.colsums) * BK * (BQ + 2) + sum(BK * m.sizes[c] for m, _, _, c in ch.colouts)
        return n * self.item + 64

    def tiles(self, rows: bool) -> tuple[int, int]:
        for bq, bk in BACK_TILES:
            if self.shared(bq, bk, rows) <= SHARED_MAX:
                return bq, bk
        return BACK_TILES[-1]

    def every(self, first: str, tile: int) -> list[str]:
        """`every`: each row of the tile of rows from `first` admits some key."""
        gen, ch = self.gen, self.ch

        def at(t, s):
            return " && ".join(f"({gen.cond(c, self.ctx(**{ch.t: t, ch.s: s}))})" for c in self.conds)
        return ["if (tid == 0) every = 1;", "__syncthreads();",
                f"for (int i = tid; i < {tile}; i += nth) {{",
                f"    const long long tq = {first} + i, z = 0, zl = ns - 1;",
                f"    if (tq < nt && !(({at('tq', 'z')}) || ({at('tq', 'zl')}))) every = 0;",
                "}", "__syncthreads();"]

    def masked(self, BQ: int, BK: int) -> str:
        gen, ch = self.gen, self.ch

        def at(t, s):
            return " && ".join(f"({gen.cond(c, self.ctx(**{ch.t: t, ch.s: s}))})" for c in self.conds)
        corners = " && ".join(f"!({at(t, s)})" for t in ("ta", "tb") for s in ("sa", "sb"))
        return (f"const long long ta = q0, tb = (q0 + {BQ} < nt ? q0 + {BQ} : nt) - 1, "
                f"sa = k0, sb = (k0 + {BK} < ns ? k0 + {BK} : ns) - 1;\n"
                f"const bool skip = every && {corners};")

    def decls(self, BQ: int, BK: int, keep: set) -> list[str]:
        ch = self.ch
        arrays = [f"{n}[{BQ * w}]" for n, w in self.rowops.values()] + [f"{n}[{BK * w}]" for n, w in self.keyops.values()]
        arrays += [f"Q{n}[{BQ * BK}]" for n, (m, _) in enumerate(ch.squares) if m.out in keep]
        return [f"__shared__ tgc_t {', '.join(arrays)};"] + (["__shared__ int every;"] if self.conds else []) + [
                f"const long long nt = {self.nt}, ns = {self.ns};", "const int tid = threadIdx.x, nth = blockDim.x;"]

    def decode(self, count: str, tile: int, var: str) -> list[str]:
        ch, gen = self.ch, self.gen
        out = ["long long rr = item;", f"const long long ti = rr % {count}; rr /= {count};"]
        for v in reversed(ch.batch):
            n = gen.size(ch.S.sizes[v])
            out.append(f"const long long {self.bvars[v]} = rr % {n}; rr /= {n};")
        return out + [f"const long long {var} = ti * {tile};"]

    # -- the kernels

    def emit(self) -> None:
        self.setup()
        ch = self.ch
        if ch.rowsums or ch.rowouts:
            self.rows_kernel()
        if ch.colsums or ch.colouts:
            self.keys_kernel()

    def rows_kernel(self) -> None:
        gen, ch = self.gen, self.ch
        BQ, BK = self.tiles(True)
        name = f"{gen.prefix}k{self.i}_flash_rows"
        keepers = {src for _, src, _, _ in ch.rowouts}
        body = self.decls(BQ, BK, keepers)
        sums = [n for n, r in enumerate(ch.rowsums) if r.reduce in ("sum", "logsumexp")]
        maxes = [n for n, r in enumerate(ch.rowsums) if r.reduce != "sum"]
        body += [f"__shared__ double Rs{n}[{BQ}];" for n in sums]
        body += [f"__shared__ tgc_t Rm{n}[{BQ}];" for n in maxes]
        body += [f"__shared__ tgc_t Rv{n}[{BQ}];" for n in range(len(ch.rowsums))]
        body += [f"__shared__ tgc_t T{n}[{BQ * BK}];" for n in range(len(ch.rowsums))]
        body += [f"__shared__ tgc_t A{n}[{BQ * m.sizes[c]}];" for n, (m, _, _, c) in enumerate(ch.rowouts)]
        body += [f"const long long ntiles = (nt + {BQ - 1}) / {BQ};",
                 f"const long long nitems = ntiles{''.join(f' * {gen.size(ch.S.sizes[v])}' for v in ch.batch)};",
                 "for (long long item = blockIdx.x; item < nitems; item += gridDim.x) {"]
        inner = self.decode("ntiles", BQ, "q0")
        inner += self.stage(self.rowops, "q0", BQ, "nt", "tq")
        if ch.rowsums:
            inner += [f"for (int i = tid; i < {BQ}; i += nth) {{ " + " ".join(
                [f"Rs{n}[i] = 0.0;" for n in sums] + [f"Rm{n}[i] = -(tgc_t)TGC_INF;" for n in maxes]) + " }"]
        for n, (m, _, _, c) in enumerate(ch.rowouts):
            inner.append(f"for (int i = tid; i < {BQ * m.sizes[c]}; i += nth) A{n}[i] = (tgc_t)0;")
        inner += self.every("q0", BQ) if self.conds else ["__syncthreads();"]
        rvals = {r.out: f"Rv{n}[a]" for n, r in enumerate(ch.rowsums)}
        passes = max([self.ready(r.out) for r in ch.rowsums] + [0])
        for p in range(passes):   # the row statistics, a pass over the keys for each level
            # (statistic n, its kernel, 'sum' | 'max' | 'maxshift' | 'lse_max' | 'lse_sum') this pass takes
            work = []
            for n, r in enumerate(ch.rowsums):
                last = self.ready(r.out) - 1
                if r.reduce == "logsumexp":
                    work += [(n, r, "lse_max")] if p == last - 1 else [(n, r, "lse_sum")] if p == last else []
                elif p == last:
                    work.append((n, r, r.reduce))
            vals = {r.out: v for r, v in zip(ch.rowsums, rvals.values()) if self.ready(r.out) <= p}
            outside = {"sum": "(tgc_t)0"}
            loop = ([self.masked(BQ, BK), "if (skip) continue;"] if self.conds else [])
            loop += self.stage(self.keyops, "k0", BK, "ns", "sk") + ["__syncthreads();"]
            loop += self.squares(BQ, BK, p, vals, [(f"T{n}", r, outside.get(kind, "-(tgc_t)TGC_INF"))
                                                    for n, r, kind in work], set())
            loop += ["__syncthreads();", f"for (int a = tid; a < {BQ}; a += nth) {{"]
            for n, r, kind in work:
                x = f"T{n}[a * {BK} + j]"
                if kind == "sum":
                    loop += ["    { double u = 0.0;", f"      for (int j = 0; j < {BK}; ++j) u += (double){x};",
                             f"      Rs{n}[a] += u; }}"]
                elif kind == "max":     # NaN propagates, as the max kernel
                    loop += [f"    {{ tgc_t m = Rm{n}[a];",
                             f"      for (int j = 0; j < {BK}; ++j) {{ const tgc_t v = {x}; if (m == m && !(v <= m)) m = v; }}",
                             f"      Rm{n}[a] = m; }}"]
                elif kind in ("maxshift", "lse_max"):
                    loop += [f"    {{ tgc_t m = Rm{n}[a];",
                             f"      for (int j = 0; j < {BK}; ++j) {{ const tgc_t v = {x}; if (v > m) m = v; }}",
                             f"      Rm{n}[a] = m; }}"]
                else:                   # lse_sum: exp(x - max), the max 0 when not finite
                    loop += [f"    {{ const tgc_t m = tgc_finite(Rm{n}[a]) ? Rm{n}[a] : (tgc_t)0; double u = 0.0;",
                             f"      for (int j = 0; j < {BK}; ++j) u += (double)tgc_exp((tgc_t)({x} - m));",
                             f"      Rs{n}[a] += u; }}"]
            loop += ["}", "__syncthreads();"]
            inner += [f"for (long long k0 = 0; k0 < ns; k0 += {BK}) {{   // pass {p}: the row statistics"]
            inner += ["    " + x for x in loop] + ["}"]
            done = [(n, r) for n, r, kind in work if kind != "lse_max"]
            if done:
                inner.append(f"for (int a = tid; a < {BQ}; a += nth) {{")
                for n, r in done:
                    value = {"sum": f"(tgc_t)Rs{n}[a]", "max": f"Rm{n}[a]", "maxshift": f"Rm{n}[a]",
                             "logsumexp": f"(tgc_t)(tgc_log((tgc_t)Rs{n}[a]) + (tgc_finite(Rm{n}[a]) ? Rm{n}[a] : (tgc_t)0))"}
                    inner.append(f"    Rv{n}[a] = {value[r.reduce]};")
                inner += ["}", "__syncthreads();"]
        if ch.rowouts:   # second pass: the outputs over the rows
            loop = ([self.masked(BQ, BK), "if (skip) continue;"] if self.conds else [])
            loop += self.stage(self.keyops, "k0", BK, "ns", "sk") + ["__syncthreads();"]
            loop += self.squares(BQ, BK, None, rvals, [], keepers)
            loop += ["__syncthreads();"]
            for n, ((m, src, _, c), K) in enumerate(zip(ch.rowouts, self.rowout_ops)):
                loop += _tile_product(n, m.sizes[c], ("a", BQ, f"a * {BK}"), ("j", BK, "j"), f"Q{self.sq_index(src)}", K)
            loop += ["__syncthreads();"]
            inner += [f"for (long long k0 = 0; k0 < ns; k0 += {BK}) {{"] + ["    " + x for x in loop] + ["}"]
        for n, r in enumerate(ch.rowsums):
            at = gen.offset(r.out, r.index, self.ctx(**{ch.t: "tq"}))
            inner += [f"for (int a = tid; a < {BQ}; a += nth) {{", "    const long long tq = q0 + a;",
                      f"    if (tq < nt) {gen.store(r.out, self.ptrs[r.out], at, f'Rv{n}[a]')}", "}"]
        for n, (m, _, _, c) in enumerate(ch.rowouts):
            inner += self.store_tile(n, m, c, ch.t, ("tq", "q0", "nt", BQ))
        inner += ["__syncthreads();"]
        body += ["    " + x for x in inner] + ["}"]
        self.finish(name, body, BQ, BK, ch.t, "rows", {r.out for r in ch.rowsums} | {m.out for m, *_ in ch.rowouts})

    def keys_kernel(self) -> None:
        gen, ch = self.gen, self.ch
        BQ, BK = self.tiles(False)
        name = f"{gen.prefix}k{self.i}_flash_keys"
        keepers = {src for _, src, _, _ in ch.colouts}
        body = self.decls(BQ, BK, keepers)
        body += [f"__shared__ double Cs{n}[{BK}];" for n in range(len(ch.colsums))]
        body += [f"__shared__ tgc_t T{n}[{BQ * BK}];" for n in range(len(ch.colsums))]
        body += [f"__shared__ tgc_t A{n}[{BK * m.sizes[c]}];" for n, (m, _, _, c) in enumerate(ch.colouts)]
        body += [f"const long long ntiles = (ns + {BK - 1}) / {BK};",
                 f"const long long nitems = ntiles{''.join(f' * {gen.size(ch.S.sizes[v])}' for v in ch.batch)};",
                 "for (long long item = blockIdx.x; item < nitems; item += gridDim.x) {"]
        inner = self.decode("ntiles", BK, "k0")
        inner += self.stage(self.keyops, "k0", BK, "ns", "sk")
        if ch.colsums:
            inner += [f"for (int i = tid; i < {BK}; i += nth) {{ {' '.join(f'Cs{n}[i] = 0.0;' for n in range(len(ch.colsums)))} }}"]
        for n, (m, _, _, c) in enumerate(ch.colouts):
            inner.append(f"for (int i = tid; i < {BK * m.sizes[c]}; i += nth) A{n}[i] = (tgc_t)0;")
        loop = []
        if self.conds:
            loop += self.every("q0", BQ) + [self.masked(BQ, BK), "__syncthreads();   // every thread has read `every`",
                                             "if (skip) continue;"]
        else:
            loop += ["__syncthreads();"]
        loop += self.stage(self.rowops, "q0", BQ, "nt", "tq") + ["__syncthreads();"]
        loop += self.squares(BQ, BK, None, {}, [(f"T{n}", r, "(tgc_t)0") for n, r in enumerate(ch.colsums)], keepers)
        loop += ["__syncthreads();"]
        for n, ((m, src, _, c), R) in enumerate(zip(ch.colouts, self.colout_ops)):
            loop += _tile_product(n, m.sizes[c], ("j", BK, "j"), ("a", BQ, f"a * {BK}"), f"Q{self.sq_index(src)}", R)
        if ch.colsums:
            loop += [f"for (int j = tid; j < {BK}; j += nth) {{"]
            for n in range(len(ch.colsums)):
                loop += ["    double u = 0.0;", f"    for (int a = 0; a < {BQ}; ++a) u += (double)T{n}[a * {BK} + j];",
                         f"    Cs{n}[j] += u;"]
            loop += ["}"]
        loop += ["__syncthreads();"]
        inner += [f"for (long long q0 = 0; q0 < nt; q0 += {BQ}) {{"] + ["    " + x for x in loop] + ["}"]
        for n, r in enumerate(ch.colsums):
            at = gen.offset(r.out, r.index, self.ctx(**{ch.s: "sk"}))
            inner += [f"for (int j = tid; j < {BK}; j += nth) {{", "    const long long sk = k0 + j;",
                      f"    if (sk < ns) {gen.store(r.out, self.ptrs[r.out], at, f'(tgc_t)Cs{n}[j]')}", "}"]
        for n, (m, _, _, c) in enumerate(ch.colouts):
            inner += self.store_tile(n, m, c, ch.s, ("sk", "k0", "ns", BK))
        inner += ["__syncthreads();"]
        body += ["    " + x for x in inner] + ["}"]
        self.finish(name, body, BQ, BK, ch.s, "keys", {r.out for r in ch.colsums} | {m.out for m, *_ in ch.colouts})

    def store_tile(self, n: int, m, c: str, edge: str, tile: tuple) -> list[str]:
        """Lines storing the tile accumulator `A{n}` of output kernel `m` (its edge `c`
        the inner one): `tile` = (the position's variable, the tile's first, the edge's
        size, the tile's length) along `edge`, the rows' or the keys'."""
        gen, w = self.gen, m.sizes[c]
        pos, first, size, length = tile
        at = gen.offset(m.out, m.index, self.ctx(**{edge: pos, c: "c"}))
        return [f"for (int i = tid; i < {length * w}; i += nth) {{",
                f"    const long long {pos} = {first} + i / {w}, c = i % {w};",
                f"    if ({pos} < {size}) {gen.store(m.out, self.ptrs[m.out], at, f'A{n}[i]')}", "}"]

    def finish(self, name: str, body: list[str], BQ: int, BK: int, edge: str, what: str, writes: set) -> None:
        gen, ch = self.gen, self.ch
        note = f"flash attention's gradients, a block per tile of {what}: {BQ} rows x {BK} keys ({self.g.note})"
        gen.kernel(name, gen.params(self.bufs, writes), body, note, min_blocks=1)
        total = (*(ch.S.sizes[v] for v in ch.batch), ch.S.sizes[edge])
        gen.launches.append(Launch("flash", name, tuple(self.bufs), total, index=self.i,
                                   writes=tuple(sorted(writes)), inner=(BQ if what == "rows" else BK,)))


def _tile_product(n: int, w: int, own: tuple, over: tuple, tile: str, other: str) -> list[str]:
    """Lines adding to the accumulator `A{n}` (`own`'s length x `w`, in double, rounded
    once per tile) the product of the shared tile `tile` with `other` (`over`'s length x
    `w`) summed over `over`: `own`, `over` = (variable, length, the tile's offset of it)."""
    (x, nx, at_x), (y, ny, at_y) = own, over
    p = f"p{x}"
    return [f"for (int i = tid; i < {nx * w}; i += nth) {{",
            f"    const int {x} = i / {w}, c = i % {w};",
            f"    double o = (double)A{n}[i];",
            f"    const tgc_t* {p} = {tile} + {at_x};",
            "    #pragma unroll 8",
            f"    for (int {y} = 0; {y} < {ny}; ++{y}) o += (double){p}[{at_y}] * (double){other}[{y} * {w} + c];",
            f"    A{n}[i] = (tgc_t)o;",
            "}"]
