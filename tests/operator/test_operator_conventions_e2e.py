"""The operator end to end, as a user of a Kubernetes operator expects it to behave: events,
conditions, deletion, ownership. kopf in-process against the emulated API (emulator.py)."""

from __future__ import annotations

from typing import Any

from loraplex.operator.kube import ADAPTERS, BASE_MODELS, CONFIG_MAPS, DEPLOYMENTS, SERVICES, Resource

from .test_operator_e2e import NS, adapter_body, base_body, plan_of

EVENTS = Resource("", "v1", "events")


async def _events_of(api: Any, name: str) -> list[dict[str, Any]]:
    listing = await api.get(EVENTS.path(NS))
    return [e for e in listing["items"] if e["involvedObject"]["name"] == name]


async def test_a_failing_handler_leaves_a_warning_event_on_its_object(api, operator, eventually_):
    """`kubectl describe loraadapter odd` shows why it was refused, not only its status."""
    await api.create(BASE_MODELS.path(NS), base_body())
    await api.create(ADAPTERS.path(NS), adapter_body("odd", 1, pinPolicy="Sometimes"))
    await api.create(ADAPTERS.path(NS), adapter_body("fine", 1))

    async def warned():
        return [e for e in await _events_of(api, "odd") if e["type"] in ("Warning", "Error")]
    (event, *_) = await eventually_(warned, what="a Warning event on odd")
    assert "pinPolicy 'Sometimes'" in event["message"]
    assert event["involvedObject"]["kind"] == "LoRAAdapter"
    await eventually_(lambda: plan_of(api), what="a plan")
    assert await _events_of(api, "fine") == []  # a success is not worth an event


async def _serving(api: Any) -> Any:
    dep = await api.get(DEPLOYMENTS.path(NS, "llama-3-8b"))
    svc = await api.get(SERVICES.path(NS, "llama-3-8b"))
    return (dep, svc) if dep and svc else None


async def test_a_deployment_deleted_by_hand_comes_back(api, operator, eventually_):
    """The operator owns the serving Deployment: deleting it (a `kubectl delete deploy` by
    mistake) must not leave the base without servers until its spec next changes."""
    await api.create(BASE_MODELS.path(NS), base_body())
    dep, _ = await eventually_(lambda: _serving(api), what="the serving workloads")
    await api._request("DELETE", DEPLOYMENTS.path(NS, "llama-3-8b"))

    async def recreated():
        again = await api.get(DEPLOYMENTS.path(NS, "llama-3-8b"))
        return again if again and again["metadata"]["uid"] != dep["metadata"]["uid"] else None
    again = await eventually_(recreated, timeout=5, what="the Deployment recreated")
    assert again["spec"]["template"]["spec"]["containers"][0]["image"] == "loraplex/server:test"
    assert again["metadata"]["ownerReferences"] == dep["metadata"]["ownerReferences"]


async def test_a_service_deleted_by_hand_comes_back_at_the_resync(api, emulator, kubeconfig, crds, operator_runner,
                                                                  eventually_, monkeypatch):
    from loraplex.operator import handlers

    monkeypatch.setattr(handlers, "RESYNC_SECONDS", 1.0)
    async with operator_runner():
        await api.create(BASE_MODELS.path(NS), base_body())
        _, svc = await eventually_(lambda: _serving(api), what="the serving workloads")
        await api._request("DELETE", SERVICES.path(NS, "llama-3-8b"))

        async def recreated():
            again = await api.get(SERVICES.path(NS, "llama-3-8b"))
            return again if again and again["metadata"]["uid"] != svc["metadata"]["uid"] else None
        await eventually_(recreated, timeout=5, what="the Service recreated")


async def test_other_owners_references_survive_the_resync_and_the_operators_writes(
        api, emulator, kubeconfig, crds, operator_runner, eventually_, settled, monkeypatch):
    """Kubernetes lets an object have several owners, at most one of them its controller: a
    reference that another controller (a GitOps tool's Application, say) adds to the serving
    objects must stay, neither stripped at every resync (the two fighting over the list) nor
    dropped when the operator next writes the object for a change of its own."""
    from loraplex.operator import handlers
    from loraplex.operator.kube import AUTOSCALERS

    monkeypatch.setattr(handlers, "RESYNC_SECONDS", 1.0)
    theirs = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Application", "name": "serving", "uid": "u-app"}
    queue = {"type": "Pods", "pods": {"metric": {"name": "loraplex_requests_waiting"},
                                      "target": {"type": "AverageValue", "averageValue": "4"}}}
    paths = [CONFIG_MAPS.path(NS, "llama-3-8b-plan"), DEPLOYMENTS.path(NS, "llama-3-8b"),
             SERVICES.path(NS, "llama-3-8b"), AUTOSCALERS.path(NS, "llama-3-8b")]

    def serving(**autoscaling: Any) -> dict[str, Any]:
        return {"image": "loraplex/server:test", "autoscaling": {"maxReplicas": 3, "metrics": [queue], **autoscaling}}

    async def refs(path: str) -> list[dict[str, Any]]:
        return (await api.get(path))["metadata"]["ownerReferences"]

    def requests_since(mark: int, path: str, *methods: str) -> list[Any]:
        return [r for r in list(emulator._requests)[mark:] if r.url.path == path and r.method in methods]

    async with operator_runner():
        await api.create(BASE_MODELS.path(NS), base_body(serving=serving()))

        async def written():
            return all([await api.get(path) for path in paths])
        await eventually_(written, what="the plan, Deployment, Service and HPA")
        await settled()
        ours = {path: await refs(path) for path in paths}
        assert all(len(r) == 1 and r[0]["controller"] for r in ours.values()), ours
        for path in paths:
            await api.merge_patch(path, {"metadata": {"ownerReferences": [*ours[path], theirs]}})
        mark = len(list(emulator._requests))

        async def resynced():  # each object read twice since: a whole resync compared it with theirs
            return all(len(requests_since(mark, path, "GET")) >= 2 for path in paths)
        await eventually_(resynced, timeout=6, what="a resync after their owner reference was added")
        for path in paths:
            assert requests_since(mark, path, "PATCH", "PUT") == [], path
            assert await refs(path) == [*ours[path], theirs], path

        # Writes of the operator's own: a new image (Deployment patched), a new maximum (HPA
        # replaced), an adapter (plan patched), and the Service's own reference lost (put back).
        await api.merge_patch(BASE_MODELS.path(NS, "llama-3-8b"), {"spec": {"serving": serving(maxReplicas=4)
                                                                            | {"image": "loraplex/server:v2"}}})
        await api.create(ADAPTERS.path(NS), adapter_body("a", 1))
        await api.merge_patch(paths[2], {"metadata": {"ownerReferences": [theirs]}})

        async def rewritten():
            dep, hpa = await api.get(paths[1]), await api.get(paths[3])
            return (dep["spec"]["template"]["spec"]["containers"][0]["image"] == "loraplex/server:v2"
                    and hpa["spec"]["maxReplicas"] == 4 and [a["name"] for a in (await plan_of(api))["adapters"]] == ["a"]
                    and len(await refs(paths[2])) == 2)
        await eventually_(rewritten, timeout=6, what="the operator's writes")
        await settled()
        for path in paths:
            assert sorted(await refs(path), key=lambda r: r["uid"]) == \
                sorted([*ours[path], theirs], key=lambda r: r["uid"]), path


async def test_the_resync_runs_while_a_warmup_window_is_far_off(api, emulator, kubeconfig, crds, operator_runner,
                                                                eventually_, monkeypatch):
    """A warm-up window that opens after the next resync (a campaign next month, as in
    examples/) held the resync off until it opened: the daemon took the end of a resync's
    sleep for an early wake-up, and repaired nothing."""
    import datetime

    from loraplex.operator import handlers

    monkeypatch.setattr(handlers, "RESYNC_SECONDS", 1.0)
    start = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=30)
    window = {"start": start.strftime("%Y-%m-%dT%H:%M:%SZ"),
              "end": (start + datetime.timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")}
    async with operator_runner():
        await api.create(BASE_MODELS.path(NS), base_body())
        await api.create(ADAPTERS.path(NS), adapter_body("campaign", 1, warmup=window))
        _, svc = await eventually_(lambda: _serving(api), what="the serving workloads")
        await eventually_(lambda: _status_of(api, "campaign"), what="the campaign adapter planned")
        await api._request("DELETE", SERVICES.path(NS, "llama-3-8b"))

        async def recreated():
            again = await api.get(SERVICES.path(NS, "llama-3-8b"))
            return again if again and again["metadata"]["uid"] != svc["metadata"]["uid"] else None
        await eventually_(recreated, timeout=5, what="the Service recreated")


async def _status_of(api: Any, name: str) -> Any:
    return ((await api.get(ADAPTERS.path(NS, name))) or {}).get("status", {}).get("phase")

async def test_the_workloads_of_a_base_being_deleted_are_left_to_the_collector(api, operator, eventually_, settled):
    """Foreground deletion (or any finalizer) keeps a deleting BaseModel around while its
    dependents go: recreating them would hold its deletion up for ever."""
    body = base_body()
    body["metadata"]["finalizers"] = ["example.com/hold"]
    await api.create(BASE_MODELS.path(NS), body)
    await eventually_(lambda: _serving(api), what="the serving workloads")
    await api._request("DELETE", BASE_MODELS.path(NS, "llama-3-8b"))

    async def released():  # the operator has seen the deletion: it stopped the daemon, let go
        base = await api.get(BASE_MODELS.path(NS, "llama-3-8b"))
        return base["metadata"]["finalizers"] == ["example.com/hold"]
    await eventually_(released, what="the operator's finalizer off the base")
    await api._request("DELETE", DEPLOYMENTS.path(NS, "llama-3-8b"))  # as the collector would
    await settled()
    assert await api.get(DEPLOYMENTS.path(NS, "llama-3-8b")) is None


async def test_a_failed_write_after_the_base_is_deleted_is_retried(api, emulator, kubeconfig, crds, operator_runner,
                                                                   eventually_, settled, monkeypatch):
    """Event handlers (a BaseModel gone, a node agent's report, a Deployment's readiness) are
    not retried by kopf: a transient API error there must not leave every adapter of a deleted
    base Accepted and pinned for good."""
    import re

    from loraplex.operator import reconciler

    from .test_operator_e2e import setup_pool

    monkeypatch.setattr(reconciler, "RETRY_SECONDS", 0.2)
    async with operator_runner():
        await setup_pool(api, eventually_)
        await eventually_(lambda: _pinned(api, "a", True), what="a pinned")
        await settled()
        path = re.compile(r".*/loraadapters/a/status")
        done = sum(1 for r in list(emulator._requests) if r.method == "PATCH" and path.fullmatch(r.url.path))
        emulator["patch", path][done:done + 1] << 500  # the next status write of a fails once
        await api._request("DELETE", BASE_MODELS.path(NS, "llama-3-8b"))

        async def parked():
            statuses = [(await api.get(ADAPTERS.path(NS, n)))["status"] for n in ("a", "b", "c")]
            return all(s["phase"] == "Pending" and s["pinned"] is False for s in statuses)
        await eventually_(parked, timeout=5, what="a, b and c Pending and unpinned")
        assert sum(1 for r in list(emulator._requests) if r.method == "PATCH" and path.fullmatch(r.url.path)) > done + 1


async def _pinned(api: Any, name: str, pinned: bool) -> bool:
    obj = await api.get(ADAPTERS.path(NS, name))
    return bool(obj and (obj.get("status") or {}).get("pinned") is pinned)


async def test_objects_of_the_same_name_that_are_not_its_own_are_left_alone(api, emulator, kubeconfig, crds,
                                                                          operator_runner, eventually_, monkeypatch):
    """A Service and a ConfigMap that another app already has under the names a new BaseModel
    would use: the operator must not rewrite them and make them its own (deleting the
    BaseModel would then garbage-collect them); it says why in the base's status, and takes
    the names once they are free."""
    from loraplex.operator import handlers

    from .test_operator_e2e import conditions

    monkeypatch.setattr(handlers, "RESYNC_SECONDS", 1.0)
    theirs = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "llama-3-8b", "namespace": NS},
              "spec": {"selector": {"app": "someone-else"}, "ports": [{"port": 80}]}}
    their_cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "llama-3-8b-plan", "namespace": NS},
                "data": {"plan.json": "theirs"}}
    await api.create(SERVICES.path(NS), theirs)
    await api.create(CONFIG_MAPS.path(NS), their_cm)
    async with operator_runner():
        await api.create(BASE_MODELS.path(NS), base_body())

        async def reported():
            base = await api.get(BASE_MODELS.path(NS, "llama-3-8b"))
            conds = conditions(base)
            return conds if conds["Ready"]["reason"] == "NameConflict" and \
                conds["Staged"]["reason"] == "NameConflict" else None
        conds = await eventually_(reported, what="the conflicts in the base's status")
        assert "Service ml/llama-3-8b" in conds["Ready"]["message"]
        assert "ConfigMap ml/llama-3-8b-plan" in conds["Staged"]["message"]
        svc = await api.get(SERVICES.path(NS, "llama-3-8b"))
        assert svc["spec"]["selector"] == {"app": "someone-else"} and not svc["metadata"].get("ownerReferences")
        cm = await api.get(CONFIG_MAPS.path(NS, "llama-3-8b-plan"))
        assert cm["data"] == {"plan.json": "theirs"} and not cm["metadata"].get("ownerReferences")
        assert await api.get(DEPLOYMENTS.path(NS, "llama-3-8b"))  # its own name was free

        await api._request("DELETE", SERVICES.path(NS, "llama-3-8b"))
        await api._request("DELETE", CONFIG_MAPS.path(NS, "llama-3-8b-plan"))

        async def taken():
            svc = await api.get(SERVICES.path(NS, "llama-3-8b"))
            plan = await plan_of(api)
            base = await api.get(BASE_MODELS.path(NS, "llama-3-8b"))
            return svc and svc["metadata"].get("ownerReferences") and plan and \
                conditions(base)["Staged"]["reason"] == "PlanWritten" and \
                conditions(base)["Ready"]["reason"] != "NameConflict"
        await eventually_(taken, timeout=6, what="the Service and the plan written once the names are free")


async def test_one_adapter_whose_status_cannot_be_written_holds_up_no_other(api, emulator, operator, eventually_,
                                                                            settled):
    """Status writes of one adapter refused for good (422: an admission policy, or a schema
    tightened under an object stored before): the plan, the other adapters' statuses and the
    deletion of another adapter (its finalizer) must still go through."""
    import re

    from .test_operator_e2e import setup_pool

    await setup_pool(api, eventually_)
    await eventually_(lambda: _pinned(api, "c", False), what="c planned, not pinned")
    await settled()
    emulator["patch", re.compile(r".*/loraadapters/c/status")] << 422
    await api._request("DELETE", ADAPTERS.path(NS, "a"))  # c moves up to pinned: its status write fails

    async def gone():
        return await api.get(ADAPTERS.path(NS, "a")) is None
    await eventually_(gone, timeout=5, what="a deleted: its finalizer released")
    plan = await plan_of(api)
    assert [x["name"] for x in plan["adapters"]] == ["b", "c"] and plan["pinned"] == ["b", "c"]

    async def base_written():
        base = await api.get(BASE_MODELS.path(NS, "llama-3-8b"))
        return base["status"]["pinned"] == ["b", "c"]
    await eventually_(base_written, timeout=5, what="the base's status written")


async def test_a_deployment_the_api_server_refuses_is_reported_in_the_status(api, emulator, operator, eventually_):
    """spec.serving passes into the Deployment as given (volumes, resources, tolerations): one
    the API server refuses (a volume with two sources; one named like the operator's own is
    refused in the spec, test_serving_volumes.py) must show in the base's status with the
    server's message, not only as a handler retried in the log."""
    import re

    from .test_operator_e2e import conditions

    refusal = {"apiVersion": "v1", "kind": "Status", "status": "Failure", "reason": "Invalid", "code": 422,
               "message": 'Deployment.apps "llama-3-8b" is invalid: spec.template.spec.volumes[3].hostPath:'
                          ' Forbidden: may not specify more than 1 volume type'}
    emulator["post", re.compile(r".*/namespaces/ml/deployments")] << 422 << refusal
    volume = {"name": "scratch", "emptyDir": {}, "hostPath": {"path": "/scratch"}}
    await api.create(BASE_MODELS.path(NS), base_body(serving={"replicas": 1, "image": "loraplex/server:test",
                                                               "volumes": [volume]}))

    async def reported():
        base = await api.get(BASE_MODELS.path(NS, "llama-3-8b"))
        ready = conditions(base).get("Ready") or {}
        return base if ready.get("reason") == "WorkloadInvalid" else None
    base = await eventually_(reported, what="the refusal in the base's status")
    ready = conditions(base)["Ready"]
    assert ready["status"] == "False" and "may not specify more than 1 volume type" in ready["message"]
    assert "Deployment ml/llama-3-8b" in ready["message"] and "{" not in ready["message"]
    assert base["status"]["phase"] == "Failed"
    assert await api.get(SERVICES.path(NS, "llama-3-8b"))  # the Service was still written


async def test_a_refused_deployment_is_written_as_soon_as_the_spec_is_fixed(api, emulator, operator, eventually_):
    import re
    import time

    refusal = {"apiVersion": "v1", "kind": "Status", "code": 422, "message": "spec.template: Invalid value"}
    emulator["post", re.compile(r".*/namespaces/ml/deployments")][0:1] << 422 << refusal  # the first create only
    await api.create(BASE_MODELS.path(NS), base_body())

    async def refused():
        base = await api.get(BASE_MODELS.path(NS, "llama-3-8b"))
        return ((base.get("status") or {}).get("phase")) == "Failed"
    await eventually_(refused, what="the refusal reported")
    fixed = time.monotonic()
    await api.merge_patch(BASE_MODELS.path(NS, "llama-3-8b"), {"spec": {"serving": {"replicas": 2}}})
    await eventually_(lambda: api.get(DEPLOYMENTS.path(NS, "llama-3-8b")), timeout=10, what="the Deployment")
    assert time.monotonic() - fixed < 10


async def test_an_invalid_spec_keeps_a_ready_condition_that_says_so(api, operator, eventually_):
    """Edited into an invalid spec, a Ready adapter or base must say Ready False (with the
    reason), not lose its Ready condition: `kubectl wait --for=condition=Ready=false` and
    tools that read Ready see nothing otherwise. Its other conditions stay."""
    from .test_operator_e2e import conditions, setup_pool

    await setup_pool(api, eventually_)
    await eventually_(lambda: _pinned(api, "a", True), what="a planned")
    await api.merge_patch(ADAPTERS.path(NS, "a"), {"spec": {"warmup": {
        "start": "2026-05-02T08:00:00Z", "end": "2026-05-01T08:00:00Z"}}})
    await api.merge_patch(BASE_MODELS.path(NS, "llama-3-8b"), {"spec": {"dtype": "int8"}})

    async def invalid(resource, name):
        obj = await api.get(resource.path(NS, name))
        conds = conditions(obj)
        return conds if conds["Accepted"]["reason"] == "InvalidSpec" else None
    for resource, name in ((ADAPTERS, "a"), (BASE_MODELS, "llama-3-8b")):
        conds = await eventually_(lambda: invalid(resource, name), what=f"{name} invalid")
        assert set(conds) == {"Accepted", "Staged", "Ready"}, conds
        assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "InvalidSpec")


async def test_a_rejected_adapter_and_a_failed_base_leave_a_warning_event(api, operator, eventually_):
    """`kubectl describe` (and `kubectl get events`) is where a user looks first for why an
    object does nothing: an adapter rejected for its base (a valid spec, so no handler
    fails) and a base with no room for a single slot must say so there, not only in status."""
    await api.create(BASE_MODELS.path(NS), base_body())
    await api.create(ADAPTERS.path(NS), adapter_body("huge", 1, rank=128))
    await api.create(BASE_MODELS.path(NS), base_body("cramped", memory={"gpuMemory": "20G", "baseWeights": "16G",
                                                                        "overhead": "8G", "adapterBytes": "40M"}))

    async def warned(name):
        found = [e for e in await _events_of(api, name) if e["type"] == "Warning"]
        return found or None
    (event,) = await eventually_(lambda: warned("huge"), what="a Warning event on huge")
    assert event["reason"] == "RankTooLarge" and "rank 128 > maxLoraRank 64" in event["message"]
    assert event["involvedObject"]["kind"] == "LoRAAdapter"
    (event,) = await eventually_(lambda: warned("cramped"), what="a Warning event on cramped")
    assert event["reason"] == "NoRoom" and event["involvedObject"]["kind"] == "BaseModel"
