"""API keys and tenants across the parts, as an operator deploys them, every part real.

    Secrets (an admin key; a tenants' keys file) and a BaseModel whose serving.apiKeys names
    them, two LoRAAdapters of two tenants (acme, globex), created through the emulated API
      -> the kopf operator (in-process) writes the plan (each adapter's tenant in it) and the
         Deployment (both Secrets' items as files of one projected volume, --api-key-file and
         --api-keys-file on the command line)
      -> the test plays the kubelet: the server is started from that Deployment's container
         args and env alone (env resolved from the downward API, $(VAR)s expanded, each
         volume a folder: the Secrets' items real files, the node's hostPaths
         under a folder standing for the node's disk, the plan ConfigMap a file kept in step)
      -> the node agent, given the servers' admin key as the chart gives it (its
         nodeAgent.serverApiKeySecret mounted for --server-api-key-file; or, among other
         teams' keys, nodeAgent.serverApiKeysSecret mounted whole for --server-api-keys-dir),
         stages and warms the server: its prefetches and pins are taken, where the same calls
         without a key are 401
      -> over HTTP: no key is a 401 under /v1/, each tenant's key sees the base and its own
         adapter only (another tenant's is a model that does not exist), the admin keys see
         both, the probes and /metrics need no key, a tenant's key may not pin
      -> the admin key rotated: both Secrets changed through the API and their mounts
         updated as the kubelet does (a new folder swapped in): the old key is a 401, the new
         one an admin's, and the agent warms with it, neither process restarted.

The server runs on the CPU (a tiny random Llama), as in test_system_e2e.py, whose helpers
this reuses.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.operator.kube import BASE_MODELS, DEPLOYMENTS, KubeClient, Resource
from loraplex.operator.workloads import (ADAPTER_CACHE_DIR, ADMIN_KEY_FILE, API_KEYS_FILE, NODE_AGENT_PORT, PLAN_FILE,
                                         SERVER_PORT, namespace_cache_dir)

from .test_system_e2e import BASE, NODE, NS, Cluster, _base_body, _free_port, _mount_plan

pytestmark = pytest.mark.slow

SECRETS = Resource("", "v1", "secrets")
AGENT_NS = "loraplex-system"  # the chart's release namespace, where nodeAgent.serverApiKeySecret lives
ADMIN_KEY = "sk-admin-e2e-0123456789"
NEW_ADMIN_KEY = "sk-admin-e2e-rotated-9876543210"
OPS_KEY = "sk-ops-e2e-0123456789"  # a key of tenant "*" in the keys file: an admin key too
TENANT_KEYS = {"acme": "sk-acme-e2e-0123456789", "globex": "sk-globex-e2e-0123456789"}
# {tenant: its adapter}, each LoRAAdapter's spec.tenant.
ADAPTER_OF = {"acme": "sql-expert", "globex": "poet"}


def _secret(namespace: str, name: str, data: dict[str, str]) -> dict[str, Any]:
    """A Secret as `kubectl create secret generic` writes it: its values base64 in data."""
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace},
            "type": "Opaque", "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


async def _secret_value(api: KubeClient, namespace: str, name: str, key: str) -> bytes:
    secret = await api.get(SECRETS.path(namespace, name))
    assert secret is not None, f"Secret {namespace}/{name} is missing"
    return base64.b64decode(secret["data"][key])


def _keyed_base_body() -> dict[str, Any]:
    """test_system_e2e's BaseModel `tiny` with serving.apiKeys, four slots, the CPU engine's
    sizes, and the checkpoint at /models/tiny on the node (a hostPath volume: its folder name
    is the base's name in the API, as the server names a base after its --model folder)."""
    body = _base_body()
    spec = body["spec"]
    spec["memory"] = {"slots": 4}
    spec["serving"] |= {
        "engine": {"maxNumSeqs": 4, "maxModelLen": 128},
        "volumes": [{"name": "models", "hostPath": {"path": "/models", "type": "Directory"}}],
        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
        "apiKeys": {"adminKeySecret": {"name": "tiny-keys", "key": "admin-key"},
                    "tenantKeysSecret": {"name": "tiny-tenant-keys"}},
    }
    return body


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


async def _pod_view(api: KubeClient, deployment: dict[str, Any], node: Path, pod: Path,
                    node_ip: str) -> tuple[list[str], dict[str, str], dict[str, Path]]:
    """The kubelet's part for the Deployment's one container: (args, env, {mountPath: local
    folder}). Env from values, the downward API (status.hostIP) and secretKeyRefs; $(VAR) in
    args expanded from it (as Kubernetes does); hostPath volumes as folders under `node` (the
    node's root), Secret and projected volumes as their Secrets' items written into a folder
    of `pod` (_write_secret_items), and ConfigMap volumes as empty folders of `pod` (the test
    keeps the plan in its one)."""
    pod_spec = deployment["spec"]["template"]["spec"]
    (container,) = pod_spec["containers"]
    namespace = deployment["metadata"]["namespace"]
    env: dict[str, str] = {}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var["valueFrom"]:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP", var
            env[var["name"]] = node_ip
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = (await _secret_value(api, namespace, ref["name"], ref["key"])).decode()
    volumes: dict[str, Path] = {}
    for volume in pod_spec["volumes"]:
        if "hostPath" in volume:
            local = node / volume["hostPath"]["path"].lstrip("/")
            if volume["hostPath"].get("type") == "DirectoryOrCreate":
                local.mkdir(parents=True, exist_ok=True)
            assert local.is_dir(), f"hostPath {volume['hostPath']['path']} is not on the node"
        elif "secret" in volume or "projected" in volume:
            local = pod / "volumes" / volume["name"]
            local.mkdir(parents=True)
            await _write_secret_items(api, namespace, volume, local)
        elif "configMap" in volume:
            local = pod / "volumes" / volume["name"]
            local.mkdir(parents=True)
        else:
            raise AssertionError(f"a volume this kubelet does not know: {volume}")
        volumes[volume["name"]] = local
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}

    def in_pod(arg: str) -> str:
        for mount_path in sorted(mounts, key=len, reverse=True):  # the deepest mount first
            if arg == mount_path or arg.startswith(mount_path + "/"):
                return str(mounts[mount_path]) + arg[len(mount_path):]
        return arg

    args = [in_pod(_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), a)) for a in container["args"]]
    env = {k: in_pod(v) for k, v in env.items()}
    return args, env, mounts


def _secret_sources(volume: dict[str, Any]) -> list[tuple[str, list[dict[str, str]] | None]]:
    """(Secret name, items) of a Secret volume (items None: every key, as a file of its name),
    or of each Secret source of a projected one."""
    if "secret" in volume:
        return [(volume["secret"]["secretName"], volume["secret"].get("items"))]
    sources = volume["projected"]["sources"]
    assert all(set(src) <= {"secret", "serviceAccountToken"} and len(src) == 1 for src in sources), \
        f"a source this kubelet does not know: {sources}"
    return [(src["secret"]["name"], src["secret"]["items"]) for src in sources if "secret" in src]


async def _write_secret_items(api: KubeClient, namespace: str, volume: dict[str, Any], local: Path) -> None:
    """The volume's Secret items as files of `local`, each written beside and renamed into place
    (the kubelet swaps a new folder in: a reader never sees half a file)."""
    for name, items in _secret_sources(volume):
        if items is None:
            secret = await api.get(SECRETS.path(namespace, name))
            assert secret is not None, f"Secret {namespace}/{name} is missing"
            items = [{"key": key, "path": key} for key in secret["data"]]
        for item in items:
            tmp = local / f".{item['path']}.tmp"
            tmp.write_bytes(await _secret_value(api, namespace, name, item["key"]))
            tmp.replace(local / item["path"])
    # A projected service-account token: the kubelet asks the API for one; a stand-in here.
    for src in volume.get("projected", {}).get("sources", []):
        if "serviceAccountToken" in src:
            (local / src["serviceAccountToken"]["path"]).write_text(f"sa-token:{namespace}:default")


async def _call(http: aiohttp.ClientSession, method: str, url: str, key: str | None = None,
                body: Any = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.request(method, url, headers=headers, json=body) as r:
        text = await r.text()
        with contextlib.suppress(ValueError):
            return r.status, json.loads(text)
        return r.status, text


def _server_calls(metrics_text: str) -> dict[tuple[str, str], float]:
    """The node agent's loraplex_node_agent_server_calls_total by (action, outcome)."""
    return {(s.labels["action"], s.labels["outcome"]): s.value
            for family in text_string_to_metric_families(metrics_text)
            if family.name == "loraplex_node_agent_server_calls"
            for s in family.samples if s.name.endswith("_total")}


@pytest.mark.parametrize("agent_keys", ["one key", "per BaseModel"])
async def test_api_keys_and_tenants_from_the_secrets_to_the_served_api(
        api, emulator, operator, eventually_, tmp_path, monkeypatch, agent_keys):
    """The agent's key for the servers as the chart gives it: one key for all
    (nodeAgent.serverApiKeySecret), or this BaseModel's among other teams' in one Secret
    mounted whole (nodeAgent.serverApiKeysSecret), where the one key for all beside it is
    not this server's."""
    from loraplex.node_agent.cli import Settings as AgentSettings
    from loraplex.server.demo import build_demo
    from loraplex.server.engine import check_settings
    from loraplex.server.settings import ServerSettings

    node = tmp_path / "node"  # the node's root: its hostPaths
    base_dir, adapter_dirs = build_demo(tmp_path / "demo")
    (node / "models").mkdir(parents=True)
    base_dir.rename(node / "models" / BASE)  # the BaseModel's checkpoint, where its hostPath volume mounts it

    # kubectl create secret, then apply the BaseModel and the two tenants' adapters.
    keys_file = {TENANT_KEYS["acme"]: "acme", TENANT_KEYS["globex"]: "globex", OPS_KEY: "*"}
    await api.create(SECRETS.path(NS), _secret(NS, "tiny-keys", {"admin-key": ADMIN_KEY}))
    await api.create(SECRETS.path(NS), _secret(NS, "tiny-tenant-keys", {"keys.json": json.dumps(keys_file)}))
    per_base = agent_keys == "per BaseModel"
    # The agents' Secret, and the key in it that is this BaseModel's servers' admin key.
    agent_secret, agent_key = ("loraplex-team-keys", f"{NS}.{BASE}") if per_base else \
        ("loraplex-server-api-key", "api-key")
    agent_data = {agent_key: ADMIN_KEY, **({"other-team": "sk-other-team-e2e-0123"} if per_base else {})}
    await api.create(SECRETS.path(AGENT_NS), _secret(AGENT_NS, agent_secret, agent_data))
    await api.create(BASE_MODELS.path(NS), _keyed_base_body())

    async def written():
        dep = await api.get(DEPLOYMENTS.path(NS, BASE))
        return dep if dep and "api-keys" in {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]} else None
    deployment = await eventually_(written, what="the Deployment with the keys' Secret volume")

    # The kubelet starts the server's container: its args and env, the volumes as folders.
    args, env, mounts = await _pod_view(api, deployment, node, tmp_path / "pod", node_ip="127.0.0.1")
    assert ADMIN_KEY not in " ".join(args) and "--api-key" not in args and ADMIN_KEY not in env.values()
    keys_path = Path(args[args.index("--api-keys-file") + 1])
    assert keys_path == mounts[API_KEYS_FILE.rsplit("/", 1)[0]] / "keys.json"
    assert json.loads(keys_path.read_text()) == keys_file
    admin_path = Path(args[args.index("--api-key-file") + 1])  # tiny-keys' admin-key, as a file
    assert admin_path == mounts[ADMIN_KEY_FILE.rsplit("/", 1)[0]] / "admin-key"
    assert admin_path.read_text() == ADMIN_KEY
    plan_mount = Path(args[args.index("--plan-file") + 1])
    assert plan_mount == mounts[PLAN_FILE.rsplit("/", 1)[0]] / "plan.json"
    cache_dir = Path(args[args.index("--adapter-cache-dir") + 1])
    # The pod's network namespace is the host's here: the container's port is a free one, and
    # the node agent's hostPort (the DaemonSet's) is where the test's agent listens.
    server_port, agent_port = _free_port(), _free_port()
    assert args[args.index("--port") + 1] == str(SERVER_PORT)
    args[args.index("--port") + 1] = str(server_port)
    agent_arg = args.index("--node-agent-url") + 1
    assert args[agent_arg] == f"http://127.0.0.1:{NODE_AGENT_PORT}"
    args[agent_arg] = f"http://127.0.0.1:{agent_port}"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = ServerSettings.from_env_and_args(args)
    check_settings(settings)  # as loraplex-server does before it loads anything
    assert (settings.api_key, settings.api_key_file, settings.api_keys_file) == \
        (None, str(admin_path), str(keys_path))
    assert (Path(settings.model).name, settings.max_loras, settings.adapter_namespace) == (BASE, 4, NS)

    stop = asyncio.Event()
    kubelet = asyncio.create_task(_mount_plan(api, plan_mount, stop))
    # The DaemonSet's agent: its command line, and the key as the chart mounts it from its Secret.
    node_cache = node / ADAPTER_CACHE_DIR.lstrip("/")
    assert cache_dir == node / namespace_cache_dir(NS).lstrip("/")  # the namespace's folder of the agent's cache
    if per_base:
        agent_volume = {"name": "server-api-keys", "secret": {"secretName": agent_secret}}  # every key
        agent_mount = tmp_path / "agent-pod" / "server-api-keys"
        key_args = ["--server-api-keys-dir", str(agent_mount), "--server-api-key", "sk-not-this-servers-e2e-key"]
    else:
        agent_volume = {"name": "server-api-key", "secret": {"secretName": agent_secret,
                                                             "items": [{"key": "api-key", "path": "api-key"}]}}
        agent_mount = tmp_path / "agent-pod" / "server-api-key"
        key_args = ["--server-api-key-file", str(agent_mount / "api-key")]
    agent_mount.mkdir(parents=True)
    await _write_secret_items(api, AGENT_NS, agent_volume, agent_mount)
    agent_settings = AgentSettings.from_env_and_args(
        ["--cache-dir", str(node_cache), "--budget-bytes", str(10**9), "--plan-configmap", f"{NS}/{BASE}-plan",
         "--server-url", f"http://127.0.0.1:{server_port}", "--kube-api-url", emulator.base_url,
         "--poll-seconds", "0.1", "--server-poll-seconds", "0.1", *key_args],
        env={"NODE_NAME": NODE})
    agent_config = agent_settings.agent_config()
    if per_base:
        assert agent_config.server_api_keys_dir == agent_mount and (agent_mount / agent_key).read_text() == ADMIN_KEY
    else:
        assert agent_config.server_api_key is None and agent_config.server_api_key_file == agent_mount / "api-key"

    async with aiohttp.ClientSession() as http:
        server_url, agent_url = f"http://127.0.0.1:{server_port}", f"http://127.0.0.1:{agent_port}"
        c = Cluster(api, http, server_url, agent_url, cache_dir, adapter_dirs, plan_mount, agent_config, settings)
        try:
            for tenant, name in ADAPTER_OF.items():
                await c.apply_adapter(name, tenant=tenant, pinPolicy="Always")

            async def planned():
                plan = await c.plan()
                return plan if plan and len(plan["adapters"]) == 2 else None
            plan = await eventually_(planned, timeout=20, what="the plan of both adapters mounted")
            assert {a["name"]: a["tenant"] for a in plan["adapters"]} == {n: t for t, n in ADAPTER_OF.items()}
            assert sorted(plan["pinned"]) == sorted(ADAPTER_OF.values())

            # The agent first (a DaemonSet's pod is on the node before a server's): it stages
            # the pins; then the server, which the agent warms once it answers /readyz.
            await c.start_agent()
            for name in ADAPTER_OF.values():
                await eventually_(lambda: c.staged(name), timeout=20, what=f"{name} staged")
            await c.start_server()

            async def warmed():
                status, body = await _call(http, "GET", f"{agent_url}/metrics")
                calls = _server_calls(body) if status == 200 else {}
                done = all(calls.get((a, "ok"), 0) >= 2 for a in ("prefetch", "pin"))
                return calls if done else None
            # The server pins the plan's pins itself too (it follows the plan file): the agent's
            # own count of its calls, by outcome, is what shows that its warm-up got through.
            calls = await eventually_(warmed, timeout=30, what="the agent's prefetches and pins taken by the server")
            assert not {k: v for k, v in calls.items() if k[1] != "ok" and v}, calls

            async def resident():
                status, body = await _call(http, "GET", f"{server_url}/v1/adapters", ADMIN_KEY)
                rows = {r["name"]: r for r in body["data"]} if status == 200 else {}
                return rows if all(rows.get(n, {}).get("tier") == "gpu" and rows[n]["pinned"]
                                   for n in ADAPTER_OF.values()) else None
            rows = await eventually_(resident, timeout=30, what="both pins resident and pinned")
            assert {n: rows[n]["tenant"] for n in ADAPTER_OF.values()} == {n: t for t, n in ADAPTER_OF.items()}

            # Without the key, the agent's calls would have been refused.
            for action in ("prefetch?wait=false", "pin"):
                status, body = await _call(http, "POST", f"{server_url}/v1/adapters/sql-expert/{action}")
                assert status == 401 and body["error"]["code"] == "invalid_api_key", (action, body)

            # No key, or a key the server does not take: 401 under /v1/.
            for key in (None, "sk-not-a-key"):
                status, body = await _call(http, "GET", f"{server_url}/v1/models", key)
                assert status == 401 and body["error"]["code"] == "invalid_api_key", (key, body)
                status, body = await _call(http, "POST", f"{server_url}/v1/completions", key,
                                           {"model": BASE, "prompt": "SELECT", "max_tokens": 2})
                assert status == 401, (key, body)
            # The probes' paths and Prometheus' need none.
            for path in ("/healthz", "/readyz", "/metrics"):
                status, _ = await _call(http, "GET", f"{server_url}{path}")
                assert status == 200, path

            completion = {"prompt": "SELECT name FROM", "max_tokens": 4, "temperature": 0}
            for tenant, key in TENANT_KEYS.items():
                own = ADAPTER_OF[tenant]
                (other,) = set(ADAPTER_OF.values()) - {own}
                status, body = await _call(http, "GET", f"{server_url}/v1/models", key)
                assert status == 200 and {m["id"] for m in body["data"]} == {BASE, own}, (tenant, body)
                status, body = await _call(http, "GET", f"{server_url}/v1/adapters", key)
                assert status == 200 and {r["name"] for r in body["data"]} == {own}, (tenant, body)
                for model in (BASE, own):
                    status, body = await _call(http, "POST", f"{server_url}/v1/completions", key,
                                               {"model": model, **completion})
                    assert status == 200 and body["choices"][0]["text"], (tenant, model, body)
                # Another tenant's adapter is a model that does not exist, wherever it is named.
                status, body = await _call(http, "POST", f"{server_url}/v1/completions", key,
                                           {"model": other, **completion})
                assert status == 404 and body["error"]["code"] == "model_not_found", (tenant, body)
                status, body = await _call(http, "GET", f"{server_url}/v1/models/{other}", key)
                assert status == 404 and body["error"]["code"] == "model_not_found", (tenant, body)
                # Pinning needs an admin key, for the tenant's own adapter too.
                status, body = await _call(http, "POST", f"{server_url}/v1/adapters/{own}/pin", key)
                assert status == 403 and body["error"]["code"] == "admin_key_required", (tenant, body)

            for key in (ADMIN_KEY, OPS_KEY):  # --api-key-file's, and the keys file's tenant "*"
                status, body = await _call(http, "GET", f"{server_url}/v1/models", key)
                assert status == 200 and {m["id"] for m in body["data"]} == {BASE, *ADAPTER_OF.values()}, body
                for name in ADAPTER_OF.values():
                    status, body = await _call(http, "POST", f"{server_url}/v1/completions", key,
                                               {"model": name, **completion})
                    assert status == 200, (name, body)
                status, body = await _call(http, "POST", f"{server_url}/v1/adapters/poet/pin", key)
                assert status == 200 and body["pinned"], body

            # The admin key rotated: both Secrets through the API, then the kubelet's sync of the
            # mounts. Neither the server nor the agent restarts.
            for namespace, name, key in ((NS, "tiny-keys", "admin-key"), (AGENT_NS, agent_secret, agent_key)):
                await api.merge_patch(SECRETS.path(namespace, name),
                                      {"data": {key: base64.b64encode(NEW_ADMIN_KEY.encode()).decode()}})
            pod_volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
            await _write_secret_items(api, NS, pod_volumes["api-keys"], admin_path.parent)
            await _write_secret_items(api, AGENT_NS, agent_volume, agent_mount)
            assert admin_path.read_text() == NEW_ADMIN_KEY and json.loads(keys_path.read_text()) == keys_file

            async def rotated():
                old, _ = await _call(http, "GET", f"{server_url}/v1/models", ADMIN_KEY)
                new, _ = await _call(http, "POST", f"{server_url}/v1/adapters/poet/unpin", NEW_ADMIN_KEY)
                return (old, new) if (old, new) == (401, 200) else None
            await eventually_(rotated, timeout=10, what="the old admin key refused and the new one taken")
            # The agent warms with the new key once it has looked at its file again (at most a
            # second after the mount changed: until then it may send the old one, the window
            # README's "Rotating a key" closes with a key of tenant "*"); from then on every
            # warm-up is taken.
            async def session_warmed():
                status, body = await _call(http, "POST", f"{agent_url}/v1/sessions", None, {"model": "poet"})
                return body if status == 200 and body["servers"] and all(s["ok"] for s in body["servers"]) else None
            await eventually_(session_warmed, timeout=20, what="a session's prefetch taken with the rotated key")
            before = _server_calls((await _call(http, "GET", f"{agent_url}/metrics"))[1])
            assert await session_warmed() is not None
            after = _server_calls((await _call(http, "GET", f"{agent_url}/metrics"))[1])
            assert after.get(("prefetch", "ok"), 0) > before.get(("prefetch", "ok"), 0), (before, after)
            assert {k: v for k, v in after.items() if k[1] != "ok"} == {k: v for k, v in before.items() if k[1] != "ok"}
        finally:
            await c.stop()
            stop.set()
            await kubelet
