"""The dashboard as an on-call engineer reads it (deploy/monitoring/dashboard.py writes it).

Every selector is scoped to the deployment the variables pick; panels evaluated by
Prometheus' own engine (`promtool test rules`, its `promql_expr_test`) on series of two
deployments, of a sidecar without a disk tier, of a vLLM run that never read the sidecar,
show what they should: no sum over deployments, no division by zero, no empty hit rate.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.deploy.monitoring import (
    DASHBOARD,
    MONITORING,
    dashboard,
    dashboard_queries,
    metric_names,
)
from tests.deploy.promql import matchers, selectors

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="no promtool on PATH: it comes with Prometheus (Debian and Ubuntu: "
    "`apt-get install prometheus`; or the promtool of a Prometheus release)",
)


def builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dashboard", MONITORING / "dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shipped_json_is_what_dashboard_py_writes() -> None:
    assert DASHBOARD.read_text() == builder().render(), (
        "the dashboard JSON was edited by hand or is stale: change deploy/monitoring/"
        "dashboard.py and run it"
    )


def unscoped(expr: str) -> list[str]:
    """The selectors of `expr` that read more than the deployment the variables pick."""
    out = []
    for s in selectors(expr):
        have = set(matchers(s))
        want = {("job", "=~", "$job"), ("namespace", "=~", "$namespace")}
        if (s.name or "").startswith("vllm:"):
            want.add(("model_name", "=~", "$model"))
        if not want <= have:
            out.append(f"{s.name}: {sorted(want - have)}")
    return out


def test_every_selector_reads_only_the_chosen_deployment() -> None:
    missing = {title: unscoped(e) for title, e in dashboard_queries() if unscoped(e)}
    assert not missing, missing
    assert unscoped('sum(rate(x{job=~"$job"}[5m])) / y') == [
        "x: [('namespace', '=~', '$namespace')]",
        "y: [('job', '=~', '$job'), ('namespace', '=~', '$namespace')]",
    ]
    assert unscoped('vllm:a{job=~"$job", namespace=~"$namespace"}') == [
        "vllm:a: [('model_name', '=~', '$model')]"
    ]


def test_the_variables_pick_one_deployment_and_model() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert list(variables) == ["datasource", "namespace", "job", "model"]
    for name in ("namespace", "job", "model"):
        v = variables[name]
        assert v["type"] == "query" and v["multi"] and v["includeAll"], name
        assert v["datasource"]["uid"] == "${datasource}", name
    # "All" keeps series without a namespace (compose, static configs) and only the jobs
    # named like ours (a Prometheus scrapes other things: their process_* are not ours)
    assert variables["namespace"]["allValue"] == ".*"
    assert variables["job"]["allValue"] == ".*ctxcache.*"
    assert variables["job"]["regex"] == "/ctxcache/"
    assert "$namespace" in variables["job"]["definition"]
    assert "$job" in variables["model"]["definition"]


def test_the_dashboard_has_the_panels_an_sre_expects() -> None:
    read = {name for _, expr in dashboard_queries() for name in metric_names(expr)}
    for wanted in (
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        "ctxcache_gateway_rate_limited_total",
        "ctxcache_gateway_rate_limit_store_errors_total",
        # the KV load path: bytes and seconds per load, failures, planned vs loaded
        "vllm:ctxcache_loads_total",
        "vllm:ctxcache_load_bytes_shm_total",
        "vllm:ctxcache_load_bytes_tcp_total",
        "vllm:ctxcache_load_us_shm_total",
        "vllm:ctxcache_load_us_tcp_total",
        "vllm:ctxcache_load_failures_total",
        "vllm:ctxcache_load_tokens_planned_total",
        "vllm:ctxcache_loaded_tokens_total",
        # the hit rate by tier on vLLM
        "vllm:prompt_tokens_by_source_total",
        # every service's process, the manager, Redis
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "process_open_fds",
        "ctxcache_manager_requests_total",
        "redis_memory_used_bytes",
        "redis_commands_processed_total",
        # implicit sessions: by result, and reused tokens by kind (issue 55)
        "ctxcache_gateway_implicit_total",
        "ctxcache_gateway_cached_tokens_by_kind_total",
    ):
        assert wanted in read, wanted


# ---- evaluated by Prometheus ----------------------------------------------------------


def panel(title: str) -> list[str]:
    found = [p for p in dashboard()["panels"] if p["title"] == title]
    assert len(found) == 1, title
    return [t["expr"] for t in found[0]["targets"]]


def expr_with(expr: str, **values: str) -> str:
    """A panel's query as Grafana sends it: the variables at `values` (else "All")."""
    settings = {"__rate_interval": "5m"}
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            settings[var["name"]] = values.get(var["name"], var["allValue"])
    for name in sorted(settings, key=len, reverse=True):
        expr = expr.replace(f"${name}", settings[name])
    return expr


def labels(**kv: str) -> str:
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(kv.items())) + "}"


def evaluate(
    tmp_path: Path, series: dict[str, str], cases: list[tuple[str, list[tuple[str, float]]]]
) -> None:
    """promtool evaluates each (expr, expected samples) 10 minutes into `series` (series
    selector -> values in promtool's notation, one per minute); any difference fails."""
    rules = tmp_path / "none.yml"
    rules.write_text("groups: []\n")
    test: dict[str, Any] = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series.items()],
                "promql_expr_test": [
                    {
                        "expr": expr,
                        "eval_time": "10m",
                        "exp_samples": [{"labels": lb, "value": v} for lb, v in expected],
                    }
                    for expr, expected in cases
                ],
            }
        ],
    }
    path = tmp_path / "panels_test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    assert PROMTOOL is not None
    out = subprocess.run(
        [PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


def per_second(rate: float) -> str:
    """A counter growing `rate` a second, sampled each minute."""
    return f"0+{rate * 60:g}x20"


@needs_promtool
def test_two_deployments_in_one_prometheus_do_not_add_up(tmp_path: Path) -> None:
    gw = "ctxcache_gateway_requests_total"
    route = {"route": "/v1/completions", "status": "200"}
    tokens = "vllm:generation_tokens_total"
    series = {
        gw + labels(job="ctxcache-gateway", namespace="a", **route): per_second(1),
        gw + labels(job="ctxcache-gateway", namespace="b", **route): per_second(2),
        gw + labels(job="other-app", namespace="a", **route): per_second(4),
        tokens + labels(job="ctxcache-worker", namespace="a", model_name="m1"): per_second(10),
        tokens + labels(job="ctxcache-worker", namespace="a", model_name="m2"): per_second(20),
        tokens + labels(job="ctxcache-worker", namespace="b", model_name="m1"): per_second(40),
    }
    requests = panel("Requests by route and status")[0]
    generated = panel("Tokens per second")[0]
    by_route = labels(**route)
    evaluate(
        tmp_path,
        series,
        [
            (expr_with(requests, namespace="a"), [(by_route, 1)]),
            (expr_with(requests, namespace="b"), [(by_route, 2)]),
            # "All": both deployments, never another application's job
            (expr_with(requests), [(by_route, 3)]),
            (expr_with(generated, namespace="a", model="m1"), [("{}", 10)]),
            (expr_with(generated, namespace="a"), [("{}", 30)]),
            (expr_with(generated, model="m1"), [("{}", 50)]),
        ],
    )


@needs_promtool
def test_a_sidecar_without_a_disk_tier_has_no_disk_line(tmp_path: Path) -> None:
    where = {"job": "ctxcache-sidecar", "instance": "sidecar:8200"}
    series = {
        "ctxcache_sidecar_memory_bytes_used" + labels(**where): "50x20",
        "ctxcache_sidecar_memory_bytes_budget" + labels(**where): "100x20",
        "ctxcache_sidecar_disk_bytes_used" + labels(**where): "0x20",
        "ctxcache_sidecar_disk_bytes_budget" + labels(**where): "0x20",
        "ctxcache_sidecar_pinned_bytes" + labels(**where): "20x20",
    }
    memory, disk, pinned = panel("Memory and disk use")
    evaluate(
        tmp_path,
        series,
        [
            (expr_with(memory), [(labels(**where), 0.5)]),
            (expr_with(disk), []),  # not NaN: no line at all
            (expr_with(pinned), [(labels(**where), 0.2)]),
        ],
    )


@needs_promtool
def test_the_hit_rate_on_vllm_shows_where_prompt_kv_came_from(tmp_path: Path) -> None:
    """The recorded vLLM run's empty panel: vLLM served every session from its own prefix
    cache, the connector loaded nothing, so the sidecar read no block (its hit and miss
    counters are for reads; the connector's lookups are EXISTS). The panel now reads
    vLLM's prompt tokens by source; the sidecar's lines are absent, not NaN."""
    engine = {"job": "ctxcache-worker", "model_name": "tiny", "engine": "0"}
    sidecar = {"job": "ctxcache-sidecar"}
    by_source = "vllm:prompt_tokens_by_source_total"
    series = {
        "vllm:prompt_tokens_total" + labels(**engine): per_second(2),
        by_source + labels(source="local_cache_hit", **engine): per_second(1.5),
        by_source + labels(source="external_kv_transfer", **engine): per_second(0.25),
        by_source + labels(source="local_compute", **engine): per_second(0.25),
        "ctxcache_sidecar_hits_total" + labels(tier="memory", **sidecar): "0x20",
        "ctxcache_sidecar_misses_total" + labels(**sidecar): "0x20",
    }
    vllm, worker, reads, missed = panel("KV hit rate by tier")
    evaluate(
        tmp_path,
        series,
        [
            (
                expr_with(vllm),
                [
                    (labels(source="local_cache_hit"), 0.75),
                    (labels(source="external_kv_transfer"), 0.125),
                    (labels(source="local_compute"), 0.125),
                ],
            ),
            (expr_with(worker), []),
            (expr_with(reads), []),
            (expr_with(missed), []),
        ],
    )
    # a stack whose engine did read the sidecar: its reads by tier
    reading = {
        "ctxcache_sidecar_hits_total" + labels(tier="memory", **sidecar): per_second(3),
        "ctxcache_sidecar_hits_total" + labels(tier="disk", **sidecar): per_second(1),
        "ctxcache_sidecar_misses_total" + labels(**sidecar): per_second(1),
    }
    evaluate(
        tmp_path,
        reading,
        [
            (expr_with(reads), [(labels(tier="memory"), 0.6), (labels(tier="disk"), 0.2)]),
            (expr_with(missed), [("{}", 0.2)]),
        ],
    )


@needs_promtool
def test_bytes_and_seconds_per_load(tmp_path: Path) -> None:
    engine = {"job": "ctxcache-worker", "model_name": "tiny", "engine": "0"}

    def counter(name: str, rate: float) -> tuple[str, str]:
        return f"vllm:ctxcache_{name}_total" + labels(**engine), per_second(rate)

    series = dict(
        [
            counter("loads", 2),  # two loads a second
            counter("load_bytes_shm", 3e6),
            counter("load_bytes_tcp", 1e6),
            counter("load_us_shm", 0.1e6),  # 0.1 s of every second loading over shm
            counter("load_us_tcp", 0),
            counter("async_loads", 0),
            counter("async_load_ms", 0),
        ]
    )
    (per_load,) = panel("KV bytes per load")
    seconds, async_seconds = panel("Seconds per load")
    shm, tcp = panel("Load bandwidth by path")
    evaluate(
        tmp_path,
        series,
        [
            (expr_with(per_load), [("{}", 2e6)]),
            (expr_with(seconds), [("{}", 0.05)]),
            (expr_with(async_seconds), []),  # no async loads: nothing, not NaN
            (expr_with(shm), [("{}", 3e7)]),
            (expr_with(tcp), []),  # bytes but no time: the guard, not +Inf
        ],
    )


@needs_promtool
def test_the_implicit_hit_ratio_reads_the_requests_served_as_turns(tmp_path: Path) -> None:
    """Hits, branches and shared prefixes over those and misses: requests passed through are not
    in it (implicit sessions off for them), unkept is a line of its own, and a stack whose
    every request is passed through draws no line, not NaN."""
    gw = {"job": "ctxcache-gateway", "instance": "gw-0:8000"}
    name = "ctxcache_gateway_implicit_total"
    per_result = {"hit": 2.0, "branch": 1.0, "shared": 1.0, "miss": 1.0, "passed": 5.0}
    per_result["unkept"] = 0.5
    series = {name + labels(result=r, **gw): per_second(v) for r, v in per_result.items()}
    ratio, unkept = panel("Implicit hit ratio")
    (by_result,) = panel("Implicit sessions by result")
    (by_kind,) = panel("Cached tokens by kind")
    kinds = "ctxcache_gateway_cached_tokens_by_kind_total"
    series |= {
        kinds + labels(kind="explicit", **gw): per_second(100),
        kinds + labels(kind="implicit", **gw): per_second(40),
        kinds + labels(kind="shared", **gw): per_second(0),
    }
    evaluate(
        tmp_path,
        series,
        [
            (expr_with(ratio), [("{}", 0.8)]),
            (expr_with(unkept), [("{}", 0.1)]),
            (expr_with(by_result), [(labels(result=r), v) for r, v in per_result.items()]),
            (
                expr_with(by_kind),
                [
                    (labels(kind="explicit"), 100),
                    (labels(kind="implicit"), 40),
                    (labels(kind="shared"), 0),
                ],
            ),
        ],
    )
    passed_only = {name + labels(result=r, **gw): "0x20" for r in per_result}
    passed_only[name + labels(result="passed", **gw)] = per_second(5)
    evaluate(tmp_path, passed_only, [(expr_with(ratio), []), (expr_with(unkept), [])])


def test_the_renderer_sends_the_queries_grafana_sends() -> None:
    spec = importlib.util.spec_from_file_location("render", MONITORING / "render_dashboard.py")
    assert spec is not None and spec.loader is not None
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    d = json.loads(DASHBOARD.read_text())
    for _, expr in dashboard_queries():
        sent = render.concrete(expr, d)
        assert "$" not in sent, sent
    (requests,) = panel("Requests by route and status")
    assert render.concrete(requests, d) == expr_with(requests).replace("5m", "20s")
