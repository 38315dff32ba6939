"""Where a step's time goes: tgc per kernel against the FMA peak, PyTorch eager per op.

For the nanoGPT-char AdamW step (`benchmarks/nanogpt.py`: examples/gpt2.tg at 6 layers,
width 384 in 6 heads, 256 tokens, vocabulary 65, batch 4, AdamW with global-norm
clipping) and the held-out conv2d with every size symbolic
(`benchmarks/workloads/conv2d_sym.tg`: 16 x 32 -> 64 channels, 32 x 32, 3 x 3, y, dx
and dK), and, with `--workload attention`, benchmarks/attention.py's causal attention at
`--t` (forward and the gradients of q, k, v; torch: SDPA with autograd), this prints:

1. the FMA peak: one core's, measured by the register-only AVX-512 FMA loop of
   `gemm_peak.peak` (per-thread CPU time), and two cores' measured by the same loop
   on two threads at once (the larger of their CPU times, `gemm_peak.Pair`);
2. the step's FLOPs in products (every GEMM kernel of tgc's lowered program:
   2 x batch x m x n x k x taps, without epilogues) and the lower bound FLOPs / peak;
3. tgc per kernel, on each thread count asked: the program is the one a timed call
   runs (the module after the IR pipeline with every size fixed, as the runtime's
   specialization builds it: `tgc.pipeline.specialized_module`), compiled again with
   `CpuOptions(profile=True)`, whose counters give each kernel's time-stamp-counter
   ticks (a loop's step kernels summed over its steps). Products are grouped by the
   normalized shape C'[P, Q] = A'[P, R] B'[R, Q] (`gemm_peak`'s: batch x P x Q x R,
   A' and B' stored N or T) with their GFLOP, ms, Mcycles (ms x the FMA clock) and
   % of the peak (of `threads` cores; an epilogue folded into a GEMM counts in its
   time), how many of its runs in that call ran in a parallel region of their own
   (`region`, `Program.region_calls`: under contention the runtime keeps a product
   on one thread, `tgc/backends/cpu/parallel.py`, and its % of two cores' peak then
   halves), and beside them each shape timed alone as benchmarks/gemm_peak.py times it
   (tgc's own kernel and OpenBLAS, % of the same peak, per-thread CPU time, no
   epilogue; `--alone-reps`); the other
   kernels with ms, MB moved (`tgc explain`'s: each buffer a kernel
   reads or writes, once) and GB/s. The rows sum to the counted call: the kernels,
   each loop's own work beyond its step kernels (`loop overhead`: carries, slices)
   and the time outside every kernel (the call's argument checks, Python). The
   profiled program runs no merged regions (`CpuOptions.merge_regions` is off under
   `profile`: its counters are per kernel) and no pairs (`regions.pairs`: a product
   and the loop after it interleaved, conv2d's dx product and column sum), so its
   call is also compared with the same program built without the profile;
4. PyTorch eager's step under `torch.profiler` (self CPU time per op): products
   (`aten::mm`, `addmm`, `bmm`, the convolutions), the fused attention (SDPA's
   flash kernels: products and softmax together), and everything else, with the
   phases of the step (`record_function`: forward, backward, clipping, AdamW);
   then what 0.7x (nanoGPT) or 0.8x (conv2d) of torch's unprofiled time would
   require of tgc;
5. for the conv2d, tgc's kernels grouped by the output they reach (y: its product;
   dx: the kernel's transposing copy, the product and the column sum after it; dK:
   the product and its copy) beside the oneDNN primitive PyTorch computes that output
   with (forward, backward data, backward weights: each primitive's own time from
   oneDNN's verbose mode, the step whose primitives took least), both at % of the FMA
   peak, and oneDNN's reorders (its layout copies into and out of blocked channels).

Each contender's unprofiled time is the median and the minimum of `--calls` calls, tgc
and torch interleaved; the counted and profiled calls are each the fastest of as many
(on a shared machine the others carry more of the other processes' time), printed with
the process's CPU time over that call's wall time and thread count (near 100%: the
threads ran, or spun, all through it; far under: other processes held the cores).
Timing is wall time: the load average is printed with each part.

    python benchmarks/breakdown.py                               # both workloads, 1 and 2 threads
    python benchmarks/breakdown.py --workload nanogpt --threads 2 --calls 7
    python benchmarks/breakdown.py --workload attention --t 2048 --threads 1 --kernel-minima
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

for _v in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):   # as benchmarks/run.py: they slow a current numpy
    os.environ.pop(_v, None)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

TARGETS = {"nanogpt": 0.7, "conv2d_sym": 0.8,   # issue 33's: tgc's time at most this times torch eager's
           "attention": 1.0}                     # issue 32's: at most torch SDPA's
PRODUCT_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::mkldnn_convolution",
               "aten::convolution_backward", "aten::mkldnn_convolution_backward", "aten::_slow_conv2d_forward",
               "aten::_slow_conv2d_backward")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


# ---------------------------------------------------------------- the clocks


def tsc_hz(seconds: float = 0.2) -> float:
    """The time-stamp counter's rate (what `CpuOptions(profile=True)` counts), against
    `time.perf_counter` over `seconds`: the median of three."""
    import llvmlite.ir as ir

    from tgc.backends.cpu import llvm_env

    mod, i64 = ir.Module("tsc"), ir.IntType(64)
    fn = ir.Function(mod, ir.FunctionType(i64, []), "tgc_bench_tsc")
    b = ir.IRBuilder(fn.append_basic_block())
    b.ret(b.call(ir.Function(mod, ir.FunctionType(i64, []), "llvm.readcyclecounter"), []))
    jit = llvm_env.jit(str(mod))
    read = ctypes.CFUNCTYPE(ctypes.c_int64)(jit.address("tgc_bench_tsc"))
    rates = []
    for _ in range(3):
        t0, c0 = time.perf_counter(), read()
        while time.perf_counter() - t0 < seconds:
            pass
        rates.append((read() - c0) / (time.perf_counter() - t0))
    jit.close()
    return statistics.median(rates)


def peaks(iters: int = 1_000_000, runs: int = 15) -> dict:
    """gemm_peak.peak (one core: 'gflops', 'fma_clock', 'flops_per_cycle', 'clock'), and
    'gflops2': the same FMA loop on two threads at once (2 x its flops over the larger of
    the two threads' CPU times, minimum of `runs`)."""
    import gemm_peak

    pk = gemm_peak.peak(iters, runs)
    jit, fns, loops = gemm_peak._asm_loops()
    pair = gemm_peak.Pair()
    fma = fns["fma x24"]
    secs = pair.time(lambda: fma(iters), lambda: fma(iters), runs)
    pair.close()
    jit.close()
    pk["gflops2"] = 2 * loops["fma x24"][2] * iters / secs / 1e9
    return pk


# ---------------------------------------------------------------- tgc's kernels


@dataclass
class Row:
    """One compiled kernel of a program, with what one call of it costs."""
    text: str
    product: bool
    flops: int                  # the product's 2 m n k (products), else tgc explain's FLOPs
    nbytes: int                 # tgc explain's bytes moved by one run (each buffer once)
    shape: str = ""             # products: batch x P x Q x R and A' B' layouts
    form: tuple | None = None   # ... as gemm_peak's product: (batch, P, Q, R, A' K-contiguous, B' N-contiguous)
    ticks: float = 0.0          # time-stamp-counter ticks per call
    regions: int = 0            # a GEMM's runs (of `times`) that ran in a parallel region of their own
    times: int = 1              # runs per call (a loop's step kernels: its trip)
    loop: bool = False          # a loop (its ticks include its step kernels')
    outputs: tuple = ()         # the program outputs its results reach (`reached_outputs`)

    @property
    def moved(self) -> int:
        """The bytes it moves per call: one run's times its runs (a loop's step
        kernel runs once per step, as `tgc explain` counts it)."""
        return self.nbytes * self.times


@dataclass
class Account:
    """One program's kernels counted over `calls` calls (per call figures)."""
    rows: list[Row]
    loops: float                # ticks of the loops beyond their step kernels
    counted: float              # ticks of the top-level kernels (loops with their steps)
    wall: float                 # seconds per call, the same calls
    hz: float                   # the time-stamp counter's rate
    calls: int
    cpu: float = 0.0            # the process's CPU seconds during that call (all its threads)

    @property
    def outside(self) -> float:
        return self.wall - self.counted / self.hz

    def seconds(self, product: bool) -> float:
        return sum(r.ticks for r in self.rows if r.product == product) / self.hz

    def product_flops(self) -> int:
        return sum(r.flops * r.times for r in self.rows if r.product)


def build(module, dims: dict, options, profile: bool, threads: int):
    """The program a timed call with `dims` runs: `module` (after the IR pipeline) with
    every size fixed as the runtime's specialization fixes them, compiled with
    `threads` (and the per-kernel counters when `profile`)."""
    from tgc import pipeline

    opts = options.with_(cpu=options.cpu.with_(profile=profile, threads=threads))
    fixed = pipeline.specialized_module(module, dims, opts) if dims else module
    return pipeline.compile_module(fixed, opts)


def optimized(source, fixed: dict | None = None):
    """(`source`'s module after the IR pipeline, its options), `fixed` dims fixed before
    it as `tgc.compile(dims=)` fixes them."""
    from tgc import pipeline

    src = pipeline.load_source(str(source), dims=fixed, lookup=False)
    return pipeline.lower(src.module, src.options).module, src.options


def kernel_rows(low, env: dict) -> tuple[list[Row], list[tuple[int, list[int]]]]:
    """A Row per compiled kernel, in the profile counters' order (the program's own
    kernels, then every loop's step kernels, `codegen.step_profile_kernels`), and, per
    loop, (its counter, its step kernels' counters)."""
    from tgc.backends.cpu.codegen import step_profile_kernels
    from tgc.explain import kernel_bytes
    from tgc.ir.sizes import size_eval
    from tgc.lower.cost import kernel_flops
    from tgc.lower.lowered import GemmKernel, StepLoop

    def row(lw, k, times: int) -> Row:
        size = lambda e: size_eval(lw.size(e), env)   # noqa: E731
        g = getattr(k, "gemm", k)   # an ImplicitGemm's product
        text = k.text().splitlines()[0]
        if isinstance(k, StepLoop):
            return Row(text, False, 0, 0, times=times, loop=True)
        if not isinstance(g, GemmKernel):
            return Row(text, False, kernel_flops(k, lambda kk, v: size_eval(kk.sizes[v], env), size),
                       kernel_bytes(lw, k, env), times=times)
        count = lambda edges: int(np.prod([size(e) for e in edges])) if edges else 1   # noqa: E731
        M, N, K, nb = count(g.m), count(g.n), count(g.k), count(g.batch) * count(g.taps)
        shape, form = product_shape(lw, g, M, N, K, nb)
        if g is not k:   # the gather packed by the product: no matrix to time alone
            shape, form = shape + " implicit", None
        return Row(text, True, 2 * M * N * K * nb, kernel_bytes(lw, k, env), shape=shape, form=form, times=times)

    reach = reached_outputs(low)
    rows = [row(low, k, 1) for k in low.kernels]
    for r, outs in zip(rows, reach):
        r.outputs = outs

    def walk(lw, times):   # step kernels in step_profile_kernels' order
        for k in lw.kernels:
            if isinstance(k, StepLoop):
                trip = times * size_eval(k.trip, env)
                rows.extend(row(k.step, s, trip) for s in k.step.kernels if not isinstance(s, StepLoop))
                walk(k.step, trip)

    loops = []
    for i, k in enumerate(low.kernels):
        if isinstance(k, StepLoop):
            first = len(rows)
            walk(_Only(k), 1)
            for r in rows[first:]:   # a loop's step kernels reach what the loop does
                r.outputs = reach[i]
            loops.append((i, list(range(first, len(rows)))))
    assert len(rows) == len(low.kernels) + len(step_profile_kernels(low)), "profile counters and rows disagree"
    return rows, loops


def reached_outputs(low) -> list[tuple[str, ...]]:
    """Per top-level kernel of `low`, the program outputs (in their order) that its
    results reach: written by it, or read, directly or through temporaries, by a
    kernel after it that reaches them (a convolution's input-gradient product and the
    column sum after it both reach `dx`)."""
    outs = sorted((n for n, b in low.buffers.items() if b.kind == "out"), key=lambda n: low.buffers[n].index)
    feeds: dict[str, set] = {}   # buffer -> the outputs the kernels after the current one reach by reading it
    reach: list[tuple[str, ...]] = [()] * len(low.kernels)
    for i in range(len(low.kernels) - 1, -1, -1):
        k = low.kernels[i]
        writes = set(k.writes())
        got = set().union(*({b} & set(outs) | feeds.get(b, set()) for b in writes)) if writes else set()
        reach[i] = tuple(o for o in outs if o in got)
        for b in set(k.buffers_used()) - writes:
            feeds.setdefault(b, set()).update(got)
    return reach


class _Only:
    """A program of one loop `k` (what `kernel_rows`' walk reads: its kernels)."""

    def __init__(self, k):
        self.kernels = [k]


def product_shape(lw, g, M, N, K, nb) -> tuple[str, tuple | None]:
    """('batch x P x Q x R AB', its form) as gemm_peak normalizes the product (C' = A'
    B', C' row-major; A', B' N or T), or the plain batch x M x N x K and None where
    an operand is no matrix."""
    try:
        from tgc.backends.cpu.gemm_dispatch import operand_forms

        f = operand_forms(lw, g)
    except Exception:  # noqa: BLE001 -- an operand that is no matrix: the plain shape
        return f"{nb} x {M} x {N} x {K}", None
    if f["c"][2]:
        P, Q, a_k, b_n = M, N, f["a"][2], f["b"][2]
    else:   # C^T = B^T A^T
        P, Q, a_k, b_n = N, M, not f["b"][2], not f["a"][2]
    return f"{nb} x {P} x {Q} x {K} {'N' if a_k else 'T'}{'N' if b_n else 'T'}", (nb, P, Q, K, a_k, b_n)


def alone(rows: list[Row], options, reps: int) -> dict[str, dict]:
    """Each product shape of `rows` timed alone as benchmarks/gemm_peak.py times it:
    tgc's own kernel and OpenBLAS on 1 thread and 2 (the halves the plan cuts), the
    minimum of `reps`: {shape: {(kernel, threads): seconds}}."""
    import gemm_peak
    from threadpoolctl import threadpool_limits

    forms = {r.shape: r.form for r in rows if r.product and r.form is not None}
    own, pair, rng = gemm_peak.Own(options.cpu, opt=options.opt_level), gemm_peak.Pair(), np.random.default_rng(0)
    out = {}
    with threadpool_limits(1):
        for shape, (nb, P, Q, R, a_k, b_n) in forms.items():
            p = dict(text=shape, batch=nb, P=P, Q=Q, R=R, a_k=a_k, b_n=b_n)
            out[shape] = gemm_peak.measure(p, own, pair, reps, rng)
    pair.close()
    own.jit.close()
    return out


def account(program, arrays: dict, calls: int, hz: float, minima: bool = False) -> Account:
    """Run `program` (built with `profile`) once to warm up, then `calls` times, each
    with its counters reset and read after it, and keep the fastest call (on a shared
    machine the others carry more of the other processes' time): each kernel's ticks
    in it, and its wall time. With `minima`, each kernel's least ticks over the calls
    instead (under load no call is quiet all through, but each kernel is in some call):
    the rows then sum to less than any one call, and the call's time is the least."""
    from tgc.explain import _fixed_dims

    low = program.lowered
    rows, loops = kernel_rows(low, _fixed_dims(low))
    n = len(low.kernels)
    program(**arrays)
    best, least = None, None
    for _ in range(calls):
        program.profile(reset=True)
        c0, t0 = time.process_time(), time.perf_counter()
        program(**arrays)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        top = {i: c for c, i, _ in program.profile()}
        counts = [top[i] for i in range(n)] + [c for c, _ in program.step_profile()]
        regions = program.region_calls()
        least = counts if least is None else [min(a, b) for a, b in zip(least, counts)]
        if best is None or wall < best[0]:
            best = (wall, counts, cpu, regions)
    wall, counts, cpu, regions = best
    if minima:
        counts = least
    for r, c, g in zip(rows, counts, regions):
        r.ticks = float(c)
        r.regions = g
    loop_ticks = sum(rows[i].ticks - sum(rows[j].ticks for j in idx) for i, idx in loops)
    counted = sum(rows[i].ticks for i in range(n))
    return Account([r for r in rows if not r.loop], loop_ticks, counted, wall, hz, calls, cpu)


# ---------------------------------------------------------------- PyTorch


def torch_profile(step, steps: int) -> dict:
    """PyTorch eager's `step` (warmed up) under torch.profiler, each of `steps` steps
    profiled alone, the fastest kept: seconds in products, fused attention and the rest
    of the ops (self CPU time), in the phases (`record_function` ranges the step opens),
    and the profiled wall time; the product FLOPs the profiler counts."""
    from torch.profiler import ProfilerActivity, profile

    step()
    best = None
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
            c0, t0 = time.process_time(), time.perf_counter()
            step()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if best is None or wall < best[0]:
            best = (wall, prof.key_averages(), cpu)
    wall, averages, cpu = best
    out = {"products": 0.0, "attention": 0.0, "other": 0.0, "product_flops": 0, "phases": {}, "wall": wall,
           "top": [], "cpu": cpu}
    for e in averages:
        s = e.self_cpu_time_total / 1e6
        if e.key.startswith("phase:"):
            out["phases"][e.key[6:]] = e.cpu_time_total / 1e6
            continue
        kind = "products" if e.key in PRODUCT_OPS else "attention" if e.key in ATTENTION_OPS else "other"
        out[kind] += s
        if kind == "products":
            out["product_flops"] += e.flops or 0
        out["top"].append((s, e.key, e.count, kind))
    out["top"].sort(reverse=True)
    return out


def onednn_profile(step, steps: int) -> dict | None:
    """PyTorch's oneDNN primitives in `step` (warmed up), from oneDNN's verbose mode
    (each primitive's own execution time, as oneDNN prints it), each of `steps` steps
    alone, the one whose primitives took least kept: {(primitive, propagation kind):
    [milliseconds, count]} (a reorder, a layout copy, under ("reorder", "")), or None
    where torch has no oneDNN. The lines go to the process's stdout (C's), which is
    sent to a file while the step runs."""
    import ctypes
    import tempfile

    import torch

    if not torch.backends.mkldnn.is_available():
        return None
    libc = ctypes.CDLL(None)
    step()
    best = None
    for _ in range(steps):
        sys.stdout.flush()
        libc.fflush(None)
        saved = os.dup(1)
        with tempfile.TemporaryFile() as f:
            os.dup2(f.fileno(), 1)
            try:
                with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                    step()
            finally:
                libc.fflush(None)
                os.dup2(saved, 1)
                os.close(saved)
            f.seek(0)
            lines = f.read().decode(errors="replace").splitlines()
        prims: dict[tuple[str, str], list] = {}
        for line in lines:
            fields = line.split(",")
            if not fields[0].startswith("onednn_verbose") or "exec" not in fields:
                continue
            i = fields.index("exec")
            try:
                ms = float(fields[-1])
            except ValueError:
                continue
            kind = (fields[i + 2], "" if fields[i + 2] == "reorder" else fields[i + 4])
            slot = prims.setdefault(kind, [0.0, 0])
            slot[0] += ms
            slot[1] += 1
        total = sum(v[0] for v in prims.values())
        if prims and (best is None or total < best[0]):
            best = (total, prims)
    return None if best is None else best[1]


def phase(name: str):
    import torch

    return torch.profiler.record_function("phase:" + name)


# ---------------------------------------------------------------- the workloads


class NanoGPT:
    name = "nanogpt"
    calls = 7   # calls per contender and thread count (fastest kept; unprofiled: median and minimum)

    def __init__(self, batch: int = 4, sizes: dict | None = None):
        import nanogpt

        self.mod, self.batch, self.sizes = nanogpt, batch, dict(sizes or nanogpt.SIZES)
        self.module, self.options = optimized(nanogpt.GPT2, self.sizes)
        self.dims = {"batch": batch}
        s = self.sizes
        self.title = (f"nanoGPT-char AdamW step ({s['layer']} layers, width {s['head'] * s['hd']}, {s['head']} heads, "
                      f"t {s['t']}, vocab {s['vocab']}, batch {batch})")

    def arrays(self, program) -> dict:
        return self.mod.initial(program, self.batch, sizes=self.sizes)

    def torch_step(self, arrays: dict, program):
        names = [s.name for s in program.inputs if s.kind == "param"]
        return self.mod.torch_step(arrays, names, False, phases=phase, sizes=self.sizes)[0]

    def model_flops(self) -> float:
        s = self.sizes
        c = s["head"] * s["hd"]
        tokens = self.batch * s["t"]
        dense = 2 * tokens * (s["layer"] * 12 * c * c + s["vocab"] * c)   # q, k, v, o (4 c^2), MLP (8 c^2), tied head
        attn = 2 * 2 * self.batch * s["layer"] * s["head"] * s["t"] ** 2 * s["hd"]   # q k^T and p v, unmasked
        return 3 * (dense + attn)   # forward and the two backward products of each


class Conv2dSym:
    name = "conv2d_sym"
    calls = 31

    def __init__(self, batch: int = 16):
        self.batch = batch
        self.module, self.options = optimized(HERE / "workloads" / "conv2d_sym.tg")
        self.dims = {"nb": batch, "cin": 32, "cout": 64, "hh": 32, "ww": 32}   # conv2d_probe's sizes
        self.title = (f"conv2d_sym forward + backward (every size symbolic; {batch} x 32 -> 64, 32 x 32, 3 x 3, "
                      f"padding 1)")

    def arrays(self, program) -> dict:
        import conv2d_probe

        return conv2d_probe._inputs(self.batch)

    def torch_step(self, arrays: dict, program):
        import torch
        import torch.nn.functional as F

        x, K = torch.tensor(arrays["x"], requires_grad=True), torch.tensor(arrays["K"], requires_grad=True)
        dy = torch.tensor(arrays["dy"])

        def step():
            with phase("forward"):
                y = F.conv2d(x, K, padding=1)
            with phase("backward"):
                return torch.autograd.grad(y, (x, K), dy)
        return step

    def model_flops(self) -> float:
        return 3 * 2 * self.batch * 64 * 32 * 9 * 32 * 32   # y, dx and dK: one product each

    # tgc's kernels by the output they reach, beside the oneDNN primitive computing it
    parts = (("y", ("convolution", "forward_training")), ("dx", ("convolution", "backward_data")),
             ("dK", ("convolution", "backward_weights")))


class Attention:
    """benchmarks/attention.py's row at `t` (`--t`): causal attention, forward and the
    gradients of q, k and v, against torch SDPA with autograd."""
    name = "attention"
    calls = 9

    def __init__(self, t: int = 1024, heads: int | None = None, batch: int | None = None):
        import attention

        self.mod, self.t = attention, t
        heads, batch = (heads, batch) if heads and batch else attention.ROWS[t]   # another size: tests
        self.heads, self.batch = heads, batch
        self.module, self.options = optimized(attention.SOURCE.format(batch=batch, heads=heads, t=t, hd=attention.HD))
        self.dims = {}
        self.title = (f"causal attention forward + backward (t {t}, {heads} heads of {attention.HD} x batch {batch}; "
                      "torch: scaled_dot_product_attention(is_causal=True) with autograd)")

    def arrays(self, program) -> dict:
        rng = np.random.default_rng(0)
        shape = (self.batch, self.heads, self.t, self.mod.HD)
        return {n: rng.standard_normal(shape, dtype=np.float32) for n in ("q", "k", "v", "dy")}

    def torch_step(self, arrays: dict, program):
        import torch
        import torch.nn.functional as F

        q, k, v = (torch.from_numpy(arrays[n]).requires_grad_(True) for n in "qkv")
        dy = torch.from_numpy(arrays["dy"])

        def step():
            with phase("forward"):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            with phase("backward"):
                return torch.autograd.grad(y, (q, k, v), dy)
        return step

    def model_flops(self) -> float:
        return 6 * 2 * self.batch * self.heads * self.t ** 2 * self.mod.HD   # q k^T, p v; dv, dp, dq, dk: unmasked


WORKLOADS = {"nanogpt": NanoGPT, "conv2d_sym": Conv2dSym, "attention": Attention}


# ---------------------------------------------------------------- the report


def load() -> str:
    return f"load average {os.getloadavg()[0]:.2f}"


def report_tgc(acc: Account, threads: int, pk: dict, plain: tuple, solo: dict) -> None:
    """The per-kernel table of one thread count."""
    hz, fma = acc.hz, pk["fma_clock"]
    peak = pk["gflops"] * 1e9 if threads == 1 else pk["gflops2"] * 1e9
    ms = lambda ticks: 1e3 * ticks / hz   # noqa: E731
    groups: dict[str, list[Row]] = {}
    for r in acc.rows:
        if r.product:
            groups.setdefault(r.shape, []).append(r)
    print(f"\n  tgc, {threads} thread{'s' if threads > 1 else ''}: counted call {acc.wall * 1e3:.1f} ms (fastest "
          f"of {acc.calls}; the process on CPU {100 * acc.cpu / acc.wall / threads:.0f}% of it x {threads}); the same "
          f"program without the counters (merged regions): {plain[0] * 1e3:.1f} ms median, {plain[1] * 1e3:.1f} min")
    print(f"  {'product (batch x P x Q x R, A B)':<42} {'x/call':>6} {'GFLOP':>7} {'ms':>8} {'Mcyc':>8} {'% peak':>6}"
          f" {'region':>6} | alone: {'own %':>5} {'blas %':>6}")
    prod_t = 0.0
    for shape, rs in sorted(groups.items(), key=lambda kv: -sum(r.ticks for r in kv[1])):
        t = sum(r.ticks for r in rs) / hz
        f = sum(r.flops * r.times for r in rs)
        prod_t += t
        one = f / sum(r.times for r in rs)
        cells = [f"{100 * one / solo[shape][k, threads] / peak:.1f}" if (k, threads) in solo.get(shape, {}) else "-"
                 for k in ("own", "blas")]
        print(f"  {shape:<42} {sum(r.times for r in rs):>6} {f / 1e9:>7.2f} {t * 1e3:>8.2f} {t * fma / 1e6:>8.1f} "
              f"{100 * f / t / peak if t else 0:>6.1f} {sum(r.regions for r in rs):>6} | {cells[0]:>12} {cells[1]:>6}")
    pf = acc.product_flops()
    print(f"  {'all products':<42} {'':>6} {pf / 1e9:>7.2f} {prod_t * 1e3:>8.2f} {prod_t * fma / 1e6:>8.1f} "
          f"{100 * pf / prod_t / peak if prod_t else 0:>6.1f}")
    others = sorted((r for r in acc.rows if not r.product), key=lambda r: -r.ticks)
    rest_t = sum(r.ticks for r in others) / hz
    print(f"  {'other kernel (first line)':<60} {'x/call':>6} {'ms':>8} {'Mcyc':>8} {'MB':>8} {'GB/s':>6}")
    small = [r for r in others if r.ticks / hz < 0.005 * acc.wall]
    for r in others:
        if r in small:
            continue
        t = r.ticks / hz
        text = r.text if len(r.text) <= 60 else r.text[:57] + "..."
        print(f"  {text:<60} {r.times:>6} {t * 1e3:>8.2f} {t * fma / 1e6:>8.1f} {r.moved / 1e6:>8.1f} "
              f"{r.moved / t / 1e9 if t else 0:>6.1f}")
    if small:
        t, nb = sum(r.ticks for r in small) / hz, sum(r.moved for r in small)
        print(f"  {f'{len(small)} more, each under 0.5% of the call':<60} {'':>6} {t * 1e3:>8.2f} "
              f"{t * fma / 1e6:>8.1f} {nb / 1e6:>8.1f} {nb / t / 1e9 if t else 0:>6.1f}")
    moved = sum(r.moved for r in others)
    print(f"  other kernels: {moved / 1e6:.0f} MB moved in {rest_t * 1e3:.1f} ms, {moved / rest_t / 1e9 if rest_t else 0:.1f} "
          f"GB/s; products: {sum(r.moved for r in acc.rows if r.product) / 1e6:.0f} MB (operands and results once "
          "per run)")
    print(f"  sum: products {prod_t * 1e3:.1f} + other kernels {rest_t * 1e3:.1f} + loop overhead "
          f"{ms(acc.loops):.1f} = counted {ms(acc.counted):.1f} ms; outside the kernels {acc.outside * 1e3:.1f}; "
          f"call {acc.wall * 1e3:.1f} ms ({100 * acc.counted / hz / acc.wall:.1f}% counted)")


def run_workload(w, threads: list[int], calls: int, pk: dict, hz: float, torch_steps: int, reps: int,
                 minima: bool = False) -> dict:
    """Build, time, count and print one workload (see the module docstring)."""
    print(f"\n== {w.title}; {load()}")
    res = {"tgc": {}, "plain": {}, "torch": {}, "torch_time": {}, "onednn": {}}
    progs = {t: (build(w.module, w.dims, w.options, True, t), build(w.module, w.dims, w.options, False, t))
             for t in threads}
    first = progs[threads[0]][1]
    arrays = {t: (w.arrays(first), w.arrays(first)) for t in threads}
    try:
        import torch
    except ImportError:
        torch = None
    tsteps = {}
    if torch is not None:
        for t in threads:
            torch.set_num_threads(t)
            tsteps[t] = w.torch_step(w.arrays(first), first)
            tsteps[t]()
    # unprofiled: tgc (no counters) and torch interleaved per thread count
    for t in threads:
        plain, a = progs[t][1], arrays[t][1]
        plain(**a)
        ts, tt = [], []
        for _ in range(calls):
            t0 = time.perf_counter()
            plain(**a)
            ts.append(time.perf_counter() - t0)
            if t in tsteps:
                torch.set_num_threads(t)
                t0 = time.perf_counter()
                tsteps[t]()
                tt.append(time.perf_counter() - t0)
        res["plain"][t] = (statistics.median(ts), min(ts))
        if tt:
            res["torch_time"][t] = (statistics.median(tt), min(tt))
    for t in threads:   # counted, then profiled, per thread count
        res["tgc"][t] = account(progs[t][0], arrays[t][0], calls, hz, minima)
        if torch is not None:
            torch.set_num_threads(t)
            res["torch"][t] = torch_profile(tsteps[t], torch_steps)
            if getattr(w, "parts", None):
                res["onednn"][t] = onednn_profile(tsteps[t], torch_steps)
    flops = res["tgc"][threads[0]].product_flops()
    res["flops"] = flops
    print(f"  products: {flops / 1e9:.2f} GFLOP in tgc's lowered program (the model's count, attention unmasked: "
          f"{w.model_flops() / 1e9:.2f}); at the FMA peak they take {1e3 * flops / (pk['gflops'] * 1e9):.1f} ms "
          f"on 1 core, {1e3 * flops / (pk['gflops2'] * 1e9):.1f} ms on 2 (the lower bound of the step)")
    solo = alone(res["tgc"][threads[0]].rows, w.options, reps) if reps else {}
    for t in threads:
        report_tgc(res["tgc"][t], t, pk, res["plain"][t], solo)
    for t in res["torch"]:
        report_torch(res["torch"][t], t, res["torch_time"][t], pk, w.model_flops())
    for t in threads:
        if getattr(w, "parts", None):
            report_parts(w.parts, res["tgc"][t], res["onednn"].get(t), t, pk, torch_steps)
    summary(w, res, threads, pk, flops)
    return res


def report_torch(prof: dict, threads: int, eager: tuple, pk: dict, model_flops: float) -> None:
    peak = (pk["gflops"] if threads == 1 else pk["gflops2"]) * 1e9
    print(f"\n  PyTorch eager, {threads} thread{'s' if threads > 1 else ''}: unprofiled {eager[0] * 1e3:.1f} ms median, "
          f"{eager[1] * 1e3:.1f} min; profiled (fastest step) {prof['wall'] * 1e3:.1f} ms (the process on CPU "
          f"{100 * prof['cpu'] / prof['wall'] / threads:.0f}% of it x {threads})")
    pf, what = prof["product_flops"], "the profiler's count"
    if not pf and not prof["attention"]:   # no count (the convolutions): the model's
        pf, what = model_flops, "the model's count"
    speed = f" ({pf / 1e9:.2f} GFLOP, {what}: {100 * pf / prof['products'] / peak:.1f}% of the peak)" \
        if pf and prof["products"] else ""
    ops = prof["products"] + prof["attention"] + prof["other"]
    print(f"  self time: products {prof['products'] * 1e3:.1f} ms{speed}; fused attention (SDPA: products and "
          f"softmax) {prof['attention'] * 1e3:.1f}; other ops {prof['other'] * 1e3:.1f}; outside ops "
          f"{(prof['wall'] - ops) * 1e3:.1f}")
    if prof["phases"]:
        print("  phases: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in prof["phases"].items()))
    print("  costliest ops: " + ", ".join(f"{k} {s * 1e3:.1f} ms ({n}x)" for s, k, n, _ in prof["top"][:8]))


def report_parts(parts, acc: Account, prims: dict | None, threads: int, pk: dict, steps: int) -> None:
    """tgc's counted kernels grouped by the output they reach (`Row.outputs`), beside
    the oneDNN primitive that computes that output in PyTorch's step (`onednn_profile`),
    both at % of the FMA peak for the output's product FLOPs; then the layout copies
    (tgc's copying kernels, counted in the rows above; oneDNN's reorders) and the totals."""
    peak = (pk["gflops"] if threads == 1 else pk["gflops2"]) * 1e9
    ms = lambda ticks: 1e3 * ticks / acc.hz   # noqa: E731
    print(f"\n  tgc by output against oneDNN's primitives, {threads} thread{'s' if threads > 1 else ''} (tgc: the "
          f"counted call's kernels; oneDNN: each primitive's own time as its verbose mode prints it, the step whose "
          f"primitives took least of {steps})")
    print(f"  {'output':<7} {'tgc kernels':<34} {'ms':>7} {'% peak':>6} | {'oneDNN primitive':<34} {'ms':>7} "
          f"{'% peak':>6}")
    total = 0.0
    for out, prim in parts:
        rows = [r for r in acc.rows if out in r.outputs]
        t = ms(sum(r.ticks for r in rows))
        total += t
        flops = sum(r.flops * r.times for r in rows if r.product)
        n_p = sum(r.times for r in rows if r.product)
        rest = [r for r in rows if not r.product]
        what = f"{n_p} product{'s' if n_p != 1 else ''}" + (
            f", {len(rest)} other ({ms(sum(r.ticks for r in rest)):.2f} ms)" if rest else "")
        pct = lambda sec: f"{100 * flops / (sec / 1e3) / peak:.1f}" if flops and sec else "-"   # noqa: E731
        cells = "-", "-", "-"
        if prims and prim in prims:
            p_ms, count = prims[prim]
            cells = f"{' '.join(prim)} ({count}x)", f"{p_ms:.2f}", pct(p_ms)
        print(f"  {out:<7} {what:<34} {t:>7.2f} {pct(t):>6} | {cells[0]:<34} {cells[1]:>7} {cells[2]:>6}")
    copies = [r for r in acc.rows if not r.product and not r.flops]
    line = f"  layout copies: tgc {ms(sum(r.ticks for r in copies)):.2f} ms ({len(copies)} kernels, in the rows above)"
    if prims:
        re_ms, re_n = prims.get(("reorder", ""), [0.0, 0])
        line += f"; oneDNN reorders {re_ms:.2f} ms ({re_n}x)"
    print(line)
    line = (f"  totals: tgc kernels {ms(acc.counted):.2f} ms (these outputs {total:.2f}), outside them "
            f"{acc.outside * 1e3:.2f}, call {acc.wall * 1e3:.2f}")
    if prims:
        line += f"; oneDNN primitives {sum(v[0] for v in prims.values()):.2f} ms"
    print(line)


def summary(w, res: dict, threads: list[int], pk: dict, flops: int) -> None:
    """What the target asks of tgc, per thread count, from the minima (the fastest
    calls: the least load)."""
    target = TARGETS[w.name]
    print(f"\n  what {target}x torch eager asks (minima):")
    for t in threads:
        acc = res["tgc"][t]
        peak = (pk["gflops"] if t == 1 else pk["gflops2"]) * 1e9
        prod, rest = acc.seconds(True), acc.seconds(False) + acc.loops / acc.hz + acc.outside
        line = (f"  {t} thread{'s' if t > 1 else ''}: tgc {res['plain'][t][1] * 1e3:.1f} ms (counted call "
                f"{acc.wall * 1e3:.1f}: products {prod * 1e3:.1f} at {100 * flops / prod / peak:.0f}% of the peak, the "
                f"rest {rest * 1e3:.1f}); the products at 100% of the peak: {flops / peak * 1e3:.1f} ms")
        eager = res["torch_time"].get(t)
        if eager is not None:
            goal = target * eager[1]
            need = goal - rest
            line += (f"; torch {eager[1] * 1e3:.1f} ms, tgc / torch {res['plain'][t][1] / eager[1]:.2f} "
                     f"(medians {res['plain'][t][0] / eager[0]:.2f}); {target}x torch = {goal * 1e3:.1f} ms: with the "
                     "rest as it is, the products would need "
                     + (f"{flops / need / peak * 100:.0f}% of the peak" if need > 0 else "less than no time"))
        print(line)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), action="append", help="default: both")
    ap.add_argument("--threads", type=int, action="append", help="default: 1 and 2")
    ap.add_argument("--calls", type=int, help="calls per contender and thread count (default: nanogpt 7, conv2d_sym 31)")
    ap.add_argument("--alone-reps", type=int, default=10,
                    help="runs of each product shape timed alone (gemm_peak's, minimum); 0: none")
    ap.add_argument("--torch-steps", type=int, default=5, help="steps under torch.profiler (the fastest kept; at least 1)")
    ap.add_argument("--kernel-minima", action="store_true",
                    help="each kernel's least time over the counted calls (a loaded machine), not the fastest call's")
    ap.add_argument("--t", type=int, default=1024, help="attention: the row's length (benchmarks/attention.py's ROWS)")
    args = ap.parse_args(argv)
    if args.torch_steps < 1:   # the torch half keeps the fastest of them: none is no breakdown
        ap.error(f"--torch-steps must be at least 1 (got {args.torch_steps})")

    from tgc.backends.cpu.llvm_env import has_feature

    if not has_feature("avx512f"):
        print("breakdown: this CPU has no AVX-512 (the peak loop uses it)", file=sys.stderr)
        return 1
    hz = tsc_hz()
    pk = peaks()
    print(f"FMA peak, measured (register-only vfmadd231ps loop, per-thread CPU time): one core "
          f"{pk['gflops']:.1f} GFLOP/s = {pk['flops_per_cycle']:.1f} flops/cycle at {pk['fma_clock'] / 1e9:.2f} GHz; "
          f"two cores at once {pk['gflops2']:.1f} GFLOP/s; time-stamp counter {hz / 1e9:.3f} GHz; {load()}")
    for name in args.workload or ("nanogpt", "conv2d_sym"):   # attention: when asked
        w = WORKLOADS[name](args.t) if name == "attention" else WORKLOADS[name]()
        run_workload(w, args.threads or [1, 2], args.calls or w.calls, pk, hz, args.torch_steps, args.alone_reps,
                     args.kernel_minima)
    return 0


if __name__ == "__main__":
    sys.exit(main())
