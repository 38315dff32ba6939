#!/usr/bin/env bash
# The device check of the cuda backend, for a machine with an NVIDIA GPU (issue 15):
# installs CuPy (cupy-cuda13x) and a CUDA build of torch if missing, runs the cuda
# tests against the interpreter, then the benchmark rows on the device against torch
# eager and torch.compile, and prints one table (benchmarks/gpu_bench.py), then the
# mixed precision rows: bf16 GEMMs (cublasGemmStridedBatchedEx) and the GPT step under
# --autocast bf16 against f32 (benchmarks/gpu_lowp.py).
# Budget: under 9 minutes on an H200 (tests <= 4 min, benchmarks <= 4 min).
#
#   benchmarks/gpu_check.sh          # on the GPU machine, from the repository root
#   benchmarks/gpu_check.sh --sim    # no GPU: the same steps on cuda-sim (small rows)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"    # this tree's tgc
"$PY" -c "import lark, click, llvmlite, numpy, opt_einsum, safetensors, pytest" 2>/dev/null \
    || "$PY" -m pip install -q lark click llvmlite numpy opt_einsum safetensors pytest hypothesis
BACKEND=cuda
if [ "${1:-}" = "--sim" ]; then
    BACKEND=cuda-sim
else
    # CuPy, and NVRTC for RawModule where the machine's toolkit has none
    "$PY" -c "import cupy" 2>/dev/null || "$PY" -m pip install -q cupy-cuda13x nvidia-cuda-nvrtc
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
        || "$PY" -m pip install -q torch
    "$PY" -c "import cupy; print('GPU:', cupy.cuda.runtime.getDeviceProperties(0)['name'].decode())"
fi
echo "== tests ($BACKEND)"
if [ "$BACKEND" = cuda ]; then
    timeout 240 "$PY" -m pytest -x -q -p no:cacheprovider tests/backends/test_cuda_gpu.py
    # data parallel through NCCL with one rank (tgc.distributed)
    timeout 60 "$PY" -m pytest -x -q -p no:cacheprovider tests/test_distributed.py -k nccl_on_a_gpu
else
    timeout 240 "$PY" -m pytest -x -q -p no:cacheprovider tests/backends/test_cuda_sim_api.py
    timeout 60 "$PY" -m pytest -x -q -p no:cacheprovider tests/test_distributed.py -k nccl_path_on_cuda_sim
fi
echo "== benchmarks ($BACKEND)"
timeout 200 "$PY" benchmarks/gpu_bench.py --backend "$BACKEND" --repeat "$([ "$BACKEND" = cuda ] && echo 7 || echo 3)"
echo "== mixed precision ($BACKEND)"
timeout 150 "$PY" benchmarks/gpu_lowp.py --backend "$BACKEND" --repeat "$([ "$BACKEND" = cuda ] && echo 7 || echo 1)"
