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
# Needs, besides torch (and the Triton its CUDA wheels ship): pytest and httpx (step 1: the
# tests' helpers import httpx); numpy, tqdm, matplotlib, prometheus-client, pydantic,
# pydantic-settings and cryptography (the sidecar and the connector's settings). Triton compiles its launcher with a C compiler ($CC, gcc or
# clang) against Python's headers (Python.h); without them the ring falls back to
# index_copy_ (logged) and the test that wants Triton fails. The pre-flight below says what
# is missing before anything runs; a step whose modules are missing is skipped (exit 3).
# PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-bench-results/kvpath-cuda}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
"$py" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
missing() {  # the modules of "$@" this interpreter cannot import
    "$py" -c 'import importlib.util, sys; print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' "$@"
}
need_tests=$(missing pytest httpx)  # httpx: the tests' helpers (ctxcache.net)
need_bench=$(missing numpy tqdm matplotlib prometheus_client pydantic pydantic_settings cryptography)
"$py" - <<'PY' || true
import os, shutil, sysconfig
try:
    import triton
    print("triton", triton.__version__)
except Exception as exc:  # the ring then scatters with index_copy_
    print("no triton:", exc)
cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang") or shutil.which("cc")
include = sysconfig.get_paths()["include"]
print("C compiler:", cc or "MISSING (Triton cannot build its launcher)")
print("Python.h:", "ok" if os.path.exists(os.path.join(include, "Python.h")) else f"MISSING in {include}")
PY
export CTXCACHE_WITHOUT_VLLM=1  # the tests of vLLM's own CPU layouts skip here
set +e
tests=3
if [ -n "$need_tests" ]; then
    echo "step 1 skipped: missing $need_tests" | tee "$out/tests.log"
else
    # -c /dev/null: not the project's pytest settings (they name plugins this machine lacks);
    # a test still running after 60 s has every thread's stack written to the log
    timeout 240 "$py" -m pytest -q -rs -p no:cacheprovider --noconftest -c /dev/null --rootdir . \
        -o faulthandler_timeout=60 \
        tests/vllm_connector/test_blockcopy.py tests/vllm_connector/test_ring.py \
        tests/vllm_connector/test_paths.py \
        2>&1 | tee "$out/tests.log"
    tests=${PIPESTATUS[0]}
fi
bench=3
if [ -n "$need_bench" ]; then
    echo "step 2 skipped: missing $need_bench" | tee "$out/bench.log"
else
    timeout 330 "$py" -m benchmarks.kvpath --device cuda --block-tokens 16,128 --rounds 3 \
        --out "$out" 2>&1 | tee "$out/bench.log"
    bench=${PIPESTATUS[0]}
fi
set -e
if [ "$tests" -ne 0 ]; then exit "$tests"; fi
exit "$bench"
