"""Train the README's MLP (`examples/mlp.tg`) on the wine data with tgc.

    python examples/train_wine.py                     # the full run (see README, "Training")
    python examples/train_wine.py --quick             # a smoke test: a few steps

The step is `mlp.tg`, the README's program: 13 features -> 64 hidden units (relu) ->
3 classes, softmax cross-entropy, one SGD step on every parameter per call. The data
are the UCI wine recognition data (178 wines, 3 cultivars) from
`sklearn.datasets.load_wine` when scikit-learn is installed; otherwise the synthetic
stand-in of the same shape in `benchmarks/data/wine.csv`, with a note. A quarter,
stratified by class and chosen by `--seed`, is the test set; the features are
standardized with the training set's mean and spread. Each step trains on a
minibatch of 32 wines.

Accuracy comes from the program's own `correct` output, with the forward-only call
(`program.run(..., updates=False)`). Writes `params.safetensors` and `training.png` to
`--out`; with PyTorch installed, trains the same model with `torch.optim.SGD` from the
same weights on the same batches for a few steps and prints both step times.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_common as tc  # noqa: E402

import tgc  # noqa: E402

TG = tc.HERE / "mlp.tg"
CSV = tc.HERE.parent / "benchmarks" / "data" / "wine.csv"
BATCH, LR = 32, 0.05


def load(seed: int):
    """(x_train, y_train, x_test, y_test, source): standardized features, one-hot labels."""
    try:
        from sklearn.datasets import load_wine
    except ImportError:
        tc.note("scikit-learn is not installed (pip install -e '.[examples]'): training on the synthetic "
                f"stand-in {CSV.relative_to(tc.HERE.parent)}, not the real wine data")
        raw = np.loadtxt(CSV, delimiter=",", skiprows=1)
        x, labels, source = raw[:, :13], raw[:, 13:].argmax(1), "synthetic stand-in (benchmarks/data/wine.csv)"
    else:
        data = load_wine()
        x, labels, source = data.data, data.target, "UCI wine (sklearn.datasets.load_wine)"
    rng = np.random.default_rng([seed, 0])
    test = np.zeros(len(x), bool)
    for c in np.unique(labels):                     # a quarter of each class, stratified
        members = rng.permutation(np.flatnonzero(labels == c))
        test[members[:round(len(members) / 4)]] = True
    mu, sd = x[~test].mean(0), x[~test].std(0)
    x = ((x - mu) / sd).astype(np.float32)
    y = np.eye(3, dtype=np.float32)[labels]
    return x[~test], y[~test], x[test], y[test], source


def init(program: tgc.Program, seed: int) -> dict[str, np.ndarray]:
    """He-normal weights (std sqrt(2 / fan-in)), zero biases."""
    rng = np.random.default_rng([seed, 1])
    return {s.name: (np.sqrt(2 / s.shape[0]) * rng.standard_normal(s.shape) if s.name.startswith("W")
                     else np.zeros(s.shape)).astype(np.float32)
            for s in program.inputs if s.kind == "param"}


def accuracy(program: tgc.Program, params: dict, x: np.ndarray, y: np.ndarray) -> float:
    """The mean of the program's `correct` output, from the forward-only call."""
    return float(np.mean(program.run({"x": x, "y": y, **params}, updates=False)["correct"]))


# ---------------------------------------------------------------- PyTorch, the same model

def torch_trainer(params: dict, dtype="float32"):
    """(P, step, optimizer): PyTorch copies of `params`, a function that takes one SGD
    step (torch.optim.SGD, lr LR) on (x, one-hot y) and returns the loss before it, and
    the optimizer."""
    import torch
    import torch.nn.functional as F
    P = {k: torch.tensor(v, dtype=getattr(torch, dtype), requires_grad=True) for k, v in params.items()}
    opt = torch.optim.SGD(list(P.values()), lr=LR, foreach=True)

    def step(x: np.ndarray, y: np.ndarray) -> float:
        opt.zero_grad(set_to_none=True)
        h = F.relu(torch.from_numpy(x).to(P["W1"].dtype) @ P["W1"] + P["b1"])
        loss = F.cross_entropy(h @ P["W2"] + P["b2"], torch.from_numpy(y).to(P["W1"].dtype))
        loss.backward()
        opt.step()
        return loss.item()
    return P, step, opt


# ---------------------------------------------------------------- the run

def main(argv=None) -> int:
    args = tc.parse(tc.parser("wine", __doc__, steps=300, quick_steps=20), argv)
    xa, ya, xb, yb, source = load(args.seed)
    program = tc.compile_step(TG, args)
    print(f"data: {source}, {len(xa)} training wines, {len(xb)} test wines")

    params = init(program, args.seed)
    start = {k: v.copy() for k, v in params.items()}
    rng = np.random.default_rng([args.seed, 2])
    order = [rng.choice(len(xa), BATCH, replace=False) for _ in range(args.steps)]
    every = max(1, min(25, args.steps // (3 if args.quick else 10)))

    lr = tc.scalar(LR)
    losses, evals, step_times = [], [], []
    progress = tc.Progress(args.steps, "wine", BATCH)
    t_train = time.perf_counter()
    for i, idx in enumerate(order):
        t = time.perf_counter()
        result = program(x=xa[idx], y=ya[idx], lr=lr, **params)
        step_times.append(time.perf_counter() - t)
        losses.append(float(result["loss"]) + 0.0)
        progress.step(i + 1, losses[-1], step_times[-1])
        if (i + 1) % every == 0 or i + 1 == args.steps:
            acc = {"test": accuracy(program, params, xb, yb), "training": accuracy(program, params, xa, ya)}
            evals.append((i + 1, acc))
            progress.write(f"step {i + 1}: loss {losses[-1]:.4g}, accuracy: test {100 * acc['test']:.1f}%, "
                           f"training {100 * acc['training']:.1f}%")
    progress.close()
    wall = time.perf_counter() - t_train

    print(f"test accuracy after {args.steps} steps: {100 * evals[-1][1]['test']:.1f}% of {len(xb)} wines")
    print(f"training: {args.steps} steps in {tc.seconds(wall)} (with the evaluations); "
          f"median step {1e3 * np.median(step_times):.3f} ms")

    def torch_twin():
        _, step, _ = torch_trainer(start)
        return lambda i: step(xa[order[i]], ya[order[i]])
    measured = tc.compare_with_torch(args, "SGD", BATCH, 10 if args.quick else 100, torch_twin, losses, step_times)
    tc.save(args, program, params, "MLP (mlp.tg) on the wine data, SGD", losses, evals,
            {"data": source, "test_accuracy": evals[-1][1]["test"], "wall_s": wall,
             "step_ms_median": 1e3 * float(np.median(step_times)), **measured})
    return 0


if __name__ == "__main__":
    sys.exit(main())
