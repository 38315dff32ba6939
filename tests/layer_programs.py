"""Small layer programs that several backend suites run (the CPU group stage, the CUDA
row groups and column sums, loops over layers): one definition each."""

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

# residual tanh layers stacked on a `layer` edge, applied with `repeat`, one SGD step
DEEP = """\
dim batch, layer
dim c = 8, c2 = 8
input x[batch, c]
param w[layer, c, c2]
input lr
fn block(h, w) = tanh(h @ w)[c2 = c] * 0.5 + h
y = repeat[layer](block, x, w)
loss = sum(y * y)
out loss
out y
update w = w - lr * grad(loss, w)
"""
