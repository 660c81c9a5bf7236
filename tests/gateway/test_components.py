"""What the gateway makes of `ctxcache serve`'s status file (`gateway/components.py`): the
503 while an engine restarts names it and carries a `retry-after` of the start time still
expected; the metrics count restarts. The supervisor that writes the file, and a real
serve killed component by component: tests/ctxcache/test_supervisor.py and
test_serve_faults.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gateway.components import ComponentCollector, Components
from gateway.pool import WorkerPool


def write(path: Path, **components: dict[str, object]) -> None:
    doc = {"supervisor_pid": 1, "updated": time.time(), "components": components}
    path.write_text(json.dumps(doc))


def state(state: str, ago_s: float, restarts: int = 0, start_s: float | None = None) -> dict:  # type: ignore[type-arg]
    return {
        "state": state,
        "since": time.time() - ago_s,
        "pid": 1,
        "restarts": restarts,
        "last_exit": -9,
        "start_s": start_s,
    }


def pool(components: Components) -> WorkerPool:
    return WorkerPool(
        [],
        connect_timeout_s=1,
        request_timeout_s=1,
        health_interval_s=1,
        imbalance_slack=0,
        max_inflight=1,
        components=components,
    )


def test_an_engine_starting_is_named_with_the_time_its_start_still_takes(tmp_path: Path) -> None:
    path = tmp_path / "components.json"
    write(
        path,
        redis=state("up", 100, start_s=0.1),
        vllm=state("starting", 10, restarts=1, start_s=58),
    )
    err = pool(Components(path, ttl_s=0)).unavailable()
    assert err.status == 503 and err.code == "backend_unavailable"
    assert "vllm is starting, 10 s so far; its last start took 58 s" in err.message
    assert "redis" not in err.message
    assert err.headers["retry-after"] in {"48", "49"}  # 58 - 10, whole seconds rounded up
    assert 47_000 <= int(err.headers["retry-after-ms"]) <= 48_100


def test_retry_after_is_one_second_without_a_file_and_at_most_a_minute(tmp_path: Path) -> None:
    err = pool(Components(None)).unavailable()
    assert err.message == "no healthy inference worker"
    assert (err.headers["retry-after"], err.headers["retry-after-ms"]) == ("1", "1000")

    path = tmp_path / "components.json"
    write(path, vllm=state("restarting", 1, restarts=2, start_s=600))
    assert Components(path).retry_after_s() == 60  # the openai SDK ignores longer ones
    write(path, worker=state("down", 1, restarts=5))
    down = Components(path)
    assert down.retry_after_s() == 1
    assert "worker is down (it kept crashing: not restarted again)" in down.describe()


@pytest.mark.parametrize("text", ["{nope", "[]", '{"components": {"x": {}}}'])
def test_an_unreadable_file_is_no_components(tmp_path: Path, text: str) -> None:
    path = tmp_path / "components.json"
    path.write_text(text)
    assert Components(path).all() == []


def test_metrics_say_which_component_is_up_and_how_often_each_restarted(tmp_path: Path) -> None:
    path = tmp_path / "components.json"
    write(path, sidecar=state("up", 5, restarts=2, start_s=1), worker=state("starting", 1))
    registry = CollectorRegistry()
    registry.register(ComponentCollector(Components(path)))
    text = generate_latest(registry).decode()
    assert 'ctxcache_component_up{component="sidecar"} 1.0' in text
    assert 'ctxcache_component_up{component="worker"} 0.0' in text
    assert 'ctxcache_component_restarts_total{component="sidecar"} 2.0' in text
