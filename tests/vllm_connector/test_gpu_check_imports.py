"""The GPU check (`benchmarks/gpu_check.sh`) runs where only torch and a few wheels are:
no vLLM, no web stack, no Redis client. What it imports must import there; this runs those
imports in a Python that refuses the packages such a machine lacks (a shared helper that
grew a module-level `starlette` import once broke the check this way)."""

from __future__ import annotations

import subprocess
import sys

from tests.deploy.manifests import ROOT

ABSENT = (
    "vllm",
    "starlette",
    "fastapi",
    "uvicorn",
    "uvloop",
    "httptools",
    "redis",
    "orjson",
    "openai",
    "opentelemetry",
)
IMPORTS = (
    "sidecar.service",
    "vllm_connector.worker",
    "vllm_connector.loads",
    "vllm_connector.stores",
    "vllm_connector.ordering",
    "vllm_connector.regions",
    "vllm_connector.blockcopy",
    "vllm_connector.ring",
    "vllm_connector.ring_kernel",
    "benchmarks.kvpath",
    "tests.vllm_connector.test_blockcopy",
    "tests.vllm_connector.test_ring",
    "tests.vllm_connector.test_worker_shm",
)
PROGRAM = """
import importlib, importlib.abc, sys
absent = set(sys.argv[1].split(","))
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in absent:
            raise ModuleNotFoundError(f"No module named {name!r} (absent on a GPU machine)")
sys.meta_path.insert(0, Absent())
for name in sys.argv[2].split(","):
    importlib.import_module(name)
"""


def test_what_the_gpu_check_imports_needs_neither_vllm_nor_the_web_stack() -> None:
    run = subprocess.run(
        [sys.executable, "-c", PROGRAM, ",".join(ABSENT), ",".join(IMPORTS)],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]


def test_the_guard_refuses_what_it_should() -> None:
    """(The check above can fail: a module that needs one of them is refused.)"""
    run = subprocess.run(
        [sys.executable, "-c", PROGRAM, ",".join(ABSENT), "ctxcache.errors"],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0 and "absent on a GPU machine" in run.stderr
