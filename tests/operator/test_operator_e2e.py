"""The operator end to end: kopf in-process against the emulated API over real HTTP.

Each test starts a fresh emulator and operator. What an emulator cannot prove (schema
validation and defaulting, RBAC, admission, pods running) is listed in emulator.py.
"""

from __future__ import annotations

from typing import Any

from loraplex.operator.kube import ADAPTERS, BASE_MODELS, CONFIG_MAPS, DEPLOYMENTS, SERVICES, KubeClient
from loraplex.operator.workloads import read_plan

NS = "ml"
G, M = 10**9, 10**6


def base_body(name: str = "llama-3-8b", **spec: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "source": "s3://models/llama-3-8b", "maxLoraRank": 64, "dtype": "float16",
        # The packing example: 10 GB of adapter room, 250 slots of 40 MB.
        "memory": {"gpuMemory": "80G", "baseWeights": "16G", "overhead": "24G", "kvCacheReserve": "30G",
                   "adapterBytes": "40M"},
        "pinnedPercent": 1,  # 2 of 250 slots pinned: small enough to watch the set move
        "serving": {"replicas": 1, "image": "loraplex/server:test"},
    }
    fields.update(spec)
    return {"apiVersion": "loraplex.io/v1alpha1", "kind": "BaseModel",
            "metadata": {"name": name, "namespace": NS}, "spec": fields}


def adapter_body(name: str, priority: int, **spec: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {"baseModel": "llama-3-8b", "source": f"https://artifacts.example/adapters/{name}", "sha256": "0" * 64,
                              "tenant": "acme", "priority": priority, "rank": 16,
                              "targetModules": ["q_proj", "v_proj"]}
    fields.update(spec)
    return {"apiVersion": "loraplex.io/v1alpha1", "kind": "LoRAAdapter",
            "metadata": {"name": name, "namespace": NS}, "spec": fields}


async def plan_of(api: KubeClient, base: str = "llama-3-8b") -> dict[str, Any] | None:
    cm = await api.get(CONFIG_MAPS.path(NS, f"{base}-plan"))
    return read_plan(cm) if cm else None


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}


async def setup_pool(api: KubeClient, eventually) -> None:
    await api.create(BASE_MODELS.path(NS), base_body())
    for name, priority in (("a", 10), ("b", 5), ("c", 1)):
        await api.create(ADAPTERS.path(NS), adapter_body(name, priority))
    await api.create(ADAPTERS.path(NS), adapter_body("too-big", 100, rank=128))

    async def planned():
        plan = await plan_of(api)
        return plan if plan and [a["name"] for a in plan["adapters"]] == ["a", "b", "c"] else None
    await eventually(planned, what="a plan with a, b, c")


async def test_pool_gets_plan_status_and_workloads(api, operator, eventually_):
    await setup_pool(api, eventually_)
    plan = await plan_of(api)
    assert plan["slots"] == 250 and plan["maxLoraRank"] == 64 and plan["pinned"] == ["a", "b"]
    assert {a["name"]: a["pinned"] for a in plan["adapters"]} == {"a": True, "b": True, "c": False}

    base = await api.get(BASE_MODELS.path(NS, "llama-3-8b"))
    status = await eventually_(lambda: _status_with(api, BASE_MODELS, "llama-3-8b", "slots"))
    assert (status["slots"], status["pinned"], status["adapterCount"], status["rejectedCount"]) == (250, ["a", "b"], 3, 1)
    assert conditions({"status": status})["Accepted"]["reason"] == "Packed"
    assert status["observedGeneration"] == base["metadata"]["generation"]

    rejected = await eventually_(lambda: _status_with(api, ADAPTERS, "too-big", "phase"))
    assert rejected["phase"] == "Rejected"
    assert conditions({"status": rejected})["Accepted"]["reason"] == "RankTooLarge"
    a = await eventually_(lambda: _status_with(api, ADAPTERS, "a", "phase"))
    assert a["pinned"] is True and a["phase"] == "Accepted" and a["rank"] == 16
    assert "loraplex.io/operator" in (await api.get(ADAPTERS.path(NS, "a")))["metadata"]["finalizers"]

    dep = await eventually_(lambda: api.get(DEPLOYMENTS.path(NS, "llama-3-8b")), what="the Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-loras") + 1] == "250" and "--plan-file" in args
    assert dep["metadata"]["ownerReferences"][0]["uid"] == base["metadata"]["uid"]
    svc = await eventually_(lambda: api.get(SERVICES.path(NS, "llama-3-8b")), what="the Service")
    assert svc["spec"]["ports"][0]["name"] == "http" and svc["spec"]["ports"][0]["port"] == 8000
    cm = await api.get(CONFIG_MAPS.path(NS, "llama-3-8b-plan"))
    assert cm["metadata"]["labels"]["loraplex.io/base-model"] == "llama-3-8b"
    assert cm["metadata"]["ownerReferences"][0]["kind"] == "BaseModel"

    # The emulator validates nothing; the CRDs' schemas (status included) are checked here,
    # so a field the operator writes and the API server would prune or refuse shows up.
    for resource, kind in ((ADAPTERS, "LoRAAdapter"), (BASE_MODELS, "BaseModel")):
        listing = await api.get(resource.path(NS))
        for obj in listing["items"]:
            errors = [e.message for e in _validator(kind).iter_errors(obj)]
            assert not errors, (obj["metadata"]["name"], errors)
            assert _undeclared(_schema(kind)["properties"]["status"], obj["status"]) == [], obj["metadata"]["name"]


def _schema(kind: str) -> dict[str, Any]:
    import pathlib

    import yaml

    plural = {"LoRAAdapter": "loraadapters", "BaseModel": "basemodels"}[kind]
    crd = yaml.safe_load((pathlib.Path(__file__).resolve().parents[2] / "crds" / f"{plural}.loraplex.io.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _validator(kind: str):
    import jsonschema

    return jsonschema.Draft7Validator(_schema(kind), format_checker=jsonschema.FormatChecker())


def _undeclared(schema: dict[str, Any], value: Any, path: str = "status") -> list[str]:
    """Fields the API server would prune: not declared in a structural schema."""
    if not isinstance(value, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        if isinstance(value, list) and isinstance(schema.get("items"), dict):
            return [p for item in value for p in _undeclared(schema["items"], item, f"{path}[]")]
        return []
    found = []
    for key, item in value.items():
        if key in (schema.get("properties") or {}):
            found += _undeclared(schema["properties"][key], item, f"{path}.{key}")
        elif isinstance(schema.get("additionalProperties"), dict):
            found += _undeclared(schema["additionalProperties"], item, f"{path}.{key}")
        else:
            found.append(f"{path}.{key}")
    return found


async def _status_with(api: KubeClient, resource, name: str, key: str) -> dict[str, Any] | None:
    obj = await api.get(resource.path(NS, name))
    status = (obj or {}).get("status") or {}
    return status if key in status else None


def history(emulator, resource, name: str, namespace: str | None = NS) -> int:
    """How many versions the emulator has stored of an object (each write adds one)."""
    import kmock

    key = (kmock.resource(resource.group, resource.version, resource.plural), namespace, name)
    return len(emulator.objects[key].history)


async def test_priority_change_moves_the_pinned_set_and_nothing_else(api, emulator, operator, eventually_, settled):
    await setup_pool(api, eventually_)
    await eventually_(lambda: _status_with(api, BASE_MODELS, "llama-3-8b", "pinned"))
    await eventually_(lambda: _status_with(api, ADAPTERS, "c", "pinned"))
    await settled()  # kopf's own bookkeeping (annotations) after the creations is done
    untouched = {"deployment": history(emulator, DEPLOYMENTS, "llama-3-8b"),
                 "service": history(emulator, SERVICES, "llama-3-8b"),
                 "a": history(emulator, ADAPTERS, "a"), "too-big": history(emulator, ADAPTERS, "too-big")}
    cm_versions = history(emulator, CONFIG_MAPS, "llama-3-8b-plan")

    await api.merge_patch(ADAPTERS.path(NS, "c"), {"spec": {"priority": 50}})

    async def moved():
        plan = await plan_of(api)
        return plan if plan["pinned"] == ["a", "c"] else None
    plan = await eventually_(moved, what="c pinned instead of b")
    assert {a["name"]: a["priority"] for a in plan["adapters"]}["c"] == 50
    b = await eventually_(lambda: _pinned_is(api, "b", False))
    c = await eventually_(lambda: _pinned_is(api, "c", True))
    assert b["phase"] == c["phase"] == "Accepted"
    base = await eventually_(lambda: _base_pinned(api, ["a", "c"]))
    assert base["pinnedCount"] == 2
    # One new plan version; the Deployment, the Service and adapters whose standing did not
    # change were not written at all.
    assert history(emulator, CONFIG_MAPS, "llama-3-8b-plan") == cm_versions + 1
    assert {"deployment": history(emulator, DEPLOYMENTS, "llama-3-8b"),
            "service": history(emulator, SERVICES, "llama-3-8b"),
            "a": history(emulator, ADAPTERS, "a"), "too-big": history(emulator, ADAPTERS, "too-big")} == untouched, \
        _last_change(emulator, "a")


def _last_change(emulator, name: str) -> str:
    """The diff of an object's last write, for a failure message."""
    import difflib
    import json

    import yaml

    versions = [v for v in emulator.objects[_key(ADAPTERS, name)].history if v is not None]
    before, after = (yaml.safe_dump(json.loads(json.dumps(v.raw))).splitlines() for v in versions[-2:])
    return "\n".join(difflib.unified_diff(before, after, lineterm=""))


async def _pinned_is(api: KubeClient, name: str, pinned: bool) -> dict[str, Any] | None:
    status = await _status_with(api, ADAPTERS, name, "pinned")
    return status if status and status["pinned"] is pinned else None


async def _base_pinned(api: KubeClient, pinned: list[str]) -> dict[str, Any] | None:
    status = await _status_with(api, BASE_MODELS, "llama-3-8b", "pinned")
    return status if status and status["pinned"] == pinned else None


async def test_deleted_adapter_leaves_the_plan_before_it_goes(api, emulator, operator, eventually_):
    await setup_pool(api, eventually_)
    await api._request("DELETE", ADAPTERS.path(NS, "a"))

    async def gone():
        plan = await plan_of(api)
        obj = await api.get(ADAPTERS.path(NS, "a"))
        return plan if obj is None and "a" not in [x["name"] for x in plan["adapters"]] else None
    plan = await eventually_(gone, what="a out of the plan and deleted")
    assert plan["pinned"] == ["b", "c"]  # the next in line is pinned now
    base = await eventually_(lambda: _base_pinned(api, ["b", "c"]))
    assert base["adapterCount"] == 2
    # The finalizer held the object until the plan without it was written.
    versions = [v for v in emulator.objects[_key(ADAPTERS, "a")].history if v is not None]
    deleting = [v for v in versions if v["metadata"].get("deletionTimestamp")]
    assert deleting and "loraplex.io/operator" in deleting[0]["metadata"]["finalizers"]


def _key(resource, name: str, namespace: str | None = NS):
    import kmock

    return (kmock.resource(resource.group, resource.version, resource.plural), namespace, name)


async def test_restart_recomputes_the_same_plan_and_writes_nothing(api, emulator, kubeconfig, crds,
                                                                   operator_runner, eventually_):
    async with operator_runner():
        await setup_pool(api, eventually_)
        await eventually_(lambda: _base_pinned(api, ["a", "b"]))
        await eventually_(lambda: _pinned_is(api, "c", False))
    before = {name: (await api.get(ADAPTERS.path(NS, name)))["status"] for name in ("a", "b", "c", "too-big")}
    base_before = (await api.get(BASE_MODELS.path(NS, "llama-3-8b")))["status"]
    owned = {(r.plural, n): history(emulator, r, n) for r, n in (
        (CONFIG_MAPS, "llama-3-8b-plan"), (DEPLOYMENTS, "llama-3-8b"), (SERVICES, "llama-3-8b"))}
    requests_before = len(list(emulator._requests))

    async with operator_runner():
        async def resumed():  # the resume handlers have run: the plan ConfigMap was read again
            return [r for r in list(emulator._requests)[requests_before:]
                    if r.url.path.endswith("/configmaps/llama-3-8b-plan")]
        await eventually_(resumed, what="the restarted operator to check the plan")
    after = {name: (await api.get(ADAPTERS.path(NS, name)))["status"] for name in ("a", "b", "c", "too-big")}
    assert after == before
    assert (await api.get(BASE_MODELS.path(NS, "llama-3-8b")))["status"] == base_before
    assert {(r.plural, n): history(emulator, r, n) for r, n in (
        (CONFIG_MAPS, "llama-3-8b-plan"), (DEPLOYMENTS, "llama-3-8b"), (SERVICES, "llama-3-8b"))} == owned


async def test_a_deployment_the_api_server_canonicalised_is_not_patched_again(api, emulator, kubeconfig, crds,
                                                                              operator_runner, eventually_):
    """The API server keeps resource quantities in canonical form (`nvidia.com/gpu: 1` as "1",
    `cpu: 0.5` as "500m"; the emulator keeps bodies as sent, so the test writes that form):
    the operator must take it for what it asked, not patch it again at every resync or restart."""
    resources = {"limits": {"nvidia.com/gpu": 1, "cpu": 0.5}, "requests": {"memory": "1024Mi", "cpu": "0.25"}}
    path = DEPLOYMENTS.path(NS, "llama-3-8b")
    async with operator_runner():
        await api.create(BASE_MODELS.path(NS), base_body(serving={"replicas": 1, "image": "loraplex/server:test",
                                                                  "resources": resources}))
        dep = await eventually_(lambda: api.get(path), what="the Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    container["resources"] = {"limits": {"nvidia.com/gpu": "1", "cpu": "500m"},
                              "requests": {"memory": "1Gi", "cpu": "250m"}}
    await api.merge_patch(path, {"spec": {"template": {"spec": {"containers": [container]}}}})
    requests_before = len(list(emulator._requests))

    async with operator_runner():
        async def resumed():  # the resume handler has compared the Deployment with its spec
            return [r for r in list(emulator._requests)[requests_before:] if r.url.path == path]
        await eventually_(resumed, what="the restarted operator to read the Deployment")
    patches = [r for r in list(emulator._requests)[requests_before:] if r.url.path == path and r.method == "PATCH"]
    assert patches == []
    live = (await api.get(path))["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert live["limits"] == {"nvidia.com/gpu": "1", "cpu": "500m"}


async def test_node_agents_staging_and_server_readiness_make_adapters_ready(api, operator, eventually_):
    await setup_pool(api, eventually_)
    await eventually_(lambda: _status_with(api, ADAPTERS, "a", "phase"))
    # Two node agents, each merge-patching only its own node's entry.
    await api.patch_status(ADAPTERS, NS, "a", {"nodes": {"node-1": {"phase": "Staging", "bytes": 0}}})
    await api.patch_status(ADAPTERS, NS, "a", {"nodes": {"node-2": {"phase": "Staged", "message": "",
                                                                    "bytes": 41943040}}})
    await api.patch_status(ADAPTERS, NS, "a", {"nodes": {"node-1": {"phase": "Staged", "bytes": 41943040}}})

    async def staged():
        status = await _status_with(api, ADAPTERS, "a", "phase")
        message = conditions({"status": status})["Staged"]["message"]
        return status if status["phase"] == "Staged" and message == "staged on 2/2 nodes" else None
    status = await eventually_(staged, what="a Staged on both nodes")
    assert set(status["nodes"]) == {"node-1", "node-2"} and status["sizeBytes"] == 41943040

    # The servers come up (an emulator runs no pods: the test plays the Deployment controller).
    await api.patch_status(DEPLOYMENTS, NS, "llama-3-8b", {"readyReplicas": 1, "replicas": 1})

    async def ready():
        status = await _status_with(api, ADAPTERS, "a", "phase")
        return status if status["phase"] == "Ready" else None
    status = await eventually_(ready, what="a Ready")
    assert conditions({"status": status})["Ready"]["status"] == "True"
    base = await eventually_(lambda: _status_with(api, BASE_MODELS, "llama-3-8b", "readyReplicas"))
    base = await eventually_(lambda: _base_ready(api))
    assert conditions({"status": base})["Ready"]["reason"] == "ReplicasReady"
    b = await api.get(ADAPTERS.path(NS, "b"))
    assert b["status"]["phase"] == "Accepted"  # ready servers, but b is not staged anywhere


async def _base_ready(api: KubeClient) -> dict[str, Any] | None:
    status = await _status_with(api, BASE_MODELS, "llama-3-8b", "readyReplicas")
    return status if status["readyReplicas"] == 1 and status["phase"] == "Ready" else None


async def test_warmup_window_enters_and_leaves_prefetch_in_time(api, operator, eventually_):
    import datetime

    await api.create(BASE_MODELS.path(NS), base_body(warmupLeadSeconds=1))
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    start, end = now + datetime.timedelta(seconds=3), now + datetime.timedelta(seconds=5)
    fmt = "%Y-%m-%dT%H:%M:%SZ"
    await api.create(ADAPTERS.path(NS), adapter_body("campaign", 1, warmup={"start": start.strftime(fmt),
                                                                              "end": end.strftime(fmt)}))
    first = await eventually_(lambda: plan_of(api), what="a plan")
    assert first["prefetch"] == [] and [a["name"] for a in first["adapters"]] == ["campaign"]

    async def listed():
        plan = await plan_of(api)
        return plan["prefetch"] or None
    entries = await eventually_(listed, timeout=6, what="campaign in prefetch")
    assert entries == [{"name": "campaign", "start": start.strftime(fmt), "end": end.strftime(fmt)}]
    assert datetime.datetime.now(datetime.timezone.utc) >= start - datetime.timedelta(seconds=1.5)

    async def dropped():
        plan = await plan_of(api)
        return plan if plan["prefetch"] == [] else None
    await eventually_(dropped, timeout=8, what="campaign out of prefetch after its end")
    assert datetime.datetime.now(datetime.timezone.utc) >= end - datetime.timedelta(seconds=1)


async def test_deleting_the_base_collects_its_workloads_and_parks_adapters(api, emulator, operator, eventually_):
    await setup_pool(api, eventually_)
    await eventually_(lambda: api.get(SERVICES.path(NS, "llama-3-8b")), what="the Service")
    await api._request("DELETE", BASE_MODELS.path(NS, "llama-3-8b"))

    async def parked():
        status = await _status_with(api, ADAPTERS, "a", "phase")
        return status if status["phase"] == "Pending" else None
    status = await eventually_(parked, what="a Pending")
    assert conditions({"status": status})["Accepted"]["reason"] == "BaseModelNotFound"
    assert status["pinned"] is False
    # Owner references: the emulator's garbage collector removed the owned objects.
    for resource, name in ((CONFIG_MAPS, "llama-3-8b-plan"), (DEPLOYMENTS, "llama-3-8b"), (SERVICES, "llama-3-8b")):
        assert await api.get(resource.path(NS, name)) is None


async def test_invalid_spec_is_rejected_with_a_reason(api, operator, eventually_):
    """The API server's schema would refuse this; the operator still never plans it."""
    await api.create(BASE_MODELS.path(NS), base_body())
    await api.create(ADAPTERS.path(NS), adapter_body("odd", 1, pinPolicy="Sometimes"))
    status = await eventually_(lambda: _status_with(api, ADAPTERS, "odd", "phase"))
    assert status["phase"] == "Rejected"
    assert conditions({"status": status})["Accepted"]["reason"] == "InvalidSpec"
    plan = await eventually_(lambda: plan_of(api))
    assert plan["adapters"] == []


async def test_the_bases_rejected_count_follows_adapters_of_an_invalid_spec(api, operator, eventually_):
    """rejectedCount counts every adapter naming the base that is Rejected: one whose spec is
    invalid too (the schema cannot refuse them all), until it is deleted."""
    await api.create(BASE_MODELS.path(NS), base_body())
    await api.create(ADAPTERS.path(NS), adapter_body("a", 1))
    await api.create(ADAPTERS.path(NS), adapter_body("odd", 1, warmup={"start": "2026-05-02T08:00:00Z",
                                                                      "end": "2026-05-01T08:00:00Z"}))

    async def counted(rejected):
        status = await _status_with(api, BASE_MODELS, "llama-3-8b", "rejectedCount")
        return status if (status["adapterCount"], status["rejectedCount"]) == (1, rejected) else None
    await eventually_(lambda: counted(1), what="odd counted as rejected")
    await api._request("DELETE", ADAPTERS.path(NS, "odd"))
    await eventually_(lambda: counted(0), what="odd no longer counted once deleted")

async def test_an_adapter_whose_spec_turns_invalid_leaves_the_plan(api, operator, eventually_):
    """A warm-up that ends before it starts passes the CRD schema; the operator rejects it.
    A planned (pinned) adapter edited that way must leave the plan then, not at a resync."""
    await setup_pool(api, eventually_)
    await eventually_(lambda: _pinned_is(api, "a", True))
    await api.merge_patch(ADAPTERS.path(NS, "a"), {"spec": {"warmup": {
        "start": "2026-05-02T08:00:00Z", "end": "2026-05-01T08:00:00Z"}}})

    async def rejected():
        status = await _status_with(api, ADAPTERS, "a", "phase")
        return status if status["phase"] == "Rejected" else None
    status = await eventually_(rejected, what="a Rejected")
    assert conditions({"status": status})["Accepted"]["reason"] == "InvalidSpec"

    async def left():
        plan = await plan_of(api)
        return plan if "a" not in [x["name"] for x in plan["adapters"]] else None
    plan = await eventually_(left, timeout=5, what="a out of the plan")
    assert plan["pinned"] == ["b", "c"]
    status = await eventually_(lambda: _pinned_is(api, "a", False), timeout=5)
    assert status["phase"] == "Rejected"


async def test_serving_fields_removed_from_the_base_leave_the_deployment(api, operator, eventually_):
    """A node selector, tolerations or resources dropped from spec.serving must go from the
    Deployment too, not stay there because a merge patch that omits a key keeps it."""
    serving = {"replicas": 1, "image": "loraplex/server:test", "nodeSelector": {"gpu": "h100"},
               "tolerations": [{"key": "gpu", "operator": "Exists"}],
               "resources": {"limits": {"nvidia.com/gpu": 1}}}
    await api.create(BASE_MODELS.path(NS), base_body(serving=serving))

    async def pod_spec(check):
        dep = await api.get(DEPLOYMENTS.path(NS, "llama-3-8b"))
        pod = dep["spec"]["template"]["spec"]
        return pod if check(pod) else None
    await eventually_(lambda: pod_spec(lambda pod: pod.get("nodeSelector") == {"gpu": "h100"}))
    await api.merge_patch(BASE_MODELS.path(NS, "llama-3-8b"), {"spec": {"serving": {"nodeSelector": None}}})
    await eventually_(lambda: pod_spec(lambda pod: not pod.get("nodeSelector")), timeout=5, what="no nodeSelector")
    await api.merge_patch(BASE_MODELS.path(NS, "llama-3-8b"), {"spec": {"serving": {"resources": None}}})
    await eventually_(lambda: pod_spec(lambda pod: not pod["containers"][0].get("resources")), timeout=5,
                      what="no resources")
    pod = await pod_spec(lambda pod: True)
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    await api.merge_patch(BASE_MODELS.path(NS, "llama-3-8b"), {"spec": {"serving": {
        "tolerations": None, "image": "loraplex/server:test2"}}})
    pod = await eventually_(lambda: pod_spec(lambda pod: pod["containers"][0]["image"] == "loraplex/server:test2"),
                            timeout=5, what="the new image")
    assert not pod.get("tolerations")
