"""Command-line flags that several `tgc` commands share."""
from __future__ import annotations

import click

FP_STRICT = click.option(
    "--fp-strict", "fp_strict", is_flag=True,
    help="No algebra, reassociation or FMA: every op as the source orders it (the strict pipeline, "
         "`tgc passes`). An f32 program runs as its f64 emulation, run or built, and gives the interpreter's "
         "bits; a library built so takes and returns double arrays (its header says so).")

AUTOCAST = click.option(
    "--autocast", type=click.Choice(["bf16", "f16"]), default=None,
    help="Mixed precision: matrix products on bf16/f16 operands with f32 accumulation; reductions, "
         "softmax, layernorm and losses stay f32 (docs/dtypes.md).")


def _dim_bindings(ctx, param, value) -> dict[str, int]:
    """NAME=N items as {name: size}; a usage error for anything else, and for one name
    given two different sizes (the same size repeated is accepted). A size is ASCII
    digits (`str.isdigit` also holds for superscripts and other scripts' digits)."""
    import re

    from tgc.ir.sizes import MAX_SIZE

    out = {}
    for item in value:
        name, sep, n = item.partition("=")
        if not sep or not name.strip() or not re.fullmatch(r"\s*-?[0-9]+\s*", n, re.ASCII):
            raise click.BadParameter(f"'{item}' is not NAME=N")
        if int(n) <= 0:
            raise click.BadParameter(f"'{item}': a size must be positive")
        if int(n) > MAX_SIZE:
            raise click.BadParameter(f"'{item}': a size must be at most 2^62 (index arithmetic is int64)")
        if out.get(name.strip(), int(n)) != int(n):
            raise click.BadParameter(f"'{name.strip()}' is given twice, as {out[name.strip()]} and as {int(n)}")
        out[name.strip()] = int(n)
    return out


DIM_FLAGS = "-D/--dim"   # how errors name the option


def dims_option(help: str, name: str = "dims"):
    """The option that sizes symbolic dims, the same in every command that takes one:
    `-D NAME=N` (as `tgc build`, after gcc's -D) or `--dim NAME=N`, repeatable; the
    command gets {name: size} as `name`."""
    return click.option("-D", "--dim", name, multiple=True, callback=_dim_bindings, metavar="NAME=N",
                        help=help + " (repeatable; -D NAME=N or --dim NAME=N).")


class _Bytes(click.ParamType):
    """A byte count: 6700000, 6.7M (10^6), 6.4Mi or 6.4MiB (2^20); k/K, M, G, with i for powers of two."""

    name = "BYTES"
    SCALE = {"": 1, "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30}

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        import re

        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([kKmMgG]i?)?[bB]?\s*", str(value))
        if not m:
            self.fail(f"'{value}' is not a byte count (e.g. 6700000, 6.7M, 6.4MiB)", param, ctx)
        n = int(float(m.group(1)) * self.SCALE[(m.group(2) or "").lower()])
        if n <= 0:
            self.fail("a byte count is a positive number of bytes", param, ctx)
        return n


MEMORY_BUDGET = click.option(
    "--memory-budget", "memory_budget", type=_Bytes(), default=None, metavar="BYTES",
    help="Recompute saved values in the backward pass (and order the updates) so that the workspace fits "
         "BYTES (6700000, 6.7M, 6.4MiB), at the dims given (others at 64); prints what it chose to stderr, "
         "and a warning with the best reached when it cannot fit.")


BYTES = _Bytes()


def report_memory(plan) -> None:
    """The planner's choice on stderr: a note, or a warning when the budget is not met."""
    if plan is None:
        return
    click.echo(f"{'note' if plan.met else 'warning'}: {plan.summary()}", err=True)
    for line in plan.lines():
        click.echo(line, err=True)


class LoweringBackends(click.Choice):
    """Every backend's name (`tgc.backends.base.backend_names`), then `extra` names,
    listed when asked for (so a backend folder found after the command line was
    imported is a choice too)."""

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        super().__init__([])
        self.extra = extra

    @property
    def choices(self):
        from tgc.backends.base import backend_names

        return (*backend_names(), *self.extra)

    @choices.setter
    def choices(self, value) -> None:
        pass


BACKEND = click.option("--backend", type=LoweringBackends(), default="cpu", show_default=True,
                       help="Whose lowering stages run after the IR passes: the neutral fuse, layout and "
                            "plan, with the backend's own between them (the CPU's group; `tgc passes`).")
