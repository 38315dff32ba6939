"""The CUDA backend: CUDA C from the lowered program (`codegen`; a row group's kernel:
`rowgen`; the C text helpers both use: `ctext`; the module and its launches:
`launches`), run on a GPU through CuPy or on this CPU by the cuda-sim emulator
(`runtime`, whose `CudaKernels` the neutral runtime calls); `backend` registers "cuda"
and "cuda-sim"; docs/cuda.md.

Stage: a backend (see `tgc.backends`); imports `tgc.backends.base` and `.cache`,
`tgc.lower`, `tgc.ir`, `tgc.options`; never another backend."""

BACKENDS = {"cuda": "tgc.backends.cuda.backend:CudaBackend", "cuda-sim": "tgc.backends.cuda.backend:CudaSimBackend"}
