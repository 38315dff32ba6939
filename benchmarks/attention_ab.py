"""Paired, interleaved timing of attention.py's rows under several stream settings.

On a shared machine one program's median moves by 2x between runs; calling the
programs in turn within one process, and keeping each one's minimum, compares them
under the same load. Programs: `off` (`Options(stream_block=0)`: whole [t, s]
matrices), `noskip` (`Options(stream_mask_groups=0)`: one loop over every key, streamed
from 16M elements), `default` (`Options()`: the causal mask's loops skip the masked
keys, streamed from 4M elements), and torch SDPA with autograd.

    python benchmarks/attention_ab.py 1024,2048 10     # rows, rounds
"""
from __future__ import annotations

import sys
from pathlib import Path
import time

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention  # noqa: E402


def main(rows: list[int], rounds: int) -> None:
    import torch

    import tgc
    from tgc.options import Options

    torch.set_num_threads(2)
    configs = {"off": Options(stream_block=0),
               "noskip": Options(stream_mask_groups=0),
               "default": Options()}
    for t in rows:
        a = attention.arrays(t)
        calls = {}
        for name, options in configs.items():
            program = tgc.compile(attention.source(t), "cpu", "f32", options=options)
            calls[name] = (lambda p=program: p(**a))
        calls["torch"] = attention.torch_step(a)
        for f in calls.values():
            f()
        times: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(rounds):
            for name, f in calls.items():
                start = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - start)
        print(t, "min ms", {k: round(1e3 * min(v)) for k, v in times.items()},
              "median ms", {k: round(1e3 * float(np.median(v))) for k, v in times.items()}, flush=True)


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1].split(",")], int(sys.argv[2]) if len(sys.argv) > 2 else 10)
