"""A BaseModel's serving.autoscaling: an autoscaling/v2 HorizontalPodAutoscaler over the
serving Deployment, which then carries no replica count of the operator's; and
`replicas: null`, which leaves the count to a controller of the user's (KEDA, say)."""

from __future__ import annotations

import copy
import datetime

import pytest

from loraplex.operator.plan import build_plan
from loraplex.operator.specs import Autoscaling, BaseModelSpec, SpecError
from loraplex.operator.status import base_status
from loraplex.operator.workloads import SPEC_HASH_ANNOTATION, autoscaler, deployment, needs_update

from .test_manifests import validator

QUEUE = {"type": "Pods", "pods": {"metric": {"name": "loraplex_requests_waiting"},
                                  "target": {"type": "AverageValue", "averageValue": "4"}}}
T0 = datetime.datetime(2026, 12, 2, tzinfo=datetime.timezone.utc)


def body(serving=None) -> dict:
    spec = {"source": "/models/llama-3-8b", "maxLoraRank": 16, "memory": {"slots": 8}}
    if serving is not None:
        spec["serving"] = serving
    return {"apiVersion": "loraplex.io/v1alpha1", "kind": "BaseModel",
            "metadata": {"name": "llama-3-8b", "namespace": "ml", "generation": 1}, "spec": spec}


def base(serving=None) -> BaseModelSpec:
    return BaseModelSpec.from_body(body(serving))


SCALED = {"autoscaling": {"minReplicas": 2, "maxReplicas": 6, "metrics": [QUEUE]}}


def test_the_autoscaler_targets_the_deployment_which_then_has_no_replica_count():
    scaled = base(SCALED)
    assert scaled.serving.autoscaling == Autoscaling(2, 6, (QUEUE,), None)
    hpa = autoscaler(scaled)
    assert (hpa["apiVersion"], hpa["kind"], hpa["metadata"]["name"], hpa["metadata"]["namespace"]) == \
        ("autoscaling/v2", "HorizontalPodAutoscaler", "llama-3-8b", "ml")
    dep = deployment(scaled, 8)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": dep["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"], hpa["spec"]["metrics"]) == (2, 6, [QUEUE])
    assert "behavior" not in hpa["spec"]
    assert "replicas" not in dep["spec"]  # the HPA's count stands; a merge patch leaves it
    # Without autoscaling: no HPA, and the operator's count again.
    plain = base({"replicas": 3})
    assert autoscaler(plain) is None and deployment(plain, 8)["spec"]["replicas"] == 3
    assert needs_update(deployment(scaled, 8) | {"spec": {**dep["spec"], "replicas": 5}}, deployment(plain, 8))
    # replicas: null: no count written either, and no HPA of the operator's.
    external = base({"replicas": None})
    assert "replicas" not in deployment(external, 8)["spec"] and autoscaler(external) is None
    assert validator("BaseModel").is_valid(body({"replicas": None}))


def test_a_field_taken_out_of_the_autoscaler_is_a_change_and_the_servers_defaults_are_not():
    with_behavior = base({"autoscaling": {**SCALED["autoscaling"],
                                          "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}}}})
    written = autoscaler(with_behavior)
    # What the API server keeps: ours, its defaults filled in, a status.
    served = copy.deepcopy(written)
    served["spec"]["behavior"]["scaleUp"] = {"stabilizationWindowSeconds": 0, "selectPolicy": "Max"}
    served["status"] = {"currentReplicas": 2}
    assert not needs_update(served, written)
    # The behavior taken out of the BaseModel: its digest differs, so the HPA is replaced.
    without = autoscaler(base(SCALED))
    assert without["metadata"]["annotations"][SPEC_HASH_ANNOTATION] != \
        written["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
    assert needs_update(served, without)
    # A metric edited by hand on the HPA is put back.
    edited = copy.deepcopy(served)
    edited["spec"]["metrics"][0]["pods"]["target"]["averageValue"] = "40"
    assert needs_update(edited, written)


@pytest.mark.parametrize(("autoscaling", "says", "schema_sees"), [
    ({"maxReplicas": 3}, "metrics", True),
    ({"maxReplicas": 3, "metrics": []}, "metrics", True),
    ({"metrics": [QUEUE]}, "maxReplicas", True),
    ({"minReplicas": 0, "maxReplicas": 3, "metrics": [QUEUE]}, "minReplicas", True),
    ({"minReplicas": 4, "maxReplicas": 3, "metrics": [QUEUE]}, "maxReplicas", False),  # CEL, not jsonschema
    ({"maxReplicas": 3, "metrics": [{"type": "Cpu"}]}, r"metrics\[0\]", True),
    ({"maxReplicas": 3, "metrics": [{"type": "Pods"}]}, r"metrics\[0\]", False),  # no `pods` object
    ({"maxReplicas": 3, "metrics": [QUEUE], "behavior": "fast"}, "behavior", True),
])
def test_an_autoscaler_the_api_server_would_refuse_is_refused_first(autoscaling, says, schema_sees):
    with pytest.raises(SpecError, match=says):
        base({"autoscaling": autoscaling})
    if schema_sees:
        assert not validator("BaseModel").is_valid(body({"autoscaling": autoscaling}))
    assert validator("BaseModel").is_valid(body(SCALED))


def test_an_autoscaled_base_is_ready_once_its_minimum_is():
    scaled = base(SCALED)
    plan = build_plan(scaled, [], T0)

    def ready(n: int) -> dict:
        return next(c for c in base_status(plan, None, n, "p", T0)["conditions"] if c["type"] == "Ready")

    assert ready(1)["status"] == "False" and "1/2 (autoscaled 2-6)" in ready(1)["message"]
    assert ready(2)["status"] == "True" and ready(5)["status"] == "True"
    external = build_plan(base({"replicas": None}), [], T0)
    got = lambda n: next(c for c in base_status(external, None, n, "p", T0)["conditions"] if c["type"] == "Ready")
    assert got(0)["status"] == "False" and got(1)["status"] == "True" and "another controller" in got(1)["message"]


async def test_an_operator_without_the_hpa_permission_still_writes_the_workloads_of_bases_without_one():
    """A ClusterRole from before serving.autoscaling (the image upgraded, the chart not) gives
    a 403 on the HPA: a base that asks for none still gets its Deployment and Service."""
    import logging

    from loraplex.operator import handlers, kube

    class Client:
        written: list = []

        async def get(self, path):
            raise kube.KubeError(403, "horizontalpodautoscalers is forbidden")

        async def ensure(self, desired):
            self.written.append(desired["kind"])
            return "created"

    owner = {"apiVersion": "loraplex.io/v1alpha1", "kind": "BaseModel",
             "metadata": {"name": "llama-3-8b", "namespace": "ml", "uid": "u-1"}}
    client = Client()
    assert await handlers._ensure_workloads(client, base(), owner, logging.getLogger("test")) is None
    assert client.written == ["Deployment", "Service"]


def test_an_autoscaler_the_api_server_canonicalised_is_no_change():
    """A metric's target values are quantities, which the API server keeps in canonical form
    (`averageValue: 4` comes back "4", "0.5" as "500m", "1000" as "1k"): compared as given,
    every resync and restart replaced the HPA with what it already had."""
    targets = [{"type": "AverageValue", "averageValue": 4}, {"type": "AverageValue", "averageValue": "0.5"},
               {"type": "Value", "value": "1000"}]
    metrics = [{"type": "Pods", "pods": {"metric": {"name": "loraplex_requests_waiting"}, "target": targets[0]}},
               {"type": "Pods", "pods": {"metric": {"name": "loraplex_requests_running"}, "target": targets[1]}},
               {"type": "Object", "object": {"metric": {"name": "queue"}, "target": targets[2],
                                             "describedObject": {"apiVersion": "v1", "kind": "Service",
                                                                 "name": "llama-3-8b"}}}]
    written = autoscaler(base({"autoscaling": {"maxReplicas": 4, "metrics": metrics}}))
    served = copy.deepcopy(written)
    served["spec"]["metrics"][0]["pods"]["target"]["averageValue"] = "4"
    served["spec"]["metrics"][1]["pods"]["target"]["averageValue"] = "500m"
    served["spec"]["metrics"][2]["object"]["target"]["value"] = "1k"
    assert not needs_update(served, written)
    # Another value, or another kind of target, is still a change.
    more = copy.deepcopy(served)
    more["spec"]["metrics"][1]["pods"]["target"]["averageValue"] = "600m"
    assert needs_update(more, written)
    other = copy.deepcopy(served)
    other["spec"]["metrics"][0]["pods"]["target"]["type"] = "Value"
    assert needs_update(other, written)


async def test_an_autoscaler_in_canonical_form_is_not_replaced_at_a_restart(api, emulator, kubeconfig, crds,
                                                                            operator_runner, eventually_):
    """The emulator keeps bodies as sent, so the test writes the API server's form itself."""
    from loraplex.operator.kube import AUTOSCALERS, BASE_MODELS

    from .test_operator_e2e import NS, base_body

    queue = {"type": "Pods", "pods": {"metric": {"name": "loraplex_requests_waiting"},
                                      "target": {"type": "AverageValue", "averageValue": 0.5}}}
    path = AUTOSCALERS.path(NS, "llama-3-8b")
    async with operator_runner():
        await api.create(BASE_MODELS.path(NS), base_body(serving={
            "image": "loraplex/server:test", "autoscaling": {"maxReplicas": 3, "metrics": [queue]}}))
        hpa = await eventually_(lambda: api.get(path), what="the HPA")
    hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] = "500m"
    await api.merge_patch(path, {"spec": {"metrics": hpa["spec"]["metrics"]}})
    requests_before = len(list(emulator._requests))

    async with operator_runner():
        async def resumed():  # the resume handler has compared the HPA with its spec
            return [r for r in list(emulator._requests)[requests_before:] if r.url.path == path]
        await eventually_(resumed, what="the restarted operator to read the HPA")
    writes = [r.method for r in list(emulator._requests)[requests_before:]
              if r.url.path == path and r.method in ("PUT", "PATCH")]
    assert writes == []
    assert (await api.get(path))["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "500m"
