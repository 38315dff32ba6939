#!/usr/bin/env bash
# The device check of the cuda backend: one call on a lent GPU machine, which has no
# package index (its image has torch, CuPy, numpy, llvmlite, pytest, pytest-xdist, but
# no lark), under 8 minutes with every NVRTC compile cold.
#
#   benchmarks/gpu_check.sh --wheels   # here, with an index: the wheels the device lacks, into build/gpu-wheels
#   benchmarks/gpu_check.sh            # on the GPU machine, from the repository root (carry build/gpu-wheels)
#   benchmarks/gpu_check.sh --sim      # no GPU: the same parts on cuda-sim (small rows), to test this script
#   benchmarks/gpu_check.sh --attention   # on the GPU machine: part 6 alone (its setup as above), at most 300 s
#
# Parts, each under its own timeout (they add up to 670 s: the last may be cut by the call's limit), each going on past a failing
# test; every benchmark row is printed as soon as it is measured:
#   1. tests/backends/test_cuda_gpu.py without its conformance test (graphs, gather error,
#      row groups and float4, bf16/f16 GemmEx, the autocast GPT step, a `repeat` loop as a
#      graph, streamed attention, the fused attention kernels), and NCCL with one rank;
#   2. the conformance: every example and tests/programs/good program, f32 and f64, on the
#      device against the interpreter (pytest-xdist workers where it is installed);
#   3. benchmarks/gpu_bench.py: the benchmark rows against torch eager (no torch.compile);
#   4. benchmarks/gpu_columns.py: column sums (bias and weight gradients) as column tiles and
#      as one block per output, layernorm rows up to 4096, against torch; same bits per run;
#   5. benchmarks/gpu_lowp.py: bf16 GEMMs and the autocast GPT step;
#   6. benchmarks/gpu_attention.py: causal attention, forward and backward, the fused kernels (flash stage)
#      against torch SDPA;
#   7. torch.compile for the GPT step alone (one cold compile; last, so a slow compile
#      costs nothing else).
# The summary line at the end names the parts that failed or ran out of time.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || PY=python
WHEELS=build/gpu-wheels
# what the device image lacks (KINDS.md of the device tool lists what it has): pure-Python wheels
MISSING="lark filecheck"

if [ "${1:-}" = "--wheels" ]; then
    mkdir -p "$WHEELS"
    for pkg in $MISSING; do
        version=$("$PY" -c "import importlib.metadata as m; print(m.version('$pkg'))" 2>/dev/null) || version=
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
            --platform any -d "$WHEELS" "$pkg${version:+==$version}" || exit 1
    done
    ls -l "$WHEELS"
    exit 0
fi

export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"    # this tree's tgc, without installing it
if ! "$PY" -c "import lark" 2>/dev/null; then
    if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/tgc-site "$WHEELS"/*.whl \
            && export PYTHONPATH="$PYTHONPATH:/tmp/tgc-site"
    else
        echo "gpu_check: lark is missing and $WHEELS has no wheels: run benchmarks/gpu_check.sh --wheels where pip reaches an index" >&2
    fi
fi
"$PY" -c "import tgc, lark, click, llvmlite, numpy, opt_einsum, safetensors, ml_dtypes, pytest" || exit 1
if ! command -v tgc >/dev/null; then   # the CLI too: this tree, installed without an index or build isolation
    timeout 90 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
        || echo "gpu_check: tgc's command line is not installed (the tests and benchmarks import the tree)"
fi

BACKEND=cuda
ONLY=
[ "${1:-}" = "--attention" ] && ONLY=attention
if [ "${1:-}" = "--sim" ]; then
    BACKEND=cuda-sim
else
    "$PY" -c "import cupy; p = cupy.cuda.runtime.getDeviceProperties(0); print('GPU:', p['name'].decode(), '|', p['multiProcessorCount'], 'SMs | CuPy', cupy.__version__)" || exit 1
fi
XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "$(( $(nproc) < 8 ? $(nproc) : 8 ))")
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts= --strict-markers)
FAILED=()
T0=$SECONDS

part() {   # part NAME SECONDS COMMAND...: runs it under a timeout, notes a failure, goes on
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name ($BACKEND, at most ${limit}s)"
    timeout -k 5 "$limit" "$@"
    local rc=$?
    [ $rc -eq 0 ] || FAILED+=("$name (rc $rc$([ $rc -ge 124 ] && echo ', timed out'))")
    echo "== $name: rc $rc in $((SECONDS - start))s"
}

if [ "$ONLY" = attention ]; then   # the default-options CUDA program against SDPA, t = 1024 .. 8192, alone
    part attention 300 "$PY" benchmarks/gpu_attention.py --repeat 5
    echo "== done in $((SECONDS - T0))s; ${#FAILED[@]} part(s) failed${FAILED[*]:+: ${FAILED[*]}}"
    [ ${#FAILED[@]} -eq 0 ]
    exit
fi
if [ "$BACKEND" = cuda ]; then
    part tests 120 "${PYTEST[@]}" tests/backends/test_cuda_gpu.py -k "not program_matches_interpreter" \
        tests/test_distributed.py::test_nccl_on_a_gpu_single_rank
    part conformance 130 "${PYTEST[@]}" "${XDIST[@]}" tests/backends/test_cuda_gpu.py -k program_matches_interpreter
else
    part tests 75 "${PYTEST[@]}" tests/backends/test_cuda_sim_api.py tests/test_distributed.py::test_nccl_path_on_cuda_sim
    part conformance 130 "${PYTEST[@]}" "${XDIST[@]}" tests/backends/test_cuda_sim_programs.py \
        -k test_program_matches_interpreter
fi
if [ "$BACKEND" = cuda ]; then   # the CPU backend on that machine's CPU (AVX-512, 16 cores: paths this one lacks)
    part cpu 90 "${PYTEST[@]}" "${XDIST[@]}" tests/backends/test_cpu_bf16.py tests/backends/test_cpu_own_gemm.py \
        tests/backends/test_cpu_vecmath.py tests/backends/test_cpu_programs.py
fi
REPEAT=$([ "$BACKEND" = cuda ] && echo 5 || echo 1)
part benchmarks 100 "$PY" benchmarks/gpu_bench.py --backend "$BACKEND" --repeat "$REPEAT" --compile none
part columns 45 "$PY" benchmarks/gpu_columns.py --backend "$BACKEND" --repeat "$REPEAT"
part lowp 70 "$PY" benchmarks/gpu_lowp.py --backend "$BACKEND" --repeat "$REPEAT"
if [ "$BACKEND" = cuda ]; then
    part attention 60 "$PY" benchmarks/gpu_attention.py --repeat "$REPEAT"
else
    part attention 60 "$PY" benchmarks/gpu_attention.py --backend cuda-sim --rows 64 --repeat 1
fi
if [ "$BACKEND" = cuda ]; then
    part torch.compile 55 "$PY" benchmarks/gpu_bench.py --backend cuda --repeat "$REPEAT" --only gpt --compile gpt
fi
echo "== done in $((SECONDS - T0))s; ${#FAILED[@]} part(s) failed${FAILED[*]:+: ${FAILED[*]}}"
[ ${#FAILED[@]} -eq 0 ]
