"""The servers' admin keys per namespace or BaseModel (node_agent/server_keys.py,
--server-api-keys-dir): a server is sent its BaseModel's key, else its namespace's, else the
one key for all; each file is re-read when it changes, one taken out stops being sent, one
that holds no key is skipped; names that are no namespace or BaseModel name no file."""

from __future__ import annotations

import logging
import os

from loraplex.node_agent.server_keys import ServerKeys
from loraplex.node_agent.store import AdapterStore
from loraplex.node_agent.warmer import StaticServers, Warmer
from loraplex.server import api_keys

from .test_warm_servers import TIMEOUT
from .helpers import ConfigMapDir, plan_json


def write(path, text):
    """As the kubelet updates a Secret's mount: the new content swapped in whole."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_a_base_models_key_then_its_namespaces_then_the_one_for_all(tmp_path, monkeypatch):
    monkeypatch.setattr(api_keys, "RELOAD_SECONDS", 0.0)
    write(tmp_path / "team-a.llama-3-8b", "sk-a-llama\n")
    write(tmp_path / "team-a", "sk-a")
    keys = ServerKeys("sk-ops", tmp_path)
    assert keys.key_for("team-a", "llama-3-8b") == "sk-a-llama"
    assert keys.key_for("team-a", "mistral-7b") == "sk-a"
    assert keys.key_for("team-b", "llama-3-8b") == "sk-ops"
    assert keys.key_for(None, "llama-3-8b") == "sk-ops"  # a plan of no namespace
    assert ServerKeys(None, tmp_path).key_for("team-b", "llama-3-8b") is None  # nothing sent

    write(tmp_path / "team-a.llama-3-8b", "sk-a-llama-2")  # rotated
    assert keys.key_for("team-a", "llama-3-8b") == "sk-a-llama-2"
    (tmp_path / "team-a.llama-3-8b").unlink()  # taken out of the Secret
    assert keys.key_for("team-a", "llama-3-8b") == "sk-a"
    write(tmp_path / "team-a.llama-3-8b", "sk-a-llama-3")  # and back
    assert keys.key_for("team-a", "llama-3-8b") == "sk-a-llama-3"


def test_a_file_that_holds_no_key_is_skipped_and_said_once(tmp_path, caplog):
    write(tmp_path / "team-a", "")
    keys = ServerKeys("sk-ops", tmp_path)
    with caplog.at_level(logging.ERROR, logger="loraplex.node_agent.server_keys"):
        assert keys.key_for("team-a", "llama-3-8b") == "sk-ops"
        assert keys.key_for("team-a", "llama-3-8b") == "sk-ops"
    (record,) = caplog.records
    assert "team-a" in record.getMessage() and "empty" in record.getMessage()
    write(tmp_path / "team-a", "two words")
    assert keys.key_for("team-a", None) == "sk-ops"
    write(tmp_path / "team-a", "sk-a")  # fixed
    assert keys.key_for("team-a", None) == "sk-a"


def test_only_namespace_and_base_model_names_name_a_file(tmp_path):
    keys_dir = tmp_path / "keys"
    keys_dir.mkdir()
    write(tmp_path / "secret", "sk-elsewhere")  # outside the folder
    write(keys_dir / "team-a", "sk-a")
    write(keys_dir / "team-a.b", "sk-a-b")
    (keys_dir / "team-a.x").mkdir()
    write(keys_dir / "team-a.x" / "y", "sk-traversed")
    keys = ServerKeys("sk-ops", keys_dir)
    assert keys.key_for("../secret", None) == "sk-ops"
    assert keys.key_for("team-a", "x/y") == "sk-a"  # not the file team-a.x/y
    assert keys.key_for("team-a.b", None) == "sk-ops"  # a dot: no namespace, so not BaseModel b's key
    assert keys.key_for("team-a", "x") == "sk-a"  # a folder is no key file


async def test_each_namespaces_servers_get_their_own_key(tmp_path, object_store, session, fake_server,
                                                         other_fake_server, monkeypatch):
    """Two BaseModels of one name in two namespaces (two teams), one agent: each plan's servers
    are warmed with their own key, and no server sees the other's or the one for all."""
    monkeypatch.setattr(api_keys, "RELOAD_SECONDS", 0.0)
    keys_dir = tmp_path / "keys"
    keys_dir.mkdir()
    write(keys_dir / "team-a.llama-3-8b", "sk-a-llama")
    write(keys_dir / "team-b", "sk-b")
    keys = ServerKeys("sk-ops", keys_dir)
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    warmers = {}
    for i, (ns, server) in enumerate((("team-a", fake_server), ("team-b", other_fake_server))):
        server.ready = True
        name = f"p{i}"
        object_store.add(name, tmp_path, seed=i)
        cm = ConfigMapDir(tmp_path / f"plan-{ns}")
        cm.write(plan_json(object_store, pinned=[name], others=[], base="llama-3-8b"))
        warmers[ns] = Warmer(store, cm.path, session, discovery=StaticServers([server.url], session), namespace=ns,
                             server_timeout_seconds=TIMEOUT, server_api_key=keys)
    for warmer in warmers.values():
        assert await warmer.check_plan()
        await warmer.reconcile()
        await warmer.check_servers()
    assert {(a, n) for a, n, _ in fake_server.calls} >= {("prefetch", "p0"), ("pin", "p0")}
    assert {(a, n) for a, n, _ in other_fake_server.calls} >= {("prefetch", "p1"), ("pin", "p1")}
    assert set(fake_server.authorizations) == {"Bearer sk-a-llama"}
    assert set(other_fake_server.authorizations) == {"Bearer sk-b"}

    (keys_dir / "team-a.llama-3-8b").unlink()
    assert (await warmers["team-a"].call_server(fake_server.url, "p0", "prefetch")).ok
    assert fake_server.authorizations[-1] == "Bearer sk-ops"
    assert object_store.authorizations and set(object_store.authorizations) == {None}
