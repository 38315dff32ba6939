"""The FMA peak of one core, and every GEMM of a nanoGPT-char step against it.

1. The peak: a register-only loop of 24 independent AVX-512 fused multiply-adds
   (`vfmadd231ps`, inline assembly built with llvmlite; 24 accumulators hide the
   4-cycle latency at 2 per cycle), timed by the thread's CPU time (minimum of 15
   runs). The clock under that load comes from a chain of dependent FMAs (4 cycles
   each), the scalar clock from a chain of dependent integer adds (1 cycle each);
   flops per cycle = the loop's GFLOP/s over the FMA clock.
2. The products: `examples/gpt2.tg` at nanoGPT-char's sizes (6 layers, 6 heads of
   64 for width 384, 12 for width 768; t 256, batch 4, vocabulary 65) compiled by
   tgc; every GEMM of the lowered program (forward, each backward transpose, the
   batched attention products), as the normalized product the CPU backend runs:
   C'[P, Q] = A'[P, R] B'[R, Q] (gemm.py), batched `batch` times, with B' stored
   N (its columns contiguous) or T (its K contiguous), A' likewise.
3. Each product timed with tgc's own kernel (fgemm.py, JIT-compiled alone at the
   LLVM level programs use; an A' with its rows contiguous packed panel by panel,
   as in the step; a product of 65 to 80 columns on its edge block, as
   `gemm_dispatch.edge_vecs` has the step run it) and with
   OpenBLAS (numpy's, through `np.matmul` on the same layouts, its pool held at one
   thread), on 1 thread (minimum per-thread CPU time) and on 2 (the product cut in
   two as tgc's plan cuts it: the batch, else the larger of P and Q; two threads
   started together, the minimum of the larger of their CPU times). Columns: GFLOP/s, % of the FMA peak (2 threads: of twice
   it), Mcycles at the FMA clock, MB moved (A', B' read and C' written once: the
   least any kernel moves) and the plan's pick (`own` or `blas`) for the product's
   tiles (`GemmGen.tiles` and `own_tile` at the options given). A batched product's
   last column: the own kernel on one thread with every batch index reading index
   0's operands (batch strides 0: in cache), so that the gap between it and `own 1T`
   is what fetching each index's operands from L3 or memory costs.

    python benchmarks/gemm_peak.py                 # peak, then width 384 and 768
    python benchmarks/gemm_peak.py --width 384 --reps 30
    python benchmarks/gemm_peak.py --peak-only
    python benchmarks/gemm_peak.py --width 384 --operands   # each operand held in cache
    python benchmarks/gemm_peak.py --width 384 --pages huge # operands on 2 MiB pages, as in the step
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GPT2 = ROOT / "examples" / "gpt2.tg"


# ---------------------------------------------------------------- the peak


def _asm_loops():
    """ctypes functions (iterations) -> None of the timed loops, and their cycles and
    flops per iteration."""
    import llvmlite.binding as llvm
    import llvmlite.ir as ir

    from tgc.backends.cpu import llvm_env

    llvm.initialize_native_asmparser()
    mod, i64 = ir.Module("peak"), ir.IntType(64)
    zero = "".join(f"vpxord %zmm{i}, %zmm{i}, %zmm{i}\n" for i in range(32)) + "xor %rax, %rax\nxor %rdx, %rdx\n"
    loops = {   # name: (body, cycles per iteration (the chains), flops per iteration)
        "add chain": ("add %rdx, %rax\n" * 16, 16, 0),
        "fma chain": ("vfmadd231ps %zmm1, %zmm2, %zmm0\n" * 16, 64, 0),
        "fma x24": ("".join(f"vfmadd231ps %zmm30, %zmm31, %zmm{i}\n" for i in range(24)), None, 24 * 32),
    }
    clobbers = "~{rax},~{rdx}," + ",".join(f"~{{zmm{i}}}" for i in range(32)) + ",~{dirflag},~{fpsr},~{flags}"
    for n, (body, _, _) in loops.items():
        fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [i64]), n.replace(" ", "_"))
        b = ir.IRBuilder(fn.append_basic_block())
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [i64]), zero + "1:\n" + body + "dec %rcx\njnz 1b\n",
                           "{rcx}," + clobbers, side_effect=True)
        b.call(asm, [fn.args[0]])
        b.ret_void()
    jit = llvm_env.jit(str(mod))
    fns = {n: ctypes.CFUNCTYPE(None, ctypes.c_int64)(jit.address(n.replace(" ", "_"))) for n in loops}
    return jit, fns, loops


def peak(iters: int = 1_000_000, runs: int = 15) -> dict:
    """{'clock', 'fma_clock' (Hz), 'gflops' (one core's FMA peak), 'flops_per_cycle'}."""
    jit, fns, loops = _asm_loops()
    best = {}
    for n, fn in fns.items():
        ts = []
        for _ in range(runs):
            t0 = time.thread_time()
            fn(iters)
            ts.append(time.thread_time() - t0)
        best[n] = min(ts)
    clock = loops["add chain"][1] * iters / best["add chain"]
    fma_clock = loops["fma chain"][1] * iters / best["fma chain"]
    flops = loops["fma x24"][2] * iters / best["fma x24"]
    jit.close()
    return {"clock": clock, "fma_clock": fma_clock, "gflops": flops / 1e9, "flops_per_cycle": flops / fma_clock}


# ---------------------------------------------------------------- the products


def products(width: int, batch: int, options) -> list[dict]:
    """Every GEMM of the nanoGPT-char step at `width` (heads of 64) as the CPU backend
    normalizes it, with how many times a step runs it and the plan's pick."""
    import tgc
    from tgc.backends.cpu.codegen import leaf_kernels
    from tgc.backends.cpu.gemm_dispatch import operand_forms, uses_own_gemm
    from tgc.backends.cpu.implicit import ImplicitGemm
    from tgc.lower.lowered import GemmKernel, StepLoop

    sizes = {"layer": 6, "head": width // 64, "hd": 64, "t": 256, "vocab": 65, "batch": batch}
    program = tgc.compile(str(GPT2), dims=sizes, options=options)
    low = program.lowered
    trips = {}

    def walk(lw, times):
        for k in lw.kernels:
            if isinstance(k, StepLoop):
                walk(k.step, times * k.trip if isinstance(k.trip, int) else times)
            else:
                trips[id(k)] = times
    walk(low, 1)
    out = []
    for lw, k in leaf_kernels(low):
        g = k.gemm if isinstance(k, ImplicitGemm) else k
        if not isinstance(g, GemmKernel):
            continue
        f = operand_forms(lw, g)
        count = lambda edges: int(np.prod([lw.size(e) for e in edges])) if edges else 1   # noqa: E731
        M, N, K, nb = count(g.m), count(g.n), count(g.k), count(g.batch) * count(g.taps)
        if f["c"][2]:
            P, Q, a_k, b_n = M, N, f["a"][2], f["b"][2]
        else:   # C^T = B^T A^T
            P, Q, a_k, b_n = N, M, not f["b"][2], not f["a"][2]
        own = uses_own_gemm(lw, g, options)
        out.append(dict(text=k.text().splitlines()[0], batch=nb, P=P, Q=Q, R=K, a_k=a_k, b_n=b_n,
                        accumulates=g.accumulates(), times=trips.get(id(k), 1),
                        pick=plan_pick(P, Q, K, nb, own, options.cpu, a_k)))
    return out


def plan_pick(P, Q, R, nb, own, cpu, a_k=True) -> str:
    """What the plan runs the product's tiles with: `GemmGen.tile_limit` and `tiles`
    (gemm.py), then `own_tile` where the own kernel may run it."""
    mnk = P * Q * R
    flops = 2 * mnk * nb
    if nb >= cpu.gemm_batch_tasks or flops < cpu.gemm_parallel_min_flops:
        limit = 1 << 62
    else:
        limit = max(mnk // max(1, cpu.gemm_tiles), cpu.blas_tile_mnk)
    tp, tq, tr = P, Q, R
    while tp * tq * tr > limit:
        hp = tp if tp >= 2 * cpu.gemm_min_tile else 0
        hq = tq if tq >= 2 * cpu.gemm_min_tile else 0
        hr = tr if tr >= 2 * cpu.gemm_min_chunk else 0
        if hp >= hq and hp > 0:
            tp = (tp + 1) // 2
        elif hq > 0:
            tq = (tq + 1) // 2
        elif hr > 0:
            tr = (tr + 1) // 2
        else:
            break
    if tp * tq * tr * 2 <= cpu.gemm_loop_max_flops:
        return "loops"
    if not own:
        return "blas"
    from tgc.backends.cpu.gemm_dispatch import OWN_COLS

    deep = tr >= cpu.own_gemm_min_depth and tq >= OWN_COLS
    wide = tq >= cpu.own_gemm_min_cols or deep
    tall = tp >= getattr(cpu, "own_gemm_min_rows", 1 << 62) and tq >= 2 * OWN_COLS and tr * tq * 4 <= getattr(
        cpu, "own_gemm_tall_max_b_bytes", 0)
    edge = OWN_COLS < tq <= 16 * cpu.own_gemm_edge_vecs   # the edge block's columns (gemm_dispatch.edge_vecs)
    if not a_k and tq % OWN_COLS and tq < 2 * OWN_COLS and not edge:   # a transposed A': whole column blocks or two
        return "blas"
    if a_k and deep and tq <= OWN_COLS:   # one block of columns: B' packed once per row panel
        return "own"
    return "own" if wide and tr * tq * 4 <= cpu.own_gemm_max_b_bytes or tall else "blas"


# ---------------------------------------------------------------- timing


class Own:
    """tgc's own kernel (fgemm.own_kernel at `cpu`'s options) JIT-compiled alone at
    LLVM level `opt` (default: `Options().opt_level`, as in a program), with
    a loop over a batch around it: fn(lo, hi, batch strides of A, B and C, M, N, K, A,
    sam, sak, B, sbk, sbn, C, ldc)."""

    def __init__(self, cpu, rows: int | None = None, vecs: int | None = None, depth: int | None = None,
                 opt: int | None = None):
        import llvmlite.ir as ir

        from tgc.backends.cpu import llvm_env
        from tgc.backends.cpu.fgemm import own_kernel
        from tgc.backends.cpu.irutil import I32, I64, PTR, for_range

        mod = ir.Module("own")
        blocks = {k: v for k, v in (("rows", rows), ("vecs", vecs)) if v is not None}
        kern = own_kernel(mod, cpu, depth=depth, **blocks)
        f32 = ir.FloatType()
        fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [I64] * 5 + [I64] * 3 + [PTR, I64, I64, PTR, I64, I64, PTR, I64]),
                         "tgc_bench_own")
        lo, hi, sa, sb, sc, M, N, K, pa, sam, sak, pb, sbk, sbn, pc, ldc = fn.args
        b = ir.IRBuilder(fn.append_basic_block())
        arrs = [b.alloca(I64) for _ in range(4)]
        for arr, v in zip(arrs, (I64(0), I64(0), I64(0), K)):
            b.store(v, arr)
        edge = None
        if not blocks and cpu.own_gemm_edge_vecs > cpu.own_gemm_vecs:   # as GemmGen.call_own picks it
            from tgc.backends.cpu.gemm_dispatch import EDGE_ROWS

            edge = own_kernel(mod, cpu, EDGE_ROWS, cpu.own_gemm_edge_vecs, depth=depth)
        with for_range(b, lo, hi, "bi") as i:
            args = [M, N, K, b.gep(pa, [b.mul(i, sa)], source_etype=f32), sam, sak,
                    b.gep(pb, [b.mul(i, sb)], source_etype=f32), sbk, sbn,
                    b.gep(pc, [b.mul(i, sc)], source_etype=f32), ldc, I32(0), I64(1)] + arrs
            if edge is None:
                b.call(kern, args)
            else:   # a product a little wider than one block: the edge block (gemm_dispatch.edge_vecs)
                wide = b.and_(b.icmp_signed(">", N, I64(16 * cpu.own_gemm_vecs)),
                              b.icmp_signed("<=", N, I64(16 * cpu.own_gemm_edge_vecs)))
                with b.if_else(wide) as (then, otherwise):
                    with then:
                        b.call(edge, args)
                    with otherwise:
                        b.call(kern, args)
        b.ret_void()
        if opt is None:   # the level programs compile at (a kernel's code differs between -O2 and -O3)
            from tgc.options import Options
            opt = Options().opt_level
        self.jit = llvm_env.jit(str(mod), opt)
        i64, vp = ctypes.c_int64, ctypes.c_void_p
        self.fn = ctypes.CFUNCTYPE(None, *([i64] * 8), vp, i64, i64, vp, i64, i64, vp, i64)(
            self.jit.address("tgc_bench_own"))


HUGE = 2 << 20   # a transparent huge page


class HugePages:
    """Arrays on 2 MiB pages: slices, each starting on a 2 MiB boundary, of one large
    numpy array, which numpy asks the kernel to back with transparent huge pages (it
    does so for every array of 4 MiB or more, where the system allows it: `madvise`
    mode). The step's buffers are such arrays (tgc's workspace, the stacked
    parameters of the larger layers), while an operand of under 4 MiB made alone
    (a 384 x 1536 weight) sits on 4 KiB pages, whose TLB misses cost the products
    that read it 3-6 points of the peak (`--pages`)."""

    def __init__(self, nbytes: int = 256 << 20):
        self.pool = np.empty(nbytes + HUGE, np.uint8)
        self.start = self.at = (-self.pool.ctypes.data) % HUGE

    def reset(self) -> None:
        self.at = self.start

    def like(self, x: np.ndarray) -> np.ndarray:
        """A copy of `x` (or of the C-contiguous array `x` views, viewed the same way) here."""
        base = x if x.base is None else x.base
        if not base.flags.c_contiguous or base.nbytes != x.nbytes:
            raise ValueError("HugePages.like: x must be a C-contiguous array or a transposed view of one")
        if self.at + base.nbytes > self.pool.size:
            raise MemoryError("HugePages: the pool is full")
        y = self.pool[self.at:self.at + base.nbytes].view(base.dtype).reshape(base.shape)
        self.at += -(-base.nbytes // HUGE) * HUGE
        y[...] = base
        return y if x.base is None else np.lib.stride_tricks.as_strided(y, x.shape, x.strides)


_PAGES: HugePages | None = None   # `--pages huge`: operands come from here


def operands(p: dict, rng):
    """(A', B', C') numpy arrays, batched, in the product's layouts (on 2 MiB pages
    with `--pages huge`: `HugePages`)."""
    nb, P, Q, R = p["batch"], p["P"], p["Q"], p["R"]
    A = rng.standard_normal((nb, P, R), np.float32) if p["a_k"] else \
        rng.standard_normal((nb, R, P), np.float32).transpose(0, 2, 1)
    B = rng.standard_normal((nb, R, Q), np.float32) if p["b_n"] else \
        rng.standard_normal((nb, Q, R), np.float32).transpose(0, 2, 1)
    C = np.zeros((nb, P, Q), np.float32)
    if _PAGES is None:
        return A, B, C
    _PAGES.reset()
    return tuple(_PAGES.like(x) for x in (A, B, C))


def halves(p: dict):
    """The product cut in two as tgc's plan cuts it: ('batch' | 'P' | 'Q', cut)."""
    if p["batch"] > 1:
        return "batch", p["batch"] // 2
    return ("P", (p["P"] + 1) // 2) if p["P"] >= p["Q"] else ("Q", (p["Q"] + 1) // 2)


def part(x, axis, lo, hi):
    """The part [lo, hi) of batched matrix `x` along 'batch', its rows 'P' or columns 'Q'."""
    return {"batch": x[lo:hi], "P": x[:, lo:hi], "Q": x[:, :, lo:hi]}[axis]


def split(p, A, B, C):
    """Both halves' (A', B', C') views."""
    axis, cut = halves(p)
    n = {"batch": p["batch"], "P": p["P"], "Q": p["Q"]}[axis]
    out = []
    for lo, hi in ((0, cut), (cut, n)):
        out.append((part(A, axis, lo, hi) if axis != "Q" else A,
                    part(B, "Q" if axis == "Q" else axis, lo, hi) if axis != "P" else B,
                    part(C, axis, lo, hi)))
    return out


def run_blas(A, B, C):
    np.matmul(A, B, out=C)


def run_own(own, A, B, C):
    nb, M, K = A.shape
    N = B.shape[2]
    s = 4
    own.fn(0, nb, A.strides[0] // s if nb > 1 else 0, B.strides[0] // s if nb > 1 else 0,
           C.strides[0] // s if nb > 1 else 0, M, N, K, A.ctypes.data, A.strides[1] // s,
           A.strides[2] // s, B.ctypes.data, B.strides[1] // s, B.strides[2] // s, C.ctypes.data, C.strides[1] // s)


def run_own_cached(own, A, B, C):
    """The own kernel on every batch index of the product, each reading batch index 0's
    A' and B' and writing its C' (batch strides 0): operands in cache, the product's
    time less what fetching each index's operands from L3 or memory costs."""
    nb, M, K = A.shape
    N = B.shape[2]
    s = 4
    own.fn(0, nb, 0, 0, 0, M, N, K, A.ctypes.data, A.strides[1] // s, A.strides[2] // s, B.ctypes.data,
           B.strides[1] // s, B.strides[2] // s, C.ctypes.data, C.strides[1] // s)


PINS = ("none", "A", "B", "C", "all")


def pinned(A, B, C, pin: str) -> list[int]:
    """`Own.fn`'s stride arguments (batch strides of A', B', C'; sam, sak; sbk, sbn; ldc)
    for batched A', B', C', with operand `pin` ('A', 'B', 'C', 'all' or 'none') held in
    one place: its batch stride and its stride other than 1 set to 0, so that every
    batch index, and every row (A', C') or K (B'), reads or writes the same few lines,
    which stay in L1. The flops and the kernel's path are the product's; the values
    are not (a timing, never a result)."""
    s, nb = 4, A.shape[0]
    st = {n: [x.strides[0] // s if nb > 1 else 0] + [v // s for v in x.strides[1:]] for n, x in zip("ABC", (A, B, C))}
    for n in ("ABC" if pin == "all" else pin if pin in "ABC" else ""):
        st[n] = [0] + [v if v == 1 else 0 for v in st[n][1:]]
    return [st["A"][0], st["B"][0], st["C"][0], *st["A"][1:], *st["B"][1:], st["C"][1]]


def operand_costs(p: dict, own, reps: int, rng) -> dict:
    """Seconds of the own kernel on one thread on product `p` with each operand pinned
    in cache (`pinned`), the variants alternated in rounds, the minimum of each: the
    gap between 'none' and 'A' is what reading A' from L2, L3 or memory costs, and so
    on; 'all' is the kernel with every operand in L1."""
    A, B, C = operands(p, rng)
    nb, M, K = A.shape
    N = B.shape[2]
    args = {pin: pinned(A, B, C, pin) for pin in PINS}
    best = dict.fromkeys(PINS, float("inf"))
    for _ in range(reps):
        for pin, (sa, sb, sc, sam, sak, sbk, sbn, ldc) in args.items():
            t0 = time.thread_time()
            own.fn(0, nb, sa, sb, sc, M, N, K, A.ctypes.data, sam, sak, B.ctypes.data, sbk, sbn, C.ctypes.data, ldc)
            best[pin] = min(best[pin], time.thread_time() - t0)
    return best


def operands_table(width: int, batch: int, reps: int, pk: dict, options) -> None:
    """Per product shape of the step, the own kernel's % of the peak on one thread with
    each operand pinned in cache (`operand_costs`)."""
    from threadpoolctl import threadpool_limits

    seen = {}
    for p in products(width, batch, options):
        key = (p["batch"], p["P"], p["Q"], p["R"], p["a_k"], p["b_n"])
        seen.setdefault(key, dict(p, times=0))["times"] += p["times"]
    own, rng = Own(options.cpu, opt=options.opt_level), np.random.default_rng(0)
    print(f"\nwidth {width}, batch {batch}: the own kernel on one thread, % of the peak with the operand named "
          f"held in cache (`pinned`); load {os.getloadavg()[0]:.2f}")
    print(f"{'product (batch x P x Q x R, A B)':<34} {'x/step':>6} | " + " ".join(f"{k:>5}" for k in PINS))
    with threadpool_limits(1):
        for (nb, P, Q, R, a_k, b_n), p in seen.items():
            best = operand_costs(p, own, reps, rng)
            flops = 2.0 * nb * P * Q * R
            name = f"{nb} x {P} x {Q} x {R} {'N' if a_k else 'T'}{'N' if b_n else 'T'}"
            print(f"{name:<34} {p['times']:>6} | "
                  + " ".join(f"{100 * flops / best[k] / 1e9 / pk['gflops']:>5.0f}" for k in PINS))
    own.jit.close()


def one_thread(fn, reps):
    ts = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        ts.append(time.thread_time() - t0)
    return min(ts)


class Pair:
    """Two worker threads that run a pair of functions at once; `time(f, g, reps)`: the
    minimum over the runs of the larger of the two threads' CPU times (on a shared
    machine the wall time says more about the other processes than about the kernels;
    each thread's own CPU time still includes what the other's traffic costs it)."""

    def __init__(self):
        self.go, self.done = threading.Barrier(3), threading.Barrier(3)
        self.work, self.spent = [None, None], [0.0, 0.0]
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(2)]
        for t in self.threads:
            t.start()

    def _loop(self, i):
        while True:
            self.go.wait()
            if self.work[i] is None:
                return
            t0 = time.thread_time()
            self.work[i]()
            self.spent[i] = time.thread_time() - t0
            self.done.wait()

    def time(self, f, g, reps):
        self.work = [f, g]
        ts = []
        for _ in range(reps):
            self.go.wait()
            self.done.wait()
            ts.append(max(self.spent))
        return min(ts)

    def close(self):
        self.work = [None, None]
        self.go.wait()


def measure(p: dict, own, pair, reps: int, rng) -> dict:
    """Seconds: own / blas on 1 and 2 threads; checks each result against numpy (an
    own kernel that reads A' with its K contiguous only, as before it took any
    strides, gives no time for the other layout)."""
    A, B, C = operands(p, rng)
    want = np.matmul(A.astype(np.float64), B.astype(np.float64))
    res = {}
    kinds = {"blas": run_blas, "own": lambda A, B, C: run_own(own, A, B, C)}
    for name, run in kinds.items():
        C[...] = np.nan
        run(A, B, C)
        err = np.abs(C - want).max() / max(1e-30, np.abs(want).max())
        if not err < 1e-5:
            if name == "own" and not p["a_k"]:
                continue
            raise AssertionError(f"{name} on {p['text']}: relative error {err:.2e}")
        res[name, 1] = one_thread(lambda: run(A, B, C), reps)
        (a0, b0, c0), (a1, b1, c1) = split(p, A, B, C)
        C[...] = np.nan
        res[name, 2] = pair.time(lambda: run(a0, b0, c0), lambda: run(a1, b1, c1), reps)
        err = np.abs(C - want).max() / max(1e-30, np.abs(want).max())
        if not err < 1e-5:
            raise AssertionError(f"{name} in two halves on {p['text']}: relative error {err:.2e}")
    if p["batch"] > 1 and ("own", 1) in res:   # the same flops with every index's operands in cache
        res["cached", 1] = one_thread(lambda: run_own_cached(own, A, B, C), reps)
    return res


def table(width: int, batch: int, reps: int, pk: dict, options) -> list[dict]:
    from threadpoolctl import threadpool_limits

    prods = products(width, batch, options)
    seen, rows = {}, []
    for p in prods:   # one row per shape and layout, with how many times a step runs it
        key = (p["batch"], p["P"], p["Q"], p["R"], p["a_k"], p["b_n"])
        if key in seen:
            seen[key]["times"] += p["times"]
            seen[key]["pick"] = seen[key]["pick"] if seen[key]["pick"] == p["pick"] else "mixed"
            continue
        seen[key] = dict(p)
        rows.append(seen[key])
    own, pair, rng = Own(options.cpu, opt=options.opt_level), Pair(), np.random.default_rng(0)
    hz, gpeak = pk["fma_clock"], pk["gflops"]
    print(f"\nwidth {width}, batch {batch} (t 256): {len(prods)} products, {len(rows)} distinct; "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'product (batch x P x Q x R, A B)':<34} {'x/step':>6} {'MB':>6} {'pick':>5} | "
          + " | ".join(f"{k:>4} {t}T: GF/s  %pk  Mcyc" for k in ("own", "blas") for t in (1, 2))
          + " | own 1T cached: GF/s  %pk")
    total = {"own": 0.0, "blas": 0.0, "pick": 0.0, "best": 0.0}
    with threadpool_limits(1):
        for p in rows:
            res = measure(p, own, pair, reps, rng)
            flops = 2.0 * p["batch"] * p["P"] * p["Q"] * p["R"]
            mb = 4 * p["batch"] * (p["P"] * p["R"] + p["R"] * p["Q"] + p["P"] * p["Q"]) / 1e6
            name = f"{p['batch']} x {p['P']} x {p['Q']} x {p['R']} {'N' if p['a_k'] else 'T'}{'N' if p['b_n'] else 'T'}"
            cells = []
            for k in ("own", "blas"):
                for t in (1, 2):
                    s = res.get((k, t))
                    if s is None:
                        cells.append(f"{'-':>19}")
                        continue
                    g = flops / s / 1e9
                    cells.append(f"{g:>7.0f} {100 * g / (gpeak * t):>4.0f} {s * hz / 1e6:>6.2f}")
            s = res.get(("cached", 1))
            cells.append(f"{'-':>23}" if s is None else f"{flops / s / 1e9:>17.0f} {100 * flops / s / 1e9 / gpeak:>4.0f}")
            p["res"] = res
            pick = p["pick"] if p["pick"] in ("own", "blas") else "blas"
            total["pick"] += p["times"] * res.get((pick, 2), res["blas", 2])
            total["blas"] += p["times"] * res["blas", 2]
            total["own"] += p["times"] * res.get(("own", 2), res["blas", 2])
            total["best"] += p["times"] * min(v for (k, t), v in res.items() if t == 2)
            print(f"{name:<34} {p['times']:>6} {mb:>6.1f} {p['pick']:>5} | " + " | ".join(cells))
    pair.close()
    own.jit.close()
    print(f"a step's products on 2 threads: {total['pick'] * 1e3:.1f} ms as the plan picks, "
          f"{total['blas'] * 1e3:.1f} all OpenBLAS, {total['own'] * 1e3:.1f} own where it may, "
          f"{total['best'] * 1e3:.1f} the faster of each")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, action="append", help="model width (a multiple of 64); default 384 and 768")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20, help="timed runs per product and kernel (minimum)")
    ap.add_argument("--peak-only", action="store_true")
    ap.add_argument("--operands", action="store_true",
                    help="instead of the table: the own kernel with each operand held in cache (what its traffic costs)")
    ap.add_argument("--pages", choices=("small", "huge"), default="small",
                    help="the operands' pages: numpy's for each array alone (4 KiB under 4 MiB), or 'huge': 2 MiB "
                         "pages, as the step's workspace and large parameters are (HugePages)")
    args = ap.parse_args(argv)
    global _PAGES
    _PAGES = HugePages() if args.pages == "huge" else None

    from tgc.backends.cpu.llvm_env import has_feature
    from tgc.options import Options

    if not has_feature("avx512f"):
        print("gemm_peak: this CPU has no AVX-512 (the peak loop and the own kernel use it)", file=sys.stderr)
        return 1
    pk = peak()
    print(f"FMA peak of one core: {pk['gflops']:.1f} GFLOP/s = {pk['flops_per_cycle']:.1f} flops/cycle at "
          f"{pk['fma_clock'] / 1e9:.2f} GHz under AVX-512 FMA load (scalar clock {pk['clock'] / 1e9:.2f} GHz); "
          f"load {os.getloadavg()[0]:.2f}")
    if args.peak_only:
        return 0
    for width in args.width or (384, 768):
        if args.operands:
            operands_table(width, args.batch, args.reps, pk, Options())
            continue
        table(width, args.batch, args.reps, pk, Options())
    return 0


if __name__ == "__main__":
    sys.exit(main())
