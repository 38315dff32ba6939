"""epilogue: elementwise kernels that read a GEMM's product become its epilogue.

`Lowered` (after `layout`) -> `Lowered`. Today a GEMM stores its product `t`, and each
loop kernel that reads `t` elementwise (a bias and a GELU after a forward product,
the GELU's derivative after a backward one, AdamW's moments and update after a
weight's gradient) reads it back from memory. This stage moves such a kernel into the
GEMM as an output of its `epilogue` (`tgc.lower.lowered.EpilogueOut`): `acc` stands
for the product's element, so a backend can compute the kernel's value as it stores
the product (or in one pass over it while it is in cache), and the product need not
be read back.

A loop kernel `y = f(t, ...)` after `gemm t = a @ b` (or one that reads an output
joined before it: AdamW's update reads the new moments) joins the GEMM's epilogue when:
- it is a plain loop (no reduction, scatter, bounds or epilogue of its own, not the
  final copy of an update) over exactly the product's edges (the same extents), writing
  `y` at that index, and `y` has exactly those edges;
- every index it loads with is a loop variable or a constant (no gathers, no floor
  divisions: an operand "of the same index", or a broadcast one: a bias), it holds no
  mask and no random draw, and it reads `t`, its own output and the outputs joined
  before it only at the element's own index;
- it can move to just after the GEMM: no kernel in between writes what it reads, or
  reads or writes `y`;
- `t` is a temporary.
Kernels join in program order, so the outputs run in the order the kernels did.
After them, a kernel that reads neither the product nor a joined output joins when it is
such a loop and every load it makes over all the product's edges is one the epilogue
already makes at the element's own index (`_sharers`: the recomputed GELU `(0.5 + 0.5 t)
u` of a reverse layer loop, of the kept pre-activation `u` and `t = tanh(..)` that GELU's
derivative in the store of `dy @ wproj^T` loads): the epilogue writes it from values it
holds, and the separate pass that read them again goes. Its output is then written
earlier and lives longer (from the GEMM to its readers).
When no kernel reads `t` any more, the GEMM stores its product straight into an output
laid out as `t` (`_product_into_output`), and `t` goes: the product's elements live on
as `acc`.

Exact: each output is the same expression of the same values (the product's element is
the value the kernel loaded), computed once per element, and moving the kernel is
allowed by the conditions above (each buffer it reads holds the same value at the
GEMM as at the kernel's old place; nothing in between sees `y`). Reading its own output
and the earlier outputs only at the element's index, the per-element order of the
epilogue gives the values of the kernels run one after another.

Where it cannot apply (the line for `docs/optimization.md`): an AdamW update under
global-norm clipping (examples/gpt2.tg) reads `clip`, a function of the sum of every
gradient's squares: it is computed after the last gradient GEMM, so no gradient's
update can move to its GEMM (the conditions above: `clip`'s kernel lies between).
The sum of squares itself is a reduction, which this stage does not fold.

`tgc.lower.lowered.epilogue_loops` gives the loop kernels an epilogue stands for (`acc` read from `t`);
the lowered interpreter runs them, and `expand` turns a program's epilogues back into
them for a backend that has no store epilogue (the CPU's `group` and the CUDA backend
call it). Terminates: one pass over the kernels (and each step's program); each GEMM
visits only the kernels that read its product or the outputs joined to it.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

from tgc.ir.passes import Pass
from tgc.lower.lowered import (Acc, Buffer, EpilogueOut, ExprVisitor, GemmKernel, Ix, Load, LoopKernel, Lowered,
                               Mask, Rand, StepLoop, Uses, epilogue_loops, walk)
from tgc.options import Options


@dataclass(frozen=True)
class GemmEpilogue(Pass[Lowered, Lowered]):
    """Fold the elementwise kernels that read a GEMM's product into its epilogue."""

    name = "epilogue"
    takes = gives = "lowered"

    def run(self, low: Lowered, options: Options) -> Lowered:
        out = low.staged("epilogue")
        out.kernels = fold(out)
        return out


def fold(low: Lowered) -> list:
    """`low`'s kernels with the foldable readers of each GEMM's product in its epilogue
    (each step's program too)."""
    uses = Uses(replace(k, step=replace(k.step, kernels=fold(k.step))) if isinstance(k, StepLoop) else k
                for k in low.kernels)
    for i, g in enumerate(uses.slots):
        if g is not None and _candidate(low, g):
            folded = _fold_gemm(low, uses, i)
            if folded is not g:
                uses.set(i, folded)
    return uses.kernels()


def _candidate(low: Lowered, g) -> bool:
    return (isinstance(g, GemmKernel) and g.cplx is None and not g.taps and not g.shifts and not g.acc
            and not any(g.rounded) and low.buffers[g.out].kind == "temp"
            and set(low.buffers[g.out].edges) == set(g.out_edges()))


def _fold_gemm(low: Lowered, uses: Uses, i: int):
    """GEMM i with the kernels that join its epilogue (removed from `uses`). The
    candidates are the kernels after it that read its product or an output joined
    before them, up to the next kernel that writes the product, in order (`Uses`: a
    scan of every later kernel per GEMM was quadratic in the program's length)."""
    g = uses.slots[i]
    edges = set(g.out_edges())
    outs: list[EpilogueOut] = []
    taken: set[int] = set()
    stop = next(iter(uses.writers(g.out, i)), None)
    todo = uses.readers(g.out, i, stop)
    seen = set(todo)
    while todo:
        j = heapq.heappop(todo)
        k = uses.slots[j]
        if not _foldable(low, g, k, edges, [o.buf for o in outs]):
            continue
        reads = k.buffers_read() - {g.out}
        between = [x for b in reads for x in uses.writers(b, i, j)] + \
            uses.readers(k.out, i, j) + uses.writers(k.out, i, j)
        if any(x not in taken for x in between):
            continue
        outs.append(EpilogueOut(k.out, _AccOf(g.out).expr(k.body)))
        taken.add(j)
        for x in uses.readers(k.out, j, stop):
            if x not in seen:
                seen.add(x)
                heapq.heappush(todo, x)
    outs += _sharers(low, uses, i, g, edges, outs, taken)
    if not outs:
        return g
    for j in taken:
        uses.set(j, None)
    g = replace(g, epilogue=g.epilogue + tuple(outs))
    if not uses.readers(g.out, i):
        g = _product_into_output(low, g)
    return g


def _own_loads(e, edges: set[str]) -> set[str]:
    """The buffers `e` loads at the element's own index (every product edge, each its own variable)."""
    return {n.buf for n in walk(e) if isinstance(n, Load) and set(dict(n.index)) == edges
            and all(ix == Ix.var(edge) for edge, ix in n.index)}


def _sharers(low: Lowered, uses: Uses, i: int, g, edges: set[str], outs: list, taken: set[int]) -> list:
    """The epilogue outputs of the kernels after GEMM i that read neither the product nor
    an output joined before them, but whose every full-size load is a load the epilogue
    already makes at the element's own index (the recomputed GELU `(0.5 + 0.5 tanh) x`
    beside GELU's derivative, both of the saved pre-activation and tanh): joined, the
    epilogue writes their output from the values it has loaded, and the kernel's pass
    that read them again from memory goes. Loads of fewer edges (a bias) are allowed.
    They join in program order after the product's readers when no kernel between the
    GEMM and them writes what they read or reads or writes their output: each reads no
    output of the epilogue, and no output before it reads its own, so the order of the
    two sets is immaterial. `taken` gains them."""
    shared = set().union(*(_own_loads(o.expr, edges) for o in (*g.epilogue, *outs))) - {g.out}
    if not shared:
        return []
    made = {g.out, *(o.buf for o in g.epilogue), *(o.buf for o in outs)}
    todo = sorted({j for b in shared for j in uses.readers(b, i)} - taken)
    joined: list[EpilogueOut] = []
    for j in todo:
        k = uses.slots[j]
        if not _foldable(low, g, k, edges, list(made)) or k.out in made:
            continue
        loads = [n for n in walk(k.body) if isinstance(n, Load)]
        if any(n.buf in made for n in loads) or not any(n.buf in shared for n in loads):
            continue
        if any(set(dict(n.index)) == edges and n.buf not in shared for n in loads):
            continue   # a full-size read the epilogue does not already make
        if any(n.buf in shared and any(ix != Ix.var(edge) for edge, ix in n.index) for n in loads):
            continue
        if any(uses.writers(b, i, j) for b in k.buffers_read()) or uses.readers(k.out, i, j) or \
                uses.writers(k.out, i, j):
            continue   # moved to the GEMM, it would see other values or be seen
        joined.append(EpilogueOut(k.out, k.body))
        taken.add(j)
        made.add(k.out)
    return joined


def _product_into_output(low: Lowered, g: GemmKernel) -> GemmKernel:
    """`g` storing its product straight into one of its epilogue's outputs, when no
    kernel reads the product itself: the first output whose buffer is laid out as the
    product's (same order and type), a temporary (not an update's, which `plan` may
    write in place) or an output of the program, that no output up to it loads. The
    product's buffer goes; its elements live on as `acc` (the product is stored there,
    then overwritten by that output's value)."""
    prod = low.buffers[g.out]
    for j, o in enumerate(g.epilogue):
        b = low.buffers[o.buf]
        if b.order != prod.order or b.dtype != prod.dtype or not (b.kind == "out" or
                                                                 (b.kind == "temp" and b.prefer is None)):
            continue
        if any(isinstance(n, Load) and n.buf == o.buf for x in g.epilogue[: j + 1] for n in walk(x.expr)):
            continue
        del low.buffers[g.out]
        return replace(g, out=o.buf)
    return g


def _foldable(low: Lowered, g: GemmKernel, k, edges: set[str], earlier: list[str]) -> bool:
    if not isinstance(k, LoopKernel) or k.reduce or k.red or k.scatter or k.epilogue is not None or k.bounds:
        return False
    if k.note.startswith("update") or k.note == "copy" or k.out == g.out:
        return False
    if set(k.loops) != edges or any(k.sizes[v] != low.size(v) for v in k.loops):
        return False
    if set(low.buffers[k.out].edges) != edges or any(ix != Ix.var(e) for e, ix in k.index):
        return False
    own = {g.out, k.out, *earlier}
    for e in walk(k.body):
        if isinstance(e, (Mask, Rand)):
            return False
        if isinstance(e, Load):
            if e.buf in own and any(ix != Ix.var(edge) for edge, ix in e.index):
                return False
            if e.buf in own and set(dict(e.index)) != edges:
                return False
            if any(not (ix.as_var() in edges or not ix.terms) for _, ix in e.index):
                return False
    return True


class _AccOf(ExprVisitor):
    """An expression with each load of `buf` (at the element's own index) as `Acc`."""

    def __init__(self, buf: str) -> None:
        self.buf = buf

    def expr_load(self, e: Load):
        return Acc() if e.buf == self.buf else e

    def expr_add(self, e):
        return replace(e, args=tuple(self.expr(a) for a in e.args))

    expr_mul = expr_map = expr_add

    def expr_mask(self, e):
        return replace(e, arg=self.expr(e.arg))

    def expr_const(self, e):
        return e

    expr_size_of = expr_acc = expr_rand = expr_const

    def atom_var(self, a):   # indices are kept as they are
        return a

    atom_id_load = atom_floor_div = atom_var


def expand(low: Lowered, keep=None) -> Lowered:
    """`low` with every GEMM epilogue written out as the GEMM (storing its product) and
    then its loop kernels (each step's program too): for a backend that runs no epilogue
    in its store, or, with `keep(program, gemm)`, for those of the GEMMs it is false for.
    `low` itself when it has none."""
    if not any(isinstance(k, GemmKernel) and k.epilogue or isinstance(k, StepLoop) for k in low.kernels):
        return low
    out = low.staged(low.stage)
    kernels: list = []
    for k in low.kernels:
        if isinstance(k, GemmKernel) and k.epilogue and not (keep is not None and keep(low, k)):
            if any(o.buf == k.out for o in k.epilogue):   # the product into a temporary of its own again
                tmp = out.fresh("t")
                b = out.buffers[k.out]
                out.buffers[tmp] = Buffer(tmp, b.dtype, b.edges, "temp", order=b.order)
                kernels += [replace(k, out=tmp, epilogue=())] + epilogue_loops(out, k, tmp)
                continue
            kernels += [replace(k, epilogue=())] + epilogue_loops(low, k)
        elif isinstance(k, StepLoop):
            kernels.append(replace(k, step=expand(k.step, keep)))
        else:
            kernels.append(k)
    out.kernels = kernels
    return out
