"""The node agent's HTTP API over real HTTP on 127.0.0.1, and its settings."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from loraplex.node_agent.adapter_files import WEIGHTS_FILE
from loraplex.node_agent.app import AGENT, AgentConfig
from loraplex.node_agent.cli import Settings, build_parser, field_docs, main
from loraplex.server.adapter_format import serving_weights_name

from .helpers import ConfigMapDir, plan_json


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


async def test_stage_list_and_metrics(tmp_path, object_store, client_factory):
    src = object_store.add("sql", tmp_path)
    client = await client_factory(AgentConfig(tmp_path / "cache", 10**9))
    body = {"name": "sql", "source": src, "sha256": object_store.adapters["sql"].sha256}
    r = await client.post("/v1/stage", json=body)
    assert r.status == 200, await r.text()
    adapter = (await r.json())["adapter"]
    assert Path(adapter["path"], WEIGHTS_FILE).is_file()
    listing = await (await client.get("/v1/adapters")).json()
    assert [a["name"] for a in listing["adapters"]] == ["sql"]
    assert listing["usedBytes"] == adapter["bytes"] > 0 and listing["adapters"][0]["pinned"] is False
    scraped = await client.get("/metrics")
    assert scraped.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"  # the body's format
    text = await scraped.text()
    assert metric(text, "loraplex_node_agent_staged_adapters") == 1
    assert metric(text, "loraplex_node_agent_disk_bytes") == adapter["bytes"]
    assert metric(text, "loraplex_node_agent_download_seconds_count") == 1
    assert metric(text, "loraplex_node_agent_downloads_in_flight") == 0
    # A server names its dtype: the F32 weights are staged in it too, once.
    r = await client.post("/v1/stage", json=body | {"dtype": "bfloat16"})
    assert r.status == 200, await r.text()
    assert Path(adapter["path"], serving_weights_name("bfloat16")).is_file()
    assert (await r.json())["adapter"]["bytes"] > adapter["bytes"]
    r = await client.post("/v1/stage", json=body | {"dtype": "float8"})
    assert r.status == 400 and (await r.json())["error"]["reason"] == "InvalidRequest"


ERRORS = [
    # (request body or raw text, status, reason)
    ("{not json", 400, "InvalidRequest"),
    ([1], 400, "InvalidRequest"),
    ({"name": "x"}, 400, "InvalidRequest"),
    ({"name": "x", "source": "gs://b/x", "sha256": "0" * 64}, 400, "Unsupported"),
    ({"name": "x", "source": "MISSING", "sha256": "0" * 64}, 404, "NotFound"),
    ({"name": "x", "source": "GOOD", "sha256": "0" * 64}, 422, "DigestMismatch"),
    ({"name": "x", "source": "CUT", "sha256": "CUT"}, 502, "Truncated"),
    ({"name": "x", "source": "GOOD", "sha256": "GOOD", "budget": 100}, 507, "BudgetExceeded"),
    ({"name": "x", "source": "GOOD", "sha256": "GOOD", "dtype": ["bfloat16"]}, 400, "InvalidRequest"),
]


@pytest.mark.parametrize("body,status,reason", ERRORS)
async def test_stage_errors(tmp_path, object_store, client_factory, body, status, reason):
    good = object_store.add("good", tmp_path)
    cut = object_store.add("cut", tmp_path, seed=1, mode="cut")
    budget = body.pop("budget", 10**9) if isinstance(body, dict) else 10**9
    client = await client_factory(AgentConfig(tmp_path / "cache", budget))
    if isinstance(body, dict):
        subst = {"GOOD": (good, object_store.adapters["good"].sha256),
                 "CUT": (cut, object_store.adapters["cut"].sha256),
                 "MISSING": (object_store.source("missing"), None)}
        if body.get("source") in subst:
            src, sha = subst[body["source"]]
            body["source"] = src
            if body.get("sha256") in subst:
                body["sha256"] = sha
    if isinstance(body, str):
        r = await client.post("/v1/stage", data=body, headers={"Content-Type": "application/json"})
    else:
        r = await client.post("/v1/stage", json=body)
    assert r.status == status
    err = (await r.json())["error"]
    assert err["reason"] == reason and err["message"]
    assert not (tmp_path / "cache" / "x").exists()


async def session_agent(tmp_path, object_store, client_factory, fake_server, api_key=None):
    """An agent following a plan that lists `chat`, with one ready server to warm."""
    object_store.add("chat", tmp_path)
    cm = ConfigMapDir(tmp_path / "plan")
    cm.write(plan_json(object_store, others=["chat"]))
    fake_server.ready = True
    client = await client_factory(AgentConfig(tmp_path / "cache", 10**9, plan_file=cm.path,
                                              server_urls=(fake_server.url,), poll_seconds=0.05,
                                              server_poll_seconds=0.05, api_key=api_key))
    warmer = client.server.app[AGENT].warmer
    for _ in range(200):  # the background loops find the plan and the ready server
        if warmer.plan is not None and warmer._ready:
            break
        await asyncio.sleep(0.02)
    return client


async def test_session_endpoint(tmp_path, object_store, client_factory, fake_server):
    client = await session_agent(tmp_path, object_store, client_factory, fake_server)
    r = await client.post("/v1/sessions", json={"model": "chat"})
    assert r.status == 200, await r.text()
    body = await r.json()
    assert body["adapter"]["name"] == "chat" and body["servers"] == [
        {"name": "chat", "action": "prefetch", "ok": True, "detail": ""}]
    assert ("prefetch", "chat", "wait=false") in fake_server.calls
    r = await client.post("/v1/sessions", json={"model": "nope"})
    assert r.status == 404 and (await r.json())["error"]["reason"] == "UnknownAdapter"
    r = await client.post("/v1/sessions", json={})
    assert r.status == 400


async def test_in_cluster_agent_warms_pods_and_reports_status(tmp_path, object_store, client_factory,
                                                              kube_api, fake_server):
    """With an API server: pods found through it get warmed, staging lands in status.nodes."""
    object_store.add("p1", tmp_path)
    cm = ConfigMapDir(tmp_path / "plan")
    cm.write(plan_json(object_store, pinned=["p1"]))
    host, port = fake_server.url.rsplit(":", 1)
    fake_server.ready = True
    kube_api.pods = [{"metadata": {"uid": "u1", "name": "srv", "namespace": "ml"},
                      "status": {"podIP": host.removeprefix("http://"),
                                 "conditions": [{"type": "Ready", "status": "True"}]}}]
    client = await client_factory(AgentConfig(
        tmp_path / "cache", 10**9, plan_file=cm.path, node_name="node-7", namespace="ml",
        kube_api_url=kube_api.url, poll_seconds=0.05, server_poll_seconds=0.05))
    agent = client.server.app[AGENT]
    agent.warmer.discovery.port = int(port)  # the fake server's port instead of 8000
    for _ in range(250):
        if kube_api.patches and ("pin", "p1", "") in fake_server.calls:
            break
        await asyncio.sleep(0.02)
    assert sorted(agent.tasks.running) == ["plan-watch", "server-watch", "status-report"]
    assert kube_api.patches[-1][:2] == ("ml", "p1")
    assert kube_api.patches[-1][2]["status"]["nodes"]["node-7"]["phase"] == "Staged"
    assert ("prefetch", "p1", "wait=false") in fake_server.calls and ("pin", "p1", "") in fake_server.calls


async def test_healthz_reports_a_crashed_loop(tmp_path, client_factory):
    client = await client_factory(AgentConfig(tmp_path / "cache", 10**9))
    r = await client.get("/healthz")
    assert r.status == 200 and (await r.json())["status"] == "ok"

    async def broken():
        raise RuntimeError("plan loop bug")

    agent = client.server.app[AGENT]
    task = agent.tasks.spawn(broken(), "plan-watch")
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)
    r = await client.get("/healthz")
    assert r.status == 500
    assert (await r.json())["crashed"] == {"plan-watch": "RuntimeError: plan loop bug"}
    text = await (await client.get("/metrics")).text()
    assert 'loraplex_node_agent_task_crashes_total{task="plan-watch"} 1.0' in text


def test_every_setting_has_a_flag_and_a_docstring():
    docs = field_docs(Settings)
    flags = {a.dest: a.option_strings for a in build_parser()._actions if a.dest != "help"}
    fields = set(Settings.__dataclass_fields__)
    assert set(flags) == fields == set(docs)
    for name, opts in flags.items():
        flag = "--" + name.replace("_", "-")
        # (an on/off setting takes its --no- form too)
        assert opts in ([flag], [flag, "--no-" + flag[2:]]), opts
        assert "Default" in docs[name], name


SETTINGS = [
    ([], {}, {"node_name": None, "kube_api_url": None, "port": 8081}),
    (["--cache-dir", "/c", "--budget-bytes", "1000", "--max-concurrent-downloads", "2",
      "--plan-file", "/p/plan.json", "--port", "9000"], {"NODE_NAME": "n1"},
     {"cache_dir": Path("/c"), "budget_bytes": 1000, "max_concurrent_downloads": 2,
      "plan_file": Path("/p/plan.json"), "port": 9000, "node_name": "n1"}),
    (["--node-name", "flag-wins"], {"NODE_NAME": "env"}, {"node_name": "flag-wins"}),
    (["--server-url", "http://a:8000", "--server-url", "http://b:8000"], {},
     {"server_url": ["http://a:8000", "http://b:8000"]}),
    ([], {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443", "POD_NAMESPACE": "ml"},
     {"kube_api_url": "https://10.96.0.1:443", "namespace": "ml"}),
    (["--plan-configmap", "ml/llama-plan"], {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "POD_NAMESPACE": "loraplex"},
     {"plan_configmap": ["ml/llama-plan"], "namespace": "ml"}),
    # Two plans: each its own namespace; --namespace (POD_NAMESPACE) is the --plan-file's.
    (["--plan-configmap", "ml/llama-plan", "--plan-configmap", "team-b/mistral-plan"],
     {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "POD_NAMESPACE": "loraplex"},
     {"plan_configmap": ["ml/llama-plan", "team-b/mistral-plan"], "namespace": "loraplex"}),
]


@pytest.mark.parametrize("argv,env,want", SETTINGS)
def test_settings_from_flags_and_env(argv, env, want):
    s = Settings.from_env_and_args(argv, env)
    for k, v in want.items():
        assert getattr(s, k) == v, k


@pytest.mark.parametrize("argv", [["--budget-bytes", "0"], ["--max-concurrent-downloads", "-1"],
                                  ["--port", "70000"], ["--log-level", "LOUD"],
                                  ["--plan-configmap", "ml/p"],  # no API to read it from
                                  ["--plan-configmap", "p", "--kube-api-url", "http://x"],
                                  ["--plan-configmap", "ml/p", "--plan-file", "/p", "--kube-api-url", "http://x"],
                                  ["--plan-configmap", "ml/p", "--plan-configmap", "ml/p", "--kube-api-url", "http://x"]])
def test_bad_settings_exit_2(argv, capsys, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(argv) == 2
    assert "loraplex-node-agent:" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--poll-seconds", "--server-poll-seconds"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_poll_intervals_must_be_finite(flag, value):
    # nan passed "<= 0" and made every sleep a no-op: the plan and the node's server pods
    # polled in a busy loop (the Kubernetes API listed without pause); inf never polled.
    with pytest.raises(ValueError, match="positive and finite"):
        Settings.from_env_and_args([flag, value], {})


def test_agent_config_maps_settings(tmp_path):
    s = Settings.from_env_and_args(["--cache-dir", str(tmp_path), "--server-url", "http://x:8000"], {})
    c = s.agent_config()
    assert c.cache_dir == tmp_path and c.server_urls == ("http://x:8000",)
    assert c.kube_token_file is None  # not in a pod
    json.dumps({"budget": c.budget_bytes})
