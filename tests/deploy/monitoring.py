"""The monitoring files (deploy/monitoring) and the metric names their queries use.

`metric_names` reads PromQL the small, honest way: label matchers, ranges and label lists
(`by (...)`, `on (...)`, ...) are dropped, numbers and strings too; what is left that looks
like a name is a function when `(` follows it, a keyword if it is one, else a metric name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "ctxcache.json"
ALERTS = MONITORING / "alerts.yml"

# series Prometheus makes itself, never in a service's /metrics
SYNTHETIC = {"up"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or"}
KEYWORDS |= {"unless", "bool", "offset", "inf", "nan"}

_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_DURATION = re.compile(r"(?<![A-Za-z0-9_:])(?:\d+(?:ms|[smhdwy]))+(?![A-Za-z0-9_:])")
_NUMBER = re.compile(r"(?<![A-Za-z0-9_:])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names an expression reads."""
    text = _STRING.sub(" ", expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges, subqueries
    text = _LABEL_LIST.sub(" ", text)
    text = _DURATION.sub(" ", text)  # `offset 5m`
    text = _NUMBER.sub(" ", text)
    names: set[str] = set()
    for m in _NAME.finditer(text):
        name, rest = m.group(), text[m.end() :].lstrip()
        if rest.startswith("(") or name.lower() in KEYWORDS:
            continue  # a function or an aggregation, or a keyword
        names.add(name)
    return names


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def dashboard_queries() -> Iterator[tuple[str, str]]:
    """(panel title, expression) of every query of every panel."""
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def queried_metrics() -> dict[str, set[str]]:
    """Metric name -> where it is queried (panel titles, alert names)."""
    out: dict[str, set[str]] = {}
    for title, expr in dashboard_queries():
        for name in metric_names(expr):
            out.setdefault(name, set()).add(f"panel {title!r}")
    for rule in alert_rules():
        for name in metric_names(rule["expr"]):
            out.setdefault(name, set()).add(f"alert {rule['alert']}")
    return out


_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
}


def exposed_names(text: str) -> set[str]:
    """Every series name a Prometheus exposition has, or declares: a labelled family with
    no child yet (a counter of refusals before the first one) has its `# TYPE` line."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(maxsplit=3)
            if kind.strip() == "counter" and family.endswith("_total"):
                family = family.removesuffix("_total")  # (prometheus_client's own form)
            names.update(family + s for s in _SUFFIXES.get(kind.strip(), ("",)))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def vllm_names_from_source(loggers: Path, connector_counters: dict[str, str]) -> set[str]:
    """vLLM's own metric names as its Prometheus logger defines them (name and type read
    from `vllm/v1/metrics/loggers.py`), and the ctxcache connector's counters."""
    names: set[str] = set()
    found = re.findall(
        r"self\._(gauge|counter|histogram)_cls\(\s*name=\"(vllm:[A-Za-z0-9_:]+)\"",
        loggers.read_text(),
    )
    for kind, name in found:
        names.update(name + s for s in _SUFFIXES.get(kind, ("",)))
    names.update(f"vllm:ctxcache_{c}_total" for c in connector_counters)
    return names
