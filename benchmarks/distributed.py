"""Data-parallel training steps over MPI on this machine: steps/s for 1, 2 and 3
processes, and the allreduce bandwidth over loopback (shared memory).

    python benchmarks/distributed.py                 # the table (runs mpirun itself)
    python benchmarks/distributed.py --json out.json # and every number
    python benchmarks/distributed.py --procs 1,2,4 --steps 100

The step is the sorting GPT's AdamW step (`examples/train_sort_gpt.tg`), one process per
rank, `Options(cpu=CpuOptions(threads=1))`, through `tgc.compile(..., data_parallel=MPI.COMM_WORLD)`:

- strong scaling: a global batch of 64 sequences split over the processes;
- weak scaling: 64 sequences on every process (a global batch of 64 x N).

Each run times `--steps` steps after 5 untimed ones, with a barrier before the clock
starts; it reports steps/s (rank 0's wall time), and the medians of the three parts of
a step (`DataParallel.last_times`), and rank 0's fastest and median step: phase 1 (forward and gradients), the reduction (the
allreduces, and the wait for the slowest rank), phase 2 (the AdamW updates).

The overlap run (`--overlap`, part of the default) compares, in the same processes and
interleaved (rounds of `--steps` / 6 steps each, so that the machine's load falls on both
alike), the step with its gradients in buckets of `--bucket-kib` KiB (default 64: the
GPT's 340 KB make 6 buckets) reduced after phase 1 (`overlap=False`) and while phase 1
runs (`overlap=True`), for the strong and the weak batch. "reduce ms" is then the
reduction's exposed part: the time from the end of phase 1 to the last bucket's sum.

The bandwidth run times `MPI.Allreduce` of float32 buffers from 4 KiB to 64 MiB and
prints the bus bandwidth 2 (N - 1) / N x bytes / time (NCCL's convention: what each
process moves through its link in a ring allreduce), from the fastest and the median of
the repetitions (each the slowest rank's time, after a barrier).

On a 2-core machine that other jobs share, expect no gain from more processes: they
divide the same two cores, and OpenMPI's waiting ranks poll. The numbers say what this
machine did, not what a cluster does; docs/distributed.md models that.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _worker(args) -> int:
    import numpy as np
    from mpi4py import MPI

    sys.path.insert(0, str(ROOT / "examples"))
    import train_sort_gpt as g

    import tgc

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    out: dict = {"procs": size}
    if args.what in ("steps", "all"):
        step = tgc.compile(g.TG, options=tgc.Options(cpu=tgc.CpuOptions(threads=1)), data_parallel=comm)
        train, _ = g.split(0)
        arrays = g.init(step, 0)
        rng = np.random.default_rng(1)
        for mode in ("strong", "weak"):
            rows = 64 if mode == "strong" else 64 * size
            batches = [g.batch(train[rng.integers(0, len(train), rows)]) for _ in range(8)]
            lr, wd = g.tc.scalar(1e-4), g.tc.scalar(1.0)
            for i in range(5):
                step(**step.shard_inputs(batches[i % 8]), **arrays, lr=lr, wd=wd)
            parts, times = [], []
            comm.Barrier()
            t = time.perf_counter()
            for i in range(args.steps):
                t0 = time.perf_counter()
                step(**step.shard_inputs(batches[i % 8]), **arrays, lr=lr, wd=wd)
                times.append(time.perf_counter() - t0)
                parts.append(step.last_times)
            wall = time.perf_counter() - t
            med = np.median(np.array(parts), axis=0) * 1e3
            out[mode] = {"global_batch": rows, "steps_per_s": args.steps / wall,
                         "sequences_per_s": args.steps * rows / wall, "phase1_ms": med[0],
                         "reduce_ms": med[1], "phase2_ms": med[2], "step_min_ms": 1e3 * min(times),
                         "step_median_ms": 1e3 * float(np.median(times))}
        out["gradient_bytes"] = step.gradient_bytes
    if args.what in ("overlap", "all"):
        out["overlap"] = _overlap_runs(args, comm, g, tgc, np)
    if args.what in ("bandwidth", "all") and size > 1:
        bw = {}
        for kib in (4, 64, 1024, 16384, 65536):
            n = kib * 256
            a = np.ones(n, np.float32)
            b = np.empty_like(a)
            reps = max(3, min(200, (64 << 20) // (kib << 10)))
            comm.Allreduce(a, b)
            times = []
            for _ in range(reps):
                comm.Barrier()
                t = time.perf_counter()
                comm.Allreduce(a, b)
                times.append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))   # the slowest rank's
            dt, med = min(times), float(np.median(times))
            bw[kib] = {"us": dt * 1e6, "median_us": med * 1e6, "bus_GBps": 2 * (size - 1) / size * n * 4 / dt / 1e9,
                       "bus_GBps_median": 2 * (size - 1) / size * n * 4 / med / 1e9}
        out["allreduce"] = bw
    if rank == 0:
        print("RESULT " + json.dumps(out))
    return 0


def _overlap_runs(args, comm, g, tgc, np) -> dict:
    """Steps with small buckets, reduced after phase 1 and while it runs, interleaved."""
    size = comm.Get_size()
    opts = tgc.Options(cpu=tgc.CpuOptions(threads=1))
    steps = {flag: tgc.compile(g.TG, options=opts, data_parallel=comm, bucket_bytes=args.bucket_kib << 10,
                               overlap=flag) for flag in (False, True)}
    train, _ = g.split(0)
    arrays = g.init(steps[False], 0)
    lr, wd = g.tc.scalar(1e-4), g.tc.scalar(1.0)
    rng = np.random.default_rng(2)
    out = {}
    for mode in ("strong", "weak"):
        rows = 64 if mode == "strong" else 64 * size
        batches = [g.batch(train[rng.integers(0, len(train), rows)]) for _ in range(8)]
        for step in steps.values():
            for i in range(5):
                step(**step.shard_inputs(batches[i % 8]), **arrays, lr=lr, wd=wd)
        per = max(1, args.steps // 6)
        times = {False: [], True: []}
        parts = {False: [], True: []}
        wall = {False: 0.0, True: 0.0}
        overlapped = {False: 0, True: 0}
        early = {False: [], True: []}
        for _ in range(6):
            for flag, step in steps.items():
                comm.Barrier()
                t = time.perf_counter()
                for i in range(per):
                    t0 = time.perf_counter()
                    step(**step.shard_inputs(batches[i % 8]), **arrays, lr=lr, wd=wd)
                    times[flag].append(time.perf_counter() - t0)
                    parts[flag].append(step.last_times)
                    overlapped[flag] += step.last_overlapped
                    early[flag].append(step.last_early_buckets)
                wall[flag] += time.perf_counter() - t
        out[mode] = {}
        for flag in (False, True):
            med = np.median(np.array(parts[flag]), axis=0) * 1e3
            n = len(times[flag])
            out[mode]["overlap" if flag else "serial"] = {
                "global_batch": rows, "steps_per_s": n / wall[flag], "step_min_ms": 1e3 * min(times[flag]),
                "step_median_ms": 1e3 * float(np.median(times[flag])), "phase1_ms": med[0], "reduce_ms": med[1],
                "phase2_ms": med[2], "overlapped_steps": overlapped[flag], "steps": n,
                "early_buckets_mean": float(np.mean(early[flag]))}
    out["buckets"] = steps[True].buckets
    return out


def _mpirun(n: int, what: str, steps: int, bucket_kib: int = 64) -> dict:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        env.pop(k, None)
    cmd = ["mpirun", "-n", str(n), "--oversubscribe", "--bind-to", "none", sys.executable, __file__,
           "--worker", what, "--steps", str(steps), "--bucket-kib", str(bucket_kib)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"mpirun -n {n} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


# Public link figures the model uses (not measured here): NCCL's bus bandwidth for a
# large allreduce and the latency of a small one.
LINKS = {
    # H200 SXM: NVLink 4, 900 GB/s per GPU (both directions); nccl-tests reach ~450 GB/s bus
    # bandwidth on 8 GPUs of one HGX node; a small allreduce takes ~15 us there
    "8 GPUs, NVLink 4 (one HGX H200 node)": (8, 450e9, 15e-6),
    # 8 nodes x 8 GPUs, one 400 Gb/s NDR InfiniBand port per GPU (50 GB/s; ~45 GB/s bus
    # bandwidth across nodes), a small allreduce ~40 us (tree across nodes)
    "64 GPUs, 8 nodes, NDR InfiniBand 400 Gb/s per GPU": (64, 45e9, 40e-6),
    # CPU nodes, one process each, 100 Gb/s (HDR100 InfiniBand / 100 GbE, ~11 GB/s),
    # latency 2 log2(N) hops of 3 us (recursive doubling)
    "8 CPU nodes, 100 Gb/s": (8, 11e9, 2 * 3 * 3e-6),
    "64 CPU nodes, 100 Gb/s": (64, 11e9, 2 * 6 * 3e-6),
}
LAUNCH_S = 4e-6        # one kernel launch on a GPU, as an order of magnitude (no CUDA graphs)


def compute_fit(repeats: int = 40) -> dict:
    """Phase 1 (forward and gradients) of the GPT step in this process, one thread, at
    batches 8 to 64: the fastest of `repeats` calls each, fitted as c0 + c1 x batch;
    phase 2 (the updates) likewise; and the gradient bytes."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "examples"))
    import train_sort_gpt as g

    import tgc
    from tgc import distributed as D

    step = tgc.compile(g.TG, options=tgc.Options(cpu=tgc.CpuOptions(threads=1)), data_parallel=D.local_group(1)[0])
    train, _ = g.split(0)
    arrays = g.init(step, 0)
    xs = [8, 16, 32, 64]
    calls = []
    for b in xs:
        inputs = {**g.batch(train[np.arange(b) % len(train)]), **arrays}
        calls.append({n: inputs[n] for n in step.grads._names})
    best = [float("inf")] * len(xs)
    for _ in range(repeats):            # interleaved, so that the machine's load falls on every batch alike
        for i, args in enumerate(calls):
            best[i] = min(best[i], _timed(lambda: step.grads.run(args)))
    ys = best
    c1, c0 = np.polyfit(xs, ys, 1)
    if c0 < 0:                          # a noisy fit: through the origin instead
        c0, c1 = 0.0, float(np.dot(xs, ys) / np.dot(xs, xs))
    first = step.grads.run({n: inputs[n] for n in step.grads._names})
    args2 = {n: first[n] if n in first else {**arrays, "lr": g.tc.scalar(1e-4), "wd": g.tc.scalar(1.0)}[n]
             for n in step.apply._names}
    apply_s = min(_timed(lambda: step.apply.run(args2)) for _ in range(repeats))
    grad_bytes = sum(int(first[n].nbytes) for n in step.split.boundary)
    from tgc import pipeline
    from tgc.backends.cuda import codegen, runtime

    def count(launches) -> int:
        """Kernel launches per call: a loop's body once per step (its `repeat` over the layers)."""
        return sum(lc.loop.trip * count(lc.body) if lc.loop is not None else 1 for lc in launches)

    launches = 0
    for module in (step.split.grads, step.split.apply):
        opts = tgc.Options()
        launches += count(codegen.generate(runtime.lower(pipeline.lower(module, opts).module, opts)).launches)
    return {"batches": xs, "phase1_s": ys, "c0_s": float(c0), "c1_s_per_seq": float(c1), "phase2_s": apply_s,
            "gradient_bytes": grad_bytes, "gpu_launches": launches}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def model(fit: dict) -> list[str]:
    """The scaling model's table (docs/distributed.md): a step on N ranks is phase 1 on
    its rows + the allreduce + phase 2, the allreduce L + 2 (N - 1) / N x bytes / bus
    bandwidth. CPU nodes: phase 1 as measured here (c0 + c1 x rows). GPUs: no GPU was
    measured; the step's floor is its kernel launches x LAUNCH_S (this small GPT is
    launch-bound at these batches), taken as its compute time at any batch."""
    S = fit["gradient_bytes"]
    rows = ["| ranks, links | allreduce of the gradients | step, batch 64 per rank (weak) | efficiency | "
            "step, global batch 64 (strong) | speed-up over 1 |", "|---|---|---|---|---|---|"]
    for name, (n, bw, lat) in LINKS.items():
        ar = lat + 2 * (n - 1) / n * S / bw
        if "GPU" in name:
            one = fit["gpu_launches"] * LAUNCH_S
            compute = lambda b: one   # noqa: E731 -- launch-bound
            apply = 0.0                # counted in the launches
        else:
            compute = lambda b: fit["c0_s"] + fit["c1_s_per_seq"] * b   # noqa: E731
            apply = fit["phase2_s"]
        t1 = compute(64) + apply
        weak = compute(64) + ar + apply
        strong = compute(64 / n) + ar + apply
        rows.append(f"| {name} | {1e6 * ar:.0f} us | {1e3 * weak:.2f} ms | {100 * t1 / weak:.0f}% | "
                    f"{1e3 * strong:.2f} ms | {t1 / strong:.1f}x |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", default="1,2,3", help="process counts (default 1,2,3)")
    ap.add_argument("--steps", type=int, default=60, help="timed steps per run (default 60)")
    ap.add_argument("--json", type=Path, help="write every number here")
    ap.add_argument("--model-only", action="store_true", help="only the scaling model (no mpirun)")
    ap.add_argument("--bucket-kib", type=int, default=64, help="bucket size of the overlap run (default 64)")
    ap.add_argument("--overlap-only", action="store_true", help="only the overlap run (no scaling model, bandwidth)")
    ap.add_argument("--worker", choices=("steps", "bandwidth", "overlap", "all"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.what = args.worker
        return _worker(args)
    import platform

    if args.overlap_only:
        results = [_mpirun(int(n), "overlap", args.steps, args.bucket_kib) for n in args.procs.split(",")]
        _print_overlap(results, args)
        if args.json:
            args.json.write_text(json.dumps({"load_average": os.getloadavg(), "steps": args.steps, "runs": results},
                                            indent=1))
        return 0
    fit = compute_fit()
    print("phase 1 of the GPT step, one process, one thread (fastest of 40): "
          + ", ".join(f"batch {b}: {1e3 * t:.2f} ms" for b, t in zip(fit["batches"], fit["phase1_s"]))
          + f"; fit {1e3 * fit['c0_s']:.3f} ms + {1e3 * fit['c1_s_per_seq']:.4f} ms per sequence; phase 2 "
          f"{1e3 * fit['phase2_s']:.3f} ms; gradients {fit['gradient_bytes']:,} bytes; "
          f"{fit['gpu_launches']} CUDA launches per step")
    print()
    print("\n".join(model(fit)))
    print()
    if args.model_only:
        return 0
    results = [_mpirun(int(n), "all", args.steps, args.bucket_kib) for n in args.procs.split(",")]
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, load average "
          f"{load[0]:.1f} (other jobs share it); GPT AdamW step (examples/train_sort_gpt.tg), "
          f"threads=1 per process, {args.steps} timed steps")
    print(f"gradient bytes reduced per step: {results[0]['gradient_bytes']:,}")
    print()
    print("| procs | scaling | global batch | steps/s | sequences/s | step min / median ms | phase 1 ms | "
          "reduce ms | phase 2 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for mode in ("strong", "weak"):
            m = r[mode]
            print(f"| {r['procs']} | {mode} | {m['global_batch']} | {m['steps_per_s']:.1f} | "
                  f"{m['sequences_per_s']:,.0f} | {m['step_min_ms']:.2f} / {m['step_median_ms']:.2f} | {m['phase1_ms']:.2f} | {m['reduce_ms']:.2f} | {m['phase2_ms']:.2f} |")
    print()
    print("| procs | allreduce size | time min / median | bus bandwidth (from min / median) |")
    print("|---|---|---|---|")
    for r in results:
        for kib, b in r.get("allreduce", {}).items():
            size = f"{int(kib) // 1024} MiB" if int(kib) >= 1024 else f"{kib} KiB"
            print(f"| {r['procs']} | {size} | {b['us']:.0f} / {b['median_us']:.0f} us | "
                  f"{b['bus_GBps']:.2f} / {b['bus_GBps_median']:.2f} GB/s |")
    print()
    _print_overlap(results, args)
    if args.json:
        args.json.write_text(json.dumps({"load_average": load, "steps": args.steps, "runs": results, "fit": fit},
                                        indent=1))
    return 0


def _print_overlap(results: list, args) -> None:
    load = os.getloadavg()
    first = next((r["overlap"]["buckets"] for r in results if r.get("overlap")), [])
    print(f"overlap: buckets of {args.bucket_kib} KiB ({len(first)} per step, full after phase 1's kernels "
          f"{', '.join(str(b[2]) for b in first)}), load average {load[0]:.1f}")
    print()
    print("| procs | scaling | global batch | reduction | steps/s | step min / median ms | phase 1 ms | "
          "exposed reduce ms | phase 2 ms | buckets done before phase 1 ended |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for mode in ("strong", "weak"):
            for which in ("serial", "overlap"):
                m = r["overlap"][mode][which]
                label = "after phase 1" if which == "serial" else \
                    f"during phase 1 ({m['overlapped_steps']}/{m['steps']} steps)"
                print(f"| {r['procs']} | {mode} | {m['global_batch']} | {label} | {m['steps_per_s']:.1f} | "
                      f"{m['step_min_ms']:.2f} / {m['step_median_ms']:.2f} | {m['phase1_ms']:.2f} | "
                      f"{m['reduce_ms']:.2f} | {m['phase2_ms']:.2f} | {m['early_buckets_mean']:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
