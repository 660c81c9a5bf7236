"""`ctxcache vllm` runs vLLM eager where nothing can compile the model (the container image),
and reads its KV cache size from the environment compose and Kubernetes set."""

from __future__ import annotations

import os
import stat
import sysconfig
from pathlib import Path

import pytest

from ctxcache.vllm_engine import (
    VllmLaunch,
    can_compile,
    kv_cache_gib_from_env,
    must_run_eager,
)

HEADERS = (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file()


def fake_compiler(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_no_compiler_on_path_means_eager(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing in it
    monkeypatch.delenv("CXX", raising=False)
    assert not can_compile()
    assert must_run_eager([])
    # the arguments for vLLM choose for themselves
    for chosen in (["--enforce-eager"], ["-O0"], ["-O3"], ["--compilation-config={}"]):
        assert not must_run_eager(chosen), chosen
    assert must_run_eager(["--dtype", "float32"])


@pytest.mark.skipif(not HEADERS, reason="this Python has no headers (Python.h)")
def test_a_compiler_and_the_headers_mean_compiled(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    fake_compiler(tmp_path, "g++")
    monkeypatch.delenv("CXX", raising=False)
    assert can_compile() and not must_run_eager([])
    # $CXX is the compiler torch looks for, when set
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert not can_compile()
    monkeypatch.setenv("CXX", str(fake_compiler(tmp_path, "clang++")))
    assert can_compile()


def test_enforce_eager_reaches_vllms_command_line() -> None:
    launch = VllmLaunch(model="/m/tiny", served_name="tiny", port=8100, enforce_eager=True)
    assert "--enforce-eager" in launch.argv()
    assert "--enforce-eager" not in VllmLaunch(model="/m", served_name="m", port=1).argv()


def test_kv_cache_size_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert kv_cache_gib_from_env() == 1
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert kv_cache_gib_from_env() == 2
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    assert kv_cache_gib_from_env() == 1
