"""Attention's backward products over the keys, alone: why dk and dv run below dq and y.

Per stream step (128 query rows, a causal run's s keys), dk = dS^T q is the own kernel's
C'[s, 64] += A'[s, 128] B'[128, 64] with A' = dS^T read with its rows contiguous (a K
stride of s floats), and dq = dS k is C'[128, 64] = A[128, s] B[s, 64] (K contiguous).
dv = P^T dy and y = P v are the same shapes over P. Two tables, one thread, the least
`time.thread_time` of `--reps` calls, variants alternated in one process:

1. `runs`: dk's product at every run's keys (s = 256 .. 8192 by 256, the L2 flushed
   before each call unless `--no-flush`), per variant (default: OpenBLAS, which ran
   it before `own_gemm_tall_transposed`, and the own kernel with `own_gemm_copy_a_rows`
   0 and at its default): per s and summed.
2. `pair`: dq then dk over one dS, as the step runs them (`sep`), against dq's K blocks
   (the kernel's own: even blocks of at most 400 keys) interleaved with dk's rows
   over the same keys (`pair`: each block of dS read by dk from L2 right after dq
   read it). Both make the same calls of the kernel per element: the same bits
   (checked). A plan, not what a program runs.

    python benchmarks/attention_pair.py
    python benchmarks/attention_pair.py --table runs --no-flush --variant blas --variant c48= --variant c96=own_gemm_copy_a_rows=96
    python benchmarks/attention_pair.py --table pair --variant off=own_gemm_copy_a_rows=0 --variant on=
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PEAK = 209.5   # one core's f32 FMA peak on the reference Xeon, GFLOP/s (gemm_peak.py)
T = 128        # a step's query rows


def build(cpu):
    """(jit, {'one': f(M, N, K, A, sam, sak, B, sbk, sbn, C, ldc, acc), 'sep' / 'pair':
    f(s, dS, q, k, dk, dq, step)}) of the own kernel at `cpu`'s options."""
    import llvmlite.ir as ir

    from tgc.backends.cpu import llvm_env
    from tgc.backends.cpu.fgemm import own_kernel
    from tgc.backends.cpu.irutil import I32, I64, PTR, for_range
    from tgc.options import Options

    f32 = ir.FloatType()
    mod = ir.Module("pair")
    kern = own_kernel(mod, cpu)

    def caller(b):
        arrs = [b.alloca(I64) for _ in range(4)]

        def call(M, N, K, pa, sam, sak, pb, sbk, sbn, pc, ldc, acc):
            for arr, v in zip(arrs, (I64(0), I64(0), I64(0), K)):
                b.store(v, arr)
            b.call(kern, [M, N, K, pa, sam, sak, pb, sbk, sbn, pc, ldc, acc, I64(1)] + arrs)
        return call

    one = ir.Function(mod, ir.FunctionType(ir.VoidType(), [I64] * 3 + [PTR, I64, I64, PTR, I64, I64, PTR, I64, I32]),
                      "one")
    b = ir.IRBuilder(one.append_basic_block())
    caller(b)(*one.args)
    b.ret_void()
    for name in ("sep", "pair"):
        fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [I64, PTR, PTR, PTR, PTR, PTR, I64]), name)
        s, dS, q, k, dk, dq, step = fn.args
        b = ir.IRBuilder(fn.append_basic_block())
        call = caller(b)
        if name == "sep":
            call(I64(T), I64(64), s, dS, s, I64(1), k, I64(64), I64(1), dq, I64(64), I32(0))
            call(s, I64(64), I64(T), dS, I64(1), s, q, I64(64), I64(1), dk, I64(64), I32(1))
        else:
            n = b.sdiv(b.add(s, b.sub(step, I64(1))), step)
            with for_range(b, I64(0), n, "c") as c:
                c0 = b.mul(c, step)
                w = b.select(b.icmp_signed("<", b.sub(s, c0), step), b.sub(s, c0), step)
                at = b.gep(dS, [c0], source_etype=f32)
                call(I64(T), I64(64), w, at, s, I64(1), b.gep(k, [b.mul(c0, I64(64))], source_etype=f32), I64(64),
                     I64(1), dq, I64(64), b.zext(b.icmp_signed(">", c, I64(0)), I32))
                call(w, I64(64), I64(T), at, I64(1), s, q, I64(64), I64(1),
                     b.gep(dk, [b.mul(c0, I64(64))], source_etype=f32), I64(64), I32(1))
        b.ret_void()
    jit = llvm_env.jit(str(mod), Options().opt_level)
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    fns = {"one": ctypes.CFUNCTYPE(None, i64, i64, i64, vp, i64, i64, vp, i64, i64, vp, i64, ctypes.c_int32)(
        jit.address("one"))}
    for name in ("sep", "pair"):
        fns[name] = ctypes.CFUNCTYPE(None, i64, vp, vp, vp, vp, vp, i64)(jit.address(name))
    return jit, fns


def aligned(shape, rng):
    """A standard normal f32 array starting on a 64-byte line (as tgc's buffers do)."""
    n = int(np.prod(shape))
    raw = np.empty(n + 16, np.float32)
    off = (-raw.ctypes.data % 64) // 4
    out = raw[off:off + n].reshape(shape)
    out[:] = rng.standard_normal(shape)
    return out


def runs_table(variants, reps, rng, flush_l2=True):
    keys = [256 * i for i in range(1, 33)]
    data = {s: [(aligned((T, s), rng), aligned((T, 64), rng), aligned((s, 64), rng)) for _ in range(2)] for s in keys}
    flush = np.ones(8 << 20, np.float32)   # 32 MB
    best = {}
    for rep in range(reps):
        for s in keys:
            for name in (list(variants) if rep % 2 == 0 else list(variants)[::-1]):
                dS, q, C = data[s][rep % 2]
                if flush_l2:
                    flush[::16] += 1.0
                t0 = time.thread_time()
                if variants[name] is None:   # OpenBLAS (numpy's, one thread): C = A' B', A' transposed
                    np.matmul(dS.T, q, out=C)
                else:
                    variants[name][1]["one"](s, 64, T, dS.ctypes.data, 1, s, q.ctypes.data, 64, 1, C.ctypes.data, 64,
                                             1)
                dt = time.thread_time() - t0
                best[name, s] = min(best.get((name, s), dt), dt)
    for s in keys:
        if s % 1024 == 0:
            print(f"s = {s}: " + "  ".join(f"{n} {1e3 * best[n, s]:.3f} ms {2 * s * 64 * T / best[n, s] / 1e9 / PEAK:.0%}"
                                         for n in variants))
    flops = sum(2 * s * 64 * T for s in keys)
    print("sum: " + "  ".join(f"{n} {1e3 * sum(best[n, s] for s in keys):.2f} ms "
                              f"{flops / sum(best[n, s] for s in keys) / 1e9 / PEAK:.1%}" for n in variants))


def pair_table(variants, reps, rng):
    variants = {n: v for n, v in variants.items() if v is not None}
    for s in (1024, 2048, 4096, 8192):
        chunks = -(-s // 400)
        step = -(-s // chunks)   # the kernel's K blocks of dq (fgemm: even, at most 5/4 of own_gemm_depth)
        sets = [[aligned(x, rng) for x in ((T, s), (T, 64), (s, 64), (s, 64), (T, 64))] for _ in range(3)]
        best, outs = {}, {}
        for rep in range(reps):
            for name in (list(variants) if rep % 2 == 0 else list(variants)[::-1]):
                for form in ("sep", "pair"):
                    dS, q, k, dk, dq = sets[rep % 3]
                    t0 = time.thread_time()
                    variants[name][1][form](s, dS.ctypes.data, q.ctypes.data, k.ctypes.data, dk.ctypes.data,
                                            dq.ctypes.data, step)
                    dt = time.thread_time() - t0
                    best[name, form] = min(best.get((name, form), dt), dt)
        for name in variants:
            for form in ("sep", "pair"):
                dS, q, k, _, _ = sets[0]
                dk, dq = np.full((s, 64), 0.5, np.float32), np.empty((T, 64), np.float32)
                variants[name][1][form](s, dS.ctypes.data, q.ctypes.data, k.ctypes.data, dk.ctypes.data,
                                        dq.ctypes.data, step)
                outs[name, form] = (dk, dq)
        ref = next(iter(outs.values()))
        same = all(np.array_equal(o[0], ref[0]) and np.array_equal(o[1], ref[1]) for o in outs.values())
        print(f"s = {s}: " + "  ".join(f"{n}/{f} {1e3 * t:.3f} ms {4 * s * 64 * T / t / 1e9 / PEAK:.0%}"
                                     for (n, f), t in best.items()) + ("" if same else "  BITS DIFFER"))


def main() -> None:
    from tgc.backends.cpu.options import CpuOptions

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", choices=("runs", "pair", "both"), default="both")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--no-flush", action="store_true", help="runs: leave the L2 as the last call left it")
    ap.add_argument("--variant", action="append", default=None,
                    help="NAME=FIELD=N,FIELD=N (CpuOptions fields), or blas (OpenBLAS, runs only); "
                         "default: blas, off=own_gemm_copy_a_rows=0 and on=")
    args = ap.parse_args()
    variants = {}
    for text in args.variant or ["blas", "off=own_gemm_copy_a_rows=0", "on="]:
        if text == "blas":
            variants["blas"] = None
            continue
        name, _, rest = text.partition("=")
        fields = {k: int(v) for k, _, v in (item.partition("=") for item in filter(None, rest.split(",")))}
        variants[name] = build(CpuOptions().with_(**fields))
    rng = np.random.default_rng(0)
    if args.table in ("runs", "both"):
        from threadpoolctl import threadpool_limits

        with threadpool_limits(1):
            runs_table(variants, args.reps, rng, flush_l2=not args.no_flush)
    if args.table in ("pair", "both"):
        pair_table(variants, args.reps, rng)


if __name__ == "__main__":
    main()
