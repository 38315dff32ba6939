"""without_rules: custom derivative rules expanded, once no derivative is left to read them.

A function with its own derivative (`def f(x) ... with vjp/jvp`) is a `custom` value in
the IR: its body, with the rules the derivative passes (`adjoint`, `tangent`) use in
place of differentiating the body. Once no `grad`, `jvp` or `vjp` is left, the rules
are dead; the lowering and the backends see only the body. The default pipeline's
`normalize` and `simplify` expand them already; a pass list without them
(`-p adjoint,fuse,...`) may leave them, so this pass runs before every lowering
(`tgc.registry.PREPARE`, whatever the stage list).

Exact: a call's value is its body's value (`tgc.ir.values.strip_custom`); a module
that still has a derivative, or no custom call, is returned as it is. Terminates: one
visit per value (`tgc.opt.rewrite.without_rules`).
"""
from __future__ import annotations

from dataclasses import dataclass

from tgc.ir.module import Module
from tgc.ir.passes import Pass
from tgc.opt.rewrite import without_rules
from tgc.options import Options


@dataclass(frozen=True)
class WithoutRules(Pass[Module, Module]):
    """Custom derivative calls replaced by their bodies, once no derivative is left."""

    name = "without_rules"

    def run(self, module: Module, options: Options) -> Module:
        return without_rules(module)
