// sim.h: the CUDA execution model on the CPU, for tgc's cuda-sim backend.
//
// A generated module (tgc.backends.cuda.codegen) is compiled unchanged with
//   g++ -fopenmp -x c++ -O2 -shared -fPIC -include sim.h -DTGC_CUDA_SIM module.cu
// Its kernels then run here as they would on a GPU, launch geometry included:
// blocks run one after another; a launch that uses barriers or shuffles runs a
// block's threads as an OpenMP team of blockDim threads (threadIdx from
// omp_get_thread_num, __syncthreads an OpenMP barrier, __shared__ variables static,
// a shuffle through a per-block exchange array between two barriers, valid when
// the whole block calls it, as CUDA requires of a full-mask shuffle); a launch
// without them (TGC_SIM_LAUNCH_SERIAL) runs a block's threads one after another,
// which is the same for code with no barrier. Atomics are GCC __atomic builtins
// (float and double add by compare-and-swap). Only the subset tgc generates is here.
#ifndef TGC_CUDA_SIM_H
#define TGC_CUDA_SIM_H
#include <math.h>
#include <string.h>
#include <omp.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

struct tgc_dim3 { unsigned x, y, z; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) ushort4 { unsigned short x, y, z, w; };   // four bf16/f16 elements
static thread_local tgc_dim3 threadIdx = {0, 0, 0};
static thread_local tgc_dim3 blockIdx = {0, 0, 0};
static tgc_dim3 blockDim = {1, 1, 1};
static tgc_dim3 gridDim = {1, 1, 1};

static inline void __syncthreads() {
#pragma omp barrier
}
// a warp's barrier: the team's (every thread of an emulated block reaches it as often)
static inline void __syncwarp(unsigned = 0xffffffffu) { __syncthreads(); }

// a shuffle: every thread of the block writes its value, all wait, each reads its source
static double tgc_sim_exchange[1024];
template <typename T> static inline T tgc_sim_shfl(T v, unsigned src) {
    __syncthreads();
    tgc_sim_exchange[threadIdx.x] = (double)v;
    __syncthreads();
    T r = (T)tgc_sim_exchange[src % blockDim.x];
    __syncthreads();
    return r;
}
template <typename T> static inline T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
    unsigned lane = threadIdx.x % width, base = threadIdx.x - lane;
    return tgc_sim_shfl(v, base + ((lane ^ (unsigned)mask) % width));
}
template <typename T> static inline T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
    unsigned lane = threadIdx.x % width;
    return tgc_sim_shfl(v, lane + delta < (unsigned)width ? threadIdx.x + delta : threadIdx.x);
}

// a warp's butterfly all-reduce, lane i combining op(v_i, v_(i^o)) for o = 16 .. 1 as
// the shuffles of tgc_warp_allreduce do on a GPU: the same values, in one exchange
// (two barriers) instead of fifteen; every thread of the block must call it
template <typename T, typename Op> static inline T tgc_sim_warp_allreduce(T v, Op op) {
    __syncthreads();
    tgc_sim_exchange[threadIdx.x] = (double)v;
    __syncthreads();
    const unsigned base = threadIdx.x - threadIdx.x % 32;
    T vals[32], next[32];
    for (unsigned i = 0; i < 32; ++i) vals[i] = (T)tgc_sim_exchange[base + i];
    for (unsigned o = 16; o > 0; o >>= 1) {
        for (unsigned i = 0; i < 32; ++i) next[i] = op(vals[i], vals[i ^ o]);
        memcpy(vals, next, sizeof vals);
    }
    T r = vals[threadIdx.x % 32];
    __syncthreads();
    return r;
}

static inline int atomicCAS(int* p, int expected, int desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}
static inline unsigned atomicCAS(unsigned* p, unsigned expected, unsigned desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}
static inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long expected,
                                           unsigned long long desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}
static inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
template <typename T, typename U> static inline T tgc_sim_atomic_fadd(T* p, T v) {
    U old = __atomic_load_n((U*)p, __ATOMIC_SEQ_CST), want;
    T f;
    do {
        memcpy(&f, &old, sizeof f);
        T sum = f + v;
        memcpy(&want, &sum, sizeof want);
    } while (!__atomic_compare_exchange_n((U*)p, &old, want, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    return f;
}
static inline float atomicAdd(float* p, float v) { return tgc_sim_atomic_fadd<float, unsigned>(p, v); }
static inline double atomicAdd(double* p, double v) { return tgc_sim_atomic_fadd<double, unsigned long long>(p, v); }

// what ran (tests read them through tgc_sim_counters): 0 float4 loops, 1 row-group rows
// held in registers, 2 row-group rows read from memory, 3 column-sum tiles read with
// float4 loads, 4 column-sum tiles read per element, 5 row-group rows read with float4
// loads, 6 row-group column partials kept in registers, 7 ... in memory (per slot),
// 8 row-group rows stored with float4 stores;
// TGC_SIM_COUNT is empty for nvcc
static long long tgc_sim_counts[16];
extern "C" long long* tgc_sim_counters() { return tgc_sim_counts; }
#define TGC_SIM_COUNT(i) __atomic_fetch_add(&tgc_sim_counts[i], 1, __ATOMIC_RELAXED)

#define __expf expf
#define __logf logf

// IEEE double operations with their rounding named (Philox draws, backends/cuda/philox.py):
// the plain operations here (SIM_FLAGS target no FMA, so nothing is contracted)
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline double __dsqrt_rn(double a) { return sqrt(a); }
static inline float __double2float_rn(double a) { return (float)a; }
static inline long long __double_as_longlong(double a) { long long r; memcpy(&r, &a, sizeof r); return r; }
static inline double __longlong_as_double(long long a) { double r; memcpy(&r, &a, sizeof r); return r; }

// Run CALL as the kernel launch <<<G, B>>>: blocks in order, each block's threads as
// an OpenMP team (kernels with barriers or shuffles) ...
#define TGC_SIM_LAUNCH(G, B, CALL)                                        \
    do {                                                                  \
        gridDim.x = (unsigned)(G); blockDim.x = (unsigned)(B);            \
        for (unsigned tgc_b = 0; tgc_b < gridDim.x; ++tgc_b) {            \
            _Pragma("omp parallel num_threads(blockDim.x)")               \
            {                                                             \
                blockIdx.x = tgc_b;                                       \
                threadIdx.x = (unsigned)omp_get_thread_num();             \
                CALL;                                                     \
            }                                                             \
        }                                                                 \
    } while (0)
// ... or one thread after another (kernels with neither: the same result, faster)
#define TGC_SIM_LAUNCH_SERIAL(G, B, CALL)                                 \
    do {                                                                  \
        gridDim.x = (unsigned)(G); blockDim.x = (unsigned)(B);            \
        for (unsigned tgc_b = 0; tgc_b < gridDim.x; ++tgc_b) {            \
            blockIdx.x = tgc_b;                                           \
            for (unsigned tgc_t = 0; tgc_t < blockDim.x; ++tgc_t) {       \
                threadIdx.x = tgc_t;                                      \
                CALL;                                                     \
            }                                                             \
        }                                                                 \
    } while (0)
#endif
