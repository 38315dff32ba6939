"""Postfix edge operations `x[...]`: renames, reindexes and gathers, applied together.

Renames in one bracket happen simultaneously (`x[i -> j, j -> i]` swaps). A reindex
`x[t = rhs]` is the contraction of `x` with the indicator `[t = rhs]`, which
replaces edge `t` by the edges of `rhs`; a gather `E[v = ids]` indexes edge `v`
by the integer tensor `ids`.
"""
from __future__ import annotations

from tgc.frontend import ast
from tgc.frontend.expressions import Ctx, Elaborator
from tgc.ir import values as V
from tgc.ir.affine import Affine, Relation
from tgc.ir.diag import did_you_mean


def apply_edge_ops(el: Elaborator, node: ast.EdgeOps, ctx: Ctx) -> V.Value:
    x = el.fexpr(node.x, ctx)
    renames = [i for i in node.items if isinstance(i, ast.Rename)]
    mapping = _rename_map(el, x, renames, ctx)
    reindexes = [i for i in node.items if isinstance(i, ast.Reindex)]
    for item in reindexes:
        if el.edge(item.edge, item, ctx) in mapping:
            raise el.error(f"edge '{item.edge}' is both renamed and indexed in one bracket "
                           f"(write the two one after the other: x[...][...])", item, ctx)
    # together: where a rename takes the name of an edge that a reindex replaces
    # (`A[i -> j, j = s + k]`), the reindexes of x's own edges read x before the renames
    replaced = {el.edge(i.edge, i, ctx) for i in reindexes} & set(x.edges)
    own = [i for i in reindexes if el.edge(i.edge, i, ctx) in replaced] if replaced & set(mapping.values()) else []
    for item in own:
        x = _reindex(el, x, item, {}, ctx)
    if mapping:
        _check_rename_targets(el, x, mapping, renames, ctx)
        x = V.rename(x, mapping, loc=node.loc)
    for item in reindexes:
        if item not in own:
            x = _reindex(el, x, item, mapping, ctx)
    return x


def _rename_map(el: Elaborator, x: V.Value, items: list[ast.Rename], ctx: Ctx) -> dict[str, str]:
    mapping: dict[str, str] = {}
    for item in items:
        dst_node = _DstNode(item.dst_loc or item.loc)
        src = el.edge(item.src, item, ctx)
        if (ctx.edges.get(item.dst, item.dst) not in el.m.edges and item.dst not in ctx.values
                and el.scope.kinds.get(item.dst) is None):
            size = el.m.edges[src] if el.m.edges[src] in el.m.dims else el.size_text(src)
            raise el.error(f"unknown edge '{item.dst}': a rename's target is an edge declared before it, as "
                           f"`dim {item.dst} = {size}` or `{item.dst}: DIM` in a tensor's declaration"
                           + did_you_mean(item.dst, [*el.m.edges, *ctx.edges]), dst_node, ctx)
        dst = el.edge(item.dst, dst_node, ctx)
        if src not in x.edges:
            raise el.error(f"cannot rename edge '{item.src}': the tensor has edges [{', '.join(x.edges)}]", item, ctx)
        if src in mapping:
            raise el.error(f"edge '{item.src}' is renamed twice", item, ctx)
        if el.m.size(src) != el.m.size(dst):
            raise el.error(f"cannot rename '{item.src}' to '{item.dst}': their sizes differ "
                           f"({el.size_text(src)} and {el.size_text(dst)})", item, ctx)
        mapping[src] = dst
    return mapping


def _check_rename_targets(el: Elaborator, x: V.Value, mapping: dict[str, str], items: list[ast.Rename],
                          ctx: Ctx) -> None:
    """A rename onto an edge that `x` keeps is an error (`x`: after the bracket's reindexes)."""
    result = [mapping.get(e, e) for e in x.edges]
    for item in reversed(items):
        dst = mapping[el.edge(item.src, item, ctx)]
        if result.count(dst) > 1:
            raise el.error(f"cannot rename onto edge '{item.dst}': the tensor already has it",
                           _DstNode(item.dst_loc or item.loc), ctx)


class _DstNode:
    """Stands for the destination edge of a rename in diagnostics."""

    def __init__(self, loc):
        self.loc = loc


def _reindex(el: Elaborator, x: V.Value, item: ast.Reindex, mapping: dict[str, str], ctx: Ctx) -> V.Value:
    target = el.edge(item.edge, item, ctx)
    target = mapping.get(target, target)
    if target not in x.edges:
        raise el.error(f"cannot index edge '{item.edge}': the tensor has edges [{', '.join(x.edges)}]", item, ctx)
    rhs = item.rhs
    if isinstance(rhs, ast.Name) and (rhs.id in ctx.values or el.scope.kinds.get(rhs.id) == "tensor"):
        ids = el.expr(rhs, ctx)
        if ids.dtype != "i32":
            raise el.error(f"gather indices must be an i32 tensor; '{rhs.id}' is a float tensor "
                           f"(declare it `input {rhs.id}: i32[...]`)", rhs, ctx)
        return el.build(item, ctx, V.gather, x, ids, target)
    affine = ast.to_affine(rhs)
    aff = el.affine(affine, ctx)
    for term in affine.terms:
        edge = term.edge and el.edge(term.edge, term, ctx)
        if edge and edge != target and edge in x.edges:
            raise el.error(f"the reindex introduces edge '{term.edge}', which the tensor already has "
                           f"(rename it first)", term, ctx)
    if target in aff.edges():
        fresh = el.m.fresh_edge(target, el.m.edges[target])
        x = V.rename(x, {target: fresh}, loc=item.loc)
        target = fresh
    rel = Relation((Affine.make([(target, 1)]), aff), ("=",))
    keep = [e for e in x.edges if e != target] + list(aff.edges())
    ind = V.indicator(rel, "f32" if x.dtype == "f32" else el.dtype, loc=item.loc)   # keeps an f32 x f32
    out = V.contract([x, ind], keep, loc=item.loc)
    return el.spread(out, el.named_edges([affine], ctx), item.loc)
