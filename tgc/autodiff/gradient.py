"""gradient_module: a program's derivative as a program (`tgc grad`).

The result's outputs are d(of)/d(x) for each x in `wrt`, each named dNAME (fresh
when taken; a for block's state `m.w` gives `dm_w`, a name a .tg output can have) with x's edges, plus the output's for a Jacobian; its arguments are the
program's. Reverse mode writes `grad(of, x)`; forward mode seeds `jvp` with an
identity over fresh copies of x's edges, then renames them back. The derivatives
are left to the `adjoint` and `tangent` passes that follow in the pipeline, so this
pass only builds values: exact (nothing is computed), and it terminates (one output
per name in `wrt`). A missing or ambiguous output, an argument that is not a float
one, or one sharing an edge with the output is a CompileError naming the flag.
"""
from __future__ import annotations

from dataclasses import dataclass

from tgc.ir.diag import CompileError, did_you_mean
from tgc.ir.module import Module
from tgc.ir.passes import Pass
from tgc.options import Options


@dataclass(frozen=True)
class GradientModule(Pass[Module, Module]):
    """The derivatives d(of)/d(x), x in wrt, as the program's outputs (still underived)."""

    name = "gradient_module"
    wrt: str = ""              # the arguments, separated by spaces
    of: str | None = None      # the output (default: the only scalar one)
    mode: str = "rev"          # rev (grad) or fwd (jvp)

    def options_error(self, module: Module) -> str | None:
        return None if self.mode in ("rev", "fwd") else f"mode is 'rev' or 'fwd', not '{self.mode}'"

    def run(self, module: Module, options: Options) -> Module:
        why = self.options_error(module)
        if why:
            raise ValueError(f"gradient_module: {why}")
        return gradient_module(module, self.wrt.split(), self.of, self.mode)


def gradient_module(module: Module, wrt: list[str], of: str | None, mode: str) -> Module:
    """A module whose outputs are d(of)/d(x) for each x in `wrt` (still underived).

    `of` defaults to the only scalar output. Reverse mode uses `grad`; forward mode
    seeds `jvp` with an identity over fresh copies of x's edges, then renames back.
    """
    from tgc.ir import values as V
    from tgc.ir.affine import Affine, Relation
    from tgc.ir.complex_io import RI
    from tgc.ir.module import Output

    scalars = [o.name for o in module.outputs if not o.value.edges]
    outputs = {o.name: o for o in module.outputs}
    if of is None:
        if len(scalars) != 1:
            raise CompileError(f"--of is needed: the program has {len(scalars)} scalar outputs"
                               + (f" ({', '.join(scalars)})" if scalars else ""))
        of = scalars[0]
    if of not in outputs:
        raise CompileError(f"--of {of}: no such output (outputs: {', '.join(outputs) or 'none'})"
                           + did_you_mean(of, outputs))
    f = outputs[of].value
    if RI in f.edges:
        raise CompileError(f"--of {of}: the output is complex; its derivative needs an explicit cotangent v: "
                           f"write vjp({of}, x, v) in the program")
    m = Module(dict(module.dims), dict(module.edges), dict(module.args))
    for name in wrt:
        arg = module.args.get(name)
        if arg is None or arg.dtype == "i32":
            raise CompileError(f"--wrt {name}: not a float input, param or state of the program" + did_you_mean(
                name, [a.name for a in module.args.values() if a.dtype != "i32"]))
        x = V.arg(name, arg.dtype, arg.order)
        if set(f.edges) & set(x.edges):
            raise CompileError(f"--of {of} and --wrt {name} share an edge; rename one of them first")
        if mode == "rev":
            value = V.grad(f, x)
        else:
            copies = {e: m.fresh_edge(e, m.edges[e]) for e in x.edges}
            seed = V.mul([V.indicator(Relation((Affine.make([(e, 1)]), Affine.make([(c, 1)])), ("=",)), f.dtype)
                          for e, c in copies.items()]) if copies else V.const(1.0, f.dtype)
            value = V.rename(V.jvp(f, x, seed), {c: e for e, c in copies.items()})
        m.outputs.append(Output(_fresh_output(m, "d" + name.replace(".", "_")), value, tuple(module.order_edges(f.edges)) + arg.order))
    return m


def _fresh_output(m: Module, base: str) -> str:
    taken = set(m.args) | set(m.edges) | {o.name for o in m.outputs}
    name, n = base, 1
    while name in taken:
        name, n = f"{base}_{n}", n + 1
    return name
