"""Adapter names in the node agent: the longest names (a Kubernetes object name has up to 253
characters) stage and survive a restart; a name that is a path never reaches the disk."""

from __future__ import annotations

import os
from pathlib import Path

import aiohttp
import pytest

from loraplex.node_agent.adapter_files import WEIGHTS_FILE
from loraplex.node_agent.store import AdapterRef, AdapterStore, StoreError
from loraplex.server.adapter_names import MAX_ADAPTER_NAME_LENGTH

from .helpers import make_adapter

@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.mark.parametrize("name", ["a" * MAX_ADAPTER_NAME_LENGTH, "b" * 120 + "." + "c" * 132])
async def test_the_longest_names_stage_and_read_back(tmp_path, session, name):
    sha = make_adapter(tmp_path / "volume" / "src")
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    staged = await store.stage(AdapterRef(name, str(tmp_path / "volume" / "src"), sha))
    assert staged.path == str(tmp_path / "cache" / name)
    assert (tmp_path / "cache" / name / WEIGHTS_FILE).is_file()
    again = AdapterStore(tmp_path / "cache", 10**9, session=session)  # a restart
    assert [a.name for a in again.list()] == [name]
    assert list((tmp_path / "cache" / ".tmp").iterdir()) == []


@pytest.mark.parametrize("name", ["../escape", "/abs", ".store", "a/../../escape"])
async def test_a_path_name_never_reaches_the_disk(tmp_path, session, name):
    sha = make_adapter(tmp_path / "volume" / "src")
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    with pytest.raises(StoreError) as err:
        await store.stage(AdapterRef(name, str(tmp_path / "volume" / "src"), sha))
    assert err.value.reason == "InvalidRequest"
    assert sorted(os.listdir(tmp_path)) == ["cache", "volume"]
    assert sorted(p.name for p in Path(tmp_path / "cache").iterdir()) == [".store", ".tmp"]
    assert list((tmp_path / "cache" / ".store").iterdir()) == []
