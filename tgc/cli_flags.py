"""Command-line flags that several `tgc` commands share."""
from __future__ import annotations

import click

FP_STRICT = click.option(
    "--fp-strict", "fp_strict", is_flag=True,
    help="No algebra, reassociation or FMA: every op as the source orders it (the default pipeline "
         "becomes normalize,adjoint,tangent,normalize; an f32 program run by tgc gives the interpreter's bits).")
