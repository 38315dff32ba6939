"""The CUDA backend: CUDA C from the lowered program (`codegen`), run on a GPU
through CuPy or on this CPU by the cuda-sim emulator (`runtime`); docs/cuda.md."""

BACKENDS = {"cuda": "tgc.backends.cuda.backend:CudaBackend", "cuda-sim": "tgc.backends.cuda.backend:CudaSimBackend"}
