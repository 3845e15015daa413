"""What the agent finds when it starts again: what an earlier run left in the cache directory,
and a plan that changed while it was down."""

from __future__ import annotations

import os

import aiohttp
import pytest

from loraplex.node_agent.store import AdapterRef, AdapterStore
from loraplex.node_agent.warmer import Warmer

from .helpers import ConfigMapDir, plan_json


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


async def _run_once(tmp_path, session, plan_path) -> Warmer:
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    warmer = Warmer(store, plan_path, session)
    assert await warmer.check_plan()
    await warmer.reconcile()
    return warmer


async def test_an_adapter_deleted_while_the_agent_was_down_leaves_the_node(tmp_path, object_store, session):
    """The plan drops an adapter while the agent restarts (a rollout, a crash). The agent
    removes what leaves the plan by comparing a new plan with the one before, which a fresh
    process does not have: the adapter stayed on the node's disk for good, and a server on
    the node, which finds adapters in the cache directory by name, kept serving it."""
    for i, n in enumerate(["keep", "gone"]):
        object_store.add(n, tmp_path, seed=i)
    object_store.add("asked", tmp_path, seed=2)
    cm = ConfigMapDir(tmp_path / "plan")
    cm.write(plan_json(object_store, pinned=["keep", "gone"]))
    first = await _run_once(tmp_path, session, cm.path)
    assert first.store.get("gone") is not None
    # Staged on request (a server's own adapter, never in the plan): not the plan's to remove.
    await first.store.stage(AdapterRef("asked", object_store.source("asked"), object_store.adapters["asked"].sha256))
    cm.write(plan_json(object_store, pinned=["keep"]))  # while the agent is down
    second = await _run_once(tmp_path, session, cm.path)
    assert second.store.get("gone") is None and not os.path.lexists(tmp_path / "cache" / "gone")
    assert second.store.get("keep") is not None and second.store.get("asked") is not None
    assert object_store.gets["keep/adapter_model.safetensors"] == 1  # found on disk, not fetched again
    # And once more with the same plan: nothing else goes.
    third = await _run_once(tmp_path, session, cm.path)
    assert sorted(a.name for a in third.store.list()) == ["asked", "keep"]
