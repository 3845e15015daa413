"""The two ways to start the operator, as processes against the emulated API:
`loraplex-operator` (the console script) and `kopf run -m loraplex.operator`."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from loraplex.operator.cli import parse_args
from loraplex.operator.kube import BASE_MODELS, CONFIG_MAPS, Resource

BIN = pathlib.Path(sys.executable).parent
NS = "ml"
NAMESPACES = Resource("", "v1", "namespaces")


def test_flags_map_onto_settings():
    settings = parse_args(["-n", "ml", "--namespace", "research-*", "-v", "--liveness", "http://0.0.0.0:8080/healthz"])
    assert settings.namespaces == ("ml", "research-*") and settings.verbose
    assert settings.liveness == "http://0.0.0.0:8080/healthz"
    assert parse_args([]).namespaces == ()


def test_operator_package_imports_no_torch():
    code = "import sys, loraplex.operator, loraplex.operator.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("command", [
    [str(BIN / "loraplex-operator"), "--namespace", NS],
    [str(BIN / "kopf"), "run", "-m", "loraplex.operator", "--standalone", "--namespace", NS],
], ids=["loraplex-operator", "kopf-run-m"])
async def test_operator_process_writes_a_plan(command, api, kubeconfig, crds, tmp_path, eventually_):
    # With --namespace, kopf watches namespaces and starts its watchers once this one exists.
    await api.create(NAMESPACES.path(None), {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    await api.create(BASE_MODELS.path(NS), {
        "apiVersion": "loraplex.io/v1alpha1", "kind": "BaseModel", "metadata": {"name": "tiny", "namespace": NS},
        "spec": {"source": "file:///models/tiny", "maxLoraRank": 8, "memory": {"slots": 4}}})
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    proc = await asyncio.create_subprocess_exec(*command, cwd=tmp_path, env=env,
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        cm = await eventually_(lambda: api.get(CONFIG_MAPS.path(NS, "tiny-plan")), timeout=20,
                               what="the plan ConfigMap from the operator process")
        assert json.loads(cm["data"]["plan.json"])["slots"] == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout=15)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise


async def test_client_logs_in_again_on_401(emulator):
    """A rotated service-account token: the first answer is 401, the client re-reads credentials."""
    import kopf

    from loraplex.operator.kube import KubeClient

    emulator["get", "/api/v1/namespaces/ml/configmaps/x"][:1] << 401
    logins = []

    def relogin() -> kopf.ConnectionInfo:
        logins.append(1)
        return kopf.ConnectionInfo(server=emulator.base_url, token="fresh")

    client = KubeClient(kopf.ConnectionInfo(server=emulator.base_url, token="stale"), relogin=relogin)
    try:
        assert await client.get(CONFIG_MAPS.path(NS, "x")) is None  # 401, re-login, then a real 404
        assert logins == [1]
        assert [r.headers.get("Authorization") for r in emulator._requests][-2:] == ["Bearer stale", "Bearer fresh"]
    finally:
        await client.close()


async def test_ensure_moves_a_growing_plan_from_data_to_binary_data(api):
    """The same ConfigMap, rewritten when the plan outgrows plain text: data is dropped."""
    from loraplex.operator.specs import BaseModelSpec
    from loraplex.operator.workloads import plan_config_map, read_plan

    base = BaseModelSpec(name="big", namespace=NS, source="/m", max_lora_rank=8)
    small = plan_config_map(base, json.dumps({"adapters": []}))
    assert await api.ensure(small) == "created"
    assert await api.ensure(small) == "unchanged"
    large_doc = {"adapters": [{"name": f"a{i:05d}", "sha256": f"{i:064x}"} for i in range(12_000)]}
    large = plan_config_map(base, json.dumps(large_doc))
    assert await api.ensure(large) == "patched"
    stored = await api.get(CONFIG_MAPS.path(NS, "big-plan"))
    assert "data" not in stored and read_plan(stored) == large_doc
    assert stored["metadata"]["annotations"]["loraplex.io/plan-encoding"] == "gzip"
    assert await api.ensure(large) == "unchanged"
