"""Small layer programs that several backend suites run (the CPU group stage, the CUDA
row groups and column sums): one definition each."""

# a layernorm with the gradients of sum(y * dy): row sums (dx) and column sums (dw, db)
LAYERNORM = """
dim rows, d
input x[rows, d]
input dy[rows, d]
param w[d], b[d]
y = layernorm[d](x, w, b)
loss = sum(y * dy)
out y
out dx = grad(loss, x)
out dw = grad(loss, w)
out db = grad(loss, b)
"""
