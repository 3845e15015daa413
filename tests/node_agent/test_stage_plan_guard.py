"""POST /v1/stage on a node that follows a plan: a plan adapter's name stages the plan's
version alone, so no pod that reaches the agent's port can put other weights under a
tenant's adapter name for the node's servers."""

from __future__ import annotations

import asyncio
import hashlib

from loraplex.node_agent.adapter_files import WEIGHTS_FILE
from loraplex.node_agent.app import AGENT, AgentConfig

from .helpers import ConfigMapDir, plan_json


async def _agent_with_plan(tmp_path, object_store, client_factory, plan, **config):
    cm = ConfigMapDir(tmp_path / "plan")
    cm.write(plan)
    client = await client_factory(AgentConfig(tmp_path / "cache", 10**9, plan_file=cm.path, poll_seconds=30,
                                              **config))
    warmer = client.server.app[AGENT].warmer
    for _ in range(200):  # the plan loop's first read
        if warmer.plan is not None:
            break
        await asyncio.sleep(0.02)
    assert warmer.plan is not None
    return client, cm


def _weights_sha(tmp_path, name):
    return hashlib.sha256((tmp_path / "cache" / name / WEIGHTS_FILE).read_bytes()).hexdigest()


async def test_another_version_of_a_plan_adapter_is_refused(tmp_path, object_store, client_factory):
    object_store.add("sql", tmp_path, seed=1)
    object_store.add("evil", tmp_path, seed=2)
    client, _ = await _agent_with_plan(tmp_path, object_store, client_factory, plan_json(object_store, others=["sql"]))
    planned = object_store.adapters["sql"].sha256
    # Other weights under the tenant's name: another source with its own digest, or no digest.
    for body in ({"name": "sql", "source": object_store.source("evil"), "sha256": object_store.adapters["evil"].sha256},
                 {"name": "sql", "source": object_store.source("evil")},
                 {"name": "sql", "source": object_store.source("sql"), "sha256": object_store.adapters["evil"].sha256}):
        r = await client.post("/v1/stage", json=body)
        assert r.status == 409, await r.text()
        err = (await r.json())["error"]
        assert err["reason"] == "NotThePlansVersion" and planned in err["message"]
    # The plan's version stages (a server's request), and what is on disk is the tenant's.
    r = await client.post("/v1/stage", json={"name": "sql", "source": object_store.source("sql"), "sha256": planned})
    assert r.status == 200, await r.text()
    assert _weights_sha(tmp_path, "sql") == planned
    assert object_store.gets["evil/adapter_model.safetensors"] == 0


async def test_the_plans_version_is_fetched_from_the_plans_source_not_the_clients(tmp_path, object_store,
                                                                                 client_factory):
    """The digest covers the weights alone: a pod serving the tenant's weights beside its own
    adapter_config.json (another lora_alpha) passes the digest check, so the agent fetches a
    plan adapter from the plan's source, whatever source the request names."""
    import dataclasses
    import json

    from loraplex.node_agent.adapter_files import CONFIG_FILE

    object_store.add("sql", tmp_path, seed=1)
    real = object_store.adapters["sql"]
    config = json.loads(real.files[CONFIG_FILE])
    forged = {**real.files, CONFIG_FILE: json.dumps({**config, "lora_alpha": 4096}).encode()}
    object_store.adapters["mimic"] = dataclasses.replace(real, files=forged)
    client, _ = await _agent_with_plan(tmp_path, object_store, client_factory, plan_json(object_store, others=["sql"]))
    r = await client.post("/v1/stage", json={"name": "sql", "source": object_store.source("mimic"),
                                             "sha256": real.sha256})
    assert r.status == 200, await r.text()
    staged = json.loads((tmp_path / "cache" / "sql" / CONFIG_FILE).read_bytes())
    assert staged["lora_alpha"] == config["lora_alpha"] != 4096
    assert object_store.gets["mimic/adapter_model.safetensors"] == 0 and object_store.gets[f"mimic/{CONFIG_FILE}"] == 0


async def test_a_plan_without_a_digest_pins_the_source_query_string_aside(tmp_path, object_store, client_factory):
    object_store.add("chat", tmp_path, seed=3)
    object_store.add("evil", tmp_path, seed=4)
    plan = plan_json(object_store, others=["chat"])
    del plan["adapters"][0]["sha256"]
    plan["adapters"][0]["source"] += "?token=old"
    client, _ = await _agent_with_plan(tmp_path, object_store, client_factory, plan)
    r = await client.post("/v1/stage", json={"name": "chat", "source": object_store.source("evil")})
    assert r.status == 409 and (await r.json())["error"]["reason"] == "NotThePlansVersion"
    r = await client.post("/v1/stage", json={"name": "chat", "source": object_store.source("chat") + "?token=new"})
    assert r.status == 200, await r.text()


async def test_a_server_ahead_of_the_agent_gets_the_newer_plans_version(tmp_path, object_store, client_factory):
    """A server that read a new plan before the agent's next poll asks for the new version:
    the agent reads the plan again rather than refusing it."""
    object_store.add("sql", tmp_path, seed=1)
    client, cm = await _agent_with_plan(tmp_path, object_store, client_factory, plan_json(object_store, others=["sql"]))
    object_store.add("sql", tmp_path, seed=5)  # v2 at the same source
    cm.write(plan_json(object_store, others=["sql"]))  # the agent polls every 30 s: not read yet
    v2 = object_store.adapters["sql"].sha256
    r = await client.post("/v1/stage", json={"name": "sql", "source": object_store.source("sql"), "sha256": v2})
    assert r.status == 200, await r.text()
    assert _weights_sha(tmp_path, "sql") == v2


async def test_names_outside_the_plan_and_agents_without_one_stage_as_asked(tmp_path, object_store, client_factory):
    object_store.add("sql", tmp_path, seed=1)
    object_store.add("other-base", tmp_path, seed=6)
    client, _ = await _agent_with_plan(tmp_path, object_store, client_factory, plan_json(object_store, others=["sql"]))
    r = await client.post("/v1/stage", json={"name": "other-base", "source": object_store.source("other-base")})
    assert r.status == 200, await r.text()
    bare = await client_factory(AgentConfig(tmp_path / "cache2", 10**9))
    r = await bare.post("/v1/stage", json={"name": "sql", "source": object_store.source("other-base")})
    assert r.status == 200, await r.text()


async def test_plan_adapters_only_refuses_other_names_unless_the_agents_key_comes(tmp_path, object_store,
                                                                                   client_factory):
    """--stage-plan-adapters-only: a pod that reaches the port cannot have the agent fetch
    sources no followed plan names; the servers' requests (plan names, also of a plan newer
    than the agent's last poll) and the key holder's are staged."""
    object_store.add("sql", tmp_path, seed=1)
    object_store.add("anything", tmp_path, seed=2)
    object_store.add("added", tmp_path, seed=3)
    client, cm = await _agent_with_plan(tmp_path, object_store, client_factory, plan_json(object_store, others=["sql"]),
                                        stage_plan_adapters_only=True, api_key="sk-agent")
    other = {"name": "anything", "source": object_store.source("anything")}
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        r = await client.post("/v1/stage", json=other, headers=headers)
        assert r.status == 403 and (await r.json())["error"]["reason"] == "NotInPlan", await r.text()
    assert object_store.gets["anything/adapter_model.safetensors"] == 0
    r = await client.post("/v1/stage", json=other, headers={"Authorization": "Bearer sk-agent"})
    assert r.status == 200, await r.text()
    sql = object_store.adapters["sql"].sha256
    r = await client.post("/v1/stage", json={"name": "sql", "source": object_store.source("sql"), "sha256": sql})
    assert r.status == 200, await r.text()
    # A name the plan lists since the agent's last poll (it polls every 30 s here).
    cm.write(plan_json(object_store, others=["sql", "added"]))
    added = object_store.adapters["added"].sha256
    r = await client.post("/v1/stage", json={"name": "added", "source": object_store.source("added"), "sha256": added})
    assert r.status == 200, await r.text()
