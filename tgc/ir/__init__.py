"""The tensor IR: every op and elementwise function defined once (ops.py), types, values,
modules, text form, verifier and interpreter.

Stage: the first (ir < frontend < opt < autodiff < lower < manager/registry < backends <
runtime < pipeline < cli); every later stage builds on it. It imports only the leaves
`tgc.options` and `tgc.fsutil`. Precision emulation (`lowp`, `emulate`), random
draws' definition (`philox`) and what a pass is (`passes`) live here because every
later stage needs them.
"""
