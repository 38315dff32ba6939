"""Symbolic derivatives at compile time: the leaf primitives' rules (`rules`), reverse
mode (`reverse`), forward mode (`forward`), the driver both share with the passes
`adjoint` and `tangent` (`driver`), and rematerialization of `checkpoint` values (`remat`).

Stage: after `tgc.opt`, before `tgc.lower`; imports `tgc.ir` and `tgc.options` only (a
derivative is built from IR values; the optimizer runs on it afterwards, as a pass).
"""
