"""Plans found by label (`--plan-selector`): the operator mirrors every BaseModel's plan into
the agent's namespace, and the agent follows each mirror it finds as a `--plan-configmap` of
the plan the mirror copies (that plan's namespace: its folder of the cache, its adapters'
status, its servers), from when it appears until it goes.

The API is the fake of conftest.py (a ConfigMap list by label selector, a GET by name, status
patches); the agent is the whole app, its background loops too, over real HTTP and files.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from loraplex.node_agent.app import AGENT, AgentConfig
from loraplex.node_agent.cli import Settings
from loraplex.node_agent.kube import KubeAPI, PlanMirrors

from .helpers import plan_json

AGENT_NS = "loraplex-system"
SELECTOR = "loraplex.io/plan-mirror=true"
NODE = "node-7"


def put_mirror(kube_api, namespace: str, base: str, plan: dict, **annotations: str) -> None:
    """The operator's mirror of `namespace`/`base`-plan, in the agent's namespace."""
    kube_api.put_configmap(AGENT_NS, f"{namespace}.{base}-plan", {"plan.json": json.dumps(plan)},
                           labels={"loraplex.io/plan-mirror": "true", "app.kubernetes.io/managed-by": "loraplex-operator"},
                           annotations={"loraplex.io/plan-of": f"{namespace}/{base}-plan",
                                        "loraplex.io/plan-namespace": namespace, **annotations})


def drop_mirror(kube_api, namespace: str, base: str) -> None:
    del kube_api.configmaps[(AGENT_NS, f"{namespace}.{base}-plan")]


def config(tmp_path, kube_api, **kwargs) -> AgentConfig:
    return AgentConfig(tmp_path / "cache", 10**9, node_name=NODE, namespace=AGENT_NS, kube_api_url=kube_api.url,
                       plan_selector=SELECTOR, plan_namespace=AGENT_NS, poll_seconds=0.05, **kwargs)


async def until(check, what: str, timeout: float = 10.0):
    for _ in range(int(timeout / 0.02)):
        result = check()
        if result:
            return result
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def reported(kube_api) -> dict:
    """The last state each adapter's status.nodes.<node> was patched to (None: removed)."""
    out = {}
    for ns, name, body, _ in kube_api.patches:
        state = body["status"]["nodes"][NODE]
        out[(ns, name)] = state and state["phase"]
    return out


async def test_a_plan_that_appears_is_followed_and_one_that_goes_is_let_go(tmp_path, object_store, client_factory,
                                                                          kube_api):
    """An agent started with a selector alone, no plan yet. A BaseModel's mirror appears: its
    pins are staged in its namespace's folder and reported on its LoRAAdapters. A second plan of
    that namespace lists one of the first's adapters. The first's mirror goes: its warmer stops,
    its adapter goes from the disk (and from its status), the shared one stays, unpinned."""
    for seed, name in enumerate(("x", "shared", "y")):
        object_store.add(name, tmp_path, seed=seed)
    client = await client_factory(config(tmp_path, kube_api))
    agent = client.server.app[AGENT]
    store = agent.store
    await until(lambda: kube_api.lists, "the first listing")
    assert kube_api.lists[0] == (AGENT_NS, {"labelSelector": SELECTOR})
    assert len(agent.warmers) == 1 and agent.warmer.plan is None  # stage on request only, so far

    put_mirror(kube_api, "team-a", "one", plan_json(object_store, pinned=["x", "shared"], base="one"))
    await until(lambda: store.get("x", "team-a") and store.get("shared", "team-a"), "the found plan's pins staged")
    assert store.get("x", "team-a").pinned and store.get("shared", "team-a").pinned
    assert store.get("x") is None and store.get("x", AGENT_NS) is None  # the plan's namespace, not the mirror's
    await until(lambda: reported(kube_api) == {("team-a", "x"): "Staged", ("team-a", "shared"): "Staged"},
                "both reported Staged on team-a's adapters")
    record = tmp_path / "cache" / ".plan-adapters.team-a.one-plan.json"
    assert json.loads(record.read_text()) == {"adapters": ["shared", "x"], "pinned": ["shared", "x"]}
    tasks = (await (await client.get("/healthz")).json())["tasks"]
    assert {"plan-discovery", "plan-watch team-a/one-plan", "status-report team-a"} <= set(tasks)

    put_mirror(kube_api, "team-a", "two", plan_json(object_store, pinned=["y"], others=["shared"], base="two"))
    await until(lambda: store.get("y", "team-a"), "the second plan's pin staged")
    assert len(agent.warmers) == 3 and set(agent.discovered) == {"team-a/one-plan", "team-a/two-plan"}

    drop_mirror(kube_api, "team-a", "one")
    # (The store forgets x before its folder is gone; the record goes after that.)
    await until(lambda: "team-a/one-plan" not in agent.discovered and store.get("x", "team-a") is None
                and not record.exists(), "the first plan let go, its record removed")
    shared = store.get("shared", "team-a")
    assert shared is not None and not shared.pinned, "the adapter the second plan lists left the disk, or kept its pin"
    assert store.get("y", "team-a").pinned
    await until(lambda: reported(kube_api).get(("team-a", "x"), "") is None, "x's status entry removed")
    assert reported(kube_api)[("team-a", "shared")] == "Staged"
    tasks = (await (await client.get("/healthz")).json())["tasks"]
    assert "plan-watch team-a/one-plan" not in tasks and "plan-watch team-a/two-plan" in tasks
    assert len(agent.warmers) == 2
    assert object_store.gets["shared/adapter_model.safetensors"] == 1  # never removed and fetched again


async def test_a_found_plan_is_followed_as_a_named_one_is(tmp_path, object_store, client_factory, kube_api):
    """Errors keyed namespace/name, a session start for the found plan's adapter, the plan guard
    of its namespace: as for --plan-configmap."""
    object_store.add("good", tmp_path, seed=1)
    object_store.add("other", tmp_path, seed=2)
    plan = plan_json(object_store, pinned=["good", "other"], base="one")
    plan["adapters"][1]["sha256"] = "0" * 64  # a wrong digest: fails for good
    put_mirror(kube_api, "team-a", "one", plan)
    client = await client_factory(config(tmp_path, kube_api))
    agent = client.server.app[AGENT]

    async def errors():
        return (await (await client.get("/v1/adapters")).json())["errors"]
    for _ in range(500):
        if "team-a/other" in await errors():
            break
        await asyncio.sleep(0.02)
    assert list(await errors()) == ["team-a/other"] and (await errors())["team-a/other"].startswith("DigestMismatch")
    r = await client.post("/v1/sessions", json={"model": "good"})
    assert r.status == 200, await r.text()
    assert (await r.json())["adapter"]["namespace"] == "team-a"
    fake = {"name": "good", "source": object_store.source("other"), "sha256": object_store.adapters["other"].sha256}
    r = await client.post("/v1/stage", json=fake | {"namespace": "team-a"})
    assert r.status == 409 and (await r.json())["error"]["reason"] == "NotThePlansVersion"
    assert agent.store.get("good", "team-a").pinned


async def test_a_named_plan_works_beside_discovery_and_is_not_followed_twice(tmp_path, object_store, client_factory,
                                                                            kube_api):
    object_store.add("a", tmp_path, seed=1)
    object_store.add("b", tmp_path, seed=2)
    object_store.add("bad", tmp_path, seed=3)
    named = plan_json(object_store, pinned=["a", "bad"], base="named")
    named["adapters"][1]["sha256"] = "0" * 64
    kube_api.put_configmap("ml", "named-plan", {"plan.json": json.dumps(named)})
    put_mirror(kube_api, "ml", "named", named)  # the operator's mirror of the same plan
    put_mirror(kube_api, "ml", "found", plan_json(object_store, pinned=["b"], base="found"))
    client = await client_factory(config(tmp_path, kube_api, plan_configmaps=("ml/named-plan",)))
    agent = client.server.app[AGENT]
    await until(lambda: agent.store.get("a", "ml") and agent.store.get("b", "ml"), "both plans' pins staged")
    assert set(agent.discovered) == {"ml/found-plan"}
    assert [w.record_file for w in agent.warmers] == [".plan-adapters.json", ".plan-adapters.ml.found-plan.json"]
    assert agent.warmer.plan is not None and agent.warmer.plan.base_model == "named"
    # The named plan stays followed while the listings do not have it.
    drop_mirror(kube_api, "ml", "named")
    drop_mirror(kube_api, "ml", "found")
    await until(lambda: not agent.discovered and agent.store.get("b", "ml") is None, "the found plan let go")
    assert agent.store.get("a", "ml").pinned and len(agent.warmers) == 1
    # One plan followed now, as at the start: its errors keyed by namespace all the same (the
    # key does not flip with the count of plans, which discovery changes at any time).
    errors = (await (await client.get("/v1/adapters")).json())["errors"]
    assert list(errors) == ["ml/bad"] and errors["ml/bad"].startswith("DigestMismatch")


async def test_a_failed_listing_lets_no_plan_go(tmp_path, object_store, client_factory, kube_api):
    object_store.add("a", tmp_path, seed=1)
    put_mirror(kube_api, "ml", "one", plan_json(object_store, pinned=["a"], base="one"))
    client = await client_factory(config(tmp_path, kube_api))
    agent = client.server.app[AGENT]
    await until(lambda: agent.store.get("a", "ml"), "the pin staged")
    kube_api.fail_lists = 5
    listed = len(kube_api.lists)
    await until(lambda: len(kube_api.lists) >= listed + 6, "listings failed and one more after")
    assert set(agent.discovered) == {"ml/one-plan"} and agent.store.get("a", "ml").pinned
    assert agent.tasks.crashed == {}


async def test_a_found_plans_record_keeps_its_name_as_plans_come_and_go(tmp_path, object_store, client_factory,
                                                                       kube_api):
    """The record of a found plan's adapters is `.plan-adapters.<ns>.<name>.json` whether it is
    the only plan followed or one of several: an adapter it dropped while the agent was down
    (and another plan appeared) is removed at the next start, as while it runs."""
    object_store.add("a", tmp_path, seed=1)
    object_store.add("b", tmp_path, seed=2)
    put_mirror(kube_api, "ml", "one", plan_json(object_store, pinned=["a", "b"], base="one"))
    client = await client_factory(config(tmp_path, kube_api))
    agent = client.server.app[AGENT]
    await until(lambda: agent.store.get("a", "ml") and agent.store.get("b", "ml"), "both pins staged")
    await client.close()

    put_mirror(kube_api, "ml", "one", plan_json(object_store, pinned=["a"], base="one"))  # b dropped meanwhile
    put_mirror(kube_api, "ml", "two", plan_json(object_store, base="two"))  # and a second plan appeared
    client = await client_factory(config(tmp_path, kube_api))
    agent = client.server.app[AGENT]
    await until(lambda: agent.store.get("b", "ml") is None and len(agent.discovered) == 2,
                "b removed by the restarted agent")
    assert agent.store.get("a", "ml").pinned
    assert object_store.gets["a/adapter_model.safetensors"] == 1


async def test_only_configmaps_naming_a_plan_are_followed(tmp_path, client_factory, kube_api, caplog):
    """A ConfigMap the selector finds without loraplex.io/plan-of NAMESPACE/NAME (or whose
    namespace is not a namespace name, or whose two annotations disagree) is skipped, logged once."""
    import aiohttp

    put_mirror(kube_api, "ml", "good", {"baseModel": "good", "adapters": []})
    labels = {"loraplex.io/plan-mirror": "true"}
    kube_api.put_configmap(AGENT_NS, "no-annotation", {"plan.json": "{}"}, labels=labels)
    kube_api.put_configmap(AGENT_NS, "bad-namespace", {"plan.json": "{}"}, labels=labels,
                           annotations={"loraplex.io/plan-of": "Not_A_Namespace/p"})
    kube_api.put_configmap(AGENT_NS, "disagrees", {"plan.json": "{}"}, labels=labels,
                           annotations={"loraplex.io/plan-of": "ml/x-plan", "loraplex.io/plan-namespace": "other"})
    kube_api.put_configmap(AGENT_NS, "unlabelled", {"plan.json": "{}"}, annotations={"loraplex.io/plan-of": "ml/y-plan"})
    async with aiohttp.ClientSession() as session:
        mirrors = PlanMirrors(KubeAPI(kube_api.url, session), AGENT_NS, SELECTOR)
        for _ in range(3):
            found = await mirrors.list()
    assert list(found) == ["ml/good-plan"]
    plan = found["ml/good-plan"]
    assert (plan.namespace, plan.name, plan.where, plan.mirror) == ("ml", "good-plan", AGENT_NS, "ml.good-plan")
    skipped = [r.getMessage() for r in caplog.records if "is not followed as a plan" in r.getMessage()]
    assert len(skipped) == 3, skipped  # once each, not once a listing


@pytest.mark.parametrize("argv, env, error", [
    (["--plan-selector", "a=b"], {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "--plan-namespace"),
    (["--plan-selector", "a=b", "--plan-namespace", "lp"], {}, "Kubernetes API"),
    (["--plan-selector", "a = b"], {"POD_NAMESPACE": "lp", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "label selector"),
    (["--plan-selector", "a=b", "--plan-namespace", "Not/A"], {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "namespace"),
    (["--plan-selector", "a=b", "--plan-file", "/p"], {"POD_NAMESPACE": "lp", "KUBERNETES_SERVICE_HOST": "10.0.0.1"},
     "not both"),
])
def test_plan_selector_settings_are_checked(argv, env, error):
    with pytest.raises(ValueError, match=error):
        Settings.from_env_and_args(argv, env=env)


def test_the_plan_namespace_defaults_to_the_agents_own():
    env = {"POD_NAMESPACE": "loraplex-system", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    settings = Settings.from_env_and_args(["--plan-selector", SELECTOR, "--plan-configmap", "ml/x-plan"], env=env)
    assert (settings.plan_selector, settings.plan_namespace) == (SELECTOR, "loraplex-system")
    config = settings.agent_config()
    assert (config.plan_selector, config.plan_namespace, config.plan_configmaps) == (
        SELECTOR, "loraplex-system", ("ml/x-plan",))
    assert Settings.from_env_and_args([], env=env).plan_namespace is None  # no selector, no plan namespace


async def test_a_plan_gone_while_the_agent_was_down_is_let_go_at_its_next_start(tmp_path, object_store,
                                                                                client_factory, kube_api):
    """A BaseModel deleted while the agent was down: its mirror is gone when the agent starts
    again, and only the record the last run left says what it had. Once the plans found have
    been read, that plan is let go as a plan that goes while the agent runs is: its adapter off
    the disk and its status entry removed, its record removed; the adapter that moved to a
    plan still found stays, pinned by that plan."""
    for seed, name in enumerate(("gone", "moved")):
        object_store.add(name, tmp_path, seed=seed)
    put_mirror(kube_api, "ml", "one", plan_json(object_store, pinned=["gone", "moved"], base="one"))
    client = await client_factory(config(tmp_path, kube_api))
    agent = client.server.app[AGENT]
    await until(lambda: agent.store.get("gone", "ml") and agent.store.get("moved", "ml"), "both pins staged")
    record = tmp_path / "cache" / ".plan-adapters.ml.one-plan.json"
    assert record.exists()
    await client.close()

    drop_mirror(kube_api, "ml", "one")  # deleted with its BaseModel, the agent down
    put_mirror(kube_api, "ml", "two", plan_json(object_store, pinned=["moved"], base="two"))
    client = await client_factory(config(tmp_path, kube_api))
    agent = client.server.app[AGENT]
    await until(lambda: agent.store.get("gone", "ml") is None and not record.exists(),
                "the gone plan's adapter and record removed at start")
    assert agent.store.get("moved", "ml").pinned, "the adapter another found plan lists left the disk or its pin"
    assert object_store.gets["moved/adapter_model.safetensors"] == 1  # kept, never fetched again
    await until(lambda: reported(kube_api).get(("ml", "gone"), "") is None, "gone's status entry removed")
    assert agent.orphan_records() == []
