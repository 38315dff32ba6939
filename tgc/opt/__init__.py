"""The optimizer: IR-to-IR rewriting passes over the value DAG (canonical form,
exact algebra, stable forms, contraction order, precision) and their helpers.

Stage: after `tgc.frontend`, before `tgc.autodiff`; imports `tgc.ir` and `tgc.options`
only. Each pass module's docstring states what it rewrites, why it is exact in
floating point (docs/optimization.md) and why it terminates.
"""
