"""CPU backend: LLVM IR through llvmlite, vector math, BLAS and threads via a function table.

Modules: ``llvm_env`` (targets, pipeline, JIT, objects), ``vecmath`` (vectorizable
elementwise math in IR), ``blas`` (numpy's OpenBLAS GEMMs), ``parallel`` (libgomp
regions), ``fntable`` (the function-pointer table generated code is given at init).
"""
