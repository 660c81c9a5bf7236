"""`ctxcache serve`: one command for the whole stack; Ctrl-C leaves nothing behind; a
restart on the same data dir continues every session."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from ctxcache.net import free_port, wait_http
from ctxcache.redis_server import RedisServer
from tests.utils import require_vllm


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children start their own sessions, so walk ppids)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_serve(
    data: Path, port: int, log: Path, engine: str = "builtin", *extra: str
) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ctxcache.cli",
                "serve",
                "--port",
                str(port),
                "--data-dir",
                str(data),
                "--engine",
                engine,
                *extra,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        wait_http(f"http://127.0.0.1:{port}/ready", timeout=600 if engine == "vllm" else 180)
    except TimeoutError:
        proc.kill()
        raise AssertionError(log.read_text()[-3000:]) from None
    return proc


def stop_serve(proc: subprocess.Popen[bytes], bundled_redis: bool = True) -> None:
    children = descendants(proc.pid)
    # redis (unless external), sidecar, worker, gateway (and their own children)
    assert len(children) >= 3 + bundled_redis
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while any(alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in children if alive(p)], "processes left behind after Ctrl-C"


@pytest.mark.timeout(600)
def test_serve_runs_stops_cleanly_and_continues_after_restart(tmp_path: Path) -> None:
    data, port, log = tmp_path / "data", free_port(), tmp_path / "serve.log"
    base = f"http://127.0.0.1:{port}/v1"
    with openai.OpenAI(base_url=base, api_key="any", max_retries=0) as client:
        _serve_restart(client, data, port, log)


def _serve_restart(client: openai.OpenAI, data: Path, port: int, log: Path) -> None:
    proc = start_serve(data, port, log)
    try:
        banner = f"serving on http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while banner not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert banner in log.read_text()
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/context",
            json={"model": "tiny", "messages": [{"role": "system", "content": "Be brief. " * 40}]},
        )
        assert r.status_code == 200, r.text
        sid = r.json()["session_id"]
        for question in ("one?", "two?", "three?"):
            out = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": question}],
                max_tokens=4,
                temperature=0,
                extra_body={"session_id": sid},
            )
            assert out.choices[0].message.content is not None
    finally:
        stop_serve(proc)

    proc = start_serve(data, port, log)  # same data dir: Redis AOF, sidecar disk tier
    try:
        info = httpx.get(f"http://127.0.0.1:{port}/v1/context/{sid}").json()
        assert info["turns"] == 4  # the create + 3 turns survived the restart
        out = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "four?"}],
            max_tokens=4,
            temperature=0,
            extra_body={"session_id": sid},
        )
        assert (out.model_extra or {})["session"]["session_id"] == sid
        assert httpx.get(f"http://127.0.0.1:{port}/v1/context/{sid}").json()["turns"] == 5
    finally:
        stop_serve(proc)


def test_serve_with_redis_url_keeps_sessions_in_that_redis(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    """`--redis-url`: no bundled Redis is started; the sessions live in the given one."""
    data, port, log = tmp_path / "data", free_port(), tmp_path / "serve.log"
    proc = start_serve(data, port, log, "builtin", "--redis-url", own_redis.url)
    try:
        names = {Path(f"/proc/{p}/comm").read_text().strip() for p in descendants(proc.pid)}
        assert not any("redis" in n for n in names), names
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/context",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 200, r.text
        sid = r.json()["session_id"]
        client = redis.Redis(port=own_redis.port)
        try:
            assert client.hget(f"ctx:{{{sid}}}", "tenant") is not None
        finally:
            client.close()
    finally:
        stop_serve(proc, bundled_redis=False)


def test_ctrl_c_during_start_up_stops_cleanly(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ctxcache.cli",
                "serve",
                "--port",
                str(free_port()),
                "--data-dir",
                str(tmp_path / "data"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while "redis is up" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    children = descendants(proc.pid)
    assert children, log.read_text()
    proc.send_signal(signal.SIGINT)  # while the other services are still starting
    assert proc.wait(timeout=60) == 0, log.read_text()[-2000:]
    time.sleep(0.5)
    assert not [p for p in children | descendants(proc.pid) if alive(p)]


@pytest.mark.timeout(900)
def test_a_vllm_stack_restarted_on_its_data_dir_reloads_a_session_from_the_disk_tier(
    tmp_path: Path,
) -> None:
    """`ctxcache serve --engine vllm`: after a full restart, vLLM's own prefix cache is
    empty and the sidecar's memory tier too; the session's next turn still reuses all but
    less than a block of its context, read from the sidecar's disk tier."""
    require_vllm()
    data, port, log = tmp_path / "data", free_port(), tmp_path / "serve.log"
    base = f"http://127.0.0.1:{port}"
    document = " ".join(["the cat sat on the mat and looked at the rain"] * 60)
    proc = start_serve(data, port, log, "vllm")
    try:
        assert "engine: vLLM with the ctxcache KV connector" in log.read_text()
        r = httpx.post(
            f"{base}/v1/context",
            json={"model": "tiny", "messages": [{"role": "system", "content": document}]},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        sid = r.json()["session_id"]
        first = chat_turn(base, sid, "what did the cat do?")
        assert first["usage"]["prompt_tokens"] > 512
    finally:
        stop_serve(proc)

    proc = start_serve(data, port, log, "vllm")
    try:
        info = httpx.get(f"{base}/v1/context/{sid}", timeout=30).json()
        assert info["turns"] == 2
        assert info["kv_tokens"] >= info["context_tokens"] - 128  # on the sidecar's disk
        second = chat_turn(base, sid, "and then?")
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= info["context_tokens"] - 128
    finally:
        stop_serve(proc)


def chat_turn(base: str, sid: str, question: str) -> dict[str, Any]:
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={
            "model": "tiny",
            "session_id": sid,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 8,
            "temperature": 0,
        },
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_internal_ports_are_distinct_and_never_the_gateways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing is bound when the ports are chosen, so the kernel may offer a port already
    handed out (CI once gave the sidecar's data and control ports the same number)."""
    import ctxcache.net
    from ctxcache.serve import _internal_ports

    gateway = free_port()
    offers = iter([gateway, gateway, free_port(), gateway])
    real_free_port = ctxcache.net.free_port
    monkeypatch.setattr(ctxcache.net, "free_port", lambda: next(offers, None) or real_free_port())
    ports = _internal_ports(tmp_path, reserved={gateway})
    assert len(set(ports.values())) == 3 and gateway not in ports.values()


def test_internal_ports_survive_a_restart_unless_a_kept_port_would_collide(
    tmp_path: Path,
) -> None:
    from ctxcache.serve import _internal_ports

    gateway = free_port()
    first = _internal_ports(tmp_path, reserved={gateway})
    assert _internal_ports(tmp_path, reserved={gateway}) == first
    # a ports.json that repeats a port, or names the gateway's, is mended on the next start
    clash = {"sidecar_data": gateway, "sidecar_control": first["engine"], "engine": first["engine"]}
    (tmp_path / "ports.json").write_text(json.dumps(clash))
    mended = _internal_ports(tmp_path, reserved={gateway})
    assert len(set(mended.values())) == 3 and gateway not in mended.values()
    assert mended["sidecar_control"] == first["engine"]
