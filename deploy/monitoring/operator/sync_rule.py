"""Write prometheusrule.yaml (beside this file): deploy/monitoring/alerts.yml as the
Prometheus Operator's PrometheusRule, its groups copied as they are written (comments and
block scalars kept, indented under `spec:`).

    python deploy/monitoring/operator/sync_rule.py           # after editing alerts.yml
    python deploy/monitoring/operator/sync_rule.py --check   # exit 1 if it is out of date

tests/deploy/test_alerts.py checks that the two agree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ALERTS = HERE.parent / "alerts.yml"
RULE = HERE / "prometheusrule.yaml"

HEADER = """\
# deploy/monitoring/alerts.yml as a PrometheusRule, for the Prometheus Operator.
# Written by deploy/monitoring/operator/sync_rule.py: edit alerts.yml, then run it.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: ctxcache
  labels:
    app.kubernetes.io/part-of: ctxcache
spec:
"""


def render(alerts: str) -> str:
    """The PrometheusRule for the text of an alert rules file: its leading comment dropped,
    the rest indented under `spec:`."""
    lines = alerts.splitlines()
    start = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    body = "".join(f"  {line}\n" if line else "\n" for line in lines[start:])
    return HEADER + body


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--check", action="store_true", help="only say whether it is up to date")
    args = p.parse_args()
    text = render(ALERTS.read_text())
    if args.check:
        if RULE.read_text() != text:
            sys.stderr.write(f"{RULE} is out of date: run {Path(__file__).name}\n")
            return 1
        return 0
    RULE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
