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
import hashlib
import json
import os
import socket
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from loraplex.node_agent.app import AgentConfig, create_app as create_agent_app
from loraplex.operator.kube import ADAPTERS, BASE_MODELS, CONFIG_MAPS, DEPLOYMENTS, KubeClient
from loraplex.operator.workloads import read_plan

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


def _adapter_body(name: str, path: Path, rank: int, targets: list[str], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "loraplex.io/v1alpha1", "kind": "LoRAAdapter", "metadata": {"name": name, "namespace": NS},
            "spec": {"baseModel": BASE, "source": path.as_uri(), "sha256": _sha256(path / "adapter_model.safetensors"),
                     "tenant": "acme", "priority": 10, "rank": rank, "targetModules": targets, **spec}}


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
async def _node_agent(config: AgentConfig):
    runner = web.AppRunner(create_agent_app(config))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_applied_adapters_are_planned_staged_warmed_served_and_removed(api, emulator, operator, eventually_,
                                                                            tmp_path):
    from loraplex.server.api.app import create_app as create_server_app
    from loraplex.server.demo import DEMO_ADAPTERS, build_demo
    from loraplex.server.engine import LLMEngine
    from loraplex.server.settings import ServerSettings

    base_dir, adapter_dirs = build_demo(tmp_path / "demo")
    pinned, cached = "sql-expert", "pirate"  # one pinned by its policy, one left to the cache
    for name, policy in ((pinned, "Always"), (cached, "Never")):
        r, _, targets, _ = DEMO_ADAPTERS[name]
        await api.create(ADAPTERS.path(NS), _adapter_body(name, adapter_dirs[name], r, targets, pinPolicy=policy))
    await api.create(BASE_MODELS.path(NS), _base_body())

    plan_mount = tmp_path / "plan" / "plan.json"
    plan_mount.parent.mkdir()
    stop = asyncio.Event()
    kubelet = asyncio.create_task(_mount_plan(api, plan_mount, stop))
    cache_dir = tmp_path / "node-cache"
    server_url = f"http://127.0.0.1:{_free_port()}"
    # The agent's --server-url stands in for finding the server pod on its node through the API.
    agent_config = AgentConfig(cache_dir=cache_dir, budget_bytes=10**9, plan_configmap=f"{NS}/{BASE}-plan",
                               server_urls=(server_url,), node_name=NODE, namespace=NS,
                               kube_api_url=emulator.base_url, poll_seconds=0.1, server_poll_seconds=0.1)
    try:
        async def mounted():
            if not plan_mount.exists():
                return None
            plan = json.loads(await asyncio.to_thread(plan_mount.read_text))
            return plan if len(plan["adapters"]) == 2 else None
        plan = await eventually_(mounted, what="the plan of both adapters mounted")
        assert plan["baseModel"] == BASE and plan["pinned"] == [pinned]
        assert sorted(a["name"] for a in plan["adapters"]) == sorted([pinned, cached])

        async with aiohttp.ClientSession() as http, _node_agent(agent_config) as agent_url:
            # A DaemonSet's pod is on the node before a server's: the pinned adapter is staged
            # from its file:// source (its sha256 checked) and reported on its status.
            async def staged_on_node(name):
                a = await api.get(ADAPTERS.path(NS, name))
                node = ((a.get("status") or {}).get("nodes") or {}).get(NODE) or {}
                return node if node.get("phase") == "Staged" else None
            node = await eventually_(lambda: staged_on_node(pinned), timeout=20, what="the pinned adapter staged")
            assert node["bytes"] > 0 and (cache_dir / pinned / "adapter_model.safetensors").is_file()
            assert not (cache_dir / cached).exists(), "an unpinned adapter outside a warm-up window is prestaged"

            settings = ServerSettings(model=str(base_dir), served_model_name=BASE, device="cpu", dtype="float32",
                                      max_num_seqs=4, max_model_len=128, max_loras=4, max_lora_rank=16,
                                      plan_file=str(plan_mount), adapter_cache_dir=str(cache_dir),
                                      node_agent_url=agent_url)
            engine = await asyncio.to_thread(LLMEngine.from_settings, settings)
            async with _Server(create_server_app(engine), int(server_url.rsplit(":", 1)[1])):
                # The plan pins it, and the warmer, finding the server ready, loads and pins it too.
                async def warmed():
                    status, body = await _get(http, f"{server_url}/v1/adapters")
                    rows = {row["name"]: row for row in body["data"]} if status == 200 else {}
                    row = rows.get(pinned)
                    return rows if row and row["tier"] == "gpu" and row["pinned"] else None
                rows = await eventually_(warmed, timeout=30, what="the pinned adapter resident and pinned")
                assert rows[cached]["tier"] == "source" and not rows[cached]["pinned"], rows[cached]

                # Both adapters and the base answer; the cold one is staged through the agent
                # on its first request.
                outputs = {}
                for model in (pinned, cached, BASE):
                    status, body = await _complete(http, server_url, model)
                    assert status == 200, body
                    outputs[model] = body["choices"][0]["text"]
                assert len(set(outputs.values())) == 3, f"an adapter changed nothing: {outputs}"
                await eventually_(lambda: staged_on_node(cached), timeout=20, what="the cold adapter staged")

                # The kubelet reports the Deployment's pod ready: the adapters turn Ready.
                await api.patch_status(DEPLOYMENTS, NS, BASE, {"readyReplicas": 1, "replicas": 1})

                async def ready(name):
                    status = (await api.get(ADAPTERS.path(NS, name))).get("status") or {}
                    return status if status.get("phase") == "Ready" else None
                status = await eventually_(lambda: ready(pinned), timeout=20, what="the pinned adapter Ready")
                assert status["pinned"] is True

                # kubectl delete: the plan drops it, the server stops serving it, the node's
                # disk lets it go, and the finalizer lets the object go.
                await api._request("DELETE", ADAPTERS.path(NS, cached))

                async def gone():
                    return await api.get(ADAPTERS.path(NS, cached)) is None
                await eventually_(gone, timeout=20, what="the deleted adapter's object gone")

                async def unserved():
                    status, body = await _complete(http, server_url, cached)
                    return body if status == 404 else None
                body = await eventually_(unserved, timeout=20, what="the deleted adapter no longer served")
                assert body["error"]["code"] == "model_not_found"
                await eventually_(lambda: asyncio.to_thread(lambda: not (cache_dir / cached).exists()),
                                  timeout=20, what="the deleted adapter off the node's disk")
                status, body = await _complete(http, server_url, pinned)
                assert status == 200 and body["choices"][0]["text"] == outputs[pinned]
    finally:
        stop.set()
        await kubelet
