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
from tgc.lower.lowered import Const, Map, Mask

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
                f"__shared__ tgc_t ms[{BQ}], ls[{BQ}], als[{BQ}];",
                "__shared__ int every;",
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
                 "    tgc_t x = (tgc_t)0;",
                 f"    const tgc_t* qa = Qs + a * {D};",
                 f"    const tgc_t* kj = Ks + j * {D};",
                 "    #pragma unroll 8",
                 f"    for (int c = 0; c < {D}; ++c) x += qa[c] * kj[c];",
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
                 "    tgc_t o = Os[i] * als[a];",
                 f"    const tgc_t* pa = Ss + a * {BK};",
                 "    #pragma unroll 8",
                 f"    for (int j = 0; j < {BK}; ++j) o += pa[j] * Vs[j * {E} + c];",
                 "    Os[i] = o;",
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
