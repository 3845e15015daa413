"""What the agent finds when it starts again: what an earlier run left in the cache directory,
and a plan that changed while it was down."""

from __future__ import annotations

import json
import os

import pytest

from loraplex.node_agent.store import AdapterRef, AdapterStore
from loraplex.node_agent.warmer import Warmer

from .helpers import ConfigMapDir, plan_json


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


async def test_a_staged_file_cut_short_on_disk_is_dropped_at_start(tmp_path, session):
    """A staged version whose weights were cut short on disk since (a disk fault, a hand at
    work): the agent read it back as staged on its metadata alone, so the plan never staged
    it again and every server load of it failed on its header for good. The start now checks
    each version's files as the download did (config, safetensors header against the file):
    a cut version is dropped (the plan stages it again), a cut serving copy only loses the
    copy."""
    from loraplex.node_agent.adapter_files import WEIGHTS_FILE
    from loraplex.server.adapter_format import serving_weights_name

    from .helpers import make_adapter

    root = tmp_path / "cache"
    store = AdapterStore(root, 10**9, session=session)
    for i, name in enumerate(["whole", "cut", "copycut"]):
        sha = make_adapter(tmp_path / "src" / name, seed=i)
        await store.stage(AdapterRef(name, str(tmp_path / "src" / name), sha, "bfloat16"))
    weights = root / "cut" / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-64])
    copy = root / "copycut" / serving_weights_name("bfloat16")
    copy.write_bytes(copy.read_bytes()[:-64])
    again = AdapterStore(root, 10**9, session=session)
    assert sorted(a.name for a in again.list()) == ["copycut", "whole"]
    assert not os.path.lexists(root / "cut") and not copy.exists()
    assert (root / "copycut" / WEIGHTS_FILE).is_file()
    plain = sum((tmp_path / "src" / "copycut" / f).stat().st_size for f in ("adapter_config.json", WEIGHTS_FILE))
    assert again.get("copycut").bytes == plain  # what is left of it, counted


async def test_a_record_that_cannot_be_written_leaves_no_temporary_file(tmp_path, session, monkeypatch):
    """The plan's record is written under a temporary name and renamed; a disk full as it
    was written left `.plan-adapters.json.tmp` in the cache for good (nothing removes it)."""
    import errno
    import pathlib

    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    warmer = Warmer(store, None, session)
    real = pathlib.Path.write_text

    def full(self, data, *args, **kwargs):
        real(self, data[: len(data) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    warmer._record({"adapters": ["a", "b"], "pinned": ["a"]})
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [".store", ".tmp"]
    warmer._record({"adapters": ["a", "b"], "pinned": ["a"]})  # room again: written (it was not before)
    assert warmer._last_run() == {"adapters": ["a", "b"], "pinned": ["a"]}


class _Crash(BaseException):
    """The process killed between two syscalls (not an OSError: nothing cleans up after it)."""


@pytest.mark.parametrize("record_file", [None, ".plan-adapters.ml.llama-3-8b.json"])
async def test_a_plan_record_cut_short_by_a_crash_is_removed_at_start(tmp_path, session, monkeypatch, record_file):
    """A crash between writing a plan record's temporary file and renaming it into place left
    `.plan-adapters*.json.tmp` in the cache for good (no start cleared it; a record written
    again later renames a new one over it only if its name comes round again). The store's
    start clears it as it clears .tmp/; the records themselves stay."""
    root = tmp_path / "cache"
    warmer = Warmer(AdapterStore(root, 10**9, session=session), None, session, record_file=record_file)
    warmer._record({"adapters": ["a"], "pinned": []})
    record = root / warmer.record_file
    assert record.is_file()

    def crash(src, dst):
        raise _Crash
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(_Crash):
        warmer._record({"adapters": ["a", "b"], "pinned": ["a"]})
    monkeypatch.undo()
    leftovers = [p.name for p in root.glob(".plan-adapters*.json.tmp")]
    assert leftovers == [f"{record.name}.tmp"]  # what the crash left

    AdapterStore(root, 10**9, session=session)  # the agent starts again
    assert list(root.glob(".plan-adapters*.tmp")) == []
    assert json.loads(record.read_text()) == {"adapters": ["a"], "pinned": []}  # the last whole record
