"""A lowered GEMM cell as one cuBLAS strided batched GEMM call, and that call run by
numpy under cuda-sim.

`plan(groups, operands, sizes)` describes `out[batch, m, n] = sum_k a[batch, m, k] * b[batch, k, n]`
(`GemmKernel`, no taps or shifts) as the arguments of `cublas<t>gemmStridedBatched`
(column-major, element strides): transpose flags, m/n/k, leading dimensions, batch
strides and count. Each edge group (batch, m, n, k) must merge into one strided
dimension in every operand that has it, with its edges in the same order (an
operand lacking the whole batch group is broadcast with batch stride 0), and each
matrix must have a unit stride on one of its two dimensions; a row-major output is
computed as its transpose (`C^T = B^T A^T`), so the orientation of every operand is
absorbed by a flag, never a copy. Otherwise `plan` returns None and the caller
multiplies strided views (`matmul`, which may copy). `plan_looped` also tries
looping over some batch edges around the call (fewest iterations first), for batch
groups that do not merge (attention's batch and head with the sequence between them).

A complex product (`GemmKernel.cplx`: float pairs along `re.im`, the innermost axis)
is the same call on the buffers seen as complex arrays, with strides in pairs, a
real scale `alpha`, and each conjugated operand read with cuBLAS's conjugate
transpose (`cublas<c|z>gemmStridedBatched`); an operand that must be conjugated but
is not transposed in the call (cuBLAS has no conjugate without transpose) is left to
the caller's strided views.

A product of two bf16 (or two f16) buffers into an f32 one (the `cublas_operands`
stage keeps those: `operands.py`) is the same call with its input type named
(`GemmCall.atype`/`btype`): `cublasGemmStridedBatchedEx` with `CUDA_R_16BF` (or
`CUDA_R_16F`) inputs, a `CUDA_R_32F` output and `CUBLAS_COMPUTE_32F`, f32 `alpha` and
`beta` (`ex_types` gives the four codes).

`run_numpy(call, a, b, c)` executes the call's exact semantics on flat host arrays
(every element addressed through the call's leading dimensions and strides), so the
emulator checks the numbers a GPU would pass to cuBLAS. Exact: one product of the
same operands (the summation order is numpy's or cuBLAS's). For a GemmEx call it
widens the bf16/f16 operands to f32 (exact) and multiplies in f32 (numpy's sgemm):
with CUBLAS_COMPUTE_32F cuBLAS forms each product of two bf16/f16 values exactly in
f32 (8 + 8 or 11 + 11 significant bits fit f32's 24) and sums in f32, so both compute
the same exact products summed in f32, in their own orders: a faithful oracle to f32
summation rounding (an f64 product rounded once would be more exact than the device).
Planning is a fixed number of passes over at most four groups: it terminates.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GemmCall:
    transa: bool          # op(A) = A^T
    transb: bool
    m: int
    n: int
    k: int
    a: str                # the buffer cuBLAS calls A (the lowered kernel's b when the output is row-major)
    lda: int
    stride_a: int
    b: str
    ldb: int
    stride_b: int
    ldc: int
    stride_c: int
    batch: int
    conja: bool = False   # a complex product: op(A) conjugates (cuBLAS's CUBLAS_OP_C, with transa)
    conjb: bool = False
    alpha: float = 1.0    # a complex product's real scale
    beta: float = 0.0     # 1: C += op(A) op(B) (an accumulating GEMM, `GemmKernel.acc`)
    atype: str = ""       # A's element type as stored when it is bf16 or f16 (a GemmEx call), else ""
    btype: str = ""


# cudaDataType_t (library_types.h) and cublasComputeType_t / cublasGemmAlgo_t (cublas_api.h)
# codes of the GemmEx calls (CuPy's runtime module names some, not CUDA_R_16BF)
CUDA_R = {"f32": 0, "f64": 1, "f16": 2, "bf16": 14}
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1


def ex_types(call: GemmCall) -> tuple[int, int, int, int] | None:
    """(Atype, Btype, Ctype, computeType) of a GemmEx call (bf16/f16 inputs, f32
    output, f32 compute), or None for a plain <t>gemmStridedBatched call."""
    if not call.atype:
        return None
    return CUDA_R[call.atype], CUDA_R[call.btype], CUDA_R["f32"], CUBLAS_COMPUTE_32F


def _merge(group, strides: dict, sizes: dict) -> tuple[int, tuple[str, ...]] | None:
    """(stride, edge order) of `group` as one dimension of a buffer with element
    `strides` per edge: its edges nested without gaps, outermost first (size-1
    edges go anywhere); None if they are not. An empty group: stride 0, ()."""
    live = [e for e in group if sizes[e] != 1]
    if not live:
        return 0, ()
    order = sorted(live, key=lambda e: -strides[e])
    for outer, inner in zip(order, order[1:]):
        if strides[outer] != strides[inner] * sizes[inner]:
            return None
    return strides[order[-1]], tuple(order)


def plan_looped(k, operands: dict, sizes: dict) -> tuple[GemmCall, tuple[str, ...]] | None:
    """The cuBLAS call of GEMM cell `k` and the batch edges looped around it (each
    iteration offsets the three pointers), fewest iterations first; None if no
    split of the batch group gives a call. `operands` maps 'a', 'b', 'out' to
    (buffer name, {view edge: element stride}); `sizes` gives each edge's size.
    (Attention's batch(batch, head) with `t` between them in memory: `batch` looped,
    `head` the call's batch.)"""
    from itertools import combinations

    splits = [c for r in range(len(k.batch) + 1) for c in combinations(k.batch, r)]
    splits.sort(key=lambda c: int(np.prod([sizes[e] for e in c], dtype=np.int64)))
    for looped in splits:
        rest = tuple(e for e in k.batch if e not in looped)
        call = plan({"batch": rest, "m": k.m, "n": k.n, "k": k.k}, operands, sizes)
        if call is not None:
            return call, looped
    return None


def plan(groups: dict, operands: dict, sizes: dict) -> GemmCall | None:
    """The cuBLAS call of `out[batch, m, n] = a[batch, m, k] @ b[batch, k, n]` over the
    edge `groups` ('batch', 'm', 'n', 'k'); operands and sizes as in `plan_looped`."""
    count = {g: int(np.prod([sizes[e] for e in es], dtype=np.int64)) for g, es in groups.items()}
    if min(count.values()) == 0:
        return None
    merged = {}
    for role, gs in (("a", ("batch", "m", "k")), ("b", ("batch", "k", "n")), ("out", ("batch", "m", "n"))):
        strides = operands[role][1]
        for g in gs:
            es = groups[g]
            if g == "batch" and role != "out" and not any(e in strides for e in es):
                merged[role, g] = (0, None)      # broadcast over the batch
                continue
            if not all(e in strides for e in es):
                return None
            got = _merge(es, strides, sizes)
            if got is None:
                return None
            merged[role, g] = got
    for g, roles in (("batch", ("a", "b", "out")), ("m", ("a", "out")), ("n", ("b", "out")), ("k", ("a", "b"))):
        orders = {merged[r, g][1] for r in roles if merged[r, g][1] is not None}
        if len(orders) > 1:
            return None

    def stride(role: str, g: str, other: str) -> int:
        """The group's stride; a size-1 group takes one that makes the matrix valid."""
        if count[g] != 1:
            return merged[role, g][0]
        s_other = merged[role, other][0] if count[other] != 1 else 1
        return count[other] * s_other if s_other == 1 else 1

    sam, sak = stride("a", "m", "k"), stride("a", "k", "m")
    sbk, sbn = stride("b", "k", "n"), stride("b", "n", "k")
    scm, scn = stride("out", "m", "n"), stride("out", "n", "m")
    M, N, K = count["m"], count["n"], count["k"]

    def operand(s_rows: int, s_cols: int, rows: int, cols: int):
        """(transposed, ld) of a column-major op(X) = [rows, cols] at these strides."""
        if s_rows == 1 and s_cols >= max(1, rows):
            return False, s_cols
        if s_cols == 1 and s_rows >= max(1, cols):
            return True, s_rows
        return None

    if scn == 1 and scm >= max(1, N):      # row-major C: C^T[N, M] = op(B)[N, K] op(A)[K, M]
        x, y = operand(sbn, sbk, N, K), operand(sak, sam, K, M)
        if x is None or y is None:
            return None
        return GemmCall(x[0], y[0], N, M, K, "b", x[1], merged["b", "batch"][0], "a", y[1],
                        merged["a", "batch"][0], scm, merged["out", "batch"][0], count["batch"])
    if scm == 1 and scn >= max(1, M):      # column-major C[M, N] = op(A)[M, K] op(B)[K, N]
        x, y = operand(sam, sak, M, K), operand(sbk, sbn, K, N)
        if x is None or y is None:
            return None
        return GemmCall(x[0], y[0], M, N, K, "a", x[1], merged["a", "batch"][0], "b", y[1],
                        merged["b", "batch"][0], scn, merged["out", "batch"][0], count["batch"])
    return None


def _matrix(flat: np.ndarray, rows: int, cols: int, trans: bool, ld: int, stride: int, batch: int) -> np.ndarray:
    """op(X) of every batch as a [batch, rows, cols] view of a flat array (column-major)."""
    s = flat.itemsize
    st = (stride * s, ld * s, s) if trans else (stride * s, s, ld * s)
    return np.lib.stride_tricks.as_strided(flat, (batch, rows, cols), st, writeable=False)


def run_numpy(call: GemmCall, a: np.ndarray, b: np.ndarray, c: np.ndarray, offsets=(0, 0, 0)) -> None:
    """`cublas<t>gemmStridedBatched(transa, transb, m, n, k, 1, A, lda, sA, B, ldb, sB, 0, C, ldc, sC)`
    with numpy, on the flat memory of `a`, `b` (cuBLAS's A and B) and `c`, each from
    its element offset; a GemmEx call (`call.atype`): bf16/f16 A and B widened to f32,
    products and sums in f32."""
    fa, fb, fc = (x.reshape(-1)[o:] for x, o in zip((a, b, c), offsets))
    A = _matrix(fa, call.m, call.k, call.transa, call.lda, call.stride_a, call.batch)
    B = _matrix(fb, call.k, call.n, call.transb, call.ldb, call.stride_b, call.batch)
    A, B = (np.conj(X) if conj else X for X, conj in ((A, call.conja), (B, call.conjb)))
    if call.atype:   # GemmEx: bf16/f16 operands widened to f32 (exact), products and sums in f32
        A, B = A.astype(np.float32), B.astype(np.float32)
    s = fc.itemsize
    C = np.lib.stride_tricks.as_strided(fc, (call.batch, call.m, call.n), (call.stride_c * s, s, call.ldc * s))
    P = np.matmul(A, B) if call.alpha == 1.0 else call.alpha * np.matmul(A, B)
    C[...] = P if call.beta == 0.0 else C + P
