"""A nanoGPT-char-sized training step: tgc against PyTorch eager (and torch.compile).

The model is `examples/gpt2.tg` (pre-LayerNorm blocks, biases, tied head, AdamW with
betas 0.9/0.95 and global-norm clipping at 1, weight decay on the embeddings and the
matrices) bound to nanoGPT's `shakespeare_char` sizes: 6 layers, 6 heads of 64
(width 384), 256 positions, a vocabulary of 65. nanoGPT trains it at batch 64; the
default here is 4 (a 2-core machine takes about 10 s per step at 64).

PyTorch runs the same model written as a PyTorch user would (one tensor per layer's
param, `F.scaled_dot_product_attention(is_causal=True)`, `clip_grad_norm_`,
`torch.optim.AdamW(foreach=True)` with two param groups) on the same initial arrays.
Both are checked first: the first step's losses and one updated param agree to f32
accuracy. Then steps are timed interleaved (tgc, torch, tgc, ...); the table gives the
median and the ratio to torch eager (issue target: tgc <= 0.7x eager).

    python benchmarks/nanogpt.py                     # batch 4, 5 timed steps each
    python benchmarks/nanogpt.py --batch 8 --repeat 7 --compile
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GPT2 = ROOT / "examples" / "gpt2.tg"
SIZES = {"layer": 6, "head": 6, "hd": 64, "t": 256, "vocab": 65}
DECAY = ("wte", "wpe", "wq", "wk", "wv", "wo", "wfc", "wproj")
LR, WD = 1e-3, 0.1


def initial(program, batch: int, seed: int = 0, sizes: dict = SIZES) -> dict[str, np.ndarray]:
    """GPT-2's initialization (N(0, 0.02) weights, zero biases, unit LayerNorm scales),
    zero AdamW states, and a batch of random tokens with their successors (`sizes`:
    the model's, nanoGPT-char's by default)."""
    rng = np.random.default_rng(seed)
    arrays = program.init_state(sizes)
    for spec in program.inputs:
        if spec.kind != "param":
            continue
        if spec.name.startswith("ln"):
            arrays[spec.name] = (np.ones if spec.name.endswith("_w") else np.zeros)(spec.shape)
        elif spec.name.startswith("b"):
            arrays[spec.name] = np.zeros(spec.shape)
        else:
            arrays[spec.name] = 0.02 * rng.standard_normal(spec.shape)
    arrays = {k: np.array(v, np.float32) for k, v in arrays.items()}
    tokens = rng.integers(0, sizes["vocab"], (batch, sizes["t"] + 1)).astype(np.int32)
    return {**arrays, "ids": tokens[:, :-1].copy(), "targets": tokens[:, 1:].copy(),
            "lr": np.float32(LR), "wd": np.float32(WD)}


def torch_step(arrays: dict[str, np.ndarray], params: list[str], compiled: bool, phases=None, sizes: dict = SIZES):
    """(step function, its params by name) for PyTorch on copies of `arrays`'s `params`
    (a stacked param `wq[layer, ...]` becomes one tensor per layer, `wq.0`, `wq.1`, ...).
    `phases(name)`: a context manager around each phase of the step (forward, backward,
    clip, adamw; benchmarks/breakdown.py's profiler ranges); `sizes`: the model's."""
    import contextlib

    import torch
    import torch.nn.functional as F

    L, H, D = sizes["layer"], sizes["head"], sizes["hd"]
    C = H * D
    stacked = [n for n in params if n not in ("wte", "wpe", "lnf_w", "lnf_b")]
    P = {}
    for n in ("wte", "wpe", "lnf_w", "lnf_b"):
        P[n] = torch.tensor(arrays[n], requires_grad=True)
    for n in stacked:
        for i in range(L):
            P[f"{n}.{i}"] = torch.tensor(arrays[n][i], requires_grad=True)
    ids = torch.from_numpy(arrays["ids"].astype(np.int64))
    targets = torch.from_numpy(arrays["targets"].astype(np.int64)).reshape(-1)

    def loss_fn(ids, targets):
        B, T = ids.shape
        x = F.embedding(ids, P["wte"]) + P["wpe"]
        for i in range(L):
            p = lambda n: P[f"{n}.{i}"]
            h = F.layer_norm(x, (C,), p("ln1_w"), p("ln1_b"), 1e-5)
            q, k, v = ((h @ p(f"w{z}") + p(f"b{z}")).reshape(B, T, H, D).transpose(1, 2) for z in "qkv")
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            a = x + o.transpose(1, 2).reshape(B, T, C) @ p("wo") + p("bo")
            h = F.layer_norm(a, (C,), p("ln2_w"), p("ln2_b"), 1e-5)
            x = a + F.gelu(h @ p("wfc") + p("bfc"), approximate="tanh") @ p("wproj") + p("bproj")
        xf = F.layer_norm(x, (C,), P["lnf_w"], P["lnf_b"], 1e-5)
        return F.cross_entropy((xf @ P["wte"].T).reshape(-1, sizes["vocab"]), targets)

    if compiled:
        loss_fn = torch.compile(loss_fn)
    decay = [t for n, t in P.items() if n.split(".")[0] in DECAY]
    rest = [t for n, t in P.items() if n.split(".")[0] not in DECAY]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    params = list(P.values())

    phase = phases or (lambda name: contextlib.nullcontext())

    def step():
        opt.zero_grad(set_to_none=True)
        with phase("forward"):
            loss = loss_fn(ids, targets)
        with phase("backward"):
            loss.backward()
        with phase("clip"):
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        with phase("adamw"):
            opt.step()
        return float(loss.detach())
    return step, P


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5, help="timed steps per contender (median)")
    ap.add_argument("--compile", action="store_true", help="also torch.compile (slow to warm up)")
    ap.add_argument("--threads", type=int, default=None, help="CpuOptions(threads=N) and torch.set_num_threads(N)")
    args = ap.parse_args(argv)

    import torch
    import tgc
    from tgc.options import CpuOptions, Options

    if args.threads:
        torch.set_num_threads(args.threads)
    options = Options(cpu=CpuOptions(threads=args.threads)) if args.threads else None
    t0 = time.perf_counter()
    program = tgc.compile(GPT2, dims=SIZES, **({"options": options} if options else {}))
    compile_s = time.perf_counter() - t0
    arrays = initial(program, args.batch)
    names = [s.name for s in program.inputs if s.kind == "param"]
    contenders = {"torch eager": torch_step(arrays, names, False)}
    if args.compile:
        contenders["torch.compile"] = torch_step(arrays, names, True)
    mine = {k: v.copy() for k, v in arrays.items()}

    # Check: the first step's loss and the updated token embedding agree.
    got = float(program(**mine)["loss"])
    for name, (step, P) in contenders.items():
        want = step()
        if abs(got - want) > 1e-4 * abs(want):
            print(f"loss differs from {name}: tgc {got!r}, {name} {want!r}", file=sys.stderr)
            return 1
        ref = P["wte"].detach().numpy()
        err = np.abs(mine["wte"] - ref).max() / np.abs(ref).max()
        # The first AdamW step moves each weight by about lr * g / (|g| + eps): where a
        # gradient is near eps, f32 rounding of g moves the update by up to its own size.
        # torch f32 itself is 1.3e-4 of the largest value from a float64 step here (tgc
        # 2.1e-4), so the bound is 1e-3: a tenth of one update (lr = 1e-3, |wte| <= 0.1).
        if err > 1e-3:
            print(f"updated wte differs from {name} by {err:.2e} of its largest value", file=sys.stderr)
            return 1
    print(f"nanoGPT-char step: {SIZES['layer']} layers, {SIZES['head']} heads x {SIZES['hd']}, "
          f"t {SIZES['t']}, vocab {SIZES['vocab']}, batch {args.batch}; tgc compile {compile_s:.1f} s; "
          f"first-step loss {got:.4f} (checked)")

    times = {"tgc": []} | {n: [] for n in contenders}
    for _ in range(args.repeat):
        times["tgc"].append(timed(lambda: program(**mine)))
        for name, (step, _) in contenders.items():
            times[name].append(timed(step))
    eager = statistics.median(times["torch eager"])
    print(f"{'contender':<14} {'median step':>12} {'min':>10} {'x eager':>8}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<14} {med * 1e3:>9.1f} ms {min(ts) * 1e3:>7.1f} ms {med / eager:>8.2f}")
    tokens = args.batch * SIZES["t"]
    n_params = sum(math.prod(s.shape) for s in program.inputs if s.kind == "param")
    flops = 6 * n_params * tokens + 3 * 4 * args.batch * SIZES["layer"] * SIZES["head"] * SIZES["t"] ** 2 * SIZES["hd"] // 2
    print(f"about {flops / 1e9:.0f} GFLOP per step (6 x params x tokens, causal attention halved): "
          f"tgc {flops / statistics.median(times['tgc']) / 1e9:.0f} GFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
