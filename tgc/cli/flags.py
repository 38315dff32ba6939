"""Command-line flags that several `tgc` commands share."""
from __future__ import annotations

import click

FP_STRICT = click.option(
    "--fp-strict", "fp_strict", is_flag=True,
    help="No algebra, reassociation or FMA: every op as the source orders it (the default pipeline "
         "becomes normalize,adjoint,tangent,normalize; an f32 program run by tgc gives the interpreter's bits).")

AUTOCAST = click.option(
    "--autocast", type=click.Choice(["bf16", "f16"]), default=None,
    help="Mixed precision: matrix products on bf16/f16 operands with f32 accumulation; reductions, "
         "softmax, layernorm and losses stay f32 (docs/dtypes.md).")
