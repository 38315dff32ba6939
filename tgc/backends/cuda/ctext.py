"""C text pieces both CUDA kernel generators (`codegen`'s loop kernels, `rowgen`'s
row groups) use: the expression context (`Ctx`), a flat index split into loop
variables (`decompose`, `split_flat`), and a loop kernel's loads (`loads_of`)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from tgc.lower.lowered import Load, LoopKernel, walk


def decompose(loops: list[tuple[str, str, str]], stmts: list[str], narrow: bool = False) -> list[str]:
    """Statements splitting the flat index `q` into loop variables (name, offset
    prefix, extent), innermost last, declaring only the variables `stmts` use;
    `narrow`: in 32-bit arithmetic (`q` and every extent below 2^31)."""
    text = "\n".join(stmts)
    used = [bool(re.search(rf"\b{name}\b", text)) for name, _, _ in loops]
    if not any(used):
        return []
    out = ["int rq = q;" if narrow else "long long rq = q;"]
    for j in reversed(range(len(loops))):
        name, lo, n = loops[j]
        n = f"(int)({n})" if narrow else n
        line = f"const long long {name} = {lo}rq{f' % {n}' if j else ''};" if used[j] else ""
        if any(used[:j]):
            line += f" rq /= {n};"
        if line:
            out.append(line.strip())
    return out


def split_flat(r: str, flat: str, loops: list[tuple[str, str, str]], decl: str = "const long long ") -> list[str]:
    """Statements splitting the flat index `flat` (less than the product of the
    extents) into loop variables (name, offset prefix, extent), outermost first,
    through the variable `r`: the outermost is what remains, with no remainder.
    `decl` declares each name ('' assigns existing ones)."""
    out = [f"long long {r} = {flat};"]
    for j in reversed(range(len(loops))):
        name, lo, n = loops[j]
        out.append(f"{decl}{name} = {lo}{r}{f' % {n}; {r} /= {n};' if j else ';'}")
    return out


def loads_of(k: LoopKernel):
    """Every `Load` of a loop kernel's body and epilogue."""
    for root in [k.body] + ([k.epilogue] if k.epilogue is not None else []):
        for n in walk(root):
            if isinstance(n, Load):
                yield n


@dataclass
class Ctx:
    """Where an expression is generated: the C names of the buffers' pointers and
    the loop variables, and what a row group or a vector loop holds in registers."""

    ptrs: dict[str, str]
    var: dict[str, str] = field(default_factory=dict)
    acc: str | None = None
    vals: dict[str, str] = field(default_factory=dict)    # buffer -> the C value holding it at this row (row groups)
    cache: dict[str, str] = field(default_factory=dict)   # buffer -> the register array holding this thread's elements
    loaded: set = field(default_factory=set)              # buffers read from memory (row groups: barriers)
    vec: dict = field(default_factory=dict)               # Load -> the float4 holding it (vector_loop)
    comp: str = ""                                        # the float4 component this expression computes

    def ptr(self, buf: str) -> str:
        return self.ptrs[buf]
