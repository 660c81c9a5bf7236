"""PromQL helpers: every selector goes through `sel`, which adds the dashboard's
variables (`$namespace`, `$job`, and `$model` on vLLM's series).
"""

from __future__ import annotations

RATE = "[$__rate_interval]"


def sel(name: str, *matchers: str) -> str:
    """`name{matchers..., job=~"$job", namespace=~"$namespace"[, model_name=~"$model"]}`."""
    scope = ['job=~"$job"', 'namespace=~"$namespace"']
    if name.startswith("vllm:"):
        scope.append('model_name=~"$model"')
    return f"{name}{{{', '.join([*matchers, *scope])}}}"


def rate(name: str, *matchers: str) -> str:
    return f"rate({sel(name, *matchers)}{RATE})"


def total(name: str, *matchers: str, by: str = "") -> str:
    """The summed per-second rate of a counter (`by`: the labels kept)."""
    return f"sum{f' by ({by})' if by else ''} ({rate(name, *matchers)})"


def quantile(q: float, histogram: str, by: str = "", *matchers: str) -> str:
    keep = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({keep}) ({rate(histogram, *matchers)}))"


def share(part: str, whole: str) -> str:
    """`part / whole` where the whole is not 0: nothing (not NaN) in a window without any."""
    return f"{part} / on() group_left() ({whole} > 0)"
