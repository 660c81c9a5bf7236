"""The alerts page for real problems only, in both shipped forms (docs/operations.md#alerts).

Every PromQL expression of the dashboard and the rules is read by a real parser; each
alert fires on series that should page and stays quiet on the cases that must not
(`promtool test rules`, tests/deploy/alert_cases.py); the Prometheus Operator's form
(deploy/monitoring/operator) renders and scrapes what prometheus-k8s.yml scrapes, with
credentials the shipped Secret and settings hold.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import promql_parser
import pytest
import yaml

from gateway.settings import GatewaySettings
from tests.deploy import kustomize_lite
from tests.deploy.alert_cases import CASES, Case, bucket_edges
from tests.deploy.manifests import (
    OVERLAYS,
    ROOT,
    compose_containers,
    k8s_containers,
    key,
    load_compose,
    pod_spec,
    real_kustomize,
    render,
    render_real,
    route_table,
)
from tests.deploy.monitoring import ALERTS, MONITORING, alert_rules, dashboard_queries
from tests.deploy.promql import parse, selectors, selects

OPERATOR = MONITORING / "operator"
OPERATIONS = ROOT / "docs" / "operations.md"
RUNBOOKS = "https://github.com/ctxcache/ctxcache/blob/main/docs/operations.md#"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="no promtool on PATH: it comes with Prometheus (Debian and Ubuntu: "
    "`apt-get install prometheus`; or the promtool of a Prometheus release)",
)


def rules() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for r in alert_rules()}


# ---- the expressions ------------------------------------------------------------------


def test_every_expression_of_the_dashboard_and_the_rules_parses() -> None:
    exprs = [(f"panel {title!r}", e) for title, e in dashboard_queries()]
    exprs += [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()]
    assert len(exprs) >= 30, "the dashboard and the rules were read at all"
    errors = {}
    for where, expr in exprs:
        try:
            parse(expr)
        except ValueError as exc:
            errors[where] = f"{exc}: {expr}"
    assert not errors, errors


@pytest.mark.parametrize(
    "expr",
    [
        "sum(rate(x_total[5m]) >",  # unbalanced
        "rate(x_total)",  # rate of an instant vector
        "histogram_quantile(0.95, x_bucket[5m])",  # a range where a vector goes
        "sum by (le) (x_bucket) > on (job) group_left bool",  # nothing after bool
        "humanize_percentage(x_total)",  # no such function (a Go template's name)
    ],
)
def test_the_parser_refuses_what_prometheus_refuses(expr: str) -> None:
    with pytest.raises(ValueError):
        parse(expr)


# ---- the rules --------------------------------------------------------------------------


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as dashes."""
    out, fenced = set(), False
    for line in markdown.splitlines():
        fenced ^= line.startswith("```")
        if not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_every_alert_says_how_bad_and_links_its_runbook_section() -> None:
    anchors = _anchors(OPERATIONS.read_text())
    for name, rule in rules().items():
        assert rule["labels"]["severity"] in {"page", "warning"}, name
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], name
        assert rule.get("for"), f"{name}: a blip does not page"
        assert notes["runbook_url"] == RUNBOOKS + name.lower(), name
        assert name.lower() in anchors, f"docs/operations.md has no section {name}"


def test_the_error_ratio_counts_api_routes_only() -> None:
    ops = {p for p in route_table("gateway") if not p.startswith("/v1/")} | {"other"}
    assert {"/health", "/ready", "/metrics"} <= ops
    api = {"/v1/completions", "/v1/chat/completions", "/v1/context/{session_id}"}
    for sel in selectors(rules()["CtxcacheHighErrorRate"]["expr"]):
        assert sel.name == "ctxcache_gateway_requests_total"
        for route in api:
            assert selects(sel, {"__name__": sel.name, "route": route, "status": "503"}), route
        for route in ops:
            assert not selects(sel, {"__name__": sel.name, "route": route, "status": "503"}), route


def test_the_ttft_alert_reads_streamed_turns_at_a_bucket_edge() -> None:
    """A non-streamed answer's "first token" is the whole answer: left out. The threshold
    is an edge of the histogram, so p95 over it is read exactly, not interpolated."""
    tree = parse(rules()["CtxcacheSlowTTFT"]["expr"])
    assert isinstance(tree, promql_parser.BinaryExpr)
    assert isinstance(tree.rhs, promql_parser.NumberLiteral)
    assert tree.rhs.val in bucket_edges("ctxcache_gateway_ttft_seconds")
    (sel,) = selectors(rules()["CtxcacheSlowTTFT"]["expr"])
    labels = {"__name__": "ctxcache_gateway_ttft_seconds_bucket", "mode": "session"}
    assert selects(sel, {**labels, "stream": "true"})
    assert not selects(sel, {**labels, "stream": "false"})


# ---- promtool: each alert fires when it should, and only then --------------------------


def test_every_alert_has_cases_that_page_and_cases_that_stay_quiet() -> None:
    names = set(rules())
    assert {c.alert for c in CASES} == names
    for name in names:
        assert any(c.fires for c in CASES if c.alert == name), f"{name}: no case fires"
        assert any(c.fires is None for c in CASES if c.alert == name), f"{name}: none quiet"
    ids = [(c.alert, c.name) for c in CASES]
    assert len(ids) == len(set(ids))


def _promtool_test(
    tmp_path: Path, case: Case, expect_firing: bool
) -> subprocess.CompletedProcess[str]:
    """`promtool test rules` on one case, against alerts.yml less its annotations (their
    templates are checked by `promtool check rules`; here the firing is)."""
    doc = yaml.safe_load(ALERTS.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(doc))
    expected = [{"exp_labels": case.fires or {}}] if expect_firing else []
    test = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in case.series],
                "alert_rule_test": [
                    {"eval_time": case.at, "alertname": case.alert, "exp_alerts": expected}
                ],
            }
        ],
    }
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test, sort_keys=False))
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, "test", "rules", "test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@needs_promtool
@pytest.mark.parametrize("case", CASES, ids=[f"{c.alert}-{c.name}" for c in CASES])
def test_the_alert_fires_only_when_it_should(tmp_path: Path, case: Case) -> None:
    out = _promtool_test(tmp_path, case, expect_firing=case.fires is not None)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_promtool_tells_a_wrong_expectation(tmp_path: Path) -> None:
    """The harness is not a formality: a case expected the other way round fails."""
    firing = next(c for c in CASES if c.fires)
    assert _promtool_test(tmp_path, firing, expect_firing=False).returncode != 0
    quiet = next(c for c in CASES if c.fires is None)
    wrong = Case(quiet.alert, quiet.name, quiet.series, quiet.at, {"severity": "page"})
    assert _promtool_test(tmp_path, wrong, expect_firing=True).returncode != 0


# ---- the Prometheus Operator's form ---------------------------------------------------


def _sync_rule() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sync_rule", OPERATOR / "sync_rule.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_prometheus_rule_is_alerts_yml() -> None:
    rule = (OPERATOR / "prometheusrule.yaml").read_text()
    assert yaml.safe_load(rule)["spec"] == yaml.safe_load(ALERTS.read_text()), (
        "run: python deploy/monitoring/operator/sync_rule.py"
    )
    assert _sync_rule().render(ALERTS.read_text()) == rule


def test_the_operator_manifests_render() -> None:
    docs = kustomize_lite.render(OPERATOR)
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == [
        ("PodMonitor", "ctxcache-gateway"),
        ("PodMonitor", "ctxcache-manager"),
        ("PodMonitor", "ctxcache-redis"),
        ("PodMonitor", "ctxcache-worker"),
        ("PrometheusRule", "ctxcache"),
    ]
    assert {d["metadata"]["namespace"] for d in docs} == {"ctxcache"}
    assert {d["apiVersion"] for d in docs} == {"monitoring.coreos.com/v1"}
    if command := real_kustomize():  # (else the minimal renderer alone)
        real = {key(d): d for d in render_real(OPERATOR, command)}
        assert real == {key(d): d for d in docs}


Target = tuple[str, str, str, str | None]  # pod name label, port name, path, token key


def _k8s_jobs() -> dict[str, Target]:
    """prometheus-k8s.yml's jobs: what each keeps (`<pod label>;<port name>`), scrapes and
    presents (the Secret key, by the Operator's mount path /etc/prometheus/secrets/<secret>/)."""
    out: dict[str, Target] = {}
    for job in yaml.safe_load((MONITORING / "prometheus-k8s.yml").read_text())["scrape_configs"]:
        (keep,) = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
        pod, port = keep["regex"].split(";")
        token = None
        if file := job.get("authorization", {}).get("credentials_file"):
            secret, token = Path(file).parts[-2:]
            assert file == f"/etc/prometheus/secrets/{secret}/{token}"
            assert secret == "ctxcache-secrets", file
        out[job["job_name"]] = (pod, port, job.get("metrics_path", "/metrics"), token)
    return out


def _pod_monitor_jobs() -> dict[str, Target]:
    out: dict[str, Target] = {}
    for doc in kustomize_lite.render(OPERATOR):
        if doc["kind"] != "PodMonitor":
            continue
        pod = doc["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
        for ep in doc["spec"]["podMetricsEndpoints"]:
            (job,) = [r["replacement"] for r in ep["relabelings"] if r["targetLabel"] == "job"]
            token = None
            if auth := ep.get("authorization"):
                assert auth["type"] == "Bearer"
                assert auth["credentials"]["name"] == "ctxcache-secrets"
                token = auth["credentials"]["key"]
            out[job] = (pod, ep["port"], ep.get("path", "/metrics"), token)
    return out


def test_the_pod_monitors_scrape_what_prometheus_k8s_scrapes() -> None:
    """Same jobs, same pods, ports, paths and token: the alerts' `job` selectors and the
    dashboard read both forms alike."""
    assert _pod_monitor_jobs() == _k8s_jobs()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_scraped_target_and_its_credentials_ship_with_the_stack(overlay: str) -> None:
    """As installed, no scrape fails (CtxcacheTargetDown would page): each job's pods and
    named port exist, and the metrics token is in the Secret and in the gateway's settings."""
    docs = render(overlay)
    ports: dict[str, set[str]] = {}
    for doc in docs:
        if (spec := pod_spec(doc)) is not None and doc["spec"].get("replicas") != 0:
            name = doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
            for c in spec["containers"]:
                ports.setdefault(name, set()).update(p.get("name", "") for p in c.get("ports", []))
    (secret,) = [
        d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "ctxcache-secrets"
    ]
    (gateway,) = [c for c in k8s_containers(docs) if c.where == "Deployment/gateway/gateway"]
    for job, (pod, port, _, token) in _k8s_jobs().items():
        if job == "ctxcache-redis" and overlay == "external-redis":
            assert pod not in ports  # (no target, so no alert: an exporter is the user's)
            continue
        assert port in ports.get(pod, set()), f"{job}: no {pod} pod with a port named {port}"
        if token is None:
            continue
        assert token in secret["stringData"], f"{job}: Secret ctxcache-secrets has no {token}"
        (ref,) = [
            v["valueFrom"]["secretKeyRef"]
            for v in gateway.raw["env"]
            if v["name"] == "CTX_GATEWAY_METRICS_TOKEN"
        ]
        assert (ref["name"], ref["key"]) == ("ctxcache-secrets", token), job
        settings = GatewaySettings(metrics_token=gateway.env["CTX_GATEWAY_METRICS_TOKEN"])
        assert settings.metrics_token == secret["stringData"][token]


def test_compose_prometheus_presents_the_gateways_metrics_token() -> None:
    (gateway,) = [c for c in compose_containers(load_compose()) if c.where == "compose/gateway"]
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    (tenants,) = [
        j for j in config["scrape_configs"] if j["job_name"] == "ctxcache-gateway-tenants"
    ]
    token = tenants["authorization"]["credentials"]
    assert GatewaySettings(metrics_token=gateway.env["CTX_GATEWAY_METRICS_TOKEN"]).metrics_token
    assert gateway.env["CTX_GATEWAY_METRICS_TOKEN"] == token


def _promtool_check_config(directory: Path, config: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, "check", "config", config],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@needs_promtool
@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-k8s.yml"])
def test_prometheus_accepts_the_scrape_configs(tmp_path: Path, config: str) -> None:
    """`promtool check config`, with the files they name where this machine has them. A
    promtool built without Kubernetes discovery (Debian's) checks the rest of each job
    (relabelling, authorization) with static targets in its place."""
    token = tmp_path / "metrics-token"
    token.write_text("a-token-of-16-chars")
    text = (MONITORING / config).read_text()
    text = text.replace("/etc/prometheus/alerts.yml", str(ALERTS))
    text = text.replace("/etc/prometheus/secrets/ctxcache-secrets/metrics-token", str(token))
    (tmp_path / config).write_text(text)
    out = _promtool_check_config(tmp_path, config)
    if "field kubernetes_sd_configs not found" in out.stdout + out.stderr:
        doc = yaml.safe_load(text)
        for job in doc["scrape_configs"]:
            assert job.pop("kubernetes_sd_configs")
            job["static_configs"] = [{"targets": ["pod:8000"]}]
        (tmp_path / config).write_text(yaml.safe_dump(doc))
        out = _promtool_check_config(tmp_path, config)
    assert out.returncode == 0, out.stdout + out.stderr
