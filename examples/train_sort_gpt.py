"""Train a 3-layer GPT to sort sequences of digits (minGPT's sorting demo) with tgc.

    python examples/train_sort_gpt.py                 # the full run (see README, "Training")
    python examples/train_sort_gpt.py --quick         # a smoke test: a few steps

The step is `train_sort_gpt.tg`: forward, backward and AdamW on every parameter in one
native call (the optimizer is written in the .tg file as state and updates). The
data are all 3^6 = 729 sequences of 6 digits from {0, 1, 2}; a quarter of them,
chosen by `--seed`, are held out and never trained on. Each step trains on 64
sequences drawn from the rest.

Evaluation decodes greedily, as minGPT's demo does: the forward-only call
(`program.run(..., updates=False)`: no gradients, no updates) reads the 6 digits and
predicts the first sorted digit, which is appended to the input, and so on 6 times; a
sequence counts as right when all 6 predicted digits are. (For a causal model this
exact-sequence accuracy equals the teacher-forced one, where every position's argmax
must be the right digit: both fail at the first wrong digit.) The run reports the
first step at which every held-out sequence is sorted right. Not every seed gets there:
a random quarter can hold out extreme sequences that the rest does not teach (seed 7
holds out all three sequences of six equal digits). Of seeds 0 to 7, six sorted every
held-out sequence when this was written; seeds 3 and 7 missed one each.

With `--data-parallel`, under MPI (`mpirun -n 2 python examples/train_sort_gpt.py
--data-parallel`; needs mpi4py: `pip install -e '.[mpi]'`), each of the N processes
trains on its 64 / N rows of every batch and the gradients are averaged over the
processes (tgc.distributed): the same training, the same batches, as one process; rank
0 prints, evaluates and writes the outputs.

Writes `params.safetensors` (parameters and the optimizer's state, loadable with
`tgc.load_params`) and `training.png` (loss and accuracies) to `--out`. With PyTorch
installed it also trains the same model with `torch.optim.AdamW` from the same
initial weights on the same batches for a few steps and prints both step times.
"""
from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_common as tc  # noqa: E402

import tgc  # noqa: E402

TG = tc.HERE / "train_sort_gpt.tg"
N, VOCAB, LAYERS, C, HEADS = 6, 3, 3, 48, 3     # as the .tg file declares them
T = 2 * N - 1
BATCH = 64
LR, MIN_LR, WARMUP = 1e-3, 1e-4, 100
WEIGHT_DECAY = 1.0     # strong: the model has no dropout (minGPT: 0.1, with dropout 0.1)
BETAS, EPS = (0.9, 0.95), 1e-8                  # as the .tg file's adam_m, adam_v, adamw
MATRICES = ("wq", "wk", "wv", "wo", "wfc", "wproj")
BLOCK = ("ln1_w", "ln1_b", "wq", "wk", "wv", "wo", "ln2_w", "ln2_b", "wfc", "bfc", "wproj", "bproj")
"""A block's params, as the .tg file declares them: each is stacked on `layer`."""


def decayed(name: str) -> bool:
    """Whether weight decay applies to a parameter: the matrices of the blocks and the
    head (the .tg file passes `wd` to their updates, 0 to the others)."""
    return name == "lm_head" or name in MATRICES


def split(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """All 729 sequences, shuffled by `seed`: (train, held out), 3/4 and 1/4."""
    seqs = np.array(list(itertools.product(range(VOCAB), repeat=N)), dtype=np.int32)
    seqs = seqs[np.random.default_rng([seed, 0]).permutation(len(seqs))]
    cut = len(seqs) // 4
    return seqs[cut:], seqs[:cut]


def batch(seqs: np.ndarray) -> dict[str, np.ndarray]:
    """The step's inputs for these sequences: `ids` (the digits, then the sorted
    digits but the last) and `sorted` (the targets)."""
    s = np.sort(seqs, axis=1)
    return {"ids": np.ascontiguousarray(np.concatenate([seqs, s[:, :-1]], axis=1), dtype=np.int32),
            "sorted": np.ascontiguousarray(s, dtype=np.int32)}


def initial(name: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    """minGPT's initialization of one parameter (of one block, for a block's): weights
    N(0, 0.02), the residual projections N(0, 0.02 / sqrt(2 * layers)), biases 0,
    LayerNorm scales 1."""
    if name.startswith("ln"):                                # LayerNorms: scale 1, shift 0
        return np.ones(shape) if name.endswith("_w") else np.zeros(shape)
    if name in ("bfc", "bproj"):
        return np.zeros(shape)
    std = 0.02 / np.sqrt(2 * LAYERS) if name in ("wo", "wproj") else 0.02
    return std * rng.standard_normal(shape)


def init(program: tgc.Program, seed: int) -> dict[str, np.ndarray]:
    """The initial params (`initial`) and the optimizer's state (zeros). The blocks'
    params are drawn block by block, block 1's, then block 2's, ..., as a model with
    one module per block draws them, and stacked on `layer`."""
    rng = np.random.default_rng([seed, 1])
    arrays = program.init_state()          # the step counter and every m.NAME, v.NAME: zeros
    params = [s for s in program.inputs if s.kind == "param"]
    block = [s for s in params if s.name in BLOCK]
    for spec in params:
        if spec.name not in BLOCK:
            arrays[spec.name] = initial(spec.name, spec.shape, rng).astype(np.float32)
        elif spec is block[0]:             # every block's params at once, in declaration order
            layers = [{b.name: initial(b.name, b.shape[1:], rng) for b in block} for _ in range(LAYERS)]
            arrays.update({b.name: np.stack([l[b.name] for l in layers]).astype(np.float32) for b in block})
    return arrays


def learning_rate(step: int, steps: int) -> float:
    """Linear warm-up over WARMUP steps (a sixth of a shorter run), then a cosine
    decay to MIN_LR at `steps`."""
    warmup = max(1, min(WARMUP, steps // 6))
    if step < warmup:
        return LR * (step + 1) / warmup
    f = (step - warmup) / max(1, steps - warmup)
    return MIN_LR + 0.5 * (LR - MIN_LR) * (1 + np.cos(np.pi * min(f, 1.0)))


def greedy_sort(program: tgc.Program, params: dict, seqs: np.ndarray) -> np.ndarray:
    """The model's sort of each sequence, decoded greedily with the forward-only call:
    6 calls, each appending the most likely next digit. Positions not yet decoded hold
    0; the causal model never reads them. `sorted` only feeds the loss, which is
    ignored here, so it gets zeros."""
    ids = np.zeros((len(seqs), T), np.int32)
    ids[:, :N] = seqs
    unused = np.zeros((len(seqs), N), np.int32)
    out = np.zeros((len(seqs), N), np.int32)
    for i in range(N):
        logits = program.run({"ids": ids, "sorted": unused, **params}, updates=False)["logits"]
        out[:, i] = logits[:, N - 1 + i].argmax(-1)
        if N + i < T:
            ids[:, N + i] = out[:, i]
    return out


def accuracy(program: tgc.Program, params: dict, seqs: np.ndarray) -> float:
    """Exact-sequence accuracy of greedy decoding."""
    return float(np.mean(np.all(greedy_sort(program, params, seqs) == np.sort(seqs, axis=1), axis=1)))


def teacher_forced_accuracy(program: tgc.Program, params: dict, seqs: np.ndarray) -> float:
    """Exact-sequence accuracy of the argmax at every predicting position, given the
    true sorted prefix (one forward-only call)."""
    b = batch(seqs)
    logits = program.run({**b, **params}, updates=False)["logits"]
    return float(np.mean(np.all(logits[:, N - 1:].argmax(-1) == b["sorted"], axis=1)))


# ---------------------------------------------------------------- PyTorch, the same model

def torch_loss(P: dict, ids, targets):
    """The model of train_sort_gpt.tg in PyTorch, parameters by the same names and in
    the same layout (x @ W, heads split head-major, a block's params stacked on a first
    axis): the mean cross-entropy of the predicting positions."""
    import torch.nn.functional as F
    B = ids.shape[0]
    x = P["wte"][ids.long()] + P["wpe"]
    for layer in range(LAYERS):
        p = {k: P[k][layer] for k in BLOCK}                 # the block's slice of the stacked params
        h = F.layer_norm(x, (C,), p["ln1_w"], p["ln1_b"])
        q, k, v = ((h @ p[w]).view(B, T, HEADS, C // HEADS).transpose(1, 2) for w in ("wq", "wk", "wv"))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + o @ p["wo"]
        h = F.layer_norm(x, (C,), p["ln2_w"], p["ln2_b"])
        x = x + F.gelu(h @ p["wfc"] + p["bfc"], approximate="tanh") @ p["wproj"] + p["bproj"]
    logits = F.layer_norm(x, (C,), P["lnf_w"], P["lnf_b"]) @ P["lm_head"]
    return F.cross_entropy(logits[:, N - 1:].reshape(-1, VOCAB), targets.reshape(-1).long())


def torch_trainer(params: dict, dtype="float32"):
    """(P, step, optimizer): PyTorch copies of `params`, a function that takes one AdamW step
    (torch.optim.AdamW, foreach, the same groups and hyperparameters) on a batch with
    a learning rate and returns the loss before it, and the optimizer."""
    import torch
    P = {k: torch.tensor(v, dtype=getattr(torch, dtype), requires_grad=True) for k, v in params.items()}
    groups = [{"params": [P[k] for k in P if decayed(k)], "weight_decay": WEIGHT_DECAY},
              {"params": [P[k] for k in P if not decayed(k)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, foreach=True)

    def step(b: dict, lr: float) -> float:
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss = torch_loss(P, torch.from_numpy(b["ids"]), torch.from_numpy(b["sorted"]))
        loss.backward()
        opt.step()
        return loss.item()
    return P, step, opt


# ---------------------------------------------------------------- the run

def main(argv=None) -> int:
    p = tc.parser("sort_gpt", __doc__, steps=600, quick_steps=12)
    p.add_argument("--data-parallel", action="store_true",
                   help="split each batch over the MPI processes (run under mpirun; needs mpi4py)")
    args = tc.parse(p, argv)
    train, held_out = split(args.seed)
    comm = None
    if args.data_parallel:
        try:
            from mpi4py import MPI
        except ImportError:
            p.error("--data-parallel needs mpi4py (pip install -e '.[mpi]') and an MPI library")
        comm = MPI.COMM_WORLD
    program = tc.compile_step(TG, args, data_parallel=comm)
    lead = comm is None or program.rank == 0          # the process that prints and writes
    if not lead:
        return worker(program, args, train)
    if comm is not None:
        print(f"data parallel: {program.size} processes, {BATCH // program.size}-{-(-BATCH // program.size)} "
              f"of each batch's {BATCH} sequences each, gradients averaged over them (MPI)")
    print(f"data: {len(train)} training sequences, {len(held_out)} held out")

    arrays = init(program, args.seed)
    params = {s.name: arrays[s.name] for s in program.inputs if s.kind == "param"}
    start = {k: v.copy() for k, v in params.items()}           # for the PyTorch comparison
    rng = np.random.default_rng([args.seed, 2])
    batches = [rng.integers(0, len(train), BATCH) for _ in range(args.steps)]
    every = max(1, min(50, args.steps // (3 if args.quick else 10)))

    losses, evals, step_times, solved = [], [], [], None
    progress = tc.Progress(args.steps, "seq", BATCH)
    t_train = time.perf_counter()
    for i in range(args.steps):
        b = batch(train[batches[i]])
        if comm is not None:
            b = program.shard_inputs(b)
        t = time.perf_counter()
        result = program(**b, **arrays, lr=tc.scalar(learning_rate(i, args.steps)),
                         wd=tc.scalar(WEIGHT_DECAY))
        step_times.append(time.perf_counter() - t)
        losses.append(float(result["loss"]) + 0.0)     # f32 may round a tiny loss to -0
        progress.step(i + 1, losses[-1], step_times[-1])
        if (i + 1) % every == 0 or i + 1 == args.steps:
            acc = {"held out": accuracy(program, params, held_out),
                   "training (256)": accuracy(program, params, train[:256])}
            evals.append((i + 1, acc))
            progress.write(f"step {i + 1}: loss {losses[-1]:.4g}, exact-sequence accuracy (greedy): held out "
                           f"{100 * acc['held out']:.1f}%, training {100 * acc['training (256)']:.1f}%")
            if solved is None and acc["held out"] == 1.0:
                solved = i + 1
    progress.close()
    wall = time.perf_counter() - t_train

    final = evals[-1][1]["held out"]
    forced = teacher_forced_accuracy(program, params, held_out)
    print(f"held-out exact-sequence accuracy after {args.steps} steps: {100 * final:.1f}% greedy, "
          f"{100 * forced:.1f}% teacher-forced ({len(held_out)} sequences)")
    print("every held-out sequence sorted right " +
          (f"first at step {solved} (evaluated every {every} steps)" if solved else "at no evaluation"))
    print(f"training: {args.steps} steps in {tc.seconds(wall)} (with the evaluations); "
          f"median step {1e3 * np.median(step_times):.2f} ms")

    def torch_twin():
        _, step, _ = torch_trainer(start)
        return lambda i: step(batch(train[batches[i]]), learning_rate(i, args.steps))
    if comm is None:
        measured = tc.compare_with_torch(args, "AdamW", BATCH, 5 if args.quick else 50, torch_twin, losses,
                                         step_times)
    else:
        measured = {"processes": program.size}
        tc.note("data parallel: no PyTorch side-by-side (its twin runs in one process)")
    tc.save(args, program, arrays, "GPT (3 layers, 3 heads, width 48) sorting 6 digits, AdamW in .tg", losses,
            evals, {"held_out_accuracy": final, "held_out_accuracy_teacher_forced": forced, "solved_at": solved,
                    "wall_s": wall, "step_ms_median": 1e3 * float(np.median(step_times)), **measured})
    return 0


def worker(program, args, train: np.ndarray) -> int:
    """A data-parallel process other than rank 0: the same batches and steps (its
    shard of each), no printing, evaluation or files."""
    arrays = init(program, args.seed)
    rng = np.random.default_rng([args.seed, 2])
    batches = [rng.integers(0, len(train), BATCH) for _ in range(args.steps)]
    for i in range(args.steps):
        b = program.shard_inputs(batch(train[batches[i]]))
        program(**b, **arrays, lr=tc.scalar(learning_rate(i, args.steps)), wd=tc.scalar(WEIGHT_DECAY))
    return 0


if __name__ == "__main__":
    sys.exit(main())
