"""Each product of a step under CpuOptions variants, A/B in one process, by CPU time.

For a workload of `benchmarks/breakdown.py` (the nanoGPT-char AdamW step by default),
the program a timed call runs (`pipeline.specialized_module`: every size fixed) is
built once per variant with `CpuOptions(profile=True)` and the contention rule off
(`contention_memory_cycles=0`, as `benchmarks/thread_split.py` builds it). A variant is
`name:field=value,field=value` (CpuOptions fields; `base:` for the defaults). The calls
of the variants alternate (the order reversed every other round). After each call,
`Program.thread_profile()` gives each kernel's CPU time: thread 0's on one thread, and
the busier of thread 0 and the others on more threads. So the table holds on a shared
machine, where wall time would mostly measure the other processes. Each figure is the
least over the calls.

The products are grouped by their normalized shape: C'[P, Q] = A'[P, R] B'[R, Q],
batch x P x Q x R, with A' and B' stored N or T (`breakdown.product_shape`). For each
shape it prints ms and % of the FMA peak: `--peak` GFLOP/s per core, times the thread
count. Ms are summed over the kernels of that shape (a loop's step kernels over their
steps), and an epilogue counts in its product's time. `lost` is the first variant's
time less the time at the peak. The shapes losing most come first. Then the totals:
products, and all kernels.

    python benchmarks/product_ab.py base: spread:own_gemm_b_spread=False
    python benchmarks/product_ab.py --threads 2 --calls 8 base: p256:own_gemm_panel_rows=256
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def parse_variant(text: str) -> tuple[str, dict]:
    """('name', {field: value}) of `name:field=value,...`; values typed as the field's
    default (bools as True/False/1/0/on/off). A bad field or value: SystemExit."""
    from tgc.options import CpuOptions

    name, _, rest = text.partition(":")
    if not name:
        raise SystemExit(f"product_ab: variant {text!r}: no name (name:field=value,...)")
    fields = {f.name: f for f in dataclasses.fields(CpuOptions)}
    defaults = CpuOptions()
    changes = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if key not in fields or not eq:
            raise SystemExit(f"product_ab: variant {name!r}: CpuOptions has no field {key!r}" if key not in fields
                             else f"product_ab: variant {name!r}: {item!r} is not field=value")
        old = getattr(defaults, key)
        try:
            if isinstance(old, bool):
                low = value.lower()
                if low not in ("true", "false", "1", "0", "on", "off"):
                    raise ValueError(value)
                changes[key] = low in ("true", "1", "on")
            elif isinstance(old, (int, float, str)):
                changes[key] = type(old)(value)
            else:
                raise ValueError(value)
        except ValueError:
            raise SystemExit(f"product_ab: variant {name!r}: {value!r} is not a value of {key}") from None
    return name, changes


def measure(w, variants: dict, threads: int, calls: int) -> tuple[list, dict]:
    """(breakdown's kernel rows, {variant: [per kernel: least CPU ns over the calls]})."""
    import breakdown
    from tgc import pipeline
    from tgc.explain import _fixed_dims

    progs, arrays = {}, {}
    for name, changes in variants.items():
        opts = w.options.with_(cpu=w.options.cpu.with_(profile=True, threads=threads, contention_memory_cycles=0,
                                                       **changes))
        fixed = pipeline.specialized_module(w.module, w.dims, opts) if w.dims else w.module
        progs[name] = pipeline.compile_module(fixed, opts)
        arrays[name] = w.arrays(progs[name])
        progs[name](**arrays[name])   # warm: first-call work out of the timings
    low = progs[next(iter(progs))].lowered
    rows, _ = breakdown.kernel_rows(low, _fixed_dims(low))
    best = {name: [float("inf")] * len(rows) for name in progs}
    order = list(progs)
    for c in range(calls):
        for name in order if c % 2 == 0 else order[::-1]:
            progs[name].profile(reset=True)
            progs[name](**arrays[name])
            prof = progs[name].thread_profile()
            for i, row in enumerate(prof):
                spent = row[0] if threads == 1 else max(row[1], row[2])
                best[name][i] = min(best[name][i], spent)
    return rows, best


def report(rows, best: dict, threads: int, peak_gflops: float) -> dict:
    """Print the table (module docstring); returns {variant: (products ms, kernels ms)}."""
    names = list(best)
    peak = peak_gflops * 1e9 * threads
    shapes: dict[str, dict] = {}
    totals = {n: [0.0, 0.0] for n in names}
    for i, r in enumerate(rows):
        if r.loop:   # its step kernels have their rows
            continue
        for n in names:
            totals[n][1] += best[n][i] / 1e6
        if not r.product:
            continue
        s = shapes.setdefault(r.shape, {"flops": 0, "kernels": 0, **dict.fromkeys(names, 0.0)})
        s["flops"] += r.flops * r.times
        s["kernels"] += 1
        for n in names:
            s[n] += best[n][i] / 1e6
            totals[n][0] += best[n][i] / 1e6
    print(f"threads {threads}; load average {os.getloadavg()[0]:.2f}; CPU ms per call (least of the calls), "
          f"% of {peak_gflops:.1f} GFLOP/s x {threads}")
    print(f"  {'product (batch x P x Q x R, A B)':<34} {'kern':>4} " + " ".join(f"{n[:16]:>16} {'%':>5}" for n in names)
          + f" {'lost':>7}")

    def pct(flops, ms):
        return 100 * flops / (ms / 1e3) / peak if ms > 0 else 0.0
    for shape, s in sorted(shapes.items(), key=lambda kv: -(kv[1][names[0]] - kv[1]["flops"] / peak * 1e3)):
        lost = s[names[0]] - s["flops"] / peak * 1e3
        print(f"  {shape:<34} {s['kernels']:>4} " + " ".join(f"{s[n]:16.2f} {pct(s['flops'], s[n]):5.1f}" for n in names)
              + f" {lost:7.2f}")
    print("  products: " + ", ".join(f"{n} {totals[n][0]:.1f} ms" for n in names)
          + "; all kernels: " + ", ".join(f"{n} {totals[n][1]:.1f} ms" for n in names))
    return {n: tuple(v) for n, v in totals.items()}


def main(argv=None) -> int:
    import breakdown

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="+", help="name:field=value,... (CpuOptions fields; 'base:' the defaults)")
    ap.add_argument("--workload", choices=sorted(breakdown.WORKLOADS), default="nanogpt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=8, help="calls of each variant, alternated (default 8)")
    ap.add_argument("--peak", type=float, default=214.0, help="one core's FMA peak, GFLOP/s (benchmarks/gemm_peak.py)")
    args = ap.parse_args(argv)
    if args.threads < 1 or args.calls < 1:
        ap.error("--threads and --calls: at least 1")
    variants = dict(parse_variant(v) for v in args.variants)
    if len(variants) != len(args.variants):
        ap.error("variant names must differ")
    w = breakdown.WORKLOADS[args.workload]()
    print(f"== {w.title}; load average {os.getloadavg()[0]:.2f}")
    rows, best = measure(w, variants, args.threads, args.calls)
    report(rows, best, args.threads, args.peak)
    return 0


if __name__ == "__main__":
    sys.exit(main())
