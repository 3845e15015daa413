"""A plan that cannot be read is logged and the last good plan kept: the plan loop goes on
(it used to die on some, taking /healthz to 500 and the agent into a restart loop that the
same bad plan repeated, so the node stopped staging altogether)."""

from __future__ import annotations

import asyncio
import gzip
import json

import pytest

from loraplex.node_agent.kube import KubeAPI, PlanConfigMap
from loraplex.node_agent.store import AdapterStore
from loraplex.node_agent.tasks import TaskGuard
from loraplex.node_agent.warmer import Warmer

from .helpers import ConfigMapDir, plan_json


def _corrupt_gzip(doc: dict) -> bytes:
    """Gzip whose deflate stream is broken (zlib.error, not a gzip or EOF error)."""
    good = gzip.compress(json.dumps(doc).encode())
    return good[:10] + b"\xff" * 8 + good[18:]


async def _loop_survives(warmer: Warmer, change) -> None:
    tasks = TaskGuard()
    tasks.spawn(warmer.run(), "plan-watch")
    try:
        for _ in range(250):
            if warmer.plan is not None:
                break
            await asyncio.sleep(0.02)
        first = warmer.plan
        assert first is not None
        change()
        await asyncio.sleep(0.3)  # several polls of the bad plan
        assert tasks.crashed == {} and tasks.running == ["plan-watch"]
        assert warmer.plan == first  # the last good plan kept
    finally:
        await tasks.close()


async def test_a_corrupt_gzipped_plan_file_is_ignored(tmp_path, object_store, session):
    object_store.add("a", tmp_path)
    doc = plan_json(object_store, pinned=["a"])
    cm = ConfigMapDir(tmp_path / "plan")
    cm.write(doc)
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    warmer = Warmer(store, cm.path, session, poll_seconds=0.02)
    await _loop_survives(warmer, lambda: cm.write(_corrupt_gzip(doc)))


@pytest.mark.parametrize("bad", ["binary-not-base64", "binary-corrupt-gzip"])
async def test_a_plan_configmap_that_does_not_decode_is_ignored(tmp_path, object_store, session, kube_api, bad):
    import base64

    object_store.add("a", tmp_path)
    doc = plan_json(object_store, pinned=["a"])
    kube_api.put_configmap("ml", "p", {"plan.json": json.dumps(doc)})
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    warmer = Warmer(store, PlanConfigMap(KubeAPI(kube_api.url, session), "ml", "p"), session, poll_seconds=0.02)
    packed = "a" if bad == "binary-not-base64" else base64.b64encode(_corrupt_gzip(doc)).decode()
    await _loop_survives(warmer, lambda: kube_api.put_configmap("ml", "p", {}, binary={"plan.json": packed}))


def _with(doc: dict, part: str) -> dict:
    doc = json.loads(json.dumps(doc))
    if part == "start-as-epoch":  # a number where a time belongs
        doc["prefetch"] = [{"name": "a", "start": 1777622400, "end": 1777708800}]
    elif part == "window-name-a-list":
        doc["prefetch"] = [{"name": ["a"], "start": "2026-05-01T08:00:00Z", "end": "2026-05-02T08:00:00Z"}]
    elif part == "adapter-name-a-number":
        doc["adapters"].append({"name": 7, "source": "/mnt/adapters/seven"})
    return doc


@pytest.mark.parametrize("part", ["start-as-epoch", "window-name-a-list", "adapter-name-a-number"])
async def test_a_plan_with_a_value_of_the_wrong_type_is_ignored(tmp_path, object_store, session, part):
    """parse_plan let some wrong types through, to fail later where nothing catches them:
    a number for a window's start (AttributeError in the parser), a list for a window's name
    (TypeError at every turn of the plan loop, in the open-window check) or a number for an
    adapter's name (TypeError quoting it into a server's URL or a status PATCH)."""
    from loraplex.node_agent.warmer import PlanError, parse_plan

    object_store.add("a", tmp_path)
    doc = plan_json(object_store, pinned=["a"])
    with pytest.raises(PlanError, match="must be a string|time"):
        parse_plan(_with(doc, part))
    cm = ConfigMapDir(tmp_path / "plan")
    cm.write(doc)
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    warmer = Warmer(store, cm.path, session, poll_seconds=0.02)
    await _loop_survives(warmer, lambda: cm.write(_with(doc, part)))
