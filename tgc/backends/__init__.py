"""Backends: one folder per target (`cpu`, `cuda`, and `lowered`: the lowered program's
interpreter, the template for a new one; docs/backends.md), each declaring the backends
it offers in `BACKENDS` (`base` finds them), plus what they share: the `Backend` and
`Kernels` interfaces and the registry (`base`), and the on-disk code cache
(`cache`, with `objfile`'s checks of cached object files). Backends never import
each other.

Stage: after `tgc.lower` and `tgc.manager`, before `tgc.runtime`; a backend imports
`tgc.ir`, `tgc.lower` (the lowered program it compiles, and the stages it adds to
it), `tgc.opt`, `tgc.options` and the leaves; nothing of a later stage."""
