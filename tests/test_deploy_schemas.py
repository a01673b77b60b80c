"""deploy/ checked against the schemas of what reads it, beyond parsing: the Kubernetes manifests
against the Kubernetes API's JSON schemas (kubernetes-validate ships them), the KEDA objects
against KEDA's CRD schemas (cloudcoil.models.keda ships them, as models generated from the CRDs;
checked strictly here), the compose file against the
compose specification (check-jsonschema ships it), and every series the Grafana dashboard and
the alert rules query against the names the code exports. Nothing is downloaded.

Each check is also run on a copy with a real mistake (a misspelled field, a wrong type) and
must refuse it: a validator that accepts anything would pass the files too."""

from __future__ import annotations

import copy
import importlib.resources
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudcoil.models.keda.v1alpha1 as keda
import jsonschema
import kubernetes_validate
import pytest
import yaml
from conftest import dashboard_exprs

from worker.monitor.metrics.instruments import exported_series

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
# The Kubernetes release whose API the manifests are checked against, the oldest
# docs/howto/deploying.md names; kubernetes-validate ships the schemas of every release since 1.25.
KUBERNETES = "1.29"


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def manifests() -> list[dict[str, Any]]:
    return [d for p in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in docs(p)]


def kube_errors(doc: dict[str, Any]) -> list[str]:
    """Strict: a field the API does not define is an error, as with kubectl --validate=strict."""
    try:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [str(exc)]
    return []


def _strict(node: Any) -> Any:
    """Every object of the schema with declared properties refuses others, as the API server
    does with `kubectl apply --validate=strict` (maps such as a trigger's metadata declare
    `additionalProperties` themselves and keep it)."""
    if isinstance(node, dict):
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for value in node.values():
            _strict(value)
    elif isinstance(node, list):
        for value in node:
            _strict(value)
    return node


def keda_errors(doc: dict[str, Any]) -> list[str]:
    """Against the schema of the KEDA model generated from KEDA's CRD of that kind."""
    model = getattr(keda, doc["kind"], None)
    if model is None:
        return [f"no KEDA kind {doc['kind']!r}"]
    schema = _strict(model.model_json_schema(by_alias=True))
    return [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(doc)]


def compose_errors(doc: dict[str, Any]) -> list[str]:
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    schema = json.loads(vendor.joinpath("compose-spec.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [e.message for e in validator.iter_errors(doc)]


def errors_of(doc: dict[str, Any]) -> list[str]:
    if doc["apiVersion"].startswith("keda.sh/"):
        return keda_errors(doc)
    return kube_errors(doc)


def one(kind: str) -> dict[str, Any]:
    found = [d for d in manifests() if d["kind"] == kind]
    assert len(found) == 1, kind
    return copy.deepcopy(found[0])


# -- Kubernetes and KEDA ---------------------------------------------------------------------------


def test_every_manifest_is_valid_for_the_api_it_targets() -> None:
    kinds = [d["kind"] for d in manifests()]
    assert {"Deployment", "Service", "Job", "PodDisruptionBudget", "Secret"} <= set(kinds)
    assert {"ScaledObject", "TriggerAuthentication"} <= set(kinds)
    for doc in manifests():
        assert errors_of(doc) == [], (doc["kind"], errors_of(doc))


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]["containers"][0]


MISTAKES: dict[str, tuple[str, Callable[[dict[str, Any]], None]]] = {
    "misspelled container field": (
        "Deployment",
        lambda d: _container(d).__setitem__("imagePulPolicy", "IfNotPresent"),
    ),
    "replicas as text": ("Deployment", lambda d: d["spec"].__setitem__("replicas", "2")),
    "port as text": (
        "Service",
        lambda d: d["spec"]["ports"][0].__setitem__("port", "9187"),
    ),
    "misspelled job field": (
        "Job",
        lambda d: d["spec"].__setitem__("backofLimit", 3),
    ),
    "pdb minAvailable as a list": (
        "PodDisruptionBudget",
        lambda d: d["spec"].__setitem__("minAvailable", [1]),
    ),
    "misspelled ScaledObject field": (
        "ScaledObject",
        lambda d: d["spec"].__setitem__("pollingInterwal", 15),
    ),
    "ScaledObject count as text": (
        "ScaledObject",
        lambda d: d["spec"].__setitem__("maxReplicaCount", "20"),
    ),
    "trigger metadata value not a string": (
        "ScaledObject",
        lambda d: d["spec"]["triggers"][0]["metadata"].__setitem__("targetQueryValue", 500),
    ),
    "trigger without a type": (
        "ScaledObject",
        lambda d: d["spec"]["triggers"][0].pop("type"),
    ),
    "misspelled secret reference": (
        "TriggerAuthentication",
        lambda d: d["spec"]["secretTargetRef"][0].__setitem__("keys", "x"),
    ),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_real_mistake_is_refused(mistake: str) -> None:
    kind, break_it = MISTAKES[mistake]
    doc = one(kind)
    assert errors_of(doc) == []
    break_it(doc)
    assert errors_of(doc), f"{mistake} was accepted"


# -- compose ---------------------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    return docs(DEPLOY / "docker-compose.yml")[0]


def test_compose_file_follows_the_compose_specification() -> None:
    assert compose_errors(compose()) == []


@pytest.mark.parametrize(
    "break_it",
    [
        lambda c: c["services"]["worker"].__setitem__("enviroment", {"A": "b"}),
        lambda c: c["services"]["worker"].__setitem__("restart", 5),
        lambda c: c["services"]["postgres"].__setitem__("healthcheck", {"tests": ["CMD", "true"]}),
        lambda c: c.__setitem__("service", {}),
    ],
    ids=["misspelled service field", "restart as a number", "misspelled healthcheck", "top"],
)
def test_compose_mistakes_are_refused(break_it: Callable[[dict[str, Any]], None]) -> None:
    doc = copy.deepcopy(compose())
    break_it(doc)
    assert compose_errors(doc)


# -- the metric names the dashboard and the alerts query -----------------------------------------

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}|\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without", "on",
             "ignoring", "group_left", "group_right", "atan2"}  # fmt: skip


def series_in(expr: str) -> set[str]:
    """The series names a PromQL expression selects: strings, label matchers, ranges, grouping
    clauses and function calls taken out, what is left that is a name is a series."""
    text = _STRINGS.sub(" ", expr)
    text = _MATCHERS.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    return {m for m in _IDENT.findall(text) if m.lower() not in _KEYWORDS}


def test_series_in_finds_every_name_whatever_its_prefix() -> None:
    expr = (
        'sum by (queue) (rate(wroker_tasks_done_total{queue=~"$queue", x="worker_fake"}[5m]))'
        " / on (queue) group_left up + histogram_quantile(0.9, x_bucket) > bool 0"
    )
    assert series_in(expr) == {"wroker_tasks_done_total", "up", "x_bucket"}


def test_dashboard_and_alerts_select_only_series_the_code_exports() -> None:
    known = exported_series()
    # label_values(SERIES, LABEL): Grafana's variable query; its first argument is a selector.
    exprs = [re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", q) for q in dashboard_exprs()]
    rules = docs(DEPLOY / "prometheus" / "alerts.yml")[0]["groups"]
    exprs += [r["expr"] for g in rules for r in g["rules"]]
    used = set().union(*(series_in(e) for e in exprs))
    # `up` is Prometheus's own series for a scrape target.
    assert used - {"up"} <= known, f"not exported by the code: {sorted(used - {'up'} - known)}"
    assert len(used) > 10
