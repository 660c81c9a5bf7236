"""PromQL read with a real parser (the `promql-parser` wheel, Prometheus' grammar and
function signatures): the dashboard's queries and the alert rules, as Prometheus would
read them, with Grafana's interval variables given a value first."""

from __future__ import annotations

import re

import promql_parser

# Grafana's built-in interval variables, outside label strings ($__rate_interval, ...):
# any duration parses the same; the _ms / _s forms are numbers
_GRAFANA_INTERVAL = re.compile(r"\$\{?__(rate_interval|interval|range)(_ms|_s)?\}?")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')


def grafana_to_promql(expr: str) -> str:
    """A Grafana query as Prometheus receives it, its interval variables set (to 5m)."""

    def interval(m: re.Match[str]) -> str:
        return {"_ms": "300000", "_s": "300"}.get(m.group(2) or "", "5m")

    out, last = [], 0
    for s in _STRING.finditer(expr):  # (a `$var` inside a label value is just text)
        out += [_GRAFANA_INTERVAL.sub(interval, expr[last : s.start()]), s.group()]
        last = s.end()
    out.append(_GRAFANA_INTERVAL.sub(interval, expr[last:]))
    return "".join(out)


def parse(expr: str) -> promql_parser.Expr:
    """The expression's syntax tree; ValueError says what is wrong, as Prometheus would."""
    return promql_parser.parse(grafana_to_promql(expr))


def selectors(expr: str) -> list[promql_parser.VectorSelector]:
    """Every series selector the expression reads (in a range, a subquery or bare)."""
    found: list[promql_parser.VectorSelector] = []
    promql_parser.walk(
        parse(expr),
        lambda node: found.append(node) if isinstance(node, promql_parser.VectorSelector) else None,
    )
    return found


_OPS = {"MatchOp.Equal": "=", "MatchOp.NotEqual": "!=", "MatchOp.Re": "=~", "MatchOp.NotRe": "!~"}


def matchers(selector: promql_parser.VectorSelector) -> list[tuple[str, str, str]]:
    """A selector's label matchers: (label, operator as written, value)."""
    return [(m.name, _OPS[str(m.op)], m.value) for m in selector.matchers.matchers]


def selects(selector: promql_parser.VectorSelector, labels: dict[str, str]) -> bool:
    """Whether a series with these labels (its name under `__name__`) is selected: regular
    expressions anchored, as Prometheus anchors them (RE2; these are plain enough)."""
    if selector.name is not None and labels.get("__name__") != selector.name:
        return False
    for name, op, value in matchers(selector):
        have = labels.get(name, "")
        ok = have == value if op in {"=", "!="} else re.fullmatch(value, have) is not None
        if ok == (op in {"!=", "!~"}):
            return False
    return True
