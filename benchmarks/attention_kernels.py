"""Where a streamed attention's time goes, per kind of kernel, under several options.

For a row of `attention.py` (causal attention of heads of 64, forward and gradients),
each variant's program is built with the per-kernel counters (`CpuOptions(profile=True)`)
and the contention rule off (`contention_memory_cycles=0`: every kernel over its
threshold runs in a region, as on a quiet machine), and the variants' calls alternate in
one process. Of each variant's calls, the one with the least CPU time of the calling
thread (`time.thread_time`, robust to other processes' load) is reported:

- `thread 0`: that call's CPU time on the calling thread (on N threads: its busy time,
  plus starting and ending regions and spinning while it waits for the others);
- `busy`: per thread, the busy time summed over the kernels of the loops' steps
  (`Program.thread_profile()`; thread 0's, and the other threads' summed);
- the step kernels' thread-0 busy time (and on N threads the others') by kind: products (`gemm`, each product of the
  step once, its copies in the causal runs and the key loops summed: the block edges'
  `.N` suffixes dropped), loop groups (`group`), and single loops by their expression.

A product's FLOPs are the same in every variant that computes it; its time is not: the
stream over rows reads `[B, s]` weights and their cotangents from L3 where a key block's
`[B, Bs]` tiles stay in L2 (docs/optimization.md, "Streaming over blocks of the keys").

    python benchmarks/attention_kernels.py --t 8192                      # off against key blocks, 1 thread
    python benchmarks/attention_kernels.py --t 8192 --wide --threads 2 --calls 2
    python benchmarks/attention_kernels.py --t 4096 --variant off= --variant k512=stream_key_block=512,stream_key_rows=256
    python benchmarks/attention_kernels.py --t 8192 --wide --variant off=cpu.own_gemm_copy_a_rows=0 --variant on=
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention  # noqa: E402

DEFAULT_VARIANTS = ["off=", "keys=stream_key_block=512,stream_key_rows=256"]


def parse_variant(text: str) -> tuple[str, dict]:
    """`name=key=value,key=value` -> (name, {key: int value})."""
    name, _, rest = text.partition("=")
    fields = {}
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        fields[k] = int(v)
    return name, fields


def kind(name: str) -> str:
    """A kernel's kind: its product with the block edges' suffixes dropped, `group`, or a
    loop's expression with its buffers' names dropped."""
    if name.startswith("gemm"):
        return re.sub(r"\.\d+", "", name.split(" batch(")[0])
    if name.startswith("loop"):
        body = name.split("=", 1)[1] if "=" in name else name
        return "loop " + re.sub(r"%\w+(\.\d+)?", "%", re.sub(r"\[[^\]]*\]", "", body)).strip()[:80]
    return name.split()[0]


def main() -> None:
    import tgc
    from tgc.options import Options

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t", type=int, default=8192, choices=sorted(attention.ROWS))
    ap.add_argument("--wide", action="store_true", help="attention.py's wide row at --t")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--variant", action="append", default=None,
                    help="NAME=OPTION=N,OPTION=N (Options fields, cpu.OPTION for CpuOptions ones; repeatable; "
                         "default: off and key blocks)")
    args = ap.parse_args()
    variants = dict(parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS))
    a = attention.arrays(args.t, wide=args.wide)
    progs = {}
    for name, fields in variants.items():
        o = Options(**{k: v for k, v in fields.items() if not k.startswith("cpu.")})
        cpu = {k[4:]: v for k, v in fields.items() if k.startswith("cpu.")}   # CpuOptions fields (0/1 for a bool)
        cpu = {k: bool(v) if isinstance(getattr(o.cpu, k), bool) else v for k, v in cpu.items()}
        o = o.with_(cpu=o.cpu.with_(threads=args.threads, profile=True, contention_memory_cycles=0, **cpu))
        progs[name] = tgc.compile(attention.source(args.t, args.wide), backend="cpu", dtype="f32", options=o)
        progs[name](**a)
    best: dict[str, tuple] = {}
    for c in range(args.calls):
        for name in (list(progs) if c % 2 == 0 else list(progs)[::-1]):
            p = progs[name]
            p.profile(reset=True)
            start = time.thread_time()
            p(**a)
            spent = time.thread_time() - start
            if name not in best or spent < best[name][0]:
                own = len(p.profile())
                names = [r[2] for r in sorted(p.profile(), key=lambda r: r[1])] + [r[1] for r in p.step_profile()]
                best[name] = (spent, p.thread_profile(), names, own)
    heads, batch = attention.row_shape(args.t, args.wide)
    print(f"t = {args.t}, {heads} heads x batch {batch}, {args.threads} thread(s), least of {args.calls} calls")
    for name, (spent, prof, names, own) in best.items():
        # the loops' step kernels; a loop inside a step (its counter holds its own step's
        # kernels) is left out, its kernels counted themselves
        steps = [(r, n) for r, n in zip(prof[own:], names[own:]) if not n.startswith("steps")]
        busy0, busy1 = sum(r[1] for r, _ in steps), sum(r[2] for r, _ in steps)
        print(f"{name} {variants[name]}: thread 0 {1e3 * spent:.1f} ms; "
              f"busy thread 0 {busy0 / 1e6:.1f} ms, others {busy1 / 1e6:.1f} ms")
        by, other = collections.Counter(), collections.Counter()
        for r, n in steps:
            by[kind(n)] += r[1]
            other[kind(n)] += r[2]
        for k, ns in by.most_common(args.top):
            print(f"  {ns / 1e6:8.1f} ms" + (f" {other[k] / 1e6:8.1f} ms" if args.threads > 1 else "") + f"  {k}")


if __name__ == "__main__":
    main()
