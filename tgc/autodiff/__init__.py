"""Symbolic derivatives at compile time: the leaf primitives' rules (`rules`), reverse
mode (`reverse`, the `adjoint` pass), forward mode (`forward`, the `tangent` pass) and
rematerialization of `checkpoint` values (`remat`).

Stage: after `tgc.opt` (it builds with `tgc.opt.canon`), before `tgc.lower`.
"""
