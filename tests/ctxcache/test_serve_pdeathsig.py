"""`ctxcache serve`'s stack dies with it, even by `kill -9`; and one serve per data dir: a
second one refuses to start and leaves the first one's shared KV directory alone."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ctxcache.in_use import InUse, lock_data_dir
from ctxcache.net import free_port
from ctxcache.serve_region import local_kv_dir, remove_local_kv_dir
from tests.ctxcache.test_serve import alive, descendants, start_serve, stop_serve
from tests.utils import require_vllm


@contextlib.contextmanager
def killing_survivors(
    pids: set[int], ours: list[subprocess.Popen[bytes]] | None = None
) -> Iterator[set[int]]:
    """Whatever of `pids` (and more added to it) still runs at the end is SIGKILLed; the
    processes in `ours` (and more added to it) are reaped."""
    try:
        yield pids
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        for proc in ours or ():
            proc.wait(timeout=10)


def gone_within(pids: set[int], seconds: float) -> set[int]:
    """Those of `pids` still running after `seconds` (polled)."""
    deadline = time.monotonic() + seconds
    while (left := {p for p in pids if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def new_session(port: int) -> str:
    r = httpx.post(
        f"http://127.0.0.1:{port}/v1/context",
        json={"model": "tiny", "messages": [{"role": "system", "content": "Be brief."}]},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return str(r.json()["session_id"])


def turn(port: int, sid: str) -> None:
    body = {
        "model": "tiny",
        "session_id": sid,
        "messages": [{"role": "user", "content": "hi?"}],
        "max_tokens": 3,
        "temperature": 0,
    }
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text


def second_serve(data: Path, model: Path) -> tuple[int, str]:
    """Another `ctxcache serve` on `data`: its exit status and output (it must end)."""
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "ctxcache.cli", "serve", "--engine", "builtin"),
            *("--port", str(free_port()), "--data-dir", str(data), "--model", str(model)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    with killing_survivors({proc.pid}, [proc]) as pids:
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # it started a stack of its own
            pids |= descendants(proc.pid)
            raise
    return proc.returncode, out.decode()


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "engine",
    [pytest.param(e, marks=pytest.mark.slow) for e in ("builtin", "vllm")],  # docs/testing.md
    ids=str,
)
def test_one_serve_per_data_dir_and_kill_9_of_it_kills_every_process_it_started(
    tmp_path: Path, tiny_model: Path, engine: str
) -> None:
    """A second serve on the data dir refuses to start, naming the first one's pid, and
    leaves its shared KV directory alone: the first one keeps serving. `kill -9` of the
    first one: Redis, the sidecar, the engine (vLLM: its EngineCore too, which vLLM's
    server starts and does not stop when it is itself SIGKILLed), the gateway and the
    reaper are gone within seconds. The next serve on the data dir starts (the dead serve's
    lock is taken over, its region removed) and continues the session. (One test, not
    three: each start of a stack costs `make test` 10-25 s on 2 CPUs.)"""
    if engine == "vllm":
        require_vllm()
    data, port, log = tmp_path / "data", free_port(), tmp_path / "serve.log"
    model = ["--model", str(tiny_model)]
    proc = start_serve(data, port, log, engine, *model)
    serves = [proc]
    try:
        with killing_survivors({proc.pid} | descendants(proc.pid), serves) as stack:
            sid = new_session(port)
            region = Path((data / "local-kv-dir").read_text().strip())
            files = {p.name for p in region.iterdir()}
            assert "sidecar.sock" in files and any(f.startswith("kv-") for f in files), files

            status, out = second_serve(data, tiny_model)
            assert status == 1, out[-3000:]
            assert f"ctxcache serve (pid {proc.pid})" in out, out[-3000:]
            assert files <= {p.name for p in region.iterdir()}
            assert Path((data / "local-kv-dir").read_text().strip()) == region
            turn(port, sid)  # the first one still serves

            stack |= descendants(proc.pid)
            names = sorted(comm(p) for p in stack)
            assert len(stack) >= 6, names  # serve, redis, sidecar, engine, gateway, the reaper
            if engine == "vllm":
                assert "VLLM::EngineCor" in names, names  # (a comm is 15 characters)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            left = gone_within(stack, 15)
            assert not left, f"left running after kill -9 of serve: {[comm(p) for p in left]}"

            proc = start_serve(data, port, log, engine, *model)
            serves.append(proc)
            stack |= {proc.pid} | descendants(proc.pid)
            try:
                assert not region.exists()  # the killed serve's region, removed
                turn(port, sid)
            finally:
                stop_serve(proc)
    finally:  # a region that a failure left behind is memory (/dev/shm) until removed
        with contextlib.suppress(InUse):
            remove_local_kv_dir(data, wait_s=5)


def test_the_data_dir_lock_names_its_holder_and_is_taken_once_it_is_let_go(
    tmp_path: Path,
) -> None:
    held = lock_data_dir(tmp_path)
    try:
        with pytest.raises(InUse, match=rf"ctxcache serve \(pid {os.getpid()}\)"):
            lock_data_dir(tmp_path, wait_s=0)
    finally:
        os.close(held)
    os.close(lock_data_dir(tmp_path, wait_s=0))


def test_a_region_directory_a_process_still_maps_is_not_removed(tmp_path: Path) -> None:
    """A stack of an older serve (no lock on the data dir) still maps its region: the
    next serve refuses rather than removing it from under it."""
    shm, data = tmp_path / "shm", tmp_path / "data"
    shm.mkdir()
    data.mkdir()
    region = local_kv_dir(data, 1 << 20, shm=shm)
    assert region is not None
    (region / "kv-1.shm").write_bytes(b"\0" * 4096)
    mapper = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import mmap, sys, time\n"
            "f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0); f.close()\n"
            "print('mapped', flush=True); time.sleep(600)",
            str(region / "kv-1.shm"),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert mapper.stdout is not None and mapper.stdout.readline() == b"mapped\n"
        with pytest.raises(InUse, match=str(mapper.pid)):
            remove_local_kv_dir(data, shm=shm)
        with pytest.raises(InUse):
            local_kv_dir(data, 1 << 20, shm=shm)
        assert (region / "kv-1.shm").is_file()
    finally:
        mapper.kill()
        mapper.wait()
        assert mapper.stdout is not None
        mapper.stdout.close()
    remove_local_kv_dir(data, shm=shm)  # nobody maps it now
    assert not region.exists()
