"""Every deployment's engines and gateway agree on the reasoning parser: one value (compose's
CTXCACHE_REASONING_PARSER, the k8s reasoning-config ConfigMap) becomes vLLM's
--reasoning-parser on the CPU engines (`ctxcache vllm`) and the GPU ones (`vllm serve`) and
the gateway's CTX_GATEWAY_REASONING_PARSER; by default none, as the shipped models do not
think."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from collections.abc import Callable

import pytest

from ctxcache.cli import build_parser
from ctxcache.vllm_reasoning import ENV, reasoning_parser_choice
from gateway.settings import GatewaySettings
from tests.deploy import manifests
from tests.deploy.manifests import (
    OVERLAYS,
    Container,
    compose_containers,
    from_vllm_image,
    k8s_containers,
    load_compose,
    render,
)

VARIABLE = "CTXCACHE_REASONING_PARSER"


def engine_parser(c: Container, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """The --reasoning-parser this engine container starts vLLM with (None: none)."""
    if c.ctxcache_command == "vllm":
        monkeypatch.delenv(ENV, raising=False)
        if ENV in c.env:
            monkeypatch.setenv(ENV, c.env[ENV])
        args = build_parser().parse_args(c.argv[1:])
        return reasoning_parser_choice(args.reasoning_parser, "/models/not-here")
    # `sh -c 'exec vllm serve "$@" ...' vllm ARGS`: run that shell, printing vLLM's argv
    assert c.argv[:2] == ["sh", "-c"], c.where
    script = c.argv[2].replace("exec vllm serve", "printf '%s\\n'")
    sh = shutil.which("sh")
    assert sh is not None
    env = {k: v for k, v in c.env.items() if re.fullmatch(r"[A-Z_][A-Z0-9_]*", k)}
    out = subprocess.run(
        [sh, "-c", script, *c.argv[3:]],
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    ).stdout.splitlines()
    if "--reasoning-parser" not in out:
        return None
    return out[out.index("--reasoning-parser") + 1]


def gateway_parser(c: Container, monkeypatch: pytest.MonkeyPatch) -> str | None:
    for name in list(GatewaySettings.model_fields):
        monkeypatch.delenv(f"CTX_GATEWAY_{name.upper()}", raising=False)
    value = c.env.get("CTX_GATEWAY_REASONING_PARSER")
    return GatewaySettings.model_validate({"reasoning_parser": value}).reasoning_parser


def parsers(
    containers: list[Container], monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, str | None], dict[str, str | None]]:
    engines = {
        c.where: engine_parser(c, monkeypatch)
        for c in containers
        if c.ctxcache_command == "vllm" or from_vllm_image(c)
    }
    gateways = {
        c.where: gateway_parser(c, monkeypatch)
        for c in containers
        if c.ctxcache_command == "gateway"
    }
    assert engines and gateways
    return engines, gateways


def compose(value: str | None) -> list[Container]:
    """compose's containers with CTXCACHE_REASONING_PARSER set to `value` (None: unset)."""

    def interpolate(text: str) -> str:
        def one(m: re.Match[str]) -> str:
            if m.group(1) == VARIABLE and value:
                return value
            return m.group(2) or ""

        # compose's own rule: `$$` is a `$` for the container, never a variable
        return "$".join(manifests.INTERPOLATION.sub(one, part) for part in text.split("$$"))

    original: Callable[[str], str] = manifests.interpolate
    manifests.interpolate = interpolate
    try:
        return list(compose_containers(load_compose()))
    finally:
        manifests.interpolate = original


def overlay(name: str, value: str | None) -> list[Container]:
    docs = copy.deepcopy(render(name))
    if value is not None:
        config = next(
            d
            for d in docs
            if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "reasoning-config"
        )
        config["data"]["parser"] = value
    return list(k8s_containers(docs))


@pytest.mark.parametrize("where", ["compose", *OVERLAYS])
def test_by_default_no_engine_parses_reasoning_and_the_gateway_knows(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = compose(None) if where == "compose" else overlay(where, None)
    engines, gateways = parsers(found, monkeypatch)
    assert set(engines.values()) == {None}, engines
    assert set(gateways.values()) == {None}, gateways


@pytest.mark.parametrize("where", ["compose", *OVERLAYS])
def test_one_value_sets_the_engines_and_the_gateway(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = compose("qwen3") if where == "compose" else overlay(where, "qwen3")
    engines, gateways = parsers(found, monkeypatch)
    assert set(engines.values()) == {"qwen3"}, engines
    assert set(gateways.values()) == {"qwen3"}, gateways
    if where == "compose":  # both profiles' engines: the CPU worker and the gpu vllm
        assert set(engines) == {"compose/worker", "compose/vllm"}
