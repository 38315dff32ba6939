"""GEMMs on shifted views (convolution taps): how `fuse` lowers a contraction whose
two factors are read through indicators as `edge + shift(short edges)` (a
convolution, its input and kernel gradients) to one `GemmKernel` with `taps` and
`shifts` (tgc.lower.lowered): a loop over the short edges (the taps) of GEMM calls
on shifted views, each shifted edge's range clipped to the input, so no im2col copy
is written.

What is found (`TapGemms.find`, on the fuser's values before it partitions them):

- the product is expanded (`expand`) through renames, identities and single-use
  inner contractions, which are folded into it (`sum_k [t = s + k] (dy @ W)`: the
  folded reductions get no kernel of their own), down to exactly two leaf factors
  and at least one indicator link;
- the links are solved for the longest summed edges first, so the edges that stay
  loops (the taps) are the short ones, with fixed sizes as with symbolic ones;
- each leaf's index is then one edge plus a shift in the taps (coefficient 1 on the
  edge): the edges split into batch / M / N / K groups as for a plain GEMM, with
  the taps outside them. A clipped edge may share its group with others (`(h, w)`
  of a 2-D image shifted along `h`): `layout` keeps the group where the clipped
  edge is outermost in every buffer, so its range is one run of the merged group,
  and splits it into loops of calls otherwise. Two clipped edges in one group (a
  2-D window on both image edges) are no strided matrix: no match, and the window
  is a loop kernel's output (im2col) and the product a plain GEMM;
- the only conditions left are the shifted reads' bounds (the clipping), and the
  product has at least `options.cpu.blas_min_flops` flops when its sizes are known.
- A shift that only splits an edge (`c2 = hd + 16*head`, every index in bounds:
  `exact_split`) is left to a copy into the split edges and one plain GEMM.

Exact: the kernel is the same sum of the same products (each call adds the terms
of one tap; the clipped ranges drop only terms the indicators zero); the order of
the additions is the GEMM's, as for any GEMM cell. Terminates: one visit per
contraction, each expansion a walk down a finite DAG that stops at a summed edge
seen twice.

This is a part of the fuse stage, not a stage of its own: which contractions are
GEMMs on shifted views decides which values get buffers (the leaves do, the folded
reductions do not), so it runs inside the fuser's partition, before it.
"""
from __future__ import annotations

from tgc.ir.values import Value
from tgc.lower.indexing import edge_size, relation_conds, simplify_conds, solve_conds
from tgc.lower.lowered import Cond, GemmKernel, Ix, View, neg
from tgc.lower.views import is_identity


class TapGemms:
    """The GEMMs on shifted views of a module being fused: found before the partition
    (`find`: the fuser's `shifted` and `folded`), then their kernels (`kernel`)."""

    def __init__(self, fuser):   # the `tgc.lower.fuse` fuser lowering the module
        self.f = fuser
        self.m, self.opt = fuser.m, fuser.opt

    def find(self) -> None:
        """Contractions that are a loop of GEMMs on shifted views: a convolution
        `sum_{c,k} x[b, c, t = s + k - 2] * W[o, c, k]` is, for each tap k, a GEMM
        (o <- c) on x shifted by k - 2 with the range of s clipped to the input."""
        f = self.f
        for v in reversed(f.values):
            if v.op == "contract" and id(v) not in f.folded and f.is_reduction(v):
                spec = self.tap_gemm(v)
                if spec is not None:
                    f.shifted[id(v)] = spec
                    f.folded |= spec["folded"]

    def kernel(self, v: Value, out: str) -> GemmKernel:
        """The GEMM kernel computing `v` (found by `find`) into buffer `out`."""
        spec = self.f.shifted[id(v)]
        a, b = (View(self.f.mat[id(leaf)], edges) for leaf, edges in zip(spec["leaves"], spec["views"]))
        return GemmKernel(out, a, b, *spec["groups"], taps=spec["taps"], shifts=spec["shifts"],
                          note="GEMMs on shifted views")

    def expand(self, v: Value, env: dict[str, Ix], acc: dict, top: bool = False) -> bool:
        """Collect the leaf factors of a product of index transforms and single-use
        reductions (summed edges become placeholders, indicators links). A product
        with several users that is not cheap to recompute is a leaf: `partition`
        gives it a buffer anyway (a max-pool's gradient, scattered back to the
        pixels, feeds both of a convolution's gradients)."""
        if not top and (id(v) in self.f.mat or (v.op not in ("contract", "rename") and not is_identity(v))
                        or (v.op == "contract" and self.f.uses(v) > 1 and not self.f.recompute(v))):
            acc["leaves"].append((v, env))
            return True
        if is_identity(v):
            return self.expand(v.operands[0], env, acc)
        if v.op == "rename":
            fwd = dict(v.attrs[0])
            x = v.operands[0]
            return self.expand(x, {e: env[fwd.get(e, e)] for e in x.edges}, acc)
        if not top and self.f.is_reduction(v):
            if self.f.uses(v) != 1 or self.f.root_uses[id(v)] or id(v) in self.f.folded:
                acc["leaves"].append((v, env))
                return True
            acc["folded"].add(id(v))
        full = dict(env)
        for e in self.f.summed(v):
            if e in acc["sizes"]:
                return False
            acc["sizes"][e] = edge_size(self.m, e)
            acc["places"].append(e)
            full[e] = Ix.var(e)
        for o in v.operands:
            if o.op == "indicator":
                acc["links"] += relation_conds(self.m, o.attrs[0], full)
            elif not self.expand(o, {e: full[e] for e in o.edges}, acc):
                return False
        return True

    def tap_gemm(self, v: Value) -> dict | None:
        sizes = {e: edge_size(self.m, e) for e in v.edges}
        acc = {"leaves": [], "links": [], "places": [], "sizes": sizes, "folded": set()}
        if not self.expand(v, {e: Ix.var(e) for e in v.edges}, acc, top=True):
            return None
        leaves = acc["leaves"]
        if len(leaves) != 2 or not acc["links"]:
            return None
        for leaf, _ in leaves:
            if leaf.dtype == "i32" or leaf.op in ("const", "size", "indicator") or self.f.broadcast_edges(leaf):
                return None
        # eliminate long edges first: the short ones (taps) stay loops
        places = self.f.long_first(acc["places"])
        sol = solve_conds(acc["links"], places, sizes)
        idx = [{e: env[e].subst(sol.sol) for e in leaf.edges} for leaf, env in leaves]
        kept, summed = list(v.edges), list(sol.remaining)

        def big(u):
            return sizes[u] if isinstance(sizes[u], int) else 1 << 40

        outer: set[str] = set()
        for d in idx:
            for ix in d.values():
                if any(not isinstance(a, str) or not isinstance(c, int) for a, c in ix.terms):
                    return None
                if len(ix.terms) >= 2:
                    mains = [a for a, c in ix.terms if c == 1]
                    if not mains:
                        return None
                    outer |= {a for a, _ in ix.terms} - {max(mains, key=big)}
        views: list[dict[str, str]] = []
        shifts, clipped = [], set()
        for role, (leaf, _), d in zip("ab", leaves, idx):
            edges: dict[str, str] = {}
            for e, ix in d.items():
                inner = [(a, c) for a, c in ix.terms if a not in outer]
                if len(inner) > 1 or (inner and inner[0][1] != 1):
                    return None
                u = inner[0][0] if inner else ix.as_var()
                if u is None or u in edges:
                    return None
                rest = Ix(tuple(t for t in ix.terms if t[0] != u), ix.const)
                if rest != Ix():
                    shifts.append((role, u, rest))
                    clipped.add(u)
                elif inner and edge_size(self.m, e) != sizes[u]:
                    return None
                edges[u] = e
            views.append(edges)
        if not shifts or all(self.exact_split(views["ab".index(r)][u], u, rest, sizes) for r, u, rest in shifts):
            return None
        A, B = set(views[0]), set(views[1])
        if any(u not in A | B | outer for u in kept) or any(u not in outer and not (u in A and u in B) for u in summed):
            return None
        order = self.m.order_edges
        batch = {u for u in kept if u in outer or (u in A and u in B)}
        groups = [[u for u in kept if u not in batch and u in A], [u for u in kept if u not in batch and u in B],
                  [u for u in summed if u not in outer]]
        taps = {u for u in summed if u in outer}
        if any(len(clipped & set(g)) > 1 for g in groups):
            return None   # two clipped edges in one group: no strided matrix (a 2-D window)
        if clipped & (batch | taps) or not all(groups):
            return None
        expected = set()
        for (role, u, rest) in shifts:
            leaf_edges = views["ab".index(role)]
            ix = Ix.var(u).plus(rest)
            size = edge_size(self.m, leaf_edges[u])
            expected |= {Cond(ix, ">="), Cond(ix.plus_const(neg(size)), "<")}
        conds = simplify_conds(sol.conds, sizes)
        if conds is None or any(c not in expected for c in conds):
            return None
        flops = 2
        for s in (sizes[u] for g in groups for u in g):
            flops = flops * s if isinstance(s, int) and isinstance(flops, int) else None
        if flops is not None and flops < self.opt.cpu.blas_min_flops:
            return None
        key = order
        return {"leaves": [leaf for leaf, _ in leaves], "folded": acc["folded"],
                "views": [tuple(sorted(d.items())) for d in views],
                "groups": (key(batch), key(groups[0]), key(groups[1]), key(groups[2])),
                "taps": key(taps), "shifts": tuple(shifts)}

    def exact_split(self, e: str, u: str, rest: Ix, sizes: dict) -> bool:
        """Whether reading buffer edge `e` at `u + rest` only splits `e` in two, as
        `c2 = hd + 16*head` splits 48 channels into 3 heads of 16: every index is in
        bounds, so the operand is better copied into the split edges once (a loop
        kernel) and the product is one plain GEMM, than run as a loop of GEMMs over
        `head` (GPT's 12 head projections: 23-35 us each as 3 calls of 704 x 16 x 48,
        14-19 us as one 704 x 48 x 48 product after a copy of 2304 weights)."""
        if rest.const != 0 or len(rest.terms) != 1:
            return False
        (h, coef), = rest.terms
        nu, nh, ne = sizes.get(u), sizes.get(h), edge_size(self.m, e)
        return all(isinstance(x, int) for x in (nu, nh, ne, coef)) and coef == nu and ne == nu * nh
