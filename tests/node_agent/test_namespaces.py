"""Namespaces in the node's cache: two Kubernetes namespaces' adapters of one name are two
adapters, each in its namespace's folder (`<cache>/.namespaces/<ns>/`), which the operator
mounts into that namespace's serving pods alone.

Before, the cache was keyed by name: two namespaces using one adapter name on a node
replaced each other's files (their loads failed on the version check, in turn), and every
serving pod could read every namespace's weights from the node's host path.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from loraplex.node_agent.adapter_files import WEIGHTS_FILE
from loraplex.node_agent.app import AGENT, AgentConfig
from loraplex.node_agent.store import AdapterRef, AdapterStore, StoreError

from .helpers import ConfigMapDir, make_adapter, plan_json


def _versions(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """Two versions of "support-bot" (two tenants' adapters): {namespace: (source, sha256)}."""
    out = {}
    for seed, ns in enumerate(("team-a", "team-b")):
        src = tmp_path / "src" / ns / "support-bot"
        out[ns] = (str(src), make_adapter(src, seed=seed))
    return out


def _self_contained(folder: Path) -> None:
    """Every adapter link in `folder` resolves inside it (a pod that mounts it alone reads it)."""
    for link in folder.iterdir():
        if link.is_symlink():
            target = (folder / os.readlink(link)).resolve()
            assert target.is_relative_to(folder.resolve()), (link, target)


async def test_one_name_in_two_namespaces_is_two_adapters(tmp_path, session):
    versions = _versions(tmp_path)
    root = tmp_path / "cache"
    store = AdapterStore(root, 10**9, session=session)
    for ns, (src, sha) in versions.items():
        staged = await store.stage(AdapterRef("support-bot", src, sha, namespace=ns))
        assert staged.path == str(root / ".namespaces" / ns / "support-bot") and staged.namespace == ns
    for ns, (_, sha) in versions.items():
        folder = root / ".namespaces" / ns
        assert store.get("support-bot", ns).sha256 == sha
        _self_contained(folder)
        assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == ["support-bot"]
    assert store.get("support-bot") is None  # and none at the top, for servers outside a namespace
    assert [a.namespace for a in store.list()] == ["team-a", "team-b"]

    # Staged again: no download, each its own version still.
    for ns, (src, sha) in versions.items():
        assert (await store.stage(AdapterRef("support-bot", src, sha, namespace=ns))).sha256 == sha

    # One leaves its namespace's plan: the other stays.
    assert await store.remove("support-bot", "team-a")
    assert store.get("support-bot", "team-a") is None and store.get("support-bot", "team-b") is not None
    assert not os.path.lexists(root / ".namespaces" / "team-a" / "support-bot")

    # A restart reads back what each namespace has.
    again = AdapterStore(root, 10**9, session=session)
    assert [(a.namespace, a.name, a.sha256) for a in again.list()] == [
        ("team-b", "support-bot", versions["team-b"][1])]


async def test_pins_and_the_budget_span_the_namespaces(tmp_path, session):
    """One budget for the node's disk; pins are per namespace (one plan pins its own)."""
    versions = _versions(tmp_path)
    now = [1000.0]
    size = sum(f.stat().st_size for f in Path(versions["team-a"][0]).iterdir())
    store = AdapterStore(tmp_path / "cache", 2 * size + size // 2, session=session, clock=lambda: now[0])
    store.set_pinned({"support-bot"}, "team-a")
    for ns, (src, sha) in versions.items():
        await store.stage(AdapterRef("support-bot", src, sha, namespace=ns))
        now[0] += 1
    assert store.get("support-bot", "team-a").pinned and not store.get("support-bot", "team-b").pinned
    third = tmp_path / "src" / "third"
    sha = make_adapter(third, seed=9)
    await store.stage(AdapterRef("other", str(third), sha))  # no room for three: the unpinned one goes
    assert store.get("support-bot", "team-b") is None and store.get("support-bot", "team-a") is not None
    store.set_pinned(set(), "team-b")  # another namespace's plan leaves team-a's pin alone
    assert store.get("support-bot", "team-a").pinned


async def test_a_namespace_that_is_not_a_kubernetes_name_is_refused(tmp_path, session):
    src, sha = _versions(tmp_path)["team-a"]
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    for bad in ("../x", "Team-A", "a/b", "", "-a", "a" * 64, ".namespaces"):
        with pytest.raises(StoreError) as e:
            await store.stage(AdapterRef("support-bot", src, sha, namespace=bad))
        assert e.value.reason == "InvalidRequest"
    assert store.list() == []
    assert not (tmp_path / "x").exists()


async def test_the_plan_guards_its_own_namespace_only(tmp_path, object_store, client_factory):
    """An agent following team-a's plan stages the plan's version alone for team-a's name, and
    another namespace's adapter of that name as that namespace's servers ask."""
    object_store.add("support-bot", tmp_path, seed=1)
    object_store.add("other-bot", tmp_path, seed=2)
    cm = ConfigMapDir(tmp_path / "plan")
    cm.write(plan_json(object_store, others=["support-bot"]))
    client = await client_factory(AgentConfig(tmp_path / "cache", 10**9, plan_file=cm.path, namespace="team-a",
                                              poll_seconds=30))
    warmer = client.server.app[AGENT].warmer
    for _ in range(200):
        if warmer.plan is not None:
            break
        await asyncio.sleep(0.02)
    other = {"name": "support-bot", "source": object_store.source("other-bot"),
             "sha256": object_store.adapters["other-bot"].sha256}
    r = await client.post("/v1/stage", json=other | {"namespace": "team-a"})
    assert r.status == 409 and (await r.json())["error"]["reason"] == "NotThePlansVersion"
    r = await client.post("/v1/stage", json=other | {"namespace": "team-b"})
    assert r.status == 200, await r.text()
    body = (await r.json())["adapter"]
    assert body["namespace"] == "team-b" and body["path"].endswith("/.namespaces/team-b/support-bot")
    weights = Path(body["path"]) / WEIGHTS_FILE
    assert weights.read_bytes() == object_store.adapters["other-bot"].files[WEIGHTS_FILE]
    r = await client.post("/v1/stage", json=other | {"namespace": "Team B"})
    assert r.status == 400 and (await r.json())["error"]["reason"] == "InvalidRequest"
    listed = (await (await client.get("/v1/adapters")).json())["adapters"]
    assert [(a["namespace"], a["name"]) for a in listed] == [("team-b", "support-bot")]


async def test_an_agent_follows_several_plans_each_in_its_namespace(tmp_path, object_store, client_factory, kube_api):
    """Two BaseModels in two namespaces, each with a pinned "support-bot" of its own: one agent
    following both plans stages each in its namespace's folder, reports each on its own
    LoRAAdapter, and a session start names the namespace where the name is ambiguous."""
    from loraplex.node_agent.app import AGENT, AgentConfig

    object_store.add("a-bot", tmp_path, seed=1)
    object_store.add("b-bot", tmp_path, seed=2)
    for ns, served in (("team-a", "a-bot"), ("team-b", "b-bot")):
        plan = plan_json(object_store, pinned=[served], base=f"{ns}-base")
        plan["adapters"][0]["name"], plan["pinned"] = "support-bot", ["support-bot"]
        kube_api.put_configmap(ns, f"{ns}-base-plan", {"plan.json": json.dumps(plan)})
    config = AgentConfig(tmp_path / "cache", 10**9, plan_configmaps=("team-a/team-a-base-plan", "team-b/team-b-base-plan"),
                         node_name="node-7", kube_api_url=kube_api.url, poll_seconds=0.05)
    client = await client_factory(config)
    agent = client.server.app[AGENT]
    store = agent.store
    def reported() -> dict:  # the last phase each adapter's status was patched to
        return {(ns, name): body["status"]["nodes"]["node-7"]["phase"] for ns, name, body, _ in kube_api.patches}

    want = {("team-a", "support-bot"): "Staged", ("team-b", "support-bot"): "Staged"}
    for _ in range(400):
        if all(store.get("support-bot", ns) for ns in ("team-a", "team-b")) and reported() == want:
            break
        await asyncio.sleep(0.02)
    for ns, served in (("team-a", "a-bot"), ("team-b", "b-bot")):
        assert store.get("support-bot", ns).sha256 == object_store.adapters[served].sha256
        assert store.get("support-bot", ns).pinned
    assert reported() == want
    assert {t for t in (await (await client.get("/healthz")).json())["tasks"]} >= {
        "plan-watch team-a/team-a-base-plan", "plan-watch team-b/team-b-base-plan"}

    r = await client.post("/v1/sessions", json={"model": "support-bot"})
    assert r.status == 400 and "namespace" in (await r.json())["error"]["message"]
    r = await client.post("/v1/sessions", json={"model": "support-bot", "namespace": "team-b"})
    assert r.status == 200, await r.text()
    assert (await r.json())["adapter"]["namespace"] == "team-b"
    r = await client.post("/v1/sessions", json={"model": "support-bot", "namespace": "team-c"})  # followed by none
    assert r.status == 404 and (await r.json())["error"]["reason"] == "UnknownAdapter"
    # A server of team-a asking for another version of team-a's plan adapter is refused; team-b's
    # plan guards team-b's name, with team-b's version.
    other = {"name": "support-bot", "source": object_store.source("b-bot"), "sha256": object_store.adapters["b-bot"].sha256}
    assert (await client.post("/v1/stage", json=other | {"namespace": "team-a"})).status == 409
    assert (await client.post("/v1/stage", json=other | {"namespace": "team-b"})).status == 200


async def test_an_adapter_moved_to_another_followed_plan_of_its_namespace_stays_on_disk(
        tmp_path, object_store, client_factory, kube_api):
    """Two BaseModels of one namespace, both followed: an adapter that moves from the first's
    plan to the second's is the second's to keep, not removed by the first as "left the plan"."""
    from loraplex.node_agent.app import AGENT, AgentConfig

    object_store.add("x", tmp_path, seed=3)
    first = plan_json(object_store, pinned=["x"], base="one")
    kube_api.put_configmap("ml", "one-plan", {"plan.json": json.dumps(first)})
    kube_api.put_configmap("ml", "two-plan", {"plan.json": json.dumps(plan_json(object_store, base="two"))})
    client = await client_factory(AgentConfig(tmp_path / "cache", 10**9, plan_configmaps=("ml/one-plan", "ml/two-plan"),
                                              kube_api_url=kube_api.url, poll_seconds=0.05))
    agent = client.server.app[AGENT]
    for _ in range(400):
        if agent.store.get("x", "ml") is not None:
            break
        await asyncio.sleep(0.02)
    staged = agent.store.get("x", "ml")
    assert staged is not None
    # x moves: the second plan lists it first (as the operator writes it), then the first drops it.
    kube_api.put_configmap("ml", "two-plan", {"plan.json": json.dumps(plan_json(object_store, pinned=["x"], base="two"))})
    second = agent.warmers[1]
    for _ in range(400):
        if second.plan is not None and "x" in second.plan.adapters:
            break
        await asyncio.sleep(0.02)
    kube_api.put_configmap("ml", "one-plan", {"plan.json": json.dumps(plan_json(object_store, base="one"))})
    first_warmer = agent.warmers[0]
    for _ in range(400):
        if first_warmer.plan is not None and "x" not in first_warmer.plan.adapters and first_warmer.reconciles >= 2:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)
    assert agent.store.get("x", "ml") is not None and agent.store.get("x", "ml").sha256 == staged.sha256
    assert object_store.gets["x/adapter_model.safetensors"] == 1  # never removed and fetched again
