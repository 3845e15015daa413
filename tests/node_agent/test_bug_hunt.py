"""Races and cleanup paths of the node agent found by a focused hunt: each test shows what
went wrong before its fix (real files, real HTTP on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import aiohttp
import pytest

from loraplex.node_agent.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from loraplex.node_agent.store import AdapterRef, AdapterStore, StoreError

from .helpers import make_adapter


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


def _adapter(tmp_path: Path, name: str, seed: int) -> tuple[str, str]:
    """A PEFT adapter on the 'volume' (a plain path source): (source, sha256)."""
    d = tmp_path / "volume" / name
    return str(d), make_adapter(d, seed=seed)


def _size(source: str) -> int:
    return sum((Path(source) / f).stat().st_size for f in (CONFIG_FILE, WEIGHTS_FILE))


def _disk_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob(".store/*/*") if f.is_file() and f.name != ".loraplex.json")


# -- an answer for a version that went while its serving copy was written -------------------


@pytest.mark.parametrize("how", ["removed", "replaced"])
async def test_a_version_that_goes_while_its_serving_copy_is_written_is_not_answered_as_staged(
        tmp_path, session, monkeypatch, how):
    """A bf16 server asks for a version staged without its bf16 copy; while the copy is
    written the version goes (the plan drops the name, or a new version replaces it). The
    request was answered 200 with the gone version (its sha256, at a path that now holds
    nothing or another version's weights), so the server loaded what the answer did not
    describe. It must fail as a download of it would: Removed, or Superseded (both 409)."""
    import loraplex.node_agent.store as store_module

    root = tmp_path / "cache"
    src, sha = _adapter(tmp_path, "a", 1)
    store = AdapterStore(root, 10**9, session=session)
    await store.stage(AdapterRef("a", src, sha))  # no dtype: no copy
    started, go = threading.Event(), threading.Event()
    real = store_module.write_serving_copy

    def gated(directory, dtype):
        started.set()
        go.wait(10)
        return real(directory, dtype)

    monkeypatch.setattr(store_module, "write_serving_copy", gated)
    asked = asyncio.ensure_future(store.stage(AdapterRef("a", src, sha, "bfloat16")))
    assert await asyncio.to_thread(started.wait, 10)
    if how == "removed":
        assert await store.remove("a")
    else:
        new_src, new_sha = _adapter(tmp_path, "a-new", 2)
        await store.stage(AdapterRef("a", new_src, new_sha))
    go.set()
    with pytest.raises(StoreError) as err:
        await asked
    assert err.value.reason == ("Removed" if how == "removed" else "Superseded") and err.value.status == 409
    assert store._reserved == 0
    if how == "replaced":
        assert store.get("a").sha256 == new_sha  # the later version stays


async def test_a_version_evicted_while_its_serving_copy_is_written_is_staged_again(tmp_path, session, monkeypatch):
    """The same, the version evicted for another adapter's room: the request is answered with
    the version on disk again (staged afresh), never with a path that holds nothing."""
    import loraplex.node_agent.store as store_module
    from loraplex.node_agent.convert import serving_copy_size

    root = tmp_path / "cache"
    src, sha = _adapter(tmp_path, "a", 1)
    size = _size(src)
    copy = serving_copy_size(src, "bfloat16")
    # Room for a, its copy and one more adapter but a byte: staging b evicts a.
    store = AdapterStore(root, 2 * size + copy - 1, session=session)
    await store.stage(AdapterRef("a", src, sha))
    started, go = threading.Event(), threading.Event()
    real = store_module.write_serving_copy
    first = []

    def gated(directory, dtype):
        if not first:
            first.append(directory)
            started.set()
            go.wait(10)
        return real(directory, dtype)

    monkeypatch.setattr(store_module, "write_serving_copy", gated)
    asked = asyncio.ensure_future(store.stage(AdapterRef("a", src, sha, "bfloat16")))
    assert await asyncio.to_thread(started.wait, 10)
    b_src, b_sha = _adapter(tmp_path, "b", 2)
    await store.stage(AdapterRef("b", b_src, b_sha))
    assert store.get("a") is None  # evicted for b
    go.set()
    staged = await asked
    assert store.get("a") is not None and staged.sha256 == sha
    assert Path(staged.path, WEIGHTS_FILE).is_file() and Path(staged.path, CONFIG_FILE).is_file()
    assert store._reserved == 0
    assert store.used_bytes == sum(a.bytes for a in store.list()) == _disk_bytes(root)
