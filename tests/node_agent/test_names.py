"""Adapter names in the node agent: the server's rule (server/adapter_names.py), so a name the
server takes is one the agent stages for it and the other way round; the longest names
(a Kubernetes object name has up to 253 characters) stage and survive a restart; a name that
is a path never reaches the disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loraplex.node_agent.adapter_files import WEIGHTS_FILE
from loraplex.node_agent.store import AdapterRef, AdapterStore, StoreError
from loraplex.server.adapter_names import MAX_ADAPTER_NAME_LENGTH, is_adapter_name

from .helpers import make_adapter

NAMES = [
    # (name, an adapter name?)
    ("sql-v2", True), ("my-adapter.v1", True), ("SQL-v2", True), ("a_b", True), ("a@1+2", True),
    ("x" * MAX_ADAPTER_NAME_LENGTH, True),
    ("a,b", False), ("a/b", False), ("../x", False), ("..", False), (".store", False), (".tmp", False),
    ("a b", False), ("café", False), ("-x", False), ("", False), ("x" * (MAX_ADAPTER_NAME_LENGTH + 1), False),
]


@pytest.mark.parametrize("name, ok", NAMES)
def test_the_agent_takes_the_names_the_server_takes(name, ok):
    assert is_adapter_name(name) is ok
    ref = AdapterRef(name, "/adapters/x", None)
    if ok:
        ref.validate()
    else:
        with pytest.raises(StoreError, match="adapter name") as err:
            ref.validate()
        assert err.value.reason == "InvalidRequest" and err.value.status == 400


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
