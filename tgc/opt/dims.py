"""fix_dims: symbolic dims given fixed sizes (`tgc.compile(dims=)`, `tgc build -D`).

A program whose dim `n` is symbolic binds it at each call from the inputs' shapes;
fixed at build time, the code specializes to it (loop bounds, tiles, unrolling). The
pass writes the given sizes into the module's dim table, and every derived dim those
sizes determine (`dim m = 2 * n`) too. Nothing else changes: the values are the same
functions of the arguments, at sizes a call would have bound anyway. A size that is
not positive, a derived dim that does not come out a whole positive number, or a dim
named with another size than its fixed or derived one is an error (ValueError, which
the command line reports against -D).

Terminates: one pass over the given dims, one over the dim table.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from tgc.ir.module import Module, size_error
from tgc.ir.passes import Pass
from tgc.ir.sizes import MAX_SIZE, size_str
from tgc.options import Options


@dataclass(frozen=True)
class FixDims(Pass[Module, Module]):
    """Symbolic dims given fixed sizes (sizes='n=4 m=3')."""

    name = "fix_dims"
    sizes: str = ""   # NAME=SIZE pairs, separated by spaces

    @classmethod
    def of(cls, dims: dict[str, int]) -> "FixDims":
        """The pass that fixes `dims` ({name: size}); ValueError for a size that is not
        a positive integer (a caller's `dims=`: its text would not say so)."""
        for d, n in dims.items():
            spaced = any(c.isspace() or c == "=" for c in str(d))   # no dim's name: its text would not read back
            why = f"the program has no dim '{d}'" if spaced else size_error(d, n)
            if why:
                raise ValueError(why)
        return cls(" ".join(f"{d}={int(n)}" for d, n in dims.items()))

    def dims(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for item in self.sizes.split():
            name, eq, n = item.partition("=")
            if not (eq and name and re.fullmatch(r"-?[0-9]+", n, re.ASCII)):
                raise ValueError(f"fix_dims: '{item}' is not NAME=SIZE")
            out[name] = int(n)
        return out

    def options_error(self, module: Module) -> str | None:
        """`sizes` not NAME=SIZE pairs, or sizes that do not fit `module` (what `run` refuses)."""
        try:
            fix_dims(module, self.dims())
        except ValueError as e:
            return str(e).removeprefix("fix_dims: ")   # the manager names the pass
        return None

    def run(self, module: Module, options: Options) -> Module:
        return fix_dims(module, self.dims())


def fix_dims(module: Module, dims: dict[str, int]) -> Module:
    """A copy of `module` with the symbolic dims named in `dims` given fixed sizes."""
    for d, n in dims.items():   # a fixed or derived dim may be named with its own size (checked below)
        why = module.dim_error(d, n, bind=False)
        if why:
            raise ValueError(why)
    given = {d: int(n) for d, n in dims.items() if module.dims[d] is None}
    new = dict(module.dims)
    new.update(given)
    from tgc.ir.sizes import SizeError, UnboundDim, size_eval_checked

    env = {d: n for d, n in new.items() if isinstance(n, int)}
    for d, s in new.items():   # a derived dim these sizes fix is fixed too (and must fit)
        if s is not None and not isinstance(s, int):
            try:
                env[d] = size_eval_checked(s, env, f"dim '{d}'")
            except UnboundDim:
                continue
            except SizeError as e:
                raise ValueError(str(e)) from None
            if not 0 < env[d] <= MAX_SIZE:
                raise ValueError(f"dim '{d}' is {env[d]}: a size is a positive integer (at most 2^62)")
            new[d] = env[d]
    for d, n in dims.items():   # a fixed or derived dim may be named with the size it has
        if d not in given and env.get(d) != n:
            have = f"is {env[d]}" if d in env else f"is derived from other dims ({size_str(module.dims[d])})"
            raise ValueError(f"dim '{d}' {have}, not {n}")
    return Module(new, dict(module.edges), dict(module.args), list(module.outputs), list(module.updates),
                  list(module.facts))
