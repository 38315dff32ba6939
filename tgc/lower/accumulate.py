"""accumulate: a GEMM whose product is added into a value becomes a GEMM adding into it.

`Lowered` (after `layout`) -> `Lowered`. A sum `r = c + a @ b` is lowered as two kernels:
the GEMM stores its product `t` (a temporary), then a loop kernel reads `c` and `t` and
stores `r`. When `r` and `c` can be the same memory, one GEMM with beta = 1
(`gemm %r += a @ b`: `GemmKernel.acc`) computes it: the product is never stored, read
back and added. Two places where `r` and `c` are the same memory:

- in place: `r[e] = add[1, 1](r[e], t[e])` (either order) in one program;
- a loop's carry (`StepLoop`): the step's output `r` (the carry's new value) is
  `add[1, 1](c[e], t[e])` of its argument `c` (the carry's value). The loop then binds the
  output to the carry's own buffer (`outs[k]` is `args[k]`), so that `r` holds `c`'s value
  when the step starts and no copy follows the step (the streamed attention's `dk` and
  `dv` partials per key block, `tgc.opt.stream`).

What is rewritten: a plain GEMM (no taps, shifts, complex pairs, rounding or epilogue)
into a temporary `t` that has exactly the product's edges, and the one kernel that reads
`t` (the first after it): a plain loop over `r`'s edges (whole) storing `r` at the
element's own index the sum `add[1, 1]` of the load of `c` at that index and the load of
`t` there, `c` and `r` laid out as `t` (same type, same order up to the renaming below); no
kernel in between writes the GEMM's operands or reads or writes `r`; no kernel after reads
`t`. An edge of `t` may be read along a longer edge of `r` under exactly the mask
`s < size(s.1)` (a causal stream's loop over the keys its rows admit: `t` covers the
leading block of `s`): the GEMM then adds into that block (`prefix(s.1 in s)`), the rest
of `r` keeps `c`'s value, as the masked sum adds zeros there. Neither `r` nor `c` is an
operand of the GEMM. For a carry, its argument is read by no kernel after the sum, the
step's output is written by the sum alone, and no other kernel of the enclosing program
uses the buffer the output was bound to. The GEMM moves to the sum's place as
`gemm %r += a @ b` and `t` goes; a carry's loop binds its output to the carry.

Floating point: BLAS with beta = 1 computes `alpha * AB + beta * C`, here `C + AB`. The
separate add stores the GEMM's sum `t` rounded, then rounds `c + t`. A GEMM that sums a
block of K in registers and adds `C` to it as it stores it (the CPU's own kernel, its
generated loops, OpenBLAS's micro-kernels, cuBLAS) computes the same `c + t`, rounded once,
when its own sum is the same: K in one block (the blocks depend on the sizes alone, the
same for both forms): then the bits are the separate add's (the attention benchmark's
outputs at t = 1024 are bitwise equal). Where K is cut into blocks, the separate GEMM adds
them into `t` in turn and `c` comes last; with beta = 1 `c` is added to the first block's
sum and the later blocks after it: a sum of the same K + 1 terms, associated differently,
with the same error bound. The lowered interpreter sums the product and the old value in
float64 and rounds once (the separate form rounds twice). `--fp-strict` keeps the two
kernels (`Options.fp_strict`).

Summed products: products read only summed together, `add[.., 1, 1, ..](.., t1, t2, ..)`
in every kernel that reads them (the input gradient of a layernorm feeding a transformer
block's q, k and v projections: three products, summed where the layernorm's backward
reads them, up to five times in one group), become one buffer: the first GEMM stores
its product, each later one adds into it (`gemm %t1 += ..`, its product's edges
renamed to the first's where they differ: both products loaded at loop variables alone,
the same renaming at every sum, laid out alike, the same sizes), and each sum reads
`t1` alone in the place of the products. It applies to GEMMs into temporaries written
once, with no taps, shifts, complex pairs, rounding or epilogue, every reader after the
last of them. Two buffers fewer are written and read back (in the nanoGPT step's
backward, 2 x 1.5 MB a layer), and the sums' adds go. Floating point: the sum of
three or more f32 terms is computed in f64 and rounded once (`lowered.wide_sum`); each
accumulating GEMM rounds its add (as PyTorch's accumulated gradients do), so the result
is the same sum with one rounding per product, within f32's bound of the largest
partial sum (tests/lower/test_accumulate_sums.py: 3.6e-7 of the largest value against
float64 at 1024 x 384, the f64 sum 3.1e-7). `--fp-strict` keeps the sum.

Where it applies: after `layout` (buffers' orders fixed), in the CPU backend's stages
before `epilogue` (which would otherwise fold the add into the GEMM's store, with the copy
of the carry still made) and in the CUDA backends' after `flash`.

Terminates: one pass over the kernels (and each loop's step), each rewrite removing a kernel;
the summed products: one pass per program over its GEMMs, each folded at most once.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tgc.ir.passes import Pass
from tgc.lower.lowered import (Add, Bind, Cond, GemmKernel, Ix, Load, LoopKernel, Lowered, Map, Mask, Mul, StepLoop, Uses,
                               View, neg, walk)
from tgc.options import Options


@dataclass(frozen=True)
class Accumulate(Pass[Lowered, Lowered]):
    """Fold `r = c + a @ b` into one accumulating GEMM where `r` and `c` share memory."""

    name = "accumulate"
    takes = gives = "lowered"

    def run(self, low: Lowered, options: Options) -> Lowered:
        if options.fp_strict:
            return low
        out = low.staged("accumulate")
        uses = Uses(_carries_in_place(out, k) if isinstance(k, StepLoop) else k for k in out.kernels)
        for i in range(len(uses.slots)):
            pair = _pair(out, uses, i) if uses.slots[i] is not None else None
            if pair is not None:
                j, r, c, prefix = pair
                if r == c:
                    _fold(out, uses, i, j, prefix)
        _summed_products(out, uses)
        out.kernels = uses.kernels()
        _drop_unused(out)
        return out


def _pair(low: Lowered, uses: Uses, i: int):
    """(j, r, c, prefix) when kernel i is a GEMM into a temporary `t` that kernel j, the
    only one to read it, turns into `r = c + t` (as the module docstring says), else None.
    `prefix`: the (product edge, `r`'s edge) pairs where `t` covers the leading block of
    a longer edge of `r` (read there under the mask `edge < size(t's edge)`). `uses`
    holds the kernels (`low.kernels` is not read) and answers which of them read or
    write a buffer (a scan of every later kernel per GEMM was quadratic)."""
    g = uses.slots[i]
    if not (isinstance(g, GemmKernel) and not g.acc and not g.taps and not g.shifts and g.cplx is None
            and not any(g.rounded) and not g.epilogue):
        return None
    t = low.buffers.get(g.out)
    if t is None or t.kind != "temp" or set(t.edges) != set(g.out_edges()):
        return None
    readers = uses.readers(g.out, i)
    if len(readers) != 1 or uses.writers(g.out, i):
        return None
    j = readers[0]
    k = uses.slots[j]
    if not (isinstance(k, LoopKernel) and not k.reduce and not k.red and not k.scatter and k.epilogue is None
            and not k.bounds):
        return None
    r = low.buffers[k.out]
    if set(k.loops) != set(r.edges) or any(k.sizes[v] != low.size(v) for v in k.loops) \
            or any(ix != Ix.var(e) for e, ix in k.index):
        return None
    body = k.body
    if not (isinstance(body, Add) and body.coefs == (1.0, 1.0) and len(body.args) == 2):
        return None
    found = [_product_load(low, a, g.out, r.edges) for a in body.args]
    if sum(f is not None for f in found) != 1:
        return None
    at = 0 if found[0] is not None else 1
    rename = found[at]
    other = body.args[1 - at]
    if not (isinstance(other, Load) and all(ix == Ix.var(e) for e, ix in other.index)):
        return None
    c = other.buf
    cb = low.buffers[c]
    if r.order is None or t.order is None or r.order != tuple(rename[e] for e in t.order) or r.dtype != t.dtype:
        return None
    if cb.edges != r.edges or cb.order != r.order or cb.dtype != r.dtype or {k.out, c} & {g.a.buf, g.b.buf}:
        return None
    if any(uses.writers(b, i, j) for b in {g.a.buf, g.b.buf, k.out}) or uses.readers(k.out, i, j):
        return None
    return j, k.out, c, tuple((e, b) for e, b in sorted(rename.items()) if e != b)


def _product_load(low: Lowered, e, t: str, edges) -> dict[str, str] | None:
    """{`t`'s edge: loop variable} when `e` loads `t` (a temporary) at loop variables
    alone, each of `t`'s edges at one of `edges` (`t`'s own or a longer one), masked by
    exactly `v < size(t's edge)` for each longer one; else None."""
    conds: tuple = ()
    if isinstance(e, Mask):
        conds, e = e.conds, e.arg
    if not (isinstance(e, Load) and e.buf == t):
        return None
    rename = {}
    for te, ix in e.index:
        v = ix.as_var()
        if v is None or v not in edges or v in rename.values():
            return None
        rename[te] = v
    want = {Cond(Ix.var(v).plus_const(neg(low.size(te))), "<") for te, v in rename.items() if te != v}
    if set(conds) != want or len(conds) != len(want):
        return None
    return rename


def _fold(low: Lowered, uses: Uses, i: int, j: int, prefix: tuple = ()) -> None:
    """Kernel j (`r = c + t`, `r` holding `c`) as kernel i's GEMM adding into `r` (into
    the leading block of each `prefix` edge)."""
    g, k = uses.slots[i], uses.slots[j]
    del low.buffers[g.out]
    uses.set(j, replace(g, out=k.out, acc=True, prefix=prefix))
    uses.set(i, None)


def _carries_in_place(low: Lowered, loop: StepLoop) -> StepLoop:
    """`loop` with each carry whose new value is `c + a @ b` updated in place: its step
    adds the product into its output, which the loop binds to the carry's buffer."""
    step = loop.step.staged(loop.step.stage)
    args = list(step.module.args)
    outs = {b.index: n for n, b in step.buffers.items() if b.kind == "out"}
    binds = list(loop.outs)
    for c in range(loop.carries):
        arg, out = args[c], outs.get(c)
        if out is None or loop.args[c].stacked or loop.outs[c].stacked or loop.outs[c].buf == loop.args[c].buf:
            continue
        new = loop.outs[c].buf
        if low.buffers[new].kind != "temp" or any(new in k.buffers_used() for k in low.kernels if k is not loop):
            continue   # (the carry's new value read after the loop: its buffer stays)
        found = None
        uses = Uses(step.kernels)
        for i in range(len(uses.slots)):
            pair = _pair(step, uses, i)
            if pair is not None and pair[1] == out and pair[2] == arg:
                found = (i, pair[0], pair[3])
                break
        if found is None:
            continue
        i, j, prefix = found
        if uses.writers(out) != [j] or uses.readers(arg, j) or uses.readers(out, hi=j):
            continue
        _fold(step, uses, i, j, prefix)
        step.kernels = uses.kernels()
        binds[c] = Bind(loop.args[c].buf)
    if binds == list(loop.outs):
        return loop
    return replace(loop, step=step, outs=tuple(binds))


def _drop_unused(low: Lowered) -> None:
    """Temporaries no kernel uses any more (a carry's copy target, once the carry is
    updated in place)."""
    used = {n for k in low.kernels for n in k.buffers_used()}
    for name in [n for n, b in low.buffers.items() if b.kind == "temp" and n not in used]:
        del low.buffers[name]


def _summed_products(low: Lowered, uses: Uses) -> bool:
    """Products that are read only summed together become one buffer the later GEMMs
    add into (the module docstring's "summed products"): each reader's sum
    `add[.., 1, 1, ..](.., t1[ix1], t2[ix2], ..)` reads the first one alone. In place
    in `uses`; each step's program too. Whether it folded any."""
    folded = False
    for i, k in enumerate(uses.slots):
        if isinstance(k, StepLoop):
            inner = k.step.staged(k.step.stage)
            u = Uses(inner.kernels)
            if _summed_products(inner, u):
                inner.kernels = u.kernels()
                _drop_unused(inner)
                uses.set(i, replace(k, step=inner))
                folded = True
    prods = {}
    for i, g in enumerate(uses.slots):
        if (isinstance(g, GemmKernel) and not g.acc and not g.taps and not g.shifts and g.cplx is None
                and not any(g.rounded) and not g.epilogue and not g.prefix):
            t = low.buffers.get(g.out)
            if t is not None and t.kind == "temp" and t.dtype in ("f32", "f64") and set(t.edges) == set(g.out_edges()) \
                    and uses.writers(g.out) == [i] and t.order is not None:
                prods[g.out] = i
    if len(prods) < 2:
        return folded
    sites: dict[str, set] = {}    # product -> the frozensets of products summed with it
    bad: set[str] = set()
    for t, i in prods.items():
        for j in uses.readers(t):
            k = uses.slots[j]
            if not isinstance(k, LoopKernel) or j < i:
                bad.add(t)
                continue
            roots = [k.body] + ([k.epilogue] if k.epilogue is not None else [])
            loads = sum(1 for r in roots for n in walk(r) if isinstance(n, Load) and n.buf == t)
            summed = 0
            for r in roots:
                for n in walk(r):
                    if isinstance(n, Add):
                        group = _summed_loads(n, prods)
                        if t in group:
                            summed += 1
                            sites.setdefault(t, set()).add(frozenset(group))
            if loads == 0 or loads != summed:
                bad.add(t)
    done: set[str] = set()
    for t in sorted(prods, key=prods.get):
        if t in done or t in bad or len(sites.get(t, ())) != 1:
            continue
        (group,) = sites[t]
        members = sorted(group, key=prods.get)
        if len(members) < 2 or any(m in bad or m in done or sites.get(m) != {group} for m in members):
            continue
        renames = _renames(low, uses, members, prods)
        if renames is None:
            continue
        _fold_sum(low, uses, members, prods, renames)
        done.update(members)
        folded = True
    return folded


def _summed_loads(e: Add, prods: dict) -> dict[str, Load]:
    """The products `e` sums with coefficient 1 (each at most once), by name."""
    out: dict[str, Load] = {}
    for c, a in zip(e.coefs, e.args):
        if isinstance(a, Load) and a.buf in prods:
            if c != 1.0 or a.buf in out:
                return {}
            out[a.buf] = a
    return out if len(out) >= 2 else {}


def _renames(low: Lowered, uses: Uses, members: list[str], prods: dict):
    """Per later product, {its edge: the first product's edge} (the same at every sum
    reading them: both loaded at loop variables alone, each edge at its own), when each
    is laid out as the first one along it with the same sizes and type, every reader
    comes after the last GEMM, and the later GEMMs can name their product's edges so;
    else None."""
    first = low.buffers[members[0]]
    last = max(prods[m] for m in members)
    if any(j <= last for m in members for j in uses.readers(m)):
        return None
    found: dict[str, dict] = {}
    for m in members:
        for j in uses.readers(m):
            k = uses.slots[j]
            for r in [k.body] + ([k.epilogue] if k.epilogue is not None else []):
                for n in walk(r):
                    if not isinstance(n, Add):
                        continue
                    group = _summed_loads(n, prods)
                    if set(group) != set(members):
                        continue
                    at = _vars(group[members[0]])
                    for b in members[1:]:
                        vb = _vars(group[b])
                        if at is None or vb is None or set(vb.values()) != set(at.values()):
                            return None
                        back = {v: e for e, v in at.items()}
                        rho = {e: back[v] for e, v in vb.items()}
                        if found.setdefault(b, rho) != rho:
                            return None
    for b in members[1:]:
        rho, buf, g = found.get(b), low.buffers[b], uses.slots[prods[b]]
        if rho is None or buf.dtype != first.dtype or tuple(rho[e] for e in buf.order) != first.order:
            return None
        if any(low.size(e) != low.size(rho[e]) for e in buf.edges):
            return None
        moved = {e for e in rho if rho[e] != e}
        kept = set(g.batch + g.m + g.n + g.k) - moved
        if {rho[e] for e in moved} & kept or {g.a.buf, g.b.buf} & set(members):
            return None
    return found


def _vars(load: Load) -> dict[str, str] | None:
    """{buffer edge: loop variable} of a load at loop variables alone, each once."""
    out = {e: ix.as_var() for e, ix in load.index}
    if any(v is None for v in out.values()) or len(set(out.values())) != len(out):
        return None
    return out


def _fold_sum(low: Lowered, uses: Uses, members: list[str], prods: dict, renames: dict) -> None:
    """The later products' GEMMs adding into the first's buffer, their edges renamed to
    its edges; each sum of them reading the first alone."""
    first = members[0]
    for b in members[1:]:
        g, rho = uses.slots[prods[b]], renames[b]
        name = lambda e: rho.get(e, e)   # noqa: E731
        view = lambda v: View(v.buf, tuple((name(e), be) for e, be in v.edges))   # noqa: E731
        uses.set(prods[b], replace(g, out=first, acc=True, a=view(g.a), b=view(g.b), batch=tuple(map(name, g.batch)),
                                   m=tuple(map(name, g.m)), n=tuple(map(name, g.n))))
        del low.buffers[b]
    readers = sorted({j for m in members for j in uses.readers(m)} - set(prods.values()))
    for j in readers:
        k = uses.slots[j]
        fix = lambda e: _one_load(e, members, prods)   # noqa: E731
        k = replace(k, body=_rewrite(k.body, fix),
                    epilogue=None if k.epilogue is None else _rewrite(k.epilogue, fix))
        uses.set(j, k)


def _one_load(e, members: list[str], prods: dict):
    """A sum of the members as the sum reading the first alone (None: not such a sum)."""
    if not isinstance(e, Add):
        return None
    group = _summed_loads(e, prods)
    if set(group) != set(members):
        return None
    coefs, args = [], []
    for c, a in zip(e.coefs, e.args):
        if isinstance(a, Load) and a.buf in group and a.buf != members[0]:
            continue
        coefs.append(c)
        args.append(_rewrite(a, lambda x: _one_load(x, members, prods)) if not isinstance(a, Load) else a)
    if len(args) == 1 and coefs[0] == 1.0:
        return args[0]
    return Add(tuple(coefs), tuple(args))


def _rewrite(e, fn):
    """`e` with each subtree `fn` gives a value for replaced by it (parents first)."""
    r = fn(e)
    if r is not None:
        return r
    if isinstance(e, (Add, Mul, Map)):
        return replace(e, args=tuple(_rewrite(a, fn) for a in e.args))
    if isinstance(e, Mask):
        return replace(e, arg=_rewrite(e.arg, fn))
    return e
