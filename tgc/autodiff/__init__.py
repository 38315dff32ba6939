"""Symbolic derivatives at compile time: the leaf primitives' rules (`rules`), reverse
mode (`reverse`), forward mode (`forward`), the driver both share with the passes
`adjoint` and `tangent` (`driver`), and rematerialization of `checkpoint` values (`remat`).

Stage: after `tgc.opt` (it builds with `tgc.opt.canon`), before `tgc.lower`.
"""
