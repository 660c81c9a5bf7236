"""The deployment files against their official schemas, with real validators, offline.

- docker-compose.yml: the Compose Specification JSON schema (compose-spec/compose-spec,
  Apache-2.0) as vendored by the `check-jsonschema` wheel, validated with `jsonschema`.
- deploy/k8s: both overlays rendered, every object validated by `kubernetes-validate`
  (the upstream OpenAPI-derived JSON schemas it bundles) in strict mode, which rejects
  unknown fields, against the oldest and the newest Kubernetes version we support.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from importlib.resources import files
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from tests.deploy.manifests import OVERLAYS, Doc, find, key, load_compose, render

K8S_VERSIONS = ("1.29", "1.33")


@cache
def compose_validator() -> jsonschema.Draft202012Validator:
    text = files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json")
    schema = json.loads(text.read_text())
    assert schema["title"] == "Compose Specification"
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def compose_errors(doc: Doc) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in compose_validator().iter_errors(doc)
    ]


def k8s_errors(doc: Doc, version: str) -> list[str]:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path))}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:  # an unknown kind is an error too
        return [e.message]
    return []


# ---- compose --------------------------------------------------------------------------


def test_compose_file_follows_the_compose_specification() -> None:
    assert compose_errors(load_compose()) == []


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda c: c["services"]["redis"].update(healthcheck={"tset": ["CMD", "x"]}), "tset"),
        (
            lambda c: c["services"]["gateway"]["depends_on"]["manager"].update(
                condition="service_up"
            ),
            "service_up",
        ),
        (lambda c: c["services"]["sidecar"].update(volumes="sidecar-data:/data"), "not of type"),
    ],
    ids=["unknown-key", "bad-condition", "wrong-type"],
)
def test_compose_validation_catches_a_broken_file(mutate: Any, expected: str) -> None:
    broken = copy.deepcopy(load_compose())
    mutate(broken)
    errors = compose_errors(broken)
    assert errors and expected in " ".join(errors)


# ---- kubernetes -------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_follows_the_kubernetes_schema(overlay: str, version: str) -> None:
    docs = render(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "Secret"} <= kinds
    assert {"HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    assert len({key(d) for d in docs}) == len(docs), "duplicate objects"
    errors = {f"{d['kind']}/{d['metadata']['name']}": k8s_errors(d, version) for d in docs}
    assert {k: v for k, v in errors.items() if v} == {}


def _misspelled_field(docs: list[Doc]) -> None:
    c = find(docs, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
    c["readinessProbe"]["httpGet"]["paht"] = c["readinessProbe"]["httpGet"].pop("path")


def _string_replicas(docs: list[Doc]) -> None:
    find(docs, "StatefulSet", "worker")["spec"]["replicas"] = "two"


def _gpu_in_wrong_place(docs: list[Doc]) -> None:
    pod = find(docs, "StatefulSet", "worker")["spec"]["template"]["spec"]
    pod["containers"][0]["resources"]["gpus"] = 1


@pytest.mark.parametrize("mutate", [_misspelled_field, _string_replicas, _gpu_in_wrong_place])
def test_kubernetes_validation_catches_a_broken_manifest(mutate: Any) -> None:
    docs = copy.deepcopy(render("gpu"))
    mutate(docs)
    assert any(k8s_errors(d, K8S_VERSIONS[-1]) for d in docs)


def test_an_unknown_kind_is_an_error_not_a_skip() -> None:
    doc = {"apiVersion": "v1", "kind": "Servise", "metadata": {"name": "x"}}
    assert k8s_errors(doc, K8S_VERSIONS[-1])
