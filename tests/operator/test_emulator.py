"""The emulator's own contract: each gap it closes in kmock 0.8, checked over HTTP."""

from __future__ import annotations

import json

import aiohttp
import pytest

CMS = "/api/v1/namespaces/ns/configmaps"
LORAS = "/apis/loraplex.io/v1alpha1/namespaces/ns/loraadapters"
MERGE = {"Content-Type": "application/merge-patch+json"}
JSON_PATCH = {"Content-Type": "application/json-patch+json"}


@pytest.fixture()
async def http(emulator):
    async with aiohttp.ClientSession(emulator.base_url) as session:
        yield session


async def call(http, method: str, path: str, body=None, headers=None) -> tuple[int, dict]:
    async with http.request(method, path, json=body, headers=headers) as response:
        return response.status, await response.json(content_type=None)


async def test_create_sets_metadata_and_answers_201(http):
    status, obj = await call(http, "POST", CMS, {"metadata": {"name": "a"}, "data": {"k": "v"}})
    assert status == 201
    meta = obj["metadata"]
    assert meta["uid"] and meta["resourceVersion"] and meta["generation"] == 1 and meta["creationTimestamp"]
    assert (obj["apiVersion"], obj["kind"], meta["namespace"]) == ("v1", "ConfigMap", "ns")
    assert (await call(http, "POST", CMS, {"metadata": {"name": "a"}}))[0] == 409


async def test_json_patch_test_failure_is_422_and_versions_move(http):
    _, obj = await call(http, "POST", CMS, {"metadata": {"name": "a"}, "data": {"k": "v"}})
    stale = [{"op": "test", "path": "/metadata/resourceVersion", "value": "0"},
             {"op": "add", "path": "/metadata/finalizers", "value": ["x"]}]
    assert (await call(http, "PATCH", f"{CMS}/a", stale, JSON_PATCH))[0] == 422
    fresh = [{**stale[0], "value": obj["metadata"]["resourceVersion"]}, stale[1]]
    status, patched = await call(http, "PATCH", f"{CMS}/a", fresh, JSON_PATCH)
    assert status == 200 and patched["metadata"]["finalizers"] == ["x"]
    assert int(patched["metadata"]["resourceVersion"]) > int(obj["metadata"]["resourceVersion"])
    # A no-op patch writes nothing.
    _, same = await call(http, "PATCH", f"{CMS}/a", {"data": {"k": "v"}}, MERGE)
    assert same["metadata"]["resourceVersion"] == patched["metadata"]["resourceVersion"]


async def test_namespaces_lists_and_put(http):
    assert (await call(http, "POST", "/api/v1/namespaces", {"metadata": {"name": "ml"}}))[0] == 201
    status, listing = await call(http, "GET", "/api/v1/namespaces")
    assert status == 200 and listing["kind"] == "NamespaceList" and [n["metadata"]["name"] for n in listing["items"]] == ["ml"]
    assert listing["metadata"]["resourceVersion"] != "..."
    _, ns = await call(http, "GET", "/api/v1/namespaces/ml")
    assert (await call(http, "PUT", "/api/v1/namespaces/ml", {**ns, "metadata": {**ns["metadata"], "labels": {"a": "b"}}}))[0] == 200
    assert (await call(http, "PUT", "/api/v1/namespaces/ml", ns))[0] == 409  # stale resourceVersion


async def test_crds_are_served_and_status_is_a_subresource(http, crds):
    status, obj = await call(http, "POST", LORAS, {"metadata": {"name": "a"}, "spec": {"priority": 1},
                                                   "status": {"phase": "Ready"}})
    assert status == 201 and "status" not in obj  # status is ignored on create
    _, obj = await call(http, "PATCH", f"{LORAS}/a/status", {"spec": {"priority": 9}, "status": {"phase": "X"}}, MERGE)
    assert obj["spec"]["priority"] == 1 and obj["status"]["phase"] == "X" and obj["metadata"]["generation"] == 1
    _, obj = await call(http, "PATCH", f"{LORAS}/a", {"spec": {"priority": 2}, "status": {"phase": "Y"}}, MERGE)
    assert obj["spec"]["priority"] == 2 and obj["status"]["phase"] == "X" and obj["metadata"]["generation"] == 2
    _, obj = await call(http, "PATCH", f"{LORAS}/a", {"metadata": {"labels": {"t": "1"}}}, MERGE)
    assert obj["metadata"]["generation"] == 2  # metadata changes do not bump it


async def test_watch_replays_from_a_version_and_ends_on_timeout(http):
    _, first = await call(http, "POST", CMS, {"metadata": {"name": "a", "labels": {"app": "x"}}})
    await call(http, "POST", CMS, {"metadata": {"name": "b"}})
    await call(http, "PATCH", f"{CMS}/a", {"data": {"k": "v"}}, MERGE)
    params = {"watch": "true", "resourceVersion": first["metadata"]["resourceVersion"], "timeoutSeconds": "1",
              "labelSelector": "app=x"}
    async with http.get(CMS, params=params) as response:
        events = [json.loads(line) for line in (await response.read()).splitlines() if line.strip()]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("MODIFIED", "a")]


async def test_a_list_by_label_selector_has_the_namespaces_matching_objects_alone(http):
    """What the node agent's plan discovery and the operator's mirror sweep ask: a list of one
    namespace's ConfigMaps by a label with a prefixed key, then a delete by name."""
    mirror = {"loraplex.io/plan-mirror": "true"}
    for path, name, labels in ((CMS, "ml.a-plan", mirror), (CMS, "ml.b-plan", mirror), (CMS, "plain", {}),
                               (CMS, "other-value", {"loraplex.io/plan-mirror": "false"}),
                               ("/api/v1/namespaces/elsewhere/configmaps", "ml.c-plan", mirror)):
        assert (await call(http, "POST", path, {"metadata": {"name": name, "labels": labels}}))[0] == 201
    status, body = await call(http, "GET", f"{CMS}?labelSelector=loraplex.io%2Fplan-mirror%3Dtrue")
    assert status == 200 and body["kind"] == "ConfigMapList"
    assert [o["metadata"]["name"] for o in body["items"]] == ["ml.a-plan", "ml.b-plan"]
    assert (await call(http, "DELETE", f"{CMS}/ml.a-plan"))[0] == 200
    _, body = await call(http, "GET", f"{CMS}?labelSelector=loraplex.io/plan-mirror=true")
    assert [o["metadata"]["name"] for o in body["items"]] == ["ml.b-plan"]
    _, body = await call(http, "GET", "/api/v1/configmaps?labelSelector=loraplex.io/plan-mirror=true")
    assert sorted(o["metadata"]["name"] for o in body["items"]) == ["ml.b-plan", "ml.c-plan"]


async def test_owned_objects_are_collected(http):
    _, owner = await call(http, "POST", CMS, {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    await call(http, "POST", CMS, {"metadata": {"name": "child", "ownerReferences": [ref]}})
    await call(http, "DELETE", f"{CMS}/owner")
    assert (await call(http, "GET", f"{CMS}/child"))[0] == 404
