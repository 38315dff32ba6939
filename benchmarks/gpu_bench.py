"""The benchmark rows on a CUDA device: tgc's cuda backend against torch eager and
torch.compile on the same GPU, and the device's copy bandwidth; one table.

    python benchmarks/gpu_bench.py                      # on an NVIDIA GPU (CuPy, torch with CUDA)
    python benchmarks/gpu_bench.py --backend cuda-sim   # the small rows, emulated on this CPU

Every row's workload and inputs are `run.py`'s (`cases()`), and so are the torch
contenders (`peers_torch.py`), with their tensors created on the device. Before
timing, tgc's first call is compared with torch eager's (each common output within
2e-3 * max|torch|); a row that disagrees prints WRONG and is not timed. A sample is
the mean of enough calls to last 20 ms, bracketed by device synchronizations; the
median of `--repeat` samples is printed. On a GPU, tgc's calls replay a CUDA graph
(`CudaOptions.graphs`); the `no graph` column times the same program launching each
kernel, and `launches` counts the kernels and GEMM calls of one call without a
graph (row groups make a softmax or layernorm row one of them). `--compile` names the
rows also timed under torch.compile (each compiles cold: tens of seconds; gpu_check.sh
times only the GPT step so). Under cuda-sim only the small rows and the
MLP step run (the emulator runs each GPU thread one after another), torch runs on
the CPU, and the times say nothing about a GPU: the mode exists to test this script.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import run  # noqa: E402  (the workloads and their inputs)


def _device(backend):
    """(array module, synchronize, device name) for the backend."""
    if backend == "cuda":
        try:
            import cupy
            if cupy.cuda.runtime.getDeviceCount() < 1:
                raise RuntimeError("no device found")
        except Exception as e:  # noqa: BLE001 -- ImportError, CuPy's CUDARuntimeError and friends
            raise SystemExit(f"error: --backend cuda needs CuPy and an NVIDIA GPU ({e}); pip install -e '.[cuda]', "
                             f"or --backend cuda-sim for the same kernels on this CPU") from None
        return cupy, cupy.cuda.Device().synchronize, cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    return np, (lambda: None), "cuda-sim (this CPU)"


def _torch(backend):
    """torch and its device, with peers_torch's tensors made there; None if torch is absent."""
    try:
        import torch
    except ImportError:
        return None, None
    dev = "cuda" if backend == "cuda" else "cpu"
    if dev == "cuda" and not torch.cuda.is_available():
        return None, None
    import peers_torch
    if dev == "cuda":
        from_numpy = torch.from_numpy
        torch.from_numpy = lambda a: from_numpy(a).to(dev)   # peers_torch's arrays, on the device
        torch.set_default_device(dev)
    return (torch, dev, peers_torch), dev


def timed(step, sync, repeat, sample_s=0.02):
    step()
    sync()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < sample_s or n < 3:
        step()
        n += 1
    sync()
    calls = max(3, int(n * sample_s / max(time.perf_counter() - t0, 1e-9)))
    samples = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        sync()
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def copy_bandwidth(xp, sync, repeat):
    a = xp.ones(1 << 26, np.float32)    # 256 MiB
    b = xp.empty_like(a)
    t = timed(lambda: b.__setitem__(Ellipsis, a), sync, repeat)
    return 2 * a.nbytes / t


def wanted(spec: str, workload: str) -> bool:
    """Whether `--compile`'s value names the workload."""
    return spec == "all" or workload in spec.split(",")


def fmt(t):
    return "n/a" if t is None else f"{t * 1e3:9.3f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["cuda", "cuda-sim"], default="cuda")
    ap.add_argument("--only", help="comma-separated workloads")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--compile", default="all",
                    help="workloads timed under torch.compile too, comma-separated, 'all' or 'none' (each row "
                         "compiles cold: tens of seconds)")
    args = ap.parse_args(argv)
    import tgc

    xp, sync, name = _device(args.backend)
    tt, _ = _torch(args.backend)
    rng = np.random.default_rng(0)
    cases = run.cases()
    if args.backend == "cuda-sim":
        cases = [c for c in cases if c.kind == "small" or c.workload == "mlp"]
    if args.only:
        cases = [c for c in cases if c.workload in args.only.split(",")]
    bw = copy_bandwidth(xp, sync, args.repeat)
    print(f"device: {name}; copy bandwidth {bw / 1e9:.0f} GB/s; backend {args.backend}")
    head = (f"{'workload':<10} {'size':<20} {'tgc ms':>9} {'no graph':>9} {'launches':>8} {'eager ms':>9} "
            f"{'compile ms':>10}  {'tgc rate':>16}  status")
    print(head)
    print("-" * len(head))
    for case in cases:
        arrays = case.inputs(rng)
        status, times = "ok", {}
        try:
            prog = tgc.compile(str(run.WORK / f"{case.workload}.tg"), backend=args.backend, dtype="f32")
            dev_arrays = {k: xp.asarray(v) for k, v in arrays.items()}
            out = prog(**dev_arrays)
            got = {k: np.asarray(v.get() if hasattr(v, "get") else v) for k, v in out.items()}
        except Exception as e:  # noqa: BLE001 -- a row that fails says why and the table goes on
            print(f"{case.workload:<10} {case.size:<20} n/a ({run.short_error(e)})")
            continue
        if tt is not None:
            torch, dev, peers = tt
            for compiled in (False, True):
                if compiled and (args.backend == "cuda-sim" or not wanted(args.compile, case.workload)):
                    continue   # torch.compile on the CPU is not what this script measures
                try:
                    step = peers.make(case.workload, run.copy_arrays(arrays), compiled)
                    ref = {k: v.detach().cpu().numpy() for k, v in step().items() if hasattr(v, "detach")}
                    sync_t = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
                    times["compile" if compiled else "eager"] = timed(step, sync_t, args.repeat)
                except Exception as e:  # noqa: BLE001
                    status = f"torch{'.compile' if compiled else ''}: {run.short_error(e)}"
                    continue
                if not compiled and not case.updates:
                    for k in set(ref) & set(got):
                        scale = float(np.max(np.abs(ref[k]))) or 1.0
                        if np.max(np.abs(got[k] - ref[k])) > 2e-3 * scale:
                            status = f"WRONG ({k})"
        if not status.startswith("WRONG"):
            times["tgc"] = timed(lambda: prog(**dev_arrays), sync, args.repeat)
            if args.backend == "cuda":
                from tgc.options import Options

                plain = tgc.compile(str(run.WORK / f"{case.workload}.tg"), backend=args.backend, dtype="f32",
                                    options=Options().with_(graphs=False))
                times["nograph"] = timed(lambda: plain(**dev_arrays), sync, args.repeat)
                if prog._kernels.graph_counts["replays"] == 0:
                    status = "no graph" if status == "ok" else status
        launches = len(prog.cuda_module.launches)
        t = times.get("tgc")
        kind, amount = case.bound
        rate = "" if t is None else (f"{amount / t / 1e9:7.1f} GB/s ({amount / t / bw:4.0%})" if kind == "bw"
                                     else f"{amount / t / 1e9:7.1f} GFLOP/s")
        print(f"{case.workload:<10} {case.size:<20} {fmt(t)} {fmt(times.get('nograph'))} {launches:>8} "
              f"{fmt(times.get('eager'))} "
              f"{fmt(times.get('compile')):>10}  {rate:>16}  {status}", flush=True)


if __name__ == "__main__":
    main()
