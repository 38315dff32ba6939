"""flash: the CUDA backends' own lowering stage: attention's softmax-contraction chain
becomes one fused kernel (`Flash`) and its derived gradient chain another (`FlashBack`),
kinds of kernel only these backends have, which `flashgen` writes as CUDA kernels with
tiles of rows and keys in shared memory and no `[t, s]` buffer (docs/cuda.md, "Attention").

`Lowered` (after `layout` and `inline_elementwise`) -> `Lowered`. The forward is five
kernels (GEMM cells or loop kernels, wherever they are: the whole program or a loop's
step, forward or derived), with `b` the batch loops, `t` the rows, `s` the reduced
edge, `d` and `e` the contracted and the value edges, named as the row max names them:

- `S[b, t, s] = sum[d] q[b, t, d] * k[b, s, d]`  (a contraction of two loads, indices
  affine in loop variables; its own loop names may differ: a GEMM over `t -> t.1` is
  renamed to the names the max reads it with);
- `m[b, t] = max[s] L(S)`, where `L` is any elementwise expression of `S` and of other
  loads (a scale, an additive bias, a `where` mask or a subtracted mask); `maxshift` too;
- `l[b, t] = logsumexp[s] (L(S) - m)`;
- `P[b, t, s] = exp((L(S) - m) - l)`  (`L - m` compared as linear combinations: the
  canonical form flattens the sum);
- `y[b, t, e] = sum[s] P * v[b, s, e]`;

where `S` and `P` are temporaries, the sizes of `d` and `e` numbers up to 256, every
load of the program's float type, and the five may run at the last one's place (no
kernel in between reads what an earlier one writes or writes what it reads or writes)
or else at the first one's. `S` has no other readers; `P` either none or a gradient
chain (`_backward`): every later kernel that reads `P` or a value computed from it over
`(b, t, s)` (`dS`; the derived backward of an unmasked softmax also reads `S`), the
products over `(b, t, s)` those read (`dP = dy . v`), each
renamed to the forward's loop names from a read of a value whose names are known; they
must form what `back_of` recognises (row statistics over `s`: sums, and the max and
logsumexp an unmasked softmax's backward takes again; key sums over `t`; outputs
contracting a `[t, s]` value with a load over `s` or over `t`), nothing in between may
write `q`, `k`, `m` or `l`, and they move to their last kernel's place or their first.
The forward becomes one `Flash` kernel writing `y`, `m` and `l`; the backward one
`FlashBack` kernel, whose members start with `S` and `P` again (computed from `q`, `k`,
`m`, `l`, as the program computes `P`). The text forms are `flash for <batch loops>
reg %S[..], %P[..]` and `flashback for <batch loops>  reg ...` followed by the members.

A chain whose `S` or `P` has other readers (an output of the weights) is left as it
is; so is every chain under `--fp-strict` or with `CudaOptions.flash` off.

Exact? The kernels compute `m` exactly (a max, NaN propagating as the max kernel
does), and `P` in the backward by the program's own expression. `y` and `l` are
reassociated: `y = sum_s exp(L - m_j) v / sum_s exp(L - m_j)` with a running max `m_j`
over the tiles seen, each partial rescaled by `exp(m_j - m_{j+1})` as the max grows
(online softmax), and `l = log(sum)`; the backward's sums are taken tile by tile. A key
tile whose every (row, key) pair a `where` mask with a fill of at most -1e8 (or -inf)
rejects is skipped when each of the tile's rows admits some key: its weights are
exactly 0 then, given admitted scores above -1e7 (as `tgc.opt.stream_skip` assumes);
the backward skips it only where every term it would add is provably 0 there. A fully
masked row keeps every key and gives the program's value (the uniform average of `v`
with a finite fill). The interpreter runs the members as they were, so `tgc dump-ir`
programs run there as before.

Terminates: each match replaces five or more kernels with one or two that are never
matched again.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from tgc.ir.passes import Pass
from tgc.ir.sizes import Size, size_str
from tgc.lower.lowered import Acc, Add, Const, GemmKernel, Ix, Load, LoopKernel, Lowered, Map, Mask, Mul, SizeOf, walk
from tgc.lower.grouping import MemberGroup, read_member_parts
from tgc.lower.text import KernelForm
from tgc.options import Options

MAX_EDGE = 256           # the contracted and value edges the kernel takes (a number up to this)
SKIP_FILL = -1e8         # a `where` fill at most this (or -inf) lets wholly masked key tiles be skipped


@dataclass
class Flash(MemberGroup):
    """The fused softmax-contraction chain: members `(S, m, l, P, y)` as loop kernels
    (the interpreter runs them), `regs` the temporaries `S` and `P` (no buffers), and
    the roles the generator needs (`roles`: loop variable names b..., t, s, d, e and
    the buffers q, k, v)."""
    outer: tuple[str, ...]
    sizes: dict[str, Size]
    members: tuple[LoopKernel, ...]
    regs: tuple[str, ...] = ()
    note: str = ""
    blocks = 0
    kind = "flash"

    def can_retarget(self, low: Lowered, target: str, tmp: str) -> bool:
        return False

    def text(self) -> str:
        loops = ", ".join(f"{v} < {size_str(self.sizes[v])}" for v in self.outer)
        regs = ", ".join(f"%{r}[{', '.join(e for e, _ in m.index)}]" for r in self.regs
                         for m in self.members if m.out == r)
        body = "".join(f"\n    {m.text()}".replace("\n      for", "\n          for") for m in self.members)
        return f"flash for {loops}  reg {regs}" + (f"    # {self.note}" if self.note else "") + body

    def interpret(self, it) -> None:
        """The members one after another, `S` and `P` as whole arrays while they run."""
        for r in self.regs:
            m = next(m for m in self.members if m.out == r)
            edges = tuple(e for e, _ in m.index)
            it.arrays[r] = np.full([it.eval_size(m.sizes[ix.as_var()]) for _, ix in m.index], np.nan, it.fp)
            it.order[r] = edges
        try:
            for m in self.members:
                it.loop(m, {})
        finally:
            for r in self.regs:
                del it.arrays[r], it.order[r]

    def chain(self) -> "Chain":
        return chain_of(self.members)


def read_flash(reader, t) -> Flash:
    """A `flash for ...` kernel of the lowered text."""
    outer, sizes, members, regs, note, _ = read_member_parts(reader, t)
    return Flash(outer, sizes, members, regs, note)


FLASH_FORM = KernelForm("flash", r"""
flash: "flash" "for" outer ("," outer)* regs? note _NL loop+
""", read_flash)


def read_flashback(reader, t) -> FlashBack:
    """A `flashback for ...` kernel of the lowered text."""
    outer, sizes, members, regs, note, _ = read_member_parts(reader, t)
    return FlashBack(outer, sizes, members, regs, note)


FLASHBACK_FORM = KernelForm("flashback", r"""
flashback: "flashback" "for" outer ("," outer)* regs? note _NL loop+
""", read_flashback)


@dataclass
class FlashBack(Flash):
    """The derived gradient chain: members `(S, P, ...)`: the forward's scores and
    weights computed again (P from the kept row max and logsumexp), then the others
    (`back_of`): products over the contracted edge of two loads of rows and keys
    (`dP`), elementwise values over (b, t, s) (`dS`), row sums over s (`D`), and the
    outputs: contractions of one of these `[t, s]` values with a load, over s (rows:
    `dq`) or over t (keys: `dk`, `dv`). `regs`: every `[t, s]` value."""
    kind = "flashback"

    def text(self) -> str:
        return "flashback" + super().text()[len("flash"):]

    def chain(self) -> "Back":
        return back_of(self.members)


@dataclass(frozen=True)
class Back:
    """The roles of a `FlashBack`: the loops (b, t, s), the scores `S` (q, k, its
    contracted loop), the `[t, s]` values in order (`squares`: (kernel, kind) with kind
    'S', 'dot' or 'expr'), the row sums, and the outputs over rows and over keys
    ((kernel, the `[t, s]` buffer it reads, the other load, the output's own loop))."""
    batch: tuple[str, ...]
    t: str
    s: str
    S: LoopKernel
    squares: tuple
    rowsums: tuple
    rowouts: tuple
    colouts: tuple
    colsums: tuple


def _out_vars(m: LoopKernel) -> set[str]:
    return {v for v in m.loops if v not in m.red}


def back_of(members) -> Back:
    """The roles of a backward group's members (raises ValueError when they fit none)."""
    S, P = members[0], members[1]
    d = S.red[0]
    a, b_ = S.body.args
    # t: in one operand only; s: in the other only
    only_a, only_b = _vars(a) - _vars(b_), _vars(b_) - _vars(a)
    if len(only_a) != 1 or len(only_b) != 1:
        raise ValueError("scores")
    t, s = only_a.pop(), only_b.pop()
    ts = set(S.loops) - {d}
    batch = tuple(v for v in P.loops if v not in (t, s))
    squares = [(S, "S"), (P, "expr")]
    names = {S.out, P.out}
    written = {S.out: S.index, P.out: P.index}
    rowsums, rowouts, colouts, colsums = [], [], [], []
    late: set[str] = set()   # [t, s] values that read a row sum (known after a first pass over the keys)
    for m in members[2:]:
        sq = [ld for ld in walk(m.body) if isinstance(ld, Load) and ld.buf in names]
        if m.reduce == "sum" and len(m.red) == 1 and m.epilogue is None and isinstance(m.body, Mul) \
                and len(m.body.args) == 2 and all(isinstance(x, Load) for x in m.body.args) \
                and not all(x.buf in names for x in m.body.args):
            x, y = m.body.args
            if x.buf in names or y.buf in names:
                src, op = (x, y) if x.buf in names else (y, x)
                if src.index != written[src.buf]:
                    raise ValueError("a [t, s] value read elsewhere than where it is written")
                own = [v for v in _out_vars(m) if v not in set(batch) | {t, s}]
                if len(own) != 1 or not isinstance(m.sizes[own[0]], int) or m.sizes[own[0]] > MAX_EDGE:
                    raise ValueError("output edge")
                if m.red == (s,) and _out_vars(m) == set(batch) | {t, own[0]} and _vars(op) <= set(batch) | {s, own[0]}:
                    rowouts.append((m, src.buf, op, own[0]))
                    continue
                if m.red == (t,) and _out_vars(m) == set(batch) | {s, own[0]} and _vars(op) <= set(batch) | {t, own[0]}:
                    colouts.append((m, src.buf, op, own[0]))
                    continue
                raise ValueError("output")
            if _out_vars(m) == ts and _plain(x) and _plain(y):
                c = m.red[0]
                xa, yb = (x, y) if t in _vars(x) else (y, x)
                if _vars(xa) <= set(batch) | {t, c} and _vars(yb) <= set(batch) | {s, c} \
                        and isinstance(m.sizes[c], int) and m.sizes[c] <= MAX_EDGE:
                    squares.append((replace(m, body=Mul((xa, yb))), "dot"))
                    names.add(m.out)
                    written[m.out] = m.index
                    continue
            raise ValueError("product")
        if any(ld.index != written[ld.buf] for ld in sq):
            raise ValueError("a [t, s] value read elsewhere than where it is written")
        if m.reduce in ("sum", "max", "maxshift", "logsumexp") and m.red == (s,) and m.epilogue is None \
                and _out_vars(m) == set(batch) | {t} and _bijective(Load(m.out, m.index)) is not None and not m.bounds:
            rowsums.append(m)   # a row statistic (D = sum[s] P * dP; a softmax's max and logsumexp again)
            continue
        if m.reduce == "sum" and m.red == (t,) and m.epilogue is None and _out_vars(m) == set(batch) | {s} \
                and _bijective(Load(m.out, m.index)) is not None and not m.bounds:
            colsums.append(m)
            continue
        if not m.reduce and not m.scatter and set(m.loops) == ts and _bijective(Load(m.out, m.index)) is not None:
            rs = {r.out: r.index for r in rowsums}
            if any(ld.buf in rs and ld.index != rs[ld.buf] for ld in walk(m.body) if isinstance(ld, Load)):
                raise ValueError("a row sum read elsewhere than at its row")
            squares.append((m, "expr"))
            names.add(m.out)
            written[m.out] = m.index
            if any(isinstance(ld, Load) and (ld.buf in rs or ld.buf in late) for ld in walk(m.body)):
                late.add(m.out)
            continue
        raise ValueError("member")
    return Back(batch, t, s, S, tuple(squares), tuple(rowsums), tuple(rowouts), tuple(colouts), tuple(colsums))


@dataclass(frozen=True)
class Chain:
    """The roles in a matched chain (members S, m, l, P, y)."""
    S: LoopKernel
    m: LoopKernel
    l: LoopKernel
    P: LoopKernel
    y: LoopKernel
    batch: tuple[str, ...]   # the batch loop variables, outermost first
    t: str
    s: str
    d: str
    e: str
    q: Load
    k: Load
    v: Load
    logit: object            # L: an expression reading S at (b, t, s)


def _contraction(low: Lowered, k) -> LoopKernel | None:
    """`k` as `out = sum[one var] load * load` (a loop kernel), or None."""
    if isinstance(k, GemmKernel):
        if k.taps or k.shifts or k.cplx is not None or any(k.rounded):
            return None
        k = _gemm_loop(low, k)
    if not (isinstance(k, LoopKernel) and k.reduce == "sum" and not k.scatter and not k.bounds
            and len(k.red) == 1 and k.epilogue is None and isinstance(k.body, Mul) and len(k.body.args) == 2
            and all(isinstance(a, Load) for a in k.body.args)):
        return None
    if not _identity(k.out, k.index) or not all(_plain(a) for a in k.body.args):
        return None
    return k


def _gemm_loop(low: Lowered, k: GemmKernel) -> LoopKernel:
    """A plain GEMM cell as the loop kernel `out = sum[k] a * b` (`codegen.gemm_as_loop`
    without taps or shifts), each operand read through its view's renaming."""
    def load(view) -> Load:
        return Load(view.buf, tuple(sorted((b, Ix.var(v)) for v, b in view.edges)))
    out_edges = low.buffers[k.out].edges
    loops = tuple(dict.fromkeys(list(out_edges) + list(k.k)))
    return LoopKernel(out=k.out, index=tuple((e, Ix.var(e)) for e in out_edges), loops=loops,
                      sizes={v: low.size(v) for v in loops}, body=Mul((load(k.a), load(k.b))), reduce="sum",
                      red=tuple(v for v in loops if v not in out_edges), note=k.note)


def _identity(out: str, index) -> bool:
    return all(ix == Ix.var(e) for e, ix in index)


def _plain(ld: Load) -> bool:
    """A load whose indices are affine in loop variables only (no ids, no floor)."""
    return all(isinstance(a, str) for _, ix in ld.index for a, _ in ix.terms)


def _vars(ld: Load) -> set[str]:
    return {a for _, ix in ld.index for a, _ in ix.terms}


def _bijective(ld: Load) -> dict[str, str] | None:
    """edge -> loop variable, when each index of `ld` is one distinct variable."""
    out = {e: ix.as_var() for e, ix in ld.index}
    if any(v is None for v in out.values()) or len(set(out.values())) != len(out):
        return None
    return out


def _rename_expr(e, m: dict):
    """`e` with its loop variables replaced (`m`: variable -> Ix)."""
    if isinstance(e, Load):
        return Load(e.buf, tuple((ed, ix.subst(m)) for ed, ix in e.index))
    if isinstance(e, Mask):
        return Mask(tuple(c.subst(m) for c in e.conds), _rename_expr(e.arg, m))
    if isinstance(e, Add):
        return Add(e.coefs, tuple(_rename_expr(a, m) for a in e.args))
    if isinstance(e, Mul):
        return Mul(tuple(_rename_expr(a, m) for a in e.args))
    if isinstance(e, Map):
        return Map(e.fn, tuple(_rename_expr(a, m) for a in e.args))
    if isinstance(e, (Const, SizeOf, Acc)):
        return e
    raise ValueError(f"cannot rename the loops of {type(e).__name__}")


def _rename(k: LoopKernel, sigma: dict[str, str]) -> LoopKernel:
    """The loop kernel `k` with its loop variables renamed (`sigma`, at once; another
    variable that would collide gets a fresh name)."""
    if k.bounds:
        raise ValueError("bounds")
    sigma = {v: w for v, w in sigma.items() if v in k.loops}
    taken = set(sigma.values())
    for v in k.loops:
        if v not in sigma:
            new = v
            while new in taken:
                new += "'"
            sigma[v] = new
            taken.add(new)
    m = {v: Ix.var(w) for v, w in sigma.items()}
    return replace(k, index=tuple((e, ix.subst(m)) for e, ix in k.index), loops=tuple(sigma[v] for v in k.loops),
                   sizes={sigma[v]: n for v, n in k.sizes.items()}, red=tuple(sigma[v] for v in k.red),
                   body=_rename_expr(k.body, m),
                   epilogue=None if k.epilogue is None else _rename_expr(k.epilogue, m))


def _lin(e, scale: float = 1.0, out: dict | None = None) -> dict:
    """`e` as a linear combination {term: coefficient}, nested sums flattened (the
    canonical form flattens `L - m` into one sum with the terms of `L`)."""
    out = {} if out is None else out
    if isinstance(e, Add):
        for c, a in zip(e.coefs, e.args):
            _lin(a, scale * c, out)
    else:
        out[e] = out.get(e, 0.0) + scale
    return {k: c for k, c in out.items() if c != 0.0}


def _diff(e, a, b) -> bool:
    """Whether `e` is `a - b` as linear combinations."""
    want = _lin(a)
    for k, c in _lin(b).items():
        want[k] = want.get(k, 0.0) - c
    return _lin(e) == {k: c for k, c in want.items() if c != 0.0}


def chain_of(members) -> Chain:
    S, m, l, P, y = members
    s = m.red[0]
    d = S.red[0]
    a, b = S.body.args
    q, k = (a, b) if s not in _vars(a) else (b, a)
    x, w = y.body.args
    v = w if x.buf == P.out else x
    t = next(v_ for v_ in _vars(q) if v_ not in _vars(k) and v_ != d)
    e = next(v_ for v_ in y.loops if v_ not in m.loops and v_ != s)
    batch = tuple(v_ for v_ in m.loops if v_ not in (t, s))
    return Chain(S, m, l, P, y, batch, t, s, d, e, q, k, v, m.body)


def _match(low: Lowered, ks: list, im: int, readers: dict) -> tuple[list[int], tuple] | None:
    """The chain whose row max is kernel `im`: (the five kernels' positions, members)."""
    M = ks[im]
    if not (isinstance(M, LoopKernel) and M.reduce in ("max", "maxshift") and not M.scatter and not M.bounds
            and len(M.red) == 1 and M.epilogue is None and _identity(M.out, M.index)):
        return None
    s = M.red[0]
    rows = [v for v in M.loops if v != s]
    # the scores: a load at the identity index of a temporary a contraction wrote
    cands = [ld for ld in walk(M.body) if isinstance(ld, Load) and low.buffers[ld.buf].kind == "temp"
             and _bijective(ld) is not None and set(_vars(ld)) == set(M.loops)]
    for ld in cands:
        writers = [j for j in range(im) if ld.buf in ks[j].writes()]
        if len(writers) != 1:
            continue
        iS = writers[0]
        S = _contraction(low, ks[iS])
        if S is None:
            continue
        S = _rename(S, {ix.as_var(): _bijective(ld)[e] for e, ix in S.index})   # S's rows and keys as M names them
        if set(S.loops) - set(S.red) != set(M.loops) or any(S.sizes[v] != M.sizes[v] for v in M.loops):
            continue
        if any(x.index != ld.index for x in walk(M.body) if isinstance(x, Load) and x.buf == ld.buf):
            continue
        d = S.red[0]
        qa, kb = S.body.args
        if s in _vars(qa):
            qa, kb = kb, qa
        if s in _vars(qa) or s not in _vars(kb) or d not in _vars(qa) or d not in _vars(kb):
            continue
        tv = [v for v in _vars(qa) if v not in _vars(kb) and v != d]
        if len(tv) != 1 or not (_vars(qa) | _vars(kb)) <= set(S.loops):
            continue
        t = tv[0]
        if not (_vars(kb) - {s, d}) <= set(rows) - {t}:
            continue
        found = _rest(low, ks, im, M, ld.buf, s, rows)
        if found is None:
            continue
        il, ip, iy, L, P, Y = found
        if any(x.index != ld.index for m_ in (L, P) for x in walk(m_.body) if isinstance(x, Load) and x.buf == ld.buf):
            continue
        x, w = Y.body.args
        v = w if x.buf == P.out else x
        e = [u for u in Y.loops if u not in M.loops]
        if len(e) != 1 or Y.red != (s,) or not (_vars(v) <= set(rows) - {t} | {s, e[0]}) or s not in _vars(v) \
                or e[0] not in _vars(v) or set(Y.loops) != set(M.loops) | {e[0]}:
            continue
        if not (isinstance(S.sizes[d], int) and 0 < S.sizes[d] <= MAX_EDGE
                and isinstance(Y.sizes[e[0]], int) and 0 < Y.sizes[e[0]] <= MAX_EDGE):
            continue
        pos = [iS, im, il, ip, iy]
        if sorted(pos) != pos:
            continue
        if low.buffers[P.out].kind != "temp":
            continue
        S = replace(S, body=Mul((qa, kb)))
        members = (S, M, L, P, Y)
        if any(low.buffers[b].dtype != low.dtype for mm in members for b in mm.buffers_read() if b not in (ld.buf, P.out)):
            continue
        at = pos[-1] if _movable(ks, pos, members) else pos[0] if _hoistable(ks, pos, set()) else None
        if at is None:
            continue
        # S has no other readers; P none but y, or a backward chain
        back = None
        if readers.get(P.out, set()) - {iy} or readers.get(ld.buf, set()) - {im, il, ip}:
            back = _backward(low, ks, iy, S, P, readers)
            if back is None or readers.get(ld.buf, set()) - {im, il, ip} - set(back[0]):
                continue
        return pos, members, back, at
    return None


def _backward(low: Lowered, ks: list, iy: int, S: LoopKernel, P: LoopKernel, readers: dict):
    """The gradient chain that reads the weights `P` after the forward's last kernel
    `iy`: (positions, members (S, P, ...)), or None. Its members are every kernel
    reading a `[t, s]` value of it, and the products `dP` those read, in order."""
    ts = set(P.loops)
    squares = {P.out, S.out}
    picked: list[int] = []
    cands: dict[str, int] = {}   # products over (b, t, s) not yet read with a [t, s] value
    for j in range(iy + 1, len(ks)):
        k = ks[j]
        reads = k.buffers_read()
        if reads & squares:
            picked.append(j)
            if isinstance(k, LoopKernel) and not k.reduce and set(k.loops) == ts:
                squares.add(k.out)
            continue
        c = _contraction(low, k)
        if c is not None and len(_out_vars(c)) == len(ts):
            cands[k.out] = j
            continue
        if reads & set(cands):   # what reads a product is no part of the chain
            for b in reads & set(cands):
                del cands[b]
    products = set()
    for j in list(picked):
        for b in ks[j].buffers_read() & set(cands):
            at = [_bijective(x) for x in _loads(ks[j]) if x.buf == b]
            if not at or any(a is None or set(a.values()) != ts for a in at):
                continue   # read as something else than a value over (b, t, s): an operand
            picked.append(cands.pop(b))
            squares.add(b)
            products.add(b)
    picked.sort()
    if not picked:
        return None
    # every member's loops named as the forward's (b, t, s): from its read of a value
    # over (b, t, s) whose names are known (S, P; a product from a reader that knows)
    known = {S.out: dict(S.index), P.out: dict(P.index)}
    pending = {}
    for j in picked:
        k = _contraction(low, ks[j]) or ks[j]
        if not isinstance(k, LoopKernel):
            return None
        pending[j] = k
    done: dict[int, LoopKernel] = {}
    try:
        while pending:
            for j, k in list(pending.items()):
                if k.out in products:
                    if k.out not in known:
                        continue
                    sigma = {ix.as_var(): known[k.out][e].as_var() for e, ix in k.index}
                else:
                    x = next((x for x in _loads(k) if x.buf in known), None)
                    if x is None or _bijective(x) is None:
                        continue
                    sigma = {ix.as_var(): known[x.buf][e].as_var() for e, ix in x.index}
                k = done[j] = _rename(k, sigma)
                del pending[j]
                if not k.reduce and set(k.loops) == ts:   # a value over (b, t, s) (dS)
                    known[k.out] = dict(k.index)
                for y in _loads(k):
                    at = _bijective(y)
                    if y.buf in products and y.buf not in known and at is not None and set(at.values()) == ts:
                        known[y.buf] = dict(y.index)
                break
            else:
                return None
    except ValueError:
        return None
    members = [S, P] + [done[j] for j in picked]
    try:
        back = back_of(members)
    except (ValueError, StopIteration, AttributeError):
        return None
    names = {m.out for m, _ in back.squares}
    for n in names - {S.out, P.out}:
        if low.buffers[n].kind != "temp" or readers.get(n, set()) - set(picked):
            return None
    if readers.get(P.out, set()) - set(picked) - {iy}:
        return None
    if any(not isinstance(m, LoopKernel) for m in members):
        return None
    if any(low.buffers[b].dtype != low.dtype for m in members for b in m.buffers_read() if b not in names):
        return None
    inputs = S.buffers_read() | P.buffers_read()   # q, k, the row max and logsumexp: read again by the group
    if any(ks[j].writes() & inputs for j in range(iy + 1, picked[-1]) if j not in picked):
        return None
    if _movable(ks, picked, members):
        return picked, tuple(members), picked[-1]
    if _hoistable(ks, picked, S.buffers_read() | P.buffers_read()):
        return picked, tuple(members), picked[0]
    return None


def _hoistable(ks, pos, reads: set) -> bool:
    """Whether the kernels at `pos` may all run at the first one's place: no kernel in
    between writes `reads` (the recomputed weights' inputs), writes what a later one
    of them reads, or reads or writes what a later one writes (the scale of `dq` after
    its product stays after it)."""
    for j in range(pos[0], pos[-1]):
        if j in pos:
            continue
        k = ks[j]
        if k.writes() & reads:
            return False
        for p in pos:
            if p > j and (ks[p].buffers_read() & k.writes() or ks[p].writes() & (k.buffers_read() | k.writes())):
                return False
    return True


def _rest(low, ks, im, M, sbuf, s, rows):
    """The logsumexp, the weights and the contraction with v after the max `M`."""
    mload = Load(M.out, M.index)
    for il in range(im + 1, len(ks)):
        L = ks[il]
        if not (isinstance(L, LoopKernel) and L.reduce == "logsumexp" and L.red == (s,) and not L.bounds
                and L.epilogue is None and set(L.loops) == set(M.loops) and _identity(L.out, L.index)
                and _diff(L.body, M.body, mload)):
            continue
        lload = Load(L.out, L.index)
        for ip in range(il + 1, len(ks)):
            P = ks[ip]
            if not (isinstance(P, LoopKernel) and not P.reduce and not P.scatter and set(P.loops) == set(M.loops)
                    and _identity(P.out, P.index) and isinstance(P.body, Map) and P.body.fn == "exp"
                    and _diff(P.body.args[0], L.body, lload)):
                continue
            for iy in range(ip + 1, len(ks)):
                Y = _contraction(low, ks[iy])
                if Y is None or Y.red != (s,):
                    continue
                pl = [a for a in Y.body.args if a.buf == P.out]
                if len(pl) != 1 or not _identity(P.out, pl[0].index):
                    continue
                return il, ip, iy, L, P, Y
    return None


def _loads(k):
    """Every load of a loop kernel or GEMM cell (a GEMM's operands as `_gemm_loop` reads them)."""
    if isinstance(k, GemmKernel):
        return [a for a in (Load(v.buf, tuple(sorted((b, Ix.var(e)) for e, b in v.edges))) for v in (k.a, k.b))]
    if isinstance(k, LoopKernel):
        return [x for root in (k.body, k.epilogue) if root is not None for x in walk(root) if isinstance(x, Load)]
    return []


def _movable(ks, pos, members) -> bool:
    """Whether the kernels at `pos` may all run at the last one's place: no kernel in
    between reads what an earlier one of them writes, or writes what an earlier one
    reads or writes (each moves down past the kernels after it)."""
    for j in range(pos[0], pos[-1]):
        if j in pos:
            continue
        k = ks[j]
        for p in pos:
            if p < j and (k.buffers_read() & ks[p].writes() or k.writes() & (ks[p].buffers_read() | ks[p].writes())):
                return False
    return True


@dataclass(frozen=True)
class FlashChains(Pass[Lowered, Lowered]):
    """Fuse attention's softmax-contraction chain into one kernel."""

    name = "flash"
    takes = gives = "lowered"

    def run(self, low: Lowered, options: Options) -> Lowered:
        out = low.staged("flash")
        if options.fp_strict or not options.cuda.flash or low.dtype not in ("f32", "f64"):
            return out
        ks = list(out.kernels)
        changed = True
        while changed:
            changed = False
            readers: dict[str, set[int]] = {}
            for i, k in enumerate(ks):
                for b in k.buffers_read():
                    readers.setdefault(b, set()).add(i)
            for im in range(len(ks)):
                found = _match(out, ks, im, readers)
                if found is None:
                    continue
                pos, members, back, at_fwd = found
                ch = chain_of(members)
                outer = ch.batch

                def lead(ms):
                    return tuple(replace(m, loops=outer + tuple(v for v in m.loops if v not in outer)) for m in ms)
                members = lead(members)
                sizes = {v: members[1].sizes[v] for v in outer}
                group = Flash(outer, sizes, members, (members[0].out, members[3].out),
                              note=f"attention over {ch.s}: rows {ch.t}, keys in shared memory")
                drop = set(pos) - {at_fwd}
                place = {at_fwd: group}
                regs = set(group.regs)
                if back is not None:
                    bpos, bmembers, at = back
                    bmembers = lead(bmembers)
                    bregs = tuple(m.out for m, _ in back_of(bmembers).squares)
                    place[at] = FlashBack(outer, sizes, bmembers, bregs,
                                                note=f"its gradients: rows {ch.t}, then keys {ch.s}")
                    drop |= set(bpos) - {at}
                    regs |= set(bregs)
                ks = [place.get(j, k) for j, k in enumerate(ks) if j not in drop]
                for r in regs:
                    del out.buffers[r]
                changed = True
                break
        out.kernels = ks
        return out
