"""Lowering: the optimized IR to the lowered program of kernels and buffers that every
backend compiles (`lowered`), in stages `fuse`, `layout`, then a backend's own (the
CPU's `group`, in `tgc.backends.cpu`), then `plan` (passes the one pass manager,
`tgc.manager`, runs), with the lowered program's text (`text`, grammar `lowered.lark`:
what `print_lowered` writes reads back; a backend's own kind of kernel registers its
grammar rules and reader, `text.KernelForm`), its verifier (`verify`) and its numpy interpreter (`interp`), the oracle for
backends' kernels (a backend's own kind of kernel runs through its `interpret` hook).
A loop over an edge lowers to a `StepLoop` whose step is a lowered program of its
own (`steps`); a convolution's contraction to GEMMs on shifted views (`taps`); both
are parts of `fuse`, which sees values through renames and identities (`views`). Also neutral pieces that backends' own stages use: `narrow` (2-byte bf16/f16 buffers,
a stage the CPU and CUDA backends run, and the widening of GEMM operands both use),
`accumulate` (a stage both run: `c + a @ b` as one GEMM with beta = 1 where the sum is in
place or a loop's carry),
`grouping` (the kernel scan of the CPU's `group` and CUDA's
`rowgroup`) and `cost` (FLOPs of kernels, for `--stats` and `tgc explain`).

Stage: after `tgc.autodiff`, before `tgc.manager` (which runs its stages) and
`tgc.backends`; imports `tgc.ir` and `tgc.options`.
"""
