"""Lowering: the optimized IR to the lowered program of kernels and buffers that every
backend compiles (`lowered`), in stages `fuse`, `layout`, `group` and `plan`, with the
lowered program's numpy interpreter (`interp`), the oracle for backends' kernels.

Stage: after `tgc.autodiff`, before `tgc.manager` and `tgc.backends`; imports `tgc.ir`,
`tgc.opt` (statistics), `tgc.options`, and (until its stages run under the one pass
manager) `tgc.manager` from `plan`.
"""
