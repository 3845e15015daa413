"""The control path with every part real, from applied CRs to a served completion.

    LoRAAdapter / BaseModel CRs (created through the emulated API, as `kubectl apply` does)
      -> the kopf operator (in-process): validation, packing, pins, the plan ConfigMap
      -> the node agent (loraplex.node_agent, its own HTTP API on a loopback port): reads the
         plan through the API, downloads the file:// sources into its cache (sha256 checked),
         reports status.nodes, warms the server
      -> the server (loraplex.server on the CPU, a tiny random Llama): follows the mounted plan
         file, loads adapters from the agent's cache, answers the OpenAI API
      -> the operator reads status.nodes and the Deployment back: phase Ready.

The emulator runs no kubelet, so the test plays two of its parts: it mounts the plan
ConfigMap as a file (copying plan.json whenever the ConfigMap changes, by a rename, as a
ConfigMap volume changes by a symlink swap) and reports the Deployment's ready replicas once
the server answers /readyz. The rest is the product's own code over real HTTP and files.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from loraplex.node_agent.app import AgentConfig, create_app as create_agent_app
from loraplex.operator.kube import ADAPTERS, BASE_MODELS, CONFIG_MAPS, DEPLOYMENTS, KubeClient
from loraplex.operator.workloads import ADAPTER_CACHE_DIR, namespace_cache_dir, read_plan

pytestmark = pytest.mark.slow

NS = "ml"
BASE = "tiny"
NODE = "node-1"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _base_body() -> dict[str, Any]:
    return {"apiVersion": "loraplex.io/v1alpha1", "kind": "BaseModel", "metadata": {"name": BASE, "namespace": NS},
            "spec": {"source": "file:///models/tiny", "maxLoraRank": 16, "dtype": "float32",
                     "targetModules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                     "memory": {"gpuMemory": "80G", "baseWeights": "16G", "overhead": "24G",
                                "kvCacheReserve": "30G", "adapterBytes": "40M"},
                     "serving": {"replicas": 1, "image": "loraplex/server:test"}}}


def _adapter_body(name: str, path: Path, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "loraplex.io/v1alpha1", "kind": "LoRAAdapter", "metadata": {"name": name, "namespace": NS},
            "spec": {"baseModel": BASE, "source": path.as_uri(), "sha256": _sha256(path / "adapter_model.safetensors"),
                     "tenant": "acme", "priority": 10, **spec}}


async def _mount_plan(api: KubeClient, mount: Path, stop: asyncio.Event) -> None:
    """The kubelet's part: the ConfigMap's plan.json as a file, replaced whole on each change."""
    seen = None
    while not stop.is_set():
        cm = await api.get(CONFIG_MAPS.path(NS, f"{BASE}-plan"))
        if cm is not None and cm["metadata"].get("resourceVersion") != seen:
            seen = cm["metadata"].get("resourceVersion")
            tmp = mount.with_name(mount.name + ".tmp")
            tmp.write_text(json.dumps(read_plan(cm)))
            os.replace(tmp, mount)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)


@contextlib.asynccontextmanager
async def _node_agent(config: AgentConfig, port: int):
    runner = web.AppRunner(create_agent_app(config))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as r:
        return r.status, await r.json(content_type=None)


async def _complete(session: aiohttp.ClientSession, url: str, model: str) -> tuple[int, Any]:
    body = {"model": model, "prompt": "SELECT name FROM", "max_tokens": 8, "temperature": 0}
    async with session.post(f"{url}/v1/completions", json=body) as r:
        return r.status, await r.json(content_type=None)


class _Server:
    """A uvicorn server for an app on a given loopback port, in a thread of its own (the
    server's engine loop is a thread too; the test's event loop runs the emulator)."""

    def __init__(self, app, port: int) -> None:
        import uvicorn

        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)

    async def __aenter__(self) -> "_Server":
        self.thread.start()
        for _ in range(600):
            if self.server.started:
                return self
            if not self.thread.is_alive():
                break
            await asyncio.sleep(0.05)
        raise RuntimeError("the server did not start")

    async def __aexit__(self, *exc) -> None:
        self.server.should_exit = True
        await asyncio.to_thread(self.thread.join, 10)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    """One node of a pool, every part running: the operator (a fixture), the node agent and a
    server of the BaseModel `tiny`; the demo's adapters as file:// sources. `restart_agent`
    and `restart_server` stop one and start a new process's worth of it on the same port,
    over the same node cache."""

    api: KubeClient
    http: aiohttp.ClientSession
    server_url: str
    agent_url: str
    cache_dir: Path  # the node's cache folder for the namespace: what the server pod mounts
    adapter_dirs: dict[str, Path]
    plan_mount: Path
    agent_config: AgentConfig
    server_settings: Any  # ServerSettings
    parts: dict[str, contextlib.AsyncExitStack] = field(default_factory=dict)

    async def start_agent(self) -> None:
        self.parts["agent"] = stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(_node_agent(self.agent_config, _port(self.agent_url)))

    async def start_server(self) -> None:
        from loraplex.server.api.app import create_app as create_server_app
        from loraplex.server.engine import LLMEngine

        self.parts["server"] = stack = contextlib.AsyncExitStack()
        engine = await asyncio.to_thread(LLMEngine.from_settings, self.server_settings)
        await stack.enter_async_context(_Server(create_server_app(engine), _port(self.server_url)))

    async def restart_agent(self) -> None:
        await self.parts.pop("agent").aclose()
        await self.start_agent()

    async def restart_server(self) -> None:
        await self.parts.pop("server").aclose()
        await self.start_server()

    async def stop(self) -> None:
        for name in ("server", "agent"):
            if name in self.parts:
                await self.parts.pop(name).aclose()

    async def apply_adapter(self, name: str, directory: Path | None = None, **spec: Any) -> None:
        from loraplex.server.demo import DEMO_ADAPTERS

        r, _, targets, _ = DEMO_ADAPTERS.get(name, DEMO_ADAPTERS["sql-expert"])
        body = _adapter_body(name, directory or self.adapter_dirs[name], **({"rank": r, "targetModules": targets} | spec))
        if await self.api.get(ADAPTERS.path(NS, name)) is None:
            await self.api.create(ADAPTERS.path(NS), body)
        else:  # kubectl apply of a changed object
            await self.api.merge_patch(ADAPTERS.path(NS, name), {"spec": body["spec"]})

    async def plan(self) -> dict[str, Any] | None:
        if not self.plan_mount.exists():
            return None
        return json.loads(await asyncio.to_thread(self.plan_mount.read_text))

    async def node_state(self, name: str) -> dict[str, Any]:
        a = await self.api.get(ADAPTERS.path(NS, name))
        return (((a or {}).get("status") or {}).get("nodes") or {}).get(NODE) or {}

    async def staged(self, name: str) -> dict[str, Any] | None:
        """This node's status entry for `name` once it says Staged, else None."""
        node = await self.node_state(name)
        return node if node.get("phase") == "Staged" else None

    async def status(self, name: str) -> dict[str, Any]:
        return ((await self.api.get(ADAPTERS.path(NS, name))) or {}).get("status") or {}

    async def rows(self) -> dict[str, dict[str, Any]]:
        status, body = await _get(self.http, f"{self.server_url}/v1/adapters")
        return {row["name"]: row for row in body["data"]} if status == 200 else {}

    async def complete(self, model: str) -> tuple[int, Any]:
        return await _complete(self.http, self.server_url, model)


@pytest.fixture()
async def cluster(api, emulator, operator, eventually_, tmp_path) -> AsyncIterator[Cluster]:
    from loraplex.server.demo import build_demo
    from loraplex.server.settings import ServerSettings

    base_dir, adapter_dirs = build_demo(tmp_path / "demo")
    await api.create(BASE_MODELS.path(NS), _base_body())
    plan_mount = tmp_path / "plan" / "plan.json"
    plan_mount.parent.mkdir()
    stop = asyncio.Event()
    kubelet = asyncio.create_task(_mount_plan(api, plan_mount, stop))
    node_cache = tmp_path / "node-cache"
    # What the operator's Deployment mounts from the host: the namespace's folder of the cache.
    cache_dir = Path(namespace_cache_dir(NS).replace(ADAPTER_CACHE_DIR, str(node_cache), 1))
    server_url, agent_url = f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
    # The agent's --server-url stands in for finding the server pod on its node through the API.
    agent_config = AgentConfig(cache_dir=node_cache, budget_bytes=10**9, plan_configmaps=(f"{NS}/{BASE}-plan",),
                               server_urls=(server_url,), node_name=NODE, namespace=NS,
                               kube_api_url=emulator.base_url, poll_seconds=0.1, server_poll_seconds=0.1)
    settings = ServerSettings(model=str(base_dir), served_model_name=BASE, device="cpu", dtype="float32",
                              max_num_seqs=4, max_model_len=128, max_loras=4, max_lora_rank=16,
                              plan_file=str(plan_mount), adapter_cache_dir=str(cache_dir),
                              adapter_namespace=NS, node_agent_url=agent_url)
    async with aiohttp.ClientSession() as http:
        c = Cluster(api, http, server_url, agent_url, cache_dir, adapter_dirs, plan_mount, agent_config, settings)
        try:
            await eventually_(lambda: asyncio.to_thread(plan_mount.exists), what="the plan mounted")
            await c.start_agent()  # a DaemonSet's pod is on the node before a server's
            await c.start_server()
            yield c
        finally:
            await c.stop()
            stop.set()
            await kubelet


async def test_applied_adapters_are_planned_staged_warmed_served_and_removed(cluster: Cluster, eventually_):
    c = cluster
    pinned, cached = "sql-expert", "pirate"  # one pinned by its policy, one left to the cache
    await c.apply_adapter(pinned, pinPolicy="Always")
    await c.apply_adapter(cached, pinPolicy="Never")

    async def planned():
        plan = await c.plan()
        return plan if plan and len(plan["adapters"]) == 2 else None
    plan = await eventually_(planned, what="the plan of both adapters mounted")
    assert plan["baseModel"] == BASE and plan["pinned"] == [pinned]

    # The agent stages the pinned adapter from its file:// source (its sha256 checked) and
    # reports it; the plan pins it in the server, and the warmer has the server load and pin it.
    staged = c.staged
    node = await eventually_(lambda: staged(pinned), timeout=20, what="the pinned adapter staged")
    assert node["bytes"] > 0 and (c.cache_dir / pinned / "adapter_model.safetensors").is_file()
    assert not (c.cache_dir / cached).exists(), "an unpinned adapter outside a warm-up window is prestaged"

    async def warmed():
        rows = await c.rows()
        return rows if rows.get(pinned, {}).get("tier") == "gpu" and rows[pinned]["pinned"] else None
    rows = await eventually_(warmed, timeout=30, what="the pinned adapter resident and pinned")
    assert rows[cached]["tier"] == "source" and not rows[cached]["pinned"], rows[cached]

    # Both adapters and the base answer; the cold one is staged through the agent on its first
    # request, and reported as the plan's own stagings are.
    outputs = {}
    for model in (pinned, cached, BASE):
        status, body = await c.complete(model)
        assert status == 200, body
        outputs[model] = body["choices"][0]["text"]
    assert len(set(outputs.values())) == 3, f"an adapter changed nothing: {outputs}"
    await eventually_(lambda: staged(cached), timeout=20, what="the cold adapter staged")

    # The kubelet reports the Deployment's pod ready: the adapters turn Ready.
    await c.api.patch_status(DEPLOYMENTS, NS, BASE, {"readyReplicas": 1, "replicas": 1})

    async def ready(name):
        status = await c.status(name)
        return status if status.get("phase") == "Ready" else None
    status = await eventually_(lambda: ready(pinned), timeout=20, what="the pinned adapter Ready")
    assert status["pinned"] is True
    await eventually_(lambda: ready(cached), timeout=20, what="the cold adapter Ready")

    # kubectl delete: the plan drops it, the server stops serving it, the node's disk lets it
    # go, and the finalizer lets the object go.
    await c.api._request("DELETE", ADAPTERS.path(NS, cached))

    async def gone():
        return await c.api.get(ADAPTERS.path(NS, cached)) is None
    await eventually_(gone, timeout=20, what="the deleted adapter's object gone")

    async def unserved():
        status, body = await c.complete(cached)
        return body if status == 404 else None
    body = await eventually_(unserved, timeout=20, what="the deleted adapter no longer served")
    assert body["error"]["code"] == "model_not_found"
    await eventually_(lambda: asyncio.to_thread(lambda: not (c.cache_dir / cached).exists()),
                      timeout=20, what="the deleted adapter off the node's disk")
    status, body = await c.complete(pinned)
    assert status == 200 and body["choices"][0]["text"] == outputs[pinned]


@pytest.mark.parametrize("digest", [True, False], ids=["sha256", "no-sha256"])
async def test_a_new_version_rolls_out_to_the_node_and_the_server(cluster: Cluster, eventually_, tmp_path, digest):
    """GitOps changes an adapter's source and digest (or, for an adapter that gives none, its
    source alone): the node stages the new version under the same name, the server serves it
    (its old copy in GPU and host memory dropped), and the old version is not served again."""
    from loraplex.server.config import named_shape
    from loraplex.server.demo import DEMO_ADAPTERS, write_random_adapter

    c = cluster
    name = "sql-expert"
    spec = {"pinPolicy": "Always"} if digest else {"pinPolicy": "Always", "sha256": None}
    await c.apply_adapter(name, **spec)

    async def served_by(expected_sha):
        node = await c.node_state(name)
        if node.get("phase") != "Staged":
            return None
        meta = json.loads((c.cache_dir / name / ".loraplex.json").read_text())
        if meta["sha256"] != expected_sha:
            return None
        status, body = await c.complete(name)
        return body["choices"][0]["text"] if status == 200 else None
    old_sha = _sha256(c.adapter_dirs[name] / "adapter_model.safetensors")
    old_text = await eventually_(lambda: served_by(old_sha), timeout=30, what="version 1 served")

    r, alpha, targets, rslora = DEMO_ADAPTERS[name]
    v2 = tmp_path / "v2" / name
    write_random_adapter(v2, named_shape("tiny"), r=r, lora_alpha=alpha, target_modules=targets,
                         use_rslora=rslora, seed=99)
    await c.apply_adapter(name, v2, **spec)
    new_sha = _sha256(v2 / "adapter_model.safetensors")

    async def new_text():
        text = await served_by(new_sha)
        return text if text is not None and text != old_text else None
    await eventually_(new_text, timeout=30, what="version 2 served")
    rows = await c.rows()
    assert rows[name]["pinned"] and rows[name]["tier"] == "gpu"


async def test_a_warm_up_window_stages_and_loads_ahead_of_the_first_request(cluster: Cluster, eventually_):
    """A campaign's adapter with an open warm-up window is staged on the node and loaded into
    the server before anyone asks for it: its first request is a GPU hit."""
    c = cluster
    now = datetime.datetime.now(datetime.timezone.utc)
    window = {"start": (now - datetime.timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "end": (now + datetime.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")}
    await c.apply_adapter("poet", pinPolicy="Never", warmup=window)

    async def resident():
        row = (await c.rows()).get("poet", {})
        return row if row.get("tier") == "gpu" else None
    row = await eventually_(resident, timeout=30, what="the campaign's adapter resident before any request")
    assert not row["pinned"] and row["hits"] == 0
    status, body = await c.complete("poet")
    assert status == 200, body
    assert (await c.rows())["poet"]["hits"] == 1


async def test_a_rejected_adapter_is_never_served(cluster: Cluster, eventually_):
    """An adapter of a rank above the base's maxLoraRank is rejected in its status, left out
    of the plan, never staged, and a request for it is a 404 from the server."""
    c = cluster
    await c.apply_adapter("sql-expert")
    await c.apply_adapter("too-big", c.adapter_dirs["poet"], rank=64)

    async def rejected():
        status = await c.status("too-big")
        return status if status.get("phase") == "Rejected" else None
    status = await eventually_(rejected, what="too-big rejected")
    accepted = next(x for x in status["conditions"] if x["type"] == "Accepted")
    assert accepted["reason"] == "RankTooLarge", accepted

    async def planned():
        plan = await c.plan()
        return plan if plan and [a["name"] for a in plan["adapters"]] == ["sql-expert"] else None
    await eventually_(planned, what="a plan without too-big")
    status, body = await c.complete("too-big")
    assert status == 404 and body["error"]["code"] == "model_not_found", body
    assert not (c.cache_dir / "too-big").exists()


async def test_a_session_start_at_the_node_agent_makes_the_first_request_a_hit(cluster: Cluster, eventually_):
    """POST /v1/sessions on the node's agent (a client opening a conversation): the adapter
    is staged on the node and loaded into the node's servers before its first request."""
    c = cluster
    await c.apply_adapter("poet", pinPolicy="Never")

    async def planned():
        plan = await c.plan()
        return plan if plan and [a["name"] for a in plan["adapters"]] == ["poet"] else None
    await eventually_(planned, what="poet planned")

    async def warmed():  # the agent warms the server once it sees it ready (nothing to pin here)
        status, _ = await _get(c.http, f"{c.agent_url}/v1/adapters")
        return status == 200 and "poet" in await c.rows()
    await eventually_(warmed, what="the server knows poet from its plan")
    assert (await c.rows())["poet"]["tier"] == "source"
    async with c.http.post(f"{c.agent_url}/v1/sessions", json={"model": "poet"}) as r:
        body = await r.json()
        assert r.status == 200, body
    assert body["adapter"]["name"] == "poet" and [s["ok"] for s in body["servers"]] == [True]

    async def resident():
        row = (await c.rows()).get("poet", {})
        return row if row.get("tier") == "gpu" else None
    row = await eventually_(resident, what="poet resident after the session start")
    assert row["hits"] == 0
    status, _ = await c.complete("poet")
    assert status == 200 and (await c.rows())["poet"]["hits"] == 1


async def test_a_priority_change_moves_the_servers_pins(cluster: Cluster, eventually_):
    """Two adapters compete for one pinned slot (pinnedPercent of the plan's slots): raising
    one's priority moves the pin, in the plan and in the server, without a restart."""
    c = cluster
    await c.api.merge_patch(BASE_MODELS.path(NS, BASE), {"spec": {"pinnedPercent": 1}})  # 2 of 250 slots
    await c.apply_adapter("sql-expert", priority=10)
    await c.apply_adapter("poet", priority=5)
    await c.apply_adapter("pirate", priority=1)

    async def pinned_in_server(names):
        plan = await c.plan()
        rows = await c.rows()
        pinned = {n for n, row in rows.items() if row["pinned"]}
        return plan if plan and sorted(plan["pinned"]) == names and pinned == set(names) else None
    await eventually_(lambda: pinned_in_server(["poet", "sql-expert"]), timeout=20, what="the first pins")
    await c.apply_adapter("pirate", priority=50)
    await eventually_(lambda: pinned_in_server(["pirate", "sql-expert"]), timeout=20, what="the pin moved")
    rows = await c.rows()
    assert rows["pirate"]["tier"] == "gpu" and not rows["poet"]["pinned"]


async def test_two_namespaces_serve_their_own_adapters_of_one_name(cluster: Cluster, eventually_, tmp_path):
    """Another tenant's namespace on the same node has its own "sql-expert": its server asks
    the same node agent for it, which stages it in that namespace's folder. Each server
    serves its namespace's version, and neither folder holds the other's (before, the node's
    cache was keyed by name: the two versions replaced each other)."""
    from loraplex.server.api.app import create_app as create_server_app
    from loraplex.server.config import named_shape
    from loraplex.server.demo import DEMO_ADAPTERS, write_random_adapter
    from loraplex.server.engine import LLMEngine

    c = cluster
    await c.apply_adapter("sql-expert")

    async def served_here():
        status, body = await c.complete("sql-expert")
        return body["choices"][0]["text"] if status == 200 else None
    ours = await eventually_(served_here, timeout=20, what="ml's sql-expert served")

    # The other tenant: its own plan (written by hand here) and server, the same node agent.
    r, alpha, targets, rslora = DEMO_ADAPTERS["sql-expert"]
    theirs_dir = tmp_path / "other" / "sql-expert"
    write_random_adapter(theirs_dir, named_shape("tiny"), r=r, lora_alpha=alpha, target_modules=targets,
                         use_rslora=rslora, seed=1234)
    plan = tmp_path / "other-plan.json"
    plan.write_text(json.dumps({"baseModel": BASE, "pinned": [], "prefetch": [], "adapters": [
        {"name": "sql-expert", "source": theirs_dir.as_uri(), "sha256": _sha256(theirs_dir / "adapter_model.safetensors")}]}))
    node_cache = c.cache_dir.parent.parent
    other_dir = node_cache / ".namespaces" / "other"
    settings = dataclasses.replace(c.server_settings, plan_file=str(plan), adapter_cache_dir=str(other_dir),
                                   adapter_namespace="other")
    engine = await asyncio.to_thread(LLMEngine.from_settings, settings)
    port = _free_port()
    async with _Server(create_server_app(engine), port):
        status, body = await _complete(c.http, f"http://127.0.0.1:{port}", "sql-expert")
        assert status == 200, body
        theirs = body["choices"][0]["text"]
    assert theirs != ours, "the other namespace was served ml's adapter"
    assert (await served_here()) == ours
    meta = {d.name: json.loads((d / "sql-expert" / ".loraplex.json").read_text())["sha256"]
            for d in (c.cache_dir, other_dir)}
    assert meta == {"ml": _sha256(c.adapter_dirs["sql-expert"] / "adapter_model.safetensors"),
                    "other": _sha256(theirs_dir / "adapter_model.safetensors")}


async def test_an_adapter_whose_files_do_not_match_its_digest_fails_clearly_everywhere(cluster: Cluster,
                                                                                     eventually_):
    """A LoRAAdapter whose sha256 is not its weights' (a wrong digest in GitOps, or a source
    changed under it): the node refuses to stage it and says why on the adapter's status; a
    request for it fails with that reason in the OpenAI error shape; the other adapters are
    served on."""
    c = cluster
    await c.apply_adapter("sql-expert")
    await c.apply_adapter("poet", sha256="0" * 64, pinPolicy="Always")

    async def failed_on_node():
        node = await c.node_state("poet")
        return node if node.get("phase") == "Failed" else None
    node = await eventually_(failed_on_node, timeout=20, what="poet failed on the node")
    assert node["message"].startswith("DigestMismatch: ")

    async def answered():  # once the server has read the plan (its mount lags the API)
        status, body = await c.complete("poet")
        return (status, body) if status != 404 else None
    status, body = await eventually_(answered, what="the server's answer for poet")
    assert status == 500 and body["error"]["code"] == "adapter_load_failed", body
    assert "sha256" in body["error"]["message"]
    assert not (c.cache_dir / "poet").exists()
    status, body = await c.complete("sql-expert")
    assert status == 200, body


async def test_a_restarted_server_and_node_agent_pick_up_where_they_were(cluster: Cluster, eventually_):
    """The server pod restarts (a new process: nothing in memory) and so does the node agent:
    the pinned adapter is loaded again from the node's disk, not downloaded again, and a cold
    adapter staged before the restart is served from disk too."""
    c = cluster
    await c.apply_adapter("sql-expert", pinPolicy="Always")
    await c.apply_adapter("pirate", pinPolicy="Never")

    async def pinned_resident():
        row = (await c.rows()).get("sql-expert", {})
        return row if row.get("tier") == "gpu" and row.get("pinned") else None
    await eventually_(pinned_resident, timeout=30, what="the pin resident")
    status, body = await c.complete("pirate")
    assert status == 200, body
    before = {n: (c.cache_dir / n / ".loraplex.json").stat().st_ino for n in ("sql-expert", "pirate")}

    await c.restart_agent()
    await c.restart_server()
    await eventually_(pinned_resident, timeout=30, what="the pin resident again")
    rows = await c.rows()
    assert rows["pirate"]["tier"] == "disk", rows["pirate"]  # found on the node's disk, not fetched
    status, body = await c.complete("pirate")
    assert status == 200, body
    after = {n: (c.cache_dir / n / ".loraplex.json").stat().st_ino for n in ("sql-expert", "pirate")}
    assert after == before, "a restart staged the node's adapters again"
    status, agent = await _get(c.http, f"{c.agent_url}/v1/adapters")
    assert status == 200 and {(a["namespace"], a["name"]) for a in agent["adapters"]} == {
        (NS, "sql-expert"), (NS, "pirate")} and agent["errors"] == {}


async def test_a_full_node_disk_evicts_the_least_recently_used_and_keeps_the_pin(cluster: Cluster, eventually_):
    """The node's disk budget holds the pinned adapter and one other: staging a third evicts
    the least recently used unpinned one from disk (its status entry for the node goes), the
    pin stays, and the server still answers for all three (the evicted one from its own
    memory tiers)."""
    c = cluster
    size = {n: sum(f.stat().st_size for f in c.adapter_dirs[n].iterdir()) for n in ("poet", "sql-expert", "pirate")}
    c.agent_config = dataclasses.replace(c.agent_config, budget_bytes=sum(size.values()) - 1)  # not all three
    await c.restart_agent()
    await c.apply_adapter("poet", pinPolicy="Always")
    await c.apply_adapter("sql-expert", pinPolicy="Never")
    await c.apply_adapter("pirate", pinPolicy="Never")
    staged = c.staged
    await eventually_(lambda: staged("poet"), timeout=20, what="the pin staged")

    async def answered(name):
        status, body = await c.complete(name)
        return body if status == 200 else None
    await eventually_(lambda: answered("sql-expert"), timeout=20, what="sql-expert served")
    await eventually_(lambda: staged("sql-expert"), timeout=20, what="sql-expert staged")
    await eventually_(lambda: answered("pirate"), timeout=20, what="pirate served")
    await eventually_(lambda: staged("pirate"), timeout=20, what="pirate staged")

    async def evicted():
        return (not (c.cache_dir / "sql-expert").exists() and await c.node_state("sql-expert") == {}) or None
    await eventually_(evicted, timeout=20, what="sql-expert evicted from the node's disk and its status")
    assert (c.cache_dir / "poet").exists() and (c.cache_dir / "pirate").exists()
    for name in ("poet", "sql-expert", "pirate"):
        assert await answered(name) is not None, name


AGENT_NS = "loraplex-system"  # the chart's release namespace: the node agents' and the mirrors'


async def test_an_agent_that_discovers_plans_follows_a_base_applied_after_it_started(
        api, emulator, kubeconfig, crds, operator_runner, eventually_, tmp_path):
    """The chart's default: the operator mirrors each plan into the agents' namespace and the
    agent, started with --plan-selector alone (no plan named, no helm upgrade), finds the plan
    of a BaseModel applied after it started: its pin is staged ahead and reported Staged on the
    LoRAAdapter in the BaseModel's namespace, a cold adapter staged on its first request is
    reported too (the found plan guards and reports its namespace's adapters), both are served.
    Deleting the BaseModel deletes the mirror; the agent lets the plan go and its adapters leave
    the node's disk and their status as adapters that leave a plan do."""
    from loraplex.server.demo import build_demo
    from loraplex.server.settings import ServerSettings

    base_dir, adapter_dirs = build_demo(tmp_path / "demo")
    plan_mount = tmp_path / "plan" / "plan.json"
    plan_mount.parent.mkdir()
    node_cache = tmp_path / "node-cache"
    cache_dir = Path(namespace_cache_dir(NS).replace(ADAPTER_CACHE_DIR, str(node_cache), 1))
    server_url, agent_url = f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
    agent_config = AgentConfig(cache_dir=node_cache, budget_bytes=10**9, server_urls=(server_url,), node_name=NODE,
                               namespace=AGENT_NS, kube_api_url=emulator.base_url,
                               plan_selector="loraplex.io/plan-mirror=true", plan_namespace=AGENT_NS,
                               poll_seconds=0.1, server_poll_seconds=0.1)
    settings = ServerSettings(model=str(base_dir), served_model_name=BASE, device="cpu", dtype="float32",
                              max_num_seqs=4, max_model_len=128, max_loras=4, max_lora_rank=16,
                              plan_file=str(plan_mount), adapter_cache_dir=str(cache_dir),
                              adapter_namespace=NS, node_agent_url=agent_url)
    mirror = CONFIG_MAPS.path(AGENT_NS, f"{NS}.{BASE}-plan")
    record = node_cache / f".plan-adapters.{NS}.{BASE}-plan.json"
    stop = asyncio.Event()
    async with operator_runner(mirror_namespace=AGENT_NS), aiohttp.ClientSession() as http:
        c = Cluster(api, http, server_url, agent_url, cache_dir, adapter_dirs, plan_mount, agent_config, settings)
        kubelet = asyncio.create_task(_mount_plan(api, plan_mount, stop))
        try:
            await c.start_agent()
            status, body = await _get(http, f"{agent_url}/healthz")
            assert status == 200 and "plan-discovery" in body["tasks"], body
            # kubectl apply, after the agent started: no plan named on its command line.
            await api.create(BASE_MODELS.path(NS), _base_body())
            pinned, cold = "sql-expert", "pirate"
            await c.apply_adapter(pinned, pinPolicy="Always")
            await c.apply_adapter(cold, pinPolicy="Never")

            async def mirrored():
                cm = await api.get(mirror)
                return cm if cm and len(read_plan(cm)["adapters"]) == 2 else None
            cm = await eventually_(mirrored, what="the plan mirrored into the agents' namespace")
            assert cm["metadata"]["annotations"]["loraplex.io/plan-of"] == f"{NS}/{BASE}-plan"

            async def planned():
                plan = await c.plan()
                return plan if plan and len(plan["adapters"]) == 2 else None
            await eventually_(planned, what="the plan mounted")
            await c.start_server()

            node = await eventually_(lambda: c.staged(pinned), timeout=20, what="the pin staged and reported")
            assert node["bytes"] > 0 and (cache_dir / pinned / "adapter_model.safetensors").is_file()
            assert json.loads(record.read_text())["pinned"] == [pinned]

            async def warmed():
                row = (await c.rows()).get(pinned, {})
                return row if row.get("tier") == "gpu" and row.get("pinned") else None
            await eventually_(warmed, timeout=30, what="the pin resident and pinned in the server")
            for model in (pinned, cold):
                status, body = await c.complete(model)
                assert status == 200, body
            await eventually_(lambda: c.staged(cold), timeout=20, what="the cold adapter staged and reported")
            status, agent = await _get(http, f"{agent_url}/v1/adapters")
            assert agent["errors"] == {} and {(a["namespace"], a["name"]) for a in agent["adapters"]} == {
                (NS, pinned), (NS, cold)}

            # kubectl delete basemodel: the mirror goes with it, and the agent lets the plan go.
            await api._request("DELETE", BASE_MODELS.path(NS, BASE))

            async def unmirrored():
                return await api.get(mirror) is None and await api.get(BASE_MODELS.path(NS, BASE)) is None
            await eventually_(unmirrored, timeout=20, what="the mirror deleted with its BaseModel")

            async def let_go():
                on_disk = await asyncio.to_thread(lambda: [n for n in (pinned, cold) if (cache_dir / n).exists()])
                return not on_disk and await c.node_state(pinned) == {} and await c.node_state(cold) == {}
            await eventually_(let_go, timeout=20, what="the plan's adapters off the node and their status")
            assert not record.exists()
            status, body = await _get(http, f"{agent_url}/healthz")
            assert status == 200 and f"plan-watch {NS}/{BASE}-plan" not in body["tasks"], body
        finally:
            await c.stop()
            stop.set()
            await kubelet
