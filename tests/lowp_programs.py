"""Programs shared by the bf16/f16 tests of the CPU (`tests/backends/test_cpu_bf16.py`)
and CUDA (`tests/backends/test_cuda_bf16.py`) backends."""

# bf16 and f16 inputs through elementwise chains (stored in 2 bytes where written
# elementwise), a reduction to f32, and f16 arithmetic with a constant
CHAIN = """
dim n = 64, m = 48
input x: bf16[i: n, j: m]
input s: bf16[j]
input h: f16[i, j]
a = x * s + x
b = exp(a) * a
out y = b - x
out r = sum[j](f32(b))
out g = h * h + f16(2)
"""
