"""The `lowered` backend: the reference lowered-program interpreter (`tgc.lower.interp`)
behind the `Backend` interface, so that `tgc.compile(..., backend="lowered")` and
`tgc run --backend lowered` run the lowered program kernel by kernel in numpy, with
its buffers bound by the neutral runtime (`tgc.runtime.program.Program`), as a
compiled backend's are.

It is also the smallest complete backend, the template for a new one: this file's
`BACKENDS` (read by `tgc.backends.base` without importing the backend), one
`Backend` subclass and one `Kernels` subclass (`backend`). It adds no lowering stage
of its own, so it runs the neutral fuse, layout and plan (or the stages
`Options.stages` names: another backend's, to run that backend's lowered program).

Stage: a backend (see `tgc.backends`); imports `tgc.backends.base`, `tgc.lower`,
`tgc.ir`; never another backend."""

BACKENDS = {"lowered": "tgc.backends.lowered.backend:LoweredBackend"}
