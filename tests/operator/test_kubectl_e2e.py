"""A new user's path, driven by kubectl 1.32 against the emulated API, operator running:

    kubectl apply -f crds/   ->   kubectl apply -k examples/   ->   kubectl wait / get / patch / delete

The operator starts before the CRDs exist and must pick them up. (`kubectl apply -f examples/`
would send kustomization.yaml to the server as an object; `-k` is how the folder is applied.)
What an emulator cannot prove is listed in emulator.py: the API server's schema validation
and defaulting, RBAC, admission, and pods running.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NS = "loraplex-demo"

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")


@pytest.fixture()
def kubectl(kubeconfig: pathlib.Path, tmp_path: pathlib.Path):
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "HOME": str(tmp_path), "KUBECACHEDIR": str(tmp_path / "cache")}

    async def run(*args: str, timeout: float = 30.0, check: bool = True) -> str:
        proc = await asyncio.create_subprocess_exec(
            "kubectl", *args, cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout=timeout)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise AssertionError(f"kubectl {' '.join(args)} took longer than {timeout}s")
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {err.decode()}")
        return out.decode()
    return run


async def plan(kubectl) -> dict:
    text = await kubectl("get", "configmap", "llama-3-8b-plan", "-n", NS, "-o", r"jsonpath={.data.plan\.json}")
    return json.loads(text)


async def test_a_user_applies_the_examples_with_kubectl(kubectl, operator_runner, eventually_):
    async with operator_runner():
        await kubectl("apply", "-f", "crds/")
        await kubectl("wait", "--for=condition=Established", "crd/basemodels.loraplex.io",
                      "crd/loraadapters.loraplex.io", "--timeout=10s")
        applied = await kubectl("apply", "-k", "examples/")
        assert "basemodel.loraplex.io/llama-3-8b created" in applied

        await kubectl("wait", "--for=jsonpath={.status.phase}=Planned", "basemodel/llama-3-8b", "-n", NS,
                      "--timeout=20s", timeout=30)
        await kubectl("wait", "--for=condition=Accepted", "loraadapters", "--all", "-n", NS, "--timeout=20s",
                      timeout=30)
        first = await eventually_(lambda: plan(kubectl), what="the plan ConfigMap")
        # examples/basemodel.yaml's comment: 1222 slots, 122 may be pinned; Never is never pinned.
        assert first["slots"] == 1222 and first["maxLoraRank"] == 16
        assert first["pinned"] == ["acme-summarise", "acme-support", "globex-holiday-campaign"]
        assert [a["name"] for a in first["adapters"]] == [
            "acme-summarise", "acme-support", "globex-holiday-campaign", "globex-sandbox"]

        table = await kubectl("get", "loraadapters", "-n", NS)
        header, *rows = table.strip().splitlines()
        assert header.split() == ["NAME", "BASE", "TENANT", "PRIORITY", "PHASE", "PINNED", "AGE"]
        sandbox = next(r.split() for r in rows if r.startswith("globex-sandbox"))
        assert sandbox[1:6] == ["llama-3-8b", "globex", "0", "Accepted", "false"]
        assert (await kubectl("get", "basemodel", "llama-3-8b", "-n", NS, "-o", "jsonpath={.status.slots}")) == "1222"
        workloads = await kubectl("get", "deployment,service", "-n", NS, "-o", "name")
        assert set(workloads.split()) == {"deployment.apps/llama-3-8b", "service/llama-3-8b"}

        await kubectl("patch", "loraadapter", "globex-sandbox", "-n", NS, "--type=merge",
                      "-p", '{"spec": {"pinPolicy": "Auto", "priority": 1000}}')

        async def sandbox_pinned():
            current = await plan(kubectl)
            return current if "globex-sandbox" in current["pinned"] else None
        await eventually_(sandbox_pinned, what="globex-sandbox pinned")
        await kubectl("wait", "--for=jsonpath={.status.pinned}=true", "loraadapter/globex-sandbox", "-n", NS,
                      "--timeout=10s", timeout=20)

        await kubectl("delete", "loraadapter", "acme-summarise", "-n", NS, "--timeout=20s", timeout=30)

        async def summarise_gone():
            current = await plan(kubectl)
            return current if "acme-summarise" not in [a["name"] for a in current["adapters"]] else None
        await eventually_(summarise_gone, what="acme-summarise out of the plan")
        left = await kubectl("get", "loraadapters", "-n", NS, "-l", "app.kubernetes.io/part-of=loraplex-demo",
                             "-o", "name")
        assert "acme-summarise" not in left and "acme-support" in left


async def test_kubectl_get_basemodels_shows_a_failed_base(kubectl, api, operator, eventually_):
    """A base the operator cannot size (no memory figures: SizeUnknown) serves no adapter;
    `kubectl get basemodels` must say so, not only leave its columns blank or zero."""
    from loraplex.operator.kube import BASE_MODELS

    from .test_operator_e2e import NS as ML, base_body

    await api.create(BASE_MODELS.path(ML), base_body("sized"))
    await api.create(BASE_MODELS.path(ML), base_body("unsized", memory={}))

    async def phases():
        table = await kubectl("get", "basemodels", "-n", ML)
        header, *rows = table.strip().splitlines()
        if "PHASE" not in header.split():
            return None
        start = header.index("PHASE")  # cells are aligned under their header; empty ones are blank
        found = {row.split()[0]: (row[start:].split() or [""])[0] for row in rows}
        return found if found == {"sized": "Planned", "unsized": "Failed"} else None
    await eventually_(phases, what="a PHASE column: sized Planned, unsized Failed")
