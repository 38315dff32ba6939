"""Mixed precision rows: f32 against `--autocast bf16`, for tgc and PyTorch on the CPU.

    python benchmarks/lowp.py            # both rows, 15 samples each (min and median reported)
    python benchmarks/lowp.py --quick    # 5 samples

Rows:
- `matmul`: one product C = A @ B of 1024 x 1024 bf16 matrices (f32 result): tgc with
  bf16 inputs (`out c = f32(a) @ f32(b)`), by the bf16 GEMM (`vdpbf16ps`, where the CPU
  has AVX-512 BF16) and by the conversion path (`bf16_gemm="off"`: widened, then
  sgemm), against tgc's f32 product and PyTorch's f32 and bf16 ones.
- `gemm`: one training step of a wide two-layer MLP (batch 512, 1024 -> 1024 -> 16,
  tanh, cross-entropy, SGD): GEMM-bound (forward and backward products are ~99% of
  its flops).
- `gpt`: the benchmark GPT's training step (benchmarks/workloads/gpt.tg, batch 64).

Each contender's samples are interleaved (A B C D A B C D ...); a sample is the mean of
enough calls to last ~50 ms; the table gives the minimum and the median in ms. tgc's
autocast rounds the products' operands to bf16, stores them in 2 bytes and runs its
bf16 GEMM on them where the CPU has AVX-512 BF16 and the product has at least 2^24
flops ("tgc autocast bf16"; smaller products run sgemm on f32), or widens them
to f32 for sgemm ("... sgemm": `CpuOptions(bf16_gemm="off")`, docs/dtypes.md);
PyTorch's CPU autocast runs oneDNN bf16 GEMMs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import tgc  # noqa: E402

GEMM_TG = """
dim batch, features = 1024, hidden = 1024, classes = 16
input x[batch, features]
input y[batch, classes]
param W1[features, hidden]
param W2[hidden, classes]
input lr
loss = mean[batch](cross_entropy[classes](tanh(x @ W1) @ W2, y))
out loss
update W1 = W1 - lr * grad(loss, W1)
update W2 = W2 - lr * grad(loss, W2)
"""


MATMUL_TG = """
dim m = 1024, k = 1024, n = 1024
input a: bf16[i: m, kk: k]
input b: bf16[kk, j: n]
out c = f32(a) @ f32(b)
"""


def matmul_inputs(rng):
    import ml_dtypes

    return {"a": rng.standard_normal((1024, 1024), np.float32).astype(ml_dtypes.bfloat16),
            "b": rng.standard_normal((1024, 1024), np.float32).astype(ml_dtypes.bfloat16)}


def torch_matmul(inputs, dtype):
    import torch

    a = torch.from_numpy(inputs["a"].astype(np.float32)).to(dtype)
    b = torch.from_numpy(inputs["b"].astype(np.float32)).to(dtype)
    return lambda: a @ b


def gemm_inputs(rng):
    y = np.eye(16, dtype=np.float32)[rng.integers(0, 16, 512)]
    return {"x": rng.standard_normal((512, 1024), np.float32), "y": y,
            "W1": (rng.standard_normal((1024, 1024), np.float32) * 0.03),
            "W2": (rng.standard_normal((1024, 16), np.float32) * 0.03), "lr": np.float32(0.1)}


def torch_gemm(inputs, autocast):
    import torch
    import torch.nn.functional as F

    x, y = torch.from_numpy(inputs["x"]), torch.from_numpy(inputs["y"]).argmax(1)
    W1 = torch.from_numpy(inputs["W1"].copy()).requires_grad_()
    W2 = torch.from_numpy(inputs["W2"].copy()).requires_grad_()

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(torch.tanh(x @ W1) @ W2, y)
        g1, g2 = torch.autograd.grad(loss.float(), (W1, W2))
        with torch.no_grad():
            W1.sub_(0.1 * g1)
            W2.sub_(0.1 * g2)
        return loss
    return step


def gpt_setup(rng):
    import run as bench   # benchmarks/run.py: the GPT row's inputs

    return (HERE / "workloads" / "gpt.tg").read_text(), bench._gpt_inputs(rng)


def sample(fn, ms=50.0):
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        t = time.perf_counter() - t0
        if t * 1e3 >= ms:
            return t / n * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default="matmul,gemm,gpt")
    args = p.parse_args(argv)
    repeat = 5 if args.quick else 15
    rng = np.random.default_rng(0)
    rows = []
    sgemm = tgc.Options().cpu.with_(bf16_gemm="off")
    for row in args.only.split(","):
        contenders = {}
        if row == "matmul":
            inputs = matmul_inputs(rng)
            f32 = {k: v.astype(np.float32) for k, v in inputs.items()}
            for name, src, opts, given in (
                    ("tgc f32", MATMUL_TG.replace("bf16", "f32").replace("f32(a) @ f32(b)", "a @ b"),
                     tgc.Options(), f32),
                    ("tgc bf16", MATMUL_TG, tgc.Options(), inputs),
                    ("tgc bf16 sgemm", MATMUL_TG, tgc.Options(cpu=sgemm), inputs)):
                prog = tgc.compile(src, options=opts)
                contenders[name] = lambda prog=prog, given=given: prog(**given)
            try:
                import torch

                torch.set_num_threads(2)
                contenders["torch f32"] = torch_matmul(inputs, torch.float32)
                contenders["torch bf16"] = torch_matmul(inputs, torch.bfloat16)
            except ImportError:
                pass
            src = None
        elif row == "gemm":
            src, inputs = GEMM_TG, gemm_inputs(rng)
        else:
            src, inputs = gpt_setup(rng)
        for name, opts in (() if src is None else
                           (("tgc f32", tgc.Options()), ("tgc autocast bf16", tgc.Options(autocast="bf16")),
                            ("tgc autocast bf16 sgemm", tgc.Options(autocast="bf16", cpu=sgemm)))):
            prog = tgc.compile(src, options=opts)
            own = {k: np.copy(v) for k, v in inputs.items()}
            contenders[name] = lambda prog=prog, own=own: prog(**own)
        if row == "gemm":
            try:
                import torch

                torch.set_num_threads(2)
                contenders["torch f32"] = torch_gemm(inputs, False)
                contenders["torch autocast bf16"] = torch_gemm(inputs, True)
            except ImportError:
                pass
        times = {k: [] for k in contenders}
        for _ in range(repeat):
            for k, fn in contenders.items():
                times[k].append(sample(fn))
        for k, ts in times.items():
            rows.append((row, k, min(ts), statistics.median(ts)))
    print(f"| row | contender | min ms | median ms |   ({repeat} samples each)")
    print("|---|---|---|---|")
    for row, k, lo, med in rows:
        print(f"| {row} | {k} | {lo:.2f} | {med:.2f} |")


if __name__ == "__main__":
    main()
