"""tgc benchmarks: every workload against numpy, PyTorch and JAX, side by side, in one process.

    python benchmarks/run.py [--quick] [--only NAME[,NAME...]] [--repeat N] [--json out.json]
                             [--specialize] [--threads N] [--wait-idle S] [--no-compile-times] [--load N]

For each row the contenders (tgc cpu f32, hand-written numpy, torch eager, torch.compile,
jax.jit when installed) are first checked against a float64 numpy reference, then timed
interleaved (A B C A B C ...); each sample is the mean of enough calls to last a few
milliseconds, and the table shows the median sample. Bounds: memory bandwidth (a numpy
triad) for the elementwise rows, sgemm GFLOP/s for the matmul rows; each tgc time is
printed as a multiple of the time its bound allows. See benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

# OpenBLAS reads these when numpy loads; they slow a current numpy (PLATFORM.md). This
# process and its children only.
for _v in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
    os.environ.pop(_v, None)


def _threads_flag(argv):
    """--threads N, read before numpy loads OpenBLAS (which takes its thread count from the environment)."""
    for i, a in enumerate(argv):
        if a == "--threads" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--threads="):
            return a.split("=", 1)[1]
    return None


# tgc and torch share one libgomp in this process (the first copy loaded serves both), and
# libgomp reads its spin setting once, at load. Fix it to tgc's runtime default before either
# loads it, so the result does not depend on import order (see README, "Noise").
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

if _threads_flag(sys.argv[1:]):
    os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = _threads_flag(sys.argv[1:])

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / "workloads"
sys.path[:0] = [str(HERE), str(ROOT)]

import ref_numpy  # noqa: E402

F32 = np.float32


# ============================================================ workloads

@dataclass
class Case:
    workload: str                   # .tg file stem, and the key of every contender's maker
    size: str
    dims: dict                      # dims bound for this row
    inputs: object                  # rng -> {name: array}
    bound: tuple                    # ("bw", bytes) or ("flops", flops)
    target: str                     # the project's target, as printed
    kind: str                       # "large-elementwise" | "small" | "abs" | "vs-torch" | "vs-one-thread"
    target_s: float = 0.0           # for kind "abs"/"small": the time to meet; "vs-torch": the most tgc/torch;
                                    # "vs-one-thread": the most tgc / (tgc on one thread)
    updates: tuple = ()             # update targets (compared as (new - old) / lr)
    only: tuple = ()                # the contenders of this row (default: all)


def _rows_inputs(rows, d, *, extra=()):
    def make(rng):
        a = {"x": (2 * rng.standard_normal((rows, d))).astype(F32),
             "dy": rng.standard_normal((rows, d)).astype(F32)}
        for name in extra:
            a[name] = (1 + 0.1 * rng.standard_normal(d)).astype(F32) if name == "w" else \
                (0.1 * rng.standard_normal(d)).astype(F32)
        return a
    return make


def _hvp_inputs(rows, c):
    def make(rng):
        t = rng.standard_normal((rows, c))
        y = np.exp(t - t.max(1, keepdims=True))
        y /= y.sum(1, keepdims=True)
        return {"x": (2 * rng.standard_normal((rows, c))).astype(F32), "y": y.astype(F32),
                "v": rng.standard_normal((rows, c)).astype(F32)}
    return make


def _conv_inputs(b, ci, co, k, length):
    def make(rng):
        return {"x": rng.standard_normal((b, ci, length)).astype(F32),
                "dy": rng.standard_normal((b, co, length)).astype(F32),
                "K": (rng.standard_normal((co, ci, k)) / math.sqrt(ci * k)).astype(F32)}
    return make


def _conv2d_inputs(b, ci, co, k, side):
    def make(rng):
        return {"x": rng.standard_normal((b, ci, side, side)).astype(F32),
                "dy": rng.standard_normal((b, co, side, side)).astype(F32),
                "K": (rng.standard_normal((co, ci, k, k)) / math.sqrt(ci * k * k)).astype(F32)}
    return make


GCN = dict(nodes=4000, edges=40000, f=16)


def _gcn_inputs(rng):
    N, E, F = GCN["nodes"], GCN["edges"], GCN["f"]
    return {"x": rng.standard_normal((N, F)).astype(F32), "dy": rng.standard_normal((N, F)).astype(F32),
            "src": rng.integers(0, N, E).astype(np.int32), "dst": rng.integers(0, N, E).astype(np.int32),
            "W1": (rng.standard_normal((F, F)) / 4).astype(F32), "W2": (rng.standard_normal((F, F)) / 4).astype(F32)}


def _gcn_bytes():
    """Each of the 4 gathers and 4 scatters reads and writes one edges x features f32 array."""
    return 8 * 2 * GCN["edges"] * GCN["f"] * 4


def load_wine():
    raw = np.loadtxt(HERE / "data" / "wine.csv", delimiter=",", skiprows=1)
    x, y = raw[:, :13], raw[:, 13:]
    x = (x - x.mean(0)) / x.std(0)                      # standardized features
    return x.astype(F32), y.astype(F32)


def _mlp_inputs(rng):
    x, y = load_wine()
    sizes = [(13, 64), (64, 64), (64, 3)]
    a = {"x": x, "y": y, "lr": np.asarray(0.05, F32)}
    for i, (m, n) in enumerate(sizes, 1):
        a[f"W{i}"] = (rng.standard_normal((m, n)) * math.sqrt(2 / m)).astype(F32)
        a[f"b{i}"] = (0.01 * rng.standard_normal(n)).astype(F32)
    return a


GPT = dict(batch=64, t=11, vocab=64, c=48, heads=3, layers=3)


def _gpt_inputs(rng, GPT=GPT):
    B, T, V, C = GPT["batch"], GPT["t"], GPT["vocab"], GPT["c"]
    a = {"ids": rng.integers(0, V, (B, T)).astype(np.int32),
         "targets": rng.integers(0, V, (B, T)).astype(np.int32), "lr": np.asarray(0.1, F32)}
    shapes = {"wte": (V, C), "wpe": (T, C), "wq": (C, C), "wk": (C, C), "wv": (C, C), "wo": (C, C),
              "wfc": (C, 4 * C), "bfc": (4 * C,), "wproj": (4 * C, C)}
    for n in ref_numpy.gpt_param_names(GPT["layers"]):
        kind = n.split("_", 1)[1] if n[0] == "l" and n[1].isdigit() else n     # l2_wq -> wq
        if kind.endswith("_w"):                                                # LayerNorm scales
            a[n] = (1 + 0.1 * rng.standard_normal(C)).astype(F32)
        elif kind.endswith("_b") or kind.startswith("b"):                      # LayerNorm shifts, biases
            a[n] = (0.02 * rng.standard_normal(shapes.get(kind, (C,)))).astype(F32)
        else:
            a[n] = (0.1 * rng.standard_normal(shapes[kind])).astype(F32)
    return a


GPT_SMALL = dict(batch=8, t=16, vocab=64, c=64, heads=4, layers=1)   # workloads/gpt_small.tg


def _gpt_small_inputs(rng):
    return _gpt_inputs(rng, GPT_SMALL)


ADAMW_STEP = 10   # the gpt_adamw row's moments and bias corrections are those of step 10


def _gpt_adamw_inputs(rng):
    """The GPT's inputs, with AdamW moments of a run under way and their bias corrections."""
    a = _gpt_inputs(rng)
    a["lr"] = np.asarray(1e-3, F32)
    for n in ref_numpy.gpt_param_names(GPT["layers"]):
        a[f"m_{n}"] = (1e-3 * rng.standard_normal(a[n].shape)).astype(F32)
        a[f"v_{n}"] = (1e-6 * (1 + rng.random(a[n].shape))).astype(F32)
    b1, b2 = ref_numpy.ADAMW["beta1"], ref_numpy.ADAMW["beta2"]
    a["bc1"] = np.asarray(1 / (1 - b1 ** ADAMW_STEP), F32)
    a["bc2"] = np.asarray(1 / (1 - b2 ** ADAMW_STEP), F32)
    return a


def _gpt_flops(GPT=GPT):
    B, T, V, C, L = GPT["batch"], GPT["t"], GPT["vocab"], GPT["c"], GPT["layers"]
    M = B * T
    per_layer = 2 * M * C * 3 * C + 2 * 2 * B * T * T * C + 2 * M * C * C + 2 * 2 * M * C * 4 * C
    fwd = L * per_layer + 2 * M * C * V
    return 3 * fwd                                      # forward + two products per product backward


def _mlp_flops(n=178):
    fwd = 2 * n * (13 * 64 + 64 * 64 + 64 * 3)
    return fwd + fwd + 2 * n * (64 * 64 + 64 * 3)       # forward, weight grads, activation grads


def _conv_flops(b=32, ci=64, co=64, k=5, length=1024):
    return 3 * 2 * b * co * ci * k * length


def _conv2d_flops(b=16, ci=32, co=64, k=3, side=32):
    return 3 * 2 * b * co * ci * k * k * side * side


def cases(load=0):
    """The rows; `load`: the busy processes `--load` runs (the gpt_small row's target)."""
    big = ("large-elementwise", "<=1.5x bw, 2x t.compile")
    out = []
    for w, extra in (("layernorm", ("w", "b")), ("gelu", ()), ("softmax", ())):
        out.append(Case(w, "4096x1024", {"rows": 4096, "d": 1024}, _rows_inputs(4096, 1024, extra=extra),
                        ("bw", 4 * 4096 * 1024 * 4), big[1], big[0]))
        out.append(Case(w, "64x256", {"rows": 64, "d": 256}, _rows_inputs(64, 256, extra=extra),
                        ("bw", 4 * 64 * 256 * 4), "<=20 us", "small", 20e-6))
    out.append(Case("hvp", "4096x1024", {"rows": 4096, "c": 1024}, _hvp_inputs(4096, 1024),
                    ("bw", 4 * 4096 * 1024 * 4), big[1], big[0]))
    out.append(Case("conv1d", "32x64x1024 k5", {"batch": 32, "len": 1024}, _conv_inputs(32, 64, 64, 5, 1024),
                    ("flops", _conv_flops()), "<=1x torch", "vs-torch", 1.0))
    out.append(Case("conv2d", "16x32->64 32x32 k3", {"batch": 16}, _conv2d_inputs(16, 32, 64, 3, 32),
                    ("flops", _conv2d_flops()), "<=1x torch", "vs-torch", 1.0))
    out.append(Case("conv2d_sym", "16x32->64 32x32 k3", {"nb": 16, "cin": 32, "cout": 64, "hh": 32, "ww": 32},
                    _conv2d_inputs(16, 32, 64, 3, 32), ("flops", _conv2d_flops()), "<=0.8x torch", "vs-torch", 0.8))
    out.append(Case("gcn", "4000 nodes 40000 edges 16 feat", {"nodes": GCN["nodes"], "edges": GCN["edges"]},
                    _gcn_inputs, ("bw", _gcn_bytes()), "<=1x torch", "vs-torch", 1.0))
    out.append(Case("mlp", "178x13-64-64-3", {"batch": 178}, _mlp_inputs, ("flops", _mlp_flops()),
                    "<=60 us", "abs", 60e-6, updates=ref_numpy.MLP_PARAMS))
    out.append(Case("gpt", "3L 3H w48 64x11", {"batch": GPT["batch"]}, _gpt_inputs, ("flops", _gpt_flops()),
                    "<=3.5 ms", "abs", 3.5e-3, updates=tuple(ref_numpy.gpt_param_names(GPT["layers"]))))
    out.append(Case("gpt_adamw", "3L 3H w48 64x11", {"batch": GPT["batch"]}, _gpt_adamw_inputs,
                    ("flops", _gpt_flops()), "<=0.5x torch", "vs-torch", 0.5,
                    updates=tuple(ref_numpy.gpt_param_names(GPT["layers"]))))
    # A step whose kernels are all too small to gain from threads, on default threads against one thread: not
    # slower on a quiet machine, at most 3x under --load (other processes oversubscribing the cores).
    out.append(Case("gpt_small", "1L 4H w64 8x16" + (f" load {load}" if load else ""), {"batch": GPT_SMALL["batch"]},
                    _gpt_small_inputs, ("flops", _gpt_flops(GPT_SMALL)),
                    "<=3x 1 thread" if load else "<=1x 1 thread", "vs-one-thread", 3.0 if load else 1.0,
                    updates=tuple(ref_numpy.gpt_param_names(GPT_SMALL["layers"])), only=("tgc", "tgc 1 thread")))
    return out


NUMPY = {"layernorm": ref_numpy.layernorm, "gelu": ref_numpy.gelu, "softmax": ref_numpy.softmax,
         "hvp": ref_numpy.hvp, "conv1d": ref_numpy.conv1d, "mlp": ref_numpy.mlp_step, "gpt": ref_numpy.gpt_step,
         "gpt_adamw": ref_numpy.gpt_adamw_step, "conv2d": ref_numpy.conv2d, "conv2d_sym": ref_numpy.conv2d,
         "gcn": ref_numpy.gcn, "gpt_small": ref_numpy.gpt_small_step}


# ============================================================ contenders

def copy_arrays(a, dtype=None):
    out = {}
    for k, v in a.items():
        v = np.array(v, copy=True)
        if dtype is not None and v.dtype.kind == "f":
            v = v.astype(dtype)
        out[k] = v
    return out


def short_error(e):
    msg = str(e).strip().splitlines()
    msg = msg[0] if msg else ""
    return f"{type(e).__name__}: {msg}"[:110]


_REGION_CALLBACKS = []   # every counting callback a table was given: alive as long as the process


class RegionCounter:
    """--count-regions: counts the parallel regions tgc's programs start. tgc's generated code
    reaches GOMP_parallel through its runtime function table (tgc/backends/cpu/fntable.py);
    programs loaded while a counter is installed get a ctypes callback there that counts and
    calls it (a few us a region). A step on 2 threads runs in one of two modes: its regions
    (the gpt_adamw step: 37-38 a call), or, while the runtime holds a lag (another process held
    a core: docs/optimization.md, "Shared cores"), serially (0-2 a call); the count says which
    one a row's samples timed. `close()` installs tgc's own table again for later programs."""

    def __init__(self):
        import ctypes

        import tgc.backends.cpu.parallel as parallel
        self.count = 0
        self._parallel, self._original = parallel, parallel.gomp_addresses
        proto = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint)
        real = proto(self._original()["gomp_parallel"])

        def counted(fn, data, n, flags):
            self.count += 1
            real(fn, data, n, flags)

        callback = proto(counted)
        _REGION_CALLBACKS.append(callback)
        address = ctypes.cast(callback, ctypes.c_void_p).value

        def addresses(*a, **k):
            return {**self._original(*a, **k), "gomp_parallel": address}

        parallel.gomp_addresses = addresses

    def close(self):
        self._parallel.gomp_addresses = self._original


class Tgc:
    """Compiles each .tg file once (dims symbolic, bound per call) or once per size (--specialize)."""

    def __init__(self, specialize, threads=None):
        self.specialize, self.threads = specialize, threads
        self.programs, self.compile_s, self.fresh = {}, {}, False
        try:
            import tgc
            self.tgc, self.error = tgc, None
        except Exception as e:   # noqa: BLE001 — reported in the table, the run goes on
            self.tgc, self.error = None, short_error(e)

    def program(self, case):
        if self.error:
            raise RuntimeError(f"import: {self.error}")
        key = (case.workload, tuple(sorted(case.dims.items())) if self.specialize else ())
        self.fresh = key not in self.programs
        if self.fresh:
            t0 = time.perf_counter()
            try:
                opts = None
                if self.threads:
                    from tgc.options import CpuOptions, Options
                    opts = Options(cpu=CpuOptions(threads=self.threads))
                self.programs[key] = self.tgc.compile(str(WORK / f"{case.workload}.tg"), backend="cpu",
                                                      dtype="f32", dims=case.dims if self.specialize else None,
                                                      options=opts)
            except Exception as e:   # noqa: BLE001
                self.programs[key] = e
            self.compile_s[key] = time.perf_counter() - t0
        p = self.programs[key]
        if isinstance(p, Exception):
            raise p
        return p, self.compile_s[key]

    def make(self, case, arrays):
        prog, _ = self.program(case)
        return lambda: prog(**arrays)

    def settle(self, case, step, budget_s=10.0):
        """Call `step` until its program runs the one specialized to the row's sizes
        (tgc.runtime.specialize: built once the sizes' generic calls have done
        `Options.specialize_work` FLOPs plus bytes), so that the samples time what a
        long run runs; at most `budget_s`. Returns what the last call ran: "specialized" or "generic"."""
        prog, _ = self.program(case)
        if not hasattr(prog, "variants"):   # a tgc without specialization
            return "generic"
        t0 = time.perf_counter()
        while prog.last_variant is None and time.perf_counter() - t0 < budget_s:
            step()
            if any(v.refused for v in prog.variants()):
                break
        if prog.last_variant is None and any(v.specialized for v in prog.variants()):
            step()   # the build (inside the last call, which ran the generic program) outlasted the budget
        return "generic" if prog.last_variant is None else "specialized"


def contenders(args, tg, torch_ok, jax_ok, one_thread=None):
    """[(name, maker(case, arrays) -> step)] in table order; `one_thread`: tgc on one thread
    (a Tgc), for the rows that compare against it."""
    out = [("tgc", tg.make)]
    if one_thread is not None:
        out.append(("tgc 1 thread", one_thread.make))
    out.append(("numpy", lambda case, a: (lambda: NUMPY[case.workload](a))))
    if torch_ok:
        import peers_torch
        out.append(("torch", lambda case, a: peers_torch.make(case.workload, a, False)))
        if not args.quick:
            out.append(("torch.compile", lambda case, a: peers_torch.make(case.workload, a, True)))
    if jax_ok:
        import peers_jax
        out.append(("jax.jit", lambda case, a: peers_jax.make(case.workload, a)))
    return out


def to_numpy(out):
    res = {}
    for k, v in out.items():
        if hasattr(v, "detach"):
            v = v.detach().numpy()
        res[k] = np.asarray(v)
    return res


def check(case, out, ref, before):
    """(None or what differs, worst error relative to the output's largest magnitude) against the
    float64 reference. Loose float32 tolerance: 2e-3 of each output's largest magnitude. An updated
    parameter is compared by its step, (new - old) / lr, allowing for the float32 rounding of new."""
    lr = float(before["lr"]) if case.updates else None
    worst = 0.0
    for name, r in ref.items():
        if name not in out:
            return f"no output '{name}'", worst
        a = np.asarray(out[name], np.float64)
        r = np.asarray(r, np.float64)
        if a.shape != r.shape:
            return f"'{name}' has shape {a.shape}, expected {r.shape}", worst
        slack = 0.0
        if name in case.updates:
            a = (a - before[name]) / lr
            r = (r - before[name]) / lr
            slack = 4 * np.finfo(F32).eps * float(np.max(np.abs(before[name]))) / lr
        if not np.all(np.isfinite(a)):
            return f"'{name}' is not finite", worst
        scale = float(np.max(np.abs(r))) if r.size else 0.0
        err = float(np.max(np.abs(a - r))) if r.size else 0.0
        worst = max(worst, err / max(scale, 1e-30))
        if err > 2e-3 * scale + slack + 1e-6:
            return f"'{name}' off by {err:.3g} (max |ref| {scale:.3g})", worst
    return None, worst


def time_interleaved(steps, repeats, sample_s, blocked=False, settle_s=0.0, warm_s=0.03):
    """Median seconds per call of each step, sampled A B C A B C ... (blocked: A A ... B B ...).

    With `settle_s`, each switch to a contender whose call takes 1 ms or more (the rows where
    every contender runs threads) first waits that long, then runs half a sample untimed: a
    thread pool the previous contender used (numpy's OpenBLAS spins ~0.1 s after a
    multi-threaded call) is idle again and does not take the cores from this one, and this
    one's own threads are awake. (Before short calls, torch's pool measured ~15x slower
    after such a pause, so they are not paused.) The untimed run is a whole sample of at
    least 3 calls, and lasts at least `warm_s`: after 0.12 s idle, tgc's GPT step measured
    4.0-5.4 ms on its first call and 3.4-4.1 on its second against 3.3-3.4 after, so half
    a sample (2 calls) left the slow second call in the timed part; tgc's layernorm
    4096x1024 took 4.2-4.7, 4.1-4.4, 3.5-3.9, 3.0-3.7, 2.6-3.4 ms on its first five calls
    against 2.3-2.6 from the seventh (~15 ms of calls: torch's own 4-7 ms calls came down
    over 1-7 of them), so 3 untimed calls left a 1-call sample (--quick) ~35% slow."""
    inner, long_calls = {}, {}
    for name, fn in steps.items():
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        inner[name] = max(1, min(10000, int(sample_s / max(dt, 1e-7))))
        long_calls[name] = dt >= 1e-3
    samples = {name: [] for name in steps}
    gc.collect()
    gc.disable()
    try:
        order = [name for name in steps for _ in range(repeats)] if blocked else list(steps) * repeats
        previous = None
        for name in order:
            fn, n = steps[name], inner[name]
            if settle_s and name != previous and long_calls[name]:
                time.sleep(settle_s)
                t0, k = time.perf_counter(), 0
                while k < max(3, n) or time.perf_counter() - t0 < warm_s:  # untimed: wakes this contender up
                    fn()
                    k += 1
            previous = name
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t0) / n)
    finally:
        gc.enable()
    return {name: float(np.median(s)) for name, s in samples.items()}, samples


class OtherLoad:
    """The share of the machine's CPUs that other processes used since `start()` (from /proc/stat)."""

    def __init__(self):
        self.start()

    @staticmethod
    def _busy_s():
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
            return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")     # all but idle and iowait
        except (OSError, ValueError, IndexError):
            return None

    @staticmethod
    def _ours_s():
        import resource
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

    def start(self):
        self.t0, self.busy0, self.ours0 = time.perf_counter(), self._busy_s(), self._ours_s()

    def fraction(self):
        busy = self._busy_s()
        if busy is None or self.busy0 is None:
            return None
        wall = (time.perf_counter() - self.t0) * (os.cpu_count() or 1)
        return max(0.0, (busy - self.busy0) - (self._ours_s() - self.ours0)) / max(wall, 1e-9)


# ============================================================ bounds

def measure_bounds(repeats, threads=None):
    """Triad bandwidth (GB/s) and sgemm GFLOP/s with numpy, median of `repeats`."""
    n = 1 << 25                                         # 128 MiB per array
    a = np.empty(n, F32)
    b = np.random.default_rng(1).random(n, F32)
    c = np.random.default_rng(2).random(n, F32)
    s = F32(3.0)
    chunk = 1 << 15                                     # 3 x 128 KiB per chunk: the temporary stays in L2

    def triad(lo, hi):
        tmp = np.empty(chunk, F32)
        for i in range(lo, hi, chunk):
            j = min(i + chunk, hi)
            np.multiply(c[i:j], s, out=tmp[:j - i])
            np.add(tmp[:j - i], b[i:j], out=a[i:j])

    def triad_threads(k):
        parts = [threading.Thread(target=triad, args=(i * n // k, (i + 1) * n // k)) for i in range(k)]
        for t in parts:
            t.start()
        for t in parts:
            t.join()

    nthreads = threads or os.cpu_count() or 1
    variants = {"1 thread": lambda: triad(0, n)}
    if nthreads > 1:
        variants[f"{nthreads} threads"] = lambda: triad_threads(nthreads)
    for f in variants.values():
        f()
    med, _ = time_interleaved(variants, repeats, 0.0)
    best = min(med, key=med.get)
    bw = 3 * n * 4 / med[best]
    assert np.allclose(a[:1000], b[:1000] + 3 * c[:1000])

    m = 2048
    A = np.random.default_rng(3).random((m, m), F32)
    B = np.random.default_rng(4).random((m, m), F32)
    C = np.empty((m, m), F32)
    gemm = {"sgemm": lambda: np.matmul(A, B, out=C)}
    gemm["sgemm"]()
    gmed, _ = time_interleaved(gemm, repeats, 0.0)
    return {"triad_GBps": bw / 1e9, "triad_variant": best,
            "triad_ms": {k: v * 1e3 for k, v in med.items()}, "sgemm_GFLOPs": 2 * m ** 3 / gmed["sgemm"] / 1e9}


def bound_seconds(case, bounds):
    kind, amount = case.bound
    return amount / (bounds["triad_GBps"] * 1e9) if kind == "bw" else amount / (bounds["sgemm_GFLOPs"] * 1e9)


# ============================================================ compile times

COLD = r"""
import json, sys, time
import numpy                      # a caller has numpy loaded already: not counted
t0 = time.perf_counter()
import tgc
t1 = time.perf_counter()
path, dims = sys.argv[1], json.loads(sys.argv[2]) or None
res = {"import_s": t1 - t0}
try:
    tgc.compile(path, backend="cpu", dtype="f32", dims=dims)
    t2 = time.perf_counter()
    res["cold_s"] = t2 - t1
    tgc.compile(path, backend="cpu", dtype="f32", dims=dims)
    res["warm_s"] = time.perf_counter() - t2
except Exception as e:
    res["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:110]
print("RESULT " + json.dumps(res))
"""


def _compile_in_fresh_process(case, dims, cache, timeout, bytecode=True):
    env = dict(os.environ, TGC_CACHE_DIR=cache, XDG_CACHE_HOME=cache, PYTHONPATH=str(ROOT))
    env.pop("TGC_CACHE", None)
    if bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    else:  # an empty bytecode directory, never written: every module compiled from source
        env.update(PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=os.path.join(cache, "no-pyc"))
    try:
        p = subprocess.run([sys.executable, "-c", COLD, str(WORK / f"{case.workload}.tg"), json.dumps(dims)],
                           capture_output=True, text=True, timeout=timeout, env=env, cwd=str(ROOT))
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        return json.loads(line[-1][7:]) if line else {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:110]}
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}


def compile_times(selected, specialize, timeout):
    """Per workload, tgc.compile: in a fresh process with an empty tgc cache (cold), again in that
    process (warm), and in a second fresh process that finds the first one's on-disk cache.

    Python's bytecode of tgc and its dependencies is compiled first (`compileall`, as `pip
    install` does), so "cold" is tgc's own work with an empty tgc cache; a process that must
    also compile tgc's source (PYTHONDONTWRITEBYTECODE, an editable install never imported)
    is measured once more without it (`no_pyc_s`)."""
    import compileall
    import importlib.util

    for pkg in ("tgc", "lark", "llvmlite", "click", "opt_einsum"):
        spec = importlib.util.find_spec(pkg)
        if spec is not None and spec.submodule_search_locations:
            compileall.compile_dir(list(spec.submodule_search_locations)[0], quiet=1)
    rows, seen = [], set()
    for case in selected:
        if case.workload in seen:
            continue
        seen.add(case.workload)
        dims = case.dims if specialize else {}
        with tempfile.TemporaryDirectory(prefix="tgc-bench-cache-") as cache:
            res = _compile_in_fresh_process(case, dims, cache, timeout)
            if "error" not in res:
                again = _compile_in_fresh_process(case, dims, cache, timeout)
                res["disk_cached_s"] = again.get("cold_s")
        with tempfile.TemporaryDirectory(prefix="tgc-bench-cache-") as cache:
            if "error" not in res:
                res["no_pyc_s"] = _compile_in_fresh_process(case, dims, cache, timeout, bytecode=False).get("cold_s")
        res.update(workload=case.workload, dims=dims)
        rows.append(res)
        msg = res.get("error") or f"cold {res['cold_s']:.3f} s, warm {res['warm_s']:.3f} s"
        print(f"  compile {case.workload:<10} {msg}", flush=True)
    return rows


# ============================================================ one row

def run_case(case, makers, args, bounds, tg):
    rng = np.random.default_rng(0)
    base = case.inputs(rng)
    ref = NUMPY[case.workload](copy_arrays(base, np.float64))
    ref = {k: np.asarray(v, np.float64) for k, v in ref.items()}
    before = copy_arrays(base, np.float64)
    row = {"workload": case.workload, "size": case.size, "target": case.target, "status": {}, "median_s": {},
           "compile_s": {}, "max_rel_err": {}}
    steps = {}
    for name, maker in makers:
        if case.only and name not in case.only:
            continue
        try:
            t0 = time.perf_counter()
            step = maker(case, copy_arrays(base))
            out = to_numpy(step())                          # first call: checks, and compiles lazy peers
            first = time.perf_counter() - t0
            bad, row["max_rel_err"][name] = check(case, out, ref, before)
            if bad:
                row["status"][name] = f"WRONG: {bad}"
                continue
            if name in ("torch.compile", "jax.jit"):
                row["compile_s"][name] = first
            if name == "tgc" and tg.fresh:
                row["compile_s"][name] = tg.program(case)[1]
            owner = getattr(maker, "__self__", None)   # "tgc" and "tgc 1 thread": a Tgc's program
            if isinstance(owner, Tgc):   # each times its specialization, not generic calls and the build
                row.setdefault("variants", {})[name] = owner.settle(case, step)
                if name == "tgc":
                    row["tgc_variant"] = row["variants"][name]
            steps[name] = step                              # a training step goes on from its first step
            row["status"][name] = "ok"
        except Exception as e:   # noqa: BLE001 — one contender failing must not stop the others
            if os.environ.get("TGC_BENCH_DEBUG"):
                traceback.print_exc()
            row["status"][name] = ("n/a (backend: " if name == "tgc" else "n/a (") + short_error(e) + ")"
    if steps:
        load = OtherLoad()
        counter, calls = getattr(args, "regions", None), [0]
        if counter is not None and "tgc" in steps:
            def counted(step=steps["tgc"]):
                calls[0] += 1
                return step()
            steps["tgc"], start = counted, counter.count
        med, samples = time_interleaved(steps, args.repeat, args.sample_ms / 1e3, args.blocked, args.settle_ms / 1e3)
        if calls[0]:
            row["tgc_regions_per_call"] = (counter.count - start) / calls[0]
        row["other_load"] = load.fraction()
        row["median_s"] = med
        row["samples_s"] = samples
    t = row["median_s"].get("tgc")
    row["bound_s"] = bound_seconds(case, bounds)
    row["bound_kind"], row["amount"] = case.bound
    row["tgc_over_bound"] = t / row["bound_s"] if t else None
    row["target_met"] = target_met(case, row)
    return row


def target_met(case, row):
    """True/False against the project's target for this row; None when it cannot be told."""
    t = row["median_s"].get("tgc")
    if t is None:
        return None
    if case.kind == "vs-torch":   # target_s: the most tgc may take, as a multiple of torch eager
        te = row["median_s"].get("torch")
        return None if te is None else t <= case.target_s * te
    if case.kind == "vs-one-thread":
        t1 = row["median_s"].get("tgc 1 thread")
        return None if t1 is None else t <= case.target_s * t1
    if case.kind != "large-elementwise":
        return t <= case.target_s
    near_bound = t <= 1.5 * row["bound_s"]
    tc = row["median_s"].get("torch.compile")
    if tc is None:
        return False if not near_bound else None
    return near_bound and 2 * t <= tc


# ============================================================ table

def fmt_t(s):
    if s is None:
        return "-"
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def fmt_ratio(a, b):
    return f"{a / b:.2f}" if a and b else "-"


def cell(row, name):
    st = row["status"].get(name)
    if st is None:
        return "-"
    if st != "ok":
        return st
    return fmt_t(row["median_s"].get(name))


def rate(row, t):
    """What tgc achieved in the bound's unit: GB/s moved or GFLOP/s."""
    if not t or "amount" not in row:
        return "-"
    return f"{row['amount'] / t / 1e9:.1f} GB/s" if row["bound_kind"] == "bw" else \
        f"{row['amount'] / t / 1e9:.1f} GFLOP/s"


def print_table(rows, names, bounds):
    one = "tgc 1 thread" in names
    head = ["workload", "size"] + names + ["tgc/numpy", "tgc/torch", "tgc/t.compile"] + ["tgc/1 thread"] * one + [
        "tgc/bound", "tgc rate", "others", "target", "met"]
    lines = []
    notes = []
    for r in rows:
        m = r["median_s"]
        cells = [r["workload"], r["size"]]
        for n in names:
            c = cell(r, n)
            if len(c) > 14:
                notes.append(f"{r['workload']} {r['size']} {n}: {c}")
                c = "n/a [" + str(len(notes)) + "]" if c.startswith("n/a") else "WRONG [" + str(len(notes)) + "]"
            cells.append(c)
        t = m.get("tgc")
        cells += [fmt_ratio(t, m.get("numpy")), fmt_ratio(t, m.get("torch")), fmt_ratio(t, m.get("torch.compile"))]
        cells += [fmt_ratio(t, m.get("tgc 1 thread"))] * one
        cells += [                  f"{r['tgc_over_bound']:.2f}x {r['bound_kind']}" if r.get("tgc_over_bound") else "-",
                  rate(r, t),
                  f"{100 * r['other_load']:.0f}%" if r.get("other_load") is not None else "-",
                  r["target"], {True: "yes", False: "NO", None: "?"}[r["target_met"]]]
        lines.append(cells)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    sep = "  "
    print(sep.join(h.ljust(w) for h, w in zip(head, widths)))
    print(sep.join("-" * w for w in widths))
    for ln in lines:
        print(sep.join(str(x).ljust(w) for x, w in zip(ln, widths)))
    for i, n in enumerate(notes, 1):
        print(f"  [{i}] {n}")
    tc = [f"{r['workload']} {r['size']} {r['compile_s']['tgc']:.2f} s" for r in rows if "tgc" in r["compile_s"]]
    if tc:
        print("tgc.compile in this process (tgc's own cache as configured): " + ", ".join(tc))
    for peer in ("torch.compile", "jax.jit"):
        tc = [f"{r['workload']} {r['size']} {r['compile_s'][peer]:.1f} s" for r in rows if peer in r["compile_s"]]
        if tc:
            print(f"{peer} first call (compiles; excluded from the medians): " + ", ".join(tc))


def machine():
    cpu = "?"
    try:
        for ln in open("/proc/cpuinfo"):
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
            "platform": platform.platform()}
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        info["tgc_commit"] = rev + ("+dirty" if dirty else "")
    except Exception:   # noqa: BLE001
        pass
    return info


def wait_idle(limit_s, window_s=3.0, idle=0.05):
    """Return once other processes used under `idle` of the CPUs for `window_s`, or after `limit_s`."""
    deadline = time.perf_counter() + limit_s
    while True:
        load = OtherLoad()
        time.sleep(window_s)
        frac = load.fraction()
        if frac is None or frac < idle or time.perf_counter() > deadline:
            return
        print(f"# waiting for idle CPUs (other processes: {100 * frac:.0f}%)", flush=True)


def _spin(stop, parent):
    """Spin until `stop` is set or the parent process is gone (killed: no stop comes)."""
    while not stop.is_set() and os.getppid() == parent:
        for _ in range(100_000):
            pass


class BusyProcesses:
    """`n` processes that each spin on a core for as long as the block runs (--load): a
    machine whose cores other programs oversubscribe."""

    def __init__(self, n):
        self.n, self.procs, self.stop = n, [], None

    def __enter__(self):
        if self.n > 0:
            import multiprocessing
            ctx = multiprocessing.get_context("spawn")   # no copy of this process's threads or libraries
            self.stop = ctx.Event()
            self.procs = [ctx.Process(target=_spin, args=(self.stop, os.getpid()), daemon=True) for _ in range(self.n)]
            for p in self.procs:
                p.start()
        return self

    def __exit__(self, *exc):
        if self.stop is not None:
            self.stop.set()
            for p in self.procs:
                p.join(5)
                if p.is_alive():
                    p.terminate()
        return False


# ============================================================ main

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few repeats, no torch.compile (< ~2 min)")
    ap.add_argument("--only", help="comma-separated workloads: " + ", ".join(sorted(set(NUMPY)))
                    + ", compile, check (tgc check at 10^5 statements: benchmarks/frontend.py)")
    ap.add_argument("--repeat", type=int, help="timed samples per contender (default 5 quick, 31 full)")
    ap.add_argument("--sample-ms", type=float, help="minimum length of one sample (default 3 quick, 20 full)")
    ap.add_argument("--json", help="also write every number to this file")
    ap.add_argument("--specialize", action="store_true",
                    help="compile tgc once per size with its dims fixed (default: once per file, dims bound per call)")
    ap.add_argument("--settle-ms", type=float, default=120.0,
                    help="idle time before each switch to another contender, so that the thread pool the "
                         "previous one used (OpenBLAS spins ~0.1 s after a call) has gone to sleep (default 120; "
                         "0 to see the contenders' pools collide)")
    ap.add_argument("--blocked", action="store_true",
                    help="time each contender's samples in one block (A A A B B B) instead of interleaved, "
                    "to see how much the contenders disturb each other")
    ap.add_argument("--no-compile-times", action="store_true", help="skip the cold/warm compile-time rows and the front-end (check) rows")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="S",
                    help="first wait up to S seconds for other processes to leave the CPUs idle")
    ap.add_argument("--threads", type=int, help="threads for every contender (default: torch 2, the others "
                    "every core); 1 gives steadier numbers while another process holds a core")
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="run N busy processes (each spinning on a core) while the rows are timed: a machine "
                         "oversubscribed by other programs (the gpt_small row's target is then <=3x one thread)")
    ap.add_argument("--count-regions", action="store_true",
                    help="count the parallel regions tgc starts per call during each row's samples (printed with "
                         "the row): 0-2 means its runtime ran the step serially (another process held a core)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-jax", action="store_true")
    args = ap.parse_args(argv)
    args.repeat = args.repeat or (5 if args.quick else 31)
    args.sample_ms = args.sample_ms or (3.0 if args.quick else 20.0)
    only = set(args.only.split(",")) if args.only else None
    if args.wait_idle > 0:
        wait_idle(args.wait_idle)
    t_start = time.perf_counter()
    whole_run = OtherLoad()

    torch_ok = jax_ok = False
    versions = {}
    inductor_cache = None
    if not args.quick and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        # torch.compile keeps compiled kernels on disk across processes; an empty cache makes its
        # reported compile time a cold one, as tgc's is.
        inductor_cache = tempfile.mkdtemp(prefix="tgc-bench-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache
    if not args.no_torch:
        try:
            import torch
            torch.set_num_threads(args.threads or 2)
            torch_ok, versions["torch"] = True, torch.__version__
        except Exception as e:   # noqa: BLE001
            versions["torch"] = f"n/a ({short_error(e)})"
    if not args.no_jax:
        try:
            import jax
            jax_ok, versions["jax"] = True, jax.__version__
        except Exception as e:   # noqa: BLE001
            versions["jax"] = "not installed" if isinstance(e, ImportError) else f"n/a ({short_error(e)})"

    info = machine()
    info.update(versions)
    cmd = "python benchmarks/run.py" + ("" if argv is None and len(sys.argv) == 1 else " " + " ".join(sys.argv[1:]))
    print(f"# {cmd}   ({datetime.datetime.now().isoformat(timespec='seconds')})")
    print("# " + ", ".join(f"{k} {v}" for k, v in info.items()))
    bounds = measure_bounds(5 if args.quick else 9, args.threads)
    print(f"# bounds: triad {bounds['triad_GBps']:.1f} GB/s (numpy, {bounds['triad_variant']}), "
          f"sgemm {bounds['sgemm_GFLOPs']:.0f} GFLOP/s (numpy float32 2048^3)", flush=True)

    if args.load < 0:
        ap.error("--load must be 0 or more")
    unknown = (only or set()) - set(NUMPY) - {"compile", "check"}
    if unknown:
        ap.error(f"--only: unknown workload(s) {', '.join(sorted(unknown))}")
    selected = [c for c in cases(args.load) if only is None or c.workload in only]
    args.regions = RegionCounter() if args.count_regions else None
    tg = Tgc(args.specialize, args.threads)
    one_thread = Tgc(args.specialize, 1) if any("tgc 1 thread" in c.only for c in selected) else None
    makers = contenders(args, tg, torch_ok, jax_ok, one_thread)
    names = [n for n, _ in makers]
    rows = []
    with BusyProcesses(args.load):
        if args.load:
            print(f"# --load {args.load}: {args.load} busy processes run while the rows are timed", flush=True)
        for case in selected:
            t0 = time.perf_counter()
            try:
                row = run_case(case, makers, args, bounds, tg)
            except Exception as e:   # noqa: BLE001 — e.g. the reference itself failed: report, go on
                traceback.print_exc()
                row = {"workload": case.workload, "size": case.size, "target": case.target, "median_s": {},
                       "compile_s": {}, "status": {n: f"n/a (harness: {short_error(e)})" for n in names},
                       "bound_kind": case.bound[0], "tgc_over_bound": None, "target_met": None}
            rows.append(row)
            print(f"  {case.workload} {case.size}: " + ", ".join(
                f"{n} {fmt_t(row['median_s'][n]) if n in row['median_s'] else row['status'].get(n)}" for n in names
                if n in row["status"]) + f"  ({time.perf_counter() - t0:.1f} s)"
                + (f", tgc regions a call {row['tgc_regions_per_call']:.1f}" if "tgc_regions_per_call" in row else ""),
                flush=True)

    ctimes = []
    if not args.no_compile_times and (only is None or "compile" in only):
        print("# compile times (fresh process each; cold = first tgc.compile, warm = the same again)", flush=True)
        listed = None if only is None or only == {"compile"} else only
        ctimes = compile_times([c for c in cases() if listed is None or c.workload in listed], args.specialize, 300)

    checks = []
    if not args.no_compile_times and (only is None or "check" in only):
        import frontend
        print(f"# front end: tgc check of generated programs, {frontend.TARGET_S:.0f} s target "
              "(fresh process each, start-up included)", flush=True)
        checks = frontend.check_times()

    if rows:
        print()
        print_table(rows, names, bounds)
    if ctimes:
        print()
        print("compile: tgc.compile (import tgc and Python start-up excluded; tgc's bytecode compiled, as after "
              "pip install), target <= 0.3 s cold")
        for r in ctimes:
            if "error" in r:
                print(f"  {r['workload']:<10} n/a (backend: {r['error']})")
            else:
                cached = r.get("disk_cached_s")
                print(f"  {r['workload']:<10} cold {r['cold_s']:.3f} s  {'yes' if r['cold_s'] <= 0.3 else 'NO '}   "
                      f"warm (same process) {r['warm_s']:.3f} s   new process, cache filled "
                      + (f"{cached:.3f} s" if cached is not None else "-")
                      + (f"   cold without .pyc {r['no_pyc_s']:.3f} s" if r.get("no_pyc_s") is not None else ""))
    total = time.perf_counter() - t_start
    busy = whole_run.fraction()
    print(f"\n# total {total:.0f} s; other processes used "
          + (f"{100 * busy:.0f}% of the CPUs meanwhile" if busy is not None else "? of the CPUs")
          + ("" if busy is None or busy <= 0.05 else
             f" (--load {args.load}'s busy processes among them)" if args.load else
             " -- NOISY: other processes took time slices from the timed calls; rerun when idle"))
    if inductor_cache:
        shutil.rmtree(inductor_cache, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": cmd, "date": datetime.datetime.now().isoformat(timespec="seconds"),
                       "machine": info, "bounds": bounds, "rows": rows, "compile": ctimes, "check": checks,
                       "repeat": args.repeat, "sample_ms": args.sample_ms, "specialize": args.specialize,
                       "threads": args.threads, "load": args.load, "blocked": args.blocked, "total_s": total, "other_load": busy}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
