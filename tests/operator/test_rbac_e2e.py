"""The operator's ClusterRole (and, mirroring plans, its Role in the release namespace),
derived from what the operator does: every API call it makes in a run through its paths
(kopf's watches, finalizers, annotations and events; its own client's plan ConfigMap, mirror,
Deployment, Service and status writes; the mirrors' sweep and deletion) is granted, and
nothing is granted that no call uses, so a leaked operator token can do no more than the operator.

The emulator checks no RBAC: it records each request, and the requests that carry the
operator's kubeconfig token are turned into (API group, resource, verb) the way the API
server's authorizer does (GET by name: get; GET of a collection: list; ?watch: watch; POST:
create; PATCH: patch; PUT: update; DELETE: delete).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from loraplex.operator.kube import ADAPTERS, AUTOSCALERS, BASE_MODELS, DEPLOYMENTS, SERVICES, Resource

from .test_chart import RELEASE_NS, VALUES, render_all
from .test_operator_e2e import NS, adapter_body, base_body, plan_of

NAMESPACES = Resource("", "v1", "namespaces")
OPERATOR_TOKEN = "Bearer not-checked"  # the kubeconfig fixture's token; the tests' own client sends none
# Granted for no API call: the OwnerReferencesPermissionEnforcement admission plugin lets an
# object name its owner with blockOwnerDeletion (kopf.adopt does, for the plan ConfigMap,
# the Deployment and the Service) only when its writer may update the owner's finalizers.
FOR_ADMISSION = {("loraplex.io", "basemodels/finalizers", "update")}


def _verb(request: Any) -> str:
    method = str(request.method.value if hasattr(request.method, "value") else request.method).upper()
    if method == "GET":
        if request.params.get("watch") in ("true", "1"):
            return "watch"
        return "get" if request.name else "list"
    if method == "DELETE":
        return "delete" if request.name else "deletecollection"
    return {"POST": "create", "PATCH": "patch", "PUT": "update"}[method]


def operator_calls(emulator: Any) -> set[tuple[str, str, str]]:
    return {call[:3] for call in operator_calls_in(emulator)}


def operator_calls_in(emulator: Any) -> set[tuple[str, str, str, str | None]]:
    """(group, resource, verb, namespace) of each call (namespace None: a cluster-wide one)."""
    calls = set()
    for request in list(emulator._requests):
        headers = {k.lower(): v for k, v in request.headers.items()}
        if headers.get("authorization") != OPERATOR_TOKEN:
            continue
        resource = request.resource
        if resource is None or resource.plural is None:
            continue  # discovery (/api, /apis, /version): non-resource URLs every account may read
        plural = str(resource.plural) + (f"/{request.subresource}" if request.subresource else "")
        calls.add((str(resource.group or ""), plural, _verb(request), request.namespace))
    return calls


def granted(values: dict[str, Any], kind: str = "ClusterRole",
            name: str = "lp-loraplex-operator") -> set[tuple[str, str, str]]:
    role = render_all(values).get((kind, name))
    return {(group, resource, verb) for rule in (role or {"rules": []})["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


async def _drive(api: Any, eventually: Any) -> None:
    """Every path that writes: create, re-plan, resize, readiness, invalid spec, both deletions."""
    await api.create(BASE_MODELS.path(NS), base_body())
    for name, priority in (("a", 10), ("b", 5), ("c", 1)):
        await api.create(ADAPTERS.path(NS), adapter_body(name, priority))
    await api.create(ADAPTERS.path(NS), adapter_body("odd", 1, pinPolicy="Sometimes"))

    async def planned(names: list[str], pinned: list[str]) -> Any:
        plan = await plan_of(api)
        return plan if [a["name"] for a in plan["adapters"]] == names and plan["pinned"] == pinned else None
    await eventually(lambda: planned(["a", "b", "c"], ["a", "b"]), what="the first plan")
    await api.merge_patch(ADAPTERS.path(NS, "c"), {"spec": {"priority": 50}})
    await eventually(lambda: planned(["a", "b", "c"], ["a", "c"]), what="c pinned")
    # A Service edited by hand is put back at the base's next change.
    await api.merge_patch(SERVICES.path(NS, "llama-3-8b"), {"spec": {"selector": {"app.kubernetes.io/name": "other"}}})
    await api.merge_patch(BASE_MODELS.path(NS, "llama-3-8b"), {"spec": {"serving": {"replicas": 2}}})

    async def scaled() -> Any:
        dep = await api.get(DEPLOYMENTS.path(NS, "llama-3-8b"))
        svc = await api.get(SERVICES.path(NS, "llama-3-8b"))
        return dep if dep["spec"]["replicas"] == 2 and svc["spec"]["selector"]["app.kubernetes.io/name"] == "loraplex-server" else None
    await eventually(scaled, what="the Deployment scaled, the Service repaired")
    await api.patch_status(DEPLOYMENTS, NS, "llama-3-8b", {"readyReplicas": 2, "replicas": 2})

    async def ready() -> Any:
        base = await api.get(BASE_MODELS.path(NS, "llama-3-8b"))
        return base if (base.get("status") or {}).get("readyReplicas") == 2 else None
    await eventually(ready, what="the base ready")
    await _autoscale(api, eventually)
    await api._request("DELETE", ADAPTERS.path(NS, "a"))
    await eventually(lambda: planned(["b", "c"], ["b", "c"]), what="a out of the plan")

    async def gone() -> bool:
        return await api.get(ADAPTERS.path(NS, "a")) is None
    await eventually(gone, what="a deleted (its finalizer removed)")
    await api._request("DELETE", BASE_MODELS.path(NS, "llama-3-8b"))

    async def parked() -> Any:
        b = await api.get(ADAPTERS.path(NS, "b"))
        return b if b["status"]["phase"] == "Pending" else None
    await eventually(parked, what="b Pending without its base")


QUEUE = {"type": "Pods", "pods": {"metric": {"name": "loraplex_requests_waiting"},
                                  "target": {"type": "AverageValue", "averageValue": "4"}}}


async def _autoscale(api: Any, eventually: Any) -> None:
    """serving.autoscaling on (the HPA created, the Deployment's count left to it), changed
    (the HPA replaced: its behavior taken out goes), and off again (the HPA deleted, the
    operator's count back)."""
    base = BASE_MODELS.path(NS, "llama-3-8b")
    hpa_path = AUTOSCALERS.path(NS, "llama-3-8b")
    scaling = {"minReplicas": 2, "maxReplicas": 5, "metrics": [QUEUE],
               "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}}}
    await api.merge_patch(base, {"spec": {"serving": {"autoscaling": scaling}}})

    async def scaled(want: dict) -> Any:
        hpa = await api.get(hpa_path)
        return hpa if hpa is not None and all(hpa["spec"].get(k) == v for k, v in want.items()) else None
    hpa = await eventually(lambda: scaled({"maxReplicas": 5, "behavior": scaling["behavior"]}), what="the HPA")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llama-3-8b"}
    assert hpa["metadata"]["ownerReferences"][0]["kind"] == "BaseModel"  # collected with it
    # The HPA scales the Deployment; the operator's resyncs leave its count alone. Another
    # tool labels the HPA: the replacement keeps that label.
    await api.merge_patch(DEPLOYMENTS.path(NS, "llama-3-8b"), {"spec": {"replicas": 4}})
    await api.merge_patch(hpa_path, {"metadata": {"labels": {"team": "ml"}}})
    await api.merge_patch(base, {"spec": {"serving": {"autoscaling": {"maxReplicas": 8, "behavior": None}}}})
    hpa = await eventually(lambda: scaled({"maxReplicas": 8}), what="the HPA replaced")
    assert "behavior" not in hpa["spec"]  # a merge patch would have kept it
    assert hpa["metadata"]["labels"]["team"] == "ml" and hpa["metadata"]["labels"]["loraplex.io/base-model"]
    assert (await api.get(DEPLOYMENTS.path(NS, "llama-3-8b")))["spec"]["replicas"] == 4
    await api.merge_patch(base, {"spec": {"serving": {"autoscaling": None}}})

    async def unscaled() -> Any:
        dep = await api.get(DEPLOYMENTS.path(NS, "llama-3-8b"))
        return dep if await api.get(hpa_path) is None and dep["spec"]["replicas"] == 2 else None
    await eventually(unscaled, what="the HPA deleted, serving.replicas back")


@pytest.mark.parametrize("namespaces, mirrors", [((), True), ((NS,), True), ((), False)],
                         ids=["clusterwide", "one-namespace", "no-mirrors"])
async def test_operator_role_grants_exactly_what_the_operator_calls(namespaces, mirrors, api, emulator, kubeconfig,
                                                                   crds, operator_runner, eventually_):
    """The operator runs as the chart runs it: with nodeAgent.discoverPlans (the default) it
    mirrors the plans into the release namespace, and what it calls there beyond its
    ClusterRole (listing and deleting the mirrors) its Role there grants, and no more."""
    values = copy.deepcopy(VALUES)
    values["operator"]["watchNamespaces"] = list(namespaces)
    values["nodeAgent"]["discoverPlans"] = mirrors
    if namespaces:  # kopf serves a listed namespace once it has seen it exist
        await api.create(NAMESPACES.path(None), {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    async with operator_runner(namespaces, mirror_namespace=RELEASE_NS if mirrors else None):
        await _drive(api, eventually_)
        if mirrors:  # the mirror was written, and deleted with its BaseModel
            assert any(k[1] == RELEASE_NS and k[2] == f"{NS}.llama-3-8b-plan" for k in emulator.objects)
    calls = operator_calls_in(emulator)
    role = granted(values)
    local = granted(values, "Role", "lp-loraplex-operator-plan-mirrors")
    beyond = {call for call in calls if call[:3] not in role}
    assert {call[:3] for call in beyond} - local == set(), "called but not granted"
    assert {call[3] for call in beyond} <= {RELEASE_NS}, "the Role's calls outside its namespace"
    assert role - {call[:3] for call in calls} - FOR_ADMISSION == set(), "granted but never called"
    assert local - {call[:3] for call in beyond} == set(), "granted in the release namespace but never called"
