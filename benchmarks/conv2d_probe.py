"""2-D convolution probe: cold compile times and step times against PyTorch eager.

    python benchmarks/conv2d_probe.py compile FILE.tg...   # cold compile, split by stage
    python benchmarks/conv2d_probe.py run [--batch 16] [--rounds 5] [--only NAME,...] [--spin-only]
    python benchmarks/conv2d_probe.py kernels [--rounds 20] [NAME:OPTION=VALUE,... ...]
    python benchmarks/conv2d_probe.py paired [--threads 1] [--seconds 8] [NAME:OPTION=VALUE,...]

`compile`: for each file, in a fresh process with an empty cache, the front end, the
IR passes, the lowering stages and code generation with LLVM, and the lines of LLVM
IR. `run`: benchmarks/workloads/conv2d.tg (batch x 32 -> 64 channels, 32 x 32, 3 x 3,
padding 1: y, dx and dK) with a symbolic batch (`tgc`), with the batch fixed in the file
(`tgc-fixed`), and benchmarks/workloads/conv2d_sym.tg, every size symbolic
(`tgc-symbolic`: timed once the runtime runs its specialization to these sizes, when it
has one; tgc.runtime.specialize), against torch.nn.functional.conv2d and autograd
(float32). Every contender runs in a
process of its own, once with its own defaults and once with GOMP_SPINCOUNT=10000
for all (libgomp's default spinning helps or hurts with the machine's load); the
processes take turns `--rounds` times, and each reports the time per call of
samples of at least 0.2 s; the table shows the minimum and median over all samples.
The machine is shared: repeat, and read minima.

`kernels`: conv2d_sym.tg specialized to 16 x 32 -> 64, 32 x 32 (the program a timed
call runs), on one thread, per kernel: the least per-thread CPU time of one call
(`Program.thread_profile`, differences between calls; `CpuOptions(profile=True)`,
which runs no merged regions and no pairs) and the whole call's least per-thread CPU
time (the same program without the counters), for each variant: a name and
CpuOptions fields (`base:` is the defaults; `t1:gemm_tiles=1`), the variants'
calls alternated in one process, so that the load falls on all of them alike.
Per-thread CPU time leaves out what other processes took, not what they evicted from
the caches: compare variants of one run. A variant differs by options only (the
on-disk cache keys code by the options and tgc's source, not by a module global).

`paired`: the program a timed call runs (no counters: pairs and merged regions as
they are; `kernels` unpairs the input gradient's product and its column sum, whose
sum then reads 6.3 MB from memory instead of 393 kB an image from L2), on `--threads`
threads, called in a loop for `--seconds` under `perf record` (Linux perf, on PATH;
the loop's process writes /tmp/perf-PID.map, so that perf names the JIT's functions);
prints each function's share of the samples in tgc's code and, on one thread, that
share of the call's least thread time (on more, the least process time, which counts
the thread pool's spinning, beside the shares). Function
names: `tgc.kN` a loop kernel (its `.work` a GEMM's tile driver, its `.own` an
implicit GEMM's copy of the own kernel), `tgc.gemm.own.f32.bR.vV` the own kernel
(`.taps`: all taps in one call).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# OpenBLAS reads these when numpy loads; they slow a current numpy (PLATFORM.md): this
# process and its children only, as benchmarks/run.py does.
for _v in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
    os.environ.pop(_v, None)

HERE = Path(__file__).resolve().parent
CONV2D = HERE / "workloads" / "conv2d.tg"
CONV2D_SYM = HERE / "workloads" / "conv2d_sym.tg"
NAMES = ("tgc", "tgc-fixed", "tgc-symbolic", "torch")


def _inputs(batch: int):
    import numpy as np
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((batch, 32, 32, 32)).astype(np.float32),
            "dy": rng.standard_normal((batch, 64, 32, 32)).astype(np.float32),
            "K": (rng.standard_normal((64, 32, 3, 3)) / math.sqrt(32 * 9)).astype(np.float32)}


def _fixed_source(batch: int) -> str:
    text = CONV2D.read_text()
    fixed = text.replace("\ndim batch\n", f"\ndim batch = {batch}\n")
    assert fixed != text, "conv2d.tg no longer declares 'dim batch' on a line of its own"
    return fixed


def _samples(step, count: int) -> list[float]:
    step()
    out = []
    for _ in range(count):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.2:
            step()
            n += 1
        out.append((time.perf_counter() - t0) / n)
    return out


def worker(name: str, batch: int, count: int) -> None:
    """One contender's samples, as JSON on stdout."""
    a = _inputs(batch)
    if name == "torch":
        import torch
        import torch.nn.functional as F
        x, K, dy = torch.tensor(a["x"], requires_grad=True), torch.tensor(a["K"], requires_grad=True), \
            torch.tensor(a["dy"])

        def step():
            y = F.conv2d(x, K, padding=1)
            return torch.autograd.grad(y, (x, K), dy)
    else:
        import tgc
        source = {"tgc": str(CONV2D), "tgc-symbolic": str(CONV2D_SYM)}.get(name) or _fixed_source(batch)
        prog = tgc.compile(source)

        def step():
            return prog(**a)
        if name == "tgc-symbolic" and hasattr(prog, "variants"):
            t0 = time.perf_counter()   # calls until the specialization runs (at most 20 s)
            while prog.last_variant is None and time.perf_counter() - t0 < 20 and \
                    not any(v.refused for v in prog.variants()):
                step()
            print(f"{name}: {prog.variants()}", file=sys.stderr)
    print(json.dumps(_samples(step, count)))


def run(args) -> None:
    names = [n for n in NAMES if args.only is None or n in args.only.split(",")]
    # libgomp's spinning: each process's own default, and GOMP_SPINCOUNT=10000 for all
    # (tgc's runtime default; benchmarks/run.py's setting), which favours neither
    settings = {"default": {}, "spin 10000": {"GOMP_SPINCOUNT": "10000"}}
    if args.spin_only:
        del settings["default"]
    samples = {(n, s): [] for s in settings for n in names}
    notes: dict[str, list[str]] = {}   # what a contender's last process said (tgc-symbolic: its variants)
    with tempfile.TemporaryDirectory() as cache:   # each tgc program compiles once, then hits
        for _ in range(args.rounds):
            for s, extra in settings.items():
                env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
                env.update(extra, TGC_CACHE_DIR=cache)
                for n in names:
                    cmd = [sys.executable, __file__, "worker", n, str(args.batch), str(args.samples)]
                    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
                    samples[n, s] += json.loads(done.stdout.strip().splitlines()[-1])
                    notes[n] = [line for line in done.stderr.splitlines() if line.startswith(f"{n}: ")]
    print(f"conv2d {args.batch} x 32 -> 64, 32 x 32, 3 x 3, padding 1 (y, dx, dK), f32; "
          f"{args.rounds} rounds x {args.samples} samples per contender and setting")
    for s in settings:
        base = min(samples["torch", s]) if "torch" in names else None
        for n in names:
            t = samples[n, s]
            ratio = f"  min / torch min {min(t) / base:5.2f}" if base else ""
            print(f"  {s:10s} {n:12s} min {min(t) * 1e3:7.2f} ms  median {statistics.median(t) * 1e3:7.2f} ms{ratio}")
    for lines in notes.values():
        for line in lines:
            print(f"  {line}")


KERNEL_DIMS = {"nb": 16, "cin": 32, "cout": 64, "hh": 32, "ww": 32}


def _variant(options, spec: str):
    """(name, options) of a `name:field=value,...` variant (CpuOptions fields)."""
    name, _, rest = spec.partition(":")
    over = {}
    for kv in filter(None, rest.split(",")):
        key, _, value = kv.partition("=")
        if not hasattr(options.cpu, key):
            raise SystemExit(f"conv2d_probe: CpuOptions has no field {key!r}")
        cur = getattr(options.cpu, key)
        over[key] = value in ("1", "true", "True") if isinstance(cur, bool) else type(cur)(value)
    return name or spec, options.with_(cpu=options.cpu.with_(**over))


def kernel_minima(specs, rounds: int, dims=None, batch_arrays=None):
    """{variant: (per-kernel least thread time in s, least call thread time in s)} and
    the kernels' first lines, for conv2d_sym.tg at `dims` on one thread (see the module)."""
    sys.path.insert(0, str(HERE))
    import breakdown
    import numpy as np

    dims = dict(dims or KERNEL_DIMS)
    module, options = breakdown.optimized(str(CONV2D_SYM))
    rng = np.random.default_rng(0)
    a = batch_arrays or {
        "x": rng.standard_normal((dims["nb"], dims["cin"], dims["hh"], dims["ww"])).astype(np.float32),
        "dy": rng.standard_normal((dims["nb"], dims["cout"], dims["hh"], dims["ww"])).astype(np.float32),
        "K": (rng.standard_normal((dims["cout"], dims["cin"], 3, 3)) / math.sqrt(dims["cin"] * 9)).astype(np.float32)}
    state = {}
    for spec in specs or ["base:"]:
        name, opts = _variant(options, spec)
        prof = breakdown.build(module, dims, opts, True, 1)
        plain = breakdown.build(module, dims, opts, False, 1)
        prof(**a)
        plain(**a)
        state[name] = [prof, plain, [t[0] for t in prof.thread_profile()], None, math.inf]
    for _ in range(rounds):
        for st in state.values():
            prof, plain = st[0], st[1]
            prof(**a)
            now = [t[0] for t in prof.thread_profile()]
            d = [(x - y) / 1e9 for x, y in zip(now, st[2])]
            st[2] = now
            st[3] = d if st[3] is None else [min(x, y) for x, y in zip(st[3], d)]
            t0 = time.thread_time()
            plain(**a)
            st[4] = min(st[4], time.thread_time() - t0)
    first = next(iter(state.values()))[0]
    names = [k.text().splitlines()[0] for k in first.lowered.kernels]
    return {n: (st[3], st[4]) for n, st in state.items()}, names


def kernels(args) -> None:
    out, names = kernel_minima(args.variants, args.rounds)
    print(f"conv2d_sym {KERNEL_DIMS}, one thread: least thread time per kernel (ms) over {args.rounds} calls; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("       " + " ".join(f"{n[:9]:>9s}" for n in out) + "  kernel")
    for i, line in enumerate(names):
        print(f"  k{i:<3d} " + " ".join(f"{v[0][i] * 1e3:9.3f}" for v in out.values()) + f"  {line[:70]}")
    print("  sum  " + " ".join(f"{sum(v[0]) * 1e3:9.3f}" for v in out.values()))
    print("  call " + " ".join(f"{v[1] * 1e3:9.3f}" for v in out.values()) + "  (without the counters)")


def perf_map(prog, path: str) -> int:
    """Write `prog`'s JIT functions as a perf map (`START SIZE NAME` a line, hex; each
    function's size taken as the distance to the next one's start); their count."""
    import re
    jit = prog._kernels._jit
    found = []
    for name in set(re.findall(r'^define [^@]*@"?([\w.$-]+)"?\(', prog.llvm_ir, re.M)):
        try:
            found.append((jit.address(name), name))
        except (KeyError, RuntimeError):
            continue
    found.sort()
    with open(path, "w") as f:
        for i, (addr, name) in enumerate(found):
            size = found[i + 1][0] - addr if i + 1 < len(found) else 1 << 16
            f.write(f"{addr:x} {min(size, 1 << 20):x} {name}\n")
    return len(found)


def paired_child(args) -> None:
    """The loop `paired` records: build, write the perf map, call for `args.seconds`."""
    sys.path.insert(0, str(HERE))
    import breakdown
    import numpy as np

    module, options = breakdown.optimized(str(CONV2D_SYM))
    _, opts = _variant(options, args.variant or "base:")
    prog = breakdown.build(module, KERNEL_DIMS, opts, False, args.threads)
    rng = np.random.default_rng(0)
    d = KERNEL_DIMS
    a = {"x": rng.standard_normal((d["nb"], d["cin"], d["hh"], d["ww"])).astype(np.float32),
         "dy": rng.standard_normal((d["nb"], d["cout"], d["hh"], d["ww"])).astype(np.float32),
         "K": (rng.standard_normal((d["cout"], d["cin"], 3, 3)) / math.sqrt(d["cin"] * 9)).astype(np.float32)}
    prog(**a)
    perf_map(prog, f"/tmp/perf-{os.getpid()}.map")
    clock = time.thread_time if args.threads == 1 else time.process_time
    best, t0 = math.inf, time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        c0 = clock()
        prog(**a)
        best = min(best, clock() - c0)
    print(json.dumps({"call_s": best, "pid": os.getpid()}))


def paired_shares(report: str) -> dict[str, float]:
    """{function: share of the samples in tgc's functions} from `perf report --stdio
    --sort sym` text."""
    shares = {}
    for line in report.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0].endswith("%") and parts[-1].startswith("tgc"):
            shares[parts[-1]] = shares.get(parts[-1], 0.0) + float(parts[0][:-1])
    total = sum(shares.values())
    return {k: v / total for k, v in sorted(shares.items(), key=lambda t: -t[1])} if total else {}


def paired(args) -> None:
    import shutil
    if shutil.which("perf") is None:
        raise SystemExit("conv2d_probe paired: needs Linux perf on PATH")
    if args.variant:   # an unknown field: a clear exit here, not the child's traceback
        from tgc.options import Options
        _variant(Options(), args.variant)
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        cmd = ["perf", "record", "-q", "-F", "4000", "-o", data, "--", sys.executable, __file__, "paired-child",
               "--threads", str(args.threads), "--seconds", str(args.seconds)] + ([args.variant] if args.variant else [])
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"conv2d_probe paired: the recorded loop failed:\n{done.stderr[-2000:]}")
        child = json.loads(done.stdout.strip().splitlines()[-1])
        call = child["call_s"]
        try:
            rep = subprocess.run(["perf", "report", "-i", data, "--stdio", "--sort", "sym"], check=True,
                                 capture_output=True, text=True).stdout
        finally:   # the map the loop wrote, once perf has read it
            Path(f"/tmp/perf-{child['pid']}.map").unlink(missing_ok=True)
    shares = paired_shares(rep)
    share_of = "and on one thread that share of the least call thread time" if args.threads == 1 else \
        "(the least call process time, with the pool's spinning)"
    print(f"conv2d_sym {KERNEL_DIMS}, {args.threads} thread(s), paired (no counters): share of perf's samples "
          f"in tgc's functions, {share_of} {call * 1e3:.3f} ms; load average {os.getloadavg()[0]:.2f}")
    for name, share in shares.items():
        if share >= 0.001:
            ms = f"  {share * call * 1e3:7.3f} ms" if args.threads == 1 else ""
            print(f"  {share * 100:6.2f}%{ms}  {name}")


def compile_one(path: str) -> None:
    """Cold compile of one file, in this process (the caller gives an empty cache)."""
    t0 = time.perf_counter()
    import tgc
    from tgc import pipeline
    from tgc.options import Options
    from tgc.pipeline import lower_module
    t_import = time.perf_counter() - t0
    opts = Options()
    t0 = time.perf_counter()
    module = pipeline.load(path, opts)
    t_front = time.perf_counter() - t0
    t0 = time.perf_counter()
    passed = pipeline.lower(module, opts).module
    t_passes = time.perf_counter() - t0
    t0 = time.perf_counter()
    low = lower_module(passed, opts)
    t_lower = time.perf_counter() - t0
    t0 = time.perf_counter()
    prog = tgc.compile(path)
    t_total = time.perf_counter() - t0
    lines = prog.llvm_ir.count("\n")
    llvm = max(0.0, t_total - t_front - t_passes - t_lower)
    print(f"{path}: tgc.compile {t_total:.2f} s = front end {t_front:.2f} + passes {t_passes:.2f} + "
          f"lowering {t_lower:.2f} + code generation and LLVM {llvm:.2f}; {len(low.kernels)} kernels, "
          f"{lines} lines of LLVM IR (import tgc {t_import:.2f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="cold compile times, split by stage")
    c.add_argument("files", nargs="+")
    r = sub.add_parser("run", help="step times against torch eager")
    r.add_argument("--batch", type=int, default=16)
    r.add_argument("--rounds", type=int, default=5)
    r.add_argument("--samples", type=int, default=3)
    r.add_argument("--only", help="comma-separated contenders: " + ", ".join(NAMES))
    r.add_argument("--spin-only", action="store_true", help="only the GOMP_SPINCOUNT=10000 setting")
    w = sub.add_parser("worker")
    w.add_argument("name")
    w.add_argument("batch", type=int)
    w.add_argument("samples", type=int)
    kp = sub.add_parser("kernels", help="per-kernel one-thread minima of conv2d_sym, option variants A/B")
    kp.add_argument("variants", nargs="*", help="NAME:FIELD=VALUE,... (CpuOptions fields); default base:")
    kp.add_argument("--rounds", type=int, default=20)
    for name in ("paired", "paired-child"):
        pp = sub.add_parser(name, help="per-function shares of the paired program under perf" if name == "paired"
                            else argparse.SUPPRESS)
        pp.add_argument("variant", nargs="?", help="NAME:FIELD=VALUE,... (CpuOptions fields)")
        pp.add_argument("--threads", type=int, default=1)
        pp.add_argument("--seconds", type=float, default=8.0)
    c1 = sub.add_parser("compile-one")
    c1.add_argument("file")
    args = ap.parse_args()
    if args.cmd == "worker":
        worker(args.name, args.batch, args.samples)
    elif args.cmd == "kernels":
        kernels(args)
    elif args.cmd == "paired":
        paired(args)
    elif args.cmd == "paired-child":
        paired_child(args)
    elif args.cmd == "compile-one":
        compile_one(args.file)
    elif args.cmd == "compile":
        for f in args.files:
            with tempfile.TemporaryDirectory() as cache:
                subprocess.run([sys.executable, __file__, "compile-one", f],
                               env=dict(os.environ, TGC_CACHE_DIR=cache), check=True)
    else:
        run(args)


if __name__ == "__main__":
    main()
