"""Panel shapes: a time series, a stat, a row, and the targets of percentiles."""

from __future__ import annotations

from typing import Any

from dashboard_panels.promql import quantile

Target = tuple[str, str]  # (expr, legend)


def timeseries(
    title: str, description: str, unit: str, *targets: Target, w: int = 8, h: int = 8
) -> Any:
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": list(targets),
        "_w": w,
        "_h": h,
    }


def stat(title: str, description: str, target: Target, w: int = 6) -> Any:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "fieldConfig": {
            "defaults": {
                "unit": "short",
                "thresholds": {
                    "mode": "absolute",
                    "steps": [{"color": "red", "value": None}, {"color": "green", "value": 1}],
                },
            },
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
            "graphMode": "none",
            "textMode": "auto",
        },
        "targets": [target],
        "_w": w,
        "_h": 6,
    }


def row(title: str) -> Any:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "_w": 24, "_h": 1}


def percentiles(
    histogram: str, by: str, label: str, qs: tuple[float, ...], *m: str
) -> list[Target]:
    return [(quantile(q, histogram, by, *m), f"p{round(q * 100, 1):g} {label}".strip()) for q in qs]
