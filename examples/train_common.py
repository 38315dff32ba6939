"""What the three training examples share: arguments, progress, plots, timing.

`train_sort_gpt.py`, `train_digits.py` and `train_wine.py` each compile one `.tg`
training step with `tgc.compile` and call it in a loop; this module holds the parts
that are not about the model. The optional packages of the `examples` extra
(`pip install -e '.[examples]'`: tqdm, matplotlib, scikit-learn) are used when
installed; without tqdm progress is printed as plain lines, without matplotlib the
plot is skipped with one note, and without torch the side-by-side timing is skipped
with one note. Nothing here changes what is trained: the losses and accuracies a
run prints depend only on `--seed` and `--steps` (tgc gives the same bits on any
number of threads).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def parser(name: str, doc: str, steps: int, quick_steps: int) -> argparse.ArgumentParser:
    """The arguments every example takes; `name` names its default output folder."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None,
                   help=f"training steps (default {steps}; {quick_steps} with --quick)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data split, the initial weights and the batches")
    p.add_argument("--out", type=Path, default=HERE / "out" / name,
                   help="folder for the parameters, the plot and summary.json (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="a few steps and a short PyTorch comparison: a smoke test that takes seconds")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch side-by-side timing")
    p.add_argument("--threads", type=int, default=0,
                   help="threads for tgc's step and for PyTorch (default 0: every core, each library's default)")
    p.add_argument("--autocast", choices=("bf16", "f16"), default=None,
                   help="mixed precision: tgc's matrix products on bf16/f16 operands, f32 accumulation")
    p.set_defaults(default_steps=steps, quick_steps=quick_steps)
    return p


def parse(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse `argv` and settle `steps` (the default depends on --quick)."""
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = args.quick_steps if args.quick else args.default_steps
    if args.steps < 1:
        p.error("--steps must be at least 1")
    from tgc.backends.cpu.options import CpuOptions
    try:   # the values CpuOptions takes (0: every core)
        CpuOptions(threads=args.threads)
    except ValueError as e:
        p.error(f"--threads: {e}")
    return args


def compile_step(path: Path, args, data_parallel=None):
    """`tgc.compile(path)` with --threads (and --autocast), printing how long it took (a
    first compile takes seconds; later runs find the code in tgc's cache). With
    `data_parallel` (a communicator) the step's batch is split over its ranks
    (tgc.distributed); only rank 0 prints."""
    import tgc
    t = time.perf_counter()
    options = tgc.Options(cpu=tgc.CpuOptions(threads=args.threads), autocast=getattr(args, "autocast", None))
    if data_parallel is None:
        program = tgc.compile(path, options=options)
    else:
        program = tgc.compile(path, options=options, data_parallel=data_parallel)
    if data_parallel is None or program.rank == 0:
        print(f"compiled {path.name} in {seconds(time.perf_counter() - t)}")
    return program


def scalar(value: float) -> np.ndarray:
    """`value` as a 0-d float32 array, the steps' scalar type. (A Python number would
    do as well: a call converts a scalar argument on its native fast path.)"""
    return np.asarray(value, np.float32)


def note(message: str) -> None:
    print(f"note: {message}", flush=True)


class Progress:
    """A progress bar over training steps showing the loss and the throughput (tqdm
    when installed; otherwise a plain line every `every` steps and at the end)."""

    def __init__(self, steps: int, unit: str, per_step: int):
        self.steps, self.unit, self.per_step = steps, unit, per_step
        self.every = max(1, steps // 10)
        self.busy = 0.0                      # seconds spent in training steps so far
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
            note("tqdm is not installed (pip install -e '.[examples]'): plain progress lines")
        else:
            self.bar = tqdm(total=steps, unit="step", dynamic_ncols=True, file=sys.stdout)

    def step(self, i: int, loss: float, seconds: float) -> None:
        """Step `i` (1-based) has finished with this loss after `seconds`; the
        throughput counts the time in steps only (not evaluations)."""
        self.busy += seconds
        rate = i * self.per_step / max(self.busy, 1e-9)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"loss {loss:.4g}, {rate:,.0f} {self.unit}/s", refresh=False)
        elif i % self.every == 0 or i == self.steps:
            print(f"step {i:>6}/{self.steps}  loss {loss:.4g}  {rate:,.0f} {self.unit}/s", flush=True)

    def write(self, line: str) -> None:
        """A line printed above the bar."""
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def plot(path: Path, title: str, losses: list[float], evals: list[tuple[int, dict[str, float]]]) -> None:
    """Write the training loss per step and the accuracies measured at `evals`
    ((step, {name: accuracy})) as two panels to `path` (skipped with a note when
    matplotlib is absent)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        note("matplotlib is not installed (pip install -e '.[examples]'): no plot")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    steps = np.arange(1, len(losses) + 1)
    a.plot(steps, losses, lw=0.6, alpha=0.5, label="per step")
    if len(losses) >= 20:
        k = max(2, len(losses) // 50)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        a.plot(steps[k - 1:], smooth, lw=1.5, label=f"mean of {k}")
    a.set_yscale("log")
    a.set_xlabel("step")
    a.set_ylabel("training loss")
    a.legend()
    lowest = 100.0
    for name in (evals[0][1] if evals else {}):
        values = [100 * e[name] for _, e in evals]
        b.plot([s for s, _ in evals], values, marker=".", label=name)
        lowest = min(lowest, *values)
    b.set_xlabel("step")
    b.set_ylabel("accuracy (%)")
    b.set_ylim(max(0.0, 10 * np.floor(lowest / 10) - 5), 100.5)
    b.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


def have_torch() -> bool:
    """Whether PyTorch is importable (it is only ever a peer to compare with)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def compare_with_torch(args, what: str, batch: int, steps: int, make_torch_step, losses: list[float],
                       step_times: list[float]) -> dict:
    """Train the PyTorch twin for `steps` steps, then print its loss beside tgc's and
    both median step times. `make_torch_step()` (called only when PyTorch is there)
    returns a function that takes step i, from the same initial weights as tgc and on
    the batch tgc's step i had, and returns its loss. Returns what it measured (empty
    when skipped: --no-torch, or PyTorch absent, with a note)."""
    if args.no_torch:
        return {}
    if not have_torch():
        note("PyTorch is not installed: no side-by-side step time")
        return {}
    k = min(steps, len(losses))
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    torch_step = make_torch_step()
    torch_losses, torch_times = [], []
    for i in range(k):
        t = time.perf_counter()
        torch_losses.append(torch_step(i))
        torch_times.append(time.perf_counter() - t)
    a, b = statistics.median(step_times[:k]), statistics.median(torch_times)
    print(f"PyTorch, the same model and {what} from the same weights on the same batches: loss at step {k} "
          f"{torch_losses[-1]:.4g} (tgc {losses[k - 1]:.4g})")
    print(f"step time, batch {batch} (median of the first {k} steps): tgc {1e3 * a:.3g} ms | "
          f"PyTorch eager {1e3 * b:.3g} ms | tgc/PyTorch {a / b:.2f}")
    return {"torch_steps": k, "torch_losses": torch_losses, "torch_step_ms": 1e3 * b, "tgc_step_ms_same_steps": 1e3 * a}


def save(args, program, arrays: dict, title: str, losses: list[float], evals: list, summary: dict) -> None:
    """Write to `args.out`: the params and states of `arrays` (`params.safetensors`,
    read back by `tgc.load_params`), the plot (`training.png`) and `summary.json`
    (the losses, the evaluations and `summary`)."""
    import json

    import tgc
    args.out.mkdir(parents=True, exist_ok=True)
    tgc.save_params(args.out / "params.safetensors", program, arrays)
    print(f"parameters{' and optimizer state' if any(s.kind == 'state' for s in program.inputs) else ''}: "
          f"{args.out / 'params.safetensors'}")
    plot(args.out / "training.png", title, losses, evals)
    record = {"steps": args.steps, "seed": args.seed, **summary, "losses": losses,
              "evaluations": [{"step": s, **acc} for s, acc in evals]}
    (args.out / "summary.json").write_text(json.dumps(record, indent=1) + "\n")


def seconds(t: float) -> str:
    return f"{t:.1f} s" if t < 120 else f"{t / 60:.1f} min"
