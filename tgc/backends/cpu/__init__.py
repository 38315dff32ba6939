"""CPU backend: LLVM IR through llvmlite, vector math, BLAS and threads via a function table.

Modules: ``backend`` (the `Backend` the registry loads), ``group`` (its own lowering
stage: loop groups for cache blocking, and the `LoopGroup` kernel kind), ``kernels``
(the JIT-loaded program the neutral runtime calls), ``options`` (`CpuOptions`),
``llvm_env`` (targets, pipeline, JIT, objects), ``vecmath`` (vectorizable elementwise
math in IR), ``blas`` (numpy's OpenBLAS GEMMs), ``parallel`` (libgomp regions),
``fntable`` (the function-pointer table generated code is given at init).

Stage: a backend (see `tgc.backends`); imports `tgc.backends.base` and `.cache`,
`tgc.lower`, `tgc.ir`, `tgc.opt`, `tgc.options`; never another backend.
"""

BACKENDS = {"cpu": "tgc.backends.cpu.backend:CpuBackend"}
