"""Backends: one folder per target (`cpu`, `cuda`), each declaring the backends it
offers in `BACKENDS` (`base` finds them), plus what they share: the `Backend` and
`Kernels` interfaces and the registry (`base`), and the on-disk code cache
(`cache`, with `objfile`'s checks of cached object files). Backends never import
each other, nor anything of a later stage (runtime, pipeline, cli)."""
