"""A value seen through renames and identities, as the lowering reads it: `stop(x)`,
`checkpoint(x)` and `recompute(x)` are `x` itself (a view of x's buffer, no copy;
the identity maps of tgc.ir.ops, `IDENTITY_FNS`), a rename is x with its edges
relabelled. Used by `fuse` and its GEMM matchers (`taps`)."""
from __future__ import annotations

from tgc.ir.ops import IDENTITY_FNS
from tgc.ir.values import Value


def is_identity(v: Value) -> bool:
    """`stop(x)`, `checkpoint(x)`, `recompute(x)`: x itself, as far as lowering goes."""
    return v.op == "stop" or (v.op == "map" and v.attrs[0] in IDENTITY_FNS)


def peel(v: Value, stored=None) -> tuple[Value, dict[str, str]]:
    """Strip renames and identities (stop, recompute): (base value, view edge -> base edge).
    With `stored` (a set of value ids), stop at the first value of the chain in it (a
    rename that has a buffer of its own is read there)."""
    mapping = {e: e for e in v.edges}
    while (v.op == "rename" or is_identity(v)) and (stored is None or id(v) not in stored):
        if v.op == "rename":
            back = {d: s for s, d in v.attrs[0]}
            mapping = {view: back.get(e, e) for view, e in mapping.items()}
        v = v.operands[0]
    return v, mapping
