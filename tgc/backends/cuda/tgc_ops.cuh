// tgc_ops.cuh: the elementwise semantics of tgc's lowered programs as CUDA device
// functions, float and double. Inlined by tgc.backends.cuda.codegen into every
// generated module (so a module is one self-contained source for nvcc, NVRTC and
// the cuda-sim emulator). Each function is one of tgc/ir/ops.py's FNS, as the CPU
// backend defines it (tgc/backends/cpu/elementwise.py) and the interpreters compute
// it (its numpy definition in tgc/ir/ops.py); codegen.TEMPLATES says which is called
// for which name:
//   max/min propagate NaN (llvm.maximum/minimum; numpy.maximum/minimum);
//   comparisons give 1/0, NaN compares unequal (ne is the unordered one);
//   where(c, a, b) takes a where c != 0 (NaN counts as true);
//   mul0(a, b) is a*b but exactly 0 where a == 0, mul00 where either is 0;
//   sigmoid and softplus go through e = exp(-|x|), which never overflows;
//   pow is C pow (numpy.power on floats: 1 for y == 0, signed for a negative base
//   with an integer exponent, NaN for a negative base with a fractional one);
//   round32 rounds to the nearest float and back;
//   log1p and expm1 are the math library's (log(1 + x) and exp(x) - 1, accurate at
//   small x).
// Transcendentals are the CUDA math library's (libm under cuda-sim): within a few
// ulps of the CPU backend's own polynomials, not bit for bit.
#ifndef TGC_OPS_CUH
#define TGC_OPS_CUH

#define TGC_DEV __device__ __forceinline__
#ifndef TGC_SIM_COUNT   /* the emulator counts which paths ran (sim.h); nothing on a GPU */
#define TGC_SIM_COUNT(i) ((void)0)
#endif
#ifdef __CUDACC__   /* nvcc and NVRTC (which has no __builtin_huge_val) */
#define TGC_INF __longlong_as_double(0x7ff0000000000000ULL)
#define TGC_NAN __longlong_as_double(0x7ff8000000000000ULL)
#else               /* the cuda-sim emulator (g++) */
#define TGC_INF __builtin_huge_val()
#define TGC_NAN __builtin_nan("")
#endif

// @libm: the functions of tgc/ir/ops.py with a math library spelling (Fn.libm)
// A softmax weight exp(d - lse) whose sum s was taken in double (tgc.lower.lowered.wide_exp):
// the float exp of s's rounding hi, corrected by the rounding's error lo (exp(hi + lo) =
// exp(hi) (1 + lo) to float's precision), so the weight does not carry |s| ulps of error.
// Infinite or NaN s (lo NaN) and an overflowed exp are exp(hi) itself.
TGC_DEV float tgc_exp_sum(double s) {
    const float hi = (float)s;
    const float e = tgc_exp(hi);
    const float lo = (float)(s - (double)hi);
    return (lo == 0.0f || lo != lo || !((double)e < TGC_INF)) ? e : e + e * lo;
}

template <typename T> TGC_DEV T tgc_div(T a, T b) { return a / b; }
template <typename T> TGC_DEV T tgc_sign(T x) { return x < T(0) ? T(-1) : (x > T(0) ? T(1) : x); }
template <typename T> TGC_DEV T tgc_max(T a, T b) {
    if (a != a) return a;
    if (b != b) return b;
    if (a == b) return signbit(a) ? b : a;   // +0 above -0, as llvm.maximum
    return a > b ? a : b;
}
template <typename T> TGC_DEV T tgc_min(T a, T b) {
    if (a != a) return a;
    if (b != b) return b;
    if (a == b) return signbit(a) ? a : b;
    return a < b ? a : b;
}
template <typename T> TGC_DEV T tgc_lt(T a, T b) { return a < b ? T(1) : T(0); }
template <typename T> TGC_DEV T tgc_le(T a, T b) { return a <= b ? T(1) : T(0); }
template <typename T> TGC_DEV T tgc_gt(T a, T b) { return a > b ? T(1) : T(0); }
template <typename T> TGC_DEV T tgc_ge(T a, T b) { return a >= b ? T(1) : T(0); }
template <typename T> TGC_DEV T tgc_eq(T a, T b) { return a == b ? T(1) : T(0); }
template <typename T> TGC_DEV T tgc_ne(T a, T b) { return a != b ? T(1) : T(0); }
template <typename T> TGC_DEV T tgc_where(T c, T a, T b) { return c != T(0) ? a : b; }
template <typename T> TGC_DEV T tgc_mul0(T a, T b) { return a == T(0) ? T(0) : a * b; }
template <typename T> TGC_DEV T tgc_mul00(T a, T b) { return (a == T(0) || b == T(0)) ? T(0) : a * b; }
template <typename T> TGC_DEV T tgc_round32(T x) { return T((float)x); }
// round_bf16 / round_f16: x through f32 to the nearest bfloat16 / half (ties to even)
// and back, as the CPU backend (tgc/backends/cpu/elementwise.py) and the interpreters.
// bf16: the f32 bits plus 0x7fff plus the lowest kept bit, cut to the top 16 (a carry
// rounds up into the exponent, up to inf); NaN stays NaN, made quiet.
TGC_DEV float tgc_bf16f(float f) {
#ifdef __CUDACC__
    unsigned u = __float_as_uint(f);
#else
    unsigned u;
    memcpy(&u, &f, 4);
#endif
    u = (f != f) ? (u | 0x00400000u) : (u + 0x7fffu + ((u >> 16) & 1u));
    u &= 0xffff0000u;
#ifdef __CUDACC__
    return __uint_as_float(u);
#else
    memcpy(&f, &u, 4);
    return f;
#endif
}
// half: the hardware conversion (cvt.rn.f16.f32 on a GPU, without cuda_fp16.h, which
// NVRTC may not find; GCC's _Float16 under the emulator)
TGC_DEV float tgc_f16f(float f) {
#ifdef __CUDACC__
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    return (float)(_Float16)f;
#endif
}
// 2-byte buffers (tgc/lower/narrow.py): a bf16 or f16 element is stored as its 16 bits
// (unsigned short; no cuda_bf16.h / cuda_fp16.h, which NVRTC may not find). A load
// widens it exactly to f32: bf16 as its bits shifted to the top of an f32
// (__bfloat162float), f16 by cvt.f32.f16 (__half2float). A store narrows with
// round-to-nearest-even (__float2bfloat16_rn, __float2half_rn), NaN kept a quiet NaN:
// the value stored is one the kernel has just rounded to that type, so the store is
// exact. Under the emulator: the same bit operations, and GCC's _Float16.
TGC_DEV float tgc_ld_bf16(unsigned short h) {
    const unsigned u = ((unsigned)h) << 16;
#ifdef __CUDACC__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}
TGC_DEV unsigned short tgc_st_bf16(float f) {
    f = tgc_bf16f(f);
#ifdef __CUDACC__
    const unsigned u = __float_as_uint(f);
#else
    unsigned u;
    memcpy(&u, &f, 4);
#endif
    return (unsigned short)(u >> 16);
}
TGC_DEV float tgc_ld_f16(unsigned short h) {
#ifdef __CUDACC__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    _Float16 x;
    memcpy(&x, &h, 2);
    return (float)x;
#endif
}
TGC_DEV unsigned short tgc_st_f16(float f) {
#ifdef __CUDACC__
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    const _Float16 x = (_Float16)f;
    unsigned short h;
    memcpy(&h, &x, 2);
    return h;
#endif
}
template <typename T> TGC_DEV T tgc_round_bf16(T x) { return T(tgc_bf16f((float)x)); }
template <typename T> TGC_DEV T tgc_round_f16(T x) { return T(tgc_f16f((float)x)); }
template <typename T> TGC_DEV T tgc_sigmoid(T x) {
    T e = tgc_exp(-tgc_abs(x));
    T d = T(1) + e;
    return x >= T(0) ? T(1) / d : e / d;
}
template <typename T> TGC_DEV T tgc_softplus(T x) {
    T e = tgc_exp(-tgc_abs(x));
    T u = T(1) + e;
    T log1p = u == T(1) ? e : tgc_log(u) * e / (u - T(1));   // exact where u rounds to 1
    return tgc_max(x, T(0)) + log1p;
}
// finite: x - x is 0 (NaN for inf and NaN)
template <typename T> TGC_DEV bool tgc_finite(T x) { return x - x == T(0); }
// floor division of integers (indices may be negative before a mask rejects them)
TGC_DEV long long tgc_floordiv(long long a, long long b) {
    long long q = a / b;
    return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}
// whether a pointer is 16-byte (8-byte) aligned: the float4 (ushort4) loops' run-time condition
TGC_DEV bool tgc_aligned16(const void* p) { return ((unsigned long long)p & 15ULL) == 0ULL; }
TGC_DEV bool tgc_aligned8(const void* p) { return ((unsigned long long)p & 7ULL) == 0ULL; }
TGC_DEV long long max_ll(long long a, long long b) { return a > b ? a : b; }
TGC_DEV long long min_ll(long long a, long long b) { return a < b ? a : b; }

// Column reductions (codegen's `col` kernels: out[c] = sum over rows of x[row, c]):
// a block takes a tile of TGC_COL_TILE neighbouring columns and one chunk of the
// rows; its partials are combined over the chunks in chunk order. The number of
// chunks is a function of the sizes alone (codegen.col_chunks is the same formula),
// so the order of every addition, and the result, is the same on every run.
#define TGC_COL_TILE 128LL
#define TGC_COL_ROWS 64LL       // at least this many rows per chunk
#define TGC_COL_BLOCKS 1024LL   // about this many blocks (tiles x chunks) when the rows allow
TGC_DEV long long tgc_col_chunks(long long nred, long long tiles) {
    const long long by_rows = (nred + TGC_COL_ROWS - 1) / TGC_COL_ROWS;
    const long long by_blocks = (TGC_COL_BLOCKS + tiles - 1) / (tiles > 0 ? tiles : 1LL);
    const long long c = by_rows < by_blocks ? by_rows : by_blocks;
    return c < 1 ? 1LL : c;
}

// A row group's column sums (rowgen.py): rows dealt to slots (slot s: rows
// s, s + slots, ...), one partial row per slot, the slots' partials added in slot
// order; the number of slots is a function of the sizes and the settings alone
// (launches.row_slots is the same formula): at least `slot_rows` rows per slot, at
// most about `slot_elems` partials per column sum.
TGC_DEV long long tgc_row_slots(long long nrows, long long ncols, long long slot_rows, long long slot_elems) {
    const long long by_rows = (nrows + slot_rows - 1) / slot_rows;
    const long long by_elems = ncols > 0 ? (slot_elems + ncols - 1) / ncols : by_rows;
    return by_rows < by_elems ? by_rows : by_elems;
}

// A segment max/min's combine (a scatter with reduce max or min): compare-and-swap
// on the element's bits until it holds the extreme. `!(v <= cur)` takes v where it is
// larger or NaN, and a NaN already stored is kept: NaN propagates whatever the order
// of the threads, as the CPU backend's and numpy's maximum/minimum do.
template <typename T, typename U> TGC_DEV void tgc_atomic_extreme(T* p, T v, bool take_max) {
    union { T f; U u; } cur, nxt;
    cur.u = *(volatile U*)p;
    nxt.f = v;
    for (;;) {
        bool better = take_max ? !(v <= cur.f) : !(v >= cur.f);
        if (!better || cur.f != cur.f) return;
        U seen = atomicCAS((U*)p, cur.u, nxt.u);
        if (seen == cur.u) return;
        cur.u = seen;
    }
}
TGC_DEV void tgc_atomic_max(float* p, float v) { tgc_atomic_extreme<float, unsigned>(p, v, true); }
TGC_DEV void tgc_atomic_max(double* p, double v) { tgc_atomic_extreme<double, unsigned long long>(p, v, true); }
TGC_DEV void tgc_atomic_min(float* p, float v) { tgc_atomic_extreme<float, unsigned>(p, v, false); }
TGC_DEV void tgc_atomic_min(double* p, double v) { tgc_atomic_extreme<double, unsigned long long>(p, v, false); }

// Block reductions (one block per output row): a warp's lanes combine by shuffles,
// then every thread combines the warps' partials from shared memory in warp order,
// so each thread gets the same value, and the order (so the rounding) depends only on
// blockDim. Every thread of the block must call it (blockDim a multiple of 32).
struct tgc_op_sum { template <typename T> __device__ T operator()(T a, T b) const { return a + b; } };
struct tgc_op_max { template <typename T> __device__ T operator()(T a, T b) const { return tgc_max(a, b); } };
struct tgc_op_min { template <typename T> __device__ T operator()(T a, T b) const { return tgc_min(a, b); } };
// maxshift's partials are never NaN (NaNs are skipped): the larger one
struct tgc_op_maxshift { template <typename T> __device__ T operator()(T a, T b) const { return b > a ? b : a; } };
// a warp's lanes combined by xor shuffles (the emulator: the same butterfly, sim.h)
template <typename T, typename Op> TGC_DEV T tgc_warp_allreduce(T v, Op op) {
#ifdef TGC_CUDA_SIM
    return tgc_sim_warp_allreduce(v, op);
#else
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
#endif
}
template <typename T, typename Op> TGC_DEV T tgc_block_reduce(T v, Op op, T* part) {
    v = tgc_warp_allreduce(v, op);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
    __syncthreads();
    T r = part[0];
    for (unsigned w = 1; w < blockDim.x / 32; ++w) r = op(r, part[w]);
    __syncthreads();   // part may be written again by the next reduction
    return r;
}
// Row groups (codegen's row-group kernels): `tpr` threads share a row, either the
// whole block or one warp (32). tgc_row_reduce combines a value over the row's
// threads: shuffles within the warp, then, for a block, the warps' partials in shared
// memory in warp order; every thread of the row gets the same value. Every thread of
// the block must call it, and tgc_row_sync, the same number of times.
template <typename T, typename Op> TGC_DEV T tgc_row_reduce(T v, Op op, T* part, unsigned tpr) {
    if (tpr == 32u) return tgc_warp_allreduce(v, op);
    return tgc_block_reduce(v, op, part);
}
TGC_DEV void tgc_row_sync(unsigned tpr) {
    if (tpr == 32u) __syncwarp();
    else __syncthreads();
}
#endif
