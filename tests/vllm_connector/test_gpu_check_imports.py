"""The GPU check (`benchmarks/gpu_check.sh`) runs where only torch and a few wheels are:
no vLLM, no web stack, no Redis client. What it imports must import there; this runs those
imports in a Python that refuses the packages such a machine lacks (a shared helper that
grew a module-level `starlette` import once broke the check this way); and every other
package they cannot do without is one the check's pre-flight looks for (`httpx`, which
the tests' helpers import, once was not)."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

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
    "vllm_connector.paths",
    "vllm_connector.paged",
    "vllm_connector.loads",
    "vllm_connector.shm_path",
    "vllm_connector.shm_loads",
    "vllm_connector.stores",
    "vllm_connector.tcp_path",
    "vllm_connector.ordering",
    "vllm_connector.regions",
    "vllm_connector.blockcopy",
    "vllm_connector.ring",
    "vllm_connector.ring_kernel",
    "benchmarks.kvpath.kvpath",
    "benchmarks.kvpath.kvpath_cuda",
    "benchmarks.kvpath.kvpath_report",
    "benchmarks.lib.util",  # (kvpath's main imports these two when it runs)
    "ctxcache.logs",
    "tests.vllm_connector.test_blockcopy",
    "tests.vllm_connector.test_ring",
    "tests.vllm_connector.test_paths",
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


LOADED = """
import importlib, sys
before = {m.split(".")[0] for m in sys.modules}
for name in sys.argv[1].split(","):
    importlib.import_module(name)
std = set(sys.stdlib_module_names) | set(sys.builtin_module_names)
tops = {m.split(".")[0] for m in sys.modules} - before
print(" ".join(sorted(t for t in tops if t not in std and not t.startswith("_"))))
"""
CLOSURE = """
import importlib.metadata as md, re, sys
dists = md.packages_distributions()
todo = [d for m in sys.argv[1:] for d in dists.get(m, [m])]
seen = set()
while todo:
    name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
    if name in seen:
        continue
    seen.add(name)
    try:
        reqs = md.requires(name) or []
    except md.PackageNotFoundError:
        continue
    todo += [re.split(r"[ ;<>=!~\\[(]", r)[0] for r in reqs if "extra ==" not in r]
ok = {m for m, ds in dists.items() if any(re.sub(r"[-_.]+", "-", d).lower() in seen for d in ds)}
print(" ".join(sorted(ok | set(sys.argv[1:]))))
"""


def gpu_check_needs() -> list[str]:
    """The modules gpu_check.sh's pre-flight looks for (its `missing ...` calls)."""
    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    return [m for line in re.findall(r"\$\(missing ([\w ]+)\)", script) for m in line.split()]


def python(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", *args],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_package_the_gpu_check_needs_is_one_its_pre_flight_looks_for() -> None:
    """A package its imports load, that neither torch nor the pre-flight's packages bring
    along, must be optional: the imports still work without it."""
    needs = gpu_check_needs()
    assert "pytest" in needs and "httpx" in needs and "pydantic" in needs, needs
    imports = ",".join(["pytest", *IMPORTS])
    loaded = python(LOADED, imports)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    covered = python(CLOSURE, "torch", "triton", *needs)
    assert covered.returncode == 0, covered.stderr[-3000:]
    others = sorted(set(loaded.stdout.split()) - set(covered.stdout.split()) - {"tests"})
    project = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    others = [m for m in others if m not in project]

    def needed(module: str) -> bool:
        return python(PROGRAM, module, imports).returncode != 0

    with ThreadPoolExecutor(4) as pool:
        needed_by = [m for m, need in zip(others, pool.map(needed, others), strict=True) if need]
    assert not needed_by, f"gpu_check.sh's pre-flight does not look for {needed_by}"
