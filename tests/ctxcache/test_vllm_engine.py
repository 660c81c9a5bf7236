"""`ctxcache vllm` runs vLLM eager where nothing can compile the model (the container image),
and reads its KV cache size from the environment compose and Kubernetes set."""

from __future__ import annotations

import json
import os
import stat
import sysconfig
from pathlib import Path

import pytest

from ctxcache.vllm_engine import (
    VllmLaunch,
    auto_reserved_cpus,
    can_compile,
    kv_cache_gib_from_env,
    must_run_eager,
    numa_nodes,
    rank_cpus,
    tensor_parallel_size,
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


def test_the_cpu_reservation_is_always_passed_so_a_connector_changes_no_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM reserves one more CPU whenever a KV connector is configured (on 2 CPUs it then
    binds to both); `ctxcache vllm` always passes the number, the same with or without the
    connector (docs/vllm.md, "Why a vLLM with a connector ran faster")."""
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    bare = VllmLaunch("m", "m", 8100)
    with_connector = VllmLaunch("m", "m", 8100, sidecar_lm="lm://127.0.0.1:65432")
    assert bare.env()["VLLM_CPU_NUM_OF_RESERVED_CPU"] == str(auto_reserved_cpus())
    assert with_connector.env()["VLLM_CPU_NUM_OF_RESERVED_CPU"] == str(auto_reserved_cpus())
    assert VllmLaunch("m", "m", 8100, reserved_cpus=3).env()["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "3"
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "2")  # the operator's own wins
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in bare.env()  # inherited as set


def test_auto_reservation_keeps_both_cpus_of_a_two_cpu_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for cpus, reserved in ((1, 0), (2, 0), (3, 1), (64, 1)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        assert auto_reserved_cpus() == reserved, cpus


def connector_extra(argv: list[str]) -> dict[str, object]:
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return config["kv_connector_extra_config"]  # type: ignore[no-any-return]


def test_the_connector_gets_the_local_dir_only_when_one_is_given() -> None:
    """`local_dir` in the connector's extra config is what makes it look for the sidecar's
    socket and shared memory; without it the connector uses lm:// alone."""
    tcp = VllmLaunch("m", "m", 8100, sidecar_lm="lm://127.0.0.1:65432")
    assert "local_dir" not in connector_extra(tcp.argv())
    local = VllmLaunch(
        "m",
        "m",
        8100,
        sidecar_lm="lm://127.0.0.1:65432",
        sidecar_local_dir="/run/ctxcache",
        connector_config={"chunk_size": 256},
    )
    extra = connector_extra(local.argv())
    assert extra == {
        "sidecar_url": "lm://127.0.0.1:65432",
        "chunk_size": 256,
        "local_dir": "/run/ctxcache",
    }


def test_ctxcache_vllm_passes_sidecar_local_dir_to_the_connector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`ctxcache vllm --sidecar-local-dir DIR` (what serve, compose and the k8s overlays
    run) reaches vLLM's --kv-transfer-config; the same line without it does not."""
    import ctxcache.vllm_engine as vllm_engine
    from ctxcache.cli import build_parser

    launched: list[list[str]] = []
    monkeypatch.setattr(vllm_engine, "available", lambda: True)
    monkeypatch.setattr(os, "execvpe", lambda _file, argv, _env: launched.append(list(argv)))
    line = ["vllm", "--model", "/m/tiny", "--sidecar", "lm://127.0.0.1:65432"]
    for extra in (["--sidecar-local-dir", "/run/ctxcache"], []):
        args = build_parser().parse_args([*line, *extra, "--", "--enforce-eager"])
        vllm_engine.main(args)
    with_dir, without = (connector_extra(argv) for argv in launched)
    assert with_dir["local_dir"] == "/run/ctxcache"
    assert "local_dir" not in without
    assert with_dir["sidecar_url"] == without["sidecar_url"] == "lm://127.0.0.1:65432"


def test_tensor_parallel_ranks_get_a_cpu_run_each_where_numa_nodes_are_fewer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """vLLM's CPU build binds each rank to a NUMA node of its own by default and does not
    start with fewer nodes than ranks (docs/vllm.md, MLA models): `ctxcache vllm` splits the
    allowed CPUs between the ranks there, and leaves a binding someone set alone."""
    assert tensor_parallel_size(["--dtype", "float32"]) == 1
    assert tensor_parallel_size(["--tensor-parallel-size", "2"]) == 2
    assert tensor_parallel_size(["-tp", "4"]) == 4
    assert tensor_parallel_size(["--tensor-parallel-size=2"]) == 2
    assert tensor_parallel_size(["-tp", "x"]) == 1  # (vLLM says what is wrong)
    for node, cpus in (("node0", "0-3"), ("node1", "4-7")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    assert numa_nodes({0, 1}, tmp_path) == 1 and numa_nodes({3, 4}, tmp_path) == 2
    assert numa_nodes({0}, tmp_path / "none") == 1  # no node directory: one node
    assert rank_cpus(2, {0, 1}, 1) == "0|1"
    assert rank_cpus(2, {0, 1, 2, 3, 4}, 1) == "0,1|2,3"
    assert rank_cpus(2, {0, 1, 2, 3}, 2) is None  # a node per rank: vLLM's own binding
    assert rank_cpus(1, {0, 1}, 1) is None and rank_cpus(4, {0, 1}, 1) is None
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    tp = VllmLaunch("m", "m", 8100, extra_args=["--tensor-parallel-size", "2"])
    bind = tp.env().get("VLLM_CPU_OMP_THREADS_BIND")
    assert bind == (None if numa_nodes({0, 1}) >= 2 else "0|1")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in VllmLaunch("m", "m", 8100).env()
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in tp.env()  # theirs (merged over os.environ)
