"""Code generators: one package per target. Backends never import each other.

Stage: after `tgc.lower` and `tgc.manager`, before `tgc.runtime`; a backend imports
`tgc.ir`, `tgc.lower` (the lowered program it compiles), `tgc.opt` and the leaves.
Still crossing forward (to be removed): the CUDA program builds on
`tgc.runtime.program` and its cache."""
