"""What the own f32 kernel's FMA loop can reach on this core: its instruction mix
as inline assembly, against the register-only loop of the same fused multiply-adds.

Each variant is one K loop (unrolled by 4, one pointer bump and index add an
iteration, as fgemm.own_kernel emits it) of a register block of R rows x V vectors
of 16 floats: per K step V aligned vector loads of a packed row of B (`vmovaps`),
per row one `vbroadcastss` of A[i, k] and V `vfmadd231ps`. A's rows are 384 floats
apart, B's packed rows K x V x 16 floats (in L1 at K = 128, L2 at 384). Variants
drop the loads of B or of A (the same FMAs on registers), use FMAs with an embedded
broadcast (`{1to16}`, one load per FMA), read A packed (the block's rows of one K
side by side), or other register blocks. Each variant's time per FMA, the minimum
over alternated runs of the thread's CPU time (pinned to one CPU), is given as a
percentage of the register-only loop's (100% = both FMA ports busy every cycle).

    python benchmarks/fma_mix.py            # K 128 and 384
    python benchmarks/fma_mix.py --k 384 --reps 60
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import numpy as np

A_REGS = ["r8", "r9", "r10", "r11", "r12", "r13", "r14", "rbx"]
A_STRIDE = 384   # floats between A's rows (a width-384 product's K)


def body(rows: int, vecs: int, k: int, a: str = "bcast", b_loads: bool = True) -> list[str]:
    """One K step (the k-th of an iteration): `a` is 'bcast' (vbroadcastss, A's rows
    through pointers and an index), 'packed' (one pointer, the rows side by side),
    'embed' (an embedded broadcast in every FMA) or 'none' (registers only)."""
    acc = rows * vecs
    breg = list(range(acc, acc + vecs))
    spare = list(range(acc + vecs, 32))
    out = [f"vmovaps {(k * vecs + c) * 64}(%rdi), %zmm{breg[c]}" for c in range(vecs)] if b_loads else []
    for r in range(rows):
        t = spare[r % len(spare)] if spare else None
        if a == "bcast":
            out.append(f"vbroadcastss {4 * k}(%{A_REGS[r]},%rax,4), %zmm{t}")
        elif a == "packed":
            out.append(f"vbroadcastss {4 * (k * rows + r)}(%{A_REGS[0]},%rax,4), %zmm{t}")
        for c in range(vecs):
            src = f"{4 * k}(%{A_REGS[r]},%rax,4){{1to16}}" if a == "embed" else f"%zmm{t}"
            out.append(f"vfmadd231ps {src}, %zmm{breg[c]}, %zmm{r * vecs + c}")
    return out


VARIANTS = {   # name: (rows, vecs, a, b_loads)
    "registers only 6x4": (6, 4, "none", False),
    "6x4 broadcasts only": (6, 4, "bcast", False),
    "6x4 B loads only": (6, 4, "none", True),
    "6x4 (the kernel's loop)": (6, 4, "bcast", True),
    "6x4 A packed": (6, 4, "packed", True),
    "6x4 embedded broadcast": (6, 4, "embed", True),
    "8x3": (8, 3, "bcast", True),
    "4x6": (4, 6, "bcast", True),
}


def build(unroll: int = 4):
    import llvmlite.binding as llvm
    import llvmlite.ir as ir

    from tgc.backends.cpu import llvm_env

    llvm.initialize_native_asmparser()
    mod, i64 = ir.Module("fma_mix"), ir.IntType(64)
    ptr = ir.PointerType(ir.IntType(8))
    zero = "".join(f"vpxord %zmm{i}, %zmm{i}, %zmm{i}\n" for i in range(32))
    clobbers = ("~{rax},~{rbx},~{rdi},~{r8},~{r9},~{r10},~{r11},~{r12},~{r13},~{r14},~{r15},"
                + ",".join(f"~{{zmm{i}}}" for i in range(32)) + ",~{dirflag},~{fpsr},~{flags},~{memory}")
    names = {}
    for i, (name, (rows, vecs, a, bl)) in enumerate(VARIANTS.items()):
        steps = [line for k in range(unroll) for line in body(rows, vecs, k, a, bl)]
        a_step = unroll * rows if a == "packed" else unroll
        load = "".join(f"movq {8 * j}(%rsi), %{r}\n" for j, r in enumerate(A_REGS))
        # args: 8 row pointers, B, iterations per pass; rcx passes over K
        asm = (zero + "2:\n" + load + "movq 64(%rsi), %rdi\nxorq %rax, %rax\nmovq 72(%rsi), %r15\n1:\n"
               + "\n".join(steps) + f"\naddq $${a_step}, %rax\naddq $${unroll * vecs * 64}, %rdi\n"
               + "decq %r15\njnz 1b\ndecq %rcx\njnz 2b\n")
        fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [i64, ptr]), f"mix{i}")
        b = ir.IRBuilder(fn.append_basic_block())
        b.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), [i64, ptr]), asm, "{rcx},{rsi}," + clobbers,
                            side_effect=True), fn.args)
        b.ret_void()
        names[name] = f"mix{i}"
    jit = llvm_env.jit(str(mod))
    return jit, {n: ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p)(jit.address(s)) for n, s in names.items()}


def run(k: int, reps: int, passes: int, unroll: int = 4) -> dict:
    """{variant: seconds per FMA}; prints each against the register-only loop."""
    jit, fns = build(unroll)
    b = np.zeros(k * 6 * 16 + 64, np.float32)
    a = np.zeros(8 * A_STRIDE + 8 * k + 64, np.float32)
    b_at = b.ctypes.data + 4 * ((-b.ctypes.data // 4) % 16)
    args = (ctypes.c_int64 * 10)(*[a.ctypes.data + 4 * r * A_STRIDE for r in range(8)], b_at, k // unroll)
    times = {n: [] for n in fns}
    for _ in range(reps):
        for n, f in fns.items():
            t0 = time.thread_time()
            f(passes, ctypes.addressof(args))
            times[n].append(time.thread_time() - t0)
    per_fma = {n: min(ts) / (passes * k * VARIANTS[n][0] * VARIANTS[n][1]) for n, ts in times.items()}
    base = per_fma["registers only 6x4"]
    print(f"K {k} (B' {k * 256 // 1024} KiB for 6x4); load {os.getloadavg()[0]:.2f}")
    for n, s in per_fma.items():
        print(f"  {n:<26} {100 * base / s:6.1f}% of the register-only loop")
    jit.close()
    return per_fma


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, action="append", help="K steps a pass (a multiple of 4); default 128 and 384")
    ap.add_argument("--reps", type=int, default=40, help="alternated runs of each variant (minimum)")
    ap.add_argument("--passes", type=int, default=300, help="passes over K a run")
    args = ap.parse_args(argv)
    from tgc.backends.cpu.llvm_env import has_feature

    if not has_feature("avx512f"):
        print("fma_mix: this CPU has no AVX-512", file=sys.stderr)
        return 1
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    for k in args.k or (128, 384):
        run(k, args.reps, args.passes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
