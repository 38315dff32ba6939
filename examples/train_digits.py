"""Train a small convolutional net on scikit-learn's 8x8 digits with tgc.

    python examples/train_digits.py                   # the full run (see README, "Training")
    python examples/train_digits.py --quick           # a smoke test: a few steps

The step is `train_digits.tg`: two blocks of 3x3 convolution (written as a reindex),
relu and 2x2 max-pool, a linear layer and softmax cross-entropy, with Adam on every
parameter, in one native call. The data are the 1,797 images of `sklearn.datasets.load_digits`
(they ship with scikit-learn: no download), scaled to [0, 1]; a quarter, stratified
by class and chosen by `--seed`, is the test set. Each step trains on a minibatch of
64 images; each epoch visits the training images in a new order.

Writes `params.safetensors` and `training.png` to `--out`; with PyTorch installed,
trains the same model with `torch.optim.Adam` from the same weights on the same
batches for a few steps and prints both step times.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_common as tc  # noqa: E402

import tgc  # noqa: E402

TG = tc.HERE / "train_digits.tg"
BATCH, LR = 64, 2e-3
CLASSES = 10


def load(seed: int):
    """(x_train, y_train, x_test, y_test): images [n, 8, 8] in [0, 1], labels 0-9."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        sys.exit("train_digits.py needs scikit-learn for its data: pip install -e '.[examples]'")
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)
    xa, xb, ya, yb = train_test_split(x, digits.target, test_size=0.25, stratify=digits.target,
                                      random_state=seed)
    return xa, ya, xb, yb


def one_hot(labels: np.ndarray) -> np.ndarray:
    return np.eye(CLASSES, dtype=np.float32)[labels]


def init(program: tgc.Program, seed: int) -> dict[str, np.ndarray]:
    """He-normal weights (std sqrt(2 / fan-in)), zero biases, the optimizer's state 0."""
    rng = np.random.default_rng([seed, 1])
    arrays = {}
    for spec in program.inputs:
        if spec.kind == "state" or (spec.kind == "param" and spec.name.startswith("b")):
            arrays[spec.name] = np.zeros(spec.shape, np.float32)
        elif spec.kind == "param":
            fan_in = int(np.prod(spec.shape)) // spec.shape[0 if spec.name.startswith("K") else -1]
            arrays[spec.name] = (np.sqrt(2 / fan_in) * rng.standard_normal(spec.shape)).astype(np.float32)
    return arrays


def accuracy(program: tgc.Program, params: dict, x: np.ndarray, labels: np.ndarray) -> float:
    """The fraction of images whose largest logit is their label (one forward-only call;
    `y` only feeds the loss, which is not used here)."""
    logits = program.run({"x": x, "y": one_hot(labels), **params}, updates=False)["logits"]
    return float(np.mean(logits.argmax(-1) == labels))


def batches(n: int, steps: int, seed: int) -> list[np.ndarray]:
    """Minibatch indices for `steps` steps: epochs in a new random order each, the last
    partial batch of an epoch dropped."""
    rng = np.random.default_rng([seed, 2])
    out = []
    while len(out) < steps:
        order = rng.permutation(n)
        out += [order[k:k + BATCH] for k in range(0, n - BATCH + 1, BATCH)]
    return out[:steps]


# ---------------------------------------------------------------- PyTorch, the same model

def torch_trainer(params: dict, dtype="float32"):
    """(P, step, optimizer): PyTorch copies of `params`, a function that takes one Adam
    step (torch.optim.Adam, foreach) on (x, one-hot y) and returns the loss before it,
    and the optimizer. The model is train_digits.tg's: K1 is [out channels, ky, kx], K2
    [out channels, in channels, ky, kx], W [channels, rows, columns, classes]."""
    import torch
    import torch.nn.functional as F
    P = {k: torch.tensor(v, dtype=getattr(torch, dtype), requires_grad=True) for k, v in params.items()}
    opt = torch.optim.Adam(list(P.values()), lr=LR, foreach=True)

    def loss_of(x, y):
        pool1 = F.relu(F.max_pool2d(F.conv2d(x[:, None], P["K1"][:, None], P["b1"], padding=1), 2))
        pool2 = F.relu(F.max_pool2d(F.conv2d(pool1, P["K2"], P["b2"], padding=1), 2))   # [batch, 32, 2, 2]
        return F.cross_entropy(pool2.flatten(1) @ P["W"].flatten(0, 2) + P["b"], y)

    def step(x: np.ndarray, y: np.ndarray) -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_of(torch.from_numpy(x).to(P["W"].dtype), torch.from_numpy(y).to(P["W"].dtype))
        loss.backward()
        opt.step()
        return loss.item()
    return P, step, opt


# ---------------------------------------------------------------- the run

def main(argv=None) -> int:
    args = tc.parse(tc.parser("digits", __doc__, steps=600, quick_steps=20), argv)
    xa, ya, xb, yb = load(args.seed)
    program = tc.compile_step(TG, args)
    print(f"data: {len(xa)} training images, {len(xb)} test images")

    arrays = init(program, args.seed)
    params = {s.name: arrays[s.name] for s in program.inputs if s.kind == "param"}
    start = {k: v.copy() for k, v in params.items()}
    order = batches(len(xa), args.steps, args.seed)
    every = max(1, min(50, args.steps // (3 if args.quick else 10)))

    lr = tc.scalar(LR)
    losses, evals, step_times = [], [], []
    progress = tc.Progress(args.steps, "img", BATCH)
    t_train = time.perf_counter()
    for i, idx in enumerate(order):
        x, y = xa[idx], one_hot(ya[idx])
        t = time.perf_counter()
        result = program(x=x, y=y, lr=lr, **arrays)
        step_times.append(time.perf_counter() - t)
        losses.append(float(result["loss"]) + 0.0)
        progress.step(i + 1, losses[-1], step_times[-1])
        if (i + 1) % every == 0 or i + 1 == args.steps:
            acc = {"test": accuracy(program, params, xb, yb), "training": accuracy(program, params, xa, ya)}
            evals.append((i + 1, acc))
            progress.write(f"step {i + 1}: loss {losses[-1]:.4g}, accuracy: test {100 * acc['test']:.2f}%, "
                           f"training {100 * acc['training']:.2f}%")
    progress.close()
    wall = time.perf_counter() - t_train

    epochs = args.steps * BATCH / len(xa)
    print(f"test accuracy after {args.steps} steps ({epochs:.1f} epochs): {100 * evals[-1][1]['test']:.2f}% "
          f"of {len(xb)} images")
    print(f"training: {args.steps} steps in {tc.seconds(wall)} (with the evaluations); "
          f"median step {1e3 * np.median(step_times):.3f} ms")

    def torch_twin():
        _, step, _ = torch_trainer(start)
        return lambda i: step(xa[order[i]], one_hot(ya[order[i]]))
    measured = tc.compare_with_torch(args, "Adam", BATCH, 10 if args.quick else 100, torch_twin, losses, step_times)
    tc.save(args, program, arrays, "conv net on 8x8 digits, Adam in .tg", losses, evals,
            {"test_accuracy": evals[-1][1]["test"], "epochs": epochs, "wall_s": wall,
             "step_ms_median": 1e3 * float(np.median(step_times)), **measured})
    return 0


if __name__ == "__main__":
    sys.exit(main())
