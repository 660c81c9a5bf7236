#!/usr/bin/env bash
# The GPU check of the KV data paths, for a machine with PyTorch (CUDA) and no vLLM
# (docs/benchmarks.md, "KV paths"). Under 5 minutes on one H100:
#   bash benchmarks/gpu_check.sh [OUT_DIR]
# 1. the CUDA tests of the block copies (caches on the GPU; the shared region registered
#    as pinned host memory; copies on a side stream), which skip on a machine without a GPU;
# 2. `python -m benchmarks.kvpath --device cuda`: load and store through the connector's
#    own code, lm:// against shared memory, against a pinned host<->device copy of the same
#    bytes in the same run.
# Needs, besides torch: numpy, tqdm, matplotlib, prometheus-client, pydantic,
# pydantic-settings and cryptography (the sidecar and the connector's settings).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench-results/kvpath-cuda}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())'
export CTXCACHE_WITHOUT_VLLM=1  # the tests of vLLM's own CPU layouts skip here
# -c /dev/null: not the project's pytest settings (they name plugins this machine lacks)
set +e
python3 -m pytest -q -p no:cacheprovider --noconftest -c /dev/null --rootdir . \
    tests/vllm_connector/test_blockcopy.py tests/vllm_connector/test_worker_shm.py \
    2>&1 | tee "$out/tests.log"
tests=${PIPESTATUS[0]}
set -e
python3 -m benchmarks.kvpath --device cuda --rounds 5 --out "$out" 2>&1 | tee "$out/bench.log"
exit "$tests"
