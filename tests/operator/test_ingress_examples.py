"""examples/ingress/: the ingress-nginx Ingress and the Gateway API Inference Extension setup
lead to what the operator runs for the example BaseModel (its Service, its pods, their `http`
port), carry the server's own body limit, and name only metrics the server exports.

The BaseModel is examples/basemodel.yaml read as the operator reads it; the exported series
come from the server's real registry (tests/operator/test_monitoring.py). The EPP's Helm chart
is not available offline: its values file is checked against the keys it sets, not rendered.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from loraplex.operator.specs import BaseModelSpec
from loraplex.operator.workloads import deployment, selector_labels, service
from loraplex.server.settings import ServerSettings

from .test_monitoring import _selects, server_series

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
NGINX = EXAMPLES / "ingress" / "nginx"
GATEWAY = EXAMPLES / "ingress" / "inference-gateway"


def _docs(path: pathlib.Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _base() -> BaseModelSpec:
    (body,) = _docs(EXAMPLES / "basemodel.yaml")
    namespace = yaml.safe_load((EXAMPLES / "kustomization.yaml").read_text())["namespace"]
    return BaseModelSpec.from_body({**body, "metadata": {**body["metadata"], "namespace": namespace}})


BASE = _base()
(INGRESS,) = _docs(NGINX / "ingress.yaml")
(GATEWAY_OBJ,) = _docs(GATEWAY / "gateway.yaml")
(ROUTE,) = _docs(GATEWAY / "httproute.yaml")
VALUES = yaml.safe_load((GATEWAY / "epp-values.yaml").read_text())
# The Helm release of epp-values.yaml, as kustomization.yaml's install step names it: the
# chart names the InferencePool after it.
(RELEASE,) = re.findall(r"helm install (\S+) ", (GATEWAY / "kustomization.yaml").read_text())


def _namespace(directory: pathlib.Path) -> str:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())["namespace"]


def _container(base: BaseModelSpec) -> dict[str, Any]:
    (container,) = deployment(base, 1)["spec"]["template"]["spec"]["containers"]
    return container


# -- ingress-nginx -------------------------------------------------------------------------------------

def test_the_ingress_leads_to_the_basemodels_service_and_port_in_its_namespace():
    assert (INGRESS["apiVersion"], INGRESS["kind"]) == ("networking.k8s.io/v1", "Ingress")
    svc = service(BASE)
    assert _namespace(NGINX) == svc["metadata"]["namespace"] == "loraplex-demo"
    backends = [p["backend"]["service"] for rule in INGRESS["spec"]["rules"] for p in rule["http"]["paths"]]
    assert backends
    for backend in backends:
        assert backend["name"] == svc["metadata"]["name"]
        assert backend["port"]["name"] in {p["name"] for p in svc["spec"]["ports"]}
    # Every path of the API is sent on, not /v1 alone (/tokenize, /detokenize).
    (path,) = [p for rule in INGRESS["spec"]["rules"] for p in rule["http"]["paths"]]
    assert (path["path"], path["pathType"]) == ("/", "Prefix")


NGINX_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def _nginx_size(value: str) -> int:
    """A size as nginx reads it (client_max_body_size): bytes, or k/m/g of 1024s."""
    number, unit = re.fullmatch(r"(\d+)([kKmMgG]?)", value).groups()
    return int(number) * NGINX_UNITS[unit.lower()]


def test_the_body_limit_is_the_servers_max_request_bytes():
    annotations = INGRESS["metadata"]["annotations"]
    assert _nginx_size(annotations["nginx.ingress.kubernetes.io/proxy-body-size"]) == ServerSettings.max_request_bytes
    assert _nginx_size("32m") == 33554432 and _nginx_size("1024") == 1024  # the reader itself


def test_streaming_annotations_turn_buffering_off_and_outlast_a_long_answer():
    annotations = INGRESS["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    for key in ("proxy-read-timeout", "proxy-send-timeout"):
        assert int(annotations[f"nginx.ingress.kubernetes.io/{key}"]) >= 600, key  # nginx's default is 60
    assert all(isinstance(v, str) for v in annotations.values())  # annotations are strings
    assert INGRESS["spec"]["ingressClassName"] == "nginx"


# -- the Gateway API Inference Extension ----------------------------------------------------------------

def test_the_inference_pool_selects_the_basemodels_pods_alone_on_their_http_port():
    pool = VALUES["inferencePool"]
    match = pool["modelServers"]["matchLabels"]
    assert match == selector_labels(BASE.name)
    template = deployment(BASE, 1)["spec"]["template"]
    assert _selects({"matchLabels": match}, template["metadata"]["labels"])
    # Not another BaseModel's pods in the namespace, nor the plan ConfigMap's labels.
    other = BaseModelSpec.from_body({"apiVersion": "loraplex.io/v1alpha1", "kind": "BaseModel",
                                     "metadata": {"name": "mistral-7b", "namespace": BASE.namespace},
                                     "spec": {"source": "/models/m", "maxLoraRank": 16}})
    assert not _selects({"matchLabels": match}, deployment(other, 1)["spec"]["template"]["metadata"]["labels"])
    (port,) = pool["targetPorts"]
    http = {p["name"]: p["containerPort"] for p in _container(BASE)["ports"]}["http"]
    assert port == {"number": http}
    assert pool["modelServerType"] == "vllm" and VALUES["provider"]["name"] == "none"


def _epp_config() -> dict[str, Any]:
    extension = VALUES["inferenceExtension"]
    files = extension["pluginsCustomConfig"]
    return yaml.safe_load(files[extension["pluginsConfigFile"]])


def _metric_names(spec: str) -> str:
    """The metric of a spec string (`name` or `name{label=value}`)."""
    return re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?", spec)[1]


def test_every_metric_the_epp_reads_is_one_the_server_exports_with_the_lora_labels():
    config = _epp_config()
    assert config["kind"] == "EndpointPickerConfig"
    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    extractor = plugins["core-metrics-extractor"]["parameters"]
    engines = {e["name"]: e for e in extractor["engineConfigs"]}
    engine = engines[extractor["defaultEngine"]]
    spec_keys = ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec", "cacheInfoSpec")
    assert set(engine) == {"name", *spec_keys}, "engineConfigs replace a whole engine: name every spec"
    series = server_series()
    named = {key: _metric_names(engine[key]) for key in spec_keys if engine[key]}
    assert named == {"queuedRequestsSpec": "vllm:num_requests_waiting",
                     "runningRequestsSpec": "vllm:num_requests_running",
                     "kvUsageSpec": "vllm:kv_cache_usage_perc", "loraSpec": "vllm:lora_requests_info",
                     "cacheInfoSpec": "vllm:cache_config_info"}
    for key, name in named.items():
        assert name in series, f"{key} names {name}, which the server does not export"
    # The EPP reads these labels of vllm:lora_requests_info (adapters joined by commas, the slot count).
    assert {"running_lora_adapters", "waiting_lora_adapters", "max_lora"} <= series[named["loraSpec"]]
    # ... and these of vllm:cache_config_info (a missing one is an extraction error there).
    assert {"block_size", "num_gpu_blocks"} <= series[named["cacheInfoSpec"]]
    # The chart's flags, where set, name no metric (v1.5.0 refuses the old metric flags).
    flags = VALUES["inferenceExtension"].get("flags") or {}
    assert not [f for f in flags if f.endswith("-metric")]


def test_the_epp_config_references_only_plugins_it_defines_and_scores_lora_affinity():
    config = _epp_config()
    names = {p.get("name", p["type"]) for p in config["plugins"]}
    refs = [p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]]
    refs += [s["pluginRef"] for s in config["data"]["sources"]]
    refs += [e["pluginRef"] for s in config["data"]["sources"] for e in s["extractors"]]
    assert set(refs) <= names, set(refs) - names
    assert "lora-affinity-scorer" in refs


def test_the_route_goes_from_the_gateway_to_the_inference_pool():
    assert (ROUTE["apiVersion"], ROUTE["kind"]) == ("gateway.networking.k8s.io/v1", "HTTPRoute")
    assert (GATEWAY_OBJ["apiVersion"], GATEWAY_OBJ["kind"]) == ("gateway.networking.k8s.io/v1", "Gateway")
    (parent,) = ROUTE["spec"]["parentRefs"]
    assert (parent["group"], parent["kind"], parent["name"]) == \
        ("gateway.networking.k8s.io", "Gateway", GATEWAY_OBJ["metadata"]["name"])
    (rule,) = ROUTE["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == \
        ("inference.networking.k8s.io", "InferencePool", RELEASE)
    assert "port" not in backend  # an InferencePool's port is its targetPorts
    # The Gateway takes routes of its own namespace, where the route and the pool are.
    (listener,) = GATEWAY_OBJ["spec"]["listeners"]
    assert listener["allowedRoutes"]["namespaces"]["from"] == "Same"
    assert _namespace(GATEWAY) == BASE.namespace


def test_no_file_names_an_image_or_a_chart_address():
    """Images and the chart come from the upstream release, never from a host named here."""
    for path in (EXAMPLES / "ingress").rglob("*.yaml"):
        text = path.read_text()
        assert "://" not in text and "image:" not in text and "hub:" not in text, path


# -- kustomize ----------------------------------------------------------------------------------------

def _build(directory: pathlib.Path) -> dict[tuple[str, str], dict[str, Any]]:
    out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True,
                         check=True).stdout
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")
def test_kubectl_kustomize_builds_the_ingress():
    built = _build(NGINX)
    assert set(built) == {("Ingress", "llama-3-8b")}
    ingress = built[("Ingress", "llama-3-8b")]
    assert ingress["metadata"]["namespace"] == BASE.namespace
    assert ingress["spec"] == INGRESS["spec"]
    assert ingress["metadata"]["annotations"] == INGRESS["metadata"]["annotations"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")
def test_kubectl_kustomize_builds_the_gateway_and_route_and_leaves_the_helm_values_out():
    built = _build(GATEWAY)
    assert set(built) == {("Gateway", "inference-gateway"), ("HTTPRoute", "llama-3-8b")}
    for doc in built.values():
        assert doc["metadata"]["namespace"] == BASE.namespace
    assert built[("HTTPRoute", "llama-3-8b")]["spec"] == ROUTE["spec"]
