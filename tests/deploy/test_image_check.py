"""The image's import check (deploy/Dockerfile, the runtime stage's `python -c`) loads vLLM's
CPU kernels the way vLLM does, never an ISA-specific module by name.

vLLM's CPU build ships three builds of its kernels, `_C` (AVX-512 with bf16), `_C_AVX512`
and `_C_AVX2`, and picks one on the CPU it runs on (`CpuPlatform.import_kernels`, run by
`vllm._custom_ops`). Importing `vllm._C` by name dies with `Illegal instruction` on an
AVX2-only CPU, which stopped `docker compose --profile cpu up --build` there (issue 48).
Here the check runs in a Python that behaves as such a CPU would for vLLM: torch reports no
AVX-512, and the two AVX-512 builds refuse to load (there they would crash); the check must
still pass. It must also still fail when no build of the kernels loads (a missing library:
its reason to be).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from tests.deploy.manifests import DOCKERFILE, ROOT

pytest.importorskip("vllm")

HARNESS = """
import importlib.abc, sys
import torch
refused = set(sys.argv[2].split(","))
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in refused:
            raise ImportError(f"{name}: refused (this CPU cannot run it)")
sys.meta_path.insert(0, Refuse())
if sys.argv[3] == "avx2":  # what vLLM asks torch about the CPU
    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
exec(compile(sys.argv[1], "<the image's check>", "exec"))
"""
AVX512_BUILDS = "vllm._C,vllm._C_AVX512"
EVERY_BUILD = "vllm._C,vllm._C_AVX512,vllm._C_AVX2"


def image_check() -> str:
    """The program of the runtime stage's `RUN python -c "..."` that imports vLLM."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    runtime = text[text.index(" AS runtime") :]
    programs = [
        shlex.split(m.group(1))[2]
        for m in re.finditer(r"^RUN (python -c .*)$", runtime, re.MULTILINE)
    ]
    (check,) = [p for p in programs if "vllm" in p]
    return check


def run_check(refused: str, cpu: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", HARNESS, image_check(), refused, cpu],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.timeout(300)
def test_the_image_check_passes_on_a_cpu_with_avx2_only() -> None:
    run = run_check(AVX512_BUILDS, "avx2")
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.slow  # ~20 s: the negative control of the check above (make test-slow, CI)
@pytest.mark.timeout(300)
def test_the_image_check_fails_when_no_build_of_the_kernels_loads() -> None:
    for cpu in ("avx2", "this"):
        run = run_check(EVERY_BUILD, cpu)
        assert run.returncode != 0, cpu
        assert "_C" in run.stderr[-3000:], cpu


def test_nothing_imports_an_isa_specific_vllm_module_by_name() -> None:
    """The image, compose, Kubernetes, CI and the tests import vLLM's kernels as vLLM
    does (`vllm._C` by name crashes an AVX2-only CPU)."""
    by_name = re.compile(r"import\s[^\n\"']*\bvllm\._C|from\s+vllm(\._C\w*\s|\s+import\s+_C)")
    roots = ["deploy", "docker-compose.yml", "Makefile", ".ci", "benchmarks", "tests"]
    roots += ["ctxcache", "vllm_connector"]
    found = []
    for root in roots:
        path = ROOT / root
        for f in [path] if path.is_file() else sorted(path.rglob("*")):
            if (
                f.is_file()
                and f.suffix not in {".pyc", ".png", ".whl"}
                and f.stat().st_size < 2**20
            ):
                text = f.read_text(errors="replace")
                found += [f"{f.relative_to(ROOT)}: {m.group(0)}" for m in by_name.finditer(text)]
    assert found == []
