"""The ctxcache Grafana dashboard as code: writes grafana/dashboards/ctxcache.json.

    .venv/bin/python deploy/monitoring/dashboard.py          # write the JSON
    .venv/bin/python deploy/monitoring/dashboard.py --check  # exit 1 if it is stale

Every selector goes through `sel` (dashboard_panels/promql.py), which adds the dashboard's
variables: `$namespace` and `$job` (one deployment of several in one Prometheus), and
`$model` on vLLM's series. So no panel can forget them, and two deployments never add up.
The panels live in dashboard_panels/, one module per component; this file puts them in
order, lays them out and adds the variables. tests/deploy/test_dashboard.py fails when the
JSON differs from what this writes; docs/operations.md explains the panels.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# deploy/monitoring is no package: run as a script or loaded by path (the tests), this file
# finds its parts next to it
if str(HERE) not in sys.path:
    sys.path.append(str(HERE))

from dashboard_panels import connector, engine, gateway, processes, sidecar, store  # noqa: E402

OUT = HERE / "grafana" / "dashboards" / "ctxcache.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# the variables' "All": every namespace (also series without one: compose, static
# configs), the jobs named like ctxcache's, every model
ALL_NAMESPACES, ALL_JOBS, ALL_MODELS = ".*", ".*ctxcache.*", ".*"


def panels() -> list[Any]:
    """Every panel, in the dashboard's order: one component's rows after another."""
    return [
        *gateway.panels(),
        *sidecar.panels(),
        *engine.panels(),
        *connector.panels(),
        *store.panels(),
        *processes.panels(),
    ]


def variables() -> list[Any]:
    def query(
        name: str, label: str, definition: str, all_value: str, regex: str = ""
    ) -> dict[str, Any]:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DATASOURCE,
            "definition": definition,
            "query": {"query": definition, "refId": f"{name}-variable"},
            "regex": regex,
            "refresh": 2,  # on time range change
            "sort": 1,
            "multi": True,
            "includeAll": True,
            "allValue": all_value,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "hide": 0,
        }

    return [
        {
            "name": "datasource",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
        },
        query("namespace", "Namespace", "label_values(up, namespace)", ALL_NAMESPACES),
        query(
            "job",
            "Job",
            'label_values(up{namespace=~"$namespace"}, job)',
            ALL_JOBS,
            regex="/ctxcache/",
        ),
        query(
            "model",
            "Model (vLLM)",
            'label_values(vllm:num_requests_running{job=~"$job", namespace=~"$namespace"}, '
            "model_name)",
            ALL_MODELS,
        ),
    ]


def build() -> dict[str, Any]:
    laid: list[Any] = []
    x = y = height = 0
    for i, panel in enumerate(panels(), start=1):
        w, h = panel.pop("_w"), panel.pop("_h")
        if x + w > 24 or panel["type"] == "row":
            x, y, height = 0, y + height, 0
        panel = {"type": panel.pop("type"), "title": panel.pop("title"), **panel}
        panel["id"] = i
        panel["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
        if panel["type"] != "row":
            panel["datasource"] = DATASOURCE
            targets = panel["targets"]
            assert len(targets) <= 8, panel["title"]
            panel["targets"] = [
                {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref}
                for (expr, legend), ref in zip(targets, "ABCDEFGH", strict=False)
            ]
        laid.append(panel)
        x, height = x + w, max(height, h)
    return {
        "title": "ctxcache",
        "uid": "ctxcache-overview",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "tags": ["ctxcache"],
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "",
        "description": "ctxcache: gateway, session store, KV sidecar, and the engine (vLLM + "
        "the ctxcache connector, or the built-in worker). Pick one deployment with Namespace "
        "and Job (series of several never add up), vLLM's model with Model. "
        "docs/operations.md explains each panel.",
        "templating": {"list": variables()},
        "annotations": {"list": []},
        "panels": laid,
    }


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUT.read_text() != text:
            sys.stderr.write(f"{OUT} is stale: run {Path(__file__).name}\n")
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
