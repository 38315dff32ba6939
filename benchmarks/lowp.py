"""Mixed precision rows: f32 against `--autocast bf16`, for tgc and PyTorch on the CPU.

    python benchmarks/lowp.py            # both rows, 15 samples each (min and median reported)
    python benchmarks/lowp.py --quick    # 5 samples
    python benchmarks/lowp.py --threads 1 --only gemm,gpt --repeat 25   # one thread (less noise when loaded)

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
bf16 GEMM on them where the CPU has AVX-512 BF16 and the product has at least 2^20
flops summed over at least 64 elements ("tgc autocast bf16"; other products run sgemm
on f32), or widens them
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


def kernel_rows(only: str, calls: int) -> None:
    """The `gemm` and `gpt` rows as time-stamp-counter cycles per kernel
    (`Program.profile()`), one thread, f32 and autocast bf16 compiled side by side and
    called in turn `calls` times; each kernel's minimum over the calls, summed, split
    into GEMMs, rounding loops (a loop whose whole body is `round_bf16` of a load) and
    the rest. Less noisy than times on a loaded machine: a kernel's minimum is taken
    over calls in the same minutes for every contender."""
    import re

    rng = np.random.default_rng(0)
    print(f"| row | contender | all kernels Mcyc | GEMMs | rounding loops | other | kernels |   (min of {calls} calls)")
    print("|---|---|---|---|---|---|---|")
    for row in only.split(","):
        if row == "matmul":
            continue
        src, inputs = (GEMM_TG, gemm_inputs(rng)) if row == "gemm" else gpt_setup(rng)
        progs = {}
        for name, extra in (("tgc f32", {}), ("tgc autocast bf16", {"autocast": "bf16"})):
            cpu = tgc.Options().cpu.with_(threads=1, profile=True)
            prog = tgc.compile(src, options=tgc.Options(cpu=cpu, **extra))
            own = {k: np.copy(v) for k, v in inputs.items()}
            prog(**own)
            prog.profile(reset=True)
            progs[name] = (prog, own, {})
        for _ in range(calls):
            for prog, own, best in progs.values():
                prog(**own)
                for cycles, i, line in prog.profile(reset=True):
                    best[i] = (min(best.get(i, (cycles, line))[0], cycles), line)
        for name, (_, _, best) in progs.items():
            split = {"gemm": 0, "round": 0, "other": 0}
            for cycles, line in best.values():
                kind = ("gemm" if line.startswith("gemm") else
                        "round" if re.fullmatch(r"loop %\w+\[[^\]]*\] = round_bf16\(%\w+\[[^\]]*\]\)", line) else "other")
                split[kind] += cycles
            total = sum(split.values())
            print(f"| {row} | {name} | {total / 1e6:.2f} | {split['gemm'] / 1e6:.2f} | {split['round'] / 1e6:.2f} "
                  f"| {split['other'] / 1e6:.2f} | {len(best)} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default="matmul,gemm,gpt")
    p.add_argument("--threads", type=int, default=2, help="threads of tgc and torch (default 2)")
    p.add_argument("--repeat", type=int, default=None, help="samples per contender (default 15, 5 with --quick)")
    p.add_argument("--kernels", action="store_true",
                   help="per-kernel cycles instead of times (gemm and gpt rows, one thread; see kernel_rows)")
    args = p.parse_args(argv)
    repeat = args.repeat or (5 if args.quick else 15)
    if args.kernels:
        return kernel_rows(args.only, args.repeat or 40)
    rng = np.random.default_rng(0)
    rows = []
    cpu = tgc.Options().cpu.with_(threads=args.threads)
    sgemm = cpu.with_(bf16_gemm="off")
    for row in args.only.split(","):
        contenders = {}
        if row == "matmul":
            inputs = matmul_inputs(rng)
            f32 = {k: v.astype(np.float32) for k, v in inputs.items()}
            for name, src, opts, given in (
                    ("tgc f32", MATMUL_TG.replace("bf16", "f32").replace("f32(a) @ f32(b)", "a @ b"),
                     tgc.Options(cpu=cpu), f32),
                    ("tgc bf16", MATMUL_TG, tgc.Options(cpu=cpu), inputs),
                    ("tgc bf16 sgemm", MATMUL_TG, tgc.Options(cpu=sgemm), inputs)):
                prog = tgc.compile(src, options=opts)
                contenders[name] = lambda prog=prog, given=given: prog(**given)
            try:
                import torch

                torch.set_num_threads(args.threads)
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
                           (("tgc f32", tgc.Options(cpu=cpu)), ("tgc autocast bf16", tgc.Options(cpu=cpu, autocast="bf16")),
                            ("tgc autocast bf16 sgemm", tgc.Options(autocast="bf16", cpu=sgemm)))):
            prog = tgc.compile(src, options=opts)
            own = {k: np.copy(v) for k, v in inputs.items()}
            contenders[name] = lambda prog=prog, own=own: prog(**own)
        if row == "gemm":
            try:
                import torch

                torch.set_num_threads(args.threads)
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
