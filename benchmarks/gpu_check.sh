#!/usr/bin/env bash
# The GPU check of the KV data paths, for a machine with PyTorch (CUDA) and no vLLM
# (docs/benchmarks.md, "KV paths"). Meant to take under 8 minutes on one H100/H200 (each
# step has its own time limit):
#   bash benchmarks/gpu_check.sh [OUT_DIR]     (default: $OUT, else bench-results/kvpath-cuda)
# 1. the CUDA tests of the block copies (caches on the GPU; the shared region registered
#    as pinned host memory; every copy through the copier's bounded ring: against the CPU
#    host path byte for byte, a load ordered after another stream's kernel by its event,
#    a 32k-token load's device memory within the ring) and of the ring's planner and Triton
#    kernel (under Triton's interpreter), which skip what needs a GPU where there is none;
# 2. `python -m benchmarks.kvpath --device cuda`: load and store through the connector's
#    own code, lm:// against shared memory, for 16- and 128-token kernel blocks, against a
#    pinned host<->device copy of the same bytes in the same run; shm rows add the copies'
#    GPU time from events, lease / copies / release wall time and peak device memory beside
#    the ring's size (a second table in kvpath.md).
# Needs, besides torch (and the Triton its CUDA wheels ship): numpy, tqdm, matplotlib,
# prometheus-client, pydantic, pydantic-settings and cryptography (the sidecar and the
# connector's settings).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-bench-results/kvpath-cuda}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())'
export CTXCACHE_WITHOUT_VLLM=1  # the tests of vLLM's own CPU layouts skip here
# -c /dev/null: not the project's pytest settings (they name plugins this machine lacks)
set +e
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider --noconftest -c /dev/null --rootdir . \
    tests/vllm_connector/test_blockcopy.py tests/vllm_connector/test_ring.py \
    tests/vllm_connector/test_worker_shm.py \
    2>&1 | tee "$out/tests.log"
tests=${PIPESTATUS[0]}
timeout 330 python3 -m benchmarks.kvpath --device cuda --block-tokens 16,128 --rounds 3 \
    --out "$out" 2>&1 | tee "$out/bench.log"
bench=${PIPESTATUS[0]}
set -e
if [ "$tests" -ne 0 ]; then exit "$tests"; fi
exit "$bench"
